#pragma once

//! @file
//! The plan of chunked linear attention: the chunk table of one set of documents, the sizes, the
//! schedule (fused or chunk-parallel, heads per work item) and the workspace layout of each pass.
//!
//!   auto plan = loom::linear_attention::make_plan(b, docs, {.tokens = T, .heads = H, .dk = dk, .dv = dv},
//!                                                 {.chunk = 64});
//!   loom::workspace_buffer ws(plan.workspace_bytes());   // forward_ / backward_workspace_bytes()
//!   loom::linear_attention::forward(b, plan, gating, x, o, final_state, ws.span());
//!
//! Precision: the plan is templated on a precision policy because its workspace holds states in
//! the accumulation type. make_plan does not see element types, so its default is loom::fp32
//! (float accumulation, which also serves bfloat16 and half storage: plan<fp32>, plan<bf16> and
//! plan<fp16> differ only in the storage type of the operands they accept);
//! make_plan<loom::fp64>(...) or any loom::precision<S, A> names another. The plan-taking calls
//! require operands of the plan's precision (a compile-time check); the convenience forms deduce
//! it from the operands.

#include <loom/backend/copy.hpp>
#include <loom/backend/traits.hpp>
#include <loom/core/error.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>
#include <loom/linear_attention/detail/layout.hpp>
#include <loom/linear_attention/types.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

namespace loom::linear_attention {

//! What the data looks like: T tokens (all documents, packed), H heads, key width dk, value width dv.
struct shape {
  index_t tokens = 0;
  index_t heads = 0;
  index_t dk = 0;
  index_t dv = 0;
};

namespace detail {
struct plan_access;

//! Byte offsets of the workspace blocks of one pass (laid out with loom::workspace_layout).
struct pass_layout {
  std::size_t chunks = 0, doc_chunk = 0, cu = 0, states = 0, log_decay = 0, cum = 0, scratch = 0, adj = 0, db = 0,
              fin = 0, bytes = 0;
};
}  // namespace detail

//! A plan (see the file comment). Immutable once made; reusable for every layer and step with the
//! same documents and shape; shareable between threads for reading (each call with its own
//! workspace and outputs). A host object: it holds the chunk table in host memory and the
//! plan-taking calls upload it into the workspace where the backend's memory is not
//! host-accessible.
template <precision_policy P = fp32>
class plan {
 public:
  using precision = P;
  using accum_type = typename P::accum_type;

  index_t tokens() const noexcept { return tokens_; }
  index_t heads() const noexcept { return heads_; }
  index_t dk() const noexcept { return dk_; }
  index_t dv() const noexcept { return dv_; }
  index_t docs() const noexcept { return docs_; }    //!< S, the number of documents
  index_t chunk() const noexcept { return chunk_; }  //!< C, tokens per chunk
  index_t lanes() const noexcept { return lanes_; }  //!< parallel work slots
  accum_type scale() const noexcept { return scale_; }
  //! The forward runs per (document, head group), the state kept in the lane's scratch, instead of
  //! in three launches over (chunk, head group) items with a chunk-state buffer. Both give the same
  //! bits. options::fused forces it; by default make_plan chooses it when the (document, head)
  //! items balance over the backend's threads.
  bool fused() const noexcept { return fused_; }
  //! Heads per forward work item (1 .. 8; their rows are loaded together).
  index_t head_group() const noexcept { return head_group_; }
  index_t head_groups() const noexcept { return (heads_ + head_group_ - 1) / head_group_; }
  index_t chunks() const noexcept { return static_cast<index_t>(table_.chunks.size()); }
  //! The document offsets (S + 1 values, int64), as given to make_plan.
  std::span<const index_t> offsets() const noexcept { return cu_; }

  //! Bytes of workspace forward needs (the same on every backend).
  std::size_t forward_workspace_bytes() const noexcept { return fwd_.bytes; }
  //! Bytes of workspace backward needs.
  std::size_t backward_workspace_bytes() const noexcept { return bwd_.bytes; }
  //! Bytes of a workspace that serves both passes (the larger of the two).
  std::size_t workspace_bytes() const noexcept { return fwd_.bytes > bwd_.bytes ? fwd_.bytes : bwd_.bytes; }

 private:
  friend struct detail::plan_access;
  index_t tokens_ = 0, heads_ = 0, dk_ = 0, dv_ = 0, docs_ = 0, chunk_ = 0, lanes_ = 1, head_group_ = 1;
  accum_type scale_ = accum_type(1);
  bool fused_ = false;
  detail::chunk_table table_;
  std::vector<index_t> cu_;
  detail::pass_layout fwd_, bwd_;
};

namespace detail {

//! The implementation's access to a plan's internals.
struct plan_access {
  template <class P>
  static const chunk_table& table(const plan<P>& p) noexcept {
    return p.table_;
  }
  template <class P>
  static const pass_layout& layout(const plan<P>& p, bool backward) noexcept {
    return backward ? p.bwd_ : p.fwd_;
  }
  template <class P, class B>
  static plan<P> make(const B& b, const segments<host_memory>& docs_in, const shape& sh, const options& opt);
};

template <class A>
pass_layout make_pass_layout(index_t chunks, index_t docs, index_t heads, index_t tokens, index_t lane_floats_,
                             index_t lanes, index_t sz, bool fused, bool backward) {
  workspace_layout l;
  pass_layout w;
  w.chunks = l.add<chunk_info>(chunks);
  w.doc_chunk = l.add<index_t>(docs + 1);
  w.cu = l.add<index_t>(docs + 1);
  const bool buffered = backward || !fused;
  w.states = l.add<A>(buffered ? chunks * heads * sz : 0);
  w.log_decay = l.add<A>(buffered ? chunks * heads : 0);
  w.cum = l.add<A>(buffered ? chunks * heads : 0);
  w.scratch = l.add<A>(lanes * lane_floats_);
  if (backward) {
    w.adj = l.add<A>(chunks * heads * sz);
    w.db = l.add<A>(tokens * heads);
    w.fin = l.add<A>(docs * heads * sz);
  }
  w.bytes = l.bytes();
  return w;
}

template <class P, class B>
plan<P> plan_access::make(const B& b, const segments<host_memory>& docs_in, const shape& sh, const options& opt) {
  constexpr std::string_view call = "linear_attention::make_plan";
  const index_t heads = sh.heads, dk = sh.dk, dv = sh.dv;
  LOOM_EXPECTS(sh.tokens >= 0, errc::invalid_argument, call, ": shape.tokens must be >= 0, got ", sh.tokens);
  LOOM_EXPECTS(heads >= 0, errc::invalid_argument, call, ": heads must be >= 0, got ", heads);
  LOOM_EXPECTS(dk > 0 && dv > 0, errc::invalid_argument, call, ": dk and dv must be > 0, got dk = ", dk, ", dv = ", dv);
  LOOM_EXPECTS(opt.lanes >= 0, errc::invalid_argument, call, ": options.lanes must be >= 0, got ", opt.lanes);
  LOOM_EXPECTS(opt.chunk > 0, errc::invalid_argument, call, ": options.chunk must be > 0, got ", opt.chunk);
  LOOM_EXPECTS(opt.head_group >= 0 && opt.head_group <= max_head_group, errc::invalid_argument, call,
               ": options.head_group must be in [0, ", max_head_group, "] (0: chosen), got ", opt.head_group);
  const double scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(static_cast<double>(dk));
  LOOM_EXPECTS(std::isfinite(scale), errc::invalid_argument, call, ": options.scale must be finite, got ", scale);
  const segments<host_memory> docs = check_segments(docs_in, sh.tokens, call);
  plan<P> p;
  p.tokens_ = sh.tokens;
  p.docs_ = docs.count();
  p.cu_.resize(static_cast<std::size_t>(p.docs_) + 1);
  for (index_t d = 0; d <= p.docs_; ++d) p.cu_[static_cast<std::size_t>(d)] = docs[d];
  p.table_ = make_chunk_table(p.cu_, opt.chunk);
  p.heads_ = heads;
  p.dk_ = dk;
  p.dv_ = dv;
  p.chunk_ = opt.chunk;
  p.lanes_ = opt.lanes > 0 ? opt.lanes : 4 * static_cast<index_t>(backend_traits<B>::concurrency(b));
  if (p.lanes_ < 1) p.lanes_ = 1;
  // Head groups: the largest that leaves every thread 4 (chunk, group) items. Fused (per document
  // and head group) with the group whose items, dealt round-robin to the lanes and the lanes in
  // contiguous blocks to the threads, load the busiest thread least (ties: the larger group),
  // provided that is at most 1.25 x the mean; always on one thread.
  const index_t threads = static_cast<index_t>(backend_traits<B>::concurrency(b)) > 1
                              ? static_cast<index_t>(backend_traits<B>::concurrency(b))
                              : 1;
  const index_t gmax = heads < max_head_group ? (heads > 1 ? heads : 1) : max_head_group;
  p.head_group_ = gmax;
  while (p.head_group_ > 1 && p.chunks() * p.head_groups() < 4 * threads) --p.head_group_;
  if (threads == 1 && heads > 0 && p.docs_ > 0) {
    p.fused_ = true;
    p.head_group_ = gmax;
  }
  index_t best = -1;
  for (index_t g = gmax; g >= 1 && threads > 1 && heads > 0 && p.docs_ > 0; --g) {
    const index_t groups = (heads + g - 1) / g, items = p.docs_ * groups;
    const index_t lanes = items < p.lanes_ ? items : p.lanes_;
    if (lanes < threads) continue;
    std::vector<index_t> load(static_cast<std::size_t>(threads), 0);
    for (index_t it = 0; it < items; ++it) {
      const index_t d = it / groups, h0 = it % groups * g;
      load[static_cast<std::size_t>(it % lanes * threads / lanes)] +=
          docs.length(d) * (h0 + g < heads ? g : heads - h0);
    }
    index_t most = 0;
    for (index_t x : load) most = x > most ? x : most;
    if (4 * most * threads <= 5 * p.tokens_ * heads && (best < 0 || most < best)) {
      best = most;
      p.fused_ = true;
      p.head_group_ = g;
    }
  }
  if (opt.fused) p.fused_ = *opt.fused;
  if (opt.head_group > 0) p.head_group_ = opt.head_group;
  p.scale_ = static_cast<typename P::accum_type>(scale);
  using A = typename P::accum_type;
  const index_t lf = lane_floats(p.chunk_, dk, dv, p.head_group_), sz = dk * dv;
  p.fwd_ = make_pass_layout<A>(p.chunks(), p.docs_, heads, p.tokens_, lf, p.lanes_, sz, p.fused_, false);
  p.bwd_ = make_pass_layout<A>(p.chunks(), p.docs_, heads, p.tokens_, lf, p.lanes_, sz, p.fused_, true);
  return p;
}

}  // namespace detail

//! Plans chunked linear attention in precision P (default loom::fp32; see the file comment) for
//! the documents `docs` (loom::segments: int32 or int64 offsets in host memory, or in the
//! backend's memory, read once here with a copy and a fence; empty: one document of every token)
//! and the shape `sh` on backend b. Host work O(T / C + S); no communication.
//! @throws loom::error(invalid_argument) for offsets check_segments rejects (naming cu_seqlens;
//!         offsets in device memory are checked like host ones), chunk <= 0, a non-positive width,
//!         a negative head or token count, a head group outside [0, 8] or a non-finite scale.
template <precision_policy P = fp32, backend B, memory_space Space = host_memory>
plan<P> make_plan(const B& b, const segments<Space>& docs, const shape& sh, const options& opt = {}) {
  return loom::detail::with_host_segments(
      b, docs, [&](const segments<host_memory>& h) { return detail::plan_access::make<P>(b, h, sh, opt); });
}

}  // namespace loom::linear_attention
