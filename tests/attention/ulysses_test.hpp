// Ulysses and hybrid Ulysses x ring sequence parallel attention, forward and backward, against the
// fp64 oracle: uneven sequence shards (T = 1021), uneven head splits, GQA/MQA with fewer kv heads
// than ranks, packed documents, causal and full, fp64/fp32/bf16; communication volume through a
// counting communicator; the planner's tables; rejections. One body, run on host memory (serial,
// comm::local) and on the device stand-in (comm::standin): support/distributed.hpp.

#include <loom/attention/hybrid.hpp>
#include <loom/attention/planner.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>

#include <support/allocations.hpp>
#include <support/distributed.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/ranks.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "fused_reference.hpp"
#include "oracle.hpp"

using loom::index_t;
namespace la = loom::attention;
namespace lu = loom::attention::ulysses;
namespace lh = loom::attention::hybrid;
namespace lt = loom::test;
namespace shard = loom::shard;

namespace {

// What a rank sent to other ranks through its counted communicator (lt::counted): point-to-point
// payload and its blocks of all_to_all(v) (agreement checks, all_gather, are not payload).
template <class C>
long sent(const C& c) {
  return static_cast<long>(c.counts().bytes_out + c.counts().scattered_out);
}

using global_inputs = lt::sharded_inputs;
const auto make_global = lt::make_inputs_for;

template <class T>
using prec = loom::default_precision<T>;

struct sp_result {
  std::vector<double> out, lse, dq, dk, dv;
  std::vector<long> fwd_bytes, bwd_bytes;  // per rank
};

la::options opts_of(const lt::attn_shape& s) { return {s.causal, s.window, s.scale}; }

template <class T>
struct rank_io {
  index_t n;
  std::vector<T> q, k, v, dout, out, dq, dk, dv;
  std::vector<loom::accum_t<T>> lse;
  index_t hq = 0, hkv = 0, dk_ = 0, dv_ = 0;
  auto qv() const { return lt::dview_t<const T, 3>(q.data(), {n, hq, dk_}); }
  auto kv() const { return lt::dview_t<const T, 3>(k.data(), {n, hkv, dk_}); }
  auto vv() const { return lt::dview_t<const T, 3>(v.data(), {n, hkv, dv_}); }
  auto ov() { return lt::dview_t<T, 3>(out.data(), {n, hq, dv_}); }
  auto lv() { return lt::dview_t<loom::accum_t<T>, 2>(lse.data(), {n, hq}); }
  auto cov() const { return lt::dview_t<const T, 3>(out.data(), {n, hq, dv_}); }
  auto clv() const { return lt::dview_t<const loom::accum_t<T>, 2>(lse.data(), {n, hq}); }
  auto dov() const { return lt::dview_t<const T, 3>(dout.data(), {n, hq, dv_}); }
  auto dqv() { return lt::dview_t<T, 3>(dq.data(), {n, hq, dk_}); }
  auto dkv() { return lt::dview_t<T, 3>(dk.data(), {n, hkv, dk_}); }
  auto dvv() { return lt::dview_t<T, 3>(dv.data(), {n, hkv, dv_}); }
};

// Which rows every rank holds: a shard::plan (ring, Ulysses), or a plan with tokens(r), scatter
// and gather of its own (hybrid, sequence_parallel).
template <class Plan>
index_t rows_of(const Plan& p, int r) {
  if constexpr (requires { p.tokens().rank(r); })
    return p.tokens().rank(r).tokens;
  else
    return p.tokens(r);
}
template <class Plan>
void scatter_rows(const Plan& p, int r, std::span<const double> g, index_t row, std::span<double> l) {
  if constexpr (requires { p.tokens().rank(r); })
    p.tokens().scatter(r, g, row, l);
  else
    p.scatter(r, g, row, l);
}
template <class Plan>
void gather_rows(const Plan& p, int r, std::span<const double> l, index_t row, std::span<double> g) {
  if constexpr (requires { p.tokens().rank(r); })
    p.tokens().gather(r, l, row, g);
  else
    p.gather(r, l, row, g);
}

template <class T, class Plan>
rank_io<T> take_rows(const Plan& plan, int r, const global_inputs& g) {
  const auto& s = g.s;
  rank_io<T> io;
  io.n = rows_of(plan, r);
  io.hq = s.hq;
  io.hkv = s.hkv;
  io.dk_ = s.dk;
  io.dv_ = s.dv;
  auto rows = [&](const std::vector<double>& global, index_t row) {
    std::vector<double> local(static_cast<std::size_t>(io.n * row));
    scatter_rows(plan, r, std::span<const double>(global), row, std::span<double>(local));
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

template <class T, class Plan>
void put_rows(const Plan& plan, int r, const global_inputs& g, const rank_io<T>& io, bool bwd, sp_result& res) {
  const auto& s = g.s;
  auto put = [&](const auto& x, index_t row, std::vector<double>& global) {
    std::vector<double> w(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) w[i] = static_cast<double>(x[i]);
    gather_rows(plan, r, std::span<const double>(w), row, std::span<double>(global));
  };
  put(io.out, s.hq * s.dv, res.out);
  put(io.lse, s.hq, res.lse);
  if (bwd) {
    put(io.dq, s.hq * s.dk, res.dq);
    put(io.dk, s.hkv * s.dk, res.dk);
    put(io.dv, s.hkv * s.dv, res.dv);
  }
}

sp_result empty_result(const global_inputs& g, int p) {
  sp_result res;
  res.out.assign(g.want.out.size(), 0.0);
  res.lse.assign(g.want.lse.size(), 0.0);
  res.dq.assign(g.q.size(), 0.0);
  res.dk.assign(g.k.size(), 0.0);
  res.dv.assign(g.v.size(), 0.0);
  res.fwd_bytes.assign(static_cast<std::size_t>(p), 0);
  res.bwd_bytes.assign(static_cast<std::size_t>(p), 0);
  return res;
}

// On p in-process ranks: make(comm) makes this rank's plan (collective); forward and, when bwd,
// backward run on it with a workspace of plan.workspace_bytes(); `fwd` / `bwd_fn` are the plan
// forms. Gathers the global results and the bytes every rank sent in each pass.
template <class T, class Make, class Fwd, class Bwd>
sp_result run(const global_inputs& g, int p, bool bwd, Make make, Fwd fwd, Bwd bwd_fn) {
  sp_result res = empty_result(g, p);
  std::mutex mu;
  lt::run_ranks(p, [&](auto& lc, const auto& be) {
    auto comm = lt::counted(lc);
    const int r = comm.rank();
    const auto plan = make(comm, be);
    auto io = take_rows<T>(plan, r, g);
    loom::workspace_buffer ws(plan.workspace_bytes());
    const long before = sent(comm);
    fwd(be, comm, plan, io.qv(), io.kv(), io.vv(), io.ov(), io.lv(), ws.span());
    res.fwd_bytes[static_cast<std::size_t>(r)] = sent(comm) - before;
    if (bwd) {
      bwd_fn(be, comm, plan, io.qv(), io.kv(), io.vv(), io.cov(), io.clv(), io.dov(), io.dqv(), io.dkv(), io.dvv(),
             ws.span());
      res.bwd_bytes[static_cast<std::size_t>(r)] = sent(comm) - before - res.fwd_bytes[static_cast<std::size_t>(r)];
    }
    loom::fence(be);
    std::lock_guard<std::mutex> lock(mu);
    put_rows(plan, r, g, io, bwd, res);
  });
  return res;
}

const auto ulysses_fwd = [](const auto& be, auto& c, const auto& plan, auto q, auto k, auto v, auto o, auto l,
                            auto ws) { lu::forward(be, c, plan, q, k, v, o, l, ws); };
const auto ulysses_bwd = [](const auto& be, auto& c, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto d,
                            auto dq, auto dk, auto dv,
                            auto ws) { lu::backward(be, c, plan, q, k, v, o, l, d, dq, dk, dv, ws); };
const auto hybrid_fwd = [](const auto& be, auto& c, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto ws) {
  lh::forward(be, c, plan, q, k, v, o, l, ws);
};
const auto hybrid_bwd = [](const auto& be, auto& c, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto d,
                           auto dq, auto dk, auto dv,
                           auto ws) { lh::backward(be, c, plan, q, k, v, o, l, d, dq, dk, dv, ws); };

la::head_shape shape_of(const lt::attn_shape& s) { return {s.hq, s.hkv, s.dk, s.dv}; }

template <class T = double>
sp_result run_ulysses(const global_inputs& g, int p, const shard::plan& plan, bool bwd,
                      std::vector<lu::traffic>* bytes = nullptr) {
  if (bytes) bytes->assign(static_cast<std::size_t>(p), {});
  std::mutex mu;
  return run<T>(
      g, p, bwd,
      [&](auto& c, const auto& be) {
        auto up = lu::make_plan<prec<T>>(be, c, plan, shape_of(g.s), opts_of(g.s));
        if (bytes) {
          std::lock_guard<std::mutex> lock(mu);
          (*bytes)[static_cast<std::size_t>(c.rank())] =
              up.bytes_sent(c.rank(), sizeof(T), sizeof(loom::accum_t<T>), sizeof(T));
        }
        return up;
      },
      ulysses_fwd, ulysses_bwd);
}

// The hybrid on U x R ranks, the ring sharded by S; `bytes` (when given) receives every rank's
// bytes_sent for element size sizeof(T).
template <class T = double, class S = shard::zigzag>
sp_result run_hybrid(const global_inputs& g, lh::grid gd, bool bwd, std::vector<lu::traffic>* bytes = nullptr) {
  const auto ring = shard::make_plan(std::span<const index_t>(g.cu), gd.ring, S{});
  const int p = gd.ulysses * gd.ring;
  if (bytes) bytes->assign(static_cast<std::size_t>(p), {});
  std::mutex mu;
  return run<T>(
      g, p, bwd,
      [&](auto& c, const auto& be) {
        auto hp = lh::make_plan<prec<T>>(be, c, ring, shape_of(g.s), opts_of(g.s));
        if (bytes) {
          std::lock_guard<std::mutex> lock(mu);
          (*bytes)[static_cast<std::size_t>(c.rank())] =
              hp.bytes_sent(c.rank(), sizeof(T), sizeof(loom::accum_t<T>), sizeof(T));
        }
        return hp;
      },
      hybrid_fwd, hybrid_bwd);
}

// The hybrid whose inner ring runs a fused band-mask engine (ring_fused.hpp) through the
// reference of fused_reference.hpp: the make_plan body of the hybrid over cuDNN, with dense head
// shards required of every Ulysses rank.
template <class T = double, class S = shard::zigzag>
sp_result run_hybrid_fused(const global_inputs& g, lh::grid gd, bool bwd) {
  const auto ring = shard::make_plan(std::span<const index_t>(g.cu), gd.ring, S{});
  using P = prec<T>;
  using Acc = loom::accum_t<T>;
  return run<T>(
      g, gd.ulysses * gd.ring, bwd,
      [&](auto& c, const auto& be) {
        using inner = loom::attention::ring::fused_plan<std::decay_t<decltype(be)>, P, lt::band_engine<T, Acc>>;
        const auto opt = opts_of(g.s);
        return lh::detail::hybrid_maker::make<inner, P>(
            be, c, ring, shape_of(g.s), opt, "hybrid::make_plan (fused reference)",
            [&](const lh::grid& grid) { lh::detail::require_dense_heads(shape_of(g.s), grid.ulysses, "hybrid"); },
            [&](auto& rc, const shard::plan& sp, const la::head_shape& hs) {
              return loom::attention::ring::detail::make_fused_plan<P>(
                  be, rc, sp, hs, opt, "ring::make_plan (fused reference)", 7,
                  [&](const la::detail::fused_program& prog, index_t) {
                    return std::make_shared<lt::band_engine<T, Acc>>(prog, hs,
                                                                     la::detail::scale_of<Acc>(opt, hs.dim_qk));
                  });
            });
      },
      hybrid_fwd, hybrid_bwd);
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

bool bitwise_equal(const sp_result& a, const sp_result& b) {
  auto same = [](const std::vector<double>& x, const std::vector<double>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
  };
  return same(a.out, b.out) && same(a.lse, b.lse) && same(a.dq, b.dq) && same(a.dk, b.dk) && same(a.dv, b.dv);
}

const std::vector<index_t> docs{0, 1, 8, 138, 141, 1021};  // lengths 1, 7, 130, 3, 880: T = 1021 (prime)

}  // namespace

TEST_CASE("ulysses: fp64 equals the oracle, P = 1..8, heads 8/12/5 with kv heads 1, 2, 4", "[attention][ulysses]") {
  const lt::tolerance tol{1e-10, 1e-10};
  struct cfg {
    index_t hq, hkv;
    bool causal;
    std::vector<int> ps;
  };
  const std::vector<cfg> cfgs{{8, 2, true, {1, 2, 3, 4, 5, 6, 8}},
                              {8, 1, false, {3, 8}},
                              {12, 4, true, {2, 3, 4, 6, 8}},
                              {5, 1, true, {2, 3, 4}},
                              {12, 2, false, {8}}};
  std::uint64_t seed = 400;
  for (const auto& c : cfgs) {
    const auto g = make_global({0, 0, c.hq, c.hkv, 8, 8, c.causal}, docs, seed += 10);
    for (int p : c.ps) {
      if (lt::sanitized && (p == 4 || p == 6 || p == 8)) continue;  // sanitizer builds: P = 1, 2, 3, 5
      INFO("heads " << c.hq << "/" << c.hkv << ", P = " << p << ", causal " << c.causal);
      const bool zig = p % 2 == 1;
      const auto plan = zig ? plan_of<shard::zigzag>(docs, p) : plan_of<shard::contiguous>(docs, p);
      check(run_ulysses(g, p, plan, true), g, true, tol, "ulysses");
    }
  }
}

TEST_CASE("hybrid: fp64 equals the oracle, U x R in {1x1, 1x3, 5x1, 2x2, 2x3, 4x2, 3x2}, every ring sharding",
          "[attention][hybrid]") {
  const lt::tolerance tol{1e-10, 1e-10};
  const auto g8 = make_global({0, 0, 8, 2, 8, 8, true}, docs, 500);
  const auto g12 = make_global({0, 0, 12, 4, 8, 8, false}, docs, 510);
  const auto g5 = make_global({0, 0, 5, 1, 8, 8, true}, docs, 520);
  for (lh::grid gd : {lh::grid{1, 1}, lh::grid{1, 3}, lh::grid{5, 1}, lh::grid{2, 2}, lh::grid{2, 3}, lh::grid{4, 2},
                      lh::grid{3, 2}}) {
    if (lt::sanitized && gd.ulysses * gd.ring > 4) continue;  // sanitizer builds: up to 4 ranks
    INFO("U x R = " << gd.ulysses << " x " << gd.ring);
    std::vector<lu::traffic> bytes;
    const auto r8 = run_hybrid(g8, gd, true, &bytes);
    check(r8, g8, true, tol, "8/2 heads causal zigzag");
    for (int r = 0; r < gd.ulysses * gd.ring; ++r) {  // the sum of the parts
      const auto want = bytes[static_cast<std::size_t>(r)];
      CHECK(r8.fwd_bytes[static_cast<std::size_t>(r)] == static_cast<long>(want.forward));
      CHECK(r8.bwd_bytes[static_cast<std::size_t>(r)] == static_cast<long>(want.backward));
    }
    check(run_hybrid<double, shard::per_document>(g12, gd, true), g12, true, tol, "12/4 heads full per_document");
    if (gd.ulysses <= 5)
      check(run_hybrid<double, shard::contiguous>(g5, gd, true), g5, true, tol, "5/1 heads causal contiguous");
  }
}

TEST_CASE("hybrid with a fused inner ring: equals the oracle, and a head split that is not one GQA block is refused",
          "[attention][hybrid][fused]") {
  const lt::tolerance tol{1e-10, 1e-10};
  const auto g8 = make_global({0, 0, 8, 2, 8, 8, true}, docs, 530);
  for (lh::grid gd : {lh::grid{1, 1}, lh::grid{1, 3}, lh::grid{2, 2}, lh::grid{4, 1}, lh::grid{2, 3}}) {
    if (lt::sanitized && gd.ulysses * gd.ring > 4) continue;
    INFO("U x R = " << gd.ulysses << " x " << gd.ring);
    check(run_hybrid_fused(g8, gd, true), g8, true, tol, "8/2 heads causal zigzag");
  }
  const auto g12 = make_global({0, 0, 12, 4, 8, 8, false}, docs, 540);
  check(run_hybrid_fused<double, shard::per_document>(g12, {2, 2}, true), g12, true, tol,
        "12/4 heads full per_document");
  // U = 3 splits 8 heads over 2 kv heads 2, 3, 3: rank 1's straddle two groups; every rank refuses.
  const auto ring = shard::make_plan(std::span<const index_t>(docs), 1, shard::zigzag{});
  const auto what = lt::errors_on_ranks_of(3, [&](auto& comm, const auto& be) {
    (void)lh::detail::hybrid_maker::make<lh::detail::ring_plan_t<std::decay_t<decltype(be)>, loom::fp32>, loom::fp32>(
        be, comm, ring, {8, 2, 8, 8}, {}, "hybrid::make_plan (fused)",
        [&](const lh::grid& grid) {
          lh::detail::require_dense_heads({8, 2, 8, 8}, grid.ulysses, "hybrid");
        },
        [&](auto& rc, const shard::plan& sp, const la::head_shape& hs) {
          return loom::attention::ring::make_plan(be, rc, sp, hs);
        });
  });
  CHECK(lt::all_contain(what, "the inner ring needs dense head shards: Ulysses rank 1 computes query heads [2, 5)"));
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
  std::vector<lu::traffic> bytes;
  const auto res = run_ulysses<float>(g, p, plan, true, &bytes);
  const long unit = (p - 1) * t / (p * p);
  const long fwd = unit * (hq * dk + hkv * (dk + dv) + hq * dv) * 4 + unit * hq * 4;
  const long bwd =
      unit * (hq * (dk + 2 * dv) + hkv * (dk + dv)) * 4 + unit * hq * 4 + unit * (hq * dk + hkv * (dk + dv)) * 4;
  for (int r = 0; r < p; ++r) {
    CHECK(res.fwd_bytes[static_cast<std::size_t>(r)] == fwd);
    CHECK(res.bwd_bytes[static_cast<std::size_t>(r)] == bwd);
    CHECK(bytes[static_cast<std::size_t>(r)].forward == static_cast<std::size_t>(fwd));
  }
  // Uneven: T = 1021 over 3 ranks, 5 q heads and 1 kv head (replicated on every rank).
  const auto g5 = make_global({0, 0, 5, 1, 8, 8, true}, docs, 710);
  const auto plan3 = plan_of<shard::zigzag>(docs, 3);
  std::vector<lu::traffic> bytes3;
  const auto r5 = run_ulysses<double>(g5, 3, plan3, true, &bytes3);
  check(r5, g5, true, {1e-10, 1e-10}, "5/1 heads on 3 ranks");
  const la::detail::head_split hs3{5, 1, 3};
  for (int r = 0; r < 3; ++r) {
    const auto n = plan3.rank(r).tokens;
    const long q_other = 5 - hs3.q_count(r), hq_r = hs3.q_count(r);
    // q to the others' heads, the single kv head to both others, out and lse back
    const long want = n * (q_other * 8 + 2 * (8 + 8)) * 8 + (1021 - n) * hq_r * (8 * 8 + 8);
    CHECK(r5.fwd_bytes[static_cast<std::size_t>(r)] == want);
    CHECK(r5.fwd_bytes[static_cast<std::size_t>(r)] == static_cast<long>(bytes3[static_cast<std::size_t>(r)].forward));
    CHECK(r5.bwd_bytes[static_cast<std::size_t>(r)] == static_cast<long>(bytes3[static_cast<std::size_t>(r)].backward));
  }
}

TEST_CASE("ulysses and hybrid: deterministic run to run", "[attention][ulysses]") {
  const auto g = make_global({0, 0, 8, 1, 8, 8, true}, docs, 800);
  const auto plan = plan_of<shard::zigzag>(docs, 6);
  const auto a = run_ulysses<float>(g, 6, plan, true), b = run_ulysses<float>(g, 6, plan, true);
  REQUIRE(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(double)) == 0);
  REQUIRE(std::memcmp(a.dk.data(), b.dk.data(), a.dk.size() * sizeof(double)) == 0);
}

TEST_CASE("ulysses and hybrid: the convenience forms are the plan forms", "[attention][ulysses][hybrid]") {
  // forward(b, comm, sharding, q, k, v, out, lse, opts) plans, allocates and calls the plan form:
  // bitwise the same results (precision deduced from q: float).
  const auto g = make_global({0, 0, 4, 2, 8, 8, true}, docs, 810);
  const auto seq = plan_of<shard::zigzag>(docs, 3);
  const auto ring = plan_of<shard::per_document>(docs, 2);
  const auto planned_u = run_ulysses<float>(g, 3, seq, true);
  const auto planned_h = run_hybrid<float, shard::per_document>(g, {2, 2}, true);
  const auto la_opts = opts_of(g.s);
  // The plan (for the rows only) and the convenience calls.
  const auto u = run<float>(
      g, 3, true,
      [&](auto& c, const auto& be) { return lu::make_plan<loom::fp32>(be, c, seq, shape_of(g.s), la_opts); },
      [&](const auto& be, auto& c, const auto&, auto q, auto k, auto v, auto o, auto l, auto) {
        lu::forward(be, c, seq, q, k, v, o, l, la_opts);
      },
      [&](const auto& be, auto& c, const auto&, auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk,
          auto dv, auto) { lu::backward(be, c, seq, q, k, v, o, l, d, dq, dk, dv, la_opts); });
  const auto h = run<float>(
      g, 4, true,
      [&](auto& c, const auto& be) { return lh::make_plan<loom::fp32>(be, c, ring, shape_of(g.s), la_opts); },
      [&](const auto& be, auto& c, const auto&, auto q, auto k, auto v, auto o, auto l, auto) {
        lh::forward(be, c, ring, q, k, v, o, l, la_opts);
      },
      [&](const auto& be, auto& c, const auto&, auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk,
          auto dv, auto) { lh::backward(be, c, ring, q, k, v, o, l, d, dq, dk, dv, la_opts); });
  CHECK(bitwise_equal(u, planned_u));
  CHECK(bitwise_equal(h, planned_h));
}

TEST_CASE("ulysses and hybrid: make_plan rejections are the same error on every rank",
          "[attention][ulysses][hybrid][errors]") {
  const std::vector<index_t> cu{0, 40}, cu2{0, 25, 40};
  const auto plan2 = plan_of<shard::contiguous>(cu, 2);
  auto every_rank = [](int p, auto body, const std::string& text) {
    const auto what = lt::errors_on_ranks_of(p, body);
    INFO(what[0]);
    CHECK(lt::all_contain(what, text));
    CHECK(lt::all_contain(what, "loom::invalid_argument"));
  };
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        (void)lu::make_plan<loom::fp64>(b, comm, plan2, {6, 4, 8, 8});
      },
      "ulysses::make_plan: q heads (6) must be a multiple of kv heads (4)");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        (void)lu::make_plan<loom::fp64>(b, comm, plan2, {0, 1, 8, 8});
      },
      "heads must be >= 1");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        (void)lu::make_plan<loom::fp64>(b, comm, plan2, {4, 1, 0, 8});
      },
      "head dims must be >= 1");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        la::options o{};
        o.window = {-2, 0};
        (void)lu::make_plan<loom::fp64>(b, comm, plan2, {4, 1, 8, 8}, o);
      },
      "ulysses::make_plan: options.window (left, right) must each be >= -1");
  every_rank(
      4,
      [&](auto& comm, const auto& b) {
        la::options o{};
        o.scale = -1.0;
        (void)lh::make_plan<loom::fp64>(b, comm, plan_of<shard::zigzag>(cu, 2), {4, 1, 8, 8}, o);
      },
      "hybrid::make_plan: options.scale must be finite and > 0");
  every_rank(
      8,
      [&](auto& comm, const auto& b) {
        (void)lu::make_plan<loom::fp64>(b, comm, plan_of<shard::contiguous>(cu, 8), {4, 1, 8, 8});
      },
      "needs ranks <= heads_q, got 8 ranks");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        (void)lu::make_plan<loom::fp64>(b, comm, plan_of<shard::contiguous>(cu, 3), {4, 1, 8, 8});
      },
      "the sharding is for 3 ranks but the communicator has 2");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        (void)lu::make_plan<loom::fp64>(b, comm, plan2, {4, comm.rank() == 0 ? index_t{2} : index_t{4}, 8, 8});
      },
      "ranks disagree on the shapes");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        const auto other = plan_of<shard::contiguous>(cu2, 2);
        (void)lu::make_plan<loom::fp64>(b, comm, comm.rank() == 1 ? other : plan2, {4, 2, 8, 8});
      },
      "ranks disagree on the plan");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        la::options o{};
        o.causal = comm.rank() == 0;
        (void)lu::make_plan<loom::fp64>(b, comm, plan2, {4, 2, 8, 8}, o);
      },
      "ranks disagree on the options");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        if (comm.rank() == 0)
          (void)lu::make_plan<loom::fp64>(b, comm, plan2, {4, 2, 8, 8});
        else
          (void)lu::make_plan<loom::fp32>(b, comm, plan2, {4, 2, 8, 8});
      },
      "ranks disagree on the element types");
  // hybrid: R must divide P; U <= heads_q
  every_rank(
      4,
      [&](auto& comm, const auto& b) {
        (void)lh::make_plan<loom::fp64>(b, comm, plan_of<shard::zigzag>(cu, 3), {4, 1, 8, 8});
      },
      "hybrid::make_plan: the ring sharding is for R = 3 ranks, which must divide the communicator's size, 4");
  every_rank(
      4,
      [&](auto& comm, const auto& b) {
        (void)lh::make_plan<loom::fp64>(b, comm, plan_of<shard::zigzag>(cu, 1), {2, 1, 8, 8});
      },
      "needs ranks <= heads_q, got 4 ranks");
  every_rank(
      4,
      [&](auto& comm, const auto& b) {
        (void)lh::make_plan<loom::fp64>(b, comm, plan_of<shard::zigzag>(comm.rank() == 3 ? cu2 : cu, 2), {4, 1, 8, 8});
      },
      "ranks disagree on the plan");
}

TEST_CASE("ulysses and hybrid: per-call checks against the plan, on the calling rank",
          "[attention][ulysses][hybrid][errors]") {
  // Every rank passes a bad argument here, so no rank waits for another in the exchange.
  const std::vector<index_t> cu{0, 40};
  const auto plan2 = plan_of<shard::contiguous>(cu, 2);
  auto every_rank = [](int p, auto body, const std::string& text, const char* code) {
    const auto what = lt::errors_on_ranks_of(p, body);
    INFO(what[0]);
    CHECK(lt::all_contain(what, text));
    CHECK(lt::all_contain(what, code));
  };
  const auto call = [&](const auto& b, auto& comm, const auto& plan, auto fwd, index_t n, index_t hq, index_t hkv,
                        std::size_t ws_bytes, std::size_t offset) {
    std::vector<double> q(static_cast<std::size_t>(n * hq * 8)), k(static_cast<std::size_t>(n * hkv * 8)),
        out(q.size()), lse(static_cast<std::size_t>(n * hq));
    loom::workspace_buffer ws(ws_bytes + offset);
    fwd(b, comm, plan, lt::dview_t<const double, 3>(q.data(), {n, hq, 8}),
        lt::dview_t<const double, 3>(k.data(), {n, hkv, 8}), lt::dview_t<const double, 3>(k.data(), {n, hkv, 8}),
        lt::dview_t<double, 3>(out.data(), {n, hq, 8}), lt::dview_t<double, 2>(lse.data(), {n, hq}),
        ws.span().subspan(offset));
  };
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        const auto up = lu::make_plan<loom::fp64>(b, comm, plan2, {4, 2, 8, 8});
        call(b, comm, up, ulysses_fwd, 20, 4, 4, up.workspace_bytes(), 0);
      },
      "ulysses::forward: k must be [20, 2, 8], got [20, 4, 8]", "loom::shape_mismatch");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        const auto up = lu::make_plan<loom::fp64>(b, comm, plan2, {4, 2, 8, 8});
        call(b, comm, up, ulysses_fwd, 21, 4, 2, up.workspace_bytes(), 0);
      },
      "ulysses::forward: q must be [20, 4, 8], got [21, 4, 8]", "loom::shape_mismatch");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        const auto up = lu::make_plan<loom::fp64>(b, comm, plan2, {4, 2, 8, 8});
        call(b, comm, up, ulysses_fwd, 20, 4, 2, up.workspace_bytes() - 1, 0);
      },
      "ulysses::forward: workspace must hold at least", "loom::invalid_argument");
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        const auto up = lu::make_plan<loom::fp64>(b, comm, plan2, {4, 2, 8, 8});
        call(b, comm, up, ulysses_fwd, 20, 4, 2, up.workspace_bytes(), 8);
      },
      "ulysses::forward: workspace must start on a 64-byte boundary", "loom::invalid_argument");
  // A plan of another rank: each rank calls with its neighbour's plan.
  using plan64 = lu::plan<lt::backend_under_test, loom::fp64>;
  std::vector<std::unique_ptr<plan64>> plans(2);
  lt::run_ranks(2, [&](auto& comm, const auto& b) {
    plans[static_cast<std::size_t>(comm.rank())] =
        std::make_unique<plan64>(lu::make_plan<loom::fp64>(b, comm, plan2, {4, 2, 8, 8}));
  });
  every_rank(
      2,
      [&](auto& comm, const auto& b) {
        const auto& up = *plans[static_cast<std::size_t>(1 - comm.rank())];
        call(b, comm, up, ulysses_fwd, 20, 4, 2, up.workspace_bytes(), 0);
      },
      "ulysses::forward: the plan was made for rank", "loom::invalid_argument");
  // hybrid 2 x 2: lse of the wrong shape
  const auto ring2 = plan_of<shard::zigzag>(cu, 2);
  every_rank(
      4,
      [&](auto& comm, const auto& b) {
        const auto hp = lh::make_plan<loom::fp64>(b, comm, ring2, {4, 2, 8, 8});
        const index_t n = hp.tokens(comm.rank());
        std::vector<double> q(static_cast<std::size_t>(n * 4 * 8)), k(static_cast<std::size_t>(n * 2 * 8)),
            out(q.size()), lse(static_cast<std::size_t>(n * 3));
        loom::workspace_buffer ws(hp.workspace_bytes());
        lh::forward(b, comm, hp, lt::dview_t<const double, 3>(q.data(), {n, 4, 8}),
                    lt::dview_t<const double, 3>(k.data(), {n, 2, 8}),
                    lt::dview_t<const double, 3>(k.data(), {n, 2, 8}), lt::dview_t<double, 3>(out.data(), {n, 4, 8}),
                    lt::dview_t<double, 2>(lse.data(), {n, 3}), ws.span());
      },
      "hybrid::forward: lse must be", "loom::shape_mismatch");
}

namespace {
// Requires that forward and backward on a plan made by make(comm) allocate nothing on any rank
// (comm::local's own queues excepted: lt::counted wraps it in loom::test::uncounted; the stand-in's
// communication runs on its stream's thread).
template <class Make, class Fwd, class Bwd>
void require_no_allocation(const global_inputs& g, int p, Make make, Fwd fwd, Bwd bwd) {
  std::vector<lt::allocation_report> f(static_cast<std::size_t>(p)), bw(f.size());
  lt::run_ranks(p, [&](auto& lc, const auto& be) {
    auto comm = lt::counted(lc);
    const auto plan = make(comm, be);
    auto io = take_rows<float>(plan, comm.rank(), g);
    loom::workspace_buffer ws(plan.workspace_bytes());
    const auto r = static_cast<std::size_t>(comm.rank());
    f[r] = lt::count_allocations([&] { fwd(be, comm, plan, io.qv(), io.kv(), io.vv(), io.ov(), io.lv(), ws.span()); });
    bw[r] = lt::count_allocations([&] {
      bwd(be, comm, plan, io.qv(), io.kv(), io.vv(), io.cov(), io.clv(), io.dov(), io.dqv(), io.dkv(), io.dvv(),
          ws.span());
    });
    loom::fence(be);
  });
  for (int r = 0; r < p; ++r) {
    INFO("rank " << r);
    CHECK(f[static_cast<std::size_t>(r)].heap == 0);
    CHECK(f[static_cast<std::size_t>(r)].temporaries == 0);
    CHECK(bw[static_cast<std::size_t>(r)].heap == 0);
    CHECK(bw[static_cast<std::size_t>(r)].temporaries == 0);
  }
}
}  // namespace

TEST_CASE("ulysses: a plan-taking call allocates nothing", "[attention][ulysses][allocations]") {
  const auto g = make_global({0, 0, 8, 2, 8, 8, true}, docs, 900);
  const auto seq = plan_of<shard::zigzag>(docs, 3);
  require_no_allocation(
      g, 3, [&](auto& c, const auto& be) { return lu::make_plan<loom::fp32>(be, c, seq, shape_of(g.s), opts_of(g.s)); },
      ulysses_fwd, ulysses_bwd);
}

TEST_CASE("hybrid: a plan-taking call allocates nothing", "[attention][hybrid][allocations]") {
  const auto g = make_global({0, 0, 8, 2, 8, 8, true}, docs, 900);
  const auto ring = plan_of<shard::per_document>(docs, 2);
  require_no_allocation(
      g, 4,
      [&](auto& c, const auto& be) { return lh::make_plan<loom::fp32>(be, c, ring, shape_of(g.s), opts_of(g.s)); },
      hybrid_fwd, hybrid_bwd);
}

namespace {
// Runs forward then backward `calls` times on each rank with one plan made by make(comm) (or
// plans[rank] when given), each call's results gathered into its own sp_result; counts the
// collectives of make_plan and of the calls.
template <class T, class Plan, class Fwd, class Bwd>
std::vector<sp_result> repeat(const global_inputs& g, int p, int calls, const std::vector<const Plan*>& plans, Fwd fwd,
                              Bwd bwd) {
  std::vector<sp_result> res(static_cast<std::size_t>(calls), empty_result(g, p));
  std::mutex mu;
  lt::run_ranks(p, [&](auto& lc, const auto& be) {
    auto comm = lt::counted(lc);
    const int r = comm.rank();
    const Plan& plan = *plans[static_cast<std::size_t>(r)];
    for (int c = 0; c < calls; ++c) {
      auto io = take_rows<T>(plan, r, g);
      loom::workspace_buffer ws(plan.workspace_bytes());
      fwd(be, comm, plan, io.qv(), io.kv(), io.vv(), io.ov(), io.lv(), ws.span());
      bwd(be, comm, plan, io.qv(), io.kv(), io.vv(), io.cov(), io.clv(), io.dov(), io.dqv(), io.dkv(), io.dvv(),
          ws.span());
      loom::fence(be);
      std::lock_guard<std::mutex> lock(mu);
      put_rows(plan, r, g, io, true, res[static_cast<std::size_t>(c)]);
    }
  });
  return res;
}

// Three calls in a row on the plans, then two worlds at once on two threads sharing the const
// plans (own workspaces and outputs): every result bitwise `fresh`.
template <class Plan, class Fwd, class Bwd>
void require_reuse(const global_inputs& g, int p, const std::vector<const Plan*>& plans, Fwd fwd, Bwd bwd,
                   const sp_result& fresh) {
  for (const auto& r : repeat<float>(g, p, 3, plans, fwd, bwd)) CHECK(bitwise_equal(r, fresh));
  std::vector<sp_result> a, b;
  std::thread t1([&] { a = repeat<float>(g, p, 2, plans, fwd, bwd); });
  std::thread t2([&] { b = repeat<float>(g, p, 2, plans, fwd, bwd); });
  t1.join();
  t2.join();
  for (const auto& r : a) CHECK(bitwise_equal(r, fresh));
  for (const auto& r : b) CHECK(bitwise_equal(r, fresh));
}

}  // namespace

TEST_CASE("ulysses: one plan reused across calls and threads is bitwise a fresh plan", "[attention][ulysses][reuse]") {
  const auto g = make_global({0, 0, 8, 2, 8, 8, true}, docs, 910);
  const int p = 3;
  const auto seq = plan_of<shard::per_document>(docs, p);
  using plan_t = lu::plan<lt::backend_under_test, loom::fp32>;
  const auto fresh = run_ulysses<float>(g, p, seq, true);
  // Plans made once, on a world of their own.
  std::vector<std::unique_ptr<plan_t>> made(p);
  lt::run_ranks(p, [&](auto& comm, const auto& be) {
    made[static_cast<std::size_t>(comm.rank())] =
        std::make_unique<plan_t>(lu::make_plan<loom::fp32>(be, comm, seq, shape_of(g.s), opts_of(g.s)));
  });
  std::vector<const plan_t*> plans;
  for (const auto& m : made) plans.push_back(m.get());
  require_reuse(g, p, plans, ulysses_fwd, ulysses_bwd, fresh);
}

// A hybrid plan holds its group communicators: it may be read from any thread, but calls on one
// plan do not overlap (hybrid.hpp). The last call of each rank runs on a thread of its own.
TEST_CASE("hybrid: one plan reused across calls and threads is bitwise a fresh plan", "[attention][hybrid][reuse]") {
  const auto g = make_global({0, 0, 4, 2, 8, 8, true}, docs, 920);
  const auto fresh = run_hybrid<float, shard::per_document>(g, {2, 2}, true);
  const auto ring = plan_of<shard::per_document>(docs, 2);
  std::vector<sp_result> res(3, empty_result(g, 4));
  std::mutex mu;
  lt::run_ranks(4, [&](auto& lc, const auto& be) {
    auto comm = lt::counted(lc);
    const auto hp = lh::make_plan<loom::fp32>(be, comm, ring, shape_of(g.s), opts_of(g.s));
    loom::workspace_buffer ws(hp.workspace_bytes());
    for (std::size_t c = 0; c < res.size(); ++c) {
      auto io = take_rows<float>(hp, comm.rank(), g);
      const auto call = [&] {
        hybrid_fwd(be, comm, hp, io.qv(), io.kv(), io.vv(), io.ov(), io.lv(), ws.span());
        hybrid_bwd(be, comm, hp, io.qv(), io.kv(), io.vv(), io.cov(), io.clv(), io.dov(), io.dqv(), io.dkv(), io.dvv(),
                   ws.span());
        loom::fence(be);
      };
      if (c + 1 < res.size()) {
        call();
      } else {
        std::thread other(call);
        other.join();
      }
      std::lock_guard<std::mutex> lock(mu);
      put_rows(hp, comm.rank(), g, io, true, res[c]);
    }
  });
  for (const auto& r : res) CHECK(bitwise_equal(r, fresh));
}

namespace {
constexpr int agreement_calls = 4;
// The collectives each rank ran in make(comm) and in `agreement_calls` forward + backward calls.
template <class Make, class Fwd, class Bwd>
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> count_collectives(const global_inputs& g, int p,
                                                                                  Make make, Fwd fwd, Bwd bwd) {
  std::vector<std::int64_t> at_plan(static_cast<std::size_t>(p)), per_calls(at_plan.size());
  lt::run_ranks(p, [&](auto& lc, const auto& be) {
    auto comm = lt::counted(lc);
    const auto plan = make(comm, be);
    const std::int64_t c0 = comm.counts().collectives;
    for (int c = 0; c < agreement_calls; ++c) {
      auto io = take_rows<float>(plan, comm.rank(), g);
      loom::workspace_buffer ws(plan.workspace_bytes());
      fwd(be, comm, plan, io.qv(), io.kv(), io.vv(), io.ov(), io.lv(), ws.span());
      bwd(be, comm, plan, io.qv(), io.kv(), io.vv(), io.cov(), io.clv(), io.dov(), io.dqv(), io.dkv(), io.dvv(),
          ws.span());
      loom::fence(be);
    }
    at_plan[static_cast<std::size_t>(comm.rank())] = c0;
    per_calls[static_cast<std::size_t>(comm.rank())] = comm.counts().collectives - c0;
  });
  return {at_plan, per_calls};
}
}  // namespace

TEST_CASE("ulysses: the agreement runs once per plan, not per call", "[attention][ulysses]") {
  // Per call only the exchange's all_to_allv: three in the forward (q, k, v; out; lse), three in
  // the backward (q, k, v, out, dout; lse; dq, dk, dv).
  const auto g = make_global({0, 0, 4, 2, 8, 8, true}, docs, 930);
  const auto seq = plan_of<shard::zigzag>(docs, 4);
  const auto [at_plan, per_calls] = count_collectives(
      g, 4, [&](auto& c, const auto& be) { return lu::make_plan<loom::fp32>(be, c, seq, shape_of(g.s), opts_of(g.s)); },
      ulysses_fwd, ulysses_bwd);
  for (int r = 0; r < 4; ++r) {
    CHECK(at_plan[static_cast<std::size_t>(r)] == 1);  // make_plan: one agreement
    CHECK(per_calls[static_cast<std::size_t>(r)] == 6 * agreement_calls);
  }
}

TEST_CASE("hybrid: the agreement runs once per plan, not per call", "[attention][hybrid]") {
  // Per call the Ulysses exchange's six all_to_allv; the ring inside moves its blocks point to
  // point and agrees only in its make_plan.
  const auto g = make_global({0, 0, 4, 2, 8, 8, true}, docs, 930);
  const auto ring = plan_of<shard::zigzag>(docs, 2);
  const auto [at_plan, per_calls] = count_collectives(
      g, 4,
      [&](auto& c, const auto& be) { return lh::make_plan<loom::fp32>(be, c, ring, shape_of(g.s), opts_of(g.s)); },
      hybrid_fwd, hybrid_bwd);
  for (int r = 0; r < 4; ++r) {
    CHECK(at_plan[static_cast<std::size_t>(r)] == 2);  // the grid's agreement, the ring plan's (one head segment)
    CHECK(per_calls[static_cast<std::size_t>(r)] == 6 * agreement_calls);
  }
}

#if defined(LOOM_TEST_BACKEND_STANDIN)
TEST_CASE("ulysses and hybrid on the stand-in: 50 seeds of random stream delays, the same bits every time",
          "[attention][ulysses][hybrid][standin][delays]") {
  // The result depends on the schedule's order only, never on timing: for each P, every seed gives
  // the bits of the first one, which matches the fp64 oracle. Ulysses on P = 1..5 ranks; the
  // hybrid on the grid of P ranks (U x R: 1x1, 1x2, 3x1, 2x2, 5x1).
  const std::vector<index_t> cu{0, 3, 40, 97, 101};
  const auto g = make_global({0, 0, 5, 1, 8, 8, true}, cu, 1400);
  const std::array<lh::grid, 6> grids{lh::grid{}, {1, 1}, {1, 2}, {3, 1}, {2, 2}, {5, 1}};
  std::array<std::array<sp_result, 2>, 6> first{};
  auto opt = lt::standin_ranks();
  opt.max_delay = std::chrono::microseconds(200);
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const int p = 1 + static_cast<int>(seed % 5);
    opt.seed = seed;
    lt::standin_override() = opt;
    const std::array<sp_result, 2> got{run_ulysses(g, p, plan_of<shard::zigzag>(cu, p), true),
                                       run_hybrid(g, grids[static_cast<std::size_t>(p)], true)};
    lt::standin_override().reset();
    INFO("seed " << seed << ", P = " << p);
    for (std::size_t v = 0; v < got.size(); ++v) {
      INFO((v == 0 ? "ulysses" : "hybrid"));
      auto& ref = first[static_cast<std::size_t>(p)][v];
      if (seed < 5) {
        check(got[v], g, true, {1e-10, 1e-10}, "the first seed of each P against the oracle");
        ref = got[v];
      }
      REQUIRE(bitwise_equal(got[v], ref));
    }
  }
}
#endif

namespace lp = loom::attention::planner;

#if !defined(LOOM_TEST_BACKEND_STANDIN)  // the planner's tables and its measuring helper: host only

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

#endif

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

namespace lsp = loom::sequence_parallel;

TEST_CASE("sequence_parallel: make_plan picks ring, Ulysses or hybrid and runs the pick against the oracle",
          "[attention][planner][sequence_parallel]") {
  struct cfg {
    index_t hq, hkv;
    lp::machine m;
    std::optional<lp::strategy> only;
    lp::strategy want;
    lsp::sharding layout;
  };
  const lp::machine slow_compute{1e9, 1e15}, slow_links{1e15, 1e9};
  const std::vector<cfg> cfgs{
      {8, 8, slow_compute, {}, lp::strategy::ring_pass_kv, lsp::sharding::per_document},  // every step hidden
      {8, 8, slow_links, {}, lp::strategy::ulysses, lsp::sharding::contiguous},           // fewest bytes
      {2, 2, slow_links, {}, lp::strategy::hybrid, lsp::sharding::zigzag},                // P > heads_q
      {4, 2, slow_links, lp::strategy::ring_pass_q, lp::strategy::ring_pass_q, lsp::sharding::zigzag},
  };
  const int p = 4;
  std::uint64_t seed = 940;
  for (const auto& c : cfgs) {
    const auto g = make_global({0, 0, c.hq, c.hkv, 8, 8, true}, docs, seed += 10);
    INFO("want " << lp::to_string(c.want));
    std::vector<lp::strategy> picked(p);
    std::vector<std::string> explained(p);
    // int32 offsets (FlashAttention's cu_seqlens) for every other configuration, int64 otherwise.
    // The offsets live in the backend's memory (on the stand-in: not host-readable; make_plan reads
    // them with a copy and a fence).
    const std::vector<std::int32_t> cu32(g.cu.begin(), g.cu.end());
    const bool narrow = seed % 20 == 0;
    const std::array<index_t, 1> n_offsets{static_cast<index_t>(g.cu.size())};
    const auto res = run<double>(
        g, p, true,
        [&](auto& comm, const auto& be) {
          using doc_space = typename loom::backend_traits<std::remove_cvref_t<decltype(be)>>::memory_space;
          const auto documents = narrow ? loom::segments<doc_space>(loom::make_view<doc_space>(cu32.data(), n_offsets))
                                        : loom::segments<doc_space>(loom::make_view<doc_space>(g.cu.data(), n_offsets));
          lsp::options o;
          o.attention = opts_of(g.s);
          o.machine = c.m;
          o.layout = c.layout;
          o.only = c.only;
          auto sp = lsp::make_plan<loom::fp64>(be, comm, documents, shape_of(g.s), o);
          picked[static_cast<std::size_t>(comm.rank())] = sp.kind();
          explained[static_cast<std::size_t>(comm.rank())] = sp.choice().explain();
          return sp;
        },
        [](const auto& be, auto& comm, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto ws) {
          lsp::forward(be, comm, plan, q, k, v, o, l, ws);
        },
        [](const auto& be, auto& comm, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto d, auto dq,
           auto dk, auto dv, auto ws) { lsp::backward(be, comm, plan, q, k, v, o, l, d, dq, dk, dv, ws); });
    INFO(explained[0]);
    for (auto k : picked) CHECK(k == c.want);
    check(res, g, true, {1e-10, 1e-10}, lp::to_string(c.want));
  }
  // A strategy that cannot run here is refused on every rank.
  const auto what = lt::errors_on_ranks_of(p, [&](auto& comm, const auto& be) {
    lsp::options o;
    o.machine = slow_links;
    o.only = lp::strategy::ulysses;
    (void)lsp::make_plan<loom::fp64>(be, comm, loom::segments<>::whole(100), {2, 2, 8, 8}, o);
  });
  CHECK(lt::all_contain(what, "sequence_parallel::make_plan: options.only = ulysses is not feasible"));
}

TEST_CASE(
    "sequence_parallel: a plan-taking call allocates nothing, and one plan reused across calls and threads is "
    "bitwise a fresh plan",
    "[attention][planner][sequence_parallel][allocations][reuse]") {
  const auto g = make_global({0, 0, 8, 2, 8, 8, true}, docs, 990);
  const int p = 3;
  const auto make = [&](auto& comm, const auto& be) {
    lsp::options o;
    o.attention = opts_of(g.s);
    o.machine = {1e15, 1e9};  // slow links: the pick is ring pass-KV (2 kv heads: the fewest bytes)
    o.layout = lsp::sharding::zigzag;
    return lsp::make_plan<loom::fp32>(be, comm, loom::segments<>(std::span<const index_t>(g.cu)), shape_of(g.s), o);
  };
  const auto fwd = [](const auto& be, auto& comm, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto ws) {
    lsp::forward(be, comm, plan, q, k, v, o, l, ws);
  };
  const auto bwd = [](const auto& be, auto& comm, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto d,
                      auto dq, auto dk, auto dv,
                      auto ws) { lsp::backward(be, comm, plan, q, k, v, o, l, d, dq, dk, dv, ws); };
  require_no_allocation(g, p, make, fwd, bwd);
  const auto fresh = run<float>(g, p, true, make, fwd, bwd);
  // Plans made once, on a world of their own, then read by three calls in a row and by two worlds
  // at once on two threads (own workspaces and outputs).
#if defined(LOOM_TEST_BACKEND_STANDIN)
  using rank_comm = loom::comm::standin;
#else
  using rank_comm = loom::comm::local;
#endif
  using counted_comm = decltype(lt::counted(std::declval<rank_comm&>()));
  using plan_t = decltype(make(std::declval<counted_comm&>(), std::declval<const lt::backend_under_test&>()));
  std::vector<std::unique_ptr<plan_t>> made(p);
  lt::run_ranks(p, [&](auto& lc, const auto& be) {
    auto comm = lt::counted(lc);
    made[static_cast<std::size_t>(comm.rank())] = std::make_unique<plan_t>(make(comm, be));
  });
  std::vector<const plan_t*> plans;
  for (const auto& m : made) {
    REQUIRE(m->kind() == lp::strategy::ring_pass_kv);  // no group communicators: usable on other worlds
    plans.push_back(m.get());
  }
  require_reuse(g, p, plans, fwd, bwd, fresh);
}

namespace {
// make_plan's steps with the local step of every ring (the ring variants and the hybrid's inner
// ring) on a fused band-mask engine, the reference of fused_reference.hpp that reads the tables a
// cuDNN engine reads: ring_cudnn.cuh's cudnn_steps with the reference in cuDNN's place. Ulysses
// keeps loom's kernel (over cuDNN its local step is one attention::cudnn plan).
struct reference_steps {
  template <loom::precision_policy P, class B, loom::comm::communicator C, class V>
  auto ring(const B& b, C& comm, V, const shard::plan& sh, const la::head_shape& s, const la::options& o) const {
    using T = typename P::storage_type;
    using Acc = typename P::accum_type;
    return la::ring::detail::make_fused_plan<P, V>(
        b, comm, sh, s, o, "ring::make_plan (fused reference)", 7, [&](const la::detail::fused_program& prog, index_t) {
          return std::make_shared<lt::band_engine<T, Acc>>(prog, s, la::detail::scale_of<Acc>(o, s.dim_qk));
        });
  }
  template <loom::precision_policy P, class B, loom::comm::communicator C>
  auto ulysses(const B& b, C& comm, const shard::plan& sh, const la::head_shape& s, const la::options& o) const {
    return lu::make_plan<P>(b, comm, sh, s, o);
  }
  template <loom::precision_policy P, class B, loom::comm::communicator C>
  auto hybrid(const B& b, C& comm, const shard::plan& sh, const la::head_shape& s, const la::options& o) const {
    using inner = decltype(ring<P>(b, comm, la::ring::pass_kv{}, sh, s, o));
    return lh::detail::hybrid_maker::make<inner, P>(
        b, comm, sh, s, o, "hybrid::make_plan (fused reference)",
        [&](const lh::grid& grid) { lh::detail::require_dense_heads(s, grid.ulysses, "hybrid"); },
        [&](C& rc, const shard::plan& sp, const la::head_shape& hs) {
          return ring<P>(b, rc, la::ring::pass_kv{}, sp, hs, o);
        });
  }
};
}  // namespace

TEST_CASE("sequence_parallel: the pick runs on the steps make_plan was given (a fused engine in every ring)",
          "[attention][planner][sequence_parallel][fused]") {
  struct cfg {
    index_t hq, hkv;
    lp::strategy only;
    lsp::sharding layout;
  };
  const std::vector<cfg> cfgs{
      {4, 2, lp::strategy::ring_pass_kv, lsp::sharding::zigzag},
      {4, 2, lp::strategy::ring_pass_q, lsp::sharding::per_document},
      {4, 2, lp::strategy::all_gather_kv, lsp::sharding::contiguous},
      {4, 4, lp::strategy::ulysses, lsp::sharding::zigzag},
      {2, 2, lp::strategy::hybrid, lsp::sharding::zigzag},
  };
  const int p = 4;
  std::uint64_t seed = 1210;
  for (const auto& c : cfgs) {
    const auto g = make_global({0, 0, c.hq, c.hkv, 8, 8, true}, docs, seed += 10);
    INFO(lp::to_string(c.only));
    std::vector<int> fused(p, -1);
    std::vector<lp::strategy> kinds(p);
    const auto res = run<double>(
        g, p, true,
        [&](auto& comm, const auto& be) {
          lsp::options o;
          o.attention = opts_of(g.s);
          o.machine = {1e12, 1e10};
          o.layout = c.layout;
          o.only = c.only;
          auto sp = lsp::detail::make_plan_with<loom::fp64>(be, comm, reference_steps{},
                                                            loom::segments<>(std::span<const index_t>(g.cu)),
                                                            shape_of(g.s), o, "sequence_parallel::make_plan (test)");
          using Plan = decltype(sp);
          using Engine = lt::band_engine<double, double>;
          using B = std::remove_cvref_t<decltype(be)>;
          using Comm = std::remove_cvref_t<decltype(comm)>;
          static_assert(std::is_same_v<typename Plan::ring_q_plan,
                                       la::ring::fused_plan<B, loom::fp64, Engine, la::ring::pass_q>>);
          static_assert(std::is_same_v<typename Plan::hybrid_plan,
                                       lh::plan<B, Comm, loom::fp64, la::ring::fused_plan<B, loom::fp64, Engine>>>);
          // The concrete plan is the steps' (a fused ring plan, or a hybrid over one), not loom's kernel.
          const auto& cp = sp.concrete();
          fused[static_cast<std::size_t>(comm.rank())] =
              std::visit([](const auto& x) { return static_cast<int>(requires { x.fused(); }); }, cp) +
              static_cast<int>(std::holds_alternative<typename Plan::hybrid_plan>(cp));
          kinds[static_cast<std::size_t>(comm.rank())] = sp.kind();  // checked after the ranks join
          return sp;
        },
        [](const auto& be, auto& comm, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto ws) {
          lsp::forward(be, comm, plan, q, k, v, o, l, ws);
        },
        [](const auto& be, auto& comm, const auto& plan, auto q, auto k, auto v, auto o, auto l, auto d, auto dq,
           auto dk, auto dv, auto ws) { lsp::backward(be, comm, plan, q, k, v, o, l, d, dq, dk, dv, ws); });
    const int want = c.only == lp::strategy::ulysses ? 0 : 1;
    for (int f : fused) CHECK(f == want);
    for (auto k : kinds) CHECK(k == c.only);
    check(res, g, true, {1e-10, 1e-10}, lp::to_string(c.only));
  }
}
