#pragma once

//! @file
//! The forward work of chunked linear attention as LOOM_HD functors (one body for every backend).
//! Notation, per head and chunk of n tokens: b_i = sum of the log-gates of tokens 0..i of the chunk
//! (inclusive, so b is non-increasing), a = exp(b_{n-1}) the chunk's decay, S0 the state before it:
//!   o_i   = scale (exp(b_i) S0^T q_i + sum_{j<=i} exp(b_i - b_j) (q_i . k_j) v_j)
//!   S_end = a S0 + L,   L = sum_j exp(b_{n-1} - b_j) k_j v_j^T
//! Only values <= 0 are exponentiated, directly or as exp(b_i) exp(-b_j) when the chunk's total
//! log-decay is small enough (>= -decay_split) that both factors stay well inside the range: no
//! overflow for any log-gate magnitude. A log-gate at or below full_decay_log_gate (down to -inf) is
//! full decay, a gate of exactly 0: in a chunk holding one, b restarts at 0 after each such token
//! and every factor that spans one is 0, selected, not computed as exp(-huge) from sums that would
//! overflow or lose their bits (mode 3 below).
//!
//! Every product is a small dense one, C (C x n) += A (C x K) B (K x n), done by tile_product on
//! tile_rows x tile_cols tiles whose accumulators the compiler keeps in vector registers (unit
//! stride over the tile's columns, the A element broadcast); on AVX2 hosts in blocks of 4 x 16
//! (loom::detail::x86::gemm_rows), since the whole tile needs 32 AVX2 registers. The lane's scratch holds the chunk's
//! operands zero-padded to multiples of tile_cols, so every tile is full and every loop is a
//! fixed-trip, unit-stride one.

#include <loom/backend/detail/item_counter.hpp>
#include <loom/backend/detail/x86_gemm.hpp>
#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/linear_attention/detail/layout.hpp>
#include <loom/scan/monoid.hpp>

#include <cmath>
#include <type_traits>

namespace loom::linear_attention::detail {

LOOM_HD inline float exp_acc(float x) { return expf(x); }
LOOM_HD inline double exp_acc(double x) { return exp(x); }

//! S <- a S + L: scan's affine combine of "S, then the step (a, L)", the one expression every
//! state pass and LASP-2's fold use (so the fused and the chunk-parallel paths, and the ranks'
//! folds, produce the same bits).
template <class A>
LOOM_HD inline A decay_add(A a, A s, A l) {
  return scan::affine<A>{}.combine({A(1), s}, {a, l}).b;
}

//! The largest -b_{n-1} for which exp(b_i - b_j) is evaluated as exp(b_i) exp(-b_j).
inline constexpr double decay_split = 40.0;

//! The smallest log-gate the kernels use: a log-gate below it (down to -inf, a gate of 0) is full
//! decay and is read as this value. Its exponential, and that of every sum or difference of
//! log-gates that includes it, is exactly 0 in A (exp underflows to 0 below about -103.97 in float
//! and -745.13 in double; the margin covers the rounding of cumulative sums), while every
//! cumulative log-gate stays far inside A's range: a chunk of C tokens sums to at least C times it,
//! so no huge gate overflows to -inf and no inf - inf or 0 * inf arises. As small in magnitude as
//! that allows: the cumulative sums after a full decay keep as many bits as possible.
template <class A>
LOOM_HD constexpr A full_decay_log_gate() {
  return sizeof(A) >= 8 ? A(-800) : A(-112);
}

//! Log-gate of token t, head h: 0 (no decay), log_gate[h] (fixed) or log_gate[t*st + h*sh], at
//! least full_decay_log_gate (a NaN stays a NaN).
template <class A>
struct gate_ref {
  const A* log_gate = nullptr;  //!< null: no decay
  index_t stride_t = 0;         //!< 0 for a fixed per-head decay
  index_t stride_h = 1;
  LOOM_HD A operator()(index_t t, index_t h) const {
    if (!log_gate) return A(0);
    const A x = log_gate[t * stride_t + h * stride_h];
    return x < full_decay_log_gate<A>() ? full_decay_log_gate<A>() : x;
  }
};

//! c[R x W] (row stride ldc) = sum_{k < n1} a1(r, k) b1[k, :] + sum_{k < n2} a2(r, k) b2[k, :], with
//! a(r, k) = a[r * ar + k * ak] and b rows of W contiguous elements (row stride ldb). Fixed loop
//! order (k ascending, first term then second): the bits depend on nothing but the operands.
template <class A>
LOOM_HD inline void tile_product(A* c, index_t ldc, const A* a1, index_t ar1, index_t ak1, const A* b1, index_t ldb1,
                                 index_t n1, const A* a2, index_t ar2, index_t ak2, const A* b2, index_t ldb2,
                                 index_t n2) {
  constexpr index_t R = tile_rows, W = tile_cols;
#if defined(LOOM_X86_KERNELS) && !LOOM_IN_DEVICE_CODE && !defined(__AVX512F__)
  // AVX2 hosts (unless the build targets AVX-512, whose 32 registers hold this tile): four blocks
  // of 4 rows x 16 columns, each term a fused multiply-add, the first product then the second.
  static_assert(R % 4 == 0, "the AVX2 form takes the tile's rows four at a time");
  if constexpr (std::is_same_v<A, float>)
    if (loom::detail::x86::avx2_available()) {
      for (index_t r0 = 0; r0 < R; r0 += 4) {
        loom::detail::x86::gemm_rows<4>(W, n1, a1 + r0 * ar1, ar1, ak1, b1, ldb1, c + r0 * ldc, ldc, false);
        if (n2 > 0) loom::detail::x86::gemm_rows<4>(W, n2, a2 + r0 * ar2, ar2, ak2, b2, ldb2, c + r0 * ldc, ldc, true);
      }
      return;
    }
#endif
  A acc[R][W];
  for (index_t r = 0; r < R; ++r)
    for (index_t x = 0; x < W; ++x) acc[r][x] = A(0);
  for (index_t k = 0; k < n1; ++k) {
    const A* bk = b1 + k * ldb1;
    const A* ak = a1 + k * ak1;
    for (index_t r = 0; r < R; ++r) {
      const A av = ak[r * ar1];
      for (index_t x = 0; x < W; ++x) acc[r][x] += av * bk[x];
    }
  }
  for (index_t k = 0; k < n2; ++k) {
    const A* bk = b2 + k * ldb2;
    const A* ak = a2 + k * ak2;
    for (index_t r = 0; r < R; ++r) {
      const A av = ak[r * ar2];
      for (index_t x = 0; x < W; ++x) acc[r][x] += av * bk[x];
    }
  }
  for (index_t r = 0; r < R; ++r)
    for (index_t x = 0; x < W; ++x) c[r * ldc + x] = acc[r][x];
}

//! Everything a chunk kernel reads or writes; copied by value into every functor.
template <class S, class A, class Space>
struct problem {
  tensor_view<const S, 3, Space> q, k, v;
  gate_ref<A> gate;
  const chunk_info* chunks = nullptr;
  const index_t* doc_chunk = nullptr;
  index_t n_chunks = 0, docs = 0, heads = 0, dk = 0, dv = 0, c = 0;
  index_t group = 1, groups = 0;  //!< heads per forward work item (<= max_head_group), ceil(H / group)
  A scale = A(1);
  A* states = nullptr;     //!< [chunks, H, dk, dv]: L of each chunk, then the state before it
  A* log_decay = nullptr;  //!< [chunks, H]: b_{n-1} of each chunk
  A* scratch = nullptr;    //!< [lanes, lane_floats]
  index_t lanes = 1, lane_stride = 0;
  index_t* next = nullptr;  //!< host backends: the launch's shared item counter (driver.hpp's launch)

  //! A lane's first item, and the item it takes after `item` (loom::detail::take_item: from the
  //! shared counter where there is one, else lane, lane + lanes, ...). Every item computes the same
  //! bits whichever lane runs it (its state starts from its inputs, in its lane's scratch).
  LOOM_HD index_t first_item(index_t lane) const { return loom::detail::take_item(next, lane); }
  LOOM_HD index_t next_item(index_t item) const { return loom::detail::take_item(next, item + lanes); }

  LOOM_HD A* state(index_t chunk, index_t h) const { return states + (chunk * heads + h) * dk * dv; }

  //! Loads the chunk into the lane's scratch: Q [n, dk], K^T [dk, C], V [n, dv], b [n] and the
  //! epochs ep [n] (see log_gates). (The backward kernels' layout.) Returns whether the chunk holds a
  //! full-decay token.
  LOOM_HD bool load(const chunk_info& ci, index_t h, A* qs, A* kt, A* vs, A* b, A* ep) const {
    const index_t n = ci.end - ci.begin;
    const bool resets = log_gates(ci.begin, n, h, b, ep);
    for (index_t i = 0; i < n; ++i) {
      const index_t t = ci.begin + i;
      for (index_t d = 0; d < dk; ++d) qs[i * dk + d] = static_cast<A>(q(t, h, d));
      for (index_t d = 0; d < dk; ++d) kt[d * c + i] = static_cast<A>(k(t, h, d));
      for (index_t e = 0; e < dv; ++e) vs[i * dv + e] = static_cast<A>(v(t, h, e));
    }
    return resets;
  }

  //! b[i] = the sum of the log-gates of tokens begin + 0..i of head h and ep[i] = 0, for m tokens,
  //! unless a token of them is full decay (log-gate <= full_decay_log_gate): then ep[i] counts those
  //! at or before i (the epoch) and b restarts at 0 at each, so b[i] - b[j] is the log-decay from j
  //! to i inside one epoch and the decay is 0 across epochs. Returns whether one was found. Without
  //! one, the sums are the plain running sums (the same bits as ever).
  LOOM_HD bool log_gates(index_t begin, index_t m, index_t h, A* b, A* ep) const {
    A acc = A(0), epoch = A(0);
    for (index_t i = 0; i < m; ++i) {
      const A g = gate(begin + i, h);
      if (g <= full_decay_log_gate<A>()) {
        epoch += A(1);
        acc = A(0);
      } else {
        acc += g;
      }
      b[i] = acc;
      ep[i] = epoch;
    }
    return epoch != A(0);
  }
};

//! The decay from token j to token i >= j of a chunk (the product of the gates in (j, i]) from its
//! log-gates b and epochs ep (problem::log_gates): 0 across a full-decay token.
template <class A>
LOOM_HD inline A decay_between(const A* b, const A* ep, index_t i, index_t j) {
  return ep[i] == ep[j] ? exp_acc(b[i] - b[j]) : A(0);
}

//! Copies row (t, h) of x, times f, into dst[0, m) and zeros dst[m, mp).
template <class S, class A, class Space>
LOOM_HD inline void load_row(A* dst, const tensor_view<const S, 3, Space>& x, index_t t, index_t h, index_t m,
                             index_t mp, A f) {
  const S* src = x.data() + t * x.stride(0) + h * x.stride(1);
  const index_t st = x.stride(2);
  if (st == 1)
    for (index_t d = 0; d < m; ++d) dst[d] = static_cast<A>(src[d]) * f;
  else
    for (index_t d = 0; d < m; ++d) dst[d] = static_cast<A>(src[d * st]) * f;
  for (index_t d = m; d < mp; ++d) dst[d] = A(0);
}

//! One lane's scratch for the forward kernels on a group of g <= max_head_group heads of one
//! chunk; every block padded: cp = C, kp = dk, vp = dv rounded up to tile_cols. Shared by the group:
//!   pm [cp, cp]  the masked, decayed scores
//!   lt [kp, vp]  the chunk's own state L
//! and per head slot s:
//!   qs [cp, kp]  queries times scale (and exp(b_i) once the scores are done)
//!   kt [kp, cp]  keys transposed (only when the scores are needed)
//!   vs [cp, vp]  values        os [cp, vp]  the output tile        s0 [kp, vp]  the state before
//!   b, u, w [cp] cumulative log-gate, exp(b), exp(-b)
//!   ks [cp, kp]  keys; scaled in place by exp(b_{n-1} - b_j) for the chunk state
//! The group's rows are staged token by token (consecutive heads are contiguous in memory), so the
//! loads of a chunk stream through memory instead of striding over it.
template <class A>
struct lane_tiles {
  index_t cp, kp, vp, slot;
  A *pm, *lt, *slots;

  LOOM_HD lane_tiles(A* base, index_t c, index_t dk, index_t dv)
      : cp(round_up(c, tile_cols)), kp(round_up(dk, tile_cols)), vp(round_up(dv, tile_cols)) {
    slot = forward_slot_floats(c, dk, dv);
    pm = base;
    lt = pm + cp * cp;
    slots = lt + kp * vp;
  }
  LOOM_HD A* qs(index_t s) const { return slots + s * slot; }
  LOOM_HD A* kt(index_t s) const { return qs(s) + cp * kp; }
  LOOM_HD A* vs(index_t s) const { return kt(s) + kp * cp; }
  LOOM_HD A* os(index_t s) const { return vs(s) + cp * vp; }
  LOOM_HD A* s0(index_t s) const { return os(s) + cp * vp; }
  LOOM_HD A* b(index_t s) const { return s0(s) + kp * vp; }
  LOOM_HD A* u(index_t s) const { return b(s) + cp; }
  LOOM_HD A* w(index_t s) const { return u(s) + cp; }
  LOOM_HD A* ks(index_t s) const { return b(s) + round_up(3 * cp, tile_cols); }
};

//! The forward steps on one chunk and a group of heads, shared by the chunk-parallel and the fused
//! kernels. Slot s holds head h0 + s.
template <class S, class A, class Space>
struct chunk_steps {
  const problem<S, A, Space>& p;
  const lane_tiles<A>& l;
  mutable index_t cached[max_head_group];   //!< fixed decay: the head whose b, u, w a slot holds (-1: none)
  mutable int cached_mode[max_head_group];  //!< and its mode

  LOOM_HD chunk_steps(const problem<S, A, Space>& p_, const lane_tiles<A>& l_) : p(p_), l(l_) {
    for (index_t s = 0; s < max_head_group; ++s) cached[s] = -1, cached_mode[s] = 0;
  }

  //! 0: no decay; 1: exp(b_i - b_j) = u_i w_j; 2: evaluated per element; 3: the chunk holds a
  //! full-decay token: per element, w holds the epochs (problem::log_gates), factors across epochs
  //! are 0 and u_i = exp(b_i) in epoch 0 only (the decay from the chunk's start).
  LOOM_HD int gates(const chunk_info& ch, index_t s, index_t h) const {
    const index_t n = ch.end - ch.begin;
    if (!p.gate.log_gate) return 0;
    const bool fixed = p.gate.stride_t == 0;
    // A fixed decay gives the same b for every chunk of the head: computed once for C tokens (its
    // mode, from the first C tokens, covers any shorter chunk).
    if (fixed && cached[s] == h) return cached_mode[s];
    A *b = l.b(s), *u = l.u(s), *w = l.w(s);
    const index_t m = fixed ? p.c : n;
    int mode = 3;
    if (p.log_gates(ch.begin, m, h, b, w)) {
      for (index_t i = 0; i < m; ++i) u[i] = w[i] == A(0) ? exp_acc(b[i]) : A(0);
    } else {
      const bool split = -static_cast<double>(b[m - 1]) <= decay_split;
      for (index_t i = 0; i < m; ++i) u[i] = exp_acc(b[i]);
      if (split)
        for (index_t i = 0; i < m; ++i) w[i] = exp_acc(-b[i]);
      mode = split ? 1 : 2;
    }
    cached[s] = fixed ? h : index_t(-1);
    cached_mode[s] = mode;
    return mode;
  }

  //! The chunk's log-decay (n tokens, slot s): the sum of its log-gates, or full_decay_log_gate when
  //! it holds a full-decay token (its exponential, the chunk's decay, is then exactly 0).
  LOOM_HD A chunk_log_decay(index_t n, index_t s, int mode) const {
    return mode == 0 ? A(0) : mode == 3 ? full_decay_log_gate<A>() : l.b(s)[n - 1];
  }

  //! Stages heads h0 .. h0 + g - 1 of the chunk, token by token: K^T and V, and Q (times scale,
  //! and exp(b_i) in mode 1) when `with_q`. Rows / columns past n are zero.
  LOOM_HD void stage(const chunk_info& ch, index_t h0, index_t g, const int* mode, bool with_q) const {
    const index_t n = ch.end - ch.begin, cp = l.cp, kp = l.kp, vp = l.vp;
    for (index_t i = 0; i < n; ++i) {
      const index_t t = ch.begin + i;
      for (index_t s = 0; s < g; ++s) {
        if (with_q) load_row(l.qs(s) + i * kp, p.q, t, h0 + s, p.dk, kp, mode[s] == 1 ? p.scale * l.u(s)[i] : p.scale);
        load_row(l.ks(s) + i * kp, p.k, t, h0 + s, p.dk, kp, A(1));
        load_row(l.vs(s) + i * vp, p.v, t, h0 + s, p.dv, vp, A(1));
      }
    }
    for (index_t s = 0; s < g; ++s) {
      for (index_t i = n; i < cp; ++i) {
        if (with_q)
          for (index_t d = 0; d < kp; ++d) l.qs(s)[i * kp + d] = A(0);
        for (index_t e = 0; e < vp; ++e) l.vs(s)[i * vp + e] = A(0);
      }
      A *kt = l.kt(s), *ks = l.ks(s);
      for (index_t i = n; i < cp; ++i)
        for (index_t d = 0; d < kp; ++d) ks[i * kp + d] = A(0);
      if (with_q)  // K^T, the B operand of the scores
        for (index_t i0 = 0; i0 < cp; i0 += tile_rows)
          for (index_t d0 = 0; d0 < kp; d0 += tile_rows)
            for (index_t i = i0; i < i0 + tile_rows; ++i)
              for (index_t d = d0; d < d0 + tile_rows; ++d) kt[d * cp + i] = ks[i * kp + d];
    }
  }

  //! The chunk's own state L = sum_j exp(b_{n-1} - b_j) k_j v_j^T of slot s into lt [kp, vp].
  //! Scales ks(s) in place.
  LOOM_HD void chunk_state(index_t n, index_t s, int mode) const {
    A* ks = l.ks(s);
    if (mode != 0) {
      const A *b = l.b(s), *u = l.u(s), *w = l.w(s);
      const A last = b[n - 1], un = u[n - 1];
      for (index_t j = 0; j < n; ++j) {
        const A f = mode == 1 ? un * w[j] : mode == 2 ? exp_acc(last - b[j]) : decay_between(b, w, n - 1, j);
        for (index_t d = 0; d < l.kp; ++d) ks[j * l.kp + d] *= f;
      }
    }
    for (index_t d0 = 0; d0 < l.kp; d0 += tile_rows)
      for (index_t e0 = 0; e0 < l.vp; e0 += tile_cols)
        tile_product(l.lt + d0 * l.vp + e0, l.vp, ks + d0, index_t(1), l.kp, l.vs(s) + e0, l.vp, n, ks, 0, 0, l.vs(s),
                     0, 0);
  }

  //! The masked decayed scores of slot s into pm; afterwards qs(s) rows carry scale exp(b_i).
  LOOM_HD void scores(const chunk_info& ch, index_t s, int mode) const {
    const index_t n = ch.end - ch.begin, cp = l.cp, kp = l.kp;
    A *qs = l.qs(s), *pm = l.pm;
    const A *b = l.b(s), *w = l.w(s);
    for (index_t i0 = 0; i0 < n; i0 += tile_rows) {
      const index_t jn = i0 + tile_rows < n ? i0 + tile_rows : n;  // columns the P V product reads
      for (index_t j0 = 0; j0 < jn; j0 += tile_cols)
        tile_product(pm + i0 * cp + j0, cp, qs + i0 * kp, kp, index_t(1), l.kt(s) + j0, cp, p.dk, qs, 0, 0, qs, 0, 0);
      for (index_t i = i0; i < jn; ++i) {
        A* row = pm + i * cp;
        if (mode == 1) {
          for (index_t j = 0; j <= i; ++j) row[j] *= w[j];
        } else if (mode == 2) {
          const A bi = b[i];
          for (index_t j = 0; j <= i; ++j) row[j] *= exp_acc(bi - b[j]);
        } else if (mode == 3) {
          for (index_t j = 0; j <= i; ++j) row[j] *= decay_between(b, w, i, j);
        }
        for (index_t j = i + 1; j < jn; ++j) row[j] = A(0);
      }
    }
    if (mode >= 2)
      for (index_t i = 0; i < n; ++i) {
        const A f = l.u(s)[i];
        for (index_t d = 0; d < kp; ++d) qs[i * kp + d] *= f;
      }
  }

  //! os(s) = P V + Q' S0 for the chunk's rows.
  LOOM_HD void output(index_t n, index_t s) const {
    const index_t cp = l.cp, kp = l.kp, vp = l.vp;
    for (index_t i0 = 0; i0 < n; i0 += tile_rows) {
      const index_t jn = i0 + tile_rows < n ? i0 + tile_rows : n;
      for (index_t e0 = 0; e0 < vp; e0 += tile_cols)
        tile_product(l.os(s) + i0 * vp + e0, vp, l.pm + i0 * cp, cp, index_t(1), l.vs(s) + e0, vp, jn,
                     l.qs(s) + i0 * kp, kp, index_t(1), l.s0(s) + e0, vp, p.dk);
    }
  }

  //! Writes the output tiles of heads h0 .. h0 + g - 1 to `o` (storage type), token by token.
  LOOM_HD void write(const chunk_info& ch, index_t h0, index_t g, const tensor_view<S, 3, Space>& o) const {
    const index_t st = o.stride(2);
    for (index_t i = 0; i < ch.end - ch.begin; ++i)
      for (index_t s = 0; s < g; ++s) {
        S* dst = o.data() + (ch.begin + i) * o.stride(0) + (h0 + s) * o.stride(1);
        const A* src = l.os(s) + i * l.vp;
        if (st == 1)
          for (index_t e = 0; e < p.dv; ++e) dst[e] = static_cast<S>(src[e]);
        else
          for (index_t e = 0; e < p.dv; ++e) dst[e * st] = static_cast<S>(src[e]);
      }
  }

  //! s0(s) [kp, vp] from a dense [dk, dv] state (null: zero), plus f x (x null: nothing).
  LOOM_HD void set_state(index_t s, const A* src, const A* x, A f) const {
    for (index_t d = 0; d < l.kp; ++d) {
      A* row = l.s0(s) + d * l.vp;
      if (d < p.dk && src) {
        const A* sr = src + d * p.dv;
        if (x) {
          const A* xr = x + d * p.dv;
          for (index_t e = 0; e < p.dv; ++e) row[e] = sr[e] + f * xr[e];
        } else {
          for (index_t e = 0; e < p.dv; ++e) row[e] = sr[e];
        }
        for (index_t e = p.dv; e < l.vp; ++e) row[e] = A(0);
      } else {
        for (index_t e = 0; e < l.vp; ++e) row[e] = A(0);
      }
    }
  }

  //! Work item `item` of a kernel over (unit, head group) items, units counted from `first`: the
  //! unit (a chunk or a document), the group's first head and its number of heads.
  struct group_item {
    index_t unit, h0, g;
  };
  LOOM_HD group_item item_of(index_t item, index_t first) const {
    const index_t h0 = item % p.groups * p.group;
    return {first + item / p.groups, h0, h0 + p.group < p.heads ? p.group : p.heads - h0};
  }

  //! The gates of heads h0 .. h0 + g for one chunk (see gates()).
  LOOM_HD void all_gates(const chunk_info& ch, index_t h0, index_t g, int* mode) const {
    for (index_t s = 0; s < g; ++s) mode[s] = gates(ch, s, h0 + s);
  }

  //! Document d's chunks within [c_lo, c_hi).
  struct chunk_range {
    index_t begin, end;
  };
  LOOM_HD chunk_range chunks_of(index_t d, index_t c_lo, index_t c_hi) const {
    return {p.doc_chunk[d] > c_lo ? p.doc_chunk[d] : c_lo, p.doc_chunk[d + 1] < c_hi ? p.doc_chunk[d + 1] : c_hi};
  }

  //! Chunk ci for heads h0 .. h0 + g: its gates (mode) and its staged rows (stage()).
  LOOM_HD chunk_info begin_chunk(index_t ci, index_t h0, index_t g, int* mode, bool with_queries) const {
    const chunk_info ch = p.chunks[ci];
    all_gates(ch, h0, g, mode);
    stage(ch, h0, g, mode, with_queries);
    return ch;
  }

  //! The states of heads h0 .. h0 + g of document d from `init` [docs, H, dk, dv] (null: zero).
  LOOM_HD void start_states(const A* init, index_t d, index_t h0, index_t g) const {
    for (index_t s = 0; s < g; ++s)
      set_state(s, init ? init + (d * p.heads + h0 + s) * p.dk * p.dv : nullptr, nullptr, A(0));
  }

  //! Slot s's state after a chunk of decay a (1 when mode is 0): S = a S + L.
  LOOM_HD void advance(index_t s, int mode, A log_decay) const {
    const A a = mode != 0 ? exp_acc(log_decay) : A(1);
    A* s0 = l.s0(s);
    for (index_t x = 0, tile = l.kp * l.vp; x < tile; ++x) s0[x] = decay_add(a, s0[x], l.lt[x]);
  }

  //! Writes the states of heads h0 .. h0 + g to document d of `fin` [docs, H, dk, dv] (null: none).
  LOOM_HD void store_states(A* fin, index_t d, index_t h0, index_t g) const {
    if (!fin) return;
    for (index_t s = 0; s < g; ++s) {
      A* out = fin + (d * p.heads + h0 + s) * p.dk * p.dv;
      for (index_t dd = 0; dd < p.dk; ++dd)
        for (index_t e = 0; e < p.dv; ++e) out[dd * p.dv + e] = l.s0(s)[dd * l.vp + e];
    }
  }
};

//! Phase 1, per (chunk, head group): L and the chunk's log-decay. Independent of every incoming
//! state.
template <class S, class A, class Space>
struct chunk_state_kernel {
  problem<S, A, Space> p;
  LOOM_HD void operator()(index_t lane) const {
    const lane_tiles<A> l(p.scratch + lane * p.lane_stride, p.c, p.dk, p.dv);
    int mode[max_head_group];
    const chunk_steps<S, A, Space> st(p, l);
    for (index_t item = p.first_item(lane); item < p.n_chunks * p.groups; item = p.next_item(item)) {
      const auto [ci, h0, g] = st.item_of(item, 0);
      const chunk_info ch = st.begin_chunk(ci, h0, g, mode, false);
      const index_t n = ch.end - ch.begin;
      for (index_t s = 0; s < g; ++s) {
        st.chunk_state(n, s, mode[s]);
        A* out = p.state(ci, h0 + s);
        for (index_t d = 0; d < p.dk; ++d)
          for (index_t e = 0; e < p.dv; ++e) out[d * p.dv + e] = l.lt[d * l.vp + e];
        p.log_decay[ci * p.heads + h0 + s] = st.chunk_log_decay(n, s, mode[s]);
      }
    }
  }
};

//! Phase 2, per (document, head): the sequential pass over the document's chunks. Replaces each
//! chunk's L by the state before the chunk; writes the document's final state when asked.
//! init/fin: [docs, H, dk, dv] or null (a zero initial state; no final state). cum (or null):
//! [chunks, H], for the chunks of document 0, the log-decay from the document's start to the chunk.
template <class S, class A, class Space>
struct state_pass_kernel {
  problem<S, A, Space> p;
  const A* init = nullptr;
  A* fin = nullptr;
  A* cum = nullptr;
  LOOM_HD void operator()(index_t lane) const {
    const index_t sz = p.dk * p.dv;
    A* run = p.scratch + lane * p.lane_stride;
    for (index_t item = p.first_item(lane); item < p.docs * p.heads; item = p.next_item(item)) {
      const index_t d = item / p.heads, h = item % p.heads;
      const A* s0 = init ? init + item * sz : nullptr;
      for (index_t x = 0; x < sz; ++x) run[x] = s0 ? s0[x] : A(0);
      A before = A(0);
      for (index_t ci = p.doc_chunk[d]; ci < p.doc_chunk[d + 1]; ++ci) {
        A* l = p.state(ci, h);
        const A a = p.gate.log_gate ? exp_acc(p.log_decay[ci * p.heads + h]) : A(1);
        if (cum && d == 0) {
          cum[ci * p.heads + h] = before;
          before += p.log_decay[ci * p.heads + h];
        }
        for (index_t x = 0; x < sz; ++x) {
          const A tmp = l[x];
          l[x] = run[x];
          run[x] = decay_add(a, run[x], tmp);
        }
      }
      if (fin)
        for (index_t x = 0; x < sz; ++x) fin[item * sz + x] = run[x];
    }
  }
};

//! Phase 3, per (chunk, head group) for chunks [first, last): o = intra-chunk masked product +
//! inter-chunk Q S0, written once. incoming (or null): [H, dk, dv], a state entering document 0
//! from outside (LASP-2), added to S0 of document 0's chunks with the decay cum [chunks, H] (see
//! state_pass_kernel).
template <class S, class A, class Space>
struct output_kernel {
  problem<S, A, Space> p;
  tensor_view<S, 3, Space> o;
  index_t first = 0, last = 0;
  const A* incoming = nullptr;
  const A* cum = nullptr;
  LOOM_HD void operator()(index_t lane) const {
    const lane_tiles<A> l(p.scratch + lane * p.lane_stride, p.c, p.dk, p.dv);
    int mode[max_head_group];
    const chunk_steps<S, A, Space> st(p, l);
    for (index_t item = p.first_item(lane); item < (last - first) * p.groups; item = p.next_item(item)) {
      const auto [ci, h0, g] = st.item_of(item, first);
      const chunk_info ch = st.begin_chunk(ci, h0, g, mode, true);
      const index_t n = ch.end - ch.begin;
      for (index_t s = 0; s < g; ++s) {
        const index_t h = h0 + s;
        st.scores(ch, s, mode[s]);
        const bool in = incoming && ch.doc == 0;
        st.set_state(s, p.state(ci, h), in ? incoming + h * p.dk * p.dv : nullptr,
                     in ? (cum ? exp_acc(cum[ci * p.heads + h]) : A(1)) : A(0));
        st.output(n, s);
      }
      st.write(ch, h0, g, o);
    }
  }
};

//! Phases 1 and 2 in one pass, per (document, head group), when those items fill the threads: the
//! chunks in order, the running state kept in the lane's scratch, each chunk's incoming state
//! written to the chunk-state buffer when `store`. The same arithmetic as the two phases (and as
//! the fused kernel), so the same bits.
template <class S, class A, class Space>
struct state_scan_kernel {
  problem<S, A, Space> p;
  const A* init = nullptr;
  A* fin = nullptr;
  A* cum = nullptr;  //!< as in state_pass_kernel
  bool store = true;
  index_t c_lo = 0, c_hi = max_index;  //!< only the chunks in [c_lo, c_hi) of each document (LASP-2)
  LOOM_HD void operator()(index_t lane) const {
    const lane_tiles<A> l(p.scratch + lane * p.lane_stride, p.c, p.dk, p.dv);
    int mode[max_head_group];
    A before[max_head_group];
    const chunk_steps<S, A, Space> st(p, l);
    for (index_t item = p.first_item(lane); item < p.docs * p.groups; item = p.next_item(item)) {
      const auto [d, h0, g] = st.item_of(item, 0);
      st.start_states(init, d, h0, g);
      for (index_t s = 0; s < g; ++s) before[s] = A(0);
      const auto range = st.chunks_of(d, c_lo, c_hi);
      for (index_t ci = range.begin; ci < range.end; ++ci) {
        const chunk_info ch = st.begin_chunk(ci, h0, g, mode, false);
        const index_t n = ch.end - ch.begin;
        for (index_t s = 0; s < g; ++s) {
          const index_t h = h0 + s;
          A* s0 = l.s0(s);
          if (store) {
            A* out = p.state(ci, h);
            for (index_t dd = 0; dd < p.dk; ++dd)
              for (index_t e = 0; e < p.dv; ++e) out[dd * p.dv + e] = s0[dd * l.vp + e];
          }
          const A lg = st.chunk_log_decay(n, s, mode[s]);
          if (cum && d == 0) {
            cum[ci * p.heads + h] = before[s];
            before[s] += lg;
          }
          st.chunk_state(n, s, mode[s]);
          st.advance(s, mode[s], lg);
        }
      }
      st.store_states(fin, d, h0, g);
    }
  }
};

//! The fused forward, per (document, head group) for documents [first, last): the chunks in order,
//! the states kept in the lane's scratch (no chunk-state buffer). Same arithmetic as phases 1-3, so
//! the same bits.
template <class S, class A, class Space>
struct fused_kernel {
  problem<S, A, Space> p;
  tensor_view<S, 3, Space> o;
  const A* init = nullptr;  //!< the state before the first chunk run (null: zero)
  A* fin = nullptr;         //!< the state after the last chunk run (null: not written)
  index_t first = 0, last = 0;
  index_t c_lo = 0, c_hi = max_index;  //!< only the chunks in [c_lo, c_hi) of each document (LASP-2)
  LOOM_HD void operator()(index_t lane) const {
    const lane_tiles<A> l(p.scratch + lane * p.lane_stride, p.c, p.dk, p.dv);
    int mode[max_head_group];
    const chunk_steps<S, A, Space> st(p, l);
    for (index_t item = p.first_item(lane); item < (last - first) * p.groups; item = p.next_item(item)) {
      const auto [d, h0, g] = st.item_of(item, first);
      st.start_states(init, d, h0, g);
      const auto range = st.chunks_of(d, c_lo, c_hi);
      for (index_t ci = range.begin; ci < range.end; ++ci) {
        const chunk_info ch = st.begin_chunk(ci, h0, g, mode, true);
        const index_t n = ch.end - ch.begin;
        for (index_t s = 0; s < g; ++s) {
          st.scores(ch, s, mode[s]);
          st.output(n, s);
          st.chunk_state(n, s, mode[s]);
          st.advance(s, mode[s], st.chunk_log_decay(n, s, mode[s]));
        }
        st.write(ch, h0, g, o);
      }
      st.store_states(fin, d, h0, g);
    }
  }
};

//! LASP-2: the contribution of a state X entering document 0 from outside, added to the outputs of
//! its chunks [first, last) that were computed from a zero incoming state (so only when the storage
//! type is the accumulation type: o is read back at full precision):
//!   o_i += scale exp(cum_c) exp(b_i) q_i^T X
//! with cum [chunks, H] (null: no decay) the log-decay from the document's start to chunk c and b_i
//! inside the chunk, as in the outputs themselves. One (n x dk) by (dk x dv) product per chunk and
//! head on the same tiles as the forward.
template <class S, class A, class Space>
struct incoming_kernel {
  problem<S, A, Space> p;
  tensor_view<S, 3, Space> o;
  const A* x = nullptr;
  const A* cum = nullptr;
  index_t first = 0, last = 0;
  LOOM_HD void operator()(index_t lane) const {
    const lane_tiles<A> l(p.scratch + lane * p.lane_stride, p.c, p.dk, p.dv);
    int mode[max_head_group];
    const chunk_steps<S, A, Space> st(p, l);
    const index_t kp = l.kp, vp = l.vp, sz = p.dk * p.dv;
    for (index_t item = p.first_item(lane); item < (last - first) * p.groups; item = p.next_item(item)) {
      const auto [ci, h0, g] = st.item_of(item, first);
      const chunk_info ch = p.chunks[ci];
      const index_t n = ch.end - ch.begin, rows = round_up(n, tile_rows);
      st.all_gates(ch, h0, g, mode);
      for (index_t i = 0; i < n; ++i)
        for (index_t s = 0; s < g; ++s)
          load_row(l.qs(s) + i * kp, p.q, ch.begin + i, h0 + s, p.dk, kp, mode[s] != 0 ? p.scale * l.u(s)[i] : p.scale);
      for (index_t s = 0; s < g; ++s) {
        const index_t h = h0 + s;
        A *qs = l.qs(s), *s0 = l.s0(s), *os = l.os(s);
        for (index_t i = n; i < rows; ++i)
          for (index_t d = 0; d < kp; ++d) qs[i * kp + d] = A(0);
        const A f = cum ? exp_acc(cum[ci * p.heads + h]) : A(1);
        for (index_t d = 0; d < p.dk; ++d) {
          for (index_t e = 0; e < p.dv; ++e) s0[d * vp + e] = f * x[h * sz + d * p.dv + e];
          for (index_t e = p.dv; e < vp; ++e) s0[d * vp + e] = A(0);
        }
        for (index_t i0 = 0; i0 < n; i0 += tile_rows)
          for (index_t e0 = 0; e0 < vp; e0 += tile_cols)
            tile_product(os + i0 * vp + e0, vp, qs + i0 * kp, kp, index_t(1), s0 + e0, vp, p.dk, qs, 0, 0, s0, 0, 0);
      }
      const index_t ost = o.stride(2);
      for (index_t i = 0; i < n; ++i)
        for (index_t s = 0; s < g; ++s) {
          S* dst = o.data() + (ch.begin + i) * o.stride(0) + (h0 + s) * o.stride(1);
          const A* src = l.os(s) + i * vp;
          for (index_t e = 0; e < p.dv; ++e) dst[e * ost] = static_cast<S>(static_cast<A>(dst[e * ost]) + src[e]);
        }
    }
  }
};

}  // namespace loom::linear_attention::detail
