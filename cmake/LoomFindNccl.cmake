# Locates NCCL (shipped with the CUDA toolkit here) as the imported target loom::nccl_library.
function(loom_find_nccl)
  if(TARGET loom::nccl_library)
    return()
  endif()
  find_path(LOOM_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(LOOM_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(LOOM_NCCL_INCLUDE_DIR AND LOOM_NCCL_LIBRARY)
    add_library(loom::nccl_library UNKNOWN IMPORTED GLOBAL)
    set_target_properties(loom::nccl_library PROPERTIES
      IMPORTED_LOCATION "${LOOM_NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${LOOM_NCCL_INCLUDE_DIR}")
  else()
    message(STATUS "loom: NCCL not found; loom::nccl is not provided")
  endif()
endfunction()
