// Chunked linear attention, forward and backward, against the fp64 token-by-token oracle; one body
// swept over every backend by loom_add_backend_test (the cuda unit is compile-only).

#include <loom/linear_attention/chunked.hpp>

#include <support/allocations.hpp>
#include <support/backends.hpp>
#include <support/convert.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>
#include <support/vector_switch.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "oracle.hpp"

namespace la = loom::linear_attention;
using loom::index_t;
using loom::test::buffer;
using loom::test::make_backend;
using loom::test::workspace;
using loom::test::la::gating;
using loom::test::la::problem;
using loom::test::la::rounded;
using loom::test::la::scaled_tol;
using space = loom::backend_traits<loom::test::backend_under_test>::memory_space;

using loom::test::cast;
using loom::test::widen;

namespace {

template <class T, std::size_t R>
loom::tensor_view<T, R, space> mk(T* data, const index_t (&e)[R]) {
  std::array<index_t, R> a;
  for (std::size_t i = 0; i < R; ++i) a[i] = e[i];
  return loom::make_view<space>(data, a);
}

// The problem's documents as int64 offsets, or as an int32 copy (FlashAttention's convention), in
// the backend's memory (on the device stand-in: memory the host may not read, so make_plan reads
// them with a copy and a fence).
struct docs_of {
  buffer<std::int64_t> wide_offsets;
  buffer<std::int32_t> narrow;
  loom::segments<space> seg;
  docs_of(const std::vector<index_t>& cu, bool wide)
      : wide_offsets(cu), narrow(std::vector<std::int32_t>(cu.begin(), cu.end())) {
    const index_t n = static_cast<index_t>(cu.size());
    seg = wide ? loom::segments<space>(mk(static_cast<const std::int64_t*>(wide_offsets.data()), {n}))
               : loom::segments<space>(mk(static_cast<const std::int32_t*>(narrow.data()), {n}));
  }
};

struct run_result {
  std::vector<double> o, fin, dq, dk, dv, dlg, dinit;
};

//! Runs loom's chunked forward (and backward when d_o is non-empty) on the backend under test.
template <class P>
run_result run(const problem& p, index_t chunk, const std::vector<double>& d_o = {},
               const std::vector<double>& dfin = {}, la::options opt = {}) {
  const docs_of offsets(p.cu, chunk % 2 == 0);  // int64 offsets for even chunks, int32 for odd
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const auto b = make_backend();
  const index_t T = p.T, H = p.H, docs = p.docs(), sz = p.dk * p.dv;
  buffer<S> q(cast<S>(p.q)), k(cast<S>(p.k)), v(cast<S>(p.v)), o(static_cast<std::size_t>(T * H * p.dv));
  buffer<A> lg(cast<A>(p.lg)), hlg(cast<A>(p.head_lg)), init(cast<A>(p.init)),
      fin(static_cast<std::size_t>(docs * H * sz));
  la::operands<P, space> x{mk(static_cast<const S*>(q.data()), {T, H, p.dk}),
                           mk(static_cast<const S*>(k.data()), {T, H, p.dk}),
                           mk(static_cast<const S*>(v.data()), {T, H, p.dv})};
  if (!p.init.empty()) x.initial_state = mk(static_cast<const A*>(init.data()), {docs, H, p.dk, p.dv});
  opt.chunk = chunk;
  opt.scale = p.scale;
  const auto fin_v = mk(fin.data(), {docs, H, p.dk, p.dv});
  const auto o_v = mk(o.data(), {T, H, p.dv});
  auto with_gating = [&](auto&& f) {
    if (p.mode == gating::none) return f(la::no_decay{});
    if (p.mode == gating::fixed) return f(la::fixed_decay<A, space>{mk(static_cast<const A*>(hlg.data()), {H})});
    return f(la::scalar_gate<A, space>{mk(static_cast<const A*>(lg.data()), {T, H})});
  };
  with_gating([&](const auto& g) { la::forward(b, offsets.seg, g, x, o_v, fin_v, opt); });
  run_result r{widen(o.to_host()), widen(fin.to_host()), {}, {}, {}, {}, {}};
  if (d_o.empty()) return r;
  buffer<S> dob(cast<S>(d_o)), dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
  buffer<A> dfb(cast<A>(dfin)), dlg(static_cast<std::size_t>(T * H)), dinit(static_cast<std::size_t>(docs * H * sz));
  la::gradients<P, space> g{mk(dq.data(), {T, H, p.dk}), mk(dk.data(), {T, H, p.dk}), mk(dv.data(), {T, H, p.dv})};
  g.d_initial_state = mk(dinit.data(), {docs, H, p.dk, p.dv});
  if (p.mode == gating::scalar) g.d_log_gate = mk(dlg.data(), {T, H});
  loom::tensor_view<const A, 4, space> dfin_v;
  if (!dfin.empty()) dfin_v = mk(static_cast<const A*>(dfb.data()), {docs, H, p.dk, p.dv});
  const auto dov = mk(static_cast<const S*>(dob.data()), {T, H, p.dv});
  with_gating([&](const auto& gt) { la::backward(b, offsets.seg, gt, x, dov, dfin_v, g, opt); });
  r.dq = widen(dq.to_host()), r.dk = widen(dk.to_host()), r.dv = widen(dv.to_host());
  r.dinit = widen(dinit.to_host());
  if (p.mode == gating::scalar) r.dlg = widen(dlg.to_host());
  return r;
}

//! Runs the plan form of the forward with the plan's path and head group set by hand.
template <class P>
run_result run_plan(const problem& p, index_t chunk, bool fused, index_t group) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const auto b = make_backend();
  const index_t T = p.T, H = p.H, docs = p.docs(), sz = p.dk * p.dv;
  buffer<S> q(cast<S>(p.q)), k(cast<S>(p.k)), v(cast<S>(p.v)), o(static_cast<std::size_t>(T * H * p.dv));
  buffer<A> lg(cast<A>(p.lg)), hlg(cast<A>(p.head_lg)), init(cast<A>(p.init)),
      fin(static_cast<std::size_t>(docs * H * sz));
  la::operands<P, space> x{mk(static_cast<const S*>(q.data()), {T, H, p.dk}),
                           mk(static_cast<const S*>(k.data()), {T, H, p.dk}),
                           mk(static_cast<const S*>(v.data()), {T, H, p.dv})};
  if (!p.init.empty()) x.initial_state = mk(static_cast<const A*>(init.data()), {docs, H, p.dk, p.dv});
  const auto pl = la::make_plan<P>(b, docs_of(p.cu, true).seg, {T, H, p.dk, p.dv},
                                   {.chunk = chunk, .scale = p.scale, .fused = fused, .head_group = group});
  REQUIRE(pl.fused() == fused);
  REQUIRE(pl.head_group() == group);
  workspace ws(pl.forward_workspace_bytes());
  const std::span<std::byte> wsp = ws.span();
  const auto fin_v = mk(fin.data(), {docs, H, p.dk, p.dv});
  const auto o_v = mk(o.data(), {T, H, p.dv});
  if (p.mode == gating::none)
    la::forward(b, pl, la::no_decay{}, x, o_v, fin_v, wsp);
  else if (p.mode == gating::fixed)
    la::forward(b, pl, la::fixed_decay<A, space>{mk(static_cast<const A*>(hlg.data()), {H})}, x, o_v, fin_v, wsp);
  else
    la::forward(b, pl, la::scalar_gate<A, space>{mk(static_cast<const A*>(lg.data()), {T, H})}, x, o_v, fin_v, wsp);
  return {widen(o.to_host()), widen(fin.to_host()), {}, {}, {}, {}, {}};
}

template <class P>
void check_forward(const problem& p0, index_t chunk, const std::string& what) {
  const problem p = rounded<P>(p0);
  const auto want = loom::test::la::oracle(p);
  const auto got = run<P>(p, chunk);
  loom::test::require_close(got.o, want.o, scaled_tol<P>(want.o), what + " o");
  loom::test::require_close(got.fin, want.fin, scaled_tol<P>(want.fin), what + " final state");
}

template <class P>
void check_backward(const problem& p0, index_t chunk, const std::string& what) {
  const problem p = rounded<P>(p0);
  const auto d_o =
      rounded<P>(p0).q.size() ? loom::test::uniform<double>(p.T * p.H * p.dv, -1, 1, 77) : std::vector<double>{};
  const auto dfin = loom::test::uniform<double>(p.docs() * p.H * p.dk * p.dv, -1, 1, 78);
  const auto dor = widen(cast<typename P::storage_type>(d_o));
  const auto dfr = widen(cast<typename P::accum_type>(dfin));
  const auto want = loom::test::la::oracle(p, &dor, &dfr);
  const auto got = run<P>(p, chunk, d_o, dfin);
  loom::test::la::require_gradients_close<P>(got, want, p.mode == gating::scalar, what);
}

const char* name(gating g) {
  return g == gating::none ? "no_decay" : g == gating::fixed ? "fixed_decay" : "scalar_gate";
}

}  // namespace

TEST_CASE("linear_attention::forward matches the recurrent oracle", "[linear_attention][forward]" LOOM_BACKEND_TAG) {
  const loom::test::vector_switch switched(GENERATE(true, false));  // host x86: AVX2 tiles, then portable
  const index_t T = GENERATE(as<index_t>{}, 1, 2, 63, 64, 65);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const bool packed = GENERATE(false, true);
  const auto cu =
      packed ? loom::test::la::random_docs(T, 4, static_cast<std::uint64_t>(T)) : std::vector<index_t>{0, T};
  const auto p = loom::test::la::make_problem(T, 2, 8, 4, mode, cu, packed, 10 + static_cast<std::uint64_t>(T));
  for (index_t chunk : {index_t{1}, index_t{7}, index_t{16}, index_t{64}}) {
    const std::string what = std::string(name(mode)) + " T=" + std::to_string(T) + " C=" + std::to_string(chunk);
    check_forward<loom::fp64>(p, chunk, what + " fp64");
    check_forward<loom::fp32>(p, chunk, what + " fp32");
    check_forward<loom::bf16>(p, chunk, what + " bf16");
  }
}

TEST_CASE("linear_attention::forward on long packed sequences", "[linear_attention][forward][long]" LOOM_BACKEND_TAG) {
  const index_t T = GENERATE(as<index_t>{}, 16323, 33753);
  const auto mode = GENERATE(gating::fixed, gating::scalar);
  const auto p = loom::test::la::make_problem(T, 1, 8, 8, mode, loom::test::la::random_docs(T, 5, 3), true, 20);
  check_forward<loom::fp64>(p, 64, std::string(name(mode)) + " fp64");
  check_forward<loom::fp32>(p, 100, std::string(name(mode)) + " fp32");
}

TEST_CASE("linear_attention: constant decay has the closed form (1 - a^(t+1)) / (1 - a)",
          "[linear_attention][closed_form]" LOOM_BACKEND_TAG) {
  const index_t T = 300, H = 8;
  problem p = loom::test::la::make_problem(T, H, 1, 1, gating::fixed, {0, T}, false, 1);
  p.scale = 1;
  std::fill(p.q.begin(), p.q.end(), 1.0), std::fill(p.k.begin(), p.k.end(), 1.0),
      std::fill(p.v.begin(), p.v.end(), 1.0);
  for (index_t h = 0; h < H; ++h) {  // LASP slopes: a_h = exp(-s_h), s_h = (2^(-8/H))^(h+1)
    p.head_lg[static_cast<std::size_t>(h)] = -std::pow(std::pow(2.0, -8.0 / H), static_cast<double>(h + 1));
    for (index_t t = 0; t < T; ++t) p.lg[static_cast<std::size_t>(t * H + h)] = p.head_lg[static_cast<std::size_t>(h)];
  }
  const auto got = run<loom::fp64>(p, 64);
  std::vector<double> want(got.o.size());
  for (index_t t = 0; t < T; ++t)
    for (index_t h = 0; h < H; ++h) {
      const double a = std::exp(p.head_lg[static_cast<std::size_t>(h)]);
      want[static_cast<std::size_t>(t * H + h)] = (1 - std::pow(a, static_cast<double>(t + 1))) / (1 - a);
    }
  loom::test::require_close(got.o, want, {1e-12, 1e-12}, "closed form");
}

TEST_CASE("linear_attention: small integers without decay are exact in fp32 for every chunk size",
          "[linear_attention][exact]" LOOM_BACKEND_TAG) {
  const index_t T = 203, H = 2, d = 4;
  problem p = loom::test::la::make_problem(T, H, d, d, gating::none, {0, 50, 50, 51, 203}, false, 3);
  p.scale = 1;
  p.q = widen(loom::test::small_integers<float>(T * H * d, -2, 2, 1));
  p.k = widen(loom::test::small_integers<float>(T * H * d, -2, 2, 2));
  p.v = widen(loom::test::small_integers<float>(T * H * d, -2, 2, 3));
  const auto want = loom::test::la::oracle(p);
  for (index_t chunk : {1, 3, 16, 64, 256}) {
    const auto got = run<loom::fp32>(p, chunk);
    REQUIRE(got.o == want.o);
    REQUIRE(got.fin == want.fin);
  }
}

TEST_CASE("linear_attention::backward matches the analytic oracle", "[linear_attention][backward]" LOOM_BACKEND_TAG) {
  const loom::test::vector_switch switched(GENERATE(true, false));  // host x86: AVX2 tiles, then portable
  const index_t T = GENERATE(as<index_t>{}, 1, 2, 63, 65, 200);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const auto p = loom::test::la::make_problem(T, 2, 8, 4, mode, loom::test::la::random_docs(T, 3, 5), true, 30);
  for (index_t chunk : {index_t{1}, index_t{16}, index_t{64}}) {
    const std::string what = std::string(name(mode)) + " T=" + std::to_string(T) + " C=" + std::to_string(chunk);
    check_backward<loom::fp64>(p, chunk, what + " fp64");
    check_backward<loom::fp32>(p, chunk, what + " fp32");
    check_backward<loom::bf16>(p, chunk, what + " bf16");
  }
}

TEST_CASE("linear_attention::forward: the fused and the chunk-parallel paths give the same bits for any head group",
          "[linear_attention][forward][paths]" LOOM_BACKEND_TAG) {
  const loom::test::vector_switch switched(GENERATE(true, false));
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const index_t T = 301, H = 5;
  const auto p = loom::test::la::make_problem(T, H, 8, 4, mode, loom::test::la::random_docs(T, 4, 9), true, 40);
  for (index_t chunk : {index_t{7}, index_t{64}}) {
    const auto ref = run_plan<loom::fp32>(p, chunk, false, 1);
    for (bool fused : {false, true})
      for (index_t group : {index_t{1}, index_t{2}, index_t{3}, index_t{5}}) {
        INFO(name(mode) << " C=" << chunk << " fused=" << fused << " group=" << group);
        const auto got = run_plan<loom::fp32>(p, chunk, fused, group);
        REQUIRE(got.o == ref.o);
        REQUIRE(got.fin == ref.fin);
      }
    check_forward<loom::fp32>(p, chunk, std::string(name(mode)) + " paths");
  }
}

TEST_CASE("linear_attention: forward and backward give the same bits with one lane or many (items in any order)",
          "[linear_attention][lanes]" LOOM_BACKEND_TAG) {
  // Host backends hand the items to the lanes from a shared counter, so which lane runs an item and
  // in what order changes from call to call; one lane runs every item in order.
  const auto mode = GENERATE(gating::fixed, gating::scalar);
  const index_t T = 389, H = 5;
  const auto p = loom::test::la::make_problem(T, H, 8, 4, mode, loom::test::la::random_docs(T, 4, 13), true, 41);
  const auto d_o = loom::test::uniform<double>(T * H * 4, -1, 1, 79);
  const auto dfin = loom::test::uniform<double>(p.docs() * H * 8 * 4, -1, 1, 80);
  for (bool fused : {false, true}) {
    const auto one = run<loom::fp32>(p, 16, d_o, dfin, {.lanes = 1, .fused = fused});
    for (index_t lanes : {index_t{2}, index_t{7}, index_t{64}})
      for (int call = 0; call < 2; ++call) {
        INFO(name(mode) << " fused=" << fused << " lanes=" << lanes << " call " << call);
        const auto got = run<loom::fp32>(p, 16, d_o, dfin, {.lanes = lanes, .fused = fused});
        REQUIRE(got.o == one.o);
        REQUIRE(got.fin == one.fin);
        REQUIRE(got.dq == one.dq);
        REQUIRE(got.dk == one.dk);
        REQUIRE(got.dv == one.dv);
        REQUIRE(got.dinit == one.dinit);
        REQUIRE(got.dlg == one.dlg);
      }
  }
}

TEST_CASE("linear_attention::forward with strong gates (decay factors evaluated per element)",
          "[linear_attention][forward][strong]" LOOM_BACKEND_TAG) {
  const auto mode = GENERATE(gating::fixed, gating::scalar);
  const index_t T = 200, H = 3;
  auto p = loom::test::la::make_problem(T, H, 8, 4, mode, {0, 70, 200}, true, 50);
  // Chunk log-decays far below -40: exp(b_i) exp(-b_j) would overflow, so every factor is an exp
  // of a difference <= 0; a mild head keeps the factored form in the same run.
  const auto strong = loom::test::uniform<double>(T * H, -6.0, -0.5, 51);
  for (index_t h = 0; h < H; ++h) {
    p.head_lg[static_cast<std::size_t>(h)] = h == 0 ? -0.01 : -1.5 * static_cast<double>(h);
    for (index_t t = 0; t < T; ++t)
      p.lg[static_cast<std::size_t>(t * H + h)] = mode == gating::fixed
                                                      ? p.head_lg[static_cast<std::size_t>(h)]
                                                      : (h == 0 ? -0.01 : strong[static_cast<std::size_t>(t * H + h)]);
  }
  for (index_t chunk : {index_t{16}, index_t{64}}) {
    const std::string what = std::string(name(mode)) + " strong C=" + std::to_string(chunk);
    check_forward<loom::fp64>(p, chunk, what + " fp64");
    check_forward<loom::fp32>(p, chunk, what + " fp32");
    check_backward<loom::fp64>(p, chunk, what + " fp64");
  }
}

namespace {

//! The buffers of one fp32 forward + backward with scalar gates, on the backend under test.
struct plan_io {
  index_t T, H, dk, dv, docs;
  buffer<float> q, k, v, lg, o, fin, dob, dq, dk_, dv_, dlg, dinit;
  explicit plan_io(const problem& p)
      : T(p.T),
        H(p.H),
        dk(p.dk),
        dv(p.dv),
        docs(p.docs()),
        q(cast<float>(p.q)),
        k(cast<float>(p.k)),
        v(cast<float>(p.v)),
        lg(cast<float>(p.lg)),
        o(static_cast<std::size_t>(T * H * dv)),
        fin(static_cast<std::size_t>(docs * H * dk * dv)),
        dob(loom::test::uniform<float>(T * H * dv, -1, 1, 501)),
        dq(p.q.size()),
        dk_(p.k.size()),
        dv_(p.v.size()),
        dlg(static_cast<std::size_t>(T * H)),
        dinit(static_cast<std::size_t>(docs * H * dk * dv)) {}
  template <class B>
  void run(const B& b, const la::plan<loom::fp32>& pl, std::span<std::byte> ws) {
    const la::operands x{mk(static_cast<const float*>(q.data()), {T, H, dk}),
                         mk(static_cast<const float*>(k.data()), {T, H, dk}),
                         mk(static_cast<const float*>(v.data()), {T, H, dv})};
    static_assert(std::is_same_v<decltype(x), const la::operands<loom::fp32, space>>);
    const la::scalar_gate<float, space> gate{mk(static_cast<const float*>(lg.data()), {T, H})};
    la::forward(b, pl, gate, x, mk(o.data(), {T, H, dv}), mk(fin.data(), {docs, H, dk, dv}), ws);
    const la::gradients g{mk(dq.data(), {T, H, dk}), mk(dk_.data(), {T, H, dk}), mk(dv_.data(), {T, H, dv}),
                          mk(dlg.data(), {T, H}), mk(dinit.data(), {docs, H, dk, dv})};
    la::backward(b, pl, gate, x, mk(static_cast<const float*>(dob.data()), {T, H, dv}), {}, g, ws);
  }
  std::vector<float> all() const {
    std::vector<float> r;
    for (const auto* x : {&o, &fin, &dq, &dk_, &dv_, &dlg, &dinit}) {
      const auto h = x->to_host();
      r.insert(r.end(), h.begin(), h.end());
    }
    return r;
  }
};

}  // namespace

TEST_CASE(
    "linear_attention plan form: allocates nothing, one plan reused across calls and threads gives the bits of "
    "fresh plans, int32 and int64 offsets agree",
    "[linear_attention][plan]" LOOM_BACKEND_TAG) {
  const auto b = make_backend();
  const index_t T = 157, H = 3;
  const auto p =
      loom::test::la::make_problem(T, H, 8, 4, gating::scalar, loom::test::la::random_docs(T, 4, 11), true, 90);
  const docs_of wide(p.cu, true), narrow(p.cu, false);
  const la::shape sh{T, H, 8, 4};
  const la::options opt{.chunk = 16};
  // Fresh plans, one per call, from int64 offsets.
  std::vector<float> want;
  {
    plan_io io(p);
    const auto pl = la::make_plan(b, wide.seg, sh, opt);
    workspace ws(pl.workspace_bytes());
    io.run(b, pl, ws.span());
    want = io.all();
  }
  // One plan from int32 offsets, one workspace, three calls: nothing allocated, the same bits.
  const auto pl = la::make_plan(b, narrow.seg, sh, opt);
  REQUIRE(pl.docs() == p.docs());
  REQUIRE(pl.workspace_bytes() >= pl.forward_workspace_bytes());
  REQUIRE(pl.workspace_bytes() >= pl.backward_workspace_bytes());
  workspace ws(pl.workspace_bytes());
  for (int call = 0; call < 3; ++call) {
    plan_io io(p);
    const auto counted = loom::test::count_allocations([&] { io.run(b, pl, ws.span()); });
    CHECK(counted.heap == 0);
    CHECK(counted.temporaries == 0);
    REQUIRE(io.all() == want);
  }
#if !defined(LOOM_TEST_BACKEND_CUDA) && !defined(LOOM_TEST_BACKEND_STANDIN)
  // One const plan shared by two threads, each with its own workspace and outputs.
  plan_io io0(p), io1(p);
  auto worker = [&](plan_io& io) {
    workspace mine(pl.workspace_bytes());
    for (int rep = 0; rep < 3; ++rep) io.run(loom::serial{}, pl, mine.span());
  };
  std::thread t0(worker, std::ref(io0)), t1(worker, std::ref(io1));
  t0.join();
  t1.join();
  REQUIRE(io0.all() == want);
  REQUIRE(io1.all() == want);
#endif
}

TEST_CASE("linear_attention::make_plan reads offsets in the backend's memory and checks every value",
          "[linear_attention][plan][errors]" LOOM_BACKEND_TAG) {
  const auto b = make_backend();
  const la::shape sh{40, 2, 8, 4};
  using loom::errc;
  for (const bool wide : {true, false}) {
    const auto pl = la::make_plan(b, docs_of({0, 17, 17, 40}, wide).seg, sh, {.chunk = 8});
    CHECK(pl.docs() == 3);
    CHECK(std::vector<index_t>(pl.offsets().begin(), pl.offsets().end()) == std::vector<index_t>{0, 17, 17, 40});
    CHECK(pl.chunks() == 3 + 3);  // 17 tokens in chunks of 8: 3, an empty document: 0, 23 tokens: 3
    loom::test::require_loom_error(
        [&] {
          (void)la::make_plan(b, docs_of({0, 17, 9, 40}, wide).seg, sh);
        },
        errc::invalid_argument, {"linear_attention::make_plan: cu_seqlens must be non-decreasing", "[2] = 9"});
    loom::test::require_loom_error(
        [&] {
          (void)la::make_plan(b, docs_of({0, 17, 39}, wide).seg, sh);
        },
        errc::invalid_argument, {"the last offset) must equal the token count 40"});
    loom::test::require_loom_error(
        [&] {
          (void)la::make_plan(b, docs_of({3, 17, 40}, wide).seg, sh);
        },
        errc::invalid_argument, {"cu_seqlens[0] must be 0, got 3"});
  }
}

TEST_CASE("linear_attention plan form rejects a too-small or misaligned workspace",
          "[linear_attention][plan][errors]" LOOM_BACKEND_TAG) {
  const auto b = make_backend();
  const index_t T = 40, H = 2;
  const auto p = loom::test::la::make_problem(T, H, 8, 4, gating::scalar, {0, 17, 40}, true, 91);
  plan_io io(p);
  const auto pl = la::make_plan(b, docs_of(p.cu, false).seg, {T, H, 8, 4}, {.chunk = 8});
  using loom::errc;
  {
    workspace ws(pl.forward_workspace_bytes() - 1);
    loom::test::require_loom_error([&] { io.run(b, pl, ws.span()); }, errc::invalid_argument,
                                   {"linear_attention::forward: workspace must hold at least"});
  }
  {
    workspace ws(pl.forward_workspace_bytes());
    loom::test::require_loom_error([&] { io.run(b, pl, ws.span(16)); }, errc::invalid_argument,
                                   {"linear_attention::forward: workspace must start on a 64-byte boundary"});
  }
  {  // enough for the forward, not for the backward
    workspace ws(pl.forward_workspace_bytes());
    REQUIRE(pl.forward_workspace_bytes() < pl.backward_workspace_bytes());
    loom::test::require_loom_error([&] { io.run(b, pl, ws.span()); }, errc::invalid_argument,
                                   {"linear_attention::backward: workspace must hold at least"});
  }
}
