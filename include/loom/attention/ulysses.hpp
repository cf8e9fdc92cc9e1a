#pragma once

//! @file
//! Ulysses (all-to-all) sequence parallel attention over the ranks of a communicator
//! (DeepSpeed-Ulysses): every rank holds a shard of the sequence, rows in a shard::plan's local
//! order (any plan: contiguous is natural); one all_to_allv turns q, k, v into head shards over the
//! whole sequence, the local kernel runs on them, and one all_to_allv turns out (and lse) back
//! into sequence shards.
//!
//!   ulysses::plan up(seq_plan, {heads_q, heads_kv, dim_qk, dim_v});
//!   std::vector<std::byte> ws(up.workspace_bytes<float>());
//!   ulysses::forward(b, comm, up, q, k, v, out, lse, opts, ws);     no allocation of its own
//!   ulysses::forward(b, comm, seq_plan, q, k, v, out, lse, opts);   convenience (plans, allocates)
//!
//! Heads: rank j computes query heads [j Hq / P, (j + 1) Hq / P) (uneven when P does not divide Hq)
//! and receives every kv head they read, so with fewer kv heads than ranks (GQA/MQA) a kv head is
//! replicated on each rank that needs it; in the backward their partial dK/dV are summed in the
//! accumulation type, in rank order. Needs P <= Hq (Ulysses' degree limit; beyond it use the
//! hybrid Ulysses x ring, hybrid.hpp).
//!
//! Shapes per rank r (n_r = plan.rank(r).tokens): q [n_r, Hq, Dqk], k [n_r, Hkv, Dqk], v [n_r, Hkv,
//! Dv], out [n_r, Hq, Dv], lse [n_r, Hq] (accumulation type). q, k, v, out and dout share one
//! storage type T; dq, dk, dv share one type G.
//!
//! Communication, bytes rank r sends to other ranks (b = sizeof(T), A = sizeof(lse), g = sizeof(G),
//! T = total tokens, hq_j / hkv_j = q / kv heads of rank j, Σ' = sum over j != r):
//!   forward   n_r (Σ' hq_j Dqk + Σ' hkv_j (Dqk + Dv)) b  +  (T - n_r) hq_r (Dv b + A)
//!   backward  n_r (Σ' hq_j (Dqk + 2 Dv) b + Σ' hq_j A + Σ' hkv_j (Dqk + Dv) b)
//!             + (T - n_r) (hq_r Dqk + hkv_r (Dqk + Dv)) g
//! For P | Hq, P | Hkv and P | T this is the blog's 4 N h / P per link: forward
//! (P - 1) / P^2 T (Hq Dqk + Hkv (Dqk + Dv) + Hq Dv) b plus the lse.
//! Collective: every rank calls with the same plan, shapes and options (checked; a mismatch is a
//! loom::error on every rank). Host memory; deterministic for a fixed backend and P.

#include <loom/attention/detail/ulysses_exchange.hpp>

#include <array>
#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::attention::ulysses {

//! Heads and head dims of an attention layer.
struct shape {
  index_t heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
};

//! Bytes one rank sends to the other ranks in one call (see the file comment's formulas).
struct traffic {
  std::size_t forward = 0, backward = 0;
};

//! Which tokens every rank holds (a shard::plan) and which heads it computes; the coordinates
//! of the whole sequence for the masks. The same on every rank.
class plan {
 public:
  //! @throws loom::error(invalid_argument) for heads < 1, dims < 1, heads_q not a multiple of
  //! heads_kv, or more ranks than query heads.
  plan(const shard::plan& tokens, shape s) : tokens_(tokens), shape_(s) {
    constexpr std::string_view call = "ulysses::plan";
    LOOM_EXPECTS(s.heads_q >= 1 && s.heads_kv >= 1, errc::invalid_argument, call, ": heads must be >= 1, got heads_q ",
                 s.heads_q, ", heads_kv ", s.heads_kv);
    LOOM_EXPECTS(s.heads_q % s.heads_kv == 0, errc::invalid_argument, call, ": heads_q (", s.heads_q,
                 ") must be a multiple of heads_kv (", s.heads_kv, ")");
    LOOM_EXPECTS(s.dim_qk >= 1 && s.dim_v >= 1, errc::invalid_argument, call, ": dims must be >= 1, got dim_qk ",
                 s.dim_qk, ", dim_v ", s.dim_v);
    LOOM_EXPECTS(tokens.ranks() <= s.heads_q, errc::invalid_argument, call, ": Ulysses splits the ", s.heads_q,
                 " query heads over the ranks, so it needs ranks <= heads_q, got ", tokens.ranks(),
                 " ranks (use hybrid Ulysses x ring)");
    heads_ = {s.heads_q, s.heads_kv, tokens.ranks()};
    const auto& cu = tokens.cu_seqlens();
    for (std::size_t d = 0; d + 1 < cu.size(); ++d)
      for (index_t t = cu[d]; t < cu[d + 1]; ++t) {
        doc_.push_back(static_cast<index_t>(d));
        pos_.push_back(t - cu[d]);
      }
  }

  [[nodiscard]] int ranks() const noexcept { return heads_.p; }
  [[nodiscard]] const shard::plan& tokens() const noexcept { return tokens_; }
  [[nodiscard]] const shape& dims() const noexcept { return shape_; }
  [[nodiscard]] const detail::head_split& heads() const noexcept { return heads_; }
  //! Query heads [first, second) rank r computes.
  [[nodiscard]] std::pair<index_t, index_t> q_heads(int r) const { return {heads_.q_begin(r), heads_.q_end(r)}; }
  //! kv heads [first, second) rank r receives.
  [[nodiscard]] std::pair<index_t, index_t> kv_heads(int r) const { return {heads_.kv_begin(r), heads_.kv_end(r)}; }
  [[nodiscard]] coords<> sequence_coords() const {
    const auto n = static_cast<index_t>(doc_.size());
    return {tensor_view<const index_t, 1>(doc_.data(), {n}), tensor_view<const index_t, 1>(pos_.data(), {n})};
  }

  //! Workspace for forward and backward with storage T and gradients G, the largest over ranks
  //! (so one size serves every rank).
  template <class T, class G = T>
  [[nodiscard]] std::size_t workspace_bytes() const;

  //! Bytes rank r sends per call, for element sizes b (storage), a (lse), g (gradients).
  [[nodiscard]] traffic bytes_sent(int r, std::size_t b, std::size_t a, std::size_t g) const {
    const auto& h = heads_;
    const auto n = static_cast<std::size_t>(tokens_.rank(r).tokens);
    const auto rest = static_cast<std::size_t>(tokens_.total_tokens()) - n;
    const auto dk = static_cast<std::size_t>(shape_.dim_qk), dv = static_cast<std::size_t>(shape_.dim_v);
    std::size_t oq = 0, okv = 0;  // heads of the other ranks
    for (int j = 0; j < h.p; ++j)
      if (j != r) {
        oq += static_cast<std::size_t>(h.q_count(j));
        okv += static_cast<std::size_t>(h.kv_count(j));
      }
    const auto hq = static_cast<std::size_t>(h.q_count(r)), hkv = static_cast<std::size_t>(h.kv_count(r));
    traffic t;
    t.forward = n * (oq * dk + okv * (dk + dv)) * b + rest * hq * (dv * b + a);
    t.backward = n * (oq * (dk + 2 * dv) * b + oq * a + okv * (dk + dv) * b) + rest * (hq * dk + hkv * (dk + dv)) * g;
    return t;
  }

 private:
  shard::plan tokens_;
  shape shape_;
  detail::head_split heads_;
  std::vector<index_t> doc_, pos_;
};

namespace detail {
using namespace loom::attention::detail;

template <class T>
struct fwd_buffers {
  T *send, *recv, *q, *k, *v, *out, *osend, *orecv;
  accum_t<T>*lse, *lsend, *lrecv;
  std::size_t* counts;
};

template <class T>
fwd_buffers<T> carve_forward(arena& a, const plan& up, int r) {
  using Acc = accum_t<T>;
  const auto& s = up.dims();
  const auto& hs = up.heads();
  const auto& tk = up.tokens();
  const std::array<full_desc<T>, 3> in{
      {{nullptr, s.dim_qk, false}, {nullptr, s.dim_qk, true}, {nullptr, s.dim_v, true}}};
  const std::array<full_desc<T>, 1> o{{{nullptr, s.dim_v, false}}};
  const std::array<full_desc<Acc>, 1> l{{{nullptr, 1, false}}};
  const auto tt = static_cast<std::size_t>(tk.total_tokens());
  fwd_buffers<T> f{};
  f.counts = a.take<std::size_t>(static_cast<std::size_t>(4 * hs.p));
  f.send = a.take<T>(shard_side_elems<T>(tk, hs, r, in));
  f.recv = a.take<T>(head_side_elems<T>(tk, hs, r, in));
  f.q = a.take<T>(tt * static_cast<std::size_t>(hs.q_count(r) * s.dim_qk));
  f.k = a.take<T>(tt * static_cast<std::size_t>(hs.kv_count(r) * s.dim_qk));
  f.v = a.take<T>(tt * static_cast<std::size_t>(hs.kv_count(r) * s.dim_v));
  f.out = a.take<T>(tt * static_cast<std::size_t>(hs.q_count(r) * s.dim_v));
  f.lse = a.take<Acc>(tt * static_cast<std::size_t>(hs.q_count(r)));
  f.osend = a.take<T>(head_side_elems<T>(tk, hs, r, o));
  f.orecv = a.take<T>(shard_side_elems<T>(tk, hs, r, o));
  f.lsend = a.take<Acc>(head_side_elems<Acc>(tk, hs, r, l));
  f.lrecv = a.take<Acc>(shard_side_elems<Acc>(tk, hs, r, l));
  return f;
}

template <class T, class G>
struct bwd_buffers {
  T *send, *recv, *q, *k, *v, *out, *dout;
  accum_t<T>*lse, *lsend, *lrecv, *acc;
  G *dq, *dk, *dv, *gsend, *grecv;
  std::size_t* counts;
};

template <class T, class G>
bwd_buffers<T, G> carve_backward(arena& a, const plan& up, int r) {
  using Acc = accum_t<T>;
  const auto& s = up.dims();
  const auto& hs = up.heads();
  const auto& tk = up.tokens();
  const std::array<full_desc<T>, 5> in{{{nullptr, s.dim_qk, false},
                                        {nullptr, s.dim_qk, true},
                                        {nullptr, s.dim_v, true},
                                        {nullptr, s.dim_v, false},
                                        {nullptr, s.dim_v, false}}};
  const std::array<full_desc<Acc>, 1> l{{{nullptr, 1, false}}};
  const std::array<full_desc<G>, 3> gr{
      {{nullptr, s.dim_qk, false}, {nullptr, s.dim_qk, true}, {nullptr, s.dim_v, true}}};
  const auto tt = static_cast<std::size_t>(tk.total_tokens());
  const auto hq = static_cast<std::size_t>(hs.q_count(r)), hkv = static_cast<std::size_t>(hs.kv_count(r));
  const auto dk = static_cast<std::size_t>(s.dim_qk), dv = static_cast<std::size_t>(s.dim_v);
  bwd_buffers<T, G> f{};
  f.counts = a.take<std::size_t>(static_cast<std::size_t>(4 * hs.p));
  f.send = a.take<T>(shard_side_elems<T>(tk, hs, r, in));
  f.recv = a.take<T>(head_side_elems<T>(tk, hs, r, in));
  f.q = a.take<T>(tt * hq * dk);
  f.k = a.take<T>(tt * hkv * dk);
  f.v = a.take<T>(tt * hkv * dv);
  f.out = a.take<T>(tt * hq * dv);
  f.dout = a.take<T>(tt * hq * dv);
  f.lsend = a.take<Acc>(shard_side_elems<Acc>(tk, hs, r, l));
  f.lrecv = a.take<Acc>(head_side_elems<Acc>(tk, hs, r, l));
  f.lse = a.take<Acc>(tt * hq);
  f.dq = a.take<G>(tt * hq * dk);
  f.dk = a.take<G>(tt * hkv * dk);
  f.dv = a.take<G>(tt * hkv * dv);
  f.gsend = a.take<G>(head_side_elems<G>(tk, hs, r, gr));
  f.grecv = a.take<G>(shard_side_elems<G>(tk, hs, r, gr));
  f.acc = a.take<Acc>(static_cast<std::size_t>(tk.rank(r).tokens * s.heads_kv) * (dk + dv));
  return f;
}

inline arena workspace_arena(std::span<std::byte> ws, std::size_t need, std::string_view call) {
  LOOM_EXPECTS(ws.size() >= need, errc::invalid_argument, call, ": the workspace holds ", ws.size(),
               " bytes, expected at least plan.workspace_bytes() = ", need);
  LOOM_EXPECTS(reinterpret_cast<std::uintptr_t>(ws.data()) % alignof(std::max_align_t) == 0, errc::invalid_argument,
               call, ": the workspace must be aligned to ", alignof(std::max_align_t), " bytes");
  return arena{ws.data(), 0, ws.size()};
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

template <class Q, class K, class V, class O, class L>
problem check_views(const Q& q, const K& k, const V& v, const O& out, const L& lse, const options& opt,
                    std::string_view call) {
  static_assert(Q::space::host_accessible, "Ulysses attention runs on host memory");
  using T = typename Q::value_type;
  static_assert(std::is_same_v<typename K::value_type, T> && std::is_same_v<typename V::value_type, T> &&
                    std::is_same_v<typename O::value_type, T>,
                "Ulysses attention: q, k, v and out must share one storage type");
  static_assert(std::is_same_v<typename L::value_type, accum_t<T>>,
                "Ulysses attention: lse must have the accumulation type");
  const problem pb = check_qkv(q, k, v, opt, call);
  check_outputs(pb, out, lse, call);
  return pb;
}

//! The digest of a Ulysses plan: its token plan and its shape (the head split follows from them).
inline std::uint64_t digest_of(const plan& up) {
  const auto& s = up.dims();
  return comm::hasher{}
      .add(attention::detail::digest_of(up.tokens()), s.heads_q, s.heads_kv, s.dim_qk, s.dim_v)
      .value();
}

//! This rank's checks against a Ulysses plan (local: the agreement follows).
template <comm::communicator C>
void check_plan(const C& comm, const plan& up, const problem& pb, std::string_view call) {
  check_plan_rank(comm, up.tokens(), pb, call);
  const auto& s = up.dims();
  LOOM_EXPECTS(pb.hq == s.heads_q && pb.hkv == s.heads_kv && pb.dk == s.dim_qk && pb.dv == s.dim_v,
               errc::shape_mismatch, call, ": the plan is for heads ", s.heads_q, "/", s.heads_kv, ", dims ", s.dim_qk,
               "/", s.dim_v, " but the views have heads ", pb.hq, "/", pb.hkv, ", dims ", pb.dk, "/", pb.dv);
}

}  // namespace detail

template <class T, class G>
std::size_t plan::workspace_bytes() const {
  std::size_t most = 0;
  for (int r = 0; r < ranks(); ++r) {
    detail::arena f, b;
    detail::carve_forward<T>(f, *this, r);
    detail::carve_backward<T, G>(b, *this, r);
    most = std::max({most, f.used, b.used});
  }
  return most + 64;
}

//! Ulysses forward with a caller-given workspace (at least up.workspace_bytes<T>() bytes, aligned
//! to alignof(std::max_align_t)); no allocation besides the local kernel's own scratch.
//! @throws loom::error: (shape_mismatch) views of the wrong shape or not matching the plan;
//! (invalid_argument) ranks disagreeing on shapes/options/plan, a short workspace.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, const plan& up, Q q, K k, V v, O out, L lse, const options& opt,
             std::span<std::byte> workspace) {
  using namespace detail;
  constexpr std::string_view call = "ulysses::forward";
  using T = typename Q::value_type;
  using Acc = accum_t<T>;
  arena a{};
  const problem pb = agree_on<T, Acc>(comm, digest_of(up), opt, call, [&] {
    const problem p = check_views(q, k, v, out, lse, opt, call);
    check_plan(comm, up, p, call);
    a = workspace_arena(workspace, up.template workspace_bytes<T>(), call);
    return p;
  });
  const int me = comm.rank();
  const fwd_buffers<T> f = carve_forward<T>(a, up, me);
  const auto& hs = up.heads();
  const auto& tk = up.tokens();
  const index_t tt = tk.total_tokens(), hq = hs.q_count(me), hkv = hs.kv_count(me);
  const std::array<rows_desc<const T>, 3> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true)};
  const std::array<full_desc<T>, 3> dst{{{f.q, pb.dk, false}, {f.k, pb.dk, true}, {f.v, pb.dv, true}}};
  to_heads<C, T>(comm, tk, hs, src, dst, f.send, f.recv, f.counts);
  const coords<> c = up.sequence_coords();
  if (tt > 0)
    for (const auto& sg : segments_of(hs, me)) {
      const index_t q0 = sg.q0 - hs.q_begin(me), k0 = sg.kv0 - hs.kv_begin(me);
      attention::forward(b, tensor_view<const T, 3>(heads_view(f.q, tt, hq, pb.dk, q0, sg.nq)),
                         tensor_view<const T, 3>(heads_view(f.k, tt, hkv, pb.dk, k0, sg.nkv)),
                         tensor_view<const T, 3>(heads_view(f.v, tt, hkv, pb.dv, k0, sg.nkv)), c, c,
                         heads_view(f.out, tt, hq, pb.dv, q0, sg.nq), heads_view2(f.lse, tt, hq, q0, sg.nq), opt);
    }
  const std::array<full_desc<const T>, 1> os{{{f.out, pb.dv, false}}};
  const std::array<rows_desc<T>, 1> od{rows_desc_of(out, false)};
  from_heads<Acc, C, T, T>(comm, tk, hs, os, od, f.osend, f.orecv, nullptr, f.counts);
  const std::array<full_desc<const Acc>, 1> ls{{{f.lse, 1, false}}};
  const std::array<rows_desc<Acc>, 1> ld{rows_desc_of(lse, false)};
  from_heads<Acc, C, Acc, Acc>(comm, tk, hs, ls, ld, f.lsend, f.lrecv, nullptr, f.counts);
}

//! Convenience: plans the heads and allocates the workspace for this call.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, const shard::plan& tokens, Q q, K k, V v, O out, L lse, const options& opt = {}) {
  const plan up(tokens, {q.extent(1), k.extent(1), q.extent(2), v.extent(2)});
  std::vector<std::max_align_t> ws(up.workspace_bytes<typename Q::value_type>() / sizeof(std::max_align_t) + 1);
  forward(b, comm, up, q, k, v, out, lse, opt, std::as_writable_bytes(std::span(ws)));
}

//! Ulysses backward: q, k, v, out, lse (the forward's) and dout travel to head shards, the local
//! backward runs, dq, dk, dv travel back (partial dK/dV of replicated kv heads summed). dq, dk, dv
//! [n_r, ...] of one type G are overwritten. Workspace: up.workspace_bytes<T, G>().
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, const plan& up, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              const options& opt, std::span<std::byte> workspace) {
  using namespace detail;
  constexpr std::string_view call = "ulysses::backward";
  using T = typename Q::value_type;
  using G = typename DQ::value_type;
  using Acc = accum_t<T>;
  static_assert(std::is_same_v<typename DO::value_type, T>, "Ulysses attention: dout must have q's storage type");
  static_assert(std::is_same_v<typename DK::value_type, G> && std::is_same_v<typename DV::value_type, G>,
                "Ulysses attention: dq, dk and dv must share one type");
  arena a{};
  const problem pb = agree_on<T, Acc>(comm, digest_of(up), opt, call, [&] {
    const problem p = check_views(q, k, v, out, lse, opt, call);
    check_gradients(p, dout, dq, dk, dv, call);
    check_plan(comm, up, p, call);
    a = workspace_arena(workspace, up.template workspace_bytes<T, G>(), call);
    return p;
  });
  const int me = comm.rank();
  const bwd_buffers<T, G> f = carve_backward<T, G>(a, up, me);
  const auto& hs = up.heads();
  const auto& tk = up.tokens();
  const index_t tt = tk.total_tokens(), hq = hs.q_count(me), hkv = hs.kv_count(me);
  const std::array<rows_desc<const T>, 5> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true),
                                              rows_desc_of(out, false), rows_desc_of(dout, false)};
  const std::array<full_desc<T>, 5> dst{
      {{f.q, pb.dk, false}, {f.k, pb.dk, true}, {f.v, pb.dv, true}, {f.out, pb.dv, false}, {f.dout, pb.dv, false}}};
  to_heads<C, T>(comm, tk, hs, src, dst, f.send, f.recv, f.counts);
  const std::array<rows_desc<const Acc>, 1> lsrc{rows_desc_of(lse, false)};
  const std::array<full_desc<Acc>, 1> ldst{{{f.lse, 1, false}}};
  to_heads<C, Acc>(comm, tk, hs, lsrc, ldst, f.lsend, f.lrecv, f.counts);
  const coords<> c = up.sequence_coords();
  if (tt > 0)
    for (const auto& sg : segments_of(hs, me)) {
      const index_t q0 = sg.q0 - hs.q_begin(me), k0 = sg.kv0 - hs.kv_begin(me);
      attention::backward(b, tensor_view<const T, 3>(heads_view(f.q, tt, hq, pb.dk, q0, sg.nq)),
                          tensor_view<const T, 3>(heads_view(f.k, tt, hkv, pb.dk, k0, sg.nkv)),
                          tensor_view<const T, 3>(heads_view(f.v, tt, hkv, pb.dv, k0, sg.nkv)), c, c,
                          tensor_view<const T, 3>(heads_view(f.out, tt, hq, pb.dv, q0, sg.nq)),
                          tensor_view<const Acc, 2>(heads_view2(f.lse, tt, hq, q0, sg.nq)),
                          tensor_view<const T, 3>(heads_view(f.dout, tt, hq, pb.dv, q0, sg.nq)),
                          heads_view(f.dq, tt, hq, pb.dk, q0, sg.nq), heads_view(f.dk, tt, hkv, pb.dk, k0, sg.nkv),
                          heads_view(f.dv, tt, hkv, pb.dv, k0, sg.nkv), opt);
    }
  const std::array<full_desc<const G>, 3> gs{{{f.dq, pb.dk, false}, {f.dk, pb.dk, true}, {f.dv, pb.dv, true}}};
  const std::array<rows_desc<G>, 3> gd{rows_desc_of(dq, false), rows_desc_of(dk, true), rows_desc_of(dv, true)};
  from_heads<Acc, C, G, G>(comm, tk, hs, gs, gd, f.gsend, f.grecv, f.acc, f.counts);
}

//! Convenience backward: plans the heads and allocates the workspace for this call.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, const shard::plan& tokens, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              const options& opt = {}) {
  const plan up(tokens, {q.extent(1), k.extent(1), q.extent(2), v.extent(2)});
  std::vector<std::max_align_t> ws(
      up.workspace_bytes<typename Q::value_type, typename DQ::value_type>() / sizeof(std::max_align_t) + 1);
  backward(b, comm, up, q, k, v, out, lse, dout, dq, dk, dv, opt, std::as_writable_bytes(std::span(ws)));
}

}  // namespace loom::attention::ulysses
