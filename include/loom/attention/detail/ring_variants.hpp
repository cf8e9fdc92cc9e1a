#pragma once

//! @file
//! The runners of ring::pass_kv, ring::pass_q and ring::all_gather_kv (forward and backward on a
//! plan's state and a caller's workspace); included by attention/ring.hpp.

#include <loom/attention/detail/ring_common.hpp>

#include <algorithm>

namespace loom::attention::detail {

//! Sizes a plan's workspaces from the runner's carving code.
template <class R, class T, class Acc>
void size_from(ring_state& st, index_t fq, index_t fk, index_t bq, index_t bk) {
  st.local_forward = forward_bytes<Acc>(st.local(fq, fk), st.cap);
  st.local_backward = backward_bytes<Acc>(st.local(bq, bk), st.cap);
  ws_sizer f, g;
  (void)R::template forward_buffers<T, Acc>(f, st);
  (void)R::template backward_buffers<T, Acc>(g, st);
  st.forward_bytes = f.l.bytes();
  st.backward_bytes = g.l.bytes();
}

//! The running (out, lse) of this rank's queries and one step's partial: every step adds the
//! queries against one rank's K/V, merged into the running pair after the first.
template <class Acc>
struct running_out {
  block<Acc> acc, part, lacc, lpart;

  template <class A>
  static running_out take(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t n = st.mine;
    running_out r;
    r.acc = take_block<Acc>(a, n, s.heads_q, s.dim_v);
    r.part = take_block<Acc>(a, n, s.heads_q, s.dim_v);
    r.lacc = take_block<Acc>(a, n, s.heads_q, 1);
    r.lpart = take_block<Acc>(a, n, s.heads_q, 1);
    return r;
  }
  //! q (this rank's) against kv (rank src's): into the running pair when first, else merged in.
  template <class B, class Q, class T>
  void add(const B& b, const ring_state& st, Q q, const kv_block<T>& kv, int src, bool first,
           std::span<std::byte> local) {
    const auto& o = first ? acc : part;
    const auto& l = first ? lacc : lpart;
    forward_on(b, st.local(st.mine, kv.k.n), st.scale<Acc>(), q, kv.k.cview(), kv.v.cview(), st.coords_of(st.me),
               st.coords_of(src), o.view(), l.view2(), local, st.cap);
    if (!first) merge(b, acc.view(), lacc.view2(), part.cview(), lpart.cview2());
  }
  template <class O, class L>
  void copy_to(O out, L lse) const {
    copy_out(acc, out);
    copy_out2(lacc, lse);
  }
};

template <>
struct runner<ring::pass_kv> {
  template <class T, class Acc>
  struct fwd {
    kv_block<T> cur, next;
    running_out<Acc> o;
    std::span<std::byte> local;
  };
  template <class T, class Acc>
  struct bwd {
    kv_block<T> cur, next;
    grads<Acc> g;
    kv_block<Acc> gnext;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class A>
  static fwd<T, Acc> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc> w;
    w.cur = kv_block<T>::take(a, st, st.max_rows);
    w.next = kv_block<T>::take(a, st, st.max_rows);
    w.o = running_out<Acc>::take(a, st);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class A>
  static bwd<T, Acc> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc> w;
    w.cur = kv_block<T>::take(a, st, st.max_rows);
    w.next = kv_block<T>::take(a, st, st.max_rows);
    w.g = grads<Acc>::take(a, st, st.mine, st.max_rows);
    w.gnext = kv_block<Acc>::take(a, st, st.max_rows);
    w.local = take_bytes(a, st.local_backward);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.mine, st.max_rows, st.mine, st.max_rows);
  }

  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    workspace_carver a(ws);
    auto w = forward_buffers<T, Acc>(a, st);
    const int p = st.ranks, me = st.me;
    w.cur.load(st.mine, k, v);
    requests<C> reqs;
    for (int s = 0; s < p; ++s) {
      if (s + 1 < p) reqs.shift(comm, w.cur, w.next, st.rows(ring_next(me, p, -(s + 1))), 0);
      w.o.add(b, st, q, w.cur, ring_next(me, p, -s), s == 0, w.local);
      reqs.wait(comm);
      std::swap(w.cur, w.next);
    }
    w.o.copy_to(out, lse);
  }

  //! K/V travel again with dK/dV accumulators (accumulation type) that collect every rank's
  //! contribution and arrive home after P steps; dQ accumulates locally.
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    workspace_carver a(ws);
    auto w = backward_buffers<T, Acc>(a, st);
    const int p = st.ranks, me = st.me;
    w.cur.load(st.mine, k, v);
    w.g.start(st.mine);
    requests<C> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      const index_t next_rows = st.rows(ring_next(me, p, -(s + 1)));
      if (s + 1 < p) reqs.shift(comm, w.cur, w.next, next_rows, 0);
      backward_on(b, st.local(st.mine, w.cur.k.n), st.scale<Acc>(), q, w.cur.k.cview(), w.cur.v.cview(),
                  st.coords_of(me), st.coords_of(src), out, lse, dout, w.g.q.view(), w.g.kv.k.view(), w.g.kv.v.view(),
                  true, w.local, st.cap);
      if (p > 1) reqs.shift(comm, w.g.kv, w.gnext, next_rows, 2);  // the accumulators move on (at the end: home)
      reqs.wait(comm);
      if (p > 1) std::swap(w.g.kv, w.gnext);
      if (s + 1 < p) std::swap(w.cur, w.next);
    }
    w.g.copy_to(dq, dk, dv);
  }
};

template <>
struct runner<ring::pass_q> {
  template <class T, class Acc>
  struct fwd {
    block<T> qc, qn;
    Acc *send, *recv;
    std::span<std::byte> local;
  };
  template <class T, class Acc>
  struct bwd {
    block<T> qc, qn, oc, on, dc, dn;
    block<Acc> lc, ln, gqn;
    grads<Acc> g;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class A>
  static fwd<T, Acc> forward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows, row = s.heads_q * (s.dim_v + 1);
    fwd<T, Acc> w;
    w.qc = take_block<T>(a, m, s.heads_q, s.dim_qk);
    w.qn = take_block<T>(a, m, s.heads_q, s.dim_qk);
    w.send = a.template take<Acc>(st.total * row);
    w.recv = a.template take<Acc>(st.ranks * st.mine * row);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class A>
  static bwd<T, Acc> backward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    bwd<T, Acc> w;
    w.qc = take_block<T>(a, m, s.heads_q, s.dim_qk);
    w.qn = take_block<T>(a, m, s.heads_q, s.dim_qk);
    w.oc = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.on = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.dc = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.dn = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.lc = take_block<Acc>(a, m, s.heads_q, 1);
    w.ln = take_block<Acc>(a, m, s.heads_q, 1);
    w.gqn = take_block<Acc>(a, m, s.heads_q, s.dim_qk);
    w.g = grads<Acc>::take(a, st, m, st.mine);
    w.local = take_bytes(a, st.local_backward);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.max_rows, st.mine, st.max_rows, st.mine);
  }

  //! Q travels, every rank computes the partial (out, lse) of the visiting queries against its
  //! own K/V; one all_to_allv returns the partials to their owners, which merge them in rank order.
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    workspace_carver a(ws);
    auto w = forward_buffers<T, Acc>(a, st);
    const int p = st.ranks, me = st.me;
    const index_t n = st.mine, hq = st.dims.heads_q, dv = st.dims.dim_v, row = hq * (dv + 1);
    w.qc.n = n;
    copy_in(q, w.qc);
    requests<C> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      if (s + 1 < p) reqs.shift(comm, w.qc, w.qn, st.rows(ring_next(me, p, -(s + 1))), 4);
      Acc* base = w.send + st.send_displs[static_cast<std::size_t>(src)];
      const index_t rows = st.rows(src);
      forward_on(b, st.local(rows, n), st.scale<Acc>(), w.qc.cview(), k, v, st.coords_of(src), st.coords_of(me),
                 tensor_view<Acc, 3>(base, {rows, hq, dv}), tensor_view<Acc, 2>(base + rows * hq * dv, {rows, hq}),
                 w.local, st.cap);
      reqs.wait(comm);
      std::swap(w.qc, w.qn);
    }
    comm.all_to_allv(std::span<const Acc>(w.send, static_cast<std::size_t>(st.total * row)),
                     std::span<const std::size_t>(st.send_counts), std::span<const std::size_t>(st.send_displs),
                     std::span<Acc>(w.recv, static_cast<std::size_t>(p * n * row)),
                     std::span<const std::size_t>(st.recv_counts), std::span<const std::size_t>(st.recv_displs));
    // Rank 0's partial is the accumulator; the others merge into it in rank order.
    const tensor_view<Acc, 3> acc(w.recv, {n, hq, dv});
    const tensor_view<Acc, 2> lacc(w.recv + n * hq * dv, {n, hq});
    for (int r = 1; r < p; ++r) {
      const Acc* base = w.recv + st.recv_displs[static_cast<std::size_t>(r)];
      merge(b, acc, lacc, tensor_view<const Acc, 3>(base, {n, hq, dv}),
            tensor_view<const Acc, 2>(base + n * hq * dv, {n, hq}));
    }
    for (index_t t = 0; t < n; ++t)
      for (index_t h = 0; h < hq; ++h) {
        for (index_t c = 0; c < dv; ++c) out(t, h, c) = static_cast<T>(acc(t, h, c));
        lse(t, h) = lacc(t, h);
      }
  }

  //! Q, out, lse and dO travel; each rank adds to its own dK/dV and to the visiting queries' dQ
  //! accumulator, which travels on and arrives home after P steps.
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    workspace_carver a(ws);
    auto w = backward_buffers<T, Acc>(a, st);
    const int p = st.ranks, me = st.me;
    const index_t n = st.mine;
    w.qc.n = w.oc.n = w.dc.n = w.lc.n = n;
    copy_in(q, w.qc);
    copy_in(out, w.oc);
    copy_in(dout, w.dc);
    copy_in2(lse, w.lc);
    w.g.start(n);
    requests<C> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      const index_t rows = st.rows(src), nn = st.rows(ring_next(me, p, -(s + 1)));
      if (s + 1 < p) {
        reqs.shift(comm, w.qc, w.qn, nn, 4);
        reqs.shift(comm, w.oc, w.on, nn, 5);
        reqs.shift(comm, w.dc, w.dn, nn, 6);
        reqs.shift(comm, w.lc, w.ln, nn, 7);
      }
      backward_on(b, st.local(rows, n), st.scale<Acc>(), w.qc.cview(), k, v, st.coords_of(src), st.coords_of(me),
                  w.oc.cview(), w.lc.cview2(), w.dc.cview(), w.g.q.view(), w.g.kv.k.view(), w.g.kv.v.view(), true,
                  w.local, st.cap);
      if (p > 1) reqs.shift(comm, w.g.q, w.gqn, nn, 8);
      reqs.wait(comm);
      if (p > 1) std::swap(w.g.q, w.gqn);
      if (s + 1 < p) {
        std::swap(w.qc, w.qn);
        std::swap(w.oc, w.on);
        std::swap(w.dc, w.dn);
        std::swap(w.lc, w.ln);
      }
    }
    w.g.copy_to(dq, dk, dv);
  }
};

template <>
struct runner<ring::all_gather_kv> {
  //! This rank's K/V padded to the largest shard, every rank's padded blocks, and the keys in rank
  //! order without the padding.
  template <class T>
  struct gathered {
    kv_block<T> mine, all, full;
  };
  template <class T, class Acc>
  struct fwd {
    gathered<T> g;
    std::span<std::byte> local;
  };
  //! dQ and dK/dV against every key, dK/dV padded per rank, and this rank's reduced rows.
  template <class T, class Acc>
  struct bwd {
    gathered<T> g;
    grads<Acc> d;
    kv_block<Acc> padded, reduced;
    std::span<std::byte> local;
  };
  template <class T, class A>
  static gathered<T> gather_buffers(A& a, const ring_state& st) {
    return {kv_block<T>::take(a, st, st.max_rows), kv_block<T>::take(a, st, st.ranks * st.max_rows),
            kv_block<T>::take(a, st, st.total)};
  }
  template <class T, class Acc, class A>
  static fwd<T, Acc> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc> w;
    w.g = gather_buffers<T>(a, st);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class A>
  static bwd<T, Acc> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc> w;
    w.g = gather_buffers<T>(a, st);
    w.d = grads<Acc>::take(a, st, st.mine, st.total);
    w.padded = kv_block<Acc>::take(a, st, st.ranks * st.max_rows);
    w.reduced = kv_block<Acc>::take(a, st, st.max_rows);
    w.local = take_bytes(a, st.local_backward);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.mine, st.total, st.mine, st.total);
  }

  //! Rank r's rows of one block between the rank-ordered form (rows begin[r]..) and the padded
  //! form (rows r * max_rows..); to_padded picks the direction.
  template <class T>
  static void repad(const ring_state& st, const block<T>& ordered, const block<T>& padded, bool to_padded) {
    const index_t row = ordered.h * ordered.d;
    for (int r = 0; r < st.ranks; ++r) {
      T* o = ordered.p + st.begin[static_cast<std::size_t>(r)] * row;
      T* pd = padded.p + r * st.max_rows * row;
      if (to_padded)
        std::copy_n(o, st.rows(r) * row, pd);
      else
        std::copy_n(pd, st.rows(r) * row, o);
    }
  }

  //! K and V of every rank in rank order: one padded all_gather each, then the padding dropped.
  template <class T, class C, class K, class V>
  static void gather(C& comm, const ring_state& st, const K& k, const V& v, gathered<T>& g) {
    g.mine.zero();
    g.mine.load(st.mine, k, v);
    g.mine.set_rows(st.max_rows);
    comm.all_gather(g.mine.k.csend(), g.all.k.span());
    comm.all_gather(g.mine.v.csend(), g.all.v.span());
    repad(st, g.full.k, g.all.k, false);
    repad(st, g.full.v, g.all.v, false);
  }

  //! One padded all_gather of K and of V, then the local kernel against every key (any mask
  //! works, the keys' coordinates come from the plan).
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    workspace_carver a(ws);
    auto w = forward_buffers<T, Acc>(a, st);
    gather(comm, st, k, v, w.g);
    forward_on(b, st.local(st.mine, st.total), st.scale<Acc>(), q, w.g.full.k.cview(), w.g.full.v.cview(),
               st.coords_of(st.me), st.all_coords(), out, lse, w.local, st.cap);
  }

  //! Gradients against every key locally, then dK/dV reduce-scattered (sum in the accumulation
  //! type) back to their owners.
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    workspace_carver a(ws);
    auto w = backward_buffers<T, Acc>(a, st);
    gather(comm, st, k, v, w.g);
    backward_on(b, st.local(st.mine, st.total), st.scale<Acc>(), q, w.g.full.k.cview(), w.g.full.v.cview(),
                st.coords_of(st.me), st.all_coords(), out, lse, dout, w.d.q.view(), w.d.kv.k.view(), w.d.kv.v.view(),
                false, w.local, st.cap);
    // Pad to the largest shard, reduce-scatter, keep my rows.
    w.padded.zero();
    repad(st, w.d.kv.k, w.padded.k, true);
    repad(st, w.d.kv.v, w.padded.v, true);
    comm.reduce_scatter(w.padded.k.csend(), w.reduced.k.span(), comm::reduce_op::sum);
    comm.reduce_scatter(w.padded.v.csend(), w.reduced.v.span(), comm::reduce_op::sum);
    w.reduced.set_rows(st.mine);
    w.d.kv = w.reduced;
    w.d.copy_to(dq, dk, dv);
  }
};

}  // namespace loom::attention::detail
