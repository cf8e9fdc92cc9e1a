// LASP-2's host schedules over comm::local (the fused lead against the oracle in fp64, fp32 and
// bf16; one plan reused; one plan shared by threads); the oracle's backward against finite
// differences; every rejection path of the public entries. Its results against single-device
// chunked attention on host memory and on the device stand-in: lasp2_distributed_test.hpp.

#include <loom/backend/openmp.hpp>
#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/lasp2.hpp>

#include <support/allocations.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "oracle.hpp"

namespace la = loom::linear_attention;
namespace lasp2 = loom::linear_attention::lasp2;
using loom::index_t;
using loom::test::la::gating;
using loom::test::la::problem;
using loom::test::la::rounded;
using loom::test::la::scaled_tol;

namespace {

template <class T, std::size_t R>
loom::tensor_view<T, R> mk(T* data, const index_t (&e)[R]) {
  std::array<index_t, R> a;
  for (std::size_t i = 0; i < R; ++i) a[i] = e[i];
  return loom::make_view(data, a);
}

struct outputs {
  std::vector<double> o, fin, dq, dk, dv, dlg, dinit;
};

loom::segments<> docs_of(const std::vector<index_t>& cu) { return loom::segments<>(std::span<const index_t>(cu)); }

}  // namespace

namespace {

//! LASP-2 forward in precision P over `splits`, one thread per rank (the fused schedule: lead,
//! scan of the rest, correction by X): the outputs and final states, widened to double.
template <class P>
outputs lasp2_forward_in(const problem& p, const std::vector<index_t>& splits, lasp2::exchange ex) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = p.T, H = p.H, dk = p.dk, dv = p.dv, docs = p.docs();
  auto cast = [](const std::vector<double>& x, auto t) { return std::vector<decltype(t)>(x.begin(), x.end()); };
  const auto q = cast(p.q, S{}), k = cast(p.k, S{}), v = cast(p.v, S{});
  const auto lg = cast(p.lg, A{}), hlg = cast(p.head_lg, A{}), init = cast(p.init, A{});
  std::vector<S> o(static_cast<std::size_t>(T * H * dv));
  std::vector<A> fin(static_cast<std::size_t>(docs * H * dk * dv), A(0));
  std::mutex mu;
  loom::comm::run_local(static_cast<int>(splits.size()) - 1, [&](loom::comm::local& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const index_t from = splits[r], n = splits[r + 1] - from;
    la::operands<P> x{mk(q.data() + from * H * dk, {n, H, dk}), mk(k.data() + from * H * dk, {n, H, dk}),
                      mk(v.data() + from * H * dv, {n, H, dv})};
    if (!p.init.empty()) x.initial_state = mk(init.data(), {docs, H, dk, dv});
    std::vector<A> f(fin.size(), A(0));
    const lasp2::options opt{.chunked = {.chunk = 16, .scale = p.scale}, .exchange = ex};
    const loom::openmp b{.threads = 1};
    const auto ov = mk(o.data() + from * H * dv, {n, H, dv});
    const auto fv = mk(f.data(), {docs, H, dk, dv});
    const auto pl = lasp2::make_plan<P>(b, comm, docs_of(p.cu), from, {n, H, dk, dv}, opt);
    loom::workspace_buffer ws(pl.forward_workspace_bytes());
    if (p.mode == gating::none)
      lasp2::forward(b, comm, pl, la::no_decay{}, x, ov, fv, {}, ws.span());
    else if (p.mode == gating::fixed)
      lasp2::forward(b, comm, pl, la::fixed_decay<A>{mk(hlg.data(), {H})}, x, ov, fv, {}, ws.span());
    else
      lasp2::forward(b, comm, pl, la::scalar_gate<A>{mk(lg.data() + from * H, {n, H})}, x, ov, fv, {}, ws.span());
    std::lock_guard lk(mu);
    for (std::size_t i = 0; i < fin.size(); ++i) fin[i] += f[i];
  });
  outputs out;
  for (S y : o) out.o.push_back(static_cast<double>(y));
  for (A y : fin) out.fin.push_back(static_cast<double>(y));
  return out;
}

template <class P>
void check_long_document(const problem& p0, const std::vector<index_t>& splits, lasp2::exchange ex,
                         const std::string& what) {
  const problem p = rounded<P>(p0);
  const auto want = loom::test::la::oracle(p);
  const auto got = lasp2_forward_in<P>(p, splits, ex);
  loom::test::require_close(got.o, want.o, scaled_tol<P>(want.o), what + " o");
  loom::test::require_close(got.fin, want.fin, scaled_tol<P>(want.fin), what + " final state");
  const auto again = lasp2_forward_in<P>(p, splits, ex);  // deterministic across runs
  CHECK(again.o == got.o);
  CHECK(again.fin == got.fin);
}

}  // namespace

TEST_CASE("linear_attention::lasp2 with a document longer than the slices matches the oracle",
          "[linear_attention][lasp2][lead]") {
  const int P = GENERATE(2, 3, 4);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const auto ex = GENERATE(lasp2::exchange::all_gather, lasp2::exchange::posted);
  const bool packed = GENERATE(false, true);
  const index_t T = 16 * 24, chunk = 16;
  // One document over every rank, or a long one between two short ones (with initial states).
  const std::vector<index_t> cu = packed ? std::vector<index_t>{0, 5, 371, 384} : std::vector<index_t>{0, T};
  const auto p = loom::test::la::make_problem(T, 2, 8, 4, mode, cu, packed, 70);
  std::vector<index_t> splits;
  for (int r = 0; r <= P; ++r) splits.push_back(T * r / P);
  if (!packed)  // every rank runs part of its slice before the exchange and part after it
    for (int r = 0; r < P; ++r) {
      const index_t n = (splits[static_cast<std::size_t>(r) + 1] - splits[static_cast<std::size_t>(r)]) / chunk;
      const la::detail::incoming_roles roles{r > 0, r + 1 < P};
      const index_t m = la::detail::incoming_lead(n, roles, true);
      CHECK(0 < m);
      CHECK(m < n);
      CHECK(la::detail::incoming_lead(n, roles, false) == (r > 0 ? 0 : m));
    }
  const std::string what = "P=" + std::to_string(P) + (packed ? " packed" : " one document");
  check_long_document<loom::fp64>(p, splits, ex, what + " fp64");
  check_long_document<loom::fp32>(p, splits, ex, what + " fp32");
  check_long_document<loom::bf16>(p, splits, ex, what + " bf16");
}

TEST_CASE("linear_attention: the oracle's backward matches finite differences", "[linear_attention][oracle]") {
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  auto p = loom::test::la::make_problem(9, 2, 3, 2, mode, {0, 4, 4, 5, 9}, true, 60);
  const auto d_o = loom::test::uniform<double>(9 * 2 * 2, -1, 1, 61);
  const auto dfin = loom::test::uniform<double>(p.docs() * 2 * 6, -1, 1, 62);
  const auto r = loom::test::la::oracle(p, &d_o, &dfin);
  const double eps = 1e-6;
  auto fd = [&](std::vector<double>& x, std::size_t i) {
    const double keep = x[i];
    x[i] = keep + eps;
    const double up = loom::test::la::loss(p, d_o, dfin);
    x[i] = keep - eps;
    const double down = loom::test::la::loss(p, d_o, dfin);
    x[i] = keep;
    return (up - down) / (2 * eps);
  };
  for (std::size_t i = 0; i < p.q.size(); ++i) REQUIRE(fd(p.q, i) == Approx(r.dq[i]).margin(1e-7));
  for (std::size_t i = 0; i < p.k.size(); ++i) REQUIRE(fd(p.k, i) == Approx(r.dk[i]).margin(1e-7));
  for (std::size_t i = 0; i < p.v.size(); ++i) REQUIRE(fd(p.v, i) == Approx(r.dv[i]).margin(1e-7));
  for (std::size_t i = 0; i < p.init.size(); ++i) REQUIRE(fd(p.init, i) == Approx(r.dinit[i]).margin(1e-7));
  if (mode == gating::scalar)
    for (std::size_t i = 0; i < p.lg.size(); ++i) REQUIRE(fd(p.lg, i) == Approx(r.dlg[i]).margin(1e-7));
}

namespace {
template <class F>
void require_error(F&& f, loom::errc code, const std::string& fragment) {
  try {
    f();
  } catch (const loom::error& e) {
    CHECK(e.code() == code);
    CHECK_THAT(e.what(), Catch::Matchers::Contains(fragment));
    return;
  }
  FAIL("expected loom::error containing '" << fragment << "'");
}
}  // namespace

TEST_CASE("linear_attention: every rejection names the argument", "[linear_attention][errors]") {
  const index_t T = 10, H = 2, d = 3;
  std::vector<float> q(T * H * d), o(T * H * d), lg(T * H, -0.1f), hl(H, -0.1f);
  const la::operands x{mk(static_cast<const float*>(q.data()), {T, H, d}),
                       mk(static_cast<const float*>(q.data()), {T, H, d}),
                       mk(static_cast<const float*>(q.data()), {T, H, d})};
  const auto ov = mk(o.data(), {T, H, d});
  const loom::serial b;
  auto fwd = [&](std::vector<index_t> cu, la::options opt = {}) {
    la::forward(b, docs_of(cu), la::no_decay{}, x, ov, {}, opt);
  };
  using loom::errc;
  require_error([&] { fwd({0, 5, 10}, {.chunk = 0}); }, errc::invalid_argument, "options.chunk must be > 0");
  require_error(
      [&] {
        fwd({0, 5, 10}, {.head_group = 9});
      },
      errc::invalid_argument, "options.head_group must be in [0, 8]");
  require_error([&] { fwd({1, 10}); }, errc::invalid_argument, "cu_seqlens[0] must be 0");
  require_error([&] { fwd({0, 6, 5, 10}); }, errc::invalid_argument, "must be non-decreasing");
  require_error([&] { fwd({0, 12, 10}); }, errc::invalid_argument, "must be non-decreasing");
  require_error([&] { fwd({0, 5, 9}); }, errc::invalid_argument, "must equal the token count 10");
  require_error([&] { fwd({}); }, errc::invalid_argument, "at least one offset");
  {  // int32 offsets go through the same validation
    const std::vector<std::int32_t> bad32{0, 4, 3, 10};
    require_error([&] { la::forward(b, loom::segments{std::span<const std::int32_t>(bad32)}, la::no_decay{}, x, ov); },
                  errc::invalid_argument, "must be non-decreasing");
  }
  require_error(
      [&] {
        la::forward(b, docs_of({0, T}), la::no_decay{}, x, mk(o.data(), {T, H, 1}));
      },
      errc::shape_mismatch, "o: expected extents");
  std::vector<float> bad = hl;
  bad[1] = 0.5f;
  require_error(
      [&] {
        la::forward(b, docs_of({0, T}), la::fixed_decay<float>{mk(static_cast<const float*>(bad.data()), {H})}, x, ov);
      },
      errc::invalid_argument, "fixed_decay.log_decay[1]");
  bad[1] = std::nanf("");
  require_error(
      [&] {
        la::forward(b, docs_of({0, T}), la::fixed_decay<float>{mk(static_cast<const float*>(bad.data()), {H})}, x, ov);
      },
      errc::invalid_argument, "not NaN");
  require_error(
      [&] {
        la::forward(b, docs_of({0, T}), la::fixed_decay<float>{mk(static_cast<const float*>(hl.data()), {1})}, x, ov);
      },
      errc::shape_mismatch, "fixed_decay.log_decay: expected extents");
  lg[7] = std::numeric_limits<float>::infinity();
  require_error(
      [&] {
        la::forward(b, docs_of({0, T}), la::scalar_gate<float>{mk(static_cast<const float*>(lg.data()), {T, H})}, x,
                    ov);
      },
      errc::invalid_argument, "scalar_gate.log_gate(3, 1)");
  std::vector<float> st(H * d * d);
  require_error(
      [&] {
        la::forward(b, docs_of({0, T}), la::no_decay{}, x, ov, mk(st.data(), {2, H, d, d}));
      },
      errc::shape_mismatch, "final_state: expected extents");
  const auto pl = la::make_plan(b, docs_of({0, T}), {T, H, d, d});
  std::vector<std::byte> small(16);
  require_error([&] { la::forward(b, pl, la::no_decay{}, x, ov, {}, std::span<std::byte>(small)); },
                errc::invalid_argument, "linear_attention::forward: workspace must hold at least");
  require_error(
      [&] {
        (void)la::make_plan(b, docs_of({0, T}), {T, H, 0, d});
      },
      errc::invalid_argument, "dk and dv must be > 0");
  // Backward: a gate gradient for a gating without gates.
  std::vector<float> g1(q.size()), g2(q.size()), g3(q.size()), dl(T * H);
  const la::gradients gr{mk(g1.data(), {T, H, d}), mk(g2.data(), {T, H, d}), mk(g3.data(), {T, H, d}),
                         mk(dl.data(), {T, H})};
  require_error(
      [&] {
        la::backward(b, docs_of({0, T}), la::no_decay{}, x, mk(static_cast<const float*>(o.data()), {T, H, d}), {}, gr);
      },
      errc::invalid_argument, "d_log_gate: expected an empty view");
  // LASP-2: a slice outside the sequence, rank 0 not starting at 0, several ranks without offsets.
  require_error(
      [&] {
        loom::comm::run_local(1, [&](loom::comm::local& comm) {
          lasp2::forward(loom::openmp{.threads = 1}, comm, docs_of({0, T + 5}), 0, la::no_decay{}, x, ov);
        });
      },
      errc::invalid_argument, "last rank's slice to end at token");
  require_error(
      [&] {
        loom::comm::run_local(1, [&](loom::comm::local& comm) {
          lasp2::forward(loom::openmp{.threads = 1}, comm, docs_of({0, T}), 3, la::no_decay{}, x, ov);
        });
      },
      errc::invalid_argument, "token_begin");
  require_error(
      [&] {
        loom::comm::run_local(2, [&](loom::comm::local& comm) {
          (void)lasp2::make_plan(loom::openmp{.threads = 1}, comm, {}, comm.rank() * 5, {5, H, d, d});
        });
      },
      errc::invalid_argument, "lasp2::make_plan: docs must hold the global document offsets");
}

namespace {

//! LASP-2 forward and backward in fp32 over `splits`, `calls` times with different inputs (call c
//! scales q, k, v and d_o by 1 + c / 4 and shifts them by c / 8): with one plan and one workspace
//! per rank made once (`reuse`; the communicator wrapped in test::uncounted and every plan-taking
//! call checked to allocate nothing on the rank's thread) or with the convenience forms, which
//! plan per call. Every call's outputs, concatenated.
std::vector<float> lasp2_calls(const problem& p, const std::vector<index_t>& splits, lasp2::exchange ex, int calls,
                               bool reuse) {
  const index_t H = p.H, dk = p.dk, dv = p.dv, docs = p.docs();
  const int P = static_cast<int>(splits.size()) - 1;
  std::vector<std::vector<float>> per(static_cast<std::size_t>(P));
  std::vector<int> allocating(static_cast<std::size_t>(P), 0);
  loom::comm::run_local(P, [&](loom::comm::local& comm_) {
    loom::test::uncounted<loom::comm::local> comm(comm_);
    const auto r = static_cast<std::size_t>(comm.rank());
    const index_t from = splits[r], n = splits[r + 1] - from;
    const loom::openmp b{.threads = 1};
    const lasp2::options opt{.chunked = {.chunk = 16, .scale = static_cast<double>(p.scale)}, .exchange = ex};
    std::optional<lasp2::plan<loom::fp32>> pl;
    std::optional<loom::workspace_buffer> ws;
    if (reuse) {
      pl.emplace(lasp2::make_plan(b, comm, docs_of(p.cu), from, {n, H, dk, dv}, opt));
      ws.emplace(pl->workspace_bytes());
    }
    const std::vector<float> lg(p.lg.begin() + from * H, p.lg.begin() + (from + n) * H);
    const std::vector<float> init(p.init.begin(), p.init.end());
    auto& out = per[r];
    for (int c = 0; c < calls; ++c) {
      auto take = [&](const std::vector<double>& src, index_t width) {
        std::vector<float> v(static_cast<std::size_t>(n * H * width));
        for (std::size_t i = 0; i < v.size(); ++i)
          v[i] = static_cast<float>(src[static_cast<std::size_t>(from * H * width) + i] * (1 + c / 4.0) + c / 8.0);
        return v;
      };
      const auto q = take(p.q, dk), k = take(p.k, dk), v = take(p.v, dv);
      const auto dov = loom::test::uniform<float>(n * H * dv, -1, 1, 300 + static_cast<std::uint64_t>(c));
      la::operands<loom::fp32> x{mk(q.data(), {n, H, dk}), mk(k.data(), {n, H, dk}), mk(v.data(), {n, H, dv}),
                                 mk(init.data(), {docs, H, dk, dv})};
      std::vector<float> o(static_cast<std::size_t>(n * H * dv)), fin(static_cast<std::size_t>(docs * H * dk * dv), 0),
          xin(static_cast<std::size_t>(H * dk * dv)), dfin(fin.size(), 0.5f), dq(q.size()), dkk(k.size()),
          dvv(v.size()), dlg(static_cast<std::size_t>(n * H)), dinit(fin.size(), 0);
      la::gradients<loom::fp32> gr{mk(dq.data(), {n, H, dk}), mk(dkk.data(), {n, H, dk}), mk(dvv.data(), {n, H, dv}),
                                   mk(dlg.data(), {n, H}), mk(dinit.data(), {docs, H, dk, dv})};
      const la::scalar_gate<float> gate{mk(lg.data(), {n, H})};
      const auto ov = mk(o.data(), {n, H, dv});
      const auto fv = mk(fin.data(), {docs, H, dk, dv});
      const auto xv = mk(xin.data(), {H, dk, dv});
      const auto dov_v = mk(dov.data(), {n, H, dv});
      const auto dfv = mk(static_cast<const float*>(dfin.data()), {docs, H, dk, dv});
      const auto xcv = mk(static_cast<const float*>(xin.data()), {H, dk, dv});
      if (reuse) {
        const auto counted = loom::test::count_allocations([&] {
          lasp2::forward(b, comm, *pl, gate, x, ov, fv, xv, ws->span());
          lasp2::backward(b, comm, *pl, gate, x, dov_v, dfv, xcv, gr, ws->span());
        });
        if (counted.heap != 0 || counted.temporaries != 0) allocating[r] = 1;
      } else {
        lasp2::forward(b, comm, docs_of(p.cu), from, gate, x, ov, fv, xv, opt);
        lasp2::backward(b, comm, docs_of(p.cu), from, gate, x, dov_v, dfv, xcv, gr, opt);
      }
      for (const auto* part : {&o, &fin, &xin, &dq, &dkk, &dvv, &dlg, &dinit})
        out.insert(out.end(), part->begin(), part->end());
    }
  });
  for (int r = 0; r < P; ++r) {
    INFO("rank " << r);
    CHECK(allocating[static_cast<std::size_t>(r)] == 0);  // nothing allocated on any rank's thread
  }
  std::vector<float> all;
  for (const auto& x : per) all.insert(all.end(), x.begin(), x.end());
  return all;
}

}  // namespace

TEST_CASE("linear_attention::lasp2 with one plan reused allocates nothing and gives the bits of fresh plans",
          "[linear_attention][lasp2][workspace]") {
  const int P = GENERATE(1, 2, 3);
  const auto ex = GENERATE(lasp2::exchange::all_gather, lasp2::exchange::posted);
  const bool packed = GENERATE(false, true);
  const index_t T = 16 * 12;
  const std::vector<index_t> cu = packed ? std::vector<index_t>{0, 5, 150, 150, 192} : std::vector<index_t>{0, T};
  const auto p = loom::test::la::make_problem(T, 2, 8, 4, gating::scalar, cu, true, 80);
  std::vector<index_t> even;
  for (int r = 0; r <= P; ++r) even.push_back(T * r / P);
  // Even slices, and (P > 1) an empty first slice (its element is the identity, a = 1, M = 0).
  std::vector<std::vector<index_t>> all{even};
  if (P == 2) all.push_back({0, 0, T});
  if (P == 3) all.push_back({0, 0, 100, T});
  for (const auto& splits : all) {
    const auto want = lasp2_calls(p, splits, ex, 3, false);
    const auto got = lasp2_calls(p, splits, ex, 3, true);
    REQUIRE(got.size() == want.size());
    CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("linear_attention::lasp2: make_plan(b, comm, ...) agrees once, N calls with one plan repeat no agreement",
          "[linear_attention][lasp2][plan]") {
  const index_t T = 60, H = 2, d = 3;
  const std::vector<std::int32_t> cu32{0, 25, 25, T};  // int32 offsets
  std::vector<float> q(static_cast<std::size_t>(T * H * d), 0.25f);
  // Per rank: collectives after make_plan, after the calls, and the plan's rank / ranks / docs
  // (checked after the ranks' threads have joined).
  std::vector<std::array<long long, 5>> seen(3);
  constexpr int calls = 4;
  loom::comm::run_local(3, [&](loom::comm::local& inner) {
    loom::comm::counting<loom::comm::local> comm(inner);
    const loom::openmp b{.threads = 1};
    const index_t from = 20 * comm.rank(), n = 20;
    const auto pl = lasp2::make_plan(b, comm, loom::segments{std::span<const std::int32_t>(cu32)}, from, {n, H, d, d});
    auto& mine = seen[static_cast<std::size_t>(comm.rank())];
    mine = {comm.counts().collectives.load(), 0, pl.rank(), pl.ranks(), pl.docs()};
    loom::workspace_buffer ws(pl.workspace_bytes());
    const la::operands x{mk(static_cast<const float*>(q.data()) + from * H * d, {n, H, d}),
                         mk(static_cast<const float*>(q.data()) + from * H * d, {n, H, d}),
                         mk(static_cast<const float*>(q.data()) + from * H * d, {n, H, d})};
    std::vector<float> o(static_cast<std::size_t>(n * H * d));
    for (int c = 0; c < calls; ++c)
      lasp2::forward(b, comm, pl, la::no_decay{}, x, mk(o.data(), {n, H, d}), {}, {}, ws.span());
    mine[1] = comm.counts().collectives.load();
  });
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    const auto& mine = seen[static_cast<std::size_t>(r)];
    CHECK(mine[0] == 1);          // the agreement, in make_plan
    CHECK(mine[1] == 1 + calls);  // one exchange per call, no agreement
    CHECK(mine[2] == r);
    CHECK(mine[3] == 3);
    CHECK(mine[4] == 3);
  }
}

TEST_CASE("linear_attention::lasp2: one plan shared by two threads gives the bits of fresh plans",
          "[linear_attention][lasp2][plan]") {
  // Two independent groups of 2 ranks (one per thread pair) share each rank's const plan.
  const index_t T = 64, H = 2, dk = 8, dv = 4;
  const auto p = loom::test::la::make_problem(T, H, dk, dv, gating::scalar, {0, 20, T}, true, 81);
  const std::vector<float> q(p.q.begin(), p.q.end()), k(p.k.begin(), p.k.end()), v(p.v.begin(), p.v.end()),
      lg(p.lg.begin(), p.lg.end());
  const std::vector<index_t> splits{0, 40, T};
  auto forward_on = [&](auto& comm, const lasp2::plan<loom::fp32>& pl, std::vector<float>& o) {
    const index_t from = splits[static_cast<std::size_t>(comm.rank())], n = pl.tokens();
    const la::operands x{mk(q.data() + from * H * dk, {n, H, dk}), mk(k.data() + from * H * dk, {n, H, dk}),
                         mk(v.data() + from * H * dv, {n, H, dv})};
    loom::workspace_buffer ws(pl.forward_workspace_bytes());
    o.assign(static_cast<std::size_t>(n * H * dv), 0.f);
    lasp2::forward(loom::serial{}, comm, pl, la::scalar_gate<float>{mk(lg.data() + from * H, {n, H})}, x,
                   mk(o.data(), {n, H, dv}), {}, {}, ws.span());
  };
  std::vector<std::vector<float>> fresh(2), shared_a(2), shared_b(2);
  loom::comm::run_local(2, [&](loom::comm::local& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const auto pl =
        lasp2::make_plan(loom::serial{}, comm, docs_of(p.cu), splits[r], {splits[r + 1] - splits[r], H, dk, dv});
    forward_on(comm, pl, fresh[r]);
    // Split into two communicators of the same size and rank and run one forward on each from two threads.
    auto ca = comm.split(0, comm.rank()), cb = comm.split(0, comm.rank());
    std::thread t([&] { forward_on(cb, pl, shared_b[r]); });
    forward_on(ca, pl, shared_a[r]);
    t.join();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(shared_a[r] == fresh[r]);
    CHECK(shared_b[r] == fresh[r]);
  }
}

TEST_CASE("linear_attention::lasp2 rejects views and workspaces that do not fit the plan",
          "[linear_attention][errors]") {
  const index_t T = 10, H = 2, d = 3;
  std::vector<float> q(T * H * d, 0.5f), o(T * H * d), st(2 * H * d * d), xin(H * d * d);
  const std::vector<index_t> cu{0, 4, T};
  using loom::errc;
  loom::comm::run_local(2, [&](loom::comm::local& comm) {
    const loom::openmp b{.threads = 1};
    const index_t from = comm.rank() == 0 ? 0 : 6, n = comm.rank() == 0 ? 6 : 4;
    const auto pl = lasp2::make_plan(b, comm, docs_of(cu), from, {n, H, d, d});
    loom::workspace_buffer ws(pl.workspace_bytes() + loom::workspace_alignment);
    const auto wsp = ws.span().first(pl.workspace_bytes());
    auto ops = [&](index_t t, index_t h, index_t dk, index_t dv) {
      return la::operands<loom::fp32>{mk(static_cast<const float*>(q.data()), {t, h, dk}),
                                      mk(static_cast<const float*>(q.data()), {t, h, dk}),
                                      mk(static_cast<const float*>(q.data()), {t, h, dv})};
    };
    const auto good = ops(n, H, d, d);
    const auto ov = mk(o.data(), {n, H, d});
    // Every rank passes the same kind of bad argument, so every rank throws before the exchange.
    auto fwd = [&](const la::operands<loom::fp32>& x, loom::tensor_view<float, 3> out,
                   loom::tensor_view<float, 4> fin = {}, std::span<std::byte> w = {}) {
      lasp2::forward(b, comm, pl, la::no_decay{}, x, out, fin, {}, w.empty() ? wsp : w);
    };
    require_error(
        [&] {
          fwd(ops(n + 1, H, d, d), mk(o.data(), {n + 1, H, d}));
        },
        errc::shape_mismatch,
        "lasp2::forward: q (the plan's [slice tokens, heads, dk]) must be [" + std::to_string(n) + ", 2, 3]");
    require_error(
        [&] {
          fwd(ops(n, 1, d, d), mk(o.data(), {n, 1, d}));
        },
        errc::shape_mismatch, "q (the plan's [slice tokens, heads, dk]) must be");
    require_error(
        [&] {
          fwd(ops(n, H, d, 2), mk(o.data(), {n, H, 2}));
        },
        errc::shape_mismatch, "v (the plan's [slice tokens, heads, dv]) must be");
    require_error(
        [&] {
          fwd(good, mk(o.data(), {n, H, 2}));
        },
        errc::shape_mismatch, "o (the plan's [slice tokens, heads, dv]) must be");
    require_error(
        [&] {
          fwd(good, ov, mk(st.data(), {1, H, d, d}));
        },
        errc::shape_mismatch, "final_state: expected extents [2, 2, 3, 3]");
    auto with_init = good;
    with_init.initial_state = mk(static_cast<const float*>(st.data()), {1, H, d, d});
    require_error([&] { fwd(with_init, ov); }, errc::shape_mismatch,
                  "initial_state (the plan's [docs, heads, dk, dv]) must be [2, 2, 3, 3]");
    require_error(
        [&] {
          lasp2::forward(b, comm, pl, la::no_decay{}, good, ov, {}, mk(xin.data(), {H, d, 2}), wsp);
        },
        errc::shape_mismatch, "incoming_state must be");
    // Non-contiguous states (read as [docs, H, dk, dv] / [H, dk, dv] blocks).
    auto strided_init = good;
    strided_init.initial_state = loom::tensor_view<const float, 4>(st.data(), {2, H, d, d}, {H * d * d, d * d, 1, d});
    require_error([&] { fwd(strided_init, ov); }, errc::shape_mismatch,
                  "lasp2::forward: initial_state: expected a contiguous view");
    require_error(
        [&] {
          lasp2::forward(b, comm, pl, la::no_decay{}, good, ov, {},
                         loom::tensor_view<float, 3>(xin.data(), {H, d, d}, {1, H * d, H}), wsp);
        },
        errc::shape_mismatch, "lasp2::forward: incoming_state: expected a contiguous view");
    // Workspaces: too small (the forward's size for the backward too), misaligned.
    require_error([&] { fwd(good, ov, {}, ws.span().first(pl.forward_workspace_bytes() - 1)); }, errc::invalid_argument,
                  "lasp2::forward: workspace must hold at least");
    require_error([&] { fwd(good, ov, {}, ws.span().subspan(8, pl.forward_workspace_bytes())); },
                  errc::invalid_argument, "lasp2::forward: workspace must start on a 64-byte boundary");
    std::vector<float> g1(q.size()), g2(q.size()), g3(q.size());
    const la::gradients<loom::fp32> gr{mk(g1.data(), {n, H, d}), mk(g2.data(), {n, H, d}), mk(g3.data(), {n, H, d})};
    const auto dov = mk(static_cast<const float*>(o.data()), {n, H, d});
    const auto xc = mk(static_cast<const float*>(xin.data()), {H, d, d});
    REQUIRE(pl.forward_workspace_bytes() < pl.backward_workspace_bytes());
    require_error(
        [&] {
          lasp2::backward(b, comm, pl, la::no_decay{}, good, dov, {}, xc, gr,
                          ws.span().first(pl.forward_workspace_bytes()));
        },
        errc::invalid_argument, "lasp2::backward: workspace must hold at least");
    require_error(
        [&] {
          lasp2::backward(b, comm, pl, la::no_decay{}, good, mk(static_cast<const float*>(o.data()), {n, H, 2}), {}, xc,
                          gr, wsp);
        },
        errc::shape_mismatch, "d_o (the plan's [slice tokens, heads, dv]) must be");
    require_error(
        [&] {
          lasp2::backward(b, comm, pl, la::no_decay{}, good, dov,
                          loom::tensor_view<const float, 4>(st.data(), {2, H, d, d}, {1, 2, 2 * H, 2 * H * d}), xc, gr,
                          wsp);
        },
        errc::shape_mismatch, "d_final_state: expected a contiguous view");
    // The same plan on another rank count.
    require_error(
        [&] {
          auto sub = comm.split(comm.rank(), 0);  // a communicator of one rank
          lasp2::forward(b, sub, pl, la::no_decay{}, good, ov, {}, {}, wsp);
        },
        errc::invalid_argument, "plan: made for rank " + std::to_string(comm.rank()) + " of 2, used on rank 0 of 1");
    // Every rank took part in no exchange above; the valid calls run together.
    lasp2::forward(b, comm, pl, la::no_decay{}, good, ov, {}, mk(xin.data(), {H, d, d}), wsp);
    lasp2::backward(b, comm, pl, la::no_decay{}, good, dov, {}, xc, gr, wsp);
  });
  // Made for a slice outside the sequence, or for rank 0 not starting at 0: every rank throws.
  require_error(
      [&] {
        loom::comm::run_local(1, [&](loom::comm::local& comm) {
          (void)lasp2::make_plan(loom::serial{}, comm, docs_of(cu), 0, {T + 1, H, d, d});
        });
      },
      errc::invalid_argument, "token_begin: expected the slice");
  require_error(
      [&] {
        loom::comm::run_local(2, [&](loom::comm::local& comm) {
          (void)lasp2::make_plan(loom::serial{}, comm, docs_of(cu), comm.rank() == 0 ? 1 : 6,
                                 {comm.rank() == 0 ? 5 : 4, H, d, d});
        });
      },
      errc::invalid_argument, "expected rank 0 to start at token 0");
}
