#pragma once

// Host x86 builds: allows or forbids loom's runtime-dispatched vector kernels for the scope of a
// test (restored on exit), so one test body runs both the vector and the portable paths. Nothing
// to switch elsewhere (device code, other architectures).

#include <loom/backend/detail/x86.hpp>

#include <catch2/catch.hpp>

namespace loom::test {

struct vector_switch {
  explicit vector_switch(bool on) {
#if defined(LOOM_X86_KERNELS)
    loom::detail::x86::vector_kernels_allowed() = on;
#endif
    UNSCOPED_INFO("vector kernels allowed: " << on);
  }
  ~vector_switch() {
#if defined(LOOM_X86_KERNELS)
    loom::detail::x86::vector_kernels_allowed() = true;
#endif
  }
  vector_switch(const vector_switch&) = delete;
  vector_switch& operator=(const vector_switch&) = delete;
};

}  // namespace loom::test
