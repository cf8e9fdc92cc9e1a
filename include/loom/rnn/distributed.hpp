#pragma once

//! @file
//! Sequence-parallel Newton solve and backward: the packed sequence is sharded over the ranks of
//! a communicator (rank 0 first, contiguous slices, any lengths, empty ones included) and every
//! Newton step's linear solve is the cross-rank loom::scan::linear_recurrence.
//!
//! Per Newton iteration each rank sends its last row of h (d values) to the next non-empty rank
//! and receives the previous one's (the h_{t-1} of its first row): one point-to-point exchange of
//! d elements; the cross-rank scan adds P × 8 bytes + P × (a_size(d) + d + 1) accumulators (padded
//! to whole 64-byte lines)
//! (all_gather); convergence is decided globally with one all_reduce(max) of S per-sequence
//! residual norms. Every rank takes the same decisions (they depend on global values only), so
//! the report is identical on every rank. The damped fallback doubles that per step; the
//! sequential fallback is a pipeline over the ranks (rank r starts when rank r-1 has sent its last
//! row). Backward: one halo exchange, the cross-rank adjoint scan, and all_reduce(sum) of
//! dtheta (param_size values) and dh0 (S × d values). Host-accessible backends only.

#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/rnn/newton.hpp>
#include <loom/scan/distributed.hpp>

#include <exception>
#include <span>
#include <typeinfo>
#include <vector>

namespace loom::rnn {

namespace detail {

template <backend B, comm::communicator C, class T, class Space>
struct comm_context {
  const B& b;
  C& comm;
  tensor_view<const index_t, 1, Space> offsets;
  tensor_view<const T, 2, Space> init;
  index_t d = 0, n = 0, begin = 0, total = 0;
  int prev = -1, next = -1;  //!< nearest non-empty ranks before and after this one

  comm_context(const B& b_, C& c, tensor_view<const index_t, 1, Space> off, tensor_view<const T, 2, Space> h0,
               index_t d_, index_t n_)
      : b(b_), comm(c), offsets(off), init(h0), d(d_), n(n_) {
    const auto p = static_cast<std::size_t>(comm.size());
    std::vector<std::int64_t> lengths(p);
    const std::int64_t mine = n;
    comm.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(lengths));
    for (int q = 0; q < static_cast<int>(p); ++q) {
      if (q < comm.rank()) {
        begin += lengths[static_cast<std::size_t>(q)];
        if (lengths[static_cast<std::size_t>(q)] > 0) prev = q;
      }
      if (q > comm.rank() && next < 0 && lengths[static_cast<std::size_t>(q)] > 0) next = q;
      total += lengths[static_cast<std::size_t>(q)];
    }
  }
  index_t base() const { return begin; }

  const T* halo(const T* h, index_t hs, index_t rows, T* buf) {
    if (rows == 0) return nullptr;
    typename C::request reqs[2];
    int k = 0;
    fence(b);
    if (next >= 0)
      reqs[k++] = comm.isend(std::span<const T>(h + (rows - 1) * hs, static_cast<std::size_t>(d)), next, 71);
    if (prev >= 0) reqs[k++] = comm.irecv(std::span<T>(buf, static_cast<std::size_t>(d)), prev, 71);
    comm::wait_all(comm, std::span<typename C::request>(reqs, static_cast<std::size_t>(k)));
    return prev >= 0 ? buf : nullptr;
  }
  void all_max(std::vector<double>& v) {
    comm.all_reduce(std::span<const double>(v), std::span<double>(v), comm::reduce_op::max);
  }
  template <class St, class AV, class RV, class HV>
  void solve(St, AV a, RV rhs, HV h, bool with_init) {
    // Agreed once per solve (make_comm_engine): the scans inside skip their own agreement.
    scan::detail::recurrence_impl(b, comm, St{}, a, rhs, h, offsets,
                                  with_init ? init : tensor_view<const T, 2, Space>{}, tensor_view<T, 2, Space>{},
                                  false, {}, false);
  }
  template <class St, class AV, class GV, class LV, class DH0V>
  void adjoint(St, AV a, GV g, LV lambda, DH0V dh0) {
    for (index_t s = 0; s < dh0.extent(0); ++s)
      for (index_t c = 0; c < dh0.extent(1); ++c) dh0(s, c) = 0;  // rows of other ranks' sequences
    scan::detail::recurrence_impl(b, comm, St{}, a, g, lambda, offsets, tensor_view<const T, 2, Space>{}, dh0, true, {},
                                  false);
  }
  template <class DTV, class DH0V>
  void sum_gradients(DTV dtheta, DH0V dh0) {
    fence(b);
    std::vector<T> v(dtheta.data(), dtheta.data() + dtheta.extent(0));
    comm.all_reduce(std::span<const T>(v), std::span<T>(v), comm::reduce_op::sum);
    std::copy(v.begin(), v.end(), dtheta.data());
    if (dh0.size() == 0) return;
    std::vector<T> w;
    for (index_t s = 0; s < dh0.extent(0); ++s)
      for (index_t c = 0; c < dh0.extent(1); ++c) w.push_back(dh0(s, c));
    comm.all_reduce(std::span<const T>(w), std::span<T>(w), comm::reduce_op::sum);
    std::size_t i = 0;
    for (index_t s = 0; s < dh0.extent(0); ++s)
      for (index_t c = 0; c < dh0.extent(1); ++c) dh0(s, c) = w[i++];
  }
  template <class F>
  void sequential(T* h, index_t hs, index_t rows, index_t, T* buf, F&& run) {
    const T* halo_row = nullptr;
    if (rows > 0 && prev >= 0) {
      auto r = comm.irecv(std::span<T>(buf, static_cast<std::size_t>(d)), prev, 72);
      comm.wait(r);
      halo_row = buf;
    }
    run(halo_row);
    fence(b);
    if (rows > 0 && next >= 0) {
      auto r = comm.isend(std::span<const T>(h + (rows - 1) * hs, static_cast<std::size_t>(d)), next, 72);
      comm.wait(r);
    }
  }
};

//! What every rank of a sequence-parallel solve must agree on: the cell (its type and sizes),
//! the options and the global cu_seqlens and h0 rows.
template <cell Cell, class H0V, class Space>
comm::signature solve_signature(const Cell& c, const H0V& h0, const options<Space>& opt) {
  comm::hasher cu;
  cu.add(opt.cu_seqlens.extent(0));
  if constexpr (Space::host_accessible)
    for (index_t i = 0; i < opt.cu_seqlens.extent(0); ++i) cu.add(opt.cu_seqlens(i));
  return comm::signature{}
      .add_digest(
          "the cell",
          comm::hasher{}.add_string(typeid(Cell).name()).add(c.state_size(), c.input_size(), c.param_size()).value())
      .add("the options", opt.solver, opt.max_iterations, opt.abs_tol, opt.rel_tol, opt.guess, opt.on_failure,
           opt.fallback_iterations, opt.damping, opt.verify_jacobian, opt.check_inputs)
      .add_digest("cu_seqlens", cu.value())
      .add("the initial states' extents", h0.extent(0), h0.extent(1));
}

//! The engine's context, after one agreement (comm/agreement.hpp) over this rank's checks (the
//! solve's, then `more()`) and the signature of the call: a rejection on any rank is the same
//! loom::error on every rank, before data moves.
template <backend B, comm::communicator C, cell Cell, class XV, class H0V, class HV, class Space, class More>
auto make_comm_engine(const B& b, C& comm, const Cell& c, XV x, H0V h0, HV h, const options<Space>& opt,
                      std::string_view call, More&& more) {
  using T = typename Cell::value_type;
  static_assert(Space::host_accessible, "loom::rnn sequence parallel: host-accessible backends only");
  auto ctx = std::make_unique<comm_context<B, C, T, Space>>(b, comm, opt.cu_seqlens, h0, c.state_size(), x.extent(0));
  auto local = opt;
  local.check_inputs = false;  // checked collectively below
  index_t segs = 0;
  comm::agree(comm, call, [&] {
    segs = validate(b, c, x, h0, h, ctx->total, local, call);
    if (opt.check_inputs) {
      const double xm =
          reduce(b, x.size(), 0.0, max_op{},
                 abs_of<typename XV::value_type>{x.data(), c.input_size() > 0 ? c.input_size() : 1, x.stride(0)});
      LOOM_EXPECTS(std::isfinite(xm), errc::invalid_argument, call, ": x holds non-finite values (NaN or inf) on rank ",
                   comm.rank());
    }
    more(segs);
    return solve_signature(c, h0, opt);
  });
  if (opt.check_inputs && h0.size() > 0) {
    const double hm =
        reduce(b, h0.size(), 0.0, max_op{}, abs_of<typename H0V::value_type>{h0.data(), c.state_size(), h0.stride(0)});
    LOOM_EXPECTS(std::isfinite(hm), errc::invalid_argument, call, ": h0 holds non-finite values (NaN or inf)");
  }
  return std::pair{std::move(ctx), segs};
}

}  // namespace detail

//! Sequence-parallel newton_solve: x, h are this rank's rows of the global packed sequence;
//! h0 [S, d] and options.cu_seqlens (global offsets) are the same on every rank. Collective:
//! every rank calls it with the same options. Returns the same report on every rank.
//! @throws as newton_solve; a rank whose arguments are rejected throws its error and the other
//! ranks throw the same error ("on rank r: ..."); ranks disagreeing on the cell, options, cu_seqlens
//! or h0's extents throw errc::invalid_argument ("ranks disagree on ...") on every rank.
template <backend B, comm::communicator C, cell Cell, class XV, class H0V, class HV,
          class Space = typename backend_traits<B>::memory_space>
report newton_solve(const B& b, C& comm, const Cell& c, XV x, H0V h0, HV h, const options<Space>& opt = {}) {
  using T = typename Cell::value_type;
  auto [ctx, segs] = detail::make_comm_engine(b, comm, c, x, h0, h, opt, "newton_solve", [](index_t) {});
  detail::engine<B, Cell, detail::comm_context<B, C, T, Space>> e(
      b, c, *ctx, x.data(), x.stride(0), h.data(), h.stride(0), x.extent(0), h0.size() ? h0.data() : nullptr,
      h0.stride(0), opt.cu_seqlens.extent(0) ? opt.cu_seqlens.data() : nullptr, segs, opt);
  return e.solve();
}

//! Sequence-parallel backward: dh, dx are this rank's rows; dtheta and dh0 come back complete
//! (summed over ranks) on every rank. Collective.
template <backend B, comm::communicator C, cell Cell, class XV, class H0V, class HV, class GV, class DXV, class DH0V,
          class DTV, class Space = typename backend_traits<B>::memory_space>
void backward(const B& b, C& comm, const Cell& c, XV x, H0V h0, HV h, GV dh, DXV dx, DH0V dh0, DTV dtheta,
              const options<Space>& opt = {}) {
  using T = typename Cell::value_type;
  constexpr std::string_view call = "backward";
  const index_t n = x.extent(0), d = c.state_size();
  auto [ctx, segs] = detail::make_comm_engine(b, comm, c, x, h0, h, opt, call, [&](index_t segs_) {
    detail::check_rows(dh, n, d, call, "dh", "the gradient of h");
    detail::check_rows(dx, n, c.input_size(), call, "dx", "like x");
    if (dh0.size() > 0) detail::check_rows(dh0, segs_, d, call, "dh0", "like h0");
    LOOM_EXPECTS(dtheta.extent(0) == c.param_size() && (dtheta.extent(0) <= 1 || dtheta.stride(0) == 1),
                 errc::shape_mismatch, call, ": dtheta must be a contiguous [", c.param_size(),
                 "] (cell.param_size()), got ", loom::detail::extents_string(dtheta));
  });
  detail::engine<B, Cell, detail::comm_context<B, C, T, Space>> e(
      b, c, *ctx, x.data(), x.stride(0), const_cast<T*>(static_cast<const T*>(h.data())), h.stride(0), n,
      h0.size() ? h0.data() : nullptr, h0.stride(0), opt.cu_seqlens.extent(0) ? opt.cu_seqlens.data() : nullptr, segs,
      opt);
  e.backward(dh, dx, dh0, dtheta);
}

}  // namespace loom::rnn
