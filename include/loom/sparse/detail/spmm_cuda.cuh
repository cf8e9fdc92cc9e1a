#pragma once

//! @file
//! loom::sparse::spmm for the tiled bitmap format on loom::cuda: the team body of kernels.hpp
//! (bitmap_team_kernel, "load as sparse, compute as dense") through loom::for_each_team, one
//! block of tile_cols (64) threads per work item, its dense tile and results in shared memory.
//! The same body runs on every host backend in the tests, with teams of 1 to 32 members. csr and
//! n_m run the generic kernels of kernels.hpp through for_each_index. Compiled by nvcc in CI; not
//! run there.

#include <loom/backend/cuda.hpp>
#include <loom/sparse/detail/dispatch.hpp>

namespace loom::sparse::detail {

template <class TA>
struct spmm_runner<cuda, bitmap_view<TA, cuda_memory>> {
  template <class TC, class Acc, class Hook>
  static void run(const cuda& b, const bitmap_kernel<TA, cuda_memory, TC, Acc, Hook>& kernel, index_t items) {
    run_bitmap_teams(b, kernel, items, static_cast<int>(tile_cols));
  }
};

}  // namespace loom::sparse::detail
