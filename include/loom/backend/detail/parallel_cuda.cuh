#pragma once

//! @file
//! The generic loops as CUDA kernels on the policy's stream. for_each is stream-ordered (no
//! synchronisation); reduce returns a host value and so synchronises the stream. Each reduce block
//! is folded by one thread in index order, so the combination order is exactly the CPU one.

#include <loom/backend/cuda.hpp>
#include <loom/backend/detail/blocking.hpp>
#include <loom/backend/detail/team.hpp>

#include <cuda_runtime_api.h>

#include <type_traits>

namespace loom::detail {

template <class F>
__global__ void for_each_index_kernel(index_t n, F f) {
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

template <class P, class Op, class F>
__global__ void fold_blocks_kernel(reduce_blocking blk, Op op, F f, P* partial) {
  const index_t k = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < blk.blocks) partial[k] = fold_block(blk, k, op, f);
}

//! The handle of a member of a CUDA team (for_each_team): a block. Its host pass (a LOOM_HD body
//! compiles for the host too) is a team of one; it runs on the device.
struct cuda_team_member {
  index_t league_rank_, league_size_;
  void* shared;
  LOOM_HD index_t league_rank() const { return league_rank_; }
  LOOM_HD index_t league_size() const { return league_size_; }
  LOOM_HD void* scratch() const { return shared; }
#if defined(__CUDA_ARCH__)
  LOOM_HD int team_rank() const { return static_cast<int>(threadIdx.x); }
  LOOM_HD int team_size() const { return static_cast<int>(blockDim.x); }
  LOOM_HD void barrier() const { __syncthreads(); }
#else
  LOOM_HD int team_rank() const { return 0; }
  LOOM_HD int team_size() const { return 1; }
  LOOM_HD void barrier() const {}
#endif
};

template <class F>
__global__ void for_each_team_kernel(index_t league, F f) {
  extern __shared__ __align__(16) unsigned char team_shared[];
  for (index_t l = blockIdx.x; l < league; l += gridDim.x) {
    f(cuda_team_member{l, league, team_shared});
    __syncthreads();  // the next league rank reuses the shared memory
  }
}

template <>
struct parallel_impl<cuda> {
  static constexpr int threads_per_block = 256;

  static int team_size_max(const cuda&) noexcept { return 1024; }
  static int team_size_recommended(const cuda&) noexcept { return 128; }
  static std::size_t team_scratch_max(const cuda&) noexcept { return std::size_t{48} << 10; }
  template <class F>
  static void for_each_team(const cuda& b, const team_policy& p, int size, const F& f) {
    const index_t grid = p.league_size < (index_t{1} << 20) ? p.league_size : (index_t{1} << 20);
    // Whole alignment units: the compiler may read the scratch in aligned 16-byte vectors (an
    // 8-byte tail would be read past), and the members may too.
    const std::size_t shared =
        (p.scratch_bytes + team_scratch_alignment - 1) / team_scratch_alignment * team_scratch_alignment;
    for_each_team_kernel<<<static_cast<unsigned>(grid), static_cast<unsigned>(size), shared, b.stream>>>(p.league_size,
                                                                                                         f);
    LOOM_CUDA_TRY(cudaGetLastError());
  }

  template <class F>
  static void for_each(const cuda& b, index_t n, const F& f) {
    if (n == 0) return;
    const index_t want = (n + threads_per_block - 1) / threads_per_block;
    const unsigned grid = static_cast<unsigned>(want < 65535 * 32 ? want : 65535 * 32);
    for_each_index_kernel<<<grid, threads_per_block, 0, b.stream>>>(n, f);
    LOOM_CUDA_TRY(cudaGetLastError());
  }

  template <class T, class Op, class F>
  static T reduce(const cuda& b, index_t n, T init, const Op& op, const F& f) {
    const reduce_blocking blk(n);
    if (blk.blocks == 0) return init;
    using P = std::remove_cvref_t<decltype(fold_block(blk, 0, op, f))>;
    static_assert(std::is_trivially_copyable_v<P>, "loom::reduce on cuda needs a trivially copyable value type");
    P* dev = nullptr;
    LOOM_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&dev), sizeof(P) * blk.blocks, b.stream));
    fold_blocks_kernel<<<1, reduce_blocking::max_blocks, 0, b.stream>>>(blk, op, f, dev);
    LOOM_CUDA_TRY(cudaGetLastError());
    P host[reduce_blocking::max_blocks];
    LOOM_CUDA_TRY(cudaMemcpyAsync(host, dev, sizeof(P) * blk.blocks, cudaMemcpyDeviceToHost, b.stream));
    LOOM_CUDA_TRY(cudaFreeAsync(dev, b.stream));
    LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
    for (index_t k = 0; k < blk.blocks; ++k) init = op(init, host[k]);
    return init;
  }
};

}  // namespace loom::detail
