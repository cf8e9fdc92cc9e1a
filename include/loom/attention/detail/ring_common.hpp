#pragma once

//! @file
//! What the ring variants share: the plan state (token coordinates of every rank's shard, from
//! the shard plan, so nothing but K/V/Q data travels; the transfer counts; the workspace sizes),
//! the cross-rank signature, and host blocks carved from the caller's workspace.

#include <loom/attention/local.hpp>
#include <loom/attention/merge.hpp>
#include <loom/backend/copy.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>
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
  static_assert(
      std::is_same_v<typename Q::space, typename K::space> && std::is_same_v<typename Q::space, typename V::space> &&
          std::is_same_v<typename Q::space, typename O::space> && std::is_same_v<typename Q::space, typename L::space>,
      "sequence parallel attention: q, k, v, out and lse must live in one memory space");
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

//! The per-call checks of every ring plan's forward and backward, on this rank: the views in the
//! backend's memory space, the communicator the plan's, the views of the plan's extents.
template <class B, class T, class Acc, class St, comm::communicator C, class Q, class K, class V, class O, class L>
void check_ring_call(C& comm, const St& st, const Q& q, const K& k, const V& v, const O& out, const L& lse,
                     std::string_view call) {
  static_assert(std::is_same_v<typename Q::space, typename backend_traits<B>::memory_space>,
                "ring attention: the views must live in the backend's memory space");
  check_comm(comm, st.ranks, st.me, call);
  check_rank_views<T, Acc, true>(st.dims, st.mine, q, k, v, out, lse, call);
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

//! Element i of a contiguous [n, h, d] block from / into a strided view (d = 1: a [n, h] view).
template <class V, class T, bool two_d>
struct copy_in_kernel {
  V v;
  T* p;
  index_t h, d;
  LOOM_HD void operator()(index_t i) const {
    if constexpr (two_d) {
      p[i] = static_cast<T>(v(i / h, i % h));
    } else {
      const index_t r = i / d;
      p[i] = static_cast<T>(v(r / h, r % h, i % d));
    }
  }
};
template <class T, class V, bool two_d>
struct copy_out_kernel {
  const T* p;
  V v;
  index_t h, d;
  LOOM_HD void operator()(index_t i) const {
    using E = typename V::value_type;
    if constexpr (two_d) {
      v(i / h, i % h) = static_cast<E>(p[i]);
    } else {
      const index_t r = i / d;
      v(r / h, r % h, i % d) = static_cast<E>(p[i]);
    }
  }
};

//! A [n, h, d] block carved from a workspace, in memory space Space (capacity fixed when carved;
//! n may shrink). Its element loops run on a backend (device kernels where Space is a device's).
template <class T, class Space = host_memory>
struct block {
  T* p = nullptr;
  index_t n = 0, h = 0, d = 0;
  [[nodiscard]] tensor_view<T, 3, Space> view() const { return {p, {n, h, d}}; }
  [[nodiscard]] tensor_view<const T, 3, Space> cview() const { return {p, {n, h, d}}; }
  //! A [n, h] view of a block with d = 1 (lse rows).
  [[nodiscard]] tensor_view<T, 2, Space> view2() const { return {p, {n, h}}; }
  [[nodiscard]] tensor_view<const T, 2, Space> cview2() const { return {p, {n, h}}; }
  [[nodiscard]] std::span<const T> csend() const { return {p, static_cast<std::size_t>(n * h * d)}; }
  [[nodiscard]] std::span<T> span() const { return {p, static_cast<std::size_t>(n * h * d)}; }
  [[nodiscard]] index_t size() const { return n * h * d; }
  template <backend B>
  void zero(const B& b) const {
    loom::detail::fill(b, p, size(), T(0));
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
template <class T, class Space, class A>
block<T, Space> take_block(A& a, index_t rows, index_t h, index_t d) {
  return {a.template take<T>(rows * h * d), rows, h, d};
}

//! The local kernel's workspace from a carver or a sizer.
template <class A>
std::span<std::byte> take_bytes(A& a, std::size_t bytes) {
  return {a.template take<std::byte>(static_cast<index_t>(bytes)), bytes};
}

//! Copies a strided [n, h, d] view into a contiguous block of the same rows (and back), on b.
template <backend B, class V, class T, class S>
void copy_in(const B& b, const V& v, block<T, S>& out) {
  if (out.size() > 0) for_each_index(b, out.size(), copy_in_kernel<V, T, false>{v, out.p, out.h, out.d});
}
template <backend B, class V, class T, class S>
void copy_in2(const B& b, const V& v, block<T, S>& out) {
  if (out.size() > 0) for_each_index(b, out.size(), copy_in_kernel<V, T, true>{v, out.p, out.h, 1});
}
template <backend B, class T, class S, class V>
void copy_out(const B& b, const block<T, S>& in, V v) {
  if (in.size() > 0) for_each_index(b, in.size(), copy_out_kernel<T, V, false>{in.p, v, in.h, in.d});
}
template <backend B, class T, class S, class V>
void copy_out2(const B& b, const block<T, S>& in, V v) {
  if (in.size() > 0) for_each_index(b, in.size(), copy_out_kernel<T, V, true>{in.p, v, in.h, 1});
}

//! A rank's keys and values as two blocks of `rows` rows: one travelling copy (or its gradient).
template <class T, class Space = host_memory>
struct kv_block {
  block<T, Space> k, v;
  template <class A>
  static kv_block take(A& a, const ring_state& st, index_t rows) {
    return {take_block<T, Space>(a, rows, st.dims.heads_kv, st.dims.dim_qk),
            take_block<T, Space>(a, rows, st.dims.heads_kv, st.dims.dim_v)};
  }
  void set_rows(index_t n) { k.n = v.n = n; }
  template <backend B>
  void zero(const B& b) const {
    k.zero(b);
    v.zero(b);
  }
  //! n rows of the caller's k and v.
  template <backend B, class K, class V>
  void load(const B& b, index_t n, const K& kk, const V& vv) {
    set_rows(n);
    copy_in(b, kk, k);
    copy_in(b, vv, v);
  }
};

//! The gradient accumulators of one call: dQ of q_rows rows, dK/dV of kv_rows rows.
template <class Acc, class Space = host_memory>
struct grads {
  block<Acc, Space> q;
  kv_block<Acc, Space> kv;
  template <class A>
  static grads take(A& a, const ring_state& st, index_t q_rows, index_t kv_rows) {
    return {take_block<Acc, Space>(a, q_rows, st.dims.heads_q, st.dims.dim_qk),
            kv_block<Acc, Space>::take(a, st, kv_rows)};
  }
  //! n rows each, zeroed.
  template <backend B>
  void start(const B& b, index_t n) {
    q.n = n;
    kv.set_rows(n);
    q.zero(b);
    kv.zero(b);
  }
  template <backend B, class DQ, class DK, class DV>
  void copy_to(const B& b, DQ dq, DK dk, DV dv) const {
    copy_out(b, q, dq);
    copy_out(b, kv.k, dk);
    copy_out(b, kv.v, dv);
  }
};

//! The token coordinates of a call where its kernels can read them: the plan's host tables on a
//! host memory space; on a device space, their copy in the workspace (uploaded, stream-ordered,
//! when the call starts). Reserved in every workspace, so one size serves every memory space.
struct coord_table {
  index_t *doc = nullptr, *pos = nullptr;
  const index_t *rdoc = nullptr, *rpos = nullptr;  //!< what the kernels read
  template <class A>
  static coord_table take(A& a, const ring_state& st) {
    return {a.template take<index_t>(st.total), a.template take<index_t>(st.total)};
  }
  template <class Space, backend B>
  void bind(const B& b, const ring_state& st) {
    if constexpr (Space::host_accessible) {
      rdoc = st.doc.data();
      rpos = st.pos.data();
    } else {
      copy_bytes(b, doc, st.doc.data(), st.doc.size() * sizeof(index_t));
      copy_bytes(b, pos, st.pos.data(), st.pos.size() * sizeof(index_t));
      rdoc = doc;
      rpos = pos;
    }
  }
  [[nodiscard]] token_coords of(const ring_state& st, int r) const {
    const index_t at = st.begin[static_cast<std::size_t>(r)];
    return {rdoc + at, rpos + at, 1, 1};
  }
  [[nodiscard]] token_coords all() const { return {rdoc, rpos, 1, 1}; }
};

//! True when C orders its operations on a stream of its own relative to b's (comm/stream_order.hpp).
template <class C, class B>
inline constexpr bool stream_ordered = requires(C& c, const B& b) {
  c.after(b);
};

//! The transfers of one step. Over a host communicator: isend / irecv requests, waited by wait()
//! (the transfer overlaps the step's compute on host threads). Over a stream-ordered one: the
//! communication stream first waits for the compute enqueued so far (the block to send is
//! complete and the block to receive into is no longer read), then one grouped sendrecv; wait()
//! makes the compute stream wait for the transfers. The step's compute, enqueued between the two,
//! overlaps them; nothing blocks the host.
template <comm::communicator C, backend B>
struct requests {
  std::array<typename C::request, 12> r{};
  std::size_t n = 0;
  //! Posts the transfer of `cur` to the next rank and of the previous rank's block into `next`
  //! (`rows` rows; with dir = -1 the other way round).
  template <class T, class S>
  void shift(C& comm, const B& b, const block<T, S>& cur, block<T, S>& next, index_t rows, int tag, int dir = 1) {
    hand_off(comm, b);
    post(comm, cur, next, rows, tag, dir);
  }
  //! Both blocks of a K/V pair (tags tag and tag + 1), after one hand-off.
  template <class T, class S>
  void shift(C& comm, const B& b, const kv_block<T, S>& cur, kv_block<T, S>& next, index_t rows, int tag, int dir = 1) {
    hand_off(comm, b);
    post(comm, cur.k, next.k, rows, tag, dir);
    post(comm, cur.v, next.v, rows, tag + 1, dir);
  }
  void wait(C& comm, const B& b) {
    if constexpr (stream_ordered<C, B>)
      comm::handback(b, comm);
    else
      comm::wait_all(comm, std::span<typename C::request>(r.data(), n));
    n = 0;
  }

 private:
  static void hand_off(C& comm, const B& b) {
    if constexpr (stream_ordered<C, B>) comm::handoff(b, comm);
  }
  template <class T, class S>
  void post(C& comm, const block<T, S>& cur, block<T, S>& next, index_t rows, int tag, int dir) {
    const int p = comm.size(), me = comm.rank();
    next.n = rows;
    if constexpr (stream_ordered<C, B>) {
      comm.sendrecv(cur.csend(), ring_next(me, p, dir), next.span(), ring_next(me, p, -dir), tag);
    } else {
      r[n++] = comm.isend(cur.csend(), ring_next(me, p, dir), tag);
      r[n++] = comm.irecv(next.span(), ring_next(me, p, -dir), tag);
    }
  }
};

//! The runner of ring variant V (specialised next to each variant): its workspace layouts, the
//! local problem bounds and the forward / backward on a carved workspace.
template <class V>
struct runner;

}  // namespace loom::attention::detail
