// Scans against their limits and baselines, in one run: 64M fp32 elements (256 MiB per array).
//   scan.memcpy           the same bytes moved by memcpy on the same threads (the ceiling)
//   scan.loom / scan.thrust_omp / scan.std_seq   inclusive scan with plus<float>
//   scan.loom_affine / scan.thrust_omp_affine    inclusive scan of scalar affine steps (a_t, b_t)
//                         with the composition (a2 a1, a2 b1 + b2): h_t = a_t h_{t-1} + b_t
//   scan.loom_diagonal    loom::scan::linear_recurrence, diagonal A, T = 1M steps of d = 64
// "GB/s" counts bytes read plus bytes written once (8 per element for plus; 16 + 16 for the
// affine pairs; 12 per element for the diagonal recurrence: A, b read, h written).

#include <loom/backend/openmp.hpp>
#include <loom/scan/recurrence.hpp>
#include <loom/scan/scan.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#if defined(LOOM_BENCH_HAVE_THRUST)
#include <thrust/scan.h>
#include <thrust/system/omp/execution_policy.h>
#endif

#include <omp.h>

namespace {

constexpr std::size_t n = std::size_t{64} << 20;
namespace ls = loom::scan;

template <class T>
struct array {
  T* p;
  explicit array(std::size_t count) : p(static_cast<T*>(std::aligned_alloc(2 << 20, sizeof(T) * count))) {
#pragma omp parallel for schedule(static)
    for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(count); ++i) p[i] = T{};
  }
  ~array() { std::free(p); }
  array(const array&) = delete;
  array& operator=(const array&) = delete;
};

struct data {
  array<float> x{n}, y{n};
  array<float> decay{n};
  array<ls::affine_pair<float>> pairs{n}, pairs_out{n};
  data() {
    for (std::size_t i = 0; i < n; ++i) {
      x.p[i] = static_cast<float>(i % 7) - 3.0f;
      decay.p[i] = 0.99f + static_cast<float>(i % 11) * 1e-4f;
      pairs.p[i] = {0.999f - static_cast<float>(i % 5) * 1e-4f, static_cast<float>(i % 3)};
    }
  }
};
data& the_data() {
  static data d;
  return d;
}

void set_bytes(benchmark::State& state, double bytes) {
  state.counters["GB/s"] =
      benchmark::Counter(bytes * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["elements"] = static_cast<double>(n);
}

void memcpy_bench(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  auto& d = the_data();
  const std::size_t bytes = n * sizeof(float);
  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const std::size_t t = static_cast<std::size_t>(omp_get_thread_num()),
                        k = static_cast<std::size_t>(omp_get_num_threads());
      const std::size_t b = bytes / k * t / 4096 * 4096, e = t + 1 == k ? bytes : bytes / k * (t + 1) / 4096 * 4096;
      std::memcpy(reinterpret_cast<char*>(d.y.p) + b, reinterpret_cast<const char*>(d.x.p) + b, e - b);
    }
    benchmark::ClobberMemory();
  }
  set_bytes(state, 2.0 * static_cast<double>(bytes));
}

void loom_plus(benchmark::State& state) {
  auto& d = the_data();
  const loom::openmp b{static_cast<int>(state.range(0))};
  const loom::tensor_view<const float, 1> in(d.x.p, {static_cast<loom::index_t>(n)});
  const loom::tensor_view<float, 1> out(d.y.p, {static_cast<loom::index_t>(n)});
  const auto plan = ls::make_plan(b, ls::plus<float>{}, static_cast<loom::index_t>(n));
  const loom::workspace_buffer ws(plan.workspace_bytes());
  for (auto _ : state) {
    ls::inclusive_scan(b, plan, in, out, ws.span());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 8.0 * n);
}

void std_seq_plus(benchmark::State& state) {
  auto& d = the_data();
  for (auto _ : state) {
    std::inclusive_scan(d.x.p, d.x.p + n, d.y.p);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 8.0 * n);
}

void loom_affine(benchmark::State& state) {
  auto& d = the_data();
  const loom::openmp b{static_cast<int>(state.range(0))};
  const loom::tensor_view<const ls::affine_pair<float>, 1> in(d.pairs.p, {static_cast<loom::index_t>(n)});
  const loom::tensor_view<ls::affine_pair<float>, 1> out(d.pairs_out.p, {static_cast<loom::index_t>(n)});
  const auto plan = ls::make_plan(b, ls::affine<float>{}, static_cast<loom::index_t>(n));
  const loom::workspace_buffer ws(plan.workspace_bytes());
  for (auto _ : state) {
    ls::inclusive_scan(b, plan, in, out, ws.span());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 16.0 * n);
}

void loom_diagonal(benchmark::State& state) {
  auto& d = the_data();
  const loom::openmp b{static_cast<int>(state.range(0))};
  const loom::index_t dim = 64, steps = static_cast<loom::index_t>(n) / dim;
  const loom::tensor_view<const float, 2> a(d.decay.p, {steps, dim});
  const loom::tensor_view<const float, 2> bv(d.x.p, {steps, dim});
  const loom::tensor_view<float, 2> h(d.y.p, {steps, dim});
  const auto plan = ls::make_plan(b, ls::diagonal{}, steps, dim);
  const loom::workspace_buffer ws(plan.workspace_bytes());
  for (auto _ : state) {
    ls::linear_recurrence(b, plan, a, bv, h, ws.span());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 12.0 * n);
}

#if defined(LOOM_BENCH_HAVE_THRUST)
void thrust_plus(benchmark::State& state) {
  auto& d = the_data();
  omp_set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    thrust::inclusive_scan(thrust::omp::par, d.x.p, d.x.p + n, d.y.p);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 8.0 * n);
}

struct compose {
  ls::affine_pair<float> operator()(const ls::affine_pair<float>& f, const ls::affine_pair<float>& g) const {
    return ls::affine<float>{}.combine(f, g);
  }
};

void thrust_affine(benchmark::State& state) {
  auto& d = the_data();
  omp_set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    thrust::inclusive_scan(thrust::omp::par, d.pairs.p, d.pairs.p + n, d.pairs_out.p, compose{});
    benchmark::ClobberMemory();
  }
  set_bytes(state, 16.0 * n);
}
#endif

void threads(benchmark::internal::Benchmark* b) {
  b->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(memcpy_bench)->Name("scan.memcpy")->Apply(threads);
BENCHMARK(loom_plus)->Name("scan.loom")->Apply(threads);
BENCHMARK(std_seq_plus)->Name("scan.std_seq")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(loom_affine)->Name("scan.loom_affine")->Apply(threads);
BENCHMARK(loom_diagonal)->Name("scan.loom_diagonal")->Apply(threads);
#if defined(LOOM_BENCH_HAVE_THRUST)
BENCHMARK(thrust_plus)->Name("scan.thrust_omp")->Apply(threads);
BENCHMARK(thrust_affine)->Name("scan.thrust_omp_affine")->Apply(threads);
#endif
