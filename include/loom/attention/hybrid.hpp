#pragma once

//! @file
//! Hybrid Ulysses x ring sequence parallel attention (USP): P = U x R ranks on a 2-D grid. Rank r
//! is Ulysses rank u = r mod U of Ulysses group g = r / U (consecutive ranks, the fast links) and
//! ring rank g of ring group u (stride U). The sequence is sharded over the R ring ranks by a
//! shard::plan (contiguous, zigzag or per_document: the causal balance of the ring); ring shard g
//! is split contiguously over the U ranks of Ulysses group g. Forward: the Ulysses pipeline of
//! ulysses.hpp inside the group (one all_to_allv turns q, k, v into head shards over the ring
//! shard, Hq / U heads, uneven allowed, kv heads replicated), with ring pass-KV across the R groups
//! as its inner attention, then one all_to_allv returns out and lse. The backward mirrors it.
//!
//!   auto hp = hybrid::make_plan<loom::fp32>(b, comm, ring_sharding, {Hq, Hkv, Dqk, Dv}, opts);
//!   hp.scatter(r, global, row, local) / hp.gather(...)         which rows rank r holds
//!   loom::workspace_buffer ws(hp.workspace_bytes());
//!   hybrid::forward(b, comm, hp, q, k, v, out, lse, ws.span());   allocates nothing
//!   hybrid::backward(b, comm, hp, q, k, v, out, lse, dout, dq, dk, dv, ws.span());
//!   hybrid::forward(b, comm, ring_sharding, q, k, v, out, lse, opts);   convenience
//!
//! The grid: R = ring_sharding.ranks(), U = comm.size() / R (R must divide the size; U <= Hq).
//! make_plan runs one agreement over comm (sharding, shape, options, precision), splits comm into
//! the Ulysses group and the ring group (two comm.split calls; the plan holds both), and makes the
//! ring pass-KV plan of each of this rank's head segments over the ring group (ring::make_plan,
//! one agreement each, at most three). Calls run no agreement. The plan is this rank's; it is
//! immutable and may be read from several threads, but calls with one plan must not run at the
//! same time (they share the plan's group communicators). Per call the views are checked on this
//! rank only: a mismatch is a loom::error there, and the other ranks get the communicator's
//! timeout error. Precision as ulysses.hpp (P, loom::fp32 by default).
//!
//! Shapes per rank r: as ulysses.hpp with n_r = hp.tokens(r).
//! Communication per rank (sum of the parts, see hp.bytes_sent): the Ulysses formulas of
//! ulysses.hpp inside the group (T replaced by the ring shard's n_g tokens), plus ring pass-KV on
//! hkv_u kv heads: forward Σ_{s=0}^{R-2} n_{g-s} hkv_u (Dqk + Dv) b; backward that again plus
//! T hkv_u (Dqk + Dv) A (the travelling dK/dV accumulators). Memory as ulysses.hpp: host memory over
//! a host communicator, device memory over a stream-ordered one (both groups are splits of comm).

#include <loom/attention/detail/ring_fused.hpp>  // the inner ring on a fused engine (ring_cudnn.cuh)
#include <loom/attention/ring.hpp>
#include <loom/attention/ulysses.hpp>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::attention::hybrid {

//! The 2-D grid: U ranks per Ulysses group, R ring groups' length.
struct grid {
  int ulysses = 1, ring = 1;
};

namespace detail {
using namespace loom::attention::ulysses::detail;

//! The ring pass-KV plan of a head segment over the ring group.
template <class B, class P>
using ring_plan_t = ring::plan<ring::pass_kv, B, P>;

//! Rows [a, b) of ring shard g held by Ulysses rank u of U: a contiguous split.
inline index_t split_begin(index_t n, int u, int U) { return n * u / U; }

//! Refuses, naming the first rank, a grid where some Ulysses rank's query heads are not one GQA
//! block (fused_heads_problem): an inner ring that reads dense head shards needs it.
inline void require_dense_heads(const head_shape& s, int ulysses, std::string_view call) {
  const attention::detail::head_split h{s.heads_q, s.heads_kv, ulysses};
  for (int u = 0; u < ulysses; ++u) {
    const std::string why = fused_heads_problem(h, u);
    LOOM_EXPECTS(why.empty(), errc::unsupported, call, ": the inner ring needs dense head shards: Ulysses ", why);
  }
}

//! The contiguous sharding of a ring shard of n rows over U ranks.
inline shard::plan group_sharding(index_t n, int U) {
  const std::array<index_t, 2> one{0, n};
  return shard::make_plan(std::span<const index_t>(one), U, shard::contiguous{});
}
}  // namespace detail

template <class B, class C, precision_policy P, class Inner>
class plan;

namespace detail {
struct hybrid_maker;
}

//! Plans hybrid attention on this rank: the ring sharding over R ring ranks (the same on every
//! rank), heads and dims `s`, masks and scale `opt`. Collective over comm (see the file comment).
//! @throws loom::error(invalid_argument) on every rank: R not dividing comm.size(), U > heads_q,
//! the shape and option errors of ulysses::make_plan, ranks disagreeing.
template <precision_policy P = fp32, class B, comm::communicator C>
plan<B, C, P, detail::ring_plan_t<B, P>> make_plan(const B& b, C& comm, const shard::plan& ring_sharding,
                                                   const head_shape& s, const options& opt = {});

//! A hybrid plan of one rank (file comment). Make it with hybrid::make_plan. Inner: the plan type
//! of the inner ring (loom's kernel by default; ring_cudnn.cuh's make_plan gives a ring over cuDNN).
template <class B, class C, precision_policy P = fp32, class Inner = detail::ring_plan_t<B, P>>
class plan : public precision_types<P> {
 public:
  //! An empty plan (make one with make_plan).
  plan() = default;

  [[nodiscard]] int ranks() const noexcept { return s_->g.ulysses * s_->g.ring; }
  //! The rank this plan was made on (in the whole grid).
  [[nodiscard]] int rank() const noexcept { return s_->me; }
  [[nodiscard]] grid dims() const noexcept { return s_->g; }
  [[nodiscard]] const head_shape& shape() const noexcept { return s_->dims; }
  [[nodiscard]] const options& opts() const noexcept { return s_->opt; }
  [[nodiscard]] index_t total_tokens() const noexcept { return s_->ring.total_tokens(); }
  //! The ring sharding over the R ring ranks.
  [[nodiscard]] const shard::plan& ring_plan() const noexcept { return s_->ring; }
  //! Rows held by rank r.
  [[nodiscard]] index_t tokens(int r) const {
    const auto n = s_->ring.rank(r / s_->g.ulysses).tokens;
    const int u = r % s_->g.ulysses;
    return detail::split_begin(n, u + 1, s_->g.ulysses) - detail::split_begin(n, u, s_->g.ulysses);
  }
  //! Workspace of forward and of backward on this rank.
  [[nodiscard]] std::size_t workspace_bytes() const noexcept {
    return std::max(s_->pipe.forward_bytes(), s_->pipe.backward_bytes());
  }

  //! Copies rank r's rows (rows of `row` elements) out of a global array, and back.
  template <class T>
  void scatter(int r, std::span<const T> global, index_t row, std::span<T> local) const {
    check_rows("scatter", r, global.size(), local.size(), row);
    for_runs(r, [&](index_t g, index_t l, index_t len) {
      std::copy_n(global.data() + g * row, len * row, local.data() + l * row);
    });
  }
  template <class T>
  void gather(int r, std::span<const T> local, index_t row, std::span<T> global) const {
    check_rows("gather", r, global.size(), local.size(), row);
    for_runs(r, [&](index_t g, index_t l, index_t len) {
      std::copy_n(local.data() + l * row, len * row, global.data() + g * row);
    });
  }

  //! Bytes rank r sends per call: Ulysses part + ring pass-KV part (file comment). b storage,
  //! a lse / ring accumulators, g gradients.
  [[nodiscard]] ulysses::traffic bytes_sent(int r, std::size_t b, std::size_t a, std::size_t g) const {
    const int uu = s_->g.ulysses, u = r % uu, gr = r / uu, rr = s_->g.ring;
    const shard::plan group = detail::group_sharding(s_->ring.rank(gr).tokens, uu);
    const attention::detail::head_split hs{s_->dims.heads_q, s_->dims.heads_kv, uu};
    ulysses::traffic t = detail::exchange_bytes(group, hs, s_->dims, u, b, a, g);
    const auto row = static_cast<std::size_t>(hs.kv_count(u) * (s_->dims.dim_qk + s_->dims.dim_v));
    std::size_t blocks = 0;
    for (int st = 0; st + 1 < rr; ++st)
      blocks += static_cast<std::size_t>(s_->ring.rank(((gr - st) % rr + rr) % rr).tokens);
    t.forward += blocks * row * b;
    t.backward += blocks * row * b + (rr > 1 ? static_cast<std::size_t>(total_tokens()) * row * a : 0);
    return t;
  }

  //! The Ulysses group and the ring group of this rank.
  [[nodiscard]] C& ulysses_comm() const noexcept { return s_->ucomm; }
  [[nodiscard]] C& ring_comm() const noexcept { return s_->rcomm; }
  [[nodiscard]] const attention::detail::head_pipeline<typename P::storage_type, typename P::accum_type>& pipeline()
      const noexcept {
    return s_->pipe;
  }
  [[nodiscard]] const Inner& ring(std::size_t s) const { return s_->inner[s]; }

 private:
  struct state {
    grid g;
    int me = 0;
    head_shape dims;
    options opt;
    shard::plan ring;
    C ucomm, rcomm;
    std::vector<Inner> inner;
    attention::detail::head_pipeline<typename P::storage_type, typename P::accum_type> pipe;
  };
  explicit plan(std::shared_ptr<state> s) : s_(std::move(s)) {}
  std::shared_ptr<state> s_;

  // Rank r's rows are rows [a, b) of ring shard g in its local order: runs of global positions.
  template <class F>
  void for_runs(int r, F&& f) const {
    const int g = r / s_->g.ulysses, u = r % s_->g.ulysses;
    const index_t n = s_->ring.rank(g).tokens;
    const index_t a = detail::split_begin(n, u, s_->g.ulysses), e = detail::split_begin(n, u + 1, s_->g.ulysses);
    for (const auto& pc : s_->ring.rank(g).pieces) {
      const index_t lo = std::max(a, pc.local_begin), hi = std::min(e, pc.local_begin + pc.length);
      if (lo < hi) f(pc.global_begin + lo - pc.local_begin, lo - a, hi - lo);
    }
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

  friend struct detail::hybrid_maker;
};

namespace detail {
//! The body of every hybrid make_plan: the agreement (with `check_grid(grid)` inside it, for what
//! the inner ring needs of the grid), the two groups, the head pipeline, and one inner ring plan
//! per head segment, made by `make_inner(ring_comm, ring_sharding, segment_shape)` (a ring
//! make_plan over the ring group: one agreement there).
struct hybrid_maker {
  template <class Inner, precision_policy P, class B, comm::communicator C, class CheckGrid, class MakeInner>
  static plan<B, C, P, Inner> make(const B& b, C& comm, const shard::plan& ring_sharding, const head_shape& s,
                                   const options& opt, std::string_view call, CheckGrid&& check_grid,
                                   MakeInner&& make_inner);
};
}  // namespace detail

template <class Inner, precision_policy P, class B, comm::communicator C, class CheckGrid, class MakeInner>
plan<B, C, P, Inner> detail::hybrid_maker::make([[maybe_unused]] const B& b, C& comm, const shard::plan& ring_sharding,
                                                const head_shape& s, const options& opt, std::string_view call,
                                                CheckGrid&& check_grid, MakeInner&& make_inner) {
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  static_assert(comm::moves<C, typename backend_traits<B>::memory_space>,
                "hybrid attention: the communicator cannot move buffers of the backend's memory space (a host "
                "communicator needs host-accessible memory; device memory needs a stream-ordered communicator)");
  const int p = comm.size(), me = comm.rank(), rr = ring_sharding.ranks();
  grid g{};
  comm::agree(comm, call, [&] {
    LOOM_EXPECTS(p % rr == 0, errc::invalid_argument, call, ": the ring sharding is for R = ", rr,
                 " ranks, which must divide the communicator's size, ", p);
    g = {p / rr, rr};
    detail::check_shape(s, opt, g.ulysses, call);
    check_grid(g);
    return detail::attention_signature<T, Acc>(
        comm::hasher{}.add(g.ulysses, g.ring, attention::detail::digest_of(ring_sharding)).value(), s, opt);
  });
  // The Ulysses group (consecutive ranks) and the ring group (stride U), kept in the plan.
  using state = typename plan<B, C, P, Inner>::state;
  const int ur = me % g.ulysses;
  auto st =
      std::shared_ptr<state>(new state{g,
                                       me,
                                       s,
                                       opt,
                                       ring_sharding,
                                       comm.split(me / g.ulysses, ur),
                                       comm.split(ur, me / g.ulysses),
                                       {},
                                       attention::detail::head_pipeline<T, Acc>(
                                           detail::group_sharding(ring_sharding.rank(me / g.ulysses).tokens, g.ulysses),
                                           {s.heads_q, s.heads_kv, g.ulysses}, ur, s.dim_qk, s.dim_v)});
  // One ring pass-KV plan per head segment, over the ring group, on the plan's own sharding.
  std::size_t fwd = 0, bwd = 0;
  for (std::size_t i = 0; i < st->pipe.segments().size(); ++i) {
    const auto sh = st->pipe.segment(i);
    st->inner.push_back(make_inner(st->rcomm, st->ring, head_shape{sh.heads_q, sh.heads_kv, sh.dim_qk, sh.dim_v}));
    fwd = std::max(fwd, st->inner.back().workspace_bytes());
    bwd = std::max(bwd, st->inner.back().backward_workspace_bytes());
  }
  st->pipe.reserve_inner(fwd, bwd);
  return plan<B, C, P, Inner>(std::move(st));
}

template <precision_policy P, class B, comm::communicator C>
plan<B, C, P, detail::ring_plan_t<B, P>> make_plan(const B& b, C& comm, const shard::plan& ring_sharding,
                                                   const head_shape& s, const options& opt) {
  return detail::hybrid_maker::make<detail::ring_plan_t<B, P>, P>(
      b, comm, ring_sharding, s, opt, "hybrid::make_plan", [](const grid&) {},
      [&](C& ring_comm, const shard::plan& sp, const head_shape& hs) {
        return ring::make_plan<P>(b, ring_comm, sp, hs, opt);
      });
}

//! Hybrid forward on a plan: allocates nothing; `workspace` as ulysses::forward. `comm` is the
//! communicator the plan was made on (checked: rank and size); the data moves over the plan's
//! groups.
//! @throws loom::error on this rank only, as ulysses::forward.
template <class B, class C, precision_policy P, class Inner, comm::communicator C0, class Q, class K, class V, class O,
          class L>
void forward(const B& b, C0& comm, const plan<B, C, P, Inner>& hp, Q q, K k, V v, O out, L lse,
             std::span<std::byte> workspace) {
  constexpr std::string_view call = "hybrid::forward";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  detail::check_comm(comm, hp.ranks(), hp.rank(), call);
  detail::check_views<T, Acc>(hp.shape(), hp.tokens(hp.rank()), q, k, v, out, lse, call);
  check_workspace(workspace, hp.workspace_bytes(), call);
  hp.pipeline().forward(
      b, hp.ulysses_comm(), q, k, v, out, lse, workspace,
      [&](std::size_t s, const auto&, auto qs, auto ks, auto vs, auto os, auto ls, std::span<std::byte> ws) {
        ring::forward(b, hp.ring_comm(), hp.ring(s), qs, ks, vs, os, ls, ws);
      });
}

//! Hybrid backward on a plan (ring pass-KV backward inside); dq, dk, dv are overwritten.
template <class B, class C, precision_policy P, class Inner, comm::communicator C0, class Q, class K, class V, class O,
          class L, class DO, class DQ, class DK, class DV>
void backward(const B& b, C0& comm, const plan<B, C, P, Inner>& hp, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, std::span<std::byte> workspace) {
  constexpr std::string_view call = "hybrid::backward";
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  detail::check_comm(comm, hp.ranks(), hp.rank(), call);
  const index_t n = hp.tokens(hp.rank());
  detail::check_views<T, Acc>(hp.shape(), n, q, k, v, out, lse, call);
  detail::check_rank_gradients<T, false>(hp.shape(), n, dout, dq, dk, dv, call);
  check_workspace(workspace, hp.workspace_bytes(), call);
  hp.pipeline().backward(b, hp.ulysses_comm(), q, k, v, out, lse, dout, dq, dk, dv, workspace,
                         [&](std::size_t s, const auto&, auto qs, auto ks, auto vs, auto os, auto ls, auto ds, auto dqs,
                             auto dks, auto dvs, std::span<std::byte> ws) {
                           ring::backward(b, hp.ring_comm(), hp.ring(s), qs, ks, vs, os, ls, ds, dqs, dks, dvs, ws);
                         });
}

//! Convenience forms: make_plan (precision deduced from q), a temporary workspace, the plan form,
//! fence.
template <class B, comm::communicator C, class Q, class K, class V, class O, class L>
void forward(const B& b, C& comm, const shard::plan& ring_sharding, Q q, K k, V v, O out, L lse,
             const options& opt = {}) {
  const auto hp = make_plan<default_precision<typename Q::value_type>>(
      b, comm, ring_sharding, {q.extent(1), k.extent(1), q.extent(2), v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(b, hp.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, comm, hp, q, k, v, out, lse, ws); });
}
template <class B, comm::communicator C, class Q, class K, class V, class O, class L, class DO, class DQ, class DK,
          class DV>
void backward(const B& b, C& comm, const shard::plan& ring_sharding, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, const options& opt = {}) {
  const auto hp = make_plan<default_precision<typename Q::value_type>>(
      b, comm, ring_sharding, {q.extent(1), k.extent(1), q.extent(2), v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(b, hp.workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, comm, hp, q, k, v, out, lse, dout, dq, dk, dv, ws);
  });
}

}  // namespace loom::attention::hybrid
