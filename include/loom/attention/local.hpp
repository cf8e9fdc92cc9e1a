#pragma once

//! @file
//! Exact attention on one device, tiled with online softmax (never the N x N score matrix):
//!
//!   loom::attention::forward(b, q, k, v, cu_seqlens, out, lse, opts);        packed documents
//!   loom::attention::forward(b, q, k, v, q_coords, k_coords, out, lse, opts); any token sets
//!   loom::attention::backward(b, q, k, v, cu_seqlens, out, lse, dout, dq, dk, dv, opts);
//!
//! Shapes, GQA and masks: see options.hpp. Rows whose queries see no key get out = 0 and
//! lse = -inf (the identity of the merge). Precision: storage double, float, bfloat16 or half;
//! scores, softmax statistics and sums in double for double storage, float otherwise. Work:
//! 2 (Dqk + Dv) flops per visible (query, key) pair forward; the backward recomputes the scores
//! (about 2.5x the forward). Extra memory: one scratch of a few tiles per thread, O(N) in all.
//! Deterministic: every output element is computed by one work item in a fixed order.

#include <loom/attention/detail/local_kernels.hpp>
#include <loom/attention/options.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/segments.hpp>
#include <loom/scan/detail/validate.hpp>

#include <cmath>
#include <string_view>
#include <type_traits>
#include <utility>

namespace loom::attention {

//! The accumulation type for storage T.
template <class T>
using accum_t = std::conditional_t<std::is_same_v<std::remove_cv_t<T>, double>, double, float>;

namespace detail {

template <class V>
auto rows_of(const V& v) {
  return rows3<typename V::element_type>{v.data(), v.stride(0), v.stride(1)};
}
template <class V>
auto rows2_of(const V& v) {
  return rows2<typename V::element_type>{v.data(), v.stride(0), v.stride(1)};
}
template <class Space>
token_coords coords_of(const coords<Space>& c) {
  return {c.doc.data(), c.pos.data(), c.doc.stride(0), c.pos.stride(0)};
}

template <class V>
void expect_shape(const V& v, std::array<index_t, V::rank> ext, std::string_view call, std::string_view name) {
  for (std::size_t d = 0; d < V::rank; ++d)
    if (v.extent(d) != ext[d]) {
      std::string e = "[";
      for (std::size_t i = 0; i < V::rank; ++i) e += (i ? ", " : "") + std::to_string(ext[i]);
      LOOM_FAIL(errc::shape_mismatch, call, ": ", name, " must be ", e, "], got ", loom::detail::extents_string(v));
    }
  if constexpr (V::rank == 3)
    LOOM_EXPECTS(v.stride(2) == 1 || v.extent(2) <= 1, errc::invalid_argument, call, ": ", name,
                 " must be contiguous in its last dimension (stride 1), got stride ", v.stride(2));
}

//! Checks q, k, v and the (out-side) views; returns the problem.
template <class Q, class K, class V>
problem check_qkv(const Q& q, const K& k, const V& v, const options& opt, std::string_view call) {
  static_assert(Q::rank == 3 && K::rank == 3 && V::rank == 3, "attention: q, k and v are [tokens, heads, dim]");
  const problem pb{q.extent(0), k.extent(0), q.extent(1), k.extent(1),
                   q.extent(2), v.extent(2), opt.causal,  opt.window};
  LOOM_EXPECTS(pb.hkv >= 1 && pb.hq >= 1, errc::invalid_argument, call, ": heads must be >= 1, got q heads ", pb.hq,
               ", kv heads ", pb.hkv);
  LOOM_EXPECTS(pb.hq % pb.hkv == 0, errc::invalid_argument, call, ": q heads (", pb.hq,
               ") must be a multiple of kv heads (", pb.hkv, ")");
  LOOM_EXPECTS(pb.dk >= 1 && pb.dv >= 1, errc::invalid_argument, call, ": head dims must be >= 1, got dim_qk ", pb.dk,
               ", dim_v ", pb.dv);
  expect_shape(q, {pb.tq, pb.hq, pb.dk}, call, "q");
  expect_shape(k, {pb.tk, pb.hkv, pb.dk}, call, "k (dim must match q's)");
  expect_shape(v, {pb.tk, pb.hkv, pb.dv}, call, "v (tokens and heads must match k's)");
  LOOM_EXPECTS(opt.window >= 0, errc::invalid_argument, call, ": options.window must be >= 0 (0: no window), got ",
               opt.window);
  LOOM_EXPECTS(opt.scale >= 0 && std::isfinite(opt.scale), errc::invalid_argument, call,
               ": options.scale must be finite and >= 0 (0: 1/sqrt(dim)), got ", opt.scale);
  return pb;
}

//! out [Tq, Hq, Dv] and lse [Tq, Hq] of problem pb.
template <class O, class L>
void check_outputs(const problem& pb, const O& out, const L& lse, std::string_view call) {
  expect_shape(out, {pb.tq, pb.hq, pb.dv}, call, "out");
  expect_shape(lse, {pb.tq, pb.hq}, call, "lse");
}

//! dout [Tq, Hq, Dv], dq [Tq, Hq, Dqk], dk [Tk, Hkv, Dqk], dv [Tk, Hkv, Dv] of problem pb.
template <class DO, class DQ, class DK, class DV>
void check_gradients(const problem& pb, const DO& dout, const DQ& dq, const DK& dk, const DV& dv,
                     std::string_view call) {
  expect_shape(dout, {pb.tq, pb.hq, pb.dv}, call, "dout");
  expect_shape(dq, {pb.tq, pb.hq, pb.dk}, call, "dq");
  expect_shape(dk, {pb.tk, pb.hkv, pb.dk}, call, "dk");
  expect_shape(dv, {pb.tk, pb.hkv, pb.dv}, call, "dv");
}

template <class Space>
void check_coords(const coords<Space>& c, index_t n, std::string_view call, std::string_view name) {
  LOOM_EXPECTS(c.doc.extent(0) == n && c.pos.extent(0) == n, errc::shape_mismatch, call, ": ", name,
               " coordinates must have one entry per token (", n, "), got doc ", c.doc.extent(0), ", pos ",
               c.pos.extent(0));
}

template <class Acc>
Acc scale_of(const options& opt, index_t dk) {
  return static_cast<Acc>(opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(dk)));
}

//! Number of scratch slots: one per thread on the host, one per item on a device.
template <backend B>
index_t slots_for(const B& b, index_t items) {
  index_t s = items;
  if constexpr (backend_traits<B>::memory_space::host_accessible) s = backend_traits<B>::concurrency(b);
  return s < items ? (s > 0 ? s : 1) : (items > 0 ? items : 1);
}

//! The prepared K/V layouts of a call (see prepared_kv), in a temporary of B's memory.
template <backend B, class Acc>
struct prepared_layouts {
  temporary_buffer<B, Acc> buf;
  prepared_kv<Acc> layouts;
  template <class K, class V>
  prepared_layouts(const B& b, const problem& pb, const K& k, const V& v, bool kt, bool vt, bool kr, bool vr)
      : buf(b, prepared_kv<Acc>::size(pb.hkv, pb.k_tiles() * tile_k, pb.dk, pb.dv, kt, vt, kr, vr)) {
    const index_t pad = pb.k_tiles() * tile_k, per = pb.hkv * pad;
    Acc* at = buf.data();
    layouts.tk_pad = pad;
    layouts.dk = pb.dk;
    layouts.dv = pb.dv;
    if (kt) layouts.kt = std::exchange(at, at + per * pb.dk);
    if (vt) layouts.vt = std::exchange(at, at + per * pb.dv);
    if (kr) layouts.kr = std::exchange(at, at + per * pb.dk);
    if (vr) layouts.vr = std::exchange(at, at + per * pb.dv);
    if (pb.tk > 0)
      for_each_index(
          b, pb.hkv * pb.k_tiles(),
          prepare_kv_kernel<typename K::value_type, typename V::value_type, Acc>{pb, rows_of(k), rows_of(v), layouts});
  }
};

//! (segment, offset) of every token of a packed sequence.
struct coords_from_offsets {
  const index_t* offsets;
  index_t segments;
  index_t* doc;
  index_t* pos;
  LOOM_HD void operator()(index_t t) const {
    const index_t lo = segment_of(offsets, segments, t);
    doc[t] = lo;
    pos[t] = t - offsets[lo];
  }
};

//! Coordinates of a packed sequence in B's memory, kept alive by the returned holder.
template <backend B>
struct packed_coords {
  temporary_buffer<B, index_t> buf;
  coords<typename backend_traits<B>::memory_space> c;
  template <class Off>
  packed_coords(const B& b, const Off& cu, index_t n, std::string_view call) : buf(b, 2 * (n > 0 ? n : 1)) {
    scan::detail::check_offsets(cu, n, call, "cu_seqlens");
    LOOM_EXPECTS(cu.stride(0) == 1, errc::invalid_argument, call, ": cu_seqlens must be contiguous");
    using S = typename backend_traits<B>::memory_space;
    c.doc = tensor_view<const index_t, 1, S>(buf.data(), {n});
    c.pos = tensor_view<const index_t, 1, S>(buf.data() + n, {n});
    for_each_index(b, n, coords_from_offsets{cu.data(), cu.extent(0) - 1, buf.data(), buf.data() + n});
  }
};

}  // namespace detail

//! Attention of the queries over the keys, masked by token coordinates (options.hpp).
//! out [Tq, Hq, Dv], lse [Tq, Hq] of the accumulation type.
//! @throws loom::error(invalid_argument) for heads_q not a multiple of heads_kv and bad options;
//! (shape_mismatch) for views or coordinates of the wrong extents.
template <backend B, class Q, class K, class V, class O, class L, class Space>
void forward(const B& b, Q q, K k, V v, const coords<Space>& qc, const coords<Space>& kc, O out, L lse,
             const options& opt = {}) {
  constexpr std::string_view call = "attention::forward";
  using Acc = accum_t<typename Q::value_type>;
  static_assert(std::is_same_v<typename L::value_type, Acc>,
                "attention::forward: lse must have the accumulation type (float, or double for double storage)");
  const detail::problem pb = detail::check_qkv(q, k, v, opt, call);
  detail::check_outputs(pb, out, lse, call);
  detail::check_coords(qc, pb.tq, call, "query");
  detail::check_coords(kc, pb.tk, call, "key");
  if (pb.tq == 0) return;
  using Kn = detail::forward_kernel<typename Q::value_type, typename K::value_type, typename V::value_type,
                                    typename O::value_type, Acc>;
  const index_t items = pb.q_tiles() * pb.hq;
  const index_t slots = detail::slots_for(b, items);
  const detail::prepared_layouts<B, Acc> kv(b, pb, k, v, true, false, false, true);
  temporary_buffer<B, Acc> ws(b, slots * Kn::scratch(pb.dk, pb.dv));
  for_each_index(b, slots,
                 Kn{pb, detail::rows_of(q), kv.layouts, detail::rows_of(out), detail::rows2_of(lse),
                    detail::coords_of(qc), detail::coords_of(kc), detail::scale_of<Acc>(opt, pb.dk), ws.data(), slots});
  fence(b);
}

//! Packed documents: q, k and v hold the same tokens, delimited by cu_seqlens (documents + 1
//! offsets, starting at 0, non-decreasing, ending at the token count).
template <backend B, class Q, class K, class V, class C, class O, class L>
void forward(const B& b, Q q, K k, V v, C cu_seqlens, O out, L lse, const options& opt = {}) {
  LOOM_EXPECTS(k.extent(0) == q.extent(0), errc::shape_mismatch,
               "attention::forward: with cu_seqlens, q and k must hold the same tokens, got ", q.extent(0), " and ",
               k.extent(0));
  detail::packed_coords<B> pc(b, cu_seqlens, q.extent(0), "attention::forward");
  forward(b, q, k, v, pc.c, pc.c, out, lse, opt);
}

//! Gradients of the attention of forward(): dq [Tq, Hq, Dqk], dk [Tk, Hkv, Dqk], dv [Tk, Hkv, Dv],
//! given the forward's out and lse (for a ring, the final merged ones) and dout. With
//! `accumulate`, the gradients are added to what dq, dk, dv hold (for sums over key blocks).
template <backend B, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV, class Space>
void backward(const B& b, Q q, K k, V v, const coords<Space>& qc, const coords<Space>& kc, O out, L lse, DO dout, DQ dq,
              DK dk, DV dv, const options& opt = {}, bool accumulate = false) {
  constexpr std::string_view call = "attention::backward";
  using Acc = accum_t<typename Q::value_type>;
  static_assert(std::is_same_v<typename L::value_type, Acc>,
                "attention::backward: lse must have the accumulation type");
  static_assert(std::is_same_v<typename DQ::value_type, typename DK::value_type> &&
                    std::is_same_v<typename DQ::value_type, typename DV::value_type>,
                "attention::backward: dq, dk and dv must have one element type");
  const detail::problem pb = detail::check_qkv(q, k, v, opt, call);
  detail::check_outputs(pb, out, lse, call);
  detail::check_gradients(pb, dout, dq, dk, dv, call);
  detail::check_coords(qc, pb.tq, call, "query");
  detail::check_coords(kc, pb.tk, call, "key");
  using TQ = typename Q::value_type;
  using TK = typename K::value_type;
  using TV = typename V::value_type;
  using TD = typename DO::value_type;
  using TG = typename DQ::value_type;
  temporary_buffer<B, Acc> delta(b, pb.tq * pb.hq);
  if (pb.tq > 0)
    for_each_index(b, pb.tq * pb.hq,
                   detail::delta_kernel<typename O::value_type, TD, Acc>{detail::rows_of(out), detail::rows_of(dout),
                                                                         delta.data(), pb.hq, pb.dv});
  const detail::prepared_layouts<B, Acc> kv(b, pb, k, v, true, true, true, false);
  const detail::backward_args<TQ, TK, TV, TD, TG, Acc> args{pb,
                                                            detail::rows_of(q),
                                                            detail::rows_of(k),
                                                            detail::rows_of(v),
                                                            detail::rows_of(dout),
                                                            detail::rows2_of(lse),
                                                            delta.data(),
                                                            detail::rows_of(dq),
                                                            detail::rows_of(dk),
                                                            detail::rows_of(dv),
                                                            detail::coords_of(qc),
                                                            detail::coords_of(kc),
                                                            detail::scale_of<Acc>(opt, pb.dk),
                                                            accumulate,
                                                            kv.layouts};
  using KV = detail::backward_kv_kernel<TQ, TK, TV, TD, TG, Acc>;
  using QK = detail::backward_q_kernel<TQ, TK, TV, TD, TG, Acc>;
  const index_t kv_items = pb.k_tiles() * pb.hkv, q_items = pb.q_tiles() * pb.hq;
  const index_t kv_slots = detail::slots_for(b, kv_items), q_slots = detail::slots_for(b, q_items);
  const index_t need = std::max(kv_slots * KV::scratch(pb.dk, pb.dv), q_slots * QK::scratch(pb.dk, pb.dv));
  temporary_buffer<B, Acc> ws(b, need);
  if (pb.tk > 0) for_each_index(b, kv_slots, KV{args, ws.data(), kv_slots});
  if (pb.tq > 0) for_each_index(b, q_slots, QK{args, ws.data(), q_slots});
  fence(b);
}

//! Packed documents (see the packed forward).
template <backend B, class Q, class K, class V, class C, class O, class L, class DO, class DQ, class DK, class DV>
void backward(const B& b, Q q, K k, V v, C cu_seqlens, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              const options& opt = {}) {
  LOOM_EXPECTS(k.extent(0) == q.extent(0), errc::shape_mismatch,
               "attention::backward: with cu_seqlens, q and k must hold the same tokens, got ", q.extent(0), " and ",
               k.extent(0));
  detail::packed_coords<B> pc(b, cu_seqlens, q.extent(0), "attention::backward");
  backward(b, q, k, v, pc.c, pc.c, out, lse, dout, dq, dk, dv, opt);
}

}  // namespace loom::attention
