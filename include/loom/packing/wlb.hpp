#pragma once

//! @file
//! Workload-balanced packing (after WLB-LLM, OSDI'25): variable-length micro-batches under a
//! token cap that balance the modelled cost (attention is quadratic, so equal tokens is not equal
//! work), with a multi-level outlier delay queue and a hard bound on how long a document waits.
//!
//! Each step (push):
//! 1. New documents at or above the first outlier threshold go to the FIFO queue of their level
//!    (thresholds L_1 < L_2 < ...; level i holds L_i <= length < L_{i+1}); the others are placed.
//! 2. A queue holding at least N documents (N = micro-batches per step) releases N of them, so the
//!    long documents of a step arrive together and spread one per micro-batch.
//! 3. Documents whose wait reached max_delay_steps are due (with max_delay_steps = 0, every
//!    document is due in the step it arrives): they are placed first, then released and
//!    carried-over documents, then the new ones; each group longest first.
//! 4. A document goes to the micro-batch of least modelled cost among those where it fits under
//!    the token cap; if none has room it is carried to the next step.
//! Delay bound: a document is emitted at most max_delay_steps steps after it was pushed. Due
//! documents are placed before anything else, so the bound holds whenever the documents due in
//! one step fit into N micro-batches (always when at most N are due); otherwise push throws
//! errc::unsupported naming the document, rather than break the bound silently.

#include <loom/core/error.hpp>
#include <loom/packing/cost_model.hpp>
#include <loom/packing/packer.hpp>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

namespace loom::packing {

//! A document entering the packer: a caller-chosen id and its length in tokens.
struct document {
  index_t id;
  index_t length;
};

struct wlb_options {
  int micro_batches = 8;                      //!< N: micro-batches per step (> 0)
  index_t token_cap = 0;                      //!< tokens per micro-batch, the memory limit (> 0)
  std::vector<index_t> outlier_thresholds{};  //!< strictly increasing; empty: no delay queues
  int max_delay_steps = 2;                    //!< the longest a document may wait (>= 0)
  cost_model cost{};                          //!< what is balanced
  std::uint64_t seed = 0;                     //!< 0: equal lengths in id order; else seeded order
};

//! What one step emits.
struct wlb_step {
  std::int64_t step = 0;                   //!< 0-based step number
  std::vector<micro_batch> micro_batches;  //!< exactly N, some possibly empty
  std::vector<index_t> waiting;            //!< ids held back at the end of this step
};

//! The stateful workload-balanced packer. Not thread-safe; one per data-parallel stream.
class wlb_packer {
 public:
  //! @throws loom::error(invalid_argument) for N <= 0, token_cap <= 0, max_delay_steps < 0,
  //! thresholds that are not strictly increasing and positive.
  explicit wlb_packer(wlb_options options) : o_(std::move(options)) {
    LOOM_EXPECTS(o_.micro_batches > 0, errc::invalid_argument, "wlb_packer: micro_batches must be > 0, got ",
                 o_.micro_batches);
    LOOM_EXPECTS(o_.token_cap > 0, errc::invalid_argument, "wlb_packer: token_cap must be > 0, got ", o_.token_cap);
    LOOM_EXPECTS(o_.max_delay_steps >= 0, errc::invalid_argument, "wlb_packer: max_delay_steps must be >= 0, got ",
                 o_.max_delay_steps);
    for (std::size_t i = 0; i < o_.outlier_thresholds.size(); ++i)
      LOOM_EXPECTS(o_.outlier_thresholds[i] > 0 && (i == 0 || o_.outlier_thresholds[i] > o_.outlier_thresholds[i - 1]),
                   errc::invalid_argument, "wlb_packer: outlier_thresholds must be positive and strictly increasing (",
                   "entry ", i, " is ", o_.outlier_thresholds[i], ")");
    queues_.resize(o_.outlier_thresholds.size());
  }

  //! Adds this step's documents and returns the step's micro-batches.
  //! @throws loom::error(invalid_argument) for a length <= 0 or > token_cap (no micro-batch could
  //! ever hold it: split it or raise the cap); errc::unsupported if the due documents overflow.
  wlb_step push(std::span<const document> docs) {
    for (const auto& d : docs) {
      LOOM_EXPECTS(d.length > 0, errc::invalid_argument, "wlb_packer::push: document ", d.id, " has length ", d.length,
                   "; lengths must be > 0");
      LOOM_EXPECTS(d.length <= o_.token_cap, errc::invalid_argument, "wlb_packer::push: document ", d.id, " has ",
                   d.length, " tokens, more than token_cap ", o_.token_cap,
                   "; no micro-batch can hold it (split it or raise the cap)");
    }
    std::vector<item> placing;
    for (const auto& d : docs) {
      const item it{d.id, d.length, step_};
      const auto level = static_cast<std::size_t>(
          std::upper_bound(o_.outlier_thresholds.begin(), o_.outlier_thresholds.end(), d.length) -
          o_.outlier_thresholds.begin());
      if (level == 0)
        placing.push_back(it);
      else
        queues_[level - 1].push_back(it);
    }
    return run_step(std::move(placing), false);
  }

  //! A step without new documents that releases every queue; call until pending() == 0.
  wlb_step flush() { return run_step({}, true); }

  //! Documents held in queues or carried over.
  [[nodiscard]] std::size_t pending() const {
    std::size_t n = carried_.size();
    for (const auto& q : queues_) n += q.size();
    return n;
  }
  [[nodiscard]] const wlb_options& options() const noexcept { return o_; }

 private:
  struct item {
    index_t id, length;
    std::int64_t arrived;
  };
  wlb_options o_;
  std::vector<std::deque<item>> queues_;
  std::vector<item> carried_;
  std::int64_t step_ = 0;

  [[nodiscard]] bool due(const item& it) const { return step_ - it.arrived >= o_.max_delay_steps; }

  wlb_step run_step(std::vector<item> fresh, bool release_all) {
    const auto n = static_cast<std::size_t>(o_.micro_batches);
    std::vector<item> first, second;  // due documents, then released and carried ones
    for (auto& it : carried_) (due(it) ? first : second).push_back(it);
    carried_.clear();
    if (o_.max_delay_steps == 0) {  // no document may wait: the new ones are due at once
      first.insert(first.end(), fresh.begin(), fresh.end());
      fresh.clear();
    }
    for (auto& q : queues_) {
      // Due documents leave their queue whatever its size; a full queue releases N more.
      for (auto it = q.begin(); it != q.end();)
        if (due(*it)) {
          first.push_back(*it);
          it = q.erase(it);
        } else {
          ++it;
        }
      while (!q.empty() && (release_all || q.size() >= n)) {
        for (std::size_t k = 0; k < n && !q.empty(); ++k) {
          second.push_back(q.front());
          q.pop_front();
        }
      }
    }
    auto by_length = [&](const item& a, const item& b) {
      if (a.length != b.length) return a.length > b.length;
      if (o_.seed) {
        const auto ka = detail::mix(o_.seed ^ static_cast<std::uint64_t>(a.id));
        const auto kb = detail::mix(o_.seed ^ static_cast<std::uint64_t>(b.id));
        if (ka != kb) return ka < kb;
      }
      return a.id < b.id;
    };
    std::sort(first.begin(), first.end(), by_length);
    std::sort(second.begin(), second.end(), by_length);
    std::sort(fresh.begin(), fresh.end(), by_length);

    wlb_step out;
    out.step = step_;
    out.micro_batches.resize(n);
    std::vector<double> cost(n, 0.0);
    auto place = [&](const item& it) {
      std::size_t best = n;
      for (std::size_t b = 0; b < n; ++b)
        if (it.length <= o_.token_cap - out.micro_batches[b].tokens() && (best == n || cost[b] < cost[best]))
          best = b;  // tokens() <= token_cap: the difference does not overflow
      if (best == n) return false;
      out.micro_batches[best].add(it.id, it.length);
      cost[best] += o_.cost(it.length);
      return true;
    };
    for (const auto& it : first)
      LOOM_EXPECTS(place(it), errc::unsupported, "wlb_packer: document ", it.id, " (", it.length,
                   " tokens) has waited ", step_ - it.arrived,
                   " steps, the bound (max_delay_steps = ", o_.max_delay_steps,
                   "), but the documents due this step do not fit into ", n, " micro-batches of ", o_.token_cap,
                   " tokens; more micro-batches or a larger cap are needed");
    for (const auto& it : second)
      if (!place(it)) carried_.push_back(it);
    for (const auto& it : fresh)
      if (!place(it)) carried_.push_back(it);  // waits: max_delay_steps > 0 here
    for (const auto& it : carried_) out.waiting.push_back(it.id);
    for (const auto& q : queues_)
      for (const auto& it : q) out.waiting.push_back(it.id);
    ++step_;
    return out;
  }
};

}  // namespace loom::packing
