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
template <class P, class C, class B, class Gating, class Space>
void check_backward_call(const C& comm, const B& b, const lasp2_core<P>& wk, const Gating& gating,
                         const operands<P, Space>& x, tensor_view<const typename P::storage_type, 3, Space> d_o,
                         tensor_view<const typename P::accum_type, 4, Space> dfin,
                         tensor_view<const typename P::accum_type, 3, Space> incoming, const gradients<P, Space>& g,
                         std::string_view call) {
  wk.check_use(comm, b, x, call);
  (void)check_gating<typename P::accum_type, Space>(gating, wk.tokens, wk.heads);
  const index_t H = wk.heads, dk = wk.dk, dv = wk.dv;
  expect_extents(d_o, {wk.tokens, H, dv}, call, "d_o (the plan's [slice tokens, heads, dv])");
  check_state_out(dfin, wk.docs, H, dk, dv, "d_final_state");
  check_state_out(g.d_initial_state, wk.docs, H, dk, dv, "d_initial_state");
  LOOM_EXPECTS(!wk.s.continues_left || present(incoming), errc::invalid_argument,
               "incoming_state: expected the [H, dk, dv] state lasp2::forward returned on this rank (the slice "
               "continues a document from an earlier rank)");
  if (present(incoming)) {
    expect_extents(incoming, {H, dk, dv}, "incoming_state");
    LOOM_EXPECTS(incoming.is_contiguous(), errc::shape_mismatch, call, ": incoming_state: expected a contiguous view");
  }
}

//! The LASP-2 backward on this rank. Engine: kernel_step (loom's kernels: run_backward), or an
//! engine of batched products (gemm_engine.hpp: backward with the contract of gemm_backward, the
//! segments' final states into fin_out), given by pointer.
template <class P, class C, class B, class Gating, class Space, class Engine = kernel_step>
void lasp2_backward_impl(const B& b, C& comm, const lasp2_core<P>& wk, const Gating& gating,
                         const operands<P, Space>& x, tensor_view<const typename P::storage_type, 3, Space> d_o,
                         tensor_view<const typename P::accum_type, 4, Space> dfin,
                         tensor_view<const typename P::accum_type, 3, Space> incoming, const gradients<P, Space>& g,
                         std::span<std::byte> ws, const Engine* engine = nullptr) {
  constexpr bool kernels = std::is_same_v<Engine, kernel_step>;
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  constexpr std::string_view call = "lasp2::backward";
  check_backward_call(comm, b, wk, gating, x, d_o, dfin, incoming, g, call);
  auto buf = carve_lasp2(b, wk, ws, true, call);
  const gate_ref<A> gate = check_gating<A, Space>(gating, wk.tokens, wk.heads);
  const auto& s = wk.s;
  const index_t H = wk.heads, sz = wk.sz, segs = s.segments(), dk = wk.dk, dv = wk.dv, tokens = wk.tokens, one = H * sz;
  const A* init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  const A* df = present(dfin) ? dfin.data() : nullptr;
  A* init_loc = buf[blk::init_loc];
  A* dfin_loc = buf[blk::dfin_loc];
  A* dinit_loc = buf[blk::dinit_loc];
  A* fin_loc = buf[blk::fin_loc];
  loom::detail::fill(b, dinit_loc, segs * one, A(0));
  loom::detail::fill(b, fin_loc, segs * one, A(0));
  if (s.continues_left) loom::copy_bytes(b, init_loc, incoming.data(), sizeof(A) * static_cast<std::size_t>(one));
  move_states(b, buf.table, wk.bwd_init, init, init_loc, one);
  move_states(b, buf.table, wk.bwd_dfin, df, dfin_loc, one);
  operands<P, Space> xl{x.q, x.k, x.v, view_of<const A, 4, Space>(init_loc, {segs, H, dk, dv})};
  gradients<P, Space> gl{g.dq, g.dk, g.dv, g.d_log_gate, view_of<A, 4, Space>(dinit_loc, {segs, H, dk, dv})};
  const auto dfin_view = view_of<const A, 4, Space>(dfin_loc, {segs, H, dk, dv});
  if constexpr (kernels)
    run_backward(b, wk.pl, gating, xl, d_o, dfin_view, gl, buf.kernels, fin_loc, call);
  else
    engine->backward(b, wk.pl, gating, xl, d_o, dfin_view, gl, buf.kernels, fin_loc, call);
  // The element passed to the left, y -> a y + M: identity for an empty slice; (product of the
  // gates, d state leaving the slice) when one document spans it; else a reset to the constant M
  // (the d state leaving segment 0, zero when the slice starts with a document).
  state_exchange<C, B, A> ex(b, H, sz, wk.ranks, wk.posted_exchange, buf[blk::send], buf[blk::recv], buf.reqs);
  ex.clear();
  const bool pass = tokens == 0 || (s.continues_left && segs == 1);
  if (tokens > 0 && s.continues_left) loom::copy_bytes(b, ex.m(), dinit_loc, sizeof(A) * static_cast<std::size_t>(one));
  ex.set(gate, tokens, pass, A(0), !pass);  // reset: a document starts here, what enters from the right stops at it
  ex.post(comm);
  ex.finish(comm);
  A* y = buf[blk::y];
  ex.fold(comm.rank() + 1, comm.size(), true, y);
  if (s.continues_right && H > 0) {
    constexpr bool gated = is_scalar_gate<Gating>;
    const index_t last = (segs - 1) * one;
    for_each_index(b, H,
                   incoming_adjoint_kernel<S, A, Space, gated>{
                       x.k, x.v, g.dk, g.dv, g.d_log_gate, gate, y, fin_loc + last, dinit_loc + last, tokens,
                       s.local_cu[static_cast<std::size_t>(segs) - 1], H, dk, dv, !(segs == 1 && s.continues_left)});
  }
  if (!present(g.d_initial_state)) return;
  move_states(b, buf.table, wk.bwd_dinit, static_cast<const A*>(dinit_loc), g.d_initial_state.data(), one);
  move_states(b, buf.table, wk.bwd_empty, df, g.d_initial_state.data(), one);
}

}  // namespace loom::linear_attention::detail
