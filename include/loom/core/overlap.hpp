#pragma once

//! @file
//! Whether two views share memory. Entry points that write an output while reading an input use
//! these to reject an output that overlaps the input (other than the exact in-place case they
//! support), which would otherwise return wrong values. Only addresses are compared: the views
//! may live in any memory space, and no element is read.

#include <loom/core/tensor_view.hpp>

#include <cstddef>
#include <cstdint>

namespace loom {

namespace detail {

//! The bytes [begin, end) from the lowest to the highest element of a view; empty (begin == end)
//! for a view without elements.
struct byte_range {
  std::uintptr_t begin = 0, end = 0;
  [[nodiscard]] constexpr bool empty() const noexcept { return begin == end; }
};

template <class V>
byte_range bytes_of(const V& v) {
  if (v.size() == 0 || v.data() == nullptr) return {};
  index_t lo = 0, hi = 0;  // element offsets of the lowest and the highest element
  for (std::size_t d = 0; d < V::rank; ++d) {
    const index_t reach = (v.extent(d) - 1) * v.stride(d);
    (reach < 0 ? lo : hi) += reach;
  }
  constexpr auto e = static_cast<index_t>(sizeof(typename V::element_type));
  const auto base = reinterpret_cast<std::uintptr_t>(v.data());
  return {base + static_cast<std::uintptr_t>(lo * e), base + static_cast<std::uintptr_t>((hi + 1) * e)};
}

}  // namespace detail

//! True if views a and b may share a byte: their byte ranges (lowest to highest element)
//! intersect. Exact for rank-1 views with the same element size and the same stride magnitude
//! (interleaved views such as the even and the odd elements of one array do not overlap);
//! conservative otherwise (two views interleaved in another way are reported as overlapping).
template <class A, class B>
bool overlaps(const A& a, const B& b) {
  const auto ra = detail::bytes_of(a), rb = detail::bytes_of(b);
  if (ra.empty() || rb.empty() || ra.end <= rb.begin || rb.end <= ra.begin) return false;
  constexpr auto e = static_cast<index_t>(sizeof(typename A::element_type));
  if constexpr (A::rank == 1 && B::rank == 1 && sizeof(typename A::element_type) == sizeof(typename B::element_type)) {
    const index_t sa = a.extent(0) > 1 ? a.stride(0) : 0, sb = b.extent(0) > 1 ? b.stride(0) : 0;
    const index_t step = (sa < 0 ? -sa : sa) * e;
    if (sa != 0 && (sb == sa || sb == -sa) && step >= 2 * e) {
      // Elements start at ra.begin + i * step and rb.begin + j * step and are e bytes long.
      const auto r = static_cast<index_t>((ra.begin > rb.begin ? ra.begin - rb.begin : rb.begin - ra.begin) %
                                          static_cast<std::uintptr_t>(step));
      return r < e || r > step - e;
    }
  }
  return true;
}

//! True if a and b are the same elements: the same address, extents and strides, and elements of
//! the same size (the in-place case: out == in).
template <class A, class B>
bool same_elements(const A& a, const B& b) {
  if constexpr (A::rank != B::rank || sizeof(typename A::element_type) != sizeof(typename B::element_type)) {
    return false;
  } else {
    if (static_cast<const void*>(a.data()) != static_cast<const void*>(b.data())) return false;
    for (std::size_t d = 0; d < A::rank; ++d)
      if (a.extent(d) != b.extent(d) || (a.extent(d) > 1 && a.stride(d) != b.stride(d))) return false;
    return true;
  }
}

}  // namespace loom
