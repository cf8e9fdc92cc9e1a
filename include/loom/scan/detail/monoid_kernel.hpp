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
  M m;
  In in;
  Out out;
  heads hd;
  bool exclusive = false;
  value_type init;  //!< exclusive: the value before each segment (and before position 0)
  index_t carry_size = 1, agg_size = 1, scratch_size = 0;

  LOOM_HD index_t index(index_t p) const { return hd.reverse ? hd.count - 1 - p : p; }
  LOOM_HD value_type load(index_t p) const { return static_cast<value_type>(in(index(p))); }
  //! The running value just after a segment head x (exclusive scans start each segment at init).
  LOOM_HD value_type head_value(const value_type& x) const { return exclusive ? m.combine(init, x) : x; }

  LOOM_HD void identity_agg(agg_type* agg) const { *agg = {m.identity(), false}; }
  LOOM_HD void global_init_carry(agg_type* c) const { init_carry(c); }
  LOOM_HD void init_carry(agg_type* c) const { *c = {exclusive ? init : m.identity(), false}; }

  LOOM_HD void reduce(index_t begin, index_t end, agg_type* agg, agg_type*) const {
    value_type acc = m.identity();
    bool head = false;
    index_t next = hd.first_at_or_after(begin);
    for (index_t p = begin; p < end;) {
      if (p == next) {
        acc = head_value(load(p));
        head = true;
        next = hd.next_after(p);
        ++p;
      }
      const index_t stop = next < end ? next : end;
      for (; p < stop; ++p) acc = m.combine(acc, load(p));
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
    value_type acc = carry->value;
    index_t next = hd.first_at_or_after(begin);
    for (index_t p = begin; p < end;) {
      if (p == next) {
        const value_type x = load(p);
        out(index(p)) = exclusive ? init : x;
        acc = head_value(x);
        next = hd.next_after(p);
        ++p;
      }
      const index_t stop = next < end ? next : end;
      if (exclusive) {
        for (; p < stop; ++p) {
          const value_type x = load(p);
          out(index(p)) = acc;
          acc = m.combine(acc, x);
        }
      } else {
        for (; p < stop; ++p) {
          acc = m.combine(acc, load(p));
          out(index(p)) = acc;
        }
      }
    }
  }
};

}  // namespace loom::scan::detail
