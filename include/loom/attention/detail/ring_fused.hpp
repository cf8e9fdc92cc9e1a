#pragma once

//! @file
//! Ring pass-KV and all-gather-KV attention whose local step is a fused band-mask kernel over
//! ragged batches (the engine: cuDNN's SDPA graphs on loom::cuda, attention/ring_cudnn.cuh)
//! instead of loom's tile kernel. Everything but the engine is here and runs on every backend:
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
//!     by one reduce_scatter (another order of summation than pass-KV's).
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

//! The batches of one rank's ring pass-KV call, step by step.
struct fused_program {
  std::vector<fused_batch> batches;
  std::vector<std::size_t> step_begin;  //!< step s runs batches [step_begin[s], step_begin[s + 1])
  std::vector<std::int64_t> words;      //!< every batch's fused_tables, each on a 32-word boundary
};

//! The program of rank `me` of shard plan `sp` for heads and dims `s` and options `opt`: step s
//! pairs this rank's queries with rank (me - s)'s keys, or, where the queries travel (pass_q),
//! rank (me - s)'s queries with this rank's keys.
inline fused_program ring_program(const shard::plan& sp, int me, const head_shape& s, const options& opt,
                                  bool queries_travel = false) {
  const int p = sp.ranks();
  fused_program prog;
  for (int step = 0; step < p; ++step) {
    prog.step_begin.push_back(prog.batches.size());
    const int other = ring_next(me, p, -step);
    const auto blocks = queries_travel ? fused_blocks(sp.rank(other), sp.rank(me), opt)
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
  template <class A>
  static fused_table_copy take(A& a, const fused_program& prog) {
    return {a.template take<std::int64_t>(static_cast<index_t>(prog.words.size()))};
  }
  template <class Space, backend B>
  const std::int64_t* bind(const B& b, const fused_program& prog) const {
    if constexpr (Space::host_accessible) {
      return prog.words.data();
    } else {
      if (!prog.words.empty()) copy_bytes(b, words, prog.words.data(), prog.words.size() * sizeof(std::int64_t));
      return words;
    }
  }
};

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

template <class T, class Acc, class S>
struct fused_forward_buffers {
  fused_table_copy tables;
  kv_block<T, S> cur, next;
  block<Acc, S> acc, lacc;
  block<T, S> part;
  block<Acc, S> lpart;
  std::span<std::byte> engine;
  //! gathered (all_gather_kv): cur is this rank's padded block, next every rank's.
  template <class A>
  static fused_forward_buffers take(A& a, const ring_state& st, const fused_program& prog, std::size_t engine_bytes,
                                    bool gathered) {
    const auto& s = st.dims;
    fused_forward_buffers w;
    w.tables = fused_table_copy::take(a, prog);
    w.cur = kv_block<T, S>::take(a, st, st.max_rows);
    w.next = kv_block<T, S>::take(a, st, gathered ? st.ranks * st.max_rows : st.max_rows);
    w.acc = take_block<Acc, S>(a, st.mine, s.heads_q, s.dim_v);
    w.lacc = take_block<Acc, S>(a, st.mine, s.heads_q, 1);
    w.part = take_block<T, S>(a, st.mine, s.heads_q, s.dim_v);
    w.lpart = take_block<Acc, S>(a, st.mine, s.heads_q, 1);
    w.engine = take_bytes(a, engine_bytes);
    return w;
  }
};

template <class T, class Acc, class S>
struct fused_backward_buffers {
  fused_table_copy tables;
  kv_block<T, S> cur, next;
  block<Acc, S> gq;
  kv_block<Acc, S> gkv, gnext;
  block<T, S> pq;
  kv_block<T, S> pkv;
  std::span<std::byte> engine;
  //! gathered (all_gather_kv): cur and next as the forward's, gkv the padded accumulator of every
  //! rank's keys and gnext this rank's reduced rows.
  template <class A>
  static fused_backward_buffers take(A& a, const ring_state& st, const fused_program& prog, std::size_t engine_bytes,
                                     bool gathered) {
    const auto& s = st.dims;
    const index_t all = gathered ? st.ranks * st.max_rows : st.max_rows;
    fused_backward_buffers w;
    w.tables = fused_table_copy::take(a, prog);
    w.cur = kv_block<T, S>::take(a, st, st.max_rows);
    w.next = kv_block<T, S>::take(a, st, all);
    w.gq = take_block<Acc, S>(a, st.mine, s.heads_q, s.dim_qk);
    w.gkv = kv_block<Acc, S>::take(a, st, all);
    w.gnext = kv_block<Acc, S>::take(a, st, st.max_rows);
    w.pq = take_block<T, S>(a, st.mine, s.heads_q, s.dim_qk);
    w.pkv = kv_block<T, S>::take(a, st, st.max_rows);
    w.engine = take_bytes(a, engine_bytes);
    return w;
  }
};

//! pass_q's forward: this rank's K/V, the visiting queries, a batch's partial, and pass_q's send
//! and receive buffers of partials (out then lse per owner, accumulation type).
template <class T, class Acc, class S>
struct fused_q_forward_buffers {
  fused_table_copy tables;
  kv_block<T, S> mine;
  block<T, S> qc, qn, part;
  block<Acc, S> lpart;
  Acc *send = nullptr, *recv = nullptr;
  std::span<std::byte> engine;
  template <class A>
  static fused_q_forward_buffers take(A& a, const ring_state& st, const fused_program& prog, std::size_t engine_bytes) {
    const auto& s = st.dims;
    const index_t m = st.max_rows, row = s.heads_q * (s.dim_v + 1);
    fused_q_forward_buffers w;
    w.tables = fused_table_copy::take(a, prog);
    w.mine = kv_block<T, S>::take(a, st, st.mine);
    w.qc = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    w.qn = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    w.part = take_block<T, S>(a, m, s.heads_q, s.dim_v);
    w.lpart = take_block<Acc, S>(a, m, s.heads_q, 1);
    w.send = a.template take<Acc>(st.total * row);
    w.recv = a.template take<Acc>(st.ranks * st.mine * row);
    w.engine = take_bytes(a, engine_bytes);
    return w;
  }
};

//! pass_q's backward: this rank's K/V, the visiting Q, out, dO (storage type) and lse, the
//! travelling dQ accumulator, this rank's dK/dV accumulator, and a batch's partials.
template <class T, class Acc, class S>
struct fused_q_backward_buffers {
  fused_table_copy tables;
  kv_block<T, S> mine, pkv;
  block<T, S> qc, qn, oc, on, dc, dn, pq;
  block<Acc, S> lc, ln, gq, gqn;
  kv_block<Acc, S> gkv;
  std::span<std::byte> engine;
  template <class A>
  static fused_q_backward_buffers take(A& a, const ring_state& st, const fused_program& prog,
                                       std::size_t engine_bytes) {
    const auto& s = st.dims;
    const index_t m = st.max_rows;
    fused_q_backward_buffers w;
    w.tables = fused_table_copy::take(a, prog);
    w.mine = kv_block<T, S>::take(a, st, st.mine);
    w.pkv = kv_block<T, S>::take(a, st, st.mine);
    for (block<T, S>* x : {&w.qc, &w.qn, &w.pq}) *x = take_block<T, S>(a, m, s.heads_q, s.dim_qk);
    for (block<T, S>* x : {&w.oc, &w.on, &w.dc, &w.dn}) *x = take_block<T, S>(a, m, s.heads_q, s.dim_v);
    w.lc = take_block<Acc, S>(a, m, s.heads_q, 1);
    w.ln = take_block<Acc, S>(a, m, s.heads_q, 1);
    w.gq = take_block<Acc, S>(a, m, s.heads_q, s.dim_qk);
    w.gqn = take_block<Acc, S>(a, m, s.heads_q, s.dim_qk);
    w.gkv = kv_block<Acc, S>::take(a, st, st.mine);
    w.engine = take_bytes(a, engine_bytes);
    return w;
  }
};

//! Whether variant V gathers K/V (all_gather_kv) instead of passing it (pass_kv).
template <class V>
inline constexpr bool fused_gathers = std::is_same_v<V, ring::all_gather_kv>;

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
  if constexpr (std::is_same_v<V, ring::pass_q>) {
    (void)fused_q_forward_buffers<T, Acc, host_memory>::take(fw, st, f.prog, fe);
    (void)fused_q_backward_buffers<T, Acc, host_memory>::take(bw, st, f.prog, be);
  } else {
    (void)fused_forward_buffers<T, Acc, host_memory>::take(fw, st, f.prog, fe, fused_gathers<V>);
    (void)fused_backward_buffers<T, Acc, host_memory>::take(bw, st, f.prog, be, fused_gathers<V>);
  }
  f.forward_bytes = fw.l.bytes();
  f.backward_bytes = bw.l.bytes();
}

template <class T, class Acc, class Var, class B, class C, class E, class Q, class K, class V, class O, class L>
void fused_forward(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                   std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  constexpr bool gathered = fused_gathers<Var>;
  workspace_carver a(ws);
  auto w =
      fused_forward_buffers<T, Acc, S>::take(a, st, f.prog, f.engine->workspace_bytes(fused_pass::forward), gathered);
  const std::int64_t* tables = w.tables.template bind<S>(b, f.prog);
  const int p = st.ranks, me = st.me;
  w.acc.zero(b);
  if (w.lacc.size() > 0) loom::detail::fill(b, w.lacc.p, w.lacc.size(), neg_inf<Acc>());
  if constexpr (gathered)
    runner<ring::all_gather_kv>::gather_padded(b, comm, st, k, v, w.cur, w.next);
  else
    w.cur.load(b, st.mine, k, v);
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    if (!gathered && s + 1 < p) reqs.shift(comm, b, w.cur, w.next, st.rows(ring_next(me, p, -(s + 1))), 0);
    const int from = ring_next(me, p, -s);
    const kv_block<T, S> keys = gathered ? rows_at(w.next, from * st.max_rows, st.rows(from)) : w.cur;
    for (std::size_t i = f.prog.step_begin[static_cast<std::size_t>(s)];
         i < f.prog.step_begin[static_cast<std::size_t>(s) + 1]; ++i) {
      loom::detail::fill(b, w.lpart.p, w.lpart.size(), neg_inf<Acc>());  // rows no entry writes
      f.engine->forward(b, i, tables + f.prog.batches[i].table_at, q.data(), keys.k.p, keys.v.p, w.part.p, w.lpart.p,
                        w.engine);
      merge(b, w.acc.view(), w.lacc.view2(), w.part.cview(), w.lpart.cview2());
    }
    if (!gathered) {
      reqs.wait(comm, b);
      std::swap(w.cur, w.next);
    }
  }
  copy_out(b, w.acc, out);
  copy_out2(b, w.lacc, lse);
}

template <class T, class Acc, class Var, class B, class C, class E, class Q, class K, class V, class O, class L,
          class DO, class DQ, class DK, class DV>
void fused_backward(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                    DO dout, DQ dq, DK dk, DV dv, std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  constexpr bool gathered = fused_gathers<Var>;
  workspace_carver a(ws);
  auto w =
      fused_backward_buffers<T, Acc, S>::take(a, st, f.prog, f.engine->workspace_bytes(fused_pass::backward), gathered);
  const std::int64_t* tables = w.tables.template bind<S>(b, f.prog);
  const int p = st.ranks, me = st.me;
  if constexpr (gathered)
    runner<ring::all_gather_kv>::gather_padded(b, comm, st, k, v, w.cur, w.next);
  else
    w.cur.load(b, st.mine, k, v);
  w.gq.n = st.mine;
  w.gq.zero(b);
  if (!gathered) w.gkv.set_rows(st.mine);
  w.gkv.zero(b);  // gathered: every rank's rows and the padding between them
  w.pq.n = st.mine;
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    const index_t next_rows = st.rows(ring_next(me, p, -(s + 1)));
    if (!gathered && s + 1 < p) reqs.shift(comm, b, w.cur, w.next, next_rows, 0);
    const int from = ring_next(me, p, -s);
    const kv_block<T, S> keys = gathered ? rows_at(w.next, from * st.max_rows, st.rows(from)) : w.cur;
    const kv_block<Acc, S> sums = gathered ? rows_at(w.gkv, from * st.max_rows, st.rows(from)) : w.gkv;
    for (std::size_t i = f.prog.step_begin[static_cast<std::size_t>(s)];
         i < f.prog.step_begin[static_cast<std::size_t>(s) + 1]; ++i) {
      w.pkv.set_rows(keys.k.n);
      zero_storage(b, w.pq);  // rows no entry writes
      zero_storage(b, w.pkv.k);
      zero_storage(b, w.pkv.v);
      f.engine->backward(b, i, tables + f.prog.batches[i].table_at, q.data(), keys.k.p, keys.v.p, out.data(),
                         lse.data(), dout.data(), w.pq.p, w.pkv.k.p, w.pkv.v.p, w.engine);
      accumulate(b, w.gq, w.pq);
      accumulate(b, sums.k, w.pkv.k);
      accumulate(b, sums.v, w.pkv.v);
    }
    if (gathered) continue;
    if (p > 1) reqs.shift(comm, b, w.gkv, w.gnext, next_rows, 2);  // the accumulators move on (at the end: home)
    reqs.wait(comm, b);
    if (p > 1) std::swap(w.gkv, w.gnext);
    if (s + 1 < p) std::swap(w.cur, w.next);
  }
  if constexpr (gathered) {
    runner<ring::all_gather_kv>::reduce_home(b, comm, st, w.gkv, w.gnext);
    w.gkv = w.gnext;
  }
  copy_out(b, w.gq, dq);
  copy_out(b, w.gkv.k, dk);
  copy_out(b, w.gkv.v, dv);
}

//! pass_q's forward on a fused engine (see the file comment).
template <class T, class Acc, class B, class C, class E, class Q, class K, class V, class O, class L>
void fused_forward_q(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                     std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  workspace_carver a(ws);
  auto w = fused_q_forward_buffers<T, Acc, S>::take(a, st, f.prog, f.engine->workspace_bytes(fused_pass::forward));
  const std::int64_t* tables = w.tables.template bind<S>(b, f.prog);
  const int p = st.ranks, me = st.me;
  const index_t n = st.mine, hq = st.dims.heads_q, dv = st.dims.dim_v, row = hq * (dv + 1);
  w.mine.load(b, n, k, v);
  w.qc.n = n;
  copy_in(b, q, w.qc);
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    const int src = ring_next(me, p, -s);
    const index_t rows = st.rows(src);
    if (s + 1 < p) reqs.shift(comm, b, w.qc, w.qn, st.rows(ring_next(me, p, -(s + 1))), 4);
    Acc* base = w.send + st.send_displs[static_cast<std::size_t>(src)];
    const block<Acc, S> acc{base, rows, hq, dv}, lacc{base + rows * hq * dv, rows, hq, 1};
    acc.zero(b);
    if (lacc.size() > 0) loom::detail::fill(b, lacc.p, lacc.size(), neg_inf<Acc>());
    w.part.n = w.lpart.n = rows;
    for (std::size_t i = f.prog.step_begin[static_cast<std::size_t>(s)];
         i < f.prog.step_begin[static_cast<std::size_t>(s) + 1]; ++i) {
      loom::detail::fill(b, w.lpart.p, w.lpart.size(), neg_inf<Acc>());  // rows no entry writes
      f.engine->forward(b, i, tables + f.prog.batches[i].table_at, w.qc.p, w.mine.k.p, w.mine.v.p, w.part.p, w.lpart.p,
                        w.engine);
      merge(b, acc.view(), lacc.view2(), w.part.cview(), w.lpart.cview2());
    }
    reqs.wait(comm, b);
    std::swap(w.qc, w.qn);
  }
  comm::handoff(comm, b);
  comm.all_to_allv(std::span<const Acc>(w.send, static_cast<std::size_t>(st.total * row)),
                   std::span<const std::size_t>(st.send_counts), std::span<const std::size_t>(st.send_displs),
                   std::span<Acc>(w.recv, static_cast<std::size_t>(p * n * row)),
                   std::span<const std::size_t>(st.recv_counts), std::span<const std::size_t>(st.recv_displs));
  comm::handback(comm, b);
  // Rank 0's partial is the accumulator; the others merge into it in rank order.
  const block<Acc, S> acc{w.recv, n, hq, dv}, lacc{w.recv + n * hq * dv, n, hq, 1};
  for (int r = 1; r < p; ++r) {
    const Acc* base = w.recv + st.recv_displs[static_cast<std::size_t>(r)];
    merge(b, acc.view(), lacc.view2(), tensor_view<const Acc, 3, S>(base, {n, hq, dv}),
          tensor_view<const Acc, 2, S>(base + n * hq * dv, {n, hq}));
  }
  copy_out(b, acc, out);
  copy_out2(b, lacc, lse);
}

//! pass_q's backward on a fused engine (see the file comment).
template <class T, class Acc, class B, class C, class E, class Q, class K, class V, class O, class L, class DO,
          class DQ, class DK, class DV>
void fused_backward_q(const B& b, C& comm, const ring_state& st, const fused_state<E>& f, Q q, K k, V v, O out, L lse,
                      DO dout, DQ dq, DK dk, DV dv, std::span<std::byte> ws) {
  using S = typename backend_traits<B>::memory_space;
  workspace_carver a(ws);
  auto w = fused_q_backward_buffers<T, Acc, S>::take(a, st, f.prog, f.engine->workspace_bytes(fused_pass::backward));
  const std::int64_t* tables = w.tables.template bind<S>(b, f.prog);
  const int p = st.ranks, me = st.me;
  const index_t n = st.mine;
  w.mine.load(b, n, k, v);
  w.qc.n = w.oc.n = w.dc.n = w.lc.n = w.gq.n = n;
  copy_in(b, q, w.qc);
  copy_in(b, out, w.oc);
  copy_in(b, dout, w.dc);
  copy_in2(b, lse, w.lc);
  w.gq.zero(b);
  w.gkv.zero(b);
  requests<C, B> reqs;
  for (int s = 0; s < p; ++s) {
    const index_t rows = st.rows(ring_next(me, p, -s)), nn = st.rows(ring_next(me, p, -(s + 1)));
    if (s + 1 < p) {
      reqs.shift(comm, b, w.qc, w.qn, nn, 4);
      reqs.shift(comm, b, w.oc, w.on, nn, 5);
      reqs.shift(comm, b, w.dc, w.dn, nn, 6);
      reqs.shift(comm, b, w.lc, w.ln, nn, 7);
    }
    w.pq.n = rows;
    for (std::size_t i = f.prog.step_begin[static_cast<std::size_t>(s)];
         i < f.prog.step_begin[static_cast<std::size_t>(s) + 1]; ++i) {
      zero_storage(b, w.pq);  // rows no entry writes
      zero_storage(b, w.pkv.k);
      zero_storage(b, w.pkv.v);
      f.engine->backward(b, i, tables + f.prog.batches[i].table_at, w.qc.p, w.mine.k.p, w.mine.v.p, w.oc.p, w.lc.p,
                         w.dc.p, w.pq.p, w.pkv.k.p, w.pkv.v.p, w.engine);
      accumulate(b, w.gq, w.pq);
      accumulate(b, w.gkv.k, w.pkv.k);
      accumulate(b, w.gkv.v, w.pkv.v);
    }
    if (p > 1) reqs.shift(comm, b, w.gq, w.gqn, nn, 8);  // the visiting queries' dQ moves on (at the end: home)
    reqs.wait(comm, b);
    if (p > 1) std::swap(w.gq, w.gqn);
    if (s + 1 < p) {
      std::swap(w.qc, w.qn);
      std::swap(w.oc, w.on);
      std::swap(w.dc, w.dn);
      std::swap(w.lc, w.ln);
    }
  }
  copy_out(b, w.gq, dq);
  copy_out(b, w.gkv.k, dk);
  copy_out(b, w.gkv.v, dv);
}

}  // namespace loom::attention::detail

namespace loom::attention::ring {

//! A ring plan of variant V (pass_kv, pass_q or all_gather_kv) of one rank whose local step is engine E (a
//! fused band-mask kernel; see the file comment). Made by the make_plan of the engine's header
//! (ring_cudnn.cuh: ring::make_plan<P>(b, comm, [variant,] cudnn::fused{}, sharding, shape,
//! opts)). Immutable; copies share one state; may be shared between threads for reading (each call
//! with its own workspace).
template <class B, precision_policy P, class E, class V = pass_kv>
class fused_plan : public precision_types<P> {
  static_assert(std::is_same_v<V, pass_kv> || std::is_same_v<V, pass_q> || std::is_same_v<V, all_gather_kv>,
                "a fused ring plan passes K/V (pass_kv), passes Q (pass_q) or gathers K/V (all_gather_kv)");

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
        f->prog = attention::detail::ring_program(sharding, comm.rank(), s, opt, std::is_same_v<V, pass_q>);
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
  else
    attention::detail::fused_backward<T, Acc, V>(b, comm, st, fp.fused(), q, k, v, out, lse, dout, dq, dk, dv,
                                                 workspace);
}

}  // namespace loom::attention::ring
