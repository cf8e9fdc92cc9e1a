#pragma once

//! @file
//! The generic loops as Kokkos::parallel_for over RangePolicy<ExecSpace, IndexType<int64>>.

#include <loom/backend/detail/blocking.hpp>
#include <loom/backend/detail/team.hpp>
#include <loom/backend/traits.hpp>

#include <Kokkos_Core.hpp>

#include <type_traits>

namespace loom {
template <class ExecSpace>
struct kokkos;

namespace detail {

template <class F>
struct kokkos_index_functor {
  F f;
  KOKKOS_INLINE_FUNCTION void operator()(const index_t i) const { f(i); }
};

template <class P, class Op, class F>
struct kokkos_block_functor {
  reduce_blocking blk;
  Op op;
  F f;
  P* partial;
  KOKKOS_INLINE_FUNCTION void operator()(const index_t k) const { partial[k] = fold_block(blk, k, op, f); }
};

//! The handle of a member of a Kokkos team (for_each_team).
template <class Member>
struct kokkos_team_member {
  const Member* m;
  void* shared;
  KOKKOS_INLINE_FUNCTION index_t league_rank() const { return m->league_rank(); }
  KOKKOS_INLINE_FUNCTION index_t league_size() const { return m->league_size(); }
  KOKKOS_INLINE_FUNCTION int team_rank() const { return m->team_rank(); }
  KOKKOS_INLINE_FUNCTION int team_size() const { return m->team_size(); }
  KOKKOS_INLINE_FUNCTION void* scratch() const { return shared; }
  KOKKOS_INLINE_FUNCTION void barrier() const { m->team_barrier(); }
};

template <class Member, class F>
struct kokkos_team_functor {
  F f;
  std::size_t bytes;
  KOKKOS_INLINE_FUNCTION void operator()(const Member& m) const {
    // Every member asks once and gets the same pointer: each member's copy of the level-0 scratch
    // space starts at the team's base.
    f(kokkos_team_member<Member>{&m, m.team_scratch(0).get_shmem_aligned(bytes, team_scratch_alignment)});
  }
};

template <class ExecSpace>
struct parallel_impl<kokkos<ExecSpace>> {
  using team_policy_type = Kokkos::TeamPolicy<ExecSpace>;
  using member_type = typename team_policy_type::member_type;
  struct probe {
    KOKKOS_INLINE_FUNCTION void operator()(const member_type&) const {}
  };

  static int team_size_max(const kokkos<ExecSpace>& b) {
    return team_policy_type(b.space, 1, 1).team_size_max(probe{}, Kokkos::ParallelForTag());
  }
  static int team_size_recommended(const kokkos<ExecSpace>& b) {
    return team_policy_type(b.space, 1, 1).team_size_recommended(probe{}, Kokkos::ParallelForTag());
  }
  static std::size_t team_scratch_max(const kokkos<ExecSpace>&) {
    return static_cast<std::size_t>(team_policy_type::scratch_size_max(0));
  }
  template <class F>
  static void for_each_team(const kokkos<ExecSpace>& b, const team_policy& p, int size, const F& f) {
    LOOM_EXPECTS(p.league_size <= index_t{2147483647}, errc::invalid_argument,
                 "for_each_team: league_size must fit int on kokkos, got ", p.league_size);
    const auto bytes = p.scratch_bytes > 0 ? p.scratch_bytes : std::size_t{1};  // Kokkos hands out no 0-byte piece
    const auto pol = team_policy_type(b.space, static_cast<int>(p.league_size), size)
                         .set_scratch_size(0, Kokkos::PerTeam(static_cast<int>(bytes + team_scratch_alignment)));
    Kokkos::parallel_for("loom::team", pol, kokkos_team_functor<member_type, F>{f, bytes});
    b.space.fence();
  }

  using policy = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<index_t>>;

  // Labels stay within std::string's inline capacity (15 characters): Kokkos turns every label into
  // a std::string per launch, and a plan-taking call allocates nothing on the heap.
  template <class F>
  static void for_each(const kokkos<ExecSpace>& b, index_t n, const F& f) {
    if (n == 0) return;
    Kokkos::parallel_for("loom::for_each", policy(b.space, 0, n), kokkos_index_functor<F>{f});
    b.space.fence();
  }

  template <class T, class Op, class F>
  static T reduce(const kokkos<ExecSpace>& b, index_t n, T init, const Op& op, const F& f) {
    const reduce_blocking blk(n);
    if (blk.blocks == 0) return init;
    using P = std::remove_cvref_t<decltype(fold_block(blk, 0, op, f))>;
    using mem = typename ExecSpace::memory_space;
    if constexpr (Kokkos::SpaceAccessibility<Kokkos::HostSpace, mem>::accessible) {
      P partial[reduce_blocking::max_blocks];
      Kokkos::parallel_for("loom::reduce", policy(b.space, 0, blk.blocks),
                           kokkos_block_functor<P, Op, F>{blk, op, f, partial});
      b.space.fence();
      for (index_t k = 0; k < blk.blocks; ++k) init = op(init, partial[k]);
    } else {
      Kokkos::View<P*, mem> dev("loom::reduce::partials", blk.blocks);
      Kokkos::parallel_for("loom::reduce", policy(b.space, 0, blk.blocks),
                           kokkos_block_functor<P, Op, F>{blk, op, f, dev.data()});
      auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace{}, dev);
      for (index_t k = 0; k < blk.blocks; ++k) init = op(init, host(k));
    }
    return init;
  }
};
}  // namespace detail
}  // namespace loom
