#pragma once

//! @file
//! The blocked scan engine shared by every scan in loom (monoid scans, segmented scans, linear
//! recurrences and their adjoints, and the local halves of cross-rank scans).
//!
//! The sequence is cut into blocks whose size depends on n and the kernel only, never on the
//! thread count. Each block is
//!   1. reduced: its elements folded into an aggregate, in index order;
//!   2. carried: carry[j+1] = advance(carry[j], agg[j]), strictly in block order;
//!   3. scanned: its elements re-scanned from carry[j], writing the output.
//! Every value is computed by the same sequence of operations whatever the thread count, so
//! results are bitwise identical on serial, openmp and kokkos.
//!
//! Host backends run one parallel region per call: each of the backend's threads takes the next
//! block from a shared counter, reduces it, waits for its turn in the carry chain (the previous
//! block's carry), advances the chain and scans its block while the block is still in its cache
//! (so the data crosses memory about twice, read and write, rather than three times). A thread
//! that is descheduled (another process on the core) delays the others by the block it holds,
//! not by a whole phase; the wait yields the core. Devices take every block at once: reduce, carry
//! and scan as three launches.
//!
//! A kernel K provides, all LOOM_HD and const:
//!   using agg_type;  index_t carry_size, agg_size, scratch_size;  (in agg_type units)
//!   init_carry(agg_type* c)                               the carry entering block 0
//!   reduce(begin, end, agg_type* agg, agg_type* scratch)  aggregate of positions [begin, end)
//!   advance(const agg_type* carry, const agg_type* agg, agg_type* out)   carry after a block
//!   compose(const agg_type* first, const agg_type* second, agg_type* out) aggregate of two spans
//!   scan(begin, end, const agg_type* carry, agg_type* scratch)           write the outputs

#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>

#include <atomic>
#include <thread>

namespace loom::scan::detail {

//! Blocks of a scan: a function of n and the kernel's cost per element only.
struct blocking {
  index_t n = 0, block = 1, blocks = 0;
  LOOM_HD constexpr index_t begin(index_t b) const noexcept { return b * block; }
  LOOM_HD constexpr index_t end(index_t b) const noexcept { return (b + 1) * block < n ? (b + 1) * block : n; }
};

//! `requested` > 0 forces the block length; otherwise blocks of about 1 MiB of data (by
//! `bytes_per_element`), at least 64 elements, and at most 64 blocks for short sequences.
inline blocking make_blocking(index_t n, index_t requested, index_t bytes_per_element) {
  blocking b;
  b.n = n;
  if (requested > 0) {
    b.block = requested;
  } else {
    const index_t by_bytes = (index_t{1} << 20) / (bytes_per_element > 0 ? bytes_per_element : 1);
    const index_t cap = by_bytes > 64 ? by_bytes : 64;
    index_t want = (n + 63) / 64;
    if (want < 64) want = 64;
    b.block = want < cap ? want : cap;
  }
  b.blocks = n > 0 ? (n + b.block - 1) / b.block : 0;
  return b;
}

//! Where the engine keeps its state, in units of the kernel's agg_type.
struct layout {
  index_t tile, carry, agg, scratch;
  LOOM_HD constexpr index_t running() const noexcept { return 0; }
  LOOM_HD constexpr index_t carries() const noexcept { return carry; }
  LOOM_HD constexpr index_t aggs() const noexcept { return carry + tile * carry; }
  LOOM_HD constexpr index_t scratches() const noexcept { return aggs() + tile * agg; }
  LOOM_HD constexpr index_t total_agg() const noexcept { return scratches() + tile * scratch; }
  LOOM_HD constexpr index_t size() const noexcept { return total_agg() + 2 * agg; }
};

template <backend B>
index_t tile_of(const B& b, const blocking& blk) {
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    const index_t t = backend_traits<B>::concurrency(b);
    return t < blk.blocks ? (t > 0 ? t : 1) : (blk.blocks > 0 ? blk.blocks : 1);
  } else {
    return blk.blocks > 0 ? blk.blocks : 1;  // devices take every block at once
  }
}

template <class K>
layout layout_for(const K& k, index_t tile) {
  return layout{tile, k.carry_size, k.agg_size, k.scratch_size};
}

template <class K>
struct init_step {
  K k;
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t) const { k.init_carry(ws); }
};

template <class K>
struct reduce_step {
  K k;
  blocking blk;
  layout lay;
  index_t first;
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t j) const {
    k.reduce(blk.begin(first + j), blk.end(first + j), ws + lay.aggs() + j * lay.agg,
             ws + lay.scratches() + j * lay.scratch);
  }
};

template <class K>
struct carry_step {
  K k;
  layout lay;
  index_t count;
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t) const {
    auto* carries = ws + lay.carries();
    for (index_t c = 0; c < lay.carry; ++c) carries[c] = ws[lay.running() + c];
    for (index_t j = 0; j < count; ++j) {
      auto* next = j + 1 < count ? carries + (j + 1) * lay.carry : ws + lay.running();
      k.advance(carries + j * lay.carry, ws + lay.aggs() + j * lay.agg, next);
    }
  }
};

template <class K>
struct scan_step {
  K k;
  blocking blk;
  layout lay;
  index_t first;
  bool single;  //!< one block in all: it starts from the running carry
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t j) const {
    const auto* carry = single ? ws + lay.running() : ws + lay.carries() + j * lay.carry;
    k.scan(blk.begin(first + j), blk.end(first + j), carry, ws + lay.scratches() + j * lay.scratch);
  }
};

//! Folds the tile's aggregates into the total aggregate at total_agg() (ping-pong with the slot
//! after it; the result always ends in total_agg()).
template <class K>
struct total_step {
  K k;
  layout lay;
  index_t count;
  bool first_tile;
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t) const {
    auto* total = ws + lay.total_agg();
    auto* tmp = total + lay.agg;
    index_t j = 0;
    if (first_tile) {
      for (index_t c = 0; c < lay.agg; ++c) total[c] = ws[lay.aggs() + c];
      j = 1;
    }
    for (; j < count; ++j) {
      k.compose(total, ws + lay.aggs() + j * lay.agg, tmp);
      for (index_t c = 0; c < lay.agg; ++c) total[c] = tmp[c];
    }
  }
};

//! dst[0..n) = src[0..n), on the backend.
template <class A>
struct copy_step {
  const A* src;
  A* dst;
  index_t n;
  LOOM_HD void operator()(index_t) const {
    for (index_t c = 0; c < n; ++c) dst[c] = src[c];
  }
};

template <class K>
struct identity_step {
  K k;
  typename K::agg_type* out;
  LOOM_HD void operator()(index_t) const { k.identity_agg(out); }
};

//! The window of a call in the global sequence: global length, where the local slice starts,
//! how many elements it has.
struct window {
  index_t total, begin, count;
};

//! Workspace (in agg_type units) run_scan and run_total need for n elements.
template <backend B, class K>
index_t workspace_size(const B& b, const K& k, const blocking& blk) {
  return layout_for(k, tile_of(b, blk)).size();
}

//! The host path's shared state: the next block to take and the block whose turn it is in the
//! chain (on the calling thread's stack: the region ends before the call returns).
struct chain {
  std::atomic<index_t> next{0}, turn{0};
  //! Takes the next block (>= blocks: none left).
  index_t take() { return next.fetch_add(1, std::memory_order_relaxed); }
  //! Waits until block j may advance the chain: a short spin, then yields the core.
  void wait_turn(index_t j) const {
    for (int spin = 0; turn.load(std::memory_order_acquire) != j; ++spin)
      if (spin >= 64) std::this_thread::yield();
  }
  void pass(index_t j) { turn.store(j + 1, std::memory_order_release); }
};

//! Host path of run_scan: worker w's slots are its carry, aggregate and scratch of the layout.
template <class K>
struct chained_scan_step {
  K k;
  blocking blk;
  layout lay;
  typename K::agg_type* ws;
  chain* ch;
  void operator()(index_t w) const {
    auto* running = ws + lay.running();
    auto* carry = ws + lay.carries() + w * lay.carry;
    auto* agg = ws + lay.aggs() + w * lay.agg;
    auto* scratch = ws + lay.scratches() + w * lay.scratch;
    for (index_t j = ch->take(); j < blk.blocks; j = ch->take()) {
      k.reduce(blk.begin(j), blk.end(j), agg, scratch);
      ch->wait_turn(j);
      for (index_t c = 0; c < lay.carry; ++c) carry[c] = running[c];
      k.advance(carry, agg, running);
      ch->pass(j);
      k.scan(blk.begin(j), blk.end(j), carry, scratch);
    }
  }
};

//! Host path of run_total: the chain composes the blocks' aggregates in block order.
template <class K>
struct chained_total_step {
  K k;
  blocking blk;
  layout lay;
  typename K::agg_type* ws;
  chain* ch;
  void operator()(index_t w) const {
    auto* total = ws + lay.total_agg();
    auto* tmp = total + lay.agg;
    auto* agg = ws + lay.aggs() + w * lay.agg;
    auto* scratch = ws + lay.scratches() + w * lay.scratch;
    for (index_t j = ch->take(); j < blk.blocks; j = ch->take()) {
      k.reduce(blk.begin(j), blk.end(j), agg, scratch);
      ch->wait_turn(j);
      if (j == 0) {
        for (index_t c = 0; c < lay.agg; ++c) total[c] = agg[c];
      } else {
        k.compose(total, agg, tmp);
        for (index_t c = 0; c < lay.agg; ++c) total[c] = tmp[c];
      }
      ch->pass(j);
    }
  }
};

template <backend B>
inline constexpr bool host_engine = backend_traits<B>::memory_space::host_accessible;

//! Scans positions [0, blk.n) with kernel k. `ws` holds workspace_size elements in B's space.
//! The carry entering block 0 is k.init_carry unless `carry_ready` (the caller wrote it at ws[0]).
template <backend B, class K>
void run_scan(const B& b, const K& k, const blocking& blk, typename K::agg_type* ws, bool carry_ready = false) {
  if (blk.blocks == 0) return;
  const index_t tile = tile_of(b, blk);
  const layout lay = layout_for(k, tile);
  if (!carry_ready) for_each_index(b, 1, init_step<K>{k, ws});
  if (blk.blocks == 1) {
    for_each_index(b, 1, scan_step<K>{k, blk, lay, 0, true, ws});
    return;
  }
  if constexpr (host_engine<B>) {
    chain ch;
    for_each_index(b, tile, chained_scan_step<K>{k, blk, lay, ws, &ch});
  } else {
    for (index_t first = 0; first < blk.blocks; first += tile) {
      const index_t count = blk.blocks - first < tile ? blk.blocks - first : tile;
      for_each_index(b, count, reduce_step<K>{k, blk, lay, first, ws});
      for_each_index(b, 1, carry_step<K>{k, lay, count, ws});
      for_each_index(b, count, scan_step<K>{k, blk, lay, first, false, ws});
    }
  }
}

//! The aggregate of all positions, left at ws + layout.total_agg() (blk.n must be > 0).
template <backend B, class K>
typename K::agg_type* run_total(const B& b, const K& k, const blocking& blk, typename K::agg_type* ws) {
  const index_t tile = tile_of(b, blk);
  const layout lay = layout_for(k, tile);
  if constexpr (host_engine<B>) {
    chain ch;
    for_each_index(b, tile, chained_total_step<K>{k, blk, lay, ws, &ch});
  } else {
    for (index_t first = 0; first < blk.blocks; first += tile) {
      const index_t count = blk.blocks - first < tile ? blk.blocks - first : tile;
      for_each_index(b, count, reduce_step<K>{k, blk, lay, first, ws});
      for_each_index(b, 1, total_step<K>{k, lay, count, first == 0, ws});
    }
  }
  return ws + lay.total_agg();
}

}  // namespace loom::scan::detail
