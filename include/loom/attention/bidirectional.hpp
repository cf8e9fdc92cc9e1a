#pragma once

//! @file
//! Bidirectional ring attention (TokenRing's idea: both directions of every link busy at once),
//! the ring::bidirectional_kv variant of ring.hpp:
//!
//!   auto plan = ring::make_plan(b, comm, ring::bidirectional_kv{}, sharding, shape, opts);
//!   ring::forward(b, comm, plan, q, k, v, out, lse, ws.span());
//!
//! K/V blocks travel clockwise and counter-clockwise at the same time: after step s a rank has
//! seen the blocks of ranks r - s and r + s, so the P - 1 foreign blocks arrive in ceil((P - 1) / 2)
//! steps instead of P - 1, each step moving two blocks (one per direction) per rank. The transfer
//! of step s + 1 is posted before the blocks of step s are computed. Same contract, plans and
//! results as pass_kv (see ring.hpp); merges run in a fixed order (own block, then for each step
//! the clockwise block, then the counter-clockwise one), so results are bitwise reproducible for a
//! fixed P.
//!
//! Backward: the same two chains carry K/V with their dK/dV accumulators (accumulation type): at
//! step s a rank adds its queries' gradients against the blocks of ranks r - s and r + s to the
//! accumulators that travel with them (dQ accumulates locally: own block, then for each step the
//! clockwise block, then the counter-clockwise one), so the P - 1 foreign blocks are visited in
//! ceil((P - 1) / 2) steps, both directions of every link busy. After the last step each chain's
//! accumulator goes straight back to its owner (one sendrecv per chain, distance ceil((P - 1) / 2)
//! and floor((P - 1) / 2)), which sums the two in Acc, clockwise first: bitwise reproducible for a
//! fixed P. Per rank and step: two K/V blocks and two accumulators sent (one per direction), then
//! the two returns.

#include <loom/attention/ring.hpp>

namespace loom::attention::detail {

//! Element i of a [n, h, d] view = x[i] + y[i] (contiguous blocks of the same rows).
template <class A, class V>
struct sum_out_kernel {
  const A *x, *y;
  V v;
  index_t h, d;
  LOOM_HD void operator()(index_t i) const {
    const index_t r = i / d;
    v(r / h, r % h, i % d) = static_cast<typename V::value_type>(x[i] + y[i]);
  }
};
template <backend B, class A, class S, class V>
void sum_out(const B& b, const block<A, S>& x, const block<A, S>& y, V v) {
  if (x.size() > 0) for_each_index(b, x.size(), sum_out_kernel<A, V>{x.p, y.p, v, x.h, x.d});
}

template <>
struct runner<ring::bidirectional_kv> {
  template <class T, class Acc, class S>
  struct fwd {
    coord_table ct;
    kv_block<T, S> cw, ccw, cw_n, ccw_n;  //!< the blocks of each direction and their next ones
    running_out<Acc, S> o;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    for (kv_block<T, S>* kv : {&w.cw, &w.ccw, &w.cw_n, &w.ccw_n}) *kv = kv_block<T, S>::take(a, st, st.max_rows);
    w.o = running_out<Acc, S>::take(a, st);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class S>
  struct bwd {
    coord_table ct;
    kv_block<T, S> cw, ccw, cw_n, ccw_n;        //!< the K/V of each direction and their next ones
    block<Acc, S> dq;                           //!< this rank's dQ
    kv_block<Acc, S> gcw, gccw, gcw_n, gccw_n;  //!< the travelling dK/dV of each direction
    std::span<std::byte> local;
  };
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc, S> w;
    w.ct = coord_table::take(a, st);
    for (kv_block<T, S>* kv : {&w.cw, &w.ccw, &w.cw_n, &w.ccw_n}) *kv = kv_block<T, S>::take(a, st, st.max_rows);
    w.dq = take_block<Acc, S>(a, st.mine, st.dims.heads_q, st.dims.dim_qk);
    for (kv_block<Acc, S>* g : {&w.gcw, &w.gccw, &w.gcw_n, &w.gccw_n}) *g = kv_block<Acc, S>::take(a, st, st.max_rows);
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
    const int foreign = p - 1, cw_steps = (foreign + 1) / 2, ccw_steps = foreign / 2;
    w.cw.load(b, st.mine, k, v);
    w.ccw.load(b, st.mine, k, v);
    requests<C, B> reqs;
    // Posts step s's transfers: the clockwise chain brings r - s from r - 1, the counter-clockwise
    // chain brings r + s from r + 1.
    auto post = [&](int s) {
      if (s <= cw_steps) reqs.shift(comm, b, w.cw, w.cw_n, st.rows(ring_next(me, p, -s)), 10);
      if (s <= ccw_steps) reqs.shift(comm, b, w.ccw, w.ccw_n, st.rows(ring_next(me, p, s)), 12, -1);
    };
    if (cw_steps >= 1) post(1);
    w.o.add(b, st, w.ct, q, w.cw, me, true, w.local);
    for (int s = 1; s <= cw_steps; ++s) {
      reqs.wait(comm, b);
      std::swap(w.cw, w.cw_n);
      if (s <= ccw_steps) std::swap(w.ccw, w.ccw_n);
      if (s + 1 <= cw_steps) post(s + 1);
      w.o.add(b, st, w.ct, q, w.cw, ring_next(me, p, -s), false, w.local);
      if (s <= ccw_steps) w.o.add(b, st, w.ct, q, w.ccw, ring_next(me, p, s), false, w.local);
    }
    w.o.copy_to(b, out, lse);
  }

  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    workspace_carver a(ws);
    auto w = backward_buffers<T, Acc, S>(a, st);
    w.ct.template bind<S>(b, st);
    const int p = st.ranks, me = st.me;
    const int foreign = p - 1, cw_steps = (foreign + 1) / 2, ccw_steps = foreign / 2;
    w.cw.load(b, st.mine, k, v);
    if (ccw_steps >= 1) w.ccw.load(b, st.mine, k, v);
    w.dq.n = st.mine;
    w.dq.zero(b);
    for (kv_block<Acc, S>* g : {&w.gcw, &w.gccw}) {
      g->set_rows(st.mine);
      g->zero(b);
    }
    requests<C, B> kv_reqs, g_reqs;
    // Step s's K/V: the clockwise chain brings r - s from r - 1, the counter-clockwise r + s from r + 1.
    auto post = [&](int s) {
      if (s <= cw_steps) kv_reqs.shift(comm, b, w.cw, w.cw_n, st.rows(ring_next(me, p, -s)), 10);
      if (s <= ccw_steps) kv_reqs.shift(comm, b, w.ccw, w.ccw_n, st.rows(ring_next(me, p, s)), 12, -1);
    };
    // This rank's queries against the K/V of rank src, into dQ and the block's accumulators.
    auto grad = [&](const kv_block<T, S>& kv, kv_block<Acc, S>& g, int src) {
      backward_on(b, st.local(st.mine, kv.k.n), st.scale<Acc>(), q, kv.k.cview(), kv.v.cview(), w.ct.of(st, me),
                  w.ct.of(st, src), out, lse, dout, w.dq.view(), g.k.view(), g.v.view(), true, w.local, st.cap);
    };
    if (cw_steps >= 1) post(1);
    grad(w.cw, w.gcw, me);
    for (int s = 1; s <= cw_steps; ++s) {
      // The accumulators of step s - 1 follow their K/V.
      g_reqs.shift(comm, b, w.gcw, w.gcw_n, st.rows(ring_next(me, p, -s)), 14);
      if (s <= ccw_steps) g_reqs.shift(comm, b, w.gccw, w.gccw_n, st.rows(ring_next(me, p, s)), 16, -1);
      kv_reqs.wait(comm, b);
      g_reqs.wait(comm, b);
      std::swap(w.cw, w.cw_n);
      std::swap(w.gcw, w.gcw_n);
      if (s <= ccw_steps) {
        std::swap(w.ccw, w.ccw_n);
        std::swap(w.gccw, w.gccw_n);
      }
      if (s + 1 <= cw_steps) post(s + 1);
      grad(w.cw, w.gcw, ring_next(me, p, -s));
      if (s <= ccw_steps) grad(w.ccw, w.gccw, ring_next(me, p, s));
    }
    // Home: the clockwise accumulator (owner r - cw_steps) and the counter-clockwise one (owner
    // r + ccw_steps) straight back to their owners.
    if (cw_steps >= 1) g_reqs.shift(comm, b, w.gcw, w.gcw_n, st.mine, 18, -cw_steps);
    if (ccw_steps >= 1) g_reqs.shift(comm, b, w.gccw, w.gccw_n, st.mine, 20, ccw_steps);
    g_reqs.wait(comm, b);
    const kv_block<Acc, S>& cw_home = cw_steps >= 1 ? w.gcw_n : w.gcw;
    copy_out(b, w.dq, dq);
    if (ccw_steps >= 1) {
      sum_out(b, cw_home.k, w.gccw_n.k, dk);
      sum_out(b, cw_home.v, w.gccw_n.v, dv);
    } else {
      copy_out(b, cw_home.k, dk);
      copy_out(b, cw_home.v, dv);
    }
  }
};

}  // namespace loom::attention::detail
