#pragma once

//! @file
//! AVX-512 host kernels for the tiled bitmap format with float, bfloat16 or half weights and float
//! accumulation, "load as sparse, compute as dense":
//!  - a tile row is turned into dense 16-lane quarters by expanding its packed values by the mask
//!    (16-bit weights are expanded as 16-bit lanes, then widened to float; the offsets of the
//!    tile's 32 quarters come from one vector popcount and prefix sum);
//!  - N >= 2, bands with more than 25 % nonzeros (sparser ones take the row lists of
//!    kernels_avx2.hpp, one FMA per stored entry): the tile is expanded into an 8 x 64 buffer in
//!    L1, then for each column k of the tile that holds a nonzero in any of its 8 rows (the OR of
//!    the row masks), the B row k (up to 32 columns, two registers) is multiplied by the broadcast
//!    A(r, k) of each row into register accumulators: 8 or 16 FMAs per B row, no per-nonzero
//!    branch;
//!  - N == 1: dense bands multiply the expanded quarters by x (x over the tile in four registers,
//!    shared by its 8 rows); sparse bands (<= 25 % nonzeros) pick x at each row's nonzero columns
//!    instead (a byte compress of the column numbers, two permutes) and take one FMA per 16
//!    nonzeros.
//! Compiled with a function-level target attribute and taken at run time when the CPU has the
//! instructions (`avx512_available()`), so the default build needs no -march flag and the portable
//! kernels of kernels.hpp remain the fallback (and the kernels of other element types, of csr and
//! n_m, of instrumented runs and of device code). The portable and vector kernels sum each output
//! in different (each fixed) orders: results are identical across host backends and thread counts
//! on one machine, and within the fp32 tolerance of each other.

#include <loom/backend/detail/x86.hpp>
#include <loom/core/float16.hpp>
#include <loom/sparse/formats.hpp>

#if defined(LOOM_X86_KERNELS)
#define LOOM_SPARSE_X86_KERNELS 1
#include <atomic>
#include <cstdint>
#include <immintrin.h>
#include <type_traits>

#define LOOM_SPARSE_X86_TARGET \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bitalg,avx512vbmi2,bmi,bmi2,popcnt,fma")))

// GCC 12's AVX-512 intrinsics build their pass-through operands from _mm512_undefined_*(), which
// -Wmaybe-uninitialized reports once inlined into a function with a target attribute.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace loom::sparse::detail::x86 {

//! The one switch of every family's vector kernels (loom::detail::x86::vector_kernels_allowed).
inline std::atomic<bool>& avx512_allowed() { return loom::detail::x86::vector_kernels_allowed(); }
using loom::detail::x86::first_lanes;
using loom::detail::x86::load16;
using loom::detail::x86::load16_bits;
using loom::detail::x86::widen;

//! Whether the CPU runs these kernels (the shared AVX-512 set plus bitalg and vbmi2, checked
//! once) and vector kernels with their AVX-512 forms are allowed.
inline bool avx512_available() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return loom::detail::x86::avx512_cpu() && __builtin_cpu_supports("avx512bitalg") &&
           __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("popcnt");
  }();
  return cpu && loom::detail::x86::avx512_available();
}

//! The first `count` (<= 16) values at s, placed at the set bits of m (zeros elsewhere), as floats:
//! float expanded as is; bfloat16 / half expanded as 16-bit lanes, then widened. A full load when
//! count is 16: a masked load feeding the expand costs 3x at N = 1, 50 % zeros, on the benchmark
//! machine.
LOOM_SPARSE_X86_TARGET inline __m512 expand16(const float* s, unsigned count, __mmask16 m) {
  return _mm512_maskz_expand_ps(m, count == 16 ? _mm512_loadu_ps(s) : load16(s, count));
}
template <class T>
LOOM_SPARSE_X86_TARGET inline __m512 expand16(const T* s, unsigned count, __mmask16 m) {
  const __m256i v = count == 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)) : load16_bits(s, count);
  return widen(s, _mm256_maskz_expand_epi16(m, v));
}

//! Whether the AVX-512 kernels take weights of type T.
template <class T>
inline constexpr bool vector_weights =
    std::is_same_v<T, float> || std::is_same_v<T, bfloat16> || std::is_same_v<T, half>;

//! The 32 quarters of one tile (quarter i = the 16 columns 16 (i % 4) + [0, 16) of tile row i / 4):
//! their masks, and the offsets of their first values in the tile's packed values, computed for
//! the whole tile at once (a vector popcount and a prefix sum over 32 lanes) so that no quarter
//! waits on the count of the one before it.
struct tile_quarters {
  alignas(64) std::uint16_t mask[32];
  alignas(64) std::uint16_t off[32];

  LOOM_SPARSE_X86_TARGET explicit tile_quarters(const std::uint64_t* row_masks) {
    const __m512i m = _mm512_loadu_si512(row_masks);
    const __m512i cnt = _mm512_popcnt_epi16(m);
    const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                          12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i inc = cnt;
    for (int s = 1; s < 32; s *= 2)  // lane i += lane i - s (zero below s)
      inc = _mm512_add_epi16(
          inc, _mm512_maskz_permutexvar_epi16(static_cast<__mmask32>(0xffffffffu << s),
                                              _mm512_sub_epi16(iota, _mm512_set1_epi16(static_cast<short>(s))), inc));
    _mm512_store_si512(mask, m);
    _mm512_store_si512(off, _mm512_sub_epi16(inc, cnt));
  }

  //! Quarter i in 16 float lanes: its values (from p, the tile's first value) at the set bits of
  //! its mask, zeros elsewhere. Loads 16 values unmasked while they lie before `end` (the expand
  //! ignores those past the quarter's own), masked at the very end of the array.
  template <class T>
  LOOM_SPARSE_X86_TARGET __m512 operator()(int i, const T* p, const T* end) const {
    const T* s = p + off[i];
    const unsigned left = end - s >= 16 ? 16u : static_cast<unsigned>(end - s);
    return expand16(s, left, static_cast<__mmask16>(mask[i]));
  }
};

//! Column mask of the 16-lane quarter q of a tile starting at column c0 (cols: A's columns).
LOOM_SPARSE_X86_TARGET inline __mmask16 lanes_valid(index_t c0, index_t cols, int q) {
  const index_t w = cols - c0 - 16 * q;
  return w >= 16  ? static_cast<__mmask16>(0xffff)
         : w <= 0 ? static_cast<__mmask16>(0)
                  : static_cast<__mmask16>((1u << w) - 1);
}

//! xv = x[c0, c0 + 64), zeros past `cols` (A's columns).
LOOM_SPARSE_X86_TARGET inline void load_x(const float* x, index_t c0, index_t cols, __m512 (&xv)[4]) {
  if (cols - c0 >= tile_cols) {
    for (int q = 0; q < 4; ++q) xv[q] = _mm512_loadu_ps(x + c0 + 16 * q);
  } else {
    for (int q = 0; q < 4; ++q) xv[q] = _mm512_maskz_loadu_ps(lanes_valid(c0, cols, q), x + c0 + 16 * q);
  }
}

//! out[r] = the sum of acc[r]'s 16 lanes, in a fixed pairwise order.
LOOM_SPARSE_X86_TARGET inline void row_sums(const __m512 (&acc)[tile_rows], float* out) {
  for (index_t r = 0; r < tile_rows; ++r) {
    alignas(64) float l[16];
    _mm512_store_ps(l, acc[r]);
    for (int h = 8; h > 0; h /= 2)
      for (int i = 0; i < h; ++i) l[i] += l[i + h];
    out[r] = l[0];
  }
}

//! N == 1: out[r] = the lane sums of acc[r] (r < 8, zeros at first) after rows(acc, mk, p, xv) ran on each tile
//! of the band in order: mk the tile's 8 row masks, p its first value, xv x over its 64 columns (zeros past A's).
template <class T, class Space, class Rows>
[[gnu::always_inline]] LOOM_SPARSE_X86_TARGET inline void band_tiles_dot(const bitmap_view<T, Space>& a, index_t band,
                                                                         const float* x, float* out, const Rows& rows) {
  __m512 acc[tile_rows];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const index_t gc = a.grid_cols();
  for (index_t tc = 0; tc < gc; ++tc) {
    const index_t t = band * gc + tc;
    __m512 xv[4];
    load_x(x, tc * tile_cols, a.cols, xv);
    rows(acc, a.masks + t * tile_rows, a.values + a.tile_offsets[t], xv);
  }
  row_sums(acc, out);
}

//! band_vector's tile: each row's four quarters expanded (end: the end of A's values) times x.
template <class T>
struct expand_rows {
  const T* end;
  LOOM_SPARSE_X86_TARGET void operator()(__m512 (&acc)[tile_rows], const std::uint64_t* mk, const T* p,
                                         const __m512 (&xv)[4]) const {
    const tile_quarters tq(mk);
    for (int r = 0; r < static_cast<int>(tile_rows); ++r) {
      const __m512 s01 = _mm512_fmadd_ps(tq(4 * r + 1, p, end), xv[1], _mm512_mul_ps(tq(4 * r, p, end), xv[0]));
      const __m512 s23 = _mm512_fmadd_ps(tq(4 * r + 3, p, end), xv[3], _mm512_mul_ps(tq(4 * r + 2, p, end), xv[2]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(s01, s23));
    }
  }
};

//! N == 1: out[r] = sum over the band's tiles of A(row r, tile) . x(tile), r < 8.
template <class T, class Space>
LOOM_SPARSE_X86_TARGET void band_vector(const bitmap_view<T, Space>& a, index_t band, const float* x, float* out) {
  band_tiles_dot(a, band, x, out, expand_rows<T>{a.values + a.tile_offsets[a.tiles()]});
}

//! band_vector_gather's tile: x picked at each row's nonzero columns times the row's packed values
//! (iota: the bytes 0..63; bit5: 32 in every int32 lane).
struct gather_rows {
  __m512i iota, bit5;
  template <class T>
  LOOM_SPARSE_X86_TARGET void operator()(__m512 (&acc)[tile_rows], const std::uint64_t* mk, const T* p,
                                         const __m512 (&xv)[4]) const {
    for (index_t r = 0; r < tile_rows; ++r) {
      const std::uint64_t m = mk[r];
      const int cnt = static_cast<int>(__builtin_popcountll(m));
      __m512i idx = _mm512_maskz_compress_epi8(_cvtu64_mask64(m), iota);
      for (int b = 0; b < cnt; b += 16) {
        const __m512i cols = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(idx));
        const __m512 lo = _mm512_permutex2var_ps(xv[0], cols, xv[1]);
        const __m512 hi = _mm512_permutex2var_ps(xv[2], cols, xv[3]);
        const __m512 xg = _mm512_mask_blend_ps(_mm512_test_epi32_mask(cols, bit5), lo, hi);
        const __m512 v = load16(p + b, static_cast<unsigned>(cnt - b));
        acc[r] = _mm512_fmadd_ps(v, xg, acc[r]);
        idx = _mm512_alignr_epi32(_mm512_setzero_si512(), idx, 4);  // the next 16 indices
      }
      p += cnt;
    }
  }
};

//! N == 1 for sparse rows: out[r] as band_vector. Per tile row, the column indices of its nonzeros (a byte compress of
//! 0..63 by the row mask), x at those columns picked from the four registers holding x over the tile (two two-source
//! permutes and a blend), times the row's packed values: one FMA per 16 nonzeros instead of four expands per row.
template <class T, class Space>
LOOM_SPARSE_X86_TARGET void band_vector_gather(const bitmap_view<T, Space>& a, index_t band, const float* x,
                                               float* out) {
  alignas(64) static constexpr std::uint8_t iota_bytes[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
      22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
      44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
  band_tiles_dot(a, band, x, out, gather_rows{_mm512_load_si512(iota_bytes), _mm512_set1_epi32(32)});
}

//! Whether a band holds at most 25 % nonzeros, where the kernels that visit stored entries only
//! (a gather for N == 1, row lists for N >= 2) beat expanding its tiles to dense.
template <class T, class Space>
inline bool sparse_band(const bitmap_view<T, Space>& a, index_t band) {
  const index_t gc = a.grid_cols();
  const index_t nnz = a.tile_offsets[(band + 1) * gc] - a.tile_offsets[band * gc];
  return 4 * nnz <= tile_rows * a.cols;
}

//! N == 1: the kernel for the band's density (measured on 4096 x 4096, 2 threads: the gather
//! kernel is 1.2-1.4x faster at 80-90 % zeros, the expand kernel 1.4x faster at 70 %, 2.5x at 50 %).
template <class T, class Space>
inline void band_dot(const bitmap_view<T, Space>& a, index_t band, const float* x, float* out) {
  if (sparse_band(a, band))
    band_vector_gather(a, band, x, out);
  else
    band_vector(a, band, x, out);
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

//! acc[r][c & 1] += A_tile(r, k) * B(k, 0, 16) for the c-th column k set in `cols` (up to 16 output
//! columns, `last` masks the lanes past nb): consecutive columns go to two accumulator sets, so 16
//! FMA chains are in flight instead of 8.
LOOM_SPARSE_X86_TARGET inline void tile_columns_narrow(__m512 (&acc)[tile_rows][2],
                                                       const float (&dense)[tile_rows][tile_cols], std::uint64_t cols,
                                                       const float* b, index_t ldb, __mmask16 last) {
  while (cols != 0) {
    const int k0 = static_cast<int>(_tzcnt_u64(cols));
    cols = _blsr_u64(cols);
    const __m512 b0 = _mm512_maskz_loadu_ps(last, b + k0 * ldb);
    if (cols == 0) {
      for (index_t r = 0; r < tile_rows; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(dense[r][k0]), b0, acc[r][0]);
      break;
    }
    const int k1 = static_cast<int>(_tzcnt_u64(cols));
    cols = _blsr_u64(cols);
    const __m512 b1 = _mm512_maskz_loadu_ps(last, b + k1 * ldb);
    for (index_t r = 0; r < tile_rows; ++r) {
      acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(dense[r][k0]), b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(dense[r][k1]), b1, acc[r][1]);
    }
  }
}

//! Expands tile t into dense (8 x 64, zeros included); returns the OR of its row masks.
template <class T, class Space>
LOOM_SPARSE_X86_TARGET inline std::uint64_t expand_tile(const bitmap_view<T, Space>& a, index_t t, const T* end,
                                                        float (&dense)[tile_rows][tile_cols]) {
  const std::uint64_t* mk = a.masks + t * tile_rows;
  const T* p = a.values + a.tile_offsets[t];
  const tile_quarters tq(mk);
  std::uint64_t any = 0;
  for (int r = 0; r < static_cast<int>(tile_rows); ++r) {
    any |= mk[r];
    for (int q = 0; q < 4; ++q) _mm512_store_ps(dense[r] + 16 * q, tq(4 * r + q, p, end));
  }
  return any;
}

//! N >= 2: out[r * out_ld + j] = (A B)(band row r, j0 + j) for j < nb (nb <= 64), B a row-major
//! panel with leading dimension ldb.
template <class T, class Space>
LOOM_SPARSE_X86_TARGET void band_panel(const bitmap_view<T, Space>& a, index_t band, const float* b, index_t ldb,
                                       index_t j0, index_t nb, float* out, index_t out_ld) {
  alignas(64) float dense[2][tile_rows][tile_cols];
  const index_t gc = a.grid_cols();
  const T* end = a.values + a.tile_offsets[a.tiles()];
  // Column groups of up to 32 (two registers per row, 16 accumulators) over [0, nb).
  for (index_t g0 = 0; g0 < nb; g0 += 32) {
    const index_t w = nb - g0 < 32 ? nb - g0 : 32;
    const int regs = w > 16 ? 2 : 1;
    const index_t tail = w - 16 * (regs - 1);
    const auto last = static_cast<__mmask16>(tail >= 16 ? 0xffffu : (1u << tail) - 1);
    __m512 acc2[tile_rows][2];
    __m512 acc1[tile_rows][2];
    for (index_t r = 0; r < tile_rows; ++r) acc2[r][0] = acc2[r][1] = acc1[r][0] = acc1[r][1] = _mm512_setzero_ps();
    // Software-pipelined: the next nonempty tile is expanded into the other buffer before the
    // current one is multiplied, so the multiply never reads a store that is still in flight.
    const index_t t0 = band * gc;
    auto next = [&](index_t tc) {
      while (tc < gc && a.tile_offsets[t0 + tc + 1] == a.tile_offsets[t0 + tc]) ++tc;
      return tc;
    };
    index_t tc = next(0);
    int cur = 0;
    std::uint64_t any = tc < gc ? expand_tile(a, t0 + tc, end, dense[0]) : 0;
    while (tc < gc) {
      const index_t tn = next(tc + 1);
      const std::uint64_t any_next = tn < gc ? expand_tile(a, t0 + tn, end, dense[cur ^ 1]) : 0;
      const float* bt = b + tc * tile_cols * ldb + j0 + g0;
      if (regs == 2)
        tile_columns<2>(acc2, dense[cur], any, bt, ldb, last);
      else
        tile_columns_narrow(acc1, dense[cur], any, bt, ldb, last);
      tc = tn;
      any = any_next;
      cur ^= 1;
    }
    for (index_t r = 0; r < tile_rows; ++r) {
      float* o = out + r * out_ld + g0;
      if (regs == 2) {
        _mm512_storeu_ps(o, acc2[r][0]);
        _mm512_mask_storeu_ps(o + 16, last, acc2[r][1]);
      } else {
        _mm512_mask_storeu_ps(o, last, _mm512_add_ps(acc1[r][0], acc1[r][1]));
      }
    }
  }
}

}  // namespace loom::sparse::detail::x86

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#undef LOOM_SPARSE_X86_TARGET
#endif
