#pragma once

// Device memory for the communicator tests on a GPU: the conformance suite's `mirror` on
// cuda_memory (device_memory<cuda_memory>), and `device_array`, n elements of T on the current
// device filled from and read back into host vectors. Included by .cu test units only.

#include <loom/backend/cuda.hpp>

#include <comm/conformance.hpp>
#include <cstddef>
#include <vector>

namespace loom::test {

template <>
struct device_memory<cuda_memory> {
  static constexpr bool separate = true;
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    LOOM_CUDA_TRY(cudaMalloc(&p, bytes));
    return p;
  }
  static void free(void* p) noexcept { cudaFree(p); }
  // cudaMemcpy from pageable memory may return before its DMA lands, and it is ordered only with
  // the legacy default stream: the device sync lets a rank's non-blocking stream read the bytes.
  static void upload(void* dst, const void* src, std::size_t bytes) {
    LOOM_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    LOOM_CUDA_TRY(cudaDeviceSynchronize());
  }
  static void download(void* dst, const void* src, std::size_t bytes) {
    LOOM_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
};

//! n elements of T on the current device, filled from a host vector.
template <class T>
class device_array {
 public:
  explicit device_array(const std::vector<T>& init) : n_(init.size()) {
    p_ = static_cast<T*>(device_memory<cuda_memory>::allocate(n_ * sizeof(T) + 1));
    device_memory<cuda_memory>::upload(p_, init.data(), n_ * sizeof(T));
  }
  explicit device_array(std::size_t n) : device_array(std::vector<T>(n)) {}
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { device_memory<cuda_memory>::free(p_); }
  T* data() const { return p_; }
  std::size_t size() const { return n_; }
  //! A host copy (synchronous: after the device's work on it).
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    LOOM_CUDA_TRY(cudaDeviceSynchronize());
    device_memory<cuda_memory>::download(h.data(), p_, n_ * sizeof(T));
    return h;
  }

 private:
  std::size_t n_;
  T* p_ = nullptr;
};

}  // namespace loom::test
