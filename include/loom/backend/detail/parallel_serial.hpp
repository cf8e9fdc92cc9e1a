#pragma once

//! @file
//! The generic loops on one thread.

#include <loom/backend/detail/blocking.hpp>
#include <loom/backend/traits.hpp>

namespace loom {
struct serial;

namespace detail {
template <>
struct parallel_impl<serial> {
  template <class F>
  static void for_each(const serial&, index_t n, const F& f) {
    for (index_t i = 0; i < n; ++i) f(i);
  }

  template <class T, class Op, class F>
  static T reduce(const serial&, index_t n, T init, const Op& op, const F& f) {
    const reduce_blocking blk(n);
    for (index_t b = 0; b < blk.blocks; ++b) init = op(init, fold_block(blk, b, op, f));
    return init;
  }
};
}  // namespace detail
}  // namespace loom
