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
#include <cstring>
#include <span>
#include <string_view>
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

//! One rank's rows of a tensor: [n, heads, dim] with strides (s0, s1, 1).
template <class T>
struct rows_desc {
  T* data;
  index_t s0, s1;
  index_t dim;
  bool kv;
};
template <class V>
rows_desc<typename V::element_type> rows_desc_of(const V& v, bool kv) {
  if constexpr (V::rank == 3)
    return {v.data(), v.stride(0), v.stride(1), v.extent(2), kv};
  else
    return {v.data(), v.stride(0), v.stride(1), 1, kv};
}

//! A head shard over the whole sequence: contiguous [T, h_me, dim].
template <class T>
struct full_desc {
  T* data;
  index_t dim;
  bool kv;
};

//! Elements of the sequence-shard side of an exchange for rank r: the sum over tensors of
//! n_r x (all heads that go to or come from other ranks) x dim, every rank's block included.
template <class T>
std::size_t shard_side_elems(const shard::plan& tokens, const head_split& hs, int r, std::span<const full_desc<T>> t) {
  std::size_t e = 0;
  for (const auto& d : t)
    for (int j = 0; j < hs.p; ++j) e += static_cast<std::size_t>(tokens.rank(r).tokens * hs.count(j, d.kv) * d.dim);
  return e;
}
//! Elements of the head-shard side for rank r: T x h_r x dim, summed over tensors.
template <class T>
std::size_t head_side_elems(const shard::plan& tokens, const head_split& hs, int r, std::span<const full_desc<T>> t) {
  std::size_t e = 0;
  for (const auto& d : t) e += static_cast<std::size_t>(tokens.total_tokens() * hs.count(r, d.kv) * d.dim);
  return e;
}

//! Sequence shards -> head shards. src: this rank's rows of each tensor ([n_me, H, dim]); dst: the
//! head shards ([T, h_me, dim], sequence order). sendbuf / recvbuf hold shard_side_elems /
//! head_side_elems elements; counts holds 4 P entries. One all_to_allv.
template <comm::communicator C, class T>
void to_heads(C& comm, const shard::plan& tokens, const head_split& hs, std::span<const rows_desc<const T>> src,
              std::span<const full_desc<T>> dst, T* sendbuf, T* recvbuf, std::size_t* counts) {
  const int p = hs.p, me = comm.rank();
  const index_t n = tokens.rank(me).tokens;
  std::size_t* sc = counts;
  std::size_t* sd = counts + p;
  std::size_t* rc = counts + 2 * p;
  std::size_t* rd = counts + 3 * p;
  std::size_t at = 0;
  for (int j = 0; j < p; ++j) {  // block j: for each tensor, [n, h_j, dim] of j's heads
    sd[j] = at;
    for (const auto& s : src) {
      const index_t h0 = hs.begin(j, s.kv), nh = hs.count(j, s.kv);
      for (index_t t = 0; t < n; ++t)
        for (index_t h = 0; h < nh; ++h) {
          std::copy_n(s.data + t * s.s0 + (h0 + h) * s.s1, s.dim, sendbuf + at);
          at += static_cast<std::size_t>(s.dim);
        }
    }
    sc[j] = at - sd[j];
  }
  at = 0;
  for (int i = 0; i < p; ++i) {
    rd[i] = at;
    std::size_t c = 0;
    for (const auto& d : dst) c += static_cast<std::size_t>(tokens.rank(i).tokens * hs.count(me, d.kv) * d.dim);
    rc[i] = c;
    at += c;
  }
  comm.all_to_allv(std::span<const T>(sendbuf, sd[p - 1] + sc[p - 1]), std::span<const std::size_t>(sc, p),
                   std::span<const std::size_t>(sd, p), std::span<T>(recvbuf, at), std::span<const std::size_t>(rc, p),
                   std::span<const std::size_t>(rd, p));
  for (int i = 0; i < p; ++i) {  // unpack: every piece of rank i to its place in the sequence
    const T* from = recvbuf + rd[i];
    const index_t ni = tokens.rank(i).tokens;
    for (const auto& d : dst) {
      const index_t row = hs.count(me, d.kv) * d.dim;
      for (const auto& pc : tokens.rank(i).pieces)
        std::copy_n(from + pc.local_begin * row, pc.length * row, d.data + pc.global_begin * row);
      from += ni * row;
    }
  }
}

//! Head shards -> sequence shards. src: head shards ([T, h_me, dim]); dst: this rank's rows
//! ([n_me, H, dim]), converted to their element type. A kv tensor's heads held by several ranks
//! are summed in Acc, in rank order (deterministic); acc holds n_me x Hkv x (sum of the kv
//! tensors' dims) elements. sendbuf / recvbuf hold head_side_elems / shard_side_elems elements.
template <class Acc, comm::communicator C, class T, class G>
void from_heads(C& comm, const shard::plan& tokens, const head_split& hs, std::span<const full_desc<const T>> src,
                std::span<const rows_desc<G>> dst, T* sendbuf, T* recvbuf, Acc* acc, std::size_t* counts) {
  const int p = hs.p, me = comm.rank();
  const index_t n = tokens.rank(me).tokens;
  std::size_t* sc = counts;
  std::size_t* sd = counts + p;
  std::size_t* rc = counts + 2 * p;
  std::size_t* rd = counts + 3 * p;
  std::size_t at = 0;
  for (int i = 0; i < p; ++i) {  // block i: for each tensor, rank i's rows of my heads
    sd[i] = at;
    const index_t ni = tokens.rank(i).tokens;
    for (const auto& s : src) {
      const index_t row = hs.count(me, s.kv) * s.dim;
      for (const auto& pc : tokens.rank(i).pieces)
        std::copy_n(s.data + pc.global_begin * row, pc.length * row, sendbuf + at + pc.local_begin * row);
      at += static_cast<std::size_t>(ni * row);
    }
    sc[i] = at - sd[i];
  }
  at = 0;
  for (int j = 0; j < p; ++j) {
    rd[j] = at;
    std::size_t c = 0;
    for (const auto& d : dst) c += static_cast<std::size_t>(n * hs.count(j, d.kv) * d.dim);
    rc[j] = c;
    at += c;
  }
  comm.all_to_allv(std::span<const T>(sendbuf, sd[p - 1] + sc[p - 1]), std::span<const std::size_t>(sc, p),
                   std::span<const std::size_t>(sd, p), std::span<T>(recvbuf, at), std::span<const std::size_t>(rc, p),
                   std::span<const std::size_t>(rd, p));
  // Some kv head is held by two ranks: its partial gradients are summed (in Acc, rank order).
  bool sum_kv = false;
  for (int j = 0; j + 1 < p; ++j) sum_kv = sum_kv || (hs.kv_count(j) > 0 && hs.kv_end(j) > hs.kv_begin(j + 1));
  std::size_t acc_size = 0;
  for (const auto& d : dst)
    if (d.kv && sum_kv) acc_size += static_cast<std::size_t>(n * hs.hkv * d.dim);
  std::fill_n(acc, acc_size, Acc(0));
  for (int j = 0; j < p; ++j) {
    const T* from = recvbuf + rd[j];
    Acc* a = acc;
    for (const auto& d : dst) {
      const index_t htot = hs.total(d.kv), h0 = hs.begin(j, d.kv), nh = hs.count(j, d.kv);
      const bool sum = d.kv && sum_kv;
      for (index_t t = 0; t < n; ++t)
        for (index_t h = 0; h < nh; ++h) {
          const T* x = from + (t * nh + h) * d.dim;
          if (sum) {
            Acc* y = a + (t * htot + h0 + h) * d.dim;
            for (index_t c = 0; c < d.dim; ++c) y[c] += static_cast<Acc>(x[c]);
          } else {
            G* y = d.data + t * d.s0 + (h0 + h) * d.s1;
            for (index_t c = 0; c < d.dim; ++c) y[c] = static_cast<G>(x[c]);
          }
        }
      from += n * nh * d.dim;
      if (sum) a += n * htot * d.dim;
    }
  }
  Acc* a = acc;
  for (const auto& d : dst) {
    if (!(d.kv && sum_kv)) continue;
    for (index_t t = 0; t < n; ++t)
      for (index_t h = 0; h < hs.hkv; ++h)
        for (index_t c = 0; c < d.dim; ++c)
          d.data[t * d.s0 + h * d.s1 + c] = static_cast<G>(a[(t * hs.hkv + h) * d.dim + c]);
    a += n * hs.hkv * d.dim;
  }
}

//! A [T, h, d] head shard (contiguous), restricted to heads [h0, h0 + nh).
template <class T>
tensor_view<T, 3> heads_view(T* base, index_t t, index_t h, index_t d, index_t h0, index_t nh) {
  return {base + h0 * d, {t, nh, d}, {h * d, d, 1}};
}
template <class T>
tensor_view<T, 2> heads_view2(T* base, index_t t, index_t h, index_t h0, index_t nh) {
  return {base + h0, {t, nh}, {h, 1}};
}

//! Heads and head dims of one inner attention call: a head segment of this rank.
struct segment_shape {
  index_t heads_q, heads_kv, dim_qk, dim_v;
};

//! One rank's to-heads -> inner attention -> back pipeline over an exchange group of hs.p ranks
//! whose rows `tokens` describes (Ulysses: the whole sequence; hybrid: one ring shard). Storage T,
//! accumulation Acc, gradients of type T. Built once per plan; const and shareable afterwards.
template <class T, class Acc>
class head_pipeline {
 public:
  head_pipeline() = default;
  //! The exchange buffers of rank `me`; the inner attention's bytes follow with reserve_inner().
  head_pipeline(shard::plan tokens, head_split hs, int me, index_t dk, index_t dv)
      : tokens_(std::move(tokens)), hs_(hs), me_(me), dk_(dk), dv_(dv), segments_(segments_of(hs, me)) {
    const auto tt = tokens_.total_tokens();
    const index_t hq = hs.q_count(me), hkv = hs.kv_count(me);
    const std::array<full_desc<T>, 3> in{{{nullptr, dk, false}, {nullptr, dk, true}, {nullptr, dv, true}}};
    const std::array<full_desc<T>, 1> o{{{nullptr, dv, false}}};
    const std::array<full_desc<Acc>, 1> l{{{nullptr, 1, false}}};
    {
      workspace_layout w;
      f_.counts = w.add<std::size_t>(4 * hs.p);
      f_.send = w.add<T>(elems(shard_side_elems<T>(tokens_, hs, me, in)));
      f_.recv = w.add<T>(elems(head_side_elems<T>(tokens_, hs, me, in)));
      f_.q = w.add<T>(tt * hq * dk);
      f_.k = w.add<T>(tt * hkv * dk);
      f_.v = w.add<T>(tt * hkv * dv);
      f_.out = w.add<T>(tt * hq * dv);
      f_.lse = w.add<Acc>(tt * hq);
      f_.osend = w.add<T>(elems(head_side_elems<T>(tokens_, hs, me, o)));
      f_.orecv = w.add<T>(elems(shard_side_elems<T>(tokens_, hs, me, o)));
      f_.lsend = w.add<Acc>(elems(head_side_elems<Acc>(tokens_, hs, me, l)));
      f_.lrecv = w.add<Acc>(elems(shard_side_elems<Acc>(tokens_, hs, me, l)));
      forward_bytes_ = w.bytes();
    }
    {
      const std::array<full_desc<T>, 5> in5{
          {{nullptr, dk, false}, {nullptr, dk, true}, {nullptr, dv, true}, {nullptr, dv, false}, {nullptr, dv, false}}};
      workspace_layout w;
      b_.counts = w.add<std::size_t>(4 * hs.p);
      b_.send = w.add<T>(elems(shard_side_elems<T>(tokens_, hs, me, in5)));
      b_.recv = w.add<T>(elems(head_side_elems<T>(tokens_, hs, me, in5)));
      b_.q = w.add<T>(tt * hq * dk);
      b_.k = w.add<T>(tt * hkv * dk);
      b_.v = w.add<T>(tt * hkv * dv);
      b_.out = w.add<T>(tt * hq * dv);
      b_.dout = w.add<T>(tt * hq * dv);
      b_.lsend = w.add<Acc>(elems(shard_side_elems<Acc>(tokens_, hs, me, l)));
      b_.lrecv = w.add<Acc>(elems(head_side_elems<Acc>(tokens_, hs, me, l)));
      b_.lse = w.add<Acc>(tt * hq);
      b_.dq = w.add<T>(tt * hq * dk);
      b_.dk = w.add<T>(tt * hkv * dk);
      b_.dv = w.add<T>(tt * hkv * dv);
      b_.gsend = w.add<T>(elems(head_side_elems<T>(tokens_, hs, me, in)));
      b_.grecv = w.add<T>(elems(shard_side_elems<T>(tokens_, hs, me, in)));
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

  //! q, k, v to head shards; inner(s, q_s, k_s, v_s, out_s, lse_s, ws) for every segment s; out
  //! and lse back. `ws` holds forward_bytes() (checked by the caller).
  template <comm::communicator C, class Q, class K, class V, class O, class L, class Inner>
  void forward(C& comm, const Q& q, const K& k, const V& v, const O& out, const L& lse, std::span<std::byte> ws,
               Inner&& inner) const {
    const workspace_carver w(ws);
    auto* counts = w.at<std::size_t>(f_.counts);
    T *fq = w.at<T>(f_.q), *fk = w.at<T>(f_.k), *fv = w.at<T>(f_.v), *fo = w.at<T>(f_.out);
    Acc* fl = w.at<Acc>(f_.lse);
    const index_t tt = tokens_.total_tokens(), hq = hs_.q_count(me_), hkv = hs_.kv_count(me_);
    const std::array<rows_desc<const T>, 3> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true)};
    const std::array<full_desc<T>, 3> dst{{{fq, dk_, false}, {fk, dk_, true}, {fv, dv_, true}}};
    to_heads<C, T>(comm, tokens_, hs_, src, dst, w.at<T>(f_.send), w.at<T>(f_.recv), counts);
    const auto iws = ws.subspan(f_.inner, inner_forward_);
    if (tt > 0)
      for (std::size_t s = 0; s < segments_.size(); ++s) {
        const auto& sg = segments_[s];
        const index_t q0 = sg.q0 - hs_.q_begin(me_), k0 = sg.kv0 - hs_.kv_begin(me_);
        inner(s, tensor_view<const T, 3>(heads_view(fq, tt, hq, dk_, q0, sg.nq)),
              tensor_view<const T, 3>(heads_view(fk, tt, hkv, dk_, k0, sg.nkv)),
              tensor_view<const T, 3>(heads_view(fv, tt, hkv, dv_, k0, sg.nkv)), heads_view(fo, tt, hq, dv_, q0, sg.nq),
              heads_view2(fl, tt, hq, q0, sg.nq), iws);
      }
    const std::array<full_desc<const T>, 1> os{{{fo, dv_, false}}};
    const std::array<rows_desc<T>, 1> od{rows_desc_of(out, false)};
    from_heads<Acc, C, T, T>(comm, tokens_, hs_, os, od, w.at<T>(f_.osend), w.at<T>(f_.orecv), nullptr, counts);
    const std::array<full_desc<const Acc>, 1> ls{{{fl, 1, false}}};
    const std::array<rows_desc<Acc>, 1> ld{rows_desc_of(lse, false)};
    from_heads<Acc, C, Acc, Acc>(comm, tokens_, hs_, ls, ld, w.at<Acc>(f_.lsend), w.at<Acc>(f_.lrecv), nullptr, counts);
  }

  //! q, k, v, out, dout and lse to head shards; inner(s, q_s, k_s, v_s, out_s, lse_s, dout_s, dq_s,
  //! dk_s, dv_s, ws) for every segment; dq, dk, dv back (partial dK/dV of replicated kv heads
  //! summed in Acc, in rank order). `ws` holds backward_bytes().
  template <comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV,
            class Inner>
  void backward(C& comm, const Q& q, const K& k, const V& v, const O& out, const L& lse, const DO& dout, const DQ& dq,
                const DK& dk, const DV& dv, std::span<std::byte> ws, Inner&& inner) const {
    const workspace_carver w(ws);
    auto* counts = w.at<std::size_t>(b_.counts);
    T *fq = w.at<T>(b_.q), *fk = w.at<T>(b_.k), *fv = w.at<T>(b_.v), *fo = w.at<T>(b_.out), *fd = w.at<T>(b_.dout);
    T *gq = w.at<T>(b_.dq), *gk = w.at<T>(b_.dk), *gv = w.at<T>(b_.dv);
    Acc* fl = w.at<Acc>(b_.lse);
    const index_t tt = tokens_.total_tokens(), hq = hs_.q_count(me_), hkv = hs_.kv_count(me_);
    const std::array<rows_desc<const T>, 5> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true),
                                                rows_desc_of(out, false), rows_desc_of(dout, false)};
    const std::array<full_desc<T>, 5> dst{
        {{fq, dk_, false}, {fk, dk_, true}, {fv, dv_, true}, {fo, dv_, false}, {fd, dv_, false}}};
    to_heads<C, T>(comm, tokens_, hs_, src, dst, w.at<T>(b_.send), w.at<T>(b_.recv), counts);
    const std::array<rows_desc<const Acc>, 1> lsrc{rows_desc_of(lse, false)};
    const std::array<full_desc<Acc>, 1> ldst{{{fl, 1, false}}};
    to_heads<C, Acc>(comm, tokens_, hs_, lsrc, ldst, w.at<Acc>(b_.lsend), w.at<Acc>(b_.lrecv), counts);
    const auto iws = ws.subspan(b_.inner, inner_backward_);
    if (tt > 0)
      for (std::size_t s = 0; s < segments_.size(); ++s) {
        const auto& sg = segments_[s];
        const index_t q0 = sg.q0 - hs_.q_begin(me_), k0 = sg.kv0 - hs_.kv_begin(me_);
        inner(s, tensor_view<const T, 3>(heads_view(fq, tt, hq, dk_, q0, sg.nq)),
              tensor_view<const T, 3>(heads_view(fk, tt, hkv, dk_, k0, sg.nkv)),
              tensor_view<const T, 3>(heads_view(fv, tt, hkv, dv_, k0, sg.nkv)),
              tensor_view<const T, 3>(heads_view(fo, tt, hq, dv_, q0, sg.nq)),
              tensor_view<const Acc, 2>(heads_view2(fl, tt, hq, q0, sg.nq)),
              tensor_view<const T, 3>(heads_view(fd, tt, hq, dv_, q0, sg.nq)), heads_view(gq, tt, hq, dk_, q0, sg.nq),
              heads_view(gk, tt, hkv, dk_, k0, sg.nkv), heads_view(gv, tt, hkv, dv_, k0, sg.nkv), iws);
      }
    const std::array<full_desc<const T>, 3> gs{{{gq, dk_, false}, {gk, dk_, true}, {gv, dv_, true}}};
    const std::array<rows_desc<typename DQ::value_type>, 3> gd{rows_desc_of(dq, false), rows_desc_of(dk, true),
                                                               rows_desc_of(dv, true)};
    from_heads<Acc, C, T, typename DQ::value_type>(comm, tokens_, hs_, gs, gd, w.at<T>(b_.gsend), w.at<T>(b_.grecv),
                                                   w.at<Acc>(b_.acc), counts);
  }

 private:
  static index_t elems(std::size_t n) { return static_cast<index_t>(n); }
  struct fwd_at {
    std::size_t counts, send, recv, q, k, v, out, lse, osend, orecv, lsend, lrecv, inner;
  };
  struct bwd_at {
    std::size_t counts, send, recv, q, k, v, out, dout, lsend, lrecv, lse, dq, dk, dv, gsend, grecv, acc, inner;
  };
  shard::plan tokens_;
  head_split hs_;
  int me_ = 0;
  index_t dk_ = 0, dv_ = 0;
  std::vector<head_segment> segments_;
  fwd_at f_{};
  bwd_at b_{};
  std::size_t forward_bytes_ = 0, backward_bytes_ = 0, inner_forward_ = 0, inner_backward_ = 0;
};

}  // namespace loom::attention::detail
