#pragma once

//! @file
//! Chunkwise causal linear attention on one device, forward and backward. Per document and head,
//! with state S in R^{dk x dv} (kept in the accumulation type):
//!   S_t = g_t S_{t-1} + k_t v_t^T,   o_t = scale S_t^T q_t,   S_{-1} = initial state (or 0)
//! with g from the gating tag (no_decay, fixed_decay, scalar_gate; see types.hpp). Packed "THD"
//! layout; documents delimited by cu_seqlens, the state reset at each document's start.
//!
//!   auto pl = linear_attention::make_plan<loom::fp32>(backend, cu_seqlens, H, dk, dv, {.chunk = 64});
//!   std::vector<std::byte> ws(pl.forward_workspace_bytes());
//!   linear_attention::forward(backend, pl, no_decay{}, {q, k, v}, o, final_state, ws);
//!
//! Algorithm (three launches of loom::for_each_index): (1) per (chunk, head) the chunk's own state
//! contribution; (2) per (document, head) the sequential pass over the chunk states; (3) per
//! (chunk, head) the output, intra-chunk masked product plus the inter-chunk term. Work:
//! O(T H (C (dk + dv) + dk dv)); workspace O(chunks H dk dv) plus per-lane scratch.
//! Deterministic: for a fixed backend and inputs the bits never change (no atomics; each output
//! element is computed by one fixed loop order, independent of the thread count).

#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/linear_attention/detail/driver.hpp>
#include <loom/linear_attention/types.hpp>

#include <cstddef>
#include <span>

namespace loom::linear_attention {

//! Runs the forward pass with a caller's workspace (at least plan.forward_workspace_bytes(),
//! aligned to alignof(std::max_align_t)). o: [T, H, dv]; final_state: [docs, H, dk, dv] in Accum,
//! or empty. No allocation.
//! @throws loom::error(shape_mismatch) for an operand whose extents do not fit the plan,
//!         loom::error(invalid_argument) for a bad gate value or a too-small workspace.
template <backend B, precision_policy P, class Gating, memory_space Space>
void forward(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
             tensor_view<typename P::storage_type, 3, Space> o,
             tensor_view<typename P::accum_type, 4, Space> final_state, std::span<std::byte> workspace) {
  static_assert(std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "linear_attention::forward: operands must live in the backend's memory space");
  detail::run_forward(b, pl, gating, x, o, final_state, workspace);
}

//! Convenience form: plans and allocates the workspace (host backends; cuda through
//! loom::temporary_buffer). cu_seqlens: host offsets, size docs + 1, from 0 to T, non-decreasing.
//! @throws loom::error(invalid_argument) for bad cu_seqlens or options, and as forward above.
template <precision_policy P, backend B, class Gating, memory_space Space>
void forward(const B& b, const Gating& gating, const operands<P, Space>& x,
             tensor_view<typename P::storage_type, 3, Space> o, std::span<const index_t> cu_seqlens,
             tensor_view<typename P::accum_type, 4, Space> final_state = {}, const options& opt = {}) {
  const auto pl = make_plan<P>(b, cu_seqlens, x.q.extent(1), x.q.extent(2), x.v.extent(2), opt);
  temporary_buffer<B, std::byte> ws(b, static_cast<index_t>(pl.forward_workspace_bytes()));
  forward(b, pl, gating, x, o, final_state, std::span<std::byte>(ws.data(), pl.forward_workspace_bytes()));
  fence(b);
}

//! The backward pass: given dO [T, H, dv] and optionally d final state [docs, H, dk, dv], writes
//! the gradients of q, k, v, of the log-gates (scalar_gate) and of the initial state. Recomputes
//! the chunk states (no saved activations). Workspace: plan.backward_workspace_bytes().
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

//! Convenience form of backward: plans and allocates the workspace.
template <precision_policy P, backend B, class Gating, memory_space Space>
void backward(const B& b, const Gating& gating, const operands<P, Space>& x,
              tensor_view<const typename P::storage_type, 3, Space> d_o, std::span<const index_t> cu_seqlens,
              tensor_view<const typename P::accum_type, 4, Space> d_final_state, const gradients<P, Space>& g,
              const options& opt = {}) {
  const auto pl = make_plan<P>(b, cu_seqlens, x.q.extent(1), x.q.extent(2), x.v.extent(2), opt);
  temporary_buffer<B, std::byte> ws(b, static_cast<index_t>(pl.backward_workspace_bytes()));
  backward(b, pl, gating, x, d_o, d_final_state, g, std::span<std::byte>(ws.data(), pl.backward_workspace_bytes()));
  fence(b);
}

}  // namespace loom::linear_attention
