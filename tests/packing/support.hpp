#pragma once

// Shared by the packing tests: long-tail length generators and coverage checks.

#include <loom/packing/packer.hpp>

#include <support/errors.hpp>
#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace loom::test {

enum class tail { lognormal, pareto };

//! n document lengths from a long-tail distribution, clipped to [1, window].
inline std::vector<index_t> long_tail(std::size_t n, tail t, index_t window, std::uint64_t stream) {
  auto g = rng(stream);
  std::vector<index_t> v(n);
  std::lognormal_distribution<double> logn(std::log(300.0), 1.2);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& x : v) {
    const double d = t == tail::lognormal ? logn(g) : 64.0 / std::pow(1.0 - u(g), 1.0 / 1.1);
    x = std::clamp<index_t>(static_cast<index_t>(d), 1, window);
  }
  return v;
}

using loom::test::require_loom_error;

//! Every document id appears in exactly one micro-batch, with its own length.
inline void require_covers(const std::vector<packing::micro_batch>& bins, const std::vector<index_t>& lengths) {
  std::vector<int> seen(lengths.size(), 0);
  std::size_t bad = 0;
  for (const auto& b : bins) {
    REQUIRE(b.cu_seqlens.size() == b.documents.size() + 1);
    REQUIRE(b.cu_seqlens[0] == 0);
    for (std::size_t i = 0; i < b.documents.size(); ++i) {
      const auto id = static_cast<std::size_t>(b.documents[i]);
      REQUIRE(id < lengths.size());
      ++seen[id];
      bad += b.cu_seqlens[i + 1] - b.cu_seqlens[i] != lengths[id];
    }
  }
  CHECK(bad == 0);
  CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<std::ptrdiff_t>(lengths.size()));
}

}  // namespace loom::test
