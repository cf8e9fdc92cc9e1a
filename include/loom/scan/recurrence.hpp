#pragma once

//! @file
//! Linear recurrences h_t = A_t h_{t-1} + b_t on any backend, with the structure of A as a tag
//! (scalar, diagonal, block_diagonal<K>, dense), packed documents (loom::segments) that reset the
//! state, initial states in and final states out, and the adjoint recurrence for backward passes.
//!
//!   auto plan = loom::scan::make_plan(b, loom::scan::diagonal{}, n, d, docs, opts);
//!   loom::workspace_buffer ws(plan.workspace_bytes());
//!   loom::scan::linear_recurrence(b, plan, a, bv, h, loom::scan::states<float>{h0, hT}, ws.span());
//!   loom::scan::linear_recurrence_adjoint(b, plan, a, g, lambda, loom::scan::adjoint_states<float>{}, ws.span());
//!   loom::scan::linear_recurrence(b, loom::scan::diagonal{}, a, bv, h, docs, states, opts);   // convenience
//!
//! Views (in the backend's memory space; rows may be strided, each row contiguous):
//!   A: scalar [T], diagonal [T, d], block_diagonal<K> [T, d/K, K, K], dense [T, d, d]
//!   b, h, g, lambda: [T, d]; states: [S, d] (S = docs.count())
//! Precision: storage may be double, float, bfloat16 or half. make_plan<P>(...) with a
//! loom::precision policy P carries the state in P::accum_type; make_plan(...) without one deduces
//! it per call from h's element type (loom::accum_t: double for double, float otherwise) and
//! reserves a workspace that fits either. Work per step: O(d) scalar/diagonal, O(d K)
//! block-diagonal, O(d²) dense (O(d³) per step inside block aggregates for dense). Deterministic:
//! same bits on every backend and thread count for the same plan.
//! The plan is immutable, reusable (forward and adjoint calls alike) and may be shared between
//! threads for reading; each concurrent call needs its own workspace and outputs. Plan-taking
//! calls allocate nothing; host backends complete on return, loom::cuda calls are stream-ordered
//! (no sync); the convenience forms fence.

#include <loom/backend/temporary.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>
#include <loom/scan/detail/affine_recurrence.hpp>
#include <loom/scan/detail/engine.hpp>
#include <loom/scan/detail/recurrence_kernel.hpp>
#include <loom/scan/detail/validate.hpp>
#include <loom/scan/options.hpp>
#include <loom/scan/scan.hpp>
#include <loom/scan/structure.hpp>

#include <algorithm>
#include <span>
#include <type_traits>

namespace loom::scan {

namespace detail {
struct recurrence_access;
//! P::accum_type for a precision policy, void for void (deduced per call).
template <class P>
struct accum_of {
  using type = typename P::accum_type;
};
template <>
struct accum_of<void> {
  using type = void;
};
}  // namespace detail

//! A linear recurrence's plan (see the file comment); made by scan::make_plan. Acc: the
//! accumulation type (void: deduced per call). Across: made by the cross-rank make_plan.
template <backend B, structure St, memory_space Space, class Acc = void, bool Across = false>
class recurrence_plan;

namespace detail {
//! P is a recurrence plan made for one rank (Across = false) or by the cross-rank make_plan.
template <class P, bool Across>
inline constexpr bool is_recurrence_plan = false;
template <class B, class St, class S, class A, bool Ac>
inline constexpr bool is_recurrence_plan<recurrence_plan<B, St, S, A, Ac>, Ac> = true;
}  // namespace detail

template <backend B, structure St, memory_space Space, class Acc, bool Across>
class recurrence_plan {
 public:
  using backend_type = B;
  using structure_type = St;
  using space = Space;
  using accum_type = Acc;
  static constexpr bool across_ranks = Across;

  //! Time steps of A, b and h (this rank's rows for cross-rank plans).
  index_t size() const noexcept { return blk_.n; }
  //! The state size d.
  index_t state_size() const noexcept { return d_; }
  //! The documents, bound to the (global) length; implicit: one document.
  const loom::segments<Space>& docs() const noexcept { return docs_; }
  const options& opts() const noexcept { return opt_; }
  //! Bytes of workspace every call with this plan needs (forward and adjoint).
  std::size_t workspace_bytes() const noexcept { return bytes_; }

 private:
  friend struct detail::plan_access;
  friend struct detail::recurrence_access;
  recurrence_plan() = default;
  index_t d_ = 0;
  loom::segments<Space> docs_{};
  options opt_{};
  detail::blocking blk_{}, blk_float_{};  //!< blocks for the accumulation type (deduced: double, float)
  detail::cross_rank cr_{};
  std::size_t bytes_ = 0;
  std::size_t vendor_at_ = 0, vendor_bytes_ = 0;  //!< the vendor scan's temporary storage (device, not reproducible)
};

namespace detail {

template <structure St, class AV>
void check_transitions(const AV& a, index_t n, index_t d, std::string_view call) {
  static_assert(AV::rank == St::a_rank, "linear_recurrence: A has the wrong rank for its structure tag");
  LOOM_EXPECTS(a.extent(0) == n, errc::shape_mismatch, call, ": A must have ", n, " time steps (as b), got ",
               a.extent(0));
  if constexpr (St::a_rank == 2) {
    expect_extents(a, {n, d}, call, "diagonal A");
  } else if constexpr (St::a_rank == 3) {
    expect_extents(a, {n, d, d}, call, "dense A");
  } else if constexpr (St::a_rank == 4) {
    constexpr index_t k = St::block;
    LOOM_EXPECTS(d % k == 0, errc::invalid_argument, call, ": block_diagonal<", k, "> needs a state size divisible by ",
                 k, ", got d = ", d);
    expect_extents(a, {n, d / k, k, k}, call, "block_diagonal A");
  }
  check_contiguous_rows(a, call, "A");
}

template <class V>
void check_rows(const V& v, index_t n, index_t d, std::string_view call, std::string_view name) {
  expect_extents(v, {n, d}, call, name);
  check_contiguous_rows(v, call, name);
}

//! Checks a per-segment [S, d] view (optional: an empty view passes).
template <class V>
void check_per_segment(const V& v, index_t segs, index_t d, std::string_view call, std::string_view name) {
  if (v.data() == nullptr && v.size() == 0) return;
  expect_extents(v, {segs, d}, call, name, "one row per segment");
  check_contiguous_rows(v, call, name);
}

template <class T>
T* data_or_null(T* p, index_t size) {
  return size > 0 ? p : nullptr;
}

//! The accumulation type of a call: the plan's, or accum_t of h's element type.
template <class Acc, class TH>
using call_accum = std::conditional_t<std::is_void_v<Acc>, loom::accum_t<TH>, Acc>;

struct recurrence_access {
  //! The plan of a recurrence over this window of the global sequence; `extra` reserves what a
  //! cross-rank plan adds after the engine's state.
  template <class Acc, bool Across, backend B, structure St, memory_space Space, class Extra>
  static recurrence_plan<B, St, Space, Acc, Across> make(const B& b, window w, index_t d,
                                                         const loom::segments<Space>& docs, const options& opt,
                                                         std::string_view call, Extra&& extra) {
    check_docs_space<B, Space>();
    check_options(opt, call);
    LOOM_EXPECTS(w.count >= 0, errc::invalid_argument, call, ": the number of time steps must be >= 0, got ", w.count);
    LOOM_EXPECTS(d >= 0, errc::invalid_argument, call, ": the state size d must be >= 0, got ", d);
    if constexpr (St::a_rank == 4)
      LOOM_EXPECTS(d % St::block == 0, errc::invalid_argument, call, ": block_diagonal<", St::block,
                   "> needs a state size divisible by ", St::block, ", got d = ", d);
    using PA = std::conditional_t<std::is_void_v<Acc>, double, Acc>;  // deduced: room for double
    recurrence_plan<B, St, Space, Acc, Across> p;
    p.d_ = d;
    p.docs_ = loom::check_segments(docs, w.total, call, "docs");
    p.opt_ = opt;
    const index_t as = St::a_size(d);
    p.blk_ = make_blocking(w.count, opt.block, static_cast<index_t>(sizeof(PA)) * (as + 2 * d));
    // deduced precision: float storage blocks as a float plan would (same bits as before)
    p.blk_float_ = std::is_void_v<Acc>
                       ? make_blocking(w.count, opt.block, static_cast<index_t>(sizeof(float)) * (as + 2 * d))
                       : p.blk_;
    p.cr_.w = w;
    const index_t agg = recurrence_agg_size<PA>(as, d);
    const std::size_t eng = std::max(
        sizeof(PA) * static_cast<std::size_t>(layout_of(b, p.blk_, d, agg, 2 * as + 2 * d).size()),
        sizeof(float) * static_cast<std::size_t>(
                            layout_of(b, p.blk_float_, d, recurrence_agg_size<float>(as, d), 2 * as + 2 * d).size()));
    workspace_layout lay;
    lay.add<std::byte>(static_cast<index_t>(eng));
    extra(p.cr_, lay, agg, d, sizeof(PA));
    if constexpr (vendor_affine<B>::available && affine_structure<St> && !Across) {
      if (!opt.reproducible) {
        // the vendor's scan by key of T d affine pairs (deduced precision: room for either)
        const index_t pairs = w.count * (d / affine_traits<St, PA>::width);
        p.vendor_bytes_ = std::max(vendor_affine<B>::template bytes<St, PA>(pairs),
                                   std::is_void_v<Acc> ? vendor_affine<B>::template bytes<St, float>(pairs) : 0);
        p.vendor_at_ = lay.add<std::byte>(static_cast<index_t>(p.vendor_bytes_));
      }
    }
    p.bytes_ = lay.bytes();
    return p;
  }
  template <class Plan>
  static std::span<std::byte> vendor_part(const Plan& p, std::span<std::byte> ws) {
    return ws.subspan(p.vendor_at_, p.vendor_bytes_);
  }
  template <class A, class Plan>
  static const blocking& blocks(const Plan& p) {
    return std::is_void_v<typename Plan::accum_type> && std::is_same_v<A, float> ? p.blk_float_ : p.blk_;
  }
  template <class Plan>
  static const cross_rank& rank_part(const Plan& p) {
    return p.cr_;
  }
};

//! Checks a call's views against its plan, builds the kernel and runs fn(kernel, blocking).
template <backend B, class Plan, class AV, class BV, class HV, class InitV, class FinV, class Fn>
void with_recurrence_kernel(const Plan& p, AV a, BV bv, HV h, InitV init, FinV fin, bool adjoint,
                            std::span<std::byte> ws, std::string_view call, Fn&& fn) {
  using St = typename Plan::structure_type;
  using TH = typename HV::value_type;
  using Acc = call_accum<typename Plan::accum_type, TH>;
  static_assert(std::is_same_v<typename Plan::backend_type, B>,
                "linear_recurrence: the plan was made for another backend");
  check_space<B, AV>();
  check_space<B, BV>();
  check_space<B, HV>();
  const index_t n = p.size(), d = p.state_size();
  check_rows(bv, n, d, call, adjoint ? "g" : "b");
  check_transitions<St>(a, n, d, call);
  check_rows(h, n, d, call, adjoint ? "lambda" : "h");
  const auto& docs = p.docs();
  const index_t segs = docs.count();
  check_per_segment(init, segs, d, call, adjoint ? "d_final" : "initial");
  check_per_segment(fin, segs, d, call, adjoint ? "d_initial" : "final_state");
  check_workspace(ws, p.workspace_bytes(), call);
  check_recurrence_overlaps(a, bv, h, offsets_bytes(docs), init, fin, adjoint, call);
  const window w = recurrence_access::rank_part(p).w;
  heads hd{ref_of(docs), docs.implicit() ? 0 : segs, w.total, adjoint ? w.total - w.begin - w.count : w.begin, w.count,
           adjoint};
  using K =
      recurrence_kernel<St, typename AV::value_type, typename BV::value_type, TH, typename InitV::value_type, Acc>;
  const K k(a.data(), a.stride(0), bv.data(), bv.stride(0), h.data(), h.stride(0),
            data_or_null(init.data(), init.size()), init.stride(0), data_or_null(fin.data(), fin.size()), fin.stride(0),
            hd, d, adjoint, hd.base == 0);
  fn(k, recurrence_access::blocks<Acc>(p));
}

//! Final values of empty documents (their initial values); `total` is the global length.
template <backend B, memory_space Space, class InitV, class FinV>
void fill_empty_segments(const B& b, const loom::segments<Space>& docs, InitV init, FinV fin, index_t d,
                         index_t total) {
  if (fin.size() == 0) return;
  using TH = typename FinV::value_type;
  using TI = typename InitV::value_type;
  static constexpr std::int64_t one_empty[2] = {0, 0};
  const bool segmented = !docs.implicit();
  if (!segmented && total > 0) return;
  if (!segmented && !backend_traits<B>::memory_space::host_accessible) {
    // one empty sequence on a device: no offsets array to point at; copy the initial row over
    for_each_index(b, d, empty_row_step<TH, TI>{data_or_null(init.data(), init.size()), fin.data()});
    return;
  }
  for_each_index(b, segmented ? docs.count() : 1,
                 empty_segments_step<TH, TI>{segmented ? ref_of(docs) : offsets_ref{one_empty, true},
                                             data_or_null(init.data(), init.size()), init.stride(0), fin.data(),
                                             fin.stride(0), d});
}

//! A scalar or diagonal recurrence of a single-rank plan as one scan by key of affine pairs
//! (detail/affine_recurrence.hpp), run by `exec(map)`: the vendor's scan on a device, the sequential
//! reference in the host tests; then the final values and the empty documents.
template <backend B, class Plan, class AV, class XV, class YV, class InV, class OutV, class Exec>
void run_affine_recurrence(const B& b, const Plan& p, AV a, XV x, YV y, InV in_states, OutV out_states, bool adjoint,
                           std::span<std::byte> ws, Exec&& exec) {
  using St = typename Plan::structure_type;
  static_assert(affine_structure<St>, "run_affine_recurrence: scalar, diagonal and block-diagonal recurrences only");
  static_assert(!Plan::across_ranks, "run_affine_recurrence: a single-rank plan");
  const std::string_view call = adjoint ? "linear_recurrence_adjoint" : "linear_recurrence";
  with_recurrence_kernel<B>(p, a, x, y, in_states, out_states, adjoint, ws, call, [&](const auto& k, const auto&) {
    using K = std::remove_cvref_t<decltype(k)>;
    const affine_map<K, St> m{k};
    if (m.count() > 0) exec(m);
    if (k.fin != nullptr)
      for_each_index(b, (k.hd.segments > 0 ? k.hd.segments : 1) * k.d, affine_finals_step<K, St>{m});
  });
  fill_empty_segments(b, p.docs(), in_states, out_states, p.state_size(), p.size());
}

template <backend B, class Plan, class AV, class XV, class YV, class InV, class OutV>
void run_local_recurrence(const B& b, const Plan& p, AV a, XV x, YV y, InV in_states, OutV out_states, bool adjoint,
                          std::span<std::byte> ws) {
  static_assert(!Plan::across_ranks, "linear_recurrence: a cross-rank plan is taken by the calls with a communicator");
  const std::string_view call = adjoint ? "linear_recurrence_adjoint" : "linear_recurrence";
  if constexpr (vendor_affine<B>::available && affine_structure<typename Plan::structure_type>) {
    if (!p.opts().reproducible) {
      run_affine_recurrence(b, p, a, x, y, in_states, out_states, adjoint, ws,
                            [&](const auto& m) { vendor_affine<B>::run(b, m, recurrence_access::vendor_part(p, ws)); });
      return;
    }
  }
  with_recurrence_kernel<B>(p, a, x, y, in_states, out_states, adjoint, ws, call, [&](const auto& k, const auto& blk) {
    using A = typename std::remove_cvref_t<decltype(k)>::agg_type;
    run_scan(b, k, blk, workspace_carver(ws).at<A>(0));
  });
  fill_empty_segments(b, p.docs(), in_states, out_states, p.state_size(), p.size());
}

//! Where every rank's slice lies, (for cross-rank plans: from the lengths make_plan's agreement exchanged).
struct slices {
  window w{};
  int ranks = 1, rank = 0;
  int prev = -1, next = -1;  //!< nearest non-empty ranks before and after this one
};

//! Reserves the cross-rank part of a workspace: own aggregate | P gathered aggregates | carry +
//! temporary.
struct rank_extra {
  int ranks, rank;
  void operator()(cross_rank& cr, workspace_layout& lay, index_t agg, index_t carry, std::size_t unit) const {
    cr.ranks = ranks;
    cr.rank = rank;
    cr.own = lay.add<std::byte>(agg * static_cast<index_t>(unit));
    cr.gathered = lay.add<std::byte>(ranks * agg * static_cast<index_t>(unit));
    cr.prefix = lay.add<std::byte>(2 * carry * static_cast<index_t>(unit));
  }
};

//! A cross-rank recurrence plan for a slice already agreed on (by make_plan's agreement, or by a
//! caller that agreed on its whole computation once, as the sequence-parallel Newton solver does).
template <class Acc, backend B, structure St, memory_space Space>
recurrence_plan<B, St, Space, Acc, true> cross_recurrence_plan(const B& b, const slices& s, index_t d,
                                                               const loom::segments<Space>& docs, const options& opt,
                                                               std::string_view call) {
  return recurrence_access::make<Acc, true, B, St>(b, s.w, d, docs, opt, call, rank_extra{s.ranks, s.rank});
}

}  // namespace detail

//! The plan of recurrences of n time steps with state size d and transitions of structure St on
//! backend b, reset at the starts of `docs` (S + 1 offsets ending at n; implicit: one sequence).
//! P: a loom::precision policy whose accum_type carries the state (void: deduced per call).
//! @throws loom::error(invalid_argument) for n < 0, d < 0, a block size K that does not divide d,
//! options.block < 0, or docs that are not a segmentation of n.
template <class P = void, backend B, structure St, memory_space Space = typename backend_traits<B>::memory_space>
auto make_plan(const B& b, St, index_t n, index_t d, const loom::segments<Space>& docs = {}, const options& opt = {}) {
  using Acc = typename detail::accum_of<P>::type;
  return detail::recurrence_access::make<Acc, false, B, St>(b, detail::window{n, 0, n}, d, docs, opt, "scan::make_plan",
                                                            detail::no_extra{});
}

//! h_t = A_t h_{t-1} + b_t for t in [0, T), per document (states: see loom::scan::states). h may
//! be b itself (the same view: in place); no other output (h, final_state) may share memory with
//! an input (A, b, the offsets, initial) or with the other output. Allocates nothing.
//! @throws loom::error(shape_mismatch) for views whose extents do not fit the plan;
//! (invalid_argument) for rows that are not contiguous, overlapping views, or a workspace below
//! plan.workspace_bytes() or not on loom::workspace_alignment.
template <backend B, class Plan, class AV, class BV, class HV, class T>
requires detail::is_recurrence_plan<Plan, false>
void linear_recurrence(const B& b, const Plan& plan, AV a, BV bv, HV h, const states<T, typename Plan::space>& st,
                       std::span<std::byte> ws) {
  detail::run_local_recurrence(b, plan, a, bv, h, st.initial, st.final_state, false, ws);
}
//! One segment per document, zero initial states, no final states.
template <backend B, class Plan, class AV, class BV, class HV>
requires detail::is_recurrence_plan<Plan, false>
void linear_recurrence(const B& b, const Plan& plan, AV a, BV bv, HV h, std::span<std::byte> ws) {
  linear_recurrence(b, plan, a, bv, h, states<typename HV::value_type, typename Plan::space>{}, ws);
}

//! The adjoint of linear_recurrence: λ_t = g_t + A_{t+1}ᵀ λ_{t+1} within each document, with
//! λ at a document's last step = g + d_final[s]; d_initial[s] = A_startᵀ λ_start. Given the
//! gradient g_t of a loss with respect to h_t, λ_t is its gradient with respect to b_t (and to h_t
//! in total). No output (lambda, d_initial) may share memory with an input (A, g, the offsets,
//! d_final) or with the other output: unlike h and b forward, lambda may not be g.
//! @throws loom::error as linear_recurrence.
template <backend B, class Plan, class AV, class GV, class LV, class T>
requires detail::is_recurrence_plan<Plan, false>
void linear_recurrence_adjoint(const B& b, const Plan& plan, AV a, GV g, LV lambda,
                               const adjoint_states<T, typename Plan::space>& st, std::span<std::byte> ws) {
  detail::run_local_recurrence(b, plan, a, g, lambda, st.d_final, st.d_initial, true, ws);
}
template <backend B, class Plan, class AV, class GV, class LV>
requires detail::is_recurrence_plan<Plan, false>
void linear_recurrence_adjoint(const B& b, const Plan& plan, AV a, GV g, LV lambda, std::span<std::byte> ws) {
  linear_recurrence_adjoint(b, plan, a, g, lambda, adjoint_states<typename LV::value_type, typename Plan::space>{}, ws);
}

//! Convenience: make_plan, a temporary workspace, the plan form, fence.
template <backend B, structure St, class AV, class BV, class HV, memory_space Space, class T>
void linear_recurrence(const B& b, St st, AV a, BV bv, HV h, const loom::segments<Space>& docs,
                       const states<T, Space>& s, const options& opt = {}) {
  const auto plan = make_plan(b, st, bv.extent(0), bv.extent(1), docs, opt);
  loom::detail::with_temporary_workspace(b, plan.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { linear_recurrence(b, plan, a, bv, h, s, ws); });
}
template <backend B, structure St, class AV, class BV, class HV>
void linear_recurrence(const B& b, St st, AV a, BV bv, HV h, const options& opt = {}) {
  using Space = typename backend_traits<B>::memory_space;
  linear_recurrence(b, st, a, bv, h, loom::segments<Space>{}, states<typename HV::value_type, Space>{}, opt);
}
template <backend B, structure St, class AV, class GV, class LV, memory_space Space, class T>
void linear_recurrence_adjoint(const B& b, St st, AV a, GV g, LV lambda, const loom::segments<Space>& docs,
                               const adjoint_states<T, Space>& s, const options& opt = {}) {
  const auto plan = make_plan(b, st, g.extent(0), g.extent(1), docs, opt);
  loom::detail::with_temporary_workspace(b, plan.workspace_bytes(), [&](std::span<std::byte> ws) {
    linear_recurrence_adjoint(b, plan, a, g, lambda, s, ws);
  });
}
template <backend B, structure St, class AV, class GV, class LV>
void linear_recurrence_adjoint(const B& b, St st, AV a, GV g, LV lambda, const options& opt = {}) {
  using Space = typename backend_traits<B>::memory_space;
  linear_recurrence_adjoint(b, st, a, g, lambda, loom::segments<Space>{},
                            adjoint_states<typename LV::value_type, Space>{}, opt);
}

namespace detail {
//! Row t of dA = λ_t h_{t-1}ᵀ projected on the structure.
template <class St, class TL, class TH, class TI, class TD>
struct transition_gradient_step {
  const TL* lambda;
  index_t l_stride;
  const TH* h;
  index_t h_stride;
  offsets_ref offsets;  //!< null: one segment
  index_t segs;
  const TI* init;  //!< null: zeros
  index_t init_stride;
  TD* da;
  index_t da_stride;
  index_t d;
  LOOM_HD double prev(index_t t, index_t c) const {
    index_t s = -1;  // the segment that starts at t, if one does
    if (offsets) {
      const index_t lo = loom::segment_of(offsets, segs, t);
      if (offsets[lo] == t) s = lo;
    } else if (t == 0) {
      s = 0;
    }
    if (s < 0) return static_cast<double>(h[(t - 1) * h_stride + c]);
    return init ? static_cast<double>(init[s * init_stride + c]) : 0.0;
  }
  LOOM_HD void operator()(index_t t) const {
    const TL* l = lambda + t * l_stride;
    TD* out = da + t * da_stride;
    if constexpr (St::a_rank == 1) {
      double acc = 0;
      for (index_t c = 0; c < d; ++c) acc += static_cast<double>(l[c]) * prev(t, c);
      out[0] = static_cast<TD>(acc);
    } else if constexpr (St::a_rank == 2) {
      for (index_t c = 0; c < d; ++c) out[c] = static_cast<TD>(static_cast<double>(l[c]) * prev(t, c));
    } else if constexpr (St::a_rank == 4) {
      constexpr index_t k = St::block;
      for (index_t blk = 0; blk < d / k; ++blk)
        for (index_t i = 0; i < k; ++i)
          for (index_t j = 0; j < k; ++j)
            out[(blk * k + i) * k + j] = static_cast<TD>(static_cast<double>(l[blk * k + i]) * prev(t, blk * k + j));
    } else {
      for (index_t i = 0; i < d; ++i)
        for (index_t j = 0; j < d; ++j) out[i * d + j] = static_cast<TD>(static_cast<double>(l[i]) * prev(t, j));
    }
  }
};
}  // namespace detail

//! The gradient of the transitions: dA_t = λ_t h_{t-1}ᵀ projected on the structure (scalar: the
//! dot product; diagonal: element-wise; block-diagonal: each K x K block of the outer product;
//! dense: the outer product), where h_{t-1} is the previous row, or the document's initial state
//! (zero without one) at a document start. λ from linear_recurrence_adjoint, h from
//! linear_recurrence with the same plan and states. dA has A's shape. Products are formed in
//! double. Needs no workspace; allocates nothing.
template <backend B, class Plan, class LV, class HV, class DAV, class T>
requires detail::is_recurrence_plan<Plan, false>
void transition_gradient(const B& b, const Plan& plan, LV lambda, HV h, DAV da,
                         const states<T, typename Plan::space>& st) {
  using St = typename Plan::structure_type;
  static_assert(!Plan::across_ranks, "transition_gradient: takes a local plan");
  constexpr std::string_view call = "transition_gradient";
  const index_t n = plan.size(), d = plan.state_size();
  detail::check_rows(lambda, n, d, call, "lambda");
  detail::check_rows(h, n, d, call, "h");
  detail::check_transitions<St>(da, n, d, call);
  const auto& docs = plan.docs();
  const index_t segs = docs.count();
  detail::check_per_segment(st.initial, segs, d, call, "initial");
  detail::check_no_overlap(da, "dA", lambda, "lambda", false, call);
  detail::check_no_overlap(da, "dA", h, "h", false, call);
  detail::check_no_overlap(da, "dA", st.initial, "initial", false, call);
  detail::check_no_overlap(da, "dA", detail::offsets_bytes(docs), "docs", false, call);
  using K = detail::transition_gradient_step<St, typename LV::value_type, typename HV::value_type, T,
                                             typename DAV::value_type>;
  for_each_index(
      b, n,
      K{lambda.data(), lambda.stride(0), h.data(), h.stride(0), detail::ref_of(docs), segs,
        detail::data_or_null(st.initial.data(), st.initial.size()), st.initial.stride(0), da.data(), da.stride(0), d});
}

template <backend B, class Plan, class LV, class HV, class DAV>
requires detail::is_recurrence_plan<Plan, false>
void transition_gradient(const B& b, const Plan& plan, LV lambda, HV h, DAV da) {
  transition_gradient(b, plan, lambda, h, da, states<typename HV::value_type, typename Plan::space>{});
}

//! Convenience: make_plan, then the plan form (no workspace, so nothing to allocate), fence.
template <backend B, structure St, class LV, class HV, class DAV, memory_space Space, class T>
void transition_gradient(const B& b, St st, LV lambda, HV h, DAV da, const loom::segments<Space>& docs,
                         const states<T, Space>& s) {
  transition_gradient(b, make_plan(b, st, h.extent(0), h.extent(1), docs), lambda, h, da, s);
  fence(b);
}
template <backend B, structure St, class LV, class HV, class DAV>
void transition_gradient(const B& b, St st, LV lambda, HV h, DAV da) {
  using Space = typename backend_traits<B>::memory_space;
  transition_gradient(b, st, lambda, h, da, loom::segments<Space>{}, states<typename HV::value_type, Space>{});
}

}  // namespace loom::scan

#if defined(__CUDACC__)
#include <loom/scan/detail/affine_recurrence_cuda.cuh>
#endif
