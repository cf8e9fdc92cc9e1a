// loom's 2-thread OpenMP paths on a quiet machine and beside one busy-loop thread that the
// benchmark starts before its timed loop and stops after it (a data loader or an MPI progress
// thread sharing the cores). busy:0 is quiet, busy:1 has the busy thread; the figure is the
// busy:1 time over the busy:0 time of the same primitive (target: at most 2.5).
//
// contention.scan/busy:b         inclusive scan, plus<float>, 16M elements
// contention.recurrence/busy:b   diagonal linear recurrence, T = 262144 steps of d = 64
// contention.short_recurrence/busy:b  the same with T = 4096, d = 8 (192 KiB: under two grains of
//                                 loom::parallel_grain_bytes, so it runs on the calling thread)
// contention.newton/busy:b       rnn::forward of para_gru<float>, T = 262144, d = 8 (full Newton)
// contention.attention/busy:b    local attention forward, fp32, T = 2048, 8 heads, d = 64, causal
// contention.attention_backward/busy:b  its backward (dq, dk, dv from the forward's output and lse)
// contention.spmm/busy:b         bitmap spmm, M = K = 4096, N = 16, 90 % zeros
// contention.linear_attention/busy:b  chunked linear attention forward, fp32, fixed decay,
//                                 T = 16384, 8 heads, dk = dv = 64, chunk 64, one document
// contention.linear_attention_backward/busy:b  its backward (dq, dk, dv; no final state)

#include <loom/attention/local.hpp>
#include <loom/backend/openmp.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/rnn/newton.hpp>
#include <loom/scan/recurrence.hpp>
#include <loom/scan/scan.hpp>
#include <loom/sparse/convert.hpp>
#include <loom/sparse/spmm.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

namespace {

using loom::index_t;
const loom::openmp two_threads{.threads = 2};

std::vector<float> random_vector(std::size_t n, unsigned seed, float lo = -1.f, float hi = 1.f) {
  std::vector<float> v(n);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (auto& x : v) x = u(g);
  return v;
}

// A thread that spins until destroyed (busy = true), or nothing.
class busy_thread {
 public:
  explicit busy_thread(bool busy) {
    if (busy)
      t_ = std::thread([this] {
        std::uint64_t x = 0;
        while (!stop_.load(std::memory_order_relaxed)) x = x * 6364136223846793005ULL + 1;
        sink_.store(x, std::memory_order_relaxed);
      });
  }
  ~busy_thread() {
    stop_.store(true);
    if (t_.joinable()) t_.join();
  }
  busy_thread(const busy_thread&) = delete;
  busy_thread& operator=(const busy_thread&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> sink_{0};
  std::thread t_;
};

// Runs call() in the timed loop with the busy thread of state.range(0) beside it.
template <class F>
void timed(benchmark::State& state, F&& call) {
  call();  // warm (first touch, caches)
  const busy_thread busy(state.range(0) != 0);
  for (auto _ : state) call();
}

void scan(benchmark::State& state) {
  const index_t n = index_t{16} << 20;
  const auto x = random_vector(static_cast<std::size_t>(n), 1);
  std::vector<float> y(x.size());
  const auto plan = loom::scan::make_plan(two_threads, loom::scan::plus<float>{}, n);
  const loom::workspace_buffer ws(plan.workspace_bytes());
  timed(state, [&] {
    loom::scan::inclusive_scan(two_threads, plan, loom::tensor_view<const float, 1>(x.data(), {n}),
                               loom::tensor_view<float, 1>(y.data(), {n}), ws.span());
  });
}

// A diagonal recurrence of t steps of d channels.
void recurrence_of(benchmark::State& state, index_t t, index_t d) {
  const auto a = random_vector(static_cast<std::size_t>(t * d), 2, 0.9f, 0.999f);
  const auto x = random_vector(a.size(), 3);
  std::vector<float> h(a.size());
  const auto plan = loom::scan::make_plan(two_threads, loom::scan::diagonal{}, t, d);
  const loom::workspace_buffer ws(plan.workspace_bytes());
  timed(state, [&] {
    loom::scan::linear_recurrence(two_threads, plan, loom::tensor_view<const float, 2>(a.data(), {t, d}),
                                  loom::tensor_view<const float, 2>(x.data(), {t, d}),
                                  loom::tensor_view<float, 2>(h.data(), {t, d}), ws.span());
  });
}

void recurrence(benchmark::State& state) { recurrence_of(state, 262144, 64); }
void short_recurrence(benchmark::State& state) { recurrence_of(state, 4096, 8); }

void newton(benchmark::State& state) {
  const index_t t = 262144, d = 8;
  const auto theta = random_vector(static_cast<std::size_t>(6 * d), 4);
  const auto x = random_vector(static_cast<std::size_t>(3 * t * d), 5);
  std::vector<float> h(static_cast<std::size_t>(t * d));
  const loom::rnn::para_gru<float> cell{theta.data(), d};
  loom::rnn::options opt;
  opt.abs_tol = 1e-4;
  opt.rel_tol = 1e-4;
  opt.max_iterations = 30;
  opt.check_inputs = false;
  const auto plan = loom::rnn::make_plan(two_threads, cell, t, loom::segments<>{}, opt);
  const loom::workspace_buffer ws(plan.workspace_bytes());
  loom::rnn::report rep(plan);
  timed(state, [&] {
    loom::rnn::forward(two_threads, plan, cell, loom::tensor_view<const float, 2>(x.data(), {t, 3 * d}),
                       loom::tensor_view<const float, 2>{}, loom::tensor_view<float, 2>(h.data(), {t, d}), rep,
                       ws.span());
  });
  state.counters["newton_iterations"] = rep.iterations;
}

// Local attention, forward (backward = false) or backward (from the forward's output and lse).
void attention_of(benchmark::State& state, bool backward) {
  const index_t t = 2048, heads = 8, dim = 64;
  const auto q = random_vector(static_cast<std::size_t>(t * heads * dim), 6);
  const auto k = random_vector(q.size(), 7), v = random_vector(q.size(), 8), d_out = random_vector(q.size(), 15);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(t * heads)), dq(q.size()), dk(q.size()), dv(q.size());
  loom::attention::options opt;
  opt.causal = true;
  const auto plan =
      loom::attention::make_plan(two_threads, loom::segments<>::whole(t), {t, heads, heads, dim, dim}, opt);
  const loom::workspace_buffer ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  using view = loom::tensor_view<const float, 3>;
  using out_view = loom::tensor_view<float, 3>;
  const auto forward = [&] {
    loom::attention::forward(two_threads, plan, view(q.data(), {t, heads, dim}), view(k.data(), {t, heads, dim}),
                             view(v.data(), {t, heads, dim}), out_view(out.data(), {t, heads, dim}),
                             loom::tensor_view<float, 2>(lse.data(), {t, heads}), ws.span());
  };
  if (!backward) return timed(state, forward);
  forward();
  timed(state, [&] {
    loom::attention::backward(two_threads, plan, view(q.data(), {t, heads, dim}), view(k.data(), {t, heads, dim}),
                              view(v.data(), {t, heads, dim}), view(out.data(), {t, heads, dim}),
                              loom::tensor_view<const float, 2>(lse.data(), {t, heads}),
                              view(d_out.data(), {t, heads, dim}), out_view(dq.data(), {t, heads, dim}),
                              out_view(dk.data(), {t, heads, dim}), out_view(dv.data(), {t, heads, dim}), ws.span());
  });
}

void attention(benchmark::State& state) { attention_of(state, false); }
void attention_backward(benchmark::State& state) { attention_of(state, true); }

void spmm(benchmark::State& state) {
  const index_t m = 4096, k = 4096, n = 16;
  const auto dense = random_vector(static_cast<std::size_t>(m * k), 9);
  const auto pruned = loom::sparse::prune_magnitude(loom::tensor_view<const float, 2>(dense.data(), {m, k}), 0.9);
  const auto a = loom::sparse::to_bitmap(loom::tensor_view<const float, 2>(pruned.data(), {m, k}));
  const auto b = random_vector(static_cast<std::size_t>(k * n), 10);
  std::vector<float> c(static_cast<std::size_t>(m * n));
  const auto plan = loom::sparse::make_plan(two_threads, a, n);
  const loom::workspace_buffer ws(plan.workspace_bytes());
  timed(state, [&] {
    loom::sparse::spmm(two_threads, plan, a, loom::tensor_view<const float, 2>(b.data(), {k, n}),
                       loom::tensor_view<float, 2>(c.data(), {m, n}), ws.span());
  });
}

// Chunked linear attention, forward (backward = false) or backward, on its own plan and workspace.
void linear_attention_of(benchmark::State& state, bool backward) {
  namespace la = loom::linear_attention;
  const index_t t = 16384, heads = 8, dim = 64;
  const auto q = random_vector(static_cast<std::size_t>(t * heads * dim), 11);
  const auto k = random_vector(q.size(), 12), v = random_vector(q.size(), 13), d_o = random_vector(q.size(), 14);
  std::vector<float> log_gate(static_cast<std::size_t>(heads), -0.01f), out(q.size()), dq(q.size()), dk(q.size()),
      dv(q.size());
  const auto plan = la::make_plan(two_threads, loom::segments<>{}, {.tokens = t, .heads = heads, .dk = dim, .dv = dim},
                                  {.chunk = 64});
  const loom::workspace_buffer ws(backward ? plan.backward_workspace_bytes() : plan.forward_workspace_bytes());
  using view = loom::tensor_view<const float, 3>;
  using out_view = loom::tensor_view<float, 3>;
  const la::operands x{view(q.data(), {t, heads, dim}), view(k.data(), {t, heads, dim}),
                       view(v.data(), {t, heads, dim})};
  const la::fixed_decay<float> gate{loom::tensor_view<const float, 1>(log_gate.data(), {heads})};
  const la::gradients g{out_view(dq.data(), {t, heads, dim}), out_view(dk.data(), {t, heads, dim}),
                        out_view(dv.data(), {t, heads, dim})};
  timed(state, [&] {
    if (backward)
      la::backward(two_threads, plan, gate, x, view(d_o.data(), {t, heads, dim}), {}, g, ws.span());
    else
      la::forward(two_threads, plan, gate, x, out_view(out.data(), {t, heads, dim}), {}, ws.span());
  });
}

void linear_attention(benchmark::State& state) { linear_attention_of(state, false); }
void linear_attention_backward(benchmark::State& state) { linear_attention_of(state, true); }

void busy_args(benchmark::internal::Benchmark* bm) {
  bm->ArgNames({"busy"})->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(scan)->Name("contention.scan")->Apply(busy_args);
BENCHMARK(recurrence)->Name("contention.recurrence")->Apply(busy_args);
BENCHMARK(short_recurrence)->Name("contention.short_recurrence")->Apply(busy_args);
BENCHMARK(newton)->Name("contention.newton")->Apply(busy_args);
BENCHMARK(attention)->Name("contention.attention")->Apply(busy_args);
BENCHMARK(attention_backward)->Name("contention.attention_backward")->Apply(busy_args);
BENCHMARK(spmm)->Name("contention.spmm")->Apply(busy_args);
BENCHMARK(linear_attention)->Name("contention.linear_attention")->Apply(busy_args);
BENCHMARK(linear_attention_backward)->Name("contention.linear_attention_backward")->Apply(busy_args);
