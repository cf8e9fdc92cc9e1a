#pragma once

//! @file
//! Scans across ranks: each rank holds a contiguous slice of one global sequence (rank 0 first)
//! and gets the slice of the global result, for any monoid and any linear recurrence.
//!
//! Algorithm (for P ranks, any communicator):
//!   1. all_gather of the P local lengths (one index each): global offsets of the slices;
//!   2. local reduce: the aggregate of the slice (a monoid value with a segment flag, or the
//!      affine map x -> M x + v of a recurrence), by the blocked engine;
//!   3. one all_gather of the P aggregates;
//!   4. the carry entering the slice: the aggregates of the ranks before it (in processing order:
//!      rank 0 first forward, rank P-1 first in reverse and adjoint scans) folded in order;
//!   5. local scan from that carry.
//! Before step 2 every rank's checks and its call (combine, options, offsets, shapes) go through
//! one agreement (comm/agreement.hpp): a rejection or a disagreement is the same loom::error on
//! every rank, before any aggregate moves.
//! Communication: P * 8 bytes + P * sizeof(aggregate) bytes received per rank, plus the
//! agreement's P * comm::agreement_bytes, independent of the sequence length (a recurrence's
//! aggregate is a_size(d) + d accumulators and a reset flag, padded to whole 64-byte lines).
//! Segment offsets are global (the segmentation of the whole sequence, identical on every rank),
//! so documents that cross rank boundaries are handled: a reset inside a slice is part of its
//! aggregate, and a carry meeting it is replaced, never multiplied by zero. The result has the
//! same bits for every P only when each rank's slice maps to whole blocks; for a fixed P and
//! slicing it is bitwise
//! reproducible.

#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/scan/recurrence.hpp>
#include <loom/scan/scan.hpp>

#include <span>
#include <typeinfo>
#include <vector>

namespace loom::scan {

namespace detail {

//! Where this rank's slice lies in the global sequence (one all_gather of the lengths).
template <comm::communicator C>
window slice_of(C& comm, index_t count, std::string_view call) {
  LOOM_EXPECTS(count >= 0, errc::invalid_argument, call, ": the local length must be >= 0, got ", count);
  const auto p = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> lengths(p);
  const std::int64_t mine = count;
  comm.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(lengths));
  window w{0, 0, count};
  for (std::size_t q = 0; q < p; ++q) {
    if (static_cast<int>(q) < comm.rank()) w.begin += lengths[q];
    w.total += lengths[q];
  }
  return w;
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

//! The digest of segment offsets (global, so the same on every rank); their count only when they
//! are not host-readable.
template <class Offsets>
std::uint64_t offsets_digest(const Offsets* offsets) {
  comm::hasher h;
  if (!offsets) return h.add(index_t{-1}).value();
  h.add(offsets->extent(0));
  if constexpr (Offsets::space::host_accessible)
    for (index_t i = 0; i < offsets->extent(0); ++i) h.add((*offsets)(i));
  return h.value();
}

//! The bytes of a value when they are all significant (arithmetic types, types without padding),
//! else only its size: padding bytes may differ between ranks holding equal values.
template <class T>
std::uint64_t value_digest(const T& v) {
  if constexpr (std::is_arithmetic_v<T> || std::has_unique_object_representations_v<T>)
    return comm::hasher{}.add(v).value();
  else
    return comm::hasher{}.add(sizeof(T)).value();
}

//! What every rank of a cross-rank scan must agree on. `op` names the combine (the monoid or the
//! recurrence's structure), `shape` the extents besides the sequence (state width, initial states).
template <class T>
comm::signature scan_signature(std::string_view op, const options& opt, bool exclusive, const T& init,
                               std::uint64_t offsets, std::uint64_t shape) {
  return comm::signature{}
      .add_digest("the combine (monoid or structure)", comm::hasher{}.add_string(op).value())
      .add("the options (direction, block)", opt.dir, opt.block)
      .add("exclusive or inclusive, and the initial value", exclusive, value_digest(init))
      .add_digest("the segment offsets", offsets)
      .add_digest("the shapes", shape);
}

//! Steps 2-5 for an engine kernel whose window has been set from `w`. `agreed(sig)` runs the
//! cross-rank agreement once this rank's checks (the workspace's) are done, before data moves.
template <backend B, comm::communicator C, class K, class Agreed>
void run_distributed(const B& b, C& comm, const K& k, const blocking& blk, bool reverse, const options& opt,
                     std::string_view call, Agreed&& agreed, const comm::signature& sig) {
  using A = typename K::agg_type;
  const index_t agg = k.agg_size;
  const layout lay = layout_for(k, tile_of(b, blk));
  const index_t local = workspace_size(b, k, blk);
  const index_t ranks = comm.size();
  // workspace: engine state | own aggregate | P gathered aggregates | carry + temporary
  const index_t own = local, gathered = own + agg, prefix = gathered + ranks * agg;
  const index_t need = prefix + 2 * k.carry_size;
  with_workspace<A>(b, opt, need, call, [&](A* ws) {
    agreed(sig);
    if (blk.n > 0) {
      const A* total = run_total(b, k, blk, ws);
      copy_step<A> cp{total, ws + own, agg};
      for_each_index(b, 1, cp);
    } else {
      for_each_index(b, 1, identity_step<K>{k, ws + own});
    }
    fence(b);
    comm.all_gather(std::span<const A>(ws + own, static_cast<std::size_t>(agg)),
                    std::span<A>(ws + gathered, static_cast<std::size_t>(ranks * agg)));
    for_each_index(b, 1,
                   prefix_step<K>{k, ws + gathered, agg, static_cast<int>(ranks), comm.rank(), reverse, ws + prefix});
    for_each_index(b, 1, copy_step<A>{ws + prefix, ws + lay.running(), k.carry_size});
    run_scan(b, k, blk, ws, true);
  });
}

template <backend B, comm::communicator C, monoid M, class In, class Out, class Offsets>
void run_monoid_distributed(const B& b, C& comm, const M& m, In in, Out out, const Offsets* offsets, bool exclusive,
                            typename M::value_type init, const options& opt, std::string_view call) {
  check_space<B, In>();
  check_space<B, Out>();
  const index_t n = in.extent(0);
  // Only segmented scans need to know where the slice lies (their offsets are global).
  const window w = offsets ? slice_of(comm, n, call) : window{n, 0, n};
  comm::agree_within(comm, call, [&](auto& agreed) {
    const auto sig = scan_signature(typeid(M).name(), opt, exclusive, init, offsets_digest(offsets),
                                    comm::hasher{}.add(sizeof(typename M::value_type)).value());
    with_monoid_kernel(m, in, out, offsets, exclusive, init, opt, w, call, [&](const auto& k, const blocking& blk) {
      run_distributed(b, comm, k, blk, opt.dir == direction::reverse, opt, call, agreed, sig);
    });
  });
}

//! The shapes a cross-rank recurrence must agree on: the state width, the transitions' extents
//! besides the rows, and the extents of the per-segment states.
template <class AV, class BV, class IV, class FV>
std::uint64_t recurrence_shape(const AV& a, const BV& bv, const IV& init, const FV& fin) {
  comm::hasher h;
  h.add(bv.extent(1), AV::rank, sizeof(typename BV::value_type));
  for (std::size_t d = 1; d < AV::rank; ++d) h.add(a.extent(d));
  return h.add(init.extent(0), init.extent(1), fin.extent(0), fin.extent(1)).value();
}

}  // namespace detail

//! Cross-rank inclusive scan: `in` and `out` are this rank's slice (any length, 0 included).
//! Collective: every rank of `comm` calls it with the same monoid and options.
template <backend B, comm::communicator C, monoid M, class In, class Out>
void inclusive_scan(const B& b, C& comm, const M& m, In in, Out out, const options& opt = {}) {
  detail::run_monoid_distributed(b, comm, m, in, out, detail::no_offsets<In>(), false, m.identity(), opt,
                                 "inclusive_scan");
}

//! Cross-rank exclusive scan; the first element of the global sequence gets `init`.
template <backend B, comm::communicator C, monoid M, class In, class Out>
void exclusive_scan(const B& b, C& comm, const M& m, In in, Out out, typename M::value_type init,
                    const options& opt = {}) {
  detail::run_monoid_distributed(b, comm, m, in, out, detail::no_offsets<In>(), true, init, opt, "exclusive_scan");
}

//! Cross-rank segmented scan. `offsets` segments the global sequence (same on every rank).
template <backend B, comm::communicator C, monoid M, class In, class Out, class Offsets>
void segmented_inclusive_scan(const B& b, C& comm, const M& m, In in, Out out, Offsets offsets,
                              const options& opt = {}) {
  detail::run_monoid_distributed(b, comm, m, in, out, &offsets, false, m.identity(), opt, "segmented_inclusive_scan");
}

//! Cross-rank exclusive segmented scan.
template <backend B, comm::communicator C, monoid M, class In, class Out, class Offsets>
void segmented_exclusive_scan(const B& b, C& comm, const M& m, In in, Out out, Offsets offsets,
                              typename M::value_type init, const options& opt = {}) {
  detail::run_monoid_distributed(b, comm, m, in, out, &offsets, true, init, opt, "segmented_exclusive_scan");
}

namespace detail {
//! The cross-rank recurrence (states in: the segments' initial states, out: their final states)
//! or its adjoint (in: the gradients at the final states, out: those of the initial states);
//! `agree` false skips the agreement (for callers that agreed on the whole computation once, as
//! the sequence-parallel Newton solver does).
template <backend B, comm::communicator C, structure St, class AV, class XV, class YV, class OffV, class InV,
          class OutV>
void recurrence_impl(const B& b, C& comm, St, AV a, XV x, YV y, OffV offsets, InV in_states, OutV out_states,
                     bool adjoint, const options& opt, bool agree) {
  const std::string_view call = adjoint ? "linear_recurrence_adjoint" : "linear_recurrence";
  const window w = slice_of(comm, x.extent(0), call);
  auto run = [&](auto&& agreed) {
    const auto sig = scan_signature(St::name(), opt, adjoint, 0, offsets_digest(&offsets),
                                    recurrence_shape(a, x, in_states, out_states));
    with_recurrence_kernel<St>(
        a, x, y, offsets, in_states, out_states, w, adjoint, opt, call,
        [&](const auto& k, const auto& blk) { run_distributed(b, comm, k, blk, adjoint, opt, call, agreed, sig); });
  };
  if (agree)
    comm::agree_within(comm, call, run);
  else
    run([](const comm::signature&) {});
  fill_empty_segments(b, offsets, in_states, out_states, x.extent(1), w.total);
}
}  // namespace detail

//! Cross-rank linear recurrence: A, b and h are this rank's rows of the global sequence.
//! seg.offsets segments the global sequence; seg.initial holds every segment's initial state (on
//! every rank); seg.final_state receives the final states of the segments that end on this rank
//! (and of empty segments), other rows are left untouched. Collective: every rank's checks and
//! call are agreed before data moves (see the file comment).
template <backend B, comm::communicator C, structure St, class AV, class BV, class HV, class T, class Space>
void linear_recurrence(const B& b, C& comm, St st, AV a, BV bv, HV h, const segments<T, Space>& seg = {},
                       const options& opt = {}) {
  detail::recurrence_impl(b, comm, st, a, bv, h, seg.offsets, seg.initial, seg.final_state, false, opt, true);
}

//! Cross-rank adjoint recurrence (see the single-rank form); d_initial rows are written for the
//! segments that start on this rank (and empty segments).
template <backend B, comm::communicator C, structure St, class AV, class GV, class LV, class T, class Space>
void linear_recurrence_adjoint(const B& b, C& comm, St st, AV a, GV g, LV lambda,
                               const adjoint_segments<T, Space>& seg = {}, const options& opt = {}) {
  detail::recurrence_impl(b, comm, st, a, g, lambda, seg.offsets, seg.d_final, seg.d_initial, true, opt, true);
}

}  // namespace loom::scan
