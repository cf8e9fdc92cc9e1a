#pragma once

//! @file
//! LASP-2 internals: the local run on a slice, the state exchange (one all_gather, or the same
//! volume posted as isend / irecv), the rank-ordered folds and the corrections of the first / last
//! document of the slice by the incoming state / incoming state gradient.

#include <loom/backend/copy.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>
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
#include <type_traits>
#include <vector>

namespace loom::linear_attention::detail {

//! Log-gates of tokens [from, to) of head h, summed in token order.
template <class A>
LOOM_HD A log_gate_sum(const gate_ref<A>& gate, index_t from, index_t to, index_t h) {
  A acc = A(0);
  for (index_t t = from; t < to; ++t) acc += gate(t, h);
  return acc;
}

//! Moves of whole states ([H, dk, dv] blocks of `block` values) between a call's global states and
//! its local ones: move e copies block pairs[2e] of src (zeros when that is -1 or src is null)
//! into block pairs[2e + 1] of dst. One item per value.
template <class A>
struct move_states_kernel {
  const index_t* pairs;
  const A* src;
  A* dst;
  index_t block;
  LOOM_HD void operator()(index_t i) const {
    const index_t e = i / block, x = i % block, from = pairs[2 * e], to = pairs[2 * e + 1];
    dst[to * block + x] = src && from >= 0 ? src[from * block + x] : A(0);
  }
};

//! The exchanged element's scalars: a[h] (exp of the log-gates of tokens [0, tokens) when `gates`,
//! else `constant`) for h < H, and the reset flag (item H). Leaves M alone.
template <class A>
struct message_kernel {
  gate_ref<A> gate;
  A* msg;
  index_t heads, sz, tokens;
  bool gates;
  A constant, reset;
  LOOM_HD void operator()(index_t h) const {
    if (h == heads)
      msg[heads * (1 + sz)] = reset;
    else
      msg[h] = gates ? exp_acc(log_gate_sum(gate, 0, tokens, h)) : constant;
  }
};

//! x[i] (i over [H, dk, dv]) <- the elements of ranks [first, last) applied to 0, in rank order
//! (ascending) or reversed (descending): M_q where q resets (selected, never 0 * x), else
//! a_q x + M_q. recv holds every rank's message of m values.
template <class A>
struct fold_kernel {
  const A* recv;
  A* x;
  index_t heads, sz, m;
  int first, last;
  bool descending;
  LOOM_HD void operator()(index_t i) const {
    const index_t h = i / sz;
    A v = A(0);
    for (int k = 0; k < last - first; ++k) {
      const A* blk = recv + m * (descending ? last - 1 - k : first + k);
      v = blk[m - 1] != A(0) ? blk[heads + i] : decay_add(blk[h], v, blk[heads + i]);
    }
    x[i] = v;
  }
};

//! out[h] = exp(the log-gates of tokens [from, to) of head h).
template <class A>
struct head_decay_kernel {
  gate_ref<A> gate;
  A* out;
  index_t from, to;
  LOOM_HD void operator()(index_t h) const { out[h] = exp_acc(log_gate_sum(gate, from, to, h)); }
};

//! y[i] += f[i / sz] x[i] over [H, dk, dv].
template <class A>
struct add_scaled_kernel {
  A* y;
  const A* x;
  const A* f;
  index_t sz;
  LOOM_HD void operator()(index_t i) const { y[i] += f[i / sz] * x[i]; }
};

//! Per head h, the last document's correction by the adjoint Y entering the slice from the right,
//! for tokens [lb, tokens) from the last backwards: D_t += exp(sum of log-gates in (t, end)) Y, so
//! dk_t, dv_t, d log g_t (scalar gates: from the last segment's end state fin) change, and, when the
//! document starts in this slice, its d S0 (dinit) gets exp(all its log-gates) Y.
template <class S, class A, class Space, bool gated>
struct incoming_adjoint_kernel {
  tensor_view<const S, 3, Space> k, v;
  tensor_view<S, 3, Space> dk, dv;
  tensor_view<A, 2, Space> dlg;
  gate_ref<A> gate;
  const A *y, *fin;
  A* dinit;
  index_t tokens, lb, heads, wk, wv;
  bool starts_here;
  LOOM_HD void operator()(index_t h) const {
    const index_t sz = wk * wv;
    const A* Y = y + h * sz;
    A wlog = A(0), accg = A(0);
    if constexpr (gated) {
      const A* sl = fin + h * sz;
      for (index_t e = 0; e < sz; ++e) accg += sl[e] * Y[e];
    }
    for (index_t t = tokens; t-- > lb;) {
      const A w = exp_acc(wlog);
      A kdk = A(0);
      for (index_t d = 0; d < wk; ++d) {
        A add = A(0);
        for (index_t e = 0; e < wv; ++e) add += Y[d * wv + e] * static_cast<A>(v(t, h, e));
        add *= w;
        kdk += static_cast<A>(k(t, h, d)) * add;
        dk(t, h, d) = static_cast<S>(static_cast<A>(dk(t, h, d)) + add);
      }
      for (index_t e = 0; e < wv; ++e) {
        A add = A(0);
        for (index_t d = 0; d < wk; ++d) add += Y[d * wv + e] * static_cast<A>(k(t, h, d));
        dv(t, h, e) = static_cast<S>(static_cast<A>(dv(t, h, e)) + w * add);
      }
      if constexpr (gated) {
        accg -= kdk;
        dlg(t, h) += accg;
      }
      wlog += gate(t, h);
    }
    if (starts_here) {
      const A decay = exp_acc(wlog);
      A* d0 = dinit + h * sz;
      for (index_t e = 0; e < sz; ++e) d0[e] += decay * Y[e];
    }
  }
};

//! True when C orders its operations on a communication stream of b's (comm::standin, comm::nccl,
//! comm::device_local): the exchange is then one all_gather issued as soon as the message is
//! ready, and the compute waits for it on its stream.
template <class C, class B>
inline constexpr bool stream_ordered_comm = requires(C& c, const B& b) {
  c.after(b);
};

//! Per head (a, M), and one reset flag, in one message of H (1 + dk dv) + 1 values. A rank's
//! element is the map X -> a X + M of its slice; reset = 1 when a document starts inside the
//! slice: the map is then the constant M, and the fold selects M instead of forming 0 X + M
//! (0 * NaN is NaN: a non-finite state of one document would reach the next). Works in buffers
//! carved from the caller's workspace (in the backend's memory): the message and the receive
//! buffer of every rank's message. Issued as one all_gather: over a stream-ordered communicator
//! when post() is called (it runs on the communication stream while the compute goes on), over a
//! host communicator in finish(), or (exchange::posted, host) as isend / irecv to every peer in
//! post(), in 2 (P - 1) request slots (host memory) constructed there and destroyed by finish() or
//! the destructor.
template <class C, class B, class A>
class state_exchange {
 public:
  using request = typename C::request;
  static constexpr bool ordered = stream_ordered_comm<C, B>;
  state_exchange(const B& b, index_t heads, index_t sz, int ranks, bool posted, A* send, A* recv, void* reqs)
      : b_(b),
        heads_(heads),
        sz_(sz),
        m_(heads * (1 + sz) + 1),
        ranks_(ranks),
        posted_(posted && !ordered),
        send_(send),
        recv_(recv),
        reqs_(static_cast<request*>(reqs)) {}
  state_exchange(const state_exchange&) = delete;
  state_exchange& operator=(const state_exchange&) = delete;
  ~state_exchange() { destroy(); }
  //! Zeroes the message: a [H], M [H, dk, dv], reset.
  void clear() { loom::detail::fill(b_, send_, m_, A(0)); }
  //! M [H, dk, dv], in the backend's memory.
  A* m() const { return send_ + heads_; }
  //! Sets a[h] (exp of the log-gates of tokens [0, tokens) when `gates`, else `constant`) and the
  //! reset flag.
  void set(const gate_ref<A>& gate, index_t tokens, bool gates, A constant, bool reset) {
    for_each_index(b_, heads_ + 1,
                   message_kernel<A>{gate, send_, heads_, sz_, tokens, gates, constant, reset ? A(1) : A(0)});
  }
  //! x [H, dk, dv] <- the elements of ranks [first, last) applied to 0 (descending: from the last).
  void fold(int first, int last, bool descending, A* x) const {
    if (heads_ * sz_ > 0)
      for_each_index(b_, heads_ * sz_, fold_kernel<A>{recv_, x, heads_, sz_, m_, first, last, descending});
  }
  //! The message is complete on b's stream: hand it to the communicator.
  void post(C& comm) {
    comm::handoff(b_, comm);
    if constexpr (ordered) {
      comm.all_gather(std::span<const A>(send_, msg()), std::span<A>(recv_, msg() * static_cast<std::size_t>(ranks_)));
    } else {
      if (!posted_) return;
      const int me = comm.rank();
      std::copy(send_, send_ + m_, recv_ + m_ * me);
      for (int q = 0; q < ranks_; ++q) {
        if (q == me) continue;
        new (reqs_ + n_) request(comm.isend(std::span<const A>(send_, msg()), q, tag));
        ++n_;
        new (reqs_ + n_) request(comm.irecv(std::span<A>(recv_ + m_ * q, msg()), q, tag));
        ++n_;
      }
    }
  }
  //! Completes the exchange from b's point of view; fold() then reads every rank's message.
  void finish(C& comm) {
    if constexpr (ordered) {
      comm::handback(b_, comm);
    } else if (posted_) {
      comm::wait_all(comm, std::span<request>(reqs_, n_));
      destroy();
    } else {
      comm.all_gather(std::span<const A>(send_, msg()), std::span<A>(recv_, msg() * static_cast<std::size_t>(ranks_)));
    }
  }

 private:
  std::size_t msg() const { return static_cast<std::size_t>(m_); }
  void destroy() noexcept {
    if constexpr (!ordered) {
      for (std::size_t i = 0; i < n_; ++i) reqs_[i].~request();
      n_ = 0;
    }
  }
  static constexpr int tag = 7301;
  const B& b_;
  index_t heads_ = 0, sz_ = 0, m_ = 0;
  int ranks_ = 1;
  bool posted_ = false;
  A *send_, *recv_;
  request* reqs_;
  std::size_t n_ = 0;
};

template <class T, std::size_t R, class Space>
tensor_view<T, R, Space> view_of(std::remove_const_t<T>* v, std::array<index_t, R> e) {
  return tensor_view<T, R, Space>(v, e);
}

//! Byte offsets of one pass's buffers in a LASP-2 workspace (loom::workspace_layout): local initial
//! / final states and their gradients [segments, H, dk, dv], the incoming state and adjoint
//! [H, dk, dv], a decay per head, the fused schedule's scratch, the exchange's message and receive
//! buffer, the request slots, the plan's move table and the slice plan's workspace.
namespace blk {
//! The Accum blocks of a LASP-2 workspace, in layout order.
enum : int { init_loc, fin_loc, xin, dfin_loc, dinit_loc, y, decay, mid, start, tail, lg, cum, send, recv, count };
}  // namespace blk
struct lasp2_layout {
  std::array<std::size_t, blk::count> at{}, size{};  //!< byte offsets and element counts of the Accum blocks
  std::size_t reqs = 0, table = 0, kernels = 0, kernel_bytes = 0, bytes = 0;
};

//! A list of state moves in lasp2_core::table: `count` (source, destination) pairs from pair `at`.
struct move_list {
  index_t at = 0, count = 0;
};

//! What a LASP-2 plan derives from the shapes, the documents and the slice (built once, in
//! make_plan; lasp2::plan is its public face).
template <class P>
struct lasp2_core {
  using A = typename P::accum_type;
  int rank = 0, ranks = 1;
  index_t begin = 0, tokens = 0, heads = 0, dk = 0, dv = 0, sz = 0, docs = 0;
  bool posted_exchange = false;
  std::size_t request_bytes = 0;          //!< sizeof the requests of make_plan's communicator (0: stream-ordered, none)
  bool engine = false;                    //!< the local step is an engine of batched products, not loom's kernels
  std::size_t engine_bytes = 0;           //!< the engine's forward workspace (engine only)
  std::size_t engine_backward_bytes = 0;  //!< the engine's backward workspace (engine only)
  std::vector<index_t> cu;
  slice_info s;
  plan<P> pl;
  lasp2_layout fwd, bwd;
  //! The state moves of a call, as (source, destination) block pairs (-1: zeros), uploaded into the
  //! workspace where the memory is not host-accessible. Forward: the initial state of each local
  //! segment (global document -> segment); the final states of the documents that close in the
  //! slice (segment -> document) and of the empty ones this rank owns (document -> document).
  //! Backward: the initial state of each segment but a continued first one; the final-state
  //! gradient of each segment (-1 unless its document closes here); the initial-state gradients
  //! (segment -> document) and those of the owned empty documents.
  std::vector<index_t> table;
  move_list fwd_init, fwd_fin, fwd_empty, bwd_init, bwd_dfin, bwd_dinit, bwd_empty;

  void make_moves() {
    table.clear();
    auto list = [&](auto&& fill) {
      move_list l{static_cast<index_t>(table.size() / 2), 0};
      fill([&](index_t from, index_t to) {
        table.push_back(from);
        table.push_back(to);
        ++l.count;
      });
      return l;
    };
    const index_t segs = s.segments();
    auto doc = [&](index_t g) { return s.seg_doc[static_cast<std::size_t>(g)]; };
    auto closes = [&](index_t g) {
      return doc(g) >= 0 &&
             s.begin + s.local_cu[static_cast<std::size_t>(g) + 1] == cu[static_cast<std::size_t>(doc(g)) + 1];
    };
    auto empty = [&](index_t d) { return cu[static_cast<std::size_t>(d)] == cu[static_cast<std::size_t>(d) + 1]; };
    fwd_init = list([&](auto add) {
      for (index_t g = 0; g < segs; ++g) add(doc(g) < 0 || (g == 0 && s.continues_left) ? -1 : doc(g), g);
    });
    fwd_fin = list([&](auto add) {
      for (index_t g = 0; g < segs; ++g)
        if (closes(g)) add(g, doc(g));
    });
    fwd_empty = list([&](auto add) {
      for (index_t d : s.owned_final)
        if (empty(d)) add(d, d);
    });
    bwd_init = list([&](auto add) {
      for (index_t g = s.continues_left ? 1 : 0; g < segs; ++g) add(doc(g), g);
    });
    bwd_dfin = list([&](auto add) {
      for (index_t g = 0; g < segs; ++g) add(closes(g) ? doc(g) : -1, g);
    });
    bwd_dinit = list([&](auto add) {
      for (index_t g = 0; g < segs; ++g)
        if (doc(g) >= 0 && !(g == 0 && s.continues_left)) add(g, doc(g));
    });
    bwd_empty = list([&](auto add) {
      for (index_t d : s.owned_start)
        if (empty(d)) add(d, d);
    });
  }

  lasp2_layout make_layout(bool backward) const {
    workspace_layout l;
    lasp2_layout w;
    const index_t states = s.segments() * heads * sz, one = heads * sz;
    const index_t n = ranks > 1 && pl.docs() > 0 && pl.fused() ? plan_access::table(pl).doc_chunk[1] * heads : 0;
    const index_t msg = heads * (1 + sz) + 1;
    const bool fused_scratch = !backward && ranks > 1 && pl.fused();
    const index_t sizes[blk::count] = {states,
                                       states,
                                       one,
                                       backward ? states : 0,
                                       backward ? states : 0,
                                       backward ? one : 0,
                                       backward ? 0 : heads,
                                       fused_scratch ? one : 0,
                                       fused_scratch ? one : 0,
                                       fused_scratch ? one : 0,
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
    w.table = l.add<index_t>(static_cast<index_t>(table.size()));
    // The local step's workspace: the engine's where the plan has one (loom's kernels never run then).
    w.kernel_bytes = engine ? (backward ? engine_backward_bytes : engine_bytes)
                            : (backward ? pl.backward_workspace_bytes() : pl.forward_workspace_bytes());
    w.kernels = l.add<std::byte>(static_cast<index_t>(w.kernel_bytes));
    w.bytes = l.bytes();
    return w;
  }

  //! Checks that a call matches what the plan was made for (on this rank only).
  template <class C, class B, class Ops>
  void check_use(const C& comm, const B&, const Ops& x, std::string_view call) const {
    LOOM_EXPECTS(comm.size() == ranks && comm.rank() == rank, errc::invalid_argument, call, ": plan: made for rank ",
                 rank, " of ", ranks, ", used on rank ", comm.rank(), " of ", comm.size());
    // (A plan made over a host communicator cannot meet a stream-ordered one: each moves only its
    // own kind of memory, and the backend's space is the plan's.)
    constexpr bool ordered = stream_ordered_comm<C, B>;
    LOOM_EXPECTS(!posted_exchange || ordered || sizeof(typename C::request) <= request_bytes, errc::invalid_argument,
                 call, ": plan: made for a communicator whose requests take ", request_bytes,
                 " bytes, used with one of ", sizeof(typename C::request));
    expect_extents(x.q, {tokens, heads, dk}, call, "q (the plan's [slice tokens, heads, dk])");
    expect_extents(x.k, {tokens, heads, dk}, call, "k (the plan's [slice tokens, heads, dk])");
    expect_extents(x.v, {tokens, heads, dv}, call, "v (the plan's [slice tokens, heads, dv])");
    if (present(x.initial_state)) {
      expect_extents(x.initial_state, {docs, heads, dk, dv}, call, "initial_state (the plan's [docs, heads, dk, dv])");
      LOOM_EXPECTS(x.initial_state.is_contiguous(), errc::shape_mismatch, call,
                   ": initial_state: expected a contiguous view");
    }
  }
};

//! One call's buffers, carved from the caller's workspace at the pass's layout, and the move
//! table where the kernels read it (the plan's on host memory, uploaded into the workspace on a
//! device).
template <class A>
struct lasp2_buffers {
  std::array<std::span<A>, blk::count> at;
  void* reqs = nullptr;
  const index_t* table = nullptr;
  incoming_scratch<A> inc;
  std::span<std::byte> kernels;
  A* operator[](int i) const noexcept { return at[static_cast<std::size_t>(i)].data(); }
};

template <class P, class B>
lasp2_buffers<typename P::accum_type> carve_lasp2(const B& b, const lasp2_core<P>& c, std::span<std::byte> ws,
                                                  bool backward, std::string_view call) {
  using A = typename P::accum_type;
  const lasp2_layout& l = backward ? c.bwd : c.fwd;
  check_workspace(ws, l.bytes, call);
  const workspace_carver k(ws);
  lasp2_buffers<A> out;
  for (std::size_t i = 0; i < out.at.size(); ++i) out.at[i] = std::span<A>(k.at<A>(l.at[i]), l.size[i]);
  out.reqs = k.at<std::byte>(l.reqs);
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    out.table = c.table.data();
  } else {
    index_t* t = k.at<index_t>(l.table);
    loom::copy_bytes(b, t, c.table.data(), sizeof(index_t) * c.table.size());
    out.table = t;
  }
  out.inc = {out.at[blk::mid], out.at[blk::start], out.at[blk::tail], out.at[blk::lg], out.at[blk::cum]};
  out.kernels = ws.subspan(l.kernels, l.kernel_bytes);
  return out;
}

//! Runs the moves of `l` from src (null: zeros) into dst, blocks of `block` values.
template <class B, class A>
void move_states(const B& b, const index_t* table, move_list l, const A* src, A* dst, index_t block) {
  if (l.count > 0 && block > 0)
    for_each_index(b, l.count * block, move_states_kernel<A>{table + 2 * l.at, src, dst, block});
}

//! Every check of one forward call on this rank (local: no communication).
template <class P, class C, class B, class Gating, class Space>
void check_forward_call(const C& comm, const B& b, const lasp2_core<P>& w, const Gating& gating,
                        const operands<P, Space>& x, tensor_view<typename P::storage_type, 3, Space> o,
                        tensor_view<typename P::accum_type, 4, Space> fin,
                        tensor_view<typename P::accum_type, 3, Space> incoming, std::string_view call) {
  w.check_use(comm, b, x, call);
  (void)check_gating<typename P::accum_type, Space>(gating, w.tokens, w.heads);
  expect_extents(o, {w.tokens, w.heads, w.dv}, call, "o (the plan's [slice tokens, heads, dv])");
  check_state_out(fin, w.docs, w.heads, w.dk, w.dv, "final_state");
  if (present(incoming)) {
    expect_extents(incoming, {w.heads, w.dk, w.dv}, call, "incoming_state");
    LOOM_EXPECTS(incoming.is_contiguous(), errc::shape_mismatch, call, ": incoming_state: expected a contiguous view");
  }
}

//! The local step of a LASP-2 pass when no engine is given: loom's chunked kernels.
struct kernel_step {};

//! The LASP-2 forward on this rank. Engine: kernel_step (loom's kernels: run_forward /
//! run_forward_incoming), or an engine of batched products (gemm_engine.hpp: forward and
//! forward_incoming with the contracts of gemm_forward and gemm_forward_incoming), given by pointer.
template <class P, class C, class B, class Gating, class Space, class Engine = kernel_step>
void lasp2_forward_impl(const B& b, C& comm, const lasp2_core<P>& w, const Gating& gating, const operands<P, Space>& x,
                        tensor_view<typename P::storage_type, 3, Space> o,
                        tensor_view<typename P::accum_type, 4, Space> fin,
                        tensor_view<typename P::accum_type, 3, Space> incoming, std::span<std::byte> ws,
                        const Engine* engine = nullptr) {
  constexpr bool kernels = std::is_same_v<Engine, kernel_step>;
  using A = typename P::accum_type;
  constexpr std::string_view call = "lasp2::forward";
  check_forward_call(comm, b, w, gating, x, o, fin, incoming, call);
  auto buf = carve_lasp2(b, w, ws, false, call);
  const gate_ref<A> gate = check_gating<A, Space>(gating, w.tokens, w.heads);
  const auto& s = w.s;
  const index_t H = w.heads, sz = w.sz, segs = s.segments(), one = H * sz;
  const A* init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  A* init_loc = buf[blk::init_loc];
  A* fin_loc = buf[blk::fin_loc];
  A* xin = buf[blk::xin];
  loom::detail::fill(b, fin_loc, segs * one, A(0));
  move_states(b, buf.table, w.fwd_init, init, init_loc, one);
  operands<P, Space> xl{x.q, x.k, x.v, view_of<const A, 4, Space>(init_loc, {segs, H, w.dk, w.dv})};
  const auto fin_view = view_of<A, 4, Space>(fin_loc, {segs, H, w.dk, w.dv});
  bool with_x = false;  // the final state of segment 0 includes X
  if (comm.size() == 1) {
    // One rank: nothing enters the slice and nothing needs exchanging; the plain forward (fused
    // when the plan says so, without a chunk-state buffer).
    loom::detail::fill(b, xin, one, A(0));
    if constexpr (kernels)
      run_forward(b, w.pl, gating, xl, o, fin_view, buf.kernels);
    else
      engine->forward(b, w.pl, gating, xl, o, fin_view, buf.kernels, call);
  } else {
    state_exchange<C, B, A> ex(b, H, sz, w.ranks, w.posted_exchange, buf[blk::send], buf[blk::recv], buf.reqs);
    ex.clear();
    const bool reset = !(s.continues_left && segs == 1) && w.tokens > 0;
    // Only later ranks fold this rank's element; the last rank's is never read (it sends a = 1,
    // M = 0 and skips computing its end state before the exchange).
    const incoming_roles roles{s.continues_left, comm.rank() + 1 < comm.size()};
    auto post = [&] {
      ex.set(gate, w.tokens, roles.publish && !reset, roles.publish ? A(0) : A(1), roles.publish && reset);
      ex.post(comm);
    };
    auto finish = [&]() -> const A* {
      ex.finish(comm);
      // X = fold over the ranks before this one, in rank order.
      ex.fold(0, comm.rank(), false, xin);
      return s.continues_left ? static_cast<const A*>(xin) : nullptr;
    };
    if constexpr (kernels)
      with_x =
          run_forward_incoming(b, w.pl, gating, xl, o, fin_view, buf.kernels, ex.m(), roles, buf.inc, post, finish);
    else
      with_x =
          engine->forward_incoming(b, w.pl, gating, xl, o, fin_view, buf.kernels, ex.m(), roles, post, finish, call);
  }
  if (present(incoming)) loom::copy_bytes(b, incoming.data(), xin, sizeof(A) * static_cast<std::size_t>(one));
  if (s.continues_left && !with_x && one > 0) {
    A* decay = buf[blk::decay];
    for_each_index(b, H, head_decay_kernel<A>{gate, decay, 0, s.local_cu[1]});
    for_each_index(b, one, add_scaled_kernel<A>{fin_loc, xin, decay, sz});
  }
  if (!present(fin)) return;
  move_states(b, buf.table, w.fwd_fin, static_cast<const A*>(fin_loc), fin.data(), one);
  move_states(b, buf.table, w.fwd_empty, init, fin.data(), one);
}

}  // namespace loom::linear_attention::detail

#include <loom/linear_attention/detail/lasp2_backward.hpp>
