#pragma once

//! @file
//! ring::pass_q and ring::all_gather_kv (forward and backward); included by attention/ring.hpp.

#include <loom/attention/ring.hpp>

#include <algorithm>

namespace loom::attention::ring {

//! Ring pass-Q forward: Q travels, every rank computes the partial (out, lse) of the visiting
//! queries against its own K/V; one all_to_allv returns the partials to their owners, which merge
//! them in rank order.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, pass_q, const shard::plan& plan, Q q, K k, V v, O out, L lse,
             const options& opt = {}) {
  using namespace detail;
  constexpr std::string_view call = "ring::forward(pass_q)";
  const problem pb = agree_ring<typename K::value_type, accum_t<typename Q::value_type>>(
      comm, plan, opt, call, [&] { return check_forward(q, k, v, out, lse, opt, call); });
  using T = typename Q::value_type;
  using Acc = accum_t<T>;
  const int p = comm.size(), me = comm.rank();
  const shard_coords sc(plan);
  auto rows = [&](int r) { return plan.rank(r).tokens; };
  block3<T> qc(pb.tq, pb.hq, pb.dk), qn(0, pb.hq, pb.dk);
  copy_in(q, qc);
  // partials of every rank's queries against my K/V: rows (out, then lse) per owner, packed
  const index_t row = pb.hq * (pb.dv + 1);
  std::vector<std::size_t> send_counts(static_cast<std::size_t>(p)), send_displs(send_counts.size()),
      recv_counts(send_counts.size()), recv_displs(send_counts.size());
  std::size_t total = 0;
  for (int r = 0; r < p; ++r) {
    send_displs[static_cast<std::size_t>(r)] = total;
    send_counts[static_cast<std::size_t>(r)] = static_cast<std::size_t>(rows(r) * row);
    total += send_counts[static_cast<std::size_t>(r)];
    recv_counts[static_cast<std::size_t>(r)] = static_cast<std::size_t>(pb.tq * row);
    recv_displs[static_cast<std::size_t>(r)] = static_cast<std::size_t>(r * pb.tq * row);
  }
  std::vector<Acc> sendbuf(total), recvbuf(static_cast<std::size_t>(p * pb.tq * row));
  std::vector<typename C::request> reqs;
  for (int s = 0; s < p; ++s) {
    const int src = ring_next(me, p, -s);
    reqs.clear();
    if (s + 1 < p) post_shift(comm, reqs, qc, qn, rows(ring_next(me, p, -(s + 1))), 4);
    Acc* base = sendbuf.data() + send_displs[static_cast<std::size_t>(src)];
    const index_t n = rows(src);
    attention::forward(b, qc.cview(), k, v, sc.of(src), sc.of(me), tensor_view<Acc, 3>(base, {n, pb.hq, pb.dv}),
                       tensor_view<Acc, 2>(base + n * pb.hq * pb.dv, {n, pb.hq}), opt);
    comm::wait_all(comm, std::span(reqs));
    std::swap(qc, qn);
  }
  comm.all_to_allv(std::span<const Acc>(sendbuf), std::span<const std::size_t>(send_counts),
                   std::span<const std::size_t>(send_displs), std::span<Acc>(recvbuf),
                   std::span<const std::size_t>(recv_counts), std::span<const std::size_t>(recv_displs));
  block3<Acc> acc(pb.tq, pb.hq, pb.dv);
  block2<Acc> lacc(pb.tq, pb.hq);
  for (int r = 0; r < p; ++r) {
    Acc* base = recvbuf.data() + recv_displs[static_cast<std::size_t>(r)];
    const tensor_view<const Acc, 3> o(base, {pb.tq, pb.hq, pb.dv});
    const tensor_view<const Acc, 2> l(base + pb.tq * pb.hq * pb.dv, {pb.tq, pb.hq});
    if (r == 0) {
      std::copy_n(base, acc.data.size(), acc.data.begin());
      std::copy_n(base + pb.tq * pb.hq * pb.dv, lacc.data.size(), lacc.data.begin());
    } else {
      merge(b, acc.view(), lacc.view(), o, l);
    }
  }
  copy_out(acc, out);
  copy_out(lacc, lse);
}

//! Ring pass-Q backward: Q, out, lse and dO travel; each rank adds to its own dK/dV and to the
//! visiting queries' dQ accumulator, which travels on and arrives home after P steps.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, pass_q, const shard::plan& plan, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, const options& opt = {}) {
  using namespace detail;
  constexpr std::string_view call = "ring::backward(pass_q)";
  const problem pb = agree_ring<typename K::value_type, accum_t<typename Q::value_type>>(
      comm, plan, opt, call, [&] { return check_backward(q, k, v, out, lse, dout, dq, dk, dv, opt, call); });
  using T = typename Q::value_type;
  using Acc = accum_t<T>;
  const int p = comm.size(), me = comm.rank();
  const shard_coords sc(plan);
  auto rows = [&](int r) { return plan.rank(r).tokens; };
  block3<T> qc(pb.tq, pb.hq, pb.dk), qn(0, pb.hq, pb.dk), oc(pb.tq, pb.hq, pb.dv), on(0, pb.hq, pb.dv),
      dc(pb.tq, pb.hq, pb.dv), dn(0, pb.hq, pb.dv);
  block3<Acc> lc(pb.tq, pb.hq, 1), ln(0, pb.hq, 1), gq(pb.tq, pb.hq, pb.dk), gqn(0, pb.hq, pb.dk),
      gk(pb.tk, pb.hkv, pb.dk), gv(pb.tk, pb.hkv, pb.dv);
  copy_in(q, qc);
  copy_in(out, oc);
  copy_in(dout, dc);
  for (index_t t = 0; t < pb.tq; ++t)
    for (index_t h = 0; h < pb.hq; ++h) lc.data[static_cast<std::size_t>(t * pb.hq + h)] = lse(t, h);
  std::vector<typename C::request> reqs;
  for (int s = 0; s < p; ++s) {
    const int src = ring_next(me, p, -s);
    const index_t n = rows(src), nn = rows(ring_next(me, p, -(s + 1)));
    reqs.clear();
    if (s + 1 < p) {
      post_shift(comm, reqs, qc, qn, nn, 4);
      post_shift(comm, reqs, oc, on, nn, 5);
      post_shift(comm, reqs, dc, dn, nn, 6);
      post_shift(comm, reqs, lc, ln, nn, 7);
    }
    local_backward_acc(b, qc.cview(), k, v, sc.of(src), sc.of(me), oc.cview(),
                       tensor_view<const Acc, 2>(lc.data.data(), {n, pb.hq}), dc.cview(), gq.view(), gk.view(),
                       gv.view(), opt);
    if (p > 1) post_shift(comm, reqs, gq, gqn, nn, 8);
    comm::wait_all(comm, std::span(reqs));
    if (p > 1) std::swap(gq, gqn);
    if (s + 1 < p) {
      std::swap(qc, qn);
      std::swap(oc, on);
      std::swap(dc, dn);
      std::swap(lc, ln);
    }
  }
  copy_out(gq, dq);
  copy_out(gk, dk);
  copy_out(gv, dv);
}

namespace detail {
//! K and V of every rank, in rank order, gathered with one padded all_gather each; and the
//! coordinates of all those keys.
template <comm::communicator C, class T>
struct gathered_kv {
  block3<T> k, v;
  std::vector<index_t> doc, pos;
  index_t max_rows = 0;
  template <class K, class V>
  gathered_kv(C& comm, const shard::plan& plan, const shard_coords& sc, const K& kl, const V& vl, const problem& pb) {
    const int p = comm.size();
    for (int r = 0; r < p; ++r) max_rows = std::max(max_rows, plan.rank(r).tokens);
    block3<T> mine_k(max_rows, pb.hkv, pb.dk), mine_v(max_rows, pb.hkv, pb.dv), all_k(p * max_rows, pb.hkv, pb.dk),
        all_v(p * max_rows, pb.hkv, pb.dv);
    block3<T> lk(pb.tk, pb.hkv, pb.dk), lv(pb.tk, pb.hkv, pb.dv);
    copy_in(kl, lk);
    copy_in(vl, lv);
    std::copy(lk.data.begin(), lk.data.end(), mine_k.data.begin());
    std::copy(lv.data.begin(), lv.data.end(), mine_v.data.begin());
    comm.all_gather(std::span<const T>(mine_k.data), std::span<T>(all_k.data));
    comm.all_gather(std::span<const T>(mine_v.data), std::span<T>(all_v.data));
    index_t total = 0;
    for (int r = 0; r < p; ++r) total += plan.rank(r).tokens;
    k = block3<T>(total, pb.hkv, pb.dk);
    v = block3<T>(total, pb.hkv, pb.dv);
    index_t at = 0;
    for (int r = 0; r < p; ++r) {
      const index_t n = plan.rank(r).tokens;
      std::copy_n(all_k.data.begin() + r * max_rows * pb.hkv * pb.dk, n * pb.hkv * pb.dk,
                  k.data.begin() + at * pb.hkv * pb.dk);
      std::copy_n(all_v.data.begin() + r * max_rows * pb.hkv * pb.dv, n * pb.hkv * pb.dv,
                  v.data.begin() + at * pb.hkv * pb.dv);
      doc.insert(doc.end(), sc.doc[static_cast<std::size_t>(r)].begin(), sc.doc[static_cast<std::size_t>(r)].end());
      pos.insert(pos.end(), sc.pos[static_cast<std::size_t>(r)].begin(), sc.pos[static_cast<std::size_t>(r)].end());
      at += n;
    }
  }
  coords<> key_coords() const {
    const auto n = static_cast<index_t>(doc.size());
    return {tensor_view<const index_t, 1>(doc.data(), {n}), tensor_view<const index_t, 1>(pos.data(), {n})};
  }
};
}  // namespace detail

//! All-gather-KV forward: one padded all_gather of K and of V, then the local kernel against every
//! key (any mask works, the keys' coordinates come from the plan).
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, all_gather_kv, const shard::plan& plan, Q q, K k, V v, O out, L lse,
             const options& opt = {}) {
  using namespace detail;
  constexpr std::string_view call = "ring::forward(all_gather_kv)";
  const problem pb = agree_ring<typename K::value_type, accum_t<typename Q::value_type>>(
      comm, plan, opt, call, [&] { return check_forward(q, k, v, out, lse, opt, call); });
  const shard_coords sc(plan);
  const gathered_kv<C, typename K::value_type> g(comm, plan, sc, k, v, pb);
  attention::forward(b, q, g.k.cview(), g.v.cview(), sc.of(comm.rank()), g.key_coords(), out, lse, opt);
}

//! All-gather-KV backward: gradients against every key locally, then dK/dV reduce-scattered (sum
//! in the accumulation type) back to their owners.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, all_gather_kv, const shard::plan& plan, Q q, K k, V v, O out, L lse, DO dout, DQ dq,
              DK dk, DV dv, const options& opt = {}) {
  using namespace detail;
  constexpr std::string_view call = "ring::backward(all_gather_kv)";
  const problem pb = agree_ring<typename K::value_type, accum_t<typename Q::value_type>>(
      comm, plan, opt, call, [&] { return check_backward(q, k, v, out, lse, dout, dq, dk, dv, opt, call); });
  using Acc = accum_t<typename Q::value_type>;
  const int p = comm.size();
  const shard_coords sc(plan);
  const gathered_kv<C, typename K::value_type> g(comm, plan, sc, k, v, pb);
  block3<Acc> gq(pb.tq, pb.hq, pb.dk), gk(g.k.n, pb.hkv, pb.dk), gv(g.v.n, pb.hkv, pb.dv);
  attention::backward(b, q, g.k.cview(), g.v.cview(), sc.of(comm.rank()), g.key_coords(), out, lse, dout, gq.view(),
                      gk.view(), gv.view(), opt);
  // Pad to the largest shard, reduce-scatter, keep my rows.
  const index_t mr = g.max_rows;
  block3<Acc> pk(p * mr, pb.hkv, pb.dk), pv(p * mr, pb.hkv, pb.dv), rk(mr, pb.hkv, pb.dk), rv(mr, pb.hkv, pb.dv);
  index_t at = 0;
  for (int r = 0; r < p; ++r) {
    const index_t n = plan.rank(r).tokens;
    std::copy_n(gk.data.begin() + at * pb.hkv * pb.dk, n * pb.hkv * pb.dk, pk.data.begin() + r * mr * pb.hkv * pb.dk);
    std::copy_n(gv.data.begin() + at * pb.hkv * pb.dv, n * pb.hkv * pb.dv, pv.data.begin() + r * mr * pb.hkv * pb.dv);
    at += n;
  }
  comm.reduce_scatter(std::span<const Acc>(pk.data), std::span<Acc>(rk.data), comm::reduce_op::sum);
  comm.reduce_scatter(std::span<const Acc>(pv.data), std::span<Acc>(rv.data), comm::reduce_op::sum);
  rk.resize(pb.tk);
  rv.resize(pb.tk);
  copy_out(gq, dq);
  copy_out(rk, dk);
  copy_out(rv, dv);
}

}  // namespace loom::attention::ring
