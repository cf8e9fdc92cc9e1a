#pragma once

//! @file
//! Chunked linear attention's forward and backward as batched dense products, for matrix engines
//! (cuBLAS on tensor cores: linear_attention/cublas.cuh). Every chunk of every head becomes one
//! batch entry of C rows, zero-padded past the chunk's end, so the products are uniform strided
//! batches. The forward:
//!
//!   L   = Ks^T V       [dk x dv]   the chunk's own state (Ks: keys times exp(b_{n-1} - b_j))
//!   Pf  = Q K^T        [C x C]     scores
//!   O   = Q S0         [C x dv]    the inter-chunk term, S0 the state before the chunk
//!   O  += Pm V         [C x dv]    Pm: scores masked (j <= i), decayed (exp(b_i - b_j)) and scaled
//!
//! The backward (gemm_backward; the gradients of backward_kernels.hpp) recomputes L, S0, Pm and O,
//! then, with E the adjoint of the state at the chunk's end:
//!
//!   adj = Qe^T dO      [dk x dv]   the chunk's adjoint sum (Qe: rows of Q times scale exp(b_i))
//!   dV  = K E + Pm^T dO            (K E's rows times exp(b_{n-1} - b_j))
//!   dP  = dO V^T       [C x C]     dPm = dP masked, decayed and scaled as Pm
//!   dQ  = dO S0^T + dPm K          (dO S0^T's rows times scale exp(b_i))
//!   dK  = V E^T + dPm^T Q          (V E^T's rows times exp(b_{n-1} - b_j))
//!
//! between elementwise LOOM_HD passes run with loom::for_each_index on the backend (log-gates per
//! chunk, gather into the padded layout, the pass over chunk states per document and head, mask
//! and row scale, scatter; in the backward the reverse pass over the chunks' adjoints per document
//! and head, E_{c-1} = a_c E_c + adj_c from d final state, and for scalar_gate the gate gradient).
//! Products read storage-type operands (Q, K, Ks, V, S0, Pm, dO, Qe, E and dPm rounded to it, as
//! matrix engines take them) and accumulate in the accumulation type; the state and adjoint passes,
//! the final state, d initial state and the gate gradient stay in the accumulation type. Notation
//! and gates as forward_kernels.hpp (log-gates b, epochs across full-decay tokens, decay_between).
//! Padded rows are zero, so no product mixes two chunks, and no chunk holds two documents:
//! documents stay isolated. Within a chunk, the masked products multiply zeros by the chunk's other
//! values, so a non-finite value reaches the results of other tokens of its own chunk (the tiled
//! kernels do not read them).
//!
//! The products go through a provider G: g(op_a, op_b, m, n, k, alpha, a, lda, stride_a, b, ldb,
//! stride_b, beta, c, ldc, stride_c, batch) computes, for each batch entry, the row-major
//! c [m x n] = alpha op(a) op(b) + beta c (op: gemm_op::n as stored, gemm_op::t transposed;
//! leading dimensions as row-major row strides). host_gemm is the reference provider (plain loops
//! in the accumulation type; host memory).

#include <loom/backend/copy.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/core/checked.hpp>
#include <loom/core/workspace.hpp>
#include <loom/linear_attention/detail/driver.hpp>
#include <loom/linear_attention/detail/forward_kernels.hpp>
#include <loom/linear_attention/detail/layout.hpp>
#include <loom/linear_attention/plan.hpp>
#include <loom/linear_attention/types.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <utility>

namespace loom::linear_attention::detail {

enum class gemm_op { n, t };

//! Byte offsets of the engine's workspace blocks (loom::workspace_layout): the chunk table, then
//! per (head, chunk, row) the log-gates and epochs [rows] (A), Q, K, Ks [rows, dk] and V [rows, dv]
//! (S), per (head, chunk) L [dk, dv] (A) and S0 [dk, dv] (S), then Pf [rows, C] (A), Pm [rows, C]
//! (S) and O [rows, dv] (A); rows = H x chunks x C.
struct gemm_layout {
  index_t batch = 0;  //!< (head, chunk) pairs: the batch count of every product
  std::size_t chunks = 0, doc_chunk = 0, b = 0, ep = 0, qg = 0, kg = 0, ks = 0, vg = 0, l = 0, s0 = 0, pf = 0, pm = 0,
              o = 0, bytes = 0;
};

//! The backward's workspace: the forward's blocks (at the same offsets; forward.bytes is the
//! forward's size), then dO [rows, dv] and Qe [rows, dk] (S), per (head, chunk) E [dk, dv] (S),
//! dQ, dK [rows, dk] and dV [rows, dv] (A), dB [T, H] (A), the token offsets [docs + 1] and the
//! final states [docs, H, dk, dv] (A, for the gate gradient). bytes: the backward's size.
struct gemm_backward_layout {
  gemm_layout forward;
  std::size_t dog = 0, qe = 0, e = 0, dq = 0, dk = 0, dv = 0, db = 0, cu = 0, fin = 0, bytes = 0;
};

//! The forward's blocks of plan pl (storage S, accumulation A) added to l.
//! @throws loom::error(invalid_argument) for sizes whose products overflow index_t.
template <class S, class A, class P>
gemm_layout add_gemm_blocks(workspace_layout& l, const plan<P>& pl) {
  using loom::detail::checked_mul;
  constexpr std::string_view what = "linear_attention: the batched-product workspace";
  const index_t batch = checked_mul(pl.heads(), pl.chunks(), what);
  const index_t rows = checked_mul(batch, pl.chunk(), what);
  const index_t states = checked_mul(batch, checked_mul(pl.dk(), pl.dv(), what), what);
  gemm_layout g;
  g.batch = batch;
  g.chunks = l.add<chunk_info>(pl.chunks());
  g.doc_chunk = l.add<index_t>(pl.docs() + 1);
  g.b = l.add<A>(rows);
  g.ep = l.add<A>(rows);
  g.qg = l.add<S>(checked_mul(rows, pl.dk(), what));
  g.kg = l.add<S>(checked_mul(rows, pl.dk(), what));
  g.ks = l.add<S>(checked_mul(rows, pl.dk(), what));
  g.vg = l.add<S>(checked_mul(rows, pl.dv(), what));
  g.l = l.add<A>(states);
  g.s0 = l.add<S>(states);
  g.pf = l.add<A>(checked_mul(rows, pl.chunk(), what));
  g.pm = l.add<S>(checked_mul(rows, pl.chunk(), what));
  g.o = l.add<A>(checked_mul(rows, pl.dv(), what));
  g.bytes = l.bytes();
  return g;
}

//! The engine's forward layout for plan pl with storage S and accumulation A.
//! @throws loom::error(invalid_argument) for sizes whose products overflow index_t.
template <class S, class A, class P>
gemm_layout make_gemm_layout(const plan<P>& pl) {
  workspace_layout l;
  return add_gemm_blocks<S, A>(l, pl);
}

//! The engine's backward layout for plan pl with storage S and accumulation A.
//! @throws loom::error(invalid_argument) for sizes whose products overflow index_t.
template <class S, class A, class P>
gemm_backward_layout make_gemm_backward_layout(const plan<P>& pl) {
  using loom::detail::checked_mul;
  constexpr std::string_view what = "linear_attention: the batched-product workspace";
  workspace_layout l;
  gemm_backward_layout g;
  g.forward = add_gemm_blocks<S, A>(l, pl);
  const index_t rows = checked_mul(g.forward.batch, pl.chunk(), what), sz = checked_mul(pl.dk(), pl.dv(), what);
  g.dog = l.add<S>(checked_mul(rows, pl.dv(), what));
  g.qe = l.add<S>(checked_mul(rows, pl.dk(), what));
  g.e = l.add<S>(checked_mul(g.forward.batch, sz, what));
  g.dq = l.add<A>(checked_mul(rows, pl.dk(), what));
  g.dk = l.add<A>(checked_mul(rows, pl.dk(), what));
  g.dv = l.add<A>(checked_mul(rows, pl.dv(), what));
  g.db = l.add<A>(checked_mul(pl.tokens(), pl.heads(), what));
  g.cu = l.add<index_t>(pl.docs() + 1);
  g.fin = l.add<A>(checked_mul(checked_mul(pl.docs(), pl.heads(), what), sz, what));
  g.bytes = l.bytes();
  return g;
}

//! What every elementwise pass reads and writes; copied by value into each functor.
template <class S, class A, class Space>
struct gemm_pass {
  problem<S, A, Space> p;  // operands, gate, chunk table, sizes, scale
  A *b = nullptr, *ep = nullptr, *l = nullptr, *pf = nullptr, *o = nullptr;
  S *qg = nullptr, *kg = nullptr, *ks = nullptr, *vg = nullptr, *s0 = nullptr, *pm = nullptr;
  const A* init = nullptr;  // [docs, H, dk, dv] or null
  A* fin = nullptr;         // [docs, H, dk, dv] or null

  //! Row i of chunk ci, head h, in the padded layout.
  LOOM_HD index_t row(index_t h, index_t ci, index_t i) const { return (h * p.n_chunks + ci) * p.c + i; }
  LOOM_HD index_t length(index_t ci) const { return p.chunks[ci].end - p.chunks[ci].begin; }
  //! a_c, the decay of the state across chunk ci: exp(b_{n-1}), 0 when the chunk holds a
  //! full-decay token (it forgets the state before it).
  LOOM_HD A chunk_decay(index_t h, index_t ci) const {
    const index_t last = row(h, ci, length(ci) - 1);
    return ep[last] == A(0) ? exp_acc(b[last]) : A(0);
  }
  //! f_i, the factor of S0 in row i's output: scale exp(b_i), 0 after a full-decay token of the
  //! chunk and past its end.
  LOOM_HD A query_factor(index_t h, index_t ci, index_t i) const {
    const index_t r0 = row(h, ci, 0);
    return i < length(ci) && ep[r0 + i] == A(0) ? p.scale * exp_acc(b[r0 + i]) : A(0);
  }
  //! w_i = exp(b_{n-1} - b_i), the factor of row i's key in the chunk's own state (0 across a
  //! full-decay token and past the chunk's end).
  LOOM_HD A key_factor(index_t h, index_t ci, index_t i) const {
    const index_t r0 = row(h, ci, 0), n = length(ci);
    return i < n ? decay_between(b + r0, ep + r0, n - 1, i) : A(0);
  }
};

//! Per (head, chunk): the log-gates b and epochs of the chunk's rows (0 past its end).
template <class S, class A, class Space>
struct gemm_gates {
  gemm_pass<S, A, Space> g;
  LOOM_HD void operator()(index_t item) const {
    const index_t h = item / g.p.n_chunks, ci = item % g.p.n_chunks, n = g.length(ci);
    A *b = g.b + g.row(h, ci, 0), *ep = g.ep + g.row(h, ci, 0);
    g.p.log_gates(g.p.chunks[ci].begin, n, h, b, ep);
    for (index_t i = n; i < g.p.c; ++i) b[i] = A(0), ep[i] = A(0);
  }
};

//! Where an elementwise pass's item falls: row r of the padded layout (head h, chunk ci, row i of
//! the chunk) and column x of a row of `width` values. Items run column fastest, so neighbouring
//! items (a device's neighbouring threads) touch neighbouring addresses.
struct gemm_item {
  index_t r, x, h, ci, i;
  LOOM_HD gemm_item(index_t item, index_t width, index_t c, index_t n_chunks)
      : r(item / width), x(item % width), h(r / c / n_chunks), ci(r / c % n_chunks), i(r % c) {}
};

//! Per (head, chunk, row, key column d): Q, K and Ks = K exp(b_{n-1} - b_i) into the padded
//! layout (zeros past the chunk's end).
template <class S, class A, class Space>
struct gemm_gather_qk {
  gemm_pass<S, A, Space> g;
  LOOM_HD void operator()(index_t item) const {
    const gemm_item at(item, g.p.dk, g.p.c, g.p.n_chunks);
    const index_t n = g.length(at.ci), to = at.r * g.p.dk + at.x;
    if (at.i >= n) {
      g.qg[to] = S(0.0f), g.kg[to] = S(0.0f), g.ks[to] = S(0.0f);
      return;
    }
    const index_t t = g.p.chunks[at.ci].begin + at.i;
    const A f = g.key_factor(at.h, at.ci, at.i);
    const S kd = g.p.k(t, at.h, at.x);
    g.qg[to] = g.p.q(t, at.h, at.x);
    g.kg[to] = kd;
    g.ks[to] = f == A(0) ? S(0.0f) : S(static_cast<A>(kd) * f);
  }
};

//! Per (head, chunk, row, value column e): V into the padded layout (zeros past the chunk's end).
template <class S, class A, class Space>
struct gemm_gather_v {
  gemm_pass<S, A, Space> g;
  LOOM_HD void operator()(index_t item) const {
    const gemm_item at(item, g.p.dv, g.p.c, g.p.n_chunks);
    g.vg[at.r * g.p.dv + at.x] = at.i >= g.length(at.ci) ? S(0.0f) : g.p.v(g.p.chunks[at.ci].begin + at.i, at.h, at.x);
  }
};

//! Per (document, head, state element): a pass over the document's chunks, forward (the states)
//! or in reverse (their adjoints). Each chunk's entry gets the running value (rounded to S for the
//! products), then run <- a run + add (decay_add, the combine every state pass uses; a the chunk's
//! decay). It starts from `start` (or 0) and leaves the last value in `last` (when given).
//! Forward: S0 of each chunk from the initial state and the chunks' own states L, the final state.
//! Reverse: E of each chunk (the adjoint of the state at its end) from d final state and the
//! adjoint sums Qe^T dO, the document's d initial state.
template <bool Reverse, class S, class A, class Space>
struct gemm_chunk_scan {
  gemm_pass<S, A, Space> g;
  const A* start = nullptr;
  const A* add = nullptr;
  S* entry = nullptr;
  A* last = nullptr;
  LOOM_HD void operator()(index_t item) const {
    const index_t sz = g.p.dk * g.p.dv, e = item % sz, dh = item / sz, h = dh % g.p.heads, doc = dh / g.p.heads;
    const index_t c0 = g.p.doc_chunk[doc], c1 = g.p.doc_chunk[doc + 1];
    A run = start ? start[dh * sz + e] : A(0);
    for (index_t step = 0; step < c1 - c0; ++step) {
      const index_t ci = Reverse ? c1 - 1 - step : c0 + step;
      const index_t at = (h * g.p.n_chunks + ci) * sz + e;
      entry[at] = S(run);
      run = decay_add(g.chunk_decay(h, ci), run, add[at]);
    }
    if (last) last[dh * sz + e] = run;
  }
};
//! The forward's pass: S0 per chunk, the final state.
template <class S, class A, class Space>
gemm_chunk_scan<false, S, A, Space> gemm_state_pass(const gemm_pass<S, A, Space>& g) {
  return {g, g.init, g.l, g.s0, g.fin};
}

//! Per (head, chunk, row i, column j): Pm(i, j) = M(i, j) Pf(i, j), M(i, j) = scale exp(b_i - b_j) for
//! j <= i inside the chunk (0 elsewhere). A factor of 0 selects 0 (no 0 x inf). The backward runs it
//! again on dP (in Pf's block) for dPm = M dP (into Pm's block).
template <class S, class A, class Space>
struct gemm_mask {
  gemm_pass<S, A, Space> g;
  LOOM_HD void operator()(index_t item) const {
    const gemm_item at(item, g.p.c, g.p.c, g.p.n_chunks);
    const A *b = g.b + g.row(at.h, at.ci, 0), *ep = g.ep + g.row(at.h, at.ci, 0);
    const A f = at.i < g.length(at.ci) && at.x <= at.i ? decay_between(b, ep, at.i, at.x) : A(0);
    const index_t to = at.r * g.p.c + at.x;
    g.pm[to] = f == A(0) ? S(0.0f) : S(g.p.scale * f * g.pf[to]);
  }
};

//! Per (head, chunk, row i, column x of rows of `width`): x(i) times the row's query_factor (Query)
//! or key_factor, in place. A factor of 0 selects 0 (no 0 x inf).
template <class S, class A, class Space, bool Query>
struct gemm_row_scale {
  gemm_pass<S, A, Space> g;
  A* x = nullptr;
  index_t width = 0;
  LOOM_HD void operator()(index_t item) const {
    const gemm_item at(item, width, g.p.c, g.p.n_chunks);
    const A f = Query ? g.query_factor(at.h, at.ci, at.i) : g.key_factor(at.h, at.ci, at.i);
    A& y = x[at.r * width + at.x];
    y = f == A(0) ? A(0) : y * f;
  }
};

//! Per (head, chunk, row i < n, column x of `out`'s rows): src (rows of out.extent(2) values in the
//! padded layout) into out (t, h, x).
template <class S, class A, class Space>
struct gemm_scatter {
  gemm_pass<S, A, Space> g;
  const A* src = nullptr;
  tensor_view<S, 3, Space> out;
  LOOM_HD void operator()(index_t item) const {
    const index_t width = out.extent(2);
    const gemm_item at(item, width, g.p.c, g.p.n_chunks);
    if (at.i >= g.length(at.ci)) return;
    out(g.p.chunks[at.ci].begin + at.i, at.h, at.x) = S(src[at.r * width + at.x]);
  }
};

//! The backward's blocks and views of one call; copied by value into each backward functor.
template <class S, class A, class Space>
struct gemm_adjoint {
  gemm_pass<S, A, Space> g;
  tensor_view<const S, 3, Space> d_o;
  S *dog = nullptr, *qe = nullptr, *e = nullptr;  // dO, Qe [rows, .], E per (head, chunk)
  A *adj = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr, *db = nullptr;
  const A* dfin = nullptr;  // [docs, H, dk, dv] or null (zero)
  A* dinit = nullptr;       // [docs, H, dk, dv] or null
};

//! Per (head, chunk, row, value column e): dO into the padded layout (zeros past the chunk's end).
template <class S, class A, class Space>
struct gemm_gather_do {
  gemm_adjoint<S, A, Space> a;
  LOOM_HD void operator()(index_t item) const {
    const auto& g = a.g;
    const gemm_item at(item, g.p.dv, g.p.c, g.p.n_chunks);
    a.dog[at.r * g.p.dv + at.x] = at.i >= g.length(at.ci) ? S(0.0f) : a.d_o(g.p.chunks[at.ci].begin + at.i, at.h, at.x);
  }
};

//! Per (head, chunk, row i, key column d): Qe = f_i Q (query_factor; 0 past the chunk's end).
template <class S, class A, class Space>
struct gemm_scale_q {
  gemm_adjoint<S, A, Space> a;
  LOOM_HD void operator()(index_t item) const {
    const auto& g = a.g;
    const gemm_item at(item, g.p.dk, g.p.c, g.p.n_chunks);
    const A f = g.query_factor(at.h, at.ci, at.i);
    const index_t at_x = at.r * g.p.dk + at.x;
    a.qe[at_x] = f == A(0) ? S(0.0f) : S(f * static_cast<A>(g.qg[at_x]));
  }
};

//! Per (head, chunk, row i < n): dB_i = dO_i . O_i - k_i . dK_i into db (t, h) ([T, H]).
template <class S, class A, class Space>
struct gemm_gate_rows {
  gemm_adjoint<S, A, Space> a;
  LOOM_HD void operator()(index_t r) const {
    const auto& g = a.g;
    const index_t h = r / g.p.c / g.p.n_chunks, ci = r / g.p.c % g.p.n_chunks, i = r % g.p.c;
    if (i >= g.length(ci)) return;
    A s = A(0);
    for (index_t e = 0; e < g.p.dv; ++e) s += static_cast<A>(a.dog[r * g.p.dv + e]) * g.o[r * g.p.dv + e];
    for (index_t d = 0; d < g.p.dk; ++d) s -= static_cast<A>(g.kg[r * g.p.dk + d]) * a.dk[r * g.p.dk + d];
    a.db[(g.p.chunks[ci].begin + i) * g.p.heads + h] = s;
  }
};

//! The reference provider: plain loops in the accumulation type TC, ascending over the reduction
//! index; host memory.
struct host_gemm {
  template <class TS, class TC>
  void operator()(gemm_op ta, gemm_op tb, index_t m, index_t n, index_t k, TC alpha, const TS* a, index_t lda,
                  index_t sa, const TS* b, index_t ldb, index_t sb, TC beta, TC* c, index_t ldc, index_t sc,
                  index_t batch) const {
    for (index_t x = 0; x < batch; ++x) {
      const TS *ax = a + x * sa, *bx = b + x * sb;
      TC* cx = c + x * sc;
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
          TC s = TC(0);
          for (index_t l = 0; l < k; ++l) {
            const TC av = static_cast<TC>(ta == gemm_op::n ? ax[i * lda + l] : ax[l * lda + i]);
            const TC bv = static_cast<TC>(tb == gemm_op::n ? bx[l * ldb + j] : bx[j * ldb + l]);
            s += av * bv;
          }
          TC& out = cx[i * ldc + j];
          out = beta == TC(0) ? alpha * s : alpha * s + beta * out;
        }
    }
  }
};

//! The elementwise passes' state of one call over the workspace carved at gl (nothing checked):
//! operands, gate and chunk table bound, final states into fin (null: not written).
template <class B, class P, class Gating, class Space>
gemm_pass<typename P::storage_type, typename P::accum_type, Space> gemm_bind(
    const B& b, const plan<P>& pl, const gemm_layout& gl, const Gating& gating, const operands<P, Space>& x,
    typename P::accum_type* fin, std::span<std::byte> ws) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const workspace_carver w(ws);
  gemm_pass<S, A, Space> g;
  g.p = problem_of(b, pl, gating, x, w.at<chunk_info>(gl.chunks), w.at<index_t>(gl.doc_chunk));
  g.b = w.at<A>(gl.b), g.ep = w.at<A>(gl.ep), g.l = w.at<A>(gl.l), g.pf = w.at<A>(gl.pf), g.o = w.at<A>(gl.o);
  g.qg = w.at<S>(gl.qg), g.kg = w.at<S>(gl.kg), g.ks = w.at<S>(gl.ks), g.vg = w.at<S>(gl.vg);
  g.s0 = w.at<S>(gl.s0), g.pm = w.at<S>(gl.pm);
  g.init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  g.fin = fin;
  return g;
}

//! The forward's checks (those of linear_attention::forward), then gemm_bind.
template <class B, class P, class Gating, class Space>
gemm_pass<typename P::storage_type, typename P::accum_type, Space> gemm_setup(
    const B& b, const plan<P>& pl, const gemm_layout& gl, const Gating& gating, const operands<P, Space>& x,
    tensor_view<typename P::storage_type, 3, Space> o, tensor_view<typename P::accum_type, 4, Space> fin,
    std::span<std::byte> ws, std::string_view call) {
  check_operands(x, pl.tokens(), pl.heads(), pl.dk(), pl.dv(), pl.docs());
  expect_extents(o, {pl.tokens(), pl.heads(), pl.dv()}, "o");
  check_state_out(fin, pl.docs(), pl.heads(), pl.dk(), pl.dv(), "final_state");
  check_workspace(ws, gl.bytes, call);
  return gemm_bind(b, pl, gl, gating, x, present(fin) ? fin.data() : nullptr, ws);
}

//! The first phase: gates, the padded operands, every chunk's own state L = Ks^T V, and the pass
//! over the chunk states of every document (S0 of each chunk, the final states).
template <class B, class G, class P, class S, class A, class Space>
void gemm_states(const B& b, const G& gemm, const plan<P>& pl, const gemm_layout& gl, const gemm_pass<S, A, Space>& g) {
  const index_t heads = pl.heads(), c = pl.chunk(), dk = pl.dk(), dv = pl.dv();
  const index_t batch = gl.batch, rows = batch * c;
  if (batch > 0) {
    for_each_index(b, batch, gemm_gates<S, A, Space>{g});
    for_each_index(b, rows * dk, gemm_gather_qk<S, A, Space>{g});
    for_each_index(b, rows * dv, gemm_gather_v<S, A, Space>{g});
    // L = Ks^T V per chunk
    gemm(gemm_op::t, gemm_op::n, dk, dv, c, A(1), static_cast<const S*>(g.ks), dk, c * dk, static_cast<const S*>(g.vg),
         dv, c * dv, A(0), g.l, dv, dk * dv, batch);
  }
  for_each_index(b, pl.docs() * heads * dk * dv, gemm_state_pass(g));
}

//! The second phase's products: the scores Pf, the inter-chunk term Q S0, the mask (Pm) and row
//! scale, the intra-chunk term: the outputs in O (padded, accumulation type).
template <class B, class G, class P, class S, class A, class Space>
void gemm_output_products(const B& b, const G& gemm, const plan<P>& pl, const gemm_layout& gl,
                          const gemm_pass<S, A, Space>& g) {
  const index_t c = pl.chunk(), dk = pl.dk(), dv = pl.dv();
  const index_t batch = gl.batch, rows = batch * c;
  if (batch == 0) return;
  const A one = A(1), zero = A(0);
  // Pf = Q K^T, O = Q S0, then the mask and row scale, then O += Pm V
  gemm(gemm_op::n, gemm_op::t, c, c, dk, one, static_cast<const S*>(g.qg), dk, c * dk, static_cast<const S*>(g.kg), dk,
       c * dk, zero, g.pf, c, c * c, batch);
  gemm(gemm_op::n, gemm_op::n, c, dv, dk, one, static_cast<const S*>(g.qg), dk, c * dk, static_cast<const S*>(g.s0), dv,
       dk * dv, zero, g.o, dv, c * dv, batch);
  for_each_index(b, rows * c, gemm_mask<S, A, Space>{g});
  for_each_index(b, rows * dv, gemm_row_scale<S, A, Space, true>{g, g.o, dv});
  gemm(gemm_op::n, gemm_op::n, c, dv, c, one, static_cast<const S*>(g.pm), c, c * c, static_cast<const S*>(g.vg), dv,
       c * dv, one, g.o, dv, c * dv, batch);
}

//! The second phase: the output products, then the outputs scattered to o.
template <class B, class G, class P, class S, class A, class Space>
void gemm_outputs(const B& b, const G& gemm, const plan<P>& pl, const gemm_layout& gl, const gemm_pass<S, A, Space>& g,
                  tensor_view<S, 3, Space> o) {
  gemm_output_products(b, gemm, pl, gl, g);
  if (gl.batch > 0) for_each_index(b, gl.batch * pl.chunk() * pl.dv(), gemm_scatter<S, A, Space>{g, g.o, o});
}

//! The forward of plan pl through provider gemm on backend b, with the engine's layout gl (from
//! make_gemm_layout for pl) in `ws`. Checks as linear_attention::forward. Allocates nothing; no
//! fence (stream-ordered where b and gemm are).
template <class B, class G, class P, class Gating, class Space>
void gemm_forward(const B& b, const G& gemm, const plan<P>& pl, const gemm_layout& gl, const Gating& gating,
                  const operands<P, Space>& x, tensor_view<typename P::storage_type, 3, Space> o,
                  tensor_view<typename P::accum_type, 4, Space> fin, std::span<std::byte> ws, std::string_view call) {
  const auto g = gemm_setup(b, pl, gl, gating, x, o, fin, ws, call);
  gemm_states(b, gemm, pl, gl, g);
  gemm_outputs(b, gemm, pl, gl, g, o);
}

//! The backward of plan pl (as linear_attention::backward: the same checks, the same gradients)
//! through provider gemm on backend b, with the engine's backward layout bl (from
//! make_gemm_backward_layout for pl) in `ws`: the forward's states and output products (O kept),
//! then per (head, chunk) batch entry
//!   adj = Qe^T dO      the chunk's adjoint sum (Qe: rows of Q times f_i, the factor of S0)
//!   E   = the reverse pass over the chunks of each document (adj, the chunk decays, d final state)
//!   dV  = row-scale_w(K E) + Pm^T dO        dP = dO V^T, dPm = M dP
//!   dQ  = row-scale_f(dO S0^T) + dPm K      dK = row-scale_w(V E^T) + dPm^T Q
//! (w_j = key_factor, f_i = query_factor), for scalar_gate dB_i = dO_i . O_i - k_i . dK_i and the
//! gate gradient (gate_gradient_kernel: the reverse cumulative sum per document from
//! <S_fin, dS_fin>), and the gradients scattered. fin_out (optional, [docs, H, dk, dv] in the
//! backend's memory): receives every document's final state (LASP-2's correction by the incoming
//! adjoint reads the last one), as run_backward's. Allocates nothing; no fence.
template <class B, class G, class P, class Gating, class Space>
void gemm_backward(const B& b, const G& gemm, const plan<P>& pl, const gemm_backward_layout& bl, const Gating& gating,
                   const operands<P, Space>& x, tensor_view<const typename P::storage_type, 3, Space> d_o,
                   tensor_view<const typename P::accum_type, 4, Space> dfin, const gradients<P, Space>& grads,
                   std::span<std::byte> ws, std::string_view call, typename P::accum_type* fin_out = nullptr) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  check_operands(x, pl.tokens(), pl.heads(), pl.dk(), pl.dv(), pl.docs());
  check_backward_args<Gating>(pl, d_o, dfin, grads);
  check_workspace(ws, bl.bytes, call, "plan.backward_workspace_bytes()");
  constexpr bool gated = is_scalar_gate<Gating>;
  const bool with_fin = gated && present(dfin);
  const workspace_carver w(ws);
  const gemm_layout& gl = bl.forward;
  gemm_adjoint<S, A, Space> a;
  a.g = gemm_bind(b, pl, gl, gating, x, fin_out ? fin_out : with_fin ? w.at<A>(bl.fin) : nullptr, ws);
  a.d_o = d_o;
  a.dog = w.at<S>(bl.dog), a.qe = w.at<S>(bl.qe), a.e = w.at<S>(bl.e);
  a.adj = a.g.l;  // L is spent once the state pass has run
  a.dq = w.at<A>(bl.dq), a.dk = w.at<A>(bl.dk), a.dv = w.at<A>(bl.dv), a.db = w.at<A>(bl.db);
  a.dfin = present(dfin) ? dfin.data() : nullptr;
  a.dinit = present(grads.d_initial_state) ? grads.d_initial_state.data() : nullptr;
  const auto& g = a.g;
  gemm_states(b, gemm, pl, gl, g);
  gemm_output_products(b, gemm, pl, gl, g);
  const index_t c = pl.chunk(), dk = pl.dk(), dv = pl.dv(), batch = gl.batch, rows = batch * c;
  const A one = A(1), zero = A(0);
  const auto cs = [](const S* p) { return p; };
  if (batch > 0) {
    for_each_index(b, rows * dv, gemm_gather_do<S, A, Space>{a});
    for_each_index(b, rows * dk, gemm_scale_q<S, A, Space>{a});
    // adj = Qe^T dO per chunk
    gemm(gemm_op::t, gemm_op::n, dk, dv, c, one, cs(a.qe), dk, c * dk, cs(a.dog), dv, c * dv, zero, a.adj, dv, dk * dv,
         batch);
  }
  for_each_index(b, pl.docs() * pl.heads() * dk * dv,
                 gemm_chunk_scan<true, S, A, Space>{a.g, a.dfin, a.adj, a.e, a.dinit});
  if (batch > 0) {
    // dV = row-scale_w(K E) + Pm^T dO
    gemm(gemm_op::n, gemm_op::n, c, dv, dk, one, cs(g.kg), dk, c * dk, cs(a.e), dv, dk * dv, zero, a.dv, dv, c * dv,
         batch);
    for_each_index(b, rows * dv, gemm_row_scale<S, A, Space, false>{g, a.dv, dv});
    gemm(gemm_op::t, gemm_op::n, c, dv, c, one, cs(g.pm), c, c * c, cs(a.dog), dv, c * dv, one, a.dv, dv, c * dv,
         batch);
    // dP = dO V^T (into Pf's block), dPm = M dP (into Pm's: Pm is spent)
    gemm(gemm_op::n, gemm_op::t, c, c, dv, one, cs(a.dog), dv, c * dv, cs(g.vg), dv, c * dv, zero, g.pf, c, c * c,
         batch);
    for_each_index(b, rows * c, gemm_mask<S, A, Space>{g});
    // dQ = row-scale_f(dO S0^T) + dPm K
    gemm(gemm_op::n, gemm_op::t, c, dk, dv, one, cs(a.dog), dv, c * dv, cs(g.s0), dv, dk * dv, zero, a.dq, dk, c * dk,
         batch);
    for_each_index(b, rows * dk, gemm_row_scale<S, A, Space, true>{g, a.dq, dk});
    gemm(gemm_op::n, gemm_op::n, c, dk, c, one, cs(g.pm), c, c * c, cs(g.kg), dk, c * dk, one, a.dq, dk, c * dk, batch);
    // dK = row-scale_w(V E^T) + dPm^T Q
    gemm(gemm_op::n, gemm_op::t, c, dk, dv, one, cs(g.vg), dv, c * dv, cs(a.e), dv, dk * dv, zero, a.dk, dk, c * dk,
         batch);
    for_each_index(b, rows * dk, gemm_row_scale<S, A, Space, false>{g, a.dk, dk});
    gemm(gemm_op::t, gemm_op::n, c, dk, c, one, cs(g.pm), c, c * c, cs(g.qg), dk, c * dk, one, a.dk, dk, c * dk, batch);
  }
  if constexpr (gated) {
    const index_t doc_items = pl.docs() * pl.heads();
    if (batch > 0) for_each_index(b, rows, gemm_gate_rows<S, A, Space>{a});
    const index_t* cu = offsets_on(b, pl, w.at<index_t>(bl.cu));
    if (doc_items > 0)
      for_each_index(b, doc_items,
                     gate_gradient_kernel<A, Space>{cu, pl.docs(), pl.heads(), dk * dv, a.db,
                                                    with_fin ? g.fin : nullptr, a.dfin, grads.d_log_gate});
  }
  if (batch > 0) {
    for_each_index(b, rows * dk, gemm_scatter<S, A, Space>{g, a.dq, grads.dq});
    for_each_index(b, rows * dk, gemm_scatter<S, A, Space>{g, a.dk, grads.dk});
    for_each_index(b, rows * dv, gemm_scatter<S, A, Space>{g, a.dv, grads.dv});
  }
}

//! The forward with a state X entering document 0 from outside (LASP-2; the contract of
//! run_forward_incoming in driver.hpp): the states phase from the given initial states (zero for a
//! document 0 that continues from an earlier rank), end_state = the last document's final state
//! when roles.publish, post(); X = finish(); where X is given, document 0's chunk states and final
//! state again from X (every chunk of document 0 then starts from S0 + exp(B) X, as the chunk-
//! parallel schedule's), then the outputs phase. Returns whether document 0's final state in fin
//! includes X. fin is required.
template <class B, class G, class P, class Gating, class Space, class Post, class Finish>
bool gemm_forward_incoming(const B& b, const G& gemm, const plan<P>& pl, const gemm_layout& gl, const Gating& gating,
                           const operands<P, Space>& x, tensor_view<typename P::storage_type, 3, Space> o,
                           tensor_view<typename P::accum_type, 4, Space> fin, std::span<std::byte> ws,
                           typename P::accum_type* end_state, incoming_roles roles, Post&& post, Finish&& finish,
                           std::string_view call) {
  using A = typename P::accum_type;
  LOOM_EXPECTS(present(fin), errc::invalid_argument, call, ": final_state: the LASP-2 schedule needs it");
  const auto g = gemm_setup(b, pl, gl, gating, x, o, fin, ws, call);
  gemm_states(b, gemm, pl, gl, g);
  const index_t one = pl.heads() * pl.dk() * pl.dv();
  if (roles.publish && pl.docs() > 0)
    loom::copy_bytes(b, end_state, g.fin + (pl.docs() - 1) * one, sizeof(A) * static_cast<std::size_t>(one));
  post();
  const A* xin = finish();
  const bool with_x = xin != nullptr && pl.docs() > 0;
  if (with_x) {
    auto g0 = g;  // document 0 only (items [0, H dk dv)), from X ([H, dk, dv]: document 0's initial state)
    g0.init = xin;
    for_each_index(b, one, gemm_state_pass(g0));
  }
  gemm_outputs(b, gemm, pl, gl, g, o);
  return with_x;
}

//! The batched-product engine on the reference provider (host memory), for the CPU tests of the
//! paths that run on cuBLAS: LASP-2's local steps, forward and backward (lasp2::make_plan with
//! host_products{}).
struct host_products {
  template <class P>
  struct engine {
    gemm_layout layout;
    gemm_backward_layout backward_layout;
    template <class B>
    static std::shared_ptr<const engine> make(const B&, const plan<P>& pl, std::string_view) {
      static_assert(backend_traits<B>::memory_space::host_accessible,
                    "host_products: the reference provider reads host memory");
      using S = typename P::storage_type;
      using A = typename P::accum_type;
      return std::make_shared<const engine>(engine{make_gemm_layout<S, A>(pl), make_gemm_backward_layout<S, A>(pl)});
    }
    [[nodiscard]] std::size_t workspace_bytes() const noexcept { return layout.bytes; }
    [[nodiscard]] std::size_t backward_workspace_bytes() const noexcept { return backward_layout.bytes; }
    template <class B, class Gating, class Space>
    void forward(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
                 tensor_view<typename P::storage_type, 3, Space> o, tensor_view<typename P::accum_type, 4, Space> fin,
                 std::span<std::byte> ws, std::string_view call) const {
      gemm_forward(b, host_gemm{}, pl, layout, gating, x, o, fin, ws, call);
    }
    template <class B, class Gating, class Space, class Post, class Finish>
    bool forward_incoming(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
                          tensor_view<typename P::storage_type, 3, Space> o,
                          tensor_view<typename P::accum_type, 4, Space> fin, std::span<std::byte> ws,
                          typename P::accum_type* end_state, incoming_roles roles, Post&& post, Finish&& finish,
                          std::string_view call) const {
      return gemm_forward_incoming(b, host_gemm{}, pl, layout, gating, x, o, fin, ws, end_state, roles,
                                   std::forward<Post>(post), std::forward<Finish>(finish), call);
    }
    template <class B, class Gating, class Space>
    void backward(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
                  tensor_view<const typename P::storage_type, 3, Space> d_o,
                  tensor_view<const typename P::accum_type, 4, Space> dfin, const gradients<P, Space>& grads,
                  std::span<std::byte> ws, typename P::accum_type* fin_out, std::string_view call) const {
      gemm_backward(b, host_gemm{}, pl, backward_layout, gating, x, d_o, dfin, grads, ws, call, fin_out);
    }
  };
};

}  // namespace loom::linear_attention::detail
