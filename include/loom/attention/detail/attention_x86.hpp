#pragma once

//! @file
//! AVX2 products of the split-KV attention path (decode_kernels.hpp), float accumulation over
//! float, bfloat16 or half storage, read straight from K and V in their [tokens, kv heads, dim]
//! layout:
//!  - scores: four query rows against one key at a time, 8 lanes of the dimension per FMA (the
//!    key's lanes loaded once for the four rows, two accumulators per row), the four sums reduced
//!    together by one horizontal-add tree;
//!  - P V: for 16 output columns, eight register accumulators (four rows x two halves) over every
//!    key of the block: two loads of V per key, one broadcast of p per row.
//! AVX2 with FMA and F16C is the vector floor of x86-64 (every CPU loom's users run). Taken at run
//! time when the CPU has the instructions and vector kernels are allowed (loom::detail::x86), for
//! head dims that are multiples of 8; the portable LOOM_HD products of decode_kernels.hpp are the
//! fallback, the reference and the device code. Each sum is taken in a fixed order, so results are
//! identical on one machine for any backend and thread count, and within the tolerance of the
//! portable ones.

#include <loom/backend/detail/x86.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstddef>
#include <type_traits>

#if defined(LOOM_X86_KERNELS)

namespace loom::attention::detail::x86 {

using loom::detail::x86::load8;

//! Storage types the vector products read.
template <class T>
inline constexpr bool vector_storage =
    std::is_same_v<T, float> || std::is_same_v<T, bfloat16> || std::is_same_v<T, half>;

//! Whether the vector products run for accumulation Acc, storage TK, TV and head dims dk, dv on
//! this CPU now.
template <class Acc, class TK, class TV>
inline bool vector_products(index_t dk, index_t dv) {
  if constexpr (std::is_same_v<Acc, float> && vector_storage<TK> && vector_storage<TV>)
    return dk % 8 == 0 && dv % 8 == 0 && loom::detail::x86::avx2_available();
  return false;
}

//! Keys ahead whose rows the products prefetch: K and V rows are a kv-head stride apart, a pattern
//! the hardware prefetchers do not follow.
inline constexpr index_t prefetch_keys = 16;
inline void prefetch(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

//! s[r * ld_s + j] = q_r . k_j for rows r < 4 (q row-major, row stride dk, a multiple of 8) and
//! keys j < nk (row stride ldk); `ahead` keys are readable from k (rows to prefetch).
template <class TK>
LOOM_X86_AVX2 inline void decode_scores(const float* q, const TK* k, index_t ldk, index_t nk, index_t dk, float* s,
                                        index_t ld_s, index_t ahead) {
  for (index_t j = 0; j < nk; ++j) {
    const TK* kr = k + j * ldk;
    if (j + prefetch_keys < ahead) prefetch(kr + prefetch_keys * ldk, static_cast<std::size_t>(dk) * sizeof(TK));
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    index_t c0 = 0;
    for (; c0 + 16 <= dk; c0 += 16) {
      const __m256 k0 = load8(kr + c0), k1 = load8(kr + c0 + 8);
      for (int r = 0; r < 4; ++r) {
        a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dk + c0), k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dk + c0 + 8), k1, a[r][1]);
      }
    }
    if (c0 < dk) {  // a last 8
      const __m256 k0 = load8(kr + c0);
      for (int r = 0; r < 4; ++r) a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dk + c0), k0, a[r][0]);
    }
    const __m256 t0 = _mm256_hadd_ps(_mm256_add_ps(a[0][0], a[0][1]), _mm256_add_ps(a[1][0], a[1][1]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_add_ps(a[2][0], a[2][1]), _mm256_add_ps(a[3][0], a[3][1]));
    const __m256 t2 = _mm256_hadd_ps(t0, t1);  // [r0, r1, r2, r3] in each 128-bit half
    alignas(16) float out[4];
    _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
    s[j] = out[0];
    s[ld_s + j] = out[1];
    s[2 * ld_s + j] = out[2];
    s[3 * ld_s + j] = out[3];
  }
}

//! acc[r * dv + c] += sum_{j < nk} p[r * ld_p + j] v_j[c] for rows r < 4 (dv a multiple of 8, v
//! rows of stride ldv), keys j ascending; `ahead` keys readable from v (rows to prefetch).
template <class TV>
LOOM_X86_AVX2 inline void decode_pv(const float* p, index_t ld_p, const TV* v, index_t ldv, index_t nk, index_t dv,
                                    float* acc, index_t ahead) {
  for (index_t j = nk; j < 2 * nk && j < ahead; ++j)  // the next block's rows, one block ahead
    prefetch(v + j * ldv, static_cast<std::size_t>(dv) * sizeof(TV));
  index_t c0 = 0;
  for (; c0 + 16 <= dv; c0 += 16) {
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) {
      a[r][0] = _mm256_loadu_ps(acc + r * dv + c0);
      a[r][1] = _mm256_loadu_ps(acc + r * dv + c0 + 8);
    }
    for (index_t j = 0; j < nk; ++j) {
      const TV* vr = v + j * ldv + c0;
      const __m256 v0 = load8(vr), v1 = load8(vr + 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p + r * ld_p + j);
        a[r][0] = _mm256_fmadd_ps(pr, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pr, v1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_storeu_ps(acc + r * dv + c0, a[r][0]);
      _mm256_storeu_ps(acc + r * dv + c0 + 8, a[r][1]);
    }
  }
  if (c0 < dv) {  // a last 8 columns
    __m256 a[4];
    for (int r = 0; r < 4; ++r) a[r] = _mm256_loadu_ps(acc + r * dv + c0);
    for (index_t j = 0; j < nk; ++j) {
      const __m256 v0 = load8(v + j * ldv + c0);
      for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * ld_p + j), v0, a[r]);
    }
    for (int r = 0; r < 4; ++r) _mm256_storeu_ps(acc + r * dv + c0, a[r]);
  }
}

}  // namespace loom::attention::detail::x86

#endif
