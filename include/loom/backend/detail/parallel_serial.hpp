#pragma once

//! @file
//! The generic loops on one thread.

#include <loom/backend/detail/blocking.hpp>
#include <loom/backend/detail/team.hpp>
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

  static int team_size_max(const serial&) noexcept { return 1; }
  static int team_size_recommended(const serial&) noexcept { return 1; }
  static std::size_t team_scratch_max(const serial&) noexcept { return std::size_t{1} << 30; }
  template <class F>
  static void for_each_team(const serial&, const team_policy& p, int, const F& f) {
    run_single_member_teams(p.league_size, p.scratch_bytes, f);
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
