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
  (void)R::template forward_buffers<T, Acc, host_memory>(f, st);
  (void)R::template backward_buffers<T, Acc, host_memory>(g, st);
  st.forward_bytes = f.l.bytes();
  st.backward_bytes = g.l.bytes();
}

//! The running (out, lse) of this rank's queries and one step's partial: every step adds the
//! queries against one rank's K/V, merged into the running pair after the first.
template <class Acc, class Space>
struct running_out {
  block<Acc, Space> acc, part, lacc, lpart;

  template <class A>
  static running_out take(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t n = st.mine;
    running_out r;
    r.acc = take_block<Acc, Space>(a, n, s.heads_q, s.dim_v);
    r.part = take_block<Acc, Space>(a, n, s.heads_q, s.dim_v);
    r.lacc = take_block<Acc, Space>(a, n, s.heads_q, 1);
    r.lpart = take_block<Acc, Space>(a, n, s.heads_q, 1);
    return r;
  }
  //! q (this rank's) against kv (rank src's): into the running pair when first, else merged in.
  template <class B, class Q, class T>
  void add(const B& b, const ring_state& st, const coord_table& ct, Q q, const kv_block<T, Space>& kv, int src,
           bool first, std::span<std::byte> local) {
    const auto& o = first ? acc : part;
    const auto& l = first ? lacc : lpart;
    forward_on(b, st.local(st.mine, kv.k.n), st.scale<Acc>(), q, kv.k.cview(), kv.v.cview(), ct.of(st, st.me),
               ct.of(st, src), o.view(), l.view2(), local, st.cap);
    if (!first) merge(b, acc.view(), lacc.view2(), part.cview(), lpart.cview2());
  }
  template <class B, class O, class L>
  void copy_to(const B& b, O out, L lse) const {
    copy_out(b, acc, out);
    copy_out2(b, lacc, lse);
  }
};

template <>
struct runner<ring::pass_kv> {
  template <class T, class Acc, class S>
  struct fwd {
    coord_table ct;
    kv_block<T, S> cur, next;
    running_out<Acc, S> o;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class S>
  struct bwd {
    coord_table ct;
    kv_block<T, S> cur, next;
    grads<Acc, S> g;
    kv_block<Acc, S> gnext;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    w.cur = kv_block<T, S>::take(a, st, st.max_rows);
    w.next = kv_block<T, S>::take(a, st, st.max_rows);
    w.o = running_out<Acc, S>::take(a, st);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    w.cur = kv_block<T, S>::take(a, st, st.max_rows);
    w.next = kv_block<T, S>::take(a, st, st.max_rows);
    w.g = grads<Acc, S>::take(a, st, st.mine, st.max_rows);
    w.gnext = kv_block<Acc, S>::take(a, st, st.max_rows);
    w.local = take_bytes(a, st.local_backward);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.mine, st.max_rows, st.mine, st.max_rows);
  }

  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    workspace_carver a(ws);
    auto w = forward_buffers<T, Acc, S>(a, st);
    w.ct.template bind<S>(b, st);
    const int p = st.ranks, me = st.me;
    w.cur.load(b, st.mine, k, v);
    requests<C, B> reqs;
    for (int s = 0; s < p; ++s) {
      if (s + 1 < p) reqs.shift(comm, b, w.cur, w.next, st.rows(ring_next(me, p, -(s + 1))), 0);
      w.o.add(b, st, w.ct, q, w.cur, ring_next(me, p, -s), s == 0, w.local);
      reqs.wait(comm, b);
      std::swap(w.cur, w.next);
    }
    w.o.copy_to(b, out, lse);
  }

  //! K/V travel again with dK/dV accumulators (accumulation type) that collect every rank's
  //! contribution and arrive home after P steps; dQ accumulates locally.
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    workspace_carver a(ws);
    auto w = backward_buffers<T, Acc, S>(a, st);
    w.ct.template bind<S>(b, st);
    const int p = st.ranks, me = st.me;
    w.cur.load(b, st.mine, k, v);
    w.g.start(b, st.mine);
    requests<C, B> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      const index_t next_rows = st.rows(ring_next(me, p, -(s + 1)));
      if (s + 1 < p) reqs.shift(comm, b, w.cur, w.next, next_rows, 0);
      backward_on(b, st.local(st.mine, w.cur.k.n), st.scale<Acc>(), q, w.cur.k.cview(), w.cur.v.cview(),
                  w.ct.of(st, me), w.ct.of(st, src), out, lse, dout, w.g.q.view(), w.g.kv.k.view(), w.g.kv.v.view(),
                  true, w.local, st.cap);
      if (p > 1) reqs.shift(comm, b, w.g.kv, w.gnext, next_rows, 2);  // the accumulators move on (at the end: home)
      reqs.wait(comm, b);
      if (p > 1) std::swap(w.g.kv, w.gnext);
      if (s + 1 < p) std::swap(w.cur, w.next);
    }
    w.g.copy_to(b, dq, dk, dv);
  }
};

template <>
struct runner<ring::pass_q> {
  template <class T, class Acc, class S>
  struct fwd {
    coord_table ct;
    block<T, S> qc, qn;
    Acc *send, *recv;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class S>
  struct bwd {
    coord_table ct;
    block<T, S> qc, qn, oc, on, dc, dn;
    block<Acc, S> lc, ln, gqn;
    grads<Acc, S> g;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows, row = s.heads_q * (s.dim_v + 1);
    fwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    w.qc = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    w.qn = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    w.send = a.template take<Acc>(st.total * row);
    w.recv = a.template take<Acc>(st.ranks * st.mine * row);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    bwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    w.qc = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    w.qn = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    w.oc = take_block<T, S>(a, m, s.heads_q, s.dim_v);
    w.on = take_block<T, S>(a, m, s.heads_q, s.dim_v);
    w.dc = take_block<T, S>(a, m, s.heads_q, s.dim_v);
    w.dn = take_block<T, S>(a, m, s.heads_q, s.dim_v);
    w.lc = take_block<Acc, S>(a, m, s.heads_q, 1);
    w.ln = take_block<Acc, S>(a, m, s.heads_q, 1);
    w.gqn = take_block<Acc, S>(a, m, s.heads_q, s.dim_qk);
    w.g = grads<Acc, S>::take(a, st, m, st.mine);
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
    using S = typename backend_traits<B>::memory_space;
    workspace_carver a(ws);
    auto w = forward_buffers<T, Acc, S>(a, st);
    w.ct.template bind<S>(b, st);
    const int p = st.ranks, me = st.me;
    const index_t n = st.mine, hq = st.dims.heads_q, dv = st.dims.dim_v;
    w.qc.n = n;
    copy_in(b, q, w.qc);
    requests<C, B> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      if (s + 1 < p) reqs.shift(comm, b, w.qc, w.qn, st.rows(ring_next(me, p, -(s + 1))), 4);
      Acc* base = w.send + st.send_displs[static_cast<std::size_t>(src)];
      const index_t rows = st.rows(src);
      forward_on(b, st.local(rows, n), st.scale<Acc>(), w.qc.cview(), k, v, w.ct.of(st, src), w.ct.of(st, me),
                 tensor_view<Acc, 3, S>(base, {rows, hq, dv}),
                 tensor_view<Acc, 2, S>(base + rows * hq * dv, {rows, hq}), w.local, st.cap);
      reqs.wait(comm, b);
      std::swap(w.qc, w.qn);
    }
    partials_home(b, comm, st, w.send, w.recv, out, lse);
  }

  //! The partials in `send` (per owner: its rows' out, then lse; owners in rank order) go home by
  //! one all_to_allv into `recv`; the owner merges them in rank order (rank 0's is the
  //! accumulator) and writes out and lse.
  template <class B, class C, class Acc, class O, class L>
  static void partials_home(const B& b, C& comm, const ring_state& st, const Acc* send, Acc* recv, O out, L lse) {
    using S = typename backend_traits<B>::memory_space;
    const int p = st.ranks;
    const index_t n = st.mine, hq = st.dims.heads_q, dv = st.dims.dim_v, row = hq * (dv + 1);
    comm::handoff(comm, b);
    comm.all_to_allv(std::span<const Acc>(send, static_cast<std::size_t>(st.total * row)),
                     std::span<const std::size_t>(st.send_counts), std::span<const std::size_t>(st.send_displs),
                     std::span<Acc>(recv, static_cast<std::size_t>(p * n * row)),
                     std::span<const std::size_t>(st.recv_counts), std::span<const std::size_t>(st.recv_displs));
    comm::handback(comm, b);
    const block<Acc, S> acc{recv, n, hq, dv}, lacc{recv + n * hq * dv, n, hq, 1};
    for (int r = 1; r < p; ++r) {
      const Acc* base = recv + st.recv_displs[static_cast<std::size_t>(r)];
      merge(b, acc.view(), lacc.view2(), tensor_view<const Acc, 3, S>(base, {n, hq, dv}),
            tensor_view<const Acc, 2, S>(base + n * hq * dv, {n, hq}));
    }
    copy_out(b, acc, out);
    copy_out2(b, lacc, lse);
  }

  //! Q, out, lse and dO travel; each rank adds to its own dK/dV and to the visiting queries' dQ
  //! accumulator, which travels on and arrives home after P steps.
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    workspace_carver a(ws);
    auto w = backward_buffers<T, Acc, S>(a, st);
    w.ct.template bind<S>(b, st);
    const int p = st.ranks, me = st.me;
    const index_t n = st.mine;
    w.qc.n = w.oc.n = w.dc.n = w.lc.n = n;
    copy_in(b, q, w.qc);
    copy_in(b, out, w.oc);
    copy_in(b, dout, w.dc);
    copy_in2(b, lse, w.lc);
    w.g.start(b, n);
    requests<C, B> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      const index_t rows = st.rows(src), nn = st.rows(ring_next(me, p, -(s + 1)));
      if (s + 1 < p) {
        reqs.shift(comm, b, w.qc, w.qn, nn, 4);
        reqs.shift(comm, b, w.oc, w.on, nn, 5);
        reqs.shift(comm, b, w.dc, w.dn, nn, 6);
        reqs.shift(comm, b, w.lc, w.ln, nn, 7);
      }
      backward_on(b, st.local(rows, n), st.scale<Acc>(), w.qc.cview(), k, v, w.ct.of(st, src), w.ct.of(st, me),
                  w.oc.cview(), w.lc.cview2(), w.dc.cview(), w.g.q.view(), w.g.kv.k.view(), w.g.kv.v.view(), true,
                  w.local, st.cap);
      if (p > 1) reqs.shift(comm, b, w.g.q, w.gqn, nn, 8);
      reqs.wait(comm, b);
      if (p > 1) std::swap(w.g.q, w.gqn);
      if (s + 1 < p) {
        std::swap(w.qc, w.qn);
        std::swap(w.oc, w.on);
        std::swap(w.dc, w.dn);
        std::swap(w.lc, w.ln);
      }
    }
    w.g.copy_to(b, dq, dk, dv);
  }
};

template <>
struct runner<ring::all_gather_kv> {
  //! This rank's K/V padded to the largest shard, every rank's padded blocks, and the keys in rank
  //! order without the padding.
  template <class T, class S>
  struct gathered {
    kv_block<T, S> mine, all, full;
  };
  template <class T, class Acc, class S>
  struct fwd {
    coord_table ct;
    gathered<T, S> g;
    std::span<std::byte> local;
  };
  //! dQ and dK/dV against every key, dK/dV padded per rank, and this rank's reduced rows.
  template <class T, class Acc, class S>
  struct bwd {
    coord_table ct;
    gathered<T, S> g;
    grads<Acc, S> d;
    kv_block<Acc, S> padded, reduced;
    std::span<std::byte> local;
  };
  template <class T, class S, class A>
  static gathered<T, S> gather_buffers(A& a, const ring_state& st) {
    return {kv_block<T, S>::take(a, st, st.max_rows), kv_block<T, S>::take(a, st, st.ranks * st.max_rows),
            kv_block<T, S>::take(a, st, st.total)};
  }
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    w.g = gather_buffers<T, S>(a, st);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    w.g = gather_buffers<T, S>(a, st);
    w.d = grads<Acc, S>::take(a, st, st.mine, st.total);
    w.padded = kv_block<Acc, S>::take(a, st, st.ranks * st.max_rows);
    w.reduced = kv_block<Acc, S>::take(a, st, st.max_rows);
    w.local = take_bytes(a, st.local_backward);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.mine, st.total, st.mine, st.total);
  }

  //! Rank r's rows of one block between the rank-ordered form (rows begin[r]..) and the padded
  //! form (rows r * max_rows..); to_padded picks the direction.
  template <class B, class T, class S>
  static void repad(const B& b, const ring_state& st, const block<T, S>& ordered, const block<T, S>& padded,
                    bool to_padded) {
    const index_t row = ordered.h * ordered.d;
    for (int r = 0; r < st.ranks; ++r) {
      T* o = ordered.p + st.begin[static_cast<std::size_t>(r)] * row;
      T* pd = padded.p + r * st.max_rows * row;
      const auto bytes = static_cast<std::size_t>(st.rows(r) * row) * sizeof(T);
      if (to_padded)
        copy_bytes(b, pd, o, bytes);
      else
        copy_bytes(b, o, pd, bytes);
    }
  }

  //! K and V of every rank, rank r's at rows r * max_rows of `all`: this rank's padded into
  //! `mine` (max_rows rows), then one all_gather each.
  template <class B, class T, class S, class C, class K, class V>
  static void gather_padded(const B& b, C& comm, const ring_state& st, const K& k, const V& v, kv_block<T, S>& mine,
                            const kv_block<T, S>& all) {
    mine.zero(b);
    mine.load(b, st.mine, k, v);
    mine.set_rows(st.max_rows);
    comm::handoff(comm, b);
    comm.all_gather(mine.k.csend(), all.k.span());
    comm.all_gather(mine.v.csend(), all.v.span());
    comm::handback(comm, b);
  }

  //! K and V of every rank in rank order: one padded all_gather each, then the padding dropped.
  template <class B, class T, class S, class C, class K, class V>
  static void gather(const B& b, C& comm, const ring_state& st, const K& k, const V& v, gathered<T, S>& g) {
    gather_padded(b, comm, st, k, v, g.mine, g.all);
    repad(b, st, g.full.k, g.all.k, false);
    repad(b, st, g.full.v, g.all.v, false);
  }

  //! dK/dV of every rank's keys, rank r's at rows r * max_rows of `padded` (padding rows zero),
  //! summed over the ranks in the accumulation type into each owner's `reduced` (one
  //! reduce_scatter each); `reduced` then holds this rank's rows.
  template <class B, class Acc, class S, class C>
  static void reduce_home(const B& b, C& comm, const ring_state& st, const kv_block<Acc, S>& padded,
                          kv_block<Acc, S>& reduced) {
    comm::handoff(comm, b);
    comm.reduce_scatter(padded.k.csend(), reduced.k.span(), comm::reduce_op::sum);
    comm.reduce_scatter(padded.v.csend(), reduced.v.span(), comm::reduce_op::sum);
    comm::handback(comm, b);
    reduced.set_rows(st.mine);
  }

  //! One padded all_gather of K and of V, then the local kernel against every key (any mask
  //! works, the keys' coordinates come from the plan).
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    workspace_carver a(ws);
    auto w = forward_buffers<T, Acc, S>(a, st);
    w.ct.template bind<S>(b, st);
    gather(b, comm, st, k, v, w.g);
    forward_on(b, st.local(st.mine, st.total), st.scale<Acc>(), q, w.g.full.k.cview(), w.g.full.v.cview(),
               w.ct.of(st, st.me), w.ct.all(), out, lse, w.local, st.cap);
  }

  //! Gradients against every key locally, then dK/dV reduce-scattered (sum in the accumulation
  //! type) back to their owners.
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    workspace_carver a(ws);
    auto w = backward_buffers<T, Acc, S>(a, st);
    w.ct.template bind<S>(b, st);
    gather(b, comm, st, k, v, w.g);
    backward_on(b, st.local(st.mine, st.total), st.scale<Acc>(), q, w.g.full.k.cview(), w.g.full.v.cview(),
                w.ct.of(st, st.me), w.ct.all(), out, lse, dout, w.d.q.view(), w.d.kv.k.view(), w.d.kv.v.view(), false,
                w.local, st.cap);
    // Pad to the largest shard, reduce-scatter, keep my rows.
    w.padded.zero(b);
    repad(b, st, w.d.kv.k, w.padded.k, true);
    repad(b, st, w.d.kv.v, w.padded.v, true);
    reduce_home(b, comm, st, w.padded, w.reduced);
    w.d.kv = w.reduced;
    w.d.copy_to(b, dq, dk, dv);
  }
};

}  // namespace loom::attention::detail
