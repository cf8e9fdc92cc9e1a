#pragma once

//! @file
//! The fixed blocking behind loom::reduce. It depends on n only, never on the thread count, so the
//! order of combination (and so the bits of a floating-point result) is the same on serial,
//! openmp and kokkos host spaces: result = init op B_0 op B_1 ..., B_k a left fold of block k.

#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>

namespace loom::detail {

struct reduce_blocking {
  static constexpr index_t max_blocks = 256;  //!< partials fit on the stack
  static constexpr index_t min_block = 4096;  //!< below this, threading does not pay
  index_t n = 0;
  index_t block = 1;
  index_t blocks = 0;

  LOOM_HD constexpr explicit reduce_blocking(index_t count) noexcept : n(count) {
    if (n <= 0) return;
    block = (n + max_blocks - 1) / max_blocks;
    if (block < min_block) block = min_block;
    blocks = (n + block - 1) / block;
  }
  LOOM_HD constexpr index_t begin(index_t b) const noexcept { return b * block; }
  LOOM_HD constexpr index_t end(index_t b) const noexcept { return (b + 1) * block < n ? (b + 1) * block : n; }
};

//! Left fold of f over [begin, end): f(begin) op f(begin+1) op ... (the range is never empty).
template <class Op, class F>
LOOM_HD auto fold_range(index_t begin, index_t end, const Op& op, const F& f) {
  auto acc = f(begin);
  for (index_t i = begin + 1; i < end; ++i) acc = op(acc, f(i));
  return acc;
}

//! Left fold of f over block b of the blocking.
template <class Op, class F>
LOOM_HD auto fold_block(const reduce_blocking& blk, index_t b, const Op& op, const F& f) {
  return fold_range(blk.begin(b), blk.end(b), op, f);
}

}  // namespace loom::detail
