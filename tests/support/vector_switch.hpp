#pragma once

// Host x86 builds: allows or forbids loom's runtime-dispatched vector kernels for the scope of a
// test (restored on exit), so one test body runs the widest vector forms, the AVX2 floor and the
// portable paths. Nothing to switch elsewhere (device code, other architectures).

#include <loom/backend/detail/x86.hpp>

#include <catch2/catch.hpp>

namespace loom::test {

//! Which of the forms a kernel has may run: the widest the CPU has (AVX-512 where it has it, and
//! the bfloat16 pair products wherever the CPU has AVX512_BF16, faster here or not), the AVX2
//! floor, or none (the portable bodies).
enum class vector_mode { widest, avx2, portable };

struct vector_switch {
  explicit vector_switch(bool on) : vector_switch(on ? vector_mode::widest : vector_mode::portable) {}
  explicit vector_switch(vector_mode mode) {
#if defined(LOOM_X86_KERNELS)
    loom::detail::x86::vector_kernels_allowed() = mode != vector_mode::portable;
    loom::detail::x86::avx512_kernels_allowed() = mode == vector_mode::widest;
    // Every form the CPU has, whether or not it is the faster one here (the bfloat16 pairs).
    loom::detail::x86::bf16_pair_policy() = loom::detail::x86::bf16_pairs::always;
#endif
    UNSCOPED_INFO("vector kernels: " << (mode == vector_mode::widest ? "widest"
                                         : mode == vector_mode::avx2 ? "AVX2 at most"
                                                                     : "none (portable)"));
  }
  ~vector_switch() {
#if defined(LOOM_X86_KERNELS)
    loom::detail::x86::vector_kernels_allowed() = true;
    loom::detail::x86::avx512_kernels_allowed() = true;
    loom::detail::x86::bf16_pair_policy() = loom::detail::x86::bf16_pairs::measured;
#endif
  }
  vector_switch(const vector_switch&) = delete;
  vector_switch& operator=(const vector_switch&) = delete;
};

}  // namespace loom::test
