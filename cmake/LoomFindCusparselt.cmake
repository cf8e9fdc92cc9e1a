# Locates cuSPARSELt (sparse tensor cores; not part of the CUDA toolkit) as the imported target
# loom::cusparselt_library. The Python-registry package nvidia-cusparselt-cu13 installs
# include/cusparseLt.h and lib/libcusparseLt.so.0 under <site-packages>/nvidia/cu13 (cu12 wheels:
# nvidia/cusparselt), searched for every python3 on PATH. Hint: CUSPARSELT_ROOT (CMake or
# environment variable), the folder holding include/ and lib/.
include(${CMAKE_CURRENT_LIST_DIR}/LoomPythonSites.cmake)

function(loom_find_cusparselt)
  if(TARGET loom::cusparselt_library)
    return()
  endif()
  set(_roots ${CUSPARSELT_ROOT} $ENV{CUSPARSELT_ROOT})
  loom_python_site_packages(_sites)
  foreach(_s IN LISTS _sites)
    list(APPEND _roots "${_s}/nvidia/cu13" "${_s}/nvidia/cusparselt")
  endforeach()
  set(_inc "")
  set(_lib "")
  foreach(_r IN LISTS _roots)
    list(APPEND _inc "${_r}/include")
    list(APPEND _lib "${_r}/lib")
  endforeach()
  find_path(LOOM_CUSPARSELT_INCLUDE_DIR cusparseLt.h HINTS ${_inc})
  find_library(LOOM_CUSPARSELT_LIBRARY NAMES cusparseLt libcusparseLt.so.0 HINTS ${_lib})
  if(LOOM_CUSPARSELT_INCLUDE_DIR AND LOOM_CUSPARSELT_LIBRARY)
    add_library(loom::cusparselt_library INTERFACE IMPORTED GLOBAL)
    set_target_properties(loom::cusparselt_library PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${LOOM_CUSPARSELT_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${LOOM_CUSPARSELT_LIBRARY};CUDA::cusparse;CUDA::cudart")
    message(STATUS "loom: cuSPARSELt ${LOOM_CUSPARSELT_LIBRARY}")
  else()
    message(STATUS "loom: cuSPARSELt (pip install nvidia-cusparselt-cu13, or CUSPARSELT_ROOT) not found; "
                   "loom::cusparselt is not provided")
  endif()
endfunction()
