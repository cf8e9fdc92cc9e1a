#pragma once

//! @file
//! The per-row LOOM_HD functors of the Newton solver, its fallbacks and its backward pass. Every
//! functor works on a window of rows [0, n) of a global packed sequence (global row base + t),
//! so the same code serves one device and one rank of a sequence-parallel solve.

#include <loom/config.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/rnn/detail/math.hpp>
#include <loom/scan/detail/monoid_kernel.hpp>

#include <cmath>

namespace loom::rnn::detail {

//! Where local row t lies: its sequence and whether it starts it.
struct row_map {
  scan::detail::offsets_ref offsets{};  //!< S + 1 global offsets (int32 or int64); null: one sequence
  index_t segs = 1;
  index_t base = 0;  //!< global index of local row 0
  LOOM_HD index_t segment_of(index_t t) const {
    if (!offsets) return 0;
    return loom::segment_of(offsets, segs, base + t);
  }
  LOOM_HD bool starts(index_t t, index_t s) const { return offsets ? offsets[s] == base + t : base + t == 0; }
  //! The local rows [begin, end) of sequence s within a window of n rows (all n for one sequence).
  struct rows {
    index_t begin, end;
  };
  LOOM_HD rows local_rows(index_t s, index_t n) const {
    if (!offsets) return {0, n};
    const index_t b = offsets[s] - base, e = offsets[s + 1] - base;
    return {b < 0 ? 0 : (b > n ? n : b), e < 0 ? 0 : (e > n ? n : e)};
  }
};

//! h_{t-1} of local row t: the previous row, the sequence's initial state (zeros when absent),
//! or, for row 0 of a rank whose first row continues a sequence, the halo row from the left.
template <class T>
struct prev_rows {
  const T* h;
  index_t hs;
  const T* init;  //!< [S, d] or null
  index_t init_s;
  const T* halo;   //!< the row before local row 0, or null
  const T* zeros;  //!< d zeros
  LOOM_HD const T* operator()(const row_map& m, index_t t, index_t s) const {
    if (m.starts(t, s)) return init ? init + s * init_s : zeros;
    return t > 0 ? h + (t - 1) * hs : halo;
  }
};

//! The cell and what it reads at local row t: the entering state h_{t-1} and the input row x_t.
template <class Cell>
struct cell_rows {
  using T = typename Cell::value_type;
  Cell cell;
  row_map map;
  prev_rows<T> prev;
  const T* x;
  index_t xs;
  //! h_{t-1} of local row t, which lies in sequence s.
  LOOM_HD const T* h_prev(index_t t, index_t s) const { return prev(map, t, s); }
  //! x_t.
  LOOM_HD const T* x_row(index_t t) const { return x + t * xs; }
};

//! max_c |h − f| / (atol + rtol |h|) for one row; NaN and inf iterates map to +inf, a finite
//! residual to a finite value (clamped at 1e300).
template <class T>
LOOM_HD double scaled_residual(const T* h, const T* f, index_t d, double atol, double rtol) {
  double m = 0;
  for (index_t c = 0; c < d; ++c) {
    const double hv = static_cast<double>(h[c]), fv = static_cast<double>(f[c]);
    if (!finite(hv) || !finite(fv)) return INFINITY;
    const double r = hv - fv, ah = hv < 0 ? -hv : hv;
    const double ar = r < 0 ? -r : r, den = atol + rtol * ah;
    const double v = ar <= den * 1e300 ? ar / den : 1e300;
    if (v > m) m = v;
  }
  return m;
}

enum class lin_mode : int { newton, quasi, picard, damped, residual };

//! Linearizes the cell at the iterate h, row by row (rows of frozen sequences are skipped):
//!   newton:   f, A = ∂f/∂h (structure), rhs = f − A h_{t-1}
//!   quasi:    f, A (scratch), ad = diag(A), rhs = f − ad ⊙ h_{t-1}
//!   picard:   f, as = 1, rhs = f − h_{t-1}
//!   damped:   f, A (the damped system is assembled once μ is known)
//!   residual: f only
//! and always norm[t] = the scaled residual of row t.
template <class Cell, class St>
struct linearize_step {
  using T = typename Cell::value_type;
  cell_rows<Cell> rows;
  T* f;               //!< [n, d]
  T* a;               //!< [n, a_size] (newton, quasi, damped)
  T* ad;              //!< [n, d] (quasi) or [n] (picard)
  T* rhs;             //!< [n, d]
  double* norm;       //!< [n]
  const int* frozen;  //!< [S] or null
  index_t d;
  double atol, rtol;
  lin_mode mode;
  LOOM_HD void operator()(index_t t) const {
    const index_t s = rows.map.segment_of(t);
    if (frozen && frozen[s]) return;
    const T* hp = rows.h_prev(t, s);
    const T* xt = rows.x_row(t);
    T* ft = f + t * d;
    const index_t as = St::a_size(d);
    if (mode == lin_mode::residual || mode == lin_mode::picard)
      rows.cell.step(hp, xt, ft);
    else
      rows.cell.linearize(hp, xt, ft, a + t * as);
    T* r = rhs + t * d;
    if (mode == lin_mode::newton) {
      St::matvec(a + t * as, false, d, hp, r);
      for (index_t c = 0; c < d; ++c) r[c] = ft[c] - r[c];
    } else if (mode == lin_mode::quasi) {
      const T* at = a + t * as;
      T* dt = ad + t * d;
      for (index_t c = 0; c < d; ++c) {
        if constexpr (St::a_rank == 1)
          dt[c] = at[0];
        else if constexpr (St::a_rank == 2)
          dt[c] = at[c];
        else if constexpr (St::a_rank == 4)
          dt[c] = at[(c / St::block) * St::block * St::block + (c % St::block) * (St::block + 1)];
        else
          dt[c] = at[c * d + c];
        r[c] = ft[c] - dt[c] * hp[c];
      }
    } else if (mode == lin_mode::picard) {
      ad[t] = T(1);
      for (index_t c = 0; c < d; ++c) r[c] = ft[c] - hp[c];
    }
    norm[t] = scaled_residual(h_row(t), ft, d, atol, rtol);
  }
  LOOM_HD const T* h_row(index_t t) const { return rows.prev.h + t * rows.prev.hs; }
};

//! Rows of frozen (converged) sequences reproduce themselves in the next solve: A = 0, rhs = h
//! (or rhs = 0 in the damped, increment form).
template <class T>
struct freeze_step {
  row_map map;
  const int* frozen;
  T* a;
  index_t as;  //!< elements of A per row
  T* rhs;
  const T* h;
  index_t hs;
  index_t d;
  bool increment;
  LOOM_HD void operator()(index_t t) const {
    if (!frozen[map.segment_of(t)]) return;
    for (index_t e = 0; e < as; ++e) a[t * as + e] = T(0);
    for (index_t c = 0; c < d; ++c) rhs[t * d + c] = increment ? T(0) : h[t * hs + c];
  }
};

//! The damped (Levenberg–Marquardt-style) system of the increment δ: (1 + μ) δ_t − A_t δ_{t-1} =
//! f_t − h_t, i.e. the scan δ_t = A_t/(1 + μ) δ_{t-1} + (f_t − h_t)/(1 + μ), μ per sequence.
template <class T>
struct damped_assemble_step {
  row_map map;
  const int* frozen;
  const double* mu;
  T* a;
  index_t as;
  const T* f;
  const T* h;
  index_t hs;
  T* rhs;
  index_t d;
  LOOM_HD void operator()(index_t t) const {
    const index_t s = map.segment_of(t);
    if (frozen[s]) return;
    const T k = static_cast<T>(1.0 / (1.0 + mu[s]));
    for (index_t e = 0; e < as; ++e) a[t * as + e] *= k;
    for (index_t c = 0; c < d; ++c) rhs[t * d + c] = (f[t * d + c] - h[t * hs + c]) * k;
  }
};

//! out = h + δ (every row), the damped candidate.
template <class T>
struct add_step {
  const T* h;
  index_t hs;
  const T* delta;
  T* out;
  index_t d;
  LOOM_HD void operator()(index_t t) const {
    for (index_t c = 0; c < d; ++c) out[t * d + c] = h[t * hs + c] + delta[t * d + c];
  }
};

//! h = src for the rows of sequences with take[s] != 0.
template <class T>
struct take_rows_step {
  row_map map;
  const int* take;
  const T* src;
  index_t ss;
  T* h;
  index_t hs;
  index_t d;
  LOOM_HD void operator()(index_t t) const {
    if (!take[map.segment_of(t)]) return;
    for (index_t c = 0; c < d; ++c) h[t * hs + c] = src[t * ss + c];
  }
};

//! Sets the rows of sequences with which[s] != 0 to zero (or every row when which is null).
template <class T>
struct zero_rows_step {
  row_map map;
  const int* which;
  T* h;
  index_t hs;
  index_t d;
  LOOM_HD void operator()(index_t t) const {
    if (which && !which[map.segment_of(t)]) return;
    for (index_t c = 0; c < d; ++c) h[t * hs + c] = T(0);
  }
};

//! The largest norm[t] over the local rows of sequence s (0 for none), one sequence per call.
struct segment_max_step {
  row_map map;
  index_t n;
  const double* norm;
  double* out;
  LOOM_HD void operator()(index_t s) const {
    const auto [b, e] = map.local_rows(s, n);
    double m = 0;
    for (index_t t = b; t < e; ++t) m = norm[t] > m ? norm[t] : m;
    out[s] = m;
  }
};

//! The exact sequential evaluation of the sequences with which[s] != 0 (all when null), one
//! sequence per call, over its local rows (prev gives the entering state).
template <class Cell>
struct sequential_step {
  using T = typename Cell::value_type;
  cell_rows<Cell> rows;
  T* h;
  index_t hs;
  const int* which;
  index_t n;
  LOOM_HD void operator()(index_t s) const {
    if (which && !which[s]) return;
    const auto [b, e] = rows.map.local_rows(s, n);
    for (index_t t = b; t < e; ++t) rows.cell.step(rows.h_prev(t, s), rows.x_row(t), h + t * hs);
  }
};

//! Backward, per chunk of rows: dx_t = (∂f/∂x)ᵀ λ_t and the chunk's partial sum of (∂f/∂θ)ᵀ λ_t
//! into part[chunk, :] (chunks fixed by n alone, so the sum's bits do not depend on threads).
template <class Cell>
struct vjp_chunk_step {
  using T = typename Cell::value_type;
  cell_rows<Cell> rows;
  const T* lambda;
  index_t d;
  T* dx;
  index_t dxs;
  T* part;
  index_t np;
  index_t chunk, n;
  LOOM_HD void operator()(index_t k) const {
    T* p = part + k * np;
    for (index_t e = 0; e < np; ++e) p[e] = T(0);
    const index_t b = k * chunk, e = b + chunk < n ? b + chunk : n;
    for (index_t t = b; t < e; ++t) {
      const index_t s = rows.map.segment_of(t);
      rows.cell.vjp(rows.h_prev(t, s), rows.x_row(t), lambda + t * d, dx + t * dxs, p);
    }
  }
};

//! out[e] = Σ_k part[k, e], in chunk order.
template <class T>
struct sum_parts_step {
  const T* part;
  index_t chunks, np;
  T* out;
  LOOM_HD void operator()(index_t e) const {
    T s = T(0);
    for (index_t k = 0; k < chunks; ++k) s += part[k * np + e];
    out[e] = s;
  }
};

//! ptr[i] = v (one element; host-to-device writes of a few scalars go through the loops).
template <class T>
struct store_step {
  T* ptr;
  T v;
  LOOM_HD void operator()(index_t) const { *ptr = v; }
};

//! |value| of element i of a [rows, cols] array with row stride rs, +inf for NaN or inf.
template <class T>
struct abs_of {
  const T* p;
  index_t cols, rs;
  LOOM_HD double operator()(index_t i) const {
    const double v = static_cast<double>(p[(i / cols) * rs + i % cols]);
    if (!finite(v)) return INFINITY;
    return v < 0 ? -v : v;
  }
};

struct max_op {
  LOOM_HD double operator()(double a, double b) const { return a < b ? b : a; }
};

}  // namespace loom::rnn::detail
