#pragma once

//! @file
//! Hybrid Ulysses x ring sequence parallel attention (USP): P = U x R ranks on a 2-D grid. Rank r
//! is Ulysses rank u = r mod U of Ulysses group g = r / U (consecutive ranks, the fast links) and
//! ring rank g of ring group u (stride U). The sequence is sharded over the R ring ranks by a
//! shard::plan (contiguous, zigzag or per_document: the causal balance of the ring); ring shard g
//! is split contiguously over the U ranks of Ulysses group g. Forward: one all_to_allv inside the
//! Ulysses group turns q, k, v into head shards over the ring shard (Hq / U heads, uneven allowed,
//! kv heads replicated as in ulysses.hpp), ring pass-KV runs across the R groups on those heads,
//! one all_to_allv returns out and lse. The backward mirrors it (ring pass-KV backward inside).
//!
//!   hybrid::plan hp(cu_seqlens, {.ulysses = U, .ring = R}, shard::zigzag{}, {Hq, Hkv, Dqk, Dv});
//!   auto g = hybrid::split(comm, hp);                        once: comm.split twice
//!   hybrid::forward(b, g, hp, q, k, v, out, lse, opts, ws);  ws: hp.workspace_bytes<T>()
//!   hp.scatter(r, global, row, local) / hp.gather(...)       which rows rank r holds
//!
//! Shapes per rank r: as ulysses.hpp with n_r = hp.tokens(r). Needs U <= Hq.
//! Communication per rank (sum of the parts, see hp.bytes_sent): the Ulysses formulas of
//! ulysses.hpp inside the group (T replaced by the ring shard's n_g tokens), plus ring pass-KV on
//! hkv_u kv heads: forward Σ_{s=0}^{R-2} n_{g-s} hkv_u (Dqk + Dv) b; backward that again plus
//! T hkv_u (Dqk + Dv) A (the travelling dK/dV accumulators).
//! Collective over the whole grid; shapes, options and plans are checked inside each Ulysses
//! group and each ring group (which together cover every rank).

#include <loom/attention/ring.hpp>
#include <loom/attention/ulysses.hpp>

#include <span>
#include <string_view>
#include <vector>

namespace loom::attention::hybrid {

//! The 2-D grid: U ranks per Ulysses group, R ring groups' length.
struct grid {
  int ulysses = 1, ring = 1;
};

//! Which rows every rank holds and which heads it computes. The same on every rank.
class plan {
 public:
  //! @throws loom::error(invalid_argument) for a grid dimension < 1, U > heads_q, or the shape
  //! errors of ulysses::plan.
  template <shard::strategy S>
  plan(std::span<const index_t> cu_seqlens, grid g, S strategy, ulysses::shape s)
      : grid_(g), ring_(shard::make_plan(cu_seqlens, check_grid(g), strategy)) {
    for (int gr = 0; gr < g.ring; ++gr) {
      const std::vector<index_t> one{0, ring_.rank(gr).tokens};
      groups_.emplace_back(shard::make_plan(std::span<const index_t>(one), g.ulysses, shard::contiguous{}), s);
    }
    runs_.resize(static_cast<std::size_t>(ranks()));
    for (int r = 0; r < ranks(); ++r) {  // ring-local rows [a, b) of rank r, mapped to global runs
      const auto& inner = groups_[static_cast<std::size_t>(r / g.ulysses)].tokens().rank(r % g.ulysses);
      const index_t a = inner.pieces.empty() ? 0 : inner.pieces.front().global_begin, b = a + inner.tokens;
      for (const auto& pc : ring_.rank(r / g.ulysses).pieces) {
        const index_t lo = std::max(a, pc.local_begin), hi = std::min(b, pc.local_begin + pc.length);
        if (lo < hi)
          runs_[static_cast<std::size_t>(r)].push_back({pc.global_begin + lo - pc.local_begin, lo - a, hi - lo});
      }
    }
  }

  [[nodiscard]] int ranks() const noexcept { return grid_.ulysses * grid_.ring; }
  [[nodiscard]] grid dims() const noexcept { return grid_; }
  [[nodiscard]] index_t total_tokens() const noexcept { return ring_.total_tokens(); }
  //! The ring sharding over the R ring ranks.
  [[nodiscard]] const shard::plan& ring_plan() const noexcept { return ring_; }
  //! The Ulysses plan of group g (the rows of ring shard g over its U ranks).
  [[nodiscard]] const ulysses::plan& group(int g) const { return groups_.at(static_cast<std::size_t>(g)); }
  //! Rows held by rank r.
  [[nodiscard]] index_t tokens(int r) const { return group(r / grid_.ulysses).tokens().rank(r % grid_.ulysses).tokens; }

  //! Copies rank r's rows (rows of `row` elements) out of a global array, and back.
  template <class T>
  void scatter(int r, std::span<const T> global, index_t row, std::span<T> local) const {
    check_rows("scatter", r, global.size(), local.size(), row);
    for (const auto& x : runs_[static_cast<std::size_t>(r)])
      std::copy_n(global.data() + x.global * row, x.length * row, local.data() + x.local * row);
  }
  template <class T>
  void gather(int r, std::span<const T> local, index_t row, std::span<T> global) const {
    check_rows("gather", r, global.size(), local.size(), row);
    for (const auto& x : runs_[static_cast<std::size_t>(r)])
      std::copy_n(local.data() + x.local * row, x.length * row, global.data() + x.global * row);
  }

  //! Workspace of forward and backward (the Ulysses part; ring attention keeps its own buffers).
  template <class T, class G = T>
  [[nodiscard]] std::size_t workspace_bytes() const {
    std::size_t most = 0;
    for (const auto& g : groups_) most = std::max(most, g.template workspace_bytes<T, G>());
    return most;
  }

  //! Bytes rank r sends per call: Ulysses part + ring pass-KV part (file comment). b storage,
  //! a lse / ring accumulators, g gradients.
  [[nodiscard]] ulysses::traffic bytes_sent(int r, std::size_t b, std::size_t a, std::size_t g) const {
    const int u = r % grid_.ulysses, gr = r / grid_.ulysses, rr = grid_.ring;
    ulysses::traffic t = group(gr).bytes_sent(u, b, a, g);
    const auto& s = group(gr).dims();
    const auto row = static_cast<std::size_t>(group(gr).heads().kv_count(u) * (s.dim_qk + s.dim_v));
    std::size_t blocks = 0;
    for (int st = 0; st + 1 < rr; ++st)
      blocks += static_cast<std::size_t>(ring_.rank(((gr - st) % rr + rr) % rr).tokens);
    t.forward += blocks * row * b;
    t.backward += blocks * row * b + (rr > 1 ? static_cast<std::size_t>(total_tokens()) * row * a : 0);
    return t;
  }

 private:
  struct run {
    index_t global, local, length;
  };
  grid grid_;
  shard::plan ring_;
  std::vector<ulysses::plan> groups_;
  std::vector<std::vector<run>> runs_;

  static int check_grid(grid g) {
    LOOM_EXPECTS(g.ulysses >= 1 && g.ring >= 1, errc::invalid_argument,
                 "hybrid::plan: grid dimensions must be >= 1, got U = ", g.ulysses, ", R = ", g.ring);
    return g.ring;
  }
  void check_rows(const char* who, int r, std::size_t global, std::size_t local, index_t row) const {
    LOOM_EXPECTS(r >= 0 && r < ranks(), errc::invalid_argument, "hybrid::plan::", who, ": rank ", r, " outside [0, ",
                 ranks(), ")");
    LOOM_EXPECTS(global == static_cast<std::size_t>(total_tokens() * row), errc::shape_mismatch, "hybrid::plan::", who,
                 ": the global array holds ", global, " elements, expected ", total_tokens(), " tokens x ", row);
    LOOM_EXPECTS(local == static_cast<std::size_t>(tokens(r) * row), errc::shape_mismatch, "hybrid::plan::", who,
                 ": the local array of rank ", r, " holds ", local, " elements, expected ", tokens(r), " tokens x ",
                 row);
  }
};

//! The two sub-communicators of a rank: its Ulysses group and its ring group.
template <class C>
struct groups {
  C ulysses, ring;
};

//! Splits comm into the grid's groups (collective; call once and reuse).
//! @throws loom::error(invalid_argument) when U x R differs from comm.size().
template <comm::communicator C>
groups<C> split(C& comm, const plan& hp) {
  const grid g = hp.dims();
  LOOM_EXPECTS(g.ulysses * g.ring == comm.size(), errc::invalid_argument, "hybrid::split: the grid U x R = ", g.ulysses,
               " x ", g.ring, " = ", g.ulysses * g.ring, " must equal the communicator's size, ", comm.size());
  const int r = comm.rank();
  C u = comm.split(r / g.ulysses, r % g.ulysses);
  C ring = comm.split(r % g.ulysses, r / g.ulysses);
  return {std::move(u), std::move(ring)};
}

namespace detail {
using namespace loom::attention::ulysses::detail;

//! The digest of a hybrid plan: the grid, the ring sharding and every group's Ulysses plan.
inline std::uint64_t digest_of(const plan& hp) {
  comm::hasher h;
  h.add(hp.dims().ulysses, hp.dims().ring, attention::detail::digest_of(hp.ring_plan()));
  for (int g = 0; g < hp.dims().ring; ++g) h.add(ulysses::detail::digest_of(hp.group(g)));
  return h.value();
}

//! The agreement of a hybrid call over the whole grid, before any data moves: `local()` checks
//! this rank's arguments and returns its problem; one agreement in the Ulysses group, then one in
//! the ring group carrying the first one's outcome, so every rank of the grid throws the same
//! error (ranks named by their rank in the whole grid) or none does.
template <class T, class Acc, class C, class Local>
problem agree_grid(groups<C>& gc, const plan& hp, const options& opt, std::string_view call, Local&& local) {
  const int label = gc.ring.rank() * hp.dims().ulysses + gc.ulysses.rank();
  const std::uint64_t digest = digest_of(hp);
  problem pb{};
  std::exception_ptr first;
  try {
    pb = agree_on<T, Acc>(gc.ulysses, digest, opt, call, local, label);
  } catch (const comm::agreement_error&) {
    first = std::current_exception();
  }
  comm::agree(
      gc.ring, call,
      [&] {
        if (first) std::rethrow_exception(first);
        return attention_signature<T, Acc>(digest, pb, opt);
      },
      label);
  return pb;
}

template <class C>
int group_of(const groups<C>& gc, const plan& hp, std::string_view call) {
  const grid g = hp.dims();
  LOOM_EXPECTS(gc.ulysses.size() == g.ulysses && gc.ring.size() == g.ring, errc::invalid_argument, call,
               ": the groups have sizes U = ", gc.ulysses.size(), ", R = ", gc.ring.size(), " but the plan's grid is ",
               g.ulysses, " x ", g.ring, " (make them with hybrid::split)");
  return gc.ring.rank();
}
}  // namespace detail

//! Hybrid forward with a caller-given workspace (hp.workspace_bytes<T>() bytes).
//! @throws loom::error as ulysses::forward and ring::forward, and for groups not of the grid.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, groups<C>& gc, const plan& hp, Q q, K k, V v, O out, L lse, const options& opt,
             std::span<std::byte> workspace) {
  using namespace detail;
  constexpr std::string_view call = "hybrid::forward";
  using T = typename Q::value_type;
  using Acc = accum_t<T>;
  const ulysses::plan* group = nullptr;
  arena a{};
  const problem pb = agree_grid<T, Acc>(gc, hp, opt, call, [&] {
    group = &hp.group(group_of(gc, hp, call));
    const problem p = check_views(q, k, v, out, lse, opt, call);
    check_plan(gc.ulysses, *group, p, call);
    a = workspace_arena(workspace, group->template workspace_bytes<T>(), call);
    return p;
  });
  const ulysses::plan& up = *group;
  const int u = gc.ulysses.rank();
  const fwd_buffers<T> f = carve_forward<T>(a, up, u);
  const auto& hs = up.heads();
  const auto& tk = up.tokens();
  const index_t tt = tk.total_tokens(), hq = hs.q_count(u), hkv = hs.kv_count(u);
  const std::array<rows_desc<const T>, 3> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true)};
  const std::array<full_desc<T>, 3> dst{{{f.q, pb.dk, false}, {f.k, pb.dk, true}, {f.v, pb.dv, true}}};
  to_heads<C, T>(gc.ulysses, tk, hs, src, dst, f.send, f.recv, f.counts);
  for (const auto& sg : segments_of(hs, u)) {
    const index_t q0 = sg.q0 - hs.q_begin(u), k0 = sg.kv0 - hs.kv_begin(u);
    ring::forward(b, gc.ring, ring::pass_kv{}, hp.ring_plan(),
                  tensor_view<const T, 3>(heads_view(f.q, tt, hq, pb.dk, q0, sg.nq)),
                  tensor_view<const T, 3>(heads_view(f.k, tt, hkv, pb.dk, k0, sg.nkv)),
                  tensor_view<const T, 3>(heads_view(f.v, tt, hkv, pb.dv, k0, sg.nkv)),
                  heads_view(f.out, tt, hq, pb.dv, q0, sg.nq), heads_view2(f.lse, tt, hq, q0, sg.nq), opt);
  }
  const std::array<full_desc<const T>, 1> os{{{f.out, pb.dv, false}}};
  const std::array<rows_desc<T>, 1> od{rows_desc_of(out, false)};
  from_heads<Acc, C, T, T>(gc.ulysses, tk, hs, os, od, f.osend, f.orecv, nullptr, f.counts);
  const std::array<full_desc<const Acc>, 1> ls{{{f.lse, 1, false}}};
  const std::array<rows_desc<Acc>, 1> ld{rows_desc_of(lse, false)};
  from_heads<Acc, C, Acc, Acc>(gc.ulysses, tk, hs, ls, ld, f.lsend, f.lrecv, nullptr, f.counts);
}

//! Hybrid backward (ring pass-KV backward inside); dq, dk, dv of one type G are overwritten.
//! Workspace: hp.workspace_bytes<T, G>().
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, groups<C>& gc, const plan& hp, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              const options& opt, std::span<std::byte> workspace) {
  using namespace detail;
  constexpr std::string_view call = "hybrid::backward";
  using T = typename Q::value_type;
  using G = typename DQ::value_type;
  using Acc = accum_t<T>;
  static_assert(std::is_same_v<typename DO::value_type, T>, "hybrid attention: dout must have q's storage type");
  const ulysses::plan* group = nullptr;
  arena a{};
  const problem pb = agree_grid<T, Acc>(gc, hp, opt, call, [&] {
    group = &hp.group(group_of(gc, hp, call));
    const problem p = check_views(q, k, v, out, lse, opt, call);
    check_gradients(p, dout, dq, dk, dv, call);
    check_plan(gc.ulysses, *group, p, call);
    a = workspace_arena(workspace, group->template workspace_bytes<T, G>(), call);
    return p;
  });
  const ulysses::plan& up = *group;
  const int u = gc.ulysses.rank();
  const bwd_buffers<T, G> f = carve_backward<T, G>(a, up, u);
  const auto& hs = up.heads();
  const auto& tk = up.tokens();
  const index_t tt = tk.total_tokens(), hq = hs.q_count(u), hkv = hs.kv_count(u);
  const std::array<rows_desc<const T>, 5> src{rows_desc_of(q, false), rows_desc_of(k, true), rows_desc_of(v, true),
                                              rows_desc_of(out, false), rows_desc_of(dout, false)};
  const std::array<full_desc<T>, 5> dst{
      {{f.q, pb.dk, false}, {f.k, pb.dk, true}, {f.v, pb.dv, true}, {f.out, pb.dv, false}, {f.dout, pb.dv, false}}};
  to_heads<C, T>(gc.ulysses, tk, hs, src, dst, f.send, f.recv, f.counts);
  const std::array<rows_desc<const Acc>, 1> lsrc{rows_desc_of(lse, false)};
  const std::array<full_desc<Acc>, 1> ldst{{{f.lse, 1, false}}};
  to_heads<C, Acc>(gc.ulysses, tk, hs, lsrc, ldst, f.lsend, f.lrecv, f.counts);
  for (const auto& sg : segments_of(hs, u)) {
    const index_t q0 = sg.q0 - hs.q_begin(u), k0 = sg.kv0 - hs.kv_begin(u);
    ring::backward(b, gc.ring, ring::pass_kv{}, hp.ring_plan(),
                   tensor_view<const T, 3>(heads_view(f.q, tt, hq, pb.dk, q0, sg.nq)),
                   tensor_view<const T, 3>(heads_view(f.k, tt, hkv, pb.dk, k0, sg.nkv)),
                   tensor_view<const T, 3>(heads_view(f.v, tt, hkv, pb.dv, k0, sg.nkv)),
                   tensor_view<const T, 3>(heads_view(f.out, tt, hq, pb.dv, q0, sg.nq)),
                   tensor_view<const Acc, 2>(heads_view2(f.lse, tt, hq, q0, sg.nq)),
                   tensor_view<const T, 3>(heads_view(f.dout, tt, hq, pb.dv, q0, sg.nq)),
                   heads_view(f.dq, tt, hq, pb.dk, q0, sg.nq), heads_view(f.dk, tt, hkv, pb.dk, k0, sg.nkv),
                   heads_view(f.dv, tt, hkv, pb.dv, k0, sg.nkv), opt);
  }
  const std::array<full_desc<const G>, 3> gs{{{f.dq, pb.dk, false}, {f.dk, pb.dk, true}, {f.dv, pb.dv, true}}};
  const std::array<rows_desc<G>, 3> gd{rows_desc_of(dq, false), rows_desc_of(dk, true), rows_desc_of(dv, true)};
  from_heads<Acc, C, G, G>(gc.ulysses, tk, hs, gs, gd, f.gsend, f.grecv, f.acc, f.counts);
}

//! Convenience forms: split the communicator and allocate the workspace for this call.
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, const plan& hp, Q q, K k, V v, O out, L lse, const options& opt = {}) {
  auto gc = split(comm, hp);
  std::vector<std::max_align_t> ws(hp.workspace_bytes<typename Q::value_type>() / sizeof(std::max_align_t) + 1);
  forward(b, gc, hp, q, k, v, out, lse, opt, std::as_writable_bytes(std::span(ws)));
}
template <backend B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, const plan& hp, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              const options& opt = {}) {
  auto gc = split(comm, hp);
  std::vector<std::max_align_t> ws(
      hp.workspace_bytes<typename Q::value_type, typename DQ::value_type>() / sizeof(std::max_align_t) + 1);
  backward(b, gc, hp, q, k, v, out, lse, dout, dq, dk, dv, opt, std::as_writable_bytes(std::span(ws)));
}

}  // namespace loom::attention::hybrid
