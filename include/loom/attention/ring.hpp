#pragma once

//! @file
//! Exact attention over the ranks of a communicator, for a sequence sharded by a shard::plan
//! (contiguous, zigzag or per_document; see loom/shard/plan.hpp).
//!
//!   auto plan = ring::make_plan(b, comm, sharding, {heads_q, heads_kv, dim_qk, dim_v}, opts);   pass-KV
//!   auto plan = ring::make_plan<loom::bf16>(b, comm, ring::pass_q{}, sharding, shape, opts);    a variant
//!   loom::workspace_buffer ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
//!   ring::forward(b, comm, plan, q, k, v, out, lse, ws.span());                  allocates nothing
//!   ring::backward(b, comm, plan, q, k, v, out, lse, dout, dq, dk, dv, ws.span());
//!   ring::forward(b, comm, ring::pass_kv{}, sharding, q, k, v, out, lse, opts);  convenience
//!
//! Each rank passes its own rows: q [n_r, Hq, Dqk], k [n_r, Hkv, Dqk], v [n_r, Hkv, Dv],
//! out [n_r, Hq, Dv], lse [n_r, Hq], with n_r = sharding.rank(r).tokens in the plan's local order.
//! Masks (causal, window) use the global (document, position) of every token, taken from the
//! shard plan, so every variant gives the local kernel's answer.
//!
//! Variants: a tag given to make_plan right after the communicator (none: pass_kv), held by the
//! plan's type; what one rank receives (b = bytes of one storage element, n = tokens per rank,
//! A = bytes of the accumulation type):
//!   ring::pass_kv          K/V travel the ring, P - 1 steps; the next block's transfer is posted
//!                          before the current block's compute (overlap). Forward: (P - 1) n Hkv
//!                          (Dqk + Dv) b. Backward: the same K/V again plus the dK/dV
//!                          accumulators, P n Hkv (Dqk + Dv) A.
//!   ring::pass_q           Q travels, K/V stay; the P partial (out, lse) come back with one
//!                          all_to_allv and are merged in rank order (Meta's pass-Q, for a large KV
//!                          cache). Forward: (P - 1) n Hq Dqk b + (P - 1) n Hq (Dv + 1) A.
//!   ring::all_gather_kv    K/V gathered once (Llama-3 style; any mask), padded to the largest
//!                          shard: (P - 1) max_n Hkv (Dqk + Dv) b; the backward reduce-scatters dK/dV.
//!   ring::bidirectional_kv K/V both ways round the ring at once (bidirectional.hpp), in the
//!                          forward and, with their dK/dV accumulators, in the backward.
//!
//! The plan: make_plan checks the shape and options, derives every rank's token coordinates and
//! the transfer sizes from the shard plan, lays out the workspace, and runs the cross-rank
//! agreement once (comm::agree, one all_gather: same sharding, shape, options, precision and
//! variant on every rank; a rejection or a disagreement is the same loom::error on every rank).
//! Calls add no agreement. The plan belongs to the rank that made it; it is immutable, copies
//! share one state, and several threads may use it at once (each call with its own workspace,
//! outputs and communicator). Per call, the views are checked against the plan on this rank
//! only: a mismatch throws a loom::error there, and the other ranks, waiting in a transfer, get
//! the communicator's timeout error. The convenience forms check the views inside the agreement
//! instead, so a mismatch there is every rank's error.
//!
//! Precision: the plan is templated on a precision policy P (loom::fp32 by default, as make_plan
//! sees no element types): q, k, v, out, dout, dq, dk, dv hold P::storage_type and lse
//! P::accum_type. The convenience forms deduce P from q.
//!
//! Workspace: plan.workspace_bytes() (forward) and plan.backward_workspace_bytes(), host memory,
//! aligned to loom::workspace_alignment: every block that travels or accumulates (sized for the
//! largest shard) and the local kernel's workspace for the largest block. Results are bitwise
//! reproducible for a fixed backend and P. Host memory only (the views host-accessible, the
//! communicator local or MPI); calls are complete on return.

#include <loom/attention/detail/ring_common.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/precision.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>

namespace loom::attention::ring {

//! One of the four variant tags.
template <class V>
concept variant = std::is_same_v<V, pass_kv> || std::is_same_v<V, pass_q> || std::is_same_v<V, all_gather_kv> ||
    std::is_same_v<V, bidirectional_kv>;

//! Heads and head dims (the tokens come from the shard plan).
using shape = head_shape;

namespace detail {
using namespace loom::attention::detail;

template <class V>
constexpr std::string_view name_of() {
  if constexpr (std::is_same_v<V, pass_kv>)
    return "pass_kv";
  else if constexpr (std::is_same_v<V, pass_q>)
    return "pass_q";
  else if constexpr (std::is_same_v<V, all_gather_kv>)
    return "all_gather_kv";
  else
    return "bidirectional_kv";
}
template <class V>
constexpr int id_of() {
  return std::is_same_v<V, pass_kv> ? 0 : std::is_same_v<V, pass_q> ? 1 : std::is_same_v<V, all_gather_kv> ? 2 : 3;
}

}  // namespace detail

template <class V, class B, precision_policy P>
class plan;

namespace detail {
template <class P, class V, class B, comm::communicator C, class Local>
plan<V, B, P> make_plan_checked(const B& b, C& comm, const shard::plan& sharding, const shape& s, const options& opt,
                                std::string_view call, Local&& local_checks, int local_kind = 0);
}

//! A ring attention plan of one rank for variant V (see the file comment). Make it with
//! ring::make_plan. Immutable; copies share one state; may be shared between threads for reading.
template <class V, class B, precision_policy P = fp32>
class plan : public precision_types<P> {
 public:
  //! An empty plan (make one with make_plan).
  plan() = default;
  using variant_type = V;

  [[nodiscard]] int ranks() const noexcept { return s_->ranks; }
  //! The rank this plan was made on.
  [[nodiscard]] int rank() const noexcept { return s_->me; }
  [[nodiscard]] const shard::plan& sharding() const noexcept { return s_->sharding; }
  [[nodiscard]] const shape& dims() const noexcept { return s_->dims; }
  [[nodiscard]] const options& opts() const noexcept { return s_->opt; }
  //! Tokens this rank holds.
  [[nodiscard]] index_t tokens() const noexcept { return s_->mine; }
  //! Workspace bytes of forward and of backward on this rank.
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return s_->forward_bytes; }
  [[nodiscard]] std::size_t backward_workspace_bytes() const noexcept { return s_->backward_bytes; }
  //! The derived state (for loom's own callers).
  [[nodiscard]] const detail::ring_state& state() const noexcept { return *s_; }

 private:
  explicit plan(std::shared_ptr<const detail::ring_state> s) : s_(std::move(s)) {}
  std::shared_ptr<const detail::ring_state> s_;

  template <class P2, class V2, class B2, comm::communicator C, class Local>
  friend plan<V2, B2, P2> detail::make_plan_checked(const B2&, C&, const shard::plan&, const shape&, const options&,
                                                    std::string_view, Local&&, int);
};

namespace detail {
template <class P, class V, class B, comm::communicator C, class Local>
plan<V, B, P> make_plan_checked(const B& b, C& comm, const shard::plan& sharding, const shape& s, const options& opt,
                                std::string_view call, Local&& local_checks, int local_kind) {
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  static_assert(comm::moves<C, typename backend_traits<B>::memory_space>,
                "ring attention: the communicator cannot move buffers of the backend's memory space (a host "
                "communicator needs host-accessible memory; device memory needs a stream-ordered communicator)");
  std::shared_ptr<ring_state> st;
  comm::agree(comm, call, [&] {
    LOOM_EXPECTS(sharding.ranks() == comm.size(), errc::invalid_argument, call, ": the plan is for ", sharding.ranks(),
                 " ranks but the communicator has ", comm.size());
    const index_t n = sharding.rank(comm.rank()).tokens;
    (void)check_problem({n, s.heads_q, s.heads_kv, s.dim_qk, s.dim_v}, opt, call);
    local_checks(n);
    st = std::make_shared<ring_state>(sharding, s, opt, comm.size(), comm.rank());
    st->cap = slot_cap(b);
    runner<V>::template size<T, Acc>(*st);
    return attention_signature<T, Acc>(digest_of(sharding), s, opt)
        .add("the ring variant", id_of<V>())
        .add("the local step (0: loom's kernel)", local_kind);
  });
  return plan<V, B, P>(std::move(st));
}
}  // namespace detail

//! Plans ring attention of variant V on this rank for the rows `sharding` gives every rank (the
//! same shard plan on every rank), heads and dims `s`, masks and scale `opt`. Collective over
//! comm: one agreement (one all_gather of comm::agreement_bytes per rank).
//! @throws loom::error(invalid_argument) on every rank: heads < 1, dims < 1, heads_q not a
//! multiple of heads_kv, bad options (those of attention::make_plan), a sharding for another
//! number of ranks, or ranks disagreeing on the sharding, shape, options, precision or variant.
template <precision_policy P = fp32, class B, comm::communicator C, variant V>
plan<V, B, P> make_plan(const B& b, C& comm, V, const shard::plan& sharding, const shape& s, const options& opt = {}) {
  return detail::make_plan_checked<P, V>(b, comm, sharding, s, opt, "ring::make_plan", [](index_t) {});
}

//! Plans pass-KV ring attention (see the tagged form).
template <precision_policy P = fp32, class B, comm::communicator C>
plan<pass_kv, B, P> make_plan(const B& b, C& comm, const shard::plan& sharding, const shape& s,
                              const options& opt = {}) {
  return make_plan<P>(b, comm, pass_kv{}, sharding, s, opt);
}

//! Forward on a plan: out and lse of this rank's queries over every rank's keys. Allocates
//! nothing. `workspace`: plan.workspace_bytes() bytes, aligned. Over a host communicator the call
//! is complete on return; over a stream-ordered one (device memory) it returns with its kernels
//! and transfers queued, and reads the plan's host tables while they run: keep the plan, the
//! views and the workspace alive until the stream has finished (fence, or a later event).
//! @throws loom::error on this rank only: (shape_mismatch) views not of the plan's extents;
//! (invalid_argument) a short or misaligned workspace, a communicator of another rank or size.
template <class B, class V, precision_policy P, comm::communicator C, class Q, class K, class Vv, class O, class L>
void forward(const B& b, C& comm, const plan<V, B, P>& rp, Q q, K k, Vv v, O out, L lse,
             std::span<std::byte> workspace) {
  constexpr std::string_view call = "ring::forward";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  const auto& st = rp.state();
  detail::check_ring_call<B, T, Acc>(comm, st, q, k, v, out, lse, call);
  check_workspace(workspace, rp.workspace_bytes(), call);
  detail::runner<V>::template forward<T, Acc>(b, comm, st, q, k, v, out, lse, workspace);
}

//! Backward on a plan: dq, dk, dv of this rank's rows (overwritten), given the forward's out and
//! lse and dout. Allocates nothing; `workspace`: plan.backward_workspace_bytes(). Errors as forward.
template <class B, class V, precision_policy P, comm::communicator C, class Q, class K, class Vv, class O, class L,
          class DO, class DQ, class DK, class DV>
void backward(const B& b, C& comm, const plan<V, B, P>& rp, Q q, K k, Vv v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              std::span<std::byte> workspace) {
  constexpr std::string_view call = "ring::backward";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  const auto& st = rp.state();
  detail::check_ring_call<B, T, Acc>(comm, st, q, k, v, out, lse, call);
  detail::check_rank_gradients<T, true>(st.dims, st.mine, dout, dq, dk, dv, call);
  check_workspace(workspace, rp.backward_workspace_bytes(), call, "plan.backward_workspace_bytes()");
  detail::runner<V>::template backward<T, Acc>(b, comm, st, q, k, v, out, lse, dout, dq, dk, dv, workspace);
}

namespace detail {
//! The convenience forms' plan: precision from q, shape from the views, the views' checks inside
//! the agreement (a mismatch on one rank is every rank's error).
template <class V, class B, comm::communicator C, class Q, class K, class Vv, class O, class L, class More>
auto convenience_plan(const B& b, C& comm, const shard::plan& sharding, const Q& q, const K& k, const Vv& v,
                      const O& out, const L& lse, const options& opt, std::string_view call, More&& more) {
  using P = default_precision<std::remove_cv_t<typename Q::value_type>>;
  const shape s{q.extent(1), k.extent(1), q.extent(2), v.extent(2)};
  return make_plan_checked<P, V>(b, comm, sharding, s, opt, call, [&](index_t n) {
    LOOM_EXPECTS(q.extent(0) == n, errc::shape_mismatch, call, ": q holds ", q.extent(0),
                 " tokens but the plan gives rank ", comm.rank(), " ", n);
    LOOM_EXPECTS(k.extent(0) == n && v.extent(0) == n, errc::shape_mismatch, call, ": k and v hold ", k.extent(0),
                 " and ", v.extent(0), " tokens but the plan gives rank ", comm.rank(), " ", n);
    check_rank_views<typename P::storage_type, typename P::accum_type, true>(s, n, q, k, v, out, lse, call);
    more(s, n);
  });
}
template <class V>
constexpr auto forward_name() {
  if constexpr (std::is_same_v<V, pass_kv>)
    return "ring::forward(pass_kv)";
  else if constexpr (std::is_same_v<V, pass_q>)
    return "ring::forward(pass_q)";
  else if constexpr (std::is_same_v<V, all_gather_kv>)
    return "ring::forward(all_gather_kv)";
  else
    return "ring::forward(bidirectional_kv)";
}
template <class V>
constexpr auto backward_name() {
  if constexpr (std::is_same_v<V, pass_kv>)
    return "ring::backward(pass_kv)";
  else if constexpr (std::is_same_v<V, pass_q>)
    return "ring::backward(pass_q)";
  else if constexpr (std::is_same_v<V, all_gather_kv>)
    return "ring::backward(all_gather_kv)";
  else
    return "ring::backward(bidirectional_kv)";
}
}  // namespace detail

//! Convenience forward: make_plan (precision from q; the views checked in the agreement), a
//! temporary workspace, the plan form. One agreement per call.
template <class B, comm::communicator C, variant V, class Q, class K, class Vv, class O, class L>
void forward(const B& b, C& comm, V, const shard::plan& sharding, Q q, K k, Vv v, O out, L lse,
             const options& opt = {}) {
  const auto rp = detail::convenience_plan<V>(b, comm, sharding, q, k, v, out, lse, opt, detail::forward_name<V>(),
                                              [](const shape&, index_t) {});
  loom::detail::with_temporary_workspace(b, rp.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, comm, rp, q, k, v, out, lse, ws); });
}

//! Convenience backward (as the convenience forward).
template <class B, comm::communicator C, variant V, class Q, class K, class Vv, class O, class L, class DO, class DQ,
          class DK, class DV>
void backward(const B& b, C& comm, V, const shard::plan& sharding, Q q, K k, Vv v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, const options& opt = {}) {
  constexpr std::string_view call = detail::backward_name<V>();
  const auto rp =
      detail::convenience_plan<V>(b, comm, sharding, q, k, v, out, lse, opt, call, [&](const shape& s, index_t n) {
        detail::check_rank_gradients<std::remove_cv_t<typename Q::value_type>, true>(s, n, dout, dq, dk, dv, call);
      });
  loom::detail::with_temporary_workspace(b, rp.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, comm, rp, q, k, v, out, lse, dout, dq, dk, dv, ws);
  });
}

}  // namespace loom::attention::ring

// The variants' runners.
#include <loom/attention/detail/ring_variants.hpp>
// (kept in this order)
#include <loom/attention/bidirectional.hpp>
