#pragma once

//! @file
//! The Newton driver shared by the single-device and the sequence-parallel solver. A context
//! object supplies what differs: the halo row (h_{t-1} of the first local row), the linear solve
//! and its adjoint (loom::scan, local or across ranks), global reductions, and the sequential
//! fallback's hand-over between ranks. The control (norms, flags, report) runs on the host; the
//! per-row work runs on the backend through the generic loops.

#include <loom/backend/parallel.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/rnn/cells.hpp>
#include <loom/rnn/detail/kernels.hpp>
#include <loom/rnn/types.hpp>
#include <loom/scan/recurrence.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

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

//! n values from the backend's memory space to the host.
template <backend B, class T>
std::vector<T> read_back(const B& b, const T* p, index_t n) {
  std::vector<T> v(static_cast<std::size_t>(n));
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    fence(b);
    std::copy(p, p + n, v.begin());
  } else {
    for (index_t i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = reduce(b, 1, T(0), plus_op<T>{}, read_one<T>{p + i});
  }
  return v;
}

//! Host values into the backend's memory space.
template <backend B, class T>
void write_to(const B& b, T* p, const std::vector<T>& v) {
  if constexpr (backend_traits<B>::memory_space::host_accessible) {
    fence(b);
    std::copy(v.begin(), v.end(), p);
  } else {
    for (std::size_t i = 0; i < v.size(); ++i) for_each_index(b, 1, store_step<T>{p + i, v[i]});
  }
}

//! A scratch array in the backend's memory space.
template <backend B, class T>
struct scratch {
  std::unique_ptr<temporary_buffer<B, T>> buf;
  T* get(const B& b, index_t n) {
    if (!buf) buf = std::make_unique<temporary_buffer<B, T>>(b, n > 0 ? n : 1);
    return buf->data();
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
         index_t init_s, const index_t* offsets, index_t segs, const options<Space>& opt)
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
        opt_(opt) {
    map_ = row_map{offsets, segs, ctx.base()};
    zeros_ = zeros_buf_.get(b, d_);
    for_each_index(b, 1, zero_rows_step<T>{row_map{}, nullptr, zeros_, 0, d_});
    frozen_ = frozen_buf_.get(b, segs_);
    conv_.assign(static_cast<std::size_t>(segs_), 0);
    write_to(b_, frozen_, conv_);
    norms_.assign(static_cast<std::size_t>(segs_), INFINITY);
  }

  report solve() {
    report rep;
    rep.requested = opt_.solver;
    if (opt_.guess == initial_guess::zeros) for_each_index(b_, n_, zero_rows_step<T>{map_, nullptr, h_, hs_, d_});
    rep.reason = run(opt_.solver, opt_.max_iterations, rep);
    if (rep.reason != termination::converged && opt_.on_failure != fallback::none) {
      if (opt_.on_failure == fallback::damped_then_sequential && opt_.solver != method::damped) {
        rep.fallback = fallback_taken::damped;
        rep.fallback_sequences = unconverged();
        reset_nonfinite();
        mu_.assign(static_cast<std::size_t>(segs_), opt_.damping);
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
    rep.residual = norms_;
    return rep;
  }

  //! The exact sequential evaluation of every sequence.
  void sequential_all() {
    std::fill(conv_.begin(), conv_.end(), 0);
    sequential_fallback();
  }

  //! Gradients at the solution h (see rnn::backward).
  template <class GV, class DXV, class DH0V, class DTV>
  void backward(GV g, DXV dx, DH0V dh0, DTV dtheta) {
    const index_t as = St::a_size(d_);
    T* a = a_buf_.get(b_, n_ * as);
    T* f = f_buf_.get(b_, n_ * d_);
    double* norm = norm_buf_.get(b_, n_);
    const T* halo = ctx_.halo(h_, hs_, n_, halo_buf_.get(b_, d_));
    for_each_index(b_, n_,
                   linearize_step<Cell, St>{cell_, map_, prev_of(h_, hs_, halo), x_, xs_, f, a, nullptr, nullptr, norm,
                                            nullptr, d_, 1.0, 0.0, lin_mode::damped});
    T* lambda = rhs_buf_.get(b_, n_ * d_);
    const tensor_view<T, 2, Space> lv(lambda, {n_, d_});
    ctx_.adjoint(St{}, a_view<St, Space>(static_cast<const T*>(a), n_, d_), g, lv, dh0);
    const index_t np = cell_.param_size();
    const index_t chunk = 256, chunks = (n_ + chunk - 1) / chunk;
    T* part = part_buf_.get(b_, (chunks > 0 ? chunks : 1) * np);
    for_each_index(b_, chunks,
                   vjp_chunk_step<Cell>{cell_, map_, prev_of(h_, hs_, halo), x_, xs_, lambda, d_, dx.data(),
                                        dx.stride(0), part, np, chunk, n_});
    if (chunks == 0)
      for_each_index(b_, 1, zero_rows_step<T>{row_map{}, nullptr, dtheta.data(), 0, np});
    else
      for_each_index(b_, np, sum_parts_step<T>{part, chunks, np, dtheta.data()});
    ctx_.sum_gradients(dtheta, dh0);
  }

 private:
  prev_rows<T> prev_of(const T* h, index_t hs, const T* halo) const {
    return prev_rows<T>{h, hs, init_, init_s_, halo, zeros_};
  }

  index_t unconverged() const {
    index_t k = 0;
    for (auto c : conv_) k += c ? 0 : 1;
    return k;
  }

  //! Per-sequence maxima of norm[0, n) (global over ranks).
  std::vector<double> segment_norms(const double* norm) {
    std::vector<double> v;
    if (segs_ == 1) {
      v.assign(1, reduce(b_, n_, 0.0, max_op{}, read_rows{norm}));
    } else {
      double* out = seg_buf_.get(b_, segs_);
      for_each_index(b_, segs_, segment_max_step{map_, n_, norm, out});
      v = read_back(b_, out, segs_);
    }
    ctx_.all_max(v);
    return v;
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
    T* f = f_buf_.get(b_, n_ * d_);
    T* rhs = rhs_buf_.get(b_, n_ * d_);
    double* norm = norm_buf_.get(b_, n_);
    T* a = m != method::picard ? a_buf_.get(b_, n_ * as) : nullptr;
    T* ad = m == method::quasi_newton ? ad_buf_.get(b_, n_ * d_) : m == method::picard ? ad1_buf_.get(b_, n_) : nullptr;
    const lin_mode mode = m == method::newton         ? lin_mode::newton
                          : m == method::quasi_newton ? lin_mode::quasi
                          : m == method::picard       ? lin_mode::picard
                                                      : lin_mode::damped;
    // Sequences dropped in earlier runs are tried again (their rows were reset to zeros).
    write_to(b_, frozen_, conv_);
    std::vector<int> dropped(static_cast<std::size_t>(segs_), 0), stop(static_cast<std::size_t>(segs_), 0);
    bool any_dropped = false;
    for (int it = 0;; ++it) {
      const T* halo = ctx_.halo(h_, hs_, n_, halo_buf_.get(b_, d_));
      for_each_index(b_, n_,
                     linearize_step<Cell, St>{cell_, map_, prev_of(h_, hs_, halo), x_, xs_, f, a, ad, rhs, norm,
                                              frozen_, d_, opt_.abs_tol, opt_.rel_tol, mode});
      norms_ = segment_norms(norm);
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
      rep.residual_history.push_back(worst);
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
    if (mu_.size() != static_cast<std::size_t>(segs_)) mu_.assign(static_cast<std::size_t>(segs_), opt_.damping);
    double* mu = mu_buf_.get(b_, segs_);
    write_to(b_, mu, mu_);
    for_each_index(b_, n_, freeze_step<T>{map_, frozen_, a, as, rhs, h_, hs_, d_, true});
    for_each_index(b_, n_, damped_assemble_step<T>{map_, frozen_, mu, a, as, f, h_, hs_, rhs, d_});
    T* delta = delta_buf_.get(b_, n_ * d_);
    T* hc = hc_buf_.get(b_, n_ * d_);
    ctx_.solve(St{}, a_view<St, Space>(static_cast<const T*>(a), n_, d_), tensor_view<const T, 2, Space>(rhs, {n_, d_}),
               tensor_view<T, 2, Space>(delta, {n_, d_}), false);
    for_each_index(b_, n_, add_step<T>{h_, hs_, delta, hc, d_});
    const T* halo = ctx_.halo(hc, d_, n_, haloc_buf_.get(b_, d_));
    for_each_index(b_, n_,
                   linearize_step<Cell, St>{cell_, map_, prev_of(hc, d_, halo), x_, xs_, f, nullptr, nullptr, nullptr,
                                            norm, frozen_, d_, opt_.abs_tol, opt_.rel_tol, lin_mode::residual});
    const auto cand = segment_norms(norm);
    std::vector<int> take(static_cast<std::size_t>(segs_), 0);
    for (index_t s = 0; s < segs_; ++s) {
      if (conv_[s]) continue;
      if (std::isfinite(cand[s]) && cand[s] < norms_[s]) {
        take[s] = 1;
        mu_[s] /= 3;
      } else {
        mu_[s] = std::min(mu_[s] * 10 + 1e-3, 1e12);
      }
    }
    int* tk = take_buf_.get(b_, segs_);
    write_to(b_, tk, take);
    for_each_index(b_, n_, take_rows_step<T>{map_, tk, hc, d_, h_, hs_, d_});
  }

  //! Rows of sequences whose iterate went non-finite restart from zeros.
  void reset_nonfinite() {
    std::vector<int> bad(static_cast<std::size_t>(segs_), 0);
    bool any = false;
    for (index_t s = 0; s < segs_; ++s)
      if (!std::isfinite(norms_[s])) bad[s] = 1, any = true;
    if (!any) return;
    int* w = take_buf_.get(b_, segs_);
    write_to(b_, w, bad);
    for_each_index(b_, n_, zero_rows_step<T>{map_, w, h_, hs_, d_});
  }

  void sequential_fallback() {
    std::vector<int> which(static_cast<std::size_t>(segs_));
    for (index_t s = 0; s < segs_; ++s) which[s] = conv_[s] ? 0 : 1;
    int* w = take_buf_.get(b_, segs_);
    write_to(b_, w, which);
    ctx_.sequential(h_, hs_, n_, d_, halo_buf_.get(b_, d_), [&](const T* halo) {
      for_each_index(b_, segs_, sequential_step<Cell>{cell_, map_, prev_of(h_, hs_, halo), x_, xs_, h_, hs_, w, n_});
    });
  }

  //! norms_ at the current h (every sequence).
  void residuals() {
    std::vector<int> none(static_cast<std::size_t>(segs_), 0);
    write_to(b_, frozen_, none);
    double* norm = norm_buf_.get(b_, n_);
    T* f = f_buf_.get(b_, n_ * d_);
    const T* halo = ctx_.halo(h_, hs_, n_, halo_buf_.get(b_, d_));
    for_each_index(b_, n_,
                   linearize_step<Cell, St>{cell_, map_, prev_of(h_, hs_, halo), x_, xs_, f, nullptr, nullptr, nullptr,
                                            norm, frozen_, d_, opt_.abs_tol, opt_.rel_tol, lin_mode::residual});
    norms_ = segment_norms(norm);
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
  const options<Space>& opt_;
  row_map map_;
  T* zeros_ = nullptr;
  int* frozen_ = nullptr;
  std::vector<int> conv_;
  std::vector<double> norms_, mu_;
  scratch<B, T> zeros_buf_, f_buf_, rhs_buf_, a_buf_, ad_buf_, ad1_buf_, delta_buf_, hc_buf_, halo_buf_, haloc_buf_,
      part_buf_;
  scratch<B, double> norm_buf_, seg_buf_, mu_buf_;
  scratch<B, int> frozen_buf_, take_buf_;
};

}  // namespace loom::rnn::detail
