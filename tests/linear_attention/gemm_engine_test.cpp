// Chunked linear attention's forward as batched dense products (detail/gemm_engine.hpp, the engine
// under linear_attention::cublas), run on the CPU with the reference provider host_gemm over the
// serial and openmp backends: against the fp64 token-by-token oracle, with full-decay gates, and
// the documents' isolation (a non-finite value changes no other document, bit for bit).

#include <loom/backend/openmp.hpp>
#include <loom/backend/serial.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/detail/gemm_engine.hpp>

#include <support/allocations.hpp>
#include <support/convert.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "oracle.hpp"

namespace la = loom::linear_attention;
using loom::index_t;
using loom::test::la::gating;
using loom::test::la::problem;

using loom::test::cast;
using loom::test::widen;

namespace {

struct outputs {
  std::vector<double> o, fin;
};

// The engine's forward of p (chunk size `chunk`) on backend b.
template <class P, class B>
outputs run_engine(const B& b, const problem& p, index_t chunk) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = p.T, H = p.H, docs = p.docs();
  const auto q = cast<S>(p.q), k = cast<S>(p.k), v = cast<S>(p.v);
  const auto lg = cast<A>(p.lg), hlg = cast<A>(p.head_lg), init = cast<A>(p.init);
  std::vector<S> o(static_cast<std::size_t>(T * H * p.dv), S(-7.0f));
  std::vector<A> fin(static_cast<std::size_t>(docs * H * p.dk * p.dv), A(-7));
  la::operands<P> x{loom::tensor_view<const S, 3>(q.data(), {T, H, p.dk}),
                    loom::tensor_view<const S, 3>(k.data(), {T, H, p.dk}),
                    loom::tensor_view<const S, 3>(v.data(), {T, H, p.dv})};
  if (!p.init.empty()) x.initial_state = loom::tensor_view<const A, 4>(init.data(), {docs, H, p.dk, p.dv});
  const loom::segments<> seg{std::span<const index_t>(p.cu)};
  const auto pl = la::make_plan<P>(b, seg, {T, H, p.dk, p.dv}, {.chunk = chunk, .scale = p.scale});
  const auto gl = la::detail::make_gemm_layout<S, A>(pl);
  loom::workspace_buffer ws(gl.bytes);
  const loom::tensor_view<S, 3> ov(o.data(), {T, H, p.dv});
  const loom::tensor_view<A, 4> fv(fin.data(), {docs, H, p.dk, p.dv});
  const la::detail::host_gemm gemm;
  if (p.mode == gating::none)
    la::detail::gemm_forward(b, gemm, pl, gl, la::no_decay{}, x, ov, fv, ws.span(), "test");
  else if (p.mode == gating::fixed)
    la::detail::gemm_forward(b, gemm, pl, gl, la::fixed_decay<A>{loom::tensor_view<const A, 1>(hlg.data(), {H})}, x, ov,
                             fv, ws.span(), "test");
  else
    la::detail::gemm_forward(b, gemm, pl, gl, la::scalar_gate<A>{loom::tensor_view<const A, 2>(lg.data(), {T, H})}, x,
                             ov, fv, ws.span(), "test");
  return {widen(o), widen(fin)};
}

template <class P>
void check_engine(const problem& p0, index_t chunk, const std::string& what) {
  const problem p = loom::test::la::rounded<P>(p0);
  const auto want = loom::test::la::oracle(p);
  for (int backend = 0; backend < 2; ++backend) {
    const auto got =
        backend == 0 ? run_engine<P>(loom::serial{}, p, chunk) : run_engine<P>(loom::openmp{.threads = 2}, p, chunk);
    const std::string w = what + (backend == 0 ? " serial" : " openmp");
    loom::test::require_close(got.o, want.o, loom::test::la::scaled_tol<P>(want.o), w + " o");
    loom::test::require_close(got.fin, want.fin, loom::test::la::scaled_tol<P>(want.fin), w + " final state");
  }
}

const char* name(gating g) {
  return g == gating::none ? "no_decay" : g == gating::fixed ? "fixed_decay" : "scalar_gate";
}

}  // namespace

TEST_CASE("linear attention as batched products matches the recurrent oracle", "[linear_attention][gemm_engine]") {
  const index_t T = GENERATE(as<index_t>{}, 1, 2, 63, 64, 65, 131);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const bool packed = GENERATE(false, true);
  const auto cu =
      packed ? loom::test::la::random_docs(T, 4, static_cast<std::uint64_t>(T)) : std::vector<index_t>{0, T};
  const auto p = loom::test::la::make_problem(T, 3, 8, 5, mode, cu, packed, 40 + static_cast<std::uint64_t>(T));
  for (index_t chunk : {index_t{1}, index_t{7}, index_t{16}, index_t{64}}) {
    const std::string what =
        std::string(name(mode)) + " T=" + std::to_string(T) + " C=" + std::to_string(chunk) + (packed ? " packed" : "");
    check_engine<loom::fp64>(p, chunk, what + " fp64");
    check_engine<loom::fp32>(p, chunk, what + " fp32");
    check_engine<loom::bf16>(p, chunk, what + " bf16");
  }
}

TEST_CASE("linear attention as batched products: full-decay gates forget the state exactly",
          "[linear_attention][gemm_engine]") {
  const index_t T = 97, H = 2;
  problem p = loom::test::la::make_problem(T, H, 6, 7, gating::scalar, {0, 40, 97}, true, 5);
  for (index_t t : {index_t{3}, index_t{17}, index_t{18}, index_t{63}, index_t{96}})
    for (index_t h = 0; h < H; ++h)
      p.lg[static_cast<std::size_t>(t * H + h)] = h == 0 ? -std::numeric_limits<double>::infinity() : -1e6;
  // The oracle takes exp(-inf) = 0 and exp(-1e6) = 0: the state is forgotten at those tokens.
  for (index_t chunk : {index_t{5}, index_t{16}, index_t{64}}) {
    check_engine<loom::fp64>(p, chunk, "full decay C=" + std::to_string(chunk) + " fp64");
    check_engine<loom::fp32>(p, chunk, "full decay C=" + std::to_string(chunk) + " fp32");
  }
}

TEST_CASE("linear attention as batched products: a non-finite value changes no other document",
          "[linear_attention][gemm_engine]") {
  const index_t T = 150;
  const std::vector<index_t> cu = {0, 37, 38, 101, 150};
  for (const auto mode : {gating::none, gating::fixed, gating::scalar}) {
    const problem clean = loom::test::la::make_problem(T, 2, 8, 4, mode, cu, true, 9);
    for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      problem dirty = clean;
      dirty.v[static_cast<std::size_t>((60 * 2 + 1) * 4 + 2)] = bad;  // document 2 (tokens 38..100), head 1
      dirty.k[static_cast<std::size_t>((45 * 2 + 0) * 8 + 5)] = bad;  // document 2, head 0
      const auto a = run_engine<loom::fp32>(loom::openmp{.threads = 2}, clean, 16);
      const auto b = run_engine<loom::fp32>(loom::openmp{.threads = 2}, dirty, 16);
      for (index_t t = 0; t < T; ++t) {
        if (t >= 38 && t < 101) continue;
        for (index_t x = 0; x < 2 * 4; ++x) {
          const std::size_t i = static_cast<std::size_t>(t * 8 + x);
          INFO(name(mode) << " token " << t << " element " << x);
          REQUIRE(std::memcmp(&a.o[i], &b.o[i], sizeof(double)) == 0);
        }
      }
      const index_t sz = 8 * 4;
      for (index_t d = 0; d < 4; ++d) {
        if (d == 2) continue;
        for (index_t x = 0; x < 2 * sz; ++x) {
          const std::size_t i = static_cast<std::size_t>(d * 2 * sz + x);
          INFO(name(mode) << " final state of document " << d);
          REQUIRE(std::memcmp(&a.fin[i], &b.fin[i], sizeof(double)) == 0);
        }
      }
    }
  }
}

TEST_CASE("linear attention as batched products: the workspace check", "[linear_attention][gemm_engine][reject]") {
  const problem p = loom::test::la::make_problem(20, 1, 4, 4, gating::none, {0, 20}, false, 3);
  const auto q = cast<float>(p.q);
  std::vector<float> o(q.size());
  const loom::serial b;
  const auto pl = la::make_plan(b, loom::segments<>{}, {20, 1, 4, 4}, {.chunk = 8});
  const auto gl = la::detail::make_gemm_layout<float, float>(pl);
  loom::workspace_buffer ws(gl.bytes);
  const la::operands<loom::fp32> x{loom::tensor_view<const float, 3>(q.data(), {20, 1, 4}),
                                   loom::tensor_view<const float, 3>(q.data(), {20, 1, 4}),
                                   loom::tensor_view<const float, 3>(q.data(), {20, 1, 4})};
  loom::test::require_loom_error(
      [&] {
        la::detail::gemm_forward(b, la::detail::host_gemm{}, pl, gl, la::no_decay{}, x,
                                 loom::tensor_view<float, 3>(o.data(), {20, 1, 4}), {}, ws.span().first(gl.bytes - 1),
                                 "linear_attention::cublas::forward");
      },
      loom::errc::invalid_argument, {"linear_attention::cublas::forward", "workspace must hold at least"});
  loom::test::require_loom_error(
      [&] {
        la::detail::gemm_forward(b, la::detail::host_gemm{}, pl, gl, la::no_decay{}, x,
                                 loom::tensor_view<float, 3>(o.data(), {20, 1, 3}), {}, ws.span(),
                                 "linear_attention::cublas::forward");
      },
      loom::errc::shape_mismatch, {"o"});
}

TEST_CASE("linear attention as batched products: the plan-taking call allocates nothing, and a plan serves many calls",
          "[linear_attention][gemm_engine]") {
  const problem p = loom::test::la::make_problem(131, 3, 8, 5, gating::scalar, {0, 40, 41, 131}, true, 11);
  const auto q = cast<float>(p.q), k = cast<float>(p.k), v = cast<float>(p.v), lg = cast<float>(p.lg),
             init = cast<float>(p.init);
  const index_t T = p.T, H = p.H, docs = p.docs();
  la::operands<loom::fp32> x{loom::tensor_view<const float, 3>(q.data(), {T, H, p.dk}),
                             loom::tensor_view<const float, 3>(k.data(), {T, H, p.dk}),
                             loom::tensor_view<const float, 3>(v.data(), {T, H, p.dv})};
  x.initial_state = loom::tensor_view<const float, 4>(init.data(), {docs, H, p.dk, p.dv});
  const la::scalar_gate<float> gate{loom::tensor_view<const float, 2>(lg.data(), {T, H})};
  const loom::openmp b{.threads = 2};
  const auto pl = la::make_plan(b, loom::segments<>{std::span<const index_t>(p.cu)}, {T, H, p.dk, p.dv},
                                {.chunk = 16, .scale = p.scale});
  const auto gl = la::detail::make_gemm_layout<float, float>(pl);
  loom::workspace_buffer ws(gl.bytes);
  std::vector<float> first(static_cast<std::size_t>(T * H * p.dv)), o(first.size()),
      fin(static_cast<std::size_t>(docs * H * p.dk * p.dv));
  auto call = [&](std::vector<float>& out) {
    la::detail::gemm_forward(b, la::detail::host_gemm{}, pl, gl, gate, x,
                             loom::tensor_view<float, 3>(out.data(), {T, H, p.dv}),
                             loom::tensor_view<float, 4>(fin.data(), {docs, H, p.dk, p.dv}), ws.span(), "test");
  };
  call(first);
  const auto counted = loom::test::count_allocations([&] { call(o); });
  CHECK(counted.heap == 0);
  CHECK(counted.temporaries == 0);
  REQUIRE(std::memcmp(first.data(), o.data(), first.size() * sizeof(float)) == 0);  // the same bits again
}
