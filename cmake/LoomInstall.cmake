# install(EXPORT) per component: loom-targets.cmake for the core, loom-<c>-targets.cmake for each
# component, so a consumer only needs the dependencies of the components it asks for.
include(CMakePackageConfigHelpers)
set(LOOM_CONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/loom)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/loom DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS loom EXPORT loom-targets)
install(EXPORT loom-targets NAMESPACE loom:: DESTINATION ${LOOM_CONFIG_DIR})
export(EXPORT loom-targets NAMESPACE loom:: FILE ${PROJECT_BINARY_DIR}/loom-targets.cmake)

foreach(_c IN LISTS LOOM_COMPONENTS)
  install(TARGETS loom_${_c} EXPORT loom-${_c}-targets)
  install(EXPORT loom-${_c}-targets NAMESPACE loom:: DESTINATION ${LOOM_CONFIG_DIR})
endforeach()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/loom-config.cmake.in
  ${PROJECT_BINARY_DIR}/loom-config.cmake INSTALL_DESTINATION ${LOOM_CONFIG_DIR})
# Header-only: the version file does not depend on the architecture. 0.x: same minor.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/loom-config-version.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/loom-config.cmake ${PROJECT_BINARY_DIR}/loom-config-version.cmake
  ${PROJECT_SOURCE_DIR}/cmake/LoomFindKokkos.cmake ${PROJECT_SOURCE_DIR}/cmake/LoomFindNccl.cmake
  ${PROJECT_SOURCE_DIR}/cmake/LoomFindCudnn.cmake ${PROJECT_SOURCE_DIR}/cmake/LoomFindCusparselt.cmake
  ${PROJECT_SOURCE_DIR}/cmake/LoomPythonSites.cmake
  DESTINATION ${LOOM_CONFIG_DIR})
