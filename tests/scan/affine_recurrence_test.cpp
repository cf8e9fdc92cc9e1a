// Scalar, diagonal and block-diagonal recurrences as one scan by key of affine steps (the path a device runs
// through its vendor's scan when options.reproducible is false), run on the host through the same
// mapping functors with the sequential scan by key: forward and adjoint against the fp64 loop,
// packed documents with empty ones, int32 and int64 offsets, initial and final states, in place,
// against the blocked engine, and document isolation.

#include <loom/backend/serial.hpp>
#include <loom/scan/recurrence.hpp>

#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using loom::index_t;
namespace ls = loom::scan;
namespace sd = loom::scan::detail;
namespace lt = loom::test;

namespace {

template <class T, std::size_t R>
using view = loom::tensor_view<T, R>;

struct problem {
  index_t n = 0, d = 0;
  bool scalar = false;
  int block = 0;                  // K of block_diagonal<K>; 0: scalar or diagonal
  std::vector<std::int64_t> off;  // empty: one implicit document
  std::vector<double> a, b, h0, g, dfin;
  [[nodiscard]] index_t segs() const { return off.empty() ? 1 : static_cast<index_t>(off.size()) - 1; }
  [[nodiscard]] double a_at(index_t t, index_t c) const { return scalar ? a[t] : a[t * d + c]; }
  [[nodiscard]] index_t first(index_t s) const { return off.empty() ? 0 : off[s]; }
  [[nodiscard]] index_t end(index_t s) const { return off.empty() ? n : off[s + 1]; }
};

problem make(index_t n, index_t d, bool scalar, std::vector<std::int64_t> off, std::uint64_t seed, int block = 0) {
  problem p;
  p.n = n, p.d = d, p.scalar = scalar, p.block = block, p.off = std::move(off);
  p.a = lt::uniform<double>(scalar ? n : n * d, -0.99, 0.99, seed);
  if (block > 0) {  // K x K blocks with rows summing below 0.99 in magnitude: a contraction
    p.a = lt::uniform<double>(n * d * block, -0.99 / block, 0.99 / block, seed);
  }
  p.b = lt::uniform<double>(n * d, -1, 1, seed + 1);
  p.g = lt::uniform<double>(n * d, -1, 1, seed + 2);
  p.h0 = lt::uniform<double>(p.segs() * d, -0.5, 0.5, seed + 3);
  p.dfin = lt::uniform<double>(p.segs() * d, -0.5, 0.5, seed + 4);
  return p;
}

// The token-by-token loops in double.
struct outputs {
  std::vector<double> h, fin, lambda, dinit;
};
outputs block_oracle(const problem& p, bool states);
outputs oracle(const problem& p, bool states) {
  if (p.block > 0) return block_oracle(p, states);
  outputs o;
  o.h.assign(static_cast<std::size_t>(p.n * p.d), 0.0);
  o.lambda = o.h;
  o.fin.assign(static_cast<std::size_t>(p.segs() * p.d), 0.0);
  o.dinit = o.fin;
  for (index_t s = 0; s < p.segs(); ++s)
    for (index_t c = 0; c < p.d; ++c) {
      double x = states ? p.h0[s * p.d + c] : 0.0;
      for (index_t t = p.first(s); t < p.end(s); ++t) o.h[t * p.d + c] = x = p.a_at(t, c) * x + p.b[t * p.d + c];
      o.fin[s * p.d + c] = x;
      double lam = states ? p.dfin[s * p.d + c] : 0.0;  // the gradient arriving at the final state
      double carry = lam;
      for (index_t t = p.end(s) - 1; t >= p.first(s); --t) {
        lam = p.g[t * p.d + c] + carry;
        o.lambda[t * p.d + c] = lam;
        carry = p.a_at(t, c) * lam;
      }
      o.dinit[s * p.d + c] = carry;  // empty document: d_final itself
    }
  return o;
}

// Block by block: h_t = A_t h_{t-1} + b_t, lambda_t = g_t + A_{t+1}^T lambda_{t+1}, in double.
outputs block_oracle(const problem& p, bool states) {
  const index_t K = p.block, d = p.d;
  outputs o;
  o.h.assign(static_cast<std::size_t>(p.n * d), 0.0);
  o.lambda = o.h;
  o.fin.assign(static_cast<std::size_t>(p.segs() * d), 0.0);
  o.dinit = o.fin;
  auto a = [&](index_t t, index_t blk, index_t i, index_t l) { return p.a[((t * (d / K) + blk) * K + i) * K + l]; };
  for (index_t s = 0; s < p.segs(); ++s)
    for (index_t blk = 0; blk < d / K; ++blk) {
      std::vector<double> x(static_cast<std::size_t>(K)), y(x.size());
      for (index_t i = 0; i < K; ++i) x[i] = states ? p.h0[s * d + blk * K + i] : 0.0;
      for (index_t t = p.first(s); t < p.end(s); ++t) {
        for (index_t i = 0; i < K; ++i) {
          double sum = p.b[t * d + blk * K + i];
          for (index_t l = 0; l < K; ++l) sum += a(t, blk, i, l) * x[l];
          y[i] = sum;
        }
        x = y;
        for (index_t i = 0; i < K; ++i) o.h[t * d + blk * K + i] = x[i];
      }
      for (index_t i = 0; i < K; ++i) o.fin[s * d + blk * K + i] = x[i];
      std::vector<double> carry(static_cast<std::size_t>(K)), lam(carry.size());
      for (index_t i = 0; i < K; ++i) carry[i] = states ? p.dfin[s * d + blk * K + i] : 0.0;
      for (index_t t = p.end(s) - 1; t >= p.first(s); --t) {
        for (index_t i = 0; i < K; ++i) lam[i] = p.g[t * d + blk * K + i] + carry[i];
        for (index_t i = 0; i < K; ++i) o.lambda[t * d + blk * K + i] = lam[i];
        for (index_t i = 0; i < K; ++i) {
          double sum = 0;
          for (index_t l = 0; l < K; ++l) sum += a(t, blk, l, i) * lam[l];
          carry[i] = sum;
        }
      }
      for (index_t i = 0; i < K; ++i) o.dinit[s * d + blk * K + i] = carry[i];
    }
  return o;
}

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}
std::vector<double> widen(const auto& v) { return std::vector<double>(v.begin(), v.end()); }

// The scan by key as a device runs it: inclusive scans inside tiles of `tile` elements, then each
// tile's prefix from the tiles before it combined in front (a composed step with a composed step,
// as CUB's look-back does), so the combine of two aggregates is exercised, not only aggregate then
// one element.
template <class Map>
void scan_by_key_tiles(const Map& m, index_t tile) {
  const typename Map::op_type op{};
  using V = typename Map::value_type;
  const index_t n = m.count();
  V carry{};
  index_t carry_key = -1;
  std::vector<V> local(static_cast<std::size_t>(tile));
  for (index_t t0 = 0; t0 < n; t0 += tile) {
    const index_t len = std::min(tile, n - t0);
    for (index_t j = 0; j < len; ++j) {
      const bool restart = j == 0 || m.key(t0 + j) != m.key(t0 + j - 1);
      local[j] = restart ? m.element(t0 + j) : op.combine(local[j - 1], m.element(t0 + j));
    }
    const index_t first_key = m.key(t0);
    for (index_t j = 0; j < len && m.key(t0 + j) == first_key; ++j)
      if (carry_key == first_key) local[j] = op.combine(carry, local[j]);
    for (index_t j = 0; j < len; ++j) m.store(t0 + j, local[j]);
    carry = local[len - 1];
    carry_key = m.key(t0 + len - 1);
  }
}

// One run through the affine path (the sequential scan by key, or the tiled one when tile > 0) or
// the blocked engine.
template <class T, class St, class Offset>
outputs run(const problem& p, bool states, bool in_place, bool affine_path, index_t tile = 0) {
  const loom::serial b{};
  std::vector<Offset> off(p.off.begin(), p.off.end());
  const loom::segments<loom::host_memory> docs =
      p.off.empty() ? loom::segments<loom::host_memory>{}
                    : loom::segments<loom::host_memory>(std::span<const Offset>(off.data(), off.size()));
  ls::options opt;
  opt.reproducible = !affine_path;
  const auto plan = ls::make_plan(b, St{}, p.n, p.d, docs, opt);
  const loom::workspace_buffer buf(plan.workspace_bytes());
  const std::span<std::byte> ws = buf.span();
  const auto a = cast<T>(p.a), g = cast<T>(p.g), h0 = cast<T>(p.h0), dfin = cast<T>(p.dfin);
  auto bv = cast<T>(p.b);
  std::vector<T> h(static_cast<std::size_t>(p.n * p.d)), lambda(h.size()),
      fin(static_cast<std::size_t>(p.segs() * p.d)), dinit(fin.size());
  const index_t s = p.segs(), n = p.n, d = p.d;
  auto a_view = [&] {
    if constexpr (std::is_same_v<St, ls::scalar>)
      return view<const T, 1>(a.data(), {n});
    else if constexpr (std::is_same_v<St, ls::diagonal>)
      return view<const T, 2>(a.data(), {n, d});
    else
      return view<const T, 4>(a.data(), {n, d / St::block, index_t{St::block}, index_t{St::block}});
  }();
  const view<T, 2> hv(in_place ? bv.data() : h.data(), {n, d});
  const ls::states<T> st{states ? view<const T, 2>(h0.data(), {s, d}) : view<const T, 2>{},
                         view<T, 2>(fin.data(), {s, d})};
  const ls::adjoint_states<T> ast{states ? view<const T, 2>(dfin.data(), {s, d}) : view<const T, 2>{},
                                  view<T, 2>(dinit.data(), {s, d})};
  const view<const T, 2> bc(bv.data(), {n, d}), gv(g.data(), {n, d});
  const view<T, 2> lv(lambda.data(), {n, d});
  auto sequential = [tile](const auto& m) {
    if (tile > 0)
      scan_by_key_tiles(m, tile);
    else
      sd::scan_by_key_sequential(m);
  };
  if (affine_path) {
    sd::run_affine_recurrence(b, plan, a_view, bc, hv, st.initial, st.final_state, false, ws, sequential);
    sd::run_affine_recurrence(b, plan, a_view, gv, lv, ast.d_final, ast.d_initial, true, ws, sequential);
  } else {
    ls::linear_recurrence(b, plan, a_view, bc, hv, st, ws);
    ls::linear_recurrence_adjoint(b, plan, a_view, gv, lv, ast, ws);
  }
  outputs o;
  o.h = widen(in_place ? bv : h);
  o.fin = widen(fin);
  o.lambda = widen(lambda);
  o.dinit = widen(dinit);
  return o;
}

void require_outputs(const outputs& got, const outputs& want, lt::tolerance tol, const std::string& what) {
  lt::require_close(got.h, want.h, tol, what + ": h");
  lt::require_close(got.fin, want.fin, tol, what + ": final states");
  lt::require_close(got.lambda, want.lambda, tol, what + ": lambda");
  lt::require_close(got.dinit, want.dinit, tol, what + ": d_initial");
}

template <class T, class St, class Offset = std::int64_t>
void check(const problem& p, bool states, bool in_place, const std::string& what) {
  const lt::tolerance tol = std::is_same_v<T, double> ? lt::tolerance{1e-12, 1e-12} : lt::tolerance{2e-5, 2e-5};
  const auto got = run<T, St, Offset>(p, states, in_place, true);
  INFO(what << " T = " << p.n << " d = " << p.d << " documents " << p.segs() << " states " << states << " in place "
            << in_place);
  require_outputs(got, oracle(p, states), tol, what + " vs fp64 loop");
  require_outputs(got, run<T, St, Offset>(p, states, in_place, false), tol, what + " vs the blocked engine");
  for (index_t tile : {1, 7, 64})
    require_outputs(run<T, St, Offset>(p, states, in_place, true, tile), got, tol,
                    what + " tiled scan (tile " + std::to_string(tile) + ") vs sequential");
}

// Over h and lambda: the values outside inside(t, c) whose bits changed, and the non-finite ones
// inside.
template <class Inside>
std::pair<std::size_t, std::size_t> compare_rows(const outputs& got, const outputs& want, const problem& p,
                                                 Inside inside) {
  std::size_t changed = 0, poisoned = 0;
  for (index_t t = 0; t < p.n; ++t)
    for (index_t c = 0; c < p.d; ++c) {
      const auto i = static_cast<std::size_t>(t * p.d + c);
      for (auto v : {&outputs::h, &outputs::lambda}) {
        const double x = (got.*v)[i], y = (want.*v)[i];
        if (inside(t, c))
          poisoned += std::isfinite(x) ? 0 : 1;
        else if (std::memcmp(&x, &y, sizeof x) != 0)
          ++changed;
      }
    }
  return {changed, poisoned};
}

const std::vector<std::int64_t> packed{0, 0, 1, 8, 8, 138, 141, 1021};  // empty documents, lengths 1, 7, 130, 3, 880

}  // namespace

TEST_CASE("affine recurrences by key: scalar and diagonal, forward and adjoint, against the fp64 loop",
          "[scan][affine]") {
  for (bool scalar : {true, false}) {
    for (bool states : {true, false}) {
      const std::string what = scalar ? "scalar" : "diagonal";
      const auto one = make(101, 5, scalar, {}, 10);
      const auto docs = make(1021, 3, scalar, packed, 20);
      if (scalar) {
        check<double, ls::scalar>(one, states, false, what + ", one document");
        check<double, ls::scalar>(docs, states, false, what + ", packed");
        check<double, ls::scalar, std::int32_t>(docs, states, true, what + ", packed, int32 offsets");
        check<float, ls::scalar>(docs, states, false, what + ", float");
      } else {
        check<double, ls::diagonal>(one, states, false, what + ", one document");
        check<double, ls::diagonal>(docs, states, false, what + ", packed");
        check<double, ls::diagonal, std::int32_t>(docs, states, true, what + ", packed, int32 offsets");
        check<float, ls::diagonal>(docs, states, false, what + ", float");
      }
    }
  }
  // Every document empty, and an empty sequence: the final states are the initial ones.
  check<double, ls::diagonal>(make(0, 4, false, {0, 0, 0}, 30), true, false, "only empty documents");
  check<double, ls::diagonal>(make(0, 4, false, {}, 31), true, false, "empty sequence");
}

TEST_CASE("affine recurrences by key: a non-finite value in one document changes no other", "[scan][affine]") {
  const auto clean = make(1021, 3, false, packed, 40);
  const auto want = run<double, ls::diagonal, std::int64_t>(clean, true, false, true);
  for (double poison : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    auto p = clean;
    p.b[static_cast<std::size_t>(100 * p.d + 1)] = poison;  // document 4 (rows 8..137), forward
    p.g[static_cast<std::size_t>(9 * p.d + 2)] = poison;    // document 4, adjoint
    p.a[static_cast<std::size_t>(120 * p.d)] = poison;      // and one of its transitions
    const auto got = run<double, ls::diagonal, std::int64_t>(p, true, false, true);
    auto [changed_elsewhere, poisoned_here] =
        compare_rows(got, want, p, [](index_t t, index_t) { return t >= 8 && t < 138; });
    for (index_t s = 0; s < p.segs(); ++s)
      for (index_t c = 0; c < p.d; ++c) {
        const auto i = static_cast<std::size_t>(s * p.d + c);
        if (s == 4) continue;  // document 4 holds rows 8..137 (documents 0, 3 are empty)
        if (std::memcmp(&got.fin[i], &want.fin[i], sizeof(double)) != 0) ++changed_elsewhere;
        if (std::memcmp(&got.dinit[i], &want.dinit[i], sizeof(double)) != 0) ++changed_elsewhere;
      }
    CHECK(changed_elsewhere == 0);
    CHECK(poisoned_here > 0);
  }
}

TEST_CASE("affine recurrences by key: a non-finite value in one channel changes no other", "[scan][affine]") {
  // One document: channels are separate keys, so channel 0's NaN never meets channel 1's first
  // step (whose restart would multiply it by zero: 0 * NaN is NaN).
  const auto clean = make(257, 4, false, {}, 50);
  const auto want = run<double, ls::diagonal, std::int64_t>(clean, true, false, true);
  auto p = clean;
  p.b[static_cast<std::size_t>(256 * p.d)] = std::numeric_limits<double>::quiet_NaN();    // last row, channel 0
  p.g[static_cast<std::size_t>(0 * p.d + 3)] = std::numeric_limits<double>::quiet_NaN();  // first row, channel 3
  const auto got = run<double, ls::diagonal, std::int64_t>(p, true, false, true);
  std::size_t changed = 0;
  for (index_t t = 0; t < p.n; ++t)
    for (index_t c = 1; c < p.d; ++c) {
      const auto i = static_cast<std::size_t>(t * p.d + c);
      if (std::memcmp(&got.h[i], &want.h[i], sizeof(double)) != 0) ++changed;
      if (c != 3 && std::memcmp(&got.lambda[i], &want.lambda[i], sizeof(double)) != 0) ++changed;
    }
  CHECK(changed == 0);
  CHECK(std::isnan(got.h[static_cast<std::size_t>(256 * p.d)]));
  CHECK(std::isnan(got.lambda[3]));
}

TEST_CASE("affine recurrences by key: block-diagonal steps, forward and adjoint, against the fp64 loop",
          "[scan][affine]") {
  for (bool states : {true, false}) {
    check<double, ls::block_diagonal<2>>(make(101, 6, false, {}, 60, 2), states, false, "block 2, one document");
    check<double, ls::block_diagonal<3>>(make(1021, 9, false, packed, 61, 3), states, false, "block 3, packed");
    check<double, ls::block_diagonal<4>, std::int32_t>(make(1021, 8, false, packed, 62, 4), states, true,
                                                       "block 4, packed, int32 offsets, in place");
    check<float, ls::block_diagonal<2>>(make(1021, 4, false, packed, 63, 2), states, false, "block 2, float");
  }
  check<double, ls::block_diagonal<3>>(make(0, 6, false, {0, 0, 0}, 64, 3), true, false, "block 3, empty documents");
}

TEST_CASE("affine recurrences by key: block-diagonal, a non-finite value changes no other document or block",
          "[scan][affine]") {
  const auto clean = make(1021, 6, false, packed, 70, 3);
  const auto want = run<double, ls::block_diagonal<3>, std::int64_t>(clean, true, false, true);
  auto p = clean;
  p.b[static_cast<std::size_t>(100 * p.d + 1)] = std::numeric_limits<double>::quiet_NaN();  // document 4, block 0
  p.g[static_cast<std::size_t>(9 * p.d + 2)] = std::numeric_limits<double>::infinity();     // document 4, block 0
  const auto got = run<double, ls::block_diagonal<3>, std::int64_t>(p, true, false, true);
  const auto [changed_elsewhere, poisoned_here] =
      compare_rows(got, want, p, [](index_t t, index_t c) { return t >= 8 && t < 138 && c < 3; });  // doc 4, block 0
  CHECK(changed_elsewhere == 0);
  CHECK(poisoned_here > 0);
}
