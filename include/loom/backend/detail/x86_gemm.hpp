#pragma once

//! @file
//! The small dense product of loom's CPU kernels (attention's tile products, chunked linear
//! attention's register tiles): C (R x n) (+)= A (R x kd) B (kd x n), float, A read with any row
//! and column strides, B and C row-major, in two register-blocked forms taken at run time:
//!  - AVX-512 (x86::avx512_available()): blocks of 6 rows x 64 columns keep their 24 accumulators
//!    in 24 of the 32 registers over the whole kd loop (then 32-, 16-column and masked tail
//!    blocks): four loads of B and six broadcasts of A per 24 fused multiply-adds;
//!  - AVX2, the floor: blocks of 6 rows x 16 columns, 12 of its 16 registers (the 8 x 32 blocks of
//!    the portable bodies need 32 and spill when compiled for AVX2), one broadcast of A and two
//!    loads of B per step.
//! In both, each output is summed over l ascending by fused multiply-adds from C (or zero): the
//! bits depend on the operands only, not on the blocking, the instruction set or the thread count.
//! Beside them, for bfloat16 operands on CPUs with AVX512_BF16, gemm_bf16(): the same blocks over
//! pairs of the reduction index by vdpbf16ps (two bfloat16 products added into each float
//! accumulator per step), B in a pair-interleaved layout.

#include <loom/backend/detail/x86.hpp>
#include <loom/core/tensor_view.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(LOOM_X86_KERNELS)

namespace loom::detail::x86 {

//! One register block: C[r][j] (+)= sum_{l < kd} a[r * ar + l * ak] b[l * ldb + j] for R rows and
//! 8 V columns.
template <int R, int V>
LOOM_X86_AVX2 inline void gemm_block(index_t kd, const float* a, index_t ar, index_t ak, const float* b, index_t ldb,
                                     float* c, index_t ldc, bool accumulate) {
  __m256 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) acc[r][v] = accumulate ? _mm256_loadu_ps(c + r * ldc + 8 * v) : _mm256_setzero_ps();
  for (index_t l = 0; l < kd; ++l) {
    __m256 bv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) bv[v] = _mm256_loadu_ps(b + l * ldb + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * ar + l * ak);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);
}

//! Rows [0, R) over columns [0, n): blocks of 16 columns, then 8, then single columns (scalar
//! fused multiply-adds, the same order).
template <int R>
LOOM_X86_AVX2 inline void gemm_rows(index_t n, index_t kd, const float* a, index_t ar, index_t ak, const float* b,
                                    index_t ldb, float* c, index_t ldc, bool accumulate) {
  index_t j = 0;
  for (; j + 16 <= n; j += 16) gemm_block<R, 2>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate);
  if (j + 8 <= n) {
    gemm_block<R, 1>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate);
    j += 8;
  }
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r) {
      float x = accumulate ? c[r * ldc + j] : 0.0f;
      for (index_t l = 0; l < kd; ++l) x = std::fma(a[r * ar + l * ak], b[l * ldb + j], x);
      c[r * ldc + j] = x;
    }
}

//! Rows [0, rows) in one block of R = rows (R counts down from Max to find it).
template <int Max>
LOOM_X86_AVX2 inline void gemm_last_rows(index_t rows, index_t n, index_t kd, const float* a, index_t ar, index_t ak,
                                         const float* b, index_t ldb, float* c, index_t ldc, bool accumulate) {
  if constexpr (Max > 0) {
    if (rows == Max) return gemm_rows<Max>(n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
    gemm_last_rows<Max - 1>(rows, n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
  }
}

//! C[i][j] (+)= sum_{l < kd} a[i * ar + l * ak] b[l * ldb + j] for i < m, j < n: blocks of 6 rows
//! x 16 columns, the rows left in one smaller block.
LOOM_X86_AVX2 inline void gemm_avx2(index_t m, index_t n, index_t kd, const float* a, index_t ar, index_t ak,
                                    const float* b, index_t ldb, float* c, index_t ldc, bool accumulate) {
  index_t i = 0;
  for (; i + 6 <= m; i += 6) gemm_rows<6>(n, kd, a + i * ar, ar, ak, b, ldb, c + i * ldc, ldc, accumulate);
  gemm_last_rows<5>(m - i, n, kd, a + i * ar, ar, ak, b, ldb, c + i * ldc, ldc, accumulate);
}

//! One AVX-512 register block: C[r][j] (+)= sum_{l < kd} a[r * ar + l * ak] b[l * ldb + j] for R rows
//! and 16 V columns, of which the last vector's lanes below `last` only (masked loads and stores).
template <int R, int V>
LOOM_X86_AVX512 inline void gemm_block512(index_t kd, const float* a, index_t ar, index_t ak, const float* b,
                                          index_t ldb, float* c, index_t ldc, bool accumulate, __mmask16 last) {
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(v + 1 < V ? __mmask16(0xffff) : last, c + r * ldc + 16 * v)
                             : _mm512_setzero_ps();
  for (index_t l = 0; l < kd; ++l) {
    __m512 bv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      bv[v] = _mm512_maskz_loadu_ps(v + 1 < V ? __mmask16(0xffff) : last, b + l * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * ar + l * ak]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v + 1 < V ? __mmask16(0xffff) : last, acc[r][v]);
}

//! Rows [0, R) over columns [0, n): blocks of 64 columns, then one block of the 1-63 left (its
//! last vector masked).
template <int R>
LOOM_X86_AVX512 inline void gemm_rows512(index_t n, index_t kd, const float* a, index_t ar, index_t ak, const float* b,
                                         index_t ldb, float* c, index_t ldc, bool accumulate) {
  index_t j = 0;
  for (; j + 64 <= n; j += 64)
    gemm_block512<R, 4>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, __mmask16(0xffff));
  const index_t left = n - j;
  if (left == 0) return;
  const __mmask16 last = first_lanes(static_cast<unsigned>((left - 1) % 16 + 1));
  if (left > 48)
    gemm_block512<R, 4>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, last);
  else if (left > 32)
    gemm_block512<R, 3>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, last);
  else if (left > 16)
    gemm_block512<R, 2>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, last);
  else
    gemm_block512<R, 1>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, last);
}

//! Rows [0, rows) in one block of R = rows (R counts down from Max to find it).
template <int Max>
LOOM_X86_AVX512 inline void gemm_last_rows512(index_t rows, index_t n, index_t kd, const float* a, index_t ar,
                                              index_t ak, const float* b, index_t ldb, float* c, index_t ldc,
                                              bool accumulate) {
  if constexpr (Max > 0) {
    if (rows == Max) return gemm_rows512<Max>(n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
    gemm_last_rows512<Max - 1>(rows, n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
  }
}

//! gemm_avx2's product with AVX-512 blocks of 6 rows x 64 columns (the same bits).
LOOM_X86_AVX512 inline void gemm_avx512(index_t m, index_t n, index_t kd, const float* a, index_t ar, index_t ak,
                                        const float* b, index_t ldb, float* c, index_t ldc, bool accumulate) {
  index_t i = 0;
  for (; i + 6 <= m; i += 6) gemm_rows512<6>(n, kd, a + i * ar, ar, ak, b, ldb, c + i * ldc, ldc, accumulate);
  gemm_last_rows512<5>(m - i, n, kd, a + i * ar, ar, ak, b, ldb, c + i * ldc, ldc, accumulate);
}

//! C[i][j] (+)= sum_{l < kd} a[i * ar + l * ak] b[l * ldb + j] for i < m, j < n, by the widest
//! blocks the CPU runs and loom allows (avx512_available()); callers check avx2_available().
inline void gemm(index_t m, index_t n, index_t kd, const float* a, index_t ar, index_t ak, const float* b, index_t ldb,
                 float* c, index_t ldc, bool accumulate) {
  if (avx512_available()) return gemm_avx512(m, n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
  gemm_avx2(m, n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
}

//! One block of gemm_bf16: R rows x 16 V columns, the last vector's lanes in `last` only.
template <int R, int V>
LOOM_X86_AVX512_BF16 inline void gemm_bf16_block(index_t kp, const std::uint16_t* a, index_t lda,
                                                 const std::uint16_t* b, index_t ldb, float* c, index_t ldc,
                                                 bool accumulate, float mul, __mmask16 last) {
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(v + 1 < V ? __mmask16(0xffff) : last, c + r * ldc + 16 * v)
                             : _mm512_setzero_ps();
  for (index_t p = 0; p < kp; ++p) {
    __m512i bv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      bv[v] = _mm512_maskz_loadu_epi32(v + 1 < V ? __mmask16(0xffff) : last, b + p * ldb + 32 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      std::uint32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
      const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
    }
  }
  const __m512 m = _mm512_set1_ps(mul);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v + 1 < V ? __mmask16(0xffff) : last,
                            accumulate ? acc[r][v] : _mm512_mul_ps(acc[r][v], m));
}

template <int R>
LOOM_X86_AVX512_BF16 inline void gemm_bf16_rows(index_t n, index_t kp, const std::uint16_t* a, index_t lda,
                                                const std::uint16_t* b, index_t ldb, float* c, index_t ldc,
                                                bool accumulate, float mul) {
  index_t j = 0;
  for (; j + 64 <= n; j += 64)
    gemm_bf16_block<R, 4>(kp, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, mul, __mmask16(0xffff));
  const index_t left = n - j;
  if (left == 0) return;
  const __mmask16 last = first_lanes(static_cast<unsigned>((left - 1) % 16 + 1));
  if (left > 48)
    gemm_bf16_block<R, 4>(kp, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, mul, last);
  else if (left > 32)
    gemm_bf16_block<R, 3>(kp, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, mul, last);
  else if (left > 16)
    gemm_bf16_block<R, 2>(kp, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, mul, last);
  else
    gemm_bf16_block<R, 1>(kp, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, mul, last);
}

template <int Max>
LOOM_X86_AVX512_BF16 inline void gemm_bf16_last_rows(index_t rows, index_t n, index_t kp, const std::uint16_t* a,
                                                     index_t lda, const std::uint16_t* b, index_t ldb, float* c,
                                                     index_t ldc, bool accumulate, float mul) {
  if constexpr (Max > 0) {
    if (rows == Max) return gemm_bf16_rows<Max>(n, kp, a, lda, b, ldb, c, ldc, accumulate, mul);
    gemm_bf16_last_rows<Max - 1>(rows, n, kp, a, lda, b, ldb, c, ldc, accumulate, mul);
  }
}

//! The bfloat16 pair product (AVX512_BF16; callers check avx512_bf16_available()): for i < m,
//! j < n, with x(p) = a[i * lda + 2p] b[p * ldb + 2j] + a[i * lda + 2p + 1] b[p * ldb + 2j + 1]
//! (bfloat16 bits; B holds rows of n column pairs, the pairs of the reduction index interleaved):
//!   accumulate:  C[i][j] = C[i][j] + x(0) + x(1) + ... + x(kp - 1)
//!   otherwise:   C[i][j] = mul * (x(0) + ... + x(kp - 1))
//! each x(p) added by one vdpbf16ps (its products exact, its sums rounded to float; subnormal
//! inputs and results flushed to zero), p ascending. Blocks of 6 rows x 64 columns, masked tails.
inline void gemm_bf16(index_t m, index_t n, index_t kp, const std::uint16_t* a, index_t lda, const std::uint16_t* b,
                      index_t ldb, float* c, index_t ldc, bool accumulate, float mul = 1.0f) {
  index_t i = 0;
  for (; i + 6 <= m; i += 6) gemm_bf16_rows<6>(n, kp, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate, mul);
  gemm_bf16_last_rows<5>(m - i, n, kp, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate, mul);
}

}  // namespace loom::detail::x86

#endif
