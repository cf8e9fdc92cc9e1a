#pragma once

//! @file
//! The blocked scan engine shared by every scan in loom (monoid scans, segmented scans, linear
//! recurrences and their adjoints, and the local halves of cross-rank scans).
//!
//! The sequence is cut into blocks, and each block into sub-blocks, whose sizes depend on n and the
//! kernel only, never on the backend or the thread count. Each block is
//!   1. reduced: each sub-block's elements folded into an aggregate, in index order, then the
//!      sub-blocks' aggregates composed in order into the block's;
//!   2. carried: carry[j+1] = advance(carry[j], agg[j]), strictly in block order;
//!   3. scanned: the carry entering each sub-block advanced from carry[j] over the sub-blocks
//!      before it, in order, and each sub-block re-scanned from its carry, writing the output.
//! Every value is computed by the same sequence of operations on every backend and thread count,
//! so results are bitwise identical on serial, openmp, kokkos, the stand-in and cuda.
//!
//! Host backends run one parallel region per call: each of the backend's threads takes the next
//! block from a shared counter, reduces it, advances the carry chain over every block reduced so
//! far (one thread at a time, in block order) and scans its block while it is still in its cache
//! (so the data crosses memory about twice, read and write, rather than three times). A block whose
//! carry is not known yet is scanned later, after the last block is taken, by whichever thread
//! claims it. No thread waits while blocks are left to take, so a thread that loses its core to
//! another process delays the others by the one block it holds; a waiting thread yields the core.
//! Devices take every block at once, one team (loom::for_each_team: a CUDA block) per block: its
//! members reduce the sub-blocks side by side, one member composes them; one thread advances the
//! carry chain over the blocks; then one member advances the sub-block carries and the members
//! scan the sub-blocks side by side. Three launches.
//!
//! A host call forks at most one worker per loom::parallel_grain_bytes of data (and none for less
//! than twice that): a parallel region ends when its last thread arrives, and on a loaded machine a
//! thread can wait a whole scheduler slice for its core, so forking for a short scan costs far more
//! than it saves. The blocks, and so the bits, are the same for any number of workers.
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

//! Data of a sub-block (the unit a device team member takes; the host folds the same units).
inline constexpr index_t sub_block_bytes = index_t{32} << 10;

//! Blocks of a scan: a function of n and the kernel's cost per element only. `workers`: the most
//! host workers worth forking for this much data (scheduling only; never changes a result).
//! `sub`: the length of a block's sub-blocks (the last one of a block may be shorter).
struct blocking {
  index_t n = 0, block = 1, blocks = 0, workers = 1, sub = 1;
  LOOM_HD constexpr index_t begin(index_t b) const noexcept { return b * block; }
  LOOM_HD constexpr index_t end(index_t b) const noexcept { return (b + 1) * block < n ? (b + 1) * block : n; }
  //! Sub-blocks of a full block (the most any block has).
  LOOM_HD constexpr index_t subs() const noexcept { return (block + sub - 1) / sub; }
  //! Sub-blocks of block b (each holds at least one element).
  LOOM_HD constexpr index_t subs_of(index_t b) const noexcept { return (end(b) - begin(b) + sub - 1) / sub; }
  LOOM_HD constexpr index_t sub_begin(index_t b, index_t s) const noexcept { return begin(b) + s * sub; }
  LOOM_HD constexpr index_t sub_end(index_t b, index_t s) const noexcept {
    return begin(b) + (s + 1) * sub < end(b) ? begin(b) + (s + 1) * sub : end(b);
  }
};

//! `requested` > 0 forces the block length; otherwise blocks of about 1 MiB of data (by
//! `bytes_per_element`), at least 64 elements, and at most 64 blocks for short sequences.
//! Sub-blocks hold about sub_block_bytes of data, at least 128 elements, at most a block.
inline blocking make_blocking(index_t n, index_t requested, index_t bytes_per_element) {
  blocking b;
  b.n = n;
  const index_t per = bytes_per_element > 0 ? bytes_per_element : 1;
  if (requested > 0) {
    b.block = requested;
  } else {
    const index_t by_bytes = (index_t{1} << 20) / per;
    const index_t cap = by_bytes > 64 ? by_bytes : 64;
    index_t want = (n + 63) / 64;
    if (want < 64) want = 64;
    b.block = want < cap ? want : cap;
  }
  b.blocks = n > 0 ? (n + b.block - 1) / b.block : 0;
  const index_t sub = sub_block_bytes / per > 128 ? sub_block_bytes / per : 128;
  b.sub = sub < b.block ? sub : b.block;
  const index_t bytes = n * per;
  const auto grain = static_cast<index_t>(parallel_grain_bytes);
  b.workers = bytes / grain > 1 ? bytes / grain : 1;
  return b;
}

//! Where the engine keeps its state, in units of the kernel's agg_type: the carry entering block j
//! at j * carry on hosts (j = 0: the running carry; j = blocks: the carry after the last block),
//! at (j + 1) * carry on devices; every block's aggregate; every sub-block's aggregate and entering
//! carry; a scratch per unit (a host worker, or a device sub-block) and a compose temporary per
//! worker or block; the total aggregate and its temporary; one state slot per block (host path:
//! reduced, scanned).
struct layout {
  index_t tile, carry, agg, scratch, blocks, subs, units, temps;
  LOOM_HD constexpr index_t running() const noexcept { return 0; }
  LOOM_HD constexpr index_t carries() const noexcept { return carry; }
  LOOM_HD constexpr index_t aggs() const noexcept { return (blocks + 1) * carry; }
  LOOM_HD constexpr index_t sub_aggs() const noexcept { return aggs() + blocks * agg; }
  LOOM_HD constexpr index_t sub_carries() const noexcept { return sub_aggs() + blocks * subs * agg; }
  LOOM_HD constexpr index_t scratches() const noexcept { return sub_carries() + blocks * subs * carry; }
  LOOM_HD constexpr index_t temps_at() const noexcept { return scratches() + units * scratch; }
  LOOM_HD constexpr index_t total_agg() const noexcept { return temps_at() + temps * agg; }
  LOOM_HD constexpr index_t states() const noexcept { return total_agg() + 2 * agg; }
  LOOM_HD constexpr index_t size() const noexcept { return states() + blocks; }
  LOOM_HD constexpr index_t sub_agg(index_t j, index_t s) const noexcept { return sub_aggs() + (j * subs + s) * agg; }
  LOOM_HD constexpr index_t sub_carry(index_t j, index_t s) const noexcept {
    return sub_carries() + (j * subs + s) * carry;
  }
};

template <backend B>
inline constexpr bool host_engine = backend_traits<B>::memory_space::host_accessible;

template <backend B>
index_t tile_of(const B& b, const blocking& blk) {
  if constexpr (host_engine<B>) {
    index_t t = backend_traits<B>::concurrency(b);
    if (t > blk.workers) t = blk.workers;
    return t < blk.blocks ? (t > 0 ? t : 1) : (blk.blocks > 0 ? blk.blocks : 1);
  } else {
    return blk.blocks > 0 ? blk.blocks : 1;  // devices take every block at once
  }
}

//! The engine's layout for kernel sizes (carry, agg, scratch) on backend b.
template <backend B>
layout layout_of(const B& b, const blocking& blk, index_t carry, index_t agg, index_t scratch) {
  const index_t tile = tile_of(b, blk), blocks = blk.blocks, subs = blocks > 0 ? blk.subs() : 0;
  // hosts: a scratch and a temporary per worker; devices: a scratch per sub-block (its members
  // run side by side), a temporary per block
  const index_t units = host_engine<B> ? tile : blocks * subs, temps = host_engine<B> ? tile : blocks;
  return layout{tile, carry, agg, scratch, blocks, subs, units, temps};
}
template <backend B, class K>
layout layout_for(const B& b, const K& k, const blocking& blk) {
  return layout_of(b, blk, k.carry_size, k.agg_size, k.scratch_size);
}

//! The scratch of sub-block s: base + s * width (width 0: one scratch for every sub-block).
template <class A>
struct scratch_at {
  A* base;
  index_t width;
  LOOM_HD A* operator()(index_t s) const { return base + s * width; }
};

//! Device path: the scratches of block j's sub-blocks, one per sub-block.
template <class A>
LOOM_HD scratch_at<A> team_scratches(const layout& lay, A* ws, index_t j) {
  return scratch_at<A>{ws + lay.scratches() + j * lay.subs * lay.scratch, lay.scratch};
}

//! f(s, begin, end) for block j's sub-blocks s = first, first + step, ...
template <class F>
LOOM_HD void for_subs(const blocking& blk, index_t j, index_t first, index_t step, const F& f) {
  const index_t subs = blk.subs_of(j);
  for (index_t s = first; s < subs; s += step) f(s, blk.sub_begin(j, s), blk.sub_end(j, s));
}

//! Block j's sub-blocks s = first, first + step, ... reduced into their aggregates.
template <class K, class ScratchOf>
LOOM_HD void reduce_subs(const K& k, const blocking& blk, const layout& lay, typename K::agg_type* ws, index_t j,
                         index_t first, index_t step, const ScratchOf& scratch_of) {
  for_subs(blk, j, first, step,
           [&](index_t s, index_t lo, index_t hi) { k.reduce(lo, hi, ws + lay.sub_agg(j, s), scratch_of(s)); });
}

//! out = the `count` aggregates at aggs, aggs + lay.agg, ... composed in order (the first alone when count <= 1;
//! tmp: agg values).
template <class K>
LOOM_HD void compose_in_order(const K& k, const layout& lay, const typename K::agg_type* aggs, index_t count,
                              typename K::agg_type* out, typename K::agg_type* tmp) {
  for (index_t c = 0; c < lay.agg; ++c) out[c] = aggs[c];
  for (index_t i = 1; i < count; ++i) {
    k.compose(out, aggs + i * lay.agg, tmp);
    for (index_t c = 0; c < lay.agg; ++c) out[c] = tmp[c];
  }
}

//! Block j's aggregate: its sub-blocks' aggregates composed in order (tmp: agg values).
template <class K>
LOOM_HD void fold_subs(const K& k, const blocking& blk, const layout& lay, typename K::agg_type* ws, index_t j,
                       typename K::agg_type* tmp) {
  compose_in_order(k, lay, ws + lay.sub_agg(j, 0), blk.subs_of(j), ws + lay.aggs() + j * lay.agg, tmp);
}

//! The carry entering each sub-block of block j, advanced in order from `carry` (the block's).
template <class K>
LOOM_HD void chain_subs(const K& k, const blocking& blk, const layout& lay, typename K::agg_type* ws, index_t j,
                        const typename K::agg_type* carry) {
  auto* c0 = ws + lay.sub_carry(j, 0);
  for (index_t c = 0; c < lay.carry; ++c) c0[c] = carry[c];
  const index_t subs = blk.subs_of(j);
  for (index_t s = 0; s + 1 < subs; ++s)
    k.advance(ws + lay.sub_carry(j, s), ws + lay.sub_agg(j, s), ws + lay.sub_carry(j, s + 1));
}

//! Block j's sub-blocks s = first, first + step, ... scanned from their carries.
template <class K, class ScratchOf>
LOOM_HD void scan_subs(const K& k, const blocking& blk, const layout& lay, typename K::agg_type* ws, index_t j,
                       index_t first, index_t step, const ScratchOf& scratch_of) {
  for_subs(blk, j, first, step,
           [&](index_t s, index_t lo, index_t hi) { k.scan(lo, hi, ws + lay.sub_carry(j, s), scratch_of(s)); });
}

//! Block j scanned on one host worker from `carry` (its sub-blocks' aggregates already reduced).
template <class K>
void scan_block_alone(const K& k, const blocking& blk, const layout& lay, typename K::agg_type* ws, index_t j,
                      const typename K::agg_type* carry, typename K::agg_type* scratch) {
  const scratch_at<typename K::agg_type> mine{scratch, 0};
  if (blk.subs_of(j) == 1) {  // one sub-block: its carry is the block's
    k.scan(blk.begin(j), blk.end(j), carry, scratch);
    return;
  }
  chain_subs(k, blk, lay, ws, j, carry);
  scan_subs(k, blk, lay, ws, j, 0, 1, mine);
}

template <class K>
struct init_step {
  K k;
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t) const { k.init_carry(ws); }
};

//! Device path, team j: block j's sub-blocks reduced by the members side by side; member 0
//! composes them into the block's aggregate (when `fold`).
template <class K>
struct team_reduce_step {
  K k;
  blocking blk;
  layout lay;
  bool fold;
  typename K::agg_type* ws;
  template <class M>
  LOOM_HD void operator()(const M& m) const {
    const index_t j = m.league_rank();
    const auto mine = team_scratches(lay, ws, j);
    reduce_subs(k, blk, lay, ws, j, m.team_rank(), m.team_size(), mine);
    m.barrier();
    if (fold && m.team_rank() == 0) fold_subs(k, blk, lay, ws, j, ws + lay.temps_at() + j * lay.agg);
  }
};

//! Device path when every block is one sub-block: block j reduced (or scanned) by one thread, the
//! same operations a team would run (no sub-block carries to advance).
template <class K>
struct block_step {
  K k;
  blocking blk;
  layout lay;
  bool scan, single;
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t j) const {
    auto* scratch = ws + lay.scratches() + j * lay.scratch;
    if (!scan)
      k.reduce(blk.begin(j), blk.end(j), ws + lay.aggs() + j * lay.agg, scratch);
    else
      k.scan(blk.begin(j), blk.end(j), single ? ws + lay.running() : ws + lay.carries() + j * lay.carry, scratch);
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

//! Device path, team j: member 0 advances the sub-block carries from the block's carry (the
//! running carry when `single`), then the members scan the sub-blocks side by side.
template <class K>
struct team_scan_step {
  K k;
  blocking blk;
  layout lay;
  bool single;
  typename K::agg_type* ws;
  template <class M>
  LOOM_HD void operator()(const M& m) const {
    const index_t j = m.league_rank();
    if (m.team_rank() == 0)
      chain_subs(k, blk, lay, ws, j, single ? ws + lay.running() : ws + lay.carries() + j * lay.carry);
    m.barrier();
    const auto mine = team_scratches(lay, ws, j);
    scan_subs(k, blk, lay, ws, j, m.team_rank(), m.team_size(), mine);
  }
};

//! Folds the `count` blocks' aggregates, in order, into the total aggregate at total_agg() (via the
//! slot after it).
template <class K>
struct total_step {
  K k;
  layout lay;
  index_t count;
  typename K::agg_type* ws;
  LOOM_HD void operator()(index_t) const {
    auto* total = ws + lay.total_agg();
    compose_in_order(k, lay, ws + lay.aggs(), count, total, total + lay.agg);
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
  return layout_for(b, k, blk).size();
}

//! The host path's shared state, on the calling thread's stack (the region ends before the call
//! returns): the next block to take, how many blocks have their entering carry (the chain), and
//! who is advancing the chain. Block j's state slot: 0 taken, 1 reduced, 2 scanned (claimed).
template <class A>
struct chain {
  std::atomic<index_t> next{0}, turn{0};
  std::atomic<bool> busy{false};
  A* states;
  index_t blocks;

  index_t take() { return next.fetch_add(1, std::memory_order_relaxed); }
  std::atomic_ref<unsigned char> state(index_t j) const {
    return std::atomic_ref<unsigned char>(*reinterpret_cast<unsigned char*>(states + j));
  }
  bool ready(index_t t) const { return t < blocks && state(t).load() >= 1; }
  //! Advances the chain over every reduced block in order (one thread at a time; a thread that
  //! finds another one advancing leaves it the work). step(t) computes the carry entering t + 1.
  template <class Step>
  void advance(Step&& step) {
    for (;;) {
      if (busy.exchange(true)) return;
      index_t t = turn.load(std::memory_order_relaxed);
      for (; ready(t); ++t) {
        step(t);
        turn.store(t + 1, std::memory_order_release);
      }
      busy.store(false);
      if (!ready(t)) return;  // nothing was reduced while this thread held the chain
    }
  }
  bool has_carry(index_t j) const { return turn.load(std::memory_order_acquire) > j; }
  bool claim(index_t j) {
    unsigned char reduced = 1;
    return state(j).compare_exchange_strong(reduced, 2);
  }
  //! Waits (advancing the chain when it can, yielding the core) until block j has its carry.
  template <class Step>
  void wait_carry(index_t j, Step&& step) {
    for (int spin = 0; !has_carry(j); ++spin) {
      advance(step);
      if (spin >= 16) std::this_thread::yield();
    }
  }
};

//! Host path of run_scan, worker w: take a block, reduce it, advance the chain, and scan the block
//! at once (still in cache) when its carry is known; blocks whose carry came late are scanned
//! after the last block is taken, by whichever worker claims them first. No worker waits while a
//! block is left to take.
template <class K>
struct chained_scan_step {
  using A = typename K::agg_type;
  K k;
  blocking blk;
  layout lay;
  A* ws;
  chain<A>* ch;
  void operator()(index_t w) const {
    A* scratch = ws + lay.scratches() + w * lay.scratch;
    A* tmp = ws + lay.temps_at() + w * lay.agg;
    const scratch_at<A> mine{scratch, 0};
    auto carry = [&](index_t j) { return ws + j * lay.carry; };
    auto agg = [&](index_t j) { return ws + lay.aggs() + j * lay.agg; };
    auto step = [&](index_t t) { k.advance(carry(t), agg(t), carry(t + 1)); };
    for (index_t j = ch->take(); j < blk.blocks; j = ch->take()) {
      reduce_subs(k, blk, lay, ws, j, 0, 1, mine);
      fold_subs(k, blk, lay, ws, j, tmp);
      ch->state(j).store(1);
      ch->advance(step);
      if (ch->has_carry(j) && ch->claim(j)) scan_block_alone(k, blk, lay, ws, j, carry(j), scratch);
    }
    for (index_t j = 0; j < blk.blocks; ++j) {
      if (ch->state(j).load() == 2) continue;
      ch->wait_carry(j, step);
      if (ch->claim(j)) scan_block_alone(k, blk, lay, ws, j, carry(j), scratch);
    }
  }
};

//! Host path of run_total: every block's aggregate, blocks taken from the counter.
template <class K>
struct block_reduce_step {
  K k;
  blocking blk;
  layout lay;
  typename K::agg_type* ws;
  chain<typename K::agg_type>* ch;
  void operator()(index_t w) const {
    auto* scratch = ws + lay.scratches() + w * lay.scratch;
    auto* tmp = ws + lay.temps_at() + w * lay.agg;
    const scratch_at<typename K::agg_type> mine{scratch, 0};
    for (index_t j = ch->take(); j < blk.blocks; j = ch->take()) {
      reduce_subs(k, blk, lay, ws, j, 0, 1, mine);
      fold_subs(k, blk, lay, ws, j, tmp);
    }
  }
};

//! Devices: a team per block, no more members than a block has sub-blocks.
template <backend B>
team_policy block_teams(const B& b, const blocking& blk) {
  const index_t rec = team_size_recommended(b);
  return {blk.blocks, static_cast<int>(rec < blk.subs() ? rec : blk.subs()), 0};
}

//! Devices: every block's sub-blocks reduced and, when `fold`, composed into the block's
//! aggregate; a thread per block when blocks are one sub-block (it reduces into the aggregate).
template <backend B, class K>
void device_reduce(const B& b, const K& k, const blocking& blk, const layout& lay, typename K::agg_type* ws,
                   bool fold) {
  if (blk.subs() > 1)
    for_each_team(b, block_teams(b, blk), team_reduce_step<K>{k, blk, lay, fold, ws});
  else
    for_each_index(b, blk.blocks, block_step<K>{k, blk, lay, false, false, ws});
}

//! Scans positions [0, blk.n) with kernel k. `ws` holds workspace_size elements in B's space.
//! The carry entering block 0 is k.init_carry unless `carry_ready` (the caller wrote it at ws[0]).
template <backend B, class K>
void run_scan(const B& b, const K& k, const blocking& blk, typename K::agg_type* ws, bool carry_ready = false) {
  if (blk.blocks == 0) return;
  const layout lay = layout_for(b, k, blk);
  if (!carry_ready) for_each_index(b, 1, init_step<K>{k, ws});
  if constexpr (host_engine<B>) {
    using A = typename K::agg_type;
    if (blk.blocks == 1) {  // one block: its carry is the running carry; no chain, no block aggregate
      A* scratch = ws + lay.scratches();
      const scratch_at<A> mine{scratch, 0};
      if (blk.subs_of(0) > 1) reduce_subs(k, blk, lay, ws, 0, 0, 1, mine);
      scan_block_alone(k, blk, lay, ws, 0, ws + lay.running(), scratch);
      return;
    }
    A* states = ws + lay.states();
    for (index_t j = 0; j < blk.blocks; ++j) *reinterpret_cast<unsigned char*>(states + j) = 0;
    chain<A> ch{{0}, {0}, {false}, states, blk.blocks};
    for_each_index(b, lay.tile, chained_scan_step<K>{k, blk, lay, ws, &ch});
  } else {  // devices: a team per block (a thread when blocks are one sub-block), every block at once
    const bool single = blk.blocks == 1, teams = blk.subs() > 1;
    if (!single || teams) device_reduce(b, k, blk, lay, ws, !single);  // one block of one sub-block: none
    if (!single) for_each_index(b, 1, carry_step<K>{k, lay, blk.blocks, ws});
    if (teams)
      for_each_team(b, block_teams(b, blk), team_scan_step<K>{k, blk, lay, single, ws});
    else
      for_each_index(b, blk.blocks, block_step<K>{k, blk, lay, true, single, ws});
  }
}

//! The aggregate of all positions, left at ws + layout.total_agg() (blk.n must be > 0).
template <backend B, class K>
typename K::agg_type* run_total(const B& b, const K& k, const blocking& blk, typename K::agg_type* ws) {
  const layout lay = layout_for(b, k, blk);
  if constexpr (host_engine<B>) {
    chain<typename K::agg_type> ch{{0}, {0}, {false}, nullptr, blk.blocks};
    for_each_index(b, lay.tile, block_reduce_step<K>{k, blk, lay, ws, &ch});
  } else {  // devices: a team per block (a thread when blocks are one sub-block), every block at once
    device_reduce(b, k, blk, lay, ws, true);
  }
  for_each_index(b, 1, total_step<K>{k, lay, blk.blocks, ws});
  return ws + lay.total_agg();
}

}  // namespace loom::scan::detail
