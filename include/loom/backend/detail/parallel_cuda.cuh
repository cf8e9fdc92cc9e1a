#pragma once

//! @file
//! The generic loops as CUDA kernels on the policy's stream. for_each is stream-ordered (no
//! synchronisation); reduce returns a host value and so synchronises the stream. Each reduce block
//! is folded by one thread in index order, so the combination order is exactly the CPU one.

#include <loom/backend/cuda.hpp>
#include <loom/backend/detail/blocking.hpp>

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

template <>
struct parallel_impl<cuda> {
  static constexpr int threads_per_block = 256;

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
