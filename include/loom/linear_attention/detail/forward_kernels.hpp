#pragma once

//! @file
//! The forward work of chunked linear attention as LOOM_HD functors (one body for every backend).
//! Notation, per head and chunk of n tokens: b_i = sum of the log-gates of tokens 0..i of the chunk
//! (inclusive, so b is non-increasing), a = exp(b_{n-1}) the chunk's decay, S0 the state before it:
//!   o_i   = scale (exp(b_i) S0^T q_i + sum_{j<=i} exp(b_i - b_j) (q_i . k_j) v_j)
//!   S_end = a S0 + L,   L = sum_j exp(b_{n-1} - b_j) k_j v_j^T
//! Only differences b_i - b_j with j <= i (and b_i itself) are exponentiated: all are <= 0.

#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/linear_attention/detail/layout.hpp>

#include <cmath>

namespace loom::linear_attention::detail {

LOOM_HD inline float exp_acc(float x) { return expf(x); }
LOOM_HD inline double exp_acc(double x) { return exp(x); }

//! Log-gate of token t, head h: 0 (no decay), log_gate[h] (fixed) or log_gate[t*st + h*sh].
template <class A>
struct gate_ref {
  const A* log_gate = nullptr;  //!< null: no decay
  index_t stride_t = 0;         //!< 0 for a fixed per-head decay
  index_t stride_h = 1;
  LOOM_HD A operator()(index_t t, index_t h) const { return log_gate ? log_gate[t * stride_t + h * stride_h] : A(0); }
};

//! Everything a chunk kernel reads or writes; copied by value into every functor.
template <class S, class A, class Space>
struct problem {
  tensor_view<const S, 3, Space> q, k, v;
  gate_ref<A> gate;
  const chunk_info* chunks = nullptr;
  const index_t* doc_chunk = nullptr;
  index_t n_chunks = 0, docs = 0, heads = 0, dk = 0, dv = 0, c = 0;
  A scale = A(1);
  A* states = nullptr;     //!< [chunks, H, dk, dv]: L of each chunk, then the state before it
  A* log_decay = nullptr;  //!< [chunks, H]: b_{n-1} of each chunk
  A* scratch = nullptr;    //!< [lanes, lane_floats]
  index_t lanes = 1, lane_stride = 0;

  LOOM_HD A* state(index_t chunk, index_t h) const { return states + (chunk * heads + h) * dk * dv; }

  //! Loads the chunk into the lane's scratch: Q [n, dk], K^T [dk, C], V [n, dv], b [n].
  LOOM_HD void load(const chunk_info& ci, index_t h, A* qs, A* kt, A* vs, A* b) const {
    const index_t n = ci.end - ci.begin;
    A acc = A(0);
    for (index_t i = 0; i < n; ++i) {
      const index_t t = ci.begin + i;
      acc += gate(t, h);
      b[i] = acc;
      for (index_t d = 0; d < dk; ++d) qs[i * dk + d] = static_cast<A>(q(t, h, d));
      for (index_t d = 0; d < dk; ++d) kt[d * c + i] = static_cast<A>(k(t, h, d));
      for (index_t e = 0; e < dv; ++e) vs[i * dv + e] = static_cast<A>(v(t, h, e));
    }
  }
};

//! Phase 1, per (chunk, head): L and the chunk's log-decay. Independent of every incoming state.
template <class S, class A, class Space>
struct chunk_state_kernel {
  problem<S, A, Space> p;
  LOOM_HD void operator()(index_t lane) const {
    A* base = p.scratch + lane * p.lane_stride;
    A *qs = base, *kt = qs + p.c * p.dk, *vs = kt + p.dk * p.c, *b = vs + p.c * p.dv, *w = b + p.c;
    for (index_t item = lane; item < p.n_chunks * p.heads; item += p.lanes) {
      const index_t ci = item / p.heads, h = item % p.heads;
      const chunk_info ch = p.chunks[ci];
      const index_t n = ch.end - ch.begin;
      p.load(ch, h, qs, kt, vs, b);
      const A last = b[n - 1];
      for (index_t j = 0; j < n; ++j) w[j] = p.gate.log_gate ? exp_acc(last - b[j]) : A(1);
      A* l = p.state(ci, h);
      for (index_t x = 0; x < p.dk * p.dv; ++x) l[x] = A(0);
      for (index_t d = 0; d < p.dk; ++d) {
        A* row = l + d * p.dv;
        for (index_t j = 0; j < n; ++j) {
          const A kw = kt[d * p.c + j] * w[j];
          const A* vj = vs + j * p.dv;
          for (index_t e = 0; e < p.dv; ++e) row[e] += kw * vj[e];
        }
      }
      p.log_decay[ci * p.heads + h] = last;
    }
  }
};

//! Phase 2, per (document, head): the sequential pass over the document's chunks. Replaces each
//! chunk's L by the state before the chunk; writes the document's final state when asked.
//! init/fin: [docs, H, dk, dv] or null (a zero initial state; no final state).
template <class S, class A, class Space>
struct state_pass_kernel {
  problem<S, A, Space> p;
  const A* init = nullptr;
  A* fin = nullptr;
  LOOM_HD void operator()(index_t lane) const {
    const index_t sz = p.dk * p.dv;
    A* run = p.scratch + lane * p.lane_stride;
    for (index_t item = lane; item < p.docs * p.heads; item += p.lanes) {
      const index_t d = item / p.heads, h = item % p.heads;
      const A* s0 = init ? init + item * sz : nullptr;
      for (index_t x = 0; x < sz; ++x) run[x] = s0 ? s0[x] : A(0);
      for (index_t ci = p.doc_chunk[d]; ci < p.doc_chunk[d + 1]; ++ci) {
        A* l = p.state(ci, h);
        const A a = p.gate.log_gate ? exp_acc(p.log_decay[ci * p.heads + h]) : A(1);
        for (index_t x = 0; x < sz; ++x) {
          const A tmp = l[x];
          l[x] = run[x];
          run[x] = a * run[x] + tmp;
        }
      }
      if (fin)
        for (index_t x = 0; x < sz; ++x) fin[item * sz + x] = run[x];
    }
  }
};

//! Phase 3, per (chunk, head): o = intra-chunk masked product + inter-chunk Q S0, written once.
template <class S, class A, class Space>
struct output_kernel {
  problem<S, A, Space> p;
  tensor_view<S, 3, Space> o;
  LOOM_HD void operator()(index_t lane) const {
    A* base = p.scratch + lane * p.lane_stride;
    A *qs = base, *kt = qs + p.c * p.dk, *vs = kt + p.dk * p.c, *b = vs + p.c * p.dv, *pr = b + p.c,
      *os = pr + p.c * p.c;
    for (index_t item = lane; item < p.n_chunks * p.heads; item += p.lanes) {
      const index_t ci = item / p.heads, h = item % p.heads;
      const chunk_info ch = p.chunks[ci];
      const index_t n = ch.end - ch.begin;
      p.load(ch, h, qs, kt, vs, b);
      const A* s0 = p.state(ci, h);
      for (index_t i = 0; i < n; ++i) {
        A* row = pr + i * p.c;
        for (index_t j = 0; j <= i; ++j) row[j] = A(0);
        for (index_t d = 0; d < p.dk; ++d) {
          const A qd = qs[i * p.dk + d];
          const A* kd = kt + d * p.c;
          for (index_t j = 0; j <= i; ++j) row[j] += qd * kd[j];
        }
        if (p.gate.log_gate)
          for (index_t j = 0; j <= i; ++j) row[j] *= p.scale * exp_acc(b[i] - b[j]);
        else
          for (index_t j = 0; j <= i; ++j) row[j] *= p.scale;
        A* orow = os + i * p.dv;
        for (index_t e = 0; e < p.dv; ++e) orow[e] = A(0);
        for (index_t j = 0; j <= i; ++j) {
          const A pj = row[j];
          const A* vj = vs + j * p.dv;
          for (index_t e = 0; e < p.dv; ++e) orow[e] += pj * vj[e];
        }
        const A qscale = p.scale * (p.gate.log_gate ? exp_acc(b[i]) : A(1));
        for (index_t d = 0; d < p.dk; ++d) {
          const A qd = qs[i * p.dk + d] * qscale;
          const A* sd = s0 + d * p.dv;
          for (index_t e = 0; e < p.dv; ++e) orow[e] += qd * sd[e];
        }
        for (index_t e = 0; e < p.dv; ++e) o(ch.begin + i, h, e) = static_cast<S>(orow[e]);
      }
    }
  }
};

}  // namespace loom::linear_attention::detail
