#pragma once

//! @file
//! Ulysses (all-to-all) sequence parallel attention over the ranks of a communicator
//! (DeepSpeed-Ulysses): every rank holds a shard of the sequence, rows in a shard::plan's local
//! order (any plan: contiguous is natural); one all_to_allv turns q, k, v into head shards over the
//! whole sequence, the local kernel runs on them, and one all_to_allv turns out (and lse) back
//! into sequence shards.
//!
//!   auto up = ulysses::make_plan<loom::fp32>(b, comm, seq_plan, {heads_q, heads_kv, dim_qk, dim_v}, opts);
//!   loom::workspace_buffer ws(up.workspace_bytes());                 forward and backward
//!   ulysses::forward(b, comm, up, q, k, v, out, lse, ws.span());     allocates nothing
//!   ulysses::backward(b, comm, up, q, k, v, out, lse, dout, dq, dk, dv, ws.span());
//!   ulysses::forward(b, comm, seq_plan, q, k, v, out, lse, opts);    convenience (plans, allocates)
//!
//! The plan: make_plan checks the shape and options, plans the head split, this rank's head
//! segments and their local-attention plans, and lays out the workspace (the all-to-all buffers,
//! the head shards and the local kernel's workspace), then runs the cross-rank agreement once
//! (comm::agree: same sharding, shape, options and precision on every rank; a rejection on one
//! rank is the same loom::error on every rank). The plan belongs to the rank that made it (its
//! buffers are this rank's) and to communicators of the same size and rank; it is immutable and
//! may be read by several threads at once (each call with its own workspace and outputs).
//! Per call, the views are checked against the plan on this rank only: a mismatch throws a
//! loom::error on that rank, and the other ranks, waiting in the all-to-all, get the
//! communicator's timeout error.
//!
//! Precision: the plan is templated on a precision policy P (loom::fp32 by default, as the plan
//! maker sees no element types): q, k, v, out, dout, dq, dk, dv hold P::storage_type and lse
//! P::accum_type; the workspace size depends on both.
//!
//! Heads: rank j computes query heads [j Hq / P, (j + 1) Hq / P) (uneven when P does not divide Hq)
//! and receives every kv head they read, so with fewer kv heads than ranks (GQA/MQA) a kv head is
//! replicated on each rank that needs it; in the backward their partial dK/dV are summed in the
//! accumulation type, in rank order. Needs P <= Hq (Ulysses' degree limit; beyond it use the
//! hybrid Ulysses x ring, hybrid.hpp).
//!
//! Shapes per rank r (n_r = plan.tokens().rank(r).tokens): q [n_r, Hq, Dqk], k [n_r, Hkv, Dqk],
//! v [n_r, Hkv, Dv], out [n_r, Hq, Dv], lse [n_r, Hq]; the backward's dq, dk, dv as q, k, v.
//!
//! Communication, bytes rank r sends to other ranks (b = sizeof(T), A = sizeof(lse), g = sizeof(G),
//! T = total tokens, hq_j / hkv_j = q / kv heads of rank j, Σ' = sum over j != r):
//!   forward   n_r (Σ' hq_j Dqk + Σ' hkv_j (Dqk + Dv)) b  +  (T - n_r) hq_r (Dv b + A)
//!   backward  n_r (Σ' hq_j (Dqk + 2 Dv) b + Σ' hq_j A + Σ' hkv_j (Dqk + Dv) b)
//!             + (T - n_r) (hq_r Dqk + hkv_r (Dqk + Dv)) g
//! For P | Hq, P | Hkv and P | T this is the blog's 4 N h / P per link: forward
//! (P - 1) / P^2 T (Hq Dqk + Hkv (Dqk + Dv) + Hq Dv) b plus the lse. make_plan adds one
//! agreement (comm/agreement.hpp); calls add none. Work: the local kernel's on T tokens and
//! hq_r heads. Deterministic for a fixed backend and P.
//!
//! Memory: host memory over a host communicator (comm::local, comm::mpi); device memory over a
//! stream-ordered one (comm::standin, comm::nccl): the packing and unpacking are kernels of the
//! backend and each all_to_allv is ordered after them on the communication stream (comm::handoff,
//! comm::handback), so a call enqueues its work and returns without a host synchronisation. On a
//! device the call reads the plan's token table (uploaded into the workspace): the plan must outlive
//! the call's stream work.

#include <loom/attention/detail/ulysses_exchange.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/workspace.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::attention::ulysses {

namespace detail {
//! Why rank j's query heads under split h are not one dense GQA block (empty: they are): whole
//! groups of heads_q / heads_kv heads, or part of one group. A local step that reads dense head
//! shards (cuDNN's) needs it.
inline std::string fused_heads_problem(const attention::detail::head_split& h, int j) {
  const auto segs = attention::detail::segments_of(h, j);
  if (segs.size() <= 1) return {};
  return loom::detail::concat("rank ", j, " computes query heads [", h.q_begin(j), ", ", h.q_end(j), ") of ", h.hq,
                              " over ", h.hkv, " kv heads: ", segs.size(),
                              " GQA blocks, not one (choose ranks that divide the kv heads, or the default "
                              "make_plan)");
}
}  // namespace detail

//! Bytes one rank sends to the other ranks in one call (see the file comment's formulas).
struct traffic {
  std::size_t forward = 0, backward = 0;
};

namespace detail {
using namespace loom::attention::detail;

//! The plan of the local attention of one head segment, over the whole sequence's documents.
template <class B, class P>
using local_plan_t = attention::plan<B, P>;

//! The local step on loom's kernel: the head shard's tokens with their (document, position)
//! coordinates. Another local plan type (attention::cudnn's, ulysses_cudnn.cuh) brings its own
//! local_forward / local_backward, found by argument-dependent lookup.
template <class B, class P, class Coords, class Q, class K, class V, class O, class L>
void local_forward(const B& b, const attention::plan<B, P>& lp, const Coords& c, Q q, K k, V v, O out, L lse,
                   std::span<std::byte> ws) {
  attention::forward(b, lp, q, k, v, c, c, out, lse, ws);
}
template <class B, class P, class Coords, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void local_backward(const B& b, const attention::plan<B, P>& lp, const Coords& c, Q q, K k, V v, O out, L lse, DO dout,
                    DQ dq, DK dk, DV dv, std::span<std::byte> ws) {
  attention::backward(b, lp, q, k, v, c, c, out, lse, dout, dq, dk, dv, ws);
}

//! The checks of make_plan (Ulysses and hybrid): the local kernel's shape and option checks, and
//! Ulysses' degree limit; `ranks` is the exchange group's size.
inline void check_shape(const head_shape& s, const options& opt, int ranks, std::string_view call) {
  (void)check_problem(attention::shape{0, s.heads_q, s.heads_kv, s.dim_qk, s.dim_v}, opt, call);
  LOOM_EXPECTS(ranks <= s.heads_q, errc::invalid_argument, call, ": Ulysses splits the ", s.heads_q,
               " query heads over the ranks, so it needs ranks <= heads_q, got ", ranks,
               " ranks (use hybrid Ulysses x ring)");
}

//! Bytes rank r of an exchange group sends per call (file comment).
inline traffic exchange_bytes(const shard::plan& tokens, const head_split& h, const head_shape& s, int r, std::size_t b,
                              std::size_t a, std::size_t g) {
  const auto n = static_cast<std::size_t>(tokens.rank(r).tokens);
  const auto rest = static_cast<std::size_t>(tokens.total_tokens()) - n;
  const auto dk = static_cast<std::size_t>(s.dim_qk), dv = static_cast<std::size_t>(s.dim_v);
  std::size_t oq = 0, okv = 0;  // heads of the other ranks
  for (int j = 0; j < h.p; ++j)
    if (j != r) {
      oq += static_cast<std::size_t>(h.q_count(j));
      okv += static_cast<std::size_t>(h.kv_count(j));
    }
  const auto hq = static_cast<std::size_t>(h.q_count(r)), hkv = static_cast<std::size_t>(h.kv_count(r));
  traffic t;
  t.forward = n * (oq * dk + okv * (dk + dv)) * b + rest * hq * (dv * b + a);
  t.backward = n * (oq * (dk + 2 * dv) * b + oq * a + okv * (dk + dv) * b) + rest * (hq * dk + hkv * (dk + dv)) * g;
  return t;
}

//! The per-call checks of a view set against a plan's rank: storage types, extents, and q, k, v
//! and out contiguous in their last dimension.
template <class T, class Acc, class Q, class K, class V, class O, class L>
void check_views(const head_shape& s, index_t n, const Q& q, const K& k, const V& v, const O& out, const L& lse,
                 std::string_view call) {
  check_rank_views<T, Acc, false>(s, n, q, k, v, out, lse, call);
  for (auto st : {q.stride(2), k.stride(2), v.stride(2), out.stride(2)})
    LOOM_EXPECTS(st == 1, errc::invalid_argument, call,
                 ": q, k, v and out must be contiguous in their last dimension (stride 1)");
}

}  // namespace detail

template <class B, precision_policy P, class Local>
class plan;

namespace detail {
struct plan_maker;
}  // namespace detail

//! Plans Ulysses attention on this rank for the rows `tokens` gives every rank (the same plan on
//! every rank), heads and dims `s`, masks and scale `opt`. Collective over comm: one agreement.
//! @throws loom::error(invalid_argument) on every rank: heads < 1, dims < 1, heads_q not a
//! multiple of heads_kv, more ranks than query heads, a sharding for another number of ranks,
//! bad options (those of attention::make_plan), or ranks disagreeing on the sharding, shape,
//! options or precision.
template <precision_policy P = fp32, class B, comm::communicator C>
plan<B, P, detail::local_plan_t<B, P>> make_plan(const B& b, C& comm, const shard::plan& tokens, const head_shape& s,
                                                 const options& opt = {});

//! A Ulysses plan of one rank (see the file comment). Make it with ulysses::make_plan. Immutable;
//! copies share one state; several threads may use one plan at once (each call with its own
//! workspace, outputs and communicator). Local: the plan type of the local step (loom's kernel by
//! default; attention::cudnn's with the make_plan of ulysses_cudnn.cuh).
template <class B, precision_policy P = fp32, class Local = detail::local_plan_t<B, P>>
class plan : public precision_types<P> {
 public:
  //! An empty plan (make one with make_plan).
  plan() = default;

  [[nodiscard]] int ranks() const noexcept { return s_->pipe.heads().p; }
  //! The rank this plan was made on.
  [[nodiscard]] int rank() const noexcept { return s_->pipe.rank(); }
  [[nodiscard]] const shard::plan& tokens() const noexcept { return s_->pipe.tokens(); }
  [[nodiscard]] const head_shape& dims() const noexcept { return s_->dims; }
  [[nodiscard]] const options& opts() const noexcept { return s_->opt; }
  [[nodiscard]] const detail::head_split& heads() const noexcept { return s_->pipe.heads(); }
  //! Query heads [first, second) rank r computes.
  [[nodiscard]] std::pair<index_t, index_t> q_heads(int r) const { return {heads().q_begin(r), heads().q_end(r)}; }
  //! kv heads [first, second) rank r receives.
  [[nodiscard]] std::pair<index_t, index_t> kv_heads(int r) const { return {heads().kv_begin(r), heads().kv_end(r)}; }
  //! Workspace of forward and of backward on this rank (one size serves both).
  [[nodiscard]] std::size_t workspace_bytes() const noexcept {
    return std::max(s_->pipe.forward_bytes(), s_->pipe.backward_bytes());
  }
  //! Bytes rank r sends per call, for element sizes b (storage), a (lse), g (gradients).
  [[nodiscard]] traffic bytes_sent(int r, std::size_t b, std::size_t a, std::size_t g) const {
    return detail::exchange_bytes(tokens(), heads(), dims(), r, b, a, g);
  }

  //! The pipeline and the local plan of head segment s (used by forward / backward).
  [[nodiscard]] const detail::head_pipeline<typename P::storage_type, typename P::accum_type>& pipeline()
      const noexcept {
    return s_->pipe;
  }
  [[nodiscard]] const Local& local(std::size_t s) const { return s_->local[s]; }

 private:
  struct state {
    head_shape dims;
    options opt;
    std::vector<Local> local;
    detail::head_pipeline<typename P::storage_type, typename P::accum_type> pipe;
  };
  explicit plan(std::shared_ptr<const state> s) : s_(std::move(s)) {}
  std::shared_ptr<const state> s_;

  friend struct detail::plan_maker;
};

namespace detail {
//! make_plan's body for any local step: make_local(pipeline, segment) plans the local step of one
//! head segment (inside the agreement, so a rejection there is every rank's).
struct plan_maker {
  template <class Local, precision_policy P, class B, comm::communicator C, class MakeLocal>
  static plan<B, P, Local> make(const B&, C& comm, const shard::plan& tokens, const head_shape& s, const options& opt,
                                std::string_view call, MakeLocal&& make_local) {
    using T = typename P::storage_type;
    using Acc = typename P::accum_type;
    using state = typename plan<B, P, Local>::state;
    static_assert(comm::moves<C, typename backend_traits<B>::memory_space>,
                  "Ulysses attention: the communicator cannot move buffers of the backend's memory space (a host "
                  "communicator needs host-accessible memory; device memory needs a stream-ordered communicator)");
    auto st = std::make_shared<state>();
    comm::agree(comm, call, [&] {
      check_shape(s, opt, comm.size(), call);
      LOOM_EXPECTS(tokens.ranks() == comm.size(), errc::invalid_argument, call, ": the sharding is for ",
                   tokens.ranks(), " ranks but the communicator has ", comm.size());
      st->dims = s;
      st->opt = opt;
      st->pipe = head_pipeline<T, Acc>(tokens, {s.heads_q, s.heads_kv, comm.size()}, comm.rank(), s.dim_qk, s.dim_v);
      std::size_t fwd = 0, bwd = 0;
      for (std::size_t i = 0; i < st->pipe.segments().size(); ++i) {
        st->local.push_back(make_local(std::as_const(st->pipe), i));
        fwd = std::max(fwd, st->local.back().workspace_bytes());
        bwd = std::max(bwd, st->local.back().backward_workspace_bytes());
      }
      st->pipe.reserve_inner(fwd, bwd);
      return attention_signature<T, Acc>(attention::detail::digest_of(tokens), s, opt);
    });
    return plan<B, P, Local>(std::move(st));
  }
};
}  // namespace detail

template <precision_policy P, class B, comm::communicator C>
plan<B, P, detail::local_plan_t<B, P>> make_plan(const B& b, C& comm, const shard::plan& tokens, const head_shape& s,
                                                 const options& opt) {
  // The local plans take the token coordinates the pipeline keeps (documents and positions).
  return detail::plan_maker::make<detail::local_plan_t<B, P>, P>(
      b, comm, tokens, s, opt, "ulysses::make_plan", [&](const auto& pipe, std::size_t i) {
        const auto sh = pipe.segment(i);
        return attention::make_plan<P>(
            b, attention::shape{pipe.tokens().total_tokens(), sh.heads_q, sh.heads_kv, sh.dim_qk, sh.dim_v}, opt);
      });
}

//! Ulysses forward on a plan: allocates nothing. `workspace`: at least plan.workspace_bytes()
//! bytes starting on loom::workspace_alignment.
//! @throws loom::error on this rank only: (shape_mismatch) views not of the plan's extents;
//! (invalid_argument) a short or misaligned workspace, a communicator of another rank or size.
template <class B, precision_policy P, class Local, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, const plan<B, P, Local>& up, Q q, K k, V v, O out, L lse,
             std::span<std::byte> workspace) {
  constexpr std::string_view call = "ulysses::forward";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  detail::check_comm(comm, up.ranks(), up.rank(), call);
  detail::check_views<T, Acc>(up.dims(), up.tokens().rank(up.rank()).tokens, q, k, v, out, lse, call);
  check_workspace(workspace, up.workspace_bytes(), call);
  up.pipeline().forward(
      b, comm, q, k, v, out, lse, workspace,
      [&](std::size_t s, const auto& c, auto qs, auto ks, auto vs, auto os, auto ls, std::span<std::byte> ws) {
        using detail::local_forward;  // loom's kernel; other local plans bring their own (ADL)
        local_forward(b, up.local(s), c, qs, ks, vs, os, ls, ws);
      });
}

//! Ulysses backward on a plan: q, k, v, out, lse (the forward's) and dout travel to head shards,
//! the local backward runs, dq, dk, dv travel back (partial dK/dV of replicated kv heads summed)
//! and overwrite dq, dk, dv. Allocates nothing; workspace and errors as forward.
template <class B, precision_policy P, class Local, comm::communicator C, class Q, class K, class V, class O, class L,
          class DO, class DQ, class DK, class DV>
void backward(const B& b, C& comm, const plan<B, P, Local>& up, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, std::span<std::byte> workspace) {
  constexpr std::string_view call = "ulysses::backward";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  detail::check_comm(comm, up.ranks(), up.rank(), call);
  const index_t n = up.tokens().rank(up.rank()).tokens;
  detail::check_views<T, Acc>(up.dims(), n, q, k, v, out, lse, call);
  detail::check_rank_gradients<T, false>(up.dims(), n, dout, dq, dk, dv, call);
  check_workspace(workspace, up.workspace_bytes(), call);
  up.pipeline().backward(b, comm, q, k, v, out, lse, dout, dq, dk, dv, workspace,
                         [&](std::size_t s, const auto& c, auto qs, auto ks, auto vs, auto os, auto ls, auto ds,
                             auto dqs, auto dks, auto dvs, std::span<std::byte> ws) {
                           using detail::local_backward;
                           local_backward(b, up.local(s), c, qs, ks, vs, os, ls, ds, dqs, dks, dvs, ws);
                         });
}

//! Convenience forward: make_plan (precision deduced from q), a temporary workspace, the plan
//! form, fence.
template <class B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, const shard::plan& tokens, Q q, K k, V v, O out, L lse, const options& opt = {}) {
  const auto up = make_plan<default_precision<typename Q::value_type>>(
      b, comm, tokens, {q.extent(1), k.extent(1), q.extent(2), v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(b, up.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, comm, up, q, k, v, out, lse, ws); });
}

//! Convenience backward (as the convenience forward).
template <class B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, const shard::plan& tokens, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              const options& opt = {}) {
  const auto up = make_plan<default_precision<typename Q::value_type>>(
      b, comm, tokens, {q.extent(1), k.extent(1), q.extent(2), v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(b, up.workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, comm, up, q, k, v, out, lse, dout, dq, dk, dv, ws);
  });
}

}  // namespace loom::attention::ulysses
