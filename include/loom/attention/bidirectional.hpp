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
//! fixed P. The backward of a bidirectional plan is pass-KV's, which needs only the forward's out
//! and lse.

#include <loom/attention/ring.hpp>

namespace loom::attention::detail {

template <>
struct runner<ring::bidirectional_kv> {
  using kv = runner<ring::pass_kv>;
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
  template <class T, class Acc, class S, class A>
  static auto backward_buffers(A& a, const ring_state& st) {
    return kv::backward_buffers<T, Acc, S>(a, st);
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

  template <class T, class Acc, class B, class C, class... Views>
  static void backward(const B& b, C& comm, const ring_state& st, Views... views) {
    kv::backward<T, Acc>(b, comm, st, views...);
  }
};

}  // namespace loom::attention::detail
