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
