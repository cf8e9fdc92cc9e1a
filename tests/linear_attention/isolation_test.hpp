// Chunked linear attention: document isolation and full decay. A NaN or an infinity in one packed
// document (q, k, v, its initial state; d_o or its final-state gradient in the backward) leaves every
// other document's outputs, final states and gradients with the same bits as a run in which that
// document is clean, on both schedules (fused, chunk-parallel); the poisoned document shows it.
// Log-gates of -3e38, -1e5 or -inf are full decay and match the fp64 oracle, forward and backward,
// without a NaN; NaN and +inf gates are rejected. One body, swept over the backends.

#include <loom/linear_attention/chunked.hpp>

#include <support/backends.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../scan/poison.hpp"
#include "oracle.hpp"

namespace la = loom::linear_attention;
namespace lp = loom::test::poison;
using loom::index_t;
using loom::test::buffer;
using loom::test::make_backend;
using loom::test::la::gating;
using loom::test::la::problem;
using loom::test::la::rounded;
using loom::test::la::scaled_tol;
using space = loom::test::space;

namespace {

template <class T, std::size_t R>
loom::tensor_view<T, R, space> mk(T* data, const index_t (&e)[R]) {
  std::array<index_t, R> a;
  for (std::size_t i = 0; i < R; ++i) a[i] = e[i];
  return loom::make_view<space>(data, a);
}

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  std::vector<T> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<T>(x[i]);
  return r;
}
// Exact and one to one (also for -0 and the infinities), so equal bits stay equal.
template <class T>
std::vector<double> widen(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(x[i]);
  return r;
}

struct result {
  std::vector<double> o, fin, dq, dk, dv, dlg, dinit;
};

//! Forward and backward through the plan form, the schedule set by hand.
template <class P>
result run(const problem& p, index_t chunk, bool fused, const std::vector<double>& d_o,
           const std::vector<double>& dfin) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const auto b = make_backend();
  const index_t T = p.T, H = p.H, dk = p.dk, dv = p.dv, docs = p.docs(), sz = dk * dv;
  buffer<S> q(cast<S>(p.q)), k(cast<S>(p.k)), v(cast<S>(p.v)), o(static_cast<std::size_t>(T * H * dv)),
      dob(cast<S>(d_o)), dq(p.q.size()), dkb(p.k.size()), dvb(p.v.size());
  buffer<A> lg(cast<A>(p.lg)), hlg(cast<A>(p.head_lg)), init(cast<A>(p.init)),
      fin(static_cast<std::size_t>(docs * H * sz)), dfb(cast<A>(dfin)), dlg(static_cast<std::size_t>(T * H)),
      dinit(static_cast<std::size_t>(docs * H * sz));
  la::operands<P, space> x{
      mk(static_cast<const S*>(q.data()), {T, H, dk}), mk(static_cast<const S*>(k.data()), {T, H, dk}),
      mk(static_cast<const S*>(v.data()), {T, H, dv}), mk(static_cast<const A*>(init.data()), {docs, H, dk, dv})};
  const auto pl = la::make_plan<P>(b, loom::segments<>(std::span<const index_t>(p.cu)), {p.T, H, dk, dv},
                                   {.chunk = chunk, .scale = p.scale, .fused = fused});
  const std::size_t bytes = pl.workspace_bytes();  // serves both passes
  buffer<std::byte> ws(bytes + loom::workspace_alignment);
  const auto pad =
      (loom::workspace_alignment - reinterpret_cast<std::uintptr_t>(ws.data()) % loom::workspace_alignment) %
      loom::workspace_alignment;
  const std::span<std::byte> wsp(ws.data() + pad, bytes);
  la::gradients<P, space> g{mk(dq.data(), {T, H, dk}), mk(dkb.data(), {T, H, dk}), mk(dvb.data(), {T, H, dv})};
  g.d_initial_state = mk(dinit.data(), {docs, H, dk, dv});
  if (p.mode == gating::scalar) g.d_log_gate = mk(dlg.data(), {T, H});
  const auto dov = mk(static_cast<const S*>(dob.data()), {T, H, dv});
  const auto dfv = mk(static_cast<const A*>(dfb.data()), {docs, H, dk, dv});
  auto both = [&](const auto& gt) {
    la::forward(b, pl, gt, x, mk(o.data(), {T, H, dv}), mk(fin.data(), {docs, H, dk, dv}), wsp);
    la::backward(b, pl, gt, x, dov, dfv, g, wsp);
  };
  if (p.mode == gating::none)
    both(la::no_decay{});
  else if (p.mode == gating::fixed)
    both(la::fixed_decay<A, space>{mk(static_cast<const A*>(hlg.data()), {H})});
  else
    both(la::scalar_gate<A, space>{mk(static_cast<const A*>(lg.data()), {T, H})});
  result r{widen(o.to_host()),   widen(fin.to_host()), widen(dq.to_host()),   widen(dkb.to_host()),
           widen(dvb.to_host()), widen(dlg.to_host()), widen(dinit.to_host())};
  return r;
}

enum class input { q, k, v, init, d_o, d_final };
const char* name(input i) {
  const char* n[] = {"q", "k", "v", "initial_state", "d_o", "d_final_state"};
  return n[static_cast<int>(i)];
}

template <class P>
std::vector<double> rounded_to(const std::vector<double>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(static_cast<P>(x[i]));
  return r;
}

template <class P>
void isolation_sweep(const std::string& what) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = 150, H = 2, dk = 5, dv = 6;
  const auto cu = lp::documents(T);
  const index_t docs = lp::docs(cu), sz = dk * dv;
  auto tok_doc = [&](index_t t) { return lp::doc_of(cu, t); };
  auto doc = [](index_t s) { return s; };
  for (gating mode : {gating::none, gating::fixed, gating::scalar}) {
    const problem clean = rounded<P>(loom::test::la::make_problem(T, H, dk, dv, mode, cu, true, 5));
    const auto d_o = rounded_to<S>(loom::test::uniform<double>(T * H * dv, -1, 1, 6));
    const auto dfin = rounded_to<A>(loom::test::uniform<double>(docs * H * sz, -1, 1, 7));
    for (index_t chunk : {7, 64})
      for (bool fused : {true, false}) {
        const auto want = run<P>(clean, chunk, fused, d_o, dfin);
        int n = 0;
        for (input in : {input::q, input::k, input::v, input::init, input::d_o, input::d_final})
          for (index_t s : {1, 3, 4, 7})
            for (lp::value val : lp::all_values) {
              ++n;
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
              const auto got = run<P>(p, chunk, fused, dd_o, ddfin);
              INFO(what << ", gating " << static_cast<int>(mode) << ", chunk " << chunk << (fused ? ", fused" : "")
                        << ": " << lp::name(val) << " in " << name(in) << " of document " << s << " (token " << t
                        << ", head " << h << ")");
              lp::require_others_equal(got.o, want.o, H * dv, tok_doc, s, "o");
              lp::require_others_equal(got.fin, want.fin, H * sz, doc, s, "final_state");
              lp::require_others_equal(got.dq, want.dq, H * dk, tok_doc, s, "dq");
              lp::require_others_equal(got.dk, want.dk, H * dk, tok_doc, s, "dk");
              lp::require_others_equal(got.dv, want.dv, H * dv, tok_doc, s, "dv");
              lp::require_others_equal(got.dlg, want.dlg, H, tok_doc, s, "d_log_gate");
              lp::require_others_equal(got.dinit, want.dinit, H * sz, doc, s, "d_initial_state");
              // The poisoned document shows it (a NaN as a NaN).
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
}

bool all_finite(const result& r) {
  for (const auto* v : {&r.o, &r.fin, &r.dq, &r.dk, &r.dv, &r.dlg, &r.dinit})
    for (double x : *v)
      if (!std::isfinite(x)) return false;
  return true;
}

//! Full decay (log-gates far below exp's range, or -inf) against the fp64 oracle, forward and
//! backward, scalar gates at scattered tokens (two in a row, a chunk's first and last token, a
//! document's first) and fixed decays per head.
template <class P>
void full_decay(const std::string& what) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = 160, H = 2, dk = 4, dv = 5;
  const std::vector<index_t> cu{0, 70, 71, 160};
  const double inf = std::numeric_limits<double>::infinity();
  for (double huge : {-3e38, -inf, -1e5})
    for (gating mode : {gating::scalar, gating::fixed}) {
      problem p0 = loom::test::la::make_problem(T, H, dk, dv, mode, cu, true, 9);
      if (mode == gating::scalar) {
        for (index_t t : {3, 20, 21, 40, 47, 48, 70, 71, 100, 101, 102, 159})
          p0.lg[static_cast<std::size_t>(t * H)] = huge;
        p0.lg[static_cast<std::size_t>(33 * H + 1)] = huge;
      } else {
        p0.head_lg[0] = huge;
      }
      const problem p = rounded<P>(p0);
      const auto d_o = rounded_to<S>(loom::test::uniform<double>(T * H * dv, -1, 1, 10));
      const auto dfin = rounded_to<A>(loom::test::uniform<double>(p.docs() * H * dk * dv, -1, 1, 11));
      const auto want = loom::test::la::oracle(p, &d_o, &dfin);
      for (index_t chunk : {1, 7, 16, 64})
        for (bool fused : {true, false}) {
          const auto got = run<P>(p, chunk, fused, d_o, dfin);
          INFO(what << ", log-gate " << huge << ", gating " << static_cast<int>(mode) << ", chunk " << chunk
                    << (fused ? ", fused" : ", chunk-parallel"));
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

template <class F>
void require_error(F&& f, const std::string& fragment) {
  try {
    f();
  } catch (const loom::error& e) {
    CHECK(e.code() == loom::errc::invalid_argument);
    CHECK_THAT(e.what(), Catch::Matchers::Contains(fragment));
    return;
  }
  FAIL("expected loom::error containing '" << fragment << "'");
}

}  // namespace

TEST_CASE("linear_attention isolation: a non-finite value in one document changes no other" LOOM_BACKEND_TAG,
          "[linear_attention][isolation]") {
  isolation_sweep<loom::fp64>("fp64");
  isolation_sweep<loom::fp32>("fp32");
}

TEST_CASE("linear_attention: huge and infinite negative log-gates are full decay" LOOM_BACKEND_TAG,
          "[linear_attention][isolation]") {
  full_decay<loom::fp64>("fp64");
  full_decay<loom::fp32>("fp32");
}

TEST_CASE("linear_attention: NaN and +inf log-gates are rejected, naming the gate" LOOM_BACKEND_TAG,
          "[linear_attention][isolation][errors]") {
  if constexpr (space::host_accessible) {  // values are checked where the memory is readable
    const index_t T = 10, H = 2, d = 3;
    buffer<float> q(std::vector<float>(T * H * d, 0.5f)), o(static_cast<std::size_t>(T * H * d));
    const la::operands<loom::fp32, space> x{mk(static_cast<const float*>(q.data()), {T, H, d}),
                                            mk(static_cast<const float*>(q.data()), {T, H, d}),
                                            mk(static_cast<const float*>(q.data()), {T, H, d})};
    const std::vector<std::int32_t> cu32{0, 4, 10};
    const loom::segments<> cu{std::span<const std::int32_t>(cu32)};
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      std::vector<float> lg(T * H, -0.1f), hl(H, -0.1f);
      lg[7] = bad;
      hl[1] = bad;
      buffer<float> lgb(lg), hlb(hl);
      require_error(
          [&] {
            la::forward(make_backend(), cu,
                        la::scalar_gate<float, space>{mk(static_cast<const float*>(lgb.data()), {T, H})}, x,
                        mk(o.data(), {T, H, d}));
          },
          "scalar_gate.log_gate(3, 1)");
      require_error(
          [&] {
            la::forward(make_backend(), cu,
                        la::fixed_decay<float, space>{mk(static_cast<const float*>(hlb.data()), {H})}, x,
                        mk(o.data(), {T, H, d}));
          },
          "fixed_decay.log_decay[1]");
    }
  }
}
