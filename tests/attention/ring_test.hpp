// Ring attention: every variant (pass_kv, pass_q, all_gather_kv, bidirectional) with every
// sharding (contiguous, zigzag, per_document), forward and backward, against the fp64 oracle;
// balance, communication counts, determinism and rejections. One body, run on host memory
// (serial, comm::local) and on the device stand-in (comm::standin): support/distributed.hpp.

#include <loom/attention/bidirectional.hpp>
#include <loom/attention/ring.hpp>
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

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "fused_reference.hpp"
#include "oracle.hpp"

using loom::index_t;
namespace la = loom::attention;
namespace lr = loom::attention::ring;
namespace lt = loom::test;
namespace shard = loom::shard;

namespace {

using global_inputs = lt::sharded_inputs;
const auto make_global = lt::make_inputs_for;

template <class T>
std::vector<T> rows_of(const shard::plan& plan, int r, const std::vector<double>& global, index_t row) {
  std::vector<double> local(static_cast<std::size_t>(plan.rank(r).tokens * row));
  plan.scatter<double>(r, global, row, local);
  std::vector<T> out(local.size());
  for (std::size_t i = 0; i < local.size(); ++i) out[i] = static_cast<T>(local[i]);
  return out;
}

struct ring_result {
  std::vector<double> out, lse, dq, dk, dv;
  long sends_per_rank = 0;              // point-to-point messages of one forward on rank 0
  long backward_sends = 0;              // and of one backward
  long plan_collectives = 0;            // collectives make_plan ran, the most over the ranks
  long plan_gathered = 0;               // bytes make_plan gathered from the other ranks, rank 0
  long forward_collectives = 0;         // collectives of all the forward calls, rank 0
  long long heap = 0, temporaries = 0;  // allocations of the plan-taking calls, every rank
};

// The rank's communicator with its traffic recorded in `rec`; on host memory comm::local's own
// allocations are not counted (lt::uncounted); on the stand-in they happen on the communication
// stream's thread.
#if defined(LOOM_TEST_BACKEND_STANDIN)
auto counted_comm(loom::comm::standin& c, std::shared_ptr<loom::comm::traffic> rec) {
  return loom::comm::counting<loom::comm::standin>(c, std::move(rec));
}
#else
auto counted_comm(loom::comm::local& c, std::shared_ptr<loom::comm::traffic> rec) {
  return lt::uncounted<loom::comm::counting<loom::comm::local>>(
      loom::comm::counting<loom::comm::local>(c, std::move(rec)));
}
#endif
// Ring pass-KV with a fused band-mask local step (attention/detail/ring_fused.hpp), run on the
// reference engine of fused_reference.hpp: the runner cuDNN's ring uses, on every backend.
// fused_ref_q, fused_ref_ag and fused_ref_bi: the same with Q travelling (pass_q), with K/V
// gathered once (all_gather_kv) and with K/V travelling both ways (bidirectional_kv).
struct fused_ref {};
struct fused_ref_q {};
struct fused_ref_ag {};
struct fused_ref_bi {};
constexpr int fused_ref_kind = 7;  // the local step's id in the agreement (any value but loom's 0)
template <class V>
constexpr bool fused_tag = std::is_same_v<V, fused_ref> || std::is_same_v<V, fused_ref_q> ||
                           std::is_same_v<V, fused_ref_ag> || std::is_same_v<V, fused_ref_bi>;
template <class V>
using fused_variant = std::conditional_t<
    std::is_same_v<V, fused_ref_ag>, lr::all_gather_kv,
    std::conditional_t<std::is_same_v<V, fused_ref_q>, lr::pass_q,
                       std::conditional_t<std::is_same_v<V, fused_ref_bi>, lr::bidirectional_kv, lr::pass_kv>>>;

template <class V, class T>
using rank_plan = std::conditional_t<fused_tag<V>,
                                     lr::fused_plan<lt::backend_under_test, loom::default_precision<T>,
                                                    lt::band_engine<T, loom::accum_t<T>>, fused_variant<V>>,
                                     lr::plan<V, lt::backend_under_test, loom::default_precision<T>>>;

// make_plan of variant V, or the fused plan on the reference engine.
template <class V, class P, class B, class C>
auto make_rank_plan(const B& be, C& comm, const shard::plan& plan, const la::head_shape& s, const la::options& opt) {
  if constexpr (fused_tag<V>) {
    using T = typename P::storage_type;
    using Acc = typename P::accum_type;
    return lr::detail::make_fused_plan<P, fused_variant<V>>(
        be, comm, plan, s, opt, "ring::make_plan (fused reference)", fused_ref_kind,
        [&](const la::detail::fused_program& prog, index_t) {
          return std::make_shared<lt::band_engine<T, Acc>>(prog, s, la::detail::scale_of<Acc>(opt, s.dim_qk));
        });
  } else {
    return lr::make_plan<P>(be, comm, V{}, plan, s, opt);
  }
}

// Runs variant V (and its backward when `bwd`) on P in-process ranks through one plan per rank
// and `calls` calls of each; gathers global results. The communicator's own allocations are not
// counted (lt::uncounted); the calls' are, on each rank's thread. `plans`, when given, are used
// instead of fresh ones (one per rank, made by an earlier run).
template <class V, class T = double>
ring_result run_ring(const global_inputs& g, int p, const shard::plan& plan, bool bwd, int calls = 1,
                     const std::vector<rank_plan<V, T>>* plans = nullptr) {
  using Acc = loom::accum_t<T>;
  using P = loom::default_precision<T>;
  const auto& s = g.s;
  ring_result res;
  res.out.assign(g.want.out.size(), 0.0);
  res.lse.assign(g.want.lse.size(), 0.0);
  res.dq.assign(g.q.size(), 0.0);
  res.dk.assign(g.k.size(), 0.0);
  res.dv.assign(g.v.size(), 0.0);
  std::mutex mu;
  const la::options opt{s.causal, s.window, s.scale};
  lt::run_ranks(p, [&](auto& lc, const auto& be) {
    auto rec = std::make_shared<loom::comm::traffic>();
    auto comm = counted_comm(lc, rec);
    const int r = comm.rank();
    const index_t n = plan.rank(r).tokens;
    auto q = rows_of<T>(plan, r, g.q, s.hq * s.dk), k = rows_of<T>(plan, r, g.k, s.hkv * s.dk),
         v = rows_of<T>(plan, r, g.v, s.hkv * s.dv), dout = rows_of<T>(plan, r, g.dout, s.hq * s.dv);
    std::vector<T> out(static_cast<std::size_t>(n * s.hq * s.dv)), dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<Acc> lse(static_cast<std::size_t>(n * s.hq));
    const lt::dview_t<const T, 3> qv(q.data(), {n, s.hq, s.dk}), kv(k.data(), {n, s.hkv, s.dk}),
        vv(v.data(), {n, s.hkv, s.dv});
    const auto rp = plans ? (*plans)[static_cast<std::size_t>(r)]
                          : make_rank_plan<V, P>(be, comm, plan, {s.hq, s.hkv, s.dk, s.dv}, opt);
    const long planned = rec->collectives.load(), gathered = rec->gathered_in.load();
    loom::workspace_buffer ws(std::max(rp.workspace_bytes(), rp.backward_workspace_bytes()));
    const long m0 = rec->messages.load();
    const auto fwd = lt::count_allocations([&] {
      for (int c = 0; c < calls; ++c)
        lr::forward(be, comm, rp, qv, kv, vv, lt::dview_t<T, 3>(out.data(), {n, s.hq, s.dv}),
                    lt::dview_t<Acc, 2>(lse.data(), {n, s.hq}), ws.span());
    });
    const long sends = (rec->messages.load() - m0) / calls, fcoll = rec->collectives.load() - planned;
    lt::allocation_report bwa;
    const long m1 = rec->messages.load();
    if (bwd)
      bwa = lt::count_allocations([&] {
        for (int c = 0; c < calls; ++c)
          lr::backward(be, comm, rp, qv, kv, vv, lt::dview_t<const T, 3>(out.data(), {n, s.hq, s.dv}),
                       lt::dview_t<const Acc, 2>(lse.data(), {n, s.hq}),
                       lt::dview_t<const T, 3>(dout.data(), {n, s.hq, s.dv}),
                       lt::dview_t<T, 3>(dq.data(), {n, s.hq, s.dk}), lt::dview_t<T, 3>(dk.data(), {n, s.hkv, s.dk}),
                       lt::dview_t<T, 3>(dv.data(), {n, s.hkv, s.dv}), ws.span());
      });
    const long bsends = (rec->messages.load() - m1) / calls;
    loom::fence(be);
    auto widen = [](const auto& x) { return std::vector<double>(x.begin(), x.end()); };
    std::lock_guard<std::mutex> lock(mu);
    res.heap += fwd.heap + bwa.heap;
    res.temporaries += fwd.temporaries + bwa.temporaries;
    res.plan_collectives = std::max(res.plan_collectives, planned);
    if (r == 0) {
      res.plan_gathered = gathered;
      res.sends_per_rank = sends;
      res.backward_sends = bsends;
      res.forward_collectives = fcoll;
    }
    plan.gather<double>(r, widen(out), s.hq * s.dv, res.out);
    plan.gather<double>(r, widen(lse), s.hq, res.lse);
    if (bwd) {
      plan.gather<double>(r, widen(dq), s.hq * s.dk, res.dq);
      plan.gather<double>(r, widen(dk), s.hkv * s.dk, res.dk);
      plan.gather<double>(r, widen(dv), s.hkv * s.dv, res.dv);
    }
  });
  return res;
}

// The same through the convenience forms (one agreement per call).
template <class V, class T = double>
ring_result run_convenience(const global_inputs& g, int p, const shard::plan& plan, bool bwd) {
  using Acc = loom::accum_t<T>;
  const auto& s = g.s;
  ring_result res;
  res.out.assign(g.want.out.size(), 0.0);
  res.lse.assign(g.want.lse.size(), 0.0);
  res.dq.assign(g.q.size(), 0.0);
  res.dk.assign(g.k.size(), 0.0);
  res.dv.assign(g.v.size(), 0.0);
  std::mutex mu;
  const la::options opt{s.causal, s.window, s.scale};
  lt::run_ranks(p, [&](auto& lc, const auto& be) {
    auto rec = std::make_shared<loom::comm::traffic>();
    loom::comm::counting<std::remove_reference_t<decltype(lc)>> comm(lc, rec);
    const int r = comm.rank();
    const index_t n = plan.rank(r).tokens;
    auto q = rows_of<T>(plan, r, g.q, s.hq * s.dk), k = rows_of<T>(plan, r, g.k, s.hkv * s.dk),
         v = rows_of<T>(plan, r, g.v, s.hkv * s.dv), dout = rows_of<T>(plan, r, g.dout, s.hq * s.dv);
    std::vector<T> out(static_cast<std::size_t>(n * s.hq * s.dv)), dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<Acc> lse(static_cast<std::size_t>(n * s.hq));
    const lt::dview_t<const T, 3> qv(q.data(), {n, s.hq, s.dk}), kv(k.data(), {n, s.hkv, s.dk}),
        vv(v.data(), {n, s.hkv, s.dv});
    lr::forward(be, comm, V{}, plan, qv, kv, vv, lt::dview_t<T, 3>(out.data(), {n, s.hq, s.dv}),
                lt::dview_t<Acc, 2>(lse.data(), {n, s.hq}), opt);
    const long fcoll = rec->collectives.load();
    if (bwd)
      lr::backward(be, comm, V{}, plan, qv, kv, vv, lt::dview_t<const T, 3>(out.data(), {n, s.hq, s.dv}),
                   lt::dview_t<const Acc, 2>(lse.data(), {n, s.hq}),
                   lt::dview_t<const T, 3>(dout.data(), {n, s.hq, s.dv}), lt::dview_t<T, 3>(dq.data(), {n, s.hq, s.dk}),
                   lt::dview_t<T, 3>(dk.data(), {n, s.hkv, s.dk}), lt::dview_t<T, 3>(dv.data(), {n, s.hkv, s.dv}), opt);
    loom::fence(be);
    auto widen = [](const auto& x) { return std::vector<double>(x.begin(), x.end()); };
    std::lock_guard<std::mutex> lock(mu);
    if (r == 0) res.forward_collectives = fcoll;
    plan.gather<double>(r, widen(out), s.hq * s.dv, res.out);
    plan.gather<double>(r, widen(lse), s.hq, res.lse);
    if (bwd) {
      plan.gather<double>(r, widen(dq), s.hq * s.dk, res.dq);
      plan.gather<double>(r, widen(dk), s.hkv * s.dk, res.dk);
      plan.gather<double>(r, widen(dv), s.hkv * s.dv, res.dv);
    }
  });
  return res;
}

bool bitwise(const ring_result& a, const ring_result& b) {
  auto same = [](const std::vector<double>& x, const std::vector<double>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
  };
  return same(a.out, b.out) && same(a.lse, b.lse) && same(a.dq, b.dq) && same(a.dk, b.dk) && same(a.dv, b.dv);
}

void check(const ring_result& got, const global_inputs& g, bool bwd, lt::tolerance tol, const char* what) {
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

}  // namespace

TEST_CASE("ring attention: every variant and sharding equals the oracle, fp64, P = 1..8" LOOM_BACKEND_TAG,
          "[attention][ring]") {
  const std::vector<index_t> docs{0, 1, 8, 138, 141, lt::long_document_end};  // lengths 1, 7, 130, 3, 1000 (400)
  const auto g = make_global({0, 0, 4, 2, 32, 24, true}, docs, 100);
  const lt::tolerance tol{1e-10, 1e-10};
  for (int p : {1, 2, 3, 4, 5, 8}) {
    if (lt::sanitized && (p == 4 || p == 8)) continue;  // sanitizer builds: odd, even and P = 1
    if (lt::sanitized && lt::standin_ranks_run && (p == 1 || p == 5)) continue;  // and on the stand-in: 2, 3
    for (int strategy = 0; strategy < 3; ++strategy) {
      const auto plan = strategy == 0   ? plan_of<shard::contiguous>(docs, p)
                        : strategy == 1 ? plan_of<shard::zigzag>(docs, p)
                                        : plan_of<shard::per_document>(docs, p);
      INFO("P = " << p << ", strategy " << strategy);
      const auto kv = run_ring<lr::pass_kv>(g, p, plan, true);
      check(kv, g, true, tol, "pass_kv");
      CHECK(kv.sends_per_rank == 2 * (p - 1));  // forward: P - 1 K/V block transfers per rank
      check(run_ring<lr::pass_q>(g, p, plan, true), g, true, tol, "pass_q");
      check(run_ring<lr::all_gather_kv>(g, p, plan, true), g, true, tol, "all_gather_kv");
      CHECK(kv.backward_sends == 2 * (p - 1) + (p > 1 ? 2 * p : 0));  // K/V P - 1 times, dK/dV P times
      const auto bi = run_ring<lr::bidirectional_kv>(g, p, plan, true);
      check(bi, g, true, tol, "bidirectional_kv");
      CHECK(bi.sends_per_rank == 2 * (p - 1));  // the same blocks in half the steps, both directions
      // backward: K/V and dK/dV P - 1 times each (both directions at once), then each direction's
      // dK/dV straight home
      CHECK(bi.backward_sends == 4 * (p - 1) + (p > 1 ? 2 : 0) + (p > 2 ? 2 : 0));
    }
  }
}

TEST_CASE(
    "ring attention on a fused band-mask engine: every sharding equals the oracle, fp64 and bf16" LOOM_BACKEND_TAG,
    "[attention][ring][fused]") {
  // The runner of ring_cudnn.cuh with the reference engine: per step the fused blocks of the
  // shard plan (full, band or none), partial (out, lse) merged, dQ / dK / dV partials added in
  // the accumulation type; the same traffic as pass_kv.
  const std::vector<index_t> docs{0, 1, 8, 138, 141, 541};  // lengths 1, 7, 130, 3, 400
  const auto g = make_global({0, 0, 4, 2, 16, 8, true}, docs, 1200);
  for (int p : {1, 2, 3, 5}) {
    if (lt::sanitized && lt::standin_ranks_run && p == 5) continue;
    for (int strategy = 0; strategy < 3; ++strategy) {
      const auto plan = strategy == 0   ? plan_of<shard::contiguous>(docs, p)
                        : strategy == 1 ? plan_of<shard::zigzag>(docs, p)
                                        : plan_of<shard::per_document>(docs, p);
      INFO("P = " << p << ", strategy " << strategy);
      const auto f = run_ring<fused_ref>(g, p, plan, true);
      check(f, g, true, {1e-10, 1e-10}, "fused, fp64");
      CHECK(f.sends_per_rank == 2 * (p - 1));
      CHECK(f.backward_sends == 2 * (p - 1) + (p > 1 ? 2 * p : 0));
      if (lt::sanitized && strategy != 1) continue;  // sanitizer builds: the other variants on zigzag shards
      // K/V gathered once: no point-to-point message; the same steps and merges, so the forward's
      // bits are pass-KV's (dQ too: added step by step in the same order).
      const auto ag = run_ring<fused_ref_ag>(g, p, plan, true);
      check(ag, g, true, {1e-10, 1e-10}, "fused all_gather_kv, fp64");
      CHECK(ag.sends_per_rank == 0);
      CHECK(ag.backward_sends == 0);
      CHECK(ag.forward_collectives == 2);  // one all_gather of K, one of V
      // Q travels (P - 1 transfers), the partials go home by one all_to_allv; in the backward Q,
      // out, dO and lse travel P - 1 times and the dQ accumulator P times.
      const auto pq = run_ring<fused_ref_q>(g, p, plan, true);
      check(pq, g, true, {1e-10, 1e-10}, "fused pass_q, fp64");
      CHECK(pq.sends_per_rank == p - 1);
      CHECK(pq.forward_collectives == 1);
      CHECK(pq.backward_sends == 4 * (p - 1) + (p > 1 ? p : 0));
      // Both directions at once: ring::bidirectional_kv's transfers.
      const auto bi = run_ring<fused_ref_bi>(g, p, plan, true);
      check(bi, g, true, {1e-10, 1e-10}, "fused bidirectional_kv, fp64");
      CHECK(bi.sends_per_rank == 2 * (p - 1));
      CHECK(bi.backward_sends == 4 * (p - 1) + (p > 1 ? 2 : 0) + (p > 2 ? 2 : 0));
      CHECK(ag.out == f.out);
      CHECK(ag.lse == f.lse);
      CHECK(ag.dq == f.dq);
    }
  }
  // bf16 storage: each step's partial out and dQ / dK / dV are rounded to bf16 (as a fused kernel
  // writes them) before they are merged or added in float.
  const auto b = make_global({0, 0, 4, 2, 64, 64, true}, docs, 1210);
  check(run_ring<fused_ref, loom::bfloat16>(b, 4, plan_of<shard::zigzag>(docs, 4), true), b, true, {2e-2, 2e-2},
        "fused, bf16");
  check(run_ring<fused_ref_ag, loom::bfloat16>(b, 3, plan_of<shard::per_document>(docs, 3), true), b, true,
        {2e-2, 2e-2}, "fused all_gather_kv, bf16");
  check(run_ring<fused_ref_q, loom::bfloat16>(b, 3, plan_of<shard::zigzag>(docs, 3), true), b, true, {2e-2, 2e-2},
        "fused pass_q, bf16");
  check(run_ring<fused_ref_bi, loom::bfloat16>(b, 4, plan_of<shard::contiguous>(docs, 4), true), b, true, {2e-2, 2e-2},
        "fused bidirectional_kv, bf16");
}

TEST_CASE(
    "ring attention on a fused engine: the local step is agreed, an engine's refusal is every rank's" LOOM_BACKEND_TAG,
    "[attention][ring][fused][errors]") {
  const std::vector<index_t> docs{0, 40};
  const auto plan = plan_of<shard::contiguous>(docs, 2);
  const la::head_shape hs{4, 2, 8, 8};
  using P = loom::default_precision<float>;
  // Rank 0 plans a fused step, rank 1 loom's kernel: both refuse. (Under one call name: a fused
  // plan's own name, as ring_cudnn.cuh's, differs from make_plan's and is refused first.)
  auto what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    if (comm.rank() == 0)
      (void)lr::detail::make_fused_plan<P>(be, comm, plan, hs, {}, "ring::make_plan", fused_ref_kind,
                                           [&](const la::detail::fused_program& prog, index_t) {
                                             return std::make_shared<lt::band_engine<float, float>>(prog, hs, 1.0f);
                                           });
    else
      (void)lr::make_plan<P>(be, comm, plan, hs);
  });
  CHECK(lt::all_contain(what, "ring::make_plan: ranks disagree on the local step"));
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    if (comm.rank() == 0)
      (void)make_rank_plan<fused_ref, P>(be, comm, plan, hs, {});
    else
      (void)lr::make_plan<P>(be, comm, plan, hs);
  });
  CHECK(lt::all_contain(what, "ranks disagree on the call"));
  // An engine that rejects the problem on rank 1 only (as cuDNN may reject a configuration).
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    (void)lr::detail::make_fused_plan<P>(be, comm, plan, hs, {}, "ring::make_plan (fused reference)", fused_ref_kind,
                                         [&](const la::detail::fused_program& prog, index_t) {
                                           LOOM_EXPECTS(comm.rank() != 1, loom::errc::unsupported,
                                                        "the engine refuses rank 1");
                                           return std::make_shared<lt::band_engine<float, float>>(prog, hs, 1.0f);
                                         });
  });
  CHECK(lt::all_contain(what, "the engine refuses rank 1"));
  // The engine reads q through element offsets: a strided q is refused, naming q.
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    const auto rp = make_rank_plan<fused_ref, P>(be, comm, plan, hs, {});
    const index_t n = rp.tokens();
    std::vector<float> q(static_cast<std::size_t>(n * 4 * 16)), kv(static_cast<std::size_t>(n * 2 * 8)), o(q.size()),
        l(static_cast<std::size_t>(n * 4));
    loom::workspace_buffer ws(rp.workspace_bytes());
    lr::forward(be, comm, rp, lt::dview_t<const float, 3>(q.data(), {n, 4, 8}, {64, 16, 1}),
                lt::dview_t<const float, 3>(kv.data(), {n, 2, 8}), lt::dview_t<const float, 3>(kv.data(), {n, 2, 8}),
                lt::dview_t<float, 3>(o.data(), {n, 4, 8}), lt::dview_t<float, 2>(l.data(), {n, 4}), ws.span());
  });
  CHECK(lt::all_contain(what, "ring::forward (fused): q must be dense [tokens, heads, dim]"));
}

TEST_CASE("ring attention: 8 heads with 8, 2 and 1 kv heads, dims 64 and 96, full and causal" LOOM_BACKEND_TAG,
          "[attention][ring]") {
  const std::vector<index_t> docs{0, 1, 8, 138, 141, lt::long_document_end};
  for (index_t hkv : {index_t{8}, index_t{2}, index_t{1}}) {
    if (lt::sanitized && hkv != 1) continue;
    const auto g = make_global({0, 0, 8, hkv, 64, 64, true}, docs, 200 + static_cast<std::uint64_t>(hkv));
    check(run_ring<lr::pass_kv>(g, 3, plan_of<shard::per_document>(docs, 3), true), g, true, {1e-10, 1e-10}, "causal");
  }
  const auto full = make_global({0, 0, 8, 2, 96, 96, false}, {0, 131, 1021}, 210);
  if (!(lt::sanitized && lt::standin_ranks_run))
    check(run_ring<lr::pass_q>(full, 4, plan_of<shard::zigzag>({0, 131, 1021}, 4), true), full, true, {1e-10, 1e-10},
          "full");
  // fp32 and bf16 storage: the tolerances against the fp64 oracle of the rounded inputs
  // are looser than rounding the inputs themselves, so the oracle sees the unrounded ones here.
  const auto f = make_global({0, 0, 4, 2, 64, 64, true}, docs, 220);
  check(run_ring<lr::pass_kv, float>(f, 4, plan_of<shard::zigzag>(docs, 4), true), f, true, {2e-5, 2e-5}, "fp32");
  check(run_ring<lr::pass_kv, loom::bfloat16>(f, 4, plan_of<shard::per_document>(docs, 4), false), f, false,
        {2e-2, 2e-2}, "bf16");
}

TEST_CASE("ring attention: balance of the plans, determinism" LOOM_BACKEND_TAG, "[attention][ring]") {
  // One causal document: zigzag and per_document give every rank the same causal pairs within 1%
  // (far inside the "1% plus one chunk").
  for (int p : {2, 3, 4, 8}) {
    const std::vector<index_t> one{0, 8191};
    for (int strategy : {1, 2}) {
      const auto plan = strategy == 1 ? plan_of<shard::zigzag>(one, p) : plan_of<shard::per_document>(one, p);
      double total = 0, worst = 0;
      for (int r = 0; r < p; ++r) total += static_cast<double>(plan.rank(r).causal_pairs);
      const double mean = total / p;
      for (int r = 0; r < p; ++r)
        worst = std::max(worst, std::abs(static_cast<double>(plan.rank(r).causal_pairs) - mean));
      INFO("P = " << p << " strategy " << strategy);
      CHECK(worst <= 0.01 * mean + 8191.0);  // 1% plus one token's row of keys
    }
  }
  const std::vector<index_t> docs{0, 1, 8, 138, 141, 1141};
  const auto g = make_global({0, 0, 2, 1, 32, 32, true}, docs, 300);
  const auto plan = plan_of<shard::zigzag>(docs, 5);
  const auto a = run_ring<lr::pass_kv, float>(g, 5, plan, true), b = run_ring<lr::pass_kv, float>(g, 5, plan, true);
  REQUIRE(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(double)) == 0);
  REQUIRE(std::memcmp(a.dk.data(), b.dk.data(), a.dk.size() * sizeof(double)) == 0);
}

TEST_CASE("ring attention: rejections on every rank" LOOM_BACKEND_TAG, "[attention][ring][errors]") {
  const std::vector<index_t> docs{0, 40};
  const auto plan = plan_of<shard::contiguous>(docs, 2);
  // Rank 1 claims 4 kv heads, rank 0 claims 2: both ranks must refuse.
  auto what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    const index_t n = plan.rank(comm.rank()).tokens;
    const index_t hkv = comm.rank() == 0 ? 2 : 4;
    std::vector<double> q(static_cast<std::size_t>(n * 4 * 8)), k(static_cast<std::size_t>(n * hkv * 8)), out(q.size()),
        lse(static_cast<std::size_t>(n * 4));
    lr::forward(be, comm, lr::pass_kv{}, plan, lt::dview_t<const double, 3>(q.data(), {n, 4, 8}),
                lt::dview_t<const double, 3>(k.data(), {n, hkv, 8}),
                lt::dview_t<const double, 3>(k.data(), {n, hkv, 8}), lt::dview_t<double, 3>(out.data(), {n, 4, 8}),
                lt::dview_t<double, 2>(lse.data(), {n, 4}));
  });
  CHECK(lt::all_contain(what, "ranks disagree on the shapes"));
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    std::vector<double> q(5 * 2 * 8), out(q.size()), lse(10);
    lr::forward(be, comm, lr::pass_kv{}, plan, lt::dview_t<const double, 3>(q.data(), {5, 2, 8}),
                lt::dview_t<const double, 3>(q.data(), {5, 2, 8}), lt::dview_t<const double, 3>(q.data(), {5, 2, 8}),
                lt::dview_t<double, 3>(out.data(), {5, 2, 8}), lt::dview_t<double, 2>(lse.data(), {5, 2}));
  });
  CHECK(lt::all_contain(what, "q holds 5 tokens but the plan gives rank"));
  const auto plan3 = plan_of<shard::contiguous>(docs, 3);
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    std::vector<double> q(20 * 2 * 8), out(q.size()), lse(40);
    lr::forward(be, comm, lr::pass_q{}, plan3, lt::dview_t<const double, 3>(q.data(), {20, 2, 8}),
                lt::dview_t<const double, 3>(q.data(), {20, 2, 8}), lt::dview_t<const double, 3>(q.data(), {20, 2, 8}),
                lt::dview_t<double, 3>(out.data(), {20, 2, 8}), lt::dview_t<double, 2>(lse.data(), {20, 2}));
  });
  CHECK(lt::all_contain(what, "the plan is for 3 ranks but the communicator has 2"));
}

TEST_CASE("ring attention: a non-finite input stays in its document on every rank" LOOM_BACKEND_TAG,
          "[attention][ring][nonfinite]") {
  // Document 1 spans rank boundaries for every sharding; one of its q, k, v or dout values is NaN
  // or inf. Every other document's out, lse and gradients are bitwise those of the clean run.
  const std::vector<index_t> docs{0, 40, 141, 163, 250};
  const auto clean = make_global({0, 0, 4, 2, 16, 16, true}, docs, 400);
  const index_t t = 77;  // in document 1
  const auto& s = clean.s;
  for (int p : {2, 3}) {
    for (int strategy = 0; strategy < 3; ++strategy) {
      const auto plan = strategy == 0   ? plan_of<shard::contiguous>(docs, p)
                        : strategy == 1 ? plan_of<shard::zigzag>(docs, p)
                                        : plan_of<shard::per_document>(docs, p);
      auto sweep = [&](auto variant, bool bwd, const char* name) {
        using V = decltype(variant);
        const auto ref = run_ring<V, double>(clean, p, plan, bwd);
        for (int which = 0; which < (bwd ? 4 : 3); ++which) {
          INFO(name << " P = " << p << " strategy " << strategy << " input "
                    << "qkvd"[which]);
          auto g = clean;
          const double bad = which % 2 ? std::numeric_limits<double>::infinity() : std::nan("");
          lt::poison(g, which, t, bad);
          const auto got = run_ring<V, double>(g, p, plan, bwd);
          lt::require_same_outside(got.out, ref.out, s.hq * s.dv, 40, 141, "out");
          lt::require_same_outside(got.lse, ref.lse, s.hq, 40, 141, "lse");
          if (which == 0) CHECK(std::isnan(got.lse[t * s.hq + 1]));  // visible where it lands
          if (which == 1) CHECK(std::isnan(got.lse[140 * s.hq + 2]));
          if (which == 2) CHECK(!std::isfinite(got.out[(140 * s.hq + 2) * s.dv]));
          if (!bwd) continue;
          lt::require_same_outside(got.dq, ref.dq, s.hq * s.dk, 40, 141, "dq");
          lt::require_same_outside(got.dk, ref.dk, s.hkv * s.dk, 40, 141, "dk");
          lt::require_same_outside(got.dv, ref.dv, s.hkv * s.dv, 40, 141, "dv");
          if (which == 3) CHECK(!std::isfinite(got.dq[(t * s.hq + 1) * s.dk]));
        }
      };
      sweep(lr::pass_kv{}, true, "pass_kv");
      sweep(lr::pass_q{}, true, "pass_q");
      sweep(lr::all_gather_kv{}, true, "all_gather_kv");
      sweep(lr::bidirectional_kv{}, true, "bidirectional_kv");
    }
  }
}

namespace {

// Plans of every rank, made on their own rank threads.
template <class V, class T>
std::vector<rank_plan<V, T>> make_plans(const global_inputs& g, int p, const shard::plan& plan) {
  const auto& s = g.s;
  std::vector<rank_plan<V, T>> plans(static_cast<std::size_t>(p));
  lt::run_ranks(p, [&](auto& comm, const auto& be) {
    plans[static_cast<std::size_t>(comm.rank())] = make_rank_plan<V, loom::default_precision<T>>(
        be, comm, plan, {s.hq, s.hkv, s.dk, s.dv}, la::options{s.causal, s.window, s.scale});
  });
  return plans;
}

template <class V>
void check_plan_lifecycle(const global_inputs& g, int p, const shard::plan& plan, const char* name) {
  INFO(name << ", P = " << p);
  const auto one = run_ring<V, double>(g, p, plan, true, 1), three = run_ring<V, double>(g, p, plan, true, 3);
  check(one, g, true, {1e-10, 1e-10}, name);
  // The agreement runs once, in make_plan: one all_gather; calls add only the variant's own
  // collectives (none for the ring passes).
  CHECK(one.plan_collectives == 1);
  CHECK(one.plan_gathered == static_cast<long>((p - 1) * loom::comm::agreement_bytes));  // an all_gather
  CHECK(three.plan_collectives == 1);
  CHECK(three.forward_collectives == 3 * one.forward_collectives);
  if (!std::is_same_v<V, lr::pass_q> && !std::is_same_v<V, lr::all_gather_kv> && !std::is_same_v<V, fused_ref_ag> &&
      !std::is_same_v<V, fused_ref_q>)
    CHECK(one.forward_collectives == 0);
  // Nothing allocates on a plan-taking call, on any rank.
  CHECK(one.heap == 0);
  CHECK(one.temporaries == 0);
  CHECK(three.heap == 0);
  CHECK(bitwise(one, three));
  // The convenience form: the same bits, plus one agreement per call.
  if constexpr (!fused_tag<V>) {
    const auto conv = run_convenience<V, double>(g, p, plan, true);
    CHECK(bitwise(one, conv));
    CHECK(conv.forward_collectives == 1 + one.forward_collectives);
  }
  // One set of plans shared by two groups of rank threads at once (each with its own
  // workspaces and outputs): the same bits as fresh plans.
  const auto plans = make_plans<V, double>(g, p, plan);
  ring_result a, b;
  std::thread ta([&] { a = run_ring<V, double>(g, p, plan, true, 1, &plans); }),
      tb([&] { b = run_ring<V, double>(g, p, plan, true, 2, &plans); });
  ta.join();
  tb.join();
  CHECK(bitwise(one, a));
  CHECK(bitwise(one, b));
  CHECK(a.plan_collectives == 0);  // the plans were made before
  CHECK(a.heap + b.heap == 0);
}

}  // namespace

TEST_CASE(
    "ring attention: one agreement per plan, no allocation per call, reuse across calls and threads" LOOM_BACKEND_TAG,
    "[attention][ring][plan]") {
  const std::vector<index_t> docs{0, 1, 8, 138, 141, 311};
  const auto g = make_global({0, 0, 4, 2, 16, 8, true, {37, 0}}, docs, 1000);
  for (int p : {1, 3}) {
    const auto plan = plan_of<shard::zigzag>(docs, p);
    check_plan_lifecycle<lr::pass_kv>(g, p, plan, "pass_kv");
    check_plan_lifecycle<lr::pass_q>(g, p, plan, "pass_q");
    check_plan_lifecycle<lr::all_gather_kv>(g, p, plan, "all_gather_kv");
    check_plan_lifecycle<lr::bidirectional_kv>(g, p, plan, "bidirectional_kv");
    check_plan_lifecycle<fused_ref>(g, p, plan, "pass_kv on a fused engine");
    check_plan_lifecycle<fused_ref_q>(g, p, plan, "pass_q on a fused engine");
    check_plan_lifecycle<fused_ref_ag>(g, p, plan, "all_gather_kv on a fused engine");
    check_plan_lifecycle<fused_ref_bi>(g, p, plan, "bidirectional_kv on a fused engine");
  }
}

TEST_CASE("ring attention: windows (left, right) across rank boundaries" LOOM_BACKEND_TAG,
          "[attention][ring][window]") {
  const std::vector<index_t> docs{0, 5, 262, 263, 401};
  const la::window_size ws[] = {{40, 0}, {0, 29}, {23, 23}, {-1, 61}};
  std::uint64_t seed = 1100;
  for (const auto w : ws)
    for (bool causal : {true, false}) {
      const auto g = make_global({0, 0, 4, 2, 16, 16, causal, w}, docs, seed++);
      INFO("window (" << w.left << ", " << w.right << ") causal " << causal);
      const auto plan = plan_of<shard::zigzag>(docs, 3);
      check(run_ring<lr::pass_kv>(g, 3, plan, true), g, true, {1e-10, 1e-10}, "pass_kv");
      check(run_ring<lr::pass_q>(g, 3, plan, true), g, true, {1e-10, 1e-10}, "pass_q");
      check(run_ring<fused_ref>(g, 3, plan, true), g, true, {1e-10, 1e-10}, "pass_kv on a fused engine");
      check(run_ring<fused_ref>(g, 4, plan_of<shard::contiguous>(docs, 4), true), g, true, {1e-10, 1e-10},
            "pass_kv on a fused engine, contiguous");
      check(run_ring<fused_ref_ag>(g, 3, plan, true), g, true, {1e-10, 1e-10}, "all_gather_kv on a fused engine");
      check(run_ring<fused_ref_q>(g, 3, plan, true), g, true, {1e-10, 1e-10}, "pass_q on a fused engine");
      check(run_ring<fused_ref_bi>(g, 4, plan_of<shard::contiguous>(docs, 4), true), g, true, {1e-10, 1e-10},
            "bidirectional_kv on a fused engine");
      check(run_ring<lr::all_gather_kv>(g, 2, plan_of<shard::per_document>(docs, 2), true), g, true, {1e-10, 1e-10},
            "all_gather_kv");
      check(run_ring<lr::bidirectional_kv>(g, 4, plan_of<shard::contiguous>(docs, 4), false), g, false, {1e-10, 1e-10},
            "bidirectional_kv");
    }
}

TEST_CASE("ring attention: make_plan agrees once, per-call checks against the plan" LOOM_BACKEND_TAG,
          "[attention][ring][errors]") {
  const std::vector<index_t> docs{0, 40};
  const auto plan = plan_of<shard::contiguous>(docs, 2);
  // Disagreements are every rank's error, from make_plan.
  auto what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    (void)lr::make_plan(be, comm, plan, {4, comm.rank() == 0 ? index_t{2} : index_t{4}, 8, 8});
  });
  CHECK(lt::all_contain(what, "ring::make_plan: ranks disagree on the shapes"));
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    if (comm.rank() == 0)
      (void)lr::make_plan(be, comm, lr::pass_q{}, plan, {4, 2, 8, 8});
    else
      (void)lr::make_plan(be, comm, lr::pass_kv{}, plan, {4, 2, 8, 8});
  });
  CHECK(lt::all_contain(what, "ranks disagree on the ring variant"));
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    la::options o;
    o.window = {comm.rank() == 1 ? index_t{-3} : index_t{4}, 0};
    (void)lr::make_plan(be, comm, plan, {4, 2, 8, 8}, o);
  });
  CHECK(lt::all_contain(what, "options.window (left, right) must each be >= -1"));
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    (void)lr::make_plan(be, comm, plan_of<shard::contiguous>(docs, 3), {4, 2, 8, 8});
  });
  CHECK(lt::all_contain(what, "the plan is for 3 ranks but the communicator has 2"));
  // Per call, on this rank (here every rank makes the same mistake, so none waits on another).
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    const auto rp = lr::make_plan(be, comm, plan, {4, 2, 8, 8}, la::options{});  // made; the call fails
    const index_t n = rp.tokens();
    std::vector<float> q(static_cast<std::size_t>(n * 4 * 8)), kv(static_cast<std::size_t>(n * 2 * 8)), o(q.size()),
        l(static_cast<std::size_t>(n * 4));
    loom::workspace_buffer ws(rp.workspace_bytes());
    lr::forward(be, comm, rp, lt::dview_t<const float, 3>(q.data(), {n, 4, 8}),
                lt::dview_t<const float, 3>(kv.data(), {n, 2, 8}), lt::dview_t<const float, 3>(kv.data(), {n, 2, 8}),
                lt::dview_t<float, 3>(o.data(), {n, 4, 8}), lt::dview_t<float, 2>(l.data(), {n, 4}),
                ws.span().first(ws.size() - 64));
  });
  CHECK(lt::all_contain(what, "ring::forward: workspace must hold at least"));
  // The backward's workspace is its own size (backward_workspace_bytes), which its message names.
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    const auto rp = lr::make_plan(be, comm, plan, {4, 2, 8, 8});
    const index_t n = rp.tokens();
    std::vector<float> q(static_cast<std::size_t>(n * 4 * 8)), kv(static_cast<std::size_t>(n * 2 * 8)), o(q.size()),
        l(static_cast<std::size_t>(n * 4)), gq(q.size()), gk(kv.size()), gv(kv.size());
    loom::workspace_buffer ws(rp.backward_workspace_bytes());
    using cv3 = lt::dview_t<const float, 3>;
    using v3 = lt::dview_t<float, 3>;
    lr::backward(be, comm, rp, cv3(q.data(), {n, 4, 8}), cv3(kv.data(), {n, 2, 8}), cv3(kv.data(), {n, 2, 8}),
                 cv3(o.data(), {n, 4, 8}), lt::dview_t<const float, 2>(l.data(), {n, 4}), cv3(o.data(), {n, 4, 8}),
                 v3(gq.data(), {n, 4, 8}), v3(gk.data(), {n, 2, 8}), v3(gv.data(), {n, 2, 8}),
                 ws.span().first(ws.size() - 64));
  });
  CHECK(lt::all_contain(what, "ring::backward: workspace must hold at least"));
  CHECK(lt::all_contain(what, "(plan.backward_workspace_bytes())"));
  what = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    const auto rp = lr::make_plan(be, comm, lr::all_gather_kv{}, plan, {4, 2, 8, 8});
    const index_t n = rp.tokens();
    std::vector<float> q(static_cast<std::size_t>(n * 4 * 8)), kv(static_cast<std::size_t>(n * 2 * 8)), o(q.size()),
        l(static_cast<std::size_t>(n * 4));
    loom::workspace_buffer ws(rp.workspace_bytes());
    lr::forward(be, comm, rp, lt::dview_t<const float, 3>(q.data(), {n, 4, 8}),
                lt::dview_t<const float, 3>(kv.data(), {n, 1, 16}), lt::dview_t<const float, 3>(kv.data(), {n, 2, 8}),
                lt::dview_t<float, 3>(o.data(), {n, 4, 8}), lt::dview_t<float, 2>(l.data(), {n, 4}), ws.span());
  });
  CHECK(lt::all_contain(what, "ring::forward: k must be [20, 2, 8], got [20, 1, 16]"));
}

#if defined(LOOM_TEST_BACKEND_STANDIN)
TEST_CASE("ring attention on the stand-in: 50 seeds of random stream delays, the same bits every time",
          "[attention][ring][standin][delays]") {
  // The result depends on the schedule's order only, never on timing: for each P and variant,
  // every seed gives the bits of the first one, which matches the fp64 oracle.
  const std::vector<index_t> docs{0, 3, 40, 97, 101};
  const auto g = make_global({0, 0, 4, 2, 8, 8, true}, docs, 1300);
  std::array<std::array<ring_result, 4>, 6> first{};
  auto opt = lt::standin_ranks();
  opt.max_delay = std::chrono::microseconds(200);
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const int p = 1 + static_cast<int>(seed % 5);
    opt.seed = seed;
    lt::standin_override() = opt;
    const auto plan = plan_of<shard::zigzag>(docs, p);
    const std::array<ring_result, 4> got{
        run_ring<lr::pass_kv>(g, p, plan, true), run_ring<lr::pass_q>(g, p, plan, true),
        run_ring<lr::all_gather_kv>(g, p, plan, true), run_ring<lr::bidirectional_kv>(g, p, plan, true)};
    lt::standin_override().reset();
    INFO("seed " << seed << ", P = " << p);
    for (std::size_t v = 0; v < got.size(); ++v) {
      INFO("variant " << v);
      auto& ref = first[static_cast<std::size_t>(p)][v];
      if (seed < 5) {
        check(got[v], g, true, {1e-10, 1e-10}, "the first seed of each P against the oracle");
        ref = got[v];
      }
      REQUIRE(bitwise(got[v], ref));
    }
  }
}
#endif
