// The Newton solver of include/loom/rnn/ against the tight sequential loop of the same cell.
//
// rnn.sequential/T:t/d:d         the loop h_t = f(h_{t-1}, x_t) of para_gru<float>, one thread
// rnn.newton/T:t/d:d/threads:n   rnn::forward with a plan (full Newton = diagonal scan for this cell), openmp
//                                n threads, tolerance 1e-4 abs + 1e-4 rel, from zeros. Counters:
//                                iterations (linear solves), converged (1 when all converged)
// rnn.sp/T:t/d:d/P:p             the sequence-parallel solve over comm::local, p ranks of one
//                                serial thread each
// The work ratio (Newton work / sequential work) is the 1-thread Newton time over the loop time.

#include <loom/backend/openmp.hpp>
#include <loom/backend/serial.hpp>
#include <loom/comm/local.hpp>
#include <loom/rnn/distributed.hpp>
#include <loom/rnn/newton.hpp>

#include <benchmark/benchmark.h>

#include <random>
#include <vector>

namespace {

using loom::index_t;
namespace lr = loom::rnn;

struct problem {
  index_t n, d;
  std::vector<float> theta, x, h;
  problem(index_t n_, index_t d_) : n(n_), d(d_), theta(6 * d_), x(3 * n_ * d_), h(n_ * d_) {
    std::mt19937 g(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto& v : theta) v = u(g);
    for (auto& v : x) v = u(g);
  }
  lr::para_gru<float> cell() const { return {theta.data(), d}; }
};

lr::options solver_options() {
  lr::options o;
  o.abs_tol = 1e-4;
  o.rel_tol = 1e-4;
  o.max_iterations = 30;
  o.check_inputs = false;
  return o;
}

void sequential(benchmark::State& st) {
  problem p(st.range(0), st.range(1));
  const auto c = p.cell();
  std::vector<float> zero(static_cast<std::size_t>(p.d), 0.f);
  for (auto _ : st) {
    const float* hp = zero.data();
    for (index_t t = 0; t < p.n; ++t) {
      c.step(hp, p.x.data() + t * 3 * p.d, p.h.data() + t * p.d);
      hp = p.h.data() + t * p.d;
    }
    benchmark::DoNotOptimize(p.h.data());
    benchmark::ClobberMemory();
  }
}

void newton(benchmark::State& st) {
  problem p(st.range(0), st.range(1));
  const loom::openmp b{.threads = static_cast<int>(st.range(2))};
  const auto plan = lr::make_plan(b, p.cell(), p.n, loom::segments<>{}, solver_options());
  const loom::workspace_buffer ws(plan.workspace_bytes());
  lr::report rep(plan);
  for (auto _ : st) {
    lr::forward(b, plan, p.cell(), loom::tensor_view<const float, 2>(p.x.data(), {p.n, 3 * p.d}),
                loom::tensor_view<const float, 2>{}, loom::tensor_view<float, 2>(p.h.data(), {p.n, p.d}), rep,
                ws.span());
  }
  st.counters["newton_iterations"] = rep.iterations;
  st.counters["converged"] = rep.all_converged() ? 1 : 0;
}

void sp(benchmark::State& st) {
  problem p(st.range(0), st.range(1));
  const int ranks = static_cast<int>(st.range(2));
  int iterations = 0;
  for (auto _ : st) {
    loom::comm::run_local(ranks, [&](loom::comm::local& comm) {
      const index_t b = p.n * comm.rank() / ranks, e = p.n * (comm.rank() + 1) / ranks;
      const auto rep = lr::forward(
          loom::serial{}, comm, p.cell(), loom::tensor_view<const float, 2>(p.x.data() + b * 3 * p.d, {e - b, 3 * p.d}),
          loom::tensor_view<const float, 2>{}, loom::tensor_view<float, 2>(p.h.data() + b * p.d, {e - b, p.d}),
          loom::segments<>{}, solver_options());
      if (comm.rank() == 0) iterations = rep.iterations;
    });
  }
  st.counters["newton_iterations"] = iterations;
}

void sizes(benchmark::internal::Benchmark* bm, bool threads) {
  for (long n : {1024L, 16384L, 262144L})
    for (long d : {8L, 64L, 256L}) {
      if (n * d > (1L << 24)) continue;  // memory: 262144 x 256 needs ~2 GB of scratch
      if (threads)
        for (long t : {1L, 2L}) bm->Args({n, d, t});
      else
        bm->Args({n, d});
    }
}

}  // namespace

BENCHMARK(sequential)->Name("rnn.sequential")->ArgNames({"T", "d"})->Apply([](auto* b) {
                                                                     sizes(b, false);
                                                                   }) -> Unit(benchmark::kMillisecond) -> UseRealTime();
BENCHMARK(newton)
    ->Name("rnn.newton")
    ->ArgNames({"T", "d", "threads"})
    ->Apply([](auto* b) { sizes(b, true); }) -> Unit(benchmark::kMillisecond) -> UseRealTime();
BENCHMARK(sp)
    ->Name("rnn.sp")
    ->ArgNames({"T", "d", "P"})
    ->Args({262144, 8, 1})
    ->Args({262144, 8, 2})
    ->Args({16384, 64, 1})
    ->Args({16384, 64, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
