// packing: cost model, FFD / BFD, the exact solvers, the WLB packer and per-sequence parallel degree.

#include <loom/packing/cost_model.hpp>
#include <loom/packing/exact.hpp>
#include <loom/packing/packer.hpp>
#include <loom/packing/parallel_degree.hpp>
#include <loom/packing/wlb.hpp>

#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <packing/support.hpp>

using loom::index_t;
namespace pk = loom::packing;
using loom::test::tail;

namespace {
bool is_invalid(const loom::error& e) { return e.code() == loom::errc::invalid_argument; }
std::vector<std::vector<index_t>> ids(const std::vector<pk::micro_batch>& bins) {
  std::vector<std::vector<index_t>> v;
  for (const auto& b : bins) v.push_back(b.documents);
  return v;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Cost model

TEST_CASE("packing::causal_pairs and chunk pairs are exact", "[packing][cost]") {
  CHECK(pk::causal_pairs(0) == 0);
  CHECK(pk::causal_pairs(1) == 1);
  CHECK(pk::causal_pairs(8) == 36);
  CHECK(pk::causal_pairs(131072) == 8590000128LL);
  static_assert(pk::causal_pairs(12) == 78 && pk::chunk_causal_pairs(9, 3) == 33);
  // Any partition of a document into chunks adds up to the whole.
  auto g = loom::test::rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const index_t n = std::uniform_int_distribution<index_t>(0, 5000)(g);
    std::int64_t sum = 0;
    for (index_t off = 0; off < n;) {
      const index_t len = std::min<index_t>(n - off, std::uniform_int_distribution<index_t>(1, 700)(g));
      sum += pk::chunk_causal_pairs(off, len);
      off += len;
    }
    REQUIRE(sum == pk::causal_pairs(n));
  }
  // One 128K document against eight 16K documents: the same tokens, about 8x the attention.
  const double ratio = static_cast<double>(pk::causal_pairs(131072)) / (8.0 * pk::causal_pairs(16384));
  CHECK(ratio == Approx(7.99957).epsilon(1e-5));
  CHECK_THROWS_MATCHES(pk::causal_pairs(-1), loom::error, Catch::Predicate<loom::error>(is_invalid));
  CHECK_THROWS_WITH(pk::chunk_causal_pairs(-2, 3), Catch::Contains("must be >= 0"));
}

TEST_CASE("packing::fit_cost_model recovers alpha, beta, gamma", "[packing][cost]") {
  const pk::cost_model truth{2e-9, 3e-6, 1e-3};
  std::vector<pk::cost_sample> samples;
  for (index_t l : {1, 7, 131, 1021, 4096, 16381, 65536}) samples.push_back({l, truth(l)});
  auto fit = pk::fit_cost_model(samples);
  CHECK(fit.alpha == Approx(truth.alpha).epsilon(1e-8));
  CHECK(fit.beta == Approx(truth.beta).epsilon(1e-7));
  CHECK(fit.gamma == Approx(truth.gamma).epsilon(1e-6));
  // With 1% multiplicative noise the fit stays within a few percent on the dominant terms.
  auto g = loom::test::rng(2);
  std::normal_distribution<double> noise(0.0, 0.01);
  samples.clear();
  for (int rep = 0; rep < 20; ++rep)
    for (index_t l : {512, 2048, 8192, 32768, 131072}) samples.push_back({l, truth(l) * (1 + noise(g))});
  fit = pk::fit_cost_model(samples);
  CHECK(fit.alpha == Approx(truth.alpha).epsilon(0.03));
  CHECK(fit(100000) == Approx(truth(100000)).epsilon(0.02));
  // Rejections.
  const std::vector<pk::cost_sample> two{{5, 1.0}, {5, 1.1}, {9, 2.0}};
  CHECK_THROWS_WITH(pk::fit_cost_model(two), Catch::Contains("at least 3 distinct lengths"));
  const std::vector<pk::cost_sample> zero{{0, 1.0}, {5, 1.1}, {9, 2.0}};
  CHECK_THROWS_WITH(pk::fit_cost_model(zero), Catch::Contains("lengths must be >= 1"));
  const std::vector<pk::cost_sample> nan{{1, NAN}, {5, 1.1}, {9, 2.0}};
  CHECK_THROWS_WITH(pk::fit_cost_model(nan), Catch::Contains("finite"));
}

// ---------------------------------------------------------------------------------------------
// First-fit- and best-fit-decreasing

TEST_CASE("packing::FFD and BFD hand-checkable cases", "[packing][ffd][bfd]") {
  // [3, 2, 3, 1] with capacity 4 packs as [[3, 1], [3], [2]] (3 bins, the lower bound).
  const std::vector<index_t> a{3, 2, 3, 1};
  for (const auto& bins : {pk::best_fit_decreasing(a, {.capacity = 4}), pk::first_fit_decreasing(a, {.capacity = 4})}) {
    CHECK(ids(bins) == std::vector<std::vector<index_t>>{{0, 3}, {2}, {1}});
    CHECK(bins[0].cu_seqlens == std::vector<index_t>{0, 3, 4});
    CHECK(bins[1].cu_seqlens == std::vector<index_t>{0, 3});
    CHECK(bins[2].cu_seqlens == std::vector<index_t>{0, 2});
  }
  // [1, 3, 6, 8] with capacity 10: first fit puts the 1 beside the 8, best fit beside the 6 + 3.
  const std::vector<index_t> b{1, 3, 6, 8};
  CHECK(ids(pk::first_fit_decreasing(b, {.capacity = 10})) == std::vector<std::vector<index_t>>{{3, 0}, {2, 1}});
  CHECK(ids(pk::best_fit_decreasing(b, {.capacity = 10})) == std::vector<std::vector<index_t>>{{3}, {2, 1, 0}});
}

TEST_CASE("packing::FFD and BFD cover every document within capacity on long-tail inputs", "[packing][ffd][bfd]") {
  const auto t = GENERATE(tail::lognormal, tail::pareto);
  const std::size_t n = GENERATE(1u, 7u, 1021u, 100003u);
  const index_t cap = 32768;
  const auto lengths = loom::test::long_tail(n, t, cap, 3 + n);
  const index_t total = std::accumulate(lengths.begin(), lengths.end(), index_t{0});
  for (const auto& bins :
       {pk::first_fit_decreasing(lengths, {.capacity = cap}), pk::best_fit_decreasing(lengths, {.capacity = cap})}) {
    loom::test::require_covers(bins, lengths);
    std::size_t over = 0;
    for (const auto& bin : bins) over += bin.tokens() > cap || bin.documents.empty();
    CHECK(over == 0);
    CHECK(static_cast<index_t>(bins.size()) >= (total + cap - 1) / cap);
    // Any fit algorithm leaves at most one bin half empty or less.
    std::size_t half_empty = 0;
    for (const auto& bin : bins) half_empty += 2 * bin.tokens() <= cap;
    CHECK(half_empty <= 1);
  }
}

TEST_CASE("packing::FFD and BFD stay within 11/9 OPT + 6/9 of the exact minimum", "[packing][ffd][bfd][exact]") {
  auto g = loom::test::rng(4);
  int trials = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const auto n = std::uniform_int_distribution<std::size_t>(1, 11)(g);
    std::vector<index_t> lengths(n);
    for (auto& l : lengths) l = std::uniform_int_distribution<index_t>(1, 10)(g);
    const int opt = pk::exact_min_bins(lengths, {.capacity = 10});
    const auto ffd = pk::first_fit_decreasing(lengths, {.capacity = 10}).size();
    const auto bfd = pk::best_fit_decreasing(lengths, {.capacity = 10}).size();
    INFO("trial " << trial << " opt " << opt);
    CHECK(static_cast<int>(ffd) >= opt);
    CHECK(9.0 * static_cast<double>(ffd) <= 11.0 * opt + 6.0);
    CHECK(9.0 * static_cast<double>(bfd) <= 11.0 * opt + 6.0);
    ++trials;
  }
  CHECK(trials == 60);
}

TEST_CASE("packing::FFD and BFD oversize policy, seeds and rejections", "[packing][ffd][bfd][errors]") {
  const std::vector<index_t> l{5, 12, 5, 3};
  CHECK_THROWS_WITH(pk::first_fit_decreasing(l, {.capacity = 10}),
                    Catch::Contains("document 1 has 12 tokens, more than the capacity 10"));
  CHECK_THROWS_WITH(pk::best_fit_decreasing(l, {.capacity = 10}), Catch::Contains("declare a policy"));
  const auto own = pk::first_fit_decreasing(l, {.capacity = 10, .policy = pk::oversize::own_batch});
  REQUIRE(own.size() == 3);
  CHECK(own[0].documents == std::vector<index_t>{1});  // alone, over the capacity
  CHECK(own[1].tokens() == 10);
  CHECK(own[2].tokens() == 3);
  CHECK(pk::best_fit_decreasing(l, {.capacity = 10, .policy = pk::oversize::own_batch}).size() == 3);
  const std::vector<index_t> zero{3, 0, 2};
  CHECK_THROWS_WITH(pk::first_fit_decreasing(zero, {.capacity = 4}), Catch::Contains("document 1 has length 0"));
  const std::vector<index_t> neg{3, -2};
  CHECK_THROWS_MATCHES(pk::best_fit_decreasing(neg, {.capacity = 4}), loom::error,
                       Catch::Predicate<loom::error>(is_invalid));
  CHECK_THROWS_WITH(pk::first_fit_decreasing(l, {.capacity = 0}), Catch::Contains("capacity must be > 0"));
  CHECK(pk::first_fit_decreasing(std::vector<index_t>{}, {.capacity = 4}).empty());
  // Seeds: equal lengths are ordered by a seeded key; a seed replays exactly.
  const std::vector<index_t> ties(40, 3);
  const auto s1 = pk::first_fit_decreasing(ties, {.capacity = 7, .seed = 99});
  CHECK(ids(s1) == ids(pk::first_fit_decreasing(ties, {.capacity = 7, .seed = 99})));
  CHECK(ids(s1) != ids(pk::first_fit_decreasing(ties, {.capacity = 7, .seed = 0})));
  CHECK(pk::first_fit_decreasing(ties, {.capacity = 7, .seed = 0})[0].documents == std::vector<index_t>{0, 1});
  loom::test::require_covers(s1, ties);
}

// ---------------------------------------------------------------------------------------------
// Exact solver

TEST_CASE("packing::exact_min_max_cost equals brute force on tiny inputs", "[packing][exact]") {
  auto g = loom::test::rng(5);
  const pk::cost_model m{1.0, 3.0, 2.0};
  for (int trial = 0; trial < 40; ++trial) {
    const auto n = std::uniform_int_distribution<std::size_t>(1, 7)(g);
    const int bins = std::uniform_int_distribution<int>(1, 3)(g);
    const index_t cap = std::uniform_int_distribution<index_t>(8, 30)(g);
    std::vector<index_t> l(n);
    for (auto& x : l) x = std::uniform_int_distribution<index_t>(1, 8)(g);
    double brute = INFINITY;
    std::vector<int> a(n, 0);
    for (long code = 0; code < static_cast<long>(std::pow(bins, n)); ++code) {
      long c = code;
      std::vector<double> load(static_cast<std::size_t>(bins), 0);
      std::vector<index_t> tok(static_cast<std::size_t>(bins), 0);
      for (std::size_t i = 0; i < n; ++i, c /= bins) {
        load[static_cast<std::size_t>(c % bins)] += m(l[i]);
        tok[static_cast<std::size_t>(c % bins)] += l[i];
      }
      if (*std::max_element(tok.begin(), tok.end()) <= cap)
        brute = std::min(brute, *std::max_element(load.begin(), load.end()));
    }
    const auto r = pk::exact_min_max_cost(l, bins, m, {.capacity = cap});
    INFO("trial " << trial);
    REQUIRE(r.proven_optimal);
    CHECK(r.feasible == std::isfinite(brute));
    if (r.feasible) {
      CHECK(r.max_cost == Approx(brute));
      // The returned assignment achieves the claimed optimum within the capacity.
      std::vector<double> load(static_cast<std::size_t>(bins), 0);
      std::vector<index_t> tok(static_cast<std::size_t>(bins), 0);
      for (std::size_t i = 0; i < n; ++i) {
        load[static_cast<std::size_t>(r.bin_of[i])] += m(l[i]);
        tok[static_cast<std::size_t>(r.bin_of[i])] += l[i];
      }
      CHECK(*std::max_element(load.begin(), load.end()) == Approx(r.max_cost));
      CHECK(*std::max_element(tok.begin(), tok.end()) <= cap);
    }
  }
  CHECK_THROWS_WITH(pk::exact_min_max_cost(std::vector<index_t>(25, 1), 2, m), Catch::Contains("tiny inputs"));
  CHECK_THROWS_WITH(pk::exact_min_max_cost(std::vector<index_t>{1}, 0, m), Catch::Contains("bins must be >= 1"));
}

// ---------------------------------------------------------------------------------------------
// Workload-balanced packing

TEST_CASE("packing::wlb balances within the LPT bound of the exact optimum", "[packing][wlb][exact]") {
  auto g = loom::test::rng(6);
  double worst = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int n_mb = std::uniform_int_distribution<int>(2, 3)(g);
    const auto n = std::uniform_int_distribution<std::size_t>(2, 10)(g);
    std::vector<index_t> l(n);
    std::vector<pk::document> docs;
    for (std::size_t i = 0; i < n; ++i) {
      l[i] = std::uniform_int_distribution<index_t>(1, 400)(g);
      docs.push_back({static_cast<index_t>(i), l[i]});
    }
    pk::wlb_packer p({.micro_batches = n_mb, .token_cap = 1 << 20, .max_delay_steps = 0});
    const auto step = p.push(docs);
    REQUIRE(p.pending() == 0);
    loom::test::require_covers(step.micro_batches, l);
    const double got = pk::balance_of(step.micro_batches, pk::cost_model{}).max;
    const auto opt = pk::exact_min_max_cost(l, n_mb, pk::cost_model{});
    REQUIRE(opt.proven_optimal);
    // Greedy longest-first onto the least loaded: Graham's 4/3 - 1/(3N) bound when the cap is loose.
    CHECK(got <= (4.0 / 3.0 - 1.0 / (3.0 * n_mb)) * opt.max_cost * (1 + 1e-12));
    worst = std::max(worst, got / opt.max_cost);
  }
  INFO("worst WLB / optimum over the trials: " << worst);
  CHECK(worst >= 1.0);
}

TEST_CASE("packing::wlb on large long-tail steps stays within mean + largest item", "[packing][wlb]") {
  const auto t = GENERATE(tail::lognormal, tail::pareto);
  const int n_mb = GENERATE(8, 16, 32);
  const auto l = loom::test::long_tail(static_cast<std::size_t>(n_mb) * 200, t, 32768, 7 + n_mb);
  std::vector<pk::document> docs;
  for (std::size_t i = 0; i < l.size(); ++i) docs.push_back({static_cast<index_t>(i), l[i]});
  const pk::cost_model m{1.0, 4096.0, 0.0};
  pk::wlb_packer p({.micro_batches = n_mb, .token_cap = 1 << 30, .max_delay_steps = 0, .cost = m});
  const auto step = p.push(docs);
  loom::test::require_covers(step.micro_batches, l);
  double total = 0, largest = 0;
  for (index_t x : l) {
    total += m(x);
    largest = std::max(largest, m(x));
  }
  const auto b = pk::balance_of(step.micro_batches, m);
  CHECK(b.max <= total / n_mb + largest);  // list scheduling: no bin exceeds the mean by more than one item
  CHECK(b.max >= std::max(total / n_mb, largest) * (1 - 1e-12));
}

TEST_CASE("packing::wlb stream covers every document, respects the cap, emits N micro-batches", "[packing][wlb]") {
  const index_t cap = 20000;
  pk::wlb_packer p({.micro_batches = 4, .token_cap = cap, .outlier_thresholds = {4000, 9000}, .max_delay_steps = 3});
  std::map<index_t, int> emitted;
  std::map<index_t, index_t> len;
  index_t next = 0;
  auto consume = [&](const pk::wlb_step& s) {
    REQUIRE(s.micro_batches.size() == 4);
    for (const auto& mb : s.micro_batches) {
      CHECK(mb.tokens() <= cap);
      for (std::size_t i = 0; i < mb.documents.size(); ++i) {
        ++emitted[mb.documents[i]];
        CHECK(mb.cu_seqlens[i + 1] - mb.cu_seqlens[i] == len[mb.documents[i]]);
      }
    }
  };
  for (int step = 0; step < 30; ++step) {
    const auto l = loom::test::long_tail(40, tail::pareto, cap, 100 + static_cast<std::uint64_t>(step));
    std::vector<pk::document> docs;
    for (index_t x : l) {
      docs.push_back({next, x});
      len[next++] = x;
    }
    consume(p.push(docs));
  }
  for (int guard = 0; p.pending() > 0 && guard < 100; ++guard) consume(p.flush());
  CHECK(p.pending() == 0);
  REQUIRE(emitted.size() == static_cast<std::size_t>(next));
  for (const auto& [id, count] : emitted) REQUIRE(count == 1);
}

TEST_CASE("packing::wlb delay bound holds on an adversarial stream", "[packing][wlb][delay]") {
  // Every step brings a new outlier (and filler); outliers never fill their queue, so only the
  // bound releases them.
  const int max_delay = GENERATE(0, 1, 2, 5);
  pk::wlb_packer p(
      {.micro_batches = 4, .token_cap = 10000, .outlier_thresholds = {3000, 6000}, .max_delay_steps = max_delay});
  std::map<index_t, std::int64_t> arrived;
  std::int64_t worst = 0, released = 0;
  index_t next = 0;
  auto consume = [&](const pk::wlb_step& s) {
    for (const auto& mb : s.micro_batches)
      for (index_t id : mb.documents) {
        worst = std::max(worst, s.step - arrived.at(id));
        ++released;
      }
  };
  for (int step = 0; step < 50; ++step) {
    std::vector<pk::document> docs{{next, step % 2 ? 3500 : 7000}};
    arrived[next++] = step;
    for (int k = 0; k < 6; ++k) {
      docs.push_back({next, 500 + 37 * k});
      arrived[next++] = step;
    }
    consume(p.push(docs));
  }
  while (p.pending() > 0) consume(p.flush());
  CHECK(released == next);
  CHECK(worst <= max_delay);
  if (max_delay > 0) CHECK(worst == max_delay);  // the outliers really waited
}

TEST_CASE("packing::wlb full queue releases N outliers spread over the micro-batches", "[packing][wlb]") {
  pk::wlb_packer p({.micro_batches = 3, .token_cap = 1000, .outlier_thresholds = {500}, .max_delay_steps = 10});
  auto s0 = p.push(std::vector<pk::document>{{0, 600}, {1, 700}, {2, 50}});
  CHECK(s0.waiting.size() == 2);
  auto s1 = p.push(std::vector<pk::document>{{3, 800}, {4, 60}});
  CHECK(s1.waiting.empty());
  int with_outlier = 0;
  for (const auto& mb : s1.micro_batches)
    with_outlier +=
        std::any_of(mb.documents.begin(), mb.documents.end(), [](index_t id) { return id <= 1 || id == 3; });
  CHECK(with_outlier == 3);
}

TEST_CASE("packing::wlb is deterministic and a seed replays it", "[packing][wlb]") {
  auto run = [](std::uint64_t seed) {
    pk::wlb_packer p({.micro_batches = 4, .token_cap = 9000, .outlier_thresholds = {3000}, .seed = seed});
    std::vector<std::vector<index_t>> out;
    for (int step = 0; step < 6; ++step) {
      std::vector<pk::document> docs;
      for (int k = 0; k < 12; ++k) docs.push_back({step * 12 + k, k % 3 ? 700 : 3500});  // many equal lengths
      for (const auto& mb : p.push(docs).micro_batches) out.push_back(mb.documents);
    }
    return out;
  };
  CHECK(run(0) == run(0));
  CHECK(run(17) == run(17));
  CHECK(run(17) != run(0));
}

TEST_CASE("packing::wlb rejections", "[packing][wlb][errors]") {
  CHECK_THROWS_WITH(pk::wlb_packer({.micro_batches = 0, .token_cap = 10}),
                    Catch::Contains("micro_batches must be > 0"));
  CHECK_THROWS_WITH(pk::wlb_packer({.micro_batches = 2, .token_cap = 0}), Catch::Contains("token_cap must be > 0"));
  CHECK_THROWS_WITH(pk::wlb_packer({.micro_batches = 2, .token_cap = 10, .outlier_thresholds = {5, 5}}),
                    Catch::Contains("strictly increasing"));
  CHECK_THROWS_WITH(pk::wlb_packer({.micro_batches = 2, .token_cap = 10, .max_delay_steps = -1}),
                    Catch::Contains("max_delay_steps must be >= 0"));
  pk::wlb_packer p({.micro_batches = 1, .token_cap = 10, .max_delay_steps = 1});
  CHECK_THROWS_WITH(p.push(std::vector<pk::document>{{7, 0}}), Catch::Contains("document 7 has length 0"));
  CHECK_THROWS_WITH(p.push(std::vector<pk::document>{{8, 11}}), Catch::Contains("more than token_cap 10"));
  // Three documents of 8 tokens, one micro-batch of 10: two wait; next step both are due and only
  // one fits, so keeping the bound is impossible and the packer says so.
  auto s = p.push(std::vector<pk::document>{{1, 8}, {2, 8}, {3, 8}});
  CHECK(s.waiting.size() == 2);
  CHECK_THROWS_MATCHES(
      p.push(std::vector<pk::document>{}), loom::error, Catch::Predicate<loom::error>([](const loom::error& e) {
        return e.code() == loom::errc::unsupported && std::string(e.what()).find("waited 1 steps") != std::string::npos;
      }));
}

// ---------------------------------------------------------------------------------------------
// Per-sequence parallel degree

namespace {
void require_valid(const pk::degree_plan& plan, const std::vector<index_t>& l, const pk::degree_options& o) {
  REQUIRE(plan.groups.size() == l.size());
  std::vector<double> load(static_cast<std::size_t>(o.ranks), 0);
  std::vector<index_t> tok(static_cast<std::size_t>(o.ranks), 0);
  for (std::size_t s = 0; s < l.size(); ++s) {
    const auto& g = plan.groups[s];
    REQUIRE(g.sequence == static_cast<index_t>(s));
    REQUIRE(!g.ranks.empty());
    REQUIRE(std::adjacent_find(g.ranks.begin(), g.ranks.end(), std::greater_equal<>()) == g.ranks.end());
    const int d = static_cast<int>(g.ranks.size());
    // The tokens of the sequence are covered exactly once by its group (per-document sharding).
    std::int64_t covered = 0;
    for (int r : g.ranks) {
      REQUIRE((r >= 0 && r < o.ranks));
      const auto ur = static_cast<std::size_t>(r);
      load[ur] += o.cost(l[s]) / d + o.comm_per_token * static_cast<double>(l[s]) * (d - 1.0) / d;
      tok[ur] += (l[s] + d - 1) / d;
      covered += (l[s] + d - 1) / d;
    }
    CHECK(covered >= l[s]);
    CHECK(covered - l[s] < d);
  }
  for (std::size_t r = 0; r < load.size(); ++r) {
    CHECK(plan.rank_load[r] == Approx(load[r]));
    CHECK(plan.rank_tokens[r] == tok[r]);
    CHECK(tok[r] <= o.memory_tokens);
  }
}
}  // namespace

TEST_CASE("packing::assign_parallel_degree is valid and within 1.25x of the exact optimum",
          "[packing][degree][exact]") {
  auto g = loom::test::rng(8);
  double worst = 1, sum = 0;
  int cases = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const int ranks = std::uniform_int_distribution<int>(2, 5)(g);
    const auto n = std::uniform_int_distribution<std::size_t>(1, 5)(g);
    std::vector<index_t> l(n);
    for (auto& x : l)
      x = static_cast<index_t>(64.0 / std::pow(1 - std::uniform_real_distribution<double>(0, 1)(g), 1.0));
    for (auto& x : l) x = std::min<index_t>(x, 4000);
    const pk::degree_options o{.ranks = ranks, .memory_tokens = 1500, .cost = {1.0, 0.0, 0.0}, .comm_per_token = 50.0};
    index_t total = 0;
    for (index_t x : l) total += x;
    if (total > 1500 * ranks * 3 / 4) continue;  // leave the greedy some memory slack
    const auto greedy = pk::assign_parallel_degree(l, o);
    const auto exact = pk::exact_parallel_degree(l, o);
    require_valid(greedy, l, o);
    require_valid(exact, l, o);
    const double gap = greedy.max_load() / exact.max_load();
    INFO("trial " << trial << ", ranks " << ranks << ", lengths " << Catch::Detail::stringify(l));
    CHECK(gap >= 1 - 1e-12);
    CHECK(gap <= 1.25);
    worst = std::max(worst, gap);
    sum += gap;
    ++cases;
  }
  REQUIRE(cases >= 30);
  INFO("greedy / exact: mean " << sum / cases << ", worst " << worst);
  SUCCEED();
}

TEST_CASE("packing::assign_parallel_degree spreads long sequences and keeps short ones local", "[packing][degree]") {
  const std::vector<index_t> l{1000, 300, 200, 100, 50};
  const pk::degree_options o{.ranks = 4, .memory_tokens = 600, .cost = {}, .comm_per_token = 20.0};
  const auto plan = pk::assign_parallel_degree(l, o);
  require_valid(plan, l, o);
  CHECK(plan.groups[0].ranks.size() == 4);  // 1000 tokens need 2 ranks for memory, balance takes 4
  CHECK(plan.groups[2].ranks.size() == 1);  // 200 and 50 tokens stay local,
  CHECK(plan.groups[4].ranks.size() == 1);
  CHECK(plan.groups[1].ranks.size() == 3);  // 300 and 100 fill the other three ranks
  CHECK(plan.max_load() == Approx(pk::exact_parallel_degree(l, o).max_load()));
}

TEST_CASE("packing::parallel degree rejections", "[packing][degree][errors]") {
  const std::vector<index_t> l{100, 50};
  CHECK_THROWS_WITH(pk::assign_parallel_degree(l, {.ranks = 0, .memory_tokens = 10}),
                    Catch::Contains("ranks must be > 0"));
  CHECK_THROWS_WITH(pk::assign_parallel_degree(l, {.ranks = 2, .memory_tokens = 0}),
                    Catch::Contains("memory_tokens must be > 0"));
  CHECK_THROWS_WITH(pk::assign_parallel_degree(l, {.ranks = 2, .memory_tokens = 40}),
                    Catch::Contains("does not fit even on all 2 ranks"));
  CHECK_THROWS_WITH(pk::assign_parallel_degree(std::vector<index_t>{60, 60, 60}, {.ranks = 2, .memory_tokens = 60}),
                    Catch::Contains("exceeds the memory"));
  CHECK_THROWS_WITH(pk::assign_parallel_degree(std::vector<index_t>{5, 0}, {.ranks = 2, .memory_tokens = 60}),
                    Catch::Contains("document 1 has length 0"));
  CHECK_THROWS_WITH(pk::exact_parallel_degree(std::vector<index_t>(7, 1), {.ranks = 2, .memory_tokens = 60}),
                    Catch::Contains("tiny inputs"));
}

// ---------------------------------------------------------------------------------------------
// Sizes near the limits of a 64-bit index, and the delay bound 0

namespace {
constexpr index_t max_index = std::numeric_limits<index_t>::max();
constexpr index_t two_62 = index_t{1} << 62;
using loom::test::require_loom_error;
}  // namespace

TEST_CASE("packing::causal_pairs and chunk_causal_pairs reject counts that overflow, naming the length",
          "[packing][cost][errors][overflow]") {
  STATIC_REQUIRE(pk::causal_pairs(pk::max_causal_length) == 9223372034707292160);  // (2^32 - 1) 2^31
  STATIC_REQUIRE(pk::causal_pairs(3037000499) == 4611686016981624750);             // odd n
  STATIC_REQUIRE(pk::chunk_causal_pairs(0, pk::max_causal_length) == pk::causal_pairs(pk::max_causal_length));
  const auto inv = loom::errc::invalid_argument;
  require_loom_error([] { (void)pk::causal_pairs(pk::max_causal_length + 1); }, inv,
                     {"causal_pairs: length must be <= 4294967295", "got 4294967296"});
  require_loom_error([] { (void)pk::causal_pairs(5'000'000'000); }, inv,
                     {"causal_pairs: length must be <= 4294967295", "got 5000000000"});
  require_loom_error([] { (void)pk::chunk_causal_pairs(0, 5'000'000'000); }, inv,
                     {"chunk_causal_pairs: length must be <= 4294967295", "got 5000000000"});
  require_loom_error([] { (void)pk::chunk_causal_pairs(index_t{1} << 40, index_t{1} << 30); }, inv,
                     {"chunk_causal_pairs: length * offset = 1073741824 * 1099511627776 overflows"});
  // length * offset fits, the pairs inside the chunk push the sum over.
  require_loom_error([] { (void)pk::chunk_causal_pairs(index_t{1} << 31, pk::max_causal_length); }, inv,
                     {"chunk_causal_pairs: length * offset + length (length + 1) / 2 = 9223372034707292160 + "
                      "9223372034707292160 overflows"});
}

TEST_CASE("packing::cost_model: any length has a cost, equal to the exact pair count where it fits",
          "[packing][cost][overflow]") {
  const pk::cost_model m;  // alpha 1: the cost is the pair count
  auto g = loom::test::rng(2);
  for (int trial = 0; trial < 2000; ++trial) {
    const index_t n = std::uniform_int_distribution<index_t>(0, pk::max_causal_length)(g);
    const index_t off = std::uniform_int_distribution<index_t>(0, pk::max_causal_length)(g);
    REQUIRE(m(n) == static_cast<double>(pk::causal_pairs(n)));
    REQUIRE(m.chunk(off, n % 100000) == static_cast<double>(pk::chunk_causal_pairs(off, n % 100000)));
  }
  CHECK(m(pk::max_causal_length) == 9223372034707292160.0);
  CHECK(m(5'000'000'000) == 12500000002500000000.0);  // 5e9 (5e9 + 1) / 2, beyond 2^63
  CHECK(m(max_index) == 4.2535295865117307932921825928971e37);
  const pk::cost_model affine{.alpha = 2.0, .beta = 3.0, .gamma = 5.0};
  CHECK(affine(5'000'000'000) == 2.0 * 12500000002500000000.0 + 3.0 * 5e9 + 5.0);
  CHECK(affine(0) == 5.0);
  CHECK(affine.chunk(7, 0) == 0.0);
}

TEST_CASE("packing::micro_batch::add rejects a token count that overflows", "[packing][errors][overflow]") {
  pk::micro_batch mb;
  mb.add(0, max_index - 1);
  mb.add(1, 1);
  CHECK(mb.tokens() == max_index);
  require_loom_error([&] { mb.add(2, 1); }, loom::errc::invalid_argument,
                     {"micro_batch::add: tokens() + length = 9223372036854775807 + 1 overflows"});
  CHECK(mb.documents == std::vector<index_t>{0, 1});  // unchanged by the failed add
  CHECK(mb.cu_seqlens == std::vector<index_t>{0, max_index - 1, max_index});
}

TEST_CASE("packing::wlb with lengths near 2^62: token sums compare without overflow", "[packing][wlb][overflow]") {
  // Two documents of 2^62 tokens do not share a micro-batch under a cap of 2^63 - 1 (their sum is
  // 2^63); a document of 2^62 - 1 tokens does, and the micro-batch then holds exactly the cap.
  pk::wlb_packer p({.micro_batches = 1, .token_cap = max_index});
  const auto s0 = p.push(std::vector<pk::document>{{0, two_62}, {1, two_62}});
  CHECK(ids(s0.micro_batches) == std::vector<std::vector<index_t>>{{0}});
  CHECK(s0.waiting == std::vector<index_t>{1});
  const auto s1 = p.push(std::vector<pk::document>{{2, two_62 - 1}});
  CHECK(ids(s1.micro_batches) == std::vector<std::vector<index_t>>{{1, 2}});
  CHECK(s1.micro_batches[0].cu_seqlens == std::vector<index_t>{0, two_62, max_index});
  CHECK(s1.waiting.empty());
  CHECK(p.pending() == 0);
}

TEST_CASE("packing::wlb with max_delay_steps = 0 never delays a document", "[packing][wlb][delay]") {
  // Documents that fit are emitted in the step they arrive, outliers included.
  pk::wlb_packer p({.micro_batches = 2, .token_cap = 10, .outlier_thresholds = {6}, .max_delay_steps = 0});
  const auto s0 = p.push(std::vector<pk::document>{{1, 4}, {2, 7}, {3, 5}});
  CHECK(ids(s0.micro_batches) == std::vector<std::vector<index_t>>{{2}, {3, 1}});
  CHECK(s0.waiting.empty());
  CHECK(p.pending() == 0);
  // Two documents of 8 tokens and one micro-batch of 10: the second cannot be emitted now, and
  // the bound 0 forbids carrying it: push says so (it used to emit it one step late).
  pk::wlb_packer q({.micro_batches = 1, .token_cap = 10, .max_delay_steps = 0});
  require_loom_error(
      [&] {
        q.push(std::vector<pk::document>{{1, 8}, {2, 8}});
      },
      loom::errc::unsupported,
      {"wlb_packer: document 2 (8 tokens) has waited 0 steps, the bound (max_delay_steps = 0)",
       "do not fit into 1 micro-batches of 10 tokens"});
  // The bound is named whatever it is: four documents, one fits per step; at step 2 two are due.
  pk::wlb_packer r({.micro_batches = 1, .token_cap = 10, .max_delay_steps = 2});
  CHECK(r.push(std::vector<pk::document>{{1, 8}, {2, 8}, {3, 8}, {4, 8}}).waiting == std::vector<index_t>{2, 3, 4});
  CHECK(ids(r.push(std::vector<pk::document>{}).micro_batches) == std::vector<std::vector<index_t>>{{2}});
  require_loom_error([&] { r.push(std::vector<pk::document>{}); }, loom::errc::unsupported,
                     {"document 4 (8 tokens) has waited 2 steps, the bound (max_delay_steps = 2)"});
}

TEST_CASE("packing::exact solvers near the index limit", "[packing][exact][overflow]") {
  // No capacity (the default is the largest index): 2^62 + 2^62 exceeds it, so three such
  // documents do not fit two micro-batches; two do.
  const pk::cost_model m;
  CHECK(!pk::exact_min_max_cost(std::vector<index_t>{two_62, two_62, two_62}, 2, m).feasible);
  const auto two = pk::exact_min_max_cost(std::vector<index_t>{two_62, two_62}, 2, m);
  CHECK(two.feasible);
  CHECK(two.bin_of == std::vector<int>{0, 1});
  // exact_min_bins: the sum of the lengths is formed, and overflows.
  CHECK(pk::exact_min_bins(std::vector<index_t>{two_62, two_62 - 2}, {.capacity = max_index - 1}) == 1);
  require_loom_error(
      [] {
        (void)pk::exact_min_bins(std::vector<index_t>{two_62, two_62, two_62}, {.capacity = max_index - 1});
      },
      loom::errc::invalid_argument,
      {"exact_min_bins: the sum of lengths = 4611686018427387904 + 4611686018427387904 overflows"});
}

TEST_CASE("packing::parallel degree near the index limit", "[packing][degree][overflow]") {
  // A sequence of 2^63 - 1 tokens on two ranks of 2^63 - 1 tokens each: its share per rank is
  // rounded up without overflow, and spreading it halves the load.
  const std::vector<index_t> l{max_index};
  const pk::degree_options o{.ranks = 2, .memory_tokens = max_index};
  for (const auto& plan : {pk::assign_parallel_degree(l, o), pk::exact_parallel_degree(l, o)}) {
    REQUIRE(plan.groups.size() == 1);
    CHECK(plan.groups[0].ranks == std::vector<int>{0, 1});
    CHECK(plan.rank_tokens == std::vector<index_t>{two_62, two_62});
  }
  // Memory for one half only: rank 1 can take the other.
  const pk::degree_options tight{.ranks = 2, .memory_tokens = two_62};
  CHECK(pk::assign_parallel_degree(l, tight).rank_tokens == std::vector<index_t>{two_62, two_62});
}
