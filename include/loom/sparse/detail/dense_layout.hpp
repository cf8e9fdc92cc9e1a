#pragma once

//! @file
//! The layouts of the dense operands the vendor SpMM paths take (sparse::cusparse,
//! sparse::cusparselt): B and C dense, both row-major or both column-major; and the checks both
//! paths make of their options and of B and C.

#include <loom/core/error.hpp>
#include <loom/core/overlap.hpp>
#include <loom/core/tensor_view.hpp>

#include <cmath>
#include <string_view>

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

//! @throws loom::error(invalid_argument) naming `call` for an order other than the two, or alpha
//!   or beta not finite.
inline void check_options(double alpha, double beta, order o, std::string_view call) {
  LOOM_EXPECTS(o == order::row_major || o == order::col_major, errc::invalid_argument, call,
               ": options.order must be order::row_major or order::col_major");
  LOOM_EXPECTS(std::isfinite(alpha) && std::isfinite(beta), errc::invalid_argument, call,
               ": options.alpha and options.beta must be finite, got ", alpha, " and ", beta);
}

//! @throws loom::error(shape_mismatch) naming `call` unless B is k x n and C is m x n;
//!   (invalid_argument) for a view not dense in `o`, or B and C sharing memory (C is written while
//!   B is read).
template <class BV, class CV>
void check_dense_operands(const BV& bm, const CV& c, index_t m, index_t k, index_t n, order o, std::string_view call) {
  expect_extents(bm, {k, n}, call, "B", "K x N");
  expect_extents(c, {m, n}, call, "C", "M x N");
  const char* layout = o == order::row_major ? "row-major" : "column-major";
  LOOM_EXPECTS(dense_in(bm, o), errc::invalid_argument, call, ": B must be dense and ", layout,
               " (the plan's order), got strides (", bm.stride(0), ", ", bm.stride(1), ")");
  LOOM_EXPECTS(dense_in(c, o), errc::invalid_argument, call, ": C must be dense and ", layout,
               " (the plan's order), got strides (", c.stride(0), ", ", c.stride(1), ")");
  LOOM_EXPECTS(!overlaps(bm, c), errc::invalid_argument, call, ": B and C share memory; C is written while B is read");
}

}  // namespace detail
}  // namespace loom::sparse
