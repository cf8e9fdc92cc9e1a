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
//! The local step of both passes: loom's chunked kernels, or, for a plan made with a products tag
//! (make_plan(b, comm, linear_attention::cublas::batched{}, ...)), the batched dense products of
//! gemm_engine.hpp (on cuBLAS; the backward's not run on a GPU: docs/gpu.md's H200 run of
//! 2026-11-28, commit 29324c3, predates it), with the same exchanges.
//!
//! Communication per rank per pass: one all_gather of H (1 + dk dv) + 1 values of Accum per rank,
//! i.e. each rank sends (H (1 + dk dv) + 1) sizeof(Accum) bytes and receives P times that,
//! independent of T.
//!
//!   auto plan = lasp2::make_plan(b, comm, docs, token_begin, {.tokens = T_r, .heads = H, .dk = dk, .dv = dv},
//!                                {.chunked = {.chunk = 64}});        // the agreement: once
//!   loom::workspace_buffer ws(plan.workspace_bytes());               // forward_ / backward_workspace_bytes()
//!   for (each layer) {
//!     lasp2::forward(b, comm, plan, gating, x, o, final_state, incoming_state, ws.span());
//!     lasp2::backward(b, comm, plan, gating, x, d_o, d_final_state, incoming_state, g, ws.span());
//!   }
//!
//! Collective checks: make_plan runs every rank's checks of the shapes, documents and options and
//! one agreement (comm/agreement.hpp): the ranks must be given the same documents, shapes, chunk,
//! scale and exchange, and their slices must tile [0, T) in rank order; otherwise every rank
//! throws the same loom::error. The agreement costs one all_gather of comm::agreement_bytes per
//! rank, once per plan. A plan-taking call checks its views against the plan on this rank only,
//! before any communication: a rank whose views do not match throws a loom::error at once, and
//! the other ranks, waiting in the exchange, get the communicator's timeout error. The
//! convenience forms run those view checks inside make_plan's agreement, so there every rank
//! throws the same error.
//! Precision: the plan's (make_plan<P>, default loom::fp32: float accumulation; see plan.hpp);
//! the convenience forms deduce it from the operands.
//! Memory: the operands, states and workspace live in the backend's memory space, one the
//! communicator moves (host memory over comm::local / comm::mpi; device memory over a
//! stream-ordered communicator: comm::nccl, comm::device_local, comm::standin). Off host memory
//! the forward runs the chunk-parallel schedule and the exchange is one all_gather issued on the
//! communication stream when the message is ready (both exchanges alike); the plan-taking calls
//! return with their work queued on the backend's stream (no host synchronisation), the
//! convenience forms fence. The documents are host offsets (the plan's tables are host-side).
//! Deterministic: the fold runs in rank order on every rank; on device memory the bits are those of
//! the host chunk-parallel schedule's (options.chunked.fused = false): the same kernels, in order.

#include <loom/backend/copy.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/detail/lasp2_impl.hpp>
#include <loom/shard/plan.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>

namespace loom::linear_attention::lasp2 {

//! How the state exchange is issued.
enum class exchange {
  all_gather,  //!< comm.all_gather after the local output kernel (no wait before the intra work)
  posted,      //!< isend / irecv to every peer, posted before the output kernel, waited after it
};

//! Options of LASP-2: the chunked options plus the exchange.
struct options {
  linear_attention::options chunked{};
  lasp2::exchange exchange = exchange::all_gather;
};

namespace detail {
struct access;
}  // namespace detail

//! A local engine of batched products for LASP-2's passes: Tag::engine<P> makes one per plan
//! (linear_attention::cublas::batched on cuBLAS; linear_attention::detail::host_products, the
//! reference provider, in loom's CPU tests).
template <class Tag, class P>
concept products_tag = requires {
  typename Tag::template engine<P>;
};

//! One rank's LASP-2 plan: its slice, the chunk plan of the slice, the agreed call and the layout of
//! every buffer a call needs (local states, the exchange's message, receive buffer and requests,
//! the fused schedule's scratch, the kernels' workspace), made once by make_plan and reused by
//! every forward / backward given it (layer after layer, step after step): such calls allocate
//! nothing and repeat no agreement. Immutable; holds no reference to the communicator (any
//! communicator of the same size, used on the same rank, will do). Shareable between threads for
//! reading; each call needs its own workspace. Engine: the local step of both passes, loom's
//! chunked kernels (linear_attention::detail::kernel_step) or an engine of batched products
//! (make_plan with a products tag).
template <precision_policy P = fp32, class Engine = linear_attention::detail::kernel_step>
class plan {
 public:
  using engine_type = Engine;
  int rank() const noexcept { return c_.rank; }
  int ranks() const noexcept { return c_.ranks; }
  index_t token_begin() const noexcept { return c_.begin; }
  index_t tokens() const noexcept { return c_.tokens; }  //!< T_r, the slice's tokens
  index_t docs() const noexcept { return c_.docs; }      //!< documents of the whole sequence
  lasp2::exchange exchange() const noexcept {
    return c_.posted_exchange ? lasp2::exchange::posted : lasp2::exchange::all_gather;
  }
  //! The chunk plan of this rank's slice (precision, heads(), dk(), dv(), chunk(), scale(), ...).
  const linear_attention::plan<P>& slice_plan() const noexcept { return c_.pl; }
  //! Bytes of workspace forward needs.
  std::size_t forward_workspace_bytes() const noexcept { return c_.fwd.bytes; }
  //! Bytes of workspace backward needs.
  std::size_t backward_workspace_bytes() const noexcept { return c_.bwd.bytes; }
  //! Bytes of a workspace that serves both passes.
  std::size_t workspace_bytes() const noexcept { return c_.fwd.bytes > c_.bwd.bytes ? c_.fwd.bytes : c_.bwd.bytes; }
  //! The engine of batched products of both passes (null for loom's kernels).
  const Engine* engine() const noexcept { return e_.get(); }

 private:
  friend struct detail::access;
  linear_attention::detail::lasp2_core<P> c_;
  std::shared_ptr<const Engine> e_;
};

namespace detail {

//! The operands' space must be the backend's, and one the communicator can move.
template <class B, class C, class Space>
constexpr void check_spaces() {
  static_assert(std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "lasp2: the operands must live in the backend's memory space");
  static_assert(comm::moves<C, Space>,
                "lasp2: the communicator cannot move buffers of the backend's memory space (a host communicator "
                "needs host-accessible memory; device memory needs a stream-ordered communicator)");
}

struct access {
  template <class P, class E>
  static const linear_attention::detail::lasp2_core<P>& core(const plan<P, E>& p) noexcept {
    return p.c_;
  }

  //! make_plan with `check(core)` run on this rank inside the agreement (the convenience forms
  //! check their views there); `make_engine(b, slice_plan, call)` makes the passes' engine, also
  //! inside the agreement (a rank whose engine cannot be made fails every rank); `first()` runs
  //! first inside the agreement (a shard plan's runs, before anything derived from them).
  template <class P, class E = linear_attention::detail::kernel_step, class B, class C, class Check,
            class MakeEngine = std::nullptr_t, class First = comm::no_check>
  static plan<P, E> make(const B& b, C& comm, const segments<host_memory>& docs_in, index_t token_begin,
                         const shape& slice, const options& opt, std::string_view call, Check&& check,
                         MakeEngine make_engine = nullptr, const First& first = {}) {
    using Space = typename backend_traits<B>::memory_space;
    check_spaces<B, C, Space>();
    static_assert(alignof(typename C::request) <= workspace_alignment, "lasp2: over-aligned communicator requests");
    plan<P, E> p;
    auto& c = p.c_;
    const auto slices = comm::agree(comm, call, [&] {
      first();
      LOOM_EXPECTS(!docs_in.implicit() || comm.size() == 1, errc::invalid_argument, call,
                   ": docs must hold the global document offsets (at least {0, T}) when there are several ranks");
      const index_t total = docs_in.implicit() ? token_begin + slice.tokens : docs_in[docs_in.count()];
      const segments<host_memory> docs = check_segments(docs_in, total, call);
      LOOM_EXPECTS(opt.chunked.chunk > 0, errc::invalid_argument, call, ": options.chunk must be > 0, got ",
                   opt.chunked.chunk);
      c.rank = comm.rank();
      c.ranks = comm.size();
      c.begin = token_begin;
      c.tokens = slice.tokens;
      c.heads = slice.heads;
      c.dk = slice.dk;
      c.dv = slice.dv;
      c.sz = slice.dk * slice.dv;
      c.docs = docs.count();
      c.posted_exchange = opt.exchange == exchange::posted;
      c.request_bytes = linear_attention::detail::stream_ordered_comm<C, B> ? 0 : sizeof(typename C::request);
      c.cu.resize(static_cast<std::size_t>(c.docs) + 1);
      for (index_t d = 0; d <= c.docs; ++d) c.cu[static_cast<std::size_t>(d)] = docs[d];
      c.s = linear_attention::detail::make_slice(c.cu, token_begin, slice.tokens, c.rank, c.ranks);
      linear_attention::options chunked = opt.chunked;
      if constexpr (!Space::host_accessible) {
        LOOM_EXPECTS(!chunked.fused || !*chunked.fused, errc::invalid_argument, call,
                     ": options.chunked.fused: the fused LASP-2 schedule runs on host memory only; leave it unset "
                     "or false on a backend whose memory is not host-accessible");
        chunked.fused = false;
      }
      c.pl = linear_attention::make_plan<P>(b, segments<host_memory>(std::span<const index_t>(c.s.local_cu)),
                                            {slice.tokens, slice.heads, slice.dk, slice.dv}, chunked);
      if constexpr (!std::is_same_v<E, linear_attention::detail::kernel_step>) {
        p.e_ = make_engine(b, c.pl, call);
        c.engine = true;
        c.engine_bytes = p.e_->workspace_bytes();
        c.engine_backward_bytes = p.e_->backward_workspace_bytes();
      }
      c.make_moves();
      c.fwd = c.make_layout(false);
      c.bwd = c.make_layout(true);
      check(c);
      return comm::signature{}
          .add("the shapes (heads, dk, dv)", c.heads, c.dk, c.dv)
          .add_range("cu_seqlens", std::span<const index_t>(c.cu))
          .add("the chunk, the scale and the exchange", c.pl.chunk(), c.pl.scale(), c.posted_exchange)
          .local(static_cast<std::uint64_t>(c.begin), static_cast<std::uint64_t>(c.begin + c.tokens));
    });
    for (std::size_t q = 1; q < slices.size(); ++q)
      LOOM_EXPECTS(slices[q][0] == slices[q - 1][1], errc::invalid_argument, call,
                   ": the slices must tile the sequence in rank order: rank ", q - 1, " ends at token ",
                   slices[q - 1][1], ", rank ", q, " begins at ", slices[q][0]);
    return p;
  }
};

}  // namespace detail

//! Plans LASP-2 for rank comm.rank() of comm.size() holding tokens [token_begin, token_begin +
//! slice.tokens) of the packed sequence `docs` (GLOBAL offsets, int32 or int64, in host memory or
//! the backend's memory, read once here with a copy and a fence; empty: one document),
//! slice.heads heads, key / value widths slice.dk, slice.dv, on backend b, in precision P
//! (default loom::fp32). Collective: every rank of comm calls it.
//! @throws loom::error on every rank (the same one) when a rank's arguments are invalid
//!         (invalid_argument: offsets, a slice outside [0, T), rank 0 not starting at 0, the last
//!         rank not ending at T, options as linear_attention::make_plan) or the ranks disagree
//!         (documents, shapes, chunk, scale, exchange; slices that do not tile [0, T)).
//! Communication: one agreement (an all_gather of comm::agreement_bytes per rank).
template <precision_policy P = fp32, backend B, comm::communicator C, memory_space DocSpace = host_memory>
plan<P> make_plan(const B& b, C& comm, const segments<DocSpace>& docs, index_t token_begin, const shape& slice,
                  const options& opt = {}) {
  return loom::detail::with_host_segments(b, docs, [&](const segments<host_memory>& h) {
    return detail::access::make<P>(b, comm, h, token_begin, slice, opt, "lasp2::make_plan", [](const auto&) {});
  });
}

//! Plans LASP-2 (as above) from a shard plan whose ranks each hold one run of the sequence, in rank
//! order (shard::contiguous, shard/plan.hpp): this rank's tokens and the documents are the plan's;
//! slice.tokens must be this rank's token count there. Collective.
//! @throws as above, and loom::error(invalid_argument) on every rank for a shard plan of another
//!         number of ranks or one that interleaves them (zigzag, per_document), (shape_mismatch) for
//!         a slice.tokens that is not the plan's.
template <precision_policy P = fp32, backend B, comm::communicator C>
plan<P> make_plan(const B& b, C& comm, const shard::plan& sharding, const shape& slice, const options& opt = {}) {
  constexpr std::string_view call = "lasp2::make_plan";
  const shard::run mine = shard::run_of(sharding, comm.rank());
  shape s = slice;
  s.tokens = mine.tokens;
  return detail::access::make<P>(
      b, comm, sharding.segments(), mine.begin, s, opt, call, [](const auto&) {}, nullptr,
      [&] {
        shard::expect_runs(sharding, comm.size(), call);
        LOOM_EXPECTS(slice.tokens == mine.tokens, errc::shape_mismatch, call,
                     ": slice.tokens must be this rank's tokens in the shard plan, ", mine.tokens, ", got ",
                     slice.tokens);
      });
}

//! Plans LASP-2 (as above) whose forward and backward run their local steps as batched dense
//! products through the engine of Tag (linear_attention::cublas::batched: cuBLAS's strided-batched
//! products on loom::cuda, cublas.cuh): forward, the chunk states before the exchange, document 0's
//! again from the incoming state after it, then the outputs; backward, gemm_backward on the slice
//! before the exchange (gemm_engine.hpp), then the same exchange and correction by the incoming
//! adjoint as with loom's kernels. The local step's part of each workspace is the engine's.
//! The engine is made inside the agreement. @throws as make_plan, and what the engine's make throws.
template <precision_policy P = fp32, backend B, comm::communicator C, class Tag, memory_space DocSpace = host_memory>
requires products_tag<Tag, P> plan<P, typename Tag::template engine<P>> make_plan(const B& b, C& comm, Tag,
                                                                                  const segments<DocSpace>& docs,
                                                                                  index_t token_begin,
                                                                                  const shape& slice,
                                                                                  const options& opt = {}) {
  using E = typename Tag::template engine<P>;
  return loom::detail::with_host_segments(b, docs, [&](const segments<host_memory>& h) {
    return detail::access::make<P, E>(
        b, comm, h, token_begin, slice, opt, "lasp2::make_plan", [](const auto&) {},
        [](const auto& be, const linear_attention::plan<P>& pl, std::string_view call) {
          return E::make(be, pl, call);
        });
  });
}

//! LASP-2 forward on this rank's slice with a caller's workspace (at least
//! plan.forward_workspace_bytes(), aligned to loom::workspace_alignment). x.q/k/v and o: the
//! plan's [T_r, H, d]; gating as in chunked.hpp on the slice's tokens; x.initial_state and
//! final_state: the GLOBAL [docs, H, dk, dv] (or empty): every rank reads the first, and writes the
//! final state of the documents whose last token it holds (an empty document: the rank whose slice
//! holds its offset, or the last rank). incoming_state [H, dk, dv] (or empty) receives the state
//! entering the slice: keep it for backward. Allocates nothing; no agreement.
//! @throws loom::error on this rank only (see the file comment): (invalid_argument) when comm's
//!         size or rank is not the plan's, for a bad gate value or a too-small or misaligned
//!         workspace; (shape_mismatch) when q, k, v, o or a state does not have the plan's extents
//!         (the message names the argument); comm errors of the communicator.
//! Communication: one all_gather (or the same volume posted) of H (1 + dk dv) + 1 Accum values
//! per rank.
template <backend B, comm::communicator C, precision_policy P, class E, class Gating, memory_space Space>
void forward(const B& b, C& comm, const plan<P, E>& pl, const Gating& gating, const operands<P, Space>& x,
             tensor_view<typename P::storage_type, 3, Space> o,
             tensor_view<typename P::accum_type, 4, Space> final_state,
             tensor_view<typename P::accum_type, 3, Space> incoming_state, std::span<std::byte> workspace) {
  detail::check_spaces<B, C, Space>();
  if constexpr (std::is_same_v<E, linear_attention::detail::kernel_step>)
    linear_attention::detail::lasp2_forward_impl<P>(b, comm, detail::access::core(pl), gating, x, o, final_state,
                                                    incoming_state, workspace);
  else
    linear_attention::detail::lasp2_forward_impl<P>(b, comm, detail::access::core(pl), gating, x, o, final_state,
                                                    incoming_state, workspace, pl.engine());
}

//! LASP-2 backward with a caller's workspace (at least plan.backward_workspace_bytes()). d_o:
//! [T_r, H, dv]; d_final_state: GLOBAL [docs, H, dk, dv] or empty (each rank reads the documents it
//! owns); incoming_state: what forward returned on this rank (required when the slice continues a
//! document from an earlier rank). g.dq/dk/dv/d_log_gate: the slice's; g.d_initial_state: GLOBAL,
//! written for the documents whose first token this rank holds. Allocates nothing; no agreement.
//! @throws as forward.
//! Communication: one all_gather of H (1 + dk dv) + 1 Accum values per rank.
template <backend B, comm::communicator C, precision_policy P, class E, class Gating, memory_space Space>
void backward(const B& b, C& comm, const plan<P, E>& pl, const Gating& gating, const operands<P, Space>& x,
              tensor_view<const typename P::storage_type, 3, Space> d_o,
              tensor_view<const typename P::accum_type, 4, Space> d_final_state,
              tensor_view<const typename P::accum_type, 3, Space> incoming_state, const gradients<P, Space>& g,
              std::span<std::byte> workspace) {
  detail::check_spaces<B, C, Space>();
  if constexpr (std::is_same_v<E, linear_attention::detail::kernel_step>)
    linear_attention::detail::lasp2_backward_impl<P>(b, comm, detail::access::core(pl), gating, x, d_o, d_final_state,
                                                     incoming_state, g, workspace);
  else
    linear_attention::detail::lasp2_backward_impl<P>(b, comm, detail::access::core(pl), gating, x, d_o, d_final_state,
                                                     incoming_state, g, workspace, pl.engine());
}

//! Convenience form of forward: make_plan (the precision and slice of the operands; this call's
//! view checks inside its agreement), a loom::temporary_buffer workspace, the plan form (complete on return).
//! @throws as make_plan and the plan form, on every rank.
//! Communication: the agreement and the exchange.
template <backend B, comm::communicator C, memory_space DocSpace = host_memory, class Gating, precision_policy P,
          memory_space Space>
void forward(const B& b, C& comm, const segments<DocSpace>& docs, index_t token_begin, const Gating& gating,
             const operands<P, Space>& x, tensor_view<typename P::storage_type, 3, Space> o,
             tensor_view<typename P::accum_type, 4, Space> final_state = {},
             tensor_view<typename P::accum_type, 3, Space> incoming_state = {}, const options& opt = {}) {
  const auto pl = loom::detail::with_host_segments(b, docs, [&](const segments<host_memory>& h) {
    return detail::access::make<P>(b, comm, h, token_begin,
                                   {x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2)}, opt, "lasp2::forward",
                                   [&](const auto& core) {
                                     linear_attention::detail::check_forward_call(
                                         comm, b, core, gating, x, o, final_state, incoming_state, "lasp2::forward");
                                   });
  });
  loom::detail::with_temporary_workspace(b, pl.forward_workspace_bytes(), [&](std::span<std::byte> ws) {
    forward(b, comm, pl, gating, x, o, final_state, incoming_state, ws);
  });
}

//! Convenience form of backward (as forward's).
template <backend B, comm::communicator C, memory_space DocSpace = host_memory, class Gating, precision_policy P,
          memory_space Space>
void backward(const B& b, C& comm, const segments<DocSpace>& docs, index_t token_begin, const Gating& gating,
              const operands<P, Space>& x, tensor_view<const typename P::storage_type, 3, Space> d_o,
              tensor_view<const typename P::accum_type, 4, Space> d_final_state,
              tensor_view<const typename P::accum_type, 3, Space> incoming_state, const gradients<P, Space>& g,
              const options& opt = {}) {
  const auto pl = loom::detail::with_host_segments(b, docs, [&](const segments<host_memory>& h) {
    return detail::access::make<P>(
        b, comm, h, token_begin, {x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2)}, opt, "lasp2::backward",
        [&](const auto& core) {
          linear_attention::detail::check_backward_call(comm, b, core, gating, x, d_o, d_final_state, incoming_state, g,
                                                        "lasp2::backward");
        });
  });
  loom::detail::with_temporary_workspace(b, pl.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, comm, pl, gating, x, d_o, d_final_state, incoming_state, g, ws);
  });
}

}  // namespace loom::linear_attention::lasp2
