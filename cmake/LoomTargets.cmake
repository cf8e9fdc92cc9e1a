# loom::loom (header-only core) and the component targets that bring one dependency each.
include(GNUInstallDirs)

add_library(loom INTERFACE)
add_library(loom::loom ALIAS loom)
target_include_directories(loom INTERFACE
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(loom INTERFACE cxx_std_20)
# CMake 3.25 cannot request C++20 from nvcc through compile features: ask for it directly.
target_compile_options(loom INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
find_package(Threads REQUIRED)  # comm::local runs ranks as std::threads
target_link_libraries(loom INTERFACE Threads::Threads)
set_target_properties(loom PROPERTIES EXPORT_NAME loom)

set(LOOM_COMPONENTS "")  # the components this build provides (for install and summary)

function(_loom_component name)
  add_library(loom_${name} INTERFACE)
  add_library(loom::${name} ALIAS loom_${name})
  set_target_properties(loom_${name} PROPERTIES EXPORT_NAME ${name})
  target_link_libraries(loom_${name} INTERFACE loom ${ARGN})
  set(LOOM_COMPONENTS ${LOOM_COMPONENTS} ${name} PARENT_SCOPE)
endfunction()

if(LOOM_ENABLE_OPENMP)
  find_package(OpenMP COMPONENTS CXX)
  if(OpenMP_CXX_FOUND)
    _loom_component(openmp OpenMP::OpenMP_CXX)
  endif()
endif()

if(LOOM_ENABLE_MPI)
  find_package(MPI COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    _loom_component(mpi MPI::MPI_CXX)
  endif()
endif()

if(LOOM_ENABLE_KOKKOS)
  include(LoomFindKokkos)
  loom_find_kokkos(REQUIRED)
  _loom_component(kokkos Kokkos::kokkos)
endif()

if(LOOM_ENABLE_CUDA)
  find_package(CUDAToolkit REQUIRED)
  include(LoomFindNccl)
  include(LoomFindCudnn)
  include(LoomFindCusparselt)
  _loom_component(cuda CUDA::cudart)
  loom_find_nccl()
  if(TARGET loom::nccl_library)
    _loom_component(nccl loom_cuda loom::nccl_library)
  endif()
  loom_find_cudnn()
  if(TARGET loom::cudnn_library)
    _loom_component(cudnn loom_cuda loom::cudnn_library)
  endif()
  # cuSPARSE and cuBLAS ship with the CUDA toolkit.
  if(TARGET CUDA::cusparse)
    _loom_component(cusparse loom_cuda CUDA::cusparse)
  endif()
  if(TARGET CUDA::cublas)
    _loom_component(cublas loom_cuda CUDA::cublas)
  endif()
  loom_find_cusparselt()
  if(TARGET loom::cusparselt_library)
    _loom_component(cusparselt loom_cuda loom::cusparselt_library)
  endif()
endif()

set(LOOM_COMPONENTS ${LOOM_COMPONENTS} CACHE INTERNAL "loom components provided by this build")
message(STATUS "loom ${PROJECT_VERSION}: components [${LOOM_COMPONENTS}]")
