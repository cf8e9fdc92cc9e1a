#pragma once

//! @file
//! Sparse weight formats: loom::sparse::csr<T>, loom::sparse::bitmap<T> (tiled bitmap, the
//! "load as sparse, compute as dense" format) and loom::sparse::n_m<N, M, T> (N:M structured).
//! Each owning format has a validating constructor (malformed arrays throw loom::error, never
//! crash), bytes() (the exact storage of its arrays) and view(): a trivially copyable view of
//! raw pointers that the kernels take, on the host or, built with make_*_view, on a device.
//! Dense round trips and conversions are in convert.hpp; the multiply is in spmm.hpp.
//!
//! Bytes per dense element at sparsity s, element size e: csr  e(1-s) + 4(1-s) + 8/K;
//! bitmap  e(1-s) + 1/8 + 1/64;  n_m  (e + 1) N/M.

#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory_space.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/sparse/detail/tile.hpp>

#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::sparse {

//! Compressed sparse rows, read by the kernels: row r holds entries [row_ptr[r], row_ptr[r+1]).
template <class T, memory_space Space = host_memory>
struct csr_view {
  using value_type = T;
  using space = Space;
  index_t rows = 0, cols = 0;
  const index_t* row_ptr = nullptr;       //!< rows + 1 offsets
  const std::int32_t* col_idx = nullptr;  //!< nnz column indices, strictly increasing per row
  const T* values = nullptr;              //!< nnz values
  LOOM_HD constexpr index_t nnz() const noexcept { return rows > 0 ? row_ptr[rows] : 0; }
};

//! Tiled bitmap: tiles of detail::tile_rows x detail::tile_cols in row-major tile order; tile t
//! owns masks[t * tile_rows + r] (bit j: element (r, j) of the tile is stored) and the values
//! [tile_offsets[t], tile_offsets[t + 1]), packed row-major within the tile.
template <class T, memory_space Space = host_memory>
struct bitmap_view {
  using value_type = T;
  using space = Space;
  index_t rows = 0, cols = 0;
  const std::uint64_t* masks = nullptr;   //!< tiles() * tile_rows words
  const index_t* tile_offsets = nullptr;  //!< tiles() + 1 offsets into values
  const T* values = nullptr;
  LOOM_HD constexpr index_t grid_rows() const noexcept { return loom::detail::ceil_div(rows, detail::tile_rows); }
  LOOM_HD constexpr index_t grid_cols() const noexcept { return loom::detail::ceil_div(cols, detail::tile_cols); }
  LOOM_HD constexpr index_t tiles() const noexcept { return grid_rows() * grid_cols(); }
};

//! N:M structured sparsity along a row: each group of M consecutive columns (the last group may be
//! narrower when M does not divide cols) stores exactly N (value, in-group index) slots, indices
//! strictly increasing and below M; slots may hold explicit zeros (a slot of the narrow last group
//! may point past the last column only with the value 0, and is then skipped). Slot s of group g of row r is at
//! (r * groups() + g) * N + s.
template <int N, int M, class T, memory_space Space = host_memory>
requires(N >= 1 && M >= N && M <= 256) struct n_m_view {
  using value_type = T;
  using space = Space;
  static constexpr int n = N, m = M;
  index_t rows = 0, cols = 0;
  const T* values = nullptr;
  const std::uint8_t* indices = nullptr;
  LOOM_HD constexpr index_t groups() const noexcept { return loom::detail::ceil_div(cols, index_t{M}); }
};

namespace detail {
//! What csr and bitmap share: the extents and three arrays (two index arrays I0, I1 and the values),
//! taken by the derived constructor, which validates them.
template <class T, class I0, class I1>
class owned_arrays {
 public:
  using value_type = T;
  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  index_t nnz() const noexcept { return static_cast<index_t>(values_.size()); }
  const std::vector<T>& values() const noexcept { return values_; }
  //! Bytes of the three arrays.
  std::size_t bytes() const noexcept {
    return first_.size() * sizeof(I0) + second_.size() * sizeof(I1) + values_.size() * sizeof(T);
  }

 protected:
  owned_arrays(std::vector<I0> first, std::vector<I1> second) : first_(std::move(first)), second_(std::move(second)) {}
  owned_arrays(index_t rows, index_t cols, std::vector<I0> first, std::vector<I1> second, std::vector<T> values)
      : rows_(rows), cols_(cols), first_(std::move(first)), second_(std::move(second)), values_(std::move(values)) {}
  index_t rows_ = 0, cols_ = 0;
  std::vector<I0> first_;
  std::vector<I1> second_;
  std::vector<T> values_;
};
}  // namespace detail

//! Owning CSR on the host. 32-bit column indices, 64-bit row offsets. Default: 0 x 0.
template <class T>
class csr : public detail::owned_arrays<T, index_t, std::int32_t> {
  using base = detail::owned_arrays<T, index_t, std::int32_t>;

 public:
  csr() : base({0}, {}) {}
  //! Validates and takes the arrays. Throws loom::error(invalid_argument) naming the array for:
  //! negative or too large extents (cols must fit int32, rows + 1 index_t), row_ptr not of size
  //! rows + 1, not starting at 0 or decreasing, row_ptr[rows] != col_idx.size(), values.size() !=
  //! col_idx.size(), a column index outside [0, cols), and unsorted or duplicate column indices
  //! within a row.
  csr(index_t rows, index_t cols, std::vector<index_t> row_ptr, std::vector<std::int32_t> col_idx,
      std::vector<T> values)
      : base(rows, cols, std::move(row_ptr), std::move(col_idx), std::move(values)) {
    validate();
  }
  const std::vector<index_t>& row_ptr() const noexcept { return this->first_; }
  const std::vector<std::int32_t>& col_idx() const noexcept { return this->second_; }
  csr_view<T> view() const noexcept {
    return {this->rows_, this->cols_, row_ptr().data(), col_idx().data(), this->values_.data()};
  }

 private:
  void validate() const;
};

//! Owning tiled bitmap on the host (see bitmap_view for the layout). Default: 0 x 0. Its bytes():
//! about e(1 - s) + 1/8 + 1/64 bytes per dense element.
template <class T>
class bitmap : public detail::owned_arrays<T, std::uint64_t, index_t> {
  using base = detail::owned_arrays<T, std::uint64_t, index_t>;

 public:
  bitmap() : base({}, {0}) {}
  //! Validates and takes the arrays. Throws loom::error(invalid_argument) naming the array for:
  //! negative extents, a tile or word count that overflows index_t, masks not of size
  //! tiles * tile_rows, a set bit outside the matrix (rows or columns of edge tiles past the
  //! extents), tile_offsets not of size tiles + 1, not starting at 0, or with tile_offsets[t + 1] -
  //! tile_offsets[t] != set bits of tile t, and values.size() != tile_offsets[tiles].
  bitmap(index_t rows, index_t cols, std::vector<std::uint64_t> masks, std::vector<index_t> tile_offsets,
         std::vector<T> values)
      : base(rows, cols, std::move(masks), std::move(tile_offsets), std::move(values)) {
    validate();
  }
  const std::vector<std::uint64_t>& masks() const noexcept { return this->first_; }
  const std::vector<index_t>& tile_offsets() const noexcept { return this->second_; }
  bitmap_view<T> view() const noexcept {
    return {this->rows_, this->cols_, masks().data(), tile_offsets().data(), this->values_.data()};
  }

 private:
  void validate() const;
};

//! Owning N:M structured sparse matrix on the host (see n_m_view). 2:4 is n_m<2, 4, T>.
template <int N, int M, class T>
requires(N >= 1 && M >= N && M <= 256) class n_m {
 public:
  using value_type = T;
  static constexpr int n = N, m = M;
  n_m() = default;
  //! Validates and takes the arrays. Throws loom::error(invalid_argument) naming the array for:
  //! negative extents, rows * groups * N overflowing index_t, values or indices not of that size,
  //! an in-group index not below M, a nonzero value past the last column, or indices not strictly
  //! increasing in a group.
  n_m(index_t rows, index_t cols, std::vector<T> values, std::vector<std::uint8_t> indices)
      : rows_(rows), cols_(cols), values_(std::move(values)), indices_(std::move(indices)) {
    validate();
  }
  index_t rows() const noexcept { return rows_; }
  index_t cols() const noexcept { return cols_; }
  index_t groups() const noexcept { return loom::detail::ceil_div(cols_, index_t{M}); }
  //! Stored slots (rows * groups * N), explicit zeros included.
  index_t slots() const noexcept { return static_cast<index_t>(values_.size()); }
  //! Bytes of the two arrays: (sizeof(T) + 1) * N / M per dense element.
  std::size_t bytes() const noexcept { return values_.size() * sizeof(T) + indices_.size(); }
  const std::vector<T>& values() const noexcept { return values_; }
  const std::vector<std::uint8_t>& indices() const noexcept { return indices_; }
  n_m_view<N, M, T> view() const noexcept { return {rows_, cols_, values_.data(), indices_.data()}; }

 private:
  void validate() const;
  index_t rows_ = 0, cols_ = 0;
  std::vector<T> values_;
  std::vector<std::uint8_t> indices_;
};

//! Unchecked views of arrays anywhere (e.g. device copies of a validated format's arrays).
template <memory_space Space, class T>
csr_view<T, Space> make_csr_view(index_t rows, index_t cols, const index_t* row_ptr, const std::int32_t* col_idx,
                                 const T* values) noexcept {
  return {rows, cols, row_ptr, col_idx, values};
}
template <memory_space Space, class T>
bitmap_view<T, Space> make_bitmap_view(index_t rows, index_t cols, const std::uint64_t* masks,
                                       const index_t* tile_offsets, const T* values) noexcept {
  return {rows, cols, masks, tile_offsets, values};
}
template <memory_space Space, int N, int M, class T>
n_m_view<N, M, T, Space> make_n_m_view(index_t rows, index_t cols, const T* values,
                                       const std::uint8_t* indices) noexcept {
  return {rows, cols, values, indices};
}

// ---------------------------------------------------------------------------------------------
// Validation

namespace detail {
inline void check_extents(index_t rows, index_t cols, const char* what) {
  LOOM_EXPECTS(rows >= 0 && cols >= 0, errc::invalid_argument, what, ": rows and cols must be >= 0, got ", rows, " x ",
               cols);
}

//! CSR row offsets: offsets[0] == 0 and non-decreasing. `who` and `name` name the call and the
//! array in the error. @throws loom::error(invalid_argument).
inline void check_row_offsets(std::span<const index_t> offsets, std::string_view who, std::string_view name) {
  LOOM_EXPECTS(!offsets.empty() && offsets[0] == 0, errc::invalid_argument, who, ": ", name, "[0] must be 0, got ",
               offsets.empty() ? index_t{-1} : offsets[0]);
  for (std::size_t r = 0; r + 1 < offsets.size(); ++r)
    LOOM_EXPECTS(offsets[r + 1] >= offsets[r], errc::invalid_argument, who, ": ", name, " must be non-decreasing, but ",
                 name, "[", r + 1, "] = ", offsets[r + 1], " < ", name, "[", r, "] = ", offsets[r]);
}
}  // namespace detail

template <class T>
void csr<T>::validate() const {
  detail::check_extents(this->rows(), this->cols(), "csr");
  LOOM_EXPECTS(this->cols() <= std::numeric_limits<std::int32_t>::max(), errc::invalid_argument,
               "csr: cols must fit a 32-bit column index, got ", this->cols());
  const index_t offsets = loom::detail::checked_add(this->rows(), index_t{1}, "csr: rows + 1");
  LOOM_EXPECTS(static_cast<index_t>(row_ptr().size()) == offsets, errc::invalid_argument,
               "csr: row_ptr must hold rows + 1 = ", offsets, " offsets, got ", row_ptr().size());
  const auto nnz = static_cast<index_t>(col_idx().size());
  LOOM_EXPECTS(this->values().size() == col_idx().size(), errc::invalid_argument,
               "csr: values must hold as many entries as col_idx (", nnz, "), got ", this->values().size());
  detail::check_row_offsets(row_ptr(), "csr", "row_ptr");
  LOOM_EXPECTS(row_ptr()[this->rows()] == nnz, errc::invalid_argument,
               "csr: row_ptr[rows] must equal col_idx.size() = ", nnz, ", got ", row_ptr()[this->rows()]);
  for (index_t r = 0; r < this->rows(); ++r) {
    for (index_t e = row_ptr()[r]; e < row_ptr()[r + 1]; ++e) {
      const index_t c = col_idx()[e];
      LOOM_EXPECTS(c >= 0 && c < this->cols(), errc::invalid_argument, "csr: col_idx[", e, "] (row ", r,
                   ") must be in [0, cols = ", this->cols(), "), got ", c);
      if (e > row_ptr()[r]) {
        LOOM_EXPECTS(c != col_idx()[e - 1], errc::invalid_argument, "csr: duplicate column ", c, " in row ", r,
                     " (col_idx[", e - 1, "] and col_idx[", e, "])");
        LOOM_EXPECTS(c > col_idx()[e - 1], errc::invalid_argument, "csr: column indices of row ", r,
                     " must be increasing, but col_idx[", e, "] = ", c, " < col_idx[", e - 1, "] = ", col_idx()[e - 1]);
      }
    }
  }
}

template <class T>
void bitmap<T>::validate() const {
  detail::check_extents(this->rows(), this->cols(), "bitmap");
  const auto v = view();
  const index_t tr = detail::tile_rows;
  const index_t tiles =
      loom::detail::checked_mul(v.grid_rows(), v.grid_cols(), "bitmap: tiles = ceil(rows / 8) * ceil(cols / 64)");
  const index_t words = loom::detail::checked_mul(tiles, tr, "bitmap: masks words = tiles * 8");
  const index_t offsets = loom::detail::checked_add(tiles, index_t{1}, "bitmap: tiles + 1");
  LOOM_EXPECTS(static_cast<index_t>(masks().size()) == words, errc::invalid_argument, "bitmap: masks must hold ", words,
               " words (", tiles, " tiles x ", tr, " rows), got ", masks().size());
  LOOM_EXPECTS(static_cast<index_t>(tile_offsets().size()) == offsets, errc::invalid_argument,
               "bitmap: tile_offsets must hold tiles + 1 = ", offsets, " offsets, got ", tile_offsets().size());
  LOOM_EXPECTS(tile_offsets()[0] == 0, errc::invalid_argument, "bitmap: tile_offsets[0] must be 0, got ",
               tile_offsets()[0]);
  for (index_t t = 0; t < tiles; ++t) {
    const index_t r0 = (t / v.grid_cols()) * tr, c0 = (t % v.grid_cols()) * detail::tile_cols;
    const std::uint64_t valid = detail::valid_bits(c0, this->cols());
    index_t count = 0;
    for (index_t r = 0; r < tr; ++r) {
      const std::uint64_t m = masks()[t * tr + r];
      LOOM_EXPECTS((r0 + r < this->rows() || m == 0) && (m & ~valid) == 0, errc::invalid_argument, "bitmap: masks[",
                   t * tr + r, "] (tile ", t, ", row ", r0 + r, ") sets a bit outside the ", this->rows(), " x ",
                   this->cols(), " matrix");
      count += detail::popcount64(m);
    }
    LOOM_EXPECTS(tile_offsets()[t + 1] - tile_offsets()[t] == count, errc::invalid_argument, "bitmap: tile ", t,
                 " sets ", count, " bits, so tile_offsets[", t + 1, "] - tile_offsets[", t, "] must be ", count,
                 ", got ", tile_offsets()[t + 1] - tile_offsets()[t]);
  }
  LOOM_EXPECTS(static_cast<index_t>(this->values().size()) == tile_offsets()[tiles], errc::invalid_argument,
               "bitmap: values must hold tile_offsets[tiles] = ", tile_offsets()[tiles], " entries, got ",
               this->values().size());
}

template <int N, int M, class T>
requires(N >= 1 && M >= N && M <= 256) void n_m<N, M, T>::validate() const {
  detail::check_extents(rows_, cols_, "n_m");
  const index_t slots = loom::detail::checked_mul(loom::detail::checked_mul(rows_, groups(), "n_m: rows * groups"),
                                                  index_t{N}, "n_m: rows * groups * N");
  LOOM_EXPECTS(static_cast<index_t>(values_.size()) == slots, errc::invalid_argument,
               "n_m: values must hold rows * groups * N = ", slots, " entries, got ", values_.size());
  LOOM_EXPECTS(static_cast<index_t>(indices_.size()) == slots, errc::invalid_argument,
               "n_m: indices must hold rows * groups * N = ", slots, " entries, got ", indices_.size());
  for (index_t s = 0; s < slots; ++s) {
    const index_t g = (s / N) % groups();
    const index_t width = cols_ - g * M < M ? cols_ - g * M : M;
    LOOM_EXPECTS(indices_[s] < M, errc::invalid_argument, "n_m: indices[", s, "] must be below M = ", M, ", got ",
                 int{indices_[s]});
    LOOM_EXPECTS(indices_[s] < width || static_cast<float>(values_[s]) == 0.0f, errc::invalid_argument, "n_m: slot ", s,
                 " points past the last column (group width ", width, ", index ", int{indices_[s]},
                 "): its value must be 0");
    LOOM_EXPECTS(s % N == 0 || indices_[s] > indices_[s - 1], errc::invalid_argument, "n_m: indices[", s,
                 "] must be greater than indices[", s - 1, "] (strictly increasing in a group), got ", int{indices_[s]},
                 " after ", int{indices_[s - 1]});
  }
}

}  // namespace loom::sparse
