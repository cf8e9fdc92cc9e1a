#pragma once

//! @file
//! The engine kernel of monoid scans: inclusive or exclusive, forward or reverse, with optional
//! segment heads. Aggregates and carries are segmented values (value, head), so a head inside a
//! block or on another rank resets the scan exactly as it does in the sequential loop.

#include <loom/scan/monoid.hpp>
#include <loom/scan/options.hpp>

namespace loom::scan::detail {

//! Segment heads as positions in processing order. `offsets` (S + 1 values) segment a global
//! sequence of `total` elements; this rank (or call) processes the window of `count` elements that
//! starts `base` elements into the global processing order. Global head positions: forward, the
//! segment starts offsets[0..S); reverse, total - offsets[S..1] (each segment's last element).
//! Head indices are ascending in position; a run of equal positions (empty segments) is
//! represented by its last index, the one non-empty segment there.
struct heads {
  const index_t* offsets = nullptr;
  index_t segments = 0;  //!< S; 0 means no segments (no heads)
  index_t total = 0;
  index_t base = 0;
  index_t count = 0;
  bool reverse = false;

  LOOM_HD index_t at(index_t s) const { return (reverse ? total - offsets[segments - s] : offsets[s]) - base; }
  //! The segment (as numbered by offsets) of head index s.
  LOOM_HD index_t segment(index_t s) const { return reverse ? segments - 1 - s : s; }
  //! The head index of the last head at or before local position p (the segment holding p), or -1.
  LOOM_HD index_t last_at_or_before(index_t p) const {
    index_t lo = 0, hi = segments;  // first index with at() > p
    while (lo < hi) {
      const index_t mid = lo + (hi - lo) / 2;
      if (at(mid) <= p)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo - 1;
  }
  //! The position of the first head after local position p (count if none in the window).
  LOOM_HD index_t next_after(index_t p) const {
    const index_t s = last_at_or_before(p) + 1;
    if (s >= segments) return count;
    const index_t q = at(s);
    return q < count ? q : count;
  }
  //! The first head position >= p, or count.
  LOOM_HD index_t first_at_or_after(index_t p) const { return next_after(p - 1); }
};

template <class M, class In, class Out>
struct monoid_kernel {
  using value_type = typename M::value_type;
  using agg_type = flagged<value_type>;
  using in_type = typename In::element_type;
  using out_type = typename Out::element_type;
  M m;
  heads hd;
  bool exclusive;
  value_type init;  //!< exclusive: the value before each segment (and before position 0)
  // Position p (processing order) lives at src[p * src_step] and dst[p * dst_step]; a reverse scan
  // starts at the last element with a negative step.
  in_type* src;
  index_t src_step;
  out_type* dst;
  index_t dst_step;
  index_t carry_size = 1, agg_size = 1, scratch_size = 0;

  monoid_kernel(const M& m_, In in, Out out, heads hd_, bool excl, value_type init_)
      : m(m_), hd(hd_), exclusive(excl), init(init_) {
    const index_t last = in.extent(0) > 0 ? in.extent(0) - 1 : 0;
    src = hd.reverse ? in.data() + last * in.stride(0) : in.data();
    src_step = hd.reverse ? -in.stride(0) : in.stride(0);
    dst = hd.reverse ? out.data() + last * out.stride(0) : out.data();
    dst_step = hd.reverse ? -out.stride(0) : out.stride(0);
  }

  LOOM_HD value_type load(index_t p) const { return static_cast<value_type>(src[p * src_step]); }
  //! The running value just after a segment head x (exclusive scans start each segment at init).
  LOOM_HD value_type head_value(const value_type& x) const { return exclusive ? m.combine(init, x) : x; }

  LOOM_HD void identity_agg(agg_type* agg) const { *agg = {m.identity(), false}; }
  LOOM_HD void global_init_carry(agg_type* c) const { init_carry(c); }
  LOOM_HD void init_carry(agg_type* c) const { *c = {exclusive ? init : m.identity(), false}; }

  // A run of positions without heads is cut into `lanes` contiguous pieces folded side by side,
  // so the combines of different pieces do not wait on each other; the pieces' results are then
  // combined in order. Any associative combine allows it, and the order is fixed by the run alone.
  static constexpr index_t lanes = 8;
  static constexpr index_t min_laned = 16 * lanes;

  //! Elements per piece of a run of len >= min_laned. Pieces whose byte distance is close to a
  //! multiple of 4 KiB would make the side-by-side loads and stores alias in the L1 (and stall on
  //! false store-to-load dependencies), so such a length is shortened a little (the last piece
  //! takes the rest). A function of len alone, so the combine order stays fixed.
  LOOM_HD static index_t lane_piece(index_t len) {
    index_t piece = len / lanes;
    const index_t bytes = (piece * static_cast<index_t>(sizeof(in_type))) % 4096;
    if (bytes < 512 || bytes > 4096 - 512)
      piece -=
          (1024 / static_cast<index_t>(sizeof(in_type))) < piece / 2 ? 1024 / static_cast<index_t>(sizeof(in_type)) : 0;
    return piece;
  }

  //! acc op x[lo] op ... op x[hi - 1] (hi > lo).
  LOOM_HD value_type fold_run(index_t lo, index_t hi, value_type acc) const {
    const index_t len = hi - lo;
    if (len < min_laned) {
      for (index_t p = lo; p < hi; ++p) acc = m.combine(acc, load(p));
      return acc;
    }
    const index_t piece = lane_piece(len);
    value_type part[lanes];
    for (index_t k = 0; k < lanes; ++k) part[k] = load(lo + k * piece);
    const index_t lane_step = piece * src_step;
    const in_type* base = src + lo * src_step;
    for (index_t i = 1; i < piece; ++i) {
      const in_type* at = base + i * src_step;
      for (index_t k = 0; k < lanes; ++k) part[k] = m.combine(part[k], static_cast<value_type>(at[k * lane_step]));
    }
    for (index_t p = lo + lanes * piece; p < hi; ++p) part[lanes - 1] = m.combine(part[lanes - 1], load(p));
    for (index_t k = 0; k < lanes; ++k) acc = m.combine(acc, part[k]);
    return acc;
  }

  //! Writes the outputs of [lo, hi) (no heads inside) starting from the running value acc.
  LOOM_HD void scan_run(index_t lo, index_t hi, value_type acc) const {
    const index_t len = hi - lo;
    if (len < min_laned) {
      for (index_t p = lo; p < hi; ++p) acc = emit(p, acc);
      return;
    }
    const index_t piece = lane_piece(len);
    value_type carry[lanes];
    carry[0] = acc;
    for (index_t k = 0; k + 1 < lanes; ++k) carry[k + 1] = fold_run(lo + k * piece, lo + (k + 1) * piece, carry[k]);
    const index_t in_lane = piece * src_step, out_lane = piece * dst_step;
    if (exclusive) {
      for (index_t i = 0; i < piece; ++i) {
        const in_type* from = src + (lo + i) * src_step;
        out_type* to = dst + (lo + i) * dst_step;
        for (index_t k = 0; k < lanes; ++k) {
          to[k * out_lane] = carry[k];
          carry[k] = m.combine(carry[k], static_cast<value_type>(from[k * in_lane]));
        }
      }
    } else {
      for (index_t i = 0; i < piece; ++i) {
        const in_type* from = src + (lo + i) * src_step;
        out_type* to = dst + (lo + i) * dst_step;
        for (index_t k = 0; k < lanes; ++k) {
          carry[k] = m.combine(carry[k], static_cast<value_type>(from[k * in_lane]));
          to[k * out_lane] = carry[k];
        }
      }
    }
    for (index_t p = lo + lanes * piece; p < hi; ++p) carry[lanes - 1] = emit(p, carry[lanes - 1]);
  }

  //! Writes the output of position p given the running value before it; returns the value after.
  LOOM_HD value_type emit(index_t p, const value_type& before) const {
    const value_type after = m.combine(before, load(p));
    dst[p * dst_step] = exclusive ? before : after;
    return after;
  }

  LOOM_HD void reduce(index_t begin, index_t end, agg_type* agg, agg_type*) const {
    value_type acc = m.identity();
    bool head = false;
    index_t next = hd.first_at_or_after(begin);
    if (next >= end) {  // no head: fold from the first element (no identity needed)
      *agg = {fold_run(begin + 1, end, load(begin)), false};
      return;
    }
    // Everything before the first head is discarded by it.
    for (index_t p = next; p < end;) {
      acc = head_value(load(p));
      head = true;
      next = hd.next_after(p);
      ++p;
      const index_t stop = next < end ? next : end;
      if (p < stop) acc = fold_run(p, stop, acc);
      p = stop;
    }
    *agg = {acc, head};
  }

  LOOM_HD void advance(const agg_type* carry, const agg_type* agg, agg_type* next) const {
    *next = agg->head ? *agg : agg_type{m.combine(carry->value, agg->value), carry->head};
  }
  LOOM_HD void compose(const agg_type* first, const agg_type* second, agg_type* result) const {
    advance(first, second, result);
  }

  LOOM_HD void scan(index_t begin, index_t end, const agg_type* carry, agg_type*) const {
    index_t next = hd.first_at_or_after(begin);
    index_t stop = next < end ? next : end;
    if (begin < stop) scan_run(begin, stop, carry->value);
    for (index_t p = stop; p < end;) {
      const value_type x = load(p);
      dst[p * dst_step] = exclusive ? init : x;
      const value_type acc = head_value(x);
      next = hd.next_after(p);
      ++p;
      stop = next < end ? next : end;
      if (p < stop) scan_run(p, stop, acc);
      p = stop;
    }
  }
};

}  // namespace loom::scan::detail
