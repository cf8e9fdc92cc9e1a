#pragma once

//! @file
//! Options and report of loom::rnn::forward.

#include <loom/core/memory_space.hpp>
#include <loom/core/tensor_view.hpp>

#include <string_view>
#include <vector>

namespace loom::rnn {

//! How each iteration linearizes f (every one is a loom::scan linear recurrence):
//!   newton        A_t = ∂f/∂h in the cell's structure (DEER / ParaRNN); quadratic near the solution
//!   quasi_newton  A_t = diag(∂f/∂h) (quasi-DEER); O(d) scan work for any cell
//!   damped        increment δ with (1 + μ) δ_t − A_t δ_{t-1} = f_t − h_t, μ per sequence adapted
//!                 by accept/reject on the residual (Levenberg–Marquardt / trust-region style)
//!   picard        A_t = I (ELK's Picard): h_t ← h_{t-1} + f(h_{t-1}) − h_{t-1} summed by a scan
enum class method { newton, quasi_newton, damped, picard };

//! The first iterate: zeros, or whatever h holds on entry (a warm start, e.g. the previous step's
//! solution).
enum class initial_guess { zeros, warm_start };

//! What happens when the requested method does not converge (max_iterations or a non-finite
//! iterate): damped iterations (from the last iterate; sequences whose iterate went non-finite
//! restart from zeros), then the exact sequential evaluation of the sequences still not
//! converged; or the sequential evaluation directly; or nothing (the report says so and h holds
//! the last iterate, which may be non-finite).
enum class fallback { damped_then_sequential, sequential, none };

//! Why the requested method stopped.
enum class termination { converged, max_iterations, non_finite };

//! The last fallback stage that ran.
enum class fallback_taken { none, damped, sequential };

constexpr std::string_view to_string(method m) noexcept {
  constexpr std::string_view names[] = {"newton", "quasi_newton", "damped", "picard"};
  return static_cast<unsigned>(m) < std::size(names) ? names[static_cast<unsigned>(m)] : "?";
}
constexpr std::string_view to_string(termination t) noexcept {
  return t == termination::converged ? "converged" : t == termination::max_iterations ? "max_iterations" : "non_finite";
}
constexpr std::string_view to_string(fallback_taken f) noexcept {
  return f == fallback_taken::none ? "none" : f == fallback_taken::damped ? "damped" : "sequential";
}

//! Numbers of a solve, given to rnn::make_plan. A sequence is converged when every element of its
//! residual r_t = h_t − f(h_{t-1}, x_t) satisfies |r| <= abs_tol + rel_tol |h|. (The documents are
//! a loom::segments given to make_plan.)
struct options {
  method solver = method::newton;
  int max_iterations = 50;  //!< Newton steps (linear solves) of the requested method
  double abs_tol = 1e-6;
  double rel_tol = 1e-6;
  initial_guess guess = initial_guess::zeros;
  fallback on_failure = fallback::damped_then_sequential;
  int fallback_iterations = 50;  //!< damped steps of the fallback
  double damping = 1.0;          //!< initial μ of damped steps
  bool verify_jacobian = false;  //!< debug: compare the declared Jacobian with finite differences first
  bool check_inputs = true;      //!< reject non-finite x and h0 (one pass over each)
};

namespace detail {
struct report_access;
}

//! What a solve did. Never silent: a result that is not converged says so here. A report made
//! for a plan (`rnn::report rep(plan);`) holds room for everything a solve with that plan writes
//! (and the host-side state of the solve), so rnn::forward with a plan allocates nothing; the
//! convenience forms return a fresh one.
struct report {
  report() = default;
  //! Room for a solve with `plan` (S sequences, at most max_iterations + fallback_iterations + 2
  //! residual_history entries).
  template <class Plan>
  explicit report(const Plan& plan) {
    reserve(plan.sequences(), plan.opts().max_iterations + plan.opts().fallback_iterations + 2);
  }

  method requested = method::newton;
  int iterations = 0;  //!< linear solves done (requested method + damped fallback)
  //! residual_history[i]: the largest scaled residual max |r| / (abs_tol + rel_tol |h|) over the
  //! sequences not converged at iterate i (entry 0: the initial guess; 0 once all converged). A
  //! sequence whose residual went non-finite is frozen (the others go on) and left out of the
  //! entries after that iterate.
  std::vector<double> residual_history;
  std::vector<bool> converged;                  //!< per sequence, at the returned h
  std::vector<double> residual;                 //!< per sequence: scaled residual at the returned h
  termination reason = termination::converged;  //!< of the requested method
  fallback_taken fallback = fallback_taken::none;
  index_t fallback_sequences = 0;  //!< sequences the last fallback stage was run on
  bool all_converged() const {
    for (bool c : converged)
      if (!c) return false;
    return true;
  }

 private:
  friend struct detail::report_access;
  void reserve(index_t sequences, int history) {
    const auto s = static_cast<std::size_t>(sequences > 0 ? sequences : 0);
    residual_history.reserve(static_cast<std::size_t>(history > 0 ? history : 1));
    converged.reserve(s);
    residual.reserve(s);
    ints_.resize(4 * s);
    doubles_.resize(4 * s);
    sequences_ = sequences;
  }
  index_t sequences_ = -1;
  std::vector<int> ints_;        //!< host state of a solve: 4 arrays of S flags
  std::vector<double> doubles_;  //!< and 4 arrays of S values
};

}  // namespace loom::rnn
