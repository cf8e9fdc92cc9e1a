// Chunked linear attention and LASP-2 against the fastest sgemm installed and the token-by-token recurrence.
//
// linear_attention.chunked/T:t/threads:n    loom's chunked forward, fp32, H = 8, dk = dv = 64,
//     chunk 64, fixed decay, one document, openmp with n threads. GFLOP/s counts its own FLOPs:
//     per chunk of c tokens and head, c(c+1)/2 (dk + dv) 2 (masked Q K^T and P V) + 2 c dk dv 2
//     (Q S and the state update). threads:1 is the one-core reference for the LASP-2 rows.
// linear_attention.sgemm/threads:n           the fastest sgemm installed, n = 1024, the dense ceiling.
// linear_attention.recurrent/T:t/threads:n   the token-by-token recurrence S = g S + k v^T,
//     o = scale S^T q, heads over n OpenMP threads; GFLOP/s with the chunked row's FLOP count (the
//     same work to produce), so the two rows compare directly.
// linear_attention.lasp2/T:t/P:p             LASP-2 forward over comm::local with p ranks of one
//     OpenMP thread each (the same problem); P:1 is the one-rank figure (one thread, so P:2 vs P:1
//     is the speedup from a second core, each rank on its own core; compare P:2 with
//     chunked/threads:2 for equal total threads). Each rank's plan (lasp2::make_plan, the agreement)
//     and workspace are made once before the timed loop, so the loop times the calls without their
//     allocation, set-up and agreement; the loop
//     still starts the P rank threads of comm::run_local on every iteration (P:1 one thread).

#include <loom/backend/openmp.hpp>
#include <loom/comm/local.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/lasp2.hpp>

#include <benchmark/benchmark.h>
#include <omp.h>

#include <cmath>
#include <cstddef>
#include <optional>
#include <random>
#include <sgemm.hpp>
#include <utility>
#include <vector>

namespace {

namespace la = loom::linear_attention;
using loom::index_t;

constexpr index_t H = 8, D = 64, C = 64;

struct data {
  index_t T;
  std::vector<float> q, k, v, o, lg;
  explicit data(index_t t) : T(t), q(t * H * D), k(q.size()), v(q.size()), o(q.size()), lg(H) {
    std::mt19937 g(7);
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto* x : {&q, &k, &v})
      for (auto& y : *x) y = u(g);
    for (index_t h = 0; h < H; ++h) lg[h] = std::log(1.0f - std::pow(2.0f, -5.0f - static_cast<float>(h)));
  }
};

double flops(index_t T) {
  double f = 0;
  for (index_t b = 0; b < T; b += C) {
    const double c = static_cast<double>(std::min(C, T - b));
    f += c * (c + 1) / 2 * 2 * D * 2 + 2 * c * D * D * 2;
  }
  return f * H;
}

void chunked(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  data x(T);
  const loom::openmp b{.threads = threads};
  const auto pl =
      la::make_plan(b, loom::segments<>{}, {.tokens = T, .heads = H, .dk = D, .dv = D}, {.chunk = C});  // one document
  loom::workspace_buffer ws(pl.forward_workspace_bytes());
  const la::operands ops{loom::tensor_view<const float, 3>(x.q.data(), {T, H, D}),
                         loom::tensor_view<const float, 3>(x.k.data(), {T, H, D}),
                         loom::tensor_view<const float, 3>(x.v.data(), {T, H, D})};
  const la::fixed_decay<float> gate{loom::tensor_view<const float, 1>(x.lg.data(), {H})};
  for (auto _ : state) {
    la::forward(b, pl, gate, ops, loom::tensor_view<float, 3>(x.o.data(), {T, H, D}), {}, ws.span());
    benchmark::DoNotOptimize(x.o.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(flops(T) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void recurrent(benchmark::State& state) {
  const index_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  data x(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (auto _ : state) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (index_t h = 0; h < H; ++h) {
      std::vector<float> s(D * D, 0.0f);
      const float g = std::exp(x.lg[h]);
      for (index_t t = 0; t < T; ++t) {
        const float* q = &x.q[(t * H + h) * D];
        const float* k = &x.k[(t * H + h) * D];
        const float* v = &x.v[(t * H + h) * D];
        float* o = &x.o[(t * H + h) * D];
        for (index_t e = 0; e < D; ++e) o[e] = 0;
        for (index_t d = 0; d < D; ++d) {
          float* row = &s[d * D];
          const float kd = k[d], qd = q[d] * scale;
          for (index_t e = 0; e < D; ++e) {
            row[e] = g * row[e] + kd * v[e];
            o[e] += qd * row[e];
          }
        }
      }
    }
    benchmark::DoNotOptimize(x.o.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(flops(T) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void sgemm(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int n = 1024;
  std::vector<float> a(n * n, 1.0f), bm(n * n, 0.5f), c(n * n);
  const auto* lib = loom::bench::fastest(n, n, n, threads);
  lib->threads(threads);
  for (auto _ : state) {
    lib->run(n, n, n, a.data(), n, bm.data(), n, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  lib->threads(1);
  state.SetLabel(lib->name);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * n * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void lasp2(benchmark::State& state) {
  const index_t T = state.range(0);
  const int P = static_cast<int>(state.range(1));
  data x(T);
  const std::vector<index_t> cu{0, T};
  const la::fixed_decay<float> gate{loom::tensor_view<const float, 1>(x.lg.data(), {H})};
  const loom::openmp b{.threads = 1};
  // One plan and one workspace per rank, made once here, outside the timed loop (as an engine keeps
  // them from layer to layer); the loop's calls allocate nothing and repeat no agreement. P:1 is
  // measured the same way.
  std::vector<std::optional<la::lasp2::plan<loom::fp32>>> plans(static_cast<std::size_t>(P));
  std::vector<std::optional<loom::workspace_buffer>> ws(static_cast<std::size_t>(P));
  auto slice = [&](int r) { return std::pair<index_t, index_t>{T * r / P, T * (r + 1) / P - T * r / P}; };
  loom::comm::run_local(P, [&](loom::comm::local& comm) {
    const auto [b0, n] = slice(comm.rank());
    const auto r = static_cast<std::size_t>(comm.rank());
    plans[r].emplace(la::lasp2::make_plan(b, comm, loom::segments{std::span<const index_t>(cu)}, b0, {n, H, D, D},
                                          {.chunked = {.chunk = C}}));
    ws[r].emplace(plans[r]->forward_workspace_bytes());
  });
  for (auto _ : state) {
    loom::comm::run_local(P, [&](loom::comm::local& comm) {
      const auto [b0, n] = slice(comm.rank());
      const auto r = static_cast<std::size_t>(comm.rank());
      const la::operands ops{loom::tensor_view<const float, 3>(x.q.data() + b0 * H * D, {n, H, D}),
                             loom::tensor_view<const float, 3>(x.k.data() + b0 * H * D, {n, H, D}),
                             loom::tensor_view<const float, 3>(x.v.data() + b0 * H * D, {n, H, D})};
      la::lasp2::forward(b, comm, *plans[r], gate, ops, loom::tensor_view<float, 3>(x.o.data() + b0 * H * D, {n, H, D}),
                         {}, {}, ws[r]->span());
    });
    benchmark::DoNotOptimize(x.o.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(flops(T) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(chunked)
    ->Name("linear_attention.chunked")
    ->ArgNames({"T", "threads"})
    ->Args({8192, 2})
    ->Args({32768, 2})
    ->Args({32768, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(recurrent)
    ->Name("linear_attention.recurrent")
    ->ArgNames({"T", "threads"})
    ->Args({8192, 2})
    ->Args({32768, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(sgemm)
    ->Name("linear_attention.sgemm")
    ->ArgNames({"threads"})
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(lasp2)
    ->Name("linear_attention.lasp2")
    ->ArgNames({"T", "P"})
    ->Args({32768, 1})
    ->Args({32768, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
