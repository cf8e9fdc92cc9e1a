#pragma once

//! @file
//! The layouts of the dense operands the vendor SpMM paths take (sparse::cusparse,
//! sparse::cusparselt): B and C dense, both row-major or both column-major.

#include <loom/core/tensor_view.hpp>

namespace loom::sparse {

//! The layout of B and C: both row-major (element (i, j) at i * N + j) or both column-major.
enum class order { row_major, col_major };

namespace detail {

//! True when v (rows x cols) is dense in `o`: unit stride along the fast index and the other
//! stride equal to the fast extent (strides of extents <= 1 are not looked at).
template <class V>
bool dense_in(const V& v, order o) {
  const index_t fast = o == order::row_major ? 1 : 0, slow = 1 - fast;
  const bool unit = v.extent(fast) <= 1 || v.stride(fast) == 1;
  const bool packed = v.extent(slow) <= 1 || v.stride(slow) == v.extent(fast);
  return unit && packed;
}

}  // namespace detail
}  // namespace loom::sparse
