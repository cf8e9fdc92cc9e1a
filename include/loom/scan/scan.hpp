#pragma once

//! @file
//! Scans over a monoid on any backend: inclusive and exclusive, forward and reverse, plain or
//! segmented (reset at the starts of loom::segments documents, int32 or int64 offsets).
//!
//!   auto plan = loom::scan::make_plan(b, loom::scan::plus<float>{}, n, docs, {.dir = loom::scan::direction::reverse});
//!   loom::workspace_buffer ws(plan.workspace_bytes());      // or any aligned span in b's memory
//!   loom::scan::inclusive_scan(b, plan, in, out, ws.span());   // allocates nothing
//!   loom::scan::exclusive_scan(b, plan, in, out, init, ws.span());
//!   loom::scan::inclusive_scan(b, m, in, out, docs, opts);     // convenience: plans, allocates, fences
//!
//! The plan holds the monoid, the length n, the documents (validated once, by
//! loom::check_segments), the options, the block layout and the workspace layout (on loom::cuda
//! with the vendor path: CUB's temporary storage, sized at plan time by CUB's own size query). It
//! is immutable, reusable for any number of calls (inclusive and exclusive alike) and may be
//! shared between threads for reading; each concurrent call needs its own workspace and outputs.
//! Completion: host backends complete on return; loom::cuda calls are stream-ordered on b.stream
//! and do not synchronise (the convenience forms fence).
//!
//! Determinism: the combine tree is fixed by n and options.block, so the result has the same bits
//! on every backend and thread count (see detail/engine.hpp). Work O(n) combines plus O(n / block)
//! for the carries; the data is read about twice and written once. On loom::cuda,
//! options.reproducible = false (and integer plus / minimum / maximum always) runs CUB's device
//! scan instead (detail/monoid_cuda.cuh): fast, but for floating-point monoids its bits may vary
//! from run to run.

#include <loom/backend/temporary.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/core/workspace.hpp>
#include <loom/scan/detail/engine.hpp>
#include <loom/scan/detail/monoid_kernel.hpp>
#include <loom/scan/detail/validate.hpp>
#include <loom/scan/monoid.hpp>
#include <loom/scan/options.hpp>

#include <span>
#include <type_traits>

namespace loom::scan {

namespace detail {
template <monoid M>
constexpr index_t monoid_bytes_per_element() {
  return static_cast<index_t>(2 * sizeof(typename M::value_type));  // one read, one write
}

//! Monoid scans a device backend runs with its vendor's library instead of the blocked engine
//! (specialised for loom::cuda by detail/monoid_cuda.cuh, included when nvcc compiles the unit).
template <class B>
struct vendor_scan {
  static constexpr bool available = false;
};

//! Monoids whose combine is exact, so that every combine order gives the same bits.
template <class M>
inline constexpr bool exact_combine = false;
template <class T>
inline constexpr bool exact_combine<plus<T>> = std::is_integral_v<T>;
template <class T>
inline constexpr bool exact_combine<maximum<T>> = std::is_integral_v<T>;
template <class T>
inline constexpr bool exact_combine<minimum<T>> = std::is_integral_v<T>;

template <class B, monoid M>
bool use_vendor_scan(const options& opt) {
  return vendor_scan<B>::available && (!opt.reproducible || exact_combine<M>);
}

//! The part of a plan that only cross-rank plans fill: where the slice lies, and the byte offsets
//! of the gathered aggregates in the workspace.
struct cross_rank {
  window w{};
  int ranks = 1, rank = 0;
  std::size_t own = 0, gathered = 0, prefix = 0;
};

//! Checks the numbers of `opt` that every scan reads: block must be >= 0 (0 picks one).
inline void check_options(const options& opt, std::string_view call) {
  LOOM_EXPECTS(opt.block >= 0, errc::invalid_argument, call, ": options.block must be >= 0 (0 picks one), got ",
               opt.block);
}

struct plan_access;

//! Documents must be readable by the backend: in its memory space, or host memory on a host backend.
template <class B, class Space>
constexpr void check_docs_space() {
  using BS = typename backend_traits<B>::memory_space;
  static_assert(std::is_same_v<Space, BS> || (Space::host_accessible && BS::host_accessible),
                "make_plan: the documents' offsets must live in the backend's memory space");
}
}  // namespace detail

template <backend B, monoid M, memory_space Space, bool Across>
class monoid_plan;

namespace detail {
//! P is a monoid plan made for one rank (Across = false) or by the cross-rank make_plan.
template <class P, bool Across>
inline constexpr bool is_monoid_plan = false;
template <class B, class M, class S, bool A>
inline constexpr bool is_monoid_plan<monoid_plan<B, M, S, A>, A> = true;
}  // namespace detail

//! A monoid scan's plan (see the file comment); made by scan::make_plan. Across: made by the
//! cross-rank make_plan (scan/distributed.hpp), taken only by the cross-rank calls.
template <backend B, monoid M, memory_space Space, bool Across>
class monoid_plan {
 public:
  using backend_type = B;
  using monoid_type = M;
  using value_type = typename M::value_type;
  using space = Space;
  static constexpr bool across_ranks = Across;

  //! Elements of in and out (this rank's slice for cross-rank plans).
  index_t size() const noexcept { return blk_.n; }
  const M& op() const noexcept { return m_; }
  //! The documents, bound to the (global) length; implicit: one document.
  const loom::segments<Space>& docs() const noexcept { return docs_; }
  const options& opts() const noexcept { return opt_; }
  //! Bytes of workspace every call with this plan needs (in b's memory space, aligned to
  //! loom::workspace_alignment).
  std::size_t workspace_bytes() const noexcept { return bytes_; }
  //! True when calls run the vendor's scan (CUB on loom::cuda) rather than loom's engine.
  bool vendor() const noexcept { return vendor_; }

 private:
  friend struct detail::plan_access;
  monoid_plan() = default;
  M m_{};
  loom::segments<Space> docs_{};
  options opt_{};
  detail::blocking blk_{};
  detail::cross_rank cr_{};
  bool vendor_ = false;
  std::size_t bytes_ = 0;
};

namespace detail {

struct plan_access {
  //! The plan of a scan over this window of the global sequence; `extra(layout, agg)` reserves
  //! what a cross-rank plan adds after the engine's state.
  template <bool Across, backend B, monoid M, memory_space Space, class Extra>
  static monoid_plan<B, M, Space, Across> monoid(const B& b, const M& m, window w, const loom::segments<Space>& docs,
                                                 const options& opt, std::string_view call, Extra&& extra) {
    check_docs_space<B, Space>();
    check_options(opt, call);
    LOOM_EXPECTS(w.count >= 0, errc::invalid_argument, call, ": the length must be >= 0, got ", w.count);
    monoid_plan<B, M, Space, Across> p;
    p.m_ = m;
    p.docs_ = loom::check_segments(docs, w.total, call, "docs");
    p.opt_ = opt;
    p.blk_ = make_blocking(w.count, opt.block, monoid_bytes_per_element<M>());
    p.cr_.w = w;
    workspace_layout lay;
    using A = flagged<typename M::value_type>;
    if constexpr (vendor_scan<B>::available) {
      if (!Across && use_vendor_scan<B, M>(opt)) {
        p.vendor_ = true;
        lay.add<std::byte>(static_cast<index_t>(vendor_scan<B>::bytes(m, w.count)));
        p.bytes_ = lay.bytes();
        return p;
      }
    }
    lay.add<A>(layout_of(b, p.blk_, 1, 1, 0).size());
    extra(p.cr_, lay, index_t{1}, index_t{1}, sizeof(A));
    p.bytes_ = lay.bytes();
    return p;
  }
  template <class Plan>
  static const blocking& blocks(const Plan& p) {
    return p.blk_;
  }
  template <class Plan>
  static const cross_rank& rank_part(const Plan& p) {
    return p.cr_;
  }
};

//! Checks the views of a call against its plan.
template <backend B, class Plan, class In, class Out>
void check_monoid_call(const Plan& p, const In& in, const Out& out, bool exclusive, std::span<std::byte> ws,
                       std::string_view call) {
  static_assert(In::rank == 1 && Out::rank == 1, "scan: in and out must be rank-1 views");
  static_assert(std::is_same_v<typename Out::value_type, typename Plan::value_type>,
                "scan: out's element type must be the monoid's value_type");
  static_assert(std::is_same_v<typename Plan::backend_type, B>, "scan: the plan was made for another backend");
  check_space<B, In>();
  check_space<B, Out>();
  const index_t n = p.size();
  expect_extents(in, {n}, call, "in", "the plan's elements");
  expect_extents(out, {n}, call, "out", "the plan's elements");
  check_workspace(ws, p.workspace_bytes(), call);
  check_no_overlap(out, "out", in, "in", !exclusive, call);
  check_no_overlap(out, "out", offsets_bytes(p.docs()), "docs", false, call);
}

//! Builds the monoid kernel of a plan's call and runs fn(kernel).
template <class Plan, class In, class Out, class Fn>
void with_monoid_kernel(const Plan& p, In in, Out out, bool exclusive, typename Plan::value_type init, Fn&& fn) {
  using M = typename Plan::monoid_type;
  const window w = plan_access::rank_part(p).w;
  const bool reverse = p.opts().dir == direction::reverse;
  heads hd{ref_of(p.docs()), p.docs().implicit() ? 0 : p.docs().count(),
           w.total,          reverse ? w.total - w.begin - w.count : w.begin,
           w.count,          reverse};
  if (reverse)
    fn(monoid_kernel<flipped<M>, In, Out>(flipped<M>{p.op()}, in, out, hd, exclusive, init));
  else
    fn(monoid_kernel<M, In, Out>(p.op(), in, out, hd, exclusive, init));
}

template <backend B, class Plan, class In, class Out>
void run_monoid(const B& b, const Plan& p, In in, Out out, bool exclusive, typename Plan::value_type init,
                std::span<std::byte> ws, std::string_view call) {
  static_assert(!Plan::across_ranks, "scan: a cross-rank plan is taken by the calls with a communicator");
  check_monoid_call<B>(p, in, out, exclusive, ws, call);
  if (p.size() == 0) return;
  if constexpr (vendor_scan<B>::available) {
    if (p.vendor()) {
      vendor_scan<B>::run(b, p.op(), in, out, ref_of(p.docs()), p.docs().implicit() ? 0 : p.docs().count(), exclusive,
                          init, p.opts().dir == direction::reverse, ws);
      return;
    }
  }
  with_monoid_kernel(p, in, out, exclusive, init, [&](const auto& k) {
    using A = typename std::remove_cvref_t<decltype(k)>::agg_type;
    run_scan(b, k, plan_access::blocks(p), workspace_carver(ws).at<A>(0));
  });
}

struct no_extra {
  void operator()(cross_rank&, workspace_layout&, index_t, index_t, std::size_t) const {}
};
}  // namespace detail

//! The plan of scans of n elements with monoid m on backend b, reset at the starts of `docs`
//! (S + 1 offsets ending at n; implicit: one sequence) and walked in options.dir.
//! @throws loom::error(invalid_argument) for n < 0, options.block < 0 or docs that are not a
//! segmentation of n (host memory: every offset is checked, once, here).
template <backend B, monoid M, memory_space Space = typename backend_traits<B>::memory_space>
monoid_plan<B, M, Space, false> make_plan(const B& b, const M& m, index_t n, const loom::segments<Space>& docs = {},
                                          const options& opt = {}) {
  return detail::plan_access::monoid<false>(b, m, detail::window{n, 0, n}, docs, opt, "scan::make_plan",
                                            detail::no_extra{});
}

//! out[i] = x[0] op x[1] op ... op x[i] (reverse: x[i] op ... op x[n-1]), restarting at every
//! document start (reverse: at each document's last element). in and out are rank-1 views of
//! plan.size() elements in b's memory space. out may be in itself (the same view: in place);
//! otherwise it must not overlap in or the offsets. Allocates nothing.
//! @throws loom::error(shape_mismatch) if a length differs from the plan's; (invalid_argument) for
//! a workspace below plan.workspace_bytes() or not on loom::workspace_alignment, or out
//! overlapping in (or the offsets) without being in.
template <backend B, class Plan, class In, class Out>
requires detail::is_monoid_plan<Plan, false>
void inclusive_scan(const B& b, const Plan& plan, In in, Out out, std::span<std::byte> ws) {
  detail::run_monoid(b, plan, in, out, false, plan.op().identity(), ws, "inclusive_scan");
}

//! out[i] = init op x[0] op ... op x[i-1]; out[start] = init for every document start (reverse:
//! out[i] = x[i+1] op ... op x[last] op init). out must not overlap in, not even as the same view:
//! exclusive scans do not run in place. @throws as inclusive_scan.
template <backend B, class Plan, class In, class Out>
requires detail::is_monoid_plan<Plan, false>
void exclusive_scan(const B& b, const Plan& plan, In in, Out out, typename Plan::value_type init,
                    std::span<std::byte> ws) {
  detail::run_monoid(b, plan, in, out, true, init, ws, "exclusive_scan");
}

//! Convenience: make_plan, a temporary workspace, the plan form, fence.
template <backend B, monoid M, class In, class Out, memory_space Space>
void inclusive_scan(const B& b, const M& m, In in, Out out, const loom::segments<Space>& docs,
                    const options& opt = {}) {
  const auto plan = make_plan(b, m, in.extent(0), docs, opt);
  loom::detail::with_temporary_workspace(b, plan.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { inclusive_scan(b, plan, in, out, ws); });
}
template <backend B, monoid M, class In, class Out>
void inclusive_scan(const B& b, const M& m, In in, Out out, const options& opt = {}) {
  inclusive_scan(b, m, in, out, loom::segments<typename backend_traits<B>::memory_space>{}, opt);
}
template <backend B, monoid M, class In, class Out, memory_space Space>
void exclusive_scan(const B& b, const M& m, In in, Out out, typename M::value_type init,
                    const loom::segments<Space>& docs, const options& opt = {}) {
  const auto plan = make_plan(b, m, in.extent(0), docs, opt);
  loom::detail::with_temporary_workspace(b, plan.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { exclusive_scan(b, plan, in, out, init, ws); });
}
template <backend B, monoid M, class In, class Out>
void exclusive_scan(const B& b, const M& m, In in, Out out, typename M::value_type init, const options& opt = {}) {
  exclusive_scan(b, m, in, out, init, loom::segments<typename backend_traits<B>::memory_space>{}, opt);
}

}  // namespace loom::scan

#if defined(__CUDACC__)
#include <loom/scan/detail/monoid_cuda.cuh>
#endif
