#pragma once

//! @file
//! What loom's runtime-dispatched x86 vector kernels share: the switch that turns them all off
//! (tests of the portable fallbacks, benchmark comparisons), the CPU checks, and 16-lane float
//! loads of float, bfloat16 and half storage. The kernels are compiled with function-level target
//! attributes and taken at run time when the CPU has the instructions, so a default build needs no
//! -march flag; the portable LOOM_HD kernels stay the fallback and the device code.
//! LOOM_X86_KERNELS is defined where these kernels exist (x86-64 host compilers, not nvcc).

#include <loom/config.hpp>
#include <loom/core/float16.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>

#if defined(__x86_64__) && !defined(__CUDACC__) && (defined(__GNUC__) || defined(__clang__))
#define LOOM_X86_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>

//! The instructions loom's AVX-512 float kernels use (a subset of every AVX-512 target attribute
//! loom writes, so these helpers inline into any of its kernels).
#define LOOM_X86_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,bmi,bmi2,fma")))
//! LOOM_X86_AVX512 plus AVX512_BF16 (vdpbf16ps, the bfloat16 pair products; vcvtneps2bf16).
#define LOOM_X86_AVX512_BF16 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,bmi,bmi2,fma")))
//! The AVX2 floor: AVX2, FMA and F16C (every x86-64 CPU since 2013-2015).
#define LOOM_X86_AVX2 __attribute__((target("avx2,fma,f16c")))

// GCC 12's AVX-512 intrinsics build their pass-through operands from _mm512_undefined_*(), which
// -Wmaybe-uninitialized reports once inlined into a function with a target attribute.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace loom::detail::x86 {

//! False forces every family's portable kernels (tests of the fallback, benchmark comparisons).
inline std::atomic<bool>& vector_kernels_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

//! Whether the CPU has the instructions of LOOM_X86_AVX512 (checked once).
inline bool avx512_cpu() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("bmi2") &&
           __builtin_cpu_supports("fma");
  }();
  return cpu;
}

//! Whether the CPU has the instructions of LOOM_X86_AVX512_BF16 (checked once).
inline bool avx512_bf16_cpu() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return avx512_cpu() && __builtin_cpu_supports("avx512bf16");
  }();
  return cpu;
}

//! Whether the CPU has the instructions of LOOM_X86_AVX2 (checked once).
inline bool avx2_cpu() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // F16C: CPUID leaf 1, ECX bit 29 (clang's builtin lacks it)
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 29) & 1u) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  }();
  return cpu;
}

//! False keeps the vector kernels that have an AVX-512 and an AVX2 form on the AVX2 one (tests of
//! both forms on one machine, benchmark comparisons); vector_kernels_allowed() still rules both.
inline std::atomic<bool>& avx512_kernels_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

//! Whether the AVX2 kernels may run: the CPU has them and vector kernels are allowed.
inline bool avx2_available() { return avx2_cpu() && vector_kernels_allowed().load(std::memory_order_relaxed); }

//! Whether the AVX-512 kernels may run: the CPU has them, vector kernels and their AVX-512 forms
//! are allowed.
inline bool avx512_available() {
  return avx512_cpu() && vector_kernels_allowed().load(std::memory_order_relaxed) &&
         avx512_kernels_allowed().load(std::memory_order_relaxed);
}

//! Whether the AVX512_BF16 kernels may run: as avx512_available(), and the CPU has AVX512_BF16.
inline bool avx512_bf16_available() { return avx512_bf16_cpu() && avx512_available(); }

//! Seconds of `steps` steps of 8 independent chains of vdpbf16ps (pairs) or of 16-lane FMAs.
LOOM_X86_AVX512_BF16 inline double bf16_chain_seconds(bool pairs, int steps) {
  const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
  const __m512bh xb = (__m512bh)_mm512_set1_epi16(0x3f80), yb = (__m512bh)_mm512_set1_epi16(0x3000);
  __m512 a0 = x, a1 = x, a2 = x, a3 = x, a4 = x, a5 = x, a6 = x, a7 = x;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    if (pairs) {
      a0 = _mm512_dpbf16_ps(a0, xb, yb), a1 = _mm512_dpbf16_ps(a1, xb, yb);
      a2 = _mm512_dpbf16_ps(a2, xb, yb), a3 = _mm512_dpbf16_ps(a3, xb, yb);
      a4 = _mm512_dpbf16_ps(a4, xb, yb), a5 = _mm512_dpbf16_ps(a5, xb, yb);
      a6 = _mm512_dpbf16_ps(a6, xb, yb), a7 = _mm512_dpbf16_ps(a7, xb, yb);
    } else {
      a0 = _mm512_fmadd_ps(x, y, a0), a1 = _mm512_fmadd_ps(x, y, a1);
      a2 = _mm512_fmadd_ps(x, y, a2), a3 = _mm512_fmadd_ps(x, y, a3);
      a4 = _mm512_fmadd_ps(x, y, a4), a5 = _mm512_fmadd_ps(x, y, a5);
      a6 = _mm512_fmadd_ps(x, y, a6), a7 = _mm512_fmadd_ps(x, y, a7);
    }
    // The chains stay in registers and no step can be folded away.
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

//! vdpbf16ps's FLOP rate over the 16-lane FMA's on this CPU (a vdpbf16ps is 64 FLOPs: two
//! products and two adds in each of 16 lanes; an FMA 32): 8 independent chains of each, the
//! fastest of 7 timings of 4096 steps (well under a millisecond in all). About 2 where vdpbf16ps
//! issues as often as an FMA: 2.00 on an AMD EPYC (family 25, model 17, 2026-11-30), where the
//! pair products made attention's bfloat16 forward 1.77x its float forward. 0.5 where it issues
//! half as often: 85 against 171 GFLOP/s a core on an Intel Xeon with AVX512_BF16 (family 6,
//! model 207, 2026-11-30), where the pair products made that forward 0.62-0.85x the float one.
//! Only on CPUs with AVX512_BF16.
inline double bf16_pair_speedup_now() {
  double fma = 1e30, pair = 1e30;
  for (int trial = 0; trial < 7; ++trial) {  // the fastest: a timing the OS interrupted is longer
    fma = std::min(fma, bf16_chain_seconds(false, 4096));
    pair = std::min(pair, bf16_chain_seconds(true, 4096));
  }
  return pair > 0 ? 2.0 * fma / pair : 0.0;
}

//! bf16_pair_speedup_now(), measured at the first call (0 on CPUs without AVX512_BF16).
inline double bf16_pair_speedup() {
  static const double speedup = avx512_bf16_cpu() ? bf16_pair_speedup_now() : 0.0;
  return speedup;
}

//! Which products the bfloat16 storage paths take where AVX512_BF16 kernels may run: `measured`
//! (the default) the pair products (vdpbf16ps) when bf16_pair_speedup() > bf16_pair_threshold,
//! else float FMAs over rows converted to float; `always` and `never` force one form (tests of
//! both, benchmark comparisons).
enum class bf16_pairs { measured, always, never };
inline constexpr double bf16_pair_threshold = 1.25;
inline std::atomic<bf16_pairs>& bf16_pair_policy() {
  static std::atomic<bf16_pairs> policy{bf16_pairs::measured};
  return policy;
}

//! Whether the bfloat16 pair products run now: avx512_bf16_available() and the policy says so.
inline bool avx512_bf16_pairs_available() {
  if (!avx512_bf16_available()) return false;
  switch (bf16_pair_policy().load(std::memory_order_relaxed)) {
    case bf16_pairs::always:
      return true;
    case bf16_pairs::never:
      return false;
    default:
      return bf16_pair_speedup() > bf16_pair_threshold;
  }
}

//! 8 values at s, as floats (AVX2).
LOOM_X86_AVX2 inline __m256 load8(const float* s) { return _mm256_loadu_ps(s); }
LOOM_X86_AVX2 inline __m256 load8(const bfloat16* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
LOOM_X86_AVX2 inline __m256 load8(const half* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}

//! The mask of the first `count` (<= 16) lanes.
LOOM_X86_AVX512 inline __mmask16 first_lanes(unsigned count) {
  return static_cast<__mmask16>(_bzhi_u32(0xffffu, count));
}

//! The first `count` (<= 16) values at s, as floats, zeros after them (a masked load).
LOOM_X86_AVX512 inline __m512 load16(const float* s, unsigned count) {
  return _mm512_maskz_loadu_ps(first_lanes(count), s);
}
LOOM_X86_AVX512 inline __m256i load16_bits(const void* s, unsigned count) {
  return _mm256_maskz_loadu_epi16(first_lanes(count), s);
}
LOOM_X86_AVX512 inline __m512 widen(const bfloat16*, __m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
LOOM_X86_AVX512 inline __m512 widen(const half*, __m256i v) { return _mm512_cvtph_ps(v); }
template <class T>
LOOM_X86_AVX512 inline __m512 load16(const T* s, unsigned count) {
  return widen(s, load16_bits(s, count));
}
//! 16 values at s, as floats (unmasked).
LOOM_X86_AVX512 inline __m512 load16(const float* s) { return _mm512_loadu_ps(s); }
template <class T>
LOOM_X86_AVX512 inline __m512 load16(const T* s) {
  return widen(s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

}  // namespace loom::detail::x86

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif
