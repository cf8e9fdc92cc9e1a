#pragma once

//! @file
//! loom::sparse::choose: whether a weight of a given sparsity is better multiplied as a tiled
//! bitmap with loom::sparse::spmm or as a dense GEMM, from (sparsity, N, element size) and a
//! two-term cost model of each path. Both paths are bound by the larger of two times:
//!
//!   dense:  max(e M K / dense_bandwidth,                 2 M K N / gemm_rate)
//!   bitmap: max((e (1 - s) + 9/64) M K / bandwidth,      tiles ceil(N / c) (tile + cols(s, N) column))
//!
//! e is the element size, s the sparsity, tiles = (1 - s^512) M K / 512 (the tiles holding a
//! nonzero, for randomly placed zeros). The bitmap kernel expands each nonempty 8 x 64
//! tile (a fixed cost per tile, whatever its sparsity) and, for N >= 2, multiplies every column of
//! the tile that holds a nonzero in any of its 8 rows by a row of B, c = columns_per_pass output
//! columns at a time (32 on the host, 64 on loom::cuda):
//! cols(s, N) = 64 (1 - s^8) for randomly placed zeros, 0 for N = 1. The defaults are calibrated on
//! the benchmark machine of docs/performance.md (2 cores, openmp 2 threads, AVX-512 kernels,
//! OpenBLAS sgemm; see docs/sparse.md); pass a cost_model measured on yours.
//!
//! Between loom's own formats the choice is measured, not modelled: measure_formats times spmm
//! with the weight held as CSR and as a tiled bitmap on this machine, this backend and this N, and
//! format_chooser does that once per (backend, M, K, N, density to 1 %) and keeps the answer, so a
//! model calibrates itself at first use. Which format wins moves with the ISA (AVX-512 or AVX2
//! kernels), the sparsity and N; see docs/sparse.md for the figures on the benchmark machines.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/core/workspace.hpp>
#include <loom/sparse/formats.hpp>
#include <loom/sparse/spmm.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <typeinfo>
#include <vector>

namespace loom::sparse {

//! Machine figures the chooser needs. Rates and times are for the whole team of threads.
struct cost_model {
  double bandwidth_gbs = 44.0;        //!< read bandwidth the bitmap kernel streams A at (GB/s)
  double dense_bandwidth_gbs = 18.7;  //!< read bandwidth of the dense GEMM at N = 1 (GB/s)
  double gemm_gflops = 180.0;         //!< dense GEMM rate at large N (GFLOP/s)
  double tile_ns = 21.0;              //!< expanding one 8 x 64 tile (ns)
  double column_ns = 0.9;             //!< one tile column times up to `columns_per_pass` columns of B, 8 rows (ns)
  double columns_per_pass = 32.0;     //!< columns of B one pass over a tile multiplies (host 32, cuda 64)
};

//! The model fitted to the H100 run of 2026-11-23 (docs/gpu.md, its Bitmap SpMM table; commits
//! 47efad8, d6dcb58): fp32, cublasSgemm as the dense path, loom's bitmap kernel on loom::cuda (one
//! block per 8-row band and 64 columns of B), M = 4096, K = 4096 and 11008, N = 1, 16, 64, 50 and
//! 90 % zeros. It predicts those 18 measured times within 0.55x-1.12x (the 6 GEMMs) and
//! 0.69x-1.15x (the 12 bitmap products), tested, and picks the dense GEMM in every cell, as
//! measured (the bitmap kernel ran at 0.09-0.26x cublasSgemm there).
inline constexpr cost_model h100_fp32_model{.bandwidth_gbs = 2500.0,
                                            .dense_bandwidth_gbs = 2200.0,
                                            .gemm_gflops = 35000.0,
                                            .tile_ns = 6.6,
                                            .column_ns = 0.05,
                                            .columns_per_pass = 64.0};

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
                   model.tile_ns >= 0 && model.column_ns >= 0 && model.columns_per_pass >= 1,
               errc::invalid_argument,
               "choose: cost_model bandwidths and GEMM rate must be > 0, the kernel times >= 0 and "
               "columns_per_pass >= 1");
  const double mk = static_cast<double>(m) * static_cast<double>(k), e = static_cast<double>(element_bytes);
  const double nn = static_cast<double>(n), groups = std::ceil(nn / model.columns_per_pass);
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

//! loom's formats that measure_formats ranks.
enum class format { csr, bitmap };

//! What measure_formats found: the faster format and each one's best time per product (seconds).
struct format_choice {
  format pick;
  double csr_seconds;
  double bitmap_seconds;
};

//! How measure_formats times: each format runs `repetitions` timed products after one untimed
//! one, and keeps its fastest.
struct measure_options {
  int repetitions = 5;
};

//! Times spmm(b, plan, A, B, C, workspace) with A given as CSR and as a tiled bitmap (the same
//! matrix) times a K x n row-major B, C = A B, on backend b; picks the faster (CSR on a tie). The
//! products run with the plan form, so the times are those of the calls a user makes; B, C and
//! the workspace are allocated here, in host memory.
//! @throws loom::error(shape_mismatch) if the two forms' extents differ, (invalid_argument) for
//!   n <= 0 or repetitions <= 0; as make_plan and spmm.
template <backend B, class T>
format_choice measure_formats(const B& b, const csr<T>& a_csr, const bitmap<T>& a_bitmap, index_t n,
                              const measure_options& opt = {}) {
  static_assert(backend_traits<B>::memory_space::host_accessible,
                "measure_formats: host backends only (the operands are made in host memory)");
  LOOM_EXPECTS(a_csr.rows() == a_bitmap.rows() && a_csr.cols() == a_bitmap.cols(), errc::shape_mismatch,
               "measure_formats: a_csr and a_bitmap must have the same extents, got ", a_csr.rows(), " x ",
               a_csr.cols(), " and ", a_bitmap.rows(), " x ", a_bitmap.cols());
  LOOM_EXPECTS(n > 0, errc::invalid_argument, "measure_formats: n must be > 0, got ", n);
  LOOM_EXPECTS(opt.repetitions > 0, errc::invalid_argument, "measure_formats: repetitions must be > 0, got ",
               opt.repetitions);
  const index_t m = a_csr.rows(), k = a_csr.cols();
  std::vector<float> bv(static_cast<std::size_t>(k * n)), cv(static_cast<std::size_t>(m * n));
  std::uint32_t x = 12345u;  // B in [-1, 1): the values do not change the time
  for (auto& v : bv) v = static_cast<float>((x = x * 1664525u + 1013904223u) >> 8) / 8388608.0f - 1.0f;
  const tensor_view<const float, 2> bview(bv.data(), {k, n});
  const tensor_view<float, 2> cview(cv.data(), {m, n});
  auto best = [&](const auto& a) {
    const auto pl = make_plan(b, a, n);
    workspace_buffer ws(pl.workspace_bytes());
    spmm(b, pl, a, bview, cview, ws.span());
    double t = 0;
    for (int r = 0; r < opt.repetitions; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      spmm(b, pl, a, bview, cview, ws.span());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      t = r == 0 ? s : std::min(t, s);
    }
    return t;
  };
  const double tc = best(a_csr), tb = best(a_bitmap);
  return {tb < tc ? format::bitmap : format::csr, tc, tb};
}

namespace detail {
//! Answers measured once per key and kept for later calls: get(key, measure) looks the key up, or
//! runs measure() (outside the lock, so other keys are not held up) and keeps its answer.
//! Thread-safe.
template <class Key, class Value>
class measured_cache {
 public:
  template <class Measure>
  Value get(const Key& k, Measure&& measure) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (const auto it = known_.find(k); it != known_.end()) return it->second;
    }
    const Value v = measure();
    const std::lock_guard<std::mutex> lock(mutex_);
    ++measured_;
    return known_.emplace(k, v).first->second;
  }
  //! How many keys were measured (not looked up) so far.
  std::size_t measured() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return measured_;
  }

 private:
  mutable std::mutex mutex_;
  std::map<Key, Value> known_;
  std::size_t measured_ = 0;
};
}  // namespace detail

//! measure_formats once per (backend type and thread count, M, K, N, density to 1 %), its answers
//! kept for later calls: the first product of a shape measures, the others look up. Thread-safe.
class format_chooser {
 public:
  //! The measured choice for this shape, measuring on first use.
  //! @throws as measure_formats.
  template <backend B, class T>
  format_choice pick(const B& b, const csr<T>& a_csr, const bitmap<T>& a_bitmap, index_t n,
                     const measure_options& opt = {}) {
    const index_t m = a_csr.rows(), k = a_csr.cols();
    const double cells = static_cast<double>(m) * static_cast<double>(k);
    const int density = cells > 0 ? static_cast<int>(std::lround(100.0 * static_cast<double>(a_csr.nnz()) / cells)) : 0;
    int threads = 0;
    if constexpr (requires { b.threads; }) threads = static_cast<int>(b.threads);
    return cache_.get(key{typeid(B).hash_code(), threads, m, k, n, density},
                      [&] { return measure_formats(b, a_csr, a_bitmap, n, opt); });
  }

  //! How many shapes were measured (not looked up) so far.
  std::size_t measured() const { return cache_.measured(); }

 private:
  using key = std::tuple<std::size_t, int, index_t, index_t, index_t, int>;
  detail::measured_cache<key, format_choice> cache_;
};

}  // namespace loom::sparse
