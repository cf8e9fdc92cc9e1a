#pragma once

//! @file
//! loom::sparse::choose: whether a weight of a given sparsity is better multiplied as a tiled
//! bitmap with loom::sparse::spmm or as a dense GEMM, from (sparsity, N, element size) and a
//! two-term cost model of each path. Both paths are bound by the larger of two times:
//!
//!   dense:  max(e M K / dense_bandwidth,                 2 M K N / gemm_rate)
//!   bitmap: max((e (1 - s) + 9/64) M K / bandwidth,      tiles ceil(N / 32) (tile + cols(s, N) column))
//!
//! e is the element size, s the sparsity, tiles = (1 - s^512) M K / 512 (the tiles holding a
//! nonzero, for randomly placed zeros). The bitmap kernel expands each nonempty 8 x 64
//! tile (a fixed cost per tile, whatever its sparsity) and, for N >= 2, multiplies every column of
//! the tile that holds a nonzero in any of its 8 rows by a row of B, 32 output columns at a time:
//! cols(s, N) = 64 (1 - s^8) for randomly placed zeros, 0 for N = 1. The defaults are calibrated on
//! the benchmark machine of docs/performance.md (2 cores, openmp 2 threads, AVX-512 kernels,
//! OpenBLAS sgemm; see docs/sparse.md); pass a cost_model measured on yours.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace loom::sparse {

//! Machine figures the chooser needs. Rates and times are for the whole team of threads.
struct cost_model {
  double bandwidth_gbs = 44.0;        //!< read bandwidth the bitmap kernel streams A at (GB/s)
  double dense_bandwidth_gbs = 18.7;  //!< read bandwidth of the dense GEMM at N = 1 (GB/s)
  double gemm_gflops = 180.0;         //!< dense GEMM rate at large N (GFLOP/s)
  double tile_ns = 21.0;              //!< expanding one 8 x 64 tile (ns)
  double column_ns = 0.9;             //!< one tile column times up to 32 columns of B, 8 rows (ns)
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
  LOOM_EXPECTS(model.bandwidth_gbs > 0 && model.dense_bandwidth_gbs > 0 && model.gemm_gflops > 0 &&
                   model.tile_ns >= 0 && model.column_ns >= 0,
               errc::invalid_argument,
               "choose: cost_model bandwidths and GEMM rate must be > 0 and the kernel times >= 0");
  const double mk = static_cast<double>(m) * static_cast<double>(k), e = static_cast<double>(element_bytes);
  const double nn = static_cast<double>(n), groups = std::ceil(nn / 32.0);
  const double tiles = mk / 512.0 * (1.0 - std::pow(sparsity, 512.0));  // empty tiles are skipped
  const double cols = n == 1 ? 0.0 : 64.0 * (1.0 - std::pow(sparsity, 8.0));
  const double dense = std::max(e * mk / (model.dense_bandwidth_gbs * 1e9), 2.0 * mk * nn / (model.gemm_gflops * 1e9));
  const double sparse = std::max((e * (1.0 - sparsity) + 9.0 / 64.0) * mk / (model.bandwidth_gbs * 1e9),
                                 tiles * groups * (model.tile_ns + cols * model.column_ns) * 1e-9);
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
