#pragma once

//! @file
//! What the ring variants share: the token coordinates of every rank's shard (from the plan, so
//! nothing but K/V/Q data travels), agreement checks across ranks, and host buffers.

#include <loom/attention/local.hpp>
#include <loom/attention/merge.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/shard/plan.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace loom::attention::detail {

//! (document, position) of the tokens of every rank's shard, in each rank's local order.
struct shard_coords {
  std::vector<std::vector<index_t>> doc, pos;
  explicit shard_coords(const shard::plan& plan) {
    const auto p = static_cast<std::size_t>(plan.ranks());
    doc.resize(p);
    pos.resize(p);
    for (std::size_t r = 0; r < p; ++r) {
      const auto& rp = plan.rank(static_cast<int>(r));
      doc[r].resize(static_cast<std::size_t>(rp.tokens));
      pos[r].resize(static_cast<std::size_t>(rp.tokens));
      for (const auto& pc : rp.pieces)
        for (index_t i = 0; i < pc.length; ++i) {
          doc[r][static_cast<std::size_t>(pc.local_begin + i)] = pc.document;
          pos[r][static_cast<std::size_t>(pc.local_begin + i)] = pc.doc_offset + i;
        }
    }
  }
  [[nodiscard]] coords<> of(int r) const {
    const auto n = static_cast<index_t>(doc[static_cast<std::size_t>(r)].size());
    return {tensor_view<const index_t, 1>(doc[static_cast<std::size_t>(r)].data(), {n}),
            tensor_view<const index_t, 1>(pos[static_cast<std::size_t>(r)].data(), {n})};
  }
};

//! The digest of a shard plan: rank count, documents and every rank's pieces.
inline std::uint64_t digest_of(const shard::plan& plan) {
  comm::hasher h;
  h.add(plan.ranks()).add_range(std::span<const index_t>(plan.cu_seqlens()));
  for (int r = 0; r < plan.ranks(); ++r)
    for (const auto& pc : plan.rank(r).pieces)
      h.add(pc.document, pc.doc_offset, pc.global_begin, pc.local_begin, pc.length);
  return h.value();
}

//! The signature of an attention call: the plan's digest, the shapes, the options and the
//! element types (storage of q, k, v and out; the accumulation type).
template <class T, class Acc>
comm::signature attention_signature(std::uint64_t plan, const problem& pb, const options& opt) {
  return comm::signature{}
      .add("the shapes (q heads, kv heads, head dims)", pb.hq, pb.hkv, pb.dk, pb.dv)
      .add("the options (causal, window, scale)", words_of(opt))
      .add("the element types", comm::dtype_of<T>(), sizeof(T), comm::dtype_of<Acc>())
      .add_digest("the plan", plan);
}

//! Every rank must call with the same plan, shapes and options: `views()` checks this rank's
//! arguments and returns its problem; then one agreement (comm/agreement.hpp) makes a rejection
//! or a disagreement the same loom::error on every rank, before any data moves.
template <class T, class Acc, comm::communicator C, class Views>
problem agree_on(C& comm, std::uint64_t plan_digest, const options& opt, std::string_view call, Views&& views,
                 int label = -1) {
  problem pb{};
  comm::agree(
      comm, call,
      [&] {
        pb = views();
        return attention_signature<T, Acc>(plan_digest, pb, opt);
      },
      label);
  return pb;
}

//! This rank's checks against a shard plan: its size and this rank's token count.
template <comm::communicator C>
void check_plan_rank(const C& comm, const shard::plan& plan, const problem& local, std::string_view call) {
  LOOM_EXPECTS(plan.ranks() == comm.size(), errc::invalid_argument, call, ": the plan is for ", plan.ranks(),
               " ranks but the communicator has ", comm.size());
  const auto& mine = plan.rank(comm.rank());
  LOOM_EXPECTS(local.tq == mine.tokens, errc::shape_mismatch, call, ": q holds ", local.tq,
               " tokens but the plan gives rank ", comm.rank(), " ", mine.tokens);
  LOOM_EXPECTS(local.tk == mine.tokens, errc::shape_mismatch, call, ": k and v hold ", local.tk,
               " tokens but the plan gives rank ", comm.rank(), " ", mine.tokens);
}

//! agree_on for the ring variants: the views, then the plan against this rank.
template <class T, class Acc, comm::communicator C, class Views>
problem agree_ring(C& comm, const shard::plan& plan, const options& opt, std::string_view call, Views&& views) {
  return agree_on<T, Acc>(comm, digest_of(plan), opt, call, [&] {
    const problem pb = views();
    check_plan_rank(comm, plan, pb, call);
    return pb;
  });
}

//! A host [n, h, d] block of T.
template <class T>
struct block3 {
  std::vector<T> data;
  index_t n = 0, h = 0, d = 0;
  block3() = default;
  block3(index_t n_, index_t h_, index_t d_) : data(static_cast<std::size_t>(n_ * h_ * d_)), n(n_), h(h_), d(d_) {}
  void resize(index_t n_) {
    n = n_;
    data.resize(static_cast<std::size_t>(n * h * d));
  }
  tensor_view<T, 3> view() { return {data.data(), {n, h, d}}; }
  tensor_view<const T, 3> cview() const { return {data.data(), {n, h, d}}; }
  std::span<const T> span() const { return data; }
  std::span<T> span() { return data; }
};

template <class T>
struct block2 {
  std::vector<T> data;
  index_t n = 0, h = 0;
  block2() = default;
  block2(index_t n_, index_t h_) : data(static_cast<std::size_t>(n_ * h_)), n(n_), h(h_) {}
  tensor_view<T, 2> view() { return {data.data(), {n, h}}; }
  tensor_view<const T, 2> cview() const { return {data.data(), {n, h}}; }
};

//! Copies a strided [n, h, d] view into a contiguous block (and back).
template <class V, class T>
void copy_in(const V& v, block3<T>& out) {
  for (index_t t = 0; t < out.n; ++t)
    for (index_t h = 0; h < out.h; ++h)
      for (index_t c = 0; c < out.d; ++c)
        out.data[static_cast<std::size_t>((t * out.h + h) * out.d + c)] = static_cast<T>(v(t, h, c));
}
template <class T, class V>
void copy_out(const block3<T>& in, V v) {
  using E = typename V::value_type;
  for (index_t t = 0; t < in.n; ++t)
    for (index_t h = 0; h < in.h; ++h)
      for (index_t c = 0; c < in.d; ++c)
        v(t, h, c) = static_cast<E>(in.data[static_cast<std::size_t>((t * in.h + h) * in.d + c)]);
}
template <class T, class V>
void copy_out(const block2<T>& in, V v) {
  using E = typename V::value_type;
  for (index_t t = 0; t < in.n; ++t)
    for (index_t h = 0; h < in.h; ++h) v(t, h) = static_cast<E>(in.data[static_cast<std::size_t>(t * in.h + h)]);
}

//! The local backward adding into dq, dk, dv (sums over key blocks).
template <class B, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV, class Space>
void local_backward_acc(const B& b, Q q, K k, V v, const coords<Space>& qc, const coords<Space>& kc, O out, L lse,
                        DO dout, DQ dq, DK dk, DV dv, const options& opt) {
  using Acc = loom::accum_t<typename Q::value_type>;
  const problem pb = check_problem(shape_of(q, k, v), opt, "ring attention");
  const temporary_buffer<B, std::byte> ws(b, static_cast<index_t>(backward_bytes<Acc>(b, pb)));
  backward_on(b, pb, scale_of<Acc>(opt, pb.dk), q, k, v, coords_of(qc), coords_of(kc), out, lse, dout, dq, dk, dv, true,
              ws.bytes());
}

inline int ring_next(int r, int p, int s = 1) { return ((r + s) % p + p) % p; }

}  // namespace loom::attention::detail
