#pragma once

//! @file
//! LASP-2 backward: the local backward with a zero adjoint entering the slice's last document from
//! the right, one exchange of (gate product, d state leaving to the left), a suffix fold, and the
//! correction of the last document by the incoming adjoint Y: for its tokens
//! D_t += exp(sum of log-gates in (t, end)) Y, so dk_t, dv_t, d log g and (for a document starting
//! in the slice) d S0 change; dq does not.

#include <loom/linear_attention/detail/lasp2_impl.hpp>

namespace loom::linear_attention::detail {

//! Every check of one backward call on this rank (local: no communication).
template <class P, class C, class Gating>
void check_backward_call(const C& comm, const lasp2_core<P>& wk, const Gating& gating,
                         const operands<P, host_memory>& x,
                         tensor_view<const typename P::storage_type, 3, host_memory> d_o,
                         tensor_view<const typename P::accum_type, 4, host_memory> dfin,
                         tensor_view<const typename P::accum_type, 3, host_memory> incoming,
                         const gradients<P, host_memory>& g, std::string_view call) {
  wk.check_use(comm, x, call);
  (void)check_gating<typename P::accum_type, host_memory>(gating, wk.tokens, wk.heads);
  const index_t H = wk.heads, dk = wk.dk, dv = wk.dv;
  expect_extents(d_o, {wk.tokens, H, dv}, call, "d_o (the plan's [slice tokens, heads, dv])");
  if (present(dfin)) expect_extents(dfin, {wk.docs, H, dk, dv}, "d_final_state");
  check_state_out(g.d_initial_state, wk.docs, H, dk, dv, "d_initial_state");
  LOOM_EXPECTS(!wk.s.continues_left || present(incoming), errc::invalid_argument,
               "incoming_state: expected the [H, dk, dv] state lasp2::forward returned on this rank (the slice "
               "continues a document from an earlier rank)");
  if (present(incoming)) expect_extents(incoming, {H, dk, dv}, "incoming_state");
}

template <class P, class C, class B, class Gating>
void lasp2_backward_impl(C& comm, const B& b, const lasp2_core<P>& wk, const Gating& gating,
                         const operands<P, host_memory>& x,
                         tensor_view<const typename P::storage_type, 3, host_memory> d_o,
                         tensor_view<const typename P::accum_type, 4, host_memory> dfin,
                         tensor_view<const typename P::accum_type, 3, host_memory> incoming,
                         const gradients<P, host_memory>& g, std::span<std::byte> ws) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  constexpr std::string_view call = "lasp2::backward";
  check_backward_call(comm, wk, gating, x, d_o, dfin, incoming, g, call);
  auto buf = carve_lasp2(wk, ws, true, call);
  const gate_ref<A> gate = check_gating<A, host_memory>(gating, wk.tokens, wk.heads);
  const auto& s = wk.s;
  const auto& cu = wk.cu;
  const index_t H = wk.heads, sz = wk.sz, segs = s.segments(), dk = wk.dk, dv = wk.dv, tokens = wk.tokens;
  const A* init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  const A* df = present(dfin) ? dfin.data() : nullptr;
  A* init_loc = buf[blk::init_loc];
  A* dfin_loc = buf[blk::dfin_loc];
  A* dinit_loc = buf[blk::dinit_loc];
  A* fin_loc = buf[blk::fin_loc];
  std::fill(dinit_loc, dinit_loc + segs * H * sz, A(0));
  std::fill(fin_loc, fin_loc + segs * H * sz, A(0));
  for (index_t k = 0; k < segs; ++k) {
    const index_t d = s.seg_doc[static_cast<std::size_t>(k)];
    const bool closed =
        d >= 0 && s.begin + s.local_cu[static_cast<std::size_t>(k) + 1] == cu[static_cast<std::size_t>(d) + 1];
    for (index_t h = 0; h < H; ++h) {
      A* dst = init_loc + (k * H + h) * sz;
      if (k == 0 && s.continues_left)
        copy_state(incoming.data() + h * sz, dst, sz);
      else
        copy_state(init && d >= 0 ? init + (d * H + h) * sz : nullptr, dst, sz);
      copy_state(df && closed ? df + (d * H + h) * sz : nullptr, dfin_loc + (k * H + h) * sz, sz);
    }
  }
  operands<P, host_memory> xl{x.q, x.k, x.v, view_of<const A, 4>(init_loc, {segs, H, dk, dv})};
  gradients<P, host_memory> gl{g.dq, g.dk, g.dv, g.d_log_gate, view_of<A, 4>(dinit_loc, {segs, H, dk, dv})};
  run_backward(b, wk.pl, gating, xl, d_o, view_of<const A, 4>(dfin_loc, {segs, H, dk, dv}), gl, buf.kernels, fin_loc,
               call);
  // The element passed to the left, y -> a y + M: identity for an empty slice; (product of the
  // gates, d state leaving the slice) when one document spans it; else a reset to the constant M
  // (the d state leaving segment 0, zero when the slice starts with a document).
  state_exchange<C, A> ex(H, sz, wk.ranks, wk.posted_exchange, buf[blk::send], buf[blk::recv], buf.reqs);
  ex.clear();
  const bool pass = tokens == 0 || (s.continues_left && segs == 1);
  for (index_t h = 0; h < H; ++h) {
    ex.a()[h] = pass ? exp_acc(log_gate_sum(gate, 0, tokens, h)) : A(0);
    copy_state(tokens > 0 && s.continues_left ? dinit_loc + h * sz : nullptr, ex.m(H) + h * sz, sz);
  }
  ex.set_reset(!pass);  // a document starts here: what enters from the right stops at it
  ex.post(comm);
  ex.finish(comm);
  A* y = buf[blk::y];
  std::fill(y, y + H * sz, A(0));
  for (int q = comm.size() - 1; q > comm.rank(); --q) ex.fold(q, y);
  if (s.continues_right) {
    const index_t lb = s.local_cu[static_cast<std::size_t>(segs) - 1];
    constexpr bool gated = is_scalar_gate<Gating>;
    for_each_index(b, H, [&](index_t h) {
      const A* Y = y + h * sz;
      A wlog = A(0), accg = A(0);
      if constexpr (gated) {
        const A* sl = fin_loc + ((segs - 1) * H + h) * sz;
        for (index_t e = 0; e < sz; ++e) accg += sl[e] * Y[e];
      }
      for (index_t t = tokens; t-- > lb;) {
        const A w = exp_acc(wlog);
        A kdk = A(0);
        for (index_t d = 0; d < dk; ++d) {
          A add = A(0);
          for (index_t e = 0; e < dv; ++e) add += Y[d * dv + e] * static_cast<A>(x.v(t, h, e));
          add *= w;
          kdk += static_cast<A>(x.k(t, h, d)) * add;
          g.dk(t, h, d) = static_cast<S>(static_cast<A>(g.dk(t, h, d)) + add);
        }
        for (index_t e = 0; e < dv; ++e) {
          A add = A(0);
          for (index_t d = 0; d < dk; ++d) add += Y[d * dv + e] * static_cast<A>(x.k(t, h, d));
          g.dv(t, h, e) = static_cast<S>(static_cast<A>(g.dv(t, h, e)) + w * add);
        }
        if constexpr (gated) {
          accg -= kdk;
          g.d_log_gate(t, h) += accg;
        }
        wlog += gate(t, h);
      }
      if (!(segs == 1 && s.continues_left)) {  // the last document starts in this slice
        const A decay = exp_acc(wlog);
        A* d0 = dinit_loc + ((segs - 1) * H + h) * sz;
        for (index_t e = 0; e < sz; ++e) d0[e] += decay * Y[e];
      }
    });
  }
  if (!present(g.d_initial_state)) return;
  A* out = g.d_initial_state.data();
  for (index_t k = 0; k < segs; ++k) {
    const index_t d = s.seg_doc[static_cast<std::size_t>(k)];
    if (d >= 0 && !(k == 0 && s.continues_left)) std::copy_n(dinit_loc + k * H * sz, H * sz, out + d * H * sz);
  }
  for (index_t d : s.owned_start)
    if (cu[static_cast<std::size_t>(d)] == cu[static_cast<std::size_t>(d) + 1])
      for (index_t h = 0; h < H; ++h) copy_state(df ? df + (d * H + h) * sz : nullptr, out + (d * H + h) * sz, sz);
}

}  // namespace loom::linear_attention::detail
