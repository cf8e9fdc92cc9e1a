// Chunked linear attention's forward and backward as batched dense products (detail/gemm_engine.hpp,
// the engine under linear_attention::cublas), run on the CPU with the reference provider host_gemm
// over the serial and openmp backends: against the fp64 token-by-token oracle (the backward also
// against loom's tiled backward), with full-decay gates, and the documents' isolation (a
// non-finite value changes no other document, bit for bit).

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
#include <string_view>
#include <utility>
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

namespace {

// p's operands, initial states and scalar gate in fp32 (the vectors kept with the views over them).
struct fp32_inputs {
  std::vector<float> q, k, v, lg, init;
  la::operands<loom::fp32> x;
  la::scalar_gate<float> gate;
  explicit fp32_inputs(const problem& p)
      : q(cast<float>(p.q)),
        k(cast<float>(p.k)),
        v(cast<float>(p.v)),
        lg(cast<float>(p.lg)),
        init(cast<float>(p.init)),
        x{loom::tensor_view<const float, 3>(q.data(), {p.T, p.H, p.dk}),
          loom::tensor_view<const float, 3>(k.data(), {p.T, p.H, p.dk}),
          loom::tensor_view<const float, 3>(v.data(), {p.T, p.H, p.dv})},
        gate{loom::tensor_view<const float, 2>(lg.data(), {p.T, p.H})} {
    x.initial_state = loom::tensor_view<const float, 4>(init.data(), {p.docs(), p.H, p.dk, p.dv});
  }
  fp32_inputs(const fp32_inputs&) = delete;
  fp32_inputs& operator=(const fp32_inputs&) = delete;
};

}  // namespace

TEST_CASE("linear attention as batched products: the plan-taking call allocates nothing, and a plan serves many calls",
          "[linear_attention][gemm_engine]") {
  const problem p = loom::test::la::make_problem(131, 3, 8, 5, gating::scalar, {0, 40, 41, 131}, true, 11);
  const index_t T = p.T, H = p.H, docs = p.docs();
  const fp32_inputs in(p);
  const auto& x = in.x;
  const auto& gate = in.gate;
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

namespace {

// The gradients of one backward, widened.
struct grads {
  std::vector<double> dq, dk, dv, dlg, dinit;
};

// The backward of p (chunk size `chunk`) on backend b, through the engine (tiled = false) or loom's
// tiled kernels on the same plan; d_o [T, H, dv], dfin [docs, H, dk, dv] (empty: none). Outputs
// start at -7, so one left unwritten shows.
template <class P, class B>
grads run_backward(const B& b, const problem& p, index_t chunk, const std::vector<double>& d_o,
                   const std::vector<double>& dfin, bool tiled = false) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = p.T, H = p.H, docs = p.docs(), sz = p.dk * p.dv;
  const auto q = cast<S>(p.q), k = cast<S>(p.k), v = cast<S>(p.v), dob = cast<S>(d_o);
  const auto lg = cast<A>(p.lg), hlg = cast<A>(p.head_lg), init = cast<A>(p.init), dfb = cast<A>(dfin);
  std::vector<S> dq(p.q.size(), S(-7.0f)), dk(p.k.size(), S(-7.0f)), dv(p.v.size(), S(-7.0f));
  std::vector<A> dlg(static_cast<std::size_t>(T * H), A(-7)), dinit(static_cast<std::size_t>(docs * H * sz), A(-7));
  la::operands<P> x{loom::tensor_view<const S, 3>(q.data(), {T, H, p.dk}),
                    loom::tensor_view<const S, 3>(k.data(), {T, H, p.dk}),
                    loom::tensor_view<const S, 3>(v.data(), {T, H, p.dv})};
  if (!p.init.empty()) x.initial_state = loom::tensor_view<const A, 4>(init.data(), {docs, H, p.dk, p.dv});
  la::gradients<P> g{loom::tensor_view<S, 3>(dq.data(), {T, H, p.dk}), loom::tensor_view<S, 3>(dk.data(), {T, H, p.dk}),
                     loom::tensor_view<S, 3>(dv.data(), {T, H, p.dv})};
  g.d_initial_state = loom::tensor_view<A, 4>(dinit.data(), {docs, H, p.dk, p.dv});
  if (p.mode == gating::scalar) g.d_log_gate = loom::tensor_view<A, 2>(dlg.data(), {T, H});
  loom::tensor_view<const A, 4> dfv;
  if (!dfin.empty()) dfv = loom::tensor_view<const A, 4>(dfb.data(), {docs, H, p.dk, p.dv});
  const loom::tensor_view<const S, 3> dov(dob.data(), {T, H, p.dv});
  const loom::segments<> seg{std::span<const index_t>(p.cu)};
  const auto pl = la::make_plan<P>(b, seg, {T, H, p.dk, p.dv}, {.chunk = chunk, .scale = p.scale});
  const auto bl = la::detail::make_gemm_backward_layout<S, A>(pl);
  loom::workspace_buffer ws(tiled ? pl.backward_workspace_bytes() : bl.bytes);
  auto call = [&](const auto& gate) {
    if (tiled)
      la::backward(b, pl, gate, x, dov, dfv, g, ws.span());
    else
      la::detail::gemm_backward(b, la::detail::host_gemm{}, pl, bl, gate, x, dov, dfv, g, ws.span(), "test");
  };
  if (p.mode == gating::none)
    call(la::no_decay{});
  else if (p.mode == gating::fixed)
    call(la::fixed_decay<A>{loom::tensor_view<const A, 1>(hlg.data(), {H})});
  else
    call(la::scalar_gate<A>{loom::tensor_view<const A, 2>(lg.data(), {T, H})});
  grads r{widen(dq), widen(dk), widen(dv), {}, widen(dinit)};
  if (p.mode == gating::scalar) r.dlg = widen(dlg);
  return r;
}

// d_o and (with_dfin) d final state for p, rounded to P's storage and accumulation types.
template <class P>
std::pair<std::vector<double>, std::vector<double>> seeds(const problem& p, bool with_dfin, std::uint64_t stream) {
  const auto d_o = widen(cast<typename P::storage_type>(loom::test::uniform<double>(p.T * p.H * p.dv, -1, 1, stream)));
  if (!with_dfin) return {d_o, {}};
  return {d_o, widen(cast<typename P::accum_type>(
                   loom::test::uniform<double>(p.docs() * p.H * p.dk * p.dv, -1, 1, stream + 1)))};
}

bool all_finite(const grads& r) {
  for (const auto* v : {&r.dq, &r.dk, &r.dv, &r.dlg, &r.dinit})
    for (double x : *v)
      if (!std::isfinite(x)) return false;
  return true;
}

// The engine's backward of p against the fp64 oracle at the tolerances of chunked_test.hpp.
template <class P>
void check_backward(const problem& p0, index_t chunk, bool with_dfin, const std::string& what) {
  const problem p = loom::test::la::rounded<P>(p0);
  const auto [d_o, dfin] = seeds<P>(p, with_dfin, 77);
  const auto want = loom::test::la::oracle(p, &d_o, with_dfin ? &dfin : nullptr);
  const auto got = run_backward<P>(loom::serial{}, p, chunk, d_o, dfin);
  CHECK(all_finite(got));
  loom::test::la::require_gradients_close<P>(got, want, p.mode == gating::scalar, what);
}

}  // namespace

TEST_CASE("linear attention's backward as batched products matches the analytic oracle",
          "[linear_attention][gemm_engine][backward]") {
  const index_t T = GENERATE(as<index_t>{}, 1, 2, 63, 65, 131);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const bool with_init = GENERATE(false, true);
  const bool with_dfin = GENERATE(false, true);
  // dk != dv, both prime; several documents with a one-token and an empty one (T > 3)
  const auto cu = loom::test::la::random_docs(T, 4, 60 + static_cast<std::uint64_t>(T));
  const auto p = loom::test::la::make_problem(T, 3, 7, 5, mode, cu, with_init, 61 + static_cast<std::uint64_t>(T));
  for (index_t chunk : {index_t{1}, index_t{7}, index_t{16}, index_t{64}}) {
    const std::string what = std::string(name(mode)) + " T=" + std::to_string(T) + " C=" + std::to_string(chunk) +
                             (with_init ? " init" : "") + (with_dfin ? " dfin" : "");
    check_backward<loom::fp64>(p, chunk, with_dfin, what + " fp64");
    check_backward<loom::fp32>(p, chunk, with_dfin, what + " fp32");
    check_backward<loom::bf16>(p, chunk, with_dfin, what + " bf16");
  }
}

TEST_CASE("linear attention's backward as batched products: full-decay gates",
          "[linear_attention][gemm_engine][backward]") {
  const index_t T = 97, H = 2;
  for (const auto mode : {gating::scalar, gating::fixed})
    for (const double huge : {-std::numeric_limits<double>::infinity(), -1e6}) {
      problem p = loom::test::la::make_problem(T, H, 6, 7, mode, {0, 40, 41, 97}, true, 5);
      if (mode == gating::scalar) {
        for (index_t t : {index_t{3}, index_t{17}, index_t{18}, index_t{40}, index_t{63}, index_t{96}})
          p.lg[static_cast<std::size_t>(t * H)] = huge;
        p.lg[static_cast<std::size_t>(50 * H + 1)] = huge;
      } else {
        p.head_lg[0] = huge;
        for (index_t t = 0; t < T; ++t) p.lg[static_cast<std::size_t>(t * H)] = huge;
      }
      for (index_t chunk : {index_t{1}, index_t{5}, index_t{16}, index_t{64}}) {
        const std::string what =
            std::string(name(mode)) + " full decay " + std::to_string(huge) + " C=" + std::to_string(chunk);
        check_backward<loom::fp64>(p, chunk, true, what + " fp64");
        check_backward<loom::fp32>(p, chunk, true, what + " fp32");
        check_backward<loom::fp32>(p, chunk, false, what + " fp32 no dfin");
      }
    }
}

TEST_CASE("linear attention's backward as batched products agrees with loom's tiled backward on the same plan",
          "[linear_attention][gemm_engine][backward]") {
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const index_t T = 211;
  const auto p0 = loom::test::la::make_problem(T, 3, 11, 6, mode, loom::test::la::random_docs(T, 5, 8), true, 62);
  auto one = [&]<class P>(P, const char* prec) {
    const problem p = loom::test::la::rounded<P>(p0);
    const auto [d_o, dfin] = seeds<P>(p, true, 90);
    for (index_t chunk : {index_t{7}, index_t{64}}) {
      const auto got = run_backward<P>(loom::openmp{.threads = 2}, p, chunk, d_o, dfin);
      const auto want = run_backward<P>(loom::serial{}, p, chunk, d_o, dfin, true);
      const std::string what = std::string(name(mode)) + " C=" + std::to_string(chunk) + prec;
      loom::test::la::require_gradients_close<P>(got, want, true, what);
    }
  };
  one(loom::fp64{}, " fp64");
  one(loom::fp32{}, " fp32");
  one(loom::bf16{}, " bf16");
}

TEST_CASE("linear attention's backward as batched products: a non-finite value changes no other document",
          "[linear_attention][gemm_engine][backward]") {
  const index_t T = 150, H = 2, dk = 8, dv = 4;
  const std::vector<index_t> cu = {0, 37, 38, 101, 150};
  for (const auto mode : {gating::none, gating::fixed, gating::scalar}) {
    const problem clean = loom::test::la::make_problem(T, H, dk, dv, mode, cu, true, 9);
    const auto [d_o, dfin] = seeds<loom::fp32>(clean, true, 91);
    const auto a = run_backward<loom::fp32>(loom::openmp{.threads = 2}, clean, 16, d_o, dfin);
    REQUIRE(all_finite(a));
    for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
      for (int in = 0; in < 4; ++in) {  // v, k, d_o, d final state of document 2 (tokens 38..100)
        problem dirty = clean;
        auto dd_o = d_o, ddfin = dfin;
        if (in == 0) dirty.v[static_cast<std::size_t>((60 * H + 1) * dv + 2)] = bad;
        if (in == 1) dirty.k[static_cast<std::size_t>((45 * H + 0) * dk + 5)] = bad;
        if (in == 2) dd_o[static_cast<std::size_t>((99 * H + 1) * dv + 3)] = bad;
        if (in == 3) ddfin[static_cast<std::size_t>((2 * H + 0) * dk * dv + 7)] = bad;
        const auto b = run_backward<loom::fp32>(loom::openmp{.threads = 2}, dirty, 16, dd_o, ddfin);
        auto same = [&](const std::vector<double>& x, const std::vector<double>& y, index_t width, bool per_token,
                        const char* what) {
          REQUIRE(x.size() == y.size());
          const index_t n = static_cast<index_t>(x.size()) / width;
          for (index_t r = 0; r < n; ++r) {
            if (per_token ? (r >= 38 && r < 101) : r == 2) continue;
            for (index_t e = 0; e < width; ++e) {
              const std::size_t i = static_cast<std::size_t>(r * width + e);
              INFO(name(mode) << " input " << in << " " << what << " row " << r << " element " << e);
              REQUIRE(std::isfinite(y[i]));
              REQUIRE(std::memcmp(&x[i], &y[i], sizeof(double)) == 0);
            }
          }
        };
        same(a.dq, b.dq, H * dk, true, "dq");
        same(a.dk, b.dk, H * dk, true, "dk");
        same(a.dv, b.dv, H * dv, true, "dv");
        same(a.dlg, b.dlg, H, true, "d log gate");
        same(a.dinit, b.dinit, H * dk * dv, false, "d initial state");
        bool poisoned = false;  // the value reaches its own document
        for (const auto* g : {&b.dq, &b.dk, &b.dv, &b.dinit})
          for (double y : *g) poisoned = poisoned || !std::isfinite(y);
        CHECK(poisoned);
      }
  }
}

TEST_CASE("linear attention's backward as batched products: the argument and workspace checks",
          "[linear_attention][gemm_engine][backward][reject]") {
  const index_t T = 20, H = 2, d = 4;
  const problem p = loom::test::la::make_problem(T, H, d, d, gating::scalar, {0, 9, 20}, false, 3);
  const auto q = cast<float>(p.q), lg = cast<float>(p.lg);
  std::vector<float> dq(q.size()), dk(q.size()), dv(q.size()), dlg(static_cast<std::size_t>(T * H));
  const loom::serial b;
  const auto pl = la::make_plan(b, loom::segments<>{std::span<const index_t>(p.cu)}, {T, H, d, d}, {.chunk = 8});
  const auto bl = la::detail::make_gemm_backward_layout<float, float>(pl);
  // The forward's blocks where the forward has them, its workspace no larger.
  CHECK(bl.forward.bytes == la::detail::make_gemm_layout<float, float>(pl).bytes);
  CHECK(bl.bytes > bl.forward.bytes);
  loom::workspace_buffer ws(bl.bytes + loom::workspace_alignment);
  const la::operands<loom::fp32> x{loom::tensor_view<const float, 3>(q.data(), {T, H, d}),
                                   loom::tensor_view<const float, 3>(q.data(), {T, H, d}),
                                   loom::tensor_view<const float, 3>(q.data(), {T, H, d})};
  const loom::tensor_view<const float, 3> dov(q.data(), {T, H, d});
  const la::scalar_gate<float> gate{loom::tensor_view<const float, 2>(lg.data(), {T, H})};
  la::gradients<loom::fp32> g{
      loom::tensor_view<float, 3>(dq.data(), {T, H, d}), loom::tensor_view<float, 3>(dk.data(), {T, H, d}),
      loom::tensor_view<float, 3>(dv.data(), {T, H, d}), loom::tensor_view<float, 2>(dlg.data(), {T, H})};
  constexpr std::string_view call = "linear_attention::cublas::backward";
  auto run = [&](const auto& gt, const la::gradients<loom::fp32>& gr, std::span<std::byte> w) {
    la::detail::gemm_backward(b, la::detail::host_gemm{}, pl, bl, gt, x, dov, {}, gr, w, call);
  };
  run(gate, g, ws.span().first(bl.bytes));  // accepted
  loom::test::require_loom_error(
      [&] { run(gate, g, ws.span().first(bl.bytes - 1)); }, loom::errc::invalid_argument,
      {"linear_attention::cublas::backward", "workspace must hold at least", "plan.backward_workspace_bytes()"});
  loom::test::require_loom_error([&] { run(gate, g, ws.span().subspan(16, bl.bytes)); }, loom::errc::invalid_argument,
                                 {"linear_attention::cublas::backward", "workspace must start on a 64-byte boundary"});
  loom::test::require_loom_error([&] { run(la::no_decay{}, g, ws.span()); }, loom::errc::invalid_argument,
                                 {"d_log_gate: expected an empty view"});
  auto no_gate = g;
  no_gate.d_log_gate = {};
  loom::test::require_loom_error([&] { run(gate, no_gate, ws.span()); }, loom::errc::shape_mismatch, {"d_log_gate"});
  auto short_dk = g;
  short_dk.dk = loom::tensor_view<float, 3>(dk.data(), {T, H, d - 1});
  loom::test::require_loom_error([&] { run(gate, short_dk, ws.span()); }, loom::errc::shape_mismatch, {"dk"});
  loom::test::require_loom_error(
      [&] {
        la::detail::gemm_backward(b, la::detail::host_gemm{}, pl, bl, gate, x,
                                  loom::tensor_view<const float, 3>(q.data(), {T, H, d - 1}), {}, g, ws.span(), call);
      },
      loom::errc::shape_mismatch, {"d_o"});
}

TEST_CASE("linear attention's backward as batched products allocates nothing, and a plan serves many calls",
          "[linear_attention][gemm_engine][backward]") {
  const problem p = loom::test::la::make_problem(131, 3, 8, 5, gating::scalar, {0, 40, 41, 131}, true, 11);
  const auto [d_o, dfin] = seeds<loom::fp32>(p, true, 12);
  const index_t T = p.T, H = p.H, docs = p.docs(), sz = p.dk * p.dv;
  const auto dob = cast<float>(d_o), dfb = cast<float>(dfin);
  const fp32_inputs in(p);
  const auto& x = in.x;
  const auto& gate = in.gate;
  const loom::openmp b{.threads = 2};
  const auto pl = la::make_plan(b, loom::segments<>{std::span<const index_t>(p.cu)}, {T, H, p.dk, p.dv},
                                {.chunk = 16, .scale = p.scale});
  const auto bl = la::detail::make_gemm_backward_layout<float, float>(pl);
  loom::workspace_buffer ws(bl.bytes);
  auto call = [&](std::vector<float>& out) {
    std::fill(out.begin(), out.end(), -7.0f);
    float* at = out.data();
    auto take = [&](index_t n) { return std::exchange(at, at + n); };
    const la::gradients<loom::fp32> g{loom::tensor_view<float, 3>(take(T * H * p.dk), {T, H, p.dk}),
                                      loom::tensor_view<float, 3>(take(T * H * p.dk), {T, H, p.dk}),
                                      loom::tensor_view<float, 3>(take(T * H * p.dv), {T, H, p.dv}),
                                      loom::tensor_view<float, 2>(take(T * H), {T, H}),
                                      loom::tensor_view<float, 4>(take(docs * H * sz), {docs, H, p.dk, p.dv})};
    la::detail::gemm_backward(
        b, la::detail::host_gemm{}, pl, bl, gate, x, loom::tensor_view<const float, 3>(dob.data(), {T, H, p.dv}),
        loom::tensor_view<const float, 4>(dfb.data(), {docs, H, p.dk, p.dv}), g, ws.span(), "test");
  };
  std::vector<float> first(static_cast<std::size_t>(T * H * (2 * p.dk + p.dv + 1) + docs * H * sz)),
      again(first.size());
  call(first);
  const auto counted = loom::test::count_allocations([&] { call(again); });
  CHECK(counted.heap == 0);
  CHECK(counted.temporaries == 0);
  REQUIRE(std::memcmp(first.data(), again.data(), first.size() * sizeof(float)) == 0);  // the same bits again
}
