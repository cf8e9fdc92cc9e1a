#pragma once

//! @file
//! Chunkwise causal linear attention on one device, forward and backward. Per document and head,
//! with state S in R^{dk x dv} (kept in the accumulation type):
//!   S_t = g_t S_{t-1} + k_t v_t^T,   o_t = scale S_t^T q_t,   S_{-1} = initial state (or 0)
//! with g from the gating tag (no_decay, fixed_decay, scalar_gate; see types.hpp). Packed "THD"
//! layout; documents delimited by cu_seqlens, the state reset at each document's start.
//!
//!   auto plan = linear_attention::make_plan(b, docs, {.tokens = T, .heads = H, .dk = dk, .dv = dv}, {.chunk = 64});
//!   loom::workspace_buffer ws(plan.forward_workspace_bytes());
//!   linear_attention::forward(b, plan, no_decay{}, x, o, final_state, ws.span());   // no allocation
//!   linear_attention::forward(b, docs, no_decay{}, x, o);                           // convenience
//!
//! docs: loom::segments over int32 or int64 offsets in host memory or the backend's memory (read
//! once by make_plan; empty: one document). Precision: the
//! operands' policy (la::operands x{q, k, v} deduces it from the element types; see types.hpp);
//! the plan form requires a plan of that precision (plan.hpp).
//! Completion: host backends complete on return; on device backends the plan forms are
//! stream-ordered on the backend's stream (no host sync) and the convenience forms fence.
//!
//! Algorithm (three launches of loom::for_each_index): (1) per (chunk, head) the chunk's own state
//! contribution; (2) per (document, head) the sequential pass over the chunk states; (3) per
//! (chunk, head) the output, intra-chunk masked product plus the inter-chunk term. Work:
//! O(T H (C (dk + dv) + dk dv)); workspace O(chunks H dk dv) plus per-lane scratch.
//! Deterministic: for a fixed backend and inputs the bits never change (no atomic sums; each output
//! element is computed by one fixed loop order, independent of the thread count and of the lane
//! that runs its item). On host backends the lanes take their items from a shared counter, so a
//! thread that loses its core to another process delays a launch by the item it holds.

#include <loom/backend/copy.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>
#include <loom/linear_attention/detail/driver.hpp>
#include <loom/linear_attention/plan.hpp>
#include <loom/linear_attention/types.hpp>

#include <cstddef>
#include <span>

namespace loom::linear_attention {

//! Runs the forward pass with a caller's workspace (at least plan.forward_workspace_bytes(), in
//! the backend's memory space, aligned to loom::workspace_alignment). x: the plan's [T, H, dk]
//! q, k and [T, H, dv] v, initial_state [docs, H, dk, dv] in Accum or empty; o: [T, H, dv];
//! final_state: [docs, H, dk, dv] in Accum, or empty. Allocates nothing; no fence.
//! @throws loom::error(shape_mismatch) for an operand whose extents do not fit the plan,
//!         loom::error(invalid_argument) for a bad gate value or a too-small or misaligned workspace.
template <backend B, precision_policy P, class Gating, memory_space Space>
void forward(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
             tensor_view<typename P::storage_type, 3, Space> o,
             tensor_view<typename P::accum_type, 4, Space> final_state, std::span<std::byte> workspace) {
  static_assert(std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "linear_attention::forward: operands must live in the backend's memory space");
  detail::run_forward(b, pl, gating, x, o, final_state, workspace);
}

//! Convenience form: make_plan (precision of the operands, tokens of q), a loom::temporary_buffer
//! workspace, the plan form, fence.
//! @throws loom::error(invalid_argument) for bad offsets or options, and as forward above.
template <backend B, memory_space DocSpace = host_memory, class Gating, precision_policy P, memory_space Space>
void forward(const B& b, const segments<DocSpace>& docs, const Gating& gating, const operands<P, Space>& x,
             tensor_view<typename P::storage_type, 3, Space> o,
             tensor_view<typename P::accum_type, 4, Space> final_state = {}, const options& opt = {}) {
  const auto pl = make_plan<P>(b, docs, {x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(
      b, pl.forward_workspace_bytes(), [&](std::span<std::byte> ws) { forward(b, pl, gating, x, o, final_state, ws); });
}

//! The backward pass: given dO [T, H, dv] and optionally d final state [docs, H, dk, dv], writes
//! the gradients of q, k, v, of the log-gates (scalar_gate) and of the initial state. Recomputes
//! the chunk states (no saved activations). Workspace: plan.backward_workspace_bytes(). Allocates
//! nothing; no fence.
//! @throws as forward; loom::error(invalid_argument) when d_log_gate is given for a gating other
//!         than scalar_gate or missing for scalar_gate.
template <backend B, precision_policy P, class Gating, memory_space Space>
void backward(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
              tensor_view<const typename P::storage_type, 3, Space> d_o,
              tensor_view<const typename P::accum_type, 4, Space> d_final_state, const gradients<P, Space>& g,
              std::span<std::byte> workspace) {
  static_assert(std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "linear_attention::backward: operands must live in the backend's memory space");
  detail::run_backward(b, pl, gating, x, d_o, d_final_state, g, workspace);
}

//! Convenience form of backward: make_plan, a temporary workspace, the plan form, fence.
template <backend B, memory_space DocSpace = host_memory, class Gating, precision_policy P, memory_space Space>
void backward(const B& b, const segments<DocSpace>& docs, const Gating& gating, const operands<P, Space>& x,
              tensor_view<const typename P::storage_type, 3, Space> d_o,
              tensor_view<const typename P::accum_type, 4, Space> d_final_state, const gradients<P, Space>& g,
              const options& opt = {}) {
  const auto pl = make_plan<P>(b, docs, {x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(b, pl.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, pl, gating, x, d_o, d_final_state, g, ws);
  });
}

}  // namespace loom::linear_attention
