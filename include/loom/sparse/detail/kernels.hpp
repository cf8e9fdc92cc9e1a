#pragma once

//! @file
//! The CPU (and generic-backend) SpMM kernels: one LOOM_HD functor per format, run by
//! loom::for_each_index over work items = (band of tile_rows output rows; spmm_common::bands of
//! them for a host CSR product with a wide B panel) x (chunk of up to n_block output columns).
//! A work item keeps its tile_rows x n_block accumulators in L1, decodes one tile of A at a time
//! into a (column, value) list in L1, then runs a micro-kernel whose inner loops are unit-stride
//! over a row-major B panel (vectorised by the compiler, no intrinsics).
//! For N == 1 the bitmap kernel takes one FMA per decoded nonzero with B's element, into
//! rotating partial sums.
//! Hook: called with the storage index of every stored value the kernel reads (coverage tests);
//! no_hook compiles away.

#include <loom/backend/parallel.hpp>
#include <loom/sparse/detail/kernels_avx2.hpp>
#include <loom/sparse/detail/kernels_x86.hpp>
#include <loom/sparse/formats.hpp>

#include <type_traits>

namespace loom::sparse::detail {

inline constexpr index_t n_block = 64;  //!< output columns per work item
inline constexpr int dot_lanes = 4;     //!< independent partial sums per row for N == 1

struct no_hook {
  LOOM_HD void operator()(index_t) const noexcept {}
};

//! A stored value in the accumulation type (16-bit types go through float, exactly).
template <class Acc, class T>
LOOM_HD constexpr Acc to_acc(const T& v) noexcept {
  if constexpr (std::is_arithmetic_v<T>)
    return static_cast<Acc>(v);
  else
    return static_cast<Acc>(static_cast<float>(v));
}

LOOM_HD constexpr index_t min_index(index_t a, index_t b) noexcept { return a < b ? a : b; }

//! C(i, j) = alpha * acc + beta * C(i, j) + bias[i]; C is not read when beta == 0.
template <class TC, class Acc>
struct epilogue {
  TC* c = nullptr;
  index_t ldr = 0, ldc = 0;  //!< strides of C's rows and columns
  Acc alpha = 1, beta = 0;
  const TC* bias = nullptr;  //!< M values, or null
  index_t rows = 0;
  LOOM_HD void store(index_t i, index_t j0, index_t nb, const Acc* acc) const {
    const Acc add = bias ? to_acc<Acc>(bias[i]) : Acc(0);
    TC* out = c + i * ldr + j0 * ldc;
    for (index_t j = 0; j < nb; ++j) {
      Acc x = alpha * acc[j] + add;
      if (beta != Acc(0)) x += beta * to_acc<Acc>(out[j * ldc]);
      out[j * ldc] = static_cast<TC>(x);
    }
  }
};

//! acc[0, nb) += v * b[0, nb): the micro-kernel row update. NB > 0 fixes the width at compile time.
template <int NB, class Acc>
LOOM_HD inline void axpy(Acc* __restrict__ acc, Acc v, const Acc* __restrict__ b, index_t nb) {
  if constexpr (NB > 0) {
    for (int j = 0; j < NB; ++j) acc[j] += v * b[j];
  } else {
    for (index_t j = 0; j < nb; ++j) acc[j] += v * b[j];
  }
}

//! The list micro-kernel: for each row r of the band, acc[r] += sum over its entries
//! [end[r-1], end[r]) of val[e] * row[e][0, nb), row[e] a row of the B panel. With NB fixed the
//! row's sums live in registers, split in two interleaved partial sums (even and odd entries) so
//! that consecutive FMAs do not wait on each other; the order is fixed, so results are the same
//! bits on every backend.
template <int NB, class Acc>
LOOM_HD inline void list_kernel(Acc* acc, const int* end, const Acc* const* row, const Acc* val, index_t nb) {
  int e = 0;
  for (index_t r = 0; r < tile_rows; ++r) {
    Acc* out = acc + r * n_block;
    if constexpr (NB > 0) {
      Acc s0[NB], s1[NB];
      for (int j = 0; j < NB; ++j) s0[j] = s1[j] = Acc(0);
      for (; e + 1 < end[r]; e += 2) {
        axpy<NB>(s0, val[e], row[e], nb);
        axpy<NB>(s1, val[e + 1], row[e + 1], nb);
      }
      if (e < end[r]) axpy<NB>(s0, val[e], row[e], nb), ++e;
      for (int j = 0; j < NB; ++j) out[j] += s0[j] + s1[j];
    } else {
      for (; e < end[r]; ++e) axpy<NB>(out, val[e], row[e], nb);
    }
  }
}

//! f(width) with width the compile-time form of nb for the unrolled widths 64, 32, 16, 8 (0: any).
template <class F>
LOOM_HD inline void dispatch_width(index_t nb, F&& f) {
  with_constant<0, 64, 32, 16, 8>(nb, f);
}

//! Work items and the packed B shared by every format's kernel.
template <class TC, class Acc>
struct spmm_common {
  const Acc* b = nullptr;  //!< K x N, row-major, leading dimension ldb
  index_t ldb = 0, n = 0, n_chunks = 0;
  index_t bands = 1;  //!< bands of tile_rows rows per work item (csr: csr_group_bands when csr_grouped)
  epilogue<TC, Acc> out;

  //! A work item: a band of tile_rows rows of A and its output columns [j0, j0 + nb).
  struct item {
    index_t band, j0, nb;
  };
  //! Work item w: band w / n_chunks, output columns from (w % n_chunks) n_block.
  LOOM_HD item item_of(index_t w) const {
    const index_t j0 = (w % n_chunks) * n_block;
    return {w / n_chunks, j0, min_index(n_block, n - j0)};
  }
};

template <class TA, class Space, class TC, class Acc, class Hook>
struct bitmap_kernel {
  bitmap_view<TA, Space> a;
  spmm_common<TC, Acc> k;
  Hook hook;

  LOOM_HD void operator()(index_t w) const {
    const auto it = k.item_of(w);
    const index_t band = it.band, j0 = it.j0, nb = it.nb;  // plain locals: lambdas capture them
    Acc acc[tile_rows * n_block];
#if defined(LOOM_SPARSE_X86_KERNELS) && !LOOM_IN_DEVICE_CODE
    if constexpr (x86::vector_weights<TA> && std::is_same_v<Acc, float> && std::is_same_v<Hook, no_hook>) {
      if (x86::avx512_available()) {
        if (k.n == 1) {
          float dots[tile_rows];
          x86::band_dot(a, band, k.b, dots);
          for (index_t r = 0; r < tile_rows; ++r) acc[r * n_block] = dots[r];
        } else if (x86::sparse_band(a, band) && x86::avx2_available()) {  // row lists: no FMA per zero
          x86::bitmap_band(a, band, k.b, k.ldb, j0, nb, k.n, acc, n_block);
        } else {
          x86::band_panel(a, band, k.b, k.ldb, j0, nb, acc, n_block);
        }
        store(band, j0, nb, acc);
        return;
      }
      if (x86::avx2_available()) {
        x86::bitmap_band(a, band, k.b, k.ldb, j0, nb, k.n, acc, n_block);
        store(band, j0, nb, acc);
        return;
      }
    }
#endif
    for (index_t i = 0; i < tile_rows * n_block; ++i) acc[i] = Acc(0);
    if (k.n == 1)
      dot_band(band, acc);
    else
      list_band(band, j0, nb, acc);
    store(band, j0, nb, acc);
  }

  LOOM_HD void store(index_t band, index_t j0, index_t nb, const Acc* acc) const {
    for (index_t r = 0; r < tile_rows && band * tile_rows + r < a.rows; ++r)
      k.out.store(band * tile_rows + r, j0, nb, acc + r * n_block);
  }

  //! Decode each tile into a (column, value) list, then the unit-stride micro-kernel over nb.
  LOOM_HD void list_band(index_t band, index_t j0, index_t nb, Acc* acc) const {
    const Acc* row[tile_rows * tile_cols];  // the B panel row of each decoded entry
    Acc val[tile_rows * tile_cols];
    int end[tile_rows];
    const index_t gc = a.grid_cols();
    for (index_t tc = 0; tc < gc; ++tc) {
      const index_t t = band * gc + tc;
      index_t p = a.tile_offsets[t];
      if (a.tile_offsets[t + 1] == p) continue;  // empty tile
      const Acc* bt = k.b + tc * tile_cols * k.ldb + j0;
      int e = 0;
      for (index_t r = 0; r < tile_rows; ++r) {
        const int start = e;
        decode_row(a.masks[t * tile_rows + r], a.values + p, [&](int j, const TA& v) {
          hook(p + (e - start));
          row[e] = bt + j * k.ldb;
          val[e++] = to_acc<Acc>(v);
        });
        p += e - start;
        end[r] = e;
      }
      dispatch_width(nb, [&](auto width) { list_kernel<decltype(width)::value>(acc, end, row, val, nb); });
    }
  }

  //! N == 1 (decoding): B is a unit-stride vector; each decoded nonzero is one FMA with the B
  //! element of its column, into dot_lanes partial sums per row taken in rotation (no FMA waits on
  //! the previous one). Summed in a fixed order at the end.
  LOOM_HD void dot_band(index_t band, Acc* acc) const {
    Acc lanes[tile_rows][dot_lanes];
    for (index_t r = 0; r < tile_rows; ++r)
      for (int l = 0; l < dot_lanes; ++l) lanes[r][l] = Acc(0);
    const index_t gc = a.grid_cols();
    for (index_t tc = 0; tc < gc; ++tc) {
      const index_t t = band * gc + tc;
      index_t p = a.tile_offsets[t];
      if (a.tile_offsets[t + 1] == p) continue;
      const Acc* bt = k.b + tc * tile_cols;
      for (index_t r = 0; r < tile_rows; ++r) {
        Acc* lr = lanes[r];
        int q = 0;
        const index_t p0 = p;
        p += decode_row(a.masks[t * tile_rows + r], a.values + p, [&](int j, const TA& v) {
          hook(p0 + q);
          lr[q++ % dot_lanes] += to_acc<Acc>(v) * bt[j];
        });
      }
    }
    for (index_t r = 0; r < tile_rows; ++r) {
      Acc s = Acc(0);
      for (int l = 0; l < dot_lanes; ++l) s += lanes[r][l];
      acc[r * n_block] = s;
    }
  }
};

template <class TA, class Space, class TC, class Acc, class Hook>
struct csr_kernel {
  csr_view<TA, Space> a;
  spmm_common<TC, Acc> k;
  Hook hook;

  LOOM_HD void operator()(index_t w) const {
    const auto it = k.item_of(w);
    const index_t j0 = it.j0, nb = it.nb;  // plain locals: lambdas capture them
    const index_t i0 = it.band * k.bands * tile_rows, i1 = min_index(i0 + k.bands * tile_rows, a.rows);
    Acc acc[n_block];
#if defined(LOOM_SPARSE_X86_KERNELS) && !LOOM_IN_DEVICE_CODE
    if constexpr (x86::vector_weights<TA> && std::is_same_v<Acc, float> && std::is_same_v<Hook, no_hook>) {
      if (x86::avx2_available()) {
        Acc item_acc[csr_group_bands * tile_rows * n_block];
        x86::csr_band(a, i0, i1 - i0, k.b, k.ldb, j0, nb, k.n, item_acc, n_block, csr_block(a.cols, nb),
                      csr_list_form(a.cols, nb, loom::detail::x86::avx512_available()));
        for (index_t r = 0; r < i1 - i0; ++r) k.out.store(i0 + r, j0, nb, item_acc + r * n_block);
        return;
      }
    }
#endif
    for (index_t i = i0; i < i1; ++i) {
      for (index_t j = 0; j < nb; ++j) acc[j] = Acc(0);
      dispatch_width(nb, [&](auto width) {
        for (index_t e = a.row_ptr[i]; e < a.row_ptr[i + 1]; ++e) {
          hook(e);
          axpy<decltype(width)::value>(acc, to_acc<Acc>(a.values[e]), k.b + index_t{a.col_idx[e]} * k.ldb + j0, nb);
        }
      });
      k.out.store(i, j0, nb, acc);
    }
  }
};

template <int N, int M, class TA, class Space, class TC, class Acc, class Hook>
struct n_m_kernel {
  n_m_view<N, M, TA, Space> a;
  spmm_common<TC, Acc> k;
  Hook hook;

  LOOM_HD void operator()(index_t w) const {
    const auto it = k.item_of(w);
    const index_t band = it.band, j0 = it.j0, nb = it.nb;  // plain locals: lambdas capture them
    const index_t groups = a.groups();
    Acc acc[n_block];
    for (index_t i = band * tile_rows; i < min_index((band + 1) * tile_rows, a.rows); ++i) {
      for (index_t j = 0; j < nb; ++j) acc[j] = Acc(0);
      dispatch_width(nb, [&](auto width) {
        for (index_t g = 0; g < groups; ++g) {
          for (index_t s = (i * groups + g) * N, e = s + N; s < e; ++s) {
            const index_t col = g * M + a.indices[s];
            if (col >= a.cols) continue;  // a zero slot of the narrow last group
            hook(s);
            axpy<decltype(width)::value>(acc, to_acc<Acc>(a.values[s]), k.b + col * k.ldb + j0, nb);
          }
        }
      });
      k.out.store(i, j0, nb, acc);
    }
  }
};

//! The bitmap product as a team body (loom::for_each_team): league rank w is the work item of
//! bitmap_kernel (band w / n_chunks, output columns from (w % n_chunks) n_block). The team's
//! scratch holds the band's dense 8 x 64 tile and its 8 x n_block results. For each nonempty tile,
//! member q expands bits q, q + size, ... of every tile row (packed_position: the lane form of the
//! decode), a barrier, then accumulates its output columns q, q + size, ... over the dense tile
//! against the row-major B panel (a team of 64 on cuda: one column per thread, coalesced), a
//! barrier before the next tile. The rows are stored by the epilogue of bitmap_kernel. Each output
//! sums its products in tile-column order, whatever the team size.
template <class TA, class Space, class TC, class Acc>
struct bitmap_team_kernel {
  bitmap_view<TA, Space> a;
  spmm_common<TC, Acc> k;

  static constexpr std::size_t scratch_bytes = sizeof(Acc) * tile_rows * (tile_cols + n_block);

  template <class M>
  LOOM_HD void operator()(const M& m) const {
    Acc* dense = static_cast<Acc*>(m.scratch());  // [tile_rows][tile_cols]
    Acc* result = dense + tile_rows * tile_cols;  // [tile_rows][n_block]
    const auto it = k.item_of(m.league_rank());
    const index_t band = it.band, j0 = it.j0, nb = it.nb;  // plain locals: lambdas capture them
    const int q = m.team_rank(), size = m.team_size();
    for (index_t i = q; i < tile_rows * n_block; i += size) result[i] = Acc(0);
    m.barrier();  // members zero other members' columns
    const index_t gc = a.grid_cols();
    for (index_t tc = 0; tc < gc; ++tc) {
      const index_t t = band * gc + tc;
      index_t p = a.tile_offsets[t];
      if (a.tile_offsets[t + 1] == p) continue;  // empty tile: the same for every member
      for (index_t r = 0; r < tile_rows; ++r) {
        const std::uint64_t mask = a.masks[t * tile_rows + r];
        for (int lane = q; lane < static_cast<int>(tile_cols); lane += size)
          dense[r * tile_cols + lane] =
              ((mask >> lane) & 1u) ? to_acc<Acc>(a.values[p + packed_position(mask, lane)]) : Acc(0);
        p += popcount64(mask);
      }
      m.barrier();
      const index_t width = min_index(tile_cols, a.cols - tc * tile_cols);
      for (index_t j = q; j < nb; j += size) {
        const Acc* bt = k.b + tc * tile_cols * k.ldb + j0 + j;
        Acc acc[tile_rows];
        for (index_t r = 0; r < tile_rows; ++r) acc[r] = result[r * n_block + j];
        for (index_t c = 0; c < width; ++c) {
          const Acc x = bt[c * k.ldb];
          for (index_t r = 0; r < tile_rows; ++r) acc[r] += dense[r * tile_cols + c] * x;
        }
        for (index_t r = 0; r < tile_rows; ++r) result[r * n_block + j] = acc[r];
      }
      m.barrier();
    }
    for (index_t r = q; r < tile_rows; r += size)
      if (band * tile_rows + r < a.rows) k.out.store(band * tile_rows + r, j0, nb, result + r * n_block);
  }
};

//! Runs a bitmap product's work items as teams of `team_size` members of bitmap_team_kernel.
template <class Backend, class TA, class Space, class TC, class Acc, class Hook>
void run_bitmap_teams(const Backend& b, const bitmap_kernel<TA, Space, TC, Acc, Hook>& kernel, index_t items,
                      int team_size) {
  using T = bitmap_team_kernel<TA, Space, TC, Acc>;
  for_each_team(b, {items, team_size, T::scratch_bytes}, T{kernel.a, kernel.k});
}

//! Packs B (any strides, any storage type) into a row-major K x N panel of Acc.
template <class BV, class Acc>
struct pack_b {
  BV b;
  Acc* out;
  index_t n;
  LOOM_HD void operator()(index_t i) const { out[i] = to_acc<Acc>(b(i / n, i % n)); }
};

}  // namespace loom::sparse::detail
