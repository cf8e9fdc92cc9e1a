#pragma once

//! @file
//! Vocabulary of loom::linear_attention: the gating tags, the options and the operand bundles
//! shared by chunked.hpp (one device) and lasp2.hpp (sequence parallel).

#include <loom/core/memory_space.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/tensor_view.hpp>

#include <optional>

namespace loom::linear_attention {

//! Gating (a): g_t = 1, plain causal linear attention.
struct no_decay {};

//! Gating (b): a fixed decay per head, g_t = gamma_h (RetNet, lightning attention), given as
//! log_decay[h] = log(gamma_h), [H] in the accumulation type. Each value must be <= 0 (gamma in
//! [0, 1]); -inf, or any value whose exponential is 0, is full decay (each token sees only its own
//! key); NaN is rejected. Checked when the memory is host-accessible.
template <class A, memory_space Space = host_memory>
struct fixed_decay {
  tensor_view<const A, 1, Space> log_decay;
};

//! Gating (c): a data-dependent scalar gate per token and head (Mamba-2, GLA-scalar), given as
//! log-gates log_gate(t, h) = log(g_t) <= 0, [T, H] in the accumulation type. <= 0, not NaN;
//! -inf (a gate of 0), or any value whose exponential is 0, is full decay: the state is forgotten
//! at that token, computed without inf - inf or 0 * inf. Checked when the memory is
//! host-accessible. The backward pass returns d log_gate (about 0 at a full-decay token).
template <class A, memory_space Space = host_memory>
struct scalar_gate {
  tensor_view<const A, 2, Space> log_gate;
};

//! Numbers of the chunked algorithm.
struct options {
  index_t chunk = 64;             //!< C, tokens per chunk (> 0); need not divide anything
  std::optional<double> scale{};  //!< the output scale; default 1 / sqrt(dk)
  index_t lanes = 0;              //!< parallel work slots (0: 4 x the backend's concurrency)
  std::optional<bool> fused{};    //!< the forward's schedule (plan::fused()); default: chosen by make_plan
  index_t head_group = 0;         //!< heads per forward work item, 1 .. 8 (0: chosen by make_plan)
};

//! The inputs of a pass, in the memory space of the backend. q, k: [T, H, dk]; v: [T, H, dv];
//! initial_state: [docs, H, dk, dv] in Accum or empty (a zero state).
//! The precision is deduced from the element types (loom::default_precision of q's element type,
//! or precision<S, A> when an initial state of Accum A is given), or named:
//! operands<loom::bf16>{q, k, v}.
template <precision_policy P, memory_space Space = host_memory>
struct operands {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  tensor_view<const S, 3, Space> q, k, v;
  tensor_view<const A, 4, Space> initial_state{};
};
template <class S, memory_space Space>
operands(tensor_view<const S, 3, Space>, tensor_view<const S, 3, Space>, tensor_view<const S, 3, Space>)
    -> operands<default_precision<S>, Space>;
template <class S, class A, memory_space Space>
operands(tensor_view<const S, 3, Space>, tensor_view<const S, 3, Space>, tensor_view<const S, 3, Space>,
         tensor_view<const A, 4, Space>) -> operands<precision<S, A>, Space>;

//! Outputs of the backward pass. dq, dk: [T, H, dk]; dv: [T, H, dv]; d_log_gate: [T, H] for
//! scalar_gate (must be empty otherwise); d_initial_state: [docs, H, dk, dv] or empty (not asked).
template <precision_policy P, memory_space Space = host_memory>
struct gradients {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  tensor_view<S, 3, Space> dq, dk, dv;
  tensor_view<A, 2, Space> d_log_gate{};
  tensor_view<A, 4, Space> d_initial_state{};
};
template <class S, memory_space Space>
gradients(tensor_view<S, 3, Space>, tensor_view<S, 3, Space>, tensor_view<S, 3, Space>)
    -> gradients<default_precision<S>, Space>;
template <class S, class A, memory_space Space>
gradients(tensor_view<S, 3, Space>, tensor_view<S, 3, Space>, tensor_view<S, 3, Space>, tensor_view<A, 2, Space>)
    -> gradients<precision<S, A>, Space>;
template <class S, class A, memory_space Space>
gradients(tensor_view<S, 3, Space>, tensor_view<S, 3, Space>, tensor_view<S, 3, Space>, tensor_view<A, 2, Space>,
          tensor_view<A, 4, Space>) -> gradients<precision<S, A>, Space>;

}  // namespace loom::linear_attention
