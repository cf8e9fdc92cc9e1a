#pragma once

//! @file
//! Parallel solution of a nonlinear recurrence h_t = f(h_{t-1}, x_t) for all t at once (DEER,
//! ParaRNN): Newton's method on the residual r_t = h_t − f(h_{t-1}, x_t), where each step is the
//! linear recurrence
//!   h^{new}_t = A_t h^{new}_{t-1} + b_t,  A_t = ∂f/∂h at h^{old}_{t-1},  b_t = f(h^{old}_{t-1}) − A_t h^{old}_{t-1}
//! solved by loom::scan::linear_recurrence in the cell's Jacobian structure. Backward: the adjoint
//! recurrence (loom::scan::linear_recurrence_adjoint) at the solution, then per-step input and
//! parameter gradients of the cell: no backpropagation through the iterations.
//!
//!   loom::rnn::para_gru<double> cell{theta, d};
//!   auto rep = loom::rnn::newton_solve(loom::openmp{}, cell, x, h0, h, {.max_iterations = 20});
//!   loom::rnn::backward(loom::openmp{}, cell, x, h0, h, dh, dx, dh0, dtheta);
//!
//! Views: x [T, m] (m = cell.input_size()), h [T, d] (d = cell.state_size()), h0 [S, d] (or
//! [1, d] without cu_seqlens; empty: zeros); rows may be strided, each row contiguous.
//! Work per iteration: one cell linearization per step plus one scan (O(T d) diagonal, O(T d K)
//! block-diagonal, O(T d³) dense); memory O(T a_size(d)) for the Jacobians.

#include <loom/backend/parallel.hpp>
#include <loom/rnn/cells.hpp>
#include <loom/rnn/detail/driver.hpp>
#include <loom/rnn/types.hpp>
#include <loom/scan/recurrence.hpp>

#include <cmath>
#include <string>

namespace loom::rnn {

namespace detail {

template <class V>
void check_rows(const V& v, index_t rows, index_t cols, std::string_view call, std::string_view name,
                std::string_view what) {
  LOOM_EXPECTS(v.extent(0) == rows && v.extent(1) == cols, errc::shape_mismatch, call, ": ", name, " must be [", rows,
               ", ", cols, "] (", what, "), got ", loom::detail::extents_string(v));
  LOOM_EXPECTS(v.extent(1) <= 1 || v.stride(1) == 1, errc::invalid_argument, call, ": the rows of ", name,
               " must be contiguous (stride 1 along dimension 1), got stride ", v.stride(1));
}

//! Validates the problem; returns the number of sequences. `total` is the global length.
template <backend B, cell Cell, class XV, class H0V, class HV, class Space>
index_t validate(const B& b, const Cell& c, XV x, H0V h0, HV h, index_t total, const options<Space>& opt,
                 std::string_view call) {
  using St = typename Cell::structure;
  const index_t n = x.extent(0), d = c.state_size(), m = c.input_size();
  LOOM_EXPECTS(d > 0, errc::invalid_argument, call, ": cell.state_size() must be > 0, got ", d);
  if constexpr (St::a_rank == 4)
    LOOM_EXPECTS(d % St::block == 0, errc::invalid_argument, call, ": the cell declares block_diagonal<", St::block,
                 "> but its state size ", d, " is not a multiple of ", St::block);
  check_rows(x, n, m, call, "x", "time steps x cell.input_size()");
  check_rows(h, n, d, call, "h", "time steps of x x cell.state_size()");
  LOOM_EXPECTS(opt.max_iterations >= 0, errc::invalid_argument, call, ": options.max_iterations must be >= 0, got ",
               opt.max_iterations);
  LOOM_EXPECTS(opt.fallback_iterations >= 0, errc::invalid_argument, call,
               ": options.fallback_iterations must be >= 0, got ", opt.fallback_iterations);
  LOOM_EXPECTS(opt.abs_tol >= 0 && opt.rel_tol >= 0 && opt.abs_tol + opt.rel_tol > 0, errc::invalid_argument, call,
               ": options.abs_tol and rel_tol must be >= 0 and not both 0, got ", opt.abs_tol, " and ", opt.rel_tol);
  LOOM_EXPECTS(opt.damping >= 0 && std::isfinite(opt.damping), errc::invalid_argument, call,
               ": options.damping must be finite and >= 0, got ", opt.damping);
  index_t segs = 1;
  if (opt.cu_seqlens.extent(0) > 0) {
    segs = opt.cu_seqlens.extent(0) - 1;
    LOOM_EXPECTS(segs >= 1, errc::invalid_argument, call, ": cu_seqlens needs at least 2 offsets, got 1");
    if constexpr (Space::host_accessible) {
      const auto& o = opt.cu_seqlens;
      LOOM_EXPECTS(o(0) == 0, errc::invalid_argument, call, ": cu_seqlens[0] must be 0, got ", o(0));
      for (index_t s = 0; s < segs; ++s)
        LOOM_EXPECTS(o(s + 1) >= o(s), errc::invalid_argument, call, ": cu_seqlens must be non-decreasing, got ", o(s),
                     " then ", o(s + 1), " at ", s);
      LOOM_EXPECTS(o(segs) == total, errc::shape_mismatch, call, ": cu_seqlens must end at the sequence length ", total,
                   ", got ", o(segs));
    }
  }
  if (!(h0.data() == nullptr && h0.size() == 0)) check_rows(h0, segs, d, call, "h0", "one initial state per sequence");
  if (opt.check_inputs) {
    const double xm =
        reduce(b, x.size(), 0.0, max_op{}, abs_of<typename XV::value_type>{x.data(), m > 0 ? m : 1, x.stride(0)});
    LOOM_EXPECTS(std::isfinite(xm), errc::invalid_argument, call,
                 ": x holds non-finite values (NaN or inf); set options.check_inputs = false to let them propagate");
    if (h0.size() > 0) {
      const double hm =
          reduce(b, h0.size(), 0.0, max_op{}, abs_of<typename H0V::value_type>{h0.data(), d, h0.stride(0)});
      LOOM_EXPECTS(std::isfinite(hm), errc::invalid_argument, call, ": h0 holds non-finite values (NaN or inf)");
    }
  }
  if (opt.verify_jacobian) {
    if constexpr (Space::host_accessible) {
      using T = typename Cell::value_type;
      std::vector<T> hp(static_cast<std::size_t>(d));
      for (index_t t : {index_t{0}, n / 2, n - 1}) {
        if (t < 0 || t >= n) continue;
        for (index_t i = 0; i < d; ++i) hp[i] = static_cast<T>(0.3 * std::sin(1.7 * static_cast<double>(i + t) + 0.5));
        const auto r = check_jacobian(c, hp.data(), x.data() + t * x.stride(0));
        const double tol = std::is_same_v<T, double> ? 1e-5 : 2e-2;
        LOOM_EXPECTS(r.ok(tol), errc::invalid_argument, call, ": the cell's declared Jacobian (structure ", St::name(),
                     ") does not match finite differences at step ", t, ": max error ", r.max_error,
                     " inside the structure, ", r.max_outside, " outside it (tolerance ", tol, ")");
      }
    }
  }
  return segs;
}

//! The single-device context of the driver.
template <backend B, class T, class Space>
struct local_context {
  const B& b;
  tensor_view<const index_t, 1, Space> offsets;
  tensor_view<const T, 2, Space> init;
  index_t base() const { return 0; }
  const T* halo(const T*, index_t, index_t, T*) { return nullptr; }
  void all_max(std::vector<double>&) {}
  template <class St, class AV, class RV, class HV>
  void solve(St, AV a, RV rhs, HV h, bool with_init) {
    scan::linear_recurrence(b, St{}, a, rhs, h,
                            scan::segments<T, Space>{offsets, with_init ? init : tensor_view<const T, 2, Space>{}, {}});
  }
  template <class St, class AV, class GV, class LV, class DH0V>
  void adjoint(St, AV a, GV g, LV lambda, DH0V dh0) {
    scan::linear_recurrence_adjoint(b, St{}, a, g, lambda, scan::adjoint_segments<T, Space>{offsets, {}, dh0});
  }
  template <class DTV, class DH0V>
  void sum_gradients(DTV, DH0V) {}
  template <class F>
  void sequential(T*, index_t, index_t, index_t, T*, F&& run) {
    run(static_cast<const T*>(nullptr));
  }
};

}  // namespace detail

//! Solves h_t = f(h_{t-1}, x_t) for every t of every packed sequence (options.cu_seqlens) with
//! the iteration options.solver, h_{-1} = h0[s] per sequence. Converged sequences are frozen
//! (not re-linearized; their rows pass through the scan unchanged). A sequence whose residual goes
//! non-finite (a NaN or inf in its x or h0 with check_inputs off, or a diverging iterate) is frozen
//! too and the others iterate on, so sequences never change each other: each one's result has the
//! bits it would have next to any other sequences. The method then stops with reason non_finite
//! once no sequence is left iterating. If it stops without converging, options.on_failure decides
//! the fallback; the report states what ran and which sequences met the tolerance. h is written in
//! place (read first with initial_guess::warm_start).
//! @throws loom::error(shape_mismatch) for views that do not fit the cell; (invalid_argument) for
//! bad options or offsets, a block structure that does not divide d, non-finite x or h0 (with
//! check_inputs), a declared Jacobian that finite differences contradict (with verify_jacobian).
template <backend B, cell Cell, class XV, class H0V, class HV, class Space = typename backend_traits<B>::memory_space>
report newton_solve(const B& b, const Cell& c, XV x, H0V h0, HV h, const options<Space>& opt = {}) {
  using T = typename Cell::value_type;
  static_assert(std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "newton_solve: options<Space> must use the backend's memory space");
  const index_t segs = detail::validate(b, c, x, h0, h, x.extent(0), opt, "newton_solve");
  detail::local_context<B, T, Space> ctx{b, opt.cu_seqlens, h0};
  detail::engine<B, Cell, detail::local_context<B, T, Space>> e(
      b, c, ctx, x.data(), x.stride(0), h.data(), h.stride(0), x.extent(0), h0.size() ? h0.data() : nullptr,
      h0.stride(0), opt.cu_seqlens.extent(0) ? opt.cu_seqlens.data() : nullptr, segs, opt);
  return e.solve();
}

//! The exact sequential evaluation h_t = f(h_{t-1}, x_t), sequences in parallel, time steps in
//! order (the baseline Newton is measured against, and the last fallback stage). Same views and
//! validation as newton_solve (options: cu_seqlens, check_inputs).
template <backend B, cell Cell, class XV, class H0V, class HV, class Space = typename backend_traits<B>::memory_space>
void sequential_solve(const B& b, const Cell& c, XV x, H0V h0, HV h, const options<Space>& opt = {}) {
  using T = typename Cell::value_type;
  const index_t segs = detail::validate(b, c, x, h0, h, x.extent(0), opt, "sequential_solve");
  detail::local_context<B, T, Space> ctx{b, opt.cu_seqlens, h0};
  detail::engine<B, Cell, detail::local_context<B, T, Space>> e(
      b, c, ctx, x.data(), x.stride(0), h.data(), h.stride(0), x.extent(0), h0.size() ? h0.data() : nullptr,
      h0.stride(0), opt.cu_seqlens.extent(0) ? opt.cu_seqlens.data() : nullptr, segs, opt);
  e.sequential_all();
}

//! Gradients of a loss L given dh = ∂L/∂h at the solution h of newton_solve (same x, h0 and
//! options.cu_seqlens): λ_t = dh_t + A_{t+1}ᵀ λ_{t+1} by loom::scan::linear_recurrence_adjoint
//! with A_t = ∂f/∂h at the solution, then dx_t = (∂f/∂x_t)ᵀ λ_t, dtheta = Σ_t (∂f/∂θ)ᵀ λ_t
//! (summed in fixed chunks of 256 steps: bitwise reproducible) and dh0[s] = A_startᵀ λ_start.
//! dx [T, m] and dtheta [cell.param_size()] are written; dh0 [S, d] is optional (empty: skipped).
//! Work: one linearization, one adjoint scan, one vjp per step.
template <backend B, cell Cell, class XV, class H0V, class HV, class GV, class DXV, class DH0V, class DTV,
          class Space = typename backend_traits<B>::memory_space>
void backward(const B& b, const Cell& c, XV x, H0V h0, HV h, GV dh, DXV dx, DH0V dh0, DTV dtheta,
              const options<Space>& opt = {}) {
  using T = typename Cell::value_type;
  constexpr std::string_view call = "backward";
  const index_t segs = detail::validate(b, c, x, h0, h, x.extent(0), opt, call);
  const index_t n = x.extent(0), d = c.state_size();
  detail::check_rows(dh, n, d, call, "dh", "the gradient of h");
  detail::check_rows(dx, n, c.input_size(), call, "dx", "like x");
  if (dh0.size() > 0) detail::check_rows(dh0, segs, d, call, "dh0", "like h0");
  LOOM_EXPECTS(dtheta.extent(0) == c.param_size() && (dtheta.extent(0) <= 1 || dtheta.stride(0) == 1),
               errc::shape_mismatch, call, ": dtheta must be a contiguous [", c.param_size(),
               "] (cell.param_size()), got ", loom::detail::extents_string(dtheta));
  detail::local_context<B, T, Space> ctx{b, opt.cu_seqlens, h0};
  detail::engine<B, Cell, detail::local_context<B, T, Space>> e(
      b, c, ctx, x.data(), x.stride(0), const_cast<T*>(static_cast<const T*>(h.data())), h.stride(0), n,
      h0.size() ? h0.data() : nullptr, h0.stride(0), opt.cu_seqlens.extent(0) ? opt.cu_seqlens.data() : nullptr, segs,
      opt);
  e.backward(dh, dx, dh0, dtheta);
}

}  // namespace loom::rnn
