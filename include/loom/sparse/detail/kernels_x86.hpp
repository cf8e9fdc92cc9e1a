#pragma once

//! @file
//! AVX-512 host kernels for the tiled bitmap format with float weights and float accumulation:
//! "load as sparse, compute as dense" taken literally. Each 16-column quarter of a tile row is
//! expanded from the packed values into a zero-filled 16-lane register by its mask (a masked load
//! of popcount(mask) values, then an expand by the mask), so a tile row costs four expands
//! whatever its sparsity, and the multiply is dense over the tile:
//!  - N == 1: each expanded quarter is multiplied by the 16 elements of x it covers (x of the tile
//!    in four registers, reused by the tile's 8 rows);
//!  - N >= 2: the tile is expanded into an 8 x 64 buffer in L1, then for each column k of the tile
//!    that holds a nonzero in any of its 8 rows (the OR of the row masks), the B row k (up to 32
//!    columns, two registers) is multiplied by the broadcast A(r, k) of each row into register
//!    accumulators: 8 or 16 FMAs per B row, no per-nonzero branch.
//! Compiled with a function-level target attribute and taken at run time when the CPU has
//! AVX-512 F/VL/BW/DQ (`avx512_available()`), so the default build needs no -march flag and the
//! portable kernels of kernels.hpp remain the fallback (and the kernels of other element types,
//! of csr and n_m, of instrumented runs and of device code). The two kernels sum each output in a
//! different (each fixed) order: results are identical across host backends and thread counts on
//! one machine, and within the fp32 tolerance of each other.

#include <loom/sparse/formats.hpp>

#if defined(__x86_64__) && !defined(__CUDACC__) && (defined(__GNUC__) || defined(__clang__))
#define LOOM_SPARSE_X86_KERNELS 1
#include <atomic>
#include <cstdint>
#include <immintrin.h>

#define LOOM_SPARSE_X86_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,bmi,bmi2,popcnt,fma")))

namespace loom::sparse::detail::x86 {

//! False forces the portable kernels (tests of the fallback, benchmark comparisons).
inline std::atomic<bool>& avx512_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

//! Whether the CPU runs the AVX-512 kernels (checked once) and they are allowed.
inline bool avx512_available() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("bmi2") &&
           __builtin_cpu_supports("popcnt");
  }();
  return cpu && avx512_allowed().load(std::memory_order_relaxed);
}

//! The 16 lanes of one quarter of a tile row: values[p, p + popcount(m)) placed at the set bits of
//! m, zeros elsewhere. Never reads past the quarter's own values (masked load).
LOOM_SPARSE_X86_TARGET inline __m512 expand_quarter(const float* p, unsigned m) {
  // (an expand straight from memory, vexpandps zmm{k}, m512, measured slower here at 70 %)
  const unsigned cnt = static_cast<unsigned>(__builtin_popcount(m));
  const __m512 packed = _mm512_maskz_loadu_ps(static_cast<__mmask16>(_bzhi_u32(0xffffu, cnt)), p);
  return _mm512_maskz_expand_ps(static_cast<__mmask16>(m), packed);
}

//! Offsets of the four quarters of a tile row inside the row's packed values.
struct quarter_offsets {
  unsigned q1, q2, q3, total;
  LOOM_SPARSE_X86_TARGET explicit quarter_offsets(std::uint64_t m)
      : q1(static_cast<unsigned>(__builtin_popcountll(m & 0xffffull))),
        q2(static_cast<unsigned>(__builtin_popcountll(m & 0xffffffffull))),
        q3(static_cast<unsigned>(__builtin_popcountll(m & 0xffffffffffffull))),
        total(static_cast<unsigned>(__builtin_popcountll(m))) {}
};

//! Column mask of the 16-lane quarter q of a tile starting at column c0 (cols: A's columns).
LOOM_SPARSE_X86_TARGET inline __mmask16 lanes_valid(index_t c0, index_t cols, int q) {
  const index_t w = cols - c0 - 16 * q;
  return w >= 16  ? static_cast<__mmask16>(0xffff)
         : w <= 0 ? static_cast<__mmask16>(0)
                  : static_cast<__mmask16>((1u << w) - 1);
}

//! N == 1: out[r] = sum over the band's tiles of A(row r, tile) . x(tile), r < 8.
template <class Space>
LOOM_SPARSE_X86_TARGET void band_vector(const bitmap_view<float, Space>& a, index_t band, const float* x, float* out) {
  __m512 acc[tile_rows];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const index_t gc = a.grid_cols();
  for (index_t tc = 0; tc < gc; ++tc) {
    const index_t t = band * gc + tc;
    const float* p = a.values + a.tile_offsets[t];
    const index_t c0 = tc * tile_cols;
    __m512 xv[4];
    if (a.cols - c0 >= tile_cols) {
      for (int q = 0; q < 4; ++q) xv[q] = _mm512_loadu_ps(x + c0 + 16 * q);
    } else {
      for (int q = 0; q < 4; ++q) xv[q] = _mm512_maskz_loadu_ps(lanes_valid(c0, a.cols, q), x + c0 + 16 * q);
    }
    const std::uint64_t* mk = a.masks + t * tile_rows;
    for (index_t r = 0; r < tile_rows; ++r) {
      const std::uint64_t m = mk[r];
      const quarter_offsets o(m);
      const __m512 d0 = expand_quarter(p, static_cast<unsigned>(m & 0xffff));
      const __m512 d1 = expand_quarter(p + o.q1, static_cast<unsigned>((m >> 16) & 0xffff));
      const __m512 d2 = expand_quarter(p + o.q2, static_cast<unsigned>((m >> 32) & 0xffff));
      const __m512 d3 = expand_quarter(p + o.q3, static_cast<unsigned>(m >> 48));
      const __m512 s01 = _mm512_fmadd_ps(d1, xv[1], _mm512_mul_ps(d0, xv[0]));
      const __m512 s23 = _mm512_fmadd_ps(d3, xv[3], _mm512_mul_ps(d2, xv[2]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(s01, s23));
      p += o.total;
    }
  }
  for (index_t r = 0; r < tile_rows; ++r) {  // a fixed pairwise order over the 16 lanes
    alignas(64) float l[16];
    _mm512_store_ps(l, acc[r]);
    for (int h = 8; h > 0; h /= 2)
      for (int i = 0; i < h; ++i) l[i] += l[i + h];
    out[r] = l[0];
  }
}

//! acc[r][0, 16 V) += A_tile(r, k) * B(k, 0, 16 V) for every column k set in `cols`; `last` masks
//! the lanes of the last register (columns past nb). B rows are ldb apart, b at the tile's first row.
template <int V>
LOOM_SPARSE_X86_TARGET inline void tile_columns(__m512 (&acc)[tile_rows][V], const float (&dense)[tile_rows][tile_cols],
                                                std::uint64_t cols, const float* b, index_t ldb, __mmask16 last) {
  while (cols != 0) {
    const int k = static_cast<int>(_tzcnt_u64(cols));
    cols = _blsr_u64(cols);
    const float* bk = b + k * ldb;
    __m512 bv[V];
    for (int v = 0; v + 1 < V; ++v) bv[v] = _mm512_loadu_ps(bk + 16 * v);
    bv[V - 1] = _mm512_maskz_loadu_ps(last, bk + 16 * (V - 1));
    for (index_t r = 0; r < tile_rows; ++r) {
      const __m512 ar = _mm512_set1_ps(dense[r][k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
}

//! N >= 2: out[r * out_ld + j] = (A B)(band row r, j0 + j) for j < nb (nb <= 64), B a row-major
//! panel with leading dimension ldb.
template <class Space>
LOOM_SPARSE_X86_TARGET void band_panel(const bitmap_view<float, Space>& a, index_t band, const float* b, index_t ldb,
                                       index_t j0, index_t nb, float* out, index_t out_ld) {
  alignas(64) float dense[tile_rows][tile_cols];
  const index_t gc = a.grid_cols();
  // Column groups of up to 32 (two registers per row, 16 accumulators) over [0, nb).
  for (index_t g0 = 0; g0 < nb; g0 += 32) {
    const index_t w = nb - g0 < 32 ? nb - g0 : 32;
    const int regs = w > 16 ? 2 : 1;
    const index_t tail = w - 16 * (regs - 1);
    const auto last = static_cast<__mmask16>(tail >= 16 ? 0xffffu : (1u << tail) - 1);
    __m512 acc2[tile_rows][2];
    __m512 acc1[tile_rows][1];
    for (index_t r = 0; r < tile_rows; ++r) acc2[r][0] = acc2[r][1] = acc1[r][0] = _mm512_setzero_ps();
    for (index_t tc = 0; tc < gc; ++tc) {
      const index_t t = band * gc + tc;
      const std::uint64_t* mk = a.masks + t * tile_rows;
      std::uint64_t any = 0;
      for (index_t r = 0; r < tile_rows; ++r) any |= mk[r];
      if (any == 0) continue;
      const float* p = a.values + a.tile_offsets[t];
      for (index_t r = 0; r < tile_rows; ++r) {
        const std::uint64_t m = mk[r];
        const quarter_offsets o(m);
        _mm512_store_ps(dense[r] + 0, expand_quarter(p, static_cast<unsigned>(m & 0xffff)));
        _mm512_store_ps(dense[r] + 16, expand_quarter(p + o.q1, static_cast<unsigned>((m >> 16) & 0xffff)));
        _mm512_store_ps(dense[r] + 32, expand_quarter(p + o.q2, static_cast<unsigned>((m >> 32) & 0xffff)));
        _mm512_store_ps(dense[r] + 48, expand_quarter(p + o.q3, static_cast<unsigned>(m >> 48)));
        p += o.total;
      }
      const float* bt = b + tc * tile_cols * ldb + j0 + g0;
      if (regs == 2)
        tile_columns<2>(acc2, dense, any, bt, ldb, last);
      else
        tile_columns<1>(acc1, dense, any, bt, ldb, last);
    }
    for (index_t r = 0; r < tile_rows; ++r) {
      float* o = out + r * out_ld + g0;
      if (regs == 2) {
        _mm512_storeu_ps(o, acc2[r][0]);
        _mm512_mask_storeu_ps(o + 16, last, acc2[r][1]);
      } else {
        _mm512_mask_storeu_ps(o, last, acc1[r][0]);
      }
    }
  }
}

}  // namespace loom::sparse::detail::x86

#undef LOOM_SPARSE_X86_TARGET
#endif
