// The physical limits of the machine the other benchmarks run on, measured in the same session:
// memory bandwidth (memcpy, STREAM triad) and dense FLOP rate (sgemm of every BLAS installed:
// Debian's OpenBLAS, a current OpenBLAS, MKL, BLIS; the fastest is the limit), each at 1 and 2
// threads. A loom kernel's GB/s or GFLOP/s is read against these rows.
//
// Units: "GB/s" is 1e9 bytes per second and counts the bytes the kernel reads plus the bytes it
// writes (STREAM's convention; the extra read a cache does before a write, write-allocate, is not
// counted). "GFLOP/s" is 1e9 floating-point operations per second, 2*n^3 per n x n sgemm.
// Every row is timed on the wall clock (UseRealTime): the work is spread over threads.

#include <loom/config.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sgemm.hpp>
#include <string>
#include <utility>
#include <vector>

#if LOOM_HAS_OPENMP
#include <omp.h>
// Without OpenMP the directives vanish instead of tripping -Wunknown-pragmas.
#define BASELINE_OMP(directive) _Pragma(LOOM_STRINGIFY(omp directive))
#else
#define BASELINE_OMP(directive)
#endif

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
const std::vector<int64_t> thread_counts = {1, 2};

int thread_id() {
#if LOOM_HAS_OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

int team_size() {
#if LOOM_HAS_OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// Each streaming array is at least 256 MiB and twice the largest cache, so even memcpy (two
// arrays) streams four times the last-level cache per pass: every byte comes from DRAM.
std::size_t stream_array_bytes() {
  std::size_t largest_cache = 0;
  for (const auto& cache : benchmark::CPUInfo::Get().caches)
    largest_cache = std::max(largest_cache, static_cast<std::size_t>(cache.size));
  const std::size_t bytes = std::max(256 * MiB, 2 * largest_cache);
  return (bytes + 64 * MiB - 1) / (64 * MiB) * (64 * MiB);
}

// Three arrays of doubles shared by every bandwidth row and allocated once: the benchmark library
// calls a row's function several times while it sizes the iteration count. Ordinary 4 KiB pages,
// as loom's own buffers get.
struct stream_arrays {
  std::size_t bytes = stream_array_bytes();
  std::size_t n = bytes / sizeof(double);
  double* a = allocate();
  double* b = allocate();
  double* c = allocate();

  stream_arrays() {
    // First touch with the static schedule the triad uses, so each thread's pages are mapped
    // (and on a multi-socket machine, placed) before timing.
    const auto count = static_cast<std::ptrdiff_t>(n);
    BASELINE_OMP(parallel for schedule(static))
    for (std::ptrdiff_t i = 0; i < count; ++i) {
      a[i] = 0.0;
      b[i] = 1.0;
      c[i] = 2.0;
    }
  }
  ~stream_arrays() {
    std::free(a);
    std::free(b);
    std::free(c);
  }
  stream_arrays(const stream_arrays&) = delete;
  stream_arrays& operator=(const stream_arrays&) = delete;

  double* allocate() const {
    void* p = std::aligned_alloc(2 * MiB, bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<double*>(p);
  }
};

stream_arrays& arrays() {
  static stream_arrays instance;
  return instance;
}

std::string mib(std::size_t bytes) { return std::to_string(bytes / MiB) + " MiB"; }

// [begin, end) of thread k's share of `bytes`, cut on 4 KiB page boundaries.
std::pair<std::size_t, std::size_t> chunk(std::size_t bytes, int k, int threads) {
  constexpr std::size_t page = 4096;
  const std::size_t pages = bytes / page;
  const auto cut = [&](int j) {
    return j == threads ? bytes : pages * static_cast<std::size_t>(j) / static_cast<std::size_t>(threads) * page;
  };
  return {cut(k), cut(k + 1)};
}

// Rows run with fewer threads than named would be mislabelled: refuse them.
bool check_team(benchmark::State& state, int threads) {
  int team = 1;
  BASELINE_OMP(parallel num_threads(threads)) {
    BASELINE_OMP(single)
    team = team_size();
  }
  if (team == threads) return true;
  state.SkipWithError(("asked for " + std::to_string(threads) + " threads, OpenMP gave " + std::to_string(team) +
                       (LOOM_HAS_OPENMP ? "" : " (built without OpenMP)"))
                          .c_str());
  return false;
}

void set_bandwidth(benchmark::State& state, std::size_t bytes_per_iteration) {
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes_per_iteration));
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(bytes_per_iteration) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// memcpy of one array into another; with 2 threads each copies its own half.
void memcpy_bandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  if (!check_team(state, threads)) return;
  auto& s = arrays();
  auto* dst = reinterpret_cast<char*>(s.a);
  const auto* src = reinterpret_cast<const char*>(s.b);
  for (auto _ : state) {
    BASELINE_OMP(parallel num_threads(threads)) {
      const auto [begin, end] = chunk(s.bytes, thread_id(), team_size());
      std::memcpy(dst + begin, src + begin, end - begin);
    }
    benchmark::ClobberMemory();
  }
  set_bandwidth(state, 2 * s.bytes);
  state.SetLabel("2 x " + mib(s.bytes));
}

// STREAM triad on doubles: a[i] = b[i] + s * c[i], 24 bytes per element.
void triad_bandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  if (!check_team(state, threads)) return;
  auto& s = arrays();
  double* __restrict a = s.a;
  const double* __restrict b = s.b;
  const double* __restrict c = s.c;
  const auto n = static_cast<std::ptrdiff_t>(s.n);
  const double scalar = 3.0;
  for (auto _ : state) {
    BASELINE_OMP(parallel for schedule(static) num_threads(threads))
    for (std::ptrdiff_t i = 0; i < n; ++i) a[i] = b[i] + scalar * c[i];
    benchmark::ClobberMemory();
  }
  set_bandwidth(state, 3 * s.bytes);
  state.SetLabel("3 x " + mib(s.bytes) + " of double");
}

// Row-major C = A * B, n x n, single precision, by one of the BLAS libraries installed
// (support/sgemm.hpp), on its own thread pool; one family per library, baseline.sgemm.<kind>.
void sgemm_flops(benchmark::State& state, std::size_t library) {
  const auto& lib = loom::bench::sgemm_libraries()[library];
  const int n = static_cast<int>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const auto elements = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  // Values of order one, away from denormals, so the timing does not depend on the data.
  std::vector<float> a(elements), b(elements), c(elements, 0.0f);
  for (std::size_t i = 0; i < elements; ++i) {
    a[i] = 1.0f + static_cast<float>(i % 7) * 0.125f;
    b[i] = 1.0f - static_cast<float>(i % 5) * 0.125f;
  }
  lib.threads(threads);
  for (auto _ : state) {
    lib.run(n, n, n, a.data(), n, b.data(), n, c.data(), n);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  // Leave the library single-threaded so its idle pool does not compete with later rows.
  lib.threads(1);
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  state.counters["GFLOP/s"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(lib.name);
}

[[maybe_unused]] const bool sgemm_registered = [] {
  const auto& libs = loom::bench::sgemm_libraries();
  for (std::size_t i = 0; i < libs.size(); ++i)
    benchmark::RegisterBenchmark(("baseline.sgemm." + libs[i].kind).c_str(), sgemm_flops, i)
        ->ArgNames({"n", "threads"})
        ->ArgsProduct({{1024, 2048}, thread_counts})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  return true;
}();

}  // namespace

BENCHMARK(memcpy_bandwidth)
    ->Name("baseline.memcpy")
    ->ArgName("threads")
    ->ArgsProduct({thread_counts})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(triad_bandwidth)
    ->Name("baseline.triad")
    ->ArgName("threads")
    ->ArgsProduct({thread_counts})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
