#pragma once

//! @file
//! Exact attention on one device, tiled with online softmax (never the N x N score matrix).
//!
//!   auto plan = loom::attention::make_plan(b, docs, {tokens, heads_q, heads_kv, dim_qk, dim_v}, opts);
//!   loom::workspace_buffer ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
//!   loom::attention::forward(b, plan, q, k, v, out, lse, ws.span());                 allocates nothing
//!   loom::attention::backward(b, plan, q, k, v, out, lse, dout, dq, dk, dv, ws.span());
//!   loom::attention::forward(b, docs, q, k, v, out, lse, opts);                      convenience
//!
//! `docs` is a loom::segments (int32 or int64 offsets, in the backend's memory space; q and k hold
//! the same tokens). Queries against a longer key history (decode, prefill against a KV cache)
//! give the documents' queries and keys separately, FlashAttention's cu_seqlens_q / cu_seqlens_k;
//! a document's queries are its last tokens (query i of Lq sits at position Lk - Lq + i):
//!
//!   auto plan = loom::attention::make_plan(b, q_docs, k_docs, {tq, heads_q, heads_kv, dim_qk, dim_v, tk}, opts);
//!   loom::attention::forward(b, plan, q, k, v, out, lse, ws.span());                 (and backward)
//!   loom::attention::forward(b, q_docs, k_docs, q, k, v, out, lse, opts);            convenience
//!
//! When no document has more than detail::decode_max_queries (16) queries, the forward splits the
//! keys (split-KV: work items are (document, kv head, key split), the splits' partial results
//! merged in a fixed order), so a decode step uses every core; otherwise, and for the backward,
//! the tiled kernels run on the tokens' coordinates.
//!
//! Any token sets, masked by explicit (document, position) coordinates (ring attention's blocks),
//! use a plan without segments and pass the coordinates per call:
//!
//!   auto plan = loom::attention::make_plan(b, {tq, heads_q, heads_kv, dim_qk, dim_v, tk}, opts);
//!   loom::attention::forward(b, plan, q, k, v, q_coords, k_coords, out, lse, ws.span());
//!   loom::attention::forward(b, q, k, v, q_coords, k_coords, out, lse, opts);       convenience
//!
//! Shapes, GQA and masks (window (left, right) with FlashAttention's meaning): see options.hpp.
//! Rows whose queries see no key get out = 0 and lse = -inf (the identity of the merge).
//!
//! Plans: make_plan checks the shape and options (and the segments: host offsets fully, device
//! ones by count) and lays out the workspaces. A plan is immutable; it may be used by several
//! threads at once, each call with its own workspace and outputs. A plan made with segments keeps
//! a view of them: the offsets must stay alive and unchanged while the plan is used.
//! Workspace: plan.workspace_bytes() for forward, plan.backward_workspace_bytes() for backward,
//! in the backend's memory space, starting on loom::workspace_alignment. It holds the token
//! coordinates (segments plans), K and V in the layouts the tile products read (accumulation
//! type), one scratch of a few tiles per thread (host) or per work item (device), and the
//! backward's row terms: O(N (Hkv (Dqk + Dv) + Hq)) in all.
//!
//! Precision: the plan is templated on a loom::precision policy P (default loom::fp32, as
//! make_plan sees no element types; make_plan<loom::fp64>(...) for double). Scores, softmax
//! statistics and sums use P::accum_type, and lse must hold it; q, k, v, out and the gradients
//! may be double, float, bfloat16 or half (converted on load and store). The convenience forms
//! deduce P from q (loom::default_precision).
//!
//! Completion: host backends are complete on return; on device backends the plan forms are
//! stream-ordered on the backend's stream and return without a sync; the convenience forms fence.
//! Work: 2 (Dqk + Dv) flops per visible (query, key) pair forward (on host backends each work
//! item takes up to 4 query heads of one kv head, which share its key tiles in the cache: the
//! workspace holds their tiles per thread); the backward recomputes the
//! scores: 5 tile products per tile pair on host backends with few threads (the fused schedule,
//! which sums dQ in per-stripe buffers of the workspace), else 7 (docs/attention.md). Deterministic:
//! every output element is summed in a fixed order that depends on the shapes only.

#include <loom/attention/detail/decode_kernels.hpp>
#include <loom/attention/detail/local_kernels.hpp>
#include <loom/attention/options.hpp>
#include <loom/backend/copy.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

namespace loom::attention {

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

//! expect_extents, and a unit stride in the last dimension of rank-3 views.
template <class V>
void expect_view(const V& v, const std::array<index_t, V::rank>& ext, std::string_view call, std::string_view name) {
  expect_extents(v, ext, call, name);
  if constexpr (V::rank == 3)
    LOOM_EXPECTS(v.stride(2) == 1 || v.extent(2) <= 1, errc::invalid_argument, call, ": ", name,
                 " must be contiguous in its last dimension (stride 1), got stride ", v.stride(2));
}

//! Checks a shape and options; returns the problem.
inline problem check_problem(const shape& s, const options& opt, std::string_view call) {
  LOOM_EXPECTS(s.tokens >= 0 && s.keys() >= 0, errc::invalid_argument, call, ": token counts must be >= 0, got ",
               s.tokens, " queries, ", s.keys(), " keys");
  LOOM_EXPECTS(s.heads_q >= 1 && s.heads_kv >= 1, errc::invalid_argument, call, ": heads must be >= 1, got q heads ",
               s.heads_q, ", kv heads ", s.heads_kv);
  LOOM_EXPECTS(s.heads_q % s.heads_kv == 0, errc::invalid_argument, call, ": q heads (", s.heads_q,
               ") must be a multiple of kv heads (", s.heads_kv, ")");
  LOOM_EXPECTS(s.dim_qk >= 1 && s.dim_v >= 1, errc::invalid_argument, call, ": head dims must be >= 1, got dim_qk ",
               s.dim_qk, ", dim_v ", s.dim_v);
  LOOM_EXPECTS(opt.window.left >= -1 && opt.window.right >= -1, errc::invalid_argument, call,
               ": options.window (left, right) must each be >= -1 (-1: unbounded), got (", opt.window.left, ", ",
               opt.window.right, ")");
  LOOM_EXPECTS(!opt.scale || (*opt.scale > 0 && std::isfinite(*opt.scale)), errc::invalid_argument, call,
               ": options.scale must be finite and > 0 (or none: 1/sqrt(dim_qk)), got ", opt.scale.value_or(0.0));
  return problem{s.tokens, s.keys(),   s.heads_q,       s.heads_kv,      s.dim_qk,
                 s.dim_v,  opt.causal, opt.window.left, opt.window.right};
}

//! The shape of q, k, v (for the convenience forms).
template <class Q, class K, class V>
shape shape_of(const Q& q, const K& k, const V& v) {
  static_assert(Q::rank == 3 && K::rank == 3 && V::rank == 3, "attention: q, k and v are [tokens, heads, dim]");
  return {q.extent(0), q.extent(1), k.extent(1), q.extent(2), v.extent(2), k.extent(0)};
}

//! q, k, v, out, lse against problem pb.
template <class Q, class K, class V, class O, class L>
void check_views(const problem& pb, const Q& q, const K& k, const V& v, const O& out, const L& lse,
                 std::string_view call) {
  static_assert(Q::rank == 3 && K::rank == 3 && V::rank == 3, "attention: q, k and v are [tokens, heads, dim]");
  expect_view(q, {pb.tq, pb.hq, pb.dk}, call, "q");
  expect_view(k, {pb.tk, pb.hkv, pb.dk}, call, "k");
  expect_view(v, {pb.tk, pb.hkv, pb.dv}, call, "v");
  expect_view(out, {pb.tq, pb.hq, pb.dv}, call, "out");
  expect_view(lse, {pb.tq, pb.hq}, call, "lse");
}

//! dout [Tq, Hq, Dv], dq [Tq, Hq, Dqk], dk [Tk, Hkv, Dqk], dv [Tk, Hkv, Dv] of problem pb.
template <class DO, class DQ, class DK, class DV>
void check_gradients(const problem& pb, const DO& dout, const DQ& dq, const DK& dk, const DV& dv,
                     std::string_view call) {
  static_assert(std::is_same_v<typename DQ::value_type, typename DK::value_type> &&
                    std::is_same_v<typename DQ::value_type, typename DV::value_type>,
                "attention::backward: dq, dk and dv must have one element type");
  expect_view(dout, {pb.tq, pb.hq, pb.dv}, call, "dout");
  expect_view(dq, {pb.tq, pb.hq, pb.dk}, call, "dq");
  expect_view(dk, {pb.tk, pb.hkv, pb.dk}, call, "dk");
  expect_view(dv, {pb.tk, pb.hkv, pb.dv}, call, "dv");
}

template <class Space>
void check_coords(const coords<Space>& c, index_t n, std::string_view call, std::string_view name) {
  LOOM_EXPECTS(c.doc.extent(0) == n && c.pos.extent(0) == n, errc::shape_mismatch, call, ": ", name,
               " coordinates must have one entry per token (", n, "), got doc ", c.doc.extent(0), ", pos ",
               c.pos.extent(0));
}

template <class Acc>
Acc scale_of(const options& opt, index_t dk) {
  return static_cast<Acc>(opt.scale ? *opt.scale : 1.0 / std::sqrt(static_cast<double>(dk)));
}

//! The most scratch slots a call on b uses: the thread count on the host (one slot per thread),
//! unbounded on a device (one slot per work item). Plans record it, so that a call made with
//! another thread count never needs more workspace than the plan reserved.
template <backend B>
index_t slot_cap(const B& b) {
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    const index_t c = backend_traits<B>::concurrency(b);
    return c > 0 ? c : 1;
  } else {
    (void)b;
    return std::numeric_limits<index_t>::max();
  }
}

//! Scratch slots for `items` work items under a cap: min(cap, items), at least 1.
inline index_t slots_for(index_t cap, index_t items) { return items < cap ? (items > 0 ? items : 1) : cap; }

//! Where the buffers of one local call sit in its workspace (byte offsets), for problem pb and a
//! slot cap. `backward` selects the backward's buffers. The same arithmetic sizes a plan's
//! workspace and carves it per call; nothing is allocated.
struct local_layout {
  std::size_t kv = 0, scratch = 0, delta = 0, dq_part = 0, query = 0, bytes = 0;
  index_t slots = 0, kv_slots = 0;  //!< forward / dQ slots; dK dV slots (backward)
  index_t heads = 1;                //!< forward: query heads per work item (forward_kernel)
  bool fused = false;               //!< backward: one pass over key tiles that also sums dQ by stripes
  bool packed = false;              //!< backward: the query side packed once (packed_query)
};

//! The most query heads a forward work item takes (their tiles and sums, 64 KiB each at d = 128,
//! stay in a core's L2 cache beside the key tile they share).
inline constexpr index_t forward_max_heads = 4;

//! The most bytes of per-stripe dQ sums the fused backward takes; above, the two-pass one runs.
inline constexpr std::size_t fused_backward_max_bytes = std::size_t{512} << 20;

//! The most bytes of packed query side (packed_query) the backward takes; above, each (key tile,
//! query tile) pair loads its query and dO tiles from the caller's rows.
inline constexpr std::size_t packed_query_max_bytes = std::size_t{512} << 20;

//! Buffers of the forward or backward of pb under a slot cap; the backward packs its query side
//! when that takes at most pack_max bytes (tests lower it to run both forms).
template <class Acc>
local_layout layout_of(const problem& pb, bool backward, index_t cap, std::size_t pack_max = packed_query_max_bytes) {
  using F = forward_kernel<float, float, float, float, Acc>;
  using KV = backward_kv_kernel<float, float, float, float, float, Acc>;
  using KVF = backward_kv_kernel<float, float, float, float, float, Acc, true>;
  using QK = backward_q_kernel<float, float, float, float, float, Acc>;
  local_layout l;
  workspace_layout w;
  const index_t pad = pb.k_tiles() * tile_k;
  if (!backward) {
    // Query heads of one kv head share an item (each key tile read once for all of them) while
    // the items still number at least 4 per slot; device backends (cap unbounded) keep one.
    for (index_t g = forward_max_heads; g > 1; --g)
      if (pb.group() % g == 0 && pb.q_tiles() * (pb.hq / g) / 4 >= cap) {
        l.heads = g;
        break;
      }
    l.slots = slots_for(cap, pb.q_tiles() * (pb.hq / l.heads));
    l.kv = w.add<Acc>(prepared_kv<Acc>::size(pb.hkv, pad, pb.dk, pb.dv, true, false, false, true));
    l.scratch = w.add<Acc>(l.slots * F::scratch(pb.dk, pb.dv, l.heads));
  } else {
    // Fused (5 tile products per tile pair instead of 7) on the host when its (stripe, kv head)
    // items keep every slot busy and its dQ sums fit the bound; both schedules give the same bits.
    const index_t stripes = stripes_of(pb), part = stripes * pb.tq * pb.hq * pb.dk;
    l.fused = pb.tk > 0 && pb.tq > 0 && cap <= stripes * pb.hkv / 2 &&
              static_cast<double>(part) * sizeof(Acc) <= static_cast<double>(fused_backward_max_bytes);
    l.slots = slots_for(cap, pb.q_tiles() * pb.hq);
    l.kv_slots = slots_for(cap, (l.fused ? stripes : pb.k_tiles()) * pb.hkv);
    l.kv = w.add<Acc>(prepared_kv<Acc>::size(pb.hkv, pad, pb.dk, pb.dv, true, true, true, false));
    const index_t kv_scratch = l.fused ? KVF::scratch(pb.dk, pb.dv) : KV::scratch(pb.dk, pb.dv);
    l.scratch = w.add<Acc>(std::max(l.kv_slots * kv_scratch, l.slots * QK::scratch(pb.dk, pb.dv)));
    l.delta = w.add<Acc>(pb.tq * pb.hq);
    if (l.fused) l.dq_part = w.add<Acc>(part);
    // Host backends only (a device's slot cap is unbounded): its kernels load their tiles.
    const index_t packed = packed_query<Acc>::size(pb.tq, pb.hq, pb.dk, pb.dv);
    l.packed = cap < std::numeric_limits<index_t>::max() && pb.tk > 0 && pb.tq > 0 &&
               static_cast<double>(packed) * sizeof(Acc) <= static_cast<double>(pack_max);
    if (l.packed) l.query = w.add<Acc>(packed);
  }
  l.bytes = w.bytes();
  return l;
}

//! Workspace bytes of forward_on / backward_on for problem pb under a slot cap (ring attention
//! sizes its own workspace with these, for its largest block: the sizes grow with the tokens).
template <class Acc>
std::size_t forward_bytes(const problem& pb, index_t cap) {
  return layout_of<Acc>(pb, false, cap).bytes;
}
template <class Acc>
std::size_t backward_bytes(const problem& pb, index_t cap) {
  return layout_of<Acc>(pb, true, cap).bytes;
}

//! Where the split-KV forward's buffers sit in its workspace: the splits' partial results (when a
//! document has more than one split) and one scratch per slot.
struct decode_layout {
  std::size_t part_out = 0, part_lse = 0, scratch = 0, bytes = 0;
  index_t slots = 0;
};

template <class Acc, class Space>
decode_layout decode_layout_of(const problem& pb, const decode_split<Space>& g, index_t cap) {
  using Kn = decode_kernel<float, float, float, float, Acc, Space>;
  const index_t splits = g.splits;
  decode_layout l;
  workspace_layout w;
  l.slots = slots_for(cap, g.docs * (pb.hkv / g.heads) * splits);
  if (splits > 1) {
    l.part_out = w.add<Acc>(pb.tq * pb.hq * splits * pb.dv);
    l.part_lse = w.add<Acc>(pb.tq * pb.hq * splits);
  }
  l.scratch = w.add<Acc>(l.slots * Kn::scratch(g.max_q, pb.group(), g.heads, pb.dk, pb.dv));
  l.bytes = w.bytes();
  return l;
}

//! Keys per split of a split-KV plan: enough splits that documents x head groups x splits reaches
//! `target` work items, each split at least decode_min_chunk keys, a multiple of tile_k. From the
//! shapes only, so the result's bits do not depend on the thread count.
inline constexpr index_t decode_min_chunk = 4 * tile_k;
inline index_t decode_chunk(index_t docs, index_t groups, index_t max_k, index_t target) {
  const index_t have = docs * groups > 0 ? docs * groups : 1;
  const index_t want = (target + have - 1) / have;  // splits per document wanted
  index_t chunk = (max_k + want - 1) / want;
  chunk = (chunk + tile_k - 1) / tile_k * tile_k;
  return chunk < decode_min_chunk ? decode_min_chunk : chunk;
}

//! K and V of problem pb in the selected prepared layouts, written into `at`.
template <class Acc, backend B, class K, class V>
prepared_kv<Acc> prepare(const B& b, const problem& pb, const K& k, const V& v, Acc* at, bool kt, bool vt, bool kr,
                         bool vr) {
  prepared_kv<Acc> p;
  const index_t pad = pb.k_tiles() * tile_k, per = pb.hkv * pad;
  p.tk_pad = pad;
  p.dk = pb.dk;
  p.dv = pb.dv;
  if (kt) p.kt = std::exchange(at, at + per * pb.dk);
  if (vt) p.vt = std::exchange(at, at + per * pb.dv);
  if (kr) p.kr = std::exchange(at, at + per * pb.dk);
  if (vr) p.vr = std::exchange(at, at + per * pb.dv);
  if (pb.tk > 0)
    for_each_index(
        b, pb.hkv * pb.k_tiles(),
        prepare_kv_kernel<typename K::value_type, typename V::value_type, Acc>{pb, rows_of(k), rows_of(v), p});
  return p;
}

//! The forward of checked views on a workspace of at least forward_bytes<Acc>(pb, cap) bytes
//! (aligned), with at most `cap` scratch slots. No checks, no fence, no allocation.
template <class Acc, backend B, class Q, class K, class V, class O, class L>
void forward_on(const B& b, const problem& pb, Acc scale, Q q, K k, V v, const token_coords& qc, const token_coords& kc,
                O out, L lse, std::span<std::byte> ws, index_t cap) {
  if (pb.tq == 0) return;
  // Items of several query heads exist on host backends only (layout_of never groups on a device).
  constexpr bool host = backend_traits<B>::memory_space::host_accessible;
  using Kn = forward_kernel<typename Q::value_type, typename K::value_type, typename V::value_type,
                            typename O::value_type, Acc, host>;
  const local_layout l = layout_of<Acc>(pb, false, cap);
  const workspace_carver w(ws);
  Acc* const kv_at = w.at<Acc>(l.kv);
  const index_t per = pb.hkv * pb.k_tiles() * tile_k;  // padded keys of all kv heads
  // Host bfloat16 storage on CPUs whose AVX512_BF16 pair products beat their float FMAs
  // (avx512_bf16_pairs_available): the pair layouts (dk + dv bfloat16 a key) in kt's place (dk
  // floats a key), V's float rows after them as always.
  pair_kv pairs{};
#if defined(LOOM_ATTENTION_X86_TILES)
  if constexpr (Kn::pair_types)
    if (pb.dk % 2 == 0 && pb.dv <= pb.dk && loom::detail::x86::avx512_bf16_pairs_available()) {
      pairs.kt = reinterpret_cast<std::uint16_t*>(kv_at);
      pairs.vr = pairs.kt + per * pb.dk;
      pairs.tk_pad = per / pb.hkv;
      pairs.dk = pb.dk;
      pairs.dv = pb.dv;
      if (pb.tk > 0)
        for_each_index(
            b, pb.hkv * pb.k_tiles(),
            prepare_pairs_kernel<typename K::value_type, typename V::value_type>{pb, rows_of(k), rows_of(v), pairs});
    }
#endif
  const prepared_kv<Acc> kv = pairs.kt ? prepare(b, pb, k, v, kv_at + per * pb.dk, false, false, false, true)
                                       : prepare(b, pb, k, v, kv_at, true, false, false, true);
  // Host backends: the slots (one per thread) take items from a shared counter, so a thread that
  // loses its core to another process delays the call by the item it holds, not by its share.
  loom::detail::launch_counter<B> items;
  for_each_index(b, l.slots,
                 Kn{pb, rows_of(q), kv, rows_of(out), rows2_of(lse), qc, kc, scale, w.at<Acc>(l.scratch), l.slots,
                    l.heads, pairs, items.get()});
}

//! The backward of checked views on a workspace of at least backward_bytes<Acc>(pb, cap) bytes
//! (layout_of<Acc>(pb, true, cap, pack_max).bytes). With `accumulate`, the gradients are added to
//! what dq, dk, dv hold (ring attention's sums over key blocks). No checks, no fence, no allocation.
template <class Acc, backend B, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV>
void backward_on(const B& b, const problem& pb, Acc scale, Q q, K k, V v, const token_coords& qc,
                 const token_coords& kc, O out, L lse, DO dout, DQ dq, DK dk, DV dv, bool accumulate,
                 std::span<std::byte> ws, index_t cap, std::size_t pack_max = packed_query_max_bytes) {
  using TQ = typename Q::value_type;
  using TK = typename K::value_type;
  using TV = typename V::value_type;
  using TD = typename DO::value_type;
  using TG = typename DQ::value_type;
  const local_layout l = layout_of<Acc>(pb, true, cap, pack_max);
  const workspace_carver w(ws);
  Acc* delta = w.at<Acc>(l.delta);
  using TO = typename O::value_type;
  const delta_kernel<TO, TD, Acc> deltas{rows_of(out), rows_of(dout), delta, pb.hq, pb.dv};
  packed_query<Acc> pq{};
  if (l.packed) {  // the packing items compute delta too
    pq = {w.at<Acc>(l.query), w.at<Acc>(l.query) + pb.tq * pb.hq * pb.dk, pb.tq, pb.dk, pb.dv};
    for_each_index(b, pb.tq * pb.hq, pack_query_kernel<TQ, TO, TD, Acc>{rows_of(q), rows_of(dout), pq, deltas, scale});
  } else if (pb.tq > 0) {
    for_each_index(b, pb.tq * pb.hq, deltas);
  }
  const prepared_kv<Acc> kv = prepare(b, pb, k, v, w.at<Acc>(l.kv), true, true, true, false);
  const backward_args<TQ, TK, TV, TD, TG, Acc> args{
      pb,          rows_of(q),  rows_of(k), rows_of(v), rows_of(dout), rows2_of(lse), delta, rows_of(dq),
      rows_of(dk), rows_of(dv), qc,         kc,         scale,         accumulate,    kv,    pq};
  // The fused schedule and the striped dQ order exist on host backends only (layout_of never picks
  // fused for a device's unbounded slot cap); device kernels keep the plain order.
  constexpr bool host = backend_traits<B>::memory_space::host_accessible;
  using KV = backward_kv_kernel<TQ, TK, TV, TD, TG, Acc>;
  using QK = backward_q_kernel<TQ, TK, TV, TD, TG, Acc, host>;
  Acc* scratch = w.at<Acc>(l.scratch);
  // Host backends: the slots of each launch take items from a counter of its own (take_items).
  loom::detail::launch_counter<B> kv_items, q_items;
  if constexpr (host)
    if (l.fused) {
      const index_t stripes = stripes_of(pb);
      Acc* part = w.at<Acc>(l.dq_part);
      loom::detail::fill(b, part, stripes * pb.tq * pb.hq * pb.dk, Acc(0));
      for_each_index(
          b, l.kv_slots,
          backward_kv_kernel<TQ, TK, TV, TD, TG, Acc, true>{args, scratch, l.kv_slots, part, kv_items.get()});
      for_each_index(b, pb.tq * pb.hq,
                     dq_reduce_kernel<TG, Acc>{part, rows_of(dq), pb.tq, pb.hq, pb.dk, stripes, scale, accumulate});
      return;
    }
  if (pb.tk > 0) for_each_index(b, l.kv_slots, KV{args, scratch, l.kv_slots, nullptr, kv_items.get()});
  if (pb.tq > 0) for_each_index(b, l.slots, QK{args, scratch, l.slots, q_items.get()});
}

//! (segment, offset) of every token of a packed sequence.
template <class Space>
struct coords_from_segments {
  segments<Space> seg;
  index_t* doc;
  index_t* pos;
  LOOM_HD void operator()(index_t t) const {
    const index_t d = seg.of(t);
    doc[t] = d;
    pos[t] = t - seg[d];
  }
};

}  // namespace detail

template <class B, precision_policy P = fp32>
class plan;

//! Plans attention over the packed documents `docs` (q and k hold the same shape.tokens tokens;
//! shape.tokens_k must be -1 or equal) with options `opt`.
//! @throws loom::error(invalid_argument) for heads < 1, heads_q not a multiple of heads_kv,
//! dims < 1, a window value below -1, a scale not finite and > 0, bad segments (check_segments),
//! tokens_k != tokens.
template <precision_policy P = fp32, backend B, memory_space Space>
plan<B, P> make_plan(const B& b, const segments<Space>& docs, const shape& s, const options& opt = {});

//! Plans attention of shape.tokens queries over shape.keys() keys masked by coordinates given
//! per call. @throws as the segments form (without the segment checks).
template <precision_policy P = fp32, backend B>
plan<B, P> make_plan(const B& b, const shape& s, const options& opt = {});

//! Plans attention of each document's queries over that document's keys: document d holds
//! queries [q_docs[d], q_docs[d + 1]) of the shape.tokens and keys [k_docs[d], k_docs[d + 1]) of
//! the shape.keys(); its queries are its last positions (bottom-right aligned, FlashAttention's
//! varlen convention with a KV cache). The offsets are read on the host once (device offsets: a
//! copy and a fence of b) to check them and to choose the split-KV forward (see the file comment).
//! @throws as the segments form, and loom::error(shape_mismatch) when q_docs and k_docs hold
//! different document counts.
template <precision_policy P = fp32, backend B, memory_space Space>
plan<B, P> make_plan(const B& b, const segments<Space>& q_docs, const segments<Space>& k_docs, const shape& s,
                     const options& opt = {});

//! A local attention plan (see the file comment). Make it with attention::make_plan.
//! Immutable; may be shared between threads for reading.
template <class B, precision_policy P>
class plan : public precision_types<P> {
 public:
  using backend_type = B;
  using space = typename backend_traits<B>::memory_space;

  [[nodiscard]] const shape& dims() const noexcept { return shape_; }
  [[nodiscard]] const options& opts() const noexcept { return opt_; }
  //! True for a plan made with segments (forward / backward without coordinates).
  [[nodiscard]] bool packed() const noexcept { return packed_; }
  //! True for a plan made with separate query and key segments.
  [[nodiscard]] bool cross() const noexcept { return cross_; }
  //! The documents of a packed plan (bound to the token count); the query documents of a cross plan.
  [[nodiscard]] const segments<space>& documents() const noexcept { return seg_; }
  //! The key documents of a cross plan (bound to the key count).
  [[nodiscard]] const segments<space>& key_documents() const noexcept { return kseg_; }
  //! True when the forward splits the keys (a cross plan whose documents have at most
  //! detail::decode_max_queries queries each).
  [[nodiscard]] bool split_keys() const noexcept { return split_.splits > 0; }
  //! The split-KV geometry (split_keys() plans).
  [[nodiscard]] const detail::decode_split<space>& split() const noexcept { return split_; }
  //! Workspace bytes of forward.
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return fwd_bytes_; }
  //! Workspace bytes of backward (at least workspace_bytes() is not implied: size a buffer for
  //! both with the max of the two). On host backends with few threads this includes the fused
  //! schedule's per-stripe dQ sums, up to 4 Tq Hq Dqk accumulation values (at most 512 MiB).
  [[nodiscard]] std::size_t backward_workspace_bytes() const noexcept { return bwd_bytes_; }

  //! The kernels' problem and scale (for loom's own callers).
  [[nodiscard]] const detail::problem& problem() const noexcept { return pb_; }
  [[nodiscard]] typename P::accum_type scale() const noexcept { return scale_; }
  //! Byte offset of the packed coordinates (doc, then pos) and of the kernels' workspace.
  [[nodiscard]] std::size_t coords_offset() const noexcept { return 0; }
  [[nodiscard]] std::size_t kernel_offset() const noexcept { return kernel_at_; }
  //! The most scratch slots a call uses (the backend's thread count when planned, on the host).
  [[nodiscard]] index_t slot_cap() const noexcept { return cap_; }

 private:
  shape shape_{};
  options opt_{};
  detail::problem pb_{};
  typename P::accum_type scale_{};
  segments<space> seg_{}, kseg_{};
  detail::decode_split<space> split_{{}, {}, 0, 0, detail::tile_k, 0, 1};
  bool packed_ = false, cross_ = false;
  std::size_t kernel_at_ = 0, fwd_bytes_ = 0, bwd_bytes_ = 0;
  index_t cap_ = 1;

  template <precision_policy Q, backend B2, memory_space S2>
  friend plan<B2, Q> make_plan(const B2&, const segments<S2>&, const shape&, const options&);
  template <precision_policy Q, backend B2>
  friend plan<B2, Q> make_plan(const B2&, const shape&, const options&);
  template <precision_policy Q, backend B2, memory_space S2>
  friend plan<B2, Q> make_plan(const B2&, const segments<S2>&, const segments<S2>&, const shape&, const options&);
};

template <precision_policy P, backend B>
plan<B, P> make_plan(const B& b, const shape& s, const options& opt) {
  using Acc = typename P::accum_type;
  plan<B, P> p;
  p.shape_ = s;
  p.opt_ = opt;
  p.pb_ = detail::check_problem(s, opt, "attention::make_plan");
  p.scale_ = detail::scale_of<Acc>(opt, s.dim_qk);
  p.cap_ = detail::slot_cap(b);
  p.fwd_bytes_ = detail::forward_bytes<Acc>(p.pb_, p.cap_);
  p.bwd_bytes_ = detail::backward_bytes<Acc>(p.pb_, p.cap_);
  return p;
}

template <precision_policy P, backend B, memory_space Space>
plan<B, P> make_plan(const B& b, const segments<Space>& docs, const shape& s, const options& opt) {
  constexpr std::string_view call = "attention::make_plan";
  static_assert(std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "attention::make_plan: the segments must live in the backend's memory space");
  LOOM_EXPECTS(s.tokens_k < 0 || s.tokens_k == s.tokens, errc::invalid_argument, call,
               ": with segments, queries and keys are the same tokens (shape.tokens_k -1 or ", s.tokens, "), got ",
               s.tokens_k);
  plan<B, P> p = make_plan<P>(b, s, opt);
  p.seg_ = check_segments(docs, s.tokens, call, "segments");
  p.packed_ = true;
  workspace_layout w;
  (void)w.add<index_t>(2 * s.tokens);
  p.kernel_at_ = w.bytes();
  p.fwd_bytes_ += p.kernel_at_;
  p.bwd_bytes_ += p.kernel_at_;
  return p;
}

template <precision_policy P, backend B, memory_space Space>
plan<B, P> make_plan(const B& b, const segments<Space>& q_docs, const segments<Space>& k_docs, const shape& s,
                     const options& opt) {
  using Acc = typename P::accum_type;
  constexpr std::string_view call = "attention::make_plan";
  static_assert(std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "attention::make_plan: the segments must live in the backend's memory space");
  plan<B, P> p = make_plan<P>(b, s, opt);
  p.seg_ = check_segments(q_docs, s.tokens, call, "q_segments");
  p.kseg_ = check_segments(k_docs, s.keys(), call, "k_segments");
  LOOM_EXPECTS(p.seg_.count() == p.kseg_.count(), errc::shape_mismatch, call,
               ": q_segments and k_segments must hold the same documents, got ", p.seg_.count(), " and ",
               p.kseg_.count(), " documents");
  // The longest query and key runs, from offsets checked on the host.
  const auto longest = [&](const segments<Space>& seg, index_t n, std::string_view name) {
    return loom::detail::with_host_segments(b, seg, [&](const segments<host_memory>& h) {
      const segments<host_memory> c = check_segments(h, n, call, name);
      index_t most = 0;
      for (index_t d = 0; d < c.count(); ++d) most = std::max(most, c.length(d));
      return most;
    });
  };
  const index_t max_q = longest(p.seg_, s.tokens, "q_segments"), max_k = longest(p.kseg_, s.keys(), "k_segments");
  p.packed_ = p.cross_ = true;
  workspace_layout w;
  (void)w.add<index_t>(2 * (s.tokens + s.keys()));  // query coordinates, then key coordinates
  p.kernel_at_ = w.bytes();
  if (max_q <= detail::decode_max_queries) {
    // Host: every kv head in one item (keys read in address order), at least 64 items; device:
    // one kv head per item, at least 2048.
    constexpr bool host = backend_traits<B>::memory_space::host_accessible;
    const index_t docs = p.seg_.count(), heads = host ? s.heads_kv : 1, target = host ? 64 : 2048;
    const index_t chunk = detail::decode_chunk(docs, s.heads_kv / heads, max_k, target);
    p.split_ = {p.seg_, p.kseg_, docs, max_q, chunk, max_k > chunk ? (max_k + chunk - 1) / chunk : 1, heads};
    p.fwd_bytes_ = detail::decode_layout_of<Acc>(p.pb_, p.split_, p.cap_).bytes;
  }
  p.fwd_bytes_ += p.kernel_at_;
  p.bwd_bytes_ += p.kernel_at_;
  return p;
}

namespace detail {
template <class P, class L>
constexpr void check_lse() {
  static_assert(std::is_same_v<std::remove_cv_t<typename L::value_type>, typename P::accum_type>,
                "attention: lse must hold the plan's accumulation type (P::accum_type: float for loom::fp32, "
                "bf16 and fp16; double for loom::fp64; make the plan with make_plan<loom::fp64> for double)");
}

//! The token coordinates of a packed plan, computed into the workspace (stream-ordered).
template <class B, class P>
token_coords packed_coords(const B& b, const plan<B, P>& p, std::span<std::byte> ws) {
  const index_t n = p.dims().tokens;
  index_t* doc = workspace_carver(ws).at<index_t>(p.coords_offset());
  if (n > 0) for_each_index(b, n, coords_from_segments<typename plan<B, P>::space>{p.documents(), doc, doc + n});
  return {doc, doc + n, 1, 1};
}

//! The query and key coordinates of a plan made with segments, computed into the workspace: one
//! set for a packed plan (queries and keys are the same tokens); for a cross plan the queries'
//! (bottom-right aligned with their document's keys), then the keys'.
template <class B, class P>
std::pair<token_coords, token_coords> segment_coords(const B& b, const plan<B, P>& p, std::span<std::byte> ws) {
  if (!p.cross()) {
    const token_coords c = packed_coords(b, p, ws);
    return {c, c};
  }
  using S = typename plan<B, P>::space;
  const index_t nq = p.dims().tokens, nk = p.dims().keys();
  index_t* at = workspace_carver(ws).at<index_t>(p.coords_offset());
  if (nq > 0) for_each_index(b, nq, query_coords<S>{p.documents(), p.key_documents(), at, at + nq});
  if (nk > 0) for_each_index(b, nk, coords_from_segments<S>{p.key_documents(), at + 2 * nq, at + 2 * nq + nk});
  return {{at, at + nq, 1, 1}, {at + 2 * nq, at + 2 * nq + nk, 1, 1}};
}

//! The split-KV forward of a cross plan on its kernel workspace.
template <class B, class P, class Q, class K, class V, class O, class L>
void split_forward(const B& b, const plan<B, P>& p, Q q, K k, V v, O out, L lse, std::span<std::byte> ws) {
  using Acc = typename P::accum_type;
  using S = typename plan<B, P>::space;
  const problem& pb = p.problem();
  if (pb.tq == 0) return;
  const decode_split<S>& g = p.split();
  const decode_layout l = decode_layout_of<Acc>(pb, g, p.slot_cap());
  const workspace_carver w(ws);
  Acc* po = g.splits > 1 ? w.at<Acc>(l.part_out) : nullptr;
  Acc* pl = g.splits > 1 ? w.at<Acc>(l.part_lse) : nullptr;
  using TO = typename O::value_type;
  loom::detail::launch_counter<B> items;  // host backends: the slots take items from it
  for_each_index(b, l.slots,
                 decode_kernel<typename Q::value_type, typename K::value_type, typename V::value_type, TO, Acc, S>{
                     pb, g, rows_of(q), rows_of(k), rows_of(v), rows_of(out), rows2_of(lse), p.scale(), po, pl,
                     w.at<Acc>(l.scratch), l.slots, items.get()});
  if (g.splits > 1)
    for_each_index(b, pb.tq * pb.hq,
                   decode_merge_kernel<TO, Acc, S>{g, rows_of(out), rows2_of(lse), po, pl, pb.hq, pb.dv});
}

template <class B, class P>
void check_kind(const plan<B, P>& p, bool packed, std::string_view call) {
  LOOM_EXPECTS(p.packed() == packed, errc::invalid_argument, call,
               packed ? ": the plan was made without segments; pass the query and key coordinates"
                      : ": the plan was made with segments; call it without coordinates");
}
}  // namespace detail

//! Forward on a coordinates plan: out [Tq, Hq, Dv], lse [Tq, Hq] of P::accum_type. Allocates
//! nothing, does not fence. `workspace`: plan.workspace_bytes(), aligned.
//! @throws loom::error(shape_mismatch) views or coordinates not of the plan's extents;
//! (invalid_argument) a short or misaligned workspace, a plan made with segments.
template <class B, precision_policy P, class Q, class K, class V, class O, class L, class Space>
void forward(const B& b, const plan<B, P>& p, Q q, K k, V v, const coords<Space>& qc, const coords<Space>& kc, O out,
             L lse, std::span<std::byte> workspace) {
  constexpr std::string_view call = "attention::forward";
  static_assert(std::is_same_v<Space, typename plan<B, P>::space>,
                "attention::forward: the coordinates must live in the backend's memory space");
  detail::check_lse<P, L>();
  detail::check_kind(p, false, call);
  const detail::problem& pb = p.problem();
  detail::check_views(pb, q, k, v, out, lse, call);
  detail::check_coords(qc, pb.tq, call, "query");
  detail::check_coords(kc, pb.tk, call, "key");
  check_workspace(workspace, p.workspace_bytes(), call);
  detail::forward_on(b, pb, p.scale(), q, k, v, detail::coords_of(qc), detail::coords_of(kc), out, lse, workspace,
                     p.slot_cap());
}

//! Forward on a segments plan (see the coordinates form for the contract).
template <class B, precision_policy P, class Q, class K, class V, class O, class L>
void forward(const B& b, const plan<B, P>& p, Q q, K k, V v, O out, L lse, std::span<std::byte> workspace) {
  constexpr std::string_view call = "attention::forward";
  detail::check_lse<P, L>();
  detail::check_kind(p, true, call);
  const detail::problem& pb = p.problem();
  detail::check_views(pb, q, k, v, out, lse, call);
  check_workspace(workspace, p.workspace_bytes(), call);
  const std::span<std::byte> kernel_ws = workspace.subspan(p.kernel_offset());
  if (p.split_keys()) return detail::split_forward(b, p, q, k, v, out, lse, kernel_ws);
  const auto [qc, kc] = detail::segment_coords(b, p, workspace);
  detail::forward_on(b, pb, p.scale(), q, k, v, qc, kc, out, lse, kernel_ws, p.slot_cap());
}

//! Gradients of the attention of forward(): dq [Tq, Hq, Dqk], dk [Tk, Hkv, Dqk], dv [Tk, Hkv, Dv]
//! (overwritten), given the forward's out and lse (for a ring, the final merged ones) and dout.
//! Coordinates plan; `workspace`: plan.backward_workspace_bytes(). Allocates nothing, no fence.
//! @throws as forward.
template <class B, precision_policy P, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV, class Space>
void backward(const B& b, const plan<B, P>& p, Q q, K k, V v, const coords<Space>& qc, const coords<Space>& kc, O out,
              L lse, DO dout, DQ dq, DK dk, DV dv, std::span<std::byte> workspace) {
  constexpr std::string_view call = "attention::backward";
  static_assert(std::is_same_v<Space, typename plan<B, P>::space>,
                "attention::backward: the coordinates must live in the backend's memory space");
  detail::check_lse<P, L>();
  detail::check_kind(p, false, call);
  const detail::problem& pb = p.problem();
  detail::check_views(pb, q, k, v, out, lse, call);
  detail::check_gradients(pb, dout, dq, dk, dv, call);
  detail::check_coords(qc, pb.tq, call, "query");
  detail::check_coords(kc, pb.tk, call, "key");
  check_workspace(workspace, p.backward_workspace_bytes(), call, "plan.backward_workspace_bytes()");
  detail::backward_on(b, pb, p.scale(), q, k, v, detail::coords_of(qc), detail::coords_of(kc), out, lse, dout, dq, dk,
                      dv, false, workspace, p.slot_cap());
}

//! Backward on a segments plan.
template <class B, precision_policy P, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, const plan<B, P>& p, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              std::span<std::byte> workspace) {
  constexpr std::string_view call = "attention::backward";
  detail::check_lse<P, L>();
  detail::check_kind(p, true, call);
  const detail::problem& pb = p.problem();
  detail::check_views(pb, q, k, v, out, lse, call);
  detail::check_gradients(pb, dout, dq, dk, dv, call);
  check_workspace(workspace, p.backward_workspace_bytes(), call, "plan.backward_workspace_bytes()");
  const auto [qc, kc] = detail::segment_coords(b, p, workspace);
  detail::backward_on(b, pb, p.scale(), q, k, v, qc, kc, out, lse, dout, dq, dk, dv, false,
                      workspace.subspan(p.kernel_offset()), p.slot_cap());
}

//! Convenience forward over packed documents: make_plan (precision from q), a temporary
//! workspace, the plan form, fence.
template <backend B, memory_space Space, class Q, class K, class V, class O, class L>
void forward(const B& b, const segments<Space>& docs, Q q, K k, V v, O out, L lse, const options& opt = {}) {
  const auto p = make_plan<default_precision<typename Q::value_type>>(b, docs, detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, p, q, k, v, out, lse, ws); });
}

//! Convenience forward of each document's queries over its keys (the cross make_plan).
template <backend B, memory_space Space, class Q, class K, class V, class O, class L>
void forward(const B& b, const segments<Space>& q_docs, const segments<Space>& k_docs, Q q, K k, V v, O out, L lse,
             const options& opt = {}) {
  const auto p =
      make_plan<default_precision<typename Q::value_type>>(b, q_docs, k_docs, detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, p, q, k, v, out, lse, ws); });
}

//! Convenience forward masked by coordinates.
template <backend B, class Q, class K, class V, class O, class L, class Space>
void forward(const B& b, Q q, K k, V v, const coords<Space>& qc, const coords<Space>& kc, O out, L lse,
             const options& opt = {}) {
  const auto p = make_plan<default_precision<typename Q::value_type>>(b, detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(
      b, p.workspace_bytes(), [&](std::span<std::byte> ws) { forward(b, p, q, k, v, qc, kc, out, lse, ws); });
}

//! Convenience backward over packed documents.
template <backend B, memory_space Space, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, const segments<Space>& docs, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              const options& opt = {}) {
  const auto p = make_plan<default_precision<typename Q::value_type>>(b, docs, detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(b, p.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, p, q, k, v, out, lse, dout, dq, dk, dv, ws);
  });
}

//! Convenience backward of each document's queries over its keys.
template <backend B, memory_space Space, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, const segments<Space>& q_docs, const segments<Space>& k_docs, Q q, K k, V v, O out, L lse,
              DO dout, DQ dq, DK dk, DV dv, const options& opt = {}) {
  const auto p =
      make_plan<default_precision<typename Q::value_type>>(b, q_docs, k_docs, detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(b, p.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, p, q, k, v, out, lse, dout, dq, dk, dv, ws);
  });
}

//! Convenience backward masked by coordinates.
template <backend B, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV, class Space>
void backward(const B& b, Q q, K k, V v, const coords<Space>& qc, const coords<Space>& kc, O out, L lse, DO dout, DQ dq,
              DK dk, DV dv, const options& opt = {}) {
  const auto p = make_plan<default_precision<typename Q::value_type>>(b, detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(b, p.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, p, q, k, v, qc, kc, out, lse, dout, dq, dk, dv, ws);
  });
}

}  // namespace loom::attention
