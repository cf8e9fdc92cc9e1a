// Ulysses and hybrid Ulysses x ring sequence parallel attention over comm::local, forward and
// backward, against the fp64 oracle: uneven sequence shards (T = 1021), uneven head splits,
// GQA/MQA with fewer kv heads than ranks, packed documents, causal and full, fp64/fp32/bf16;
// communication volume through a counting communicator; the planner's tables; rejections.

#include <loom/attention/hybrid.hpp>
#include <loom/attention/planner.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>

#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "oracle.hpp"

using loom::index_t;
namespace la = loom::attention;
namespace lu = loom::attention::ulysses;
namespace lh = loom::attention::hybrid;
namespace lt = loom::test;
namespace shard = loom::shard;

namespace {

// Counts what each rank sends to other ranks: point-to-point payload and its blocks of
// all_to_all(v) (agreement checks, all_gather, are not payload).
using counting = loom::comm::counting<loom::comm::local>;
long sent(const counting& c) { return static_cast<long>(c.counts().bytes_out + c.counts().scattered_out); }

using global_inputs = lt::sharded_inputs;
const auto make_global = lt::make_inputs_for;

struct sp_result {
  std::vector<double> out, lse, dq, dk, dv;
  std::vector<long> fwd_bytes, bwd_bytes;  // per rank
};

// A method: tokens(r), scatter/gather of rows, and the calls on one rank.
template <class T>
struct rank_io {
  index_t n;
  std::vector<T> q, k, v, dout, out, dq, dk, dv;
  std::vector<la::accum_t<T>> lse;
};

template <class T, class Plan>
rank_io<T> take_rows(const Plan& plan, int r, const global_inputs& g) {
  const auto& s = g.s;
  rank_io<T> io;
  io.n = plan.tokens(r);
  auto rows = [&](const std::vector<double>& global, index_t row) {
    std::vector<double> local(static_cast<std::size_t>(io.n * row));
    plan.scatter(r, std::span<const double>(global), row, std::span<double>(local));
    return std::vector<T>(local.begin(), local.end());
  };
  io.q = rows(g.q, s.hq * s.dk);
  io.k = rows(g.k, s.hkv * s.dk);
  io.v = rows(g.v, s.hkv * s.dv);
  io.dout = rows(g.dout, s.hq * s.dv);
  io.out.assign(static_cast<std::size_t>(io.n * s.hq * s.dv), T(0));
  io.lse.assign(static_cast<std::size_t>(io.n * s.hq), 0);
  io.dq.assign(io.q.size(), T(0));
  io.dk.assign(io.k.size(), T(0));
  io.dv.assign(io.v.size(), T(0));
  return io;
}

// The shard::plan viewed through the interface of hybrid::plan (tokens, scatter, gather).
struct seq_plan {
  const shard::plan* p;
  index_t tokens(int r) const { return p->rank(r).tokens; }
  void scatter(int r, std::span<const double> g, index_t row, std::span<double> l) const { p->scatter(r, g, row, l); }
  void gather(int r, std::span<const double> l, index_t row, std::span<double> g) const { p->gather(r, l, row, g); }
};

// Runs `fwd` and, when bwd, `bwd_fn` on p in-process ranks; gathers global results.
template <class T, class Plan, class Fwd, class Bwd>
sp_result run(const global_inputs& g, int p, const Plan& plan, bool bwd, Fwd fwd, Bwd bwd_fn) {
  using Acc = la::accum_t<T>;
  const auto& s = g.s;
  sp_result res;
  res.out.assign(g.want.out.size(), 0.0);
  res.lse.assign(g.want.lse.size(), 0.0);
  res.dq.assign(g.q.size(), 0.0);
  res.dk.assign(g.k.size(), 0.0);
  res.dv.assign(g.v.size(), 0.0);
  res.fwd_bytes.assign(static_cast<std::size_t>(p), 0);
  res.bwd_bytes.assign(static_cast<std::size_t>(p), 0);
  std::mutex mu;
  const la::options opt{s.causal, s.window, s.scale};
  loom::comm::run_local(p, [&](loom::comm::local& lc) {
    counting comm(lc);
    const int r = comm.rank();
    auto io = take_rows<T>(plan, r, g);
    const index_t n = io.n;
    const loom::tensor_view<const T, 3> qv(io.q.data(), {n, s.hq, s.dk}), kv(io.k.data(), {n, s.hkv, s.dk}),
        vv(io.v.data(), {n, s.hkv, s.dv});
    fwd(comm, qv, kv, vv, loom::tensor_view<T, 3>(io.out.data(), {n, s.hq, s.dv}),
        loom::tensor_view<Acc, 2>(io.lse.data(), {n, s.hq}), opt);
    res.fwd_bytes[static_cast<std::size_t>(r)] = sent(comm);
    if (bwd) {
      bwd_fn(comm, qv, kv, vv, loom::tensor_view<const T, 3>(io.out.data(), {n, s.hq, s.dv}),
             loom::tensor_view<const Acc, 2>(io.lse.data(), {n, s.hq}),
             loom::tensor_view<const T, 3>(io.dout.data(), {n, s.hq, s.dv}),
             loom::tensor_view<T, 3>(io.dq.data(), {n, s.hq, s.dk}),
             loom::tensor_view<T, 3>(io.dk.data(), {n, s.hkv, s.dk}),
             loom::tensor_view<T, 3>(io.dv.data(), {n, s.hkv, s.dv}), opt);
      res.bwd_bytes[static_cast<std::size_t>(r)] = sent(comm) - res.fwd_bytes[static_cast<std::size_t>(r)];
    }
    auto widen = [](const auto& x) {
      std::vector<double> w(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) w[i] = static_cast<double>(x[i]);
      return w;
    };
    std::lock_guard<std::mutex> lock(mu);
    auto put = [&](const auto& x, index_t row, std::vector<double>& global) {
      const auto w = widen(x);
      plan.gather(r, std::span<const double>(w), row, std::span<double>(global));
    };
    put(io.out, s.hq * s.dv, res.out);
    put(io.lse, s.hq, res.lse);
    if (bwd) {
      put(io.dq, s.hq * s.dk, res.dq);
      put(io.dk, s.hkv * s.dk, res.dk);
      put(io.dv, s.hkv * s.dv, res.dv);
    }
  });
  return res;
}

template <class T = double>
sp_result run_ulysses(const global_inputs& g, int p, const shard::plan& plan, bool bwd) {
  const lu::plan up(plan, {g.s.hq, g.s.hkv, g.s.dk, g.s.dv});
  return run<T>(
      g, p, seq_plan{&plan}, bwd,
      [&](counting& c, auto q, auto k, auto v, auto o, auto l, const la::options& opt) {
        std::vector<std::max_align_t> ws(up.workspace_bytes<T>() / sizeof(std::max_align_t) + 1);
        lu::forward(loom::serial{}, c, up, q, k, v, o, l, opt, std::as_writable_bytes(std::span(ws)));
      },
      [&](counting& c, auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk, auto dv,
          const la::options& opt) { lu::backward(loom::serial{}, c, plan, q, k, v, o, l, d, dq, dk, dv, opt); });
}

template <class T = double, class S = shard::zigzag>
sp_result run_hybrid(const global_inputs& g, lh::grid gd, bool bwd, const lh::plan** out_plan = nullptr) {
  static std::vector<std::unique_ptr<lh::plan>> keep;
  keep.push_back(
      std::make_unique<lh::plan>(std::span<const index_t>(g.cu), gd, S{}, lu::shape{g.s.hq, g.s.hkv, g.s.dk, g.s.dv}));
  const lh::plan& hp = *keep.back();
  if (out_plan) *out_plan = &hp;
  return run<T>(
      g, gd.ulysses * gd.ring, hp, bwd,
      [&](counting& c, auto q, auto k, auto v, auto o, auto l, const la::options& opt) {
        lh::forward(loom::serial{}, c, hp, q, k, v, o, l, opt);
      },
      [&](counting& c, auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk, auto dv,
          const la::options& opt) { lh::backward(loom::serial{}, c, hp, q, k, v, o, l, d, dq, dk, dv, opt); });
}

void check(const sp_result& got, const global_inputs& g, bool bwd, lt::tolerance tol, const char* what) {
  INFO(what);
  lt::require_close(got.out, g.want.out, tol, "out");
  std::vector<double> a = got.lse, b = g.want.lse;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::isinf(b[i])) {
      REQUIRE(std::isinf(a[i]));
      a[i] = b[i] = 0;
    }
  lt::require_close(a, b, tol, "lse");
  if (!bwd) return;
  lt::require_close(got.dq, g.want.dq, tol, "dq");
  lt::require_close(got.dk, g.want.dk, tol, "dk");
  lt::require_close(got.dv, g.want.dv, tol, "dv");
}

template <class S>
shard::plan plan_of(const std::vector<index_t>& cu, int p) {
  return shard::make_plan(std::span<const index_t>(cu), p, S{});
}

const std::vector<index_t> docs{0, 1, 8, 138, 141, 1021};  // lengths 1, 7, 130, 3, 880: T = 1021 (prime)

}  // namespace

TEST_CASE("ulysses: fp64 equals the oracle, P = 2..8, heads 8/12/5 with kv heads 1, 2, 4", "[attention][ulysses]") {
  const lt::tolerance tol{1e-10, 1e-10};
  struct cfg {
    index_t hq, hkv;
    bool causal;
    std::vector<int> ps;
  };
  const std::vector<cfg> cfgs{{8, 2, true, {2, 3, 4, 6, 8}},
                              {8, 1, false, {3, 8}},
                              {12, 4, true, {2, 3, 4, 6, 8}},
                              {5, 1, true, {2, 3, 4}},
                              {12, 2, false, {8}}};
  std::uint64_t seed = 400;
  for (const auto& c : cfgs) {
    const auto g = make_global({0, 0, c.hq, c.hkv, 8, 8, c.causal}, docs, seed += 10);
    for (int p : c.ps) {
      INFO("heads " << c.hq << "/" << c.hkv << ", P = " << p << ", causal " << c.causal);
      const bool zig = p % 2 == 1;
      const auto plan = zig ? plan_of<shard::zigzag>(docs, p) : plan_of<shard::contiguous>(docs, p);
      check(run_ulysses(g, p, plan, true), g, true, tol, "ulysses");
    }
  }
}

TEST_CASE("hybrid: fp64 equals the oracle, U x R in {2x2, 2x3, 4x2, 3x2}, every ring sharding", "[attention][hybrid]") {
  const lt::tolerance tol{1e-10, 1e-10};
  const auto g8 = make_global({0, 0, 8, 2, 8, 8, true}, docs, 500);
  const auto g12 = make_global({0, 0, 12, 4, 8, 8, false}, docs, 510);
  const auto g5 = make_global({0, 0, 5, 1, 8, 8, true}, docs, 520);
  for (lh::grid gd : {lh::grid{2, 2}, lh::grid{2, 3}, lh::grid{4, 2}, lh::grid{3, 2}}) {
    INFO("U x R = " << gd.ulysses << " x " << gd.ring);
    const lh::plan* hp = nullptr;
    const auto r8 = run_hybrid(g8, gd, true, &hp);
    check(r8, g8, true, tol, "8/2 heads causal zigzag");
    for (int r = 0; r < gd.ulysses * gd.ring; ++r) {  // the sum of the parts
      const auto want = hp->bytes_sent(r, sizeof(double), sizeof(double), sizeof(double));
      CHECK(r8.fwd_bytes[static_cast<std::size_t>(r)] == static_cast<long>(want.forward));
      CHECK(r8.bwd_bytes[static_cast<std::size_t>(r)] == static_cast<long>(want.backward));
    }
    check(run_hybrid<double, shard::per_document>(g12, gd, true), g12, true, tol, "12/4 heads full per_document");
    if (gd.ulysses <= 5)
      check(run_hybrid<double, shard::contiguous>(g5, gd, true), g5, true, tol, "5/1 heads causal contiguous");
  }
}

TEST_CASE("ulysses and hybrid: fp32 and bf16 storage", "[attention][ulysses][hybrid]") {
  const auto g = make_global({0, 0, 8, 2, 16, 16, true}, docs, 600);
  check(run_ulysses<float>(g, 4, plan_of<shard::contiguous>(docs, 4), true), g, true, {2e-5, 2e-5}, "fp32 ulysses");
  check(run_ulysses<loom::bfloat16>(g, 3, plan_of<shard::zigzag>(docs, 3), true), g, true, {2e-2, 2e-2},
        "bf16 ulysses");
  check(run_hybrid<float>(g, {2, 2}, true), g, true, {2e-5, 2e-5}, "fp32 hybrid");
  check(run_hybrid<loom::bfloat16>(g, {2, 3}, false), g, false, {2e-2, 2e-2}, "bf16 hybrid");
}

TEST_CASE("ulysses: bytes moved follow the documented formula", "[attention][ulysses]") {
  // P | Hq, P | Hkv, P | T: every rank sends (P - 1) / P^2 T (Hq Dqk + Hkv (Dqk + Dv) + Hq Dv) b
  // plus (P - 1) / P^2 T Hq A of lse in the forward.
  const std::vector<index_t> even{0, 1000, 1024};
  const index_t hq = 8, hkv = 4, dk = 8, dv = 16, t = 1024;
  const int p = 4;
  const auto g = make_global({0, 0, hq, hkv, dk, dv, true}, even, 700);
  const auto plan = plan_of<shard::contiguous>(even, p);
  const auto res = run_ulysses<float>(g, p, plan, true);
  const long unit = (p - 1) * t / (p * p);
  const long fwd = unit * (hq * dk + hkv * (dk + dv) + hq * dv) * 4 + unit * hq * 4;
  const long bwd =
      unit * (hq * (dk + 2 * dv) + hkv * (dk + dv)) * 4 + unit * hq * 4 + unit * (hq * dk + hkv * (dk + dv)) * 4;
  const lu::plan up(plan, {hq, hkv, dk, dv});
  for (int r = 0; r < p; ++r) {
    CHECK(res.fwd_bytes[static_cast<std::size_t>(r)] == fwd);
    CHECK(res.bwd_bytes[static_cast<std::size_t>(r)] == bwd);
    CHECK(up.bytes_sent(r, 4, 4, 4).forward == static_cast<std::size_t>(fwd));
  }
  // Uneven: T = 1021 over 3 ranks, 5 q heads and 1 kv head (replicated on every rank).
  const auto g5 = make_global({0, 0, 5, 1, 8, 8, true}, docs, 710);
  const auto plan3 = plan_of<shard::zigzag>(docs, 3);
  const auto r5 = run_ulysses<double>(g5, 3, plan3, true);
  check(r5, g5, true, {1e-10, 1e-10}, "5/1 heads on 3 ranks");
  const lu::plan up3(plan3, {5, 1, 8, 8});
  for (int r = 0; r < 3; ++r) {
    const auto n = plan3.rank(r).tokens;
    const long q_other = 5 - up3.heads().q_count(r), hq_r = up3.heads().q_count(r);
    // q to the others' heads, the single kv head to both others, out and lse back
    const long want = n * (q_other * 8 + 2 * (8 + 8)) * 8 + (1021 - n) * hq_r * (8 * 8 + 8);
    CHECK(r5.fwd_bytes[static_cast<std::size_t>(r)] == want);
    CHECK(r5.bwd_bytes[static_cast<std::size_t>(r)] == static_cast<long>(up3.bytes_sent(r, 8, 8, 8).backward));
  }
}

TEST_CASE("ulysses and hybrid: deterministic run to run", "[attention][ulysses]") {
  const auto g = make_global({0, 0, 8, 1, 8, 8, true}, docs, 800);
  const auto plan = plan_of<shard::zigzag>(docs, 6);
  const auto a = run_ulysses<float>(g, 6, plan, true), b = run_ulysses<float>(g, 6, plan, true);
  REQUIRE(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(double)) == 0);
  REQUIRE(std::memcmp(a.dk.data(), b.dk.data(), a.dk.size() * sizeof(double)) == 0);
}

TEST_CASE("ulysses and hybrid: rejections", "[attention][ulysses][hybrid][errors]") {
  const std::vector<index_t> cu{0, 40};
  auto throws_with = [](auto f, loom::errc code, const std::string& text) {
    try {
      f();
    } catch (const loom::error& e) {
      CHECK(e.code() == code);
      CHECK_THAT(e.what(), Catch::Contains(text));
      return;
    }
    FAIL("no loom::error: " << text);
  };
  const auto plan2 = plan_of<shard::contiguous>(cu, 2);
  throws_with(
      [&] {
        lu::plan(plan2, {6, 4, 8, 8});
      },
      loom::errc::invalid_argument, "heads_q (6) must be a multiple of heads_kv (4)");
  throws_with(
      [&] {
        lu::plan(plan_of<shard::contiguous>(cu, 8), {4, 1, 8, 8});
      },
      loom::errc::invalid_argument, "needs ranks <= heads_q, got 8 ranks");
  throws_with(
      [&] {
        lh::plan(std::span<const index_t>(cu), {0, 2}, shard::zigzag{}, {4, 1, 8, 8});
      },
      loom::errc::invalid_argument, "grid dimensions must be >= 1");
  // U x R != P
  const lh::plan hp(std::span<const index_t>(cu), {2, 3}, shard::zigzag{}, {4, 1, 8, 8});
  std::atomic<int> refused{0};
  loom::comm::run_local(4, [&](loom::comm::local& comm) {
    try {
      (void)lh::split(comm, hp);
    } catch (const loom::error& e) {
      if (e.code() == loom::errc::invalid_argument &&
          std::string(e.what()).find("U x R = 2 x 3 = 6 must equal the communicator's size, 4") != std::string::npos)
        ++refused;
    }
  });
  CHECK(refused == 4);
  // ranks disagreeing on shapes: every rank refuses
  refused = 0;
  loom::comm::run_local(2, [&](loom::comm::local& comm) {
    const index_t n = plan2.rank(comm.rank()).tokens, hkv = comm.rank() == 0 ? 2 : 4;
    std::vector<double> q(static_cast<std::size_t>(n * 4 * 8)), k(static_cast<std::size_t>(n * hkv * 8)), out(q.size()),
        lse(static_cast<std::size_t>(n * 4));
    try {
      lu::forward(loom::serial{}, comm, plan2, loom::tensor_view<const double, 3>(q.data(), {n, 4, 8}),
                  loom::tensor_view<const double, 3>(k.data(), {n, hkv, 8}),
                  loom::tensor_view<const double, 3>(k.data(), {n, hkv, 8}),
                  loom::tensor_view<double, 3>(out.data(), {n, 4, 8}),
                  loom::tensor_view<double, 2>(lse.data(), {n, 4}));
    } catch (const loom::error& e) {
      if (e.code() == loom::errc::invalid_argument &&
          std::string(e.what()).find("ranks disagree on the shapes") != std::string::npos)
        ++refused;
    }
  });
  CHECK(refused == 2);
  // views not matching the plan, a short workspace
  const lu::plan up(plan2, {4, 2, 8, 8});
  loom::comm::run_local(2, [&](loom::comm::local& comm) {
    const index_t n = plan2.rank(comm.rank()).tokens;
    std::vector<double> q(static_cast<std::size_t>(n * 4 * 8)), out(q.size()), lse(static_cast<std::size_t>(n * 4));
    std::vector<std::max_align_t> ws(2);
    const loom::tensor_view<const double, 3> qv(q.data(), {n, 4, 8});
    std::string msg;
    try {
      lu::forward(loom::serial{}, comm, up, qv, qv, qv, loom::tensor_view<double, 3>(out.data(), {n, 4, 8}),
                  loom::tensor_view<double, 2>(lse.data(), {n, 4}), {}, std::as_writable_bytes(std::span(ws)));
    } catch (const loom::error& e) {
      msg = e.what();
    }
    if (comm.rank() == 0 && msg.find("the plan is for heads 4/2") == std::string::npos)
      throw std::runtime_error("expected a plan mismatch, got: " + msg);
    const lu::plan up4(plan2, {4, 4, 8, 8});
    try {
      lu::forward(loom::serial{}, comm, up4, qv, qv, qv, loom::tensor_view<double, 3>(out.data(), {n, 4, 8}),
                  loom::tensor_view<double, 2>(lse.data(), {n, 4}), {}, std::as_writable_bytes(std::span(ws)));
    } catch (const loom::error& e) {
      msg = e.what();
    }
    if (msg.find("the workspace holds 64 bytes, expected at least") == std::string::npos)
      throw std::runtime_error("expected a short workspace, got: " + msg);
  });
}

namespace lp = loom::attention::planner;

TEST_CASE("planner: Meta's pass-KV / pass-Q criterion with cached tokens", "[attention][planner]") {
  // Hq 128, Hkv 8 (threshold 2 Hkv / Hq = 12.5%), CP4, 128K tokens in all; F / BW = 25600 flop/byte
  // puts pass-KV's overlap point at T = P F Hkv e / (2 Hq BW) = 6400.
  const lp::machine m{400e12, 15.625e9};
  auto pick = [&](index_t t, const lp::machine& mm) {
    return lp::choose({t, 131072 - t, 128, 8, 128, 128, 4, 2, true}, mm);
  };
  CHECK(pick(3200, m).best.kind == lp::strategy::ring_pass_q);       // 2.5% miss: no overlap, Q smaller
  CHECK(pick(12800, m).best.kind == lp::strategy::ring_pass_kv);     // 10%: pass-KV hides behind compute
  const lp::machine fast{4000e12, 15.625e9};                         // overlap point 64000
  CHECK(pick(12800, fast).best.kind == lp::strategy::ring_pass_q);   // 9.8% < 12.5%
  CHECK(pick(20000, fast).best.kind == lp::strategy::ring_pass_kv);  // 15% > 12.5%: K/V smaller
  const auto c = pick(3200, m);
  CHECK_THAT(c.explain(), Catch::Contains("rule 1 (Meta CP)") && Catch::Contains("pass-Q because"));
}

TEST_CASE("planner: training shapes (ring, Ulysses, hybrid)", "[attention][planner]") {
  const lp::machine m{100e12, 25e9};
  // 128K tokens, GQA 32/8, P = 8: every ring step hides behind 22 ms of compute; Ulysses' all-to-all
  // (about 12 ms) does not.
  const auto a = lp::choose({131072, 0, 32, 8, 128, 128, 8, 2, true}, m);
  CHECK(a.best.kind == lp::strategy::ring_pass_kv);
  // 8K tokens, MHA 32/32: a ring step moves 16.8 MB (0.67 ms) against 86 us of compute; Ulysses
  // moves 29 MB once (1.2 ms).
  const auto b = lp::choose({8192, 0, 32, 32, 128, 128, 8, 2, true}, m);
  CHECK(b.best.kind == lp::strategy::ulysses);
  // 4 heads on 8 ranks: Ulysses cannot (P > heads_q); hybrid 4 x 2 moves the least exposed bytes.
  const auto c = lp::choose({8192, 0, 4, 4, 128, 128, 8, 2, true}, m);
  CHECK(c.best.kind == lp::strategy::hybrid);
  CHECK(c.best.ulysses == 4);
  CHECK(c.best.ring == 2);
  CHECK_THAT(c.explain(), Catch::Contains("P > heads_q"));
  // rejections
  CHECK_THROWS_WITH(lp::choose({8192, 0, 6, 4, 128, 128, 8, 2, true}, m),
                    Catch::Contains("heads_q (6) must be a positive multiple of heads_kv (4)"));
  CHECK_THROWS_WITH(lp::choose({8192, 0, 8, 4, 128, 128, 8, 2, true}, lp::machine{}),
                    Catch::Contains("the machine needs flops > 0 and link_bandwidth > 0"));
  // the measuring helper gives positive figures on every rank
  std::atomic<int> ok{0};
  loom::comm::run_local(2, [&](loom::comm::local& comm) {
    const auto mm = lp::measure(loom::serial{}, comm, 1 << 16);
    if (mm.flops > 0 && mm.link_bandwidth > 0) ++ok;
  });
  CHECK(ok == 2);
}

TEST_CASE("ulysses and hybrid: a non-finite input stays in its document on every rank",
          "[attention][ulysses][hybrid][nonfinite]") {
  // Document 1 crosses rank boundaries; one of its q, k, v or dout values is NaN or inf. Every
  // other document's out, lse and gradients are bitwise those of the clean run.
  const std::vector<index_t> cu{0, 40, 141, 163, 250};
  const auto clean = make_global({0, 0, 4, 2, 16, 16, true}, cu, 500);
  const auto& s = clean.s;
  const index_t t = 77;
  auto sweep = [&](auto runner, const char* name) {
    const auto ref = runner(clean);
    for (int which = 0; which < 4; ++which) {
      INFO(name << " input "
                << "qkvd"[which]);
      auto g = clean;
      const double bad = which % 2 ? std::numeric_limits<double>::infinity() : std::nan("");
      lt::poison(g, which, t, bad);
      const auto got = runner(g);
      lt::require_same_outside(got.out, ref.out, s.hq * s.dv, 40, 141, "out");
      lt::require_same_outside(got.lse, ref.lse, s.hq, 40, 141, "lse");
      lt::require_same_outside(got.dq, ref.dq, s.hq * s.dk, 40, 141, "dq");
      lt::require_same_outside(got.dk, ref.dk, s.hkv * s.dk, 40, 141, "dk");
      lt::require_same_outside(got.dv, ref.dv, s.hkv * s.dv, 40, 141, "dv");
      if (which == 0) CHECK(std::isnan(got.lse[t * s.hq + 1]));  // visible where it lands
      if (which == 1) CHECK(std::isnan(got.lse[140 * s.hq + 2]));
      if (which == 2) CHECK(!std::isfinite(got.out[(140 * s.hq + 2) * s.dv]));
      if (which == 3) CHECK(!std::isfinite(got.dq[(t * s.hq + 1) * s.dk]));
    }
  };
  for (int p : {2, 3})
    sweep([&](const global_inputs& g) { return run_ulysses<float>(g, p, plan_of<shard::zigzag>(cu, p), true); },
          p == 2 ? "ulysses P = 2" : "ulysses P = 3");
  sweep([&](const global_inputs& g) { return run_hybrid<float>(g, {2, 2}, true); }, "hybrid 2 x 2");
  sweep(
      [&](const global_inputs& g) {
        return run_hybrid<float, shard::per_document>(g, {2, 3}, true);
      },
      "hybrid 2 x 3");
}
