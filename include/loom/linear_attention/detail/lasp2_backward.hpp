#pragma once

//! @file
//! LASP-2 backward: the local backward with a zero adjoint entering the slice's last document from
//! the right, one exchange of (gate product, d state leaving to the left), a suffix fold, and the
//! correction of the last document by the incoming adjoint Y: for its tokens
//! D_t += exp(sum of log-gates in (t, end)) Y, so dk_t, dv_t, d log g and (for a document starting
//! in the slice) d S0 change; dq does not.

#include <loom/linear_attention/detail/lasp2_impl.hpp>

namespace loom::linear_attention::detail {

template <class P, class C, class B, class Gating>
void lasp2_backward_impl(C& comm, const B& b, const Gating& gating, const operands<P, host_memory>& x,
                         tensor_view<const typename P::storage_type, 3, host_memory> d_o, std::span<const index_t> cu,
                         index_t begin, tensor_view<const typename P::accum_type, 4, host_memory> dfin,
                         tensor_view<const typename P::accum_type, 3, host_memory> incoming,
                         const gradients<P, host_memory>& g, const options& opt, bool posted) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  lasp2_setup<P, C, B, Gating> st(comm, b, gating, x, cu, begin, opt);
  const auto& s = st.s;
  const index_t H = st.heads, sz = st.sz, segs = st.segs(), dk = st.dk, dv = st.dv;
  if (present(dfin)) expect_extents(dfin, {st.docs, H, dk, dv}, "d_final_state");
  check_state_out(g.d_initial_state, st.docs, H, dk, dv, "d_initial_state");
  LOOM_EXPECTS(!s.continues_left || present(incoming), errc::invalid_argument,
               "incoming_state: expected the [H, dk, dv] state lasp2_forward returned on this rank (the slice "
               "continues a document from an earlier rank)");
  if (present(incoming)) expect_extents(incoming, {H, dk, dv}, "incoming_state");
  const A* init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  const A* df = present(dfin) ? dfin.data() : nullptr;
  const std::size_t n = static_cast<std::size_t>(segs * H * sz);
  std::vector<A> init_loc(n), dfin_loc(n), dinit_loc(n), fin_loc(n);
  for (index_t k = 0; k < segs; ++k) {
    const index_t d = s.seg_doc[static_cast<std::size_t>(k)];
    const bool closed =
        d >= 0 && s.begin + s.local_cu[static_cast<std::size_t>(k) + 1] == cu[static_cast<std::size_t>(d) + 1];
    for (index_t h = 0; h < H; ++h) {
      A* dst = init_loc.data() + (k * H + h) * sz;
      if (k == 0 && s.continues_left)
        st.copy_state(incoming.data() + h * sz, dst);
      else
        st.copy_state(init && d >= 0 ? init + (d * H + h) * sz : nullptr, dst);
      st.copy_state(df && closed ? df + (d * H + h) * sz : nullptr, dfin_loc.data() + (k * H + h) * sz);
    }
  }
  operands<P, host_memory> xl{x.q, x.k, x.v, view_of<const A, 4>(init_loc, {segs, H, dk, dv})};
  gradients<P, host_memory> gl{g.dq, g.dk, g.dv, g.d_log_gate, view_of<A, 4>(dinit_loc, {segs, H, dk, dv})};
  const auto bytes = st.pl.backward_workspace_bytes();
  temporary_buffer<B, std::byte> ws(b, static_cast<index_t>(bytes));
  run_backward(b, st.pl, gating, xl, d_o, view_of<const A, 4>(dfin_loc, {segs, H, dk, dv}), gl,
               std::span<std::byte>(ws.data(), bytes), fin_loc.data());
  // The element passed to the left: identity for an empty slice, (0, 0) when the slice starts a
  // document, else (product of the gates if one document spans the slice, d state leaving it).
  state_exchange<C, A> ex(comm, H, sz, posted);
  for (index_t h = 0; h < H; ++h) {
    const bool pass = st.tokens == 0 || (s.continues_left && segs == 1);
    ex.a()[h] = pass ? exp_acc(st.log_gate_sum(0, st.tokens, h)) : A(0);
    st.copy_state(st.tokens > 0 && s.continues_left ? dinit_loc.data() + h * sz : nullptr, ex.m(H) + h * sz);
  }
  ex.post();
  const auto& all = ex.finish();
  std::vector<A> y(static_cast<std::size_t>(H * sz), A(0));
  const std::size_t m = static_cast<std::size_t>(H * (1 + sz));
  for (int q = comm.size() - 1; q > comm.rank(); --q) {
    const A* blk = all.data() + m * static_cast<std::size_t>(q);
    for (index_t h = 0; h < H; ++h)
      for (index_t e = 0; e < sz; ++e) y[h * sz + e] = blk[h] * y[h * sz + e] + blk[H + h * sz + e];
  }
  if (s.continues_right) {
    const index_t lb = s.local_cu[static_cast<std::size_t>(segs) - 1];
    constexpr bool gated = is_scalar_gate<Gating>;
    for_each_index(b, H, [&](index_t h) {
      const A* Y = y.data() + h * sz;
      A wlog = A(0), accg = A(0);
      if constexpr (gated) {
        const A* sl = fin_loc.data() + ((segs - 1) * H + h) * sz;
        for (index_t e = 0; e < sz; ++e) accg += sl[e] * Y[e];
      }
      for (index_t t = st.tokens; t-- > lb;) {
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
        wlog += st.gate(t, h);
      }
      if (!(segs == 1 && s.continues_left)) {  // the last document starts in this slice
        const A decay = exp_acc(wlog);
        A* d0 = dinit_loc.data() + ((segs - 1) * H + h) * sz;
        for (index_t e = 0; e < sz; ++e) d0[e] += decay * Y[e];
      }
    });
  }
  if (!present(g.d_initial_state)) return;
  A* out = g.d_initial_state.data();
  for (index_t k = 0; k < segs; ++k) {
    const index_t d = s.seg_doc[static_cast<std::size_t>(k)];
    if (d >= 0 && !(k == 0 && s.continues_left)) std::copy_n(dinit_loc.data() + k * H * sz, H * sz, out + d * H * sz);
  }
  for (index_t d : s.owned_start)
    if (cu[static_cast<std::size_t>(d)] == cu[static_cast<std::size_t>(d) + 1])
      for (index_t h = 0; h < H; ++h) st.copy_state(df ? df + (d * H + h) * sz : nullptr, out + (d * H + h) * sz);
}

}  // namespace loom::linear_attention::detail
