#pragma once

//! @file
//! The generic execution building blocks every primitive is written with. Each takes a callable
//! that is LOOM_HD (host and device) so one body serves every backend:
//!   loom::for_each_index(b, n, f)                      f(i) for i in [0, n)
//!   loom::reduce(b, n, init, op, f)                    init op f(0) op ... op f(n-1)
//!   loom::for_each_tile(b, rows, cols, tile, f)         f(tile2d) for each tile of a 2-D space
//!   loom::for_each_team(b, {league, size, scratch}, f)  f(member) for each member of each team
//! Include the header of the backend you use (loom/backend/openmp.hpp, ...) before calling.

#include <loom/backend/serial.hpp>
#include <loom/backend/traits.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstddef>

namespace loom {

//! Calls f(i) for every i in [0, n), in parallel on `b`; the order of calls is unspecified.
//! Stream-ordered on cuda (returns before the kernel finishes); complete on return elsewhere.
//! @throws loom::error(invalid_argument) if n < 0.
template <backend B, class F>
void for_each_index(const B& b, index_t n, const F& f) {
  LOOM_EXPECTS(n >= 0, errc::invalid_argument, "for_each_index: n must be >= 0, got ", n);
  detail::parallel_impl<B>::for_each(b, n, f);
}

//! The work a host thread should get before a call forks a parallel region for it: 1 MiB of memory
//! traffic, about 0.1 ms on one core. A region ends when its last thread arrives, and on a loaded
//! machine (data loaders, progress threads, another job) a thread can wait a whole scheduler slice
//! for its core, so a region around less work costs more than it saves.
inline constexpr std::size_t parallel_grain_bytes = std::size_t{1} << 20;

namespace detail {
//! `b`, or a copy of it on one thread when `work_bytes` (memory traffic, or its equivalent in
//! arithmetic) is under two grains and b's thread count is a field (openmp). Scheduling only: the
//! primitives that use it compute the same bits on any thread count.
template <backend B>
B for_work(const B& b, double work_bytes) {
  if constexpr (requires(B x) { x.threads = 1; }) {
    if (work_bytes < 2.0 * static_cast<double>(parallel_grain_bytes)) {
      B one = b;
      one.threads = 1;
      return one;
    }
  }
  return b;
}
}  // namespace detail

//! Reduces f(0..n-1) with the associative `op` (commutativity not assumed): the result is
//! init op B_0 op B_1 op ..., where B_k is the left fold of a fixed block of indices that depends
//! only on n. So the bits of the result are the same for serial, openmp (any thread count) and
//! kokkos host spaces. Returns init when n == 0. Synchronous on every backend.
//! @throws loom::error(invalid_argument) if n < 0.
template <backend B, class T, class Op, class F>
T reduce(const B& b, index_t n, T init, const Op& op, const F& f) {
  LOOM_EXPECTS(n >= 0, errc::invalid_argument, "reduce: n must be >= 0, got ", n);
  return detail::parallel_impl<B>::reduce(b, n, init, op, f);
}

//! One tile of a 2-D index space: rows [row_begin, row_end) x cols [col_begin, col_end).
struct tile2d {
  index_t row_begin, row_end, col_begin, col_end;
  index_t tile_row, tile_col;  //!< the tile's coordinates in the tile grid
};

//! Tile sizes for for_each_tile.
struct tile_shape {
  index_t rows = 64;
  index_t cols = 64;
};

namespace detail {
//! Fills p[0..n) with v (one item per element): for_each_index(b, n, fill_kernel<T>{p, v}).
template <class T>
struct fill_kernel {
  T* p;
  T v;
  LOOM_HD void operator()(index_t i) const { p[i] = v; }
};

template <class F>
struct tile_body {
  index_t rows, cols, tile_rows, tile_cols, grid_cols;
  F f;
  LOOM_HD void operator()(index_t t) const {
    const index_t tr = t / grid_cols, tc = t % grid_cols;
    const index_t r0 = tr * tile_rows, c0 = tc * tile_cols;
    const index_t r1 = r0 + tile_rows < rows ? r0 + tile_rows : rows;
    const index_t c1 = c0 + tile_cols < cols ? c0 + tile_cols : cols;
    f(tile2d{r0, r1, c0, c1, tr, tc});
  }
};
}  // namespace detail

//! Calls f(tile2d) once for every tile of [0, rows) x [0, cols), tiles in parallel. Edge tiles
//! are clipped (never padded). Same completion semantics as for_each_index.
//! @throws loom::error(invalid_argument) for negative extents or non-positive tile sizes.
template <backend B, class F>
void for_each_tile(const B& b, index_t rows, index_t cols, tile_shape tile, const F& f) {
  LOOM_EXPECTS(rows >= 0 && cols >= 0, errc::invalid_argument, "for_each_tile: rows and cols must be >= 0, got ", rows,
               " x ", cols);
  LOOM_EXPECTS(tile.rows > 0 && tile.cols > 0, errc::invalid_argument, "for_each_tile: tile sizes must be > 0, got ",
               tile.rows, " x ", tile.cols);
  const index_t grid_rows = (rows + tile.rows - 1) / tile.rows;
  const index_t grid_cols = (cols + tile.cols - 1) / tile.cols;
  if (grid_rows == 0 || grid_cols == 0) return;
  detail::parallel_impl<B>::for_each(b, grid_rows * grid_cols,
                                     detail::tile_body<F>{rows, cols, tile.rows, tile.cols, grid_cols, f});
}

//! The largest team_size for_each_team accepts on b: 1 on serial (one thread); the backend's
//! thread count on openmp; 1024 on cuda; the execution space's limit on kokkos; 32 on the stand-in.
template <backend B>
int team_size_max(const B& b) {
  return detail::parallel_impl<B>::team_size_max(b);
}

//! The team size for_each_team runs when the policy says 0: 1 on host backends (a team per
//! thread), 128 on cuda, Kokkos::AUTO's choice on kokkos, 4 on the stand-in.
template <backend B>
int team_size_recommended(const B& b) {
  return detail::parallel_impl<B>::team_size_recommended(b);
}

//! Cooperative work: calls f(m) once for every member m of every team, league ranks
//! [0, p.league_size), team_size members per team (p.team_size, or team_size_recommended(b) for 0).
//! A member's handle m has league_rank(), league_size(), team_rank(), team_size(), scratch() (the
//! team's p.scratch_bytes, shared by its members, aligned to team_scratch_alignment, contents
//! undefined at the start of each league rank) and barrier() (every member of the team waits until
//! all arrive; writes before it are visible after it; every member must call it the same number of
//! times). Teams run concurrently in any order; a body must not wait on another team. f is one
//! LOOM_HD body for every backend: `template <class M> LOOM_HD void operator()(const M& m) const`.
//! Mapping: cuda: a block of team_size threads per team, scratch in shared memory, barrier
//! __syncthreads(); openmp: team_size threads of one parallel region per team, up to threads /
//! team_size teams at once taking league ranks dynamically, a barrier that sleeps rather than spins;
//! kokkos: Kokkos::TeamPolicy with level-0 team scratch and team_barrier(); serial: teams of one
//! member in league order; stand-in: one team at a time on team_size threads of its own.
//! Completion as for_each_index (stream-ordered on cuda and the stand-in). On host backends the
//! scratch comes from a per-thread block that only grows: a call allocates only when it asks for
//! more scratch than any call before it on that thread.
//! @throws loom::error(invalid_argument) if league_size < 0, team_size is outside
//!   [0, team_size_max(b)] or scratch_bytes exceeds the backend's limit (48 KiB on cuda and the
//!   stand-in); (unsupported) if OpenMP runs fewer threads than a team needs.
template <backend B, class F>
void for_each_team(const B& b, const team_policy& p, const F& f) {
  using impl = detail::parallel_impl<B>;
  const int size =
      detail::checked_team_size(p, impl::team_size_recommended(b), impl::team_size_max(b), impl::team_scratch_max(b));
  if (p.league_size == 0) return;
  impl::for_each_team(b, p, size, f);
}

namespace detail {
//! p[0..n) = v on b (stream-ordered like for_each_index; nothing for n == 0).
template <backend B, class T>
void fill(const B& b, T* p, index_t n, T v) {
  if (n > 0) for_each_index(b, n, fill_kernel<T>{p, v});
}
}  // namespace detail

}  // namespace loom
