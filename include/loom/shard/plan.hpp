#pragma once

//! @file
//! Context-parallel shard plans: which tokens of a packed sequence (documents delimited by a
//! loom::segments view, int32 or int64 offsets) each of P ranks holds. One planner serves
//! attention (ring, Ulysses and hybrid sharding), scans and linear attention (state-reset points)
//! and the packers; strategies are tag types:
//!
//!   shard::contiguous     rank r holds tokens [r T / P, (r + 1) T / P)
//!   shard::zigzag         the packed sequence in 2P chunks; rank r holds chunks r and 2P - 1 - r
//!                         (balanced for one causal document, not for several)
//!   shard::per_document   every document on its own: floor(d / 2P) tokens per chunk, rank r holds
//!                         chunks r and 2P - 1 - r of it, and the d mod 2P middle tokens are dealt
//!                         to the ranks with the fewest (then the cheapest) middle tokens so far,
//!                         across documents. Padding-free;
//!                         token counts per rank differ by at most one; the symmetric part of each
//!                         document costs every rank the same; works for documents shorter than 2P.
//!
//! A plan lists, per rank, the pieces it holds (a piece is a run of consecutive tokens of one
//! document) in local order, the local cu_seqlens (one segment per piece), the local positions
//! where a document starts (where a scan resets its state), and the exact causal work. It maps
//! global token positions to (rank, local position) and back.
//!
//!   std::vector<std::int32_t> cu = {0, 5, 12};
//!   auto p = loom::shard::make_plan(loom::segments{std::span<const std::int32_t>(cu)}, 4,
//!                                   loom::shard::per_document{});
//!   p.rank(r).segments();   // rank r's local documents (one per piece), as loom::segments
//!
//! A plan is immutable once made, and may be read from several threads at once.

#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/packing/cost_model.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

namespace loom::shard {

struct contiguous {};
struct zigzag {};
struct per_document {};

template <class S>
concept strategy = std::same_as<S, contiguous> || std::same_as<S, zigzag> || std::same_as<S, per_document>;

//! A run of consecutive tokens of one document held by one rank.
struct piece {
  index_t document;      //!< index of the document in cu_seqlens
  index_t doc_offset;    //!< position of its first token inside the document
  index_t global_begin;  //!< position of its first token in the packed input
  index_t local_begin;   //!< position of its first token on its rank
  index_t length;        //!< tokens
};

//! What one rank holds.
struct rank_plan {
  std::vector<piece> pieces;          //!< in local order
  std::vector<index_t> cu_seqlens;    //!< local segment offsets, one segment per piece (size pieces + 1)
  std::vector<index_t> reset_points;  //!< local positions where a document starts (doc_offset == 0)
  index_t tokens = 0;                 //!< tokens held
  std::int64_t causal_pairs = 0;      //!< exact causal (query, key) pairs of the held queries

  //! The local offsets as a loom::segments view (valid while the plan lives).
  [[nodiscard]] loom::segments<host_memory> segments() const noexcept {
    return loom::segments<host_memory>(std::span<const std::int64_t>(cu_seqlens));
  }

  //! Modelled cost of this rank's queries: sum over pieces of m.chunk(doc_offset, length).
  [[nodiscard]] double cost(const packing::cost_model& m) const {
    double c = 0;
    for (const auto& p : pieces) c += m.chunk(p.doc_offset, p.length);
    return c;
  }
};

//! A plan for P ranks over a packed sequence.
class plan {
 public:
  struct location {
    int rank;
    index_t local;
  };

  [[nodiscard]] int ranks() const noexcept { return static_cast<int>(rank_.size()); }
  [[nodiscard]] index_t total_tokens() const noexcept { return cu_seqlens_.back(); }
  [[nodiscard]] const std::vector<index_t>& cu_seqlens() const noexcept { return cu_seqlens_; }
  //! The global document offsets as a loom::segments view (int64; valid while the plan lives).
  [[nodiscard]] loom::segments<host_memory> segments() const noexcept {
    return loom::segments<host_memory>(std::span<const std::int64_t>(cu_seqlens_));
  }
  [[nodiscard]] const rank_plan& rank(int r) const { return rank_.at(static_cast<std::size_t>(r)); }

  //! Where global token `g` lives. @throws loom::error(invalid_argument) if g is out of range.
  [[nodiscard]] location to_local(index_t g) const {
    LOOM_EXPECTS(g >= 0 && g < total_tokens(), errc::invalid_argument, "shard::plan::to_local: token ", g,
                 " outside [0, ", total_tokens(), ")");
    auto it = std::upper_bound(by_global_.begin(), by_global_.end(), g,
                               [&](index_t v, const ref& r) { return v < piece_of(r).global_begin; });
    const ref& r = *(it - 1);
    const piece& p = piece_of(r);
    return {r.rank, p.local_begin + (g - p.global_begin)};
  }

  //! The global position of local token `local` on rank `r`. @throws loom::error if out of range.
  [[nodiscard]] index_t to_global(int r, index_t local) const {
    LOOM_EXPECTS(r >= 0 && r < ranks(), errc::invalid_argument, "shard::plan::to_global: rank ", r, " outside [0, ",
                 ranks(), ")");
    const auto& rp = rank_[static_cast<std::size_t>(r)];
    LOOM_EXPECTS(local >= 0 && local < rp.tokens, errc::invalid_argument, "shard::plan::to_global: local token ", local,
                 " outside [0, ", rp.tokens, ") on rank ", r);
    auto it = std::upper_bound(rp.pieces.begin(), rp.pieces.end(), local,
                               [](index_t v, const piece& p) { return v < p.local_begin; });
    return (it - 1)->global_begin + (local - (it - 1)->local_begin);
  }

  //! Copies this rank's rows out of a global array of rows of `row` elements (e.g. heads x dim).
  template <class T>
  void scatter(int r, std::span<const T> global, index_t row, std::span<T> local) const {
    check_rows("scatter", r, global.size(), local.size(), row);
    for (const auto& p : rank_[static_cast<std::size_t>(r)].pieces)
      std::copy_n(global.data() + p.global_begin * row, p.length * row, local.data() + p.local_begin * row);
  }

  //! Copies this rank's rows back into their places in a global array.
  template <class T>
  void gather(int r, std::span<const T> local, index_t row, std::span<T> global) const {
    check_rows("gather", r, global.size(), local.size(), row);
    for (const auto& p : rank_[static_cast<std::size_t>(r)].pieces)
      std::copy_n(local.data() + p.local_begin * row, p.length * row, global.data() + p.global_begin * row);
  }

 private:
  template <strategy S>
  friend plan make_plan(const loom::segments<host_memory>& documents, int ranks, S);

  struct ref {
    int rank;
    std::size_t index;
  };
  std::vector<index_t> cu_seqlens_;
  std::vector<rank_plan> rank_;
  std::vector<ref> by_global_;  // every piece, by global position

  [[nodiscard]] const piece& piece_of(const ref& r) const {
    return rank_[static_cast<std::size_t>(r.rank)].pieces[r.index];
  }
  void check_rows(const char* who, int r, std::size_t global, std::size_t local, index_t row) const {
    LOOM_EXPECTS(r >= 0 && r < ranks(), errc::invalid_argument, "shard::plan::", who, ": rank ", r, " outside [0, ",
                 ranks(), ")");
    LOOM_EXPECTS(row > 0, errc::invalid_argument, "shard::plan::", who, ": row must be > 0, got ", row);
    LOOM_EXPECTS(!loom::detail::mul_overflows(total_tokens(), row), errc::invalid_argument, "shard::plan::", who,
                 ": total tokens * row = ", total_tokens(), " * ", row, " overflows a 64-bit signed integer");
    LOOM_EXPECTS(global == static_cast<std::size_t>(total_tokens() * row), errc::shape_mismatch, "shard::plan::", who,
                 ": the global array holds ", global, " elements, expected ", total_tokens(), " tokens x ", row);
    const auto want = static_cast<std::size_t>(rank_[static_cast<std::size_t>(r)].tokens * row);
    LOOM_EXPECTS(local == want, errc::shape_mismatch, "shard::plan::", who, ": the local array of rank ", r, " holds ",
                 local, " elements, expected ", rank_[static_cast<std::size_t>(r)].tokens, " tokens x ", row);
  }
};

namespace detail {

// Appends the tokens [g0, g1) of the packed sequence to a rank, split at document boundaries and
// merged with the previous piece when they continue it.
inline void append_range(rank_plan& rp, std::span<const index_t> cu, index_t g0, index_t g1) {
  while (g0 < g1) {
    const auto d = static_cast<index_t>(std::upper_bound(cu.begin(), cu.end(), g0) - cu.begin()) - 1;
    const index_t end = std::min(g1, cu[static_cast<std::size_t>(d) + 1]);
    const index_t len = end - g0;
    if (!rp.pieces.empty()) {
      piece& last = rp.pieces.back();
      if (last.document == d && last.global_begin + last.length == g0) {
        last.length += len;
        rp.tokens += len;
        g0 = end;
        continue;
      }
    }
    rp.pieces.push_back({d, g0 - cu[static_cast<std::size_t>(d)], g0, rp.tokens, len});
    rp.tokens += len;
    g0 = end;
  }
}

}  // namespace detail

namespace detail {

//! Validates `documents` for the planner and returns their offsets widened to index_t: the
//! offsets must start at 0 and be non-decreasing (loom::check_segments); implicit segments must
//! be bound to a token count (loom::segments<>::whole(n)).
inline std::vector<index_t> checked_offsets(const loom::segments<host_memory>& documents, std::string_view call) {
  LOOM_EXPECTS(!documents.implicit() || documents[1] >= 0, errc::invalid_argument, call,
               ": implicit cu_seqlens must be bound to a token count (loom::segments<>::whole(n))");
  const index_t n = documents.implicit() ? documents[1] : documents.size() >= 1 ? documents[documents.count()] : 0;
  const auto seg = loom::check_segments(documents, n, call, "cu_seqlens");
  std::vector<index_t> cu(static_cast<std::size_t>(seg.count()) + 1);
  for (std::size_t i = 0; i < cu.size(); ++i) cu[i] = seg[static_cast<index_t>(i)];
  return cu;
}

}  // namespace detail

//! Plans `ranks` shards of the packed sequence whose documents `documents` delimits (int32 or
//! int64 offsets in host memory, documents + 1 values starting at 0, non-decreasing; empty
//! documents are allowed and hold no tokens). O(tokens / chunk + documents * ranks) time; the
//! plan is the same on every rank that calls it.
//! @throws loom::error(invalid_argument) for ranks < 1, malformed offsets (loom::check_segments),
//! implicit segments without a token count, sizes whose products overflow (ranks * tokens,
//! 2 * ranks * tokens for zigzag), a document longer than packing::max_causal_length, or causal
//! pairs summed over the documents beyond 2^63 - 1.
template <strategy S>
plan make_plan(const loom::segments<host_memory>& documents, int ranks, S) {
  LOOM_EXPECTS(ranks >= 1, errc::invalid_argument, "shard::make_plan: ranks must be >= 1, got ", ranks);
  const std::vector<index_t> offsets = detail::checked_offsets(documents, "shard::make_plan");
  const std::span<const index_t> cu_seqlens(offsets);
  const index_t total = cu_seqlens.back();
  const index_t p = ranks;
  // Chunk boundaries are k * total / P (contiguous) and k * total / 2P (zigzag) for k <= P or 2P.
  if constexpr (std::same_as<S, contiguous>)
    (void)loom::detail::checked_mul(p, total, "shard::make_plan: ranks * cu_seqlens.back()");
  else if constexpr (std::same_as<S, zigzag>)
    (void)loom::detail::checked_mul(2 * p, total, "shard::make_plan: 2 * ranks * cu_seqlens.back()");
  // Every rank's causal_pairs (and the middle work per_document balances) is at most the sum of
  // the documents' causal pairs: it must fit a 64-bit count.
  std::int64_t pairs = 0;
  for (std::size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    const index_t len = cu_seqlens[d + 1] - cu_seqlens[d];
    LOOM_EXPECTS(len <= packing::max_causal_length, errc::invalid_argument, "shard::make_plan: document ", d,
                 " of cu_seqlens has ", len, " tokens; its causal pairs fit a 64-bit count only up to ",
                 packing::max_causal_length, " tokens");
    pairs = loom::detail::checked_add(pairs, packing::causal_pairs(len),
                                      "shard::make_plan: the causal pairs of the documents of cu_seqlens");
  }
  plan out;
  out.cu_seqlens_ = offsets;
  out.rank_.resize(static_cast<std::size_t>(ranks));
  auto& rk = out.rank_;

  if constexpr (std::same_as<S, contiguous>) {
    for (index_t r = 0; r < p; ++r)
      detail::append_range(rk[static_cast<std::size_t>(r)], cu_seqlens, r * total / p, (r + 1) * total / p);
  } else if constexpr (std::same_as<S, zigzag>) {
    auto bound = [&](index_t k) { return k * total / (2 * p); };
    for (index_t r = 0; r < p; ++r) {
      detail::append_range(rk[static_cast<std::size_t>(r)], cu_seqlens, bound(r), bound(r + 1));
      detail::append_range(rk[static_cast<std::size_t>(r)], cu_seqlens, bound(2 * p - 1 - r), bound(2 * p - r));
    }
  } else {
    // Middle tokens go, one by one, to the rank with the fewest middle tokens so far and, among
    // those, the least middle work: token counts stay within one, and the work of the middle
    // tokens (the only part that differs between ranks) is balanced greedily across documents.
    std::vector<index_t> mid_tokens(static_cast<std::size_t>(p), 0);
    std::vector<std::int64_t> mid_work(static_cast<std::size_t>(p), 0);
    std::vector<std::vector<index_t>> mine(static_cast<std::size_t>(p));
    for (std::size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
      const index_t start = cu_seqlens[d], len = cu_seqlens[d + 1] - start;
      const index_t c = len / (2 * p), rem = len % (2 * p);
      for (auto& m : mine) m.clear();
      for (index_t j = rem; j-- > 0;) {  // costliest first
        std::size_t best = 0;
        for (std::size_t r = 1; r < mine.size(); ++r)
          if (mid_tokens[r] < mid_tokens[best] || (mid_tokens[r] == mid_tokens[best] && mid_work[r] < mid_work[best]))
            best = r;
        mine[best].push_back(start + p * c + j);
        ++mid_tokens[best];
        mid_work[best] += p * c + j + 1;  // causal pairs of the token at offset p c + j
      }
      for (index_t r = 0; r < p; ++r) {
        auto& rp = rk[static_cast<std::size_t>(r)];
        detail::append_range(rp, cu_seqlens, start + r * c, start + (r + 1) * c);  // chunk r
        auto& m = mine[static_cast<std::size_t>(r)];
        std::sort(m.begin(), m.end());  // local order follows the document
        for (index_t g : m) detail::append_range(rp, cu_seqlens, g, g + 1);
        const index_t hi = start + p * c + rem + (p - 1 - r) * c;  // chunk 2P - 1 - r, after the middle
        detail::append_range(rp, cu_seqlens, hi, hi + c);
      }
    }
  }

  for (int r = 0; r < ranks; ++r) {
    auto& rp = rk[static_cast<std::size_t>(r)];
    rp.cu_seqlens.assign(1, 0);
    for (std::size_t i = 0; i < rp.pieces.size(); ++i) {
      const auto& pc = rp.pieces[i];
      rp.cu_seqlens.push_back(pc.local_begin + pc.length);
      if (pc.doc_offset == 0) rp.reset_points.push_back(pc.local_begin);
      rp.causal_pairs += packing::chunk_causal_pairs(pc.doc_offset, pc.length);
      out.by_global_.push_back({r, i});
    }
  }
  std::sort(out.by_global_.begin(), out.by_global_.end(),
            [&](const auto& a, const auto& b) { return out.piece_of(a).global_begin < out.piece_of(b).global_begin; });
  return out;
}

//! One rank's tokens as a single run of the packed sequence: what the families that keep the
//! sequence order across ranks (cross-rank scans and recurrences, LASP-2) take from a shard plan.
struct run {
  index_t begin = 0;   //!< the rank's first token in the packed sequence
  index_t tokens = 0;  //!< tokens held
};

//! Rank r's run in `p` (no checks: an r outside the plan gives an empty run). See expect_runs.
inline run run_of(const plan& p, int r) noexcept {
  if (r < 0 || r >= p.ranks()) return {};
  const rank_plan& rp = p.rank(r);
  index_t begin = 0;
  for (int q = 0; q < r; ++q) begin += p.rank(q).tokens;
  return {begin, rp.tokens};
}

//! Checks that `p` is a plan for `ranks` ranks whose ranks each hold one run of the packed
//! sequence, in rank order (shard::contiguous does; zigzag and per_document interleave the ranks).
//! @throws loom::error(invalid_argument) naming `call`, the rank and the token where it breaks.
inline void expect_runs(const plan& p, int ranks, std::string_view call) {
  LOOM_EXPECTS(p.ranks() == ranks, errc::invalid_argument, call, ": the shard plan is for ", p.ranks(),
               " ranks, the communicator has ", ranks);
  index_t next = 0;
  for (int r = 0; r < ranks; ++r)
    for (const piece& pc : p.rank(r).pieces) {
      LOOM_EXPECTS(pc.global_begin == next, errc::invalid_argument, call,
                   ": the shard plan must give each rank one run of the sequence, in rank order (shard::contiguous): "
                   "rank ",
                   r, " holds a piece from token ", pc.global_begin, " where token ", next, " comes next");
      next += pc.length;
    }
}

}  // namespace loom::shard
