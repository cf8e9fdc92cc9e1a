#pragma once

//! @file
//! The CUDA kernel of loom::sparse::spmm for the tiled bitmap format ("load as sparse, compute as
//! dense"): one thread block of tile_cols (64) threads per work item (band of tile_rows output rows
//! x up to n_block output columns). For each tile of the band, thread j expands bit j of every
//! tile row into a dense tile in shared memory (packed_position: the lane form of the decode of
//! detail/tile.hpp, the same format logic the CPU kernels use), then thread j accumulates output
//! column j0 + j for the band's rows over the dense tile against a row-major B panel, coalesced
//! across the block. The epilogue is the CPU one (epilogue::store). csr and n_m run the generic
//! kernels of kernels.hpp through for_each_index. Compiled by nvcc in CI; not run there.

#include <loom/backend/cuda.hpp>
#include <loom/sparse/detail/dispatch.hpp>

namespace loom::sparse::detail {

template <class TA, class TC, class Acc>
__global__ void __launch_bounds__(tile_cols)
    bitmap_spmm_kernel(bitmap_view<TA, cuda_memory> a, spmm_common<TC, Acc> k) {
  __shared__ Acc dense[tile_rows][tile_cols];
  __shared__ Acc result[tile_rows][n_block];
  const index_t band = blockIdx.x, j0 = static_cast<index_t>(blockIdx.y) * n_block;
  const index_t nb = min_index(n_block, k.n - j0);
  const int lane = static_cast<int>(threadIdx.x);
  Acc acc[tile_rows];
  for (index_t r = 0; r < tile_rows; ++r) acc[r] = Acc(0);
  const index_t gc = a.grid_cols();
  for (index_t tc = 0; tc < gc; ++tc) {
    const index_t t = band * gc + tc;
    index_t p = a.tile_offsets[t];
    if (a.tile_offsets[t + 1] == p) continue;  // empty tile: uniform across the block
    for (index_t r = 0; r < tile_rows; ++r) {
      const std::uint64_t m = a.masks[t * tile_rows + r];
      const bool set = (m >> lane) & 1u;
      dense[r][lane] = set ? to_acc<Acc>(a.values[p + packed_position(m, lane)]) : Acc(0);
      p += popcount64(m);
    }
    __syncthreads();
    if (lane < nb) {
      const index_t width = min_index(tile_cols, a.cols - tc * tile_cols);
      const Acc* bt = k.b + tc * tile_cols * k.ldb + j0 + lane;
      for (index_t c = 0; c < width; ++c) {
        const Acc x = bt[c * k.ldb];
        for (index_t r = 0; r < tile_rows; ++r) acc[r] += dense[r][c] * x;
      }
    }
    __syncthreads();
  }
  for (index_t r = 0; r < tile_rows; ++r) result[r][lane] = acc[r];
  __syncthreads();
  if (lane < tile_rows && band * tile_rows + lane < a.rows)
    k.out.store(band * tile_rows + lane, j0, nb, &result[lane][0]);
}

template <class TA>
struct spmm_runner<cuda, bitmap_view<TA, cuda_memory>> {
  template <class TC, class Acc, class Hook>
  static void run(const cuda& b, const bitmap_kernel<TA, cuda_memory, TC, Acc, Hook>& kernel, index_t items) {
    const index_t bands = (kernel.a.rows + tile_rows - 1) / tile_rows;
    if (items == 0) return;
    const dim3 grid(static_cast<unsigned>(bands), static_cast<unsigned>(kernel.k.n_chunks));
    bitmap_spmm_kernel<TA, TC, Acc><<<grid, static_cast<unsigned>(tile_cols), 0, b.stream>>>(kernel.a, kernel.k);
    LOOM_CUDA_TRY(cudaGetLastError());
  }
};

}  // namespace loom::sparse::detail
