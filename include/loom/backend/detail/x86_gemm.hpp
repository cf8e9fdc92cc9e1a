#pragma once

//! @file
//! The AVX2 small dense product of loom's CPU kernels (attention's tile products, chunked linear
//! attention's register tiles): C (R x n) (+)= A (R x kd) B (kd x n), float, A read with any row
//! and column strides, B and C row-major. Blocks of R rows x 16 columns keep their R x 2
//! accumulators in registers over the whole kd loop (up to 6 rows: 12 of AVX2's 16 registers; the
//! 8 x 32 blocks of the portable bodies need 32 and spill when compiled for AVX2), one broadcast
//! of A and two loads of B per step. Each output is summed over l ascending by fused
//! multiply-adds: the bits depend on the operands only (not on the blocking or the thread count).

#include <loom/backend/detail/x86.hpp>
#include <loom/core/tensor_view.hpp>

#include <cmath>

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
LOOM_X86_AVX2 inline void gemm(index_t m, index_t n, index_t kd, const float* a, index_t ar, index_t ak, const float* b,
                               index_t ldb, float* c, index_t ldc, bool accumulate) {
  index_t i = 0;
  for (; i + 6 <= m; i += 6) gemm_rows<6>(n, kd, a + i * ar, ar, ak, b, ldb, c + i * ldc, ldc, accumulate);
  gemm_last_rows<5>(m - i, n, kd, a + i * ar, ar, ak, b, ldb, c + i * ldc, ldc, accumulate);
}

}  // namespace loom::detail::x86

#endif
