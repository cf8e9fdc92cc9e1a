// Chunked linear attention: document isolation and full decay. A NaN or an infinity in one packed
// document (q, k, v, its initial state; d_o or its final-state gradient in the backward) leaves every
// other document's outputs, final states and gradients with the same bits as a run in which that
// document is clean, on both schedules (fused, chunk-parallel); the poisoned document shows it.
// Log-gates of -3e38, -1e5 or -inf are full decay and match the fp64 oracle, forward and backward,
// without a NaN; NaN and +inf gates are rejected. One body, swept over the backends.

#include <loom/linear_attention/chunked.hpp>

#include <support/backends.hpp>
#include <support/convert.hpp>
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
#include "isolation_checks.hpp"
#include "oracle.hpp"

namespace la = loom::linear_attention;
namespace lp = loom::test::poison;
using loom::index_t;
using loom::test::buffer;
using loom::test::make_backend;
using loom::test::la::gating;
using loom::test::la::input;
using loom::test::la::poison_input;
using loom::test::la::problem;
using loom::test::la::require_isolated;
using loom::test::la::result;
using loom::test::la::rounded;
using loom::test::la::rounded_to;
using space = loom::test::space;

using loom::test::cast;
using loom::test::widen;

namespace {

template <class T, std::size_t R>
loom::tensor_view<T, R, space> mk(T* data, const index_t (&e)[R]) {
  std::array<index_t, R> a;
  for (std::size_t i = 0; i < R; ++i) a[i] = e[i];
  return loom::make_view<space>(data, a);
}

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

template <class P>
void isolation_sweep(const std::string& what) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = 150, H = 2, dk = 5, dv = 6;
  const auto cu = lp::documents(T);
  const index_t docs = lp::docs(cu), sz = dk * dv;
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
              const auto dirty = poison_input<A>(clean, d_o, dfin, in, s, n, val);
              if (!dirty) continue;
              const auto got = run<P>(dirty->p, chunk, fused, dirty->d_o, dirty->dfin);
              INFO(what << ", gating " << static_cast<int>(mode) << ", chunk " << chunk << (fused ? ", fused" : "")
                        << ": " << lp::name(val) << " in " << name(in) << " of document " << s << " (token "
                        << dirty->token << ", head " << dirty->head << ")");
              require_isolated(got, want, cu, s, H, dk, dv, in, val);
            }
      }
  }
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
          loom::test::la::require_oracle_close<P>(got, want, mode);
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
