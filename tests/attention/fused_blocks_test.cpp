// The blocks a fused (cuDNN-style diagonal band) attention kernel runs per step, derived from
// shard plans and windows, checked pair by pair against the coordinate mask; the graph keys and
// the graph cache. Host-only: the mapping, not cuDNN. Beside them, the hull the host kernels trim
// a partial tile pair to (detail/tile.hpp), checked pair by pair against the same mask.

#include <loom/attention/detail/fused_blocks.hpp>
#include <loom/attention/detail/tile.hpp>

#include <support/errors.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

using loom::index_t;
namespace la = loom::attention;
namespace ld = loom::attention::detail;
namespace shard = loom::shard;

namespace {

struct row {
  index_t doc, pos;
};

std::vector<row> rows_of(const shard::rank_plan& r) {
  std::vector<row> out(static_cast<std::size_t>(r.tokens));
  for (const auto& p : r.pieces)
    for (index_t t = 0; t < p.length; ++t)
      out[static_cast<std::size_t>(p.local_begin + t)] = {p.document, p.doc_offset + t};
  return out;
}

// loom's rule (attention/options.hpp), written out independently of the mapping.
bool visible(const la::options& o, row q, row k) {
  if (q.doc != k.doc) return false;
  if (o.causal && k.pos > q.pos) return false;
  if (o.window.left >= 0 && k.pos < q.pos - o.window.left) return false;
  if (o.window.right >= 0 && k.pos > q.pos + o.window.right) return false;
  return true;
}

// The band convention, in block-local rows i and keys j.
bool band(const ld::fused_block& b, index_t i, index_t j) {
  if (b.left_bound >= 0 && !(j > i - b.left_bound)) return false;
  if (b.right_bound >= 0 && !(j <= i + b.right_bound)) return false;
  return true;
}

// Every (query row, key row) pair of two ranks: covered by at most one block, and visible through
// the blocks exactly when the coordinate rule says so; every block tight (no empty row or key
// column), its bounds in the band kernels' range, full exactly when it needs no mask.
void check_pair(const shard::rank_plan& qr, const shard::rank_plan& kr, const la::options& o) {
  const auto qs = rows_of(qr), ks = rows_of(kr);
  const auto blocks = ld::fused_blocks(qr, kr, o);
  std::vector<int> cover(qs.size() * ks.size(), 0), seen(qs.size() * ks.size(), 0);
  std::size_t other_document = 0;  // cells of a block outside its document
  for (const auto& b : blocks) {
    REQUIRE(b.q_count > 0);
    REQUIRE(b.k_count > 0);
    REQUIRE(b.q_begin >= 0);
    REQUIRE(b.q_begin + b.q_count <= qr.tokens);
    REQUIRE(b.k_begin >= 0);
    REQUIRE(b.k_begin + b.k_count <= kr.tokens);
    CHECK((b.left_bound == -1 || b.left_bound >= 1));
    CHECK((b.right_bound == -1 || b.right_bound >= 0));
    CHECK((b.kind == ld::block_kind::full) == (b.left_bound == -1 && b.right_bound == -1));
    std::vector<int> row_any(static_cast<std::size_t>(b.q_count), 0), col_any(static_cast<std::size_t>(b.k_count), 0);
    for (index_t i = 0; i < b.q_count; ++i)
      for (index_t j = 0; j < b.k_count; ++j) {
        const auto at = static_cast<std::size_t>(b.q_begin + i) * ks.size() + static_cast<std::size_t>(b.k_begin + j);
        ++cover[at];
        if (qs[static_cast<std::size_t>(b.q_begin + i)].doc != b.document ||
            ks[static_cast<std::size_t>(b.k_begin + j)].doc != b.document)
          ++other_document;
        if (band(b, i, j)) {
          seen[at] = 1;
          row_any[static_cast<std::size_t>(i)] = col_any[static_cast<std::size_t>(j)] = 1;
        }
      }
    CHECK(std::count(row_any.begin(), row_any.end(), 0) == 0);  // no fully masked row
    CHECK(std::count(col_any.begin(), col_any.end(), 0) == 0);  // no key nobody sees
  }
  CHECK(other_document == 0);
  std::size_t wrong = 0, twice = 0;
  for (std::size_t a = 0; a < qs.size(); ++a)
    for (std::size_t c = 0; c < ks.size(); ++c) {
      if (cover[a * ks.size() + c] > 1) ++twice;
      if ((seen[a * ks.size() + c] != 0) != visible(o, qs[a], ks[c])) ++wrong;
    }
  CHECK(twice == 0);
  CHECK(wrong == 0);
  // The batches: every block in exactly one, one pair of bounds per batch, and no query row or
  // key row in two blocks of one batch (no two entries of a graph run write the same rows).
  const auto batches = ld::batches_of(blocks);
  std::size_t in_batches = 0, shared_rows = 0, mixed_bounds = 0;
  for (const auto& g : batches) {
    REQUIRE(!g.empty());
    in_batches += g.size();
    std::vector<int> qrow(qs.size(), 0), krow(ks.size(), 0);
    for (const auto& b : g) {
      if (b.left_bound != g.front().left_bound || b.right_bound != g.front().right_bound) ++mixed_bounds;
      for (index_t i = 0; i < b.q_count; ++i) shared_rows += qrow[static_cast<std::size_t>(b.q_begin + i)]++ > 0;
      for (index_t j = 0; j < b.k_count; ++j) shared_rows += krow[static_cast<std::size_t>(b.k_begin + j)]++ > 0;
    }
  }
  CHECK(in_batches == blocks.size());
  CHECK(mixed_bounds == 0);
  CHECK(shared_rows == 0);
}

template <class S>
shard::plan plan_of(const std::vector<index_t>& cu, int p) {
  return shard::make_plan(std::span<const index_t>(cu), p, S{});
}

}  // namespace

TEST_CASE("fused blocks: hand-checked blocks of one causal document", "[attention][fused]") {
  const la::options causal{};
  // Queries at positions [4, 8) against keys [0, 4): every pair visible, no mask.
  auto b = ld::fuse_block(causal, 4, 4, 10, 0, 4, 20);
  REQUIRE(b);
  CHECK(*b == ld::fused_block{10, 4, 20, 4, ld::block_kind::full, -1, -1, 0});
  // The diagonal block: the causal band, j <= i.
  b = ld::fuse_block(causal, 0, 4, 0, 0, 4, 0);
  REQUIRE(b);
  CHECK(*b == ld::fused_block{0, 4, 0, 4, ld::block_kind::band, -1, 0, 0});
  // Keys after every query: no block.
  CHECK(!ld::fuse_block(causal, 0, 4, 0, 4, 4, 0));
  // Window (2, 0): queries 4, 5 see keys 2..3 and 3; 6 and 7 see none of [0, 4). Cropped to rows
  // 4..5 and keys 2..3, where j' >= i' (left bound 1: the query's own column counts).
  la::options w{};
  w.window = {2, 0};
  b = ld::fuse_block(w, 4, 4, 0, 0, 4, 0);
  REQUIRE(b);
  CHECK(*b == ld::fused_block{0, 2, 2, 2, ld::block_kind::band, 1, -1, 0});
  // A symmetric window (1, 1), not causal, on the diagonal block of 5: a band of width 3.
  la::options sym{};
  sym.causal = false;
  sym.window = {1, 1};
  b = ld::fuse_block(sym, 0, 5, 0, 0, 5, 0);
  REQUIRE(b);
  CHECK(*b == ld::fused_block{0, 5, 0, 5, ld::block_kind::band, 2, 1, 0});
  // Empty pieces: no block.
  CHECK(!ld::fuse_block(causal, 0, 0, 0, 0, 4, 0));
  CHECK(!ld::fuse_block(causal, 0, 4, 0, 0, 0, 0));
}

TEST_CASE("fused blocks: every rank pair of every plan equals the coordinate mask", "[attention][fused]") {
  const std::vector<std::vector<index_t>> corpora{{0, 1, 8, 138, 141, 300},  // lengths 1, 7, 130, 3, 159
                                                  {0, 0, 5, 5, 42, 59},      // empty documents too
                                                  {0, 97}};
  std::vector<la::options> opts;
  for (bool causal : {true, false})
    for (la::window_size w :
         {la::window_size{-1, -1}, la::window_size{0, 0}, la::window_size{7, 0}, la::window_size{31, 3},
          la::window_size{5, 5}, la::window_size{-1, 4}, la::window_size{13, -1}}) {
      la::options o{};
      o.causal = causal;
      o.window = w;
      opts.push_back(o);
    }
  for (const auto& cu : corpora)
    for (int p : {1, 2, 3, 5})
      for (int strategy = 0; strategy < 3; ++strategy) {
        const auto plan = strategy == 0   ? plan_of<shard::contiguous>(cu, p)
                          : strategy == 1 ? plan_of<shard::zigzag>(cu, p)
                                          : plan_of<shard::per_document>(cu, p);
        for (const auto& o : opts)
          for (int a = 0; a < p; ++a)
            for (int c = 0; c < p; ++c) {
              INFO("tokens " << cu.back() << " P " << p << " strategy " << strategy << " causal " << o.causal
                             << " window (" << o.window.left << ", " << o.window.right << ") query rank " << a
                             << " key rank " << c);
              check_pair(plan.rank(a), plan.rank(c), o);
            }
      }
}

TEST_CASE("fused blocks: a zigzag ring step whose query chunk sees both key chunks gives two batches",
          "[attention][fused]") {
  // One causal document of 60 tokens over P = 3, zigzag: rank 0 holds chunks 0 and 5 (positions
  // [0, 10) and [50, 60)), rank 1 chunks 1 and 4 ([10, 20), [40, 50)). Rank 0's queries against
  // rank 1's keys: chunk 5 sees both key chunks fully (two blocks on the same query rows).
  const std::vector<index_t> cu{0, 60};
  const auto plan = plan_of<shard::zigzag>(cu, 3);
  la::options o{};
  const auto blocks = ld::fused_blocks(plan.rank(0), plan.rank(1), o);
  REQUIRE(blocks.size() == 2);
  CHECK(blocks[0] == ld::fused_block{10, 10, 0, 10, ld::block_kind::full, -1, -1, 0});
  CHECK(blocks[1] == ld::fused_block{10, 10, 10, 10, ld::block_kind::full, -1, -1, 0});
  const auto batches = ld::batches_of(blocks);
  REQUIRE(batches.size() == 2);  // same bounds, but the same query rows
  CHECK(batches[0] == std::vector<ld::fused_block>{blocks[0]});
  CHECK(batches[1] == std::vector<ld::fused_block>{blocks[1]});
}

TEST_CASE("fused blocks: graph keys, batches and the graph cache", "[attention][fused]") {
  const la::head_shape s{16, 4, 128, 128};
  const std::vector<ld::fused_block> blocks{{0, 100, 0, 100, ld::block_kind::band, -1, 0, 0},
                                            {100, 37, 100, 37, ld::block_kind::band, -1, 0, 1},
                                            {137, 5, 0, 90, ld::block_kind::full, -1, -1, 1},
                                            {142, 9, 190, 9, ld::block_kind::band, -1, 0, 2}};
  const auto batches = ld::batches_of(blocks);
  REQUIRE(batches.size() == 2);
  CHECK(batches[0].size() == 3);
  CHECK(batches[1].size() == 1);
  CHECK(batches[1][0] == blocks[2]);

  const auto k = ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, batches[0]);
  CHECK(k.kind == ld::block_kind::band);
  CHECK(k.batch == 64);
  CHECK(k.max_q == 128);  // largest block 100, a power of two at least 64
  CHECK(k.max_k == 128);
  CHECK(k.right_bound == 0);
  CHECK(k.left_bound == -1);
  const ld::graph_key_hash h;
  CHECK(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, batches[0]) == k);
  CHECK(h(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, batches[0])) == h(k));
  // Every field that changes the graph changes the key.
  auto differs = [&](ld::graph_key other) {
    CHECK(!(other == k));
    CHECK(h(other) != h(k));
  };
  differs(ld::key_of(ld::fused_pass::backward, ld::fused_element::bf16, s, 0.088, batches[0]));
  differs(ld::key_of(ld::fused_pass::forward, ld::fused_element::fp16, s, 0.088, batches[0]));
  differs(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, {16, 8, 128, 128}, 0.088, batches[0]));
  differs(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, {16, 4, 64, 128}, 0.088, batches[0]));
  differs(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.125, batches[0]));
  {
    auto totals = k;
    totals.total_q = 4096;
    differs(totals);
    totals = k;
    totals.total_k = 4096;
    differs(totals);
  }
  differs(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, batches[1]));
  {
    auto longer = batches[0];
    longer[0].q_count = 129;  // the next bucket
    differs(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, longer));
    longer = batches[0];
    longer[0].q_count = 128;  // the same bucket: the same graph
    CHECK(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, longer) == k);
    auto wide = batches[0];
    for (auto& b : wide) b.left_bound = 9;
    differs(ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, wide));
  }
  CHECK(ld::graph_bucket(0) == 64);
  CHECK(ld::graph_bucket(64) == 64);
  CHECK(ld::graph_bucket(65) == 128);
  CHECK(ld::graph_bucket(1000) == 1024);
  loom::test::require_loom_error([] { (void)ld::graph_bucket(-1); }, loom::errc::invalid_argument,
                                 {"graph_bucket", "n must be >= 0"});
  loom::test::require_loom_error(
      [&] { (void)ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, {}); },
      loom::errc::invalid_argument, {"fused graph key", "blocks must not be empty"});
  loom::test::require_loom_error(
      [&] { (void)ld::key_of(ld::fused_pass::forward, ld::fused_element::bf16, s, 0.088, blocks); },
      loom::errc::invalid_argument, {"fused graph key", "bounds of the first"});

  // The cache: one build per key, shared by every caller and thread.
  struct graph {
    ld::graph_key key;
  };
  ld::graph_cache<graph> cache;
  std::atomic<int> builds{0};
  auto build = [&](const ld::graph_key& key) {
    ++builds;
    std::this_thread::yield();
    return graph{key};
  };
  std::vector<std::shared_ptr<graph>> got(8);
  {
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < got.size(); ++t) threads.emplace_back([&, t] { got[t] = cache.get(k, build); });
    for (auto& t : threads) t.join();
  }
  CHECK(builds.load() == 1);
  for (const auto& g : got) {
    REQUIRE(g);
    CHECK(g.get() == got[0].get());
    CHECK(g->key == k);
  }
  const auto k2 = ld::key_of(ld::fused_pass::backward, ld::fused_element::bf16, s, 0.088, batches[0]);
  CHECK(cache.get(k2, build).get() != got[0].get());
  CHECK(builds.load() == 2);
  CHECK(cache.get(k, build).get() == got[0].get());
  CHECK(builds.load() == 2);
  CHECK(cache.size() == 2);
  // A build that throws leaves the key to be built by the next caller.
  const auto k3 = ld::key_of(ld::fused_pass::forward, ld::fused_element::fp16, s, 0.088, batches[0]);
  CHECK_THROWS_AS(cache.get(k3, [](const ld::graph_key&) -> graph { throw std::runtime_error("no plan"); }),
                  std::runtime_error);
  CHECK(cache.get(k3, build)->key == k3);
  CHECK(builds.load() == 3);
}

namespace {
struct plain_coords {  // the d(t), p(t) of the kernels' token_coords
  const std::vector<index_t>& doc;
  const std::vector<index_t>& pos;
  index_t d(index_t t) const { return doc[static_cast<std::size_t>(t)]; }
  index_t p(index_t t) const { return pos[static_cast<std::size_t>(t)]; }
};
}  // namespace

TEST_CASE("tile hull: every visible pair of a partial tile pair lies inside its hull", "[attention][tile]") {
  // Packed documents (contiguous runs, positions from 0) and scattered coordinates (any document,
  // any position per token), causal or not, with and without windows; tiles of 1, 7, 13 and 64
  // tokens at every offset. The hull must hold every visible pair; a hull left empty must have
  // none. Then hand-checked hulls.
  std::mt19937 rng(2027);
  const auto hull_holds_every_pair = [](const std::vector<index_t>& qd, const std::vector<index_t>& qp,
                                        const std::vector<index_t>& kd, const std::vector<index_t>& kp, index_t tile,
                                        bool causal, index_t left, index_t right) {
    const plain_coords qc{qd, qp}, kc{kd, kp};
    const auto tq = static_cast<index_t>(qd.size()), tk = static_cast<index_t>(kd.size());
    index_t partial = 0;
    for (index_t q0 = 0; q0 < tq; q0 += tile)
      for (index_t k0 = 0; k0 < tk; k0 += tile) {
        const index_t nq = std::min(tile, tq - q0), nk = std::min(tile, tk - k0);
        const auto qb = ld::bounds_of(qd.data(), 1, qp.data(), 1, q0, nq);
        const auto kb = ld::bounds_of(kd.data(), 1, kp.data(), 1, k0, nk);
        if (ld::classify(qb, kb, causal, left, right) != ld::tile_kind::partial) continue;
        ++partial;
        const auto h = ld::hull_of(qc, kc, qb, kb, q0, nq, k0, nk, causal, left, right);
        REQUIRE(h.r0 >= 0);
        REQUIRE(h.r1 <= nq);
        REQUIRE(h.c0 >= 0);
        REQUIRE(h.c1 <= nk);
        for (index_t i = 0; i < nq; ++i)
          for (index_t j = 0; j < nk; ++j)
            if (ld::visible(qc.d(q0 + i), qc.p(q0 + i), kc.d(k0 + j), kc.p(k0 + j), causal, left, right)) {
              INFO("q0 " << q0 << " k0 " << k0 << " i " << i << " j " << j);
              REQUIRE(!h.empty());
              REQUIRE(i >= h.r0);
              REQUIRE(i < h.r1);
              REQUIRE(j >= h.c0);
              REQUIRE(j < h.c1);
            }
      }
    return partial;
  };
  index_t partial = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const bool causal = trial % 2 == 0;
    const index_t left = trial % 3 == 0 ? -1 : static_cast<index_t>(rng() % 40);
    const index_t right = trial % 5 < 2 ? -1 : static_cast<index_t>(rng() % 40);
    const index_t tile = std::vector<index_t>{1, 7, 13, 64}[static_cast<std::size_t>(trial % 4)];
    // Packed: documents of 1 to 150 tokens up to 331 tokens.
    std::vector<index_t> doc, pos;
    for (index_t d = 0; static_cast<index_t>(doc.size()) < 331; ++d) {
      const auto len = std::min<index_t>(1 + static_cast<index_t>(rng() % 150), 331 - static_cast<index_t>(doc.size()));
      for (index_t t = 0; t < len; ++t) {
        doc.push_back(d);
        pos.push_back(t);
      }
    }
    partial += hull_holds_every_pair(doc, pos, doc, pos, tile, causal, left, right);
    // Scattered: 197 queries and 211 keys of 3 documents, positions 0..99 in any order.
    std::vector<index_t> qd(197), qp(197), kd(211), kp(211);
    for (std::size_t t = 0; t < qd.size(); ++t) qd[t] = rng() % 3, qp[t] = rng() % 100;
    for (std::size_t t = 0; t < kd.size(); ++t) kd[t] = rng() % 3, kp[t] = rng() % 100;
    partial += hull_holds_every_pair(qd, qp, kd, kp, tile, causal, left, right);
  }
  CHECK(partial > 1000);  // the sweep reached many partial pairs

  // Hand-checked: queries 0..7 are document 0 (positions 10..17) then document 1 (0..3) in rows
  // 8..11; keys of document 0 at positions 0..7. Causal: rows 0..7 only, every key.
  const std::vector<index_t> qd{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1}, qp{10, 11, 12, 13, 14, 15, 16, 17, 0, 1, 2, 3};
  const std::vector<index_t> kd(8, 0), kp{0, 1, 2, 3, 4, 5, 6, 7};
  const plain_coords qc{qd, qp}, kc{kd, kp};
  const auto qb = ld::bounds_of(qd.data(), 1, qp.data(), 1, 0, 12),
             kb = ld::bounds_of(kd.data(), 1, kp.data(), 1, 0, 8);
  auto h = ld::hull_of(qc, kc, qb, kb, 0, 12, 0, 8, true, -1, -1);
  CHECK((h.r0 == 0 && h.r1 == 8 && h.c0 == 0 && h.c1 == 8));
  // Rows 0..7 alone (document 0, positions 10..17) with a window of 9 back: row 7 (17) sees no
  // key (17 - 7 > 9) and key 0 is seen by no row (10 - 0 > 9).
  const auto qb0 = ld::bounds_of(qd.data(), 1, qp.data(), 1, 0, 8);
  REQUIRE(ld::classify(qb0, kb, true, 9, -1) == ld::tile_kind::partial);
  h = ld::hull_of(qc, kc, qb0, kb, 0, 8, 0, 8, true, 9, -1);
  CHECK((h.r0 == 0 && h.r1 == 7 && h.c0 == 1 && h.c1 == 8));
  // Keys of document 1 at positions 5..7 against the same queries, causal: document 1's rows are
  // at positions 0..3 (< 5), document 0's rows are another document: nothing can be seen.
  const std::vector<index_t> kd1(3, 1), kp1{5, 6, 7};
  const plain_coords kc1{kd1, kp1};
  const auto kb1 = ld::bounds_of(kd1.data(), 1, kp1.data(), 1, 0, 3);
  h = ld::hull_of(qc, kc1, qb, kb1, 0, 12, 0, 3, true, -1, -1);
  CHECK(h.empty());
}
