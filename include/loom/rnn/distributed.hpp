#pragma once

//! @file
//! Sequence-parallel forward and backward: the packed sequence is sharded over the ranks of a
//! communicator (rank 0 first, contiguous slices, any lengths, empty ones included) and every
//! Newton step's linear solve is the cross-rank loom::scan::linear_recurrence, through the
//! cross-rank scan plans the rnn plan holds.
//!
//!   auto plan = loom::rnn::make_plan(b, comm, cell, T_local, docs, opts);   // agrees once
//!   loom::workspace_buffer ws(plan.workspace_bytes());
//!   loom::rnn::report rep(plan);
//!   loom::rnn::forward(b, comm, plan, cell, x, h0, h, rep, ws.span());
//!   loom::rnn::backward(b, comm, plan, cell, x, h0, h, dh, dx, dh0, dtheta, ws.span());
//!
//! make_plan is collective: one agreement (comm/agreement.hpp, one all_gather of
//! comm::agreement_bytes per rank) compares every rank's cell, options and global documents, runs
//! every rank's checks (a rejection is the same loom::error on every rank) and tells each rank
//! where its slice lies; nothing is agreed again per call. A call checks its views against the
//! plan on its own rank: a mismatch is a loom::error on that rank, while the other ranks wait in
//! the call's first collective until the communicator's timeout error. Non-finite x (with
//! check_inputs) is decided collectively (one all_reduce of one value), so every rank throws.
//! Per Newton iteration each rank sends its last row of h (d values) to the next non-empty rank
//! and receives the previous one's (the h_{t-1} of its first row): one point-to-point exchange of
//! d elements; the cross-rank scan adds P × (a_size(d) + d + 1) accumulators (padded to whole
//! 64-byte lines) (all_gather); convergence is decided globally with one all_reduce(max) of S
//! per-sequence residual norms. Every rank takes the same decisions (they depend on global values
//! only), so the report is identical on every rank. The damped fallback doubles that per step;
//! the sequential fallback is a pipeline over the ranks (rank r starts when rank r-1 has sent its
//! last row). Backward: one halo exchange, the cross-rank adjoint scan, and all_reduce(sum) of
//! dtheta (param_size values) and dh0 (S × d values). A call allocates nothing of its own (the
//! communicator's own buffers are the communicator's).
//!
//! Memory: host memory over a host communicator; device memory over a stream-ordered one
//! (comm::standin, comm::nccl): the halo, the scans' exchange and the gradient sums are ordered
//! with the backend's stream (comm::handoff / handback, a stream wait per request), and the
//! residual norms, which every rank reads on the host to decide convergence, go through
//! comm::host_all_reduce (complete on return, as the single-device solver's read-back is).

#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>
#include <loom/rnn/newton.hpp>
#include <loom/scan/distributed.hpp>

#include <span>
#include <typeinfo>

namespace loom::rnn {

namespace detail {

//! Zeroes a [rows, cols] view with strides (s0, s1), one item per element.
template <class T>
struct zero_2d {
  T* p;
  index_t s0, s1, cols;
  LOOM_HD void operator()(index_t i) const { p[(i / cols) * s0 + (i % cols) * s1] = T(0); }
};

template <backend B, comm::communicator C, class Plan>
struct comm_context {
  using T = typename Plan::value_type;
  using Space = typename Plan::space;
  const B& b;
  C& comm;
  const Plan& p;
  tensor_view<const T, 2, Space> init;
  std::span<std::byte> scan_ws;
  index_t d = 0;
  int prev = -1, next = -1;

  index_t base() const { return plan_access::begin(p); }

  // The last row of h to the next non-empty rank, the previous one's into buf. The ranks form a
  // chain (never a cycle), so the send posted before the receive cannot block both neighbours.
  const T* halo(const T* h, index_t hs, index_t rows, T* buf) {
    if (rows == 0) return nullptr;
    typename C::request reqs[2];
    int k = 0;
    comm::handoff(b, comm);
    if (next >= 0)
      reqs[k++] = comm.isend(std::span<const T>(h + (rows - 1) * hs, static_cast<std::size_t>(d)), next, 71);
    if (prev >= 0) reqs[k++] = comm.irecv(std::span<T>(buf, static_cast<std::size_t>(d)), prev, 71);
    comm::wait_all_on(b, comm, std::span<typename C::request>(reqs, static_cast<std::size_t>(k)));
    return prev >= 0 ? buf : nullptr;
  }
  // Host values every rank decides on (the residual norms): the control plane.
  void all_max(std::span<double> v) {
    comm::host_all_reduce(comm, std::span<const double>(v), v, comm::reduce_op::max);
  }
  template <class St, class AV, class RV, class HV>
  void solve(St, AV a, RV rhs, HV h, bool with_init) {
    scan::linear_recurrence(b, comm, plan_access::scan_plan<St>(p), a, rhs, h,
                            scan::states<T, Space>{with_init ? init : tensor_view<const T, 2, Space>{}, {}}, scan_ws);
  }
  template <class St, class AV, class GV, class LV, class DH0V>
  void adjoint(St, AV a, GV g, LV lambda, DH0V dh0) {
    if (dh0.size() > 0)  // rows of other ranks' sequences stay zero
      for_each_index(b, dh0.size(),
                     zero_2d<typename DH0V::value_type>{dh0.data(), dh0.stride(0), dh0.stride(1), dh0.extent(1)});
    scan::linear_recurrence_adjoint(b, comm, plan_access::scan_plan<St>(p), a, g, lambda,
                                    scan::adjoint_states<T, Space>{{}, dh0}, scan_ws);
  }
  template <class DTV, class DH0V>
  void sum_gradients(DTV dtheta, DH0V dh0) {
    comm::handoff(b, comm);
    using V = typename DTV::value_type;
    const std::span<V> t(dtheta.data(), static_cast<std::size_t>(dtheta.extent(0)));
    comm.all_reduce(std::span<const V>(t), t, comm::reduce_op::sum);
    for (index_t s = 0; s < dh0.extent(0) && dh0.size() > 0; ++s) {  // row by row: rows may be strided
      const std::span<typename DH0V::value_type> row(dh0.data() + s * dh0.stride(0),
                                                     static_cast<std::size_t>(dh0.extent(1)));
      comm.all_reduce(std::span<const typename DH0V::value_type>(row), row, comm::reduce_op::sum);
    }
    comm::handback(b, comm);
  }
  template <class F>
  void sequential(T* h, index_t hs, index_t rows, index_t, T* buf, F&& run) {
    const T* halo_row = nullptr;
    if (rows > 0 && prev >= 0) {
      comm::handoff(b, comm);  // buf is no longer read by earlier work
      typename C::request r = comm.irecv(std::span<T>(buf, static_cast<std::size_t>(d)), prev, 72);
      comm::wait_all_on(b, comm, std::span<typename C::request>(&r, 1));
      halo_row = buf;
    }
    run(halo_row);
    if (rows > 0 && next >= 0) {
      comm::handoff(b, comm);
      typename C::request r =
          comm.isend(std::span<const T>(h + (rows - 1) * hs, static_cast<std::size_t>(d)), next, 72);
      comm::wait_all_on(b, comm, std::span<typename C::request>(&r, 1));
    }
  }
};

template <backend B, comm::communicator C, class Plan, class H0V>
comm_context<B, C, Plan> context_of(const B& b, C& comm, const Plan& p, const H0V& h0, std::span<std::byte> ws,
                                    std::string_view call) {
  LOOM_EXPECTS(comm.size() > plan_access::neighbours(p).first && comm.size() > plan_access::neighbours(p).second,
               errc::invalid_argument, call, ": the plan was made for a larger communicator");
  return comm_context<B, C, Plan>{b,
                                  comm,
                                  p,
                                  h0,
                                  ws.subspan(plan_access::layout(p).scan),
                                  p.state_size(),
                                  plan_access::neighbours(p).first,
                                  plan_access::neighbours(p).second};
}

//! Non-finite x on any rank, decided by all ranks (one all_reduce of one value).
template <backend B, comm::communicator C, class XV>
void check_x_collectively(const B& b, C& comm, XV x, index_t m, std::string_view call) {
  const double xm =
      reduce(b, x.size(), 0.0, max_op{}, abs_of<typename XV::value_type>{x.data(), m > 0 ? m : 1, x.stride(0)});
  const double mine = std::isfinite(xm) ? -1.0 : static_cast<double>(comm.rank());
  double bad = -1.0;
  comm::host_all_reduce(comm, std::span<const double>(&mine, 1), std::span<double>(&bad, 1), comm::reduce_op::max);
  LOOM_EXPECTS(bad < 0, errc::invalid_argument, call, ": x holds non-finite values (NaN or inf) on rank ",
               static_cast<int>(bad), "; set options.check_inputs = false to let them propagate");
}

}  // namespace detail

//! The plan of sequence-parallel solves: this rank holds n time steps of the global packed
//! sequence, `docs` are the global documents (the same on every rank). Collective: one agreement
//! over every rank's cell (type and sizes), options and docs (see the file comment).
//! @throws as the single-device make_plan, on every rank; (invalid_argument) "ranks disagree on
//! ..." when the ranks' cells, options or docs differ.
template <backend B, comm::communicator C, cell Cell, memory_space Space = typename backend_traits<B>::memory_space>
plan<B, Cell, Space, true> make_plan(const B& b, C& comm, const Cell& c, index_t n,
                                     const loom::segments<Space>& docs = {}, const options& opt = {}) {
  static_assert(comm::moves<C, Space>,
                "loom::rnn sequence parallel: the communicator cannot move buffers of the backend's memory space (a "
                "host communicator needs host-accessible memory; device memory needs a stream-ordered communicator)");
  constexpr std::string_view call = "rnn::make_plan";
  const auto locals = comm::agree(comm, call, [&] {
    detail::check_plan(c, n, opt, call);
    return comm::signature{}
        .add_digest(
            "the cell",
            comm::hasher{}.add_string(typeid(Cell).name()).add(c.state_size(), c.input_size(), c.param_size()).value())
        .add("the options", opt.solver, opt.max_iterations, opt.abs_tol, opt.rel_tol, opt.guess, opt.on_failure,
             opt.fallback_iterations, opt.damping, opt.verify_jacobian, opt.check_inputs)
        .add_digest("the document offsets", scan::detail::docs_digest(b, docs))
        .local(static_cast<std::uint64_t>(n));
  });
  return detail::plan_access::make<true>(b, c, scan::detail::slices_of(locals, comm.rank()), docs, opt, call);
}

//! Sequence-parallel forward: x, h are this rank's rows of the global packed sequence; h0 [S, d]
//! is the same on every rank. Collective: every rank calls it with its plan. Writes the same
//! report on every rank. Allocates nothing.
//! @throws as the single-device forward on the rank whose views do not fit its plan (see the file
//! comment for the other ranks); non-finite x on any rank (with check_inputs) on every rank.
template <backend B, comm::communicator C, class Plan, class XV, class H0V, class HV>
requires detail::is_plan<Plan, true>
void forward(const B& b, C& comm, const Plan& p, const typename Plan::cell_type& c, XV x, H0V h0, HV h, report& rep,
             std::span<std::byte> ws) {
  using Cell = typename Plan::cell_type;
  constexpr std::string_view call = "rnn::forward";
  const auto sp = detail::check_call(b, p, c, x, h0, h, ws, call, false);
  const auto hst = detail::report_access::state(rep, p.sequences(), call);
  if (p.opts().check_inputs) detail::check_x_collectively(b, comm, x, p.input_size(), call);
  auto ctx = detail::context_of(b, comm, p, h0, ws, call);
  detail::engine<B, Cell, decltype(ctx)> e(b, c, ctx, x.data(), x.stride(0), h.data(), h.stride(0), p.size(),
                                           detail::init_of<Plan>(h0), h0.stride(0), scan::detail::ref_of(p.docs()),
                                           p.sequences(), p.opts(), sp, hst);
  e.solve(rep);
}

//! Sequence-parallel backward: dh, dx are this rank's rows; dtheta and dh0 come back complete
//! (summed over ranks) on every rank. Collective. Allocates nothing.
template <backend B, comm::communicator C, class Plan, class XV, class H0V, class HV, class GV, class DXV, class DH0V,
          class DTV>
requires detail::is_plan<Plan, true>
void backward(const B& b, C& comm, const Plan& p, const typename Plan::cell_type& c, XV x, H0V h0, HV h, GV dh, DXV dx,
              DH0V dh0, DTV dtheta, std::span<std::byte> ws) {
  using Cell = typename Plan::cell_type;
  using T = typename Cell::value_type;
  constexpr std::string_view call = "rnn::backward";
  const auto sp = detail::check_call(b, p, c, x, h0, h, ws, call, false);
  detail::check_gradients(p, dh, dx, dh0, dtheta, call);
  if (p.opts().check_inputs) detail::check_x_collectively(b, comm, x, p.input_size(), call);
  auto ctx = detail::context_of(b, comm, p, h0, ws, call);
  detail::engine<B, Cell, decltype(ctx)> e(b, c, ctx, x.data(), x.stride(0),
                                           const_cast<T*>(static_cast<const T*>(h.data())), h.stride(0), p.size(),
                                           detail::init_of<Plan>(h0), h0.stride(0), scan::detail::ref_of(p.docs()),
                                           p.sequences(), p.opts(), sp, detail::host_state{});
  e.backward(dh, dx, dh0, dtheta);
}

//! Convenience forms: make_plan (with its agreement), a temporary workspace and report, the plan
//! form, fence.
template <backend B, comm::communicator C, cell Cell, class XV, class H0V, class HV, memory_space Space>
report forward(const B& b, C& comm, const Cell& c, XV x, H0V h0, HV h, const loom::segments<Space>& docs,
               const options& opt = {}) {
  const auto p = make_plan(b, comm, c, x.extent(0), docs, opt);
  report rep(p);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, comm, p, c, x, h0, h, rep, ws); });
  return rep;
}
template <backend B, comm::communicator C, cell Cell, class XV, class H0V, class HV, class GV, class DXV, class DH0V,
          class DTV, memory_space Space>
void backward(const B& b, C& comm, const Cell& c, XV x, H0V h0, HV h, GV dh, DXV dx, DH0V dh0, DTV dtheta,
              const loom::segments<Space>& docs, const options& opt = {}) {
  const auto p = make_plan(b, comm, c, x.extent(0), docs, opt);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, comm, p, c, x, h0, h, dh, dx, dh0, dtheta, ws);
  });
}

}  // namespace loom::rnn
