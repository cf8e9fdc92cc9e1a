#pragma once

//! @file
//! The one to-heads -> inner attention -> back pipeline of Ulysses (ulysses.hpp) and of the hybrid
//! Ulysses x ring (hybrid.hpp); they differ only in the inner attention (the local kernel, or ring
//! pass-KV over the ring group). to_heads turns sequence shards of several tensors ([n_r, H, D] per
//! rank, rows in a shard::plan's local order) into head shards over the group's whole sequence
//! ([T, h_r, D] in the sequence's order); from_heads turns head shards back into sequence shards,
//! summing the partial gradients of kv heads that several ranks held (GQA/MQA with fewer kv heads
//! than ranks). Both use one all_to_allv per element type. head_pipeline lays every buffer out
//! once (at plan time) and carves them, and the inner attention's workspace, from the caller's
//! workspace on every call: nothing allocates.

#include <loom/attention/detail/ring_common.hpp>
#include <loom/attention/local.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/core/workspace.hpp>
#include <loom/shard/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace loom::attention::detail {

//! Query heads split over P ranks as evenly as possible (rank j: [j Hq / P, (j + 1) Hq / P)); the kv
//! heads rank j needs are those its query heads read (h / (Hq / Hkv)), replicated on every rank
//! that needs them.
struct head_split {
  index_t hq = 0, hkv = 0;
  int p = 1;
  [[nodiscard]] index_t group() const { return hq / hkv; }
  [[nodiscard]] index_t q_begin(int j) const { return j * hq / p; }
  [[nodiscard]] index_t q_end(int j) const { return (j + 1) * hq / p; }
  [[nodiscard]] index_t q_count(int j) const { return q_end(j) - q_begin(j); }
  [[nodiscard]] index_t kv_begin(int j) const { return q_begin(j) / group(); }
  [[nodiscard]] index_t kv_end(int j) const { return q_count(j) == 0 ? kv_begin(j) : (q_end(j) - 1) / group() + 1; }
  [[nodiscard]] index_t kv_count(int j) const { return kv_end(j) - kv_begin(j); }
  //! Heads of rank j of a tensor of q heads (kv = false) or kv heads (kv = true).
  [[nodiscard]] index_t begin(int j, bool kv) const { return kv ? kv_begin(j) : q_begin(j); }
  [[nodiscard]] index_t count(int j, bool kv) const { return kv ? kv_count(j) : q_count(j); }
  [[nodiscard]] index_t total(bool kv) const { return kv ? hkv : hq; }
};

//! A run of rank j's query heads that read consecutive kv heads as a GQA block of its own:
//! q heads [q0, q0 + nq) read kv heads [kv0, kv0 + nkv), nq a multiple of nkv.
struct head_segment {
  index_t q0, nq, kv0, nkv;
};

//! At most three segments (a partial group, whole groups, a partial group), so the local
//! kernel sees a plain GQA problem in each.
inline std::vector<head_segment> segments_of(const head_split& hs, int j) {
  std::vector<head_segment> out;
  const index_t g = hs.group();
  for (index_t kv = hs.kv_begin(j); kv < hs.kv_end(j); ++kv) {
    const index_t a = std::max(hs.q_begin(j), kv * g), e = std::min(hs.q_end(j), (kv + 1) * g);
    const bool whole = a == kv * g && e == (kv + 1) * g;
    if (whole && !out.empty()) {
      auto& last = out.back();
      if (last.nq == last.nkv * g && last.kv0 + last.nkv == kv) {
        last.nq += g;
        ++last.nkv;
        continue;
      }
    }
    out.push_back({a, e - a, kv, 1});
  }
  return out;
}

//! One rank's rows of a tensor: [n, heads, dim] with strides (s0, s1, s2) (an lse view: dim 1).
template <class T>
struct rows_desc {
  T* data;
  index_t s0, s1, s2;
  index_t dim;
  bool kv;
};
template <class V>
rows_desc<typename V::element_type> rows_desc_of(const V& v, bool kv) {
  if constexpr (V::rank == 3)
    return {v.data(), v.stride(0), v.stride(1), v.stride(2), v.extent(2), kv};
  else
    return {v.data(), v.stride(0), v.stride(1), 1, 1, kv};
}

//! A head shard over the whole sequence: contiguous [T, h_me, dim].
template <class T>
struct full_desc {
  T* data;
  index_t dim;
  bool kv;
};

//! The columns of one exchanged tensor: its head dim, and whether its heads are kv heads.
struct column {
  index_t dim;
  bool kv;
};

//! The counts and displacements (elements) of one all_to_allv of rank me, made at plan time; `row`
//! is the elements of one token on the head-shard side (Σ over tensors of h_me x dim).
struct exchange {
  std::vector<std::size_t> sc, sd, rc, rd;
  index_t row = 0;
  [[nodiscard]] std::size_t send_elems() const { return sd.empty() ? 0 : sd.back() + sc.back(); }
  [[nodiscard]] std::size_t recv_elems() const { return rd.empty() ? 0 : rd.back() + rc.back(); }
  //! The way back: what was sent is received.
  [[nodiscard]] exchange back() const { return {rc, rd, sc, sd, row}; }
};

//! Sequence shards -> head shards of the tensors `cols` on rank me: to rank j, n_me x Σ h_j x dim
//! (block j: each tensor's [n_me, h_j, dim] in turn); from rank i, n_i x row (each tensor's [n_i,
//! h_me, dim] in turn). head -> sequence is its back().
inline exchange to_heads_exchange(const shard::plan& tokens, const head_split& hs, int me,
                                  std::span<const column> cols) {
  exchange e;
  const auto n = static_cast<std::size_t>(tokens.rank(me).tokens);
  for (const auto& c : cols) e.row += hs.count(me, c.kv) * c.dim;
  std::size_t s = 0, r = 0;
  for (int j = 0; j < hs.p; ++j) {
    std::size_t per = 0;
    for (const auto& c : cols) per += static_cast<std::size_t>(hs.count(j, c.kv) * c.dim);
    e.sd.push_back(s);
    e.sc.push_back(n * per);
    s += n * per;
    e.rd.push_back(r);
    e.rc.push_back(static_cast<std::size_t>(tokens.rank(j).tokens * e.row));
    r += e.rc.back();
  }
  return e;
}

//! Where each token of the group's sequence sits in the exchange blocks: its owner's first token
//! in rank order (`start`), the owner's token count (`own`) and its local row there (`loc`). Token
//! g of tensor k (prefix = Σ of the earlier tensors' rows) is at start[g] row + own[g] prefix +
//! loc[g] row_k of the head-shard side's blocks. And its (document, position): the coordinates of
//! the inner attention over the head shards.
struct token_table {
  static constexpr int columns = 5;
  std::vector<index_t> start, own, loc, doc, pos;
  token_table() = default;
  explicit token_table(const shard::plan& tokens) {
    const auto t = static_cast<std::size_t>(tokens.total_tokens());
    start.assign(t, -1);
    own.assign(t, 0);
    loc.assign(t, 0);
    doc.assign(t, 0);
    pos.assign(t, 0);
    index_t first = 0;
    for (int i = 0; i < tokens.ranks(); ++i) {
      for (const auto& pc : tokens.rank(i).pieces)
        for (index_t k = 0; k < pc.length; ++k) {
          const auto g = static_cast<std::size_t>(pc.global_begin + k);
          start[g] = first;
          own[g] = tokens.rank(i).tokens;
          loc[g] = pc.local_begin + k;
          doc[g] = pc.document;
          pos[g] = pc.doc_offset + k;
        }
      first += tokens.rank(i).tokens;
    }
    for (const auto s : start)
      LOOM_EXPECTS(s >= 0, errc::invalid_argument, "sequence parallel plan: the sharding leaves a token unassigned");
  }
};

//! The token table where a call's kernels read it (pointers into the plan on host memory, into the
//! call's workspace on a device).
struct token_at {
  const index_t *start, *own, *loc, *doc, *pos;
  //! The (document, position) of the group's t tokens, as the inner attention reads them.
  template <class S>
  [[nodiscard]] attention::coords<S> coords(index_t t) const {
    return {tensor_view<const index_t, 1, S>(doc, {t}), tensor_view<const index_t, 1, S>(pos, {t})};
  }
};

//! Rows (t, h) of n x nh, dim elements each, from one strided [n, nh, dim] layout into another
//! (converted to D; added when `add`). One item per row.
template <class S, class D, bool add>
struct rows_kernel {
  const S* src;
  index_t ss0, ss1, ss2;
  D* dst;
  index_t ds0, ds1, ds2;
  index_t nh, dim;
  LOOM_HD void operator()(index_t i) const {
    const index_t t = i / nh, h = i % nh;
    const S* x = src + t * ss0 + h * ss1;
    D* y = dst + t * ds0 + h * ds1;
    for (index_t c = 0; c < dim; ++c) {
      if constexpr (add)
        y[c * ds2] += static_cast<D>(x[c * ss2]);
      else
        y[c * ds2] = static_cast<D>(x[c * ss2]);
    }
  }
};

//! Token g of a head shard ([T, row], contiguous) to (to_blocks) or from its place in the
//! exchange blocks (token_table). One item per token.
template <class G, class X, bool to_blocks>
struct tokens_kernel {
  G* shard;
  X* blocks;
  token_at at;
  index_t block_row, prefix, row;
  LOOM_HD void operator()(index_t g) const {
    const index_t b = at.start[g] * block_row + at.own[g] * prefix + at.loc[g] * row;
    for (index_t c = 0; c < row; ++c) {
      if constexpr (to_blocks)
        blocks[b + c] = shard[g * row + c];
      else
        shard[g * row + c] = blocks[b + c];
    }
  }
};

//! Sequence shards -> head shards, on b (kernels) and comm (one all_to_allv of ex). src: this
//! rank's rows of each tensor ([n_me, H, dim]); dst: the head shards ([T, h_me, dim], sequence
//! order). sendbuf / recvbuf hold ex.send_elems() / ex.recv_elems() elements.
template <backend B, comm::communicator C, class T>
void to_heads(const B& b, C& comm, const shard::plan& tokens, const head_split& hs, const exchange& ex, token_at at,
              std::span<const rows_desc<const T>> src, std::span<const full_desc<T>> dst, T* sendbuf, T* recvbuf) {
  const int p = hs.p, me = comm.rank();
  const index_t n = tokens.rank(me).tokens, tt = tokens.total_tokens();
  for (int j = 0; j < p; ++j) {  // block j: each tensor's [n, h_j, dim] of j's heads
    T* to = sendbuf + ex.sd[static_cast<std::size_t>(j)];
    for (const auto& s : src) {
      const index_t nh = hs.count(j, s.kv);
      if (n * nh > 0)
        for_each_index(b, n * nh,
                       rows_kernel<T, T, false>{s.data + hs.begin(j, s.kv) * s.s1, s.s0, s.s1, s.s2, to, nh * s.dim,
                                                s.dim, 1, nh, s.dim});
      to += n * nh * s.dim;
    }
  }
  comm::handoff(b, comm);
  comm.all_to_allv(std::span<const T>(sendbuf, ex.send_elems()), std::span<const std::size_t>(ex.sc),
                   std::span<const std::size_t>(ex.sd), std::span<T>(recvbuf, ex.recv_elems()),
                   std::span<const std::size_t>(ex.rc), std::span<const std::size_t>(ex.rd));
  comm::handback(b, comm);
  index_t prefix = 0;
  for (const auto& d : dst) {  // every token of each tensor to its place in the sequence
    const index_t row = hs.count(me, d.kv) * d.dim;
    if (tt * row > 0) for_each_index(b, tt, tokens_kernel<T, T, false>{d.data, recvbuf, at, ex.row, prefix, row});
    prefix += row;
  }
}

//! Head shards -> sequence shards (ex: a to_heads exchange's back()). src: head shards ([T, h_me,
//! dim]); dst: this rank's rows ([n_me, H, dim]), converted to their element type. When `sum_kv`,
//! the kv tensors' heads (held by several ranks) are summed in Acc, in rank order (deterministic):
//! acc holds n_me x Hkv x (Σ of the kv tensors' dims) elements.
template <class Acc, backend B, comm::communicator C, class T, class G>
void from_heads(const B& b, C& comm, const shard::plan& tokens, const head_split& hs, const exchange& ex, token_at at,
                bool sum_kv, std::span<const full_desc<const T>> src, std::span<const rows_desc<G>> dst, T* sendbuf,
                T* recvbuf, Acc* acc) {
  const int p = hs.p, me = comm.rank();
  const index_t n = tokens.rank(me).tokens, tt = tokens.total_tokens();
  index_t prefix = 0;
  for (const auto& s : src) {  // block i: each tensor's rows of rank i, in i's local order
    const index_t row = hs.count(me, s.kv) * s.dim;
    if (tt * row > 0) for_each_index(b, tt, tokens_kernel<const T, T, true>{s.data, sendbuf, at, ex.row, prefix, row});
    prefix += row;
  }
  comm::handoff(b, comm);
  comm.all_to_allv(std::span<const T>(sendbuf, ex.send_elems()), std::span<const std::size_t>(ex.sc),
                   std::span<const std::size_t>(ex.sd), std::span<T>(recvbuf, ex.recv_elems()),
                   std::span<const std::size_t>(ex.rc), std::span<const std::size_t>(ex.rd));
  comm::handback(b, comm);
  Acc* a = acc;
  for (const auto& d : dst)
    if (d.kv && sum_kv && n > 0) {
      loom::detail::fill(b, a, n * hs.hkv * d.dim, Acc(0));
      a += n * hs.hkv * d.dim;
    }
  for (int j = 0; j < p; ++j) {
    const T* from = recvbuf + ex.rd[static_cast<std::size_t>(j)];
    a = acc;
    for (const auto& d : dst) {
      const index_t h0 = hs.begin(j, d.kv), nh = hs.count(j, d.kv), htot = hs.total(d.kv);
      const bool sum = d.kv && sum_kv;
      if (n * nh > 0) {
        if (sum)
          for_each_index(
              b, n * nh,
              rows_kernel<T, Acc, true>{from, nh * d.dim, d.dim, 1, a + h0 * d.dim, htot * d.dim, d.dim, 1, nh, d.dim});
        else
          for_each_index(
              b, n * nh,
              rows_kernel<T, G, false>{from, nh * d.dim, d.dim, 1, d.data + h0 * d.s1, d.s0, d.s1, d.s2, nh, d.dim});
      }
      from += n * nh * d.dim;
      if (sum) a += n * htot * d.dim;
    }
  }
  a = acc;
  for (const auto& d : dst) {
    if (!(d.kv && sum_kv)) continue;
    if (n > 0)
      for_each_index(b, n * hs.hkv,
                     rows_kernel<Acc, G, false>{a, hs.hkv * d.dim, d.dim, 1, d.data, d.s0, d.s1, d.s2, hs.hkv, d.dim});
    a += n * hs.hkv * d.dim;
  }
}

//! A [T, h, d] head shard (contiguous), restricted to heads [h0, h0 + nh), in memory space S.
template <class S, class T>
tensor_view<T, 3, S> heads_view(T* base, index_t t, index_t h, index_t d, index_t h0, index_t nh) {
  return {base + h0 * d, {t, nh, d}, {h * d, d, 1}};
}
template <class S, class T>
tensor_view<T, 2, S> heads_view2(T* base, index_t t, index_t h, index_t h0, index_t nh) {
  return {base + h0, {t, nh}, {h, 1}};
}

//! Heads and head dims of one inner attention call: a head segment of this rank.
struct segment_shape {
  index_t heads_q, heads_kv, dim_qk, dim_v;
};

//! One rank's to-heads -> inner attention -> back pipeline over an exchange group of hs.p ranks
//! whose rows `tokens` describes (Ulysses: the whole sequence; hybrid: one ring shard). Storage T,
//! accumulation Acc, gradients of type T. Built once per plan (the exchanges' counts, the token
//! table, the workspace layouts); const and shareable afterwards. Its element loops are kernels of
//! the call's backend and the exchanges are ordered after them with comm::handoff / handback, so
//! the pipeline runs on host memory and, stream-ordered, on a device's.
template <class T, class Acc>
class head_pipeline {
 public:
  head_pipeline() = default;
  //! The exchange buffers of rank `me`; the inner attention's bytes follow with reserve_inner().
  head_pipeline(shard::plan tokens, head_split hs, int me, index_t dk, index_t dv)
      : tokens_(std::move(tokens)),
        hs_(hs),
        me_(me),
        dk_(dk),
        dv_(dv),
        segments_(segments_of(hs, me)),
        table_(tokens_) {
    const index_t tt = tokens_.total_tokens();
    const index_t hq = hs.q_count(me), hkv = hs.kv_count(me);
    for (int j = 0; j + 1 < hs.p; ++j) sum_kv_ = sum_kv_ || (hs.kv_count(j) > 0 && hs.kv_end(j) > hs.kv_begin(j + 1));
    const std::array<column, 3> in3{{{dk, false}, {dk, true}, {dv, true}}};
    const std::array<column, 5> in5{{{dk, false}, {dk, true}, {dv, true}, {dv, false}, {dv, false}}};
    const std::array<column, 1> o{{{dv, false}}}, l{{{1, false}}};
    in3_ = to_heads_exchange(tokens_, hs, me, in3);
    in5_ = to_heads_exchange(tokens_, hs, me, in5);
    lse_in_ = to_heads_exchange(tokens_, hs, me, l);
    out_back_ = to_heads_exchange(tokens_, hs, me, o).back();
    lse_back_ = lse_in_.back();
    grad_back_ = in3_.back();
    {
      workspace_layout w;
      add_shards(w, f_, in3_);
      f_.lse = w.add<Acc>(tt * hq);
      f_.osend = w.add<T>(elems(out_back_.send_elems()));
      f_.orecv = w.add<T>(elems(out_back_.recv_elems()));
      f_.lsend = w.add<Acc>(elems(lse_back_.send_elems()));
      f_.lrecv = w.add<Acc>(elems(lse_back_.recv_elems()));
      forward_bytes_ = w.bytes();
    }
    {
      workspace_layout w;
      add_shards(w, b_, in5_);
      b_.dout = w.add<T>(tt * hq * dv);
      b_.lsend = w.add<Acc>(elems(lse_in_.send_elems()));
      b_.lrecv = w.add<Acc>(elems(lse_in_.recv_elems()));
      b_.lse = w.add<Acc>(tt * hq);
      b_.dq = w.add<T>(tt * hq * dk);
      b_.dk = w.add<T>(tt * hkv * dk);
      b_.dv = w.add<T>(tt * hkv * dv);
      b_.gsend = w.add<T>(elems(grad_back_.send_elems()));
      b_.grecv = w.add<T>(elems(grad_back_.recv_elems()));
      b_.acc = w.add<Acc>(tokens_.rank(me).tokens * hs.hkv * (dk + dv));
      backward_bytes_ = w.bytes();
    }
  }

  //! Appends the inner attention's workspace: `forward` / `backward` bytes, the largest over the
  //! segments (they run one after the other in the same bytes). Called once, while planning.
  void reserve_inner(std::size_t forward, std::size_t backward) {
    f_.inner = forward_bytes_;
    b_.inner = backward_bytes_;
    forward_bytes_ = loom::detail::checked_add(forward_bytes_, workspace_round(forward), "workspace size");
    backward_bytes_ = loom::detail::checked_add(backward_bytes_, workspace_round(backward), "workspace size");
    inner_forward_ = forward;
    inner_backward_ = backward;
  }

  [[nodiscard]] const shard::plan& tokens() const noexcept { return tokens_; }
  [[nodiscard]] const head_split& heads() const noexcept { return hs_; }
  [[nodiscard]] int rank() const noexcept { return me_; }
  [[nodiscard]] std::span<const head_segment> segments() const noexcept { return segments_; }
  //! The shape of the inner call of segment s.
  [[nodiscard]] segment_shape segment(std::size_t s) const { return {segments_[s].nq, segments_[s].nkv, dk_, dv_}; }
  [[nodiscard]] std::size_t forward_bytes() const noexcept { return forward_bytes_; }
  [[nodiscard]] std::size_t backward_bytes() const noexcept { return backward_bytes_; }

  //! q, k, v to head shards; inner(s, c, q_s, k_s, v_s, out_s, lse_s, ws) for every segment s (c:
  //! the coordinates of the group's tokens); out and lse back. `ws` holds forward_bytes() (checked by the caller).
  template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class Inner>
  void forward(const B& b, C& comm, const Q& q, const K& k, const V& v, const O& out, const L& lse,
               std::span<std::byte> ws, Inner&& inner) const {
    using S = typename backend_traits<B>::memory_space;
    const workspace_carver w(ws);
    const token_at at = bind<S>(b, w.at<index_t>(f_.table));
    T *fq = w.at<T>(f_.q), *fk = w.at<T>(f_.k), *fv = w.at<T>(f_.v), *fo = w.at<T>(f_.out);
    Acc* fl = w.at<Acc>(f_.lse);
    const index_t tt = tokens_.total_tokens(), hq = hs_.q_count(me_);
    const std::array<rows_desc<const T>, 3> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true)};
    const std::array<full_desc<T>, 3> dst{{{fq, dk_, false}, {fk, dk_, true}, {fv, dv_, true}}};
    to_heads<B, C, T>(b, comm, tokens_, hs_, in3_, at, src, dst, w.at<T>(f_.send), w.at<T>(f_.recv));
    const auto iws = ws.subspan(f_.inner, inner_forward_);
    each_segment<S>(tt, fq, fk, fv, fo, [&](std::size_t s, const auto& g) {
      inner(s, at.template coords<S>(tt), g.q, g.k, g.v, g.out, heads_view2<S>(fl, tt, hq, g.q0, g.nq), iws);
    });
    const std::array<full_desc<const T>, 1> os{{{fo, dv_, false}}};
    const std::array<rows_desc<T>, 1> od{rows_desc_of(out, false)};
    from_heads<Acc, B, C, T, T>(b, comm, tokens_, hs_, out_back_, at, false, os, od, w.at<T>(f_.osend),
                                w.at<T>(f_.orecv), nullptr);
    const std::array<full_desc<const Acc>, 1> ls{{{fl, 1, false}}};
    const std::array<rows_desc<Acc>, 1> ld{rows_desc_of(lse, false)};
    from_heads<Acc, B, C, Acc, Acc>(b, comm, tokens_, hs_, lse_back_, at, false, ls, ld, w.at<Acc>(f_.lsend),
                                    w.at<Acc>(f_.lrecv), nullptr);
  }

  //! q, k, v, out, dout and lse to head shards; inner(s, c, q_s, k_s, v_s, out_s, lse_s, dout_s,
  //! dq_s, dk_s, dv_s, ws) for every segment; dq, dk, dv back (partial dK/dV of replicated kv heads
  //! summed in Acc, in rank order). `ws` holds backward_bytes().
  template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
            class DV, class Inner>
  void backward(const B& b, C& comm, const Q& q, const K& k, const V& v, const O& out, const L& lse, const DO& dout,
                const DQ& dq, const DK& dk, const DV& dv, std::span<std::byte> ws, Inner&& inner) const {
    using S = typename backend_traits<B>::memory_space;
    const workspace_carver w(ws);
    const token_at at = bind<S>(b, w.at<index_t>(b_.table));
    T *fq = w.at<T>(b_.q), *fk = w.at<T>(b_.k), *fv = w.at<T>(b_.v), *fo = w.at<T>(b_.out), *fd = w.at<T>(b_.dout);
    T *gq = w.at<T>(b_.dq), *gk = w.at<T>(b_.dk), *gv = w.at<T>(b_.dv);
    Acc* fl = w.at<Acc>(b_.lse);
    const index_t tt = tokens_.total_tokens(), hq = hs_.q_count(me_), hkv = hs_.kv_count(me_);
    const std::array<rows_desc<const T>, 5> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true),
                                                rows_desc_of(out, false), rows_desc_of(dout, false)};
    const std::array<full_desc<T>, 5> dst{
        {{fq, dk_, false}, {fk, dk_, true}, {fv, dv_, true}, {fo, dv_, false}, {fd, dv_, false}}};
    to_heads<B, C, T>(b, comm, tokens_, hs_, in5_, at, src, dst, w.at<T>(b_.send), w.at<T>(b_.recv));
    const std::array<rows_desc<const Acc>, 1> lsrc{rows_desc_of(lse, false)};
    const std::array<full_desc<Acc>, 1> ldst{{{fl, 1, false}}};
    to_heads<B, C, Acc>(b, comm, tokens_, hs_, lse_in_, at, lsrc, ldst, w.at<Acc>(b_.lsend), w.at<Acc>(b_.lrecv));
    const auto iws = ws.subspan(b_.inner, inner_backward_);
    each_segment<S>(tt, fq, fk, fv, static_cast<const T*>(fo), [&](std::size_t s, const auto& g) {
      inner(s, at.template coords<S>(tt), g.q, g.k, g.v, g.out,
            heads_view2<S>(static_cast<const Acc*>(fl), tt, hq, g.q0, g.nq),
            heads_view<S>(static_cast<const T*>(fd), tt, hq, dv_, g.q0, g.nq),
            heads_view<S>(gq, tt, hq, dk_, g.q0, g.nq), heads_view<S>(gk, tt, hkv, dk_, g.k0, g.nkv),
            heads_view<S>(gv, tt, hkv, dv_, g.k0, g.nkv), iws);
    });
    using G = typename DQ::value_type;
    const std::array<full_desc<const T>, 3> gs{{{gq, dk_, false}, {gk, dk_, true}, {gv, dv_, true}}};
    const std::array<rows_desc<G>, 3> gd{rows_desc_of(dq, false), rows_desc_of(dk, true), rows_desc_of(dv, true)};
    from_heads<Acc, B, C, T, G>(b, comm, tokens_, hs_, grad_back_, at, sum_kv_, gs, gd, w.at<T>(b_.gsend),
                                w.at<T>(b_.grecv), w.at<Acc>(b_.acc));
  }

 private:
  static index_t elems(std::size_t n) { return static_cast<index_t>(n); }
  //! One head segment's views of the shards q, k, v (read) and out (O: T or const T), and where its
  //! heads start and how many there are within this rank's shards.
  template <class S, class O>
  struct segment_views {
    tensor_view<const T, 3, S> q, k, v;
    tensor_view<O, 3, S> out;
    index_t q0, k0, nq, nkv;
  };
  //! f(s, segment_views) for every head segment s; nothing when this rank's shards hold no tokens.
  template <class S, class O, class F>
  void each_segment(index_t tt, const T* fq, const T* fk, const T* fv, O* fo, F&& f) const {
    const index_t hq = hs_.q_count(me_), hkv = hs_.kv_count(me_);
    if (tt == 0) return;
    for (std::size_t s = 0; s < segments_.size(); ++s) {
      const auto& sg = segments_[s];
      const index_t q0 = sg.q0 - hs_.q_begin(me_), k0 = sg.kv0 - hs_.kv_begin(me_);
      f(s, segment_views<S, O>{heads_view<S>(fq, tt, hq, dk_, q0, sg.nq), heads_view<S>(fk, tt, hkv, dk_, k0, sg.nkv),
                               heads_view<S>(fv, tt, hkv, dv_, k0, sg.nkv), heads_view<S>(fo, tt, hq, dv_, q0, sg.nq),
                               q0, k0, sg.nq, sg.nkv});
    }
  }
  //! The token table where the call's kernels read it: the plan's on host memory; on a device,
  //! its copy in the workspace (token_table::columns x T index_t, reserved on every space so one
  //! size serves all), uploaded stream-ordered when the call starts.
  template <class S, backend B>
  token_at bind(const B& b, index_t* ws) const {
    const std::array<const std::vector<index_t>*, token_table::columns> cols{&table_.start, &table_.own, &table_.loc,
                                                                             &table_.doc, &table_.pos};
    std::array<const index_t*, token_table::columns> at{};
    const auto t = table_.start.size();
    for (std::size_t c = 0; c < cols.size(); ++c) {
      if constexpr (S::host_accessible) {
        at[c] = cols[c]->data();
      } else {
        if (t > 0) copy_bytes(b, ws + c * t, cols[c]->data(), t * sizeof(index_t));
        at[c] = ws + c * t;
      }
    }
    return {at[0], at[1], at[2], at[3], at[4]};
  }
  //! Where both passes' workspaces begin: the token table, the to-heads exchange's send and receive
  //! buffers, the head shards of q, k, v and out.
  struct shards_at {
    std::size_t table, send, recv, q, k, v, out;
  };
  struct fwd_at : shards_at {
    std::size_t lse, osend, orecv, lsend, lrecv, inner;
  };
  struct bwd_at : shards_at {
    std::size_t dout, lsend, lrecv, lse, dq, dk, dv, gsend, grecv, acc, inner;
  };
  //! Adds shards_at's blocks to w, the exchange's buffers those of `x` (the pass's to-heads exchange).
  void add_shards(workspace_layout& w, shards_at& s, const exchange& x) const {
    const index_t tt = tokens_.total_tokens(), hq = hs_.q_count(me_), hkv = hs_.kv_count(me_);
    s.table = w.add<index_t>(token_table::columns * tt);
    s.send = w.add<T>(elems(x.send_elems()));
    s.recv = w.add<T>(elems(x.recv_elems()));
    s.q = w.add<T>(tt * hq * dk_);
    s.k = w.add<T>(tt * hkv * dk_);
    s.v = w.add<T>(tt * hkv * dv_);
    s.out = w.add<T>(tt * hq * dv_);
  }
  shard::plan tokens_;
  head_split hs_;
  int me_ = 0;
  index_t dk_ = 0, dv_ = 0;
  std::vector<head_segment> segments_;
  token_table table_;
  bool sum_kv_ = false;
  exchange in3_, in5_, lse_in_, out_back_, lse_back_, grad_back_;
  fwd_at f_{};
  bwd_at b_{};
  std::size_t forward_bytes_ = 0, backward_bytes_ = 0, inner_forward_ = 0, inner_backward_ = 0;
};

}  // namespace loom::attention::detail
