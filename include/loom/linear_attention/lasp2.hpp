#pragma once

//! @file
//! LASP-2 sequence parallelism for chunked linear attention, over any loom::comm::communicator.
//! Rank r holds the contiguous token slice [token_begin, token_begin + T_r) of one packed sequence
//! (slices in rank order tile [0, T); documents may cross slice boundaries; global cu_seqlens).
//!
//! Forward: each rank runs the chunked algorithm on its slice with a zero incoming state, and sends
//! the affine element of its slice, per head (a = product of its gates, or 0 when a document starts
//! inside the slice; M = its end state), in ONE all_gather. Rank r folds the elements of ranks < r,
//! X = a_q X + M_q, and its first document's outputs get the incoming state's contribution scale
//! exp(B_t) q_t^T X (B_t: the log-gates from the slice start to t), through the state for the chunks
//! run after the exchange and as an added product for those run before it (docs/linear_attention.md:
//! the schedule, and which precisions use which). Backward mirrors it: one
//! all_gather of (product of gates, d state leaving the slice to the left) and a suffix fold.
//!
//! Communication per rank per pass: one all_gather of H (1 + dk dv) values of Accum per rank, i.e.
//! each rank sends H (1 + dk dv) sizeof(Accum) bytes and receives P times that, independent of T.
//! Deterministic: the fold runs in rank order on every rank.

#include <loom/comm/communicator.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/detail/lasp2_impl.hpp>

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

//! LASP-2 forward on this rank's slice. x.q/k/v and o: [T_r, H, d] of the slice; gating as in
//! chunked.hpp on the slice's tokens; x.initial_state and final_state: the GLOBAL [docs, H, dk, dv]
//! (or empty): every rank reads the first, and writes the final state of the documents whose last
//! token it holds (an empty document: the rank whose slice holds its offset, or the last rank).
//! incoming_state [H, dk, dv] (or empty) receives the state entering the slice: save it for
//! lasp2_backward. Host memory spaces; allocates its workspace.
//! @throws loom::error as chunked forward, and (invalid_argument) for a slice outside [0, T), rank 0
//!         not starting at 0 or the last rank not ending at T; comm errors of the communicator.
//! Communication: one all_gather of H (1 + dk dv) Accum values per rank.
template <precision_policy P, comm::communicator C, backend B, class Gating>
void lasp2_forward(C& comm, const B& b, const Gating& gating, const operands<P, host_memory>& x,
                   tensor_view<typename P::storage_type, 3, host_memory> o, std::span<const index_t> cu_seqlens,
                   index_t token_begin, tensor_view<typename P::accum_type, 4, host_memory> final_state = {},
                   tensor_view<typename P::accum_type, 3, host_memory> incoming_state = {},
                   const lasp2_options& opt = {}) {
  static_assert(backend_traits<B>::memory_space::host_accessible, "lasp2_forward: host backends only");
  detail::lasp2_forward_impl<P>(comm, b, gating, x, o, cu_seqlens, token_begin, final_state, incoming_state,
                                opt.chunked, opt.exchange == exchange::posted);
}

//! LASP-2 backward on this rank's slice. d_o: [T_r, H, dv]; d_final_state: GLOBAL [docs, H, dk, dv]
//! or empty (each rank reads the documents it owns); incoming_state: what lasp2_forward returned
//! on this rank. g.dq/dk/dv/d_log_gate: the slice's; g.d_initial_state: GLOBAL, written for the
//! documents whose first token this rank holds.
//! Communication: one all_gather of H (1 + dk dv) Accum values per rank.
template <precision_policy P, comm::communicator C, backend B, class Gating>
void lasp2_backward(C& comm, const B& b, const Gating& gating, const operands<P, host_memory>& x,
                    tensor_view<const typename P::storage_type, 3, host_memory> d_o,
                    std::span<const index_t> cu_seqlens, index_t token_begin,
                    tensor_view<const typename P::accum_type, 4, host_memory> d_final_state,
                    tensor_view<const typename P::accum_type, 3, host_memory> incoming_state,
                    const gradients<P, host_memory>& g, const lasp2_options& opt = {}) {
  static_assert(backend_traits<B>::memory_space::host_accessible, "lasp2_backward: host backends only");
  detail::lasp2_backward_impl<P>(comm, b, gating, x, d_o, cu_seqlens, token_begin, d_final_state, incoming_state, g,
                                 opt.chunked, opt.exchange == exchange::posted);
}

}  // namespace loom::linear_attention
