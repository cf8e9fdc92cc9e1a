#pragma once

//! @file
//! Conversions between dense matrices and the sparse formats, and magnitude pruning.
//!
//!   auto w = loom::sparse::prune_magnitude(dense, 0.9);          // 90% zeros, per row
//!   auto a = loom::sparse::to_bitmap(loom::tensor_view<const float, 2>(w.data(), {m, k}));
//!   auto c = loom::sparse::to_csr(a);                             // format -> format
//!   std::vector<float> back = loom::sparse::to_dense(c);          // exact
//!
//! A source is a host tensor_view<const T, 2> (any strides; its nonzeros are taken) or an owning
//! format (csr and bitmap give every stored entry, explicit zeros included; n_m gives its nonzero
//! slots). Every round trip dense -> format -> dense and format -> format is exact. Conversions
//! are O(stored entries + rows + tiles), to_dense O(rows * cols); all host-side and serial.

#include <loom/core/checked.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/sparse/formats.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::sparse {

namespace detail {
template <class T>
bool is_zero(const T& v) {
  return static_cast<double>(v) == 0.0;
}

// Row-major streams of (row, col, value) entries, one overload per kind of source.
template <class T, std::size_t R, class F>
void for_each_entry(const tensor_view<T, R, host_memory>& d, F&& f) {
  static_assert(R == 2, "a dense source must be a rank-2 view");
  for (index_t r = 0; r < d.extent(0); ++r)
    for (index_t c = 0; c < d.extent(1); ++c)
      if (!is_zero(d(r, c))) f(r, c, d(r, c));
}
template <class T, class F>
void for_each_entry(const csr<T>& a, F&& f) {
  for (index_t r = 0; r < a.rows(); ++r)
    for (index_t e = a.row_ptr()[r]; e < a.row_ptr()[r + 1]; ++e) f(r, index_t{a.col_idx()[e]}, a.values()[e]);
}
template <class T, class F>
void for_each_entry(const bitmap<T>& a, F&& f) {
  const auto v = a.view();
  std::vector<index_t> pos(static_cast<std::size_t>(v.grid_cols()));
  for (index_t br = 0; br < v.grid_rows(); ++br) {
    for (index_t tc = 0; tc < v.grid_cols(); ++tc) pos[tc] = v.tile_offsets[br * v.grid_cols() + tc];
    for (index_t r = 0; r < tile_rows && br * tile_rows + r < v.rows; ++r) {
      for (index_t tc = 0; tc < v.grid_cols(); ++tc) {
        const index_t t = br * v.grid_cols() + tc;
        pos[tc] += decode_row(v.masks[t * tile_rows + r], v.values + pos[tc],
                              [&](int j, const T& x) { f(br * tile_rows + r, tc * tile_cols + j, x); });
      }
    }
  }
}
template <int N, int M, class T, class F>
void for_each_entry(const n_m<N, M, T>& a, F&& f) {
  for (index_t r = 0; r < a.rows(); ++r)
    for (index_t g = 0; g < a.groups(); ++g)
      for (index_t s = (r * a.groups() + g) * N, e = s + N; s < e; ++s)
        if (!is_zero(a.values()[s])) f(r, g * M + a.indices()[s], a.values()[s]);
}

template <class S>
struct source_traits {  // owning formats
  using value_type = typename S::value_type;
  static index_t rows(const S& s) { return s.rows(); }
  static index_t cols(const S& s) { return s.cols(); }
};
template <class T, std::size_t R>
struct source_traits<tensor_view<T, R, host_memory>> {
  using value_type = std::remove_cv_t<T>;
  static index_t rows(const tensor_view<T, R, host_memory>& s) { return s.extent(0); }
  static index_t cols(const tensor_view<T, R, host_memory>& s) { return s.extent(1); }
};
template <class S>
using source_value_t = typename source_traits<S>::value_type;
}  // namespace detail

//! CSR holding the source's entries. @throws loom::error(invalid_argument) if cols exceeds int32.
template <class Src>
csr<detail::source_value_t<Src>> to_csr(const Src& src) {
  using T = detail::source_value_t<Src>;
  const index_t rows = detail::source_traits<Src>::rows(src), cols = detail::source_traits<Src>::cols(src);
  std::vector<index_t> row_ptr(
      static_cast<std::size_t>(loom::detail::checked_add(rows, index_t{1}, "to_csr: rows + 1")), 0);
  std::vector<std::int32_t> col_idx;
  std::vector<T> values;
  detail::for_each_entry(src, [&](index_t r, index_t c, const T& v) {
    ++row_ptr[r + 1];
    col_idx.push_back(static_cast<std::int32_t>(c));
    values.push_back(v);
  });
  for (index_t r = 0; r < rows; ++r) row_ptr[r + 1] += row_ptr[r];
  return csr<T>(rows, cols, std::move(row_ptr), std::move(col_idx), std::move(values));
}

//! Tiled bitmap holding the source's entries.
template <class Src>
bitmap<detail::source_value_t<Src>> to_bitmap(const Src& src) {
  using T = detail::source_value_t<Src>;
  const index_t rows = detail::source_traits<Src>::rows(src), cols = detail::source_traits<Src>::cols(src);
  const bitmap_view<T> shape{rows, cols};
  const index_t gc = shape.grid_cols();
  const index_t tiles =
      loom::detail::checked_mul(shape.grid_rows(), gc, "to_bitmap: tiles = ceil(rows / 8) * ceil(cols / 64)");
  std::vector<std::uint64_t> masks(
      static_cast<std::size_t>(loom::detail::checked_mul(tiles, detail::tile_rows, "to_bitmap: tiles * 8")), 0);
  std::vector<index_t> offsets(
      static_cast<std::size_t>(loom::detail::checked_add(tiles, index_t{1}, "to_bitmap: tiles + 1")), 0);
  // Entries arrive row by row; a band of tile_rows rows is gathered per tile, then appended.
  std::vector<std::vector<T>> band(static_cast<std::size_t>(gc));
  std::vector<T> values;
  index_t band_row = 0;
  auto flush = [&](index_t br) {
    for (index_t tc = 0; tc < gc; ++tc) {
      offsets[br * gc + tc + 1] = static_cast<index_t>(band[tc].size());
      values.insert(values.end(), band[tc].begin(), band[tc].end());
      band[tc].clear();
    }
  };
  detail::for_each_entry(src, [&](index_t r, index_t c, const T& v) {
    const index_t br = r / detail::tile_rows, tc = c / detail::tile_cols;
    while (band_row < br) flush(band_row++);
    masks[(br * gc + tc) * detail::tile_rows + r % detail::tile_rows] |= std::uint64_t{1} << (c % detail::tile_cols);
    band[tc].push_back(v);
  });
  while (band_row < shape.grid_rows()) flush(band_row++);
  for (index_t t = 0; t < tiles; ++t) offsets[t + 1] += offsets[t];
  return bitmap<T>(rows, cols, std::move(masks), std::move(offsets), std::move(values));
}

//! N:M matrix holding the source's nonzeros; unused slots get the lowest free in-group indices and
//! the value 0. @throws loom::error(invalid_argument) naming the row and group if a group of M
//! columns holds more than N nonzeros (prune with prune_n_m first).
template <int N, int M, class Src>
n_m<N, M, detail::source_value_t<Src>> to_n_m(const Src& src) {
  using T = detail::source_value_t<Src>;
  const index_t rows = detail::source_traits<Src>::rows(src), cols = detail::source_traits<Src>::cols(src);
  const index_t groups = loom::detail::ceil_div(cols, index_t{M});
  const index_t cells = loom::detail::checked_mul(rows, groups, "to_n_m: rows * groups");
  const index_t slots = loom::detail::checked_mul(cells, index_t{N}, "to_n_m: rows * groups * N");
  std::vector<int> count(static_cast<std::size_t>(cells), 0);
  std::vector<T> values(static_cast<std::size_t>(slots), T(0.0f));
  std::vector<std::uint8_t> indices(values.size(), 0);
  detail::for_each_entry(src, [&](index_t r, index_t c, const T& v) {
    if (detail::is_zero(v)) return;
    const index_t cell = r * groups + c / M;
    LOOM_EXPECTS(count[cell] < N, errc::invalid_argument, "to_n_m: row ", r, ", columns [", (c / M) * M, ", ",
                 (c / M) * M + M, ") hold more than N = ", N, " nonzeros (", M, "-wide groups); prune first");
    values[cell * N + count[cell]] = v;
    indices[cell * N + count[cell]++] = static_cast<std::uint8_t>(c % M);
  });
  for (index_t cell = 0; cell < cells; ++cell) {  // pad with zeros, keep indices sorted
    std::uint8_t* idx = &indices[cell * N];
    T* val = &values[cell * N];
    for (int s = count[cell], free = 0; s < N; ++s, ++free) {
      while (std::find(idx, idx + count[cell], free) != idx + count[cell]) ++free;
      idx[s] = static_cast<std::uint8_t>(free);
    }
    for (int s = 1; s < N; ++s)  // insertion sort of the N slots by index
      for (int u = s; u > 0 && idx[u] < idx[u - 1]; --u) {
        std::swap(idx[u], idx[u - 1]);
        std::swap(val[u], val[u - 1]);
      }
  }
  return n_m<N, M, T>(rows, cols, std::move(values), std::move(indices));
}

//! The dense matrix, row-major (rows * cols values); positions not stored are T(0).
template <class Src>
std::vector<detail::source_value_t<Src>> to_dense(const Src& src) {
  using T = detail::source_value_t<Src>;
  const index_t rows = detail::source_traits<Src>::rows(src), cols = detail::source_traits<Src>::cols(src);
  std::vector<T> d(static_cast<std::size_t>(loom::detail::checked_mul(rows, cols, "to_dense: rows * cols")), T(0.0f));
  detail::for_each_entry(src, [&](index_t r, index_t c, const T& v) { d[r * cols + c] = v; });
  return d;
}

//! Where magnitude pruning ranks the entries: over the whole matrix or within each row.
enum class prune_scope { global, per_row };

//! A row-major copy of `dense` with the round(sparsity * count) smallest magnitudes set to zero,
//! count being rows * cols (global) or cols (per_row, every row then has the same sparsity).
//! Ties are broken by position (earlier entries are pruned first), so the result is deterministic.
//! @throws loom::error(invalid_argument) if sparsity is not in [0, 1]. O(n log n).
template <class T>
std::vector<std::remove_cv_t<T>> prune_magnitude(tensor_view<T, 2, host_memory> dense, double sparsity,
                                                 prune_scope scope = prune_scope::per_row) {
  using V = std::remove_cv_t<T>;
  LOOM_EXPECTS(sparsity >= 0.0 && sparsity <= 1.0, errc::invalid_argument,
               "prune_magnitude: sparsity must be in [0, 1], got ", sparsity);
  const index_t rows = dense.extent(0), cols = dense.extent(1);
  std::vector<V> out(static_cast<std::size_t>(loom::detail::checked_mul(rows, cols, "prune_magnitude: rows * cols")));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) out[r * cols + c] = dense(r, c);
  auto prune_range = [&](index_t begin, index_t count) {
    const auto k = static_cast<index_t>(std::llround(sparsity * static_cast<double>(count)));
    std::vector<index_t> order(static_cast<std::size_t>(count));
    for (index_t i = 0; i < count; ++i) order[i] = begin + i;
    auto less = [&](index_t x, index_t y) {
      const double ax = std::fabs(static_cast<double>(out[x])), ay = std::fabs(static_cast<double>(out[y]));
      return ax < ay || (ax == ay && x < y);
    };
    if (k > 0 && k < count) std::nth_element(order.begin(), order.begin() + k, order.end(), less);
    for (index_t i = 0; i < k; ++i) out[order[i]] = V(0.0f);
  };
  if (scope == prune_scope::global)
    prune_range(0, rows * cols);
  else
    for (index_t r = 0; r < rows; ++r) prune_range(r * cols, cols);
  return out;
}

//! A row-major copy of `dense` keeping, in each group of M consecutive columns of a row, the N
//! largest magnitudes (ties: the earlier column), so that to_n_m<N, M> accepts it.
template <int N, int M, class T>
std::vector<std::remove_cv_t<T>> prune_n_m(tensor_view<T, 2, host_memory> dense) {
  using V = std::remove_cv_t<T>;
  const index_t rows = dense.extent(0), cols = dense.extent(1);
  std::vector<V> out(static_cast<std::size_t>(loom::detail::checked_mul(rows, cols, "prune_n_m: rows * cols")),
                     V(0.0f));
  for (index_t r = 0; r < rows; ++r)
    for (index_t g = 0; g < cols; g += M) {
      const index_t w = cols - g < M ? cols - g : M;
      for (index_t c = g; c < g + w; ++c) {
        const double a = std::fabs(static_cast<double>(dense(r, c)));
        int larger = 0;  // entries of the group that outrank this one
        for (index_t d = g; d < g + w; ++d) {
          const double b = std::fabs(static_cast<double>(dense(r, d)));
          larger += b > a || (b == a && d < c);
        }
        if (larger < N) out[r * cols + c] = dense(r, c);
      }
    }
  return out;
}

}  // namespace loom::sparse
