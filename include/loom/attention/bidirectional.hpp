#pragma once

//! @file
//! Bidirectional ring attention (TokenRing's idea: both directions of every link busy at once).
//! K/V blocks travel clockwise and counter-clockwise at the same time: after step s a rank has
//! seen the blocks of ranks r - s and r + s, so the P - 1 foreign blocks arrive in ceil((P - 1) / 2)
//! steps instead of P - 1, each step moving two blocks (one per direction) per rank. The transfer of
//! step s + 1 is posted before the blocks of step s are computed. Same contract, plans and
//! results as ring::forward(pass_kv) (see ring.hpp); merges run in a fixed order (own block, then
//! for each step the clockwise block, then the counter-clockwise one), so results are bitwise
//! reproducible for a fixed P. Forward only; the backward of the same layout is ring::backward
//! with pass_kv, which needs only the forward's out and lse.

#include <loom/attention/ring.hpp>

namespace loom::attention::ring {

struct bidirectional_kv {};

template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, bidirectional_kv, const shard::plan& plan, Q q, K k, V v, O out, L lse,
             const options& opt = {}) {
  using namespace detail;
  constexpr std::string_view call = "ring::forward(bidirectional_kv)";
  const problem pb = agree_ring<typename K::value_type, accum_t<typename Q::value_type>>(
      comm, plan, opt, call, [&] { return check_forward(q, k, v, out, lse, opt, call); });
  using T = typename K::value_type;
  using Acc = accum_t<typename Q::value_type>;
  const int p = comm.size(), me = comm.rank();
  const int foreign = p - 1, cw_steps = (foreign + 1) / 2, ccw_steps = foreign / 2;
  const shard_coords sc(plan);
  block3<T> kcw(pb.tk, pb.hkv, pb.dk), vcw(pb.tk, pb.hkv, pb.dv);
  copy_in(k, kcw);
  copy_in(v, vcw);
  block3<T> kccw = kcw, vccw = vcw, kcw_n(0, pb.hkv, pb.dk), vcw_n(0, pb.hkv, pb.dv), kccw_n(0, pb.hkv, pb.dk),
            vccw_n(0, pb.hkv, pb.dv);
  block3<Acc> acc(pb.tq, pb.hq, pb.dv), part(pb.tq, pb.hq, pb.dv);
  block2<Acc> lacc(pb.tq, pb.hq), lpart(pb.tq, pb.hq);
  std::vector<typename C::request> reqs;
  // Posts step s's transfers: the clockwise chain brings r - s from r - 1, the counter-clockwise
  // chain brings r + s from r + 1.
  auto post = [&](int s) {
    reqs.clear();
    if (s <= cw_steps) {
      const index_t rows = plan.rank(ring_next(me, p, -s)).tokens;
      kcw_n.resize(rows);
      vcw_n.resize(rows);
      reqs.push_back(comm.isend(kcw.span(), ring_next(me, p), 10));
      reqs.push_back(comm.isend(vcw.span(), ring_next(me, p), 11));
      reqs.push_back(comm.irecv(kcw_n.span(), ring_next(me, p, -1), 10));
      reqs.push_back(comm.irecv(vcw_n.span(), ring_next(me, p, -1), 11));
    }
    if (s <= ccw_steps) {
      const index_t rows = plan.rank(ring_next(me, p, s)).tokens;
      kccw_n.resize(rows);
      vccw_n.resize(rows);
      reqs.push_back(comm.isend(kccw.span(), ring_next(me, p, -1), 12));
      reqs.push_back(comm.isend(vccw.span(), ring_next(me, p, -1), 13));
      reqs.push_back(comm.irecv(kccw_n.span(), ring_next(me, p), 12));
      reqs.push_back(comm.irecv(vccw_n.span(), ring_next(me, p), 13));
    }
  };
  auto add = [&](const block3<T>& kb, const block3<T>& vb, int src, bool first) {
    auto& o = first ? acc : part;
    auto& l = first ? lacc : lpart;
    attention::forward(b, q, kb.cview(), vb.cview(), sc.of(me), sc.of(src), o.view(), l.view(), opt);
    if (!first) merge(b, acc.view(), lacc.view(), part.cview(), lpart.cview());
  };
  if (cw_steps >= 1) post(1);
  add(kcw, vcw, me, true);
  for (int s = 1; s <= cw_steps; ++s) {
    comm::wait_all(comm, std::span(reqs));
    reqs.clear();
    std::swap(kcw, kcw_n);
    std::swap(vcw, vcw_n);
    if (s <= ccw_steps) {
      std::swap(kccw, kccw_n);
      std::swap(vccw, vccw_n);
    }
    if (s + 1 <= cw_steps) post(s + 1);
    add(kcw, vcw, ring_next(me, p, -s), false);
    if (s <= ccw_steps) add(kccw, vccw, ring_next(me, p, s), false);
  }
  copy_out(acc, out);
  copy_out(lacc, lse);
}

}  // namespace loom::attention::ring
