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
  template <class T, class Acc>
  struct fwd {
    block<T> kcw, vcw, kccw, vccw, kcw_n, vcw_n, kccw_n, vccw_n;
    running_out<Acc> o;
    std::span<std::byte> local;
  };
  template <class T, class Acc, class A>
  static fwd<T, Acc> forward_buffers(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    fwd<T, Acc> w;
    for (block<T>* k : {&w.kcw, &w.kccw, &w.kcw_n, &w.kccw_n}) *k = take_block<T>(a, m, s.heads_kv, s.dim_qk);
    for (block<T>* v : {&w.vcw, &w.vccw, &w.vcw_n, &w.vccw_n}) *v = take_block<T>(a, m, s.heads_kv, s.dim_v);
    w.o = running_out<Acc>::take(a, st);
    w.local = take_bytes(a, st.local_forward);
    return w;
  }
  template <class T, class Acc, class A>
  static auto backward_buffers(A& a, const ring_state& st) {
    return kv::backward_buffers<T, Acc>(a, st);
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
    const int foreign = p - 1, cw_steps = (foreign + 1) / 2, ccw_steps = foreign / 2;
    const index_t n = st.mine;
    const Acc scale = scale_of<Acc>(st.opt, st.dims.dim_qk);
    w.kcw.n = w.vcw.n = w.kccw.n = w.vccw.n = n;
    copy_in(k, w.kcw);
    copy_in(v, w.vcw);
    copy_in(k, w.kccw);
    copy_in(v, w.vccw);
    requests<C> reqs;
    // Posts step s's transfers: the clockwise chain brings r - s from r - 1, the counter-clockwise
    // chain brings r + s from r + 1.
    auto post = [&](int s) {
      if (s <= cw_steps) {
        const index_t rows = st.rows(ring_next(me, p, -s));
        reqs.shift(comm, w.kcw, w.kcw_n, rows, 10);
        reqs.shift(comm, w.vcw, w.vcw_n, rows, 11);
      }
      if (s <= ccw_steps) {
        const index_t rows = st.rows(ring_next(me, p, s));
        reqs.shift(comm, w.kccw, w.kccw_n, rows, 12, -1);
        reqs.shift(comm, w.vccw, w.vccw_n, rows, 13, -1);
      }
    };
    auto add = [&](const block<T>& kb, const block<T>& vb, int src, bool first) {
      w.o.add(b, st, scale, q, kb, vb, src, first, w.local);
    };
    if (cw_steps >= 1) post(1);
    add(w.kcw, w.vcw, me, true);
    for (int s = 1; s <= cw_steps; ++s) {
      reqs.wait(comm);
      std::swap(w.kcw, w.kcw_n);
      std::swap(w.vcw, w.vcw_n);
      if (s <= ccw_steps) {
        std::swap(w.kccw, w.kccw_n);
        std::swap(w.vccw, w.vccw_n);
      }
      if (s + 1 <= cw_steps) post(s + 1);
      add(w.kcw, w.vcw, ring_next(me, p, -s), false);
      if (s <= ccw_steps) add(w.kccw, w.vccw, ring_next(me, p, s), false);
    }
    w.o.copy_to(out, lse);
  }

  template <class T, class Acc, class B, class C, class... Views>
  static void backward(const B& b, C& comm, const ring_state& st, Views... views) {
    kv::backward<T, Acc>(b, comm, st, views...);
  }
};

}  // namespace loom::attention::detail
