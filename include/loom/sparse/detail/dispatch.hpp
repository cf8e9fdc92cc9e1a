#pragma once

//! @file
//! Argument checks and backend dispatch of loom::sparse::spmm. The generic path runs the
//! kernels of kernels.hpp through loom::for_each_index; spmm_cuda.cuh specialises the bitmap
//! format for loom::cuda with a block-per-band kernel that decodes tiles into shared memory.

#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/checked.hpp>
#include <loom/core/overlap.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/sparse/detail/kernels.hpp>

#include <string_view>
#include <type_traits>

namespace loom::sparse::detail {

template <class A>
auto as_view(const A& a) {
  if constexpr (requires { a.view(); })
    return a.view();
  else
    return a;
}

template <class V>
struct format_of;  // which kernel serves a view type
template <class T, class S>
struct format_of<csr_view<T, S>> {
  template <class TC, class Acc, class Hook>
  using kernel = csr_kernel<T, S, TC, Acc, Hook>;
};
template <class T, class S>
struct format_of<bitmap_view<T, S>> {
  template <class TC, class Acc, class Hook>
  using kernel = bitmap_kernel<T, S, TC, Acc, Hook>;
};
template <int N, int M, class T, class S>
struct format_of<n_m_view<N, M, T, S>> {
  template <class TC, class Acc, class Hook>
  using kernel = n_m_kernel<N, M, T, S, TC, Acc, Hook>;
};

//! Runs kernel K over every work item on backend B. Specialised for the cuda bitmap kernel.
template <class Backend, class AV>
struct spmm_runner {
  template <class K>
  static void run(const Backend& b, const K& kernel, index_t items) {
    for_each_index(b, items, kernel);
  }
};

//! Values a host view stores (for the work estimate of a call).
template <class AV>
double stored_values(const AV& a) {
  if constexpr (requires { a.nnz(); })
    return static_cast<double>(a.nnz());
  else if constexpr (requires { a.tile_offsets; })
    return a.tiles() > 0 ? static_cast<double>(a.tile_offsets[a.tiles()]) : 0.0;
  else
    return static_cast<double>(a.rows) * static_cast<double>(a.groups()) * AV::n;
}

//! Rows and columns of a view: a row-major or column-major 2-D layout (unit stride on one side).
template <class V>
void check_layout(const V& v, std::string_view name) {
  const bool row_major = v.stride(1) == 1 || v.extent(1) <= 1;
  const bool col_major = v.stride(0) == 1 || v.extent(0) <= 1;
  LOOM_EXPECTS(row_major || col_major, errc::invalid_argument, "spmm: ", name,
               " must be row-major (stride(1) == 1) or column-major (stride(0) == 1), got strides ", v.stride(0), ", ",
               v.stride(1));
}

template <class AV>
index_t rows_of(const AV& a) {
  return a.rows;
}

//! The counts a kernel forms from A's extents must fit index_t (views are built unchecked).
template <class AV>
void check_sizes(const AV& a) {
  if constexpr (requires { AV::n; }) {  // n_m: slot (r * groups + g) * N
    (void)loom::detail::checked_mul(loom::detail::checked_mul(a.rows, a.groups(), "spmm: A.rows * A.groups()"),
                                    index_t{AV::n}, "spmm: A.rows * A.groups() * N");
  } else if constexpr (requires { a.tiles(); }) {  // bitmap: mask word t * tile_rows + r
    (void)loom::detail::checked_mul(
        loom::detail::checked_mul(a.grid_rows(), a.grid_cols(), "spmm: A's tiles (ceil(rows / 8) * ceil(cols / 64))"),
        tile_rows, "spmm: A's mask words (tiles * 8)");
  } else {  // csr: row_ptr[rows]
    (void)loom::detail::checked_add(a.rows, index_t{1}, "spmm: A.rows + 1");
  }
}

//! The accumulation type spmm deduces from the element types: double if any operand is double,
//! else float.
template <class TA, class TB, class TC>
using deduced_accum =
    std::conditional_t<std::is_same_v<TA, double> || std::is_same_v<TB, double> || std::is_same_v<TC, double>, double,
                       float>;

//! What a plan derives from A's extents and N: the sizes a kernel forms (checked for overflow).
struct geometry {
  index_t m = 0, k = 0, n = 0, panel = 0, items = 0;  //!< items: one band of tile_rows rows each
};

template <class AV>
geometry plan_geometry(const AV& a, index_t n) {
  const index_t m = a.rows, k = a.cols;
  LOOM_EXPECTS(m >= 0 && k >= 0, errc::invalid_argument, "spmm: A's extents must be >= 0, got ", m, " x ", k);
  LOOM_EXPECTS(n >= 0, errc::invalid_argument, "spmm: B's column count must be >= 0, got ", n);
  check_sizes(a);
  geometry g{m, k, n, 0, 0};
  g.panel = loom::detail::checked_mul(k, n, "spmm: A.cols * B.cols (the packed B panel)");
  g.items = loom::detail::checked_mul(loom::detail::ceil_div(m, tile_rows), loom::detail::ceil_div(n, n_block),
                                      "spmm: work items (A.rows / 8 * B.cols / 64)");
  return g;
}

//! Bands of tile_rows rows per work item of a product of A (its view type AV) with a B of n columns:
//! csr_group_bands for a CSR A in host memory when csr_grouped(K, min(n, n_block)), else 1. From
//! the format and the shape only (a plan holds extents, not the format).
template <class AV>
index_t bands_per_item(index_t k, index_t n) {
  if constexpr (requires(const AV& a) { a.row_ptr; } && AV::space::host_accessible)
    return csr_grouped(k, min_index(n, n_block)) ? csr_group_bands : 1;
  else
    return 1;
}

//! The per-call checks of B, C and the bias against the plan's geometry (allocate nothing unless
//! they throw).
template <class AV, class BV, class CV, class Bias>
void check_call(const geometry& g, const AV& a, const BV& bm, const CV& c, const Bias* bias) {
  LOOM_EXPECTS(a.rows == g.m && a.cols == g.k, errc::shape_mismatch, "spmm: A must be ", g.m, " x ", g.k,
               " (the plan's), got ", a.rows, " x ", a.cols);
  expect_extents(bm, {g.k, g.n}, "spmm", "B", "A.cols x the plan's N");
  expect_extents(c, {g.m, g.n}, "spmm", "C", "A.rows x the plan's N");
  check_layout(bm, "B");
  check_layout(c, "C");
  if (bias) {
    expect_extents(*bias, {g.m}, "spmm", "bias", "A.rows values");
    LOOM_EXPECTS(bias->stride(0) == 1 || g.m <= 1, errc::invalid_argument, "spmm: bias must be contiguous");
    LOOM_EXPECTS(!overlaps(*bias, c), errc::invalid_argument,
                 "spmm: bias and C share memory; bias must not overlap C (it is read while C is written)");
  }
}

//! Runs the product with accumulation type Acc; `panel` holds g.panel values of Acc in the
//! backend's memory (the packed copy of B, used unless B already is such a panel). No allocation,
//! no fence: stream-ordered on device backends.
template <class Acc, class Backend, class AV, class BV, class CV, class Bias, class Hook>
void spmm_run(const Backend& b, const geometry& g, const AV& a, const BV& bm, const CV& c, double alpha, double beta,
              const Bias* bias, const Hook& hook, Acc* panel) {
  using space = typename backend_traits<Backend>::memory_space;
  static_assert(BV::rank == 2 && CV::rank == 2, "spmm: B and C must be rank-2 views");
  static_assert(std::is_same_v<typename AV::space, space> || (AV::space::host_accessible && space::host_accessible),
                "spmm: A must live in the backend's memory space");
  static_assert(std::is_same_v<typename BV::space, space> || (BV::space::host_accessible && space::host_accessible),
                "spmm: B must live in the backend's memory space");
  static_assert(std::is_same_v<typename CV::space, space> || (CV::space::host_accessible && space::host_accessible),
                "spmm: C must live in the backend's memory space");
  using TB = typename BV::value_type;
  using TC = typename CV::value_type;
  static_assert(!std::is_const_v<typename CV::element_type>, "spmm: C must be writable");
  check_call(g, a, bm, c, bias);
  const index_t m = g.m, k = g.k, n = g.n;
  if (m == 0 || n == 0) return;
  // A product under two grains of work (loom::parallel_grain_bytes) runs on the calling thread of a
  // host backend: its stored values and indices, B, C, and a multiply-add per stored value and
  // column counted as a byte. The work items, and so the bits, are the same.
  const Backend eb = [&] {
    if constexpr (space::host_accessible) {
      const double stored = stored_values(a), rows_cols = static_cast<double>(m) * static_cast<double>(n);
      const double work = stored * static_cast<double>(sizeof(typename AV::value_type) + 4) +
                          static_cast<double>(k) * static_cast<double>(n) * sizeof(TB) + rows_cols * sizeof(TC) +
                          stored * static_cast<double>(n);
      return loom::detail::for_work(b, work);
    } else {
      return b;
    }
  }();

  spmm_common<TC, Acc> common;
  common.n = n;
  common.n_chunks = loom::detail::ceil_div(n, n_block);
  common.bands = bands_per_item<AV>(k, n);
  common.out = {c.data(),
                c.stride(0),
                c.stride(1),
                static_cast<Acc>(alpha),
                static_cast<Acc>(beta),
                bias ? bias->data() : nullptr,
                m};
  using K = typename format_of<AV>::template kernel<TC, Acc, Hook>;
  // B is used in place when it is already a row-major panel of Acc (a unit-stride vector for N == 1)
  // that C does not overlap; otherwise it is first copied into the panel, so C may share B's memory.
  const bool direct = std::is_same_v<TB, Acc> && (n == 1 ? bm.stride(0) == 1 : bm.stride(1) == 1) && !overlaps(bm, c);
  if (direct) {
    common.b = reinterpret_cast<const Acc*>(bm.data());
    common.ldb = bm.stride(0);
  } else {
    if (k > 0) for_each_index(eb, g.panel, pack_b<BV, Acc>{bm, panel, n});
    common.b = panel;
    common.ldb = n;
  }
  const index_t items = loom::detail::ceil_div(loom::detail::ceil_div(m, tile_rows), common.bands) * common.n_chunks;
  spmm_runner<Backend, AV>::run(eb, K{a, common, hook}, items);
}

}  // namespace loom::sparse::detail
