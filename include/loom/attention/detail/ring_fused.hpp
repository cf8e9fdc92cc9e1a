#pragma once

//! @file
//! Ring attention (every variant: pass_kv, pass_q, all_gather_kv, bidirectional_kv) whose local step
//! is a fused band-mask kernel over ragged batches (the engine: cuDNN's SDPA graphs on loom::cuda,
//! attention/ring_cudnn.cuh) instead of loom's tile kernel. Everything but the engine is here and
//! runs on every backend:
//!
//!   - the program: step s pairs this rank's queries with the keys of rank (me - s) mod P; the
//!     step's fused blocks (fused_blocks.hpp: cropped, full or band-masked, none where nothing is
//!     visible) grouped into batches (batches_of), each with its ragged tables (fused_tables);
//!   - the forward: K/V travel the ring as in ring::pass_kv; each batch writes a partial (out in
//!     the storage type, lse) of this rank's rows, rows it does not cover at lse = -inf, and the
//!     partial is merged into the running (out, lse) in the accumulation type (merge.hpp);
//!   - the backward: each batch writes dQ, dK, dV of its rows in the storage type (the rest
//!     zeroed), added into dQ and into the travelling dK/dV accumulators in the accumulation type;
//!     the accumulators arrive home after P steps, as in ring::pass_kv;
//!   - pass_q: K/V stay; at step s rank (me - s)'s queries visit, each batch's partial is merged
//!     into that rank's slot of a send buffer (accumulation type), one all_to_allv returns the
//!     partials to their owners, which merge them in rank order (as ring::pass_q); in the backward
//!     Q, out, lse and dO travel with a dQ accumulator that arrives home after P steps, and dK/dV
//!     accumulate locally;
//!   - all_gather_kv: the same program and merges with every rank's K/V gathered once (padded, as
//!     ring::all_gather_kv) instead of travelling, so the forward's bits are pass-KV's; the
//!     backward adds each step's dK/dV into a padded accumulator of every rank's keys, summed home
//!     by one reduce_scatter (another order of summation than pass-KV's);
//!   - bidirectional_kv: K/V travel both ways at once (ring::bidirectional_kv's two chains); the
//!     program visits this rank's own keys, then per step the clockwise and the counter-clockwise
//!     block, merging in that order; in the backward each chain's dK/dV accumulator travels with
//!     its K/V and goes straight home after the last step, where the two are summed.
//!
//! An engine E runs one batch on a backend B; its tables are in B's memory (the program's tables
//! are uploaded into the workspace at the start of a call, or read in place on host memory):
//!
//!   e.workspace_bytes(fused_pass)                  bytes of its own workspace, largest batch
//!   e.check_call(fused_pass, call)                 throws what the engine cannot run (before any
//!                                                  transfer of the call)
//!   e.forward(b, i, tables, q, k, v, out, lse, ws)  batch i: out (T*), lse (Acc*) of its entries
//!   e.backward(b, i, tables, q, k, v, out, lse, dout, dq, dk, dv, ws)
//!
//! with q, out, lse, dout, dq this rank's dense rows and k, v, dk, dv the key block's, addressed
//! through the tables' element offsets. tests/attention/fused_reference.hpp holds an engine that
//! runs the same tables with loom kernels on every backend (the runner's CPU test).

#include <loom/attention/detail/fused_blocks.hpp>
#include <loom/attention/ring.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::attention::detail {

//! One batch of a fused ring program: its blocks (one bound pair), their largest sizes, and the
//! word offset of its tables in the program's table buffer.
struct fused_batch {
  std::vector<fused_block> blocks;
  index_t max_q = 0, max_k = 0;
  std::size_t table_at = 0;
};

//! The batches of one rank's ring call, visit by visit (a visit: one block of queries against one
//! block of keys).
struct fused_program {
  std::vector<fused_batch> batches;
  std::vector<std::size_t> step_begin;  //!< visit s runs batches [step_begin[s], step_begin[s + 1])
  std::vector<std::int64_t> words;      //!< every batch's fused_tables, each on a 32-word boundary
};

//! How a fused plan's variant moves its blocks.
enum class fused_kind { pass_kv, pass_q, gathered, both_ways };
template <class V>
inline constexpr fused_kind fused_kind_of = std::is_same_v<V, ring::pass_q>             ? fused_kind::pass_q
                                            : std::is_same_v<V, ring::all_gather_kv>    ? fused_kind::gathered
                                            : std::is_same_v<V, ring::bidirectional_kv> ? fused_kind::both_ways
                                                                                        : fused_kind::pass_kv;

//! The program of rank `me` of shard plan `sp` for heads and dims `s` and options `opt`, visit by
//! visit: visit s pairs this rank's queries with rank (me - s)'s keys; pass_q: rank (me - s)'s
//! queries with this rank's keys; both_ways: this rank's queries with its own keys, then for each
//! step s the keys of rank me - s (clockwise) and, where that chain runs, of rank me + s.
inline fused_program ring_program(const shard::plan& sp, int me, const head_shape& s, const options& opt,
                                  fused_kind kind) {
  const int p = sp.ranks();
  std::vector<int> others;
  if (kind == fused_kind::both_ways) {
    others.push_back(me);
    for (int step = 1; step <= p / 2; ++step) {
      others.push_back(ring_next(me, p, -step));
      if (step <= (p - 1) / 2) others.push_back(ring_next(me, p, step));
    }
  } else {
    for (int step = 0; step < p; ++step) others.push_back(ring_next(me, p, -step));
  }
  fused_program prog;
  for (const int other : others) {
    prog.step_begin.push_back(prog.batches.size());
    const auto blocks = kind == fused_kind::pass_q ? fused_blocks(sp.rank(other), sp.rank(me), opt)
                                                   : fused_blocks(sp.rank(me), sp.rank(other), opt);
    for (auto& g : batches_of(blocks)) {
      fused_batch fb;
      fb.table_at = prog.words.size();
      const fused_tables t = tables_of(g, s);
      prog.words.insert(prog.words.end(), t.words.begin(), t.words.end());
      for (const auto& b : g) fb.max_q = std::max(fb.max_q, b.q_count), fb.max_k = std::max(fb.max_k, b.k_count);
      fb.blocks = std::move(g);
      prog.batches.push_back(std::move(fb));
    }
  }
  prog.step_begin.push_back(prog.batches.size());
  return prog;
}

//! A fused ring plan's own state: the program, the engine and the workspace sizes.
template <class E>
struct fused_state {
  fused_program prog;
  std::shared_ptr<E> engine;
  std::size_t forward_bytes = 0, backward_bytes = 0;
};

//! The program's tables where the engine reads them: in place on host memory, else uploaded into
//! the workspace (stream-ordered) when the call starts. Reserved in every workspace.
struct fused_table_copy {
  std::int64_t* words = nullptr;
  const std::int64_t* bound = nullptr;  //!< the tables the engine reads (after bind)
  template <class A>
  static fused_table_copy take(A& a, const fused_program& prog) {
    return {a.template take<std::int64_t>(static_cast<index_t>(prog.words.size()))};
  }
  template <class Space, backend B>
  void bind(const B& b, const fused_program& prog) {
    if constexpr (Space::host_accessible) {
      bound = prog.words.data();
    } else {
      if (!prog.words.empty()) copy_bytes(b, words, prog.words.data(), prog.words.size() * sizeof(std::int64_t));
      bound = words;
    }
  }
};

//! What every fused pass's buffers (W::take) begin and end with: the program's tables, then the
//! engine's workspace.
struct fused_buffers {
  fused_table_copy tables;
  std::span<std::byte> engine;
};

//! Buffers W of one fused pass: the program's tables, W's own (W::take(a, st, extra...)), the
//! engine's workspace of `engine_bytes`.
template <class W, class A, class... X>
W take_fused(A& a, const ring_state& st, const fused_program& prog, std::size_t engine_bytes, X... extra) {
  const fused_table_copy tables = fused_table_copy::take(a, prog);
  W w = W::take(a, st, extra...);
  w.tables = tables;
  w.engine = take_bytes(a, engine_bytes);
  return w;
}

//! a[i] += p[i] in the accumulation type.
template <class Acc, class T>
struct accumulate_kernel {
  Acc* a;
  const T* p;
  LOOM_HD void operator()(index_t i) const { a[i] += static_cast<Acc>(p[i]); }
};
template <backend B, class Acc, class T, class S>
void accumulate(const B& b, const block<Acc, S>& a, const block<T, S>& p) {
  if (p.size() > 0) for_each_index(b, p.size(), accumulate_kernel<Acc, T>{a.p, p.p});
}
template <backend B, class T, class S>
void zero_storage(const B& b, const block<T, S>& x) {
  if (x.size() > 0) loom::detail::fill(b, x.p, x.size(), static_cast<T>(0.0f));
}

//! The K/V blocks of a K/V-moving kind (bidirectional.hpp's chain_blocks): cw and cw_n the
//! current and next block (gathered: this rank's padded block and every rank's), ccw and ccw_n the
//! counter-clockwise pair (both_ways only): cw_rows and cw_n_rows rows, the pair max_rows each.
template <class T, class S, class A>
chain_blocks<T, S> take_chains(A& a, const ring_state& st, fused_kind kind, index_t cw_rows, index_t cw_n_rows) {
  const index_t both = kind == fused_kind::both_ways ? st.max_rows : 0;
  return {kv_block<T, S>::take(a, st, cw_rows), kv_block<T, S>::take(a, st, cw_n_rows),
          kv_block<T, S>::take(a, st, both), kv_block<T, S>::take(a, st, both)};
}

template <class T, class Acc, class S>
struct fused_forward_buffers : fused_buffers {
  chain_blocks<T, S> kv;
  block<Acc, S> acc, lacc;
  block<T, S> part;
  block<Acc, S> lpart;
  template <class A>
  static fused_forward_buffers take(A& a, const ring_state& st, fused_kind kind) {
    const auto& s = st.dims;
    fused_forward_buffers w;
    w.kv = take_chains<T, S>(a, st, kind, st.max_rows,
                             kind == fused_kind::gathered ? st.ranks * st.max_rows : st.max_rows);
    w.acc = take_block<Acc, S>(a, st.mine, s.heads_q, s.dim_v);
    w.lacc = take_block<Acc, S>(a, st.mine, s.heads_q, 1);
    w.part = take_block<T, S>(a, st.mine, s.heads_q, s.dim_v);
    w.lpart = take_block<Acc, S>(a, st.mine, s.heads_q, 1);
    return w;
  }
};

//! g: the dK/dV accumulators, travelling with kv (gathered: g.cw the padded accumulator of every
//! rank's keys, g.cw_n this rank's reduced rows).
template <class T, class Acc, class S>
struct fused_backward_buffers : fused_buffers {
  chain_blocks<T, S> kv;
  block<Acc, S> gq;
  chain_blocks<Acc, S> g;
  block<T, S> pq;
  kv_block<T, S> pkv;
  template <class A>
  static fused_backward_buffers take(A& a, const ring_state& st, fused_kind kind) {
    const auto& s = st.dims;
    const index_t m = st.max_rows, all = kind == fused_kind::gathered ? st.ranks * m : m;
    fused_backward_buffers w;
    w.kv = take_chains<T, S>(a, st, kind, m, all);
    w.gq = take_block<Acc, S>(a, st.mine, s.heads_q, s.dim_qk);
    w.g = take_chains<Acc, S>(a, st, kind, all, m);
    w.pq = take_block<T, S>(a, st.mine, s.heads_q, s.dim_qk);
    w.pkv = kv_block<T, S>::take(a, st, m);
    return w;
  }
};

//! pass_q's forward: this rank's K/V, the visiting queries, a batch's partial, and pass_q's send
//! and receive buffers of partials (out then lse per owner, accumulation type).
template <class T, class Acc, class S>
struct fused_q_forward_buffers : fused_buffers, q_partials<T, Acc, S> {
  kv_block<T, S> mine;
  block<T, S> part;
  block<Acc, S> lpart;
  template <class A>
  static fused_q_forward_buffers take(A& a, const ring_state& st) {
    const auto& s = st.dims;
    fused_q_forward_buffers w;
    w.mine = kv_block<T, S>::take(a, st, st.mine);
    static_cast<q_partials<T, Acc, S>&>(w).take(a, st);
    w.part = take_block<T, S>(a, st.max_rows, s.heads_q, s.dim_v);
    w.lpart = take_block<Acc, S>(a, st.max_rows, s.heads_q, 1);
    return w;
  }
};

//! pass_q's backward: this rank's K/V, the visitors (q_visitors), the travelling dQ accumulator,
//! this rank's dK/dV accumulator, and a batch's partials.
template <class T, class Acc, class S>
struct fused_q_backward_buffers : fused_buffers {
  kv_block<T, S> mine, pkv;
  q_visitors<T, Acc, S> vis;
  block<T, S> pq;
  block<Acc, S> gq, gqn;
  kv_block<Acc, S> gkv;
  template <class A>
  static fused_q_backward_buffers take(A& a, const ring_state& st) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    fused_q_backward_buffers w;
    w.mine = kv_block<T, S>::take(a, st, st.mine);
    w.pkv = kv_block<T, S>::take(a, st, st.mine);
    w.vis = q_visitors<T, Acc, S>::take(a, st);
    w.pq = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    for (block<Acc, S>* x : {&w.gq, &w.gqn}) *x = take_block<Acc, S>(a, m, s.heads_q, s.dim_qk);
    w.gkv = kv_block<Acc, S>::take(a, st, st.mine);
    return w;
  }
};

//! Rows r0 .. r0 + n of a block.
template <class T, class S>
kv_block<T, S> rows_at(const kv_block<T, S>& x, index_t r0, index_t n) {
  return {{x.k.p + r0 * x.k.h * x.k.d, n, x.k.h, x.k.d}, {x.v.p + r0 * x.v.h * x.v.d, n, x.v.h, x.v.d}};
}

//! Sizes both workspaces of a fused plan of variant V (the carving code run against sizers).
template <class T, class Acc, class V, class E>
void size_fused(const ring_state& st, fused_state<E>& f) {
  ws_sizer fw, bw;
  const std::size_t fe = f.engine->workspace_bytes(fused_pass::forward),
                    be = f.engine->workspace_bytes(fused_pass::backward);
  if constexpr (fused_kind_of<V> == fused_kind::pass_q) {
    (void)take_fused<fused_q_forward_buffers<T, Acc, host_memory>>(fw, st, f.prog, fe);
    (void)take_fused<fused_q_backward_buffers<T, Acc, host_memory>>(bw, st, f.prog, be);
  } else {
    (void)take_fused<fused_forward_buffers<T, Acc, host_memory>>(fw, st, f.prog, fe, fused_kind_of<V>);
    (void)take_fused<fused_backward_buffers<T, Acc, host_memory>>(bw, st, f.prog, be, fused_kind_of<V>);
  }
  f.forward_bytes = fw.l.bytes();
  f.backward_bytes = bw.l.bytes();
}

//! Buffers W of one fused pass carved from `ws` (take_fused, with the engine's bytes for `pass`),
//! the program's tables bound (w.tables.bound).
template <class W, class B, class E, class... X>
W carve_fused(const B& b, const ring_state& st, const fused_state<E>& f, fused_pass pass, std::span<std::byte> ws,
              X... extra) {
  using S = typename backend_traits<B>::memory_space;
  workspace_carver a(ws);
  W w = take_fused<W>(a, st, f.prog, f.engine->workspace_bytes(pass), extra...);
  w.tables.template bind<S>(b, f.prog);
  return w;
}

//! A running (out, lse) pair before its first merge: out 0, lse -inf (merge's identity).
template <class B, class Acc, class S>
void start_running(const B& b, const block<Acc, S>& acc, const block<Acc, S>& lacc) {
  acc.zero(b);
  if (lacc.size() > 0) loom::detail::fill(b, lacc.p, lacc.size(), neg_inf<Acc>());
}

//! Visit v of the program: each of its batches' partial (out, lse) of queries q against keys
//! (rows of `keys`) merged in the accumulation type into (acc, lacc), in batch order.
template <class B, class E, class T, class Acc, class S>
void forward_visit(const B& b, const fused_state<E>& f, const std::int64_t* tables, std::size_t v, const T* q,
                   const kv_block<T, S>& keys, const block<T, S>& part, const block<Acc, S>& lpart,
                   const block<Acc, S>& acc, const block<Acc, S>& lacc, std::span<std::byte> ws) {
  for (std::size_t i = f.prog.step_begin[v]; i < f.prog.step_begin[v + 1]; ++i) {
    loom::detail::fill(b, lpart.p, lpart.size(), neg_inf<Acc>());  // rows no entry writes
    f.engine->forward(b, i, tables + f.prog.batches[i].table_at, q, keys.k.p, keys.v.p, part.p, lpart.p, ws);
    merge(b, acc.view(), lacc.view2(), part.cview(), lpart.cview2());
  }
}

//! Visit v of the program's backward: each batch's dQ and dK/dV (storage type, pq and pkv zeroed
//! first: rows no entry writes) added in the accumulation type into gq and into gkv (the rows of
//! `keys`), in batch order.
template <class B, class E, class T, class Acc, class S>
void backward_visit(const B& b, const fused_state<E>& f, const std::int64_t* tables, std::size_t v, const T* q,
                    const kv_block<T, S>& keys, const T* out, const Acc* lse, const T* dout, const block<T, S>& pq,
                    kv_block<T, S> pkv, const block<Acc, S>& gq, const kv_block<Acc, S>& gkv, std::span<std::byte> ws) {
  pkv.set_rows(keys.k.n);
  for (std::size_t i = f.prog.step_begin[v]; i < f.prog.step_begin[v + 1]; ++i) {
    zero_storage(b, pq);
    zero_storage(b, pkv.k);
    zero_storage(b, pkv.v);
    f.engine->backward(b, i, tables + f.prog.batches[i].table_at, q, keys.k.p, keys.v.p, out, lse, dout, pq.p, pkv.k.p,
                       pkv.v.p, ws);
    accumulate(b, gq, pq);
    accumulate(b, gkv.k, pkv.k);
    accumulate(b, gkv.v, pkv.v);
  }
}

//! The K/V a fused pass starts from: this rank's block (pass_kv) or every rank's, gathered
//! (all_gather_kv).
template <bool Gathered, class B, class C, class K, class V, class KV>
void first_kv(const B& b, C& comm, const ring_state& st, K k, V v, KV& kv) {
  if constexpr (Gathered)
    runner<ring::all_gather_kv>::gather_padded(b, comm, st, k, v, kv.cw, kv.cw_n);
  else
    kv.cw.load(b, st.mine, k, v);
}

//! pass_kv's and all_gather_kv's forward on a fused engine (see the file comment).
template <class T, class Acc, class Var, class B, class C, class E, class Q, class K, class V, class O, class L>
void fused_forward(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                   std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  constexpr bool gathered = fused_kind_of<Var> == fused_kind::gathered;
  auto w = carve_fused<fused_forward_buffers<T, Acc, S>>(b, st, f, fused_pass::forward, ws, fused_kind_of<Var>);
  const std::int64_t* tables = w.tables.bound;
  const int p = st.ranks, me = st.me;
  auto& kv = w.kv;
  start_running(b, w.acc, w.lacc);
  first_kv<gathered>(b, comm, st, k, v, kv);
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    if (!gathered && s + 1 < p) reqs.shift(comm, b, kv.cw, kv.cw_n, st.rows(ring_next(me, p, -(s + 1))), 0);
    const int from = ring_next(me, p, -s);
    forward_visit(b, f, tables, static_cast<std::size_t>(s), q.data(),
                  gathered ? rows_at(kv.cw_n, from * st.max_rows, st.rows(from)) : kv.cw, w.part, w.lpart, w.acc,
                  w.lacc, w.engine);
    if (!gathered) {
      reqs.wait(comm, b);
      std::swap(kv.cw, kv.cw_n);
    }
  }
  copy_out(b, w.acc, out);
  copy_out2(b, w.lacc, lse);
}

//! pass_kv's and all_gather_kv's backward on a fused engine (see the file comment).
template <class T, class Acc, class Var, class B, class C, class E, class Q, class K, class V, class O, class L,
          class DO, class DQ, class DK, class DV>
void fused_backward(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                    DO dout, DQ dq, DK dk, DV dv, std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  constexpr bool gathered = fused_kind_of<Var> == fused_kind::gathered;
  auto w = carve_fused<fused_backward_buffers<T, Acc, S>>(b, st, f, fused_pass::backward, ws, fused_kind_of<Var>);
  const std::int64_t* tables = w.tables.bound;
  const int p = st.ranks, me = st.me;
  auto& kv = w.kv;
  first_kv<gathered>(b, comm, st, k, v, kv);
  w.gq.n = st.mine;
  w.gq.zero(b);
  if (!gathered) w.g.cw.set_rows(st.mine);
  w.g.cw.zero(b);  // gathered: every rank's rows and the padding between them
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    const index_t next_rows = st.rows(ring_next(me, p, -(s + 1)));
    if (!gathered && s + 1 < p) reqs.shift(comm, b, kv.cw, kv.cw_n, next_rows, 0);
    const int from = ring_next(me, p, -s);
    const index_t at = from * st.max_rows, rows = st.rows(from);
    backward_visit(b, f, tables, static_cast<std::size_t>(s), q.data(), gathered ? rows_at(kv.cw_n, at, rows) : kv.cw,
                   out.data(), lse.data(), dout.data(), w.pq, w.pkv, w.gq,
                   gathered ? rows_at(w.g.cw, at, rows) : w.g.cw, w.engine);
    if (gathered) continue;
    if (p > 1) reqs.shift(comm, b, w.g.cw, w.g.cw_n, next_rows, 2);  // the accumulators move on (at the end: home)
    reqs.wait(comm, b);
    if (p > 1) std::swap(w.g.cw, w.g.cw_n);
    if (s + 1 < p) std::swap(kv.cw, kv.cw_n);
  }
  if constexpr (gathered) {
    runner<ring::all_gather_kv>::reduce_home(b, comm, st, w.g.cw, w.g.cw_n);
    w.g.cw = w.g.cw_n;
  }
  copy_out(b, w.gq, dq);
  copy_out(b, w.g.cw.k, dk);
  copy_out(b, w.g.cw.v, dv);
}

//! bidirectional_kv's forward on a fused engine: ring::bidirectional_kv's two chains, each visit
//! the program's next (own block, then per step the clockwise block and the counter-clockwise
//! one).
template <class T, class Acc, class B, class C, class E, class Q, class K, class V, class O, class L>
void fused_forward_both(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                        std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  auto w = carve_fused<fused_forward_buffers<T, Acc, S>>(b, st, f, fused_pass::forward, ws, fused_kind::both_ways);
  const std::int64_t* tables = w.tables.bound;
  start_running(b, w.acc, w.lacc);
  std::size_t at = 0;
  runner<ring::bidirectional_kv>::forward_chains(b, comm, st, k, v, w.kv, [&](const kv_block<T, S>& keys, int) {
    forward_visit(b, f, tables, at++, q.data(), keys, w.part, w.lpart, w.acc, w.lacc, w.engine);
  });
  copy_out(b, w.acc, out);
  copy_out2(b, w.lacc, lse);
}

//! bidirectional_kv's backward on a fused engine: the two chains carry K/V with their dK/dV
//! accumulators, which go home after the last step and are summed there (ring::bidirectional_kv).
template <class T, class Acc, class B, class C, class E, class Q, class K, class V, class O, class L, class DO,
          class DQ, class DK, class DV>
void fused_backward_both(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out,
                         L lse, DO dout, DQ dq, DK dk, DV dv, std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  auto w = carve_fused<fused_backward_buffers<T, Acc, S>>(b, st, f, fused_pass::backward, ws, fused_kind::both_ways);
  const std::int64_t* tables = w.tables.bound;
  w.gq.n = st.mine;
  w.gq.zero(b);
  std::size_t at = 0;
  runner<ring::bidirectional_kv>::backward_chains(
      b, comm, st, k, v, w.kv, w.g, dk, dv, [&](const kv_block<T, S>& keys, const kv_block<Acc, S>& g, int) {
        backward_visit(b, f, tables, at++, q.data(), keys, out.data(), lse.data(), dout.data(), w.pq, w.pkv, w.gq, g,
                       w.engine);
      });
  copy_out(b, w.gq, dq);
}

//! pass_q's forward on a fused engine (see the file comment).
template <class T, class Acc, class B, class C, class E, class Q, class K, class V, class O, class L>
void fused_forward_q(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                     std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  auto w = carve_fused<fused_q_forward_buffers<T, Acc, S>>(b, st, f, fused_pass::forward, ws);
  const std::int64_t* tables = w.tables.bound;
  const int p = st.ranks, me = st.me;
  const index_t n = st.mine, hq = st.dims.heads_q, dv = st.dims.dim_v;
  w.mine.load(b, n, k, v);
  w.qc.n = n;
  copy_in(b, q, w.qc);
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    const int src = ring_next(me, p, -s);
    const index_t rows = st.rows(src);
    if (s + 1 < p) reqs.shift(comm, b, w.qc, w.qn, st.rows(ring_next(me, p, -(s + 1))), 4);
    // The visitors' partial, in their slot of the send buffer.
    Acc* base = w.send + st.send_displs[static_cast<std::size_t>(src)];
    const block<Acc, S> acc{base, rows, hq, dv}, lacc{base + rows * hq * dv, rows, hq, 1};
    start_running(b, acc, lacc);
    forward_visit(b, f, tables, static_cast<std::size_t>(s), w.qc.p, w.mine, block<T, S>{w.part.p, rows, hq, dv},
                  block<Acc, S>{w.lpart.p, rows, hq, 1}, acc, lacc, w.engine);
    reqs.wait(comm, b);
    std::swap(w.qc, w.qn);
  }
  runner<ring::pass_q>::partials_home(b, comm, st, w.send, w.recv, out, lse);
}

//! pass_q's backward on a fused engine (see the file comment).
template <class T, class Acc, class B, class C, class E, class Q, class K, class V, class O, class L, class DO,
          class DQ, class DK, class DV>
void fused_backward_q(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                      DO dout, DQ dq, DK dk, DV dv, std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  auto w = carve_fused<fused_q_backward_buffers<T, Acc, S>>(b, st, f, fused_pass::backward, ws);
  const std::int64_t* tables = w.tables.bound;
  const int p = st.ranks, me = st.me;
  const index_t n = st.mine;
  w.mine.load(b, n, k, v);
  auto& vis = w.vis;
  vis.load(b, n, q, out, dout, lse);
  w.gq.n = n;
  w.gq.zero(b);
  w.gkv.zero(b);
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    const index_t rows = st.rows(ring_next(me, p, -s)), nn = st.rows(ring_next(me, p, -(s + 1)));
    if (s + 1 < p) vis.post(reqs, comm, b, nn);
    backward_visit(b, f, tables, static_cast<std::size_t>(s), vis.q.p, w.mine, vis.o.p, vis.l.p, vis.d.p,
                   block<T, S>{w.pq.p, rows, w.pq.h, w.pq.d}, w.pkv, w.gq, w.gkv, w.engine);
    if (p > 1) reqs.shift(comm, b, w.gq, w.gqn, nn, 8);  // the visitors' dQ moves on (at the end: home)
    reqs.wait(comm, b);
    if (p > 1) std::swap(w.gq, w.gqn);
    if (s + 1 < p) vis.advance();
  }
  copy_out(b, w.gq, dq);
  copy_out(b, w.gkv.k, dk);
  copy_out(b, w.gkv.v, dv);
}

}  // namespace loom::attention::detail

namespace loom::attention::ring {

//! A ring plan of variant V (pass_kv, pass_q, all_gather_kv or bidirectional_kv) of one rank whose local step is engine
//! E (a fused band-mask kernel; see the file comment). Made by the make_plan of the engine's header (ring_cudnn.cuh:
//! ring::make_plan<P>(b, comm, [variant,] cudnn::fused{}, sharding, shape, opts)). Immutable; copies share one state;
//! may be shared between threads for reading (each call with its own workspace).
template <class B, precision_policy P, class E, class V = pass_kv>
class fused_plan : public precision_types<P> {
  static_assert(variant<V>, "a fused ring plan takes a ring variant tag");

 public:
  fused_plan() = default;
  using variant_type = V;
  using engine_type = E;
  [[nodiscard]] int ranks() const noexcept { return base_.ranks(); }
  [[nodiscard]] int rank() const noexcept { return base_.rank(); }
  [[nodiscard]] const shard::plan& sharding() const noexcept { return base_.sharding(); }
  [[nodiscard]] const shape& dims() const noexcept { return base_.dims(); }
  [[nodiscard]] const options& opts() const noexcept { return base_.opts(); }
  [[nodiscard]] index_t tokens() const noexcept { return base_.tokens(); }
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return f_->forward_bytes; }
  [[nodiscard]] std::size_t backward_workspace_bytes() const noexcept { return f_->backward_bytes; }
  //! The fused batches each call runs (all steps).
  [[nodiscard]] std::size_t batches() const noexcept { return f_->prog.batches.size(); }
  //! The derived state (for loom's own callers).
  [[nodiscard]] const detail::ring_state& state() const noexcept { return base_.state(); }
  [[nodiscard]] const attention::detail::fused_state<E>& fused() const noexcept { return *f_; }

  fused_plan(plan<V, B, P> base, std::shared_ptr<const attention::detail::fused_state<E>> f)
      : base_(std::move(base)), f_(std::move(f)) {}

 private:
  plan<V, B, P> base_;
  std::shared_ptr<const attention::detail::fused_state<E>> f_;
};

namespace detail {
//! Makes a fused ring plan of variant V: the ring plan's checks and agreement (make_plan_checked,
//! the variant and the local step named `local_kind` in the signature), with
//! `make_engine(program, n)` run inside the agreement, so an engine that rejects the problem on
//! one rank (loom::error) is every rank's error. make_engine returns a std::shared_ptr<E>.
template <precision_policy P, class V = pass_kv, class B, comm::communicator C, class MakeEngine>
auto make_fused_plan(const B& b, C& comm, const shard::plan& sharding, const shape& s, const options& opt,
                     std::string_view call, int local_kind, MakeEngine&& make_engine) {
  using E = typename std::invoke_result_t<MakeEngine&, const attention::detail::fused_program&, index_t>::element_type;
  auto f = std::make_shared<attention::detail::fused_state<E>>();
  auto base = make_plan_checked<P, V>(
      b, comm, sharding, s, opt, call,
      [&](index_t n) {
        f->prog = attention::detail::ring_program(sharding, comm.rank(), s, opt, attention::detail::fused_kind_of<V>);
        f->engine = make_engine(std::as_const(f->prog), n);
      },
      local_kind);
  attention::detail::size_fused<typename P::storage_type, typename P::accum_type, V>(base.state(), *f);
  return fused_plan<B, P, E, V>(std::move(base), std::move(f));
}

//! The per-call checks of a fused plan's call: the ring plan's, and dense views where the engine
//! reads them through element offsets.
template <class Q, class O, class L>
void check_fused_views(const Q& q, const O& out, const L& lse, bool outputs_read, std::string_view call) {
  attention::detail::expect_dense(q, call, "q");
  if (outputs_read) {
    attention::detail::expect_dense(out, call, "out");
    attention::detail::expect_dense(lse, call, "lse");
  }
}
}  // namespace detail

//! Forward on a fused plan: as ring::forward on a plan of its variant (same views, same traffic,
//! same results up to the engine's summation order), with q dense. Allocates nothing;
//! stream-ordered on device backends. all_gather_kv gives the bits of pass_kv on the same engine.
template <class B, precision_policy P, class E, class V, comm::communicator C, class Q, class K, class Vv, class O,
          class L>
void forward(const B& b, C& comm, const fused_plan<B, P, E, V>& fp, Q q, K k, Vv v, O out, L lse,
             std::span<std::byte> workspace) {
  constexpr std::string_view call = "ring::forward (fused)";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  const auto& st = fp.state();
  detail::check_ring_call<B, T, Acc>(comm, st, q, k, v, out, lse, call);
  detail::check_fused_views(q, out, lse, false, call);
  check_workspace(workspace, fp.workspace_bytes(), call);
  fp.fused().engine->check_call(attention::detail::fused_pass::forward, call);
  if constexpr (std::is_same_v<V, pass_q>)
    attention::detail::fused_forward_q<T, Acc>(b, comm, st, fp.fused(), q, k, v, out, lse, workspace);
  else if constexpr (std::is_same_v<V, bidirectional_kv>)
    attention::detail::fused_forward_both<T, Acc>(b, comm, st, fp.fused(), q, k, v, out, lse, workspace);
  else
    attention::detail::fused_forward<T, Acc, V>(b, comm, st, fp.fused(), q, k, v, out, lse, workspace);
}

//! Backward on a fused plan: as ring::backward on a plan of its variant, with q, out, lse and dout
//! dense.
template <class B, precision_policy P, class E, class V, comm::communicator C, class Q, class K, class Vv, class O,
          class L, class DO, class DQ, class DK, class DV>
void backward(const B& b, C& comm, const fused_plan<B, P, E, V>& fp, Q q, K k, Vv v, O out, L lse, DO dout, DQ dq,
              DK dk, DV dv, std::span<std::byte> workspace) {
  constexpr std::string_view call = "ring::backward (fused)";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  const auto& st = fp.state();
  detail::check_ring_call<B, T, Acc>(comm, st, q, k, v, out, lse, call);
  detail::check_rank_gradients<T, true>(st.dims, st.mine, dout, dq, dk, dv, call);
  detail::check_fused_views(q, out, lse, true, call);
  attention::detail::expect_dense(dout, call, "dout");
  check_workspace(workspace, fp.backward_workspace_bytes(), call, "plan.backward_workspace_bytes()");
  fp.fused().engine->check_call(attention::detail::fused_pass::backward, call);
  if constexpr (std::is_same_v<V, pass_q>)
    attention::detail::fused_backward_q<T, Acc>(b, comm, st, fp.fused(), q, k, v, out, lse, dout, dq, dk, dv,
                                                workspace);
  else if constexpr (std::is_same_v<V, bidirectional_kv>)
    attention::detail::fused_backward_both<T, Acc>(b, comm, st, fp.fused(), q, k, v, out, lse, dout, dq, dk, dv,
                                                   workspace);
  else
    attention::detail::fused_backward<T, Acc, V>(b, comm, st, fp.fused(), q, k, v, out, lse, dout, dq, dk, dv,
                                                 workspace);
}

}  // namespace loom::attention::ring
