#pragma once

//! @file
//! The two all-to-alls of Ulysses sequence parallelism, shared by ulysses.hpp and hybrid.hpp:
//! to_heads turns sequence shards of several tensors ([n_r, H, D] per rank, rows in a shard::plan's
//! local order) into head shards over the whole sequence ([T, h_r, D] in the sequence's order);
//! from_heads turns head shards back into sequence shards, summing the partial gradients of kv
//! heads that several ranks held (GQA/MQA with fewer kv heads than ranks). Both use one
//! all_to_allv per element type, with every buffer carved from a caller-given workspace.

#include <loom/attention/detail/ring_common.hpp>
#include <loom/attention/local.hpp>
#include <loom/comm/communicator.hpp>
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

//! Bump allocator over a workspace; with a null base it only measures.
struct arena {
  std::byte* base = nullptr;
  std::size_t used = 0, capacity = 0;
  template <class T>
  T* take(std::size_t count) {
    used = (used + 63) / 64 * 64;
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += count * sizeof(T);
    LOOM_EXPECTS(!base || used <= capacity, errc::internal, "ulysses: workspace layout overflow");
    return p;
  }
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

}  // namespace loom::attention::detail
