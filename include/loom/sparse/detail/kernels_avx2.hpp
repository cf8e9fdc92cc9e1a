#pragma once

//! @file
//! AVX2 host kernels of loom::sparse::spmm (float accumulation; float, bfloat16 or half weights):
//! CSR on every CPU with AVX2; the bitmap on CPUs without the AVX-512 kernels of kernels_x86.hpp,
//! and on those for its sparse bands (N >= 2). One micro-kernel serves both formats: a row's
//! nonzeros as a (column, value) list, multiplied into up to 64 output columns held in registers
//! (ceil(nb / 8) vectors, in 1, 2 or 4 interleaved sets so that consecutive FMAs do not wait on
//! each other), one broadcast and ceil(nb / 8) FMAs per nonzero, no branch per nonzero. CSR rows
//! already are such lists. A band of the tiled bitmap is decoded into them 8 tiles (512 columns)
//! at a time, without a branch per nonzero either: the column numbers of each mask byte come from a
//! 256-entry table (8 stored per byte, the count advances the list), and a tile row's values are
//! copied 8 at a time. N == 1 takes the same lists with an 8-lane gather of x. CSR items of 64 rows
//! with a B block in L1 (csr_grouped), and CSR items of more than 32 columns whose B panel stays
//! in L2, take a 16-lane form of the list product on AVX-512 CPUs (the latter prefetching B rows).
//! Every output sums its nonzeros in one fixed order (list order, the sets added in order), so
//! results are the same bits on every host backend and thread count; they differ from the portable
//! kernels' within the fp32 tolerance.

#include <loom/backend/detail/x86.hpp>
#include <loom/sparse/formats.hpp>

namespace loom::sparse::detail {

//! How a host CSR product walks A. A work item is one band of 8 rows, or csr_group_bands bands
//! when csr_grouped(K, nb): a chunk of more than 32 columns of B whose panel (K nb floats) outgrows
//! L2. The AVX2 kernel then goes through A's columns csr_block(K, nb) at a time for every row of
//! the item, so each block of B rows is read from cache by many rows (8 rows alone reuse a B row
//! about 0.8 times at 90 % zeros). Shape-only choices: the bits do not depend on the thread count.
inline constexpr index_t csr_group_bands = 8;
constexpr bool csr_grouped(index_t k, index_t nb) { return nb > 32 && k * nb > (index_t{1} << 18); }
//! Columns of A per block: 128 in a grouped item (a 32 KiB block of B at nb = 64), 2048 when the
//! panel outgrows L2, else all of them.
constexpr index_t csr_block(index_t k, index_t nb) {
  return csr_grouped(k, nb) ? 128 : k * nb > (index_t{1} << 18) ? 2048 : k;
}

//! The list product a CSR item runs: 8 lanes (AVX2, or 32 columns or fewer), or on AVX-512 CPUs
//! 16 lanes, reading a B block held in L1 (csr_grouped) or a panel in L2, whose rows are then
//! prefetched csr_prefetch entries ahead (K = 4096, N = 64 at 80 and 90 % zeros: 13-17 % less time
//! than the 8-lane product without prefetching; one band per item reuses a B row about 1.4 times).
enum class list_form { lanes8, lanes16, lanes16_prefetch };
inline constexpr int csr_prefetch = 16;
constexpr list_form csr_list_form(index_t k, index_t nb, bool avx512) {
  return !avx512 || nb <= 32  ? list_form::lanes8
         : csr_grouped(k, nb) ? list_form::lanes16
                              : list_form::lanes16_prefetch;
}

}  // namespace loom::sparse::detail

#if defined(LOOM_X86_KERNELS)
#include <cstdint>
#include <immintrin.h>
#include <type_traits>

#define LOOM_SPARSE_AVX2_TARGET __attribute__((target("avx2,fma,f16c,popcnt,bmi,bmi2")))

namespace loom::sparse::detail::x86 {

//! Whether the CPU runs the AVX2 kernels (the shared AVX2 floor plus popcnt and BMI2) and vector
//! kernels are allowed.
inline bool avx2_available() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return loom::detail::x86::avx2_cpu() && __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("bmi2");
  }();
  return cpu && loom::detail::x86::vector_kernels_allowed().load(std::memory_order_relaxed);
}

//! For each byte value, the positions of its set bits in increasing order, one per byte (unused
//! bytes 0).
struct byte_positions {
  std::uint64_t of[256] = {};
  constexpr byte_positions() {
    for (unsigned v = 0; v < 256; ++v) {
      unsigned n = 0;
      for (unsigned bit = 0; bit < 8; ++bit)
        if ((v >> bit) & 1u) of[v] |= std::uint64_t{bit} << (8 * n++);
    }
  }
};
inline constexpr byte_positions positions{};

//! Interleaved accumulator sets for V vectors per row: enough independent FMA chains to cover the
//! FMA latency, no more registers than AVX2 has.
template <int V>
inline constexpr int list_sets = V <= 2   ? 4
                                 : V <= 4 ? 2
                                          : 1;

//! acc[0, V) += x * B row bk (8 V columns); with Tail the last vector loads only the lanes of `tail`.
template <int V, bool Tail>
LOOM_SPARSE_AVX2_TARGET inline void row_update(__m256 (&acc)[V], __m256 x, const float* bk, __m256i tail) {
  for (int v = 0; v + 1 < V; ++v) acc[v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(bk + 8 * v), acc[v]);
  const __m256 last = Tail ? _mm256_maskload_ps(bk + 8 * (V - 1), tail) : _mm256_loadu_ps(bk + 8 * (V - 1));
  acc[V - 1] = _mm256_fmadd_ps(x, last, acc[V - 1]);
}

//! out[0, 8 V) += sum over e < count of val[e] * B(col[e], 0, 8 V), B rows ldb apart from b. With
//! Tail the last vector loads only its first nb % 8 columns.
template <int V, bool Tail, class T>
LOOM_SPARSE_AVX2_TARGET inline void list_product(float* out, const std::int32_t* col, const T* val, index_t count,
                                                 const float* b, index_t ldb, index_t nb) {
  constexpr int S = list_sets<V>;
  const __m256i tail =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nb % 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 s[S][V];
  for (int i = 0; i < S; ++i)
    for (int v = 0; v < V; ++v) s[i][v] = _mm256_setzero_ps();
  index_t e = 0;
  for (; e + S <= count; e += S)
    for (int i = 0; i < S; ++i)
      row_update<V, Tail>(s[i], _mm256_set1_ps(static_cast<float>(val[e + i])),
                          b + static_cast<index_t>(col[e + i]) * ldb, tail);
  for (int i = 0; e < count; ++e, ++i)
    row_update<V, Tail>(s[i], _mm256_set1_ps(static_cast<float>(val[e])), b + static_cast<index_t>(col[e]) * ldb, tail);
  for (int v = 0; v < V; ++v) {
    __m256 t = s[0][v];
    for (int i = 1; i < S; ++i) t = _mm256_add_ps(t, s[i][v]);
    _mm256_storeu_ps(out + 8 * v, _mm256_add_ps(_mm256_loadu_ps(out + 8 * v), t));
  }
}

//! acc[0, V) += x * B row bk (16 V columns, the last vector masked to `tail`).
template <int V>
LOOM_X86_AVX512 inline void row_update16(__m512 (&acc)[V], __m512 x, const float* bk, __mmask16 tail) {
  for (int v = 0; v + 1 < V; ++v) acc[v] = _mm512_fmadd_ps(x, _mm512_loadu_ps(bk + 16 * v), acc[v]);
  acc[V - 1] = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(tail, bk + 16 * (V - 1)), acc[V - 1]);
}

//! The 16-lane form of list_product (CPUs with AVX-512): ceil(nb / 16) vectors per B row, the last
//! masked to the columns left, in interleaved sets so that 8 or more FMA chains are in flight. With
//! Prefetch > 0, the B row of entry e + Prefetch is prefetched while entry e is multiplied.
template <int V, int Prefetch, class T>
LOOM_X86_AVX512 void list_product16(float* out, const std::int32_t* col, const T* val, index_t count, const float* b,
                                    index_t ldb, index_t nb) {
  constexpr int S = V == 1 ? 8 : V == 2 ? 4 : V == 3 ? 3 : 2;
  const __mmask16 tail = loom::detail::x86::first_lanes(static_cast<unsigned>(nb - 16 * (V - 1)));
  __m512 s[S][V];
  for (int i = 0; i < S; ++i)
    for (int v = 0; v < V; ++v) s[i][v] = _mm512_setzero_ps();
  index_t e = 0;
  if constexpr (Prefetch > 0)
    for (; e + S + Prefetch <= count; e += S)
      for (int i = 0; i < S; ++i) {
        const float* ahead = b + static_cast<index_t>(col[e + i + Prefetch]) * ldb;
        for (int v = 0; v < V; ++v) _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * v), _MM_HINT_T0);
        row_update16<V>(s[i], _mm512_set1_ps(static_cast<float>(val[e + i])),
                        b + static_cast<index_t>(col[e + i]) * ldb, tail);
      }
  for (; e + S <= count; e += S)
    for (int i = 0; i < S; ++i)
      row_update16<V>(s[i], _mm512_set1_ps(static_cast<float>(val[e + i])), b + static_cast<index_t>(col[e + i]) * ldb,
                      tail);
  for (int i = 0; e < count; ++e, ++i)
    row_update16<V>(s[i], _mm512_set1_ps(static_cast<float>(val[e])), b + static_cast<index_t>(col[e]) * ldb, tail);
  for (int v = 0; v < V; ++v) {
    __m512 t = s[0][v];
    for (int i = 1; i < S; ++i) t = _mm512_add_ps(t, s[i][v]);
    const __mmask16 m = v + 1 < V ? __mmask16(0xffff) : tail;
    _mm512_mask_storeu_ps(out + 16 * v, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, out + 16 * v), t));
  }
}

//! sum over e < count of val[e] * x[col[e]] (N == 1): 8 lanes at a time through a gather, the
//! remainder one by one, added in a fixed order.
template <class T>
LOOM_SPARSE_AVX2_TARGET inline float list_dot(const std::int32_t* col, const T* val, index_t count, const float* x) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  index_t e = 0;
  for (; e + 16 <= count; e += 16) {
    const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + e));
    const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + e + 8));
    s0 = _mm256_fmadd_ps(loom::detail::x86::load8(val + e), _mm256_i32gather_ps(x, c0, 4), s0);
    s1 = _mm256_fmadd_ps(loom::detail::x86::load8(val + e + 8), _mm256_i32gather_ps(x, c1, 4), s1);
  }
  if (e + 8 <= count) {
    const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + e));
    s0 = _mm256_fmadd_ps(loom::detail::x86::load8(val + e), _mm256_i32gather_ps(x, c0, 4), s0);
    e += 8;
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, _mm256_add_ps(s0, s1));
  float r = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  for (; e < count; ++e) r += static_cast<float>(val[e]) * x[col[e]];
  return r;
}

//! Calls f(V, Tail) for the vector count and tail of nb columns (1 <= nb <= 64).
template <class F>
inline void dispatch_vectors(index_t nb, F&& f) {
  with_constant<8, 1, 2, 3, 4, 5, 6, 7>((nb + 7) / 8, [&](auto v) {
    if (nb % 8 != 0)
      f(v, std::true_type{});
    else
      f(v, std::false_type{});
  });
}

//! Output rows of a work item (rows <= csr_group_bands * tile_rows):
//! acc[r * acc_ld + [0, nb)] = (A B)(row i0 + r, j0 + [0, nb)) for N >= 2,
//! acc[r * acc_ld] = A(row i0 + r, :) . x for N == 1. The rows go through A's columns `block` at a
//! time (csr_block), so the B rows of one block stay in cache for every row of the item; each
//! row's entries in a block are found by a forward scan (8 entries a step) from where the previous
//! block ended.
template <class T, class Space>
LOOM_SPARSE_AVX2_TARGET void csr_band(const csr_view<T, Space>& a, index_t i0, index_t rows, const float* b,
                                      index_t ldb, index_t j0, index_t nb, index_t n, float* acc, index_t acc_ld,
                                      index_t block, list_form form = list_form::lanes8) {
  if (n == 1) {
    for (index_t r = 0; r < rows; ++r) {
      const index_t e0 = a.row_ptr[i0 + r];
      acc[r * acc_ld] = list_dot(a.col_idx + e0, a.values + e0, a.row_ptr[i0 + r + 1] - e0, b);
    }
    return;
  }
  const index_t width = (nb + 7) / 8 * 8;
  for (index_t r = 0; r < rows; ++r)
    for (index_t j = 0; j < width; ++j) acc[r * acc_ld + j] = 0.0f;
  index_t cur[csr_group_bands * tile_rows];
  for (index_t r = 0; r < rows; ++r) cur[r] = a.row_ptr[i0 + r];
  for (index_t c1 = block; c1 - block < a.cols; c1 += block) {
    for (index_t r = 0; r < rows; ++r) {
      const index_t hi = a.row_ptr[i0 + r + 1];
      index_t lo = cur[r];
      if (c1 < a.cols) {  // the first entry at column >= c1: 8 entries a step while the 8th is below
        while (lo + 8 <= hi && a.col_idx[lo + 7] < c1) lo += 8;
        while (lo < hi && a.col_idx[lo] < c1) ++lo;
      } else {
        lo = hi;
      }
      const auto sixteen = [&](auto prefetch) {
        with_constant<4, 3>((nb + 15) / 16, [&](auto v) {
          list_product16<decltype(v)::value, decltype(prefetch)::value>(
              acc + r * acc_ld, a.col_idx + cur[r], a.values + cur[r], lo - cur[r], b + j0, ldb, nb);
        });
      };
      if (form == list_form::lanes16)
        sixteen(std::integral_constant<int, 0>{});
      else if (form == list_form::lanes16_prefetch)
        sixteen(std::integral_constant<int, csr_prefetch>{});
      else
        dispatch_vectors(nb, [&](auto v, auto tl) {
          list_product<decltype(v)::value, decltype(tl)::value>(acc + r * acc_ld, a.col_idx + cur[r], a.values + cur[r],
                                                                lo - cur[r], b + j0, ldb, nb);
        });
      cur[r] = lo;
    }
  }
}

//! Tiles decoded into row lists at a time (512 columns: 32 KiB of lists for 8 dense rows).
inline constexpr index_t list_tiles = 8;

//! One band of the tiled bitmap: acc[r * acc_ld + [0, nb)] = (A B)(band row r, j0 + [0, nb)) for
//! N >= 2, acc[r * acc_ld] = A(band row r, :) . x for N == 1.
template <class T, class Space>
LOOM_SPARSE_AVX2_TARGET void bitmap_band(const bitmap_view<T, Space>& a, index_t band, const float* b, index_t ldb,
                                         index_t j0, index_t nb, index_t n, float* acc, index_t acc_ld) {
  constexpr index_t cap = list_tiles * tile_cols + 8;  // + 8: the decode writes 8 lanes past a list's end
  alignas(32) std::int32_t col[tile_rows][cap];
  alignas(32) float val[tile_rows][cap];
  const index_t width = (nb + 7) / 8 * 8;
  for (index_t r = 0; r < tile_rows; ++r)
    for (index_t j = 0; j < width; ++j) acc[r * acc_ld + j] = 0.0f;
  const index_t gc = a.grid_cols();
  const T* end = a.values + a.tile_offsets[a.tiles()];
  for (index_t tc0 = 0; tc0 < gc; tc0 += list_tiles) {
    index_t count[tile_rows] = {};
    const index_t tc1 = tc0 + list_tiles < gc ? tc0 + list_tiles : gc;
    for (index_t tc = tc0; tc < tc1; ++tc) {
      const index_t t = band * gc + tc;
      const T* p = a.values + a.tile_offsets[t];
      if (a.tile_offsets[t + 1] == a.tile_offsets[t]) continue;  // empty tile
      const auto c0 = static_cast<std::int32_t>(tc * tile_cols);
      for (index_t r = 0; r < tile_rows; ++r) {
        const std::uint64_t m = a.masks[t * tile_rows + r];
        const auto cnt = static_cast<index_t>(_mm_popcnt_u64(m));
        std::int32_t* c = col[r] + count[r];
        index_t at = 0;
        for (int byte = 0; byte < 8; ++byte) {  // 8 column numbers per byte, advanced by its count
          const unsigned bits = static_cast<unsigned>(m >> (8 * byte)) & 0xffu;
          const __m256i pos = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(positions.of[bits])));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + at),
                              _mm256_add_epi32(pos, _mm256_set1_epi32(c0 + 8 * byte)));
          at += _mm_popcnt_u32(bits);
        }
        float* v = val[r] + count[r];
        if (end - p >= cnt + 8) {
          for (index_t q = 0; q < cnt; q += 8) _mm256_storeu_ps(v + q, loom::detail::x86::load8(p + q));
        } else {  // the last values of the array: no load past its end
          for (index_t q = 0; q < cnt; ++q) v[q] = static_cast<float>(p[q]);
        }
        p += cnt;
        count[r] += cnt;
      }
    }
    for (index_t r = 0; r < tile_rows; ++r) {
      if (n == 1) {
        acc[r * acc_ld] += list_dot(col[r], val[r], count[r], b);
      } else {
        dispatch_vectors(nb, [&](auto v, auto tl) {
          list_product<decltype(v)::value, decltype(tl)::value>(acc + r * acc_ld, col[r], val[r], count[r], b + j0, ldb,
                                                                nb);
        });
      }
    }
  }
}

}  // namespace loom::sparse::detail::x86

#undef LOOM_SPARSE_AVX2_TARGET
#endif
