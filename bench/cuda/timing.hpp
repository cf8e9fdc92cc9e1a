#pragma once

// Timing of stream-ordered work on the GPU for loom's CUDA benchmarks: CUDA events on the default
// stream around each call, the median of the timed calls after warm-up.

#include <loom/backend/cuda.hpp>

#include <algorithm>
#include <vector>

namespace loom::bench {

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
