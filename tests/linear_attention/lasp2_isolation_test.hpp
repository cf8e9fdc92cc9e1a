// LASP-2 over P = 2..4 ranks (documents crossing slices, both exchanges, and on host memory both
// ways of entering the incoming state): a NaN or an infinity in one document (q, k, v, its initial
// state; d_o or its final-state gradient) leaves every other document's outputs, final states and
// gradients with the same bits as the same run with that document clean, forward and backward.
// Full decay (log-gates of -3e38 and -inf) matches the fp64 oracle. On host memory both also with the
// local steps as batched products (the reference provider). One body, run on host memory (serial,
// comm::local) and on the device stand-in (comm::standin): support/distributed.hpp.

#include <loom/linear_attention/detail/gemm_engine.hpp>

#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../scan/poison.hpp"
#include "isolation_checks.hpp"
#include "lasp2_ranks.hpp"

namespace lp = loom::test::poison;
using loom::index_t;
using loom::test::la::gating;
using loom::test::la::input;
using loom::test::la::problem;
using loom::test::la::rounded;
using loom::test::la::rounded_to;

namespace {

//! LASP-2 on the ranks under test, its local steps on loom's kernels (Engine void) or through the
//! products tag Engine.
template <class P, class Engine>
loom::test::la::outputs run(const problem& p, const std::vector<index_t>& cut, const std::vector<double>& d_o,
                            const std::vector<double>& dfin, loom::test::la::schedule sc, index_t chunk) {
  return loom::test::la::run_lasp2<P, loom::test::space, loom::test::la::ranks_under_test, Engine>(p, cut, d_o, dfin,
                                                                                                   sc, chunk);
}

//! Cut points of T tokens over P ranks, every slice non-empty and the documents crossing them.
std::vector<index_t> splits(index_t T, int ranks, std::uint64_t stream) {
  auto g = loom::test::rng(stream);
  std::vector<index_t> s{0};
  for (int r = 1; r < ranks; ++r) s.push_back(T * r / ranks + static_cast<index_t>(g() % 7) - 3);
  s.push_back(T);
  return s;
}

//! Engine: void (loom's kernels) or a products tag (both local steps as batched products).
template <class P, class Engine = void>
void isolation(const std::string& what) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = 150, H = 2, dk = 4, dv = 3;
  const auto cu = lp::documents(T);
  const index_t docs = lp::docs(cu), sz = dk * dv;
  int n = 0;
  for (gating mode : {gating::none, gating::fixed, gating::scalar})
    for (int ranks : {2, 3, 4})
      for (const auto& sc : loom::test::la::schedules()) {
        const problem clean = rounded<P>(loom::test::la::make_problem(T, H, dk, dv, mode, cu, true, 15));
        const auto d_o = rounded_to<S>(loom::test::uniform<double>(T * H * dv, -1, 1, 16));
        const auto dfin = rounded_to<A>(loom::test::uniform<double>(docs * H * sz, -1, 1, 17));
        const auto cut = splits(T, ranks, 18 + static_cast<std::uint64_t>(ranks));
        const auto want = run<P, Engine>(clean, cut, d_o, dfin, sc, 16);
        for (input in : {input::q, input::k, input::v, input::init, input::d_o, input::d_final})
          for (index_t s : {1, 3, 4, 5, 7}) {
            const lp::value val = lp::all_values[++n % 3];
            const auto dirty = loom::test::la::poison_input<A>(clean, d_o, dfin, in, s, n, val);
            if (!dirty) continue;
            const auto got = run<P, Engine>(dirty->p, cut, dirty->d_o, dirty->dfin, sc, 16);
            INFO(what << ", gating " << static_cast<int>(mode) << ", P = " << ranks << ", exchange "
                      << static_cast<int>(sc.ex) << (sc.fused ? ", chunk-parallel" : "") << ": " << lp::name(val)
                      << " in " << name(in) << " of document " << s << " (token " << dirty->token << ", head "
                      << dirty->head << ")");
            loom::test::la::require_isolated(got, want, cu, s, H, dk, dv, in, val);
          }
      }
}

template <class P, class Engine = void>
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
          const auto got = run<P, Engine>(p, cut, d_o, dfin, sc, 7);
          INFO(what << ", log-gate " << huge << ", gating " << static_cast<int>(mode) << ", P = " << ranks
                    << ", exchange " << static_cast<int>(sc.ex) << (sc.fused ? ", chunk-parallel" : ""));
          loom::test::la::require_oracle_close<P>(got, want, mode);
        }
    }
}

}  // namespace

TEST_CASE("lasp2 isolation: a non-finite value in one document changes no other, across ranks",
          "[linear_attention][lasp2][comm][isolation]") {
  isolation<loom::fp64>("fp64");
  isolation<loom::fp32>("fp32");
  // both local steps as batched products (the reference provider reads host memory)
  if constexpr (std::is_same_v<loom::test::space, loom::host_memory>)
    isolation<loom::fp64, loom::linear_attention::detail::host_products>("fp64, batched products");
}

TEST_CASE("lasp2: huge and infinite negative log-gates are full decay, across ranks",
          "[linear_attention][lasp2][comm][isolation]") {
  full_decay<loom::fp64>("fp64");
  full_decay<loom::fp32>("fp32");
  if constexpr (std::is_same_v<loom::test::space, loom::host_memory>) {
    full_decay<loom::fp64, loom::linear_attention::detail::host_products>("fp64, batched products");
    full_decay<loom::fp32, loom::linear_attention::detail::host_products>("fp32, batched products");
  }
}
