#pragma once

// What loom's CUDA benchmarks share: device arrays from loom's stream-ordered scratch, and the
// timing of stream-ordered work (CUDA events on the default stream around each call, the median
// of the timed calls after warm-up).

#include <loom/backend/cuda.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace loom::bench {

//! Device memory from loom's stream-ordered scratch (default stream), optionally filled from the host.
template <class T>
struct device_array : loom::temporary_buffer<loom::cuda, T> {
  explicit device_array(std::size_t count)
      : loom::temporary_buffer<loom::cuda, T>(loom::cuda{}, static_cast<index_t>(count)) {}
  explicit device_array(const std::vector<T>& h) : device_array(h.size()) {
    LOOM_CUDA_TRY(cudaMemcpy(this->data(), h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  }
};

//! Median milliseconds of `reps` calls of f after `warm` untimed ones.
template <class F>
double median_ms(F&& f, int warm = 3, int reps = 15) {
  for (int i = 0; i < warm; ++i) f();
  LOOM_CUDA_TRY(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  LOOM_CUDA_TRY(cudaEventCreate(&a));
  LOOM_CUDA_TRY(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    LOOM_CUDA_TRY(cudaEventRecord(a));
    f();
    LOOM_CUDA_TRY(cudaEventRecord(b));
    LOOM_CUDA_TRY(cudaEventSynchronize(b));
    float t = 0;
    LOOM_CUDA_TRY(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace loom::bench
