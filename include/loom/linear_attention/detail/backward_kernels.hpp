#pragma once

//! @file
//! The backward work of chunked linear attention. With D_t the adjoint of the state S_t
//! (D_t = scale q_t do_t^T + g_{t+1} D_{t+1}, and D at a document's last token = d final state):
//!   dq_t = scale S_t do_t,   dk_t = D_t v_t,   dv_t = D_t^T k_t,   d S0 = g_first D_first,
//!   with B_t the cumulative log-gate, dB_t = do_t . o_t - k_t . dk_t (+ <S_fin, dS_fin> at the
//!   last token), and d log g_u = sum_{t >= u in the document} dB_t.
//! Chunked: E_c = adjoint of the state at the end of chunk c; E_{c-1} = a_c E_c + sum_i exp(b_i)
//! scale q_i do_i^T. Inside a chunk D_i = sum_{j>=i} exp(b_j - b_i) scale q_j do_j^T +
//! exp(b_{n-1} - b_i) E_c. In a chunk holding a full-decay token every such factor comes from
//! decay_between (0 across the token, see problem::log_gates), as in the forward.

#include <loom/linear_attention/detail/forward_kernels.hpp>

namespace loom::linear_attention::detail {

//! Backward step 1, per (chunk, head): sum_i exp(b_i) scale q_i do_i^T into adj[chunk, h].
template <class S, class A, class Space>
struct adjoint_chunk_kernel {
  problem<S, A, Space> p;
  tensor_view<const S, 3, Space> d_o;
  A* adj = nullptr;  //!< [chunks, H, dk, dv]
  LOOM_HD void operator()(index_t lane) const {
    A* base = p.scratch + lane * p.lane_stride;
    A *qs = base, *kt = qs + p.c * p.dk, *vs = kt + p.dk * p.c, *b = vs + p.c * p.dv, *dos = b + p.c,
      *ep = dos + p.c * p.dv;
    for (index_t item = p.first_item(lane); item < p.n_chunks * p.heads; item = p.next_item(item)) {
      const index_t ci = item / p.heads, h = item % p.heads;
      const chunk_info ch = p.chunks[ci];
      const index_t n = ch.end - ch.begin;
      const bool resets = p.load(ch, h, qs, kt, vs, b, ep);
      for (index_t i = 0; i < n; ++i)
        for (index_t e = 0; e < p.dv; ++e) dos[i * p.dv + e] = static_cast<A>(d_o(ch.begin + i, h, e));
      A* out = adj + (ci * p.heads + h) * p.dk * p.dv;
      for (index_t x = 0; x < p.dk * p.dv; ++x) out[x] = A(0);
      for (index_t d = 0; d < p.dk; ++d) {
        A* row = out + d * p.dv;
        for (index_t i = 0; i < n; ++i) {
          const A u = !p.gate.log_gate ? A(1) : resets && ep[i] != A(0) ? A(0) : exp_acc(b[i]);
          const A w = p.scale * u * qs[i * p.dk + d];
          for (index_t e = 0; e < p.dv; ++e) row[e] += w * dos[i * p.dv + e];
        }
      }
    }
  }
};

//! Backward step 2, per (document, head): the reverse pass. Replaces adj[c] by E_c and writes the
//! document's d initial state. dfin: [docs, H, dk, dv] or null (zero); dinit: the same or null.
template <class S, class A, class Space>
struct adjoint_pass_kernel {
  problem<S, A, Space> p;
  A* adj = nullptr;
  const A* dfin = nullptr;
  A* dinit = nullptr;
  LOOM_HD void operator()(index_t lane) const {
    const index_t sz = p.dk * p.dv;
    A* run = p.scratch + lane * p.lane_stride;
    for (index_t item = p.first_item(lane); item < p.docs * p.heads; item = p.next_item(item)) {
      const index_t d = item / p.heads, h = item % p.heads;
      for (index_t x = 0; x < sz; ++x) run[x] = dfin ? dfin[item * sz + x] : A(0);
      for (index_t ci = p.doc_chunk[d + 1]; ci-- > p.doc_chunk[d];) {
        A* l = adj + (ci * p.heads + h) * sz;
        const A a = p.gate.log_gate ? exp_acc(p.log_decay[ci * p.heads + h]) : A(1);
        for (index_t x = 0; x < sz; ++x) {
          const A tmp = l[x];
          l[x] = run[x];
          run[x] = a * run[x] + tmp;
        }
      }
      if (dinit)
        for (index_t x = 0; x < sz; ++x) dinit[item * sz + x] = run[x];
    }
  }
};

//! Backward step 3, per (chunk, head): dq, dk, dv and dB (into db [T, H]; null: not needed).
template <class S, class A, class Space>
struct gradient_kernel {
  problem<S, A, Space> p;
  tensor_view<const S, 3, Space> d_o;
  tensor_view<S, 3, Space> dq, dk, dv;
  const A* adj = nullptr;
  A* db = nullptr;
  LOOM_HD void operator()(index_t lane) const {
    const index_t c = p.c, nk = p.dk, nv = p.dv;
    A* base = p.scratch + lane * p.lane_stride;
    A *qs = base, *kt = qs + c * nk, *vs = kt + nk * c, *b = vs + c * nv, *pr = b + c, *os = pr + c * c;
    A *dos = os + c * nv, *vt = dos + c * nv, *dvs = vt + nv * c, *ks = dvs + c * nv, *dqs = ks + c * nk,
      *dks = dqs + c * nk, *dp = dks + c * nk, *st = dp + c * c, *et = st + nv * nk, *ep = et + nv * nk;
    for (index_t item = p.first_item(lane); item < p.n_chunks * p.heads; item = p.next_item(item)) {
      const index_t ci = item / p.heads, h = item % p.heads;
      const chunk_info ch = p.chunks[ci];
      const index_t n = ch.end - ch.begin;
      const bool resets = p.load(ch, h, qs, kt, vs, b, ep);
      // exp(b_i - b_j), the decay from j to i (the same expression as ever without a full decay)
      auto decay = [&](index_t i, index_t j) { return resets ? decay_between(b, ep, i, j) : exp_acc(b[i] - b[j]); };
      const A* s0 = p.state(ci, h);
      const A* e0 = adj + (ci * p.heads + h) * nk * nv;
      for (index_t d = 0; d < nk; ++d)
        for (index_t e = 0; e < nv; ++e) {
          st[e * nk + d] = s0[d * nv + e];
          et[e * nk + d] = e0[d * nv + e];
        }
      for (index_t i = 0; i < n; ++i) {
        for (index_t e = 0; e < nv; ++e) {
          dos[i * nv + e] = static_cast<A>(d_o(ch.begin + i, h, e));
          vt[e * c + i] = vs[i * nv + e];
        }
        for (index_t d = 0; d < nk; ++d) ks[i * nk + d] = kt[d * c + i];
      }
      const bool gated = p.gate.log_gate != nullptr;
      for (index_t x = 0; x < n * nk; ++x) dqs[x] = dks[x] = A(0);
      for (index_t x = 0; x < n * nv; ++x) dvs[x] = os[x] = A(0);
      // P and dP rows, then the row-wise (i) products.
      for (index_t i = 0; i < n; ++i) {
        A *prow = pr + i * c, *drow = dp + i * c;
        for (index_t j = 0; j <= i; ++j) prow[j] = drow[j] = A(0);
        for (index_t d = 0; d < nk; ++d) {
          const A qd = qs[i * nk + d];
          for (index_t j = 0; j <= i; ++j) prow[j] += qd * kt[d * c + j];
        }
        for (index_t e = 0; e < nv; ++e) {
          const A de = dos[i * nv + e];
          for (index_t j = 0; j <= i; ++j) drow[j] += de * vt[e * c + j];
        }
        for (index_t j = 0; j <= i; ++j) {
          const A w = p.scale * (gated ? decay(i, j) : A(1));
          prow[j] *= w;
          drow[j] *= w;
        }
        const A wi = p.scale * (!gated ? A(1) : resets && ep[i] != A(0) ? A(0) : exp_acc(b[i]));
        for (index_t j = 0; j <= i; ++j) {
          for (index_t e = 0; e < nv; ++e) os[i * nv + e] += prow[j] * vs[j * nv + e];
          for (index_t d = 0; d < nk; ++d) dqs[i * nk + d] += drow[j] * ks[j * nk + d];
        }
        for (index_t d = 0; d < nk; ++d) {
          const A qd = wi * qs[i * nk + d];
          for (index_t e = 0; e < nv; ++e) os[i * nv + e] += qd * s0[d * nv + e];
        }
        for (index_t e = 0; e < nv; ++e) {
          const A de = wi * dos[i * nv + e];
          for (index_t d = 0; d < nk; ++d) dqs[i * nk + d] += de * st[e * nk + d];
        }
      }
      // Column-wise (j) products: dk_j = sum_i dP_ij q_i + ..., dv_j = sum_i P_ij do_i + ...
      for (index_t i = 0; i < n; ++i)
        for (index_t j = 0; j <= i; ++j) {
          const A pij = pr[i * c + j], dij = dp[i * c + j];
          for (index_t d = 0; d < nk; ++d) dks[j * nk + d] += dij * qs[i * nk + d];
          for (index_t e = 0; e < nv; ++e) dvs[j * nv + e] += pij * dos[i * nv + e];
        }
      for (index_t j = 0; j < n; ++j) {
        const A w = gated ? decay(n - 1, j) : A(1);
        for (index_t e = 0; e < nv; ++e) {
          const A ve = w * vs[j * nv + e];
          for (index_t d = 0; d < nk; ++d) dks[j * nk + d] += ve * et[e * nk + d];
        }
        for (index_t d = 0; d < nk; ++d) {
          const A kd = w * ks[j * nk + d];
          for (index_t e = 0; e < nv; ++e) dvs[j * nv + e] += kd * e0[d * nv + e];
        }
      }
      for (index_t i = 0; i < n; ++i) {
        const index_t t = ch.begin + i;
        A dbi = A(0);
        for (index_t e = 0; e < nv; ++e) dbi += dos[i * nv + e] * os[i * nv + e];
        for (index_t d = 0; d < nk; ++d) dbi -= ks[i * nk + d] * dks[i * nk + d];
        if (db) db[t * p.heads + h] = dbi;
        for (index_t d = 0; d < nk; ++d) {
          dq(t, h, d) = static_cast<S>(dqs[i * nk + d]);
          dk(t, h, d) = static_cast<S>(dks[i * nk + d]);
        }
        for (index_t e = 0; e < nv; ++e) dv(t, h, e) = static_cast<S>(dvs[i * nv + e]);
      }
    }
  }
};

//! Backward step 4, per (document, head): d log g = reverse cumulative sum of dB inside the
//! document, starting from <S_fin, dS_fin> at its last token (fin/dfin null: 0).
template <class A, class Space>
struct gate_gradient_kernel {
  const index_t* cu = nullptr;  //!< [docs + 1]
  index_t docs = 0, heads = 0, sz = 0;
  const A* db = nullptr;
  const A* fin = nullptr;
  const A* dfin = nullptr;
  tensor_view<A, 2, Space> dg;
  LOOM_HD void operator()(index_t item) const {
    const index_t d = item / heads, h = item % heads;
    A acc = A(0);
    if (fin && dfin)
      for (index_t x = 0; x < sz; ++x) acc += fin[item * sz + x] * dfin[item * sz + x];
    for (index_t t = cu[d + 1]; t-- > cu[d];) {
      acc += db[t * heads + h];
      dg(t, h) = acc;
    }
  }
};

}  // namespace loom::linear_attention::detail
