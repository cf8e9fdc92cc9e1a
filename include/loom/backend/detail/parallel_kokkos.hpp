#pragma once

//! @file
//! The generic loops as Kokkos::parallel_for over RangePolicy<ExecSpace, IndexType<int64>>.

#include <loom/backend/detail/blocking.hpp>
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

template <class ExecSpace>
struct parallel_impl<kokkos<ExecSpace>> {
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
