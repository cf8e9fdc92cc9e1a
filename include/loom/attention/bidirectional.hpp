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

//! The K/V blocks of the two chains of a bidirectional call: each direction's current block and
//! the next one (any element type: K/V in the storage type, their dK/dV accumulators).
template <class T, class S>
struct chain_blocks {
  kv_block<T, S> cw, cw_n, ccw, ccw_n;
  //! Blocks of max_rows rows (ccw: `ccw_rows`, 0 where a caller has no counter-clockwise chain).
  template <class A>
  static chain_blocks take(A& a, const ring_state& st, index_t ccw_rows) {
    return {kv_block<T, S>::take(a, st, st.max_rows), kv_block<T, S>::take(a, st, st.max_rows),
            kv_block<T, S>::take(a, st, ccw_rows), kv_block<T, S>::take(a, st, ccw_rows)};
  }
};

template <>
struct runner<ring::bidirectional_kv> {
  template <class T, class Acc, class S>
  struct fwd : ring_buffers {
    chain_blocks<T, S> kv;
    running_out<Acc, S> o;
  };
  template <class T, class Acc, class S, class A>
  static fwd<T, Acc, S> forward_buffers(A& a, const ring_state& st) {
    fwd<T, Acc, S> w;
    w.kv = chain_blocks<T, S>::take(a, st, st.max_rows);
    w.o = running_out<Acc, S>::take(a, st);
    return w;
  }
  template <class T, class Acc, class S>
  struct bwd : ring_buffers {
    chain_blocks<T, S> kv;   //!< the K/V of each direction and their next ones
    block<Acc, S> dq;        //!< this rank's dQ
    chain_blocks<Acc, S> g;  //!< the travelling dK/dV of each direction
  };
  template <class T, class Acc, class S, class A>
  static bwd<T, Acc, S> backward_buffers(A& a, const ring_state& st) {
    bwd<T, Acc, S> w;
    w.kv = chain_blocks<T, S>::take(a, st, st.max_rows);
    w.dq = take_block<Acc, S>(a, st.mine, st.dims.heads_q, st.dims.dim_qk);
    w.g = chain_blocks<Acc, S>::take(a, st, st.max_rows);
    return w;
  }
  template <class T, class Acc>
  static void size(ring_state& st) {
    size_from<runner, T, Acc>(st, st.mine, st.max_rows, st.mine, st.max_rows);
  }

  //! Steps of each chain: the clockwise one brings the P - 1 foreign blocks' first half (rounded up).
  static int cw_steps(const ring_state& st) { return st.ranks / 2; }
  static int ccw_steps(const ring_state& st) { return (st.ranks - 1) / 2; }

  //! The forward's schedule over blocks kv: visit(block, src) for this rank's own K/V, then per step
  //! s the clockwise block (rank r - s) and the counter-clockwise one (rank r + s); step s + 1's
  //! transfers are posted before step s's blocks are visited.
  template <class B, class C, class T, class S, class K, class V, class Visit>
  static void forward_chains(const B& b, C& comm, const ring_state& st, const K& k, const V& v, chain_blocks<T, S>& kv,
                             Visit&& visit) {
    const int p = st.ranks, me = st.me, cw = cw_steps(st), ccw = ccw_steps(st);
    kv.cw.load(b, st.mine, k, v);
    if (ccw >= 1) kv.ccw.load(b, st.mine, k, v);
    requests<C, B> reqs;
    // Step s: the clockwise chain brings r - s from r - 1, the counter-clockwise r + s from r + 1.
    auto post = [&](int s) {
      if (s <= cw) reqs.shift(comm, b, kv.cw, kv.cw_n, st.rows(ring_next(me, p, -s)), 10);
      if (s <= ccw) reqs.shift(comm, b, kv.ccw, kv.ccw_n, st.rows(ring_next(me, p, s)), 12, -1);
    };
    if (cw >= 1) post(1);
    visit(kv.cw, me);
    for (int s = 1; s <= cw; ++s) {
      reqs.wait(comm, b);
      std::swap(kv.cw, kv.cw_n);
      if (s <= ccw) std::swap(kv.ccw, kv.ccw_n);
      if (s + 1 <= cw) post(s + 1);
      visit(kv.cw, ring_next(me, p, -s));
      if (s <= ccw) visit(kv.ccw, ring_next(me, p, s));
    }
  }

  //! The backward's schedule: the forward's visits, visit(block, its dK/dV accumulator, src), the
  //! accumulators of step s - 1 following their K/V; after the last step each chain's accumulator
  //! goes straight home and dk, dv = the clockwise one + the counter-clockwise one (in Acc).
  template <class B, class C, class T, class Acc, class S, class K, class V, class DK, class DV, class Visit>
  static void backward_chains(const B& b, C& comm, const ring_state& st, const K& k, const V& v, chain_blocks<T, S>& kv,
                              chain_blocks<Acc, S>& g, DK dk, DV dv, Visit&& visit) {
    const int p = st.ranks, me = st.me, cw = cw_steps(st), ccw = ccw_steps(st);
    kv.cw.load(b, st.mine, k, v);
    if (ccw >= 1) kv.ccw.load(b, st.mine, k, v);
    for (kv_block<Acc, S>* a : {&g.cw, &g.ccw}) {
      a->set_rows(st.mine);
      a->zero(b);
    }
    requests<C, B> kv_reqs, g_reqs;
    auto post = [&](int s) {
      if (s <= cw) kv_reqs.shift(comm, b, kv.cw, kv.cw_n, st.rows(ring_next(me, p, -s)), 10);
      if (s <= ccw) kv_reqs.shift(comm, b, kv.ccw, kv.ccw_n, st.rows(ring_next(me, p, s)), 12, -1);
    };
    if (cw >= 1) post(1);
    visit(kv.cw, g.cw, me);
    for (int s = 1; s <= cw; ++s) {
      g_reqs.shift(comm, b, g.cw, g.cw_n, st.rows(ring_next(me, p, -s)), 14);
      if (s <= ccw) g_reqs.shift(comm, b, g.ccw, g.ccw_n, st.rows(ring_next(me, p, s)), 16, -1);
      kv_reqs.wait(comm, b);
      g_reqs.wait(comm, b);
      std::swap(kv.cw, kv.cw_n);
      std::swap(g.cw, g.cw_n);
      if (s <= ccw) {
        std::swap(kv.ccw, kv.ccw_n);
        std::swap(g.ccw, g.ccw_n);
      }
      if (s + 1 <= cw) post(s + 1);
      visit(kv.cw, g.cw, ring_next(me, p, -s));
      if (s <= ccw) visit(kv.ccw, g.ccw, ring_next(me, p, s));
    }
    // Home: the clockwise accumulator (owner r - cw) and the counter-clockwise one (owner r + ccw)
    // straight back to their owners.
    if (cw >= 1) g_reqs.shift(comm, b, g.cw, g.cw_n, st.mine, 18, -cw);
    if (ccw >= 1) g_reqs.shift(comm, b, g.ccw, g.ccw_n, st.mine, 20, ccw);
    g_reqs.wait(comm, b);
    const kv_block<Acc, S>& cw_home = cw >= 1 ? g.cw_n : g.cw;
    if (ccw >= 1) {
      sum_out(b, cw_home.k, g.ccw_n.k, dk);
      sum_out(b, cw_home.v, g.ccw_n.v, dv);
    } else {
      copy_out(b, cw_home.k, dk);
      copy_out(b, cw_home.v, dv);
    }
  }

  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L>
  static void forward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    auto w = carve<runner, T, Acc, true>(b, st, ws);
    bool first = true;
    forward_chains(b, comm, st, k, v, w.kv, [&](const kv_block<T, S>& kv, int src) {
      w.o.add(b, st, w.ct, q, kv, src, first, w.local);
      first = false;
    });
    w.o.copy_to(b, out, lse);
  }

  template <class T, class Acc, class B, class C, class Q, class K, class V, class O, class L, class DO, class DQ,
            class DK, class DV>
  static void backward(const B& b, C& comm, const ring_state& st, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
                       DV dv, std::span<std::byte> ws) {
    using S = typename backend_traits<B>::memory_space;
    auto w = carve<runner, T, Acc, false>(b, st, ws);
    const int me = st.me;
    w.dq.n = st.mine;
    w.dq.zero(b);
    // This rank's queries against the K/V of rank src, into dQ and the block's accumulators.
    backward_chains(
        b, comm, st, k, v, w.kv, w.g, dk, dv, [&](const kv_block<T, S>& kv, const kv_block<Acc, S>& g, int src) {
          backward_on(b, st.local(st.mine, kv.k.n), st.scale<Acc>(), q, kv.k.cview(), kv.v.cview(), w.ct.of(st, me),
                      w.ct.of(st, src), out, lse, dout, w.dq.view(), g.k.view(), g.v.view(), true, w.local, st.cap);
        });
    copy_out(b, w.dq, dq);
  }
};

}  // namespace loom::attention::detail
