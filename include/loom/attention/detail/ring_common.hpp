#pragma once

//! @file
//! What the ring variants share: the plan state (token coordinates of every rank's shard, from
//! the shard plan, so nothing but K/V/Q data travels; the transfer counts; the workspace sizes),
//! the cross-rank signature, and host blocks carved from the caller's workspace.

#include <loom/attention/local.hpp>
#include <loom/attention/merge.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/core/workspace.hpp>
#include <loom/shard/plan.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::attention::ring {
//! The variant tags (see ring.hpp).
struct pass_kv {};
struct pass_q {};
struct all_gather_kv {};
struct bidirectional_kv {};
}  // namespace loom::attention::ring

namespace loom::attention::detail {

//! The digest of a shard plan: rank count, documents and every rank's pieces.
inline std::uint64_t digest_of(const shard::plan& plan) {
  comm::hasher h;
  h.add(plan.ranks()).add_range(std::span<const index_t>(plan.cu_seqlens()));
  for (int r = 0; r < plan.ranks(); ++r)
    for (const auto& pc : plan.rank(r).pieces)
      h.add(pc.document, pc.doc_offset, pc.global_begin, pc.local_begin, pc.length);
  return h.value();
}

//! The signature of an attention plan: the shard plan's digest, the shapes, the options and the
//! element types (storage; the accumulation type).
template <class T, class Acc>
comm::signature attention_signature(std::uint64_t plan, const head_shape& s, const options& opt) {
  return comm::signature{}
      .add("the shapes (q heads, kv heads, head dims)", s.heads_q, s.heads_kv, s.dim_qk, s.dim_v)
      .add("the options (causal, window, scale)", words_of(opt))
      .add("the element types", comm::dtype_of<T>(), sizeof(T), comm::dtype_of<Acc>())
      .add_digest("the plan", plan);
}

//! This rank of comm against the rank and size a plan was made for.
template <comm::communicator C>
void check_comm(const C& comm, int ranks, int rank, std::string_view call) {
  LOOM_EXPECTS(comm.size() == ranks && comm.rank() == rank, errc::invalid_argument, call,
               ": the plan was made for rank ", rank, " of ", ranks, ", but the communicator is rank ", comm.rank(),
               " of ", comm.size());
}

//! expect_view (extents and a unit stride in the last dimension) where unit_stride, else
//! expect_extents.
template <bool unit_stride, class V>
void expect_rank_view(const V& v, const std::array<index_t, V::rank>& ext, std::string_view call,
                      std::string_view name) {
  if constexpr (unit_stride)
    expect_view(v, ext, call, name);
  else
    expect_extents(v, ext, call, name);
}

//! The per-call checks of a view set against a rank's n rows: host memory, storage types, extents.
template <class T, class Acc, bool unit_stride, class Q, class K, class V, class O, class L>
void check_rank_views(const head_shape& s, index_t n, const Q& q, const K& k, const V& v, const O& out, const L& lse,
                      std::string_view call) {
  static_assert(Q::space::host_accessible && K::space::host_accessible && V::space::host_accessible &&
                    O::space::host_accessible && L::space::host_accessible,
                "sequence parallel attention runs on host memory");
  static_assert(std::is_same_v<std::remove_cv_t<typename Q::value_type>, T> &&
                    std::is_same_v<std::remove_cv_t<typename K::value_type>, T> &&
                    std::is_same_v<std::remove_cv_t<typename V::value_type>, T> &&
                    std::is_same_v<std::remove_cv_t<typename O::value_type>, T>,
                "sequence parallel attention: q, k, v and out must hold the plan's storage type (P::storage_type)");
  static_assert(std::is_same_v<std::remove_cv_t<typename L::value_type>, Acc>,
                "sequence parallel attention: lse must hold the plan's accumulation type (P::accum_type)");
  expect_rank_view<unit_stride>(q, {n, s.heads_q, s.dim_qk}, call, "q");
  expect_rank_view<unit_stride>(k, {n, s.heads_kv, s.dim_qk}, call, "k");
  expect_rank_view<unit_stride>(v, {n, s.heads_kv, s.dim_v}, call, "v");
  expect_rank_view<unit_stride>(out, {n, s.heads_q, s.dim_v}, call, "out");
  expect_rank_view<unit_stride>(lse, {n, s.heads_q}, call, "lse");
}

//! The per-call checks of the gradient views against a rank's n rows: storage types, extents.
template <class T, bool unit_stride, class DO, class DQ, class DK, class DV>
void check_rank_gradients(const head_shape& s, index_t n, const DO& dout, const DQ& dq, const DK& dk, const DV& dv,
                          std::string_view call) {
  static_assert(std::is_same_v<std::remove_cv_t<typename DO::value_type>, T> &&
                    std::is_same_v<std::remove_cv_t<typename DQ::value_type>, T> &&
                    std::is_same_v<std::remove_cv_t<typename DK::value_type>, T> &&
                    std::is_same_v<std::remove_cv_t<typename DV::value_type>, T>,
                "sequence parallel attention: dout, dq, dk and dv must hold the plan's storage type (P::storage_type)");
  expect_rank_view<unit_stride>(dout, {n, s.heads_q, s.dim_v}, call, "dout");
  expect_rank_view<unit_stride>(dq, {n, s.heads_q, s.dim_qk}, call, "dq");
  expect_rank_view<unit_stride>(dk, {n, s.heads_kv, s.dim_qk}, call, "dk");
  expect_rank_view<unit_stride>(dv, {n, s.heads_kv, s.dim_v}, call, "dv");
}

inline int ring_next(int r, int p, int s = 1) { return ((r + s) % p + p) % p; }

//! Everything a ring plan derives from the shard plan, the shapes and the options on one rank.
struct ring_state {
  shard::plan sharding;
  head_shape dims{};
  options opt{};
  int ranks = 1, me = 0;
  index_t mine = 0, max_rows = 0, total = 0;
  std::vector<index_t> doc, pos;  //!< (document, position) of every rank's tokens, in rank order
  std::vector<index_t> begin;     //!< rank r's tokens start at doc[begin[r]]; ranks + 1 values
  std::vector<std::size_t> send_counts, send_displs, recv_counts, recv_displs;  //!< pass-Q's all_to_allv
  index_t cap = 1;                                    //!< scratch slots of the local kernel (local.hpp)
  std::size_t local_forward = 0, local_backward = 0;  //!< the local kernel's workspace, largest block
  std::size_t forward_bytes = 0, backward_bytes = 0;

  [[nodiscard]] index_t rows(int r) const { return sharding.rank(r).tokens; }
  [[nodiscard]] token_coords coords_of(int r) const {
    const auto at = static_cast<std::size_t>(begin[static_cast<std::size_t>(r)]);
    return {doc.data() + at, pos.data() + at, 1, 1};
  }
  [[nodiscard]] token_coords all_coords() const { return {doc.data(), pos.data(), 1, 1}; }
  //! The softmax scale of the plan's options in the accumulation type.
  template <class Acc>
  [[nodiscard]] Acc scale() const {
    return scale_of<Acc>(opt, dims.dim_qk);
  }
  //! The local problem of tq queries against tk keys.
  [[nodiscard]] problem local(index_t tq, index_t tk) const {
    return {tq,         tk,         dims.heads_q,    dims.heads_kv,   dims.dim_qk,
            dims.dim_v, opt.causal, opt.window.left, opt.window.right};
  }

  ring_state() = default;
  ring_state(const shard::plan& sp, const head_shape& s, const options& o, int p, int r)
      : sharding(sp), dims(s), opt(o), ranks(p), me(r) {
    begin.assign(static_cast<std::size_t>(p) + 1, 0);
    for (int q = 0; q < p; ++q) {
      max_rows = std::max(max_rows, rows(q));
      begin[static_cast<std::size_t>(q) + 1] = begin[static_cast<std::size_t>(q)] + rows(q);
    }
    total = begin.back();
    mine = rows(r);
    doc.resize(static_cast<std::size_t>(total));
    pos.resize(doc.size());
    for (int q = 0; q < p; ++q)
      for (const auto& pc : sharding.rank(q).pieces)
        for (index_t i = 0; i < pc.length; ++i) {
          const auto at = static_cast<std::size_t>(begin[static_cast<std::size_t>(q)] + pc.local_begin + i);
          doc[at] = pc.document;
          pos[at] = pc.doc_offset + i;
        }
    // pass-Q: partials (out, then lse) of every rank's queries against my K/V, per owner
    const index_t row = s.heads_q * (s.dim_v + 1);
    std::size_t at = 0;
    for (int q = 0; q < p; ++q) {
      send_displs.push_back(at);
      send_counts.push_back(static_cast<std::size_t>(rows(q) * row));
      at += send_counts.back();
      recv_counts.push_back(static_cast<std::size_t>(mine * row));
      recv_displs.push_back(static_cast<std::size_t>(q * mine * row));
    }
  }
};

//! A host [n, h, d] block carved from a workspace (capacity fixed when carved; n may shrink).
template <class T>
struct block {
  T* p = nullptr;
  index_t n = 0, h = 0, d = 0;
  [[nodiscard]] tensor_view<T, 3> view() const { return {p, {n, h, d}}; }
  [[nodiscard]] tensor_view<const T, 3> cview() const { return {p, {n, h, d}}; }
  //! A [n, h] view of a block with d = 1 (lse rows).
  [[nodiscard]] tensor_view<T, 2> view2() const { return {p, {n, h}}; }
  [[nodiscard]] tensor_view<const T, 2> cview2() const { return {p, {n, h}}; }
  [[nodiscard]] std::span<const T> csend() const { return {p, static_cast<std::size_t>(n * h * d)}; }
  [[nodiscard]] std::span<T> span() const { return {p, static_cast<std::size_t>(n * h * d)}; }
  void zero() const {
    for (index_t e = 0; e < n * h * d; ++e) p[e] = T(0);
  }
};

//! Sizes a workspace: the carving code run against it records the layout and hands out nulls.
struct ws_sizer {
  workspace_layout l;
  template <class T>
  T* take(index_t count) {
    (void)l.add<T>(count);
    return nullptr;
  }
};

//! rows x h x d elements of T from a carver or a sizer.
template <class T, class A>
block<T> take_block(A& a, index_t rows, index_t h, index_t d) {
  return {a.template take<T>(rows * h * d), rows, h, d};
}

//! The local kernel's workspace from a carver or a sizer.
template <class A>
std::span<std::byte> take_bytes(A& a, std::size_t bytes) {
  return {a.template take<std::byte>(static_cast<index_t>(bytes)), bytes};
}

//! Copies a strided [n, h, d] view into a contiguous block of the same rows (and back).
template <class V, class T>
void copy_in(const V& v, block<T>& out) {
  for (index_t t = 0; t < out.n; ++t)
    for (index_t h = 0; h < out.h; ++h)
      for (index_t c = 0; c < out.d; ++c) out.p[(t * out.h + h) * out.d + c] = static_cast<T>(v(t, h, c));
}
template <class V, class T>
void copy_in2(const V& v, block<T>& out) {
  for (index_t t = 0; t < out.n; ++t)
    for (index_t h = 0; h < out.h; ++h) out.p[t * out.h + h] = static_cast<T>(v(t, h));
}
template <class T, class V>
void copy_out(const block<T>& in, V v) {
  using E = typename V::value_type;
  for (index_t t = 0; t < in.n; ++t)
    for (index_t h = 0; h < in.h; ++h)
      for (index_t c = 0; c < in.d; ++c) v(t, h, c) = static_cast<E>(in.p[(t * in.h + h) * in.d + c]);
}
template <class T, class V>
void copy_out2(const block<T>& in, V v) {
  using E = typename V::value_type;
  for (index_t t = 0; t < in.n; ++t)
    for (index_t h = 0; h < in.h; ++h) v(t, h) = static_cast<E>(in.p[t * in.h + h]);
}

//! A rank's keys and values as two blocks of `rows` rows: one travelling copy (or its gradient).
template <class T>
struct kv_block {
  block<T> k, v;
  template <class A>
  static kv_block take(A& a, const ring_state& st, index_t rows) {
    return {take_block<T>(a, rows, st.dims.heads_kv, st.dims.dim_qk),
            take_block<T>(a, rows, st.dims.heads_kv, st.dims.dim_v)};
  }
  void set_rows(index_t n) { k.n = v.n = n; }
  void zero() const {
    k.zero();
    v.zero();
  }
  //! n rows of the caller's k and v.
  template <class K, class V>
  void load(index_t n, const K& kk, const V& vv) {
    set_rows(n);
    copy_in(kk, k);
    copy_in(vv, v);
  }
};

//! The gradient accumulators of one call: dQ of q_rows rows, dK/dV of kv_rows rows.
template <class Acc>
struct grads {
  block<Acc> q;
  kv_block<Acc> kv;
  template <class A>
  static grads take(A& a, const ring_state& st, index_t q_rows, index_t kv_rows) {
    return {take_block<Acc>(a, q_rows, st.dims.heads_q, st.dims.dim_qk), kv_block<Acc>::take(a, st, kv_rows)};
  }
  //! n rows each, zeroed.
  void start(index_t n) {
    q.n = n;
    kv.set_rows(n);
    q.zero();
    kv.zero();
  }
  template <class DQ, class DK, class DV>
  void copy_to(DQ dq, DK dk, DV dv) const {
    copy_out(q, dq);
    copy_out(kv.k, dk);
    copy_out(kv.v, dv);
  }
};

//! Outstanding requests of one step, in a fixed array (no allocation).
template <comm::communicator C>
struct requests {
  std::array<typename C::request, 12> r{};
  std::size_t n = 0;
  //! Posts the transfer of `cur` to the next rank and of the previous rank's block into `next`
  //! (`rows` rows; with dir = -1 the other way round).
  template <class T>
  void shift(C& comm, const block<T>& cur, block<T>& next, index_t rows, int tag, int dir = 1) {
    const int p = comm.size(), me = comm.rank();
    next.n = rows;
    r[n++] = comm.isend(cur.csend(), ring_next(me, p, dir), tag);
    r[n++] = comm.irecv(next.span(), ring_next(me, p, -dir), tag);
  }
  //! Both blocks of a K/V pair (tags tag and tag + 1).
  template <class T>
  void shift(C& comm, const kv_block<T>& cur, kv_block<T>& next, index_t rows, int tag, int dir = 1) {
    shift(comm, cur.k, next.k, rows, tag, dir);
    shift(comm, cur.v, next.v, rows, tag + 1, dir);
  }
  void wait(C& comm) {
    comm::wait_all(comm, std::span<typename C::request>(r.data(), n));
    n = 0;
  }
};

//! The runner of ring variant V (specialised next to each variant): its workspace layouts, the
//! local problem bounds and the forward / backward on a carved workspace.
template <class V>
struct runner;

}  // namespace loom::attention::detail
