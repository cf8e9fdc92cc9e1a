#pragma once

//! @file
//! Parallel solution of a nonlinear recurrence h_t = f(h_{t-1}, x_t) for all t at once (DEER,
//! ParaRNN): Newton's method on the residual r_t = h_t − f(h_{t-1}, x_t), where each step is the
//! linear recurrence
//!   h^{new}_t = A_t h^{new}_{t-1} + b_t,  A_t = ∂f/∂h at h^{old}_{t-1},  b_t = f(h^{old}_{t-1}) − A_t h^{old}_{t-1}
//! solved by loom::scan::linear_recurrence in the cell's Jacobian structure, through scan plans the
//! rnn plan holds (scan's slicing, blocking and workspace layout). Backward: the adjoint
//! recurrence (loom::scan::linear_recurrence_adjoint) at the solution, then per-step input and
//! parameter gradients of the cell: no backpropagation through the iterations.
//!
//!   loom::rnn::para_gru<double> cell{theta, d};
//!   auto plan = loom::rnn::make_plan(b, cell, T, docs, {.max_iterations = 20});
//!   loom::workspace_buffer ws(plan.workspace_bytes());
//!   loom::rnn::report rep(plan);                                   // room for the report
//!   loom::rnn::forward(b, plan, cell, x, h0, h, rep, ws.span());  // allocates nothing
//!   loom::rnn::backward(b, plan, cell, x, h0, h, dh, dx, dh0, dtheta, ws.span());
//!   auto r = loom::rnn::forward(b, cell, x, h0, h, docs, opts);      // convenience
//!
//! The passes are named forward and backward as in every loom family; the iteration is a number
//! of the options (options.solver: Newton, quasi-Newton, damped, Picard); rnn::sequential is the
//! exact sequential evaluation. The plan holds the sizes (from the cell: d, m, param_size; the
//! steps T; the documents, validated once by loom::check_segments), the options, the three scan
//! plans of the linear solves and the workspace layout. It is immutable, reusable for any number
//! of calls and may be shared between threads for reading (each concurrent call needs its own
//! workspace, report and outputs). A call with a plan allocates nothing (the report made for the
//! plan holds the host-side state). Completion: on host backends a call is complete on return;
//! on device backends the per-row work is stream-ordered, but the convergence control reads
//! per-sequence norms back to the host every iteration (so forward synchronises once per
//! iteration).
//!
//! Views: x [T, m] (m = cell.input_size()), h [T, d] (d = cell.state_size()), h0 [S, d] (S =
//! docs.count(); empty: zeros); rows may be strided, each row contiguous. Workspace:
//! O(T (a_size(d) + 6 d)) elements plus the scan's. Work per iteration: one cell linearization
//! per step plus one scan (O(T d) diagonal, O(T d K) block-diagonal, O(T d³) dense).

#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>
#include <loom/rnn/cells.hpp>
#include <loom/rnn/detail/driver.hpp>
#include <loom/rnn/types.hpp>
#include <loom/scan/recurrence.hpp>

#include <cmath>
#include <span>
#include <string>

namespace loom::rnn {

template <backend B, cell Cell, memory_space Space, bool Across = false>
class plan;

namespace detail {
struct plan_access;
//! P is an rnn plan made for one rank (Across = false) or by the cross-rank make_plan.
template <class P, bool Across>
inline constexpr bool is_plan = false;
template <class B, class C, class S, bool A>
inline constexpr bool is_plan<plan<B, C, S, A>, A> = true;
}  // namespace detail

//! The plan of solves of cell's recurrence (see the file comment); made by rnn::make_plan.
template <backend B, cell Cell, memory_space Space, bool Across>
class plan {
 public:
  using backend_type = B;
  using cell_type = Cell;
  using value_type = typename Cell::value_type;
  using structure = typename Cell::structure;
  using space = Space;
  static constexpr bool across_ranks = Across;
  template <class St>
  using scan_plan = scan::recurrence_plan<B, St, Space, loom::accum_t<value_type>, Across>;

  //! Time steps (this rank's rows for a sequence-parallel plan).
  index_t size() const noexcept { return n_; }
  index_t state_size() const noexcept { return d_; }
  index_t input_size() const noexcept { return m_; }
  index_t param_size() const noexcept { return np_; }
  //! Sequences S (documents of the global sequence).
  index_t sequences() const noexcept { return docs_.count(); }
  const loom::segments<Space>& docs() const noexcept { return docs_; }
  const options& opts() const noexcept { return opt_; }
  //! Bytes of workspace of every call (forward, backward, sequential) with this plan.
  std::size_t workspace_bytes() const noexcept { return bytes_; }

 private:
  friend struct detail::plan_access;
  plan(scan_plan<structure> nw, scan_plan<scan::diagonal> qn, scan_plan<scan::scalar> pc)
      : newton_(nw), quasi_(qn), picard_(pc) {}
  index_t n_ = 0, d_ = 0, m_ = 0, np_ = 0;
  loom::segments<Space> docs_{};
  options opt_{};
  scan_plan<structure> newton_;
  scan_plan<scan::diagonal> quasi_;
  scan_plan<scan::scalar> picard_;
  detail::scratch_layout lay_{};
  std::size_t bytes_ = 0;
  index_t begin_ = 0;          //!< global index of local row 0
  int prev_ = -1, next_ = -1;  //!< nearest non-empty ranks before and after this one
};

namespace detail {

template <class V>
void check_rows(const V& v, index_t rows, index_t cols, std::string_view call, std::string_view name,
                std::string_view what) {
  expect_extents(v, {rows, cols}, call, name, what);
  LOOM_EXPECTS(v.extent(1) <= 1 || v.stride(1) == 1, errc::invalid_argument, call, ": the rows of ", name,
               " must be contiguous (stride 1 along dimension 1), got stride ", v.stride(1));
}

//! The numbers of a plan.
template <cell Cell>
void check_plan(const Cell& c, index_t n, const options& opt, std::string_view call) {
  using St = typename Cell::structure;
  const index_t d = c.state_size();
  LOOM_EXPECTS(n >= 0, errc::invalid_argument, call, ": the number of time steps must be >= 0, got ", n);
  LOOM_EXPECTS(d > 0, errc::invalid_argument, call, ": cell.state_size() must be > 0, got ", d);
  if constexpr (St::a_rank == 4)
    LOOM_EXPECTS(d % St::block == 0, errc::invalid_argument, call, ": the cell declares block_diagonal<", St::block,
                 "> but its state size ", d, " is not a multiple of ", St::block);
  LOOM_EXPECTS(opt.max_iterations >= 0, errc::invalid_argument, call, ": options.max_iterations must be >= 0, got ",
               opt.max_iterations);
  LOOM_EXPECTS(opt.fallback_iterations >= 0, errc::invalid_argument, call,
               ": options.fallback_iterations must be >= 0, got ", opt.fallback_iterations);
  LOOM_EXPECTS(opt.abs_tol >= 0 && opt.rel_tol >= 0 && opt.abs_tol + opt.rel_tol > 0, errc::invalid_argument, call,
               ": options.abs_tol and rel_tol must be >= 0 and not both 0, got ", opt.abs_tol, " and ", opt.rel_tol);
  LOOM_EXPECTS(opt.damping >= 0 && std::isfinite(opt.damping), errc::invalid_argument, call,
               ": options.damping must be finite and >= 0, got ", opt.damping);
}

struct plan_access {
  //! A plan over the window w of the global sequence (ranks/rank/prev/next: the slicing).
  template <bool Across, backend B, cell Cell, memory_space Space>
  static plan<B, Cell, Space, Across> make(const B& b, const Cell& c, const scan::detail::slices& s,
                                           const loom::segments<Space>& docs, const options& opt,
                                           std::string_view call) {
    using P = plan<B, Cell, Space, Across>;
    using T = typename Cell::value_type;
    using Acc = loom::accum_t<T>;
    using St = typename Cell::structure;
    check_plan(c, s.w.count, opt, call);
    const index_t d = c.state_size();
    const auto bound = loom::check_segments(docs, s.w.total, call, "docs");
    auto scan_plan = [&](auto st) {
      using S = decltype(st);
      if constexpr (Across)
        return scan::detail::cross_recurrence_plan<Acc, B, S>(b, s, d, bound, scan::options{}, call);
      else
        return scan::detail::recurrence_access::make<Acc, false, B, S>(b, s.w, d, bound, scan::options{}, call,
                                                                       scan::detail::no_extra{});
    };
    P p(scan_plan(St{}), scan_plan(scan::diagonal{}), scan_plan(scan::scalar{}));
    p.n_ = s.w.count;
    p.d_ = d;
    p.m_ = c.input_size();
    p.np_ = c.param_size();
    p.docs_ = bound;
    p.opt_ = opt;
    p.begin_ = s.w.begin;
    p.prev_ = s.prev;
    p.next_ = s.next;
    const std::size_t scan_bytes =
        std::max({p.newton_.workspace_bytes(), p.quasi_.workspace_bytes(), p.picard_.workspace_bytes()});
    workspace_layout lay;
    p.lay_ = scratch_layout::make<T>(lay, p.n_, p.d_, St::a_size(p.d_), p.docs_.count(), p.np_, scan_bytes);
    p.bytes_ = lay.bytes();
    return p;
  }
  template <class St, class P>
  static const auto& scan_plan(const P& p) {
    if constexpr (std::is_same_v<St, typename P::structure>)
      return p.newton_;
    else if constexpr (std::is_same_v<St, scan::diagonal>)
      return p.quasi_;
    else
      return p.picard_;
  }
  template <class P>
  static const scratch_layout& layout(const P& p) {
    return p.lay_;
  }
  template <class P>
  static index_t begin(const P& p) {
    return p.begin_;
  }
  template <class P>
  static std::pair<int, int> neighbours(const P& p) {
    return {p.prev_, p.next_};
  }
};

//! Checks a call's views against its plan and the inputs' values; returns the device scratch.
//! `local_x_check` false: the caller checks x collectively.
template <backend B, class Plan, class XV, class H0V, class HV>
scratch<typename Plan::value_type> check_call(const B& b, const Plan& p, const typename Plan::cell_type& c, XV x,
                                              H0V h0, HV h, std::span<std::byte> ws, std::string_view call,
                                              bool local_x_check = true) {
  using Cell = typename Plan::cell_type;
  using St = typename Cell::structure;
  using T = typename Cell::value_type;
  static_assert(std::is_same_v<typename Plan::backend_type, B>, "rnn: the plan was made for another backend");
  const index_t n = p.size(), d = p.state_size(), m = p.input_size();
  LOOM_EXPECTS(c.state_size() == d && c.input_size() == m && c.param_size() == p.param_size(), errc::shape_mismatch,
               call, ": the cell's sizes (state ", c.state_size(), ", input ", c.input_size(), ", parameters ",
               c.param_size(), ") differ from the plan's (", d, ", ", m, ", ", p.param_size(), ")");
  check_rows(x, n, m, call, "x", "time steps x cell.input_size()");
  check_rows(h, n, d, call, "h", "time steps of x x cell.state_size()");
  if (!(h0.data() == nullptr && h0.size() == 0))
    check_rows(h0, p.sequences(), d, call, "h0", "one initial state per sequence");
  check_workspace(ws, p.workspace_bytes(), call);
  const auto sp = plan_access::layout(p).template carve<T>(ws);
  if (p.opts().check_inputs) {
    if (local_x_check) {
      const double xm =
          reduce(b, x.size(), 0.0, max_op{}, abs_of<typename XV::value_type>{x.data(), m > 0 ? m : 1, x.stride(0)});
      LOOM_EXPECTS(std::isfinite(xm), errc::invalid_argument, call,
                   ": x holds non-finite values (NaN or inf); set options.check_inputs = false to let them propagate");
    }
    if (h0.size() > 0) {
      const double hm =
          reduce(b, h0.size(), 0.0, max_op{}, abs_of<typename H0V::value_type>{h0.data(), d, h0.stride(0)});
      LOOM_EXPECTS(std::isfinite(hm), errc::invalid_argument, call, ": h0 holds non-finite values (NaN or inf)");
    }
  }
  if (p.opts().verify_jacobian) {
    if constexpr (Plan::space::host_accessible) {
      T* hp = sp.zeros;  // d values of scratch (zeroed again by the solve)
      for (index_t t : {index_t{0}, n / 2, n - 1}) {
        if (t < 0 || t >= n) continue;
        for (index_t i = 0; i < d; ++i) hp[i] = static_cast<T>(0.3 * std::sin(1.7 * static_cast<double>(i + t) + 0.5));
        const auto r = check_jacobian(c, hp, x.data() + t * x.stride(0));
        const double tol = std::is_same_v<T, double> ? 1e-5 : 2e-2;
        LOOM_EXPECTS(r.ok(tol), errc::invalid_argument, call, ": the cell's declared Jacobian (structure ", St::name(),
                     ") does not match finite differences at step ", t, ": max error ", r.max_error,
                     " inside the structure, ", r.max_outside, " outside it (tolerance ", tol, ")");
      }
    }
  }
  return sp;
}

//! Checks backward's gradient views.
template <class Plan, class GV, class DXV, class DH0V, class DTV>
void check_gradients(const Plan& p, GV dh, DXV dx, DH0V dh0, DTV dtheta, std::string_view call) {
  const index_t n = p.size(), d = p.state_size();
  check_rows(dh, n, d, call, "dh", "the gradient of h");
  check_rows(dx, n, p.input_size(), call, "dx", "like x");
  if (dh0.size() > 0) check_rows(dh0, p.sequences(), d, call, "dh0", "like h0");
  LOOM_EXPECTS(dtheta.extent(0) == p.param_size() && (dtheta.extent(0) <= 1 || dtheta.stride(0) == 1),
               errc::shape_mismatch, call, ": dtheta must be a contiguous [", p.param_size(),
               "] (cell.param_size()), got ", loom::detail::extents_string(dtheta));
}

//! The single-device context of the driver: the linear solves through the plan's scan plans.
template <backend B, class Plan>
struct local_context {
  using T = typename Plan::value_type;
  using Space = typename Plan::space;
  const B& b;
  const Plan& p;
  tensor_view<const T, 2, Space> init;
  std::span<std::byte> scan_ws;
  index_t base() const { return 0; }
  const T* halo(const T*, index_t, index_t, T*) { return nullptr; }
  void all_max(std::span<double>) {}
  template <class St, class AV, class RV, class HV>
  void solve(St, AV a, RV rhs, HV h, bool with_init) {
    scan::linear_recurrence(b, plan_access::scan_plan<St>(p), a, rhs, h,
                            scan::states<T, Space>{with_init ? init : tensor_view<const T, 2, Space>{}, {}}, scan_ws);
  }
  template <class St, class AV, class GV, class LV, class DH0V>
  void adjoint(St, AV a, GV g, LV lambda, DH0V dh0) {
    scan::linear_recurrence_adjoint(b, plan_access::scan_plan<St>(p), a, g, lambda,
                                    scan::adjoint_states<T, Space>{{}, dh0}, scan_ws);
  }
  template <class DTV, class DH0V>
  void sum_gradients(DTV, DH0V) {}
  template <class F>
  void sequential(T*, index_t, index_t, index_t, T*, F&& run) {
    run(static_cast<const T*>(nullptr));
  }
};

template <class Plan, class H0V>
const typename Plan::value_type* init_of(const H0V& h0) {
  return h0.size() ? h0.data() : nullptr;
}

}  // namespace detail

//! The plan of solves of `c`'s recurrence over n time steps, packed as `docs` (S + 1 offsets,
//! int32 or int64, ending at n; implicit: one sequence). Only the cell's sizes and type are used.
//! @throws loom::error(invalid_argument) for bad options or docs, n < 0, a block structure that
//! does not divide d.
template <backend B, cell Cell, memory_space Space = typename backend_traits<B>::memory_space>
plan<B, Cell, Space, false> make_plan(const B& b, const Cell& c, index_t n, const loom::segments<Space>& docs = {},
                                      const options& opt = {}) {
  scan::detail::slices s;
  s.w = scan::detail::window{n, 0, n};
  return detail::plan_access::make<false>(b, c, s, docs, opt, "rnn::make_plan");
}

//! Solves h_t = f(h_{t-1}, x_t) for every t of every packed sequence with the iteration
//! options.solver, h_{-1} = h0[s] per sequence; writes h and `rep` (made for this plan).
//! Converged sequences are frozen (not re-linearized; their rows pass through the scan
//! unchanged). A sequence whose residual goes non-finite (a NaN or inf in its x or h0 with
//! check_inputs off, or a diverging iterate) is frozen too and the others iterate on, so sequences
//! never change each other: each one's result has the bits it would have next to any other
//! sequences. The method then stops with reason non_finite once no sequence is left iterating. If
//! it stops without converging, options.on_failure decides the fallback; the report states what
//! ran and which sequences met the tolerance. h is written in place (read first with
//! initial_guess::warm_start). Allocates nothing.
//! @throws loom::error(shape_mismatch) for views (or a cell) that do not fit the plan;
//! (invalid_argument) for a workspace below plan.workspace_bytes() or misaligned, a report not
//! made for this plan, non-finite x or h0 (with check_inputs), a declared Jacobian that finite
//! differences contradict (with verify_jacobian).
template <backend B, class Plan, class XV, class H0V, class HV>
requires detail::is_plan<Plan, false>
void forward(const B& b, const Plan& p, const typename Plan::cell_type& c, XV x, H0V h0, HV h, report& rep,
             std::span<std::byte> ws) {
  using Cell = typename Plan::cell_type;
  constexpr std::string_view call = "rnn::forward";
  const auto sp = detail::check_call(b, p, c, x, h0, h, ws, call);
  const auto hst = detail::report_access::state(rep, p.sequences(), call);
  detail::local_context<B, Plan> ctx{b, p, h0, ws.subspan(detail::plan_access::layout(p).scan)};
  detail::engine<B, Cell, detail::local_context<B, Plan>> e(
      b, c, ctx, x.data(), x.stride(0), h.data(), h.stride(0), p.size(), detail::init_of<Plan>(h0), h0.stride(0),
      scan::detail::ref_of(p.docs()), p.sequences(), p.opts(), sp, hst);
  e.solve(rep);
}

//! The exact sequential evaluation h_t = f(h_{t-1}, x_t), sequences in parallel, time steps in
//! order (the baseline Newton is measured against, and the last fallback stage). Same views and
//! checks as forward. Allocates nothing.
template <backend B, class Plan, class XV, class H0V, class HV>
requires detail::is_plan<Plan, false>
void sequential(const B& b, const Plan& p, const typename Plan::cell_type& c, XV x, H0V h0, HV h,
                std::span<std::byte> ws) {
  using Cell = typename Plan::cell_type;
  constexpr std::string_view call = "rnn::sequential";
  const auto sp = detail::check_call(b, p, c, x, h0, h, ws, call);
  // host flags of the sequences: the scratch's take array is all this needs (no report)
  detail::local_context<B, Plan> ctx{b, p, h0, ws.subspan(detail::plan_access::layout(p).scan)};
  detail::engine<B, Cell, detail::local_context<B, Plan>> e(
      b, c, ctx, x.data(), x.stride(0), h.data(), h.stride(0), p.size(), detail::init_of<Plan>(h0), h0.stride(0),
      scan::detail::ref_of(p.docs()), p.sequences(), p.opts(), sp, detail::host_state{});
  e.sequential_all();
}

//! Gradients of a loss L given dh = ∂L/∂h at the solution h of forward (same plan, x and h0):
//! λ_t = dh_t + A_{t+1}ᵀ λ_{t+1} by loom::scan::linear_recurrence_adjoint with A_t = ∂f/∂h at the
//! solution, then dx_t = (∂f/∂x_t)ᵀ λ_t, dtheta = Σ_t (∂f/∂θ)ᵀ λ_t (summed in fixed chunks of 256
//! steps: bitwise reproducible) and dh0[s] = A_startᵀ λ_start. dx [T, m] and dtheta
//! [cell.param_size()] are written; dh0 [S, d] is optional (empty: skipped). Work: one
//! linearization, one adjoint scan, one vjp per step. Allocates nothing.
template <backend B, class Plan, class XV, class H0V, class HV, class GV, class DXV, class DH0V, class DTV>
requires detail::is_plan<Plan, false>
void backward(const B& b, const Plan& p, const typename Plan::cell_type& c, XV x, H0V h0, HV h, GV dh, DXV dx, DH0V dh0,
              DTV dtheta, std::span<std::byte> ws) {
  using Cell = typename Plan::cell_type;
  using T = typename Cell::value_type;
  constexpr std::string_view call = "rnn::backward";
  const auto sp = detail::check_call(b, p, c, x, h0, h, ws, call);
  detail::check_gradients(p, dh, dx, dh0, dtheta, call);
  detail::local_context<B, Plan> ctx{b, p, h0, ws.subspan(detail::plan_access::layout(p).scan)};
  detail::engine<B, Cell, detail::local_context<B, Plan>> e(
      b, c, ctx, x.data(), x.stride(0), const_cast<T*>(static_cast<const T*>(h.data())), h.stride(0), p.size(),
      detail::init_of<Plan>(h0), h0.stride(0), scan::detail::ref_of(p.docs()), p.sequences(), p.opts(), sp,
      detail::host_state{});
  e.backward(dh, dx, dh0, dtheta);
}

//! Convenience forms: make_plan, a temporary workspace (and a report), the plan form, fence.
template <backend B, cell Cell, class XV, class H0V, class HV, memory_space Space>
report forward(const B& b, const Cell& c, XV x, H0V h0, HV h, const loom::segments<Space>& docs,
               const options& opt = {}) {
  const auto p = make_plan(b, c, x.extent(0), docs, opt);
  report rep(p);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, p, c, x, h0, h, rep, ws); });
  return rep;
}
template <backend B, cell Cell, class XV, class H0V, class HV>
report forward(const B& b, const Cell& c, XV x, H0V h0, HV h, const options& opt = {}) {
  return forward(b, c, x, h0, h, loom::segments<typename backend_traits<B>::memory_space>{}, opt);
}
template <backend B, cell Cell, class XV, class H0V, class HV, memory_space Space>
void sequential(const B& b, const Cell& c, XV x, H0V h0, HV h, const loom::segments<Space>& docs,
                const options& opt = {}) {
  const auto p = make_plan(b, c, x.extent(0), docs, opt);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { sequential(b, p, c, x, h0, h, ws); });
}
template <backend B, cell Cell, class XV, class H0V, class HV>
void sequential(const B& b, const Cell& c, XV x, H0V h0, HV h, const options& opt = {}) {
  sequential(b, c, x, h0, h, loom::segments<typename backend_traits<B>::memory_space>{}, opt);
}
template <backend B, cell Cell, class XV, class H0V, class HV, class GV, class DXV, class DH0V, class DTV,
          memory_space Space>
void backward(const B& b, const Cell& c, XV x, H0V h0, HV h, GV dh, DXV dx, DH0V dh0, DTV dtheta,
              const loom::segments<Space>& docs, const options& opt = {}) {
  const auto p = make_plan(b, c, x.extent(0), docs, opt);
  loom::detail::with_temporary_workspace(
      b, p.workspace_bytes(), [&](std::span<std::byte> ws) { backward(b, p, c, x, h0, h, dh, dx, dh0, dtheta, ws); });
}
template <backend B, cell Cell, class XV, class H0V, class HV, class GV, class DXV, class DH0V, class DTV>
void backward(const B& b, const Cell& c, XV x, H0V h0, HV h, GV dh, DXV dx, DH0V dh0, DTV dtheta,
              const options& opt = {}) {
  backward(b, c, x, h0, h, dh, dx, dh0, dtheta, loom::segments<typename backend_traits<B>::memory_space>{}, opt);
}

}  // namespace loom::rnn
