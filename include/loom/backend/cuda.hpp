#pragma once

//! @file
//! loom::cuda: a CUDA stream. Host-compilable; the kernels (backend/detail/parallel_cuda.cuh) are
//! pulled in only when nvcc compiles the translation unit. Link loom::cuda.

#include <loom/backend/temporary.hpp>
#include <loom/backend/traits.hpp>
#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>

namespace loom {

//! Work is enqueued on `stream` (0: the legacy default stream). Data must be device-accessible.
struct cuda {
  cudaStream_t stream = nullptr;
};

namespace detail {
inline void cuda_check(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess)
    fail(errc::internal, concat(what, " failed: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status)), file,
         line);
}
}  // namespace detail

template <>
struct backend_traits<cuda> {
  using memory_space = cuda_memory;
  static constexpr std::string_view name() noexcept { return "cuda"; }
  static void fence(const cuda& b) {
    detail::cuda_check(cudaStreamSynchronize(b.stream), "cudaStreamSynchronize", __FILE__, __LINE__);
  }
  static int concurrency(const cuda&) {
    int device = 0, sms = 0;
    detail::cuda_check(cudaGetDevice(&device), "cudaGetDevice", __FILE__, __LINE__);
    detail::cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute",
                       __FILE__, __LINE__);
    return sms;
  }
  //! loom::copy_bytes: cudaMemcpyAsync on the stream (either side host or device).
  static void copy(const cuda& b, void* dst, const void* src, std::size_t bytes) {
    detail::cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, b.stream), "cudaMemcpyAsync", __FILE__,
                       __LINE__);
  }
};

//! Stream-ordered device scratch: allocated and freed on the policy's stream.
template <class T>
class temporary_buffer<cuda, T, cuda_memory> {
 public:
  temporary_buffer(const cuda& b, index_t count) : stream_(b.stream), count_(count > 0 ? count : 0) {
    const auto bytes = sizeof(T) * static_cast<std::size_t>(count > 0 ? count : 1);
    detail::cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&data_), bytes, stream_), "cudaMallocAsync", __FILE__,
                       __LINE__);
    detail::temporary_counter().fetch_add(1, std::memory_order_relaxed);
  }
  temporary_buffer(const temporary_buffer&) = delete;
  temporary_buffer& operator=(const temporary_buffer&) = delete;
  ~temporary_buffer() { cudaFreeAsync(data_, stream_); }
  T* data() const noexcept { return data_; }
  std::span<std::byte> bytes() const noexcept {
    return {reinterpret_cast<std::byte*>(data_), sizeof(T) * static_cast<std::size_t>(count_)};
  }

 private:
  cudaStream_t stream_;
  index_t count_;
  T* data_ = nullptr;
};

}  // namespace loom

//! Throws loom::error(internal) naming the call when a CUDA runtime call fails.
#define LOOM_CUDA_TRY(call) ::loom::detail::cuda_check((call), #call, __FILE__, __LINE__)

#if defined(__CUDACC__)
#include <loom/backend/detail/parallel_cuda.cuh>
#endif
