// LASP-2 over P = 2..4 ranks (documents crossing slices, both exchanges, and on host memory both
// ways of entering the incoming state): a NaN or an infinity in one document (q, k, v, its initial
// state; d_o or its final-state gradient) leaves every other document's outputs, final states and
// gradients with the same bits as the same run with that document clean, forward and backward.
// Full decay (log-gates of -3e38 and -inf) matches the fp64 oracle. One body, run on host memory
// (serial, comm::local) and on the device stand-in (comm::standin): support/distributed.hpp.

#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../scan/poison.hpp"
#include "lasp2_ranks.hpp"

namespace lp = loom::test::poison;
using loom::index_t;
using loom::test::la::gating;
using loom::test::la::problem;
using loom::test::la::rounded;
using loom::test::la::scaled_tol;

namespace {

using result = loom::test::la::outputs;

//! Cut points of T tokens over P ranks, every slice non-empty and the documents crossing them.
std::vector<index_t> splits(index_t T, int ranks, std::uint64_t stream) {
  auto g = loom::test::rng(stream);
  std::vector<index_t> s{0};
  for (int r = 1; r < ranks; ++r) s.push_back(T * r / ranks + static_cast<index_t>(g() % 7) - 3);
  s.push_back(T);
  return s;
}

template <class T>
std::vector<double> rounded_to(const std::vector<double>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(static_cast<T>(x[i]));
  return r;
}

enum class input { q, k, v, init, d_o, d_final };

template <class P>
void isolation(const std::string& what) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = 150, H = 2, dk = 4, dv = 3;
  const auto cu = lp::documents(T);
  const index_t docs = lp::docs(cu), sz = dk * dv;
  auto tok_doc = [&](index_t t) { return lp::doc_of(cu, t); };
  auto doc = [](index_t s) { return s; };
  int n = 0;
  for (gating mode : {gating::none, gating::fixed, gating::scalar})
    for (int ranks : {2, 3, 4})
      for (const auto& sc : loom::test::la::schedules()) {
        const problem clean = rounded<P>(loom::test::la::make_problem(T, H, dk, dv, mode, cu, true, 15));
        const auto d_o = rounded_to<S>(loom::test::uniform<double>(T * H * dv, -1, 1, 16));
        const auto dfin = rounded_to<A>(loom::test::uniform<double>(docs * H * sz, -1, 1, 17));
        const auto cut = splits(T, ranks, 18 + static_cast<std::uint64_t>(ranks));
        const auto want = loom::test::la::run_lasp2<P>(clean, cut, d_o, dfin, sc, 16);
        for (input in : {input::q, input::k, input::v, input::init, input::d_o, input::d_final})
          for (index_t s : {1, 3, 4, 5, 7}) {
            const lp::value val = lp::all_values[++n % 3];
            const bool per_doc = in == input::init || in == input::d_final;
            const bool empty = cu[static_cast<std::size_t>(s)] == cu[static_cast<std::size_t>(s) + 1];
            if (empty && !per_doc) continue;
            problem p = clean;
            auto dd_o = d_o, ddfin = dfin;
            const index_t t = empty ? -1 : lp::row_in(cu, s, n % 3), h = n % H;
            const double x = static_cast<double>(lp::make<A>(val));
            const auto row = static_cast<std::size_t>(t * H + h);
            if (in == input::q) p.q[row * dk + static_cast<std::size_t>(n % dk)] = x;
            if (in == input::k) p.k[row * dk + static_cast<std::size_t>(n % dk)] = x;
            if (in == input::v) p.v[row * dv + static_cast<std::size_t>(n % dv)] = x;
            if (in == input::d_o) dd_o[row * dv + static_cast<std::size_t>(n % dv)] = x;
            if (in == input::init) p.init[static_cast<std::size_t>((s * H + h) * sz + n % sz)] = x;
            if (in == input::d_final) ddfin[static_cast<std::size_t>((s * H + h) * sz + n % sz)] = x;
            const auto got = loom::test::la::run_lasp2<P>(p, cut, dd_o, ddfin, sc, 16);
            INFO(what << ", gating " << static_cast<int>(mode) << ", P = " << ranks << ", exchange "
                      << static_cast<int>(sc.ex) << (sc.fused ? ", chunk-parallel" : "") << ": " << lp::name(val)
                      << " in input " << static_cast<int>(in) << " of document " << s << " (token " << t << ", head "
                      << h << ")");
            lp::require_others_equal(got.o, want.o, H * dv, tok_doc, s, "o");
            lp::require_others_equal(got.fin, want.fin, H * sz, doc, s, "final_state");
            lp::require_others_equal(got.dq, want.dq, H * dk, tok_doc, s, "dq");
            lp::require_others_equal(got.dk, want.dk, H * dk, tok_doc, s, "dk");
            lp::require_others_equal(got.dv, want.dv, H * dv, tok_doc, s, "dv");
            lp::require_others_equal(got.dlg, want.dlg, H, tok_doc, s, "d_log_gate");
            lp::require_others_equal(got.dinit, want.dinit, H * sz, doc, s, "d_initial_state");
            const bool any = val != lp::value::nan;
            const index_t b0 = cu[static_cast<std::size_t>(s)], b1 = cu[static_cast<std::size_t>(s) + 1];
            if (in == input::q || in == input::k || in == input::v || in == input::init)
              CHECK((lp::rows_hold(got.o, H * dv, b0, b1, any) || lp::rows_hold(got.fin, H * sz, s, s + 1, any)));
            else
              CHECK((lp::rows_hold(got.dq, H * dk, b0, b1, any) || lp::rows_hold(got.dk, H * dk, b0, b1, any) ||
                     lp::rows_hold(got.dinit, H * sz, s, s + 1, any)));
          }
      }
}

bool all_finite(const result& r) {
  for (const auto* v : {&r.o, &r.fin, &r.dq, &r.dk, &r.dv, &r.dlg, &r.dinit})
    for (double x : *v)
      if (!std::isfinite(x)) return false;
  return true;
}

template <class P>
void full_decay(const std::string& what) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = 120, H = 2, dk = 3, dv = 4;
  const std::vector<index_t> cu{0, 50, 51, 120};
  for (double huge : {-3e38, -std::numeric_limits<double>::infinity()})
    for (gating mode : {gating::scalar, gating::fixed}) {
      problem p0 = loom::test::la::make_problem(T, H, dk, dv, mode, cu, true, 25);
      if (mode == gating::scalar)
        for (index_t t : {5, 29, 30, 31, 59, 60, 89, 90, 119}) p0.lg[static_cast<std::size_t>(t * H + t % H)] = huge;
      else
        p0.head_lg[1] = huge;
      const problem p = rounded<P>(p0);
      const auto d_o = rounded_to<S>(loom::test::uniform<double>(T * H * dv, -1, 1, 26));
      const auto dfin = rounded_to<A>(loom::test::uniform<double>(p.docs() * H * dk * dv, -1, 1, 27));
      const auto want = loom::test::la::oracle(p, &d_o, &dfin);
      for (int ranks : {2, 3, 4})
        for (const auto& sc : loom::test::la::schedules()) {
          // cuts at 30 and 60 put a full-decay token on each side of a slice boundary
          const std::vector<index_t> cut = ranks == 2   ? std::vector<index_t>{0, 60, T}
                                           : ranks == 3 ? std::vector<index_t>{0, 30, 60, T}
                                                        : std::vector<index_t>{0, 30, 31, 90, T};
          const auto got = loom::test::la::run_lasp2<P>(p, cut, d_o, dfin, sc, 7);
          INFO(what << ", log-gate " << huge << ", gating " << static_cast<int>(mode) << ", P = " << ranks
                    << ", exchange " << static_cast<int>(sc.ex) << (sc.fused ? ", chunk-parallel" : ""));
          CHECK(all_finite(got));
          namespace lt = loom::test;
          lt::require_close(got.o, want.o, scaled_tol<P>(want.o), "o");
          lt::require_close(got.fin, want.fin, scaled_tol<P>(want.fin), "final state");
          lt::require_close(got.dq, want.dq, scaled_tol<P>(want.dq), "dq");
          lt::require_close(got.dk, want.dk, scaled_tol<P>(want.dk), "dk");
          lt::require_close(got.dv, want.dv, scaled_tol<P>(want.dv), "dv");
          lt::require_close(got.dinit, want.dinit, scaled_tol<P>(want.dinit), "d initial state");
          if (mode == gating::scalar) lt::require_close(got.dlg, want.dlg, scaled_tol<P>(want.dlg), "d log gate");
        }
    }
}

}  // namespace

TEST_CASE("lasp2 isolation: a non-finite value in one document changes no other, across ranks",
          "[linear_attention][lasp2][comm][isolation]") {
  isolation<loom::fp64>("fp64");
  isolation<loom::fp32>("fp32");
}

TEST_CASE("lasp2: huge and infinite negative log-gates are full decay, across ranks",
          "[linear_attention][lasp2][comm][isolation]") {
  full_decay<loom::fp64>("fp64");
  full_decay<loom::fp32>("fp32");
}
