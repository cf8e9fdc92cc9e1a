// The nonlinear-RNN solver: one body, instantiated per backend by loom_add_backend_test. Every
// result is compared with the token-by-token fp64 loop written here (the oracle); gradients with
// central finite differences of that loop and with backpropagation through time.

#include <loom/rnn/newton.hpp>

#include <support/allocations.hpp>
#include <support/backends.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using loom::index_t;
using loom::test::backend_under_test;
using loom::test::buffer;
using loom::test::make_backend;
using loom::test::workspace;
namespace lr = loom::rnn;
namespace lt = loom::test;

namespace {

using space = loom::backend_traits<backend_under_test>::memory_space;
template <class T, std::size_t R>
using view = loom::tensor_view<T, R, space>;

// A linear cell through the concept: f(h, x) = a ⊙ h + x (diagonal, exact Jacobian).
struct linear_cell {
  using value_type = double;
  using structure = loom::scan::diagonal;
  const double* theta = nullptr;
  index_t d = 0;
  LOOM_HD index_t state_size() const { return d; }
  LOOM_HD index_t input_size() const { return d; }
  LOOM_HD index_t param_size() const { return d; }
  LOOM_HD void step(const double* hp, const double* x, double* o) const {
    for (index_t i = 0; i < d; ++i) o[i] = theta[i] * hp[i] + x[i];
  }
  LOOM_HD void linearize(const double* hp, const double* x, double* f, double* a) const {
    step(hp, x, f);
    for (index_t i = 0; i < d; ++i) a[i] = theta[i];
  }
  LOOM_HD void vjp(const double* hp, const double*, const double* l, double* dx, double* dt) const {
    for (index_t i = 0; i < d; ++i) {
      dx[i] = l[i];
      dt[i] += l[i] * hp[i];
    }
  }
};

// A bounded chaotic scalar map: h' = 1.9 sin(2 h) + x (|f'| up to 3.8; iterates stay finite,
// unlike the logistic map's, whose Newton iterates overflow within a few iterations).
struct sine_cell {
  using value_type = double;
  using structure = loom::scan::diagonal;
  index_t d = 1;
  LOOM_HD index_t state_size() const { return d; }
  LOOM_HD index_t input_size() const { return d; }
  LOOM_HD index_t param_size() const { return 0; }
  LOOM_HD void step(const double* hp, const double* x, double* o) const {
    for (index_t i = 0; i < d; ++i) o[i] = 1.9 * sin(2 * hp[i]) + x[i];
  }
  LOOM_HD void linearize(const double* hp, const double* x, double* f, double* a) const {
    step(hp, x, f);
    for (index_t i = 0; i < d; ++i) a[i] = 3.8 * cos(2 * hp[i]);
  }
  LOOM_HD void vjp(const double*, const double*, const double* l, double* dx, double*) const {
    for (index_t i = 0; i < d; ++i) dx[i] = l[i];
  }
};

// A cell that declares a diagonal Jacobian but couples its channels (a wrong declaration).
struct mislabelled_cell {
  using value_type = double;
  using structure = loom::scan::diagonal;
  index_t d = 3;
  LOOM_HD index_t state_size() const { return d; }
  LOOM_HD index_t input_size() const { return d; }
  LOOM_HD index_t param_size() const { return 0; }
  LOOM_HD void step(const double* hp, const double* x, double* o) const {
    for (index_t i = 0; i < d; ++i) o[i] = tanh(0.5 * hp[i] + 0.4 * hp[(i + 1) % d] + x[i]);
  }
  LOOM_HD void linearize(const double* hp, const double* x, double* f, double* a) const {
    step(hp, x, f);
    for (index_t i = 0; i < d; ++i) a[i] = 0.5 * (1 - f[i] * f[i]);
  }
  LOOM_HD void vjp(const double*, const double*, const double* l, double* dx, double*) const {
    for (index_t i = 0; i < d; ++i) dx[i] = l[i];
  }
};

// A user cell declaring block_diagonal<2> with an odd state size (rejected).
struct odd_block {
  using value_type = double;
  using structure = loom::scan::block_diagonal<2>;
  LOOM_HD index_t state_size() const { return 3; }
  LOOM_HD index_t input_size() const { return 3; }
  LOOM_HD index_t param_size() const { return 0; }
  LOOM_HD void step(const double*, const double*, double*) const {}
  LOOM_HD void linearize(const double*, const double*, double*, double*) const {}
  LOOM_HD void vjp(const double*, const double*, const double*, double*, double*) const {}
};

// The problem of one test: parameters, inputs, packed offsets and initial states (host copies).
struct problem {
  index_t n = 0, d = 0, m = 0, segs = 1;
  std::vector<double> theta, x, h0;
  std::vector<index_t> offsets;  // empty: one sequence
};

std::vector<index_t> packed_offsets(index_t n, std::uint64_t stream) {
  auto g = lt::rng(stream);
  std::vector<index_t> o{0};
  if (n > 3) o.push_back(0);  // an empty sequence
  while (o.back() < n) o.push_back(std::min<index_t>(n, o.back() + 1 + static_cast<index_t>(g() % (n / 3 + 1))));
  return o;
}

// The oracle: the sequential loop in double, on host copies.
template <class Cell>
std::vector<double> sequential(const Cell& c, const problem& p) {
  std::vector<double> h(static_cast<std::size_t>(p.n * p.d)), zero(static_cast<std::size_t>(p.d), 0.0);
  const auto offs = p.offsets.empty() ? std::vector<index_t>{0, p.n} : p.offsets;
  for (std::size_t s = 0; s + 1 < offs.size(); ++s)
    for (index_t t = offs[s]; t < offs[s + 1]; ++t) {
      const double* hp = t == offs[s] ? (p.h0.empty() ? zero.data() : p.h0.data() + s * p.d) : h.data() + (t - 1) * p.d;
      c.step(hp, p.x.data() + t * p.m, h.data() + t * p.d);
    }
  return h;
}

template <class MakeCell>
problem make_problem(MakeCell make, index_t n, index_t d, bool packed, double theta_scale, std::uint64_t stream) {
  problem p;
  p.n = n;
  p.d = d;
  const auto probe = make(static_cast<const double*>(nullptr), d);
  p.m = probe.input_size();
  p.theta = lt::uniform<double>(probe.param_size(), -theta_scale, theta_scale, stream);
  p.x = lt::uniform<double>(n * p.m, -1, 1, stream + 1);
  if (packed) p.offsets = packed_offsets(n, stream + 2);
  p.segs = p.offsets.empty() ? 1 : static_cast<index_t>(p.offsets.size()) - 1;
  p.h0 = lt::uniform<double>(p.segs * probe.state_size(), -0.5, 0.5, stream + 3);
  p.d = probe.state_size();
  return p;
}

// Device copies of a problem, the solve, and the host result.
template <class MakeCell>
struct solved {
  std::vector<double> h;
  lr::report rep;
};

template <class MakeCell>
solved<MakeCell> solve(MakeCell make, const problem& p, lr::options opt, index_t d_arg,
                       const std::vector<double>* warm = nullptr) {
  buffer<double> theta(p.theta), x(p.x), h0(p.h0),
      h(warm ? *warm : std::vector<double>(static_cast<std::size_t>(p.n * p.d)));
  buffer<index_t> off(p.offsets);
  const auto c = make(static_cast<const double*>(theta.data()), d_arg);
  const loom::segments<space> docs =
      p.offsets.empty()
          ? loom::segments<space>{}
          : loom::segments<space>(view<const index_t, 1>(off.data(), {static_cast<index_t>(p.offsets.size())}));
  solved<MakeCell> r;
  r.rep =
      lr::forward(make_backend(), c, view<const double, 2>(x.data(), {p.n, p.m}),
                  view<const double, 2>(h0.data(), {p.segs, p.d}), view<double, 2>(h.data(), {p.n, p.d}), docs, opt);
  r.h = h.to_host();
  return r;
}

auto make_gru = [](const double* th, index_t d) { return lr::para_gru<double>{th, d}; };
auto make_lstm = [](const double* th, index_t u) { return lr::para_lstm_cifg<double>{th, u}; };
auto make_rnn = [](const double* th, index_t d) { return lr::tanh_rnn<double>{th, d}; };
auto make_linear = [](const double* th, index_t d) { return linear_cell{th, d}; };

const lt::tolerance tight{1e-8, 1e-9};

template <class MakeCell>
void check_against_loop(MakeCell make, index_t n, index_t d, bool packed, lr::method meth, double scale,
                        const std::string& what) {
  const problem p = make_problem(make, n, d, packed, scale, 100 + static_cast<std::uint64_t>(n * 7 + d));
  lr::options opt;
  opt.solver = meth;
  opt.abs_tol = 1e-11;
  opt.rel_tol = 0;
  opt.max_iterations = 200;
  opt.on_failure = lr::fallback::none;
  const auto r = solve(make, p, opt, d);
  const auto c = make(p.theta.data(), d);
  INFO(what << ": T = " << n << ", d = " << p.d << ", " << lr::to_string(meth) << ", iterations " << r.rep.iterations);
  CHECK(r.rep.reason == lr::termination::converged);
  CHECK(r.rep.all_converged());
  CHECK(r.rep.fallback == lr::fallback_taken::none);
  lt::require_close(r.h, sequential(c, p), tight, what);
}

}  // namespace

TEST_CASE("rnn: each cell against the sequential fp64 loop" LOOM_BACKEND_TAG, "[rnn]") {
  {  // every backend, device memory included (the inputs are uploaded, the results read back)
    for (index_t n : {1, 2, 100, 4097})
      for (index_t d : {1, 5, 64}) {
        if (n == 4097 && d == 64) continue;  // the big sizes for the cheap cells only
        check_against_loop(make_gru, n, d, n > 2, lr::method::newton, 1.0, "para_gru");
        check_against_loop(make_lstm, n, d, n > 2, lr::method::newton, 1.0, "para_lstm_cifg");
        if (n <= 100)
          check_against_loop(make_rnn, n, d, n > 2, lr::method::newton, 1.0 / std::sqrt(double(d)), "tanh_rnn");
      }
    check_against_loop(make_rnn, 4097, 5, true, lr::method::newton, 0.4, "tanh_rnn");
  }
}

TEST_CASE("rnn: quasi-Newton, damped and Picard reach the same solution" LOOM_BACKEND_TAG, "[rnn]") {
  {  // every backend, device memory included (the inputs are uploaded, the results read back)
    for (auto meth : {lr::method::quasi_newton, lr::method::damped, lr::method::picard}) {
      check_against_loop(make_gru, 100, 5, true, meth, 1.0, "para_gru");
      check_against_loop(make_lstm, 100, 5, true, meth, 1.0, "para_lstm_cifg");
      check_against_loop(make_rnn, 100, 5, true, meth, 0.3, "tanh_rnn");
    }
  }
}

TEST_CASE("rnn: a linear cell converges in one iteration" LOOM_BACKEND_TAG, "[rnn]") {
  {  // every backend, device memory included (the inputs are uploaded, the results read back)
    const problem p = make_problem(make_linear, 1000, 7, true, 1.0, 7);
    lr::options opt;
    opt.abs_tol = 1e-12;
    opt.rel_tol = 1e-12;
    const auto r = solve(make_linear, p, opt, 7);
    CHECK(r.rep.iterations == 1);
    CHECK(r.rep.residual_history.size() == 2);
    CHECK(r.rep.all_converged());
    lt::require_close(r.h, sequential(linear_cell{p.theta.data(), 7}, p), {1e-12, 1e-12}, "linear cell");
  }
}

TEST_CASE("rnn: full Newton is exact on the first i steps after i iterations (chaotic map)" LOOM_BACKEND_TAG, "[rnn]") {
  {  // every backend, device memory included (the inputs are uploaded, the results read back)
    problem p;
    p.n = 32;
    p.d = p.m = 1;
    p.x.assign(32, 0.0);
    p.h0 = {0.3};
    const auto want = sequential(sine_cell{}, p);
    auto make = [](const double*, index_t) { return sine_cell{}; };
    for (int i = 1; i <= 32; ++i) {
      lr::options opt;
      opt.max_iterations = i;
      opt.abs_tol = 1e-200;
      opt.rel_tol = 0;
      opt.on_failure = lr::fallback::none;
      const auto r = solve(make, p, opt, 1);
      INFO("after " << i << " iterations");
      // Newton fixes one more leading step per iteration; the map amplifies rounding by up to
      // 3.8x per step, so the exact prefix is checked with a tolerance that grows accordingly.
      for (int t = 0; t < i; ++t) CHECK(std::abs(r.h[t] - want[t]) <= 1e-14 * std::pow(4.0, t));
    }
  }
}

TEST_CASE("rnn: ParaGRU with moderate weights converges to 1e-6 in a few iterations" LOOM_BACKEND_TAG, "[rnn]") {
  {  // every backend, device memory included (the inputs are uploaded, the results read back)
    const problem p = make_problem(make_gru, 4096, 16, false, 1.0, 11);
    lr::options opt;
    opt.abs_tol = 1e-6;
    opt.rel_tol = 0;
    for (auto meth : {lr::method::newton, lr::method::quasi_newton}) {
      opt.solver = meth;
      const auto r = solve(make_gru, p, opt, 16);
      WARN("para_gru T = 4096, d = 16, " << lr::to_string(meth) << ": " << r.rep.iterations
                                         << " iterations, residual history (units of 1e-6):" << [&] {
                                              std::ostringstream os;
                                              for (double v : r.rep.residual_history) os << ' ' << v;
                                              return os.str();
                                            }());
      CHECK(r.rep.all_converged());
      CHECK(r.rep.iterations <= 8);
      lt::require_close(r.h, sequential(lr::para_gru<double>{p.theta.data(), 16}, p), {0, 1e-5}, "para_gru 1e-6");
    }
  }
}

TEST_CASE("rnn: a chaotic, badly scaled cell falls back and returns the sequential result" LOOM_BACKEND_TAG, "[rnn]") {
  {  // every backend, device memory included (the inputs are uploaded, the results read back)
    // tanh RNN with weights of scale 3 (spectral radius well above 1): Newton from zeros needs
    // far more than a handful of iterations.
    const problem p = make_problem(make_rnn, 2000, 8, true, 3.0, 13);
    const auto want = sequential(lr::tanh_rnn<double>{p.theta.data(), 8}, p);
    lr::options opt;
    opt.max_iterations = 3;
    opt.fallback_iterations = 3;
    opt.abs_tol = 1e-10;
    opt.rel_tol = 0;
    const auto r = solve(make_rnn, p, opt, 8);
    CHECK(r.rep.reason != lr::termination::converged);
    CHECK(r.rep.fallback == lr::fallback_taken::sequential);
    CHECK(r.rep.fallback_sequences > 0);
    CHECK(r.rep.all_converged());
    lt::require_close(r.h, want, {1e-12, 1e-12}, "chaotic tanh_rnn after fallback");
    // Without a fallback the report says the result is not converged.
    opt.on_failure = lr::fallback::none;
    const auto r2 = solve(make_rnn, p, opt, 8);
    CHECK(r2.rep.reason != lr::termination::converged);
    CHECK_FALSE(r2.rep.all_converged());
    CHECK(r2.rep.fallback == lr::fallback_taken::none);
    // The sequential-only fallback gives the same result.
    opt.on_failure = lr::fallback::sequential;
    const auto r3 = solve(make_rnn, p, opt, 8);
    CHECK(r3.rep.fallback == lr::fallback_taken::sequential);
    lt::require_close(r3.h, want, {1e-12, 1e-12}, "sequential fallback");
    // The 'difficult' DEER case: weights x100, inputs /100; never NaN in the result.
    problem q = make_problem(make_gru, 500, 2, false, 100.0, 17);
    for (auto& v : q.x) v /= 100;
    opt.on_failure = lr::fallback::damped_then_sequential;
    opt.max_iterations = 50;
    const auto r4 = solve(make_gru, q, opt, 2);
    CHECK(r4.rep.all_converged());
    lt::require_close(r4.h, sequential(lr::para_gru<double>{q.theta.data(), 2}, q), {1e-8, 1e-9}, "difficult GRU");
  }
}

TEST_CASE("rnn: converged sequences stop early, warm start" LOOM_BACKEND_TAG, "[rnn]") {
  {  // every backend, device memory included (the inputs are uploaded, the results read back)
    // One easy sequence (tiny weights would converge at once) next to long ones: all match.
    const problem p = make_problem(make_gru, 3000, 4, true, 1.0, 19);
    lr::options opt;
    opt.abs_tol = 1e-12;
    opt.rel_tol = 0;
    const auto r = solve(make_gru, p, opt, 4);
    CHECK(r.rep.all_converged());
    const auto want = sequential(lr::para_gru<double>{p.theta.data(), 4}, p);
    lt::require_close(r.h, want, tight, "packed para_gru");
    // A warm start at the solution converges with no iteration.
    opt.guess = lr::initial_guess::warm_start;
    const auto w = solve(make_gru, p, opt, 4, &want);
    CHECK(w.rep.iterations == 0);
    CHECK(w.rep.all_converged());
  }
}

namespace {
// L = Σ w ⊙ h over the sequential loop (host), for finite differences.
template <class MakeCell>
double loss(MakeCell make, const problem& p, index_t d_arg, const std::vector<double>& w) {
  const auto h = sequential(make(p.theta.data(), d_arg), p);
  double s = 0;
  for (std::size_t i = 0; i < h.size(); ++i) s += w[i] * h[i];
  return s;
}

// Backpropagation through time on the host: the reference gradient.
template <class Cell>
void bptt(const Cell& c, const problem& p, const std::vector<double>& h, const std::vector<double>& g,
          std::vector<double>& dx, std::vector<double>& dh0, std::vector<double>& dth) {
  using St = typename Cell::structure;
  const index_t d = p.d, m = p.m;
  dx.assign(p.x.size(), 0);
  dh0.assign(p.h0.size(), 0);
  dth.assign(p.theta.size(), 0);
  std::vector<double> zero(d, 0.0), f(d), a(St::a_size(d)), lam(d), carry(d);
  const auto offs = p.offsets.empty() ? std::vector<index_t>{0, p.n} : p.offsets;
  for (std::size_t s = 0; s + 1 < offs.size(); ++s) {
    std::fill(carry.begin(), carry.end(), 0.0);
    for (index_t t = offs[s + 1] - 1; t >= offs[s]; --t) {
      for (index_t i = 0; i < d; ++i) lam[i] = g[t * d + i] + carry[i];
      const double* hp = t == offs[s] ? p.h0.data() + s * d : h.data() + (t - 1) * d;
      c.vjp(hp, p.x.data() + t * m, lam.data(), dx.data() + t * m, dth.data());
      c.linearize(hp, p.x.data() + t * m, f.data(), a.data());
      St::matvec(a.data(), true, d, lam.data(), carry.data());
      if (t == offs[s])
        for (index_t i = 0; i < d; ++i) dh0[s * d + i] = carry[i];
    }
  }
}

template <class MakeCell>
void check_gradients(MakeCell make, index_t n, index_t d_arg, double scale, const std::string& what) {
  const problem p = make_problem(make, n, d_arg, true, scale, 300 + static_cast<std::uint64_t>(d_arg));
  const auto w = lt::uniform<double>(p.n * p.d, -1, 1, 400);
  buffer<double> theta(p.theta), x(p.x), h0(p.h0), h(sequential(make(p.theta.data(), d_arg), p)), g(w), dx(p.x.size()),
      dh0(p.h0.size()), dth(p.theta.size());
  buffer<index_t> off(p.offsets);
  lr::options opt;
  const std::vector<std::int32_t> off32(p.offsets.begin(), p.offsets.end());
  buffer<std::int32_t> o32(off32);  // int32 offsets here, int64 in solve()
  const loom::segments<space> docs(view<const std::int32_t, 1>(o32.data(), {static_cast<index_t>(off32.size())}));
  const auto c = make(static_cast<const double*>(theta.data()), d_arg);
  lr::backward(make_backend(), c, view<const double, 2>(x.data(), {p.n, p.m}),
               view<const double, 2>(h0.data(), {p.segs, p.d}), view<const double, 2>(h.data(), {p.n, p.d}),
               view<const double, 2>(g.data(), {p.n, p.d}), view<double, 2>(dx.data(), {p.n, p.m}),
               view<double, 2>(dh0.data(), {p.segs, p.d}),
               view<double, 1>(dth.data(), {static_cast<index_t>(p.theta.size())}), docs, opt);
  if constexpr (space::host_accessible) {
    std::vector<double> bx, bh0, bth;
    bptt(make(p.theta.data(), d_arg), p, h.to_host(), w, bx, bh0, bth);
    lt::require_close(dx.to_host(), bx, {1e-10, 1e-12}, what + " dx vs BPTT");
    lt::require_close(dh0.to_host(), bh0, {1e-10, 1e-12}, what + " dh0 vs BPTT");
    lt::require_close(dth.to_host(), bth, {1e-10, 1e-12}, what + " dtheta vs BPTT");
    // central finite differences of the sequential loop, on a few entries of each
    auto fd = [&](std::vector<double> problem::*field, std::size_t i) {
      problem q = p;
      const double e = 1e-6;
      (q.*field)[i] += e;
      const double lp = loss(make, q, d_arg, w);
      (q.*field)[i] -= 2 * e;
      return (lp - loss(make, q, d_arg, w)) / (2 * e);
    };
    const auto gx = dx.to_host(), gh0 = dh0.to_host(), gth = dth.to_host();
    for (std::size_t k = 0; k < 6; ++k) {
      const std::size_t ix = (k * 7919) % p.x.size(), ih = (k * 31) % p.h0.size(), it = (k * 13) % p.theta.size();
      CHECK(gx[ix] == Approx(fd(&problem::x, ix)).epsilon(1e-5).margin(1e-7));
      CHECK(gh0[ih] == Approx(fd(&problem::h0, ih)).epsilon(1e-5).margin(1e-7));
      CHECK(gth[it] == Approx(fd(&problem::theta, it)).epsilon(1e-5).margin(1e-7));
    }
  }
}
}  // namespace

TEST_CASE("rnn: gradients vs finite differences and backprop through time" LOOM_BACKEND_TAG, "[rnn][backward]") {
  check_gradients(make_gru, 300, 5, 1.0, "para_gru");
  check_gradients(make_lstm, 300, 3, 1.0, "para_lstm_cifg");
  check_gradients(make_rnn, 100, 5, 0.4, "tanh_rnn");
  check_gradients(make_linear, 700, 1, 1.0, "linear");
}

TEST_CASE("rnn: declared Jacobians match finite differences" LOOM_BACKEND_TAG, "[rnn]") {
  for (index_t d : {1, 2, 5}) {
    const auto th = lt::uniform<double>(64, -1, 1, 21);
    const auto x = lt::uniform<double>(64, -1, 1, 22);
    const auto hp = lt::uniform<double>(64, -1, 1, 23);
    CHECK(lr::check_jacobian(lr::para_gru<double>{th.data(), d}, hp.data(), x.data()).ok(1e-6));
    CHECK(lr::check_jacobian(lr::para_lstm_cifg<double>{th.data(), d}, hp.data(), x.data()).ok(1e-6));
    CHECK(lr::check_jacobian(lr::tanh_rnn<double>{th.data(), d}, hp.data(), x.data()).ok(1e-6));
  }
  const double x3[3] = {0.1, 0.2, 0.3}, h3[3] = {0.5, -0.2, 0.4};
  const auto r = lr::check_jacobian(mislabelled_cell{}, h3, x3);
  CHECK(r.max_error < 1e-6);
  CHECK(r.max_outside > 0.1);
}

TEST_CASE("rnn: rejections" LOOM_BACKEND_TAG, "[rnn][errors]") {
  const problem p = make_problem(make_gru, 10, 3, false, 1.0, 31);
  buffer<double> theta(p.theta), x(p.x), h0(p.h0), h(p.n * p.d), bad_x(std::vector<double>(p.x.size(), NAN));
  const auto c = make_gru(static_cast<const double*>(theta.data()), 3);
  const auto b = make_backend();
  const view<const double, 2> xv(x.data(), {p.n, p.m}), h0v(h0.data(), {1, p.d});
  const view<double, 2> hv(h.data(), {p.n, p.d});
  auto expect = [](auto&& f, loom::errc code, const std::string& needle) {
    try {
      f();
      FAIL("no error thrown, expected " << needle);
    } catch (const loom::error& e) {
      CHECK(e.code() == code);
      CHECK_THAT(e.what(), Catch::Contains(needle));
    }
  };
  lr::options opt;
  expect(
      [&] {
        lr::forward(b, c, view<const double, 2>(x.data(), {p.n, p.m - 1}), h0v, hv, opt);
      },
      loom::errc::shape_mismatch, "x must be [10, 9]");
  expect(
      [&] {
        lr::forward(b, c, xv, h0v, view<double, 2>(h.data(), {p.n - 1, p.d}), opt);
      },
      loom::errc::shape_mismatch, "h must be [10, 3]");
  expect(
      [&] {
        lr::forward(b, c, xv, view<const double, 2>(h0.data(), {2, p.d}), hv, opt);
      },
      loom::errc::shape_mismatch, "h0 must be [1, 3]");
  expect(
      [&] {
        lr::forward(b, c, view<const double, 2>(bad_x.data(), {p.n, p.m}), h0v, hv, opt);
      },
      loom::errc::invalid_argument, "x holds non-finite values");
  {
    auto o = opt;
    o.max_iterations = -1;
    expect([&] { lr::forward(b, c, xv, h0v, hv, o); }, loom::errc::invalid_argument, "max_iterations must be >= 0");
    o = opt;
    o.abs_tol = 0;
    o.rel_tol = 0;
    expect([&] { lr::forward(b, c, xv, h0v, hv, o); }, loom::errc::invalid_argument, "not both 0");
  }
  {  // a block-diagonal<2> cell whose state size is odd cannot exist: LSTM state is 2u; a user
     // cell declaring block_diagonal<2> with d = 3 is rejected
    buffer<double> x3(std::vector<double>(30, 0.0));
    expect(
        [&] {
          lr::forward(b, odd_block{}, view<const double, 2>(x3.data(), {10, 3}), h0v, hv, opt);
        },
        loom::errc::invalid_argument, "declares block_diagonal<2> but its state size 3");
  }
  if constexpr (space::host_accessible) {
    const std::vector<index_t> bad_off{0, 4, 3, 10}, short_off{0, 4, 9};
    auto o = opt;
    expect(
        [&] {
          lr::forward(b, c, xv, view<const double, 2>{}, hv,
                      loom::segments<space>(view<const index_t, 1>(bad_off.data(), {4})), o);
        },
        loom::errc::invalid_argument, "non-decreasing");
    expect(
        [&] {
          lr::forward(b, c, xv, view<const double, 2>{}, hv,
                      loom::segments<space>(view<const index_t, 1>(short_off.data(), {3})), o);
        },
        loom::errc::invalid_argument, "must equal the token count 10");
    // a declared structure that does not match the cell (with verify_jacobian)
    const std::vector<double> x3(30, 0.1);
    std::vector<double> h3(30);
    o = opt;
    o.verify_jacobian = true;
    expect(
        [&] {
          lr::forward(b, mislabelled_cell{}, view<const double, 2>(x3.data(), {10, 3}), view<const double, 2>{},
                      view<double, 2>(h3.data(), {10, 3}), o);
        },
        loom::errc::invalid_argument, "declared Jacobian (structure diagonal) does not match");
  }
}

namespace {

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(double) * a.size()) == 0;
}

}  // namespace

TEST_CASE(
    "rnn plans: no allocation per call, reuse across calls and threads, int32 and int64 offsets, workspace "
    "rejections" LOOM_BACKEND_TAG,
    "[rnn][plan]") {
  const problem p = make_problem(make_gru, 1021, 5, true, 1.0, 77);
  const auto w = lt::uniform<double>(p.n * p.d, -1, 1, 78);
  buffer<double> theta(p.theta), x(p.x), h0(p.h0), g(w);
  buffer<index_t> off(p.offsets);
  buffer<std::int32_t> off32(std::vector<std::int32_t>(p.offsets.begin(), p.offsets.end()));
  const auto c = make_gru(static_cast<const double*>(theta.data()), 5);
  const auto b = make_backend();
  const view<const double, 2> xv(x.data(), {p.n, p.m}), h0v(h0.data(), {p.segs, p.d}), gv(g.data(), {p.n, p.d});
  const auto no = static_cast<index_t>(p.offsets.size());
  lr::options opt;
  opt.abs_tol = 1e-10;
  opt.rel_tol = 0;
  // references: the convenience forms (fresh plans), int64 offsets
  const loom::segments<space> docs64(view<const index_t, 1>(off.data(), {no}));
  const loom::segments<space> docs32(view<const std::int32_t, 1>(off32.data(), {no}));
  buffer<double> href(static_cast<std::size_t>(p.n * p.d)), dxref(p.x.size()), dh0ref(p.h0.size()),
      dthref(p.theta.size());
  const auto rep_ref = lr::forward(b, c, xv, h0v, view<double, 2>(href.data(), {p.n, p.d}), docs64, opt);
  REQUIRE(rep_ref.all_converged());
  const view<const double, 2> hrv(href.data(), {p.n, p.d});
  lr::backward(b, c, xv, h0v, hrv, gv, view<double, 2>(dxref.data(), {p.n, p.m}),
               view<double, 2>(dh0ref.data(), {p.segs, p.d}),
               view<double, 1>(dthref.data(), {static_cast<index_t>(p.theta.size())}), docs64, opt);
  const auto want_h = href.to_host(), want_dx = dxref.to_host(), want_dth = dthref.to_host();
  // one plan (int32 offsets), three calls: nothing allocated, the same bits
  const auto plan = lr::make_plan(b, c, p.n, docs32, opt);
  REQUIRE(plan.sequences() == p.segs);
  const workspace ws(plan.workspace_bytes());
  lr::report rep(plan);
  buffer<double> h(static_cast<std::size_t>(p.n * p.d)), dx(p.x.size()), dh0(p.h0.size()), dth(p.theta.size());
  for (int call = 0; call < 3; ++call) {
    const auto count = lt::count_allocations([&] {
      lr::forward(b, plan, c, xv, h0v, view<double, 2>(h.data(), {p.n, p.d}), rep, ws.span());
      lr::backward(b, plan, c, xv, h0v, view<const double, 2>(h.data(), {p.n, p.d}), gv,
                   view<double, 2>(dx.data(), {p.n, p.m}), view<double, 2>(dh0.data(), {p.segs, p.d}),
                   view<double, 1>(dth.data(), {static_cast<index_t>(p.theta.size())}), ws.span());
    });
    CHECK(count.heap == 0);
    CHECK(count.temporaries == 0);
    CHECK(rep.iterations == rep_ref.iterations);
    CHECK(rep.residual_history == rep_ref.residual_history);
    REQUIRE(same_bits(h.to_host(), want_h));
    REQUIRE(same_bits(dx.to_host(), want_dx));
    REQUIRE(same_bits(dth.to_host(), want_dth));
  }
  // two threads share the plan, each with its own workspace, report and output
  if constexpr (space::host_accessible) {
    std::vector<double> got[2];
    std::thread t[2];
    for (int k = 0; k < 2; ++k)
      t[k] = std::thread([&, k] {
        const workspace mine(plan.workspace_bytes());
        lr::report r(plan);
        std::vector<double> hk(static_cast<std::size_t>(p.n * p.d));
        lr::forward(b, plan, c, xv, h0v, view<double, 2>(hk.data(), {p.n, p.d}), r, mine.span());
        got[k] = hk;
      });
    for (auto& th : t) th.join();
    REQUIRE(same_bits(got[0], want_h));
    REQUIRE(same_bits(got[1], want_h));
  }
  // rejections: a small or misaligned workspace, a report of another plan, views off the plan
  const view<double, 2> hv(h.data(), {p.n, p.d});
  lt::require_loom_error([&] { lr::forward(b, plan, c, xv, h0v, hv, rep, ws.span().first(64)); },
                         loom::errc::invalid_argument, {"rnn::forward: workspace must hold at least"});
  const workspace ws2(plan.workspace_bytes() + 16);
  lt::require_loom_error([&] { lr::forward(b, plan, c, xv, h0v, hv, rep, ws2.span(16)); }, loom::errc::invalid_argument,
                         {"rnn::forward: workspace must start on a 64-byte boundary"});
  lr::report other(lr::make_plan(b, c, p.n, loom::segments<space>{}, opt));
  lt::require_loom_error([&] { lr::forward(b, plan, c, xv, h0v, hv, other, ws.span()); }, loom::errc::invalid_argument,
                         {"rnn::forward: the report was not made for this plan"});
  lt::require_loom_error([&] { lr::forward(b, plan, c, xv.slice(0, p.n - 1), h0v, hv, rep, ws.span()); },
                         loom::errc::shape_mismatch, {"rnn::forward: x must be"});
  const auto c4 = make_gru(static_cast<const double*>(theta.data()), 4);
  lt::require_loom_error([&] { lr::sequential(b, plan, c4, xv, h0v, hv, ws.span()); }, loom::errc::shape_mismatch,
                         {"rnn::sequential: the cell's sizes"});
  lt::require_loom_error([&] { (void)lr::make_plan(b, c, -1, loom::segments<space>{}, opt); },
                         loom::errc::invalid_argument, {"rnn::make_plan: the number of time steps must be >= 0"});
}

#if defined(LOOM_TEST_BACKEND_STANDIN)
// On a device the host steers the iterations: per iteration one device reduction and one host
// read of the per-sequence norms, one write of the per-sequence flags, whatever the number of
// sequences (not one reduction or launch per sequence). Counted as operations on the stand-in's
// stream, for 1 and 61 sequences of the same problem; the solutions match the sequential loop.
TEST_CASE("rnn on a device: stream operations per iteration do not grow with the sequences", "[rnn][standin]") {
  const index_t len = 29, many = 61;
  double per_iteration[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    const index_t segs = k == 0 ? 1 : many;
    problem p = make_problem(make_gru, len * segs, 4, true, 1.0, 91);
    p.offsets.clear();
    for (index_t s = 0; s <= segs; ++s) p.offsets.push_back(s * len);
    p.segs = segs;
    p.h0 = lt::uniform<double>(segs * p.d, -0.5, 0.5, 92);
    buffer<double> theta(p.theta), x(p.x), h0(p.h0), h(static_cast<std::size_t>(p.n * p.d));
    buffer<index_t> off(p.offsets);
    const auto c = make_gru(static_cast<const double*>(theta.data()), 4);
    const auto b = make_backend();
    const loom::segments<space> docs(view<const index_t, 1>(off.data(), {segs + 1}));
    lr::options opt;
    opt.abs_tol = 1e-11;
    opt.rel_tol = 0;
    opt.on_failure = lr::fallback::none;
    const auto plan = lr::make_plan(b, c, p.n, docs, opt);
    const workspace ws(plan.workspace_bytes());
    lr::report rep(plan);
    loom::fence(b);
    const std::uint64_t before = b.queue().last();
    lr::forward(b, plan, c, view<const double, 2>(x.data(), {p.n, p.m}), view<const double, 2>(h0.data(), {segs, p.d}),
                view<double, 2>(h.data(), {p.n, p.d}), rep, ws.span());
    loom::fence(b);
    const auto ops = static_cast<double>(b.queue().last() - before);
    INFO("sequences " << segs << ": " << ops << " stream operations, " << rep.iterations << " iterations");
    REQUIRE(rep.all_converged());
    REQUIRE(rep.iterations >= 2);
    per_iteration[k] = ops / (rep.iterations + 1);
    lt::require_close(h.to_host(), sequential(c, p), tight, "gru, equal sequences");
  }
  INFO("operations per iteration: 1 sequence " << per_iteration[0] << ", " << many << " sequences "
                                               << per_iteration[1]);
  CHECK(per_iteration[1] <= per_iteration[0] + 4);
}
#endif
