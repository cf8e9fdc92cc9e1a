#pragma once

//! @file
//! LASP-2 internals: the local run on a slice, the state exchange (one all_gather, or the same
//! volume posted as isend / irecv), the rank-ordered folds and the corrections of the first / last
//! document of the slice by the incoming state / incoming state gradient.

#include <loom/comm/communicator.hpp>
#include <loom/core/workspace.hpp>
#include <loom/linear_attention/detail/driver.hpp>
#include <loom/linear_attention/detail/slice.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string_view>
#include <vector>

namespace loom::linear_attention::detail {

//! Per head (a, M), and one reset flag, in one message of H (1 + dk dv) + 1 values; issued as one
//! all_gather or posted. Works in buffers carved from the caller's workspace: the message, the
//! receive buffer of every rank's message and (posted) 2 (P - 1) request slots, in which the
//! requests are constructed by post() and destroyed by finish() or the destructor. A rank's element
//! is the map X -> a X + M of its slice; reset = 1 when a document starts inside the slice: the map
//! is then the constant M, and fold() selects M instead of forming 0 X + M (0 * NaN is NaN: a
//! non-finite state of one document would reach the next).
template <class C, class A>
class state_exchange {
 public:
  using request = typename C::request;
  state_exchange(index_t heads, index_t sz, int ranks, bool posted, A* send, A* recv, void* reqs)
      : heads_(heads),
        sz_(sz),
        m_(static_cast<std::size_t>(heads * (1 + sz) + 1)),
        ranks_(ranks),
        posted_(posted),
        send_(send),
        recv_(recv),
        reqs_(static_cast<request*>(reqs)) {}
  state_exchange(const state_exchange&) = delete;
  state_exchange& operator=(const state_exchange&) = delete;
  ~state_exchange() { destroy(); }
  //! The message, zeroed: a [H], M [H, dk, dv], reset.
  void clear() { std::fill(send_, send_ + m_, A(0)); }
  A* a() { return send_; }
  A* m(index_t heads) { return send_ + heads; }
  void set_reset(bool r) { send_[m_ - 1] = r ? A(1) : A(0); }
  //! x [H, dk, dv] <- rank q's element applied to x: M_q when q resets, else a_q x + M_q.
  void fold(int q, A* x) const {
    const A* blk = recv_ + m_ * static_cast<std::size_t>(q);
    const bool reset = blk[m_ - 1] != A(0);
    for (index_t h = 0; h < heads_; ++h) {
      const A* mq = blk + heads_ + h * sz_;
      A* xh = x + h * sz_;
      if (reset)
        for (index_t e = 0; e < sz_; ++e) xh[e] = mq[e];
      else
        for (index_t e = 0; e < sz_; ++e) xh[e] = decay_add(blk[h], xh[e], mq[e]);
    }
  }
  void post(C& comm) {
    if (!posted_) return;
    const int me = comm.rank();
    std::copy(send_, send_ + m_, recv_ + m_ * static_cast<std::size_t>(me));
    for (int q = 0; q < ranks_; ++q) {
      if (q == me) continue;
      new (reqs_ + n_) request(comm.isend(std::span<const A>(send_, m_), q, tag));
      ++n_;
      new (reqs_ + n_) request(comm.irecv(std::span<A>(recv_ + m_ * static_cast<std::size_t>(q), m_), q, tag));
      ++n_;
    }
  }
  //! Completes the exchange; fold() then reads rank q's message.
  void finish(C& comm) {
    if (posted_) {
      comm::wait_all(comm, std::span<request>(reqs_, n_));
      destroy();
    } else {
      comm.all_gather(std::span<const A>(send_, m_), std::span<A>(recv_, m_ * static_cast<std::size_t>(ranks_)));
    }
  }

 private:
  void destroy() noexcept {
    for (std::size_t i = 0; i < n_; ++i) reqs_[i].~request();
    n_ = 0;
  }
  static constexpr int tag = 7301;
  index_t heads_ = 0, sz_ = 0;
  std::size_t m_ = 0;
  int ranks_ = 1;
  bool posted_ = false;
  A *send_, *recv_;
  request* reqs_;
  std::size_t n_ = 0;
};

template <class T, std::size_t R>
tensor_view<T, R, host_memory> view_of(std::remove_const_t<T>* v, std::array<index_t, R> e) {
  return tensor_view<T, R, host_memory>(v, e);
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

//! Byte offsets of one pass's buffers in a LASP-2 workspace (loom::workspace_layout): local initial
//! / final states and their gradients [segments, H, dk, dv], the incoming state and adjoint
//! [H, dk, dv], the fused schedule's scratch, the exchange's message, receive buffer and request
//! slots, and the slice plan's workspace.
namespace blk {
//! The Accum blocks of a LASP-2 workspace, in layout order.
enum : int { init_loc, fin_loc, xin, dfin_loc, dinit_loc, y, mid, start, tail, lg, cum, send, recv, count };
}  // namespace blk
struct lasp2_layout {
  std::array<std::size_t, blk::count> at{}, size{};  //!< byte offsets and element counts of the Accum blocks
  std::size_t reqs = 0, kernels = 0, kernel_bytes = 0, bytes = 0;
};

//! What a LASP-2 plan derives from the shapes, the documents and the slice (built once, in
//! make_plan; lasp2::plan is its public face).
template <class P>
struct lasp2_core {
  using A = typename P::accum_type;
  int rank = 0, ranks = 1;
  index_t begin = 0, tokens = 0, heads = 0, dk = 0, dv = 0, sz = 0, docs = 0;
  bool posted_exchange = false;
  std::size_t request_bytes = 0;  //!< sizeof the requests of the communicator given to make_plan
  std::vector<index_t> cu;
  slice_info s;
  plan<P> pl;
  lasp2_layout fwd, bwd;

  lasp2_layout make_layout(bool backward) const {
    workspace_layout l;
    lasp2_layout w;
    const index_t states = s.segments() * heads * sz, one = heads * sz;
    const index_t n = ranks > 1 && pl.docs() > 0 ? plan_access::table(pl).doc_chunk[1] * heads : 0;
    const index_t msg = heads * (1 + sz) + 1;
    const bool fwd_scratch = !backward && ranks > 1;
    const index_t sizes[blk::count] = {states,
                                       states,
                                       one,
                                       backward ? states : 0,
                                       backward ? states : 0,
                                       backward ? one : 0,
                                       fwd_scratch ? one : 0,
                                       fwd_scratch ? one : 0,
                                       fwd_scratch ? one : 0,
                                       backward ? 0 : n,
                                       backward ? 0 : n,
                                       msg,
                                       msg * ranks};
    for (int i = 0; i < blk::count; ++i) {
      w.at[static_cast<std::size_t>(i)] = l.add<A>(sizes[i]);
      w.size[static_cast<std::size_t>(i)] = static_cast<std::size_t>(sizes[i]);
    }
    w.reqs = l.add<std::byte>(
        posted_exchange ? static_cast<index_t>(request_bytes) * 2 * static_cast<index_t>(ranks - 1) : 0);
    w.kernel_bytes = backward ? pl.backward_workspace_bytes() : pl.forward_workspace_bytes();
    w.kernels = l.add<std::byte>(static_cast<index_t>(w.kernel_bytes));
    w.bytes = l.bytes();
    return w;
  }

  //! Checks that a call matches what the plan was made for (on this rank only).
  template <class C, class Ops>
  void check_use(const C& comm, const Ops& x, std::string_view call) const {
    LOOM_EXPECTS(comm.size() == ranks && comm.rank() == rank, errc::invalid_argument, call, ": plan: made for rank ",
                 rank, " of ", ranks, ", used on rank ", comm.rank(), " of ", comm.size());
    LOOM_EXPECTS(!posted_exchange || sizeof(typename C::request) <= request_bytes, errc::invalid_argument, call,
                 ": plan: made for a communicator whose requests take ", request_bytes, " bytes, used with one of ",
                 sizeof(typename C::request));
    expect_extents(x.q, {tokens, heads, dk}, call, "q (the plan's [slice tokens, heads, dk])");
    expect_extents(x.k, {tokens, heads, dk}, call, "k (the plan's [slice tokens, heads, dk])");
    expect_extents(x.v, {tokens, heads, dv}, call, "v (the plan's [slice tokens, heads, dv])");
    if (present(x.initial_state))
      expect_extents(x.initial_state, {docs, heads, dk, dv}, call, "initial_state (the plan's [docs, heads, dk, dv])");
  }
};

//! One call's buffers, carved from the caller's workspace at the pass's layout.
template <class A>
struct lasp2_buffers {
  std::array<std::span<A>, blk::count> at;
  void* reqs = nullptr;
  incoming_scratch<A> inc;
  std::span<std::byte> kernels;
  A* operator[](int i) const noexcept { return at[static_cast<std::size_t>(i)].data(); }
};

template <class P>
lasp2_buffers<typename P::accum_type> carve_lasp2(const lasp2_core<P>& c, std::span<std::byte> ws, bool backward,
                                                  std::string_view call) {
  using A = typename P::accum_type;
  const lasp2_layout& l = backward ? c.bwd : c.fwd;
  check_workspace(ws, l.bytes, call);
  const workspace_carver k(ws);
  lasp2_buffers<A> b;
  for (std::size_t i = 0; i < b.at.size(); ++i) b.at[i] = std::span<A>(k.at<A>(l.at[i]), l.size[i]);
  b.reqs = k.at<std::byte>(l.reqs);
  b.inc = {b.at[blk::mid], b.at[blk::start], b.at[blk::tail], b.at[blk::lg], b.at[blk::cum]};
  b.kernels = ws.subspan(l.kernels, l.kernel_bytes);
  return b;
}

//! Every check of one forward call on this rank (local: no communication).
template <class P, class C, class Gating>
void check_forward_call(const C& comm, const lasp2_core<P>& w, const Gating& gating, const operands<P, host_memory>& x,
                        tensor_view<typename P::storage_type, 3, host_memory> o,
                        tensor_view<typename P::accum_type, 4, host_memory> fin,
                        tensor_view<typename P::accum_type, 3, host_memory> incoming, std::string_view call) {
  w.check_use(comm, x, call);
  (void)check_gating<typename P::accum_type, host_memory>(gating, w.tokens, w.heads);
  expect_extents(o, {w.tokens, w.heads, w.dv}, call, "o (the plan's [slice tokens, heads, dv])");
  check_state_out(fin, w.docs, w.heads, w.dk, w.dv, "final_state");
  if (present(incoming)) expect_extents(incoming, {w.heads, w.dk, w.dv}, call, "incoming_state");
}

template <class P, class C, class B, class Gating>
void lasp2_forward_impl(C& comm, const B& b, const lasp2_core<P>& w, const Gating& gating,
                        const operands<P, host_memory>& x, tensor_view<typename P::storage_type, 3, host_memory> o,
                        tensor_view<typename P::accum_type, 4, host_memory> fin,
                        tensor_view<typename P::accum_type, 3, host_memory> incoming, std::span<std::byte> ws) {
  using A = typename P::accum_type;
  constexpr std::string_view call = "lasp2::forward";
  check_forward_call(comm, w, gating, x, o, fin, incoming, call);
  auto buf = carve_lasp2(w, ws, false, call);
  const gate_ref<A> gate = check_gating<A, host_memory>(gating, w.tokens, w.heads);
  const auto& s = w.s;
  const auto& cu = w.cu;
  const index_t H = w.heads, sz = w.sz, segs = s.segments();
  const A* init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  A* init_loc = buf[blk::init_loc];
  A* fin_loc = buf[blk::fin_loc];
  A* xin = buf[blk::xin];
  std::fill(fin_loc, fin_loc + segs * H * sz, A(0));
  std::fill(xin, xin + H * sz, A(0));
  for (index_t g = 0; g < segs; ++g)
    for (index_t h = 0; h < H; ++h) {
      const index_t d = s.seg_doc[static_cast<std::size_t>(g)];
      const bool zero = !init || d < 0 || (g == 0 && s.continues_left);
      copy_state(zero ? nullptr : init + (d * H + h) * sz, init_loc + (g * H + h) * sz, sz);
    }
  operands<P, host_memory> xl{x.q, x.k, x.v, view_of<const A, 4>(init_loc, {segs, H, w.dk, w.dv})};
  bool with_x = false;  // the final state of segment 0 includes X
  if (comm.size() == 1) {
    // One rank: nothing enters the slice and nothing needs exchanging; the plain forward (fused
    // when the plan says so, without a chunk-state buffer).
    run_forward(b, w.pl, gating, xl, o, view_of<A, 4>(fin_loc, {segs, H, w.dk, w.dv}), buf.kernels);
  } else {
    state_exchange<C, A> ex(H, sz, w.ranks, w.posted_exchange, buf[blk::send], buf[blk::recv], buf.reqs);
    ex.clear();
    const bool reset = !(s.continues_left && segs == 1) && w.tokens > 0;
    // Only later ranks fold this rank's element; the last rank's is never read (it sends a = 1,
    // M = 0 and skips computing its end state before the exchange).
    const incoming_roles roles{s.continues_left, comm.rank() + 1 < comm.size()};
    with_x = run_forward_incoming(
        b, w.pl, gating, xl, o, view_of<A, 4>(fin_loc, {segs, H, w.dk, w.dv}), buf.kernels, ex.m(H), roles, buf.inc,
        [&] {
          for (index_t h = 0; h < H; ++h)
            ex.a()[h] = !roles.publish ? A(1) : reset ? A(0) : exp_acc(log_gate_sum(gate, 0, w.tokens, h));
          ex.set_reset(roles.publish && reset);
          ex.post(comm);
        },
        [&]() -> const A* {
          ex.finish(comm);
          // X = fold over the ranks before this one, in rank order.
          for (int q = 0; q < comm.rank(); ++q) ex.fold(q, xin);
          return s.continues_left ? static_cast<const A*>(xin) : nullptr;
        });
  }
  if (present(incoming)) std::copy(xin, xin + H * sz, incoming.data());
  if (s.continues_left && !with_x) {
    const index_t n0 = s.local_cu[1];
    for (index_t h = 0; h < H; ++h) {
      const A decay = exp_acc(log_gate_sum(gate, 0, n0, h));
      A* f0 = fin_loc + h * sz;
      const A* X = xin + h * sz;
      for (index_t e = 0; e < sz; ++e) f0[e] += decay * X[e];
    }
  }
  if (!present(fin)) return;
  for (index_t g = 0; g < segs; ++g) {
    const index_t d = s.seg_doc[static_cast<std::size_t>(g)];
    if (d >= 0 && s.begin + s.local_cu[static_cast<std::size_t>(g) + 1] == cu[static_cast<std::size_t>(d) + 1])
      std::copy_n(fin_loc + g * H * sz, H * sz, fin.data() + d * H * sz);
  }
  for (index_t d : s.owned_final)
    if (cu[static_cast<std::size_t>(d)] == cu[static_cast<std::size_t>(d) + 1])
      for (index_t h = 0; h < H; ++h)
        copy_state(init ? init + (d * H + h) * sz : nullptr, fin.data() + (d * H + h) * sz, sz);
}

}  // namespace loom::linear_attention::detail

#include <loom/linear_attention/detail/lasp2_backward.hpp>
