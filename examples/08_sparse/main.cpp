// Prune a dense layer to 90 % sparsity, store it as a tiled bitmap, multiply it with a batch of
// activations, and compare with the dense product: memory, time and the largest difference.
//
//   loom.example.sparse [sparsity]      (default 0.9)

#include <loom/backend/openmp.hpp>
#include <loom/sparse/chooser.hpp>
#include <loom/sparse/convert.hpp>
#include <loom/sparse/spmm.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  namespace ls = loom::sparse;
  using loom::index_t;
  const double sparsity = argc > 1 ? std::atof(argv[1]) : 0.9;
  const index_t m = 1024, k = 2048, n = 8;  // a layer of 2048 -> 1024 features, 8 tokens

  std::mt19937 g(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> w(static_cast<std::size_t>(m * k)), x(static_cast<std::size_t>(k * n));
  for (auto& v : w) v = normal(g);
  for (auto& v : x) v = normal(g) * 50.0f;

  // 1. magnitude pruning (per row), 2. conversion to the tiled bitmap format
  const auto pruned = ls::prune_magnitude(loom::tensor_view<const float, 2>(w.data(), {m, k}), sparsity);
  const auto a = ls::to_bitmap(loom::tensor_view<const float, 2>(pruned.data(), {m, k}));

  // 3. y = A x on two threads, with x and y row-major (K x N and M x N)
  std::vector<float> y(static_cast<std::size_t>(m * n));
  const loom::openmp backend{.threads = 2};
  const loom::tensor_view<const float, 2> xv(x.data(), {k, n});
  const loom::tensor_view<float, 2> yv(y.data(), {m, n});
  ls::spmm(backend, a, xv, yv);  // the convenience form (plans and allocates per call); warm-up
  // Repeated products of one shape: plan once, one workspace, no allocation per call.
  const auto plan = ls::make_plan(backend, a, n);
  loom::workspace_buffer ws(plan.workspace_bytes());
  const auto t0 = std::chrono::steady_clock::now();
  const int reps = 20;
  for (int r = 0; r < reps; ++r) ls::spmm(backend, plan, a, xv, yv, ws.span());
  const double sparse_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;

  // 4. the dense product of the pruned matrix, in double, for comparison
  double worst = 0, scale = 0;
  const auto t1 = std::chrono::steady_clock::now();
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double s = 0;
      for (index_t p = 0; p < k; ++p) s += static_cast<double>(pruned[i * k + p]) * x[p * n + j];
      worst = std::max(worst, std::abs(s - y[i * n + j]));
      scale = std::max(scale, std::abs(s));
    }
  const double dense_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();

  const double dense_bytes = static_cast<double>(m * k) * 4.0, bitmap_bytes = static_cast<double>(a.bytes());
  std::printf("layer %ld x %ld, N = %ld, sparsity %.1f %% (%ld nonzeros)\n", static_cast<long>(m), static_cast<long>(k),
              static_cast<long>(n), 100.0 * sparsity, static_cast<long>(a.nnz()));
  std::printf("memory: dense %.2f MB, bitmap %.2f MB (%.3fx), csr %.2f MB\n", dense_bytes / 1e6, bitmap_bytes / 1e6,
              bitmap_bytes / dense_bytes, static_cast<double>(ls::to_csr(a).bytes()) / 1e6);
  std::printf("time: loom spmm %.3f ms per call; naive fp64 dense loop %.1f ms\n", sparse_ms, dense_ms);
  std::printf("max |loom - fp64| = %.3g (max |y| = %.3g)\n", worst, scale);
  const auto c = ls::choose(sparsity, m, k, n, sizeof(float));
  std::printf("chooser: %s (predicted dense %.3f ms, bitmap %.3f ms)\n",
              c.pick == ls::choice::path::bitmap_spmm ? "bitmap spmm" : "dense gemm", c.dense_seconds * 1e3,
              c.sparse_seconds * 1e3);
  // Between loom's own formats the choice is measured on this machine (once per shape, then kept).
  ls::format_chooser formats;
  const auto f = formats.pick(backend, ls::to_csr(a), a, n);
  std::printf("measured: %s (csr %.3f ms, bitmap %.3f ms per call)\n", f.pick == ls::format::csr ? "csr" : "bitmap",
              f.csr_seconds * 1e3, f.bitmap_seconds * 1e3);
  const bool ok =
      worst <= 1e-4 * std::max(scale, 1.0) && std::equal(pruned.begin(), pruned.end(), ls::to_dense(a).begin());
  std::printf("%s\n", ok ? "OK: exact round trip, product within fp32 rounding" : "MISMATCH");
  return ok ? 0 : 1;
}
