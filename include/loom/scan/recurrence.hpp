#pragma once

//! @file
//! Linear recurrences h_t = A_t h_{t-1} + b_t on any backend, with the structure of A as a tag
//! (scalar, diagonal, block_diagonal<K>, dense), packed segments that reset the state, initial
//! states in and final states out, and the adjoint recurrence for backward passes.
//!
//!   loom::scan::linear_recurrence(loom::openmp{}, loom::scan::diagonal{}, a, b, h);
//!   loom::scan::linear_recurrence_adjoint(loom::openmp{}, loom::scan::diagonal{}, a, g, lambda);
//!
//! Views (in the backend's memory space; rows may be strided, each row contiguous):
//!   A: scalar [T], diagonal [T, d], block_diagonal<K> [T, d/K, K, K], dense [T, d, d]
//!   b, h, g, lambda: [T, d]
//! Storage may be double, float, bfloat16 or half; the state is carried in double for double
//! storage and in float otherwise. Work per step: O(d) scalar/diagonal, O(d K) block-diagonal,
//! O(d²) dense (O(d³) per step inside block aggregates for dense). Deterministic: same bits on
//! every backend and thread count for the same options.block.

#include <loom/core/segments.hpp>
#include <loom/scan/detail/engine.hpp>
#include <loom/scan/detail/recurrence_kernel.hpp>
#include <loom/scan/detail/validate.hpp>
#include <loom/scan/options.hpp>
#include <loom/scan/structure.hpp>

#include <type_traits>

namespace loom::scan {

//! The type a recurrence over storage T carries its state in.
template <class T>
using accum_t = std::conditional_t<std::is_same_v<std::remove_cv_t<T>, double>, double, float>;

//! Segments of a packed recurrence. Every part is optional (an empty view):
//!   offsets      S + 1 offsets (cu_seqlens): the state resets at each offsets[s]; empty: one segment
//!   initial      [S, d] (or [1, d] without offsets): h_{-1} of each segment; empty: zeros
//!   final_state  [S, d] (or [1, d]): receives each segment's last state (an empty segment's is its
//!                initial state); empty: not written
template <class T, class Space = host_memory>
struct segments {
  tensor_view<const index_t, 1, Space> offsets{};
  tensor_view<const T, 2, Space> initial{};
  tensor_view<T, 2, Space> final_state{};
};

//! The adjoint's view of the same segments:
//!   d_final    [S, d]: the gradient arriving at each segment's final state; empty: zeros
//!   d_initial  [S, d]: receives the gradient of each segment's initial state; empty: not written
template <class T, class Space = host_memory>
struct adjoint_segments {
  tensor_view<const index_t, 1, Space> offsets{};
  tensor_view<const T, 2, Space> d_final{};
  tensor_view<T, 2, Space> d_initial{};
};

namespace detail {

template <structure St, class AV>
void check_transitions(const AV& a, index_t n, index_t d, std::string_view call) {
  static_assert(AV::rank == St::a_rank, "linear_recurrence: A has the wrong rank for its structure tag");
  LOOM_EXPECTS(a.extent(0) == n, errc::shape_mismatch, call, ": A must have ", n, " time steps (as b), got ",
               a.extent(0));
  if constexpr (St::a_rank == 2) {
    LOOM_EXPECTS(a.extent(1) == d, errc::shape_mismatch, call, ": diagonal A must be [T, ", d, "], got ",
                 loom::detail::extents_string(a));
  } else if constexpr (St::a_rank == 3) {
    LOOM_EXPECTS(a.extent(1) == d && a.extent(2) == d, errc::shape_mismatch, call, ": dense A must be [T, ", d, ", ", d,
                 "], got ", loom::detail::extents_string(a));
  } else if constexpr (St::a_rank == 4) {
    constexpr index_t k = St::block;
    LOOM_EXPECTS(d % k == 0, errc::invalid_argument, call, ": block_diagonal<", k, "> needs a state size divisible by ",
                 k, ", got d = ", d);
    LOOM_EXPECTS(a.extent(1) == d / k && a.extent(2) == k && a.extent(3) == k, errc::shape_mismatch, call,
                 ": block_diagonal A must be [T, ", d / k, ", ", k, ", ", k, "], got ",
                 loom::detail::extents_string(a));
  }
  check_contiguous_rows(a, call, "A");
}

template <class V>
void check_rows(const V& v, index_t n, index_t d, std::string_view call, std::string_view name) {
  LOOM_EXPECTS(v.extent(0) == n && v.extent(1) == d, errc::shape_mismatch, call, ": ", name, " must be [", n, ", ", d,
               "], got ", loom::detail::extents_string(v));
  check_contiguous_rows(v, call, name);
}

//! Checks a per-segment [S, d] view (optional: an empty view passes).
template <class V>
void check_per_segment(const V& v, index_t segs, index_t d, std::string_view call, std::string_view name) {
  if (v.data() == nullptr && v.size() == 0) return;
  LOOM_EXPECTS(v.extent(0) == segs && v.extent(1) == d, errc::shape_mismatch, call, ": ", name, " must be [", segs,
               ", ", d, "] (one row per segment), got ", loom::detail::extents_string(v));
  check_contiguous_rows(v, call, name);
}

template <class T>
T* data_or_null(T* p, index_t size) {
  return size > 0 ? p : nullptr;
}

//! Builds the kernel of a (local or distributed) recurrence and runs `fn(kernel, blocking)`.
template <structure St, class AV, class BV, class HV, class OffV, class InitV, class FinV, class Fn>
void with_recurrence_kernel(AV a, BV bv, HV h, OffV offsets, InitV init, FinV fin, window w, bool adjoint,
                            const options& opt, std::string_view call, Fn&& fn) {
  using TH = typename HV::value_type;
  using Acc = accum_t<TH>;
  const index_t n = bv.extent(0), d = bv.extent(1);
  check_transitions<St>(a, n, d, call);
  check_rows(h, n, d, call, adjoint ? "lambda" : "h");
  const bool segmented = offsets.extent(0) > 0;
  if (segmented) check_offsets(offsets, w.total, call);
  const index_t segs = segmented ? offsets.extent(0) - 1 : 1;
  check_per_segment(init, segs, d, call, adjoint ? "d_final" : "initial");
  check_per_segment(fin, segs, d, call, adjoint ? "d_initial" : "final_state");
  check_options(opt, call);
  check_recurrence_overlaps(a, bv, h, offsets, init, fin, adjoint, call);
  heads hd{segmented ? offsets.data() : nullptr,
           segmented ? segs : 0,
           w.total,
           adjoint ? w.total - w.begin - w.count : w.begin,
           w.count,
           adjoint};
  using K =
      recurrence_kernel<St, typename AV::value_type, typename BV::value_type, TH, typename InitV::value_type, Acc>;
  const K k(a.data(), a.stride(0), bv.data(), bv.stride(0), h.data(), h.stride(0),
            data_or_null(init.data(), init.size()), init.stride(0), data_or_null(fin.data(), fin.size()), fin.stride(0),
            hd, d, adjoint, hd.base == 0);
  const index_t bytes = static_cast<index_t>(sizeof(Acc)) * (St::a_size(d) + 2 * d);
  fn(k, make_blocking(n, opt.block, bytes));
}

template <backend B, class K>
void run_local_recurrence(const B& b, const K& k, const blocking& blk, const options& opt, std::string_view call) {
  with_workspace<typename K::agg_type>(b, opt, workspace_size(b, k, blk), call,
                                       [&](typename K::agg_type* ws) { run_scan(b, k, blk, ws); });
}

//! Final values of empty segments (their initial values); `total` is the global length.
template <backend B, class OffV, class InitV, class FinV>
void fill_empty_segments(const B& b, OffV offsets, InitV init, FinV fin, index_t d, index_t total) {
  if (fin.size() == 0) return;
  using TH = typename FinV::value_type;
  using TI = typename InitV::value_type;
  static constexpr index_t one_empty[2] = {0, 0};
  const bool segmented = offsets.extent(0) > 0;
  if (!segmented && total > 0) return;
  if (!segmented && !backend_traits<B>::memory_space::host_accessible) {
    // one empty sequence on a device: no offsets array to point at; copy the initial row over
    for_each_index(b, d, empty_row_step<TH, TI>{data_or_null(init.data(), init.size()), fin.data()});
    return;
  }
  for_each_index(
      b, segmented ? offsets.extent(0) - 1 : 1,
      empty_segments_step<TH, TI>{segmented ? offsets.data() : one_empty, data_or_null(init.data(), init.size()),
                                  init.stride(0), fin.data(), fin.stride(0), d});
}

}  // namespace detail

//! h_t = A_t h_{t-1} + b_t for t in [0, T), per segment (see loom::scan::segments). h may be b
//! itself (the same view: in place); no other output (h, final_state) may share memory with an
//! input (A, b, offsets, initial) or with the other output.
//! @throws loom::error(shape_mismatch) for views whose extents do not fit; (invalid_argument) for
//! malformed offsets, a block size K that does not divide d, rows that are not contiguous,
//! options.block < 0, or overlapping views.
template <backend B, structure St, class AV, class BV, class HV, class T, class Space>
void linear_recurrence(const B& b, St, AV a, BV bv, HV h, const segments<T, Space>& seg, const options& opt = {}) {
  constexpr std::string_view call = "linear_recurrence";
  const detail::window w{bv.extent(0), 0, bv.extent(0)};
  detail::with_recurrence_kernel<St>(
      a, bv, h, seg.offsets, seg.initial, seg.final_state, w, false, opt, call,
      [&](const auto& k, const auto& blk) { detail::run_local_recurrence(b, k, blk, opt, call); });
  detail::fill_empty_segments(b, seg.offsets, seg.initial, seg.final_state, bv.extent(1), bv.extent(0));
}

//! One segment, zero initial state.
template <backend B, structure St, class AV, class BV, class HV>
void linear_recurrence(const B& b, St st, AV a, BV bv, HV h, const options& opt = {}) {
  linear_recurrence(b, st, a, bv, h, segments<typename HV::value_type, typename HV::space>{}, opt);
}

//! The adjoint of linear_recurrence: λ_t = g_t + A_{t+1}ᵀ λ_{t+1} within each segment, with
//! λ at a segment's last step = g + d_final[s]; d_initial[s] = A_startᵀ λ_start. Given the
//! gradient g_t of a loss with respect to h_t, λ_t is its gradient with respect to b_t (and to h_t
//! in total). No output (lambda, d_initial) may share memory with an input (A, g, offsets,
//! d_final) or with the other output: unlike h and b forward, lambda may not be g.
//! @throws loom::error as linear_recurrence.
template <backend B, structure St, class AV, class GV, class LV, class T, class Space>
void linear_recurrence_adjoint(const B& b, St, AV a, GV g, LV lambda, const adjoint_segments<T, Space>& seg,
                               const options& opt = {}) {
  constexpr std::string_view call = "linear_recurrence_adjoint";
  const detail::window w{g.extent(0), 0, g.extent(0)};
  detail::with_recurrence_kernel<St>(
      a, g, lambda, seg.offsets, seg.d_final, seg.d_initial, w, true, opt, call,
      [&](const auto& k, const auto& blk) { detail::run_local_recurrence(b, k, blk, opt, call); });
  detail::fill_empty_segments(b, seg.offsets, seg.d_final, seg.d_initial, g.extent(1), g.extent(0));
}

template <backend B, structure St, class AV, class GV, class LV>
void linear_recurrence_adjoint(const B& b, St st, AV a, GV g, LV lambda, const options& opt = {}) {
  linear_recurrence_adjoint(b, st, a, g, lambda, adjoint_segments<typename LV::value_type, typename LV::space>{}, opt);
}

namespace detail {
//! Row t of dA = λ_t h_{t-1}ᵀ projected on the structure.
template <class St, class TL, class TH, class TI, class TD>
struct transition_gradient_step {
  const TL* lambda;
  index_t l_stride;
  const TH* h;
  index_t h_stride;
  const index_t* offsets;  //!< null: one segment
  index_t segs;
  const TI* init;  //!< null: zeros
  index_t init_stride;
  TD* da;
  index_t da_stride;
  index_t d;
  LOOM_HD double prev(index_t t, index_t c) const {
    index_t s = -1;  // the segment that starts at t, if one does
    if (offsets) {
      const index_t lo = segment_of(offsets, segs, t);
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
//! dense: the outer product), where h_{t-1} is the previous row, or the segment's initial state
//! (zero without one) at a segment start. λ from linear_recurrence_adjoint, h from
//! linear_recurrence with the same segments. dA has A's shape. Products are formed in double.
template <backend B, structure St, class LV, class HV, class DAV, class T, class Space>
void transition_gradient(const B& b, St, LV lambda, HV h, DAV da, const segments<T, Space>& seg = {}) {
  constexpr std::string_view call = "transition_gradient";
  const index_t n = h.extent(0), d = h.extent(1);
  detail::check_rows(lambda, n, d, call, "lambda");
  detail::check_rows(h, n, d, call, "h");
  detail::check_transitions<St>(da, n, d, call);
  const bool segmented = seg.offsets.extent(0) > 0;
  if (segmented) detail::check_offsets(seg.offsets, n, call);
  const index_t segs = segmented ? seg.offsets.extent(0) - 1 : 1;
  detail::check_per_segment(seg.initial, segs, d, call, "initial");
  detail::check_no_overlap(da, "dA", lambda, "lambda", false, call);
  detail::check_no_overlap(da, "dA", h, "h", false, call);
  detail::check_no_overlap(da, "dA", seg.initial, "initial", false, call);
  detail::check_no_overlap(da, "dA", seg.offsets, "offsets", false, call);
  using K = detail::transition_gradient_step<St, typename LV::value_type, typename HV::value_type, T,
                                             typename DAV::value_type>;
  for_each_index(b, n,
                 K{lambda.data(), lambda.stride(0), h.data(), h.stride(0), segmented ? seg.offsets.data() : nullptr,
                   segs, detail::data_or_null(seg.initial.data(), seg.initial.size()), seg.initial.stride(0), da.data(),
                   da.stride(0), d});
}

}  // namespace loom::scan
