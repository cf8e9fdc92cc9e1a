#pragma once

//! @file
//! What the ring variants share: the token coordinates of every rank's shard (from the plan, so
//! nothing but K/V/Q data travels), agreement checks across ranks, and host buffers.

#include <loom/attention/local.hpp>
#include <loom/attention/merge.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/packing/cp_shard.hpp>

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

//! Every rank must call with the same plan, shapes and options: gathered and compared, so a
//! disagreement is an error on every rank instead of a hang or silent corruption.
template <comm::communicator C>
void check_agreement(C& comm, const shard::plan& plan, const problem& local, const options& opt,
                     std::string_view call) {
  LOOM_EXPECTS(plan.ranks() == comm.size(), errc::invalid_argument, call, ": the plan is for ", plan.ranks(),
               " ranks but the communicator has ", comm.size());
  const auto& mine = plan.rank(comm.rank());
  LOOM_EXPECTS(local.tq == mine.tokens, errc::shape_mismatch, call, ": q holds ", local.tq,
               " tokens but the plan gives rank ", comm.rank(), " ", mine.tokens);
  LOOM_EXPECTS(local.tk == mine.tokens, errc::shape_mismatch, call, ": k and v hold ", local.tk,
               " tokens but the plan gives rank ", comm.rank(), " ", mine.tokens);
  double scale_bits = opt.scale;
  std::uint64_t scale_u = 0;
  std::memcpy(&scale_u, &scale_bits, sizeof scale_u);
  const std::array<std::int64_t, 8> desc{local.hq,
                                         local.hkv,
                                         local.dk,
                                         local.dv,
                                         opt.causal ? 1 : 0,
                                         opt.window,
                                         static_cast<std::int64_t>(scale_u),
                                         plan.total_tokens()};
  std::vector<std::int64_t> all(desc.size() * static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(desc), std::span<std::int64_t>(all));
  for (int r = 0; r < comm.size(); ++r)
    for (std::size_t i = 0; i < desc.size(); ++i)
      LOOM_EXPECTS(all[static_cast<std::size_t>(r) * desc.size() + i] == desc[i], errc::invalid_argument, call,
                   ": ranks disagree on ",
                   (i < 4   ? "the shapes (q heads, kv heads, dims)"
                    : i < 7 ? "the options"
                            : "the plan"),
                   ": rank ", comm.rank(), " has ", desc[i], ", rank ", r, " has ",
                   all[static_cast<std::size_t>(r) * desc.size() + i]);
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

inline int ring_next(int r, int p, int s = 1) { return ((r + s) % p + p) % p; }

}  // namespace loom::attention::detail
