#pragma once

//! @file
//! The generic loops on OpenMP threads (dynamic schedule over chunks; reduce uses the fixed blocking).

#include <loom/backend/detail/blocking.hpp>
#include <loom/backend/detail/team.hpp>
#include <loom/backend/traits.hpp>

#include <type_traits>

// The pragmas vanish without OpenMP (no unknown-pragma warnings); the static_asserts below then
// tell the user to link loom::openmp.
#if LOOM_HAS_OPENMP
#include <omp.h>
#define LOOM_OMP(...) _Pragma(LOOM_STRINGIFY(omp __VA_ARGS__))
#else
#define LOOM_OMP(...)
#endif

namespace loom {
struct openmp;

namespace detail {
template <>
struct parallel_impl<openmp> {
  template <class B>
  static int team(const B& b) noexcept {
    return backend_traits<B>::concurrency(b);
  }

  template <class B, class F>
  static void for_each(const B& b, index_t n, const F& f) {
    static_assert(LOOM_HAS_OPENMP || always_false<B>,
                  "loom::openmp needs OpenMP: link the loom::openmp CMake target (or pass -fopenmp)");
    [[maybe_unused]] const int t = team(b);
    // Chunks of about 1/16 of a thread's share, taken dynamically: a thread that loses its core to
    // another process delays the loop by the chunk it holds, not by its whole share.
    [[maybe_unused]] const index_t share = n / (16 * index_t{t > 0 ? t : 1}), chunk = share > 1 ? share : 1;
    LOOM_OMP(parallel for schedule(dynamic, chunk) num_threads(t) if (n > 1 && t > 1))
    for (index_t i = 0; i < n; ++i) f(i);
  }

  //! Teams of up to the backend's thread count; each team is team_size threads of one parallel
  //! region (threads / team_size teams at once, at most 64), taking league ranks dynamically.
  template <class B>
  static int team_size_max(const B& b) noexcept {
    const int t = team(b);
    return t > 1 ? t : 1;
  }
  template <class B>
  static int team_size_recommended(const B&) noexcept {
    return 1;
  }
  template <class B>
  static std::size_t team_scratch_max(const B&) noexcept {
    return std::size_t{1} << 30;
  }
  template <class B, class F>
  static void for_each_team(const B& b, const team_policy& p, int size, const F& f) {
    static_assert(LOOM_HAS_OPENMP || always_false<B>,
                  "loom::openmp needs OpenMP: link the loom::openmp CMake target (or pass -fopenmp)");
    constexpr int max_teams = 64;
    const index_t league = p.league_size;
    int teams = team_size_max(b) / size;
    teams = teams < max_teams ? teams : max_teams;
    teams = league < teams ? static_cast<int>(league) : teams;
    if (size == 1 && teams <= 1) {
      run_single_member_teams(league, p.scratch_bytes, f);
      return;
    }
    host_team_state st[max_teams];
    std::atomic<index_t> next{0};
    [[maybe_unused]] int got = size * teams;
#if LOOM_HAS_OPENMP
    LOOM_OMP(parallel num_threads(size * teams)) {
      const int n = omp_get_num_threads(), tid = omp_get_thread_num(), formed = n / size;
      if (tid == 0) got = n;
      if (tid < formed * size && tid % size == 0) {
        st[tid / size].barrier.reset(size);
        st[tid / size].scratch = host_team_scratch(p.scratch_bytes);
      }
      LOOM_OMP(barrier)
      if (tid < formed * size) host_team_loop(st[tid / size], next, league, tid % size, size, f);
    }
#endif
    LOOM_EXPECTS(got >= size, errc::unsupported, "for_each_team: OpenMP ran ", got,
                 " threads, fewer than team_size = ", size, " (nested parallelism or a thread limit)");
  }

  template <class B, class T, class Op, class F>
  static T reduce(const B& b, index_t n, T init, const Op& op, const F& f) {
    static_assert(LOOM_HAS_OPENMP || always_false<B>,
                  "loom::openmp needs OpenMP: link the loom::openmp CMake target (or pass -fopenmp)");
    const reduce_blocking blk(n);
    using P = std::remove_cvref_t<decltype(fold_block(blk, 0, op, f))>;
    P partial[reduce_blocking::max_blocks];
    [[maybe_unused]] const int t = team(b);
    LOOM_OMP(parallel for schedule(static) num_threads(t) if (blk.blocks > 1 && t > 1))
    for (index_t k = 0; k < blk.blocks; ++k) partial[k] = fold_block(blk, k, op, f);
    for (index_t k = 0; k < blk.blocks; ++k) init = op(init, partial[k]);
    return init;
  }
};
}  // namespace detail
}  // namespace loom
