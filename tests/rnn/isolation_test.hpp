// The Newton solver and its backward: a NaN or an infinity in one packed sequence's inputs (x, its
// row of h0; dh in the backward), with input checks off, leaves every other sequence's solution,
// convergence, dx and dh0 with the same bits as a run in which that sequence is clean. The
// poisoned sequence shows it: the sequential loop's NaN where it has one (and its report says not
// converged), the loop's values elsewhere. One body, swept over the backends.

#include <loom/rnn/newton.hpp>

#include <support/backends.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "../scan/poison.hpp"

using loom::index_t;
using loom::test::buffer;
using loom::test::make_backend;
namespace lr = loom::rnn;
namespace lt = loom::test;
namespace lp = loom::test::poison;

namespace {

using space = loom::test::space;
template <class T, std::size_t R>
using view = loom::tensor_view<T, R, space>;

struct rnn_problem {
  index_t n = 0, d = 0, m = 0, segs = 0, np = 0;
  std::vector<double> theta, x, h0, g;
  std::vector<index_t> off;
};

template <class Make>
rnn_problem make_problem(Make make, index_t n, index_t d_arg, double scale, std::uint64_t stream) {
  rnn_problem p;
  const auto probe = make(static_cast<const double*>(nullptr), d_arg);
  p.n = n, p.d = probe.state_size(), p.m = probe.input_size(), p.np = probe.param_size();
  p.off = lp::documents(n);
  p.segs = lp::docs(p.off);
  p.theta = lt::uniform<double>(p.np, -scale, scale, stream);
  p.x = lt::uniform<double>(n * p.m, -1, 1, stream + 1);
  p.h0 = lt::uniform<double>(p.segs * p.d, -0.5, 0.5, stream + 2);
  p.g = lt::uniform<double>(n * p.d, -1, 1, stream + 3);
  return p;
}

struct rnn_result {
  std::vector<double> h, dx, dh0, dth;
  lr::report rep;
};

//! rnn::forward, then backward at its solution (input checks off).
template <class Make>
rnn_result run(Make make, const rnn_problem& p, index_t d_arg, lr::options opt) {
  const auto b = make_backend();
  buffer<double> theta(p.theta), x(p.x), h0(p.h0), g(p.g), h(static_cast<std::size_t>(p.n * p.d)), dx(p.x.size()),
      dh0(p.h0.size()), dth(static_cast<std::size_t>(p.np));
  buffer<index_t> off(p.off);
  const loom::segments<space> docs(view<const index_t, 1>(off.data(), {p.segs + 1}));
  opt.check_inputs = false;
  const auto c = make(static_cast<const double*>(theta.data()), d_arg);
  const view<const double, 2> xv(x.data(), {p.n, p.m}), h0v(h0.data(), {p.segs, p.d});
  rnn_result r;
  r.rep = lr::forward(b, c, xv, h0v, view<double, 2>(h.data(), {p.n, p.d}), docs, opt);
  lr::backward(b, c, xv, h0v, view<const double, 2>(h.data(), {p.n, p.d}), view<const double, 2>(g.data(), {p.n, p.d}),
               view<double, 2>(dx.data(), {p.n, p.m}), view<double, 2>(dh0.data(), {p.segs, p.d}),
               view<double, 1>(dth.data(), {p.np}), docs, opt);
  r.h = h.to_host(), r.dx = dx.to_host(), r.dh0 = dh0.to_host(), r.dth = dth.to_host();
  return r;
}

//! The sequential fp64 loop on the host.
template <class Cell>
std::vector<double> sequential(const Cell& c, const rnn_problem& p) {
  std::vector<double> h(static_cast<std::size_t>(p.n * p.d));
  for (std::size_t s = 0; s + 1 < p.off.size(); ++s)
    for (index_t t = p.off[s]; t < p.off[s + 1]; ++t)
      c.step(t == p.off[s] ? p.h0.data() + s * p.d : h.data() + (t - 1) * p.d, p.x.data() + t * p.m,
             h.data() + t * p.d);
  return h;
}

enum class input { x, h0, dh };

template <class Make>
void isolation(Make make, index_t d_arg, double scale, lr::method meth, const std::string& what) {
  const rnn_problem clean = make_problem(make, 240, d_arg, scale, 90);
  lr::options opt;
  opt.solver = meth;
  opt.abs_tol = 1e-10;
  opt.rel_tol = 0;
  opt.max_iterations = 100;
  const auto want = run(make, clean, d_arg, opt);
  REQUIRE(want.rep.all_converged());
  const index_t d = clean.d, m = clean.m;
  auto row_doc = [&](index_t r) { return lp::doc_of(clean.off, r); };
  auto seg_doc = [](index_t r) { return r; };
  int k = 0;
  for (input in : {input::x, input::h0, input::dh})
    for (index_t s : {1, 3, 4, 7})
      for (lp::value v : lp::all_values) {
        ++k;
        const index_t b0 = clean.off[static_cast<std::size_t>(s)], b1 = clean.off[static_cast<std::size_t>(s) + 1];
        if (b0 == b1 && in != input::h0) continue;
        rnn_problem p = clean;
        const index_t t = b0 == b1 ? -1 : lp::row_in(clean.off, s, k % 3);
        const double x = lp::make<double>(v);
        if (in == input::x) p.x[static_cast<std::size_t>(t * m + k % m)] = x;
        if (in == input::h0) p.h0[static_cast<std::size_t>(s * d + k % d)] = x;
        if (in == input::dh) p.g[static_cast<std::size_t>(t * d + k % d)] = x;
        const auto got = run(make, p, d_arg, opt);
        INFO(what << ": " << lp::name(v) << " in "
                  << (in == input::x    ? "x"
                      : in == input::h0 ? "h0"
                                        : "dh")
                  << " of sequence " << s << " (row " << t << "), iterations " << got.rep.iterations);
        lp::require_others_equal(got.h, want.h, d, row_doc, s, "h");
        lp::require_others_equal(got.dx, want.dx, m, row_doc, s, "dx");
        lp::require_others_equal(got.dh0, want.dh0, d, seg_doc, s, "dh0");
        for (index_t o = 0; o < clean.segs; ++o)
          if (o != s) CHECK(got.rep.converged[static_cast<std::size_t>(o)]);
        if (b0 == b1) continue;
        if (in != input::dh) {
          // The poisoned sequence: the sequential loop's result (NaN where it is NaN).
          std::vector<double> theta = p.theta;
          const auto loop = sequential(make(static_cast<const double*>(theta.data()), d_arg), p);
          for (index_t i = b0 * d; i < b1 * d; ++i) {
            const double a = got.h[static_cast<std::size_t>(i)], o = loop[static_cast<std::size_t>(i)];
            if (std::isnan(o))
              CHECK(std::isnan(a));
            else if (!std::isfinite(o))
              CHECK(a == o);
            else
              CHECK(std::abs(a - o) <= 1e-7 + 1e-7 * std::abs(o));
          }
          if (v == lp::value::nan) CHECK_FALSE(got.rep.converged[static_cast<std::size_t>(s)]);
        }
        if (v == lp::value::nan) {
          // its gradients show it, and so does the parameter gradient, a sum over every sequence
          CHECK((lp::rows_hold(got.dx, m, b0, b1, false) || lp::rows_hold(got.dh0, d, s, s + 1, false)));
          CHECK(lp::rows_hold(got.dth, 1, 0, clean.np, false));
        }
      }
}

auto make_gru = [](const double* th, index_t d) { return lr::para_gru<double>{th, d}; };
auto make_lstm = [](const double* th, index_t u) { return lr::para_lstm_cifg<double>{th, u}; };
auto make_rnn = [](const double* th, index_t d) { return lr::tanh_rnn<double>{th, d}; };

}  // namespace

TEST_CASE("rnn isolation: a non-finite input of one sequence changes no other" LOOM_BACKEND_TAG, "[rnn][isolation]") {
  isolation(make_gru, 4, 1.0, lr::method::newton, "para_gru, newton");
  isolation(make_lstm, 2, 1.0, lr::method::newton, "para_lstm_cifg, newton");
  isolation(make_rnn, 4, 0.4, lr::method::newton, "tanh_rnn, newton");
  isolation(make_gru, 4, 1.0, lr::method::quasi_newton, "para_gru, quasi_newton");
  isolation(make_gru, 4, 1.0, lr::method::damped, "para_gru, damped");
  isolation(make_rnn, 4, 0.4, lr::method::picard, "tanh_rnn, picard");
}
