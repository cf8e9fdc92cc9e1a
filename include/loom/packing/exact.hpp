#pragma once

//! @file
//! Exact solvers for tiny inputs, to measure how far the heuristics are from optimal:
//!   exact_min_max_cost: assign documents to `bins` micro-batches, each within `capacity` tokens,
//!                       minimising the largest modelled cost (the WLB-LLM objective);
//!   exact_min_bins:     the fewest micro-batches of `capacity` tokens (the FFD/BFD objective).
//! Branch and bound: documents by decreasing cost, one empty bin tried per level (bins are
//! interchangeable), pruned by max(current max, average load, next item). Exponential in the
//! worst case: inputs are limited to 24 documents and the search to options.node_limit nodes.

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

struct exact_options {
  index_t capacity = std::numeric_limits<index_t>::max();  //!< tokens per micro-batch
  std::int64_t node_limit = 50'000'000;                    //!< search nodes before giving up
};

struct exact_solution {
  bool feasible = false;        //!< some assignment respects the capacity
  bool proven_optimal = false;  //!< the search finished within node_limit
  double max_cost = std::numeric_limits<double>::infinity();
  std::vector<int> bin_of;  //!< per document (input order)
  std::int64_t nodes = 0;   //!< search nodes visited
};

namespace detail {

struct exact_search {
  std::vector<index_t> len;
  std::vector<double> cost, suffix;  // by search order
  std::vector<std::size_t> order;
  index_t capacity;
  int bins;
  std::int64_t node_limit;
  bool first_feasible_only;

  std::vector<double> load;
  std::vector<index_t> tokens;
  std::vector<int> current, best_assign;
  double best = std::numeric_limits<double>::infinity();
  std::int64_t nodes = 0;
  bool aborted = false, found = false;

  void dfs(std::size_t k, double cur_max, double placed) {
    if (aborted || (first_feasible_only && found)) return;
    if (++nodes > node_limit) {
      aborted = true;
      return;
    }
    if (k == len.size()) {
      if (cur_max < best) {
        best = cur_max;
        best_assign = current;
        found = true;
      }
      return;
    }
    const double bound = std::max({cur_max, (placed + suffix[k]) / bins, cost[k]});
    if (!first_feasible_only && bound >= best * (1 - 1e-12)) return;
    bool tried_empty = false;
    for (int b = 0; b < bins; ++b) {
      const auto ub = static_cast<std::size_t>(b);
      if (len[k] > capacity - tokens[ub]) continue;  // tokens <= capacity: no overflow
      if (tokens[ub] == 0) {
        if (tried_empty) continue;  // empty bins are interchangeable
        tried_empty = true;
      }
      load[ub] += cost[k];
      tokens[ub] += len[k];
      current[order[k]] = b;
      dfs(k + 1, std::max(cur_max, load[ub]), placed + cost[k]);
      load[ub] -= cost[k];
      tokens[ub] -= len[k];
    }
  }
};

inline exact_solution exact_run(std::span<const index_t> lengths, int bins, const cost_model& m, const exact_options& o,
                                bool first_feasible_only, const char* who) {
  check_lengths(lengths, who);
  LOOM_EXPECTS(bins >= 1, errc::invalid_argument, who, ": bins must be >= 1, got ", bins);
  LOOM_EXPECTS(o.capacity > 0, errc::invalid_argument, who, ": capacity must be > 0, got ", o.capacity);
  LOOM_EXPECTS(lengths.size() <= 24, errc::unsupported, who,
               ": the exact solver is for tiny inputs (<= 24 documents), got ", lengths.size());
  exact_search s;
  s.order.resize(lengths.size());
  std::iota(s.order.begin(), s.order.end(), std::size_t{0});
  std::stable_sort(s.order.begin(), s.order.end(),
                   [&](std::size_t a, std::size_t b) { return m(lengths[a]) > m(lengths[b]); });
  for (auto i : s.order) {
    s.len.push_back(lengths[i]);
    s.cost.push_back(m(lengths[i]));
  }
  s.suffix.assign(s.len.size() + 1, 0.0);
  for (std::size_t k = s.len.size(); k-- > 0;) s.suffix[k] = s.suffix[k + 1] + s.cost[k];
  s.capacity = o.capacity;
  s.bins = bins;
  s.node_limit = o.node_limit;
  s.first_feasible_only = first_feasible_only;
  s.load.assign(static_cast<std::size_t>(bins), 0.0);
  s.tokens.assign(static_cast<std::size_t>(bins), 0);
  s.current.assign(lengths.size(), -1);
  s.dfs(0, 0.0, 0.0);
  exact_solution r;
  r.feasible = s.found;
  r.proven_optimal = !s.aborted;
  r.nodes = s.nodes;
  if (s.found) {
    r.max_cost = s.best;
    r.bin_of = s.best_assign;
  }
  return r;
}

}  // namespace detail

//! The assignment of documents to `bins` micro-batches (each within options.capacity tokens) that
//! minimises the largest modelled cost. infeasible: feasible == false.
//! @throws loom::error for lengths <= 0, bins < 1, capacity <= 0, or more than 24 documents.
inline exact_solution exact_min_max_cost(std::span<const index_t> lengths, int bins, const cost_model& m,
                                         const exact_options& options = {}) {
  return detail::exact_run(lengths, bins, m, options, false, "exact_min_max_cost");
}

//! The fewest micro-batches of options.capacity tokens that hold every document (each document
//! must fit alone). @throws as exact_min_max_cost, and if a document exceeds the capacity.
inline int exact_min_bins(std::span<const index_t> lengths, const exact_options& options) {
  detail::check_lengths(lengths, "exact_min_bins");
  LOOM_EXPECTS(options.capacity > 0 && options.capacity < std::numeric_limits<index_t>::max(), errc::invalid_argument,
               "exact_min_bins: a finite capacity > 0 is required");
  index_t total = 0;
  for (index_t l : lengths) {
    LOOM_EXPECTS(l <= options.capacity, errc::invalid_argument, "exact_min_bins: a document of ", l,
                 " tokens exceeds the capacity ", options.capacity);
    total = loom::detail::checked_add(total, l, "exact_min_bins: the sum of lengths");
  }
  if (lengths.empty()) return 0;
  for (int k = static_cast<int>(loom::detail::ceil_div(total, options.capacity));; ++k) {
    const auto r = detail::exact_run(lengths, k, cost_model{}, options, true, "exact_min_bins");
    LOOM_EXPECTS(r.proven_optimal || r.feasible, errc::not_converged, "exact_min_bins: node limit reached at ", k,
                 " bins");
    if (r.feasible) return k;
  }
}

}  // namespace loom::packing
