#pragma once

//! @file
//! The Newton driver shared by the single-device and the sequence-parallel solver. A context
//! object supplies what differs: the halo row (h_{t-1} of the first local row), the linear solve
//! and its adjoint (loom::scan, local or across ranks), global reductions, and the sequential
//! fallback's hand-over between ranks. The control (norms, flags, report) runs on the host; the
//! per-row work runs on the backend through the generic loops.

#include <loom/backend/copy.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/rnn/cells.hpp>
#include <loom/rnn/detail/kernels.hpp>
#include <loom/rnn/types.hpp>
#include <loom/scan/recurrence.hpp>

#include <algorithm>
#include <cmath>
#include <span>

namespace loom::rnn::detail {

template <class T>
struct read_one {
  const T* p;
  LOOM_HD T operator()(index_t) const { return *p; }
};
template <class T>
struct plus_op {
  LOOM_HD T operator()(T a, T b) const { return a + b; }
};

struct read_rows {
  const double* p;
  LOOM_HD double operator()(index_t i) const { return p[i]; }
};

//! v.size() values from the backend's memory space to the host: one transfer and a fence (a
//! backend without a copy: one reduction per value).
template <backend B, class T>
void read_back(const B& b, const T* p, std::span<T> v) {
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    fence(b);
    std::copy(p, p + v.size(), v.begin());
  } else if constexpr (loom::has_copy<B>) {
    copy_bytes(b, v.data(), p, v.size_bytes());
    fence(b);
  } else {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = reduce(b, 1, T(0), plus_op<T>{}, read_one<T>{p + i});
  }
}

//! Host values into the backend's memory space: one transfer, fenced so that the host values may
//! change on return (a backend without a copy: one stream-ordered store per value).
template <backend B, class T>
void write_to(const B& b, T* p, std::span<const T> v) {
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    fence(b);
    std::copy(v.begin(), v.end(), p);
  } else if constexpr (loom::has_copy<B>) {
    copy_bytes(b, p, v.data(), v.size_bytes());
    fence(b);
  } else {
    for (std::size_t i = 0; i < v.size(); ++i) for_each_index(b, 1, store_step<T>{p + i, v[i]});
  }
}
template <backend B, class T>
void write_to(const B& b, T* p, std::span<T> v) {
  write_to(b, p, std::span<const T>(v));
}

//! The device scratch of a solve: byte offsets in the workspace (fixed by the plan) and the
//! pointers carved from one workspace.
template <class T>
struct scratch {
  T *zeros, *f, *rhs, *a, *ad, *ad1, *delta, *hc, *halo, *haloc, *part;
  double *norm, *seg, *mu;
  int *frozen, *take;
};
struct scratch_layout {
  std::size_t zeros, f, rhs, a, ad, ad1, delta, hc, halo, haloc, part, norm, seg, mu, frozen, take, scan;
  //! Lays out the scratch of a solve over n local rows, d states, S sequences, np parameters,
  //! then `scan_bytes` for the linear solves.
  template <class T>
  static scratch_layout make(workspace_layout& lay, index_t n, index_t d, index_t as, index_t segs, index_t np,
                             std::size_t scan_bytes) {
    const index_t chunks = (n + 255) / 256;
    scratch_layout l{};
    l.zeros = lay.add<T>(d);
    l.f = lay.add<T>(n * d);
    l.rhs = lay.add<T>(n * d);
    l.a = lay.add<T>(n * as);
    l.ad = lay.add<T>(n * d);
    l.ad1 = lay.add<T>(n);
    l.delta = lay.add<T>(n * d);
    l.hc = lay.add<T>(n * d);
    l.halo = lay.add<T>(d);
    l.haloc = lay.add<T>(d);
    l.part = lay.add<T>((chunks > 0 ? chunks : 1) * np);
    l.norm = lay.add<double>(n);
    l.seg = lay.add<double>(segs);
    l.mu = lay.add<double>(segs);
    l.frozen = lay.add<int>(segs);
    l.take = lay.add<int>(segs);
    l.scan = lay.add<std::byte>(static_cast<index_t>(scan_bytes));
    return l;
  }
  template <class T>
  scratch<T> carve(std::span<std::byte> ws) const {
    const workspace_carver c(ws);
    return {c.at<T>(zeros),    c.at<T>(f),       c.at<T>(rhs),      c.at<T>(a),     c.at<T>(ad),   c.at<T>(ad1),
            c.at<T>(delta),    c.at<T>(hc),      c.at<T>(halo),     c.at<T>(haloc), c.at<T>(part), c.at<double>(norm),
            c.at<double>(seg), c.at<double>(mu), c.at<int>(frozen), c.at<int>(take)};
  }
};

//! The host-side state of a solve, in the report's room (see rnn::report).
struct host_state {
  std::span<int> conv, dropped, stop, tmp;
  std::span<double> norms, mu, cand;
};

struct report_access {
  static host_state state(report& r, index_t segs, std::string_view call) {
    LOOM_EXPECTS(r.sequences_ == segs, errc::invalid_argument, call,
                 ": the report was not made for this plan (rnn::report rep(plan)): it has room for ", r.sequences_,
                 " sequences, the plan has ", segs);
    const auto s = static_cast<std::size_t>(segs);
    std::span<int> i(r.ints_);
    std::span<double> v(r.doubles_);
    return {i.subspan(0, s), i.subspan(s, s), i.subspan(2 * s, s), i.subspan(3 * s, s),
            v.subspan(0, s), v.subspan(s, s), v.subspan(2 * s, s)};
  }
};

//! A view of A with the rank of structure St.
template <class St, class Space, class T>
auto a_view(T* p, index_t n, index_t d) {
  if constexpr (St::a_rank == 1)
    return tensor_view<T, 1, Space>(p, {n});
  else if constexpr (St::a_rank == 2)
    return tensor_view<T, 2, Space>(p, {n, d});
  else if constexpr (St::a_rank == 4)
    return tensor_view<T, 4, Space>(
        p, {n, d / St::block, static_cast<index_t>(St::block), static_cast<index_t>(St::block)});
  else
    return tensor_view<T, 3, Space>(p, {n, d, d});
}

//! Everything one solve works on: the problem (local rows) and the scratch arrays.
template <backend B, cell Cell, class Ctx>
class engine {
 public:
  using T = typename Cell::value_type;
  using St = typename Cell::structure;
  using Space = typename backend_traits<B>::memory_space;

  engine(const B& b, const Cell& c, Ctx& ctx, const T* x, index_t xs, T* h, index_t hs, index_t n, const T* init,
         index_t init_s, scan::detail::offsets_ref offsets, index_t segs, const options& opt, const scratch<T>& sp,
         const host_state& hst)
      : b_(b),
        cell_(c),
        ctx_(ctx),
        x_(x),
        xs_(xs),
        h_(h),
        hs_(hs),
        n_(n),
        d_(c.state_size()),
        init_(init),
        init_s_(init_s),
        segs_(segs),
        opt_(opt),
        sp_(sp),
        conv_(hst.conv),
        dropped_(hst.dropped),
        stop_(hst.stop),
        tmp_(hst.tmp),
        norms_(hst.norms),
        mu_(hst.mu),
        cand_(hst.cand) {
    map_ = row_map{offsets, segs, ctx.base()};
    zeros_ = sp_.zeros;
    for_each_index(b, 1, zero_rows_step<T>{row_map{}, nullptr, zeros_, 0, d_});
    frozen_ = sp_.frozen;
    std::fill(conv_.begin(), conv_.end(), 0);
    write_to(b_, frozen_, conv_);
    std::fill(norms_.begin(), norms_.end(), INFINITY);
  }

  void solve(report& rep) {
    rep.requested = opt_.solver;
    rep.iterations = 0;
    rep.residual_history.clear();
    rep.fallback = fallback_taken::none;
    rep.fallback_sequences = 0;
    if (opt_.guess == initial_guess::zeros) for_each_index(b_, n_, zero_rows_step<T>{map_, nullptr, h_, hs_, d_});
    rep.reason = run(opt_.solver, opt_.max_iterations, rep);
    if (rep.reason != termination::converged && opt_.on_failure != fallback::none) {
      if (opt_.on_failure == fallback::damped_then_sequential && opt_.solver != method::damped) {
        rep.fallback = fallback_taken::damped;
        rep.fallback_sequences = unconverged();
        reset_nonfinite();
        std::fill(mu_.begin(), mu_.end(), opt_.damping);
        mu_ready_ = true;
        run(method::damped, opt_.fallback_iterations, rep);
      }
      if (unconverged() > 0) {
        rep.fallback = fallback_taken::sequential;
        rep.fallback_sequences = unconverged();
        sequential_fallback();
        residuals();
        for (index_t s = 0; s < segs_; ++s) conv_[s] = norms_[s] <= 1.0 ? 1 : 0;
      }
    }
    rep.converged.resize(static_cast<std::size_t>(segs_));
    for (index_t s = 0; s < segs_; ++s) rep.converged[s] = conv_[s] != 0;
    rep.residual.assign(norms_.begin(), norms_.end());
  }

  //! The exact sequential evaluation of every sequence.
  void sequential_all() {
    ctx_.sequential(h_, hs_, n_, d_, sp_.halo, [&](const T* halo) {
      for_each_index(b_, segs_, sequential_step<Cell>{rows_of(h_, hs_, halo), h_, hs_, nullptr, n_});
    });
  }

  //! Gradients at the solution h (see rnn::backward).
  template <class GV, class DXV, class DH0V, class DTV>
  void backward(GV g, DXV dx, DH0V dh0, DTV dtheta) {
    const index_t as = St::a_size(d_);
    (void)as;
    T* a = sp_.a;
    T* f = sp_.f;
    double* norm = sp_.norm;
    const T* halo = ctx_.halo(h_, hs_, n_, sp_.halo);
    for_each_index(b_, n_,
                   linearize_step<Cell, St>{rows_of(h_, hs_, halo), f, a, nullptr, nullptr, norm, nullptr, d_, 1.0, 0.0,
                                            lin_mode::damped});
    T* lambda = sp_.rhs;
    const tensor_view<T, 2, Space> lv(lambda, {n_, d_});
    ctx_.adjoint(St{}, a_view<St, Space>(static_cast<const T*>(a), n_, d_), g, lv, dh0);
    const index_t np = cell_.param_size();
    const index_t chunk = 256, chunks = (n_ + chunk - 1) / chunk;
    T* part = sp_.part;
    for_each_index(
        b_, chunks,
        vjp_chunk_step<Cell>{rows_of(h_, hs_, halo), lambda, d_, dx.data(), dx.stride(0), part, np, chunk, n_});
    if (chunks == 0)
      for_each_index(b_, 1, zero_rows_step<T>{row_map{}, nullptr, dtheta.data(), 0, np});
    else
      for_each_index(b_, np, sum_parts_step<T>{part, chunks, np, dtheta.data()});
    ctx_.sum_gradients(dtheta, dh0);
  }

 private:
  //! The cell, its inputs and the entering states read from the iterate h (stride hs), halo from the left.
  cell_rows<Cell> rows_of(const T* h, index_t hs, const T* halo) const {
    return cell_rows<Cell>{cell_, map_, prev_rows<T>{h, hs, init_, init_s_, halo, zeros_}, x_, xs_};
  }

  index_t unconverged() const {
    index_t k = 0;
    for (auto c : conv_) k += c ? 0 : 1;
    return k;
  }

  //! Per-sequence maxima of norm[0, n) (global over ranks), into v.
  void segment_norms(const double* norm, std::span<double> v) {
    if (segs_ == 1) {
      v[0] = reduce(b_, n_, 0.0, max_op{}, read_rows{norm});
    } else {
      double* out = sp_.seg;
      for_each_index(b_, segs_, segment_max_step{map_, n_, norm, out});
      read_back(b_, static_cast<const double*>(out), v);
    }
    ctx_.all_max(v);
  }

  index_t a_elems(method m) const {
    if (m == method::picard) return 1;
    if (m == method::quasi_newton) return d_;
    return St::a_size(d_);
  }

  //! Iterates `m` from the current h; returns why it stopped. Updates conv_, norms_, rep.
  //! A sequence whose residual goes non-finite is dropped from this run (frozen like a converged
  //! one: its rows pass through every later solve unchanged) while the others go on, so one
  //! sequence's NaN or infinity never changes what happens to another; the run stops when no
  //! sequence is left iterating or the budget is spent, and reports non_finite if one was dropped.
  //! (residual_history leaves a dropped sequence out after the iterate where it went non-finite.)
  termination run(method m, int budget, report& rep) {
    const index_t as = St::a_size(d_);
    (void)as;
    T* f = sp_.f;
    T* rhs = sp_.rhs;
    double* norm = sp_.norm;
    T* a = m != method::picard ? sp_.a : nullptr;
    T* ad = m == method::quasi_newton ? sp_.ad : m == method::picard ? sp_.ad1 : nullptr;
    const lin_mode mode = m == method::newton         ? lin_mode::newton
                          : m == method::quasi_newton ? lin_mode::quasi
                          : m == method::picard       ? lin_mode::picard
                                                      : lin_mode::damped;
    // Sequences dropped in earlier runs are tried again (their rows were reset to zeros).
    write_to(b_, frozen_, conv_);
    auto dropped = dropped_, stop = stop_;
    std::fill(dropped.begin(), dropped.end(), 0);
    std::fill(stop.begin(), stop.end(), 0);
    bool any_dropped = false;
    for (int it = 0;; ++it) {
      const T* halo = ctx_.halo(h_, hs_, n_, sp_.halo);
      for_each_index(b_, n_,
                     linearize_step<Cell, St>{rows_of(h_, hs_, halo), f, a, ad, rhs, norm, frozen_, d_, opt_.abs_tol,
                                              opt_.rel_tol, mode});
      segment_norms(norm, norms_);
      double worst = 0;
      index_t active = 0, frozen = 0;
      for (index_t s = 0; s < segs_; ++s) {
        conv_[s] = norms_[s] <= 1.0 ? 1 : 0;
        if (dropped[s]) {  // its residual is the stale non-finite one
          ++frozen;
          continue;
        }
        if (!conv_[s]) worst = std::max(worst, norms_[s]);
        if (!std::isfinite(norms_[s])) dropped[s] = 1, any_dropped = true;
        stop[s] = conv_[s] || dropped[s] ? 1 : 0;
        active += stop[s] ? 0 : 1;
        frozen += stop[s];
      }
      if (rep.residual_history.size() < rep.residual_history.capacity()) rep.residual_history.push_back(worst);
      const termination failed = any_dropped ? termination::non_finite : termination::max_iterations;
      if (active == 0) return any_dropped ? termination::non_finite : termination::converged;
      if (it >= budget) return failed;
      write_to(b_, frozen_, stop);
      const index_t ae = a_elems(m);
      T* a_solve = (m == method::quasi_newton || m == method::picard) ? ad : a;
      if (m == method::damped) {
        damped_step(a, f, rhs, norm, rep);
      } else {
        if (frozen > 0) for_each_index(b_, n_, freeze_step<T>{map_, frozen_, a_solve, ae, rhs, h_, hs_, d_, false});
        const tensor_view<const T, 2, Space> rv(rhs, {n_, d_});
        const tensor_view<T, 2, Space> hv(h_, {n_, d_}, {hs_, 1});
        if (m == method::newton)
          ctx_.solve(St{}, a_view<St, Space>(static_cast<const T*>(a_solve), n_, d_), rv, hv, true);
        else if (m == method::quasi_newton)
          ctx_.solve(scan::diagonal{}, a_view<scan::diagonal, Space>(static_cast<const T*>(a_solve), n_, d_), rv, hv,
                     true);
        else
          ctx_.solve(scan::scalar{}, a_view<scan::scalar, Space>(static_cast<const T*>(a_solve), n_, d_), rv, hv, true);
      }
      ++rep.iterations;
    }
  }

  //! One damped step: solve for the increment with μ per sequence, accept it per sequence when
  //! the residual decreases (then μ /= 3), otherwise keep h and raise μ tenfold.
  void damped_step(T* a, T* f, T* rhs, double* norm, report&) {
    const index_t as = St::a_size(d_);
    if (!mu_ready_) std::fill(mu_.begin(), mu_.end(), opt_.damping), mu_ready_ = true;
    double* mu = sp_.mu;
    write_to(b_, mu, mu_);
    for_each_index(b_, n_, freeze_step<T>{map_, frozen_, a, as, rhs, h_, hs_, d_, true});
    for_each_index(b_, n_, damped_assemble_step<T>{map_, frozen_, mu, a, as, f, h_, hs_, rhs, d_});
    T* delta = sp_.delta;
    T* hc = sp_.hc;
    ctx_.solve(St{}, a_view<St, Space>(static_cast<const T*>(a), n_, d_), tensor_view<const T, 2, Space>(rhs, {n_, d_}),
               tensor_view<T, 2, Space>(delta, {n_, d_}), false);
    for_each_index(b_, n_, add_step<T>{h_, hs_, delta, hc, d_});
    const T* halo = ctx_.halo(hc, d_, n_, sp_.haloc);
    for_each_index(b_, n_,
                   linearize_step<Cell, St>{rows_of(hc, d_, halo), f, nullptr, nullptr, nullptr, norm, frozen_, d_,
                                            opt_.abs_tol, opt_.rel_tol, lin_mode::residual});
    const auto cand = cand_;
    segment_norms(norm, cand);
    const auto take = tmp_;
    std::fill(take.begin(), take.end(), 0);
    for (index_t s = 0; s < segs_; ++s) {
      if (conv_[s]) continue;
      if (std::isfinite(cand[s]) && cand[s] < norms_[s]) {
        take[s] = 1;
        mu_[s] /= 3;
      } else {
        mu_[s] = std::min(mu_[s] * 10 + 1e-3, 1e12);
      }
    }
    int* tk = sp_.take;
    write_to(b_, tk, take);
    for_each_index(b_, n_, take_rows_step<T>{map_, tk, hc, d_, h_, hs_, d_});
  }

  //! Rows of sequences whose iterate went non-finite restart from zeros.
  void reset_nonfinite() {
    const auto bad = tmp_;
    std::fill(bad.begin(), bad.end(), 0);
    bool any = false;
    for (index_t s = 0; s < segs_; ++s)
      if (!std::isfinite(norms_[s])) bad[s] = 1, any = true;
    if (!any) return;
    int* w = sp_.take;
    write_to(b_, w, bad);
    for_each_index(b_, n_, zero_rows_step<T>{map_, w, h_, hs_, d_});
  }

  void sequential_fallback() {
    const auto which = tmp_;
    for (index_t s = 0; s < segs_; ++s) which[s] = conv_[s] ? 0 : 1;
    int* w = sp_.take;
    write_to(b_, w, which);
    ctx_.sequential(h_, hs_, n_, d_, sp_.halo, [&](const T* halo) {
      for_each_index(b_, segs_, sequential_step<Cell>{rows_of(h_, hs_, halo), h_, hs_, w, n_});
    });
  }

  //! norms_ at the current h (every sequence).
  void residuals() {
    const auto none = tmp_;
    std::fill(none.begin(), none.end(), 0);
    write_to(b_, frozen_, none);
    double* norm = sp_.norm;
    T* f = sp_.f;
    const T* halo = ctx_.halo(h_, hs_, n_, sp_.halo);
    for_each_index(b_, n_,
                   linearize_step<Cell, St>{rows_of(h_, hs_, halo), f, nullptr, nullptr, nullptr, norm, frozen_, d_,
                                            opt_.abs_tol, opt_.rel_tol, lin_mode::residual});
    segment_norms(norm, norms_);
  }

  const B& b_;
  Cell cell_;
  Ctx& ctx_;
  const T* x_;
  index_t xs_;
  T* h_;
  index_t hs_, n_, d_;
  const T* init_;
  index_t init_s_, segs_;
  const options& opt_;
  scratch<T> sp_;
  row_map map_;
  T* zeros_ = nullptr;
  int* frozen_ = nullptr;
  std::span<int> conv_, dropped_, stop_, tmp_;
  std::span<double> norms_, mu_, cand_;
  bool mu_ready_ = false;
};

}  // namespace loom::rnn::detail
