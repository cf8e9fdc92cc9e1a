#pragma once

//! @file
//! Exact attention over the ranks of a communicator, for a sequence sharded by a shard::plan
//! (contiguous, zigzag or per_document; see loom/shard/plan.hpp). Each rank passes its own
//! rows: q [n_r, Hq, Dqk], k [n_r, Hkv, Dqk], v [n_r, Hkv, Dv], out [n_r, Hq, Dv], lse [n_r, Hq], with
//! n_r = plan.rank(r).tokens in the plan's local order. Masks use the global (document, position)
//! of every token, taken from the plan, so every variant gives the local kernel's answer.
//!
//! Variants (tag types), with what one rank receives (b = bytes of one element of storage,
//! n = tokens per rank, A = bytes of the accumulation type):
//!   ring::pass_kv        K/V travel the ring, P - 1 steps; the next block's transfer is posted
//!                        before the current block's compute (overlap). Forward: (P - 1) n Hkv
//!                        (Dqk + Dv) b. Backward: the same K/V again plus the dK/dV accumulators,
//!                        P n Hkv (Dqk + Dv) A.
//!   ring::pass_q         Q travels, K/V stay; the P partial (out, lse) come back with one
//!                        all_to_allv and are merged in rank order (Meta's pass-Q, for a large KV
//!                        cache). Forward: (P - 1) n Hq Dqk b + (P - 1) n Hq (Dv + 1) A.
//!   ring::all_gather_kv  K/V gathered once (Llama-3 style; any mask), padded to the largest
//!                        shard: (P - 1) max_n Hkv (Dqk + Dv) b; the backward reduce-scatters dK/dV.
//! Collective: every rank calls with the same plan, shapes and options (checked: a mismatch is a
//! loom::error on every rank). Results are bitwise reproducible for a fixed backend and P. Host
//! memory only: the views are host-accessible, the communicator local or MPI.

#include <loom/attention/detail/ring_common.hpp>

namespace loom::attention::ring {

struct pass_kv {};
struct pass_q {};
struct all_gather_kv {};

namespace detail {
using namespace loom::attention::detail;

template <class Q, class K, class V, class O, class L>
problem check_forward(const Q& q, const K& k, const V& v, const O& out, const L& lse, const options& opt,
                      std::string_view call) {
  static_assert(Q::space::host_accessible, "ring attention runs on host memory");
  const problem pb = check_problem(shape_of(q, k, v), opt, call);
  check_views(pb, q, k, v, out, lse, call);
  return pb;
}

template <class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV>
problem check_backward(const Q& q, const K& k, const V& v, const O& out, const L& lse, const DO& dout, const DQ& dq,
                       const DK& dk, const DV& dv, const options& opt, std::string_view call) {
  const problem pb = check_forward(q, k, v, out, lse, opt, call);
  check_gradients(pb, dout, dq, dk, dv, call);
  return pb;
}

//! Posts the transfer of `cur` to the next rank and of the previous rank's block into `next`.
template <comm::communicator C, class T>
void post_shift(C& comm, std::vector<typename C::request>& reqs, const block3<T>& cur, block3<T>& next,
                index_t next_rows, int tag) {
  const int p = comm.size(), me = comm.rank();
  next.resize(next_rows);
  reqs.push_back(comm.isend(cur.span(), ring_next(me, p), tag));
  reqs.push_back(comm.irecv(next.span(), ring_next(me, p, -1), tag));
}
}  // namespace detail

//! Ring pass-KV forward. See the file comment for the contract.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, pass_kv, const shard::plan& plan, Q q, K k, V v, O out, L lse,
             const options& opt = {}) {
  using namespace detail;
  constexpr std::string_view call = "ring::forward(pass_kv)";
  const problem pb = agree_ring<typename K::value_type, accum_t<typename Q::value_type>>(
      comm, plan, opt, call, [&] { return check_forward(q, k, v, out, lse, opt, call); });
  using T = typename K::value_type;
  using Acc = accum_t<typename Q::value_type>;
  const int p = comm.size(), me = comm.rank();
  const shard_coords sc(plan);
  block3<T> kc(pb.tk, pb.hkv, pb.dk), vc(pb.tk, pb.hkv, pb.dv), kn(0, pb.hkv, pb.dk), vn(0, pb.hkv, pb.dv);
  copy_in(k, kc);
  copy_in(v, vc);
  block3<Acc> acc(pb.tq, pb.hq, pb.dv), part(pb.tq, pb.hq, pb.dv);
  block2<Acc> lacc(pb.tq, pb.hq), lpart(pb.tq, pb.hq);
  std::vector<typename C::request> reqs;
  for (int s = 0; s < p; ++s) {
    const int src = ring_next(me, p, -s);
    reqs.clear();
    if (s + 1 < p) {
      const index_t rows = plan.rank(ring_next(me, p, -(s + 1))).tokens;
      post_shift(comm, reqs, kc, kn, rows, 0);
      post_shift(comm, reqs, vc, vn, rows, 1);
    }
    auto& o = s == 0 ? acc : part;
    auto& l = s == 0 ? lacc : lpart;
    attention::forward(b, q, kc.cview(), vc.cview(), sc.of(me), sc.of(src), o.view(), l.view(), opt);
    if (s > 0) merge(b, acc.view(), lacc.view(), part.cview(), lpart.cview());
    comm::wait_all(comm, std::span(reqs));
    std::swap(kc, kn);
    std::swap(vc, vn);
  }
  copy_out(acc, out);
  copy_out(lacc, lse);
}

//! Ring pass-KV backward: K/V travel again with fp32 (accumulation type) dK/dV accumulators that
//! collect every rank's contribution and arrive home after P steps; dQ accumulates locally.
//! out and lse are the forward's (final) results; dq, dk, dv [n_r, ...] are overwritten.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, pass_kv, const shard::plan& plan, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, const options& opt = {}) {
  using namespace detail;
  constexpr std::string_view call = "ring::backward(pass_kv)";
  const problem pb = agree_ring<typename K::value_type, accum_t<typename Q::value_type>>(
      comm, plan, opt, call, [&] { return check_backward(q, k, v, out, lse, dout, dq, dk, dv, opt, call); });
  using T = typename K::value_type;
  using Acc = accum_t<typename Q::value_type>;
  const int p = comm.size(), me = comm.rank();
  const shard_coords sc(plan);
  block3<T> kc(pb.tk, pb.hkv, pb.dk), vc(pb.tk, pb.hkv, pb.dv), kn(0, pb.hkv, pb.dk), vn(0, pb.hkv, pb.dv);
  copy_in(k, kc);
  copy_in(v, vc);
  block3<Acc> gq(pb.tq, pb.hq, pb.dk), gk(pb.tk, pb.hkv, pb.dk), gv(pb.tk, pb.hkv, pb.dv), gkn(0, pb.hkv, pb.dk),
      gvn(0, pb.hkv, pb.dv);
  std::vector<typename C::request> reqs;
  for (int s = 0; s < p; ++s) {
    const int src = ring_next(me, p, -s);
    reqs.clear();
    if (s + 1 < p) {
      const index_t rows = plan.rank(ring_next(me, p, -(s + 1))).tokens;
      post_shift(comm, reqs, kc, kn, rows, 0);
      post_shift(comm, reqs, vc, vn, rows, 1);
    }
    local_backward_acc(b, q, kc.cview(), vc.cview(), sc.of(me), sc.of(src), out, lse, dout, gq.view(), gk.view(),
                       gv.view(), opt);
    if (p > 1) {  // the accumulators move on (after the last step: home)
      const index_t rows = plan.rank(ring_next(me, p, -(s + 1))).tokens;
      post_shift(comm, reqs, gk, gkn, rows, 2);
      post_shift(comm, reqs, gv, gvn, rows, 3);
    }
    comm::wait_all(comm, std::span(reqs));
    if (p > 1) {
      std::swap(gk, gkn);
      std::swap(gv, gvn);
    }
    if (s + 1 < p) {
      std::swap(kc, kn);
      std::swap(vc, vn);
    }
  }
  copy_out(gq, dq);
  copy_out(gk, dk);
  copy_out(gv, dv);
}

}  // namespace loom::attention::ring

#include <loom/attention/detail/ring_variants.hpp>
