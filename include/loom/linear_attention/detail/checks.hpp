#pragma once

//! @file
//! Argument validation of the public entries (host side; every failure is a loom::error naming
//! the argument and the expected value).

#include <loom/core/error.hpp>
#include <loom/linear_attention/detail/forward_kernels.hpp>
#include <loom/linear_attention/types.hpp>

#include <type_traits>

namespace loom::linear_attention::detail {

template <class V>
bool present(const V& v) {
  return v.data() != nullptr || v.size() != 0;
}

//! Gate of a gating tag for the kernels, after validating its shape and (host memory) values.
template <class A, class Space>
gate_ref<A> check_gating(const no_decay&, index_t, index_t) {
  return {};
}

template <class A, class Space, class GA, class GS>
gate_ref<A> check_gating(const fixed_decay<GA, GS>& g, index_t, index_t heads) {
  static_assert(std::is_same_v<GA, A>, "fixed_decay: log_decay must be in the accumulation type");
  static_assert(std::is_same_v<GS, Space>, "fixed_decay: log_decay must be in the backend's memory space");
  expect_extents(g.log_decay, {heads}, "fixed_decay.log_decay");
  if constexpr (Space::host_accessible)
    for (index_t h = 0; h < heads; ++h) {
      const A x = g.log_decay(h);
      LOOM_EXPECTS(x <= A(0), errc::invalid_argument, "fixed_decay.log_decay[", h, "] = ", static_cast<double>(x),
                   ": expected a log-decay <= 0 (decay in [0, 1]; -inf is a decay of 0), not NaN or > 0");
    }
  return {g.log_decay.data(), 0, g.log_decay.stride(0)};
}

template <class A, class Space, class GA, class GS>
gate_ref<A> check_gating(const scalar_gate<GA, GS>& g, index_t tokens, index_t heads) {
  static_assert(std::is_same_v<GA, A>, "scalar_gate: log_gate must be in the accumulation type");
  static_assert(std::is_same_v<GS, Space>, "scalar_gate: log_gate must be in the backend's memory space");
  expect_extents(g.log_gate, {tokens, heads}, "scalar_gate.log_gate");
  if constexpr (Space::host_accessible)
    for (index_t t = 0; t < tokens; ++t)
      for (index_t h = 0; h < heads; ++h) {
        const A x = g.log_gate(t, h);
        LOOM_EXPECTS(x <= A(0), errc::invalid_argument, "scalar_gate.log_gate(", t, ", ", h,
                     ") = ", static_cast<double>(x),
                     ": expected a log-gate <= 0 (-inf is a gate of 0, full decay), not NaN or > 0");
      }
  // A null data pointer means "no decay" to the kernels: only possible when T * H == 0.
  return {tokens * heads > 0 ? g.log_gate.data() : nullptr, g.log_gate.stride(0), g.log_gate.stride(1)};
}

template <class G>
inline constexpr bool is_scalar_gate = false;
template <class A, class Space>
inline constexpr bool is_scalar_gate<scalar_gate<A, Space>> = true;

//! Shapes of q, k, v (and an optional state [docs, H, dk, dv]) against the plan.
template <class Ops>
void check_operands(const Ops& x, index_t tokens, index_t heads, index_t dk, index_t dv, index_t docs) {
  expect_extents(x.q, {tokens, heads, dk}, "q");
  expect_extents(x.k, {tokens, heads, dk}, "k");
  expect_extents(x.v, {tokens, heads, dv}, "v");
  if (present(x.initial_state)) expect_extents(x.initial_state, {docs, heads, dk, dv}, "initial_state");
  if (present(x.initial_state))
    LOOM_EXPECTS(x.initial_state.is_contiguous(), errc::shape_mismatch, "initial_state: expected a contiguous view");
}

template <class V>
void check_state_out(const V& s, index_t docs, index_t heads, index_t dk, index_t dv, const char* name) {
  if (!present(s)) return;
  expect_extents(s, {docs, heads, dk, dv}, name);
  LOOM_EXPECTS(s.is_contiguous(), errc::shape_mismatch, name, ": expected a contiguous view");
}

}  // namespace loom::linear_attention::detail
