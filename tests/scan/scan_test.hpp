// Monoid scans and linear recurrences: one body, instantiated per backend by
// loom_add_backend_test. Every result is compared with an fp64 serial loop (tests/scan/oracle.hpp)
// and, for determinism, bit for bit with the serial backend run on the same inputs.

#include <loom/scan/recurrence.hpp>
#include <loom/scan/scan.hpp>

#include <support/allocations.hpp>
#include <support/backends.hpp>
#include <support/convert.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "oracle.hpp"

using loom::index_t;
using loom::test::backend_under_test;
using loom::test::buffer;
using loom::test::make_backend;
using loom::test::require_loom_error;
using loom::test::workspace;
namespace ls = loom::scan;
namespace lt = loom::test;

namespace {

using loom::test::space;
using loom::test::view_of;

// Offsets as loom::segments, int64 (the buffer's own) or int32 (a narrowed copy kept in `narrow`).
template <class Off>
loom::segments<space> docs_of(const Off& off, std::size_t count) {
  if (count == 0) return {};
  return loom::segments<space>(
      view_of<const std::remove_const_t<typename std::remove_pointer_t<decltype(off.data())>>, 1>(
          off, {static_cast<index_t>(count)}));
}

std::vector<std::int32_t> narrowed(const std::vector<index_t>& o) {
  return std::vector<std::int32_t>(o.begin(), o.end());
}

template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), sizeof(T) * x.size()) == 0);
}

const index_t lengths[] = {0, 1, 2, 63, 64, 65, 1021, 16323, 33753};

// Oracle of a monoid scan on the host: inclusive/exclusive, forward/reverse, segmented.
template <class M>
std::vector<typename M::value_type> scan_oracle(const M& m, const std::vector<typename M::value_type>& x,
                                                std::vector<index_t> offsets, bool exclusive, bool reverse,
                                                typename M::value_type init) {
  const auto n = static_cast<index_t>(x.size());
  if (offsets.empty()) offsets = {0, n};
  std::vector<typename M::value_type> out(x.size());
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    auto acc = exclusive ? init : m.identity();
    if (!reverse) {
      for (index_t i = offsets[s]; i < offsets[s + 1]; ++i) {
        if (exclusive) out[i] = acc;
        acc = m.combine(acc, x[i]);
        if (!exclusive) out[i] = acc;
      }
    } else {
      for (index_t i = offsets[s + 1] - 1; i >= offsets[s]; --i) {
        if (exclusive) out[i] = acc;
        acc = m.combine(x[i], acc);
        if (!exclusive) out[i] = acc;
      }
    }
  }
  return out;
}

// Runs the loom scan of x with the given variant on backend b (host vectors in and out).
// reproducible = false: CUB's device scan on cuda (host backends ignore it).
template <class B, class M>
std::vector<typename M::value_type> run_scan(const B& b, const M& m, const std::vector<typename M::value_type>& x,
                                             const std::vector<index_t>& offsets, bool exclusive, bool reverse,
                                             typename M::value_type init, index_t block, bool reproducible = true,
                                             bool int32_offsets = false) {
  using T = typename M::value_type;
  const auto n = static_cast<index_t>(x.size());
  buffer<T> in(x), out(x.size());
  buffer<index_t> off(offsets);
  buffer<std::int32_t> off32(narrowed(offsets));
  ls::options opt{reverse ? ls::direction::reverse : ls::direction::forward, block};
  opt.reproducible = reproducible;
  auto vi = view_of<const T, 1>(in, {n});
  auto vo = view_of<T, 1>(out, {n});
  const auto docs = int32_offsets ? docs_of(off32, offsets.size()) : docs_of(off, offsets.size());
  if (exclusive)
    ls::exclusive_scan(b, m, vi, vo, init, docs, opt);
  else
    ls::inclusive_scan(b, m, vi, vo, docs, opt);
  return out.to_host();
}

// Segment offsets over n elements with empty segments, single-element segments and long ones.
std::vector<index_t> ragged_offsets(index_t n, std::uint64_t stream) {
  std::vector<index_t> o{0};
  if (n > 0) o.push_back(0);  // an empty first segment
  auto g = lt::rng(stream);
  while (o.back() < n) {
    const index_t step = static_cast<index_t>(g() % 5 == 0 ? 1 : 1 + g() % (n / 3 + 2));
    o.push_back(o.back() + step < n ? o.back() + step : n);
    if (g() % 7 == 0) o.push_back(o.back());  // empty segment in the middle
  }
  o.push_back(n);  // an empty last segment
  return o;
}

}  // namespace

TEST_CASE("scan: non-commutative monoid, every variant, exact" LOOM_BACKEND_TAG, "[scan]") {
  const auto b = make_backend();
  const lt::mat2_product m;
  for (index_t n : lengths) {
    auto g = lt::rng(100 + static_cast<std::uint64_t>(n));
    std::vector<lt::mat2> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = {g() % 5, g() % 3, g() % 3, g() % 5};
    const lt::mat2 init{2, 1, 1, 1};
    for (int variant = 0; variant < 8; ++variant) {
      const bool exclusive = variant & 1, reverse = variant & 2, segmented = variant & 4;
      const auto offsets = segmented ? ragged_offsets(n, 7 + n) : std::vector<index_t>{};
      const auto want = scan_oracle(m, x, offsets, exclusive, reverse, init);
      for (index_t block : {index_t{0}, index_t{7}, index_t{64}}) {
        INFO("n = " << n << ", exclusive " << exclusive << ", reverse " << reverse << ", segmented " << segmented
                    << ", block " << block);
        REQUIRE(run_scan(b, m, x, offsets, exclusive, reverse, init, block) == want);
        if (segmented) REQUIRE(run_scan(b, m, x, offsets, exclusive, reverse, init, block, true, true) == want);
      }
      INFO("n = " << n << ", exclusive " << exclusive << ", reverse " << reverse << ", segmented " << segmented
                  << ", not reproducible");
      REQUIRE(run_scan(b, m, x, offsets, exclusive, reverse, init, 0, false) == want);
    }
  }
}

// Integer plus, minimum and maximum combine exactly in any order: cuda runs them through CUB's
// scan even when reproducible, so every path must equal the oracle.
TEST_CASE("scan: integer plus, minimum and maximum, every variant, exact" LOOM_BACKEND_TAG, "[scan]") {
  const auto b = make_backend();
  for (index_t n : lengths) {
    auto g = lt::rng(400 + static_cast<std::uint64_t>(n));
    std::vector<std::int64_t> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = static_cast<std::int64_t>(g() % 2001) - 1000;
    std::vector<int> xi(x.begin(), x.end());
    for (int variant = 0; variant < 8; ++variant) {
      const bool exclusive = variant & 1, reverse = variant & 2, segmented = variant & 4;
      const auto offsets = segmented ? ragged_offsets(n, 11 + n) : std::vector<index_t>{};
      INFO("n = " << n << ", exclusive " << exclusive << ", reverse " << reverse << ", segmented " << segmented);
      REQUIRE(run_scan(b, ls::plus<std::int64_t>{}, x, offsets, exclusive, reverse, std::int64_t{5}, 0) ==
              scan_oracle(ls::plus<std::int64_t>{}, x, offsets, exclusive, reverse, std::int64_t{5}));
      REQUIRE(run_scan(b, ls::maximum<int>{}, xi, offsets, exclusive, reverse, -7, 0) ==
              scan_oracle(ls::maximum<int>{}, xi, offsets, exclusive, reverse, -7));
      REQUIRE(run_scan(b, ls::minimum<int>{}, xi, offsets, exclusive, reverse, 3, 0) ==
              scan_oracle(ls::minimum<int>{}, xi, offsets, exclusive, reverse, 3));
    }
  }
}

// Float minimum and maximum keep loom's combine (b < a ? b : a and a < b ? b : a, in sequence
// order: of equal values the first) on every path, CUB's included (reproducible = false): on
// signed zeros, where the order decides the bits, an operator that looks at its operands in
// another order gives other bits. (NaN is left out: with it neither combine is associative.)
TEST_CASE("scan: float minimum and maximum over signed zeros, every variant, loom's bits" LOOM_BACKEND_TAG, "[scan]") {
  const auto b = make_backend();
  // Short inputs mix in ±1; long ones (many of CUB's tiles) hold zeros only, so that every
  // combine is a tie.
  for (index_t n : {index_t{1}, index_t{2}, index_t{7}, index_t{61}, index_t{1021}, index_t{16323}}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    auto g = lt::rng(900 + static_cast<std::uint64_t>(n));
    for (auto& e : x) e = n < 100 && g() % 4 == 0 ? (g() % 2 ? 1.0f : -1.0f) : (g() % 2 ? 0.0f : -0.0f);
    for (int variant = 0; variant < 16; ++variant) {
      const bool exclusive = variant & 1, reverse = variant & 2, segmented = variant & 4, reproducible = variant & 8;
      const auto offsets = segmented ? ragged_offsets(n, 31 + n) : std::vector<index_t>{};
      INFO("n = " << n << ", exclusive " << exclusive << ", reverse " << reverse << ", segmented " << segmented
                  << ", reproducible " << reproducible);
      REQUIRE(same_bits(run_scan(b, ls::maximum<float>{}, x, offsets, exclusive, reverse, -0.0f, 0, reproducible),
                        scan_oracle(ls::maximum<float>{}, x, offsets, exclusive, reverse, -0.0f)));
      REQUIRE(same_bits(run_scan(b, ls::minimum<float>{}, x, offsets, exclusive, reverse, 0.0f, 0, reproducible),
                        scan_oracle(ls::minimum<float>{}, x, offsets, exclusive, reverse, 0.0f)));
    }
  }
}

#if defined(__CUDACC__)
// The operators CUB is given (detail/monoid_cuda.cuh): its own where they give loom's bits in
// either operand order, loom's combine otherwise.
namespace cub_ops {
using loom::scan::detail::combine_op;
template <bool Swap, class M>
using cub_op_t = decltype(loom::scan::detail::cub_operator<Swap>(M{}));
static_assert(std::is_same_v<cub_op_t<true, ls::plus<float>>, ::cuda::std::plus<float>>);
static_assert(std::is_same_v<cub_op_t<false, ls::plus<std::int64_t>>, ::cuda::std::plus<std::int64_t>>);
static_assert(std::is_same_v<cub_op_t<true, ls::maximum<int>>, ::cuda::maximum<int>>);
static_assert(std::is_same_v<cub_op_t<false, ls::minimum<int>>, ::cuda::minimum<int>>);
static_assert(std::is_same_v<cub_op_t<false, ls::maximum<float>>, combine_op<ls::maximum<float>, false>>);
static_assert(std::is_same_v<cub_op_t<true, ls::minimum<double>>, combine_op<ls::minimum<double>, true>>);
static_assert(std::is_same_v<cub_op_t<false, ls::multiplies<float>>, combine_op<ls::multiplies<float>, false>>);
}  // namespace cub_ops
#endif

TEST_CASE("scan: plus in fp32 against the fp64 oracle, same bits as serial" LOOM_BACKEND_TAG, "[scan]") {
  const auto b = make_backend();
  for (index_t n : lengths) {
    const auto xf = lt::uniform<float>(n, -1.0, 1.0, 200 + static_cast<std::uint64_t>(n));
    std::vector<double> xd(xf.begin(), xf.end());
    for (bool reverse : {false, true}) {
      const auto want = scan_oracle(ls::plus<double>{}, xd, {}, false, reverse, 0.0);
      const auto got = run_scan(b, ls::plus<float>{}, xf, {}, false, reverse, 0.0f, 0);
      // Summing n terms of size <= 1 in float: error grows like n * 2^-24.
      lt::require_close(got, want, {0.0, 1e-7 * static_cast<double>(n + 1)}, "plus<float>");
      const auto fast = run_scan(b, ls::plus<float>{}, xf, {}, false, reverse, 0.0f, 0, false);
      lt::require_close(fast, want, {0.0, 1e-7 * static_cast<double>(n + 1)}, "plus<float>, not reproducible");
      if constexpr (space::host_accessible) {  // device results are compared on a device run
        const auto serial = run_scan(loom::serial{}, ls::plus<float>{}, xf, {}, false, reverse, 0.0f, 0);
        REQUIRE(same_bits(got, serial));
      }
    }
  }
}

// plus<float> / plus<double> on contiguous data take vector sums on x86 hosts (groups of 4
// vectors, single vectors, a scalar tail; streamed stores for long runs): lengths around every
// boundary of that blocking and of the 16 KiB chunks, inclusive and exclusive, plain and
// segmented, several block lengths. Small integers keep every partial sum exact in any order, so
// the result must equal the oracle bit for bit.
template <class T>
void plus_every_tail() {
  const auto b = make_backend();
  const index_t sizes[] = {15,   16,   17,   63,   64,   65,   79,   80,   81,   127,
                           1021, 2047, 2048, 2049, 4095, 4096, 4097, 4181, 16323};
  for (index_t n : sizes) {
    const auto x = lt::small_integers<T>(n, -3, 3, 300 + static_cast<std::uint64_t>(n));
    for (int variant = 0; variant < 4; ++variant) {
      const bool exclusive = variant & 1, segmented = variant & 2;
      const auto offsets = segmented ? ragged_offsets(n, 11 + n) : std::vector<index_t>{};
      const auto want = scan_oracle(ls::plus<T>{}, x, offsets, exclusive, false, T(5));
      for (index_t block : {index_t{0}, index_t{7}, index_t{1000}, index_t{5000}}) {
        INFO("n = " << n << ", exclusive " << exclusive << ", segmented " << segmented << ", block " << block);
        REQUIRE(run_scan(b, ls::plus<T>{}, x, offsets, exclusive, false, T(5), block) == want);
      }
    }
  }
}

TEST_CASE("scan: plus in fp32 and fp64, every vector and chunk boundary, exact" LOOM_BACKEND_TAG, "[scan]") {
  plus_every_tail<float>();
  plus_every_tail<double>();
}

TEST_CASE("scan: strided views, forward and reverse, exact, the gaps are not written" LOOM_BACKEND_TAG, "[scan]") {
  const auto b = make_backend();
  for (index_t n : {index_t{1}, index_t{65}, index_t{1021}, index_t{16323}}) {
    const auto x = lt::small_integers<float>(n, -3, 3, 500 + static_cast<std::uint64_t>(n));
    std::vector<float> spread(static_cast<std::size_t>(2 * n), 99.0f);
    for (index_t i = 0; i < n; ++i) spread[static_cast<std::size_t>(2 * i)] = x[static_cast<std::size_t>(i)];
    for (bool reverse : {false, true})
      for (bool reproducible : {true, false}) {
        INFO("n = " << n << ", reverse " << reverse << ", reproducible " << reproducible);
        buffer<float> in(spread), out(std::vector<float>(static_cast<std::size_t>(3 * n), -5.0f));
        ls::options opt{reverse ? ls::direction::reverse : ls::direction::forward};
        opt.reproducible = reproducible;
        ls::inclusive_scan(b, ls::plus<float>{}, loom::tensor_view<const float, 1, space>(in.data(), {n}, {2}),
                           loom::tensor_view<float, 1, space>(out.data(), {n}, {3}), opt);
        const auto want = scan_oracle(ls::plus<float>{}, x, {}, false, reverse, 0.0f);
        const auto got = out.to_host();
        for (std::size_t i = 0; i < got.size(); ++i) {
          const float expect = i % 3 == 0 ? want[i / 3] : -5.0f;
          if (got[i] != expect) FAIL("element " << i << ": " << got[i] << " != " << expect);
        }
      }
  }
}

TEST_CASE("scan: rejections" LOOM_BACKEND_TAG, "[scan][errors]") {
  const auto b = make_backend();
  buffer<float> in(std::vector<float>(10, 1.0f)), out(std::vector<float>(9));
  const auto vi = view_of<const float, 1>(in, {10});
  CHECK_THROWS_WITH(ls::inclusive_scan(b, ls::plus<float>{}, vi, view_of<float, 1>(out, {9})),
                    Catch::Contains("shape_mismatch") && Catch::Contains("out must be [10] (the plan's elements)"));
  buffer<float> out10(std::vector<float>(10));
  const auto vo = view_of<float, 1>(out10, {10});
  if constexpr (space::host_accessible) {
    auto bad = [&](std::vector<index_t> o, const char* what) {
      buffer<index_t> off(o);
      CHECK_THROWS_WITH(
          ls::inclusive_scan(b, ls::plus<float>{}, vi, vo,
                             loom::segments<space>(view_of<const index_t, 1>(off, {static_cast<index_t>(o.size())}))),
          Catch::Contains("invalid_argument") && Catch::Contains(what));
      buffer<std::int32_t> o32(narrowed(o));
      CHECK_THROWS_WITH(
          ls::make_plan(b, ls::plus<float>{}, 10,
                        loom::segments<space>(view_of<const std::int32_t, 1>(o32, {static_cast<index_t>(o.size())}))),
          Catch::Contains("scan::make_plan") && Catch::Contains(what));
    };
    bad({1, 10}, "docs[0] must be 0");
    bad({0, 6, 4, 10}, "must be non-decreasing");
    bad({0, 4, 12}, "must equal the token count 10");
    bad({0, 4, 9}, "must equal the token count 10");
    bad({}, "at least one offset");
  }
  // A workspace below plan.workspace_bytes(), or not on loom::workspace_alignment, is rejected on
  // either path (engine or, on cuda, CUB's temporary storage).
  for (bool reproducible : {true, false}) {
    ls::options opt;
    opt.reproducible = reproducible;
    const auto plan = ls::make_plan(b, ls::plus<float>{}, 10, {}, opt);
    REQUIRE(plan.workspace_bytes() > 0);
    REQUIRE(plan.workspace_bytes() % loom::workspace_alignment == 0);
    const workspace ws(plan.workspace_bytes());
    lt::require_loom_error([&] { ls::inclusive_scan(b, plan, vi, vo, ws.span().first(plan.workspace_bytes() - 1)); },
                           loom::errc::invalid_argument,
                           {"inclusive_scan: workspace must hold at least", "plan.workspace_bytes()"});
    const workspace ws2(plan.workspace_bytes() + 8);
    lt::require_loom_error([&] { ls::exclusive_scan(b, plan, vi, vo, 0.0f, ws2.span(8)); },
                           loom::errc::invalid_argument,
                           {"exclusive_scan: workspace must start on a 64-byte boundary"});
    // A view that does not match the plan's length.
    lt::require_loom_error([&] { ls::inclusive_scan(b, plan, vi.slice(0, 9), vo, ws.span()); },
                           loom::errc::shape_mismatch, {"inclusive_scan: in must be [10] (the plan's elements)"});
  }
}

// ---------------------------------------------------------------------------------------------
// Linear recurrences

namespace {

// Random transitions whose full matrices have norm below 1 (the recurrence is stable), so errors
// do not grow with T and one tolerance fits every length.
std::vector<double> random_transitions(lt::shape s, index_t n, index_t d, std::uint64_t stream) {
  const index_t as = lt::a_size(s, d);
  const double width = s == lt::shape::dense ? 0.9 / static_cast<double>(d)
                       : s == lt::shape::scalar || s == lt::shape::diagonal
                           ? 0.95
                           : 0.9 / static_cast<double>(lt::block_of(s));
  return lt::uniform<double>(n * as, -width, width, stream);
}

struct rec_case {
  lt::shape s;
  index_t n, d;
  bool segmented, with_init;
};

// Runs loom's recurrence (forward or adjoint) on backend b in storage T; returns rows and finals.
template <class St, class T, class B>
std::pair<std::vector<double>, std::vector<double>> run_recurrence(
    const B& b, const rec_case& c, const std::vector<double>& a, const std::vector<double>& bv,
    const std::vector<index_t>& offsets, const std::vector<double>& init, bool adjoint, index_t block,
    bool int32_offsets = false, bool reproducible = true) {
  const index_t n = c.n, d = c.d;
  const index_t segs = offsets.empty() ? 1 : static_cast<index_t>(offsets.size()) - 1;
  buffer<T> ab(loom::test::cast<T>(a)), bb(loom::test::cast<T>(bv)), hb(static_cast<std::size_t>(n * d)),
      ib(loom::test::cast<T>(init)), fb(std::vector<T>(static_cast<std::size_t>(segs * d), T(-7.0f)));
  buffer<index_t> ob(offsets);
  auto av = [&] {
    if constexpr (St::a_rank == 1)
      return view_of<const T, 1>(ab, {n});
    else if constexpr (St::a_rank == 2)
      return view_of<const T, 2>(ab, {n, d});
    else if constexpr (St::a_rank == 3)
      return view_of<const T, 3>(ab, {n, d, d});
    else
      return view_of<const T, 4>(ab, {n, d / St::block, St::block, St::block});
  }();
  buffer<std::int32_t> ob32(narrowed(offsets));
  const auto docs = int32_offsets ? docs_of(ob32, offsets.size()) : docs_of(ob, offsets.size());
  const auto initv = init.empty() ? loom::tensor_view<const T, 2, space>{} : view_of<const T, 2>(ib, {segs, d});
  const auto finv = view_of<T, 2>(fb, {segs, d});
  ls::options opt;
  opt.block = block;
  opt.reproducible = reproducible;
  if (!adjoint)
    ls::linear_recurrence(b, St{}, av, view_of<const T, 2>(bb, {n, d}), view_of<T, 2>(hb, {n, d}), docs,
                          ls::states<T, space>{initv, finv}, opt);
  else
    ls::linear_recurrence_adjoint(b, St{}, av, view_of<const T, 2>(bb, {n, d}), view_of<T, 2>(hb, {n, d}), docs,
                                  ls::adjoint_states<T, space>{initv, finv}, opt);
  return {loom::test::widen(hb.to_host()), loom::test::widen(fb.to_host())};
}

template <class St>
void check_structure(lt::shape s, std::initializer_list<rec_case> cases) {
  const auto b = make_backend();
  for (const rec_case& c : cases) {
    const auto seed = static_cast<std::uint64_t>(c.n * 131 + c.d * 7 + static_cast<int>(s));
    const auto a = random_transitions(s, c.n, c.d, seed);
    const auto bv = lt::uniform<double>(c.n * c.d, -1.0, 1.0, seed + 1);
    const auto offsets = c.segmented ? ragged_offsets(c.n, seed + 2) : std::vector<index_t>{};
    const index_t segs = offsets.empty() ? 1 : static_cast<index_t>(offsets.size()) - 1;
    const auto init = c.with_init ? lt::uniform<double>(segs * c.d, -1.0, 1.0, seed + 3) : std::vector<double>{};
    for (bool adjoint : {false, true}) {
      INFO(St::name() << " n = " << c.n << " d = " << c.d << " segmented " << c.segmented << " init " << c.with_init
                      << " adjoint " << adjoint);
      const auto want = adjoint ? lt::adjoint_oracle(s, c.n, c.d, a, bv, offsets, init)
                                : lt::forward_oracle(s, c.n, c.d, a, bv, offsets, init);
      for (index_t block : {index_t{0}, index_t{13}}) {
        const auto got = run_recurrence<St, double>(b, c, a, bv, offsets, init, adjoint, block);
        lt::require_close(got.first, want.h, lt::tolerance_for<loom::fp64>(), "rows fp64");
        lt::require_close(got.second, want.finals, lt::tolerance_for<loom::fp64>(), "finals fp64");
      }
      // reproducible = false: scalar, diagonal and block-diagonal take the vendor's scan by key on
      // cuda (host backends and the dense structure ignore it)
      const auto fast = run_recurrence<St, double>(b, c, a, bv, offsets, init, adjoint, 0, false, false);
      lt::require_close(fast.first, want.h, lt::tolerance_for<loom::fp64>(), "rows fp64, not reproducible");
      lt::require_close(fast.second, want.finals, lt::tolerance_for<loom::fp64>(), "finals fp64, not reproducible");
      const auto f32 = run_recurrence<St, float>(b, c, a, bv, offsets, init, adjoint, 0);
      lt::require_close(f32.first, want.h, lt::tolerance_for<loom::fp32>(), "rows fp32");
      if constexpr (space::host_accessible) {
        const auto f32_serial = run_recurrence<St, float>(loom::serial{}, c, a, bv, offsets, init, adjoint, 0);
        REQUIRE(same_bits(f32.first, f32_serial.first));
        REQUIRE(same_bits(f32.second, f32_serial.second));
      }
      const auto h16 = run_recurrence<St, loom::bfloat16>(b, c, a, bv, offsets, init, adjoint, 0);
      lt::require_close(h16.first, want.h, lt::tolerance_for<loom::bf16>(), "rows bf16");
    }
  }
}

}  // namespace

TEST_CASE("recurrence: scalar and diagonal against the fp64 oracle" LOOM_BACKEND_TAG, "[scan][recurrence]") {
  check_structure<ls::scalar>(lt::shape::scalar, {{lt::shape::scalar, 1, 3, false, true},
                                                  {lt::shape::scalar, 65, 3, true, true},
                                                  {lt::shape::scalar, 16323, 2, true, false}});
  check_structure<ls::diagonal>(lt::shape::diagonal, {{lt::shape::diagonal, 0, 4, false, false},
                                                      {lt::shape::diagonal, 2, 4, false, true},
                                                      {lt::shape::diagonal, 63, 5, true, true},
                                                      {lt::shape::diagonal, 64, 1, false, true},
                                                      {lt::shape::diagonal, 33753, 3, true, true}});
}

namespace {
// Serial runs on host memory: the references of bitwise comparisons on every backend.
std::vector<float> serial_plus(const std::vector<float>& x, const std::vector<index_t>& off, bool reverse) {
  const auto n = static_cast<index_t>(x.size());
  std::vector<float> out(x.size());
  ls::inclusive_scan(
      loom::serial{}, ls::plus<float>{}, loom::tensor_view<const float, 1>(x.data(), {n}),
      loom::tensor_view<float, 1>(out.data(), {n}),
      loom::segments<>(loom::tensor_view<const index_t, 1>(off.data(), {static_cast<index_t>(off.size())})),
      ls::options{reverse ? ls::direction::reverse : ls::direction::forward, 0});
  return out;
}

// A plus<float> scan of n elements on b gets a worker per thread of b (backends whose thread count
// is a field).
template <class B>
void require_a_worker_per_thread(const B& b, index_t n) {
  if constexpr (requires { b.threads; })
    REQUIRE(ls::detail::tile_of(b, ls::detail::make_blocking(
                                       n, 0, ls::detail::monoid_bytes_per_element<ls::plus<float>>())) == b.threads);
}

std::vector<double> serial_diagonal(const rec_case& c, const std::vector<double>& a, const std::vector<double>& bv,
                                    const std::vector<index_t>& off, const std::vector<double>& init) {
  const auto af = loom::test::cast<float>(a), bf = loom::test::cast<float>(bv), inf = loom::test::cast<float>(init);
  const index_t segs = static_cast<index_t>(off.size()) - 1;
  std::vector<float> h(static_cast<std::size_t>(c.n * c.d)), fin(static_cast<std::size_t>(segs * c.d));
  ls::linear_recurrence(
      loom::serial{}, ls::diagonal{}, loom::tensor_view<const float, 2>(af.data(), {c.n, c.d}),
      loom::tensor_view<const float, 2>(bf.data(), {c.n, c.d}), loom::tensor_view<float, 2>(h.data(), {c.n, c.d}),
      loom::segments<>(loom::tensor_view<const index_t, 1>(off.data(), {static_cast<index_t>(off.size())})),
      ls::states<float, loom::host_memory>{loom::tensor_view<const float, 2>(inf.data(), {segs, c.d}),
                                           loom::tensor_view<float, 2>(fin.data(), {segs, c.d})},
      ls::options{});
  return loom::test::widen(h);
}
}  // namespace

// Host calls fork one worker per MiB of data at most (short scans run on the calling thread): these
// sequences are long enough for several workers, so the chained blocks run concurrently.
TEST_CASE(
    "scan and recurrence: sequences of several MiB take several workers, exact and the same bits as "
    "serial" LOOM_BACKEND_TAG,
    "[scan][recurrence]") {
  const auto b = make_backend();
  const index_t n = 1000003;          // 8 MB of plus<float> traffic
  require_a_worker_per_thread(b, n);  // the premise of the case
  const auto x = lt::small_integers<float>(n, -3, 3, 5150);
  const auto offsets = ragged_offsets(n, 5151);
  for (bool reverse : {false, true})
    for (bool segmented : {false, true}) {
      INFO("reverse " << reverse << ", segmented " << segmented);
      const auto off = segmented ? offsets : std::vector<index_t>{};
      // every partial sum is an integer below 2^24: exact in any order
      REQUIRE(run_scan(b, ls::plus<float>{}, x, off, false, reverse, 0.0f, 0) ==
              scan_oracle(ls::plus<float>{}, x, off, false, reverse, 0.0f));
    }
  const rec_case c{lt::shape::diagonal, 100003, 4, true, true};  // 48 bytes per position: 4.8 MB
  const auto a = random_transitions(c.s, c.n, c.d, 5152);
  const auto bv = lt::uniform<double>(c.n * c.d, -1.0, 1.0, 5153);
  const auto roff = ragged_offsets(c.n, 5154);
  const auto init = lt::uniform<double>((static_cast<index_t>(roff.size()) - 1) * c.d, -1.0, 1.0, 5155);
  for (bool adjoint : {false, true}) {
    INFO("adjoint " << adjoint);
    const auto want = adjoint ? lt::adjoint_oracle(c.s, c.n, c.d, a, bv, roff, init)
                              : lt::forward_oracle(c.s, c.n, c.d, a, bv, roff, init);
    const auto got = run_recurrence<ls::diagonal, float>(b, c, a, bv, roff, init, adjoint, 0);
    lt::require_close(got.first, want.h, lt::tolerance_for<loom::fp32>(), "rows fp32");
    lt::require_close(got.second, want.finals, lt::tolerance_for<loom::fp32>(), "finals fp32");
    // host workers or device teams: the same sub-blocks in the same order as serial's
    if (!adjoint) REQUIRE(same_bits(got.first, serial_diagonal(c, a, bv, roff, init)));
  }
  const auto xf = lt::uniform<float>(n, -1.0, 1.0, 5156);
  for (bool reverse : {false, true}) {
    INFO("fp32 data, reverse " << reverse);
    REQUIRE(same_bits(run_scan(b, ls::plus<float>{}, xf, offsets, false, reverse, 0.0f, 0),
                      serial_plus(xf, offsets, reverse)));
  }
}

TEST_CASE("recurrence: block-diagonal 2, 3, 4 and dense against the fp64 oracle" LOOM_BACKEND_TAG,
          "[scan][recurrence]") {
  check_structure<ls::block_diagonal<2>>(
      lt::shape::block2, {{lt::shape::block2, 65, 4, true, true}, {lt::shape::block2, 4097, 2, false, true}});
  check_structure<ls::block_diagonal<3>>(lt::shape::block3, {{lt::shape::block3, 1021, 6, true, true}});
  check_structure<ls::block_diagonal<4>>(lt::shape::block4, {{lt::shape::block4, 63, 8, true, false}});
  check_structure<ls::dense>(lt::shape::dense,
                             {{lt::shape::dense, 1, 5, false, true}, {lt::shape::dense, 1021, 5, true, true}});
}

TEST_CASE("recurrence: exactness harness, ±1 transitions and integer payloads give exact bits" LOOM_BACKEND_TAG,
          "[scan][recurrence][exact]") {
  const auto b = make_backend();
  for (index_t n : {index_t{2}, index_t{65}, index_t{4097}, index_t{16323}}) {
    const index_t d = 4;
    // diagonal entries in {-1, +1}; b in {-1, 0, 1}: every partial sum is a small integer.
    auto g = lt::rng(300 + static_cast<std::uint64_t>(n));
    std::vector<double> a(static_cast<std::size_t>(n * d)), bv(static_cast<std::size_t>(n * d));
    for (auto& x : a) x = g() % 2 ? 1.0 : -1.0;
    for (auto& x : bv) x = static_cast<double>(static_cast<int>(g() % 3) - 1);
    const auto offsets = ragged_offsets(n, 301);
    const auto want = lt::forward_oracle(lt::shape::diagonal, n, d, a, bv, offsets, {});
    // 2 x 2 blocks that swap and flip signs: [[0, ±1], [±1, 0]] or diag(±1, ±1).
    std::vector<double> a2(static_cast<std::size_t>(n * d * 2), 0.0);
    for (index_t t = 0; t < n; ++t)
      for (index_t blk = 0; blk < d / 2; ++blk) {
        double* m = a2.data() + (t * d + blk * 2) * 2;
        const double s1 = g() % 2 ? 1.0 : -1.0, s2 = g() % 2 ? 1.0 : -1.0;
        if (g() % 2) {
          m[1] = s1;
          m[2] = s2;
        } else {
          m[0] = s1;
          m[3] = s2;
        }
      }
    const auto want2 = lt::forward_oracle(lt::shape::block2, n, d, a2, bv, offsets, {});
    const auto wantg = lt::adjoint_oracle(lt::shape::block2, n, d, a2, bv, offsets, {});
    for (index_t block : {index_t{0}, index_t{1}, index_t{64}, index_t{1000}}) {
      const rec_case c{lt::shape::diagonal, n, d, true, false};
      REQUIRE(run_recurrence<ls::diagonal, float>(b, c, a, bv, offsets, {}, false, block).first == want.h);
      REQUIRE(run_recurrence<ls::block_diagonal<2>, float>(b, c, a2, bv, offsets, {}, false, block).first == want2.h);
      const auto adj = run_recurrence<ls::block_diagonal<2>, float>(b, c, a2, bv, offsets, {}, true, block);
      REQUIRE(adj.first == wantg.h);
      REQUIRE(adj.second == wantg.finals);
    }
  }
}

TEST_CASE("recurrence: rotations keep the norm, closed-form geometric sums" LOOM_BACKEND_TAG, "[scan][recurrence]") {
  const auto b = make_backend();
  const index_t n = 33753, d = 2;
  // h_t = R(θ_t) h_{t-1}, h_{-1} = e1: h_t = R(θ_0 + ... + θ_t) e1.
  const auto theta = lt::uniform<double>(n, 0.0, 6.283185307179586, 400);
  std::vector<double> a(static_cast<std::size_t>(n * 4)), bv(static_cast<std::size_t>(n * d), 0.0);
  for (index_t t = 0; t < n; ++t) {
    a[t * 4 + 0] = std::cos(theta[t]);
    a[t * 4 + 1] = -std::sin(theta[t]);
    a[t * 4 + 2] = std::sin(theta[t]);
    a[t * 4 + 3] = std::cos(theta[t]);
  }
  const rec_case c{lt::shape::block2, n, d, false, true};
  const auto h = run_recurrence<ls::block_diagonal<2>, double>(b, c, a, bv, {}, {1.0, 0.0}, false, 0).first;
  double angle = 0, worst = 0;
  for (index_t t = 0; t < n; ++t) {
    angle += theta[t];
    worst = std::max(worst, std::abs(h[t * 2] - std::cos(angle)) + std::abs(h[t * 2 + 1] - std::sin(angle)));
    REQUIRE(std::abs(std::hypot(h[t * 2], h[t * 2 + 1]) - 1.0) < 1e-10);
  }
  CHECK(worst < 1e-9);
  // h_t = a h_{t-1} + 1 from 0: h_t = (1 - a^{t+1}) / (1 - a).
  for (double decay : {0.5, 0.999}) {
    const index_t m = 131071;
    const std::vector<double> av(static_cast<std::size_t>(m), decay), ones(static_cast<std::size_t>(m), 1.0);
    const rec_case cs{lt::shape::scalar, m, 1, false, false};
    const auto h64 = run_recurrence<ls::scalar, double>(b, cs, av, ones, {}, {}, false, 0).first;
    const auto h32 = run_recurrence<ls::scalar, float>(b, cs, av, ones, {}, {}, false, 0).first;
    for (index_t t = 0; t < m; t += 97) {
      const double exact = (1.0 - std::pow(decay, static_cast<double>(t + 1))) / (1.0 - decay);
      REQUIRE(std::abs(h64[t] - exact) <= 1e-12 * exact);
      REQUIRE(std::abs(h32[t] - exact) <= 2e-4 * exact);  // float: the limit 1/(1-a) sums 1000 terms
    }
  }
}

TEST_CASE("recurrence: gradients of b, A and the initial state match finite differences" LOOM_BACKEND_TAG,
          "[scan][recurrence][gradient]") {
  {  // every backend: the adjoint and the transition gradient run on the backend under test
    const auto b = make_backend();
    const index_t n = 9, d = 4;
    const std::vector<index_t> offsets{0, 4, 4, 9};
    const index_t segs = 3;
    const auto a = random_transitions(lt::shape::block2, n, d, 500);
    const auto bv = lt::uniform<double>(n * d, -1, 1, 501);
    const auto init = lt::uniform<double>(segs * d, -1, 1, 502);
    const auto w = lt::uniform<double>(n * d, -1, 1, 503);  // L = Σ w·h + Σ wf·final
    const auto wf = lt::uniform<double>(segs * d, -1, 1, 504);
    auto loss = [&](const std::vector<double>& aa, const std::vector<double>& bb, const std::vector<double>& ii) {
      const auto r = lt::forward_oracle(lt::shape::block2, n, d, aa, bb, offsets, ii);
      double l = 0;
      for (std::size_t i = 0; i < r.h.size(); ++i) l += w[i] * r.h[i];
      for (std::size_t i = 0; i < r.finals.size(); ++i) l += wf[i] * r.finals[i];
      return l;
    };
    auto fd = [&](int which, std::size_t i) {
      auto aa = a, bb = bv, ii = init;
      auto& v = which == 0 ? aa : which == 1 ? bb : ii;
      const double e = 1e-6, x = v[i];
      v[i] = x + e;
      const double up = loss(aa, bb, ii);
      v[i] = x - e;
      return (up - loss(aa, bb, ii)) / (2 * e);
    };
    const rec_case c{lt::shape::block2, n, d, true, true};
    const auto h = run_recurrence<ls::block_diagonal<2>, double>(b, c, a, bv, offsets, init, false, 0).first;
    const auto adj = run_recurrence<ls::block_diagonal<2>, double>(b, c, a, w, offsets, wf, true, 0);
    buffer<double> adj_b(adj.first), h_b(h), da_b(std::vector<double>(a.size())), init_b(init);
    buffer<std::int32_t> off_b(narrowed(offsets));
    ls::transition_gradient(b, ls::block_diagonal<2>{}, view_of<const double, 2>(adj_b, {n, d}),
                            view_of<const double, 2>(h_b, {n, d}), view_of<double, 4>(da_b, {n, d / 2, 2, 2}),
                            docs_of(off_b, offsets.size()),
                            ls::states<double, space>{view_of<const double, 2>(init_b, {segs, d}), {}});
    const std::vector<double> da = da_b.to_host();
    for (std::size_t i = 0; i < bv.size(); ++i) REQUIRE(std::abs(adj.first[i] - fd(1, i)) < 1e-8);
    for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(std::abs(da[i] - fd(0, i)) < 1e-8);
    for (std::size_t i = 0; i < init.size(); ++i) REQUIRE(std::abs(adj.second[i] - fd(2, i)) < 1e-8);
  }
}

TEST_CASE("recurrence: rejections" LOOM_BACKEND_TAG, "[scan][recurrence][errors]") {
  const auto b = make_backend();
  const index_t n = 10, d = 6;
  buffer<float> ab(std::vector<float>(n * d * 4, 0.5f)), bb(std::vector<float>(n * d)), hb(std::vector<float>(n * d));
  const auto bv = view_of<const float, 2>(bb, {n, d});
  const auto hv = view_of<float, 2>(hb, {n, d});
  CHECK_THROWS_WITH(ls::linear_recurrence(b, ls::diagonal{}, view_of<const float, 2>(ab, {n - 1, d}), bv, hv),
                    Catch::Contains("shape_mismatch") && Catch::Contains("A must have 10 time steps"));
  CHECK_THROWS_WITH(ls::linear_recurrence(b, ls::diagonal{}, view_of<const float, 2>(ab, {n, d + 1}), bv, hv),
                    Catch::Contains("diagonal A must be [10, 6]"));
  CHECK_THROWS_WITH(
      ls::linear_recurrence(b, ls::block_diagonal<4>{}, view_of<const float, 4>(ab, {n, 1, 4, 4}), bv, hv),
      Catch::Contains("invalid_argument") && Catch::Contains("divisible by 4, got d = 6"));
  CHECK_THROWS_WITH(ls::linear_recurrence(b, ls::dense{}, view_of<const float, 3>(ab, {n, d, 4}), bv, hv),
                    Catch::Contains("dense A must be [10, 6, 6]"));
  CHECK_THROWS_WITH(ls::linear_recurrence(b, ls::diagonal{}, view_of<const float, 2>(ab, {n, d}), bv,
                                          view_of<float, 2>(hb, {n, d - 1})),
                    Catch::Contains("h must be [10, 6]"));
  // Rows must be contiguous: a view with a gap between the elements of one row.
  const loom::tensor_view<const float, 2, space> gappy(ab.data(), {n, d}, {2 * d, 2});
  CHECK_THROWS_WITH(ls::linear_recurrence(b, ls::diagonal{}, gappy, bv, hv),
                    Catch::Contains("A must be contiguous within a time step"));
  buffer<float> ib(std::vector<float>(2 * d));
  CHECK_THROWS_WITH(
      ls::linear_recurrence(b, ls::diagonal{}, view_of<const float, 2>(ab, {n, d}), bv, hv, loom::segments<space>{},
                            ls::states<float, space>{view_of<const float, 2>(ib, {2, d}), {}}),
      Catch::Contains("initial must be [1, 6] (one row per segment)"));
  if constexpr (space::host_accessible) {
    const std::vector<index_t> o{0, 11};
    buffer<index_t> ob(o);
    CHECK_THROWS_WITH(
        ls::linear_recurrence(b, ls::diagonal{}, view_of<const float, 2>(ab, {n, d}), bv, hv,
                              loom::segments<space>(view_of<const index_t, 1>(ob, {2})), ls::states<float, space>{}),
        Catch::Contains("must equal the token count 10, got 11"));
  }
}

// ---------------------------------------------------------------------------------------------
// In place, overlapping views and options.block

namespace {

// The inclusive scan of x in place: one buffer is both in and out.
template <class B, class M>
std::vector<typename M::value_type> run_scan_in_place(const B& b, const M& m,
                                                      const std::vector<typename M::value_type>& x,
                                                      const std::vector<index_t>& offsets, bool reverse, index_t block,
                                                      bool reproducible) {
  using T = typename M::value_type;
  const auto n = static_cast<index_t>(x.size());
  buffer<T> io(x);
  buffer<index_t> off(offsets);
  ls::options opt{reverse ? ls::direction::reverse : ls::direction::forward, block};
  opt.reproducible = reproducible;
  auto v = view_of<T, 1>(io, {n});
  const loom::tensor_view<const T, 1, space> vi = v;
  ls::inclusive_scan(b, m, vi, v, docs_of(off, offsets.size()), opt);
  return io.to_host();
}

}  // namespace

TEST_CASE("scan: inclusive scans in place (out is in), every variant, exact" LOOM_BACKEND_TAG, "[scan][in_place]") {
  const auto b = make_backend();
  const lt::mat2_product m;
  for (index_t n : lengths) {
    auto g = lt::rng(700 + static_cast<std::uint64_t>(n));
    std::vector<lt::mat2> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = {g() % 5, g() % 3, g() % 3, g() % 5};
    const auto xf = lt::small_integers<float>(n, -3, 3, 701 + static_cast<std::uint64_t>(n));
    for (int variant = 0; variant < 4; ++variant) {
      const bool reverse = variant & 1, segmented = variant & 2;
      const auto offsets = segmented ? ragged_offsets(n, 17 + n) : std::vector<index_t>{};
      const auto want = scan_oracle(m, x, offsets, false, reverse, m.identity());
      const auto wantf = scan_oracle(ls::plus<float>{}, xf, offsets, false, reverse, 0.0f);
      for (index_t block : {index_t{0}, index_t{7}, index_t{64}})
        for (bool reproducible : {true, false}) {
          INFO("n = " << n << ", reverse " << reverse << ", segmented " << segmented << ", block " << block
                      << ", reproducible " << reproducible);
          REQUIRE(run_scan_in_place(b, m, x, offsets, reverse, block, reproducible) == want);
          REQUIRE(run_scan_in_place(b, ls::plus<float>{}, xf, offsets, reverse, block, reproducible) == wantf);
        }
    }
  }
}

TEST_CASE("scan: out overlapping in without being in is rejected, interleaved views are not" LOOM_BACKEND_TAG,
          "[scan][errors]") {
  const auto b = make_backend();
  const index_t n = 64;
  buffer<float> buf(std::vector<float>(static_cast<std::size_t>(2 * n + 1), 1.0f));
  const loom::tensor_view<const float, 1, space> in(buf.data(), {n});
  for (index_t shift : {index_t{1}, index_t{-1}, index_t{n - 1}}) {
    INFO("out starts " << shift << " elements after in");
    const index_t in0 = shift < 0 ? -shift : 0;
    const loom::tensor_view<const float, 1, space> in_at(buf.data() + in0, {n});
    const loom::tensor_view<float, 1, space> out_at(buf.data() + in0 + shift, {n});
    for (bool exclusive : {false, true})
      require_loom_error(
          [&] {
            if (exclusive)
              ls::exclusive_scan(b, ls::plus<float>{}, in_at, out_at, 0.0f);
            else
              ls::inclusive_scan(b, ls::plus<float>{}, in_at, out_at);
          },
          loom::errc::invalid_argument,
          {exclusive ? "exclusive_scan" : "inclusive_scan", "out and in share memory",
           exclusive ? "out must not overlap in" : "out must be the same view as in"});
  }
  // Exclusive scans do not run in place: the same view as out and in is rejected.
  const loom::tensor_view<float, 1, space> same(buf.data(), {n});
  require_loom_error([&] { ls::exclusive_scan(b, ls::plus<float>{}, in, same, 0.0f); }, loom::errc::invalid_argument,
                     {"exclusive_scan: out and in share memory", "out must not overlap in"});
  buffer<index_t> two(std::vector<index_t>{0, n});
  require_loom_error(
      [&] {
        ls::exclusive_scan(b, ls::plus<float>{}, in, same, 0.0f,
                           loom::segments<space>(view_of<const index_t, 1>(two, {2})));
      },
      loom::errc::invalid_argument, {"exclusive_scan: out and in share memory", "out must not overlap in"});
  // The same first element, another stride: the elements differ.
  require_loom_error(
      [&] { ls::inclusive_scan(b, ls::plus<float>{}, in, loom::tensor_view<float, 1, space>(buf.data(), {n}, {2})); },
      loom::errc::invalid_argument, {"inclusive_scan", "out and in share memory"});
  // in read backwards from its end while out is written forwards over the same elements.
  require_loom_error(
      [&] {
        ls::inclusive_scan(b, ls::plus<float>{},
                           loom::tensor_view<const float, 1, space>(buf.data() + (n - 1), {n}, {-1}),
                           loom::tensor_view<float, 1, space>(buf.data(), {n}));
      },
      loom::errc::invalid_argument, {"inclusive_scan", "out and in share memory"});
  // Document offsets overwritten by the output.
  buffer<index_t> ob(std::vector<index_t>{0, 2}), ib(std::vector<index_t>{1, 1});
  require_loom_error(
      [&] {
        ls::inclusive_scan(b, ls::plus<index_t>{}, view_of<const index_t, 1>(ib, {2}),
                           loom::tensor_view<index_t, 1, space>(ob.data(), {2}),
                           loom::segments<space>(view_of<const index_t, 1>(ob, {2})));
      },
      loom::errc::invalid_argument, {"inclusive_scan", "out and docs share memory"});
  // Interleaved views of one buffer share no element: the even elements scanned into the odd ones.
  std::vector<float> x(static_cast<std::size_t>(2 * n + 1), -1.0f);
  for (index_t i = 0; i < n; ++i) x[static_cast<std::size_t>(2 * i)] = static_cast<float>(i % 5);
  buffer<float> mixed(x);
  ls::inclusive_scan(b, ls::plus<float>{}, loom::tensor_view<const float, 1, space>(mixed.data(), {n}, {2}),
                     loom::tensor_view<float, 1, space>(mixed.data() + 1, {n}, {2}));
  const auto got = mixed.to_host();
  float acc = 0;
  for (index_t i = 0; i < n; ++i) {
    acc += static_cast<float>(i % 5);
    REQUIRE(got[static_cast<std::size_t>(2 * i)] == static_cast<float>(i % 5));
    REQUIRE(got[static_cast<std::size_t>(2 * i + 1)] == acc);
  }
}

TEST_CASE("scan: options.block < 0 is rejected" LOOM_BACKEND_TAG, "[scan][errors]") {
  const auto b = make_backend();
  buffer<float> in(std::vector<float>(10, 1.0f)), out(std::vector<float>(10));
  ls::options opt;
  opt.block = -8;
  const std::initializer_list<std::string_view> parts = {"options.block must be >= 0", "got -8"};
  require_loom_error(
      [&] {
        ls::inclusive_scan(b, ls::plus<float>{}, view_of<const float, 1>(in, {10}), view_of<float, 1>(out, {10}), opt);
      },
      loom::errc::invalid_argument, parts);
  require_loom_error([&] { (void)ls::make_plan(b, ls::plus<float>{}, 10, {}, opt); }, loom::errc::invalid_argument,
                     parts);
  require_loom_error(
      [&] {
        ls::linear_recurrence(b, ls::scalar{}, view_of<const float, 1>(in, {10}), view_of<const float, 2>(in, {10, 1}),
                              view_of<float, 2>(out, {10, 1}), opt);
      },
      loom::errc::invalid_argument, {"scan::make_plan: options.block must be >= 0", "got -8"});
}

namespace {

// run_recurrence (forward) with h written over b: one buffer is both.
template <class St, class T, class B>
std::pair<std::vector<double>, std::vector<double>> run_recurrence_in_place(
    const B& b, const rec_case& c, const std::vector<double>& a, const std::vector<double>& bv,
    const std::vector<index_t>& offsets, const std::vector<double>& init, index_t block) {
  const index_t n = c.n, d = c.d;
  const index_t segs = offsets.empty() ? 1 : static_cast<index_t>(offsets.size()) - 1;
  buffer<T> ab(loom::test::cast<T>(a)), io(loom::test::cast<T>(bv)), ib(loom::test::cast<T>(init)),
      fb(std::vector<T>(static_cast<std::size_t>(segs * d), T(-7.0f)));
  buffer<index_t> ob(offsets);
  auto av = [&] {  // scalar or diagonal transitions
    if constexpr (St::a_rank == 1)
      return view_of<const T, 1>(ab, {n});
    else
      return view_of<const T, 2>(ab, {n, d});
  }();
  const auto initv = init.empty() ? loom::tensor_view<const T, 2, space>{} : view_of<const T, 2>(ib, {segs, d});
  ls::options opt;
  opt.block = block;
  const auto hv = view_of<T, 2>(io, {n, d});
  ls::linear_recurrence(b, St{}, av, loom::tensor_view<const T, 2, space>(hv), hv, docs_of(ob, offsets.size()),
                        ls::states<T, space>{initv, view_of<T, 2>(fb, {segs, d})}, opt);
  return {loom::test::widen(io.to_host()), loom::test::widen(fb.to_host())};
}

}  // namespace

TEST_CASE("recurrence: h written over b gives the same bits as separate buffers" LOOM_BACKEND_TAG,
          "[scan][recurrence][in_place]") {
  const auto b = make_backend();
  for (index_t n : {index_t{1}, index_t{65}, index_t{4097}}) {
    const index_t d = 3;
    const auto seed = static_cast<std::uint64_t>(900 + n);
    const auto offsets = ragged_offsets(n, seed);
    const index_t segs = static_cast<index_t>(offsets.size()) - 1;
    const auto init = lt::uniform<double>(segs * d, -1.0, 1.0, seed + 1);
    const auto bv = lt::uniform<double>(n * d, -1.0, 1.0, seed + 2);
    const auto a1 = random_transitions(lt::shape::scalar, n, d, seed + 3);
    const auto a2 = random_transitions(lt::shape::diagonal, n, d, seed + 4);
    for (index_t block : {index_t{0}, index_t{13}}) {
      INFO("n = " << n << ", block " << block);
      const rec_case cs{lt::shape::scalar, n, d, true, true}, cd{lt::shape::diagonal, n, d, true, true};
      REQUIRE(run_recurrence_in_place<ls::scalar, float>(b, cs, a1, bv, offsets, init, block) ==
              run_recurrence<ls::scalar, float>(b, cs, a1, bv, offsets, init, false, block));
      REQUIRE(run_recurrence_in_place<ls::diagonal, double>(b, cd, a2, bv, offsets, init, block) ==
              run_recurrence<ls::diagonal, double>(b, cd, a2, bv, offsets, init, false, block));
    }
  }
}

TEST_CASE("recurrence: outputs overlapping inputs are rejected, naming both" LOOM_BACKEND_TAG,
          "[scan][recurrence][errors]") {
  const auto b = make_backend();
  const index_t n = 10, d = 4;
  buffer<float> ab(std::vector<float>(static_cast<std::size_t>(n * d), 0.5f));
  buffer<float> bb(std::vector<float>(static_cast<std::size_t>((n + 1) * d), 1.0f));
  buffer<float> hb(std::vector<float>(static_cast<std::size_t>(n * d))), fb(std::vector<float>(2 * d));
  const auto av = view_of<const float, 2>(ab, {n, d});
  const auto bv = view_of<const float, 2>(bb, {n, d});
  const auto hv = view_of<float, 2>(hb, {n, d});
  const auto inv = loom::errc::invalid_argument;
  // h one row after b: row t of h is row t + 1 of b, read later.
  const loom::tensor_view<float, 2, space> h_shifted(bb.data() + d, {n, d});
  require_loom_error([&] { ls::linear_recurrence(b, ls::diagonal{}, av, bv, h_shifted); }, inv,
                     {"linear_recurrence: h and b share memory", "must be the same view as b"});
  require_loom_error([&] { ls::linear_recurrence_adjoint(b, ls::diagonal{}, av, bv, h_shifted); }, inv,
                     {"linear_recurrence_adjoint: lambda and g share memory", "lambda must not overlap g"});
  // The adjoint does not run in place: lambda may not be g.
  const auto gv = view_of<float, 2>(bb, {n, d});
  require_loom_error(
      [&] { ls::linear_recurrence_adjoint(b, ls::diagonal{}, av, loom::tensor_view<const float, 2, space>(gv), gv); },
      inv, {"linear_recurrence_adjoint: lambda and g share memory", "lambda must not overlap g"});
  // h over A, and A's transitions over h.
  require_loom_error(
      [&] {
        ls::linear_recurrence(b, ls::diagonal{}, av, bv, loom::tensor_view<float, 2, space>(ab.data(), {n, d}));
      },
      inv, {"linear_recurrence: h and A share memory", "h must not overlap A"});
  // final_state over b, over the initial state, over h.
  const auto init = view_of<const float, 2>(fb, {1, d});
  require_loom_error(
      [&] {
        ls::linear_recurrence(b, ls::diagonal{}, av, bv, hv, loom::segments<space>{},
                              ls::states<float, space>{{}, loom::tensor_view<float, 2, space>(bb.data(), {1, d})});
      },
      inv, {"final_state and b share memory"});
  require_loom_error(
      [&] {
        ls::linear_recurrence(b, ls::diagonal{}, av, bv, hv, loom::segments<space>{},
                              ls::states<float, space>{init, view_of<float, 2>(fb, {1, d})});
      },
      inv, {"final_state and initial share memory"});
  require_loom_error(
      [&] {
        ls::linear_recurrence(
            b, ls::diagonal{}, av, bv, hv, loom::segments<space>{},
            ls::states<float, space>{{}, loom::tensor_view<float, 2, space>(hb.data() + (n - 1) * d, {1, d})});
      },
      inv, {"final_state and h share memory"});
  require_loom_error(
      [&] {
        ls::linear_recurrence(
            b, ls::diagonal{}, av, bv, hv, loom::segments<space>{},
            ls::states<float, space>{loom::tensor_view<const float, 2, space>(hb.data(), {1, d}), {}});
      },
      inv, {"h and initial share memory"});
  if constexpr (space::host_accessible) {
    // dA of transition_gradient over lambda.
    std::vector<float> lam(static_cast<std::size_t>(n * d)), hh(static_cast<std::size_t>(n * d));
    require_loom_error(
        [&] {
          ls::transition_gradient(b, ls::diagonal{}, loom::tensor_view<const float, 2>(lam.data(), {n, d}),
                                  loom::tensor_view<const float, 2>(hh.data(), {n, d}),
                                  loom::tensor_view<float, 2>(lam.data(), {n, d}));
        },
        inv, {"transition_gradient: dA and lambda share memory"});
  }
}

// ---------------------------------------------------------------------------------------------
// Plans: no allocation per call, reuse across calls and threads, int32 and int64 offsets

TEST_CASE(
    "scan plans: a plan-taking call allocates nothing, reuse across calls and threads is bitwise equal to fresh "
    "plans" LOOM_BACKEND_TAG,
    "[scan][plan]") {
  const auto b = make_backend();
  const index_t n = 16323;
  const auto x = lt::uniform<float>(n, -1.0f, 1.0f, 4242);
  const auto offsets = ragged_offsets(n, 4243);
  buffer<float> in(x);
  buffer<index_t> off(offsets);
  buffer<std::int32_t> off32(narrowed(offsets));
  const auto vi = view_of<const float, 1>(in, {n});
  for (bool wide : {true, false})
    for (bool reproducible : {true, false}) {
      INFO("int64 offsets " << wide << ", reproducible " << reproducible);
      const auto docs = wide ? docs_of(off, offsets.size()) : docs_of(off32, offsets.size());
      ls::options opt{ls::direction::reverse, 0};
      opt.reproducible = reproducible;
      const auto plan = ls::make_plan(b, ls::plus<float>{}, n, docs, opt);
      // the reference: a fresh plan per call (the convenience form)
      buffer<float> ref(static_cast<std::size_t>(n)), ref_ex(static_cast<std::size_t>(n));
      ls::inclusive_scan(b, ls::plus<float>{}, vi, view_of<float, 1>(ref, {n}), docs, opt);
      ls::exclusive_scan(b, ls::plus<float>{}, vi, view_of<float, 1>(ref_ex, {n}), 0.5f, docs, opt);
      const auto want = ref.to_host(), want_ex = ref_ex.to_host();
      const auto oracle =
          scan_oracle(ls::plus<double>{}, std::vector<double>(x.begin(), x.end()), offsets, false, true, 0.0);
      for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(std::abs(want[i] - oracle[i]) < 1e-3);
      const workspace ws(plan.workspace_bytes());
      buffer<float> out(static_cast<std::size_t>(n)), out_ex(static_cast<std::size_t>(n));
      for (int call = 0; call < 3; ++call) {
        const auto count = lt::count_allocations([&] {
          ls::inclusive_scan(b, plan, vi, view_of<float, 1>(out, {n}), ws.span());
          ls::exclusive_scan(b, plan, vi, view_of<float, 1>(out_ex, {n}), 0.5f, ws.span());
        });
        CHECK(count.heap == 0);
        CHECK(count.temporaries == 0);
        REQUIRE(same_bits(out.to_host(), want));
        REQUIRE(same_bits(out_ex.to_host(), want_ex));
      }
      // two threads share the plan, each with its own workspace and output
      if constexpr (space::host_accessible) {
        std::vector<float> got[2];
        std::thread t[2];
        for (int k = 0; k < 2; ++k)
          t[k] = std::thread([&, k] {
            const workspace mine(plan.workspace_bytes());
            std::vector<float> o(static_cast<std::size_t>(n));
            for (int rep = 0; rep < 3; ++rep)
              ls::inclusive_scan(b, plan, vi, loom::tensor_view<float, 1, space>(o.data(), {n}), mine.span());
            got[k] = o;
          });
        for (auto& th : t) th.join();
        REQUIRE(same_bits(got[0], want));
        REQUIRE(same_bits(got[1], want));
      }
    }
}

TEST_CASE(
    "recurrence plans: no allocation per call, reuse across calls and threads, int32 and int64 offsets, "
    "precision override" LOOM_BACKEND_TAG,
    "[scan][recurrence][plan]") {
  const auto b = make_backend();
  const index_t n = 4099, d = 4;
  const auto a = random_transitions(lt::shape::block2, n, d, 77);
  const auto bv = lt::uniform<double>(n * d, -1.0, 1.0, 78);
  const auto offsets = ragged_offsets(n, 79);
  const index_t segs = static_cast<index_t>(offsets.size()) - 1;
  const auto init = lt::uniform<double>(segs * d, -1.0, 1.0, 80);
  const rec_case c{lt::shape::block2, n, d, true, true};
  using St = ls::block_diagonal<2>;
  for (bool adjoint : {false, true}) {
    const auto want64 = run_recurrence<St, float>(b, c, a, bv, offsets, init, adjoint, 0);
    const auto want32 = run_recurrence<St, float>(b, c, a, bv, offsets, init, adjoint, 0, true);
    REQUIRE(want64 == want32);
    const auto oracle = adjoint ? lt::adjoint_oracle(lt::shape::block2, n, d, a, bv, offsets, init)
                                : lt::forward_oracle(lt::shape::block2, n, d, a, bv, offsets, init);
    for (std::size_t i = 0; i < oracle.h.size(); ++i) REQUIRE(std::abs(want64.first[i] - oracle.h[i]) < 1e-4);
  }
  buffer<float> ab(loom::test::cast<float>(a)), bb(loom::test::cast<float>(bv)), ib(loom::test::cast<float>(init));
  buffer<std::int32_t> ob(narrowed(offsets));
  const auto docs = docs_of(ob, offsets.size());
  const auto av = view_of<const float, 4>(ab, {n, d / 2, 2, 2});
  const auto xv = view_of<const float, 2>(bb, {n, d});
  const auto iv = view_of<const float, 2>(ib, {segs, d});
  const auto plan = ls::make_plan(b, St{}, n, d, docs);
  const auto fresh = run_recurrence<St, float>(b, c, a, bv, offsets, init, false, 0);
  const workspace ws(plan.workspace_bytes());
  buffer<float> hb(static_cast<std::size_t>(n * d)), fb(static_cast<std::size_t>(segs * d));
  for (int call = 0; call < 3; ++call) {
    const auto count = lt::count_allocations([&] {
      ls::linear_recurrence(b, plan, av, xv, view_of<float, 2>(hb, {n, d}),
                            ls::states<float, space>{iv, view_of<float, 2>(fb, {segs, d})}, ws.span());
    });
    CHECK(count.heap == 0);
    CHECK(count.temporaries == 0);
    REQUIRE(loom::test::widen(hb.to_host()) == fresh.first);
    REQUIRE(loom::test::widen(fb.to_host()) == fresh.second);
  }
  if constexpr (space::host_accessible) {
    std::vector<float> got[2];
    std::thread t[2];
    for (int k = 0; k < 2; ++k)
      t[k] = std::thread([&, k] {
        const workspace mine(plan.workspace_bytes());
        std::vector<float> h(static_cast<std::size_t>(n * d));
        ls::linear_recurrence(b, plan, av, xv, loom::tensor_view<float, 2, space>(h.data(), {n, d}),
                              ls::states<float, space>{iv, {}}, mine.span());
        got[k] = h;
      });
    for (auto& th : t) th.join();
    REQUIRE(loom::test::widen(got[0]) == fresh.first);
    REQUIRE(loom::test::widen(got[1]) == fresh.first);
  }
  // Too small and misaligned workspaces, and views that do not fit the plan.
  require_loom_error(
      [&] {
        ls::linear_recurrence(b, plan, av, xv, view_of<float, 2>(hb, {n, d}),
                              ws.span().first(plan.workspace_bytes() - 64));
      },
      loom::errc::invalid_argument, {"linear_recurrence: workspace must hold at least"});
  const workspace ws2(plan.workspace_bytes() + 32);
  require_loom_error(
      [&] {
        ls::linear_recurrence_adjoint(b, plan, av, xv, view_of<float, 2>(hb, {n, d}), ws2.span(32));
      },
      loom::errc::invalid_argument, {"linear_recurrence_adjoint: workspace must start on a 64-byte boundary"});
  require_loom_error(
      [&] {
        ls::linear_recurrence(b, plan, av, xv, view_of<float, 2>(hb, {n, d}),
                              ls::states<float, space>{view_of<const float, 2>(ib, {1, d}), {}}, ws.span());
      },
      loom::errc::shape_mismatch, {"linear_recurrence: initial must be [", "(one row per segment)"});
  // A precision override: float storage carried in double is at least as close to the oracle.
  const auto p64 = ls::make_plan<loom::precision<float, double>>(b, St{}, n, d, docs);
  REQUIRE(p64.workspace_bytes() >= plan.workspace_bytes());
  const workspace ws64(p64.workspace_bytes());
  ls::linear_recurrence(b, p64, av, xv, view_of<float, 2>(hb, {n, d}), ls::states<float, space>{iv, {}}, ws64.span());
  const auto oracle = lt::forward_oracle(lt::shape::block2, n, d, a, bv, offsets, init);
  const auto h64 = loom::test::widen(hb.to_host());
  for (std::size_t i = 0; i < oracle.h.size(); ++i) REQUIRE(std::abs(h64[i] - oracle.h[i]) < 1e-5);
}
