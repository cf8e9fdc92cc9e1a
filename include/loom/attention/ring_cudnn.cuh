#pragma once

//! @file
//! Ring attention (ring.hpp; pass-KV, pass-Q, all-gather-KV and bidirectional) whose local step is
//! cuDNN's fused attention (cudnn.hpp) instead of loom's tile kernel, on loom::cuda over a
//! stream-ordered communicator (comm::nccl, comm::device_local):
//!
//!   auto rp = loom::attention::ring::make_plan<loom::bf16>(b, comm, loom::attention::cudnn::fused{},
//!                                                         sharding, {heads_q, heads_kv, dim_qk, dim_v}, opts);
//!   // or make_plan<loom::bf16>(b, comm, ring::pass_q{} (or all_gather_kv{}, bidirectional_kv{}),
//!   //                         cudnn::fused{}, sharding, shape, opts)
//!   loom::temporary_buffer<loom::cuda, std::byte> ws(b, std::max(rp.workspace_bytes(),
//!                                                                rp.backward_workspace_bytes()));
//!   loom::attention::ring::forward(b, comm, rp, q, k, v, out, lse, ws.bytes());     allocates nothing
//!   loom::attention::ring::backward(b, comm, rp, q, k, v, out, lse, dout, dq, dk, dv, ws.bytes());
//!
//! The views, results, traffic and agreement are ring::pass_kv's (ring.hpp): K/V travel the ring
//! (P - 1 transfers each way per call, the next block's posted before the current block's
//! compute), dK/dV accumulators travel in the backward and arrive home. What differs is the local
//! step (attention/detail/ring_fused.hpp): make_plan derives from the shard plan, per step, the
//! fused blocks of this rank's queries against the visiting rank's keys (full, causal or windowed
//! as cuDNN's top-left diagonal band, cropped to the rows that see a key; none where nothing is
//! visible) and groups them into ragged batches; each batch is one cuDNN graph, built once per
//! plan (graphs of equal bounds and sizes shared between steps). A call uploads the batches'
//! ragged tables into its workspace and runs, per step, every batch of the step on b.stream:
//! forward, each batch's (out, lse) merged into the running pair in float; backward, each batch's
//! dQ, dK, dV added in float into dQ and the travelling dK/dV accumulators. With pass_q the views,
//! traffic and agreement are ring::pass_q's: step s runs rank (me - s)'s visiting queries against
//! this rank's keys, each step's partial merged into the visitor's slot and sent home by one
//! all_to_allv; in the backward Q, out, lse and dO travel with the visitors' dQ accumulator. With
//! all_gather_kv they are ring::all_gather_kv's (K/V gathered once, padded; dK/dV summed home by
//! one reduce_scatter) and the steps, batches and graphs are pass-KV's. With bidirectional_kv they
//! are ring::bidirectional_kv's (both directions of every link busy; own block, then per step the
//! clockwise and the counter-clockwise block; dK/dV accumulators home after the last step).
//!
//! Needs what attention::cudnn needs (bfloat16 or half storage with float lse; dims multiples of 8
//! up to 256; blocks under 2^31 tokens) and dense q, out, lse, dout ([n, H, D] with strides
//! (H D, D, 1)). make_plan runs its checks and builds the graphs inside the ring's agreement, so a
//! rejection on one rank (cuDNN's reason quoted) is loom::error(unsupported) on every rank; a
//! device where cuDNN has no backward for a graph gets the error from backward, before anything is
//! sent. Results: each step's partial out and dQ / dK / dV are rounded to the storage type by
//! cuDNN before loom merges or adds them in float; cuDNN's order of summation, not loom's (dQ need
//! not repeat bit for bit). Compile with nvcc; link loom::cudnn.
//!
//! Hybrid Ulysses x ring with this ring inside: hybrid::make_plan<P>(b, comm, cudnn::fused{},
//! ring_sharding, shape, opts) (below); it also needs each Ulysses rank's query heads to be one
//! GQA block, so that the head shards the ring reads are dense.
//!
//! The planner's pick through cuDNN: sequence_parallel::make_plan<P>(b, comm, cudnn::fused{},
//! documents, shape, opts) (below) picks as sequence_parallel::make_plan and makes the pick's plan
//! over cuDNN (the ring variants and the hybrid above, Ulysses from ulysses_cudnn.cuh);
//! sequence_parallel::forward / backward run it.
//!
//! The runner is tested on the CPU with a reference engine that reads the same tables
//! (tests/attention/ring_test.hpp, serial and the device stand-in); the cuDNN form has a [gpu]
//! case in tests/attention/distributed_cudnn_test.cu for .ci/gpu. Not run: the last GPU run,
//! docs/gpu.md: NVIDIA H200, 2026-11-28, commit 29324c3, predates it.

#include <loom/attention/cudnn.hpp>
#include <loom/attention/detail/ring_fused.hpp>
#include <loom/attention/hybrid.hpp>
#include <loom/attention/planner.hpp>
#include <loom/attention/ulysses_cudnn.cuh>
#include <loom/backend/cuda.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace loom::attention::cudnn {

namespace detail {

//! The fused ring engine on cuDNN: one handle, the graphs of every batch of the program (from one
//! cache), the batch sizes; the tables come with each call (in its workspace).
class ring_engine {
 public:
  [[nodiscard]] std::size_t workspace_bytes(fused_pass pass) const noexcept {
    return pass == fused_pass::forward ? fwd_ : bwd_;
  }
  //! The checks a call makes before it sends anything: the plan's device current, and for the
  //! backward, a backward cuDNN can run.
  void check_call(fused_pass pass, std::string_view call) const {
    check_device(st_, call);
    LOOM_EXPECTS(pass == fused_pass::forward || st_.backward_unsupported.empty(), errc::unsupported, call,
                 ": cuDNN has no backward for this plan on this device (", st_.backward_unsupported,
                 "); ring::backward on a loom-kernel plan runs it");
  }
  template <class T, class Acc>
  void forward(const loom::cuda& b, std::size_t i, const std::int64_t* tables, const T* q, const T* k, const T* v, T* o,
               Acc* lse, std::span<std::byte> ws) {
    static_assert(std::is_same_v<Acc, float>, "ring over cuDNN: lse is float");
    run(b, i, tables, fused_pass::forward,
        {{u_q, ptr(q)}, {u_k, ptr(k)}, {u_v, ptr(v)}, {u_o, ptr(o)}, {u_lse, ptr(lse)}}, ws);
  }
  template <class T, class Acc>
  void backward(const loom::cuda& b, std::size_t i, const std::int64_t* tables, const T* q, const T* k, const T* v,
                const T* o, const Acc* lse, const T* dout, T* dq, T* dk, T* dv, std::span<std::byte> ws) {
    static_assert(std::is_same_v<Acc, float>, "ring over cuDNN: lse is float");
    run(b, i, tables, fused_pass::backward,
        {{u_q, ptr(q)},
         {u_k, ptr(k)},
         {u_v, ptr(v)},
         {u_o, ptr(o)},
         {u_lse, ptr(lse)},
         {u_do, ptr(dout)},
         {u_dq, ptr(dq)},
         {u_dk, ptr(dk)},
         {u_dv, ptr(dv)}},
        ws);
  }

  //! Builds the graphs of `prog` (queries: `rows_q` tokens; key blocks: at most `rows_k`).
  template <precision_policy P>
  void build(const attention::detail::fused_program& prog, const head_shape& s, const options& opt, index_t rows_q,
             index_t rows_k, std::string_view call) {
    if (prog.batches.empty()) return;
    st_.device = loom::detail::current_cuda_device();
    check_cudnn(cudnnCreate(&st_.handle), call, "cudnnCreate");
    std::vector<std::vector<fused_block>> groups;
    for (const auto& fb : prog.batches) {
      groups.push_back(fb.blocks);
      entries_.push_back(static_cast<index_t>(fb.blocks.size()));
    }
    std::tie(fwd_, bwd_) = add_batches(st_, groups, s, attention::detail::scale_of<double>(opt, s.dim_qk),
                                       element_of<typename P::storage_type>(), rows_q, rows_k, call);
  }

 private:
  template <class T>
  static void* ptr(const T* p) {
    return const_cast<void*>(static_cast<const void*>(p));
  }
  void run(const loom::cuda& b, std::size_t i, const std::int64_t* tables, fused_pass pass,
           std::initializer_list<std::pair<std::int64_t, void*>> views, std::span<std::byte> ws) {
    constexpr std::string_view call = "ring over cuDNN";
    const attention::detail::fused_tables layout{entries_[i], {}};
    auto* t = const_cast<std::int64_t*>(tables);
    std::lock_guard lock(st_.enqueue);
    check_cudnn(cudnnSetStream(st_.handle, b.stream), call, "cudnnSetStream");
    batch& bt = st_.batches[i];
    for (int w = 0; w < 5; ++w) bt.pack.at(u_rq + w) = t + layout.ragged(w);
    bt.pack.at(u_len_q) = t + layout.lengths(0);
    bt.pack.at(u_len_k) = t + layout.lengths(1);
    run_batch(st_, bt, pass, views, ws, call);
  }

  state st_;
  std::vector<index_t> entries_;
  std::size_t fwd_ = 0, bwd_ = 0;
};

}  // namespace detail

}  // namespace loom::attention::cudnn

namespace loom::attention::ring {

//! Plans ring attention of variant V (any of ring.hpp's four) whose local step is cuDNN's (see
//! the file comment). Collective over comm: one agreement (the ring's, naming the variant and the
//! local step), with the cuDNN checks and graph builds inside it. @throws loom::error on every
//! rank: as ring::make_plan; (unsupported) dims, precision or a configuration cuDNN does not take
//! (its reason quoted); (internal) a failing CUDA or cuDNN call.
template <precision_policy P = bf16, comm::communicator C, variant V>
fused_plan<loom::cuda, P, cudnn::detail::ring_engine, V> make_plan(const loom::cuda& b, C& comm, V, cudnn::fused,
                                                                   const shard::plan& sharding, const shape& s,
                                                                   const options& opt = {}) {
  static_assert(cudnn::detail::storable<typename P::storage_type>,
                "ring over cuDNN: the fused kernels take bfloat16 or half storage (loom::bf16, loom::fp16)");
  constexpr std::string_view call = "ring::make_plan (cuDNN)";
  constexpr int cudnn_local_step = 1;
  return detail::make_fused_plan<P, V>(
      b, comm, sharding, s, opt, call, cudnn_local_step, [&](const attention::detail::fused_program& prog, index_t n) {
        (void)cudnn::detail::check_arguments({n, s.heads_q, s.heads_kv, s.dim_qk, s.dim_v}, opt, call);
        index_t most = 0;
        for (int r = 0; r < sharding.ranks(); ++r) most = std::max(most, sharding.rank(r).tokens);
        // The query rows a batch may address: this rank's, or any visitor's where queries travel;
        // the key rows: any rank's block, or this rank's own.
        const bool q_travels = std::is_same_v<V, pass_q>;
        auto e = std::make_shared<cudnn::detail::ring_engine>();
        e->build<P>(prog, s, opt, q_travels ? most : n, q_travels ? n : most, call);
        return e;
      });
}

//! Plans ring pass-KV attention whose local step is cuDNN's (the tagged form above).
template <precision_policy P = bf16, comm::communicator C>
fused_plan<loom::cuda, P, cudnn::detail::ring_engine> make_plan(const loom::cuda& b, C& comm, cudnn::fused f,
                                                                const shard::plan& sharding, const shape& s,
                                                                const options& opt = {}) {
  return make_plan<P>(b, comm, pass_kv{}, f, sharding, s, opt);
}

}  // namespace loom::attention::ring

namespace loom::attention::hybrid {

//! Plans hybrid Ulysses x ring attention (hybrid.hpp) whose inner ring runs its steps through
//! cuDNN (ring::make_plan with cudnn::fused, above). Needs, besides what the ring over cuDNN
//! needs, every Ulysses rank's query heads to be one GQA block (dense head shards, as
//! ulysses_cudnn.cuh): checked for every rank inside the hybrid's agreement. Collective over comm
//! as hybrid::make_plan (its agreement, the group splits, one ring agreement per head segment
//! over the ring group, with the graphs built inside it).
//! @throws loom::error on every rank: as hybrid::make_plan; (unsupported) a head split that is
//! not one GQA block per Ulysses rank; as ring::make_plan with cudnn::fused on every rank of a ring
//! group.
template <precision_policy P = bf16, comm::communicator C>
plan<loom::cuda, C, P, ring::fused_plan<loom::cuda, P, cudnn::detail::ring_engine>> make_plan(
    const loom::cuda& b, C& comm, cudnn::fused, const shard::plan& ring_sharding, const head_shape& s,
    const options& opt = {}) {
  constexpr std::string_view call = "hybrid::make_plan (cuDNN)";
  using inner = ring::fused_plan<loom::cuda, P, cudnn::detail::ring_engine>;
  return detail::hybrid_maker::make<inner, P>(
      b, comm, ring_sharding, s, opt, call, [&](const grid& g) { detail::require_dense_heads(s, g.ulysses, call); },
      [&](C& ring_comm, const shard::plan& sp, const head_shape& hs) {
        return ring::make_plan<P>(b, ring_comm, cudnn::fused{}, sp, hs, opt);
      });
}

}  // namespace loom::attention::hybrid

namespace loom::sequence_parallel {

//! make_plan's steps (planner.hpp's loom_kernel) over cuDNN's fused attention: the ring variants
//! and the hybrid's inner ring as ring::make_plan with cudnn::fused, Ulysses as ulysses_cudnn.cuh's.
struct cudnn_steps {
  template <precision_policy P, class B, comm::communicator C, class V>
  auto ring(const B& b, C& comm, V v, const shard::plan& sh, const attention::head_shape& s,
            const attention::options& o) const {
    return attention::ring::make_plan<P>(b, comm, v, attention::cudnn::fused{}, sh, s, o);
  }
  template <precision_policy P, class B, comm::communicator C>
  auto ulysses(const B& b, C& comm, const shard::plan& sh, const attention::head_shape& s,
               const attention::options& o) const {
    return attention::ulysses::make_plan<P>(b, comm, attention::cudnn::fused{}, sh, s, o);
  }
  template <precision_policy P, class B, comm::communicator C>
  auto hybrid(const B& b, C& comm, const shard::plan& sh, const attention::head_shape& s,
              const attention::options& o) const {
    return attention::hybrid::make_plan<P>(b, comm, attention::cudnn::fused{}, sh, s, o);
  }
};

//! Picks a strategy as make_plan (planner.hpp) and plans it with cuDNN's fused attention as every
//! step's local kernel (see the file comment); sequence_parallel::forward / backward run it.
//! Collective over comm: make_plan's agreement, then the pick's own.
//! @throws loom::error on every rank: as make_plan; as the pick's make_plan with cudnn::fused
//! (unsupported: what cuDNN does not take, a head split that is not one GQA block per rank).
template <precision_policy P = bf16, comm::communicator C>
plan<loom::cuda, C, P, cudnn_steps> make_plan(const loom::cuda& b, C& comm, attention::cudnn::fused,
                                              const loom::segments<>& documents, const attention::head_shape& s,
                                              const options& opt = {}) {
  return detail::make_plan_with<P>(b, comm, cudnn_steps{}, documents, s, opt, "sequence_parallel::make_plan (cuDNN)");
}

}  // namespace loom::sequence_parallel
