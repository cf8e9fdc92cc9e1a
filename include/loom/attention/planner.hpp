#pragma once

//! @file
//! Automatic choice of the sequence parallel strategy for one attention layer: ring pass-KV,
//! ring pass-Q, all-gather-KV, Ulysses, or hybrid Ulysses x ring (U x R = P), from the shapes
//! and a machine model. The choice comes with every candidate's modelled time and the rule that
//! decided, printable with explain().
//!
//! Model (per rank, per layer forward; e = bytes per element, F = FLOP/s, BW = link bytes/s):
//!   compute      W = 2 (Dqk + Dv) Hq pairs / P / F, pairs = T (T + 1) / 2 + T C when causal
//!                (T new tokens, C cached), T (T + C) when full; Ulysses multiplies W by its head
//!                imbalance ceil(Hq / U) U / Hq.
//!   ring pass-KV P - 1 steps, each moving (T + C) / P Hkv (Dqk + Dv) e bytes and overlapped with a
//!                step of compute W / P: time W + (P - 1) max(0, comm_step - W / P).
//!   ring pass-Q  steps move T / P Hq Dqk e (Q) overlapped likewise, plus one all-to-all of the
//!                partial outputs, (P - 1) / P T / P Hq (Dv e + 4) bytes, not overlapped.
//!   all-gather   (P - 1) (T + C) / P Hkv (Dqk + Dv) e bytes before the compute (not overlapped).
//!   Ulysses      needs U <= Hq; the all-to-alls of ulysses.hpp (q, k, v in, out and lse back),
//!                not overlapped.
//!   hybrid U x R Ulysses inside groups of U consecutive ranks on (T + C) / R tokens, ring pass-KV
//!                over R groups on ceil(Hkv / U) kv heads.
//! Links: a collective among ranks of one node (machine.node_ranks consecutive ranks) runs at
//! node_bandwidth, otherwise at link_bandwidth.
//! Rules:
//!   1. With cached tokens (partial prefill, decode): Meta's criterion (Yang et al., "Context
//!      Parallelism for Scalable Million-Token Inference", eqs. 1-3): pass-KV when its transfer
//!      hides behind compute, T >= P F Hkv e / (2 Hq BW), or when K/V are the smaller message,
//!      T / (T + C) > 2 Hkv / Hq; otherwise pass-Q.
//!   2. Without a cache (training, full prefill): the smallest modelled time among ring pass-KV,
//!      all-gather, Ulysses (P <= Hq: DeepSpeed-Ulysses' degree limit by heads) and every hybrid
//!      split U x R with 1 < U < P, U | P, U <= Hq; ties go to the earlier in that order.
//!
//! The runnable form, loom::sequence_parallel, plans the pick and runs it:
//!
//!   sequence_parallel::options o{.attention = opts, .machine = m};
//!   auto sp = loom::sequence_parallel::make_plan<loom::fp32>(b, comm, documents, {Hq, Hkv, Dqk, Dv}, o);
//!   sp.choice().explain();                   what was picked, and why
//!   sp.scatter(r, global, row, local);       which rows rank r holds (depends on the pick)
//!   loom::workspace_buffer ws(sp.workspace_bytes());
//!   loom::sequence_parallel::forward(b, comm, sp, q, k, v, out, lse, ws.span());
//!   loom::sequence_parallel::backward(b, comm, sp, q, k, v, out, lse, dout, dq, dk, dv, ws.span());
//!
//! make_plan agrees once over comm on the documents, shape and options (so every rank makes the
//! same pick, even from a machine model measured per rank), then makes the concrete plan of the
//! pick (ring::make_plan, ulysses::make_plan or hybrid::make_plan, each with its own agreement).
//! Calls run the concrete plan's forward / backward: no agreement, no allocation.

#include <loom/attention/hybrid.hpp>
#include <loom/attention/local.hpp>
#include <loom/attention/ring.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/copy.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/shard/plan.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace loom::attention::planner {

//! One layer's shapes.
struct workload {
  index_t new_tokens = 0;     //!< T: tokens whose queries are computed (the whole sequence in training)
  index_t cached_tokens = 0;  //!< C: keys/values already cached (0 for training and full prefill)
  index_t heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
  int ranks = 1;             //!< P
  double element_bytes = 2;  //!< e: bf16 by default
  bool causal = true;
};

//! The machine: FLOP rate of one rank's attention kernel and link bandwidths (bytes/s, per rank).
struct machine {
  double flops = 0;           //!< F
  double link_bandwidth = 0;  //!< BW between nodes (or the only link)
  int node_ranks = 1;         //!< ranks that share the faster link
  double node_bandwidth = 0;  //!< bandwidth inside a node (0: link_bandwidth)
};

enum class strategy { ring_pass_kv, ring_pass_q, all_gather_kv, ulysses, hybrid };

inline const char* to_string(strategy s) {
  constexpr const char* names[] = {"ring pass_kv", "ring pass_q", "all_gather_kv", "ulysses", "hybrid"};
  return names[static_cast<int>(s)];
}

//! A modelled candidate.
struct candidate {
  strategy kind = strategy::ring_pass_kv;
  int ulysses = 1, ring = 1;  //!< grid (U, R); ring variants: (1, P), Ulysses: (P, 1)
  double seconds = 0, compute_seconds = 0, exposed_comm_seconds = 0;
  double bytes_per_rank = 0;  //!< bytes one rank sends
  bool feasible = true;
  std::string note;
};

//! The planner's answer.
struct choice {
  candidate best;
  std::vector<candidate> candidates;
  std::string rule;  //!< the rule that decided (file comment)
  //! A printable explanation: the rule and every candidate's modelled time.
  [[nodiscard]] std::string explain() const {
    std::string s = std::string("chose ") + to_string(best.kind);
    char buf[256];
    if (best.kind == strategy::hybrid) {
      std::snprintf(buf, sizeof buf, " %d x %d", best.ulysses, best.ring);
      s += buf;
    }
    s += ": " + rule + "\n";
    for (const auto& c : candidates) {
      std::snprintf(buf, sizeof buf,
                    "  %-14s U=%-3d R=%-3d %s %10.4g s (compute %.4g s, exposed comm %.4g s, %.4g MB sent)%s%s\n",
                    to_string(c.kind), c.ulysses, c.ring, c.feasible ? "  " : "no", c.seconds, c.compute_seconds,
                    c.exposed_comm_seconds, c.bytes_per_rank * 1e-6, c.note.empty() ? "" : " ", c.note.c_str());
      s += buf;
    }
    return s;
  }
};

namespace detail {

inline candidate make(strategy k, int u, int r) {
  candidate c;
  c.kind = k;
  c.ulysses = u;
  c.ring = r;
  return c;
}

inline double pairs(const workload& w) {
  const double t = static_cast<double>(w.new_tokens), c = static_cast<double>(w.cached_tokens);
  return w.causal ? t * (t + 1) / 2 + t * c : t * (t + c);
}

inline double bw(const machine& m, bool inside_node) {
  return inside_node && m.node_bandwidth > 0 ? m.node_bandwidth : m.link_bandwidth;
}

// Ulysses on U ranks over n tokens (bytes one rank sends, forward): q, k, v to the other U - 1
// ranks' heads, out and lse back.
inline double ulysses_bytes(const workload& w, int u, double n) {
  const double hq = static_cast<double>(w.heads_q), dk = static_cast<double>(w.dim_qk),
               dv = static_cast<double>(w.dim_v);
  const double kv_heads_sent = std::max(static_cast<double>(w.heads_kv), static_cast<double>(u));  // replication
  const double f = static_cast<double>(u - 1) / (static_cast<double>(u) * u);
  return f * n * (hq * dk + kv_heads_sent * (dk + dv) + hq * dv) * w.element_bytes + f * n * hq * 4;
}

inline candidate ring_kv(const workload& w, const machine& m, double compute, int r, double kv_heads, bool node) {
  candidate c = make(strategy::ring_pass_kv, 1, r);
  const double n = static_cast<double>(w.new_tokens + w.cached_tokens) / r;
  const double step = n * kv_heads * static_cast<double>(w.dim_qk + w.dim_v) * w.element_bytes;
  c.compute_seconds = compute;
  c.exposed_comm_seconds = (r - 1) * std::max(0.0, step / bw(m, node) - compute / r);
  c.bytes_per_rank = (r - 1) * step;
  c.seconds = c.compute_seconds + c.exposed_comm_seconds;
  return c;
}

}  // namespace detail

//! Picks the strategy for w on m. @throws loom::error(invalid_argument) for non-positive shapes,
//! heads_q not a multiple of heads_kv, or a machine without FLOP rate or bandwidth.
inline choice choose(const workload& w, const machine& m) {
  constexpr const char* call = "planner::choose";
  LOOM_EXPECTS(w.new_tokens >= 1 && w.cached_tokens >= 0 && w.ranks >= 1, errc::invalid_argument, call,
               ": new_tokens and ranks must be >= 1 and cached_tokens >= 0, got ", w.new_tokens, ", ", w.ranks, ", ",
               w.cached_tokens);
  LOOM_EXPECTS(w.heads_q >= 1 && w.heads_kv >= 1 && w.heads_q % w.heads_kv == 0, errc::invalid_argument, call,
               ": heads_q (", w.heads_q, ") must be a positive multiple of heads_kv (", w.heads_kv, ")");
  LOOM_EXPECTS(w.dim_qk >= 1 && w.dim_v >= 1 && w.element_bytes > 0, errc::invalid_argument, call,
               ": dims and element_bytes must be positive");
  LOOM_EXPECTS(m.flops > 0 && m.link_bandwidth > 0, errc::invalid_argument, call,
               ": the machine needs flops > 0 and link_bandwidth > 0, got ", m.flops, ", ", m.link_bandwidth);
  const int p = w.ranks;
  const double hq = static_cast<double>(w.heads_q), hkv = static_cast<double>(w.heads_kv);
  const double dk = static_cast<double>(w.dim_qk), dv = static_cast<double>(w.dim_v);
  const double t = static_cast<double>(w.new_tokens), cache = static_cast<double>(w.cached_tokens);
  const double compute = 2 * (dk + dv) * hq * detail::pairs(w) / p / m.flops;
  const bool whole_node = p <= m.node_ranks;
  choice out;
  auto& cs = out.candidates;
  cs.push_back(detail::ring_kv(w, m, compute, p, hkv, whole_node));
  {  // pass-Q
    candidate c = detail::make(strategy::ring_pass_q, 1, p);
    const double step = t / p * hq * dk * w.element_bytes;
    const double a2a = static_cast<double>(p - 1) / p * (t / p) * hq * (dv * w.element_bytes + 4);
    c.compute_seconds = compute;
    c.exposed_comm_seconds =
        (p - 1) * std::max(0.0, step / detail::bw(m, whole_node) - compute / p) + a2a / detail::bw(m, whole_node);
    c.bytes_per_rank = (p - 1) * step + a2a;
    c.seconds = c.compute_seconds + c.exposed_comm_seconds;
    cs.push_back(c);
  }
  {
    candidate c = detail::make(strategy::all_gather_kv, 1, p);
    c.bytes_per_rank = (p - 1) * (t + cache) / p * hkv * (dk + dv) * w.element_bytes;
    c.compute_seconds = compute;
    c.exposed_comm_seconds = c.bytes_per_rank / detail::bw(m, whole_node);
    c.seconds = c.compute_seconds + c.exposed_comm_seconds;
    cs.push_back(c);
  }
  auto imbalance = [&](int u) { return std::ceil(hq / u) * u / hq; };
  {
    candidate c = detail::make(strategy::ulysses, p, 1);
    c.feasible = p <= w.heads_q && w.cached_tokens == 0;
    if (p > w.heads_q) c.note = "P > heads_q (Ulysses' degree limit)";
    if (w.cached_tokens > 0) c.note = "cached tokens: not modelled for Ulysses";
    c.compute_seconds = compute * imbalance(p);
    c.bytes_per_rank = detail::ulysses_bytes(w, p, t);
    c.exposed_comm_seconds = c.bytes_per_rank / detail::bw(m, whole_node);
    c.seconds = c.compute_seconds + c.exposed_comm_seconds;
    cs.push_back(c);
  }
  for (int u = 2; u < p; ++u) {
    if (p % u != 0) continue;
    const int r = p / u;
    candidate c = detail::make(strategy::hybrid, u, r);
    c.feasible = u <= w.heads_q && w.cached_tokens == 0;
    if (u > w.heads_q) c.note = "U > heads_q";
    const double ub = detail::ulysses_bytes(w, u, t / r);
    const candidate ring = detail::ring_kv(w, m, compute * imbalance(u), r, std::ceil(hkv / u), false);
    c.compute_seconds = compute * imbalance(u);
    c.bytes_per_rank = ub + ring.bytes_per_rank;
    c.exposed_comm_seconds = ub / detail::bw(m, u <= m.node_ranks) + ring.exposed_comm_seconds;
    c.seconds = c.compute_seconds + c.exposed_comm_seconds;
    cs.push_back(c);
  }
  if (w.cached_tokens > 0) {
    const double miss = t / (t + cache), threshold = 2 * hkv / hq;
    const double overlap_t = p * m.flops * hkv * w.element_bytes / (2 * hq * detail::bw(m, whole_node));
    char buf[320];
    if (t >= overlap_t || miss > threshold) {
      out.best = cs[0];
      std::snprintf(buf, sizeof buf,
                    "rule 1 (Meta CP): cached tokens; pass-KV because %s (T = %.0f, overlap needs T >= %.0f; miss rate "
                    "%.3g, K/V smaller above %.3g)",
                    t >= overlap_t ? "its transfer hides behind compute" : "K/V are the smaller message", t, overlap_t,
                    miss, threshold);
    } else {
      out.best = cs[1];
      std::snprintf(buf, sizeof buf,
                    "rule 1 (Meta CP): cached tokens; pass-Q because pass-KV would not overlap (T = %.0f < %.0f) and Q "
                    "is the smaller message (miss rate %.3g <= %.3g)",
                    t, overlap_t, miss, threshold);
    }
    out.rule = buf;
    return out;
  }
  const candidate* best = nullptr;
  for (const auto& c : cs)
    if (c.feasible && c.kind != strategy::ring_pass_q && (!best || c.seconds < best->seconds)) best = &c;
  out.best = *best;
  out.rule = "rule 2: no cache; the smallest modelled time (pass-Q, made for a large cache, is listed only)";
  return out;
}

//! Measures a machine model on this communicator (collective): the FLOP rate of the local kernel
//! on backend b (fp32, 1024 tokens, 4 heads, dim 64, full) and the bandwidth of one ring step of
//! `bytes` bytes to the next rank; the slowest rank's figures, on every rank. node_ranks = P.
template <backend B, comm::communicator C>
machine measure(const B& b, C& comm, std::size_t bytes = std::size_t{1} << 22) {
  const index_t n = 1024, h = 4, d = 64;
  std::vector<float> x(static_cast<std::size_t>(n * h * d), 0.5f), o(x.size()), l(static_cast<std::size_t>(n * h));
  const tensor_view<const float, 3> xv(x.data(), {n, h, d});
  options opt;
  opt.causal = false;
  auto t0 = std::chrono::steady_clock::now();
  attention::forward(b, loom::segments<>::whole(n), xv, xv, xv, tensor_view<float, 3>(o.data(), {n, h, d}),
                     tensor_view<float, 2>(l.data(), {n, h}), opt);
  const double fsec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<float> s(bytes / sizeof(float)), r(s.size());
  const int p = comm.size(), me = comm.rank();
  comm.barrier();
  t0 = std::chrono::steady_clock::now();
  if (p > 1) comm.sendrecv(std::span<const float>(s), (me + 1) % p, std::span<float>(r), (me + p - 1) % p, 0);
  const double csec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::array<double, 2> worst{fsec, csec};
  comm.all_reduce(std::span<const double>(worst), std::span<double>(worst), comm::reduce_op::max);
  machine m;
  m.flops = 4.0 * d * h * static_cast<double>(n) * n / std::max(worst[0], 1e-9);
  m.link_bandwidth = static_cast<double>(s.size() * sizeof(float)) / std::max(worst[1], 1e-9);
  m.node_ranks = p;
  return m;
}

}  // namespace loom::attention::planner

namespace loom::sequence_parallel {

using strategy = attention::planner::strategy;

//! How make_plan shards the sequence: over the P ranks for the ring variants and Ulysses, over
//! the R ring ranks for the hybrid (each ring shard then split contiguously over U ranks).
enum class sharding { contiguous, zigzag, per_document };

//! Options of sequence_parallel::make_plan.
struct options {
  attention::options attention{};         //!< masks and scale of the attention
  attention::planner::machine machine{};  //!< the machine model (planner::measure measures one)
  sharding layout = sharding::per_document;
  std::optional<strategy> only{};  //!< run this strategy instead of the model's pick
  int ulysses = 0;                 //!< with only = hybrid: U (0: the model's best U)
};

namespace detail {

inline shard::plan shard_of(const loom::segments<>& documents, int ranks, sharding s) {
  switch (s) {
    case sharding::contiguous:
      return shard::make_plan(documents, ranks, shard::contiguous{});
    case sharding::zigzag:
      return shard::make_plan(documents, ranks, shard::zigzag{});
    default:
      return shard::make_plan(documents, ranks, shard::per_document{});
  }
}

}  // namespace detail

//! How make_plan makes the concrete plan of its pick, i.e. which local step the strategies run:
//! loom's own attention kernel. ring_cudnn.cuh's make_plan(b, comm, cudnn::fused{}, ...) runs the
//! pick through cuDNN's fused attention instead. A steps type has const members
//!   ring<P>(b, comm, variant, sharding, shape, opts)      (pass_kv, pass_q, all_gather_kv)
//!   ulysses<P>(b, comm, sharding, shape, opts)
//!   hybrid<P>(b, comm, ring_sharding, shape, opts)
//! each returning the concrete plan that ring::, ulysses:: or hybrid::forward / backward take.
struct loom_kernel {
  template <precision_policy P, class B, comm::communicator C, class V>
  auto ring(const B& b, C& comm, V v, const shard::plan& sh, const attention::head_shape& s,
            const attention::options& o) const {
    return attention::ring::make_plan<P>(b, comm, v, sh, s, o);
  }
  template <precision_policy P, class B, comm::communicator C>
  auto ulysses(const B& b, C& comm, const shard::plan& sh, const attention::head_shape& s,
               const attention::options& o) const {
    return attention::ulysses::make_plan<P>(b, comm, sh, s, o);
  }
  template <precision_policy P, class B, comm::communicator C>
  auto hybrid(const B& b, C& comm, const shard::plan& sh, const attention::head_shape& s,
              const attention::options& o) const {
    return attention::hybrid::make_plan<P>(b, comm, sh, s, o);
  }
};

template <class B, class C, precision_policy P, class Steps>
class plan;

namespace detail {
//! The concrete plan types of a steps type (see loom_kernel).
template <class Steps, precision_policy P, class B, class C, class V>
using ring_plan_of = decltype(std::declval<const Steps&>().template ring<P>(
    std::declval<const B&>(), std::declval<C&>(), V{}, std::declval<const shard::plan&>(),
    std::declval<const attention::head_shape&>(), std::declval<const attention::options&>()));
template <class Steps, precision_policy P, class B, class C>
using ulysses_plan_of = decltype(std::declval<const Steps&>().template ulysses<P>(
    std::declval<const B&>(), std::declval<C&>(), std::declval<const shard::plan&>(),
    std::declval<const attention::head_shape&>(), std::declval<const attention::options&>()));
template <class Steps, precision_policy P, class B, class C>
using hybrid_plan_of = decltype(std::declval<const Steps&>().template hybrid<P>(
    std::declval<const B&>(), std::declval<C&>(), std::declval<const shard::plan&>(),
    std::declval<const attention::head_shape&>(), std::declval<const attention::options&>()));

//! The body of every make_plan: the agreement, the pick, the concrete plan made by `steps`.
template <precision_policy P, class B, comm::communicator C, class Steps>
plan<B, C, P, Steps> make_plan_with(const B& b, C& comm, const Steps& steps, const loom::segments<>& documents,
                                    const attention::head_shape& s, const options& opt, std::string_view call);
}  // namespace detail

//! Picks a strategy for this layer with the planner's cost model (or options.only) and plans it
//! on this rank. documents: the whole sequence's documents (the same on every rank); s: heads and
//! dims. Collective over comm.
//! @throws loom::error(invalid_argument) on every rank: the planner's errors (shape, machine), a
//! forced strategy that is not feasible, the concrete make_plan's errors, ranks disagreeing.
template <precision_policy P = fp32, class B, comm::communicator C>
plan<B, C, P, loom_kernel> make_plan(const B& b, C& comm, const loom::segments<>& documents,
                                     const attention::head_shape& s, const options& opt = {}) {
  return detail::make_plan_with<P>(b, comm, loom_kernel{}, documents, s, opt, "sequence_parallel::make_plan");
}

//! The plan of the strategy make_plan picked, on one rank: its choice (inspect it with
//! choice().explain()), the layout of the rows every rank holds and the concrete plan. Immutable;
//! readable from several threads (calls: as the concrete plan allows). Steps: how the concrete plan
//! was made (loom_kernel: loom's attention kernel).
template <class B, class C, precision_policy P = fp32, class Steps = loom_kernel>
class plan {
 public:
  //! An empty plan (make one with make_plan).
  plan() = default;
  using steps_type = Steps;
  using ring_kv_plan = detail::ring_plan_of<Steps, P, B, C, attention::ring::pass_kv>;
  using ring_q_plan = detail::ring_plan_of<Steps, P, B, C, attention::ring::pass_q>;
  using ring_ag_plan = detail::ring_plan_of<Steps, P, B, C, attention::ring::all_gather_kv>;
  using ulysses_plan = detail::ulysses_plan_of<Steps, P, B, C>;
  using hybrid_plan = detail::hybrid_plan_of<Steps, P, B, C>;
  //! The concrete plan of the pick: index 1 + static_cast<int>(strategy) (never monostate once
  //! made).
  using concrete_plan =
      std::variant<std::monostate, ring_kv_plan, ring_q_plan, ring_ag_plan, ulysses_plan, hybrid_plan>;

  //! What was picked, every candidate and the rule that decided.
  [[nodiscard]] const attention::planner::choice& choice() const noexcept { return s_->choice; }
  [[nodiscard]] strategy kind() const noexcept { return s_->choice.best.kind; }
  [[nodiscard]] int ranks() const noexcept { return s_->ranks; }
  [[nodiscard]] int rank() const noexcept { return s_->me; }
  [[nodiscard]] const concrete_plan& concrete() const noexcept { return s_->plan; }
  //! The sharding over P ranks (ring, Ulysses) or over the R ring ranks (hybrid).
  [[nodiscard]] const shard::plan& sharding() const noexcept { return s_->sharding; }
  //! Workspace of forward and backward on this rank.
  [[nodiscard]] std::size_t workspace_bytes() const {
    return std::visit(
        [](const auto& p) -> std::size_t {
          if constexpr (requires { p.backward_workspace_bytes(); })
            return std::max(p.workspace_bytes(), p.backward_workspace_bytes());
          else if constexpr (requires { p.workspace_bytes(); })
            return p.workspace_bytes();
          else
            return 0;
        },
        s_->plan);
  }
  //! Rows rank r holds.
  [[nodiscard]] index_t tokens(int r) const {
    if (const auto* h = std::get_if<hybrid_plan>(&s_->plan)) return h->tokens(r);
    return s_->sharding.rank(r).tokens;
  }
  //! Copies rank r's rows (rows of `row` elements) out of a global array, and back.
  template <class T>
  void scatter(int r, std::span<const T> global, index_t row, std::span<T> local) const {
    if (const auto* h = std::get_if<hybrid_plan>(&s_->plan))
      h->scatter(r, global, row, local);
    else
      s_->sharding.scatter(r, global, row, local);
  }
  template <class T>
  void gather(int r, std::span<const T> local, index_t row, std::span<T> global) const {
    if (const auto* h = std::get_if<hybrid_plan>(&s_->plan))
      h->gather(r, local, row, global);
    else
      s_->sharding.gather(r, local, row, global);
  }

 private:
  struct state {
    attention::planner::choice choice;
    shard::plan sharding;
    concrete_plan plan;
    int ranks = 1, me = 0;
  };
  explicit plan(std::shared_ptr<const state> s) : s_(std::move(s)) {}
  std::shared_ptr<const state> s_;

  template <precision_policy Q, class B2, comm::communicator C2, class S2>
  friend plan<B2, C2, Q, S2> detail::make_plan_with(const B2&, C2&, const S2&, const loom::segments<>&,
                                                    const attention::head_shape&, const options&, std::string_view);
};

template <precision_policy P, class B, comm::communicator C, class Steps>
plan<B, C, P, Steps> detail::make_plan_with(const B& b, C& comm, const Steps& steps, const loom::segments<>& documents,
                                            const attention::head_shape& s, const options& opt, std::string_view call) {
  using T = typename P::storage_type;
  using Acc = typename P::accum_type;
  namespace lp = attention::planner;
  using state = typename plan<B, C, P, Steps>::state;
  auto st = std::make_shared<state>();
  st->ranks = comm.size();
  st->me = comm.rank();
  comm::agree(comm, call, [&] {
    const shard::plan whole = shard::make_plan(documents, 1, shard::contiguous{});
    lp::workload w{
        whole.total_tokens(), 0, s.heads_q, s.heads_kv, s.dim_qk, s.dim_v, comm.size(), static_cast<double>(sizeof(T)),
        opt.attention.causal};
    st->choice = lp::choose(w, opt.machine);
    if (opt.only) {
      const lp::candidate* best = nullptr;
      for (const auto& c : st->choice.candidates)
        if (c.kind == *opt.only && c.feasible && (opt.ulysses == 0 || c.ulysses == opt.ulysses) &&
            (!best || c.seconds < best->seconds))
          best = &c;
      LOOM_EXPECTS(best != nullptr, errc::invalid_argument, call, ": options.only = ", lp::to_string(*opt.only),
                   opt.ulysses > 0 ? " with the requested U" : "", " is not feasible for this layer on ", comm.size(),
                   " ranks");
      st->choice.best = *best;
      st->choice.rule = std::string("options.only: ") + lp::to_string(*opt.only);
    }
    const auto& m = opt.machine;
    const auto& best = st->choice.best;
    return attention::detail::attention_signature<T, Acc>(
        comm::hasher{}
            .add(attention::detail::digest_of(whole), static_cast<int>(opt.layout), best.kind, best.ulysses, best.ring)
            .add(m.flops, m.link_bandwidth, m.node_ranks, m.node_bandwidth)
            .value(),
        s, opt.attention);
  });
  // The concrete plan, made in place on the plan's own sharding.
  const auto& best = st->choice.best;
  st->sharding = detail::shard_of(documents, best.kind == strategy::hybrid ? best.ring : comm.size(), opt.layout);
  const shard::plan& sh = st->sharding;
  namespace ring = attention::ring;
  const attention::options& ao = opt.attention;
  switch (best.kind) {
    case strategy::ring_pass_kv:
      st->plan.template emplace<1>(steps.template ring<P>(b, comm, ring::pass_kv{}, sh, s, ao));
      break;
    case strategy::ring_pass_q:
      st->plan.template emplace<2>(steps.template ring<P>(b, comm, ring::pass_q{}, sh, s, ao));
      break;
    case strategy::all_gather_kv:
      st->plan.template emplace<3>(steps.template ring<P>(b, comm, ring::all_gather_kv{}, sh, s, ao));
      break;
    case strategy::ulysses:
      st->plan.template emplace<4>(steps.template ulysses<P>(b, comm, sh, s, ao));
      break;
    case strategy::hybrid:
      st->plan.template emplace<5>(steps.template hybrid<P>(b, comm, sh, s, ao));
      break;
  }
  return plan<B, C, P, Steps>(std::move(st));
}

//! The same from documents in the backend's memory: read once here (a copy and a fence of b),
//! checked like host offsets, then planned as above (the shard plans are host objects).
template <precision_policy P = fp32, class B, comm::communicator C, memory_space Space>
requires(!std::is_same_v<Space, host_memory>) plan<B, C, P, loom_kernel> make_plan(
    const B& b, C& comm, const loom::segments<Space>& documents, const attention::head_shape& s,
    const options& opt = {}) {
  return loom::detail::with_host_segments(
      b, documents, [&](const loom::segments<>& h) { return sequence_parallel::make_plan<P>(b, comm, h, s, opt); });
}

//! Runs the picked strategy's forward on its plan: allocates nothing. Views: this rank's rows
//! (plan.tokens(rank)), shapes as ulysses.hpp; workspace: plan.workspace_bytes().
//! @throws loom::error on this rank only, as the concrete forward.
template <class B, class C, precision_policy P, class Steps, comm::communicator C0, class Q, class K, class V, class O,
          class L>
void forward(const B& b, C0& comm, const plan<B, C, P, Steps>& sp, Q q, K k, V v, O out, L lse,
             std::span<std::byte> workspace) {
  std::visit(
      [&](const auto& p) {
        using Plan = std::remove_cvref_t<decltype(p)>;
        if constexpr (std::is_same_v<Plan, std::monostate>)
          LOOM_FAIL(errc::invalid_argument, "sequence_parallel::forward: the plan was not made by make_plan");
        else if constexpr (std::is_same_v<Plan, typename plan<B, C, P, Steps>::ulysses_plan>)
          attention::ulysses::forward(b, comm, p, q, k, v, out, lse, workspace);
        else if constexpr (std::is_same_v<Plan, typename plan<B, C, P, Steps>::hybrid_plan>)
          attention::hybrid::forward(b, comm, p, q, k, v, out, lse, workspace);
        else
          attention::ring::forward(b, comm, p, q, k, v, out, lse, workspace);
      },
      sp.concrete());
}

//! Runs the picked strategy's backward on its plan (as forward).
template <class B, class C, precision_policy P, class Steps, comm::communicator C0, class Q, class K, class V, class O,
          class L, class DO, class DQ, class DK, class DV>
void backward(const B& b, C0& comm, const plan<B, C, P, Steps>& sp, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, std::span<std::byte> workspace) {
  std::visit(
      [&](const auto& p) {
        using Plan = std::remove_cvref_t<decltype(p)>;
        if constexpr (std::is_same_v<Plan, std::monostate>)
          LOOM_FAIL(errc::invalid_argument, "sequence_parallel::backward: the plan was not made by make_plan");
        else if constexpr (std::is_same_v<Plan, typename plan<B, C, P, Steps>::ulysses_plan>)
          attention::ulysses::backward(b, comm, p, q, k, v, out, lse, dout, dq, dk, dv, workspace);
        else if constexpr (std::is_same_v<Plan, typename plan<B, C, P, Steps>::hybrid_plan>)
          attention::hybrid::backward(b, comm, p, q, k, v, out, lse, dout, dq, dk, dv, workspace);
        else
          attention::ring::backward(b, comm, p, q, k, v, out, lse, dout, dq, dk, dv, workspace);
      },
      sp.concrete());
}

}  // namespace loom::sequence_parallel
