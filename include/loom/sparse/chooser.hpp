#pragma once

//! @file
//! loom::sparse::choose: whether a weight of a given sparsity is better multiplied as a tiled
//! bitmap with loom::sparse::spmm or as a dense GEMM, from (sparsity, N, element size) and a
//! two-term cost model of each path. Both paths are bound by the larger of two times:
//!
//!   dense:  max(bytes(A) / bandwidth,                        2 M K N / gemm_rate)
//!   bitmap: max((e (1 - s) + 9/64) M K / bandwidth,           nnz (decode + N * fma) / threads)
//!
//! where e is the element size, s the sparsity, nnz = (1 - s) M K, and the bitmap's compute term
//! is its per-nonzero decode cost plus one multiply-add per output column (the sparse kernel skips
//! zeros, so it does (1 - s) of the dense FLOPs, but at a lower rate than a tuned GEMM). The
//! defaults are calibrated on the benchmark machine of docs/performance.md (2 cores, openmp 2
//! threads, OpenBLAS sgemm); pass a cost_model measured on yours.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <cstddef>

namespace loom::sparse {

//! Machine figures the chooser needs. Rates are for the whole team of threads.
struct cost_model {
  double bandwidth_gbs = 17.5;  //!< streaming read bandwidth for A (GB/s)
  double gemm_gflops = 60.0;    //!< dense GEMM rate at the skinny N of decoding (GFLOP/s)
  double decode_ns = 0.95;      //!< bitmap decode per stored nonzero (ns, whole team)
  double fma_ns = 0.2;          //!< one multiply-add row element per nonzero and column (ns, whole team)
};

//! What choose() picked, with both predicted times (seconds) for M x K x N.
struct choice {
  enum class path { dense_gemm, bitmap_spmm } pick;
  double dense_seconds;
  double sparse_seconds;
};

//! Picks dense GEMM or bitmap SpMM for an M x K weight with `sparsity` zeros times a K x N
//! activation of `element_bytes` per element.
//! @throws loom::error(invalid_argument) for sparsity outside [0, 1], non-positive sizes.
inline choice choose(double sparsity, index_t m, index_t k, index_t n, std::size_t element_bytes,
                     const cost_model& model = {}) {
  LOOM_EXPECTS(sparsity >= 0.0 && sparsity <= 1.0, errc::invalid_argument, "choose: sparsity must be in [0, 1], got ",
               sparsity);
  LOOM_EXPECTS(m > 0 && k > 0 && n > 0, errc::invalid_argument, "choose: m, k, n must be > 0, got ", m, ", ", k, ", ",
               n);
  LOOM_EXPECTS(element_bytes > 0, errc::invalid_argument, "choose: element_bytes must be > 0");
  const double mk = static_cast<double>(m) * static_cast<double>(k), e = static_cast<double>(element_bytes);
  const double nn = static_cast<double>(n), nnz = (1.0 - sparsity) * mk;
  const double dense = std::max(e * mk / (model.bandwidth_gbs * 1e9), 2.0 * mk * nn / (model.gemm_gflops * 1e9));
  const double sparse = std::max((e * (1.0 - sparsity) + 9.0 / 64.0) * mk / (model.bandwidth_gbs * 1e9),
                                 nnz * (model.decode_ns + nn * model.fma_ns) * 1e-9);
  return {sparse < dense ? choice::path::bitmap_spmm : choice::path::dense_gemm, dense, sparse};
}

//! The smallest sparsity (to 0.5 %) at which choose() picks the bitmap path, or 1.0 if none.
inline double crossover_sparsity(index_t m, index_t k, index_t n, std::size_t element_bytes,
                                 const cost_model& model = {}) {
  for (int pct = 0; pct <= 200; ++pct)
    if (choose(pct / 200.0, m, k, n, element_bytes, model).pick == choice::path::bitmap_spmm) return pct / 200.0;
  return 1.0;
}

}  // namespace loom::sparse
