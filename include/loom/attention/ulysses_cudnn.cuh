#pragma once

//! @file
//! Ulysses sequence parallel attention (ulysses.hpp) whose local step is cuDNN's fused attention
//! (cudnn.hpp) instead of loom's kernel, on loom::cuda over a stream-ordered communicator
//! (comm::nccl, comm::device_local):
//!
//!   auto up = loom::attention::ulysses::make_plan<loom::bf16>(b, comm, loom::attention::cudnn::fused{},
//!                                                            seq_plan, {heads_q, heads_kv, dim_qk, dim_v}, opts);
//!   loom::temporary_buffer<loom::cuda, std::byte> ws(b, up.workspace_bytes());
//!   loom::attention::ulysses::forward(b, comm, up, q, k, v, out, lse, ws.bytes());    allocates nothing
//!   loom::attention::ulysses::backward(b, comm, up, q, k, v, out, lse, dout, dq, dk, dv, ws.bytes());
//!
//! Everything but the local step is Ulysses' own: the all-to-alls, the head split, the agreement,
//! the workspace (with cuDNN's workspace as the local step's part), the traffic formulas and the
//! checks. After the first all-to-all a rank holds its query heads (and the kv heads they read)
//! over the whole sequence in sequence order, so the local step is cuDNN's attention over the
//! sharding's documents (shard::plan::segments()): one attention::cudnn plan, built at make_plan
//! with its graphs. Compile with nvcc (the exchange runs loom kernels); link loom::cudnn.
//!
//! Needs what attention::cudnn needs (bfloat16 or half storage with float lse, dims multiples of 8
//! up to 256) and each rank's query heads to be one GQA block: whole groups of heads_q / heads_kv
//! query heads, or part of a single group (true when the number of ranks divides heads_kv, or when
//! each rank's share heads_q / ranks divides heads_q / heads_kv), so that the head shards are
//! dense [T, h, d] tensors. Otherwise make_plan throws loom::error(unsupported) on every rank,
//! naming the rank and its heads; the default ulysses::make_plan (loom's kernel) takes any split.
//!
//! Not run (the last GPU run, docs/gpu.md: NVIDIA H200, 2026-11-28, commit 29324c3, predates it);
//! tests/attention/distributed_cudnn_test.cu holds its [gpu] case
//! (against one device's attention::cudnn over the same documents) for .ci/gpu.

#include <loom/attention/cudnn.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/cuda.hpp>

#include <cstddef>
#include <span>
#include <string_view>

namespace loom::attention::cudnn {

//! The local step of a Ulysses plan on cuDNN (found by argument-dependent lookup): the documents
//! are the plan's, so the pipeline's token coordinates are not read.
template <precision_policy P, class Coords, class Q, class K, class V, class O, class L>
void local_forward(const loom::cuda& b, const plan<P>& lp, const Coords&, Q q, K k, V v, O out, L lse,
                   std::span<std::byte> ws) {
  forward(b, lp, q, k, v, out, lse, ws);
}
template <precision_policy P, class Coords, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void local_backward(const loom::cuda& b, const plan<P>& lp, const Coords&, Q q, K k, V v, O out, L lse, DO dout, DQ dq,
                    DK dk, DV dv, std::span<std::byte> ws) {
  backward(b, lp, q, k, v, out, lse, dout, dq, dk, dv, ws);
}

}  // namespace loom::attention::cudnn

namespace loom::attention::ulysses {

//! Plans Ulysses attention whose local step is cuDNN's (see the file comment). Collective over
//! comm: one agreement, as ulysses::make_plan.
//! @throws loom::error on every rank: as ulysses::make_plan and attention::cudnn::make_plan;
//! (unsupported) a rank whose query heads are not one GQA block, cuDNN rejecting the shape.
template <precision_policy P = bf16, comm::communicator C>
plan<loom::cuda, P, cudnn::plan<P>> make_plan(const loom::cuda& b, C& comm, cudnn::fused, const shard::plan& tokens,
                                              const head_shape& s, const options& opt = {}) {
  constexpr std::string_view call = "ulysses::make_plan (cuDNN)";
  return detail::plan_maker::make<cudnn::plan<P>, P>(
      b, comm, tokens, s, opt, call, [&](const auto& pipe, std::size_t i) {
        const std::string why = detail::fused_heads_problem(pipe.heads(), pipe.rank());
        LOOM_EXPECTS(why.empty(), errc::unsupported, call, ": cuDNN's local step needs dense head shards: ", why);
        const auto sh = pipe.segment(i);
        return cudnn::make_plan<P>(b, tokens.segments(),
                                   {tokens.total_tokens(), sh.heads_q, sh.heads_kv, sh.dim_qk, sh.dim_v}, opt);
      });
}

}  // namespace loom::attention::ulysses
