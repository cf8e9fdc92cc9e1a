#pragma once

//! @file
//! The drivers that validate a call against its plan (plan.hpp) and launch the kernels of
//! forward_kernels.hpp / backward_kernels.hpp with loom::for_each_index.

#include <loom/backend/copy.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/linear_attention/detail/backward_kernels.hpp>
#include <loom/linear_attention/detail/checks.hpp>
#include <loom/linear_attention/detail/layout.hpp>
#include <loom/linear_attention/plan.hpp>
#include <loom/linear_attention/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::linear_attention {

namespace detail {

template <class B>
void upload(const B& b, void* dst, const void* src, std::size_t bytes) {
  loom::copy_bytes(b, dst, src, bytes);
}

//! The workspace blocks of one pass. The chunk table and offsets are copied into the workspace
//! only where the backend's memory is not host-accessible; their blocks are reserved on every
//! backend so that one size serves every memory space.
template <class A>
struct blocks {
  chunk_info* chunks = nullptr;
  index_t* doc_chunk = nullptr;
  const index_t* cu = nullptr;
  A *states = nullptr, *log_decay = nullptr, *cum = nullptr, *scratch = nullptr, *adj = nullptr, *db = nullptr,
    *fin = nullptr;
};

//! The plan's document offsets [docs + 1] where the backend's kernels read them: the plan's own on
//! host-accessible memory, else uploaded (stream-ordered) into `room` (docs + 1 elements).
template <class B, class P>
const index_t* offsets_on(const B& b, const plan<P>& pl, index_t* room) {
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    return pl.offsets().data();
  } else {
    upload(b, room, pl.offsets().data(), sizeof(index_t) * pl.offsets().size());
    return room;
  }
}

//! Checks the caller's workspace (size and alignment) and carves the pass's blocks from it (the
//! offsets where the backend reads them: offsets_on).
template <class B, class P>
blocks<typename P::accum_type> carve(const B& b, const plan<P>& pl, std::span<std::byte> ws, bool backward,
                                     std::string_view call) {
  using A = typename P::accum_type;
  const pass_layout& l = plan_access::layout(pl, backward);
  check_workspace(ws, l.bytes, call);
  const workspace_carver c(ws);
  blocks<A> w;
  w.chunks = c.at<chunk_info>(l.chunks);
  w.doc_chunk = c.at<index_t>(l.doc_chunk);
  w.cu = offsets_on(b, pl, c.at<index_t>(l.cu));
  w.states = c.at<A>(l.states);
  w.log_decay = c.at<A>(l.log_decay);
  w.cum = c.at<A>(l.cum);
  w.scratch = c.at<A>(l.scratch);
  if (backward) {
    w.adj = c.at<A>(l.adj);
    w.db = c.at<A>(l.db);
    w.fin = c.at<A>(l.fin);
  }
  return w;
}

//! The kernels' problem of plan pl over operands x (the gate checked): operands, gate, sizes, scale
//! and the chunk table, the plan's own where the memory is host-accessible, else copied into
//! `chunks` and `doc_chunk` (room for the plan's table in the backend's memory).
template <class B, class P, class Gating, class Space>
problem<typename P::storage_type, typename P::accum_type, Space> problem_of(const B& b, const plan<P>& pl,
                                                                            const Gating& gating,
                                                                            const operands<P, Space>& x,
                                                                            chunk_info* chunks, index_t* doc_chunk) {
  using A = typename P::accum_type;
  problem<typename P::storage_type, A, Space> p;
  p.q = x.q;
  p.k = x.k;
  p.v = x.v;
  p.gate = check_gating<A, Space>(gating, pl.tokens(), pl.heads());
  const chunk_table& table = plan_access::table(pl);
  if constexpr (Space::host_accessible) {
    p.chunks = table.chunks.data();
    p.doc_chunk = table.doc_chunk.data();
  } else {
    upload(b, chunks, table.chunks.data(), sizeof(chunk_info) * table.chunks.size());
    upload(b, doc_chunk, table.doc_chunk.data(), sizeof(index_t) * table.doc_chunk.size());
    p.chunks = chunks;
    p.doc_chunk = doc_chunk;
  }
  p.n_chunks = pl.chunks();
  p.docs = pl.docs();
  p.heads = pl.heads();
  p.dk = pl.dk();
  p.dv = pl.dv();
  p.c = pl.chunk();
  p.scale = pl.scale();
  return p;
}

//! Validates the operands and the workspace and builds the kernels' problem over it.
template <class B, class P, class Gating, class Space>
auto setup(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x, std::span<std::byte> ws,
           bool backward, std::string_view call) {
  check_operands(x, pl.tokens(), pl.heads(), pl.dk(), pl.dv(), pl.docs());
  auto w = carve(b, pl, ws, backward, call);
  auto p = problem_of(b, pl, gating, x, w.chunks, w.doc_chunk);
  p.states = w.states;
  p.log_decay = w.log_decay;
  p.scratch = w.scratch;
  p.lane_stride = lane_floats(pl.chunk(), pl.dk(), pl.dv(), pl.head_group());
  p.group = pl.head_group();
  p.groups = pl.head_groups();
  return std::pair{p, w};
}

//! for_each_index over min(lanes, items) lanes. On host backends (each launch complete on return)
//! the lanes take the items from a shared counter; elsewhere each strides them by the lane count.
template <class B, class K>
void launch(const B& b, K k, index_t items, index_t lanes) {
  if (items <= 0) return;
  k.p.lanes = items < lanes ? items : lanes;
  loom::detail::launch_counter<B> counter;
  k.p.next = counter.get();
  for_each_index(b, k.p.lanes, k);
}

//! The forward pass: fused per (document, head) or in three launches, as the plan says.
template <class B, class P, class Gating, class Space>
void run_forward(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
                 tensor_view<typename P::storage_type, 3, Space> o, tensor_view<typename P::accum_type, 4, Space> fin,
                 std::span<std::byte> ws) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  auto [p, w] = setup(b, pl, gating, x, ws, false, "linear_attention::forward");
  expect_extents(o, {pl.tokens(), pl.heads(), pl.dv()}, "o");
  check_state_out(fin, pl.docs(), pl.heads(), pl.dk(), pl.dv(), "final_state");
  const index_t chunk_items = pl.chunks() * pl.head_groups(), doc_items = pl.docs() * pl.heads();
  A* fin_p = present(fin) ? fin.data() : nullptr;
  if (pl.fused()) {
    launch(b, fused_kernel<S, A, Space>{p, o, x.initial_state.data(), fin_p, 0, pl.docs()},
           pl.docs() * pl.head_groups(), pl.lanes());
    return;
  }
  launch(b, chunk_state_kernel<S, A, Space>{p}, chunk_items, pl.lanes());
  launch(b, state_pass_kernel<S, A, Space>{p, x.initial_state.data(), fin_p, nullptr}, doc_items, pl.lanes());
  launch(b, output_kernel<S, A, Space>{p, o, 0, pl.chunks()}, chunk_items, pl.lanes());
}

//! How a LASP-2 rank runs its slice (a fused plan): `needs_x`, a state X enters document 0 (it
//! continues a document from the left); `publish`, the end state of the last document, computed
//! from a zero state entering document 0, is needed by a later rank.
struct incoming_roles {
  bool needs_x = false;
  bool publish = true;
};

//! The chunks of document 0 a single-document slice computes before the exchange (the lead), out of
//! n. The other ranks' slices are taken to be as long as this one, and the work counted in fused
//! chunks: the end state of chunks [m, n) from a scan costs about scan_cost of a fused chunk, the
//! correction of an output chunk by X about correct_cost. A publishing rank leads with m = f n fused
//! chunks and scans the rest, f chosen so that a rank without an element to publish, leading with
//! the same work in fused chunks and correcting them afterwards, finishes with it; that rank's lead
//! is that work. Deterministic: the bits depend on the lead, the lead only on n and the roles.
inline index_t incoming_lead(index_t n, incoming_roles r, bool correctable) {
  constexpr double scan_cost = 0.35, correct_cost = 0.35;
  constexpr double f = scan_cost * (1 - correct_cost) / (scan_cost + correct_cost - correct_cost * scan_cost);
  const double work = f + scan_cost * (1 - f);  // the publishing ranks' work before the exchange, per chunk
  if (!r.needs_x) return r.publish ? static_cast<index_t>(f * static_cast<double>(n) + 0.5) : n;
  if (!correctable) return 0;
  const double m = (r.publish ? f : work) * static_cast<double>(n) + 0.5;
  return static_cast<index_t>(m) < n ? static_cast<index_t>(m) : n;
}

//! The host buffers of run_forward_incoming with a fused plan (the state after the lead, the state
//! entering the rest, the scan's end state: [H, dk, dv] each; per chunk of document 0 and head its
//! log-decay and its start's: [n, H]), carved from the caller's LASP-2 workspace.
template <class A>
struct incoming_scratch {
  std::span<A> mid, start, tail, lg, cum;
};

//! The forward with a state X entering document 0 from outside (LASP-2). post() is called once
//! `end_state` [H, dk, dv] holds the end state of the last document computed from a zero state
//! entering document 0 (when roles.publish); finish() then returns X [H, dk, dv] (or null when
//! nothing enters). Returns whether document 0's final state in `fin` includes X.
//!
//! Fused plan (host memory): documents 1.. run fused before the exchange. Document 0, when it is the
//! only one, runs its first m chunks (incoming_lead) fused from its initial state (zero when X
//! enters), the end state of the remaining chunks comes from a scan of those chunks alone, and
//! end_state = exp(their log-decay) S_m + that scan; after the exchange X joins the state,
//! S_m + exp(B_m) X, the remaining chunks run fused from it and the first m chunks' outputs get
//! scale exp(B_t) q_t^T X added (incoming_kernel; only when the storage type is the accumulation
//! type, else m = 0). No chunk state is computed twice except in the scanned chunks of a publishing
//! rank. With several documents, document 0 runs after the exchange from X.
//! Otherwise (chunk-parallel plan, every memory space): phases 1 and 2, the end state copied out of
//! the last document's final state (loom::copy_bytes, in the backend's order), post(), the output of
//! documents 1.., finish(), then X folded into the chunk states of document 0, S0 + exp(B) X (its
//! final state does not include X).
template <class B, class P, class Gating, class Space, class Post, class Finish>
bool run_forward_incoming(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
                          tensor_view<typename P::storage_type, 3, Space> o,
                          tensor_view<typename P::accum_type, 4, Space> fin, std::span<std::byte> ws,
                          typename P::accum_type* end_state, incoming_roles roles,
                          const incoming_scratch<typename P::accum_type>& sc, Post&& post, Finish&& finish) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  auto [p, w] = setup(b, pl, gating, x, ws, false, "lasp2::forward");
  expect_extents(o, {pl.tokens(), pl.heads(), pl.dv()}, "o");
  check_state_out(fin, pl.docs(), pl.heads(), pl.dk(), pl.dv(), "final_state");
  const index_t groups = pl.head_groups(), doc_items = pl.docs() * pl.heads(), H = pl.heads(), sz = pl.dk() * pl.dv();
  A* fin_p = present(fin) ? fin.data() : nullptr;
  const A* init = x.initial_state.data();
  LOOM_EXPECTS(Space::host_accessible || !pl.fused(), errc::invalid_argument,
               "run_forward_incoming: the fused schedule runs on host memory only");
  if constexpr (Space::host_accessible) {
    if (pl.fused() && pl.docs() > 0) {
      LOOM_EXPECTS(fin_p != nullptr, errc::invalid_argument, "final_state: the LASP-2 schedule needs it");
      const index_t docs = pl.docs(), n = plan_access::table(pl).doc_chunk[1];
      LOOM_EXPECTS(sc.mid.size() == static_cast<std::size_t>(H * sz) && sc.lg.size() == static_cast<std::size_t>(n * H),
                   errc::invalid_argument, "run_forward_incoming: scratch sized for another plan");
      const std::span<A> mid = sc.mid, start = sc.start, lg = sc.lg, cum = sc.cum;
      std::fill(mid.begin(), mid.end(), A(0));
      auto state_of = [&](index_t h) -> const A* { return init ? init + h * sz : nullptr; };  // document 0's
      if (docs > 1) {
        // Documents 1.. do not depend on X; document 0 does not when nothing enters it.
        const index_t d0 = roles.needs_x ? 1 : 0;
        launch(b, fused_kernel<S, A, Space>{p, o, init, fin_p, d0, docs}, (docs - d0) * groups, pl.lanes());
        fence(b);
        if (roles.publish) std::copy_n(fin_p + (docs - 1) * H * sz, H * sz, end_state);
        post();
        const A* xin = finish();
        if (!roles.needs_x) return true;
        for (index_t h = 0; h < H; ++h)
          for (index_t e = 0; e < sz; ++e) start[h * sz + e] = (xin ? xin[h * sz + e] : A(0));
        launch(b, fused_kernel<S, A, Space>{p, o, start.data(), fin_p, 0, 1}, groups, pl.lanes());
        return true;
      }
      const index_t m = incoming_lead(n, roles, std::is_same_v<S, A>);
      // Per chunk of document 0 and head: its log-decay (the sum the kernels form), and its start's
      // log-decay from the document's start.
      for (index_t c = 0; c < n; ++c)
        for (index_t h = 0; h < H; ++h) {
          A acc = A(0);
          for (index_t t = plan_access::table(pl).chunks[static_cast<std::size_t>(c)].begin;
               t < plan_access::table(pl).chunks[static_cast<std::size_t>(c)].end; ++t)
            acc += p.gate(t, h);
          lg[c * H + h] = acc;
          cum[c * H + h] = c == 0 ? A(0) : cum[(c - 1) * H + h] + lg[(c - 1) * H + h];
        }
      auto decay_from = [&](index_t c, index_t h) {  // exp(log-decay of chunks [c, n))
        A acc = A(0);
        for (index_t k = c; k < n; ++k) acc += lg[k * H + h];
        return exp_acc(acc);
      };
      if (m > 0) launch(b, fused_kernel<S, A, Space>{p, o, init, mid.data(), 0, 1, 0, m}, groups, pl.lanes());
      fence(b);
      auto s_m = [&](index_t h) -> const A* { return m > 0 ? mid.data() + h * sz : state_of(h); };
      if (roles.publish) {
        const std::span<A> tail = sc.tail;
        std::fill(tail.begin(), tail.end(), A(0));
        if (m < n)
          launch(b, state_scan_kernel<S, A, Space>{p, nullptr, tail.data(), nullptr, false, m, n}, groups, pl.lanes());
        fence(b);
        for (index_t h = 0; h < H; ++h) {
          const A a = decay_from(m, h), *sm = s_m(h);
          for (index_t e = 0; e < sz; ++e) end_state[h * sz + e] = (sm ? a * sm[e] : A(0)) + tail[h * sz + e];
        }
      }
      post();
      const A* xin = finish();
      for (index_t h = 0; h < H; ++h) {
        const A* sm = s_m(h);
        const A a = m < n ? exp_acc(cum[m * H + h]) : decay_from(0, h);  // exp(B_m)
        for (index_t e = 0; e < sz; ++e) start[h * sz + e] = (sm ? sm[e] : A(0)) + (xin ? a * xin[h * sz + e] : A(0));
      }
      if (xin && m > 0)
        launch(b, incoming_kernel<S, A, Space>{p, o, xin, p.gate.log_gate ? cum.data() : nullptr, 0, m}, m * groups,
               pl.lanes());
      if (m < n)
        launch(b, fused_kernel<S, A, Space>{p, o, start.data(), fin_p, 0, 1, m, n}, groups, pl.lanes());
      else
        std::copy(start.begin(), start.end(), fin_p);
      return true;
    }
  }
  launch(b, chunk_state_kernel<S, A, Space>{p}, pl.chunks() * groups, pl.lanes());
  launch(b, state_pass_kernel<S, A, Space>{p, init, fin_p, w.cum}, doc_items, pl.lanes());
  if (roles.publish && pl.docs() > 0)
    loom::copy_bytes(b, end_state, fin_p + (pl.docs() - 1) * H * sz, sizeof(A) * static_cast<std::size_t>(H * sz));
  post();
  const index_t split = pl.docs() > 0 ? plan_access::table(pl).doc_chunk[1] : 0;
  launch(b, output_kernel<S, A, Space>{p, o, split, pl.chunks()}, (pl.chunks() - split) * groups, pl.lanes());
  const A* incoming = finish();
  launch(b, output_kernel<S, A, Space>{p, o, 0, split, incoming, w.cum}, split * groups, pl.lanes());
  return false;
}

//! The checks of a backward's output gradients (d_o, d_final_state: optional) and gradients (dq,
//! dk, dv; d_initial_state: optional; d_log_gate: for scalar_gate only, and there required) against
//! plan pl. Every backward runs them (loom's kernels, the batched products).
template <class Gating, class P, class Space>
void check_backward_args(const plan<P>& pl, tensor_view<const typename P::storage_type, 3, Space> d_o,
                         tensor_view<const typename P::accum_type, 4, Space> dfin, const gradients<P, Space>& g) {
  expect_extents(d_o, {pl.tokens(), pl.heads(), pl.dv()}, "d_o");
  if (present(dfin)) expect_extents(dfin, {pl.docs(), pl.heads(), pl.dk(), pl.dv()}, "d_final_state");
  if (present(dfin))
    LOOM_EXPECTS(dfin.is_contiguous(), errc::shape_mismatch, "d_final_state: expected a contiguous view");
  expect_extents(g.dq, {pl.tokens(), pl.heads(), pl.dk()}, "dq");
  expect_extents(g.dk, {pl.tokens(), pl.heads(), pl.dk()}, "dk");
  expect_extents(g.dv, {pl.tokens(), pl.heads(), pl.dv()}, "dv");
  check_state_out(g.d_initial_state, pl.docs(), pl.heads(), pl.dk(), pl.dv(), "d_initial_state");
  if constexpr (is_scalar_gate<Gating>)
    expect_extents(g.d_log_gate, {pl.tokens(), pl.heads()}, "d_log_gate");
  else
    LOOM_EXPECTS(!present(g.d_log_gate), errc::invalid_argument,
                 "d_log_gate: expected an empty view (only scalar_gate has a gate gradient)");
}

template <class B, class P, class Gating, class Space>
void run_backward(const B& b, const plan<P>& pl, const Gating& gating, const operands<P, Space>& x,
                  tensor_view<const typename P::storage_type, 3, Space> d_o,
                  tensor_view<const typename P::accum_type, 4, Space> dfin, const gradients<P, Space>& g,
                  std::span<std::byte> ws, typename P::accum_type* fin_out = nullptr,
                  std::string_view call = "linear_attention::backward") {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  auto [p, w] = setup(b, pl, gating, x, ws, true, call);
  check_backward_args<Gating>(pl, d_o, dfin, g);
  constexpr bool gated = is_scalar_gate<Gating>;
  const index_t chunk_items = pl.chunks() * pl.heads(), doc_items = pl.docs() * pl.heads();
  const bool with_fin = gated && present(dfin);
  launch(b, chunk_state_kernel<S, A, Space>{p}, pl.chunks() * pl.head_groups(), pl.lanes());
  A* fin = fin_out ? fin_out : with_fin ? w.fin : nullptr;
  launch(b, state_pass_kernel<S, A, Space>{p, x.initial_state.data(), fin, nullptr}, doc_items, pl.lanes());
  launch(b, adjoint_chunk_kernel<S, A, Space>{p, d_o, w.adj}, chunk_items, pl.lanes());
  launch(b, adjoint_pass_kernel<S, A, Space>{p, w.adj, dfin.data(), g.d_initial_state.data()}, doc_items, pl.lanes());
  launch(b, gradient_kernel<S, A, Space>{p, d_o, g.dq, g.dk, g.dv, w.adj, gated ? w.db : nullptr}, chunk_items,
         pl.lanes());
  if constexpr (gated)
    if (doc_items > 0)
      for_each_index(b, doc_items,
                     gate_gradient_kernel<A, Space>{w.cu, pl.docs(), pl.heads(), pl.dk() * pl.dv(), w.db,
                                                    with_fin ? fin : nullptr, dfin.data(), g.d_log_gate});
}

}  // namespace detail
}  // namespace loom::linear_attention
