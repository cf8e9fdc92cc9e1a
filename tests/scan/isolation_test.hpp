// Document isolation: a NaN or an infinity in one packed document leaves every other document's
// outputs and gradients with the same bits as a run in which that document is clean. Linear
// recurrences of every structure, forward, adjoint and transition gradient (the value injected in
// A, b or the initial state, in g or the final-state gradient), and segmented monoid scans (every
// variant, plus on the vector path and affine pairs). One body, swept over the backends by
// loom_add_backend_test.

#include <loom/scan/recurrence.hpp>
#include <loom/scan/scan.hpp>

#include <support/backends.hpp>
#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <type_traits>
#include <vector>

#include "poison.hpp"

using loom::index_t;
using loom::test::buffer;
using loom::test::make_backend;
namespace ls = loom::scan;
namespace lt = loom::test;
namespace lp = loom::test::poison;

namespace {

using loom::test::space;
template <class T, std::size_t R>
using view = loom::tensor_view<T, R, space>;

template <class T>
struct rec_inputs {
  std::vector<T> a, b, init, g, dfin;
};
template <class T>
struct rec_outputs {
  std::vector<T> h, fin, lambda, dinit, da;
};

//! Forward (h, final states), adjoint (λ, initial-state gradients) and transition gradient.
template <class St, class T>
rec_outputs<T> run_recurrence(const rec_inputs<T>& in, const std::vector<index_t>& off, index_t n, index_t d,
                              index_t block) {
  const auto be = make_backend();
  const index_t segs = lp::docs(off), as = St::a_size(d);
  buffer<T> a(in.a), x(in.b), init(in.init), g(in.g), dfin(in.dfin), h(static_cast<std::size_t>(n * d)),
      fin(static_cast<std::size_t>(segs * d)), lam(static_cast<std::size_t>(n * d)),
      dinit(static_cast<std::size_t>(segs * d)), da(static_cast<std::size_t>(n * as));
  buffer<index_t> o(off);
  const loom::segments<space> docs(view<const index_t, 1>(o.data(), {segs + 1}));
  ls::options opt;
  opt.block = block;
  const auto av = lp::a_view<St, space>(static_cast<const T*>(a.data()), n, d);
  const ls::states<T, space> st{view<const T, 2>(init.data(), {segs, d}), view<T, 2>(fin.data(), {segs, d})};
  ls::linear_recurrence(be, St{}, av, view<const T, 2>(x.data(), {n, d}), view<T, 2>(h.data(), {n, d}), docs, st, opt);
  const ls::adjoint_states<T, space> ast{view<const T, 2>(dfin.data(), {segs, d}), view<T, 2>(dinit.data(), {segs, d})};
  ls::linear_recurrence_adjoint(be, St{}, av, view<const T, 2>(g.data(), {n, d}), view<T, 2>(lam.data(), {n, d}), docs,
                                ast, opt);
  ls::transition_gradient(be, St{}, view<const T, 2>(lam.data(), {n, d}), view<const T, 2>(h.data(), {n, d}),
                          lp::a_view<St, space>(da.data(), n, d), docs, st);
  return {h.to_host(), fin.to_host(), lam.to_host(), dinit.to_host(), da.to_host()};
}

enum class input { a, b, init, g, d_final };
const char* name(input i) {
  return i == input::a ? "A" : i == input::b ? "b" : i == input::init ? "initial" : i == input::g ? "g" : "d_final";
}

//! Every input of documents 1 (one token), 4 and 7 (the last, one token) and the per-document
//! inputs of the empty document 3, NaN, +inf and -inf, at the first, a middle or the last token;
//! block sizes that put document starts inside blocks and documents over many blocks and tiles.
template <class St, class T>
void recurrence_isolation(const std::string& what, index_t d) {
  const index_t n = 700;
  const auto off = lp::documents(n);
  const index_t segs = lp::docs(off), as = St::a_size(d);
  const double scale = 1.0 / static_cast<double>(as / d > 1 ? as / d : 1);
  rec_inputs<T> clean{lt::uniform<T>(n * as, -scale, scale, 11), lt::uniform<T>(n * d, -1, 1, 12),
                      lt::uniform<T>(segs * d, -1, 1, 13), lt::uniform<T>(n * d, -1, 1, 14),
                      lt::uniform<T>(segs * d, -1, 1, 15)};
  auto row_doc = [&](index_t r) { return lp::doc_of(off, r); };
  auto seg_doc = [](index_t r) { return r; };
  for (index_t block : {0, 7, 64}) {
    const auto want = run_recurrence<St>(clean, off, n, d, block);
    int k = 0;
    for (input in : {input::a, input::b, input::init, input::g, input::d_final})
      for (index_t s : {1, 3, 4, 7})
        for (lp::value v : lp::all_values) {
          ++k;
          const bool per_doc = in == input::init || in == input::d_final;
          const bool empty = off[static_cast<std::size_t>(s)] == off[static_cast<std::size_t>(s) + 1];
          if (empty && !per_doc) continue;
          auto dirty = clean;
          const index_t t = empty ? -1 : lp::row_in(off, s, k % 3), c = k % d;
          const T x = lp::make<T>(v);
          switch (in) {
            case input::a:
              dirty.a[static_cast<std::size_t>(t * as + k % as)] = x;
              break;
            case input::b:
              dirty.b[static_cast<std::size_t>(t * d + c)] = x;
              break;
            case input::init:
              dirty.init[static_cast<std::size_t>(s * d + c)] = x;
              break;
            case input::g:
              dirty.g[static_cast<std::size_t>(t * d + c)] = x;
              break;
            case input::d_final:
              dirty.dfin[static_cast<std::size_t>(s * d + c)] = x;
              break;
          }
          const auto got = run_recurrence<St>(dirty, off, n, d, block);
          INFO(what << ", block " << block << ": " << lp::name(v) << " in " << name(in) << " of document " << s
                    << " (token " << t << ")");
          lp::require_others_equal(got.h, want.h, d, row_doc, s, "h");
          lp::require_others_equal(got.fin, want.fin, d, seg_doc, s, "final_state");
          lp::require_others_equal(got.lambda, want.lambda, d, row_doc, s, "lambda");
          lp::require_others_equal(got.dinit, want.dinit, d, seg_doc, s, "d_initial");
          lp::require_others_equal(got.da, want.da, as, row_doc, s, "dA");
          // The poisoned document shows it: a NaN stays a NaN; an infinity makes the state non-finite.
          const bool nan = v == lp::value::nan;
          if (in == input::a || in == input::b || in == input::init) CHECK(lp::rows_hold(got.fin, d, s, s + 1, !nan));
          if (in == input::a || in == input::g || in == input::d_final)
            CHECK(lp::rows_hold(got.dinit, d, s, s + 1, !nan));
        }
  }
}

template <class T>
bool finite_value(T x) {
  return lp::is_finite(x);
}
template <class T>
bool finite_value(const ls::affine_pair<T>& p) {
  return lp::is_finite(p.a) && lp::is_finite(p.b);
}

template <class V, class M>
std::vector<V> run_monoid(const M& m, const std::vector<V>& x, const std::vector<index_t>& off, bool exclusive,
                          bool reverse, V init, index_t block) {
  const auto be = make_backend();
  const auto n = static_cast<index_t>(x.size());
  buffer<V> in(x), out(x.size());
  buffer<index_t> o(off);
  const loom::segments<space> ov(view<const index_t, 1>(o.data(), {static_cast<index_t>(off.size())}));
  ls::options opt;
  opt.block = block;
  opt.dir = reverse ? ls::direction::reverse : ls::direction::forward;
  const view<const V, 1> iv(in.data(), {n});
  const view<V, 1> outv(out.data(), {n});
  if (exclusive)
    ls::exclusive_scan(be, m, iv, outv, init, ov, opt);
  else
    ls::inclusive_scan(be, m, iv, outv, ov, opt);
  return out.to_host();
}

//! Segmented scans, every variant: a non-finite element of documents 1, 4 or 7 changes no other
//! document; an inclusive scan shows it at its position (`shows`; max and min may drop a NaN).
//! `set(x, v)` poisons element x.
template <class M, class Set>
void monoid_isolation(const M& m, const std::vector<typename M::value_type>& clean, typename M::value_type init,
                      Set set, bool shows, const std::string& what) {
  const auto n = static_cast<index_t>(clean.size());
  const auto off = lp::documents(n);
  auto row_doc = [&](index_t r) { return lp::doc_of(off, r); };
  for (index_t block : {0, 7, 64})
    for (int variant = 0; variant < 4; ++variant) {
      const bool exclusive = variant & 1, reverse = variant & 2;
      const auto want = run_monoid(m, clean, off, exclusive, reverse, init, block);
      int k = 0;
      for (index_t s : {1, 4, 7})
        for (lp::value v : lp::all_values) {
          auto dirty = clean;
          const index_t t = lp::row_in(off, s, ++k % 3);
          set(dirty[static_cast<std::size_t>(t)], v);
          const auto got = run_monoid(m, dirty, off, exclusive, reverse, init, block);
          INFO(what << ", block " << block << ", exclusive " << exclusive << ", reverse " << reverse << ": "
                    << lp::name(v) << " at token " << t << " (document " << s << ")");
          lp::require_others_equal(got, want, 1, row_doc, s, "out");
          if (shows && !exclusive) CHECK(!finite_value(got[static_cast<std::size_t>(t)]));
        }
    }
}

}  // namespace

TEST_CASE("isolation: recurrences, a non-finite value in one document changes no other (fp64)" LOOM_BACKEND_TAG,
          "[scan][recurrence][isolation]") {
  recurrence_isolation<ls::scalar, double>("scalar", 6);
  recurrence_isolation<ls::diagonal, double>("diagonal", 6);
  recurrence_isolation<ls::block_diagonal<2>, double>("block_diagonal<2>", 6);
  recurrence_isolation<ls::block_diagonal<3>, double>("block_diagonal<3>", 6);
  recurrence_isolation<ls::dense, double>("dense", 5);
}

TEST_CASE("isolation: recurrences, a non-finite value in one document changes no other (fp32)" LOOM_BACKEND_TAG,
          "[scan][recurrence][isolation]") {
  recurrence_isolation<ls::scalar, float>("scalar", 6);
  recurrence_isolation<ls::diagonal, float>("diagonal", 16);
  recurrence_isolation<ls::block_diagonal<2>, float>("block_diagonal<2>", 6);
  recurrence_isolation<ls::block_diagonal<4>, float>("block_diagonal<4>", 8);
  recurrence_isolation<ls::dense, float>("dense", 4);
}

TEST_CASE("isolation: segmented scans, a non-finite element in one document changes no other" LOOM_BACKEND_TAG,
          "[scan][isolation]") {
  auto set = [](auto& x, lp::value v) { x = lp::make<std::remove_reference_t<decltype(x)>>(v); };
  // long documents: whole vector chunks of the plus kernels
  monoid_isolation(ls::plus<float>{}, lt::uniform<float>(40000, -1, 1, 31), 0.5f, set, true, "plus<float>");
  monoid_isolation(ls::plus<double>{}, lt::uniform<double>(20000, -1, 1, 32), 0.5, set, true, "plus<double>");
  monoid_isolation(ls::maximum<float>{}, lt::uniform<float>(3000, -1, 1, 33), 0.5f, set, false, "maximum<float>");
  const auto a = lt::uniform<double>(3000, -1, 1, 34), b = lt::uniform<double>(3000, -1, 1, 35);
  std::vector<ls::affine_pair<double>> pairs(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) pairs[i] = {a[i], b[i]};
  int flip = 0;
  monoid_isolation(
      ls::affine<double>{}, pairs, ls::affine_pair<double>{0.5, 0.25},
      [&](ls::affine_pair<double>& x, lp::value v) { (++flip % 2 ? x.a : x.b) = lp::make<double>(v); }, true,
      "affine<double>");
}
