#pragma once

//! @file
//! LASP-2 internals: the local run on a slice, the state exchange (one all_gather, or the same
//! volume posted as isend / irecv), the rank-ordered folds and the corrections of the first / last
//! document of the slice by the incoming state / incoming state gradient.

#include <loom/backend/temporary.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/linear_attention/detail/driver.hpp>
#include <loom/linear_attention/detail/slice.hpp>

#include <cmath>
#include <span>
#include <vector>

namespace loom::linear_attention::detail {

//! Per head (a, M) in one message of H (1 + dk dv) values; issued as one all_gather or posted.
template <class C, class A>
class state_exchange {
 public:
  state_exchange(C& comm, index_t heads, index_t sz, bool posted)
      : comm_(comm), m_(static_cast<std::size_t>(heads * (1 + sz))), posted_(posted) {
    send_.assign(m_, A(0));
    recv_.assign(m_ * static_cast<std::size_t>(comm.size()), A(0));
  }
  A* a() { return send_.data(); }
  A* m(index_t heads) { return send_.data() + heads; }
  void post() {
    if (!posted_) return;
    const int me = comm_.rank();
    std::copy(send_.begin(), send_.end(), recv_.begin() + static_cast<std::ptrdiff_t>(m_ * me));
    for (int q = 0; q < comm_.size(); ++q) {
      if (q == me) continue;
      reqs_.push_back(comm_.isend(std::span<const A>(send_.data(), m_), q, tag));
      reqs_.push_back(comm_.irecv(std::span<A>(recv_.data() + m_ * static_cast<std::size_t>(q), m_), q, tag));
    }
  }
  //! Returns the gathered elements: block q is rank q's message.
  const std::vector<A>& finish() {
    if (posted_)
      comm::wait_all(comm_, std::span<typename C::request>(reqs_));
    else
      comm_.all_gather(std::span<const A>(send_.data(), m_), std::span<A>(recv_.data(), recv_.size()));
    return recv_;
  }

 private:
  static constexpr int tag = 7301;
  C& comm_;
  std::size_t m_;
  bool posted_;
  std::vector<A> send_, recv_;
  std::vector<typename C::request> reqs_;
};

template <class T, std::size_t R>
tensor_view<T, R, host_memory> view_of(std::vector<std::remove_const_t<T>>& v, std::array<index_t, R> e) {
  return tensor_view<T, R, host_memory>(v.data(), e);
}

//! Shared set-up of both passes: validation, slice, plan, gate of the slice.
template <class P, class C, class B, class Gating>
struct lasp2_setup {
  using A = typename P::accum_type;
  index_t heads, dk, dv, sz, docs, tokens;
  slice_info s;
  plan<P> pl;
  gate_ref<A> gate;
  lasp2_setup(C& comm, const B& b, const Gating& gating, const operands<P, host_memory>& x, std::span<const index_t> cu,
              index_t begin, const options& opt)
      : heads(x.q.extent(1)), dk(x.q.extent(2)), dv(x.v.extent(2)), sz(dk * dv), tokens(x.q.extent(0)) {
    LOOM_EXPECTS(!cu.empty(), errc::invalid_argument, "cu_seqlens: expected at least 2 offsets (docs + 1), got 0");
    (void)make_chunk_table(cu, cu.back(), opt.chunk, "cu_seqlens");
    docs = static_cast<index_t>(cu.size()) - 1;
    s = make_slice(cu, begin, tokens, comm.rank(), comm.size());
    pl = make_plan<P>(b, s.local_cu, heads, dk, dv, opt);
    gate = check_gating<A, host_memory>(gating, tokens, heads);
    if (present(x.initial_state)) expect_extents(x.initial_state, {docs, heads, dk, dv}, "initial_state");
  }
  index_t segs() const { return s.segments(); }
  A log_gate_sum(index_t from, index_t to, index_t h) const {
    A acc = A(0);
    for (index_t t = from; t < to; ++t) acc += gate(t, h);
    return acc;
  }
  void copy_state(const A* src, A* dst) const {
    for (index_t x = 0; x < sz; ++x) dst[x] = src ? src[x] : A(0);
  }
};

template <class P, class C, class B, class Gating>
void lasp2_forward_impl(C& comm, const B& b, const Gating& gating, const operands<P, host_memory>& x,
                        tensor_view<typename P::storage_type, 3, host_memory> o, std::span<const index_t> cu,
                        index_t begin, tensor_view<typename P::accum_type, 4, host_memory> fin,
                        tensor_view<typename P::accum_type, 3, host_memory> incoming, const options& opt, bool posted) {
  using A = typename P::accum_type;
  lasp2_setup<P, C, B, Gating> st(comm, b, gating, x, cu, begin, opt);
  const auto& s = st.s;
  const index_t H = st.heads, sz = st.sz, segs = st.segs();
  check_state_out(fin, st.docs, H, st.dk, st.dv, "final_state");
  if (present(incoming)) expect_extents(incoming, {H, st.dk, st.dv}, "incoming_state");
  const A* init = present(x.initial_state) ? x.initial_state.data() : nullptr;
  std::vector<A> init_loc(static_cast<std::size_t>(segs * H * sz)), fin_loc(init_loc.size());
  for (index_t g = 0; g < segs; ++g)
    for (index_t h = 0; h < H; ++h) {
      const index_t d = s.seg_doc[static_cast<std::size_t>(g)];
      const bool zero = !init || d < 0 || (g == 0 && s.continues_left);
      st.copy_state(zero ? nullptr : init + (d * H + h) * sz, init_loc.data() + (g * H + h) * sz);
    }
  operands<P, host_memory> xl{x.q, x.k, x.v, view_of<const A, 4>(init_loc, {segs, H, st.dk, st.dv})};
  std::vector<A> xin(static_cast<std::size_t>(H * sz), A(0));
  bool with_x = false;  // the final state of segment 0 includes X
  if (comm.size() == 1) {
    // One rank: nothing enters the slice and nothing needs exchanging; the plain forward (fused
    // when the plan says so, without a chunk-state buffer).
    const auto bytes = st.pl.forward_workspace_bytes();
    temporary_buffer<B, std::byte> ws(b, static_cast<index_t>(bytes));
    run_forward(b, st.pl, gating, xl, o, view_of<A, 4>(fin_loc, {segs, H, st.dk, st.dv}),
                std::span<std::byte>(ws.data(), bytes));
  } else {
    const auto bytes = st.pl.forward_workspace_bytes();
    temporary_buffer<B, std::byte> ws(b, static_cast<index_t>(bytes));
    state_exchange<C, A> ex(comm, H, sz, posted);
    const bool reset = !(s.continues_left && segs == 1) && st.tokens > 0;
    // Only later ranks fold this rank's element; the last rank's is never read (it sends a = 1,
    // M = 0 and skips computing its end state before the exchange).
    const incoming_roles roles{s.continues_left, comm.rank() + 1 < comm.size()};
    with_x = run_forward_incoming(
        b, st.pl, gating, xl, o, view_of<A, 4>(fin_loc, {segs, H, st.dk, st.dv}),
        std::span<std::byte>(ws.data(), bytes), ex.m(H), roles,
        [&] {
          for (index_t h = 0; h < H; ++h)
            ex.a()[h] = !roles.publish ? A(1) : reset ? A(0) : exp_acc(st.log_gate_sum(0, st.tokens, h));
          ex.post();
        },
        [&]() -> const A* {
          const auto& all = ex.finish();
          // X = fold over the ranks before this one, in rank order.
          const std::size_t m = static_cast<std::size_t>(H * (1 + sz));
          for (int q = 0; q < comm.rank(); ++q) {
            const A* blk = all.data() + m * static_cast<std::size_t>(q);
            for (index_t h = 0; h < H; ++h)
              for (index_t e = 0; e < sz; ++e) xin[h * sz + e] = blk[h] * xin[h * sz + e] + blk[H + h * sz + e];
          }
          return s.continues_left ? static_cast<const A*>(xin.data()) : nullptr;
        });
  }
  if (present(incoming)) std::copy(xin.begin(), xin.end(), incoming.data());
  if (s.continues_left && !with_x) {
    const index_t n0 = s.local_cu[1];
    for (index_t h = 0; h < H; ++h) {
      const A decay = exp_acc(st.log_gate_sum(0, n0, h));
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
        st.copy_state(init ? init + (d * H + h) * sz : nullptr, fin.data() + (d * H + h) * sz);
}

}  // namespace loom::linear_attention::detail

#include <loom/linear_attention/detail/lasp2_backward.hpp>
