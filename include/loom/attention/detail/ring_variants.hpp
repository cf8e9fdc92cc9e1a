#pragma once

//! @file
//! The runners of ring::pass_kv, ring::pass_q and ring::all_gather_kv (forward and backward on a
//! plan's state and a caller's workspace); included by attention/ring.hpp.

#include <loom/attention/detail/ring_common.hpp>

#include <algorithm>

namespace loom::attention::detail {

//! What every runner's buffers (R::forward_buffers, R::backward_buffers) begin and end with: the
//! coordinate table, then the local kernel's workspace.
struct ring_buffers {
  coord_table ct;
  std::span<std::byte> local;
};

//! Runner R's buffers of one pass: the coordinate table, R's own (R::forward_buffers or
//! R::backward_buffers), the local kernel's workspace.
template <class R, class T, class Acc, class S, bool Forward, class A>
auto take_buffers(A& a, const ring_state& st) {
  const coord_table ct = coord_table::take(a, st);
  auto w = [&] {
    if constexpr (Forward)
      return R::template forward_buffers<T, Acc, S>(a, st);
    else
      return R::template backward_buffers<T, Acc, S>(a, st);
  }();
  w.ct = ct;
  w.local = take_bytes(a, Forward ? st.local_forward : st.local_backward);
  return w;
}

//! Sizes a plan's workspaces from the runner's carving code.
template <class R, class T, class Acc>
void size_from(ring_state& st, index_t fq, index_t fk, index_t bq, index_t bk) {
  st.local_forward = forward_bytes<Acc>(st.local(fq, fk), st.cap);
  st.local_backward = backward_bytes<Acc>(st.local(bq, bk), st.cap);
  ws_sizer f, g;
  (void)take_buffers<R, T, Acc, host_memory, true>(f, st);
  (void)take_buffers<R, T, Acc, host_memory, false>(g, st);
  st.forward_bytes = f.l.bytes();
  st.backward_bytes = g.l.bytes();
}

//! Runner R's buffers of one pass carved from `ws` (take_buffers), the coordinate table bound on
//! the backend.
template <class R, class T, class Acc, bool Forward, class B>
auto carve(const B& b, const ring_state& st, std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  workspace_carver a(ws);
  auto w = take_buffers<R, T, Acc, S, Forward>(a, st);
  w.ct.template bind<S>(b, st);
  return w;
}

//! The visiting queries of pass_q's forward (loom's kernel and a fused engine), current and next
//! (max_rows rows each), and the send and receive buffers of the partials (per owner: its rows'
//! out, then lse; accumulation type).
template <class T, class Acc, class S>
struct q_partials {
  block<T, S> qc, qn;
  Acc *send = nullptr, *recv = nullptr;
  template <class A>
  void take(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows, row = s.heads_q * (s.dim_v + 1);
    qc = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    qn = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    send = a.template take<Acc>(st.total * row);
    recv = a.template take<Acc>(st.ranks * st.mine * row);
  }
};

//! The visiting queries of pass_q's backward (loom's kernel and a fused engine): Q, out, dO
//! (storage type) and lse (accumulation type) of the rank being visited, and the next visitor's
//! (max_rows rows each).
template <class T, class Acc, class S>
struct q_visitors {
  block<T, S> q, qn, o, on, d, dn;
  block<Acc, S> l, ln;
  template <class A>
  static q_visitors take(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    q_visitors w;
    for (block<T, S>* x : {&w.q, &w.qn}) *x = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    for (block<T, S>* x : {&w.o, &w.on, &w.d, &w.dn}) *x = take_block<T, S>(a, m, s.heads_q, s.dim_v);
    for (block<Acc, S>* x : {&w.l, &w.ln}) *x = take_block<Acc, S>(a, m, s.heads_q, 1);
    return w;
  }
  //! This rank's n rows as the first visitors.
  template <class B, class Q, class O, class DO, class L>
  void load(const B& b, index_t n, const Q& q_in, const O& out, const DO& dout, const L& lse) {
    q.n = o.n = d.n = l.n = n;
    copy_in(b, q_in, q);
    copy_in(b, out, o);
    copy_in(b, dout, d);
    copy_in2(b, lse, l);
  }
  //! Posts the visitors on to the next rank and the next ones (nn rows) in (tags 4 to 7).
  template <class R, class C, class B>
  void post(R& reqs, C& comm, const B& b, index_t nn) {
    reqs.shift(comm, b, q, qn, nn, 4);
    reqs.shift(comm, b, o, on, nn, 5);
    reqs.shift(comm, b, d, dn, nn, 6);
    reqs.shift(comm, b, l, ln, nn, 7);
  }
  //! After the transfers: the next visitors become the current ones.
  void advance() {
    std::swap(q, qn);
    std::swap(o, on);
    std::swap(d, dn);
    std::swap(l, ln);
  }
};

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
  struct fwd : ring_buffers {
    kv_block<T, S> cur, next;
    running_out<Acc, S> o;
  };
  template <class T, class Acc, class S>
  struct bwd : ring_buffers {
    kv_block<T, S> cur, next;
    grads<Acc, S> g;
    kv_block<Acc, S> gnext;
  };
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc, S> w;
    w.cur = kv_block<T, S>::take(a, st, st.max_rows);
    w.next = kv_block<T, S>::take(a, st, st.max_rows);
    w.o = running_out<Acc, S>::take(a, st);
    return w;
  }
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc, S> w;
    w.cur = kv_block<T, S>::take(a, st, st.max_rows);
    w.next = kv_block<T, S>::take(a, st, st.max_rows);
    w.g = grads<Acc, S>::take(a, st, st.mine, st.max_rows);
    w.gnext = kv_block<Acc, S>::take(a, st, st.max_rows);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.mine, st.max_rows, st.mine, st.max_rows);
  }

  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    auto w = carve<runner, T, Acc, true>(b, st, ws);
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
    auto w = carve<runner, T, Acc, false>(b, st, ws);
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
  struct fwd : ring_buffers, q_partials<T, Acc, S> {};
  template <class T, class Acc, class S>
  struct bwd : ring_buffers {
    q_visitors<T, Acc, S> vis;
    block<Acc, S> gqn;
    grads<Acc, S> g;
  };
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc, S> w;
    static_cast<q_partials<T, Acc, S>&>(w).take(a, st);
    return w;
  }
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    bwd<T, Acc, S> w;
    w.vis = q_visitors<T, Acc, S>::take(a, st);
    w.gqn = take_block<Acc, S>(a, m, s.heads_q, s.dim_qk);
    w.g = grads<Acc, S>::take(a, st, m, st.mine);
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
    auto w = carve<runner, T, Acc, true>(b, st, ws);
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
    comm::handoff(b, comm);
    comm.all_to_allv(std::span<const Acc>(send, static_cast<std::size_t>(st.total * row)),
                     std::span<const std::size_t>(st.send_counts), std::span<const std::size_t>(st.send_displs),
                     std::span<Acc>(recv, static_cast<std::size_t>(p * n * row)),
                     std::span<const std::size_t>(st.recv_counts), std::span<const std::size_t>(st.recv_displs));
    comm::handback(b, comm);
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
    auto w = carve<runner, T, Acc, false>(b, st, ws);
    const int p = st.ranks, me = st.me;
    const index_t n = st.mine;
    auto& vis = w.vis;
    vis.load(b, n, q, out, dout, lse);
    w.g.start(b, n);
    requests<C, B> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      const index_t rows = st.rows(src), nn = st.rows(ring_next(me, p, -(s + 1)));
      if (s + 1 < p) vis.post(reqs, comm, b, nn);
      backward_on(b, st.local(rows, n), st.scale<Acc>(), vis.q.cview(), k, v, w.ct.of(st, src), w.ct.of(st, me),
                  vis.o.cview(), vis.l.cview2(), vis.d.cview(), w.g.q.view(), w.g.kv.k.view(), w.g.kv.v.view(), true,
                  w.local, st.cap);
      if (p > 1) reqs.shift(comm, b, w.g.q, w.gqn, nn, 8);
      reqs.wait(comm, b);
      if (p > 1) std::swap(w.g.q, w.gqn);
      if (s + 1 < p) vis.advance();
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
  struct fwd : ring_buffers {
    gathered<T, S> g;
  };
  //! dQ and dK/dV against every key, dK/dV padded per rank, and this rank's reduced rows.
  template <class T, class Acc, class S>
  struct bwd : ring_buffers {
    gathered<T, S> g;
    grads<Acc, S> d;
    kv_block<Acc, S> padded, reduced;
  };
  template <class T, class S, class A>
  static gathered<T, S> gather_buffers(A& a, const ring_state& st) {
    return {kv_block<T, S>::take(a, st, st.max_rows), kv_block<T, S>::take(a, st, st.ranks * st.max_rows),
            kv_block<T, S>::take(a, st, st.total)};
  }
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc, S> w;
    w.g = gather_buffers<T, S>(a, st);
    return w;
  }
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc, S> w;
    w.g = gather_buffers<T, S>(a, st);
    w.d = grads<Acc, S>::take(a, st, st.mine, st.total);
    w.padded = kv_block<Acc, S>::take(a, st, st.ranks * st.max_rows);
    w.reduced = kv_block<Acc, S>::take(a, st, st.max_rows);
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
    comm::handoff(b, comm);
    comm.all_gather(mine.k.csend(), all.k.span());
    comm.all_gather(mine.v.csend(), all.v.span());
    comm::handback(b, comm);
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
    comm::handoff(b, comm);
    comm.reduce_scatter(padded.k.csend(), reduced.k.span(), comm::reduce_op::sum);
    comm.reduce_scatter(padded.v.csend(), reduced.v.span(), comm::reduce_op::sum);
    comm::handback(b, comm);
    reduced.set_rows(st.mine);
  }

  //! One padded all_gather of K and of V, then the local kernel against every key (any mask
  //! works, the keys' coordinates come from the plan).
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    auto w = carve<runner, T, Acc, true>(b, st, ws);
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
    auto w = carve<runner, T, Acc, false>(b, st, ws);
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
