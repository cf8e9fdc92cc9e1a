// How much of the ring's transfer time the stream-ordered schedule hides behind compute, measured
// on the device stand-in (loom::standin compute streams, comm::standin with a modelled link).
//
// overlap.ring_pass_kv/P:p/transfer_pct:x
//   ring pass-KV forward, fp32, full attention, contiguous shards of 1024 tokens per rank, 8 heads,
//   dim 64, on P stand-in ranks (one compute stream each: the local kernel on one thread). First
//   without a modelled link (time T0 per call), then with a link whose bandwidth makes each
//   step's K/V transfer take x % of one step's compute (T0 / P): time T1. Counters:
//     step_compute_ms, step_transfer_ms  the modelled step
//     hidden    1 - (T1 - T0) / ((P - 1) * step transfer): the share of the transfer time that did
//               not lengthen the call (target: >= 0.9 whenever the transfer is shorter than the
//               compute).
// The reported time is T1.

#include <loom/attention/ring.hpp>
#include <loom/backend/standin.hpp>
#include <loom/comm/standin.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <span>
#include <vector>

namespace {

namespace la = loom::attention;
using loom::index_t;

constexpr index_t per_rank = 1024, heads = 8, dim = 64;

struct ring_data {
  int p;
  std::vector<index_t> docs;
  loom::shard::plan plan;
  std::vector<std::vector<float>> q, k, v, o, l;
  explicit ring_data(int ranks)
      : p(ranks),
        docs{0, per_rank * ranks},
        plan(loom::shard::make_plan(std::span<const index_t>(docs), ranks, loom::shard::contiguous{})) {
    std::mt19937 g(7);
    std::uniform_real_distribution<float> u(-1, 1);
    for (int r = 0; r < p; ++r) {
      const auto sz = static_cast<std::size_t>(per_rank * heads * dim);
      for (auto* x : {&q, &k, &v, &o}) {
        x->emplace_back(sz);
        for (auto& e : x->back()) e = u(g);
      }
      l.emplace_back(static_cast<std::size_t>(per_rank * heads));
    }
  }
  //! The wall time of one ring forward on every rank (the slowest rank), with the given link.
  double run(const loom::comm::standin_link& link) {
    std::vector<double> t(static_cast<std::size_t>(p));
    loom::comm::standin_options opt;
    opt.link = link;
    loom::comm::run_standin(
        p,
        [&](loom::comm::standin& comm, loom::standin b) {
          const int r = comm.rank();
          const auto ru = static_cast<std::size_t>(r);
          la::options full;
          full.causal = false;
          const auto rp = la::ring::make_plan(b, comm, plan, {heads, heads, dim, dim}, full);
          const loom::temporary_buffer<loom::standin, std::byte> ws(b, static_cast<index_t>(rp.workspace_bytes()));
          using view = loom::tensor_view<const float, 3, loom::standin_memory>;
          comm.barrier();
          const auto t0 = std::chrono::steady_clock::now();
          la::ring::forward(b, comm, rp, view(q[ru].data(), {per_rank, heads, dim}),
                            view(k[ru].data(), {per_rank, heads, dim}), view(v[ru].data(), {per_rank, heads, dim}),
                            loom::tensor_view<float, 3, loom::standin_memory>(o[ru].data(), {per_rank, heads, dim}),
                            loom::tensor_view<float, 2, loom::standin_memory>(l[ru].data(), {per_rank, heads}),
                            ws.bytes());
          loom::fence(b);
          t[ru] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        },
        opt);
    return *std::max_element(t.begin(), t.end());
  }
};

void ring_pass_kv(benchmark::State& state) {
  const int p = static_cast<int>(state.range(0));
  const double pct = static_cast<double>(state.range(1)) / 100.0;
  ring_data d(p);
  const double step_bytes = 2.0 * per_rank * heads * dim * sizeof(float);  // K and V of one rank
  double t0_sum = 0, t1_sum = 0, transfer_sum = 0, step_compute = 0;
  int n = 0;
  for (auto _ : state) {
    const double t0 = d.run({});
    step_compute = t0 / p;
    const double step_transfer = pct * step_compute;
    loom::comm::standin_link link;
    link.bytes_per_second = step_bytes / step_transfer;
    const double t1 = d.run(link);
    state.SetIterationTime(t1);
    t0_sum += t0;
    t1_sum += t1;
    transfer_sum += (p - 1) * step_transfer;
    ++n;
  }
  state.counters["step_compute_ms"] = 1e3 * t0_sum / (n * p);
  state.counters["step_transfer_ms"] = 1e3 * pct * t0_sum / (n * p);
  state.counters["hidden"] = transfer_sum > 0 ? 1.0 - (t1_sum - t0_sum) / transfer_sum : 0.0;
}

}  // namespace

BENCHMARK(ring_pass_kv)
    ->Name("overlap.ring_pass_kv")
    ->ArgNames({"P", "transfer_pct"})
    ->Args({2, 50})
    ->Args({2, 90})
    ->Args({3, 50})
    ->Iterations(5)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
