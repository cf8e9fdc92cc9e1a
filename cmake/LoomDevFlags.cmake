# Flags for loom's own tests, benchmarks and examples. Never attached to loom::loom.
add_library(loom_dev_flags INTERFACE)
target_compile_options(loom_dev_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>)
if(LOOM_ENABLE_WERROR)
  target_compile_options(loom_dev_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
endif()
if(LOOM_ENABLE_CUDA)
  target_compile_options(loom_dev_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--extended-lambda --expt-relaxed-constexpr>)
  if(LOOM_CUDA_RESOURCE_REPORT)
    target_compile_options(loom_dev_flags INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
  endif()
endif()
if(LOOM_SANITIZE)
  target_compile_options(loom_dev_flags INTERFACE -fsanitize=${LOOM_SANITIZE} -fno-omit-frame-pointer
    -fno-sanitize-recover=all)
  target_link_options(loom_dev_flags INTERFACE -fsanitize=${LOOM_SANITIZE})
  # Tests thin their largest numeric sweeps under sanitizers (tests/support/tolerance.hpp,
  # loom::test::sanitized): the full sweeps run in the default build, the sanitizers look for
  # memory and threading errors on every code path with fewer repetitions of each.
  target_compile_definitions(loom_dev_flags INTERFACE LOOM_TEST_SANITIZED=1)
  # GCC's flow analysis gives false maybe-uninitialized reports inside the standard library
  # (std::function in <regex>) once sanitizer instrumentation is on.
  target_compile_options(loom_dev_flags INTERFACE $<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized>)
endif()
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
  OUTPUT_VARIABLE LOOM_GIT_REVISION OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT LOOM_GIT_REVISION)
  set(LOOM_GIT_REVISION "unknown")
endif()
