#pragma once

//! @file
//! Packing documents into micro-batches: the micro_batch type, balance statistics, and the
//! baseline bin packers first-fit-decreasing and best-fit-decreasing on a token capacity.
//! Workload-balanced packing is in packing/wlb.hpp, the exact solver in packing/exact.hpp.
//!
//! Every packer is deterministic: documents are ordered by length (descending), equal lengths by
//! id, or by a seeded hash of the id when options.seed != 0, so a seed replays a plan exactly.

#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/packing/cost_model.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <set>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::packing {

//! One micro-batch: the ids of its documents in packing order and their cu_seqlens (offsets of
//! the documents in the packed sequence; size documents + 1, starting at 0).
struct micro_batch {
  std::vector<index_t> documents;
  std::vector<index_t> cu_seqlens{0};

  [[nodiscard]] index_t tokens() const noexcept { return cu_seqlens.back(); }
  //! Modelled cost: the sum of cost(length) over its documents.
  [[nodiscard]] double cost(const cost_model& m) const {
    double c = 0;
    for (std::size_t i = 0; i + 1 < cu_seqlens.size(); ++i) c += m(cu_seqlens[i + 1] - cu_seqlens[i]);
    return c;
  }
  //! Appends document `id` of `length` tokens. @throws loom::error(invalid_argument) if the
  //! micro-batch's token count would overflow.
  void add(index_t id, index_t length) {
    const index_t end = loom::detail::checked_add(cu_seqlens.back(), length, "micro_batch::add: tokens() + length");
    documents.push_back(id);
    cu_seqlens.push_back(end);
  }
};

//! max, mean and max / mean of a list of costs (max_over_mean is 1 for an empty or all-zero list).
struct balance {
  double max = 0, mean = 0, max_over_mean = 1;
};

inline balance balance_of(std::span<const double> costs) {
  balance b;
  if (costs.empty()) return b;
  b.max = *std::max_element(costs.begin(), costs.end());
  b.mean = std::accumulate(costs.begin(), costs.end(), 0.0) / static_cast<double>(costs.size());
  b.max_over_mean = b.mean > 0 ? b.max / b.mean : 1.0;
  return b;
}

//! Balance of the modelled cost over micro-batches.
inline balance balance_of(std::span<const micro_batch> batches, const cost_model& m) {
  std::vector<double> c;
  c.reserve(batches.size());
  for (const auto& b : batches) c.push_back(b.cost(m));
  return balance_of(c);
}

//! What to do with a document longer than the capacity.
enum class oversize {
  reject,     //!< throw loom::error(invalid_argument) naming the document (the default)
  own_batch,  //!< give it a micro-batch of its own, over the capacity
};

//! Options of the bin packers.
struct bin_options {
  index_t capacity = 0;                //!< tokens per micro-batch (> 0)
  oversize policy = oversize::reject;  //!< documents longer than capacity
  std::uint64_t seed = 0;              //!< 0: equal lengths in id order; else a seeded order
};

namespace detail {

inline void check_lengths(std::span<const index_t> lengths, std::string_view who) {
  for (std::size_t i = 0; i < lengths.size(); ++i)
    LOOM_EXPECTS(lengths[i] > 0, errc::invalid_argument, who, ": document ", i, " has length ", lengths[i],
                 "; lengths must be > 0");
}

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

//! Document ids by length descending; ties by id, or by a seeded hash of the id.
inline std::vector<index_t> decreasing_order(std::span<const index_t> lengths, std::uint64_t seed) {
  std::vector<index_t> order(lengths.size());
  std::iota(order.begin(), order.end(), index_t{0});
  auto key = [&](index_t i) {
    return seed ? mix(seed ^ static_cast<std::uint64_t>(i)) : static_cast<std::uint64_t>(i);
  };
  std::sort(order.begin(), order.end(), [&](index_t a, index_t b) {
    const auto la = lengths[static_cast<std::size_t>(a)], lb = lengths[static_cast<std::size_t>(b)];
    if (la != lb) return la > lb;
    const auto ka = key(a), kb = key(b);
    return ka != kb ? ka < kb : a < b;
  });
  return order;
}

inline void check_bin_options(std::span<const index_t> lengths, const bin_options& o, std::string_view who) {
  LOOM_EXPECTS(o.capacity > 0, errc::invalid_argument, who, ": capacity must be > 0, got ", o.capacity);
  check_lengths(lengths, who);
  if (o.policy == oversize::reject)
    for (std::size_t i = 0; i < lengths.size(); ++i)
      LOOM_EXPECTS(lengths[i] <= o.capacity, errc::invalid_argument, who, ": document ", i, " has ", lengths[i],
                   " tokens, more than the capacity ", o.capacity,
                   "; declare a policy (bin_options::policy = oversize::own_batch) to pack it alone");
}

//! Max-segment-tree over bin remaining capacities: the leftmost bin with room for `need` in
//! O(log n). Unopened bins hold the full capacity, so "no open bin fits" finds the next new one.
class first_fit_tree {
 public:
  first_fit_tree(std::size_t n, index_t capacity) : size_(1) {
    while (size_ < std::max<std::size_t>(n, 1)) size_ *= 2;
    tree_.assign(2 * size_, capacity);
  }
  [[nodiscard]] std::size_t leftmost(index_t need) const {
    std::size_t node = 1;
    while (node < size_) node = tree_[2 * node] >= need ? 2 * node : 2 * node + 1;
    return node - size_;
  }
  [[nodiscard]] index_t remaining(std::size_t bin) const { return tree_[size_ + bin]; }
  void set(std::size_t bin, index_t remaining) {
    std::size_t node = size_ + bin;
    tree_[node] = remaining;
    for (node /= 2; node >= 1; node /= 2) tree_[node] = std::max(tree_[2 * node], tree_[2 * node + 1]);
  }

 private:
  std::size_t size_;
  std::vector<index_t> tree_;
};

}  // namespace detail

//! First-fit-decreasing: each document, longest first, goes to the first micro-batch with room.
//! O(n log n). @throws loom::error(invalid_argument) for lengths <= 0, capacity <= 0, or a
//! document over the capacity with policy oversize::reject.
inline std::vector<micro_batch> first_fit_decreasing(std::span<const index_t> lengths, const bin_options& options) {
  detail::check_bin_options(lengths, options, "first_fit_decreasing");
  std::vector<micro_batch> bins;
  detail::first_fit_tree tree(lengths.size(), options.capacity);
  for (const index_t id : detail::decreasing_order(lengths, options.seed)) {
    const index_t len = lengths[static_cast<std::size_t>(id)];
    std::size_t b;
    if (len > options.capacity) {  // oversize::own_batch: a closed micro-batch of its own
      b = bins.size();
      tree.set(b, 0);
    } else {
      b = tree.leftmost(len);
      tree.set(b, tree.remaining(b) - len);
    }
    if (b == bins.size()) bins.emplace_back();
    bins[b].add(id, len);
  }
  return bins;
}

//! Best-fit-decreasing: each document, longest first, goes to the micro-batch with the least room
//! that still fits it (ties: the earliest). O(n log n). Same errors as first_fit_decreasing.
inline std::vector<micro_batch> best_fit_decreasing(std::span<const index_t> lengths, const bin_options& options) {
  detail::check_bin_options(lengths, options, "best_fit_decreasing");
  std::vector<micro_batch> bins;
  std::set<std::pair<index_t, std::size_t>> room;  // (remaining, bin)
  for (const index_t id : detail::decreasing_order(lengths, options.seed)) {
    const index_t len = lengths[static_cast<std::size_t>(id)];
    std::size_t b = bins.size();
    if (len <= options.capacity) {
      auto it = room.lower_bound({len, 0});
      if (it != room.end()) {
        b = it->second;
        const index_t left = it->first - len;
        room.erase(it);
        if (left > 0) room.insert({left, b});
      } else if (options.capacity - len > 0) {
        room.insert({options.capacity - len, b});
      }
    }
    if (b == bins.size()) bins.emplace_back();
    bins[b].add(id, len);
  }
  return bins;
}

}  // namespace loom::packing
