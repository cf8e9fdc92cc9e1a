#pragma once

//! @file
//! loom::tensor_view: a non-owning, strided, memory-space-aware view of a Rank-d array.

#include <loom/config.hpp>
#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory_space.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

namespace loom {

using index_t = std::int64_t;  //!< signed index and extent type of every loom view

//! A non-owning view: pointer, extents and strides (in elements), tagged with its memory space.
//! Element (i0, ..., iR-1) lives at data()[sum_d i_d * stride(d)]. Copying a view is cheap and
//! never copies elements. Element access is LOOM_HD; host-only checks live in the free functions.
template <class T, std::size_t Rank, memory_space Space = host_memory>
requires(Rank >= 1) class tensor_view {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using index_type = index_t;
  using space = Space;
  static constexpr std::size_t rank = Rank;

  constexpr tensor_view() noexcept = default;

  //! Explicit strides (elements). Unchecked: use loom::make_view for validated construction.
  LOOM_HD constexpr tensor_view(T* data, const std::array<index_t, Rank>& extents,
                                const std::array<index_t, Rank>& strides) noexcept
      : data_(data) {
    for (std::size_t d = 0; d < Rank; ++d) {
      ext_[d] = extents[d];
      str_[d] = strides[d];
    }
  }

  //! Row-major contiguous (the last index varies fastest).
  LOOM_HD constexpr tensor_view(T* data, const std::array<index_t, Rank>& extents) noexcept : data_(data) {
    index_t s = 1;
    for (std::size_t d = Rank; d-- > 0;) {
      ext_[d] = extents[d];
      str_[d] = s;
      s *= extents[d];
    }
  }

  //! A view of non-const T converts to a view of const T.
  template <class U>
  requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>) LOOM_HD
      constexpr tensor_view(const tensor_view<U, Rank, Space>& other) noexcept
      : data_(other.data()) {
    for (std::size_t d = 0; d < Rank; ++d) {
      ext_[d] = other.extent(d);
      str_[d] = other.stride(d);
    }
  }

  LOOM_HD constexpr T* data() const noexcept { return data_; }
  LOOM_HD constexpr index_t extent(std::size_t d) const noexcept { return ext_[d]; }
  LOOM_HD constexpr index_t stride(std::size_t d) const noexcept { return str_[d]; }
  LOOM_HD constexpr index_t size() const noexcept {
    index_t n = 1;
    for (std::size_t d = 0; d < Rank; ++d) n *= ext_[d];
    return n;
  }
  LOOM_HD constexpr bool empty() const noexcept { return size() == 0; }

  //! True when the elements are dense and row-major (strides of a packed array).
  LOOM_HD constexpr bool is_contiguous() const noexcept {
    index_t s = 1;
    for (std::size_t d = Rank; d-- > 0;) {
      if (ext_[d] != 1 && str_[d] != s) return false;
      s *= ext_[d];
    }
    return true;
  }

  template <class... I>
  requires(sizeof...(I) == Rank && (std::is_integral_v<I> && ...)) LOOM_HD constexpr T& operator()(
      I... idx) const noexcept {
    const index_t i[Rank] = {static_cast<index_t>(idx)...};
    index_t off = 0;
    for (std::size_t d = 0; d < Rank; ++d) off += i[d] * str_[d];
    return data_[off];
  }

  //! Rows [begin, end) of the leading dimension; the other dimensions are kept. Unchecked.
  LOOM_HD constexpr tensor_view slice(index_t begin, index_t end) const noexcept {
    tensor_view r = *this;
    r.data_ = data_ + begin * str_[0];
    r.ext_[0] = end - begin;
    return r;
  }

 private:
  T* data_ = nullptr;
  index_t ext_[Rank] = {};
  index_t str_[Rank] = {};
};

namespace detail {
template <class V>
std::string extents_string(const V& v) {
  std::string s = "[";
  for (std::size_t d = 0; d < V::rank; ++d) s += (d ? ", " : "") + std::to_string(v.extent(d));
  return s + "]";
}
}  // namespace detail

//! Validated row-major view; `name` is used in the error. Throws loom::error(invalid_argument)
//! for a negative extent, extents whose product (the size) overflows index_t, or a null pointer
//! with a non-zero size.
template <memory_space Space = host_memory, class T, std::size_t Rank>
tensor_view<T, Rank, Space> make_view(T* data, const std::array<index_t, Rank>& extents,
                                      std::string_view name = "view") {
  for (std::size_t d = 0; d < Rank; ++d)
    LOOM_EXPECTS(extents[d] >= 0, errc::invalid_argument, name, ": extent ", d, " must be >= 0, got ", extents[d]);
  index_t size = 1;
  for (std::size_t d = 0; d < Rank; ++d) {
    if (detail::mul_overflows(size, extents[d])) [[unlikely]] {
      std::string e;
      for (std::size_t k = 0; k < Rank; ++k) e += (k ? ", " : "") + std::to_string(extents[k]);
      LOOM_FAIL(errc::invalid_argument, name, ": extents [", e,
                "] hold more elements than a 64-bit signed index can count");
    }
    size *= extents[d];
  }
  tensor_view<T, Rank, Space> v(data, extents);
  LOOM_EXPECTS(data != nullptr || v.size() == 0, errc::invalid_argument, name, ": null data with ", v.size(),
               " elements");
  return v;
}

//! Throws loom::error(shape_mismatch) naming `name` unless `v` has exactly `expected` extents.
template <class V>
void expect_extents(const V& v, const std::array<index_t, V::rank>& expected, std::string_view name) {
  for (std::size_t d = 0; d < V::rank; ++d) {
    if (v.extent(d) != expected[d]) {
      std::string e = "[";
      for (std::size_t k = 0; k < V::rank; ++k) e += (k ? ", " : "") + std::to_string(expected[k]);
      LOOM_FAIL(errc::shape_mismatch, name, ": expected extents ", e, "], got ", detail::extents_string(v));
    }
  }
}

//! Throws loom::error(shape_mismatch) "call: name must be [expected] (note), got [extents]" unless
//! `v` has exactly `expected` extents (the note, when given, says what the extents are). The one
//! shape check every family uses.
template <class V>
void expect_extents(const V& v, const std::array<index_t, V::rank>& expected, std::string_view call,
                    std::string_view name, std::string_view note = {}) {
  for (std::size_t d = 0; d < V::rank; ++d) {
    if (v.extent(d) != expected[d]) {
      std::string e = "[";
      for (std::size_t k = 0; k < V::rank; ++k) e += (k ? ", " : "") + std::to_string(expected[k]);
      e += "]";
      if (!note.empty()) e += " (" + std::string(note) + ")";
      LOOM_FAIL(errc::shape_mismatch, call, ": ", name, " must be ", e, ", got ", detail::extents_string(v));
    }
  }
}

}  // namespace loom
