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
  //! q (this rank's) against kb, vb (rank src's): into the running pair when first, else merged in.
  template <class B, class Q, class T>
  void add(const B& b, const ring_state& st, Acc scale, Q q, const block<T>& kb, const block<T>& vb, int src,
           bool first, std::span<std::byte> local) {
    const auto& o = first ? acc : part;
    const auto& l = first ? lacc : lpart;
    forward_on(b, st.local(st.mine, kb.n), scale, q, kb.cview(), vb.cview(), st.coords_of(st.me), st.coords_of(src),
               o.view(), l.view2(), local, st.cap);
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
    block<T> kc, vc, kn, vn;
    running_out<Acc> o;
    std::span<std::byte> local;
  };
  template <class T, class Acc>
  struct bwd {
    block<T> kc, vc, kn, vn;
    block<Acc> gq, gk, gv, gkn, gvn;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class A>
  static fwd<T, Acc> forward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    fwd<T, Acc> w;
    w.kc = take_block<T>(a, m, s.heads_kv, s.dim_qk);
    w.vc = take_block<T>(a, m, s.heads_kv, s.dim_v);
    w.kn = take_block<T>(a, m, s.heads_kv, s.dim_qk);
    w.vn = take_block<T>(a, m, s.heads_kv, s.dim_v);
    w.o = running_out<Acc>::take(a, st);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class A>
  static bwd<T, Acc> backward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows, n = st.mine;
    bwd<T, Acc> w;
    w.kc = take_block<T>(a, m, s.heads_kv, s.dim_qk);
    w.vc = take_block<T>(a, m, s.heads_kv, s.dim_v);
    w.kn = take_block<T>(a, m, s.heads_kv, s.dim_qk);
    w.vn = take_block<T>(a, m, s.heads_kv, s.dim_v);
    w.gq = take_block<Acc>(a, n, s.heads_q, s.dim_qk);
    w.gk = take_block<Acc>(a, m, s.heads_kv, s.dim_qk);
    w.gv = take_block<Acc>(a, m, s.heads_kv, s.dim_v);
    w.gkn = take_block<Acc>(a, m, s.heads_kv, s.dim_qk);
    w.gvn = take_block<Acc>(a, m, s.heads_kv, s.dim_v);
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
    const index_t n = st.mine;
    const Acc scale = scale_of<Acc>(st.opt, st.dims.dim_qk);
    w.kc.n = w.vc.n = n;
    copy_in(k, w.kc);
    copy_in(v, w.vc);
    requests<C> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      if (s + 1 < p) {
        const index_t rows = st.rows(ring_next(me, p, -(s + 1)));
        reqs.shift(comm, w.kc, w.kn, rows, 0);
        reqs.shift(comm, w.vc, w.vn, rows, 1);
      }
      w.o.add(b, st, scale, q, w.kc, w.vc, src, s == 0, w.local);
      reqs.wait(comm);
      std::swap(w.kc, w.kn);
      std::swap(w.vc, w.vn);
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
    const index_t n = st.mine;
    const Acc scale = scale_of<Acc>(st.opt, st.dims.dim_qk);
    w.kc.n = w.vc.n = w.gq.n = w.gk.n = w.gv.n = n;
    copy_in(k, w.kc);
    copy_in(v, w.vc);
    w.gq.zero();
    w.gk.zero();
    w.gv.zero();
    requests<C> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      const index_t next_rows = st.rows(ring_next(me, p, -(s + 1)));
      if (s + 1 < p) {
        reqs.shift(comm, w.kc, w.kn, next_rows, 0);
        reqs.shift(comm, w.vc, w.vn, next_rows, 1);
      }
      backward_on(b, st.local(n, w.kc.n), scale, q, w.kc.cview(), w.vc.cview(), st.coords_of(me), st.coords_of(src),
                  out, lse, dout, w.gq.view(), w.gk.view(), w.gv.view(), true, w.local, st.cap);
      if (p > 1) {  // the accumulators move on (after the last step: home)
        reqs.shift(comm, w.gk, w.gkn, next_rows, 2);
        reqs.shift(comm, w.gv, w.gvn, next_rows, 3);
      }
      reqs.wait(comm);
      if (p > 1) {
        std::swap(w.gk, w.gkn);
        std::swap(w.gv, w.gvn);
      }
      if (s + 1 < p) {
        std::swap(w.kc, w.kn);
        std::swap(w.vc, w.vn);
      }
    }
    copy_out(w.gq, dq);
    copy_out(w.gk, dk);
    copy_out(w.gv, dv);
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
    block<Acc> lc, ln, gq, gqn, gk, gv;
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
    const index_t m = st.max_rows, n = st.mine;
    bwd<T, Acc> w;
    w.qc = take_block<T>(a, m, s.heads_q, s.dim_qk);
    w.qn = take_block<T>(a, m, s.heads_q, s.dim_qk);
    w.oc = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.on = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.dc = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.dn = take_block<T>(a, m, s.heads_q, s.dim_v);
    w.lc = take_block<Acc>(a, m, s.heads_q, 1);
    w.ln = take_block<Acc>(a, m, s.heads_q, 1);
    w.gq = take_block<Acc>(a, m, s.heads_q, s.dim_qk);
    w.gqn = take_block<Acc>(a, m, s.heads_q, s.dim_qk);
    w.gk = take_block<Acc>(a, n, s.heads_kv, s.dim_qk);
    w.gv = take_block<Acc>(a, n, s.heads_kv, s.dim_v);
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
    const Acc scale = scale_of<Acc>(st.opt, st.dims.dim_qk);
    w.qc.n = n;
    copy_in(q, w.qc);
    requests<C> reqs;
    for (int s = 0; s < p; ++s) {
      const int src = ring_next(me, p, -s);
      if (s + 1 < p) reqs.shift(comm, w.qc, w.qn, st.rows(ring_next(me, p, -(s + 1))), 4);
      Acc* base = w.send + st.send_displs[static_cast<std::size_t>(src)];
      const index_t rows = st.rows(src);
      forward_on(b, st.local(rows, n), scale, w.qc.cview(), k, v, st.coords_of(src), st.coords_of(me),
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
    const Acc scale = scale_of<Acc>(st.opt, st.dims.dim_qk);
    w.qc.n = w.oc.n = w.dc.n = w.lc.n = w.gq.n = n;
    copy_in(q, w.qc);
    copy_in(out, w.oc);
    copy_in(dout, w.dc);
    copy_in2(lse, w.lc);
    w.gq.zero();
    w.gk.zero();
    w.gv.zero();
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
      backward_on(b, st.local(rows, n), scale, w.qc.cview(), k, v, st.coords_of(src), st.coords_of(me), w.oc.cview(),
                  w.lc.cview2(), w.dc.cview(), w.gq.view(), w.gk.view(), w.gv.view(), true, w.local, st.cap);
      if (p > 1) reqs.shift(comm, w.gq, w.gqn, nn, 8);
      reqs.wait(comm);
      if (p > 1) std::swap(w.gq, w.gqn);
      if (s + 1 < p) {
        std::swap(w.qc, w.qn);
        std::swap(w.oc, w.on);
        std::swap(w.dc, w.dn);
        std::swap(w.lc, w.ln);
      }
    }
    copy_out(w.gq, dq);
    copy_out(w.gk, dk);
    copy_out(w.gv, dv);
  }
};

template <>
struct runner<ring::all_gather_kv> {
  template <class T>
  struct gathered {
    block<T> mine_k, mine_v, all_k, all_v, k, v;
  };
  template <class T, class Acc>
  struct fwd {
    gathered<T> g;
    std::span<std::byte> local;
  };
  template <class T, class Acc>
  struct bwd {
    gathered<T> g;
    block<Acc> gq, gk, gv, pk, pv, rk, rv;
    std::span<std::byte> local;
  };
  template <class T, class A>
  static gathered<T> gather_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows, pm = st.ranks * m;
    return {take_block<T>(a, m, s.heads_kv, s.dim_qk),        take_block<T>(a, m, s.heads_kv, s.dim_v),
            take_block<T>(a, pm, s.heads_kv, s.dim_qk),       take_block<T>(a, pm, s.heads_kv, s.dim_v),
            take_block<T>(a, st.total, s.heads_kv, s.dim_qk), take_block<T>(a, st.total, s.heads_kv, s.dim_v)};
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
    const auto& s = st.dims;
    const index_t m = st.max_rows, pm = st.ranks * m;
    bwd<T, Acc> w;
    w.g = gather_buffers<T>(a, st);
    w.gq = take_block<Acc>(a, st.mine, s.heads_q, s.dim_qk);
    w.gk = take_block<Acc>(a, st.total, s.heads_kv, s.dim_qk);
    w.gv = take_block<Acc>(a, st.total, s.heads_kv, s.dim_v);
    w.pk = take_block<Acc>(a, pm, s.heads_kv, s.dim_qk);
    w.pv = take_block<Acc>(a, pm, s.heads_kv, s.dim_v);
    w.rk = take_block<Acc>(a, m, s.heads_kv, s.dim_qk);
    w.rv = take_block<Acc>(a, m, s.heads_kv, s.dim_v);
    w.local = take_bytes(a, st.local_backward);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.mine, st.total, st.mine, st.total);
  }

  //! K and V of every rank in rank order: one padded all_gather each, then the padding dropped.
  template <class T, class C, class K, class V>
  static void gather(C& comm, const ring_state& st, const K& k, const V& v, gathered<T>& g) {
    const index_t m = st.max_rows, hkv = st.dims.heads_kv, dk = st.dims.dim_qk, dv = st.dims.dim_v;
    g.mine_k.zero();
    g.mine_v.zero();
    block<T> kk = g.mine_k, vv = g.mine_v;
    kk.n = vv.n = st.mine;
    copy_in(k, kk);
    copy_in(v, vv);
    comm.all_gather(g.mine_k.csend(), g.all_k.span());
    comm.all_gather(g.mine_v.csend(), g.all_v.span());
    for (int r = 0; r < st.ranks; ++r) {
      const index_t n = st.rows(r), at = st.begin[static_cast<std::size_t>(r)];
      std::copy_n(g.all_k.p + r * m * hkv * dk, n * hkv * dk, g.k.p + at * hkv * dk);
      std::copy_n(g.all_v.p + r * m * hkv * dv, n * hkv * dv, g.v.p + at * hkv * dv);
    }
  }

  //! One padded all_gather of K and of V, then the local kernel against every key (any mask
  //! works, the keys' coordinates come from the plan).
  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    workspace_carver a(ws);
    auto w = forward_buffers<T, Acc>(a, st);
    gather(comm, st, k, v, w.g);
    forward_on(b, st.local(st.mine, st.total), scale_of<Acc>(st.opt, st.dims.dim_qk), q, w.g.k.cview(), w.g.v.cview(),
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
    backward_on(b, st.local(st.mine, st.total), scale_of<Acc>(st.opt, st.dims.dim_qk), q, w.g.k.cview(), w.g.v.cview(),
                st.coords_of(st.me), st.all_coords(), out, lse, dout, w.gq.view(), w.gk.view(), w.gv.view(), false,
                w.local, st.cap);
    // Pad to the largest shard, reduce-scatter, keep my rows.
    const index_t m = st.max_rows, hkv = st.dims.heads_kv, dkd = st.dims.dim_qk, dvd = st.dims.dim_v;
    w.pk.zero();
    w.pv.zero();
    for (int r = 0; r < st.ranks; ++r) {
      const index_t n = st.rows(r), at = st.begin[static_cast<std::size_t>(r)];
      std::copy_n(w.gk.p + at * hkv * dkd, n * hkv * dkd, w.pk.p + r * m * hkv * dkd);
      std::copy_n(w.gv.p + at * hkv * dvd, n * hkv * dvd, w.pv.p + r * m * hkv * dvd);
    }
    comm.reduce_scatter(w.pk.csend(), w.rk.span(), comm::reduce_op::sum);
    comm.reduce_scatter(w.pv.csend(), w.rv.span(), comm::reduce_op::sum);
    w.rk.n = w.rv.n = st.mine;
    copy_out(w.gq, dq);
    copy_out(w.rk, dk);
    copy_out(w.rv, dv);
  }
};

}  // namespace loom::attention::detail
