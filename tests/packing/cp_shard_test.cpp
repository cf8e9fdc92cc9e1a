// shard::make_plan: hand-checkable cases, coverage and round-trip properties for every strategy,
// balance of per_document, and rejections.

#include <loom/shard/plan.hpp>

#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <packing/support.hpp>
#include <vector>

using loom::index_t;
namespace shard = loom::shard;
namespace pk = loom::packing;

namespace {

std::vector<index_t> globals_of(const shard::plan& p, int r) {
  std::vector<index_t> g;
  for (const auto& pc : p.rank(r).pieces)
    for (index_t k = 0; k < pc.length; ++k) g.push_back(pc.global_begin + k);
  return g;
}

std::vector<index_t> cu_of(const std::vector<index_t>& lengths) {
  std::vector<index_t> cu{0};
  for (index_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

template <class S>
void require_valid(const std::vector<index_t>& cu, int ranks, S strategy) {
  const auto p = shard::make_plan(std::span<const index_t>(cu), ranks, strategy);
  const index_t total = cu.back();
  REQUIRE(p.ranks() == ranks);
  REQUIRE(p.total_tokens() == total);
  std::vector<int> seen(static_cast<std::size_t>(total), 0);
  std::int64_t pairs = 0;
  index_t tokens = 0, resets = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto& rp = p.rank(r);
    REQUIRE(rp.cu_seqlens.size() == rp.pieces.size() + 1);
    index_t local = 0;
    std::size_t reset_i = 0;
    std::int64_t rank_pairs = 0;
    for (std::size_t i = 0; i < rp.pieces.size(); ++i) {
      const auto& pc = rp.pieces[i];
      REQUIRE(pc.length > 0);
      REQUIRE(pc.local_begin == local);
      REQUIRE(rp.cu_seqlens[i] == local);
      const auto d = static_cast<std::size_t>(pc.document);
      REQUIRE(pc.global_begin == cu[d] + pc.doc_offset);  // inside its document
      REQUIRE(pc.doc_offset + pc.length <= cu[d + 1] - cu[d]);
      if (pc.doc_offset == 0) {
        REQUIRE(reset_i < rp.reset_points.size());
        CHECK(rp.reset_points[reset_i++] == pc.local_begin);
      }
      for (index_t k = 0; k < pc.length; ++k) {
        ++seen[static_cast<std::size_t>(pc.global_begin + k)];
        const auto loc = p.to_local(pc.global_begin + k);
        REQUIRE(loc.rank == r);
        REQUIRE(loc.local == local + k);
        REQUIRE(p.to_global(r, local + k) == pc.global_begin + k);
      }
      rank_pairs += pk::chunk_causal_pairs(pc.doc_offset, pc.length);
      local += pc.length;
    }
    CHECK(reset_i == rp.reset_points.size());
    REQUIRE(rp.cu_seqlens.back() == local);
    REQUIRE(rp.tokens == local);
    CHECK(rp.causal_pairs == rank_pairs);
    pairs += rp.causal_pairs;
    tokens += rp.tokens;
    resets += static_cast<index_t>(rp.reset_points.size());
  }
  CHECK(std::count(seen.begin(), seen.end(), 1) == total);  // every token exactly once
  CHECK(tokens == total);
  std::int64_t want = 0;
  index_t nonempty = 0;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    want += pk::causal_pairs(cu[d + 1] - cu[d]);
    nonempty += cu[d + 1] > cu[d];
  }
  CHECK(pairs == want);
  CHECK(resets == nonempty);  // one reset point per non-empty document, on the rank of its first token

  // scatter then gather restores a global array of rows.
  const index_t row = 3;
  std::vector<int> global(static_cast<std::size_t>(total * row)), back(global.size(), -1);
  std::iota(global.begin(), global.end(), 0);
  for (int r = 0; r < ranks; ++r) {
    std::vector<int> local(static_cast<std::size_t>(p.rank(r).tokens * row));
    p.scatter(r, std::span<const int>(global), row, std::span<int>(local));
    p.gather(r, std::span<const int>(local), row, std::span<int>(back));
  }
  CHECK(back == global);
}

double work_ratio(const shard::plan& p) {
  std::vector<double> w;
  for (int r = 0; r < p.ranks(); ++r) w.push_back(static_cast<double>(p.rank(r).causal_pairs));
  return pk::balance_of(w).max_over_mean;
}

}  // namespace

TEST_CASE("shard::zigzag of one 8-token document on 2 ranks", "[packing][shard]") {
  const std::vector<index_t> cu{0, 8};
  const auto p = shard::make_plan(std::span<const index_t>(cu), 2, shard::zigzag{});
  CHECK(globals_of(p, 0) == std::vector<index_t>{0, 1, 6, 7});
  CHECK(globals_of(p, 1) == std::vector<index_t>{2, 3, 4, 5});
  CHECK(p.rank(0).cu_seqlens == std::vector<index_t>{0, 2, 4});
  CHECK(p.rank(1).cu_seqlens == std::vector<index_t>{0, 4});
  CHECK(p.rank(0).reset_points == std::vector<index_t>{0});
  CHECK(p.rank(1).reset_points.empty());  // its piece continues the document: the scan carries state in
  CHECK(p.rank(0).causal_pairs == 1 + 2 + 7 + 8);
  CHECK(p.rank(1).causal_pairs == 3 + 4 + 5 + 6);
  const auto c = shard::make_plan(std::span<const index_t>(cu), 2, shard::contiguous{});
  CHECK(globals_of(c, 0) == std::vector<index_t>{0, 1, 2, 3});
  CHECK(c.rank(1).causal_pairs == 5 + 6 + 7 + 8);
}

TEST_CASE("shard::per_document balances packed documents that zigzag does not", "[packing][shard]") {
  // Documents [4, 12] on 2 ranks: per-document head-tail gives 44 / 44 causal pairs.
  const std::vector<index_t> cu{0, 4, 16};
  const auto p = shard::make_plan(std::span<const index_t>(cu), 2, shard::per_document{});
  CHECK(p.rank(0).causal_pairs == 44);
  CHECK(p.rank(1).causal_pairs == 44);
  // Documents [3c, c], c = 1024: sequence-level zigzag gives 1,049,600 vs 4,195,328 (max/mean 1.6).
  const std::vector<index_t> cu2{0, 3072, 4096};
  const auto z = shard::make_plan(std::span<const index_t>(cu2), 2, shard::zigzag{});
  CHECK(z.rank(0).causal_pairs == 1049600);
  CHECK(z.rank(1).causal_pairs == 4195328);
  CHECK(work_ratio(z) == Approx(1.6).epsilon(1e-3));
  CHECK(work_ratio(shard::make_plan(std::span<const index_t>(cu2), 2, shard::per_document{})) == Approx(1.0));
}

TEST_CASE("shard::zigzag balances one causal document exactly, contiguous does not", "[packing][shard]") {
  const int ranks = GENERATE(1, 2, 3, 4, 5, 8);
  const index_t c = 7;
  const std::vector<index_t> cu{0, 2 * ranks * c};
  const auto z = shard::make_plan(std::span<const index_t>(cu), ranks, shard::zigzag{});
  for (int r = 0; r < ranks; ++r) CHECK(z.rank(r).causal_pairs == c * c * (2 * ranks - 1) + c * (c + 1));
  // Contiguous: max / mean tends to (2P - 1) / P for long documents.
  const std::vector<index_t> big{0, 1 << 20};
  const auto ct = shard::make_plan(std::span<const index_t>(big), ranks, shard::contiguous{});
  CHECK(work_ratio(ct) == Approx((2.0 * ranks - 1) / ranks).epsilon(1e-3));
}

TEST_CASE("shard plans cover every token once and map both ways", "[packing][shard]") {
  const int ranks = GENERATE(1, 2, 3, 4, 5, 8);
  auto g = loom::test::rng(20 + static_cast<std::uint64_t>(ranks));
  std::vector<std::vector<index_t>> cases = {
      {0},              // no documents
      {0, 1},           // one token
      {0, 7},           // shorter than 2P
      {0, 131},         // odd, prime
      {0, 0, 5, 5, 6},  // empty documents between short ones
      {0, 1021, 1022, 2039},
  };
  for (int k = 0; k < 4; ++k)
    cases.push_back(
        cu_of(loom::test::long_tail(37 + 17 * static_cast<std::size_t>(k), loom::test::tail::pareto, 4099, g())));
  for (const auto& cu : cases) {
    INFO("ranks " << ranks << ", documents " << cu.size() - 1 << ", tokens " << cu.back());
    require_valid(cu, ranks, shard::contiguous{});
    require_valid(cu, ranks, shard::zigzag{});
    require_valid(cu, ranks, shard::per_document{});
  }
}

TEST_CASE("shard::per_document: tokens within one and work balanced on long-tail batches", "[packing][shard]") {
  const int ranks = GENERATE(2, 3, 4, 8);
  const auto t = GENERATE(loom::test::tail::lognormal, loom::test::tail::pareto);
  const auto lengths = loom::test::long_tail(400, t, 32768, 40 + static_cast<std::uint64_t>(ranks));
  const auto cu = cu_of(lengths);
  const auto p = shard::make_plan(std::span<const index_t>(cu), ranks, shard::per_document{});
  index_t lo = cu.back(), hi = 0;
  for (int r = 0; r < ranks; ++r) {
    lo = std::min(lo, p.rank(r).tokens);
    hi = std::max(hi, p.rank(r).tokens);
  }
  CHECK(hi - lo <= 1);
  const double ratio = work_ratio(p);
  const double zig = work_ratio(shard::make_plan(std::span<const index_t>(cu), ranks, shard::zigzag{}));
  INFO("per_document max/mean " << ratio << ", zigzag " << zig);
  CHECK(ratio <= 1.01);
  // Many documents shorter than 2P: tokens still within one, work spread.
  const std::vector<index_t> tiny = cu_of(std::vector<index_t>(101, 3));
  const auto q = shard::make_plan(std::span<const index_t>(tiny), ranks, shard::per_document{});
  index_t qlo = tiny.back(), qhi = 0;
  for (int r = 0; r < ranks; ++r) {
    qlo = std::min(qlo, q.rank(r).tokens);
    qhi = std::max(qhi, q.rank(r).tokens);
  }
  CHECK(qhi - qlo <= 1);
  CHECK(work_ratio(q) <= 1.05);
}

TEST_CASE("shard::make_plan rejections", "[packing][shard][errors]") {
  using loom::test::require_loom_error;
  const auto inv = loom::errc::invalid_argument;
  const std::vector<index_t> ok{0, 4, 9};
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(ok), 0, shard::zigzag{}); }, inv,
                     {"shard::make_plan", "ranks must be >= 1, got 0"});
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(), 2, shard::zigzag{}); }, inv,
                     {"shard::make_plan", "cu_seqlens must hold at least one offset"});
  const std::vector<index_t> bad_start{1, 4};
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(bad_start), 2, shard::per_document{}); },
                     inv, {"shard::make_plan", "cu_seqlens[0] must be 0, got 1"});
  const std::vector<index_t> decreasing{0, 5, 3};
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(decreasing), 2, shard::contiguous{}); }, inv,
                     {"shard::make_plan", "non-decreasing, but cu_seqlens[2] = 3 < cu_seqlens[1] = 5"});
  const std::vector<std::int32_t> decreasing32{0, 5, 3};
  require_loom_error(
      [&] { (void)shard::make_plan(std::span<const std::int32_t>(decreasing32), 2, shard::contiguous{}); }, inv,
      {"shard::make_plan", "non-decreasing, but cu_seqlens[2] = 3 < cu_seqlens[1] = 5"});
  require_loom_error([&] { (void)shard::make_plan(loom::segments<>{}, 2, shard::contiguous{}); }, inv,
                     {"shard::make_plan", "implicit cu_seqlens must be bound to a token count"});
  const auto p = shard::make_plan(std::span<const index_t>(ok), 2, shard::per_document{});
  CHECK_THROWS_WITH(p.to_local(9), Catch::Contains("token 9 outside [0, 9)"));
  CHECK_THROWS_WITH(p.to_global(2, 0), Catch::Contains("rank 2 outside"));
  CHECK_THROWS_WITH(p.to_global(0, 5), Catch::Contains("local token 5 outside"));
  std::vector<float> g(9), l(3);
  CHECK_THROWS_WITH(p.scatter(0, std::span<const float>(g), 1, std::span<float>(l)),
                    Catch::Contains("local array of rank 0 holds 3 elements, expected 5"));
  CHECK_THROWS_WITH(p.gather(0, std::span<const float>(l), 2, std::span<float>(g)),
                    Catch::Contains("global array holds 9"));
}

TEST_CASE("shard::make_plan takes int32 and int64 offsets and whole(n) alike", "[packing][shard]") {
  const std::vector<std::int32_t> cu32{0, 5, 5, 12, 31};
  const std::vector<index_t> cu64(cu32.begin(), cu32.end());
  const int ranks = GENERATE(1, 2, 3);
  const auto check_same = [&](const shard::plan& a, const shard::plan& b) {
    REQUIRE(a.ranks() == b.ranks());
    CHECK(a.cu_seqlens() == b.cu_seqlens());
    for (int r = 0; r < a.ranks(); ++r) {
      CHECK(globals_of(a, r) == globals_of(b, r));
      CHECK(a.rank(r).cu_seqlens == b.rank(r).cu_seqlens);
      CHECK(a.rank(r).reset_points == b.rank(r).reset_points);
      CHECK(a.rank(r).causal_pairs == b.rank(r).causal_pairs);
    }
  };
  const auto wide = shard::make_plan(loom::segments(std::span<const index_t>(cu64)), ranks, shard::per_document{});
  const auto narrow =
      shard::make_plan(loom::segments(std::span<const std::int32_t>(cu32)), ranks, shard::per_document{});
  check_same(wide, narrow);
  CHECK(wide.cu_seqlens() == cu64);
  // Device-style views of the same host memory.
  const auto view32 = loom::tensor_view<const std::int32_t, 1>(cu32.data(), {static_cast<index_t>(cu32.size())});
  check_same(wide, shard::make_plan(loom::segments(view32), ranks, shard::per_document{}));
  // The plan's segments views read back the offsets.
  const auto seg = wide.segments();
  REQUIRE(seg.count() == 4);
  CHECK(seg[4] == 31);
  for (int r = 0; r < ranks; ++r) {
    const auto local = wide.rank(r).segments();
    REQUIRE(local.count() == static_cast<index_t>(wide.rank(r).pieces.size()));
    CHECK(local[local.count()] == wide.rank(r).tokens);
  }
  // whole(n): one document of n tokens.
  const std::vector<index_t> one{0, 31};
  check_same(shard::make_plan(loom::segments<>::whole(31), ranks, shard::zigzag{}),
             shard::make_plan(std::span<const index_t>(one), ranks, shard::zigzag{}));
}

TEST_CASE("shard::make_plan: products and sums of sizes that overflow are errors naming the argument",
          "[packing][shard][errors][overflow]") {
  using loom::test::require_loom_error;
  const auto inv = loom::errc::invalid_argument;
  constexpr index_t two_62 = index_t{1} << 62;
  // r * total for r <= P (contiguous), k * total for k <= 2P (zigzag).
  const std::vector<index_t> huge{0, two_62};
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(huge), 4, shard::contiguous{}); }, inv,
                     {"shard::make_plan: ranks * cu_seqlens.back() = 4 * 4611686018427387904 overflows"});
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(huge), 2, shard::zigzag{}); }, inv,
                     {"shard::make_plan: 2 * ranks * cu_seqlens.back() = 4 * 4611686018427387904 overflows"});
  // The causal pairs of a rank: one document too long to count them, two whose sum overflows.
  const std::vector<index_t> long_doc{0, 5, 5'000'000'005};
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(long_doc), 2, shard::per_document{}); }, inv,
                     {"shard::make_plan: document 1 of cu_seqlens has 5000000000 tokens", "up to 4294967295"});
  const index_t m = pk::max_causal_length;
  const std::vector<index_t> two_long{0, m, 2 * m};
  require_loom_error([&] { (void)shard::make_plan(std::span<const index_t>(two_long), 1, shard::contiguous{}); }, inv,
                     {"shard::make_plan: the causal pairs of the documents of cu_seqlens = 9223372034707292160 + "
                      "9223372034707292160 overflows"});
  // scatter / gather: total tokens * row.
  const std::vector<index_t> ok{0, 4, 9};
  const auto p = shard::make_plan(std::span<const index_t>(ok), 2, shard::zigzag{});
  std::vector<float> g(9), l(5);
  require_loom_error([&] { p.scatter(0, std::span<const float>(g), two_62, std::span<float>(l)); }, inv,
                     {"shard::plan::scatter: total tokens * row = 9 * 4611686018427387904 overflows"});
  require_loom_error([&] { p.gather(0, std::span<const float>(l), two_62, std::span<float>(g)); }, inv,
                     {"shard::plan::gather: total tokens * row = 9 * 4611686018427387904 overflows"});
}

TEST_CASE("shard::make_plan of 5e9 tokens: exact causal pairs per rank", "[packing][shard][overflow]") {
  // Ten documents of 5e8 tokens: 5e9 in all (beyond 32 bits), each document's causal pairs
  // 125000000250000000, their sum 1.25e18 (within 64 bits). Contiguous on 2 ranks gives five
  // documents each; per_document gives each rank half of every document's pairs.
  const std::vector<index_t> lengths(10, 500'000'000);
  const auto cu = cu_of(lengths);
  REQUIRE(cu.back() == 5'000'000'000);
  for (const auto& p : {shard::make_plan(std::span<const index_t>(cu), 2, shard::contiguous{}),
                        shard::make_plan(std::span<const index_t>(cu), 2, shard::per_document{})}) {
    for (int r = 0; r < 2; ++r) {
      CHECK(p.rank(r).tokens == 2'500'000'000);
      CHECK(p.rank(r).causal_pairs == 625000001250000000);
    }
    CHECK(p.to_local(4'999'999'999).local == 2'499'999'999);
  }
  const auto z = shard::make_plan(std::span<const index_t>(cu), 2, shard::zigzag{});
  CHECK(z.rank(0).tokens + z.rank(1).tokens == 5'000'000'000);
  CHECK(z.rank(0).causal_pairs + z.rank(1).causal_pairs == 1250000002500000000);
}
