#pragma once

//! @file
//! Chunked linear attention's forward as batched dense products, for matrix engines (cuBLAS on
//! tensor cores: linear_attention/cublas.cuh). Every chunk of every head becomes one batch entry of
//! C rows, zero-padded past the chunk's end, so the four products are uniform strided batches:
//!
//!   L   = Ks^T V       [dk x dv]   the chunk's own state (Ks: keys times exp(b_{n-1} - b_j))
//!   Pf  = Q K^T        [C x C]     scores
//!   O   = Q S0         [C x dv]    the inter-chunk term, S0 the state before the chunk
//!   O  += Pm V         [C x dv]    Pm: scores masked (j <= i), decayed (exp(b_i - b_j)) and scaled
//!
//! between elementwise LOOM_HD passes run with loom::for_each_index on the backend (log-gates per
//! chunk, gather into the padded layout, the pass over chunk states per document and head, mask
//! and row scale, scatter). Products read storage-type operands (Q, K, Ks, V, S0 and Pm rounded to
//! it, as matrix engines take them) and accumulate in the accumulation type; the state pass and
//! the final state stay in the accumulation type. Notation and gates as forward_kernels.hpp
//! (log-gates b, epochs across full-decay tokens, decay_between). Padded rows are zero, so no
//! product mixes two chunks, and no chunk holds two documents: documents stay isolated. Within a
//! chunk, the masked product Pm V multiplies zeros by the chunk's later values, so a non-finite
//! value reaches the outputs of the earlier tokens of its own chunk (the tiled kernels do not
//! read them).
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

//! The engine's layout for plan pl with storage S and accumulation A.
//! @throws loom::error(invalid_argument) for sizes whose products overflow index_t.
template <class S, class A, class P>
gemm_layout make_gemm_layout(const plan<P>& pl) {
  using loom::detail::checked_mul;
  constexpr std::string_view what = "linear_attention: the batched-product workspace";
  const index_t batch = checked_mul(pl.heads(), pl.chunks(), what);
  const index_t rows = checked_mul(batch, pl.chunk(), what);
  const index_t states = checked_mul(batch, checked_mul(pl.dk(), pl.dv(), what), what);
  workspace_layout l;
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

//! What every elementwise pass reads and writes; copied by value into each functor.
template <class S, class A, class Space>
struct gemm_pass {
  problem<S, A, Space> p;  // operands, gate, chunk table, sizes, scale
  A *b = nullptr, *ep = nullptr, *l = nullptr, *pf = nullptr, *o = nullptr;
  S *qg = nullptr, *kg = nullptr, *ks = nullptr, *vg = nullptr, *s0 = nullptr, *pm = nullptr;
  const A* init = nullptr;  // [docs, H, dk, dv] or null
  A* fin = nullptr;         // [docs, H, dk, dv] or null
  S* out = nullptr;         // o (t, h, e) at out[t * ot + h * oh + e * oe]
  index_t ot = 0, oh = 0, oe = 0;

  //! Row i of chunk ci, head h, in the padded layout.
  LOOM_HD index_t row(index_t h, index_t ci, index_t i) const { return (h * p.n_chunks + ci) * p.c + i; }
  LOOM_HD index_t length(index_t ci) const { return p.chunks[ci].end - p.chunks[ci].begin; }
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
    const A f = decay_between(g.b + g.row(at.h, at.ci, 0), g.ep + g.row(at.h, at.ci, 0), n - 1, at.i);
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

//! Per (document, head, state element): the pass over the document's chunks, S0 of each chunk
//! (rounded to S for the products) and the final state, S <- a S + L (decay_add, the combine every
//! state pass uses).
template <class S, class A, class Space>
struct gemm_state_pass {
  gemm_pass<S, A, Space> g;
  LOOM_HD void operator()(index_t item) const {
    const index_t sz = g.p.dk * g.p.dv, e = item % sz, dh = item / sz, h = dh % g.p.heads, doc = dh / g.p.heads;
    A s = g.init ? g.init[dh * sz + e] : A(0);
    for (index_t ci = g.p.doc_chunk[doc]; ci < g.p.doc_chunk[doc + 1]; ++ci) {
      const index_t at = (h * g.p.n_chunks + ci) * sz + e, last = g.row(h, ci, g.length(ci) - 1);
      g.s0[at] = S(s);
      const A a = g.ep[last] == A(0) ? exp_acc(g.b[last]) : A(0);  // a full-decay token forgets S0
      s = decay_add(a, s, g.l[at]);
    }
    if (g.fin) g.fin[dh * sz + e] = s;
  }
};

//! Per (head, chunk, row i, column j): Pm(i, j) = scale exp(b_i - b_j) Pf(i, j) for j <= i inside
//! the chunk (0 elsewhere). A factor of 0 selects 0 (no 0 x inf).
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

//! Per (head, chunk, row i, value column e): O (= Q S0 so far) times scale exp(b_i) (0 after a
//! full-decay token, and past the chunk's end). A factor of 0 selects 0 (no 0 x inf).
template <class S, class A, class Space>
struct gemm_row_scale {
  gemm_pass<S, A, Space> g;
  LOOM_HD void operator()(index_t item) const {
    const gemm_item at(item, g.p.dv, g.p.c, g.p.n_chunks);
    const index_t r0 = g.row(at.h, at.ci, 0);
    const A f = at.i < g.length(at.ci) && g.ep[r0 + at.i] == A(0) ? g.p.scale * exp_acc(g.b[r0 + at.i]) : A(0);
    A& o = g.o[at.r * g.p.dv + at.x];
    o = f == A(0) ? A(0) : o * f;
  }
};

//! Per (head, chunk, row i < n, value column e): the output into o (t, h, e).
template <class S, class A, class Space>
struct gemm_scatter {
  gemm_pass<S, A, Space> g;
  LOOM_HD void operator()(index_t item) const {
    const gemm_item at(item, g.p.dv, g.p.c, g.p.n_chunks);
    if (at.i >= g.length(at.ci)) return;
    const index_t t = g.p.chunks[at.ci].begin + at.i;
    g.out[t * g.ot + at.h * g.oh + at.x * g.oe] = S(g.o[at.r * g.p.dv + at.x]);
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

//! The elementwise passes' state of one call: the checks of linear_attention::forward, the
//! workspace carved at gl, the operands, gate and outputs bound.
template <class B, class P, class Gating, class Space>
gemm_pass<typename P::storage_type, typename P::accum_type, Space> gemm_setup(
    const B& b, const plan<P>& pl, const gemm_layout& gl, const Gating& gating, const operands<P, Space>& x,
    tensor_view<typename P::storage_type, 3, Space> o, tensor_view<typename P::accum_type, 4, Space> fin,
    std::span<std::byte> ws, std::string_view call) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  check_operands(x, pl.tokens(), pl.heads(), pl.dk(), pl.dv(), pl.docs());
  expect_extents(o, {pl.tokens(), pl.heads(), pl.dv()}, "o");
  check_state_out(fin, pl.docs(), pl.heads(), pl.dk(), pl.dv(), "final_state");
  check_workspace(ws, gl.bytes, call);
  const workspace_carver w(ws);
  gemm_pass<S, A, Space> g;
  g.p = problem_of(b, pl, gating, x, w.at<chunk_info>(gl.chunks), w.at<index_t>(gl.doc_chunk));
  g.b = w.at<A>(gl.b), g.ep = w.at<A>(gl.ep), g.l = w.at<A>(gl.l), g.pf = w.at<A>(gl.pf), g.o = w.at<A>(gl.o);
  g.qg = w.at<S>(gl.qg), g.kg = w.at<S>(gl.kg), g.ks = w.at<S>(gl.ks), g.vg = w.at<S>(gl.vg);
  g.s0 = w.at<S>(gl.s0), g.pm = w.at<S>(gl.pm);
  g.init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  g.fin = present(fin) ? fin.data() : nullptr;
  g.out = o.data(), g.ot = o.stride(0), g.oh = o.stride(1), g.oe = o.stride(2);
  return g;
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
  for_each_index(b, pl.docs() * heads * dk * dv, gemm_state_pass<S, A, Space>{g});
}

//! The second phase: the scores, the inter-chunk term Q S0, the mask and row scale, the intra-chunk
//! term, and the outputs scattered to o.
template <class B, class G, class P, class S, class A, class Space>
void gemm_outputs(const B& b, const G& gemm, const plan<P>& pl, const gemm_layout& gl,
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
  for_each_index(b, rows * dv, gemm_row_scale<S, A, Space>{g});
  gemm(gemm_op::n, gemm_op::n, c, dv, c, one, static_cast<const S*>(g.pm), c, c * c, static_cast<const S*>(g.vg), dv,
       c * dv, one, g.o, dv, c * dv, batch);
  for_each_index(b, rows * dv, gemm_scatter<S, A, Space>{g});
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
  gemm_outputs(b, gemm, pl, gl, g);
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
  using S = typename P::storage_type;
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
    for_each_index(b, one, gemm_state_pass<S, A, Space>{g0});
  }
  gemm_outputs(b, gemm, pl, gl, g);
  return with_x;
}

//! The batched-product engine on the reference provider (host memory), for the CPU tests of the
//! paths that run on cuBLAS: LASP-2's local step (lasp2::make_plan with host_products{}).
struct host_products {
  template <class P>
  struct engine {
    gemm_layout layout;
    template <class B>
    static std::shared_ptr<const engine> make(const B&, const plan<P>& pl, std::string_view) {
      static_assert(backend_traits<B>::memory_space::host_accessible,
                    "host_products: the reference provider reads host memory");
      return std::make_shared<const engine>(
          engine{make_gemm_layout<typename P::storage_type, typename P::accum_type>(pl)});
    }
    [[nodiscard]] std::size_t workspace_bytes() const noexcept { return layout.bytes; }
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
  };
};

}  // namespace loom::linear_attention::detail
