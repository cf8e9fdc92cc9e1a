#pragma once

//! @file
//! LASP-2 internals: the local run on a slice, the state exchange (one all_gather, or the same
//! volume posted as isend / irecv), the rank-ordered folds and the corrections of the first / last
//! document of the slice by the incoming state / incoming state gradient.

#include <loom/comm/communicator.hpp>
#include <loom/linear_attention/detail/driver.hpp>
#include <loom/linear_attention/detail/slice.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace loom::linear_attention::detail {

//! Per head (a, M), and one reset flag, in one message of H (1 + dk dv) + 1 values; issued as one
//! all_gather or posted. Holds the send / receive buffers and the requests across calls (no
//! communicator kept). A rank's element is the map X -> a X + M of its slice; reset = 1 when a
//! document starts inside the slice: the map is then the constant M, and fold() selects M instead of
//! forming 0 X + M (0 * NaN is NaN: a non-finite state of one document would reach the next).
template <class C, class A>
class state_exchange {
 public:
  state_exchange() = default;
  state_exchange(index_t heads, index_t sz, int ranks, bool posted)
      : heads_(heads), sz_(sz), m_(static_cast<std::size_t>(heads * (1 + sz) + 1)), posted_(posted) {
    send_.assign(m_, A(0));
    recv_.assign(m_ * static_cast<std::size_t>(ranks), A(0));
    if (posted_) reqs_.reserve(2 * static_cast<std::size_t>(ranks - 1));
  }
  //! The message, zeroed: a [H], M [H, dk, dv], reset.
  void clear() { std::fill(send_.begin(), send_.end(), A(0)); }
  A* a() { return send_.data(); }
  A* m(index_t heads) { return send_.data() + heads; }
  void set_reset(bool r) { send_[m_ - 1] = r ? A(1) : A(0); }
  //! x [H, dk, dv] <- rank q's element applied to x: M_q when q resets, else a_q x + M_q.
  void fold(int q, A* x) const {
    const A* blk = recv_.data() + m_ * static_cast<std::size_t>(q);
    const bool reset = blk[m_ - 1] != A(0);
    for (index_t h = 0; h < heads_; ++h) {
      const A* mq = blk + heads_ + h * sz_;
      A* xh = x + h * sz_;
      if (reset)
        for (index_t e = 0; e < sz_; ++e) xh[e] = mq[e];
      else
        for (index_t e = 0; e < sz_; ++e) xh[e] = blk[h] * xh[e] + mq[e];
    }
  }
  void post(C& comm) {
    if (!posted_) return;
    reqs_.clear();
    const int me = comm.rank();
    std::copy(send_.begin(), send_.end(), recv_.begin() + static_cast<std::ptrdiff_t>(m_ * me));
    for (int q = 0; q < comm.size(); ++q) {
      if (q == me) continue;
      reqs_.push_back(comm.isend(std::span<const A>(send_.data(), m_), q, tag));
      reqs_.push_back(comm.irecv(std::span<A>(recv_.data() + m_ * static_cast<std::size_t>(q), m_), q, tag));
    }
  }
  //! Completes the exchange; fold() then reads rank q's message.
  void finish(C& comm) {
    if (posted_) {
      comm::wait_all(comm, std::span<typename C::request>(reqs_));
      reqs_.clear();
    } else {
      comm.all_gather(std::span<const A>(send_.data(), m_), std::span<A>(recv_.data(), recv_.size()));
    }
  }

 private:
  static constexpr int tag = 7301;
  index_t heads_ = 0, sz_ = 0;
  std::size_t m_ = 0;
  bool posted_ = false;
  std::vector<A> send_, recv_;
  std::vector<typename C::request> reqs_;
};

template <class T, std::size_t R>
tensor_view<T, R, host_memory> view_of(std::vector<std::remove_const_t<T>>& v, std::array<index_t, R> e) {
  return tensor_view<T, R, host_memory>(v.data(), e);
}

template <class A>
A log_gate_sum(const gate_ref<A>& gate, index_t from, index_t to, index_t h) {
  A acc = A(0);
  for (index_t t = from; t < to; ++t) acc += gate(t, h);
  return acc;
}

template <class A>
void copy_state(const A* src, A* dst, index_t sz) {
  for (index_t x = 0; x < sz; ++x) dst[x] = src ? src[x] : A(0);
}

//! Everything one rank's LASP-2 calls reuse: the validated shapes, the slice, the plan of the
//! slice, and every per-call buffer (local initial / final states and their gradients, the incoming
//! state and adjoint, the exchange, the fused schedule's scratch, the kernels' workspace). Built
//! once; lasp2_workspace (lasp2.hpp) is its public face.
template <class P, class C>
struct lasp2_work {
  using A = typename P::accum_type;
  int rank = 0, ranks = 1;
  index_t begin = 0, tokens = 0, heads = 0, dk = 0, dv = 0, sz = 0, docs = 0;
  bool backward = false, posted_exchange = false;
  std::vector<index_t> cu;
  slice_info s;
  plan<P> pl;
  std::vector<A> init_loc, fin_loc, xin, dfin_loc, dinit_loc, y;
  incoming_scratch<A> inc;
  state_exchange<C, A> ex;
  std::unique_ptr<std::byte[]> store;
  std::span<std::byte> bytes;  //!< the kernels' workspace, 64-byte aligned, forward and backward alike

  template <class B>
  lasp2_work(int rank_, int ranks_, const B& b, std::span<const index_t> cu_, index_t begin_, index_t tokens_,
             index_t heads_, index_t dk_, index_t dv_, const options& opt, bool posted, bool backward_)
      : rank(rank_),
        ranks(ranks_),
        begin(begin_),
        tokens(tokens_),
        heads(heads_),
        dk(dk_),
        dv(dv_),
        sz(dk_ * dv_),
        backward(backward_),
        posted_exchange(posted) {
    LOOM_EXPECTS(!cu_.empty(), errc::invalid_argument, "cu_seqlens: expected at least 2 offsets (docs + 1), got 0");
    (void)make_chunk_table(cu_, cu_.back(), opt.chunk, "cu_seqlens");
    docs = static_cast<index_t>(cu_.size()) - 1;
    cu.assign(cu_.begin(), cu_.end());
    s = make_slice(cu_, begin, tokens, rank, ranks);
    pl = make_plan<P>(b, s.local_cu, heads, dk, dv, opt);
    const auto states = static_cast<std::size_t>(s.segments() * heads * sz), one = static_cast<std::size_t>(heads * sz);
    init_loc.assign(states, A(0));
    fin_loc.assign(states, A(0));
    xin.assign(one, A(0));
    if (backward) {
      dfin_loc.assign(states, A(0));
      dinit_loc.assign(states, A(0));
      y.assign(one, A(0));
    }
    if (ranks > 1) inc = incoming_scratch<A>(pl);
    ex = state_exchange<C, A>(heads, sz, ranks, posted);
    std::size_t need = pl.forward_workspace_bytes();
    if (backward) need = std::max(need, pl.backward_workspace_bytes());
    store.reset(new std::byte[need + 64]);
    const auto at = (reinterpret_cast<std::uintptr_t>(store.get()) + 63) / 64 * 64;
    bytes = std::span<std::byte>(store.get() + (at - reinterpret_cast<std::uintptr_t>(store.get())), need);
  }

  //! Checks that a call matches what the workspace was built for.
  template <class Ops>
  void check_use(const C& comm, const Ops& x, const char* call) const {
    LOOM_EXPECTS(comm.size() == ranks && comm.rank() == rank, errc::invalid_argument, call,
                 ": workspace: built for rank ", rank, " of ", ranks, ", used on rank ", comm.rank(), " of ",
                 comm.size());
    expect_extents(x.q, {tokens, heads, dk}, "q (the workspace's [slice tokens, heads, dk])");
    expect_extents(x.k, {tokens, heads, dk}, "k (the workspace's [slice tokens, heads, dk])");
    expect_extents(x.v, {tokens, heads, dv}, "v (the workspace's [slice tokens, heads, dv])");
    if (present(x.initial_state))
      expect_extents(x.initial_state, {docs, heads, dk, dv}, "initial_state (the workspace's [docs, heads, dk, dv])");
  }
};

//! Every check of one forward call on this rank, run before the cross-rank agreement; the
//! implementation relies on it.
template <class P, class C, class Gating>
void check_forward_call(const C& comm, const lasp2_work<P, C>& w, const Gating& gating,
                        const operands<P, host_memory>& x, tensor_view<typename P::storage_type, 3, host_memory> o,
                        tensor_view<typename P::accum_type, 4, host_memory> fin,
                        tensor_view<typename P::accum_type, 3, host_memory> incoming) {
  w.check_use(comm, x, "lasp2_forward");
  (void)check_gating<typename P::accum_type, host_memory>(gating, w.tokens, w.heads);
  expect_extents(o, {w.tokens, w.heads, w.dv}, "o (the workspace's [slice tokens, heads, dv])");
  check_state_out(fin, w.docs, w.heads, w.dk, w.dv, "final_state");
  if (present(incoming)) expect_extents(incoming, {w.heads, w.dk, w.dv}, "incoming_state");
}

//! Access to lasp2_workspace's internals for the implementation.
struct lasp2_access {
  template <class W>
  static auto& work(W& w) {
    return w.w_;
  }
};

template <class P, class C, class B, class Gating>
void lasp2_forward_impl(C& comm, const B& b, lasp2_work<P, C>& w, const Gating& gating,
                        const operands<P, host_memory>& x, tensor_view<typename P::storage_type, 3, host_memory> o,
                        tensor_view<typename P::accum_type, 4, host_memory> fin,
                        tensor_view<typename P::accum_type, 3, host_memory> incoming) {
  using A = typename P::accum_type;
  // The arguments were checked by check_forward_call before the agreement (lasp2.hpp).
  const gate_ref<A> gate = check_gating<A, host_memory>(gating, w.tokens, w.heads);
  const auto& s = w.s;
  const auto& cu = w.cu;
  const index_t H = w.heads, sz = w.sz, segs = s.segments();
  const A* init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  auto& init_loc = w.init_loc;
  auto& fin_loc = w.fin_loc;
  auto& xin = w.xin;
  std::fill(fin_loc.begin(), fin_loc.end(), A(0));
  std::fill(xin.begin(), xin.end(), A(0));
  for (index_t g = 0; g < segs; ++g)
    for (index_t h = 0; h < H; ++h) {
      const index_t d = s.seg_doc[static_cast<std::size_t>(g)];
      const bool zero = !init || d < 0 || (g == 0 && s.continues_left);
      copy_state(zero ? nullptr : init + (d * H + h) * sz, init_loc.data() + (g * H + h) * sz, sz);
    }
  operands<P, host_memory> xl{x.q, x.k, x.v, view_of<const A, 4>(init_loc, {segs, H, w.dk, w.dv})};
  bool with_x = false;  // the final state of segment 0 includes X
  if (comm.size() == 1) {
    // One rank: nothing enters the slice and nothing needs exchanging; the plain forward (fused
    // when the plan says so, without a chunk-state buffer).
    run_forward(b, w.pl, gating, xl, o, view_of<A, 4>(fin_loc, {segs, H, w.dk, w.dv}), w.bytes);
  } else {
    auto& ex = w.ex;
    ex.clear();
    const bool reset = !(s.continues_left && segs == 1) && w.tokens > 0;
    // Only later ranks fold this rank's element; the last rank's is never read (it sends a = 1,
    // M = 0 and skips computing its end state before the exchange).
    const incoming_roles roles{s.continues_left, comm.rank() + 1 < comm.size()};
    with_x = run_forward_incoming(
        b, w.pl, gating, xl, o, view_of<A, 4>(fin_loc, {segs, H, w.dk, w.dv}), w.bytes, ex.m(H), roles, w.inc,
        [&] {
          for (index_t h = 0; h < H; ++h)
            ex.a()[h] = !roles.publish ? A(1) : reset ? A(0) : exp_acc(log_gate_sum(gate, 0, w.tokens, h));
          ex.set_reset(roles.publish && reset);
          ex.post(comm);
        },
        [&]() -> const A* {
          ex.finish(comm);
          // X = fold over the ranks before this one, in rank order.
          for (int q = 0; q < comm.rank(); ++q) ex.fold(q, xin.data());
          return s.continues_left ? static_cast<const A*>(xin.data()) : nullptr;
        });
  }
  if (present(incoming)) std::copy(xin.begin(), xin.end(), incoming.data());
  if (s.continues_left && !with_x) {
    const index_t n0 = s.local_cu[1];
    for (index_t h = 0; h < H; ++h) {
      const A decay = exp_acc(log_gate_sum(gate, 0, n0, h));
      A* f0 = fin_loc.data() + h * sz;
      const A* X = xin.data() + h * sz;
      for (index_t e = 0; e < sz; ++e) f0[e] += decay * X[e];
    }
  }
  if (!present(fin)) return;
  for (index_t g = 0; g < segs; ++g) {
    const index_t d = s.seg_doc[static_cast<std::size_t>(g)];
    if (d >= 0 && s.begin + s.local_cu[static_cast<std::size_t>(g) + 1] == cu[static_cast<std::size_t>(d) + 1])
      std::copy_n(fin_loc.data() + g * H * sz, H * sz, fin.data() + d * H * sz);
  }
  for (index_t d : s.owned_final)
    if (cu[static_cast<std::size_t>(d)] == cu[static_cast<std::size_t>(d) + 1])
      for (index_t h = 0; h < H; ++h)
        copy_state(init ? init + (d * H + h) * sz : nullptr, fin.data() + (d * H + h) * sz, sz);
}

}  // namespace loom::linear_attention::detail

#include <loom/linear_attention/detail/lasp2_backward.hpp>
