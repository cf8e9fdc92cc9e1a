#pragma once

// Seeded generators. Every random input of a test derives from loom::test::seed() (the
// LOOM_TEST_SEED environment variable, or a fixed default) and a per-use stream id, so a run is
// reproducible and a failure can be replayed.

#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

namespace loom::test {

inline std::uint64_t seed() {
  static const std::uint64_t s = [] {
    const char* env = std::getenv("LOOM_TEST_SEED");
    return env ? std::strtoull(env, nullptr, 10) : std::uint64_t{20261122};
  }();
  return s;
}

//! A generator for stream `stream` of the run's seed.
inline std::mt19937_64 rng(std::uint64_t stream) { return std::mt19937_64(seed() * 0x9E3779B97F4A7C15ull + stream); }

//! n values uniform in [lo, hi), converted to T.
template <class T>
std::vector<T> uniform(index_t n, double lo, double hi, std::uint64_t stream) {
  auto g = rng(stream);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<T>(d(g));
  return v;
}

//! n small integers in [lo, hi] as T: sums of them are exact in every precision we test.
template <class T>
std::vector<T> small_integers(index_t n, int lo, int hi, std::uint64_t stream) {
  auto g = rng(stream);
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<T>(static_cast<float>(d(g)));
  return v;
}

//! Cut points (P + 1 values) of n elements over P ranks: uneven, and rank 1 empty when P > 2, the
//! slicing the cross-rank tests use.
inline std::vector<index_t> uneven_slices(index_t n, int p, std::uint64_t stream) {
  auto g = rng(stream);
  std::vector<index_t> cut{0};
  for (int r = 1; r < p; ++r) cut.push_back(static_cast<index_t>(g() % static_cast<std::uint64_t>(n + 1)));
  cut.push_back(n);
  std::sort(cut.begin(), cut.end());
  if (p > 2) cut[2] = cut[1];
  return cut;
}

}  // namespace loom::test
