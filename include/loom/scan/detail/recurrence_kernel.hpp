#pragma once

//! @file
//! The engine kernel of linear recurrences, forward and adjoint, for any structure tag.
//!
//! forward  (rows in order):   x <- A_t x + b_t;            out_t = x
//! adjoint  (rows reversed):   out_t = x + g_t;  x <- A_tᵀ (x + g_t)
//! With x entering row t as λ-contribution from row t+1, the adjoint's out_t is
//! λ_t = g_t + A_{t+1}ᵀ λ_{t+1}, and the x left after a segment's first row is A_startᵀ λ_start,
//! the gradient of the segment's initial state. Both forms only ever read A at the row they
//! process, so a rank never needs its neighbour's rows. At a segment head (first row forward,
//! last row adjoint) x is replaced by the segment's initial value (init[s], or zero). After the
//! segment's last processed row, x is written to fin[s] (forward: final state; adjoint: d init).
//! Aggregates are affine maps x_in -> M x_in + v, stored as [M (structure layout), v (d), reset (1)]
//! and zeros up to a whole number of 64-byte lines.
//! reset = 1 when a segment head lies inside the span: the map is then the constant v, and every
//! consumer selects v instead of forming M x_in + v (M is 0 there, but 0 * NaN is NaN: a non-finite
//! value of one segment would leak into the next one). The same selection in compose() keeps the
//! lifted monoid associative, so resets survive block, tile and rank boundaries exactly.

#include <loom/scan/detail/monoid_kernel.hpp>
#include <loom/scan/detail/stream.hpp>
#include <loom/scan/structure.hpp>

#include <type_traits>

namespace loom::scan::detail {

//! A recurrence's aggregate [M, v, reset], in Acc units, padded to whole 64-byte lines.
template <class Acc>
constexpr index_t recurrence_agg_size(index_t a_size, index_t d) {
  constexpr index_t line = 64 / static_cast<index_t>(sizeof(Acc));
  return (a_size + d + 1 + line - 1) / line * line;
}

template <class St, class TA, class TB, class TH, class TI, class Acc>
struct recurrence_kernel {
  using agg_type = Acc;
  const TA* a;
  index_t a_stride;
  const TB* b;
  index_t b_stride;
  TH* h;
  index_t h_stride;
  const TI* init;  //!< [segments or 1, d] initial values, or null for zeros
  index_t init_stride;
  TH* fin;  //!< [segments or 1, d] values after each segment, or null
  index_t fin_stride;
  heads hd;
  index_t d;
  bool adjoint;
  bool first_window;  //!< this window holds global position 0 (used when there are no segments)
  index_t carry_size, agg_size, scratch_size;

  recurrence_kernel(const TA* a_, index_t as, const TB* b_, index_t bs, TH* h_, index_t hs, const TI* init_, index_t is,
                    TH* fin_, index_t fs, heads hd_, index_t d_, bool adj, bool first)
      : a(a_),
        a_stride(as),
        b(b_),
        b_stride(bs),
        h(h_),
        h_stride(hs),
        init(init_),
        init_stride(is),
        fin(fin_),
        fin_stride(fs),
        hd(hd_),
        d(d_),
        adjoint(adj),
        first_window(first) {
    carry_size = d;
    // [M, v, reset] padded to whole 64-byte lines, so the engine's arrays after the aggregates keep
    // the alignment of the state rows (the scratch rows are vectorized)
    agg_size = recurrence_agg_size<Acc>(St::a_size(d), d);
    scratch_size = 2 * St::a_size(d) + 2 * d;
  }

  LOOM_HD index_t row(index_t p) const { return hd.reverse ? hd.count - 1 - p : p; }
  //! Position after which the segment holding p ends, in window positions (may lie outside).
  LOOM_HD index_t segment_end(index_t p) const {
    if (hd.segments == 0) return hd.total - hd.base;
    const index_t s = hd.last_at_or_before(p) + 1;
    return s < hd.segments ? hd.at(s) : hd.total - hd.base;
  }
  LOOM_HD index_t segment_of(index_t p) const { return hd.segments == 0 ? 0 : hd.segment(hd.last_at_or_before(p)); }
  LOOM_HD void load_init(index_t seg, Acc* x) const {
    for (index_t c = 0; c < d; ++c) x[c] = init ? static_cast<Acc>(init[seg * init_stride + c]) : Acc(0);
  }
  //! One row applied to vector x (into y): forward A x + b, adjoint Aᵀ (x + g) (x is changed).
  LOOM_HD void step_vec(index_t t, Acc* x, Acc* y) const {
    const TA* at = a + t * a_stride;
    const TB* bt = b + t * b_stride;
    if (adjoint) {
      for (index_t c = 0; c < d; ++c) x[c] += static_cast<Acc>(bt[c]);
      St::matvec(at, true, d, x, y);
    } else {
      St::matvec(at, false, d, x, y);
      for (index_t c = 0; c < d; ++c) y[c] += static_cast<Acc>(bt[c]);
    }
  }

  //! Diagonal A, forward: y = a_t * x + b_t and, when mo is set, mo = a_t * m, in one pass over the
  //! d lanes (the arrays do not overlap), so the compiler vectorises it without alias checks.
  LOOM_HD void diagonal_step(index_t t, const Acc* __restrict__ x, Acc* __restrict__ y, const Acc* __restrict__ m,
                             Acc* __restrict__ mo) const {
    const TA* __restrict__ at = a + t * a_stride;
    const TB* __restrict__ bt = b + t * b_stride;
    if (mo) {
      for (index_t c = 0; c < d; ++c) {
        const Acc ac = static_cast<Acc>(at[c]);
        y[c] = ac * x[c] + static_cast<Acc>(bt[c]);
        mo[c] = ac * m[c];
      }
    } else {
      for (index_t c = 0; c < d; ++c) y[c] = static_cast<Acc>(at[c]) * x[c] + static_cast<Acc>(bt[c]);
    }
  }
  static constexpr bool fused_diagonal = std::is_same_v<St, diagonal>;

  LOOM_HD void identity_agg(Acc* agg) const {
    St::identity(d, agg);
    for (index_t e = St::a_size(d); e < agg_size; ++e) agg[e] = Acc(0);
  }
  //! Whether aggregate g holds a segment head (its map ignores what enters it).
  LOOM_HD bool resets(const Acc* g) const { return g[St::a_size(d) + d] != Acc(0); }

  //! The value entering global position 0.
  LOOM_HD void global_init_carry(Acc* c) const {
    if (hd.segments == 0)
      load_init(0, c);
    else
      for (index_t k = 0; k < d; ++k) c[k] = Acc(0);
  }
  LOOM_HD void init_carry(Acc* c) const {
    if (first_window)
      global_init_carry(c);
    else
      for (index_t k = 0; k < d; ++k) c[k] = Acc(0);
  }

  //! Before the first head the block's map is composed row by row (M and v); from a head on the map
  //! is constant, so only v is carried (restarted from the segment's initial value).
  LOOM_HD void reduce(index_t begin, index_t end, Acc* agg, Acc* scratch) const {
    const index_t asz = St::a_size(d);
    Acc *m0 = scratch, *m1 = scratch + asz, *x0 = scratch + 2 * asz, *x1 = x0 + d;
    St::identity(d, m0);
    for (index_t c = 0; c < d; ++c) x0[c] = Acc(0);
    index_t next = hd.segments == 0 ? hd.count : hd.first_at_or_after(begin);
    bool reset = false;
    for (index_t p = begin; p < end; ++p) {
      const index_t t = row(p);
      if (p == next) {
        reset = true;
        load_init(segment_of(p), x0);
        next = hd.next_after(p);
      }
      if (reset) {
        if (fused_diagonal && !adjoint)
          diagonal_step(t, x0, x1, nullptr, nullptr);
        else
          step_vec(t, x0, x1);
      } else {
        if (fused_diagonal && !adjoint) {
          diagonal_step(t, x0, x1, m0, m1);
        } else {
          step_vec(t, x0, x1);
          St::matmat(a + t * a_stride, adjoint, d, m0, m1);
        }
        Acc* tm = m0;
        m0 = m1;
        m1 = tm;
      }
      Acc* tx = x0;
      x0 = x1;
      x1 = tx;
    }
    for (index_t e = 0; e < asz; ++e) agg[e] = reset ? Acc(0) : m0[e];
    for (index_t c = 0; c < d; ++c) agg[asz + c] = x0[c];
    agg[asz + d] = reset ? Acc(1) : Acc(0);
    for (index_t e = asz + d + 1; e < agg_size; ++e) agg[e] = Acc(0);
  }

  //! out = the carry after a span: agg's v when the span holds a head (selected, never 0 * carry),
  //! else M carry + v.
  LOOM_HD void advance(const Acc* carry, const Acc* agg, Acc* out) const {
    const index_t asz = St::a_size(d);
    if (resets(agg)) {
      for (index_t c = 0; c < d; ++c) out[c] = agg[asz + c];
      return;
    }
    St::matvec(agg, false, d, carry, out);
    for (index_t c = 0; c < d; ++c) out[c] += agg[asz + c];
  }

  //! The aggregate of `first` then `second`: second itself when it holds a head, else
  //! (M2 M1, M2 v1 + v2) with first's reset flag.
  LOOM_HD void compose(const Acc* first, const Acc* second, Acc* out) const {
    const index_t asz = St::a_size(d);
    if (resets(second)) {
      for (index_t e = 0; e < agg_size; ++e) out[e] = second[e];
      return;
    }
    if (resets(first))
      for (index_t e = 0; e < asz; ++e) out[e] = Acc(0);  // a constant map stays constant
    else
      St::matmat(second, false, d, first, out);
    St::matvec(second, false, d, first + asz, out + asz);
    for (index_t c = 0; c < d; ++c) out[asz + c] += second[asz + c];
    out[asz + d] = first[asz + d];
    for (index_t e = asz + d + 1; e < agg_size; ++e) out[e] = Acc(0);
  }

  //! ht[0, d) = y. On x86 hosts, a state of 16 bytes or more in the accumulation type goes to
  //! memory with non-temporal stores (see stream.hpp; scan() fences them).
  LOOM_HD void store_row(TH* ht, const Acc* y) const {
#if LOOM_SCAN_STREAM_STORES && !LOOM_IN_DEVICE_CODE
    if constexpr (std::is_same_v<TH, Acc> && streamable<TH>) {
      if (d * static_cast<index_t>(sizeof(TH)) >= 16) {
        stream_copy(y, ht, d);
        return;
      }
    }
#endif
    for (index_t c = 0; c < d; ++c) ht[c] = static_cast<TH>(y[c]);
  }

  LOOM_HD void scan(index_t begin, index_t end, const Acc* carry, Acc* scratch) const {
#if LOOM_SCAN_STREAM_STORES && !LOOM_IN_DEVICE_CODE
    struct fence_at_exit {
      ~fence_at_exit() { stream_fence(); }
    } fence;
#endif
    Acc *x = scratch, *y = scratch + d;
    for (index_t c = 0; c < d; ++c) x[c] = carry[c];
    index_t next = hd.segments == 0 ? hd.count : hd.first_at_or_after(begin);
    for (index_t p = begin; p < end; ++p) {
      const index_t t = row(p);
      if (p == next) {
        load_init(segment_of(p), x);
        next = hd.next_after(p);
      }
      TH* ht = h + t * h_stride;
      if (adjoint) {
        for (index_t c = 0; c < d; ++c) ht[c] = static_cast<TH>(x[c] + static_cast<Acc>(b[t * b_stride + c]));
        step_vec(t, x, y);
      } else {
        if (fused_diagonal)
          diagonal_step(t, x, y, nullptr, nullptr);
        else
          step_vec(t, x, y);
        store_row(ht, y);
      }
      Acc* tmp = x;
      x = y;
      y = tmp;
      if (fin && segment_end(p) == p + 1) {
        TH* f = fin + segment_of(p) * fin_stride;
        for (index_t c = 0; c < d; ++c) f[c] = static_cast<TH>(x[c]);
      }
    }
  }
};

//! fin[s] = init[s] (or zero) for every empty segment s.
template <class TH, class TI>
struct empty_segments_step {
  offsets_ref offsets;
  const TI* init;
  index_t init_stride;
  TH* fin;
  index_t fin_stride;
  index_t d;
  LOOM_HD void operator()(index_t s) const {
    if (offsets[s] != offsets[s + 1]) return;
    for (index_t c = 0; c < d; ++c)
      fin[s * fin_stride + c] = init ? static_cast<TH>(init[s * init_stride + c]) : static_cast<TH>(0.0f);
  }
};

//! fin[c] = init[c] (or zero): the one segment of an empty sequence.
template <class TH, class TI>
struct empty_row_step {
  const TI* init;
  TH* fin;
  LOOM_HD void operator()(index_t c) const { fin[c] = init ? static_cast<TH>(init[c]) : static_cast<TH>(0.0f); }
};

}  // namespace loom::scan::detail
