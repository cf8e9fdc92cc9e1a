#pragma once

//! @file
//! LASP-2 sequence parallelism for chunked linear attention, over any loom::comm::communicator.
//! Rank r holds the contiguous token slice [token_begin, token_begin + T_r) of one packed sequence
//! (slices in rank order tile [0, T); documents may cross slice boundaries; global cu_seqlens).
//!
//! Forward: each rank runs the chunked algorithm on its slice with a zero incoming state, and sends
//! the affine element of its slice, per head (a = product of its gates; M = its end state) and one
//! reset flag (a document starts inside the slice), in ONE all_gather. Rank r folds the elements of
//! ranks < r, X = a_q X + M_q, or X = M_q where q resets (selected, never 0 · X), and its first document's outputs get
//! the incoming state's contribution scale exp(B_t) q_t^T X (B_t: the log-gates from the slice start to t), through the
//! state for the chunks run after the exchange and as an added product for those run before it
//! (docs/linear_attention.md: the schedule, and which precisions use which). Backward mirrors it: one all_gather of
//! (product of gates, d state leaving the slice to the left) and a suffix fold.
//!
//! Communication per rank per pass: one all_gather of H (1 + dk dv) + 1 values of Accum per rank,
//! i.e. each rank sends (H (1 + dk dv) + 1) sizeof(Accum) bytes and receives P times that,
//! independent of T.
//! Collective checks: before any state moves, every rank's checks and its call (cu_seqlens, shapes,
//! chunk, scale, exchange) go through one agreement (comm/agreement.hpp), and the ranks' slices
//! must tile [0, T) in rank order: otherwise every rank throws the same loom::error. The
//! agreement costs one all_gather of comm::agreement_bytes per rank per call.
//! Deterministic: the fold runs in rank order on every rank.

#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/detail/lasp2_impl.hpp>

#include <optional>

namespace loom::linear_attention {

//! How the state exchange is issued.
enum class exchange {
  all_gather,  //!< comm.all_gather after the local output kernel (no wait before the intra work)
  posted,      //!< isend / irecv to every peer, posted before the output kernel, waited after it
};

//! Options of LASP-2: the chunked options plus the exchange.
struct lasp2_options {
  options chunked{};
  linear_attention::exchange exchange = exchange::all_gather;
};

//! Which passes a lasp2_workspace serves. The backward needs the most memory (the chunk adjoints,
//! [chunks of the slice, H, dk, dv]), so a forward-only workspace leaves it out.
enum class lasp2_passes {
  forward,               //!< lasp2_forward only
  forward_and_backward,  //!< lasp2_forward and lasp2_backward
};

//! One rank's LASP-2 plan and workspace: the slice, the chunk plan of the slice and every buffer a
//! call needs (local states, the exchange's send / receive buffers and requests, the fused
//! schedule's scratch, the kernels' workspace), built once from the shapes and reused by every
//! lasp2_forward / lasp2_backward given it (e.g. layer after layer, step after step): such calls
//! allocate nothing. Host memory; holds no reference to the communicator (any communicator of
//! the same size, used on the same rank, will do). Not shared between threads or ranks: one per
//! rank, used by one call at a time. Move-only.
//!
//!   lasp2_workspace<fp32, comm::local> ws(comm, b, cu_seqlens, token_begin, T_r, H, dk, dv, opt);
//!   for (each layer) lasp2_forward(comm, b, ws, gating, x, o, final_state, incoming_state);
template <precision_policy P, comm::communicator C>
class lasp2_workspace {
 public:
  //! Plans rank comm.rank() of comm.size() holding tokens [token_begin, token_begin + tokens) of
  //! the packed sequence `cu_seqlens` (copied), H heads, key / value widths dk, dv, on backend b.
  //! @throws loom::error(invalid_argument) as lasp2_forward's argument checks and make_plan.
  template <backend B>
  lasp2_workspace(const C& comm, const B& b, std::span<const index_t> cu_seqlens, index_t token_begin, index_t tokens,
                  index_t heads, index_t dk, index_t dv, const lasp2_options& opt = {},
                  lasp2_passes passes = lasp2_passes::forward_and_backward)
      : w_(comm.rank(), comm.size(), b, cu_seqlens, token_begin, tokens, heads, dk, dv, opt.chunked,
           opt.exchange == exchange::posted, passes == lasp2_passes::forward_and_backward) {
    static_assert(backend_traits<B>::memory_space::host_accessible, "lasp2_workspace: host backends only");
  }
  int rank() const { return w_.rank; }
  int ranks() const { return w_.ranks; }
  index_t token_begin() const { return w_.begin; }
  index_t tokens() const { return w_.tokens; }
  index_t heads() const { return w_.heads; }
  index_t dk() const { return w_.dk; }
  index_t dv() const { return w_.dv; }
  index_t docs() const { return w_.docs; }
  bool serves_backward() const { return w_.backward; }
  //! The chunk plan of this rank's slice.
  const plan<P>& slice_plan() const { return w_.pl; }

 private:
  friend struct detail::lasp2_access;
  detail::lasp2_work<P, C> w_;
};

namespace detail {
//! What the ranks of a LASP-2 call must agree on; the slice travels as the local numbers.
template <class P, class C>
comm::signature lasp2_signature(const lasp2_work<P, C>& w) {
  return comm::signature{}
      .add("the shapes (heads, dk, dv)", w.heads, w.dk, w.dv)
      .add_range("cu_seqlens", std::span<const index_t>(w.cu))
      .add("the chunk, the scale and the exchange", w.pl.chunk, w.pl.scale, w.posted_exchange)
      .local(static_cast<std::uint64_t>(w.begin), static_cast<std::uint64_t>(w.begin + w.tokens));
}

//! One agreement over `check()` (this rank's checks; returns its workspace's internals), then the
//! slices of the ranks must follow each other: rank q + 1 begins where rank q ends.
template <class C, class Check>
void lasp2_agree(C& comm, std::string_view call, Check&& check) {
  const auto slices = comm::agree(comm, call, [&] { return lasp2_signature(check()); });
  for (std::size_t q = 1; q < slices.size(); ++q)
    LOOM_EXPECTS(slices[q][0] == slices[q - 1][1], errc::invalid_argument, call,
                 ": the slices must tile the sequence in rank order: rank ", q - 1, " ends at token ", slices[q - 1][1],
                 ", rank ", q, " begins at ", slices[q][0]);
}
}  // namespace detail

//! LASP-2 forward on this rank's slice with a workspace built for it (no allocation). x.q/k/v and
//! o: [T_r, H, d] of the workspace's slice; gating on the slice's tokens; x.initial_state and
//! final_state: the GLOBAL [docs, H, dk, dv] (or empty); incoming_state as below.
//! @throws loom::error(invalid_argument) when comm's size or rank is not the workspace's,
//!         (shape_mismatch) when q, k, v, o or a state does not have the workspace's extents
//!         (the message names the argument and the expected extents); as chunked forward.
template <precision_policy P, comm::communicator C, backend B, class Gating>
void lasp2_forward(C& comm, const B& b, lasp2_workspace<P, C>& ws, const Gating& gating,
                   const operands<P, host_memory>& x, tensor_view<typename P::storage_type, 3, host_memory> o,
                   tensor_view<typename P::accum_type, 4, host_memory> final_state = {},
                   tensor_view<typename P::accum_type, 3, host_memory> incoming_state = {}) {
  static_assert(backend_traits<B>::memory_space::host_accessible, "lasp2_forward: host backends only");
  auto& w = detail::lasp2_access::work(ws);
  detail::lasp2_agree(
      comm, "lasp2_forward", [&]() -> const auto& {
        detail::check_forward_call(comm, w, gating, x, o, final_state, incoming_state);
        return w;
      });
  detail::lasp2_forward_impl<P>(comm, b, w, gating, x, o, final_state, incoming_state);
}

//! LASP-2 backward with a workspace built for this slice with lasp2_passes::forward_and_backward
//! (no allocation); arguments as the form below without cu_seqlens, token_begin and options.
//! @throws loom::error(invalid_argument) for a forward-only workspace or another comm size / rank,
//!         (shape_mismatch) for extents that are not the workspace's; as the form below.
template <precision_policy P, comm::communicator C, backend B, class Gating>
void lasp2_backward(C& comm, const B& b, lasp2_workspace<P, C>& ws, const Gating& gating,
                    const operands<P, host_memory>& x, tensor_view<const typename P::storage_type, 3, host_memory> d_o,
                    tensor_view<const typename P::accum_type, 4, host_memory> d_final_state,
                    tensor_view<const typename P::accum_type, 3, host_memory> incoming_state,
                    const gradients<P, host_memory>& g) {
  static_assert(backend_traits<B>::memory_space::host_accessible, "lasp2_backward: host backends only");
  auto& w = detail::lasp2_access::work(ws);
  detail::lasp2_agree(
      comm, "lasp2_backward", [&]() -> const auto& {
        detail::check_backward_call(comm, w, gating, x, d_o, d_final_state, incoming_state, g);
        return w;
      });
  detail::lasp2_backward_impl<P>(comm, b, w, gating, x, d_o, d_final_state, incoming_state, g);
}

//! LASP-2 forward on this rank's slice. x.q/k/v and o: [T_r, H, d] of the slice; gating as in
//! chunked.hpp on the slice's tokens; x.initial_state and final_state: the GLOBAL [docs, H, dk, dv]
//! (or empty): every rank reads the first, and writes the final state of the documents whose last
//! token it holds (an empty document: the rank whose slice holds its offset, or the last rank).
//! incoming_state [H, dk, dv] (or empty) receives the state entering the slice: save it for
//! lasp2_backward. Host memory spaces; builds a lasp2_workspace for the call (allocates: for
//! repeated calls build one and pass it to the form above).
//! @throws loom::error as chunked forward, and (invalid_argument) for a slice outside [0, T), rank 0
//!         not starting at 0 or the last rank not ending at T; comm errors of the communicator.
//! Communication: one all_gather of H (1 + dk dv) + 1 Accum values per rank, and the agreement.
template <precision_policy P, comm::communicator C, backend B, class Gating>
void lasp2_forward(C& comm, const B& b, const Gating& gating, const operands<P, host_memory>& x,
                   tensor_view<typename P::storage_type, 3, host_memory> o, std::span<const index_t> cu_seqlens,
                   index_t token_begin, tensor_view<typename P::accum_type, 4, host_memory> final_state = {},
                   tensor_view<typename P::accum_type, 3, host_memory> incoming_state = {},
                   const lasp2_options& opt = {}) {
  std::optional<lasp2_workspace<P, C>> ws;
  detail::lasp2_agree(
      comm, "lasp2_forward", [&]() -> const auto& {
        ws.emplace(comm, b, cu_seqlens, token_begin, x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2), opt,
                   lasp2_passes::forward);
        auto& w = detail::lasp2_access::work(*ws);
        detail::check_forward_call(comm, w, gating, x, o, final_state, incoming_state);
        return w;
      });
  detail::lasp2_forward_impl<P>(comm, b, detail::lasp2_access::work(*ws), gating, x, o, final_state, incoming_state);
}

//! LASP-2 backward on this rank's slice. d_o: [T_r, H, dv]; d_final_state: GLOBAL [docs, H, dk, dv]
//! or empty (each rank reads the documents it owns); incoming_state: what lasp2_forward returned
//! on this rank. g.dq/dk/dv/d_log_gate: the slice's; g.d_initial_state: GLOBAL, written for the
//! documents whose first token this rank holds. Builds a lasp2_workspace for the call.
//! Communication: one all_gather of H (1 + dk dv) + 1 Accum values per rank, and the agreement.
template <precision_policy P, comm::communicator C, backend B, class Gating>
void lasp2_backward(C& comm, const B& b, const Gating& gating, const operands<P, host_memory>& x,
                    tensor_view<const typename P::storage_type, 3, host_memory> d_o,
                    std::span<const index_t> cu_seqlens, index_t token_begin,
                    tensor_view<const typename P::accum_type, 4, host_memory> d_final_state,
                    tensor_view<const typename P::accum_type, 3, host_memory> incoming_state,
                    const gradients<P, host_memory>& g, const lasp2_options& opt = {}) {
  std::optional<lasp2_workspace<P, C>> ws;
  detail::lasp2_agree(
      comm, "lasp2_backward", [&]() -> const auto& {
        ws.emplace(comm, b, cu_seqlens, token_begin, x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2), opt,
                   lasp2_passes::forward_and_backward);
        auto& w = detail::lasp2_access::work(*ws);
        detail::check_backward_call(comm, w, gating, x, d_o, d_final_state, incoming_state, g);
        return w;
      });
  detail::lasp2_backward_impl<P>(comm, b, detail::lasp2_access::work(*ws), gating, x, d_o, d_final_state,
                                 incoming_state, g);
}

}  // namespace loom::linear_attention
