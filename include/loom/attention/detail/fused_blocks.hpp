#pragma once

//! @file
//! What a fused attention kernel with a diagonal-band mask (cuDNN's SDPA graph: a left and a right
//! bound on the diagonal, top-left aligned, ragged batches) runs for one step of a distributed
//! attention call, derived from the shard plan and the options alone; and the keys under which
//! the graphs for those blocks are built once and cached.
//!
//! A step pairs the queries one rank holds with a block of keys (its own, or another rank's in a
//! ring step). Every (query piece, key piece) pair of the same document becomes at most one
//! fused block:
//!
//!   - cropped to the query rows that see at least one key of the piece and the keys that at
//!     least one of those rows sees (both runs are contiguous), so no row of a block is empty and
//!     the fused kernel never meets a fully masked row;
//!   - its mask in the band convention, in block-local rows i and keys j:
//!
//!       key j visible to query i  iff  j > i - left_bound  and  j <= i + right_bound
//!
//!     (-1: unbounded on that side; after the crop a bounded left_bound is >= 1 and a bounded
//!     right_bound >= 0, the values the band kernels accept). In positions of the document,
//!     loom's window (left, right) and causal flag say i - left <= j <= i + right and j <= i; the
//!     shift between the two pieces' first positions moves the diagonal, and a window's left
//!     counts keys behind the query while the band's left_bound counts the query itself too.
//!   - kind full when neither bound is needed (every pair visible): the unmasked graph.
//!
//! Pairs where no query sees any key (a key piece after a causal query piece, beyond a window,
//! another document) give no block. Blocks with the same bounds and disjoint rows run as one
//! ragged batch (batches_of); a graph_key names the graph such a batch needs.

#include <loom/attention/options.hpp>
#include <loom/core/error.hpp>
#include <loom/shard/plan.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom::attention::detail {

enum class block_kind : std::uint8_t { full, band };

//! One fused block: local rows of the query rank and of the key block, and the band mask.
struct fused_block {
  index_t q_begin = 0, q_count = 0;  //!< query rows [q_begin, q_begin + q_count) on the query rank
  index_t k_begin = 0, k_count = 0;  //!< key rows [k_begin, k_begin + k_count) of the key block
  block_kind kind = block_kind::full;
  index_t left_bound = -1;   //!< key j visible to query i only if j > i - left_bound; -1: unbounded
  index_t right_bound = -1;  //!< and only if j <= i + right_bound; -1: unbounded
  index_t document = 0;      //!< the document both pieces belong to
  friend bool operator==(const fused_block&, const fused_block&) = default;
};

//! The visible offsets j - i (key position minus query position in the document) of a window:
//! [lo, hi], with the unbounded sides as the widest index_t values.
struct offset_range {
  index_t lo, hi;
};
inline offset_range visible_offsets(const options& opt) noexcept {
  constexpr index_t inf = std::numeric_limits<index_t>::max() / 4;
  const index_t lo = opt.window.left < 0 ? -inf : -opt.window.left;
  index_t hi = opt.window.right < 0 ? inf : opt.window.right;
  if (opt.causal) hi = std::min<index_t>(hi, 0);
  return {lo, hi};
}

//! The fused block of `nq` queries at document positions [q0, q0 + nq) (local rows from
//! `q_local`) against `nk` keys at [k0, k0 + nk) of the same document (rows from `k_local`);
//! none where no query sees any key.
inline std::optional<fused_block> fuse_block(const options& opt, index_t q0, index_t nq, index_t q_local, index_t k0,
                                             index_t nk, index_t k_local) {
  if (nq <= 0 || nk <= 0) return std::nullopt;
  const auto [wlo, whi] = visible_offsets(opt);
  if (wlo > whi) return std::nullopt;
  // In piece-local rows i, keys j: visible iff lo <= j - i <= hi.
  const index_t shift = q0 - k0;
  const index_t lo = wlo + shift, hi = whi + shift;
  // Rows with a visible key: i + hi >= 0 and i + lo <= nk - 1; keys seen by a row: j - hi <= nq - 1
  // and j - lo >= 0.
  const index_t i0 = std::max<index_t>(0, -hi), i1 = std::min<index_t>(nq - 1, nk - 1 - lo);
  const index_t j0 = std::max<index_t>(0, lo), j1 = std::min<index_t>(nk - 1, nq - 1 + hi);
  if (i0 > i1 || j0 > j1) return std::nullopt;
  fused_block b;
  b.q_begin = q_local + i0;
  b.q_count = i1 - i0 + 1;
  b.k_begin = k_local + j0;
  b.k_count = j1 - j0 + 1;
  // Re-based to the cropped rows: j' - i' = (j - i) - j0 + i0.
  const index_t lo2 = lo - j0 + i0, hi2 = hi - j0 + i0;
  if (lo2 > -(b.q_count - 1)) b.left_bound = 1 - lo2;  // j' >= i' + lo2  <=>  j' > i' - (1 - lo2)
  if (hi2 < b.k_count - 1) b.right_bound = hi2;
  b.kind = b.left_bound < 0 && b.right_bound < 0 ? block_kind::full : block_kind::band;
  return b;
}

//! Every fused block of the queries `q` holds against the keys `k` holds (two ranks of one shard
//! plan, or one rank twice), in (query piece, key piece) order.
inline std::vector<fused_block> fused_blocks(const shard::rank_plan& q, const shard::rank_plan& k, const options& opt) {
  std::vector<fused_block> out;
  for (const auto& qp : q.pieces)
    for (const auto& kp : k.pieces) {
      if (qp.document != kp.document) continue;
      if (auto b =
              fuse_block(opt, qp.doc_offset, qp.length, qp.local_begin, kp.doc_offset, kp.length, kp.local_begin)) {
        b->document = qp.document;
        out.push_back(*b);
      }
    }
  return out;
}

//! The tables of one ragged batch, in 64-bit words, as a fused kernel reads them (cuDNN's ragged
//! offsets and sequence lengths): the element offsets (batch + 1 each, int64) of the q, k, v, out
//! and lse rows of each entry, then the query counts and the key counts (batch int32 each). Each
//! of the seven regions starts on a 256-byte boundary of the table.
struct fused_tables {
  index_t batch = 0;
  std::vector<std::int64_t> words;
  //! Words per region: batch + 1 rounded up to 32.
  static constexpr std::size_t region(index_t batch) { return (static_cast<std::size_t>(batch) + 1 + 31) / 32 * 32; }
  static constexpr std::size_t size_of(index_t batch) { return 7 * region(batch); }
  //! Word offset of the offsets of q (0), k, v, out, lse (4).
  [[nodiscard]] std::size_t ragged(int which) const { return static_cast<std::size_t>(which) * region(batch); }
  //! Word offset of the query (0) or key (1) counts.
  [[nodiscard]] std::size_t lengths(int which) const { return static_cast<std::size_t>(5 + which) * region(batch); }
  //! Count `entry` of the query (0) or key (1) counts (int32, packed two per word).
  [[nodiscard]] std::int32_t count(int which, index_t entry) const {
    std::int32_t v;
    std::memcpy(&v, reinterpret_cast<const std::byte*>(words.data() + lengths(which)) + 4 * entry, sizeof v);
    return v;
  }
  void set_count(int which, index_t entry, std::int32_t v) {
    std::memcpy(reinterpret_cast<std::byte*>(words.data() + lengths(which)) + 4 * entry, &v, sizeof v);
  }
};

//! The tables of `blocks` as one batch (every entry a block), for heads and dims `s` (any shape
//! with heads_q, heads_kv, dim_qk, dim_v). Counts must fit int32 (the callers check).
template <class Shape>
fused_tables tables_of(const std::vector<fused_block>& blocks, const Shape& s) {
  fused_tables t;
  t.batch = static_cast<index_t>(blocks.size());
  t.words.assign(fused_tables::size_of(t.batch), 0);
  const std::int64_t per_token[5] = {s.heads_q * s.dim_qk, s.heads_kv * s.dim_qk, s.heads_kv * s.dim_v,
                                     s.heads_q * s.dim_v, s.heads_q};
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const fused_block& b = blocks[i];
    const std::int64_t row[5] = {b.q_begin, b.k_begin, b.k_begin, b.q_begin, b.q_begin};
    const std::int64_t count[5] = {b.q_count, b.k_count, b.k_count, b.q_count, b.q_count};
    for (int w = 0; w < 5; ++w) {
      t.words[t.ragged(w) + i] = row[w] * per_token[w];
      // The last offset: the end of the furthest entry.
      auto& end = t.words[t.ragged(w) + blocks.size()];
      end = std::max(end, (row[w] + count[w]) * per_token[w]);
    }
    t.set_count(0, static_cast<index_t>(i), static_cast<std::int32_t>(b.q_count));
    t.set_count(1, static_cast<index_t>(i), static_cast<std::int32_t>(b.k_count));
  }
  return t;
}

//! The views a fused kernel reads through element offsets must be dense: [tokens, heads, dim]
//! with strides (heads dim, dim, 1), or [tokens, heads] with strides (heads, 1).
template <class V>
void expect_dense(const V& v, std::string_view call, std::string_view name) {
  if constexpr (V::rank == 3)
    LOOM_EXPECTS(v.stride(2) == 1 && v.stride(1) == v.extent(2) && v.stride(0) == v.extent(1) * v.extent(2),
                 errc::invalid_argument, call, ": ", name, " must be dense [tokens, heads, dim] (strides ",
                 v.extent(1) * v.extent(2), ", ", v.extent(2), ", 1), got strides ", v.stride(0), ", ", v.stride(1),
                 ", ", v.stride(2));
  else
    LOOM_EXPECTS(v.stride(1) == 1 && v.stride(0) == v.extent(1), errc::invalid_argument, call, ": ", name,
                 " must be dense [tokens, heads] (strides ", v.extent(1), ", 1), got strides ", v.stride(0), ", ",
                 v.stride(1));
}

enum class fused_pass : std::uint8_t { forward, backward };
enum class fused_element : std::uint8_t { fp16, bf16 };

//! Names one fused graph: what cuDNN fixes when a graph is built. key_of rounds a batch's largest
//! block and its size up to a power of two (at least 64), so that the steps of a ring plan can
//! share graphs; a caller that builds for the exact sizes (attention::cudnn) sets them itself.
struct graph_key {
  fused_pass pass = fused_pass::forward;
  fused_element element = fused_element::bf16;
  block_kind kind = block_kind::full;
  index_t heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
  index_t batch = 0, max_q = 0, max_k = 0;  //!< see above
  index_t left_bound = -1, right_bound = -1;
  std::uint64_t scale_bits = 0;      //!< the softmax scale's bits (a graph attribute)
  index_t total_q = 0, total_k = 0;  //!< packed token counts the graph may address (0: not fixed)
  friend bool operator==(const graph_key&, const graph_key&) = default;
};

inline index_t graph_bucket(index_t n) {
  LOOM_EXPECTS(n >= 0, errc::invalid_argument, "graph_bucket: n must be >= 0, got ", n);
  return static_cast<index_t>(std::bit_ceil(static_cast<std::uint64_t>(std::max<index_t>(n, 64))));
}

//! The key of the graph that runs `blocks` (all with the bounds of the first) as one ragged batch.
inline graph_key key_of(fused_pass pass, fused_element element, const head_shape& s, double scale,
                        std::span<const fused_block> blocks) {
  LOOM_EXPECTS(!blocks.empty(), errc::invalid_argument, "fused graph key: blocks must not be empty");
  graph_key k;
  k.pass = pass;
  k.element = element;
  k.kind = blocks.front().kind;
  k.heads_q = s.heads_q;
  k.heads_kv = s.heads_kv;
  k.dim_qk = s.dim_qk;
  k.dim_v = s.dim_v;
  k.left_bound = blocks.front().left_bound;
  k.right_bound = blocks.front().right_bound;
  index_t mq = 0, mk = 0;
  for (const auto& b : blocks) {
    LOOM_EXPECTS(b.left_bound == k.left_bound && b.right_bound == k.right_bound, errc::invalid_argument,
                 "fused graph key: every block of a batch must have the bounds of the first");
    mq = std::max(mq, b.q_count);
    mk = std::max(mk, b.k_count);
  }
  k.batch = graph_bucket(static_cast<index_t>(blocks.size()));
  k.max_q = graph_bucket(mq);
  k.max_k = graph_bucket(mk);
  k.scale_bits = std::bit_cast<std::uint64_t>(scale);
  return k;
}

struct graph_key_hash {
  std::size_t operator()(const graph_key& k) const noexcept {
    const std::uint64_t words[] = {static_cast<std::uint64_t>(k.pass),
                                   static_cast<std::uint64_t>(k.element),
                                   static_cast<std::uint64_t>(k.kind),
                                   static_cast<std::uint64_t>(k.heads_q),
                                   static_cast<std::uint64_t>(k.heads_kv),
                                   static_cast<std::uint64_t>(k.dim_qk),
                                   static_cast<std::uint64_t>(k.dim_v),
                                   static_cast<std::uint64_t>(k.batch),
                                   static_cast<std::uint64_t>(k.max_q),
                                   static_cast<std::uint64_t>(k.max_k),
                                   static_cast<std::uint64_t>(k.left_bound),
                                   static_cast<std::uint64_t>(k.right_bound),
                                   k.scale_bits,
                                   static_cast<std::uint64_t>(k.total_q),
                                   static_cast<std::uint64_t>(k.total_k)};
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (std::uint64_t w : words)
      for (int byte = 0; byte < 8; ++byte) {
        h ^= (w >> (8 * byte)) & 0xffu;
        h *= 1099511628211ull;
      }
    return static_cast<std::size_t>(h);
  }
};

//! Blocks grouped into ragged batches: blocks of one batch have the same (left_bound, right_bound)
//! and pairwise disjoint query rows and key rows, so no two entries of a batch write the same
//! out / lse rows (forward) or dK / dV rows (backward). A query piece that sees two key pieces of
//! its document in one step (a zigzag ring step) thus gives two batches, whose partial results the
//! caller merges like any two key blocks. Batches are in the order their first block appears;
//! each block goes to the first batch it fits.
inline std::vector<std::vector<fused_block>> batches_of(std::span<const fused_block> blocks) {
  const auto apart = [](index_t b0, index_t n0, index_t b1, index_t n1) { return b0 + n0 <= b1 || b1 + n1 <= b0; };
  std::vector<std::vector<fused_block>> out;
  for (const auto& b : blocks) {
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& g) {
      return g.front().left_bound == b.left_bound && g.front().right_bound == b.right_bound &&
             std::all_of(g.begin(), g.end(), [&](const fused_block& o) {
               return apart(o.q_begin, o.q_count, b.q_begin, b.q_count) &&
                      apart(o.k_begin, o.k_count, b.k_begin, b.k_count);
             });
    });
    if (it == out.end())
      out.push_back({b});
    else
      it->push_back(b);
  }
  return out;
}

//! Graphs built once per key and shared: a plan holds one cache; calls from several threads that
//! need the same graph build it once (the others wait) and all get the same one.
template <class Graph>
class graph_cache {
 public:
  template <class Build>
  std::shared_ptr<Graph> get(const graph_key& key, Build&& build) {
    std::unique_lock lock(m_);
    auto& slot = map_[key];
    if (!slot) slot = std::make_shared<entry>();
    const auto e = slot;
    lock.unlock();
    std::call_once(e->once, [&] { e->graph = std::make_shared<Graph>(std::invoke(std::forward<Build>(build), key)); });
    return e->graph;
  }
  [[nodiscard]] std::size_t size() const {
    std::lock_guard lock(m_);
    return map_.size();
  }

 private:
  struct entry {
    std::once_flag once;
    std::shared_ptr<Graph> graph;
  };
  mutable std::mutex m_;
  std::unordered_map<graph_key, std::shared_ptr<entry>, graph_key_hash> map_;
};

}  // namespace loom::attention::detail
