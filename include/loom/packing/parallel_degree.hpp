#pragma once

//! @file
//! Per-sequence parallel degree (after ByteScale and FlexSP): each sequence of a global batch gets
//! its own context-parallel degree d and a group of d ranks, so that long sequences are spread
//! over many ranks and short ones run alone, balancing compute under a per-rank memory cap.
//!
//! Model: a sequence of length l on d ranks costs each of them cost(l) / d plus
//! comm_per_token * l * (d - 1) / d (the share of its K/V that travels the ring), and holds
//! ceil(l / d) of its tokens. A rank's load is the sum over the sequences it serves; its memory is
//! the sum of its token shares and must stay within memory_tokens.
//!
//! assign_parallel_degree (greedy): sequences by decreasing cost; each tries every degree d its
//! memory allows, on the d least-loaded ranks with room, and keeps the d that minimises the larger
//! of the maximum load it leaves and the average load the batch must reach (ties: the smaller d). exact_parallel_degree
//! solves tiny cases by enumerating every rank subset per sequence, to measure the greedy's gap.

#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/packing/cost_model.hpp>
#include <loom/packing/packer.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

namespace loom::packing {

struct degree_options {
  int ranks = 0;                //!< ranks available (> 0)
  index_t memory_tokens = 0;    //!< tokens one rank may hold (> 0)
  cost_model cost{};            //!< compute of a whole sequence
  double comm_per_token = 0.0;  //!< cost per token of spreading a sequence (>= 0)
};

//! One sequence's degree and rank group.
struct sequence_group {
  index_t sequence;        //!< index in the input
  std::vector<int> ranks;  //!< ascending; its degree is ranks.size()
};

struct degree_plan {
  std::vector<sequence_group> groups;  //!< one per sequence, in input order
  std::vector<double> rank_load;       //!< modelled load per rank
  std::vector<index_t> rank_tokens;    //!< tokens held per rank
  [[nodiscard]] double max_load() const {
    return rank_load.empty() ? 0.0 : *std::max_element(rank_load.begin(), rank_load.end());
  }
};

namespace detail {

inline double share(const degree_options& o, index_t len, int d) {
  const double dd = d;
  return o.cost(len) / dd + o.comm_per_token * static_cast<double>(len) * (dd - 1) / dd;
}
inline index_t tokens_share(index_t len, int d) { return loom::detail::ceil_div(len, index_t{d}); }

inline void check_degree_inputs(std::span<const index_t> lengths, const degree_options& o, const char* who) {
  LOOM_EXPECTS(o.ranks > 0, errc::invalid_argument, who, ": ranks must be > 0, got ", o.ranks);
  LOOM_EXPECTS(o.memory_tokens > 0, errc::invalid_argument, who, ": memory_tokens must be > 0, got ", o.memory_tokens);
  LOOM_EXPECTS(o.comm_per_token >= 0, errc::invalid_argument, who, ": comm_per_token must be >= 0, got ",
               o.comm_per_token);
  check_lengths(lengths, who);
  for (std::size_t i = 0; i < lengths.size(); ++i)
    LOOM_EXPECTS(tokens_share(lengths[i], o.ranks) <= o.memory_tokens, errc::invalid_argument, who, ": sequence ", i,
                 " of ", lengths[i], " tokens does not fit even on all ", o.ranks, " ranks (", o.memory_tokens,
                 " tokens each)");
}

}  // namespace detail

//! Greedy degree and group per sequence. O(n log n + n R^2).
//! @throws loom::error(invalid_argument) for bad options, lengths <= 0, or a sequence that cannot
//! fit even on all ranks; errc::unsupported when the batch as a whole does not fit in memory.
inline degree_plan assign_parallel_degree(std::span<const index_t> lengths, const degree_options& o) {
  detail::check_degree_inputs(lengths, o, "assign_parallel_degree");
  const auto nr = static_cast<std::size_t>(o.ranks);
  degree_plan out;
  out.groups.resize(lengths.size());
  out.rank_load.assign(nr, 0.0);
  out.rank_tokens.assign(nr, 0);
  std::vector<index_t> order(lengths.size());
  std::iota(order.begin(), order.end(), index_t{0});
  std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) {
    return o.cost(lengths[static_cast<std::size_t>(a)]) > o.cost(lengths[static_cast<std::size_t>(b)]);
  });
  // Work still to place after each sequence, at its cheapest (degree 1, no communication).
  double remaining = 0;
  for (index_t l : lengths) remaining += o.cost(l);
  std::vector<int> by_load(nr);
  for (index_t s : order) {
    const index_t len = lengths[static_cast<std::size_t>(s)];
    std::iota(by_load.begin(), by_load.end(), 0);
    std::stable_sort(by_load.begin(), by_load.end(), [&](int a, int b) {
      return out.rank_load[static_cast<std::size_t>(a)] < out.rank_load[static_cast<std::size_t>(b)];
    });
    const double now = out.max_load();
    remaining -= o.cost(len);
    const double placed = std::accumulate(out.rank_load.begin(), out.rank_load.end(), 0.0);
    // Try every degree the memory allows on the least-loaded ranks with room; score each by the
    // larger of the maximum load it leaves and the average load the whole batch will reach at
    // least (spreading adds communication work for everyone); keep the best (ties: smaller d).
    std::vector<int> best_group;
    double best = std::numeric_limits<double>::infinity();
    const int d_min = static_cast<int>(loom::detail::ceil_div(len, o.memory_tokens));
    for (int d = d_min; d <= o.ranks; ++d) {
      const index_t need = detail::tokens_share(len, d);
      std::vector<int> group;
      double worst = now;
      for (int r : by_load) {
        const auto ur = static_cast<std::size_t>(r);
        if (static_cast<int>(group.size()) == d) break;
        if (need > o.memory_tokens - out.rank_tokens[ur]) continue;  // rank_tokens <= memory_tokens
        group.push_back(r);
        worst = std::max(worst, out.rank_load[ur] + detail::share(o, len, d));
      }
      worst = std::max(worst, (placed + d * detail::share(o, len, d) + remaining) / o.ranks);
      if (static_cast<int>(group.size()) == d && worst < best * (1 - 1e-12)) {
        best = worst;
        best_group = std::move(group);
      }
    }
    LOOM_EXPECTS(!best_group.empty(), errc::unsupported, "assign_parallel_degree: sequence ", s, " of ", len,
                 " tokens finds no ranks with room; the batch exceeds the memory of the ", o.ranks, " ranks");
    const int d = static_cast<int>(best_group.size());
    std::sort(best_group.begin(), best_group.end());
    for (int r : best_group) {
      out.rank_load[static_cast<std::size_t>(r)] += detail::share(o, len, d);
      out.rank_tokens[static_cast<std::size_t>(r)] += detail::tokens_share(len, d);
    }
    out.groups[static_cast<std::size_t>(s)] = {s, std::move(best_group)};
  }
  return out;
}

//! The optimum over every assignment of a non-empty rank subset to each sequence (tiny inputs:
//! ranks <= 6 and sequences <= 6). Returns an empty plan (no groups) if nothing fits.
//! @throws loom::error as assign_parallel_degree, and errc::unsupported for larger inputs.
inline degree_plan exact_parallel_degree(std::span<const index_t> lengths, const degree_options& o) {
  detail::check_degree_inputs(lengths, o, "exact_parallel_degree");
  LOOM_EXPECTS(o.ranks <= 6 && lengths.size() <= 6, errc::unsupported,
               "exact_parallel_degree: tiny inputs only (ranks <= 6, sequences <= 6), got ", o.ranks, " ranks and ",
               lengths.size(), " sequences");
  const auto nr = static_cast<std::size_t>(o.ranks);
  const unsigned subsets = 1u << o.ranks;
  std::vector<double> load(nr, 0.0);
  std::vector<index_t> tok(nr, 0);
  std::vector<unsigned> pick(lengths.size()), best_pick;
  double best = std::numeric_limits<double>::infinity();
  auto dfs = [&](auto&& self, std::size_t k, double cur) -> void {
    if (cur >= best) return;
    if (k == lengths.size()) {
      best = cur;
      best_pick = pick;
      return;
    }
    for (unsigned m = 1; m < subsets; ++m) {
      const int d = __builtin_popcount(m);
      const double sh = detail::share(o, lengths[k], d);
      const index_t need = detail::tokens_share(lengths[k], d);
      bool fits = true;
      double nxt = cur;
      for (std::size_t r = 0; r < nr; ++r)
        if (m >> r & 1u) {
          fits = fits && need <= o.memory_tokens - tok[r];
          nxt = std::max(nxt, load[r] + sh);
        }
      if (!fits || nxt >= best) continue;
      for (std::size_t r = 0; r < nr; ++r)
        if (m >> r & 1u) load[r] += sh, tok[r] += need;
      pick[k] = m;
      self(self, k + 1, nxt);
      for (std::size_t r = 0; r < nr; ++r)
        if (m >> r & 1u) load[r] -= sh, tok[r] -= need;
    }
  };
  dfs(dfs, 0, 0.0);
  degree_plan out;
  out.rank_load.assign(nr, 0.0);
  out.rank_tokens.assign(nr, 0);
  if (best_pick.empty() && !lengths.empty()) return out;
  for (std::size_t k = 0; k < lengths.size(); ++k) {
    sequence_group g{static_cast<index_t>(k), {}};
    const int d = __builtin_popcount(best_pick[k]);
    for (int r = 0; r < o.ranks; ++r)
      if (best_pick[k] >> r & 1u) {
        g.ranks.push_back(r);
        out.rank_load[static_cast<std::size_t>(r)] += detail::share(o, lengths[k], d);
        out.rank_tokens[static_cast<std::size_t>(r)] += detail::tokens_share(lengths[k], d);
      }
    out.groups.push_back(std::move(g));
  }
  return out;
}

}  // namespace loom::packing
