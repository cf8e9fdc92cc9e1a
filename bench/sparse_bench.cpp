// Sparse weight x dense activation: loom::sparse::spmm against the fastest sgemm installed on the same (dense)
// matrix and Eigen's SparseMatrix x dense, openmp 2 threads, fp32.
//
// sparse.bitmap/M:m/K:k/N:n/s:pct   loom spmm, tiled bitmap A (magnitude-pruned random weights,
//     pct % zeros per row), B K x N row-major, C M x N row-major. Counters: GFLOP/s at the dense
//     FLOP count 2 M K N (so rows compare directly with sgemm), bytes_ratio = bitmap bytes / dense
//     fp32 bytes.
// sparse.bitmap_colmajor/...        the same with B and C column-major (Y^T = W X^T layouts).
// sparse.csr/...                    loom spmm, CSR A (same matrix).
// sparse.chosen/...                 loom spmm in the format sparse::format_chooser measured as the
//     faster for this shape (the measurement is made before the timing); label: the format.
// sparse.eigen/...                  Eigen::SparseMatrix<float, RowMajor> * MatrixXf (OpenMP, 2 threads).
// sparse.sgemm/M:m/K:k/N:n          the fastest sgemm on this shape (support/sgemm.hpp), dense matrix, 2 threads.

#include <loom/backend/openmp.hpp>
#include <loom/sparse/chooser.hpp>
#include <loom/sparse/convert.hpp>
#include <loom/sparse/spmm.hpp>

#include <benchmark/benchmark.h>
#include <omp.h>

#include <Eigen/Core>
#include <Eigen/SparseCore>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <sgemm.hpp>
#include <tuple>
#include <vector>

namespace {

namespace ls = loom::sparse;
using loom::index_t;
// 2 threads (the setting); LOOM_BENCH_SPARSE_THREADS overrides it for experiments.
const int threads = [] {
  const char* e = std::getenv("LOOM_BENCH_SPARSE_THREADS");
  return e ? std::atoi(e) : 2;
}();

// The matrices of one (M, K, sparsity) cell, built once and reused by consecutive rows.
struct cell {
  index_t m = 0, k = 0;
  int pct = -1;
  std::vector<float> dense;  // the pruned matrix, row-major (freed once converted)
  ls::bitmap<float> bitmap;
  ls::csr<float> csr;
  Eigen::SparseMatrix<float, Eigen::RowMajor> eigen;
};

std::vector<float> random_dense(index_t m, index_t k) {
  std::vector<float> d(static_cast<std::size_t>(m * k));
  std::mt19937_64 g(42);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : d) x = u(g);
  return d;
}

// Cells are kept (random interleaving of repetitions revisits them); about 2 GB for the grid.
const cell& get(index_t m, index_t k, int pct) {
  static std::map<std::tuple<index_t, index_t, int>, std::unique_ptr<cell>> cache;
  auto& c = cache[{m, k, pct}];
  if (c) return *c;
  c = std::make_unique<cell>();
  c->m = m;
  c->k = k;
  c->pct = pct;
  const auto d = random_dense(m, k);
  c->dense = ls::prune_magnitude(loom::tensor_view<const float, 2>(d.data(), {m, k}), pct / 100.0);
  const loom::tensor_view<const float, 2> v(c->dense.data(), {m, k});
  c->bitmap = ls::to_bitmap(v);
  c->csr = ls::to_csr(v);
  std::vector<Eigen::Triplet<float>> t;
  t.reserve(static_cast<std::size_t>(c->csr.nnz()));
  for (index_t i = 0; i < m; ++i)
    for (index_t e = c->csr.row_ptr()[i]; e < c->csr.row_ptr()[i + 1]; ++e)
      t.emplace_back(static_cast<int>(i), c->csr.col_idx()[e], c->csr.values()[e]);
  c->eigen.resize(static_cast<Eigen::Index>(m), static_cast<Eigen::Index>(k));
  c->eigen.setFromTriplets(t.begin(), t.end());
  c->eigen.makeCompressed();
  c->dense = {};
  return *c;
}

std::vector<float> activations(index_t k, index_t n) {
  std::vector<float> b(static_cast<std::size_t>(k * n));
  std::mt19937_64 g(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : b) x = u(g);
  return b;
}

void rate(benchmark::State& state, index_t m, index_t k, index_t n) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(m * k * n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

template <int Format>  // 0 bitmap row-major, 1 bitmap column-major, 2 csr, 3 the chooser's pick
void loom_spmm(benchmark::State& state) {
  const index_t m = state.range(0), k = state.range(1), n = state.range(2);
  const auto& c = get(m, k, static_cast<int>(state.range(3)));
  const auto b = activations(k, n);
  std::vector<float> out(static_cast<std::size_t>(m * n));
  const bool col = Format == 1;
  const loom::tensor_view<const float, 2> bv(b.data(), {k, n}, {col ? 1 : n, col ? k : 1});
  const loom::tensor_view<float, 2> cv(out.data(), {m, n}, {col ? 1 : n, col ? m : 1});
  const loom::openmp be{.threads = threads};
  // One plan and one workspace for every call (the plan form allocates nothing).
  const auto pl = ls::make_plan(be, c.bitmap, n);
  loom::workspace_buffer ws(pl.workspace_bytes());
  static ls::format_chooser chooser;
  const bool use_csr = Format == 2 || (Format == 3 && chooser.pick(be, c.csr, c.bitmap, n).pick == ls::format::csr);
  if (Format == 3) state.SetLabel(use_csr ? "csr" : "bitmap");
  for (auto _ : state) {
    if (use_csr)
      ls::spmm(be, pl, c.csr, bv, cv, ws.span());
    else
      ls::spmm(be, pl, c.bitmap, bv, cv, ws.span());
    benchmark::DoNotOptimize(out.data());
  }
  rate(state, m, k, n);
  state.counters["bytes_ratio"] =
      static_cast<double>(use_csr ? c.csr.bytes() : c.bitmap.bytes()) / (4.0 * static_cast<double>(m * k));
}

void eigen_spmm(benchmark::State& state) {
  const index_t m = state.range(0), k = state.range(1), n = state.range(2);
  const auto& c = get(m, k, static_cast<int>(state.range(3)));
  Eigen::setNbThreads(threads);
  const Eigen::MatrixXf b = Eigen::MatrixXf::Random(static_cast<Eigen::Index>(k), static_cast<Eigen::Index>(n));
  Eigen::MatrixXf out(static_cast<Eigen::Index>(m), static_cast<Eigen::Index>(n));
  for (auto _ : state) {
    out.noalias() = c.eigen * b;
    benchmark::DoNotOptimize(out.data());
  }
  rate(state, m, k, n);
}

void sgemm(benchmark::State& state) {
  const index_t m = state.range(0), k = state.range(1), n = state.range(2);
  static std::map<std::pair<index_t, index_t>, std::vector<float>> cache;
  auto& a = cache[{m, k}];
  if (a.empty()) a = random_dense(m, k);
  const auto b = activations(k, n);
  std::vector<float> out(static_cast<std::size_t>(m * n));
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const auto* lib = loom::bench::fastest(mi, ni, ki, threads);
  lib->threads(threads);
  for (auto _ : state) {
    lib->run(mi, ni, ki, a.data(), ki, b.data(), ni, out.data(), ni);
    benchmark::DoNotOptimize(out.data());
  }
  lib->threads(1);
  state.SetLabel(lib->name);
  rate(state, m, k, n);
}

const index_t shapes[][2] = {{4096, 4096}, {4096, 11008}};
const int widths[] = {1, 8, 16, 32, 64};
const int sparsities[] = {50, 70, 80, 90};

// Rows are registered cell by cell so that each (M, K, sparsity) matrix is built once.
const bool registered = [] {
  for (const auto& s : shapes) {
    for (int w : widths)
      benchmark::RegisterBenchmark("sparse.sgemm", sgemm)
          ->ArgNames({"M", "K", "N"})
          ->Args({s[0], s[1], w})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    for (int pct : sparsities)
      for (int w : widths) {
        const std::vector<std::int64_t> args{s[0], s[1], w, pct};
        benchmark::RegisterBenchmark("sparse.bitmap", loom_spmm<0>)
            ->ArgNames({"M", "K", "N", "s"})
            ->Args(args)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        if (w == 16)
          benchmark::RegisterBenchmark("sparse.bitmap_colmajor", loom_spmm<1>)
              ->ArgNames({"M", "K", "N", "s"})
              ->Args(args)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime();
        benchmark::RegisterBenchmark("sparse.csr", loom_spmm<2>)
            ->ArgNames({"M", "K", "N", "s"})
            ->Args(args)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark("sparse.chosen", loom_spmm<3>)
            ->ArgNames({"M", "K", "N", "s"})
            ->Args(args)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark("sparse.eigen", eigen_spmm)
            ->ArgNames({"M", "K", "N", "s"})
            ->Args(args)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  }
  return true;
}();

}  // namespace
