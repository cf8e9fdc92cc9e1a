// The sequence-parallel Newton solver over comm::local (P ranks as threads), P = 1..4, with
// uneven and empty slices and packed sequences crossing rank boundaries: forward against the
// sequential fp64 loop, backward against the single-device backward, the report identical on
// every rank, fallbacks and rejections reaching every rank.

#include <loom/backend/serial.hpp>
#include <loom/comm/local.hpp>
#include <loom/rnn/distributed.hpp>

#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

using loom::index_t;
namespace lr = loom::rnn;
namespace lt = loom::test;

namespace {

template <class T, std::size_t R>
using view = loom::tensor_view<T, R>;

const auto slices = lt::uneven_slices;

std::vector<index_t> crossing_offsets(index_t n, std::uint64_t stream) {
  auto g = lt::rng(stream);
  std::vector<index_t> o{0, 0};
  while (o.back() < n) o.push_back(std::min<index_t>(n, o.back() + 1 + static_cast<index_t>(g() % (n / 3 + 1))));
  return o;
}

template <class Cell>
std::vector<double> sequential(const Cell& c, const std::vector<double>& x, const std::vector<double>& h0,
                               const std::vector<index_t>& offs, index_t n) {
  const index_t d = c.state_size(), m = c.input_size();
  std::vector<double> h(static_cast<std::size_t>(n * d));
  for (std::size_t s = 0; s + 1 < offs.size(); ++s)
    for (index_t t = offs[s]; t < offs[s + 1]; ++t)
      c.step(t == offs[s] ? h0.data() + s * d : h.data() + (t - 1) * d, x.data() + t * m, h.data() + t * d);
  return h;
}

struct rank_result {
  lr::report rep;
  std::string error;
};

template <class Cell>
void check_cell(const Cell& c, index_t n, double x_scale, lr::options<> opt, const std::string& what,
                bool expect_fallback = false) {
  const index_t d = c.state_size(), m = c.input_size();
  const auto x = lt::uniform<double>(n * m, -x_scale, x_scale, 5);
  const auto offs = crossing_offsets(n, 6);
  const auto segs = static_cast<index_t>(offs.size()) - 1;
  const auto h0 = lt::uniform<double>(segs * d, -0.5, 0.5, 7);
  const auto want = sequential(c, x, h0, offs, n);
  const auto g = lt::uniform<double>(n * d, -1, 1, 8);
  // single-device backward: the reference for the cross-rank one
  std::vector<double> dx1(x.size()), dh01(h0.size()), dth1(static_cast<std::size_t>(c.param_size()));
  opt.cu_seqlens = view<const index_t, 1>(offs.data(), {segs + 1});
  lr::backward(loom::serial{}, c, view<const double, 2>(x.data(), {n, m}), view<const double, 2>(h0.data(), {segs, d}),
               view<const double, 2>(want.data(), {n, d}), view<const double, 2>(g.data(), {n, d}),
               view<double, 2>(dx1.data(), {n, m}), view<double, 2>(dh01.data(), {segs, d}),
               view<double, 1>(dth1.data(), {c.param_size()}), opt);
  for (int p : {1, 2, 3, 4}) {
    const auto cut = slices(n, p, 10 + static_cast<std::uint64_t>(p));
    std::vector<double> h(want.size()), dx(x.size());
    std::vector<std::vector<double>> dth(static_cast<std::size_t>(p)), dh0(static_cast<std::size_t>(p));
    std::vector<rank_result> res(static_cast<std::size_t>(p));
    loom::comm::run_local(p, [&](loom::comm::local& comm) {
      const int r = comm.rank();
      const index_t b = cut[r], e = cut[r + 1];
      auto& out = res[static_cast<std::size_t>(r)];
      try {
        out.rep = lr::newton_solve(loom::serial{}, comm, c, view<const double, 2>(x.data() + b * m, {e - b, m}),
                                   view<const double, 2>(h0.data(), {segs, d}),
                                   view<double, 2>(h.data() + b * d, {e - b, d}), opt);
        dth[r].assign(static_cast<std::size_t>(c.param_size()), 0);
        dh0[r].assign(h0.size(), 0);
        lr::backward(loom::serial{}, comm, c, view<const double, 2>(x.data() + b * m, {e - b, m}),
                     view<const double, 2>(h0.data(), {segs, d}), view<const double, 2>(h.data() + b * d, {e - b, d}),
                     view<const double, 2>(g.data() + b * d, {e - b, d}),
                     view<double, 2>(dx.data() + b * m, {e - b, m}), view<double, 2>(dh0[r].data(), {segs, d}),
                     view<double, 1>(dth[r].data(), {c.param_size()}), opt);
      } catch (const std::exception& ex) {
        out.error = ex.what();
      }
    });
    INFO(what << ", P = " << p << ", iterations " << res[0].rep.iterations);
    for (const auto& r : res) REQUIRE(r.error.empty());
    for (const auto& r : res) {
      CHECK(r.rep.iterations == res[0].rep.iterations);
      CHECK(r.rep.residual_history == res[0].rep.residual_history);
      CHECK(r.rep.converged == res[0].rep.converged);
      CHECK(r.rep.fallback == res[0].rep.fallback);
    }
    CHECK(res[0].rep.all_converged());
    CHECK((res[0].rep.fallback != lr::fallback_taken::none) == expect_fallback);
    lt::require_close(h, want, {1e-9, 1e-10}, what + " forward");
    lt::require_close(dx, dx1, {1e-8, 1e-10}, what + " dx");
    for (int r = 0; r < p; ++r) {
      lt::require_close(dth[r], dth1, {1e-8, 1e-10}, what + " dtheta");
      lt::require_close(dh0[r], dh01, {1e-8, 1e-10}, what + " dh0");
    }
  }
}

}  // namespace

TEST_CASE("rnn over ranks: each cell against the sequential loop, backward against one device", "[rnn][comm]") {
  lr::options<> opt;
  opt.abs_tol = 1e-11;
  opt.rel_tol = 0;
  for (index_t d : {1, 5}) {
    const auto th = lt::uniform<double>(8 * 64 + 64, -1, 1, 1);
    check_cell(lr::para_gru<double>{th.data(), d}, 1500, 1.0, opt, "para_gru");
    check_cell(lr::para_lstm_cifg<double>{th.data(), d}, 1500, 1.0, opt, "para_lstm_cifg");
    auto th2 = th;
    for (auto& v : th2) v *= 0.4;
    check_cell(lr::tanh_rnn<double>{th2.data(), d}, 300, 1.0, opt, "tanh_rnn");
  }
  for (auto meth : {lr::method::quasi_newton, lr::method::picard, lr::method::damped}) {
    opt.solver = meth;
    opt.max_iterations = meth == lr::method::picard ? 1000 : 50;  // Picard converges linearly
    const auto th = lt::uniform<double>(6 * 4, -1, 1, 2);
    check_cell(lr::para_gru<double>{th.data(), 4}, 700, 1.0, opt,
               std::string("para_gru ") + std::string(lr::to_string(meth)));
  }
}

TEST_CASE("rnn over ranks: a chaotic cell falls back on every rank and matches the loop", "[rnn][comm]") {
  lr::options<> opt;
  opt.abs_tol = 1e-11;
  opt.rel_tol = 0;
  opt.max_iterations = 3;
  opt.fallback_iterations = 2;
  auto th = lt::uniform<double>(6 * 6 + 6, -3, 3, 3);
  check_cell(lr::tanh_rnn<double>{th.data(), 6}, 600, 1.0, opt, "chaotic tanh_rnn", true);
}

TEST_CASE("rnn over ranks: a rejection on one rank reaches every rank", "[rnn][comm][errors]") {
  const auto th = lt::uniform<double>(12, -1, 1, 4);
  const lr::para_gru<double> c{th.data(), 2};
  std::vector<double> x(60, 0.1), h(40);
  std::vector<std::string> err(3);
  loom::comm::run_local(3, [&](loom::comm::local& comm) {
    const int r = comm.rank();
    try {
      const index_t rows = r == 1 ? 5 : 7;  // rank 1's h has the wrong length
      lr::newton_solve(loom::serial{}, comm, c, view<const double, 2>(x.data() + r * 6, {7, 6}),
                       view<const double, 2>{}, view<double, 2>(h.data() + r * 2 * 7, {rows, 2}));
    } catch (const loom::error& e) {
      err[static_cast<std::size_t>(r)] = e.what();
    }
  });
  // The same error on every rank, naming the rank that rejected its arguments and why.
  CHECK_THAT(err[1], Catch::Contains("on rank 1: newton_solve: h must be [7, 2]"));
  CHECK(err[0] == err[1]);
  CHECK(err[2] == err[1]);
}
