// loom::for_each_index, loom::reduce and loom::for_each_tile: one body, instantiated per backend by
// loom_add_backend_test. Functors are LOOM_HD so the same body compiles for cuda.

#include <loom/backend/parallel.hpp>
#include <loom/core/precision.hpp>

#include <support/backends.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <tuple>
#include <vector>

using loom::index_t;
using loom::test::backend_under_test;
using loom::test::buffer;
using loom::test::make_backend;

static_assert(loom::backend<backend_under_test>);
static_assert(!loom::backend<int>);

namespace {

struct count_visits {
  int* counts;
  LOOM_HD void operator()(index_t i) const { counts[i] += 1; }
};

template <class S, class A>
struct load_as {
  const S* x;
  LOOM_HD A operator()(index_t i) const { return static_cast<A>(x[i]); }
};

template <class A>
struct plus {
  LOOM_HD A operator()(A a, A b) const { return a + b; }
};

// Affine maps x -> a x + b over unsigned 64-bit integers (arithmetic mod 2^64): associative,
// not commutative, and exact, so any reordering of the combination would show.
struct affine {
  std::uint64_t a, b;
};
struct compose {
  LOOM_HD affine operator()(affine f, affine g) const { return {g.a * f.a, g.a * f.b + g.b}; }
};
struct make_affine {
  LOOM_HD affine operator()(index_t i) const {
    const auto u = static_cast<std::uint64_t>(i);
    return {2 * u + 3, u * u + 1};
  }
};

struct mark_tiles {
  int* counts;
  int* owner;
  index_t cols, tile_rows, tile_cols;
  LOOM_HD void operator()(const loom::tile2d& t) const {
    for (index_t r = t.row_begin; r < t.row_end; ++r)
      for (index_t c = t.col_begin; c < t.col_end; ++c) {
        counts[r * cols + c] += 1;
        // The tile coordinates must agree with the ranges.
        owner[r * cols + c] = (t.row_begin == t.tile_row * tile_rows && t.col_begin == t.tile_col * tile_cols) ? 1 : -1;
      }
  }
};

}  // namespace

TEST_CASE("backend::for_each_index visits every index exactly once", "[backend][for_each]" LOOM_BACKEND_TAG) {
  const index_t n = GENERATE(as<index_t>{}, 0, 1, 7, 131, 1021, 100003);
  buffer<int> counts(static_cast<std::size_t>(n));
  loom::for_each_index(make_backend(), n, count_visits{counts.data()});
  const auto h = counts.to_host();
  std::size_t wrong = 0;
  for (int c : h) wrong += c != 1;
  CHECK(wrong == 0);
}

using reduce_precisions = std::tuple<loom::fp64, loom::fp32, loom::bf16, loom::fp16>;

TEMPLATE_LIST_TEST_CASE("backend::reduce matches the fp64 oracle", "[backend][reduce]" LOOM_BACKEND_TAG,
                        reduce_precisions) {
  using S = typename TestType::storage_type;
  using A = typename TestType::accum_type;
  const index_t n = GENERATE(as<index_t>{}, 1, 2, 131, 4097, 1000003);
  const auto host = loom::test::uniform<S>(n, -1.0, 1.0, 11);
  double oracle = 0;
  for (const S& v : host) oracle += static_cast<double>(v);
  buffer<S> x(host);
  const A got = loom::reduce(make_backend(), n, A(0), plus<A>{}, load_as<S, A>{x.data()});
  // A sum of n terms of magnitude <= 1 carries an error up to ~ n u sum|x|: scale the tolerance.
  auto tol = loom::test::tolerance_for<loom::precision<A, A>>();
  tol.abs *= static_cast<double>(n) / 16 + 1;
  loom::test::require_close(std::vector<double>{static_cast<double>(got)}, std::vector<double>{oracle}, tol,
                            "sum of " + std::to_string(n));
}

TEST_CASE("backend::reduce of small integers is exact and bitwise equal to serial",
          "[backend][reduce]" LOOM_BACKEND_TAG) {
  const index_t n = GENERATE(as<index_t>{}, 1, 4095, 4096, 4097, 65537, 1048583);
  const auto host = loom::test::small_integers<float>(n, -8, 8, 12);
  double oracle = 0;
  for (float v : host) oracle += v;
  buffer<float> x(host);
  const float got = loom::reduce(make_backend(), n, 0.f, plus<float>{}, load_as<float, float>{x.data()});
  CHECK(static_cast<double>(got) == oracle);
  // Non-integers: the blocking fixes the combination order, so the bits match serial.
  const auto frac = loom::test::uniform<float>(n, 0.0, 1.0, 13);
  buffer<float> y(frac);
  const float par = loom::reduce(make_backend(), n, 0.5f, plus<float>{}, load_as<float, float>{y.data()});
  const float ser = loom::reduce(loom::serial{}, n, 0.5f, plus<float>{}, load_as<float, float>{frac.data()});
  CHECK(par == ser);
}

TEST_CASE("backend::reduce keeps the order of a non-commutative monoid", "[backend][reduce]" LOOM_BACKEND_TAG) {
  const index_t n = GENERATE(as<index_t>{}, 0, 1, 3, 5003, 300007);
  affine expect{1, 0};
  for (index_t i = 0; i < n; ++i) expect = compose{}(expect, make_affine{}(i));
  const affine got = loom::reduce(make_backend(), n, affine{1, 0}, compose{}, make_affine{});
  CHECK(got.a == expect.a);
  CHECK(got.b == expect.b);
}

namespace {
template <class B>
void check_grain(const B& b) {
  const double grain = static_cast<double>(loom::parallel_grain_bytes);
  const B small = loom::detail::for_work(b, 2.0 * grain - 1.0), large = loom::detail::for_work(b, 2.0 * grain);
  if constexpr (requires { b.threads; }) {
    CHECK(small.threads == 1);
    CHECK(large.threads == b.threads);
  }
  if constexpr (loom::backend_traits<B>::memory_space::host_accessible) {  // every index still once
    std::vector<int> seen(1000, 0);
    int* p = seen.data();
    loom::for_each_index(small, 1000, [p](index_t i) { ++p[i]; });
    for (int v : seen) REQUIRE(v == 1);
  }
}
}  // namespace

TEST_CASE("backend: a call under two grains of work runs on one thread, a larger one on the backend's threads",
          "[backend][grain]" LOOM_BACKEND_TAG) {
  check_grain(make_backend());
}

TEST_CASE("backend::for_each_tile covers a 2-D space exactly once, edge tiles clipped",
          "[backend][tile]" LOOM_BACKEND_TAG) {
  const auto [rows, cols] = GENERATE(std::pair<index_t, index_t>{1, 1}, std::pair<index_t, index_t>{7, 13},
                                     std::pair<index_t, index_t>{131, 97}, std::pair<index_t, index_t>{0, 5});
  const auto [tr, tc] = GENERATE(std::pair<index_t, index_t>{1, 1}, std::pair<index_t, index_t>{7, 5},
                                 std::pair<index_t, index_t>{64, 64}, std::pair<index_t, index_t>{200, 3});
  buffer<int> counts(static_cast<std::size_t>(rows * cols)), owner(static_cast<std::size_t>(rows * cols));
  loom::for_each_tile(make_backend(), rows, cols, {tr, tc}, mark_tiles{counts.data(), owner.data(), cols, tr, tc});
  const auto h = counts.to_host();
  const auto o = owner.to_host();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < h.size(); ++i) wrong += (h[i] != 1) + (o[i] != 1);
  CHECK(wrong == 0);
}

TEST_CASE("backend building blocks reject bad arguments", "[backend][errors]" LOOM_BACKEND_TAG) {
  const auto b = make_backend();
  auto is_invalid = [](const loom::error& e) { return e.code() == loom::errc::invalid_argument; };
  CHECK_THROWS_MATCHES(loom::for_each_index(b, -1, count_visits{nullptr}), loom::error,
                       Catch::Predicate<loom::error>(is_invalid));
  CHECK_THROWS_WITH(loom::reduce(b, -5, 0.f, plus<float>{}, load_as<float, float>{nullptr}),
                    Catch::Contains("n must be >= 0, got -5"));
  CHECK_THROWS_WITH(loom::for_each_tile(b, 4, 4, {0, 2}, mark_tiles{nullptr, nullptr, 4, 0, 2}),
                    Catch::Contains("tile sizes must be > 0"));
  CHECK_THROWS_WITH(loom::for_each_tile(b, -1, 4, {2, 2}, mark_tiles{nullptr, nullptr, 4, 2, 2}),
                    Catch::Contains("rows and cols must be >= 0"));
}

namespace {

// League rank l sums x[l seg, (l + 1) seg): each member its strided share into its scratch slot;
// after the barrier member 0 adds the slots in rank order. Also records the team size it saw
// (negated if the league size it saw is wrong).
struct team_segment_sum {
  const std::int64_t* x;
  std::int64_t* out;
  int* sizes;
  index_t seg, league;
  template <class M>
  LOOM_HD void operator()(const M& m) const {
    auto* slot = static_cast<std::int64_t*>(m.scratch());
    const int r = m.team_rank(), n = m.team_size();
    const index_t base = m.league_rank() * seg;
    std::int64_t s = 0;
    for (index_t i = r; i < seg; i += n) s += x[base + i];
    slot[r] = s;
    m.barrier();
    if (r == 0) {
      std::int64_t t = 0;
      for (int k = 0; k < n; ++k) t += slot[k];
      out[m.league_rank()] = t;
      sizes[m.league_rank()] = m.league_size() == league ? n : -n;
    }
  }
};

// Inclusive scan of each league rank's segment in the team's scratch (Hillis-Steele: log2(seg)
// steps, one barrier each, two buffers swapped by every member alike): a missing or leaky barrier
// shows as a wrong prefix.
struct team_segment_scan {
  const std::int64_t* x;
  std::int64_t* y;
  index_t seg;
  template <class M>
  LOOM_HD void operator()(const M& m) const {
    auto* a = static_cast<std::int64_t*>(m.scratch());
    auto* b = a + seg;
    const int r = m.team_rank(), n = m.team_size();
    const index_t base = m.league_rank() * seg;
    for (index_t i = r; i < seg; i += n) a[i] = x[base + i];
    m.barrier();
    for (index_t d = 1; d < seg; d *= 2) {
      for (index_t i = r; i < seg; i += n) b[i] = i >= d ? a[i] + a[i - d] : a[i];
      m.barrier();
      std::int64_t* t = a;
      a = b;
      b = t;
    }
    for (index_t i = r; i < seg; i += n) y[base + i] = a[i];
  }
};

}  // namespace

TEST_CASE("backend::for_each_team: every team, every member, a shared scratch and a barrier",
          "[backend][team]" LOOM_BACKEND_TAG) {
  const auto b = make_backend();
  const int max = loom::team_size_max(b), rec = loom::team_size_recommended(b);
  REQUIRE(max >= 1);
  REQUIRE(rec >= 1);
  REQUIRE(rec <= max);
  const index_t league = GENERATE(as<index_t>{}, 0, 1, 2, 37);
  const index_t seg = GENERATE(as<index_t>{}, 1, 53, 200);
  const auto host = loom::test::small_integers<double>(league * seg, -1000, 1000, 31);
  std::vector<std::int64_t> xs(host.size());
  for (std::size_t i = 0; i < host.size(); ++i) xs[i] = static_cast<std::int64_t>(host[i]) * 1000003;
  buffer<std::int64_t> x(xs);
  for (int size : {0, 1, 2, 3, 7, max}) {
    if (size > max) continue;
    const int runs = size == 0 ? rec : size;
    INFO("league " << league << ", segment " << seg << ", team_size " << size << " (runs " << runs << ")");
    buffer<std::int64_t> out(static_cast<std::size_t>(league)), y(static_cast<std::size_t>(league * seg));
    buffer<int> sizes(static_cast<std::size_t>(league));
    loom::for_each_team(b, {league, size, sizeof(std::int64_t) * static_cast<std::size_t>(runs)},
                        team_segment_sum{x.data(), out.data(), sizes.data(), seg, league});
    loom::for_each_team(b, {league, size, 2 * sizeof(std::int64_t) * static_cast<std::size_t>(seg)},
                        team_segment_scan{x.data(), y.data(), seg});
    const auto o = out.to_host();
    const auto s = sizes.to_host();
    const auto yh = y.to_host();
    std::size_t wrong = 0;
    for (index_t l = 0; l < league; ++l) {
      std::int64_t want = 0;
      for (index_t i = 0; i < seg; ++i) {
        want += xs[static_cast<std::size_t>(l * seg + i)];
        wrong += yh[static_cast<std::size_t>(l * seg + i)] != want;
      }
      wrong += o[static_cast<std::size_t>(l)] != want;
      wrong += s[static_cast<std::size_t>(l)] != runs;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("backend::for_each_team rejects a bad policy, naming the field", "[backend][team][reject]" LOOM_BACKEND_TAG) {
  const auto b = make_backend();
  const team_segment_sum none{nullptr, nullptr, nullptr, 0, 0};
  auto rejects = [&](loom::team_policy p, const char* what) {
    try {
      loom::for_each_team(b, p, none);
      FAIL("accepted " << what);
    } catch (const loom::error& e) {
      CHECK(e.code() == loom::errc::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains(what));
    }
  };
  rejects({-1, 1, 8}, "league_size must be >= 0");
  rejects({1, loom::team_size_max(b) + 1, 8}, "team_size must be in [0, ");
  rejects({1, -2, 8}, "team_size must be in [0, ");
  rejects({1, 1, std::size_t{1} << 40}, "scratch_bytes must be <= ");
}
