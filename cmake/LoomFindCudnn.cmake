# Locates cuDNN (shipped with the CUDA toolkit here) and the cuDNN frontend's C++ headers as the
# imported target loom::cudnn_library (with NVRTC, which the frontend calls). The frontend is header-only; the Python-registry package
# nvidia-cudnn-frontend installs its headers under <site-packages>/include, which is searched for
# every python3 on PATH. Hints: CUDNN_FRONTEND_INCLUDE_DIR (CMake or environment variable), the
# folder holding cudnn_frontend.h.
include(${CMAKE_CURRENT_LIST_DIR}/LoomPythonSites.cmake)

function(loom_find_cudnn)
  if(TARGET loom::cudnn_library)
    return()
  endif()
  find_path(LOOM_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(LOOM_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR})
  set(_hints ${CUDNN_FRONTEND_INCLUDE_DIR} $ENV{CUDNN_FRONTEND_INCLUDE_DIR})
  loom_python_site_packages(_sites)
  foreach(_s IN LISTS _sites)
    list(APPEND _hints "${_s}/include")
  endforeach()
  find_path(LOOM_CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS ${_hints})
  if(LOOM_CUDNN_INCLUDE_DIR AND LOOM_CUDNN_LIBRARY AND LOOM_CUDNN_FRONTEND_INCLUDE_DIR)
    add_library(loom::cudnn_library INTERFACE IMPORTED GLOBAL)
    # Imported include folders are system folders: the frontend's own warnings stay its own.
    set_target_properties(loom::cudnn_library PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${LOOM_CUDNN_FRONTEND_INCLUDE_DIR};${LOOM_CUDNN_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${LOOM_CUDNN_LIBRARY};CUDA::nvrtc;${CMAKE_DL_LIBS}")
    message(STATUS "loom: cuDNN ${LOOM_CUDNN_LIBRARY}, frontend headers ${LOOM_CUDNN_FRONTEND_INCLUDE_DIR}")
  else()
    message(STATUS "loom: cuDNN or the cuDNN frontend headers (pip install nvidia-cudnn-frontend) not found; "
                   "loom::cudnn is not provided")
  endif()
endfunction()
