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
//!    loads of B per step; the 1-15 columns left in one block whose last vector is masked (a
//!    scalar loop there took 2.4 % of the float attention forward, T = 4096, AMD EPYC family 25
//!    model 1, where the causal diagonal's bands end at any column).
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

//! 8 floats at p, or (Masked) those in `lanes` (all ones), the others 0 and not read; the store
//! writes those lanes only.
template <bool Masked>
LOOM_X86_AVX2 inline __m256 load_lanes(const float* p, __m256i lanes) {
  if constexpr (Masked) return _mm256_maskload_ps(p, lanes);
  (void)lanes;
  return _mm256_loadu_ps(p);
}
template <bool Masked>
LOOM_X86_AVX2 inline void store_lanes(float* p, __m256i lanes, __m256 x) {
  if constexpr (Masked) return _mm256_maskstore_ps(p, lanes, x);
  (void)lanes;
  _mm256_storeu_ps(p, x);
}
//! One register block: C[r][j] (+)= sum_{l < kd} a[r * ar + l * ak] b[l * ldb + j] for R rows and
//! 8 V columns; with Tail, the last vector's columns only in the lanes of `last` (masked loads and
//! stores: nothing past them is read or written).
template <int R, int V, bool Tail = false>
LOOM_X86_AVX2 inline void gemm_block(index_t kd, const float* a, index_t ar, index_t ak, const float* b, index_t ldb,
                                     float* c, index_t ldc, bool accumulate, __m256i last) {
  const __m256i all = _mm256_set1_epi32(-1);
  __m256 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v)
      acc[r][v] = accumulate ? load_lanes<Tail>(c + r * ldc + 8 * v, v + 1 < V ? all : last) : _mm256_setzero_ps();
  for (index_t l = 0; l < kd; ++l) {
    __m256 bv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) bv[v] = load_lanes<Tail>(b + l * ldb + 8 * v, v + 1 < V ? all : last);
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
    for (int v = 0; v < V; ++v) store_lanes<Tail>(c + r * ldc + 8 * v, v + 1 < V ? all : last, acc[r][v]);
}

//! Rows [0, R) over columns [0, n): blocks of 16 columns, then the 1-15 left in one block of one or
//! two vectors, the last one masked (its lanes summed as the others: the same bits).
template <int R>
LOOM_X86_AVX2 inline void gemm_rows(index_t n, index_t kd, const float* a, index_t ar, index_t ak, const float* b,
                                    index_t ldb, float* c, index_t ldc, bool accumulate) {
  index_t j = 0;
  for (; j + 16 <= n; j += 16) gemm_block<R, 2>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, __m256i{});
  const index_t left = n - j;
  if (left == 0) return;
  const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>((left - 1) % 8 + 1)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  if (left > 8)
    gemm_block<R, 2, true>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, last);
  else
    gemm_block<R, 1, true>(kd, a, ar, ak, b + j, ldb, c + j, ldc, accumulate, last);
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

//! The accumulators of an AVX-512 register block of R rows x 16 V columns at c: loaded (or zeros),
//! and stored times `mul` (1: as they are); the last vector's lanes in `last` only.
template <int R, int V>
LOOM_X86_AVX512 inline void acc_load(__m512 (&acc)[R][V], const float* c, index_t ldc, bool accumulate,
                                     __mmask16 last) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(v + 1 < V ? __mmask16(0xffff) : last, c + r * ldc + 16 * v)
                             : _mm512_setzero_ps();
}
template <int R, int V>
LOOM_X86_AVX512 inline void acc_store(__m512 (&acc)[R][V], float* c, index_t ldc, float mul, __mmask16 last) {
  const __m512 m = _mm512_set1_ps(mul);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v + 1 < V ? __mmask16(0xffff) : last,
                            mul == 1.0f ? acc[r][v] : _mm512_mul_ps(acc[r][v], m));
}

//! The lanes below `count` (1 to 16) of a 16-lane mask.
constexpr __mmask16 lanes_of(index_t count) {
  return static_cast<__mmask16>(count >= 16 ? 0xffffu : (1u << count) - 1u);
}

//! Runs blk.block<R, V>(i, j, last) over the m x n output of an AVX-512 product: rows in blocks of
//! 6 (the rows left in one smaller block), columns in blocks of 64 (the 1-63 left in one block of
//! up to 4 vectors, the last one's lanes in `last`). Each block is one call (its whole reduction
//! inside), so the walk needs no target attribute of its own.
template <int R, class Block>
inline void walk_columns(index_t i, index_t n, const Block& blk) {
  index_t j = 0;
  for (; j + 64 <= n; j += 64) blk.template block<R, 4>(i, j, lanes_of(16));
  const index_t left = n - j;
  if (left == 0) return;
  const __mmask16 last = lanes_of((left - 1) % 16 + 1);
  if (left > 48)
    blk.template block<R, 4>(i, j, last);
  else if (left > 32)
    blk.template block<R, 3>(i, j, last);
  else if (left > 16)
    blk.template block<R, 2>(i, j, last);
  else
    blk.template block<R, 1>(i, j, last);
}
template <int Max, class Block>
inline void walk_last_rows(index_t i, index_t rows, index_t n, const Block& blk) {
  if constexpr (Max > 0) {
    if (rows == Max) return walk_columns<Max>(i, n, blk);
    walk_last_rows<Max - 1>(i, rows, n, blk);
  }
}
template <class Block>
inline void walk_blocks(index_t m, index_t n, const Block& blk) {
  index_t i = 0;
  for (; i + 6 <= m; i += 6) walk_columns<6>(i, n, blk);
  walk_last_rows<5>(i, m - i, n, blk);
}

//! The float product's AVX-512 block: C[r][j] (+)= sum_{l < kd} a[r * ar + l * ak] b[l * ldb + j].
struct float_blocks {
  index_t kd;
  const float* a;
  index_t ar, ak;
  const float* b;
  index_t ldb;
  float* c;
  index_t ldc;
  bool accumulate;
  template <int R, int V>
  LOOM_X86_AVX512 void block(index_t i, index_t j, __mmask16 last) const {
    const float* ai = a + i * ar;
    const float* bj = b + j;
    float* cij = c + i * ldc + j;
    __m512 acc[R][V];
    acc_load<R, V>(acc, cij, ldc, accumulate, last);
    for (index_t l = 0; l < kd; ++l) {
      __m512 bv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        bv[v] = _mm512_maskz_loadu_ps(v + 1 < V ? __mmask16(0xffff) : last, bj + l * ldb + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 av = _mm512_set1_ps(ai[r * ar + l * ak]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
      }
    }
    acc_store<R, V>(acc, cij, ldc, 1.0f, last);
  }
};

//! gemm_avx2's product with AVX-512 blocks of 6 rows x 64 columns (the same bits).
inline void gemm_avx512(index_t m, index_t n, index_t kd, const float* a, index_t ar, index_t ak, const float* b,
                        index_t ldb, float* c, index_t ldc, bool accumulate) {
  walk_blocks(m, n, float_blocks{kd, a, ar, ak, b, ldb, c, ldc, accumulate});
}

//! C[i][j] (+)= sum_{l < kd} a[i * ar + l * ak] b[l * ldb + j] for i < m, j < n, by the widest
//! blocks the CPU runs and loom allows (avx512_available()); callers check avx2_available().
inline void gemm(index_t m, index_t n, index_t kd, const float* a, index_t ar, index_t ak, const float* b, index_t ldb,
                 float* c, index_t ldc, bool accumulate) {
  if (avx512_available()) return gemm_avx512(m, n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
  gemm_avx2(m, n, kd, a, ar, ak, b, ldb, c, ldc, accumulate);
}

//! The bfloat16 pair product's block (gemm_bf16).
struct bf16_blocks {
  index_t kp;
  const std::uint16_t* a;
  index_t lda;
  const std::uint16_t* b;
  index_t ldb;
  float* c;
  index_t ldc;
  bool accumulate;
  float mul;
  template <int R, int V>
  LOOM_X86_AVX512_BF16 void block(index_t i, index_t j, __mmask16 last) const {
    const std::uint16_t* ai = a + i * lda;
    const std::uint16_t* bj = b + 2 * j;
    float* cij = c + i * ldc + j;
    __m512 acc[R][V];
    acc_load<R, V>(acc, cij, ldc, accumulate, last);
    for (index_t p = 0; p < kp; ++p) {
      __m512i bv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        bv[v] = _mm512_maskz_loadu_epi32(v + 1 < V ? __mmask16(0xffff) : last, bj + p * ldb + 32 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        std::uint32_t pair;
        std::memcpy(&pair, ai + r * lda + 2 * p, sizeof pair);
        const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
      }
    }
    acc_store<R, V>(acc, cij, ldc, accumulate ? 1.0f : mul, last);
  }
};

//! The bfloat16 pair product (AVX512_BF16; callers check avx512_bf16_available()): for i < m,
//! j < n, with x(p) = a[i * lda + 2p] b[p * ldb + 2j] + a[i * lda + 2p + 1] b[p * ldb + 2j + 1]
//! (bfloat16 bits; B holds rows of n column pairs, the pairs of the reduction index interleaved):
//!   accumulate:  C[i][j] = C[i][j] + x(0) + x(1) + ... + x(kp - 1)
//!   otherwise:   C[i][j] = mul * (x(0) + ... + x(kp - 1))
//! each x(p) added by one vdpbf16ps (its products exact, its sums rounded to float; subnormal
//! inputs and results flushed to zero), p ascending. Blocks of 6 rows x 64 columns, masked tails.
inline void gemm_bf16(index_t m, index_t n, index_t kp, const std::uint16_t* a, index_t lda, const std::uint16_t* b,
                      index_t ldb, float* c, index_t ldc, bool accumulate, float mul = 1.0f) {
  walk_blocks(m, n, bf16_blocks{kp, a, lda, b, ldb, c, ldc, accumulate, mul});
}

}  // namespace loom::detail::x86

#endif
