#pragma once

//! @file
//! Which path multiplies a sparse weight fastest on this GPU, measured rather than modelled: a
//! dense cuBLAS GEMM (cublasGemmEx on a dense matrix of A's shape; its values do not change the
//! time), cuSPARSE's CSR SpMM (sparse::cusparse) or loom's bitmap kernel (sparse::spmm on
//! loom::cuda), each timed with CUDA events on the backend's stream:
//!
//!   loom::sparse::device_chooser chooser;                       // one per process (thread-safe)
//!   auto c = chooser.pick(b, a_csr, a_bitmap, nnz, n);          // measures on first use of a shape
//!   if (c.pick == loom::sparse::device_path::csr_cusparse) ...  // then looks up
//!
//! Compile with nvcc; link loom::cusparse and loom::cublas. On both GPU runs so far (docs/gpu.md: an H100 on
//! 2026-11-23 and an H200 on 2026-11-28, commit 29324c3) loom's bitmap kernel ran at 0.05-0.26x cublasSgemm, and
//! sparse::h100_fp32_model (chooser.hpp) picks the dense GEMM at every sparsity a pruned LLM weight
//! has; this chooser measures the three paths on the caller's device instead. Measuring allocates
//! B, C, a dense A and the workspaces (device memory, freed on return) and synchronises the stream;
//! later picks of the same shape do neither.

#include <loom/backend/cuda.hpp>
#include <loom/backend/detail/cublas_handle.hpp>
#include <loom/backend/detail/cuda_vendor.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/sparse/chooser.hpp>
#include <loom/sparse/cusparse.hpp>
#include <loom/sparse/spmm.hpp>

#include <cmath>
#include <cstddef>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>

namespace loom::sparse {

//! The paths device_chooser ranks.
enum class device_path { dense_cublas, csr_cusparse, bitmap_loom };

//! What measure_device_paths found: the fastest path and each one's best time per product (s).
struct device_choice {
  device_path pick;
  double dense_seconds;
  double csr_seconds;
  double bitmap_seconds;
};

namespace detail {

//! The fastest of the three times; on a tie the dense GEMM, then CSR (the vendors' paths first).
inline device_path fastest(double dense, double csr, double bitmap) {
  if (dense <= csr && dense <= bitmap) return device_path::dense_cublas;
  return csr <= bitmap ? device_path::csr_cusparse : device_path::bitmap_loom;
}

//! The density of an M x K weight holding nnz entries, in whole percent (the chooser's key).
inline int density_percent(index_t nnz, index_t m, index_t k) {
  const double cells = static_cast<double>(m) * static_cast<double>(k);
  return cells > 0 ? static_cast<int>(std::lround(100.0 * static_cast<double>(nnz) / cells)) : 0;
}

//! The best of `reps` timed calls of f (after one untimed) on b.stream, in seconds.
template <class F>
double best_seconds(const loom::cuda& b, int reps, F&& f) {
  f();
  cudaEvent_t start, stop;
  LOOM_CUDA_TRY(cudaEventCreate(&start));
  LOOM_CUDA_TRY(cudaEventCreate(&stop));
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    LOOM_CUDA_TRY(cudaEventRecord(start, b.stream));
    f();
    LOOM_CUDA_TRY(cudaEventRecord(stop, b.stream));
    LOOM_CUDA_TRY(cudaEventSynchronize(stop));
    float ms = 0;
    LOOM_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop));
    best = r == 0 ? ms * 1e-3 : std::min(best, ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

}  // namespace detail

//! Times C = A B (row-major B: K x n, C: M x n, of T) on b's device three ways: cublasGemmEx on a
//! dense M x K matrix, sparse::cusparse::spmm on a_csr, sparse::spmm on a_bitmap (the same weight in
//! device memory); picks the fastest (ties: dense, then CSR).
//! @throws loom::error(shape_mismatch) the two forms' extents differ; (invalid_argument) n <= 0 or
//!   repetitions <= 0; as the three paths.
template <class T>
device_choice measure_device_paths(const loom::cuda& b, const csr_view<T, cuda_memory>& a_csr,
                                   const bitmap_view<T, cuda_memory>& a_bitmap, index_t n,
                                   const measure_options& opt = {}) {
  constexpr std::string_view call = "sparse::measure_device_paths";
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, loom::bfloat16> || std::is_same_v<T, loom::half>,
                "sparse::measure_device_paths: float, bfloat16 or half weights");
  LOOM_EXPECTS(a_csr.rows == a_bitmap.rows && a_csr.cols == a_bitmap.cols, errc::shape_mismatch, call,
               ": a_csr and a_bitmap must have the same extents, got ", a_csr.rows, " x ", a_csr.cols, " and ",
               a_bitmap.rows, " x ", a_bitmap.cols);
  LOOM_EXPECTS(n > 0, errc::invalid_argument, call, ": n must be > 0, got ", n);
  LOOM_EXPECTS(opt.repetitions > 0, errc::invalid_argument, call, ": repetitions must be > 0, got ", opt.repetitions);
  const index_t m = a_csr.rows, k = a_csr.cols;
  const temporary_buffer<loom::cuda, T> bm(b, k * n), c(b, m * n), dense(b, m * k);
  LOOM_CUDA_TRY(cudaMemsetAsync(bm.data(), 0, sizeof(T) * static_cast<std::size_t>(k * n), b.stream));
  LOOM_CUDA_TRY(cudaMemsetAsync(dense.data(), 0, sizeof(T) * static_cast<std::size_t>(m * k), b.stream));
  const tensor_view<const T, 2, cuda_memory> bv(bm.data(), {k, n});
  const tensor_view<T, 2, cuda_memory> cv(c.data(), {m, n});

  const loom::detail::cublas_handle h(call);
  loom::detail::check_cublas(cublasSetStream(h.get(), b.stream), call, "cublasSetStream");
  const float one = 1, zero = 0;
  // Row-major C (M x n) = A (M x K) B (K x n) is column-major C^T = B^T A^T.
  const double t_dense = detail::best_seconds(b, opt.repetitions, [&] {
    loom::detail::check_cublas(
        cublasGemmEx(h.get(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                     &one, bm.data(), loom::detail::cuda_data_type<T>(), static_cast<int>(n), dense.data(),
                     loom::detail::cuda_data_type<T>(), static_cast<int>(k), &zero, c.data(),
                     loom::detail::cuda_data_type<T>(), static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        call, "cublasGemmEx");
  });
  const auto csr_plan = cusparse::make_plan(b, a_csr, n);
  const temporary_buffer<loom::cuda, std::byte> csr_ws(b, static_cast<index_t>(csr_plan.workspace_bytes()));
  const double t_csr =
      detail::best_seconds(b, opt.repetitions, [&] { cusparse::spmm(b, csr_plan, a_csr, bv, cv, csr_ws.bytes()); });
  const auto bitmap_plan = make_plan(b, a_bitmap, n);
  const temporary_buffer<loom::cuda, std::byte> bitmap_ws(b, static_cast<index_t>(bitmap_plan.workspace_bytes()));
  const double t_bitmap =
      detail::best_seconds(b, opt.repetitions, [&] { spmm(b, bitmap_plan, a_bitmap, bv, cv, bitmap_ws.bytes()); });
  fence(b);
  return {detail::fastest(t_dense, t_csr, t_bitmap), t_dense, t_csr, t_bitmap};
}

//! measure_device_paths once per (device, element type, M, K, N, density to 1 %), its answers kept
//! for later calls. Thread-safe.
class device_chooser {
 public:
  //! The measured choice for this shape on the current device, measuring on first use.
  //! `nnz`: a_csr's entries (the caller knows it; reading it from device memory would sync).
  //! @throws as measure_device_paths.
  template <class T>
  device_choice pick(const loom::cuda& b, const csr_view<T, cuda_memory>& a_csr,
                     const bitmap_view<T, cuda_memory>& a_bitmap, index_t nnz, index_t n,
                     const measure_options& opt = {}) {
    const key kk{loom::detail::current_cuda_device(),
                 typeid(T).hash_code(),
                 a_csr.rows,
                 a_csr.cols,
                 n,
                 detail::density_percent(nnz, a_csr.rows, a_csr.cols)};
    return cache_.get(kk, [&] { return measure_device_paths(b, a_csr, a_bitmap, n, opt); });
  }

  //! How many shapes were measured (not looked up) so far.
  std::size_t measured() const { return cache_.measured(); }

 private:
  using key = std::tuple<int, std::size_t, index_t, index_t, index_t, int>;
  detail::measured_cache<key, device_choice> cache_;
};

}  // namespace loom::sparse
