#pragma once

//! @file
//! Scans across ranks: each rank holds a contiguous slice of one global sequence (rank 0 first)
//! and gets the slice of the global result, for any monoid and any linear recurrence.
//!
//!   auto plan = loom::scan::make_plan(b, comm, loom::scan::plus<double>{}, n_local, docs, opts);  // agrees once
//!   loom::workspace_buffer ws(plan.workspace_bytes());
//!   loom::scan::inclusive_scan(b, comm, plan, in, out, ws.span());     // any number of calls
//!   auto rp = loom::scan::make_plan(b, comm, loom::scan::diagonal{}, n_local, d, docs, opts);
//!   loom::scan::linear_recurrence(b, comm, rp, a, bv, h, loom::scan::states<double>{h0, hT}, ws2.span());
//!
//! make_plan (collective) runs the cross-rank agreement (comm/agreement.hpp) once: every rank's
//! checks and its plan (combine, options, documents, state size) are compared in one all_gather of
//! comm::agreement_bytes per rank, which also carries every rank's length (where its slice lies).
//! A rejection or a disagreement is the same loom::error on every rank. A call then checks its
//! views against the plan on its own rank only: a mismatch is a loom::error on that rank, while
//! the other ranks, already in the call's all_gather, get the communicator's timeout error.
//! Plans are immutable, reusable and shareable between threads for reading (calls on one
//! communicator must still be issued in the same order on every rank).
//!
//! Algorithm of a call (P ranks, any communicator):
//!   1. local reduce: the aggregate of the slice (a monoid value with a segment flag, or the
//!      affine map x -> M x + v of a recurrence), by the blocked engine;
//!   2. one all_gather of the P aggregates;
//!   3. the carry entering the slice: the aggregates of the ranks before it (in processing order:
//!      rank 0 first forward, rank P-1 first in reverse and adjoint scans) folded in order;
//!   4. local scan from that carry.
//! Communication per call: P * sizeof(aggregate) bytes received per rank (a recurrence's aggregate
//! is a_size(d) + d accumulators and a reset flag, padded to whole 64-byte lines), independent of
//! the sequence length; per plan: P * comm::agreement_bytes. Nothing is allocated per call.
//! Document offsets are global (the segmentation of the whole sequence, identical on every rank),
//! so documents that cross rank boundaries are handled: a reset inside a slice is part of its
//! aggregate, and a carry meeting it is replaced, never multiplied by zero. The result has the
//! same bits for every P only when each rank's slice maps to whole blocks; for a fixed P and
//! slicing it is bitwise reproducible.

#include <loom/backend/copy.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>
#include <loom/scan/recurrence.hpp>
#include <loom/scan/scan.hpp>
#include <loom/shard/plan.hpp>

#include <span>
#include <typeinfo>
#include <vector>

namespace loom::scan {

namespace detail {

inline slices slices_of(const std::vector<std::array<std::uint64_t, 2>>& locals, int rank) {
  slices s;
  s.ranks = static_cast<int>(locals.size());
  s.rank = rank;
  for (int q = 0; q < s.ranks; ++q) {
    const auto len = static_cast<index_t>(locals[static_cast<std::size_t>(q)][0]);
    if (q < rank) {
      s.w.begin += len;
      if (len > 0) s.prev = q;
    }
    if (q == rank) s.w.count = len;
    if (q > rank && s.next < 0 && len > 0) s.next = q;
    s.w.total += len;
  }
  return s;
}

//! ws[0..carry) = the carry entering rank `me`: init_carry of the first rank in processing
//! order, advanced by the aggregates of every rank before `me` in that order.
template <class K>
struct prefix_step {
  K k;
  const typename K::agg_type* gathered;  //!< P aggregates, rank order
  index_t agg;
  int ranks, me;
  bool reverse;
  typename K::agg_type* ws;  //!< running carry at ws[0], a temporary after it
  LOOM_HD void operator()(index_t) const {
    auto* carry = ws;
    auto* tmp = ws + k.carry_size;
    k.global_init_carry(carry);
    const int steps = reverse ? ranks - 1 - me : me;
    for (int i = 0; i < steps; ++i) {
      const int q = reverse ? ranks - 1 - i : i;
      k.advance(carry, gathered + q * agg, tmp);
      for (index_t c = 0; c < k.carry_size; ++c) carry[c] = tmp[c];
    }
  }
};

//! The digest of document offsets (global, so the same on every rank). Offsets in device memory
//! are copied to the host for it (plan time only).
template <backend B, memory_space Space>
std::uint64_t docs_digest(const B& b, const loom::segments<Space>& docs) {
  comm::hasher h;
  if (docs.implicit()) return h.add(index_t{-1}).value();
  h.add(docs.size());
  for (const index_t o : loom::detail::host_offsets(b, docs)) h.add(o);
  return h.value();
}

//! What every rank of a cross-rank scan must agree on. `op` names the combine (the monoid or the
//! recurrence's structure), `shape` the extents besides the sequence (state width, element size).
inline comm::signature scan_signature(std::string_view op, const options& opt, std::uint64_t docs, std::uint64_t shape,
                                      index_t local_length) {
  return comm::signature{}
      .add_digest("the combine (monoid or structure)", comm::hasher{}.add_string(op).value())
      .add("the options (direction, block, reproducible)", opt.dir, opt.block, opt.reproducible)
      .add_digest("the document offsets", docs)
      .add_digest("the shapes", shape)
      .local(static_cast<std::uint64_t>(local_length));
}

//! The agreement of a cross-rank make_plan: this rank's checks, then every rank's signature;
//! returns where the slices lie. Every rank gives the same docs (agreed), so checking them
//! against the global length afterwards gives the same outcome on every rank.
//! `extra`: more of this rank's checks (a shard plan's runs), run first inside the agreement.
template <comm::communicator C, class Extra = comm::no_check>
slices agree_plan(C& comm, std::string_view call, index_t n, const comm::signature& sig, const options& opt,
                  const Extra& extra = {}) {
  const auto locals = comm::agree(comm, call, [&] {
    extra();
    LOOM_EXPECTS(n >= 0, errc::invalid_argument, call, ": the local length must be >= 0, got ", n);
    check_options(opt, call);
    return sig;
  });
  return slices_of(locals, comm.rank());
}

//! Steps 1-4 of a call for an engine kernel built from a cross-rank plan.
template <backend B, comm::communicator C, class K>
void run_distributed(const B& b, C& comm, const K& k, const blocking& blk, const cross_rank& cr, bool reverse,
                     std::span<std::byte> ws, std::string_view call) {
  using A = typename K::agg_type;
  static_assert(comm::moves<C, typename backend_traits<B>::memory_space>,
                "cross-rank scans: the communicator cannot move buffers of the backend's memory space (a host "
                "communicator needs host-accessible memory; device memory needs a stream-ordered communicator)");
  LOOM_EXPECTS(comm.size() == cr.ranks && comm.rank() == cr.rank, errc::invalid_argument, call,
               ": the plan was made for rank ", cr.rank, " of ", cr.ranks, ", called on rank ", comm.rank(), " of ",
               comm.size());
  const index_t agg = k.agg_size;
  const workspace_carver carve(ws);
  A* eng = carve.at<A>(0);
  A* own = carve.at<A>(cr.own);
  A* gathered = carve.at<A>(cr.gathered);
  A* prefix = carve.at<A>(cr.prefix);
  const layout lay = layout_for(b, k, blk);
  if (blk.n > 0) {
    const A* total = run_total(b, k, blk, eng);
    for_each_index(b, 1, copy_step<A>{total, own, agg});
  } else {
    for_each_index(b, 1, identity_step<K>{k, own});
  }
  comm::handoff(b, comm);
  comm.all_gather(std::span<const A>(own, static_cast<std::size_t>(agg)),
                  std::span<A>(gathered, static_cast<std::size_t>(cr.ranks * agg)));
  comm::handback(b, comm);
  for_each_index(b, 1, prefix_step<K>{k, gathered, agg, cr.ranks, cr.rank, reverse, prefix});
  for_each_index(b, 1, copy_step<A>{prefix, eng + lay.running(), k.carry_size});
  run_scan(b, k, blk, eng, true);
}

template <backend B, comm::communicator C, class Plan, class In, class Out>
void run_monoid_distributed(const B& b, C& comm, const Plan& p, In in, Out out, bool exclusive,
                            typename Plan::value_type init, std::span<std::byte> ws, std::string_view call) {
  check_monoid_call<B>(p, in, out, exclusive, ws, call);
  with_monoid_kernel(p, in, out, exclusive, init, [&](const auto& k) {
    run_distributed(b, comm, k, plan_access::blocks(p), plan_access::rank_part(p), p.opts().dir == direction::reverse,
                    ws, call);
  });
}

template <backend B, comm::communicator C, class Plan, class AV, class XV, class YV, class InV, class OutV>
void run_recurrence_distributed(const B& b, C& comm, const Plan& p, AV a, XV x, YV y, InV in_states, OutV out_states,
                                bool adjoint, std::span<std::byte> ws) {
  const std::string_view call = adjoint ? "linear_recurrence_adjoint" : "linear_recurrence";
  with_recurrence_kernel<B>(p, a, x, y, in_states, out_states, adjoint, ws, call, [&](const auto& k, const auto& blk) {
    run_distributed(b, comm, k, blk, recurrence_access::rank_part(p), adjoint, ws, call);
  });
  fill_empty_segments(b, p.docs(), in_states, out_states, p.state_size(), recurrence_access::rank_part(p).w.total);
}

//! The cross-rank plans' makers: the signature, the agreement (with `extra` checks), the plan.
template <backend B, comm::communicator C, monoid M, memory_space Space, class Extra>
monoid_plan<B, M, Space, true> cross_monoid_plan(const B& b, C& comm, const M& m, index_t n,
                                                 const loom::segments<Space>& docs, const options& opt,
                                                 const Extra& extra) {
  constexpr std::string_view call = "scan::make_plan";
  const auto sig = scan_signature(typeid(M).name(), opt, docs_digest(b, docs),
                                  comm::hasher{}.add(sizeof(typename M::value_type)).value(), n);
  const slices s = agree_plan(comm, call, n, sig, opt, extra);
  return plan_access::monoid<true>(b, m, s.w, docs, opt, call, rank_extra{s.ranks, s.rank});
}
template <class P, backend B, comm::communicator C, structure St, memory_space Space, class Extra>
auto cross_recurrence_plan_agreed(const B& b, C& comm, St, index_t n, index_t d, const loom::segments<Space>& docs,
                                  const options& opt, const Extra& extra) {
  constexpr std::string_view call = "scan::make_plan";
  using Acc = typename accum_of<P>::type;
  const auto sig = scan_signature(
      St::name(), opt, docs_digest(b, docs),
      comm::hasher{}
          .add(d, St::a_size(d), static_cast<std::uint64_t>(sizeof(std::conditional_t<std::is_void_v<Acc>, char, Acc>)))
          .value(),
      n);
  const slices s = agree_plan(comm, call, n, sig, opt, extra);
  return cross_recurrence_plan<Acc, B, St>(b, s, d, docs, opt, call);
}

}  // namespace detail

//! The plan of cross-rank scans with monoid m: this rank holds n elements of the global sequence;
//! `docs` segments the global sequence (the same on every rank). Collective (one agreement, see
//! the file comment). @throws loom::error on every rank as scan::make_plan, or
//! (invalid_argument) "ranks disagree on ..." when the ranks' monoids, options or docs differ.
template <backend B, comm::communicator C, monoid M, memory_space Space = typename backend_traits<B>::memory_space>
monoid_plan<B, M, Space, true> make_plan(const B& b, C& comm, const M& m, index_t n,
                                         const loom::segments<Space>& docs = {}, const options& opt = {}) {
  return detail::cross_monoid_plan(b, comm, m, n, docs, opt, comm::no_check{});
}

//! The same from a shard plan (shard/plan.hpp) whose ranks each hold one run of the sequence, in
//! rank order (shard::contiguous): this rank's length is its run, the documents are the plan's
//! (host memory: host backends). The scan plan views the shard plan's offsets: keep the shard plan
//! alive while the scan plan is used (a temporary shard plan does not compile). Collective.
//! @throws as above, and (invalid_argument) on every rank when the plan is for another number of
//! ranks or interleaves them (zigzag, per_document).
template <backend B, comm::communicator C, monoid M>
requires backend_traits<B>::memory_space::host_accessible auto make_plan(const B& b, C& comm, const M& m,
                                                                         const shard::plan& sharding,
                                                                         const options& opt = {}) {
  return detail::cross_monoid_plan(b, comm, m, shard::run_of(sharding, comm.rank()).tokens, sharding.segments(), opt,
                                   [&] { shard::expect_runs(sharding, comm.size(), "scan::make_plan"); });
}
template <backend B, comm::communicator C, monoid M>
void make_plan(const B&, C&, const M&, const shard::plan&&, const options& = {}) = delete;

//! The plan of cross-rank recurrences: n time steps of the global sequence on this rank, state
//! size d, documents of the global sequence. P as for the single-rank make_plan. Collective.
template <class P = void, backend B, comm::communicator C, structure St,
          memory_space Space = typename backend_traits<B>::memory_space>
auto make_plan(const B& b, C& comm, St st, index_t n, index_t d, const loom::segments<Space>& docs = {},
               const options& opt = {}) {
  return detail::cross_recurrence_plan_agreed<P>(b, comm, st, n, d, docs, opt, comm::no_check{});
}

//! The same from a shard plan whose ranks each hold one run of the sequence, in rank order
//! (shard::contiguous): this rank's time steps are its run, the documents are the plan's (host
//! memory: host backends; viewed: keep the shard plan alive, a temporary one does not compile).
//! Collective. @throws as above, and (invalid_argument) on every rank when the plan is for another
//! number of ranks or interleaves them (zigzag, per_document).
template <class P = void, backend B, comm::communicator C, structure St>
requires backend_traits<B>::memory_space::host_accessible auto make_plan(const B& b, C& comm, St st,
                                                                         const shard::plan& sharding, index_t d,
                                                                         const options& opt = {}) {
  return detail::cross_recurrence_plan_agreed<P>(b, comm, st, shard::run_of(sharding, comm.rank()).tokens, d,
                                                 sharding.segments(), opt,
                                                 [&] { shard::expect_runs(sharding, comm.size(), "scan::make_plan"); });
}
template <class P = void, backend B, comm::communicator C, structure St>
void make_plan(const B&, C&, St, const shard::plan&&, index_t, const options& = {}) = delete;

//! Cross-rank inclusive scan: `in` and `out` are this rank's slice (plan.size() elements).
//! Collective: every rank calls it with its plan, in the same order. Allocates nothing; one
//! all_gather of the aggregates.
template <backend B, comm::communicator C, class Plan, class In, class Out>
requires detail::is_monoid_plan<Plan, true>
void inclusive_scan(const B& b, C& comm, const Plan& plan, In in, Out out, std::span<std::byte> ws) {
  detail::run_monoid_distributed(b, comm, plan, in, out, false, plan.op().identity(), ws, "inclusive_scan");
}

//! Cross-rank exclusive scan; every document's first element gets `init` (the same on every rank).
template <backend B, comm::communicator C, class Plan, class In, class Out>
requires detail::is_monoid_plan<Plan, true>
void exclusive_scan(const B& b, C& comm, const Plan& plan, In in, Out out, typename Plan::value_type init,
                    std::span<std::byte> ws) {
  detail::run_monoid_distributed(b, comm, plan, in, out, true, init, ws, "exclusive_scan");
}

//! Convenience forms: make_plan (with its agreement), a temporary workspace, the plan form, fence.
template <backend B, comm::communicator C, monoid M, class In, class Out, memory_space Space>
void inclusive_scan(const B& b, C& comm, const M& m, In in, Out out, const loom::segments<Space>& docs,
                    const options& opt = {}) {
  const auto plan = make_plan(b, comm, m, in.extent(0), docs, opt);
  loom::detail::with_temporary_workspace(b, plan.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { inclusive_scan(b, comm, plan, in, out, ws); });
}
template <backend B, comm::communicator C, monoid M, class In, class Out>
void inclusive_scan(const B& b, C& comm, const M& m, In in, Out out, const options& opt = {}) {
  inclusive_scan(b, comm, m, in, out, loom::segments<typename backend_traits<B>::memory_space>{}, opt);
}
template <backend B, comm::communicator C, monoid M, class In, class Out, memory_space Space>
void exclusive_scan(const B& b, C& comm, const M& m, In in, Out out, typename M::value_type init,
                    const loom::segments<Space>& docs, const options& opt = {}) {
  const auto plan = make_plan(b, comm, m, in.extent(0), docs, opt);
  loom::detail::with_temporary_workspace(
      b, plan.workspace_bytes(), [&](std::span<std::byte> ws) { exclusive_scan(b, comm, plan, in, out, init, ws); });
}
template <backend B, comm::communicator C, monoid M, class In, class Out>
void exclusive_scan(const B& b, C& comm, const M& m, In in, Out out, typename M::value_type init,
                    const options& opt = {}) {
  exclusive_scan(b, comm, m, in, out, init, loom::segments<typename backend_traits<B>::memory_space>{}, opt);
}

//! Cross-rank linear recurrence: A, b and h are this rank's rows of the global sequence.
//! st.initial holds every document's initial state (on every rank); st.final_state receives the
//! final states of the documents that end on this rank (and of empty documents), other rows are
//! left untouched. Collective; allocates nothing.
template <backend B, comm::communicator C, class Plan, class AV, class BV, class HV, class T>
requires detail::is_recurrence_plan<Plan, true>
void linear_recurrence(const B& b, C& comm, const Plan& plan, AV a, BV bv, HV h,
                       const states<T, typename Plan::space>& st, std::span<std::byte> ws) {
  detail::run_recurrence_distributed(b, comm, plan, a, bv, h, st.initial, st.final_state, false, ws);
}
template <backend B, comm::communicator C, class Plan, class AV, class BV, class HV>
requires detail::is_recurrence_plan<Plan, true>
void linear_recurrence(const B& b, C& comm, const Plan& plan, AV a, BV bv, HV h, std::span<std::byte> ws) {
  linear_recurrence(b, comm, plan, a, bv, h, states<typename HV::value_type, typename Plan::space>{}, ws);
}

//! Cross-rank adjoint recurrence (see the single-rank form); d_initial rows are written for the
//! documents that start on this rank (and empty documents).
template <backend B, comm::communicator C, class Plan, class AV, class GV, class LV, class T>
requires detail::is_recurrence_plan<Plan, true>
void linear_recurrence_adjoint(const B& b, C& comm, const Plan& plan, AV a, GV g, LV lambda,
                               const adjoint_states<T, typename Plan::space>& st, std::span<std::byte> ws) {
  detail::run_recurrence_distributed(b, comm, plan, a, g, lambda, st.d_final, st.d_initial, true, ws);
}
template <backend B, comm::communicator C, class Plan, class AV, class GV, class LV>
requires detail::is_recurrence_plan<Plan, true>
void linear_recurrence_adjoint(const B& b, C& comm, const Plan& plan, AV a, GV g, LV lambda, std::span<std::byte> ws) {
  linear_recurrence_adjoint(b, comm, plan, a, g, lambda,
                            adjoint_states<typename LV::value_type, typename Plan::space>{}, ws);
}

//! Convenience forms of the cross-rank recurrences.
template <backend B, comm::communicator C, structure St, class AV, class BV, class HV, memory_space Space, class T>
void linear_recurrence(const B& b, C& comm, St st, AV a, BV bv, HV h, const loom::segments<Space>& docs,
                       const states<T, Space>& s, const options& opt = {}) {
  const auto plan = make_plan(b, comm, st, bv.extent(0), bv.extent(1), docs, opt);
  loom::detail::with_temporary_workspace(
      b, plan.workspace_bytes(), [&](std::span<std::byte> ws) { linear_recurrence(b, comm, plan, a, bv, h, s, ws); });
}
template <backend B, comm::communicator C, structure St, class AV, class GV, class LV, memory_space Space, class T>
void linear_recurrence_adjoint(const B& b, C& comm, St st, AV a, GV g, LV lambda, const loom::segments<Space>& docs,
                               const adjoint_states<T, Space>& s, const options& opt = {}) {
  const auto plan = make_plan(b, comm, st, g.extent(0), g.extent(1), docs, opt);
  loom::detail::with_temporary_workspace(b, plan.workspace_bytes(), [&](std::span<std::byte> ws) {
    linear_recurrence_adjoint(b, comm, plan, a, g, lambda, s, ws);
  });
}

}  // namespace loom::scan
