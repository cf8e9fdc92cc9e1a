// The sequence-parallel Newton solver over comm::local (P ranks as threads), P = 1..4, with
// uneven and empty slices and packed sequences crossing rank boundaries: forward against the
// sequential fp64 loop, backward against the single-device backward, the report identical on
// every rank, fallbacks and rejections reaching every rank.

#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>
#include <loom/rnn/distributed.hpp>

#include <support/allocations.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
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
void check_cell(const Cell& c, index_t n, double x_scale, lr::options opt, const std::string& what,
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
  const std::vector<std::int32_t> offs32(offs.begin(), offs.end());
  const loom::segments<> docs64(std::span<const index_t>(offs.data(), offs.size()));
  const loom::segments<> docs32(std::span<const std::int32_t>(offs32.data(), offs32.size()));
  lr::backward(loom::serial{}, c, view<const double, 2>(x.data(), {n, m}), view<const double, 2>(h0.data(), {segs, d}),
               view<const double, 2>(want.data(), {n, d}), view<const double, 2>(g.data(), {n, d}),
               view<double, 2>(dx1.data(), {n, m}), view<double, 2>(dh01.data(), {segs, d}),
               view<double, 1>(dth1.data(), {c.param_size()}), docs64, opt);
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
        // one plan (int32 offsets on odd P, int64 on even) for forward and backward
        const auto plan = lr::make_plan(loom::serial{}, comm, c, e - b, p % 2 ? docs32 : docs64, opt);
        loom::workspace_buffer ws(plan.workspace_bytes());
        out.rep = lr::report(plan);
        lr::forward(loom::serial{}, comm, plan, c, view<const double, 2>(x.data() + b * m, {e - b, m}),
                    view<const double, 2>(h0.data(), {segs, d}), view<double, 2>(h.data() + b * d, {e - b, d}), out.rep,
                    ws.span());
        dth[r].assign(static_cast<std::size_t>(c.param_size()), 0);
        dh0[r].assign(h0.size(), 0);
        lr::backward(loom::serial{}, comm, plan, c, view<const double, 2>(x.data() + b * m, {e - b, m}),
                     view<const double, 2>(h0.data(), {segs, d}), view<const double, 2>(h.data() + b * d, {e - b, d}),
                     view<const double, 2>(g.data() + b * d, {e - b, d}),
                     view<double, 2>(dx.data() + b * m, {e - b, m}), view<double, 2>(dh0[r].data(), {segs, d}),
                     view<double, 1>(dth[r].data(), {c.param_size()}), ws.span());
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
  lr::options opt;
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
  lr::options opt;
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
  {  // at make_plan (the agreement): the same error on every rank, naming the rank and why
    std::vector<std::string> err(3);
    loom::comm::run_local(3, [&](loom::comm::local& comm) {
      const int r = comm.rank();
      try {
        lr::options opt;
        if (r == 1) opt.max_iterations = -1;
        (void)lr::make_plan(loom::serial{}, comm, c, 7, loom::segments<>{}, opt);
      } catch (const loom::error& e) {
        err[static_cast<std::size_t>(r)] = e.what();
      }
    });
    CHECK_THAT(err[1], Catch::Contains("on rank 1: rnn::make_plan: options.max_iterations must be >= 0"));
    CHECK(err[0] == err[1]);
    CHECK(err[2] == err[1]);
  }
  {  // ranks disagreeing on the documents
    std::vector<std::string> err(2);
    loom::comm::run_local(2, [&](loom::comm::local& comm) {
      const int r = comm.rank();
      const std::vector<index_t> off{0, r == 0 ? index_t{3} : index_t{4}, 14};
      try {
        (void)lr::make_plan(loom::serial{}, comm, c, 7, loom::segments{std::span<const index_t>(off)});
      } catch (const loom::error& e) {
        err[static_cast<std::size_t>(r)] = e.what();
      }
    });
    CHECK_THAT(err[0], Catch::Contains("ranks disagree on the document offsets"));
    CHECK(err[0] == err[1]);
  }
  {  // at a call: views that do not fit the plan are refused on that rank; the others are released
    std::vector<std::string> err(3);
    try {
      loom::comm::run_local(3, [&](loom::comm::local& comm) {
        const int r = comm.rank();
        try {
          const auto plan = lr::make_plan(loom::serial{}, comm, c, 7);
          loom::workspace_buffer ws(plan.workspace_bytes());
          lr::report rep(plan);
          const index_t rows = r == 1 ? 5 : 7;  // rank 1's h has the wrong length
          lr::forward(loom::serial{}, comm, plan, c, view<const double, 2>(x.data() + r * 6, {7, 6}),
                      view<const double, 2>{}, view<double, 2>(h.data() + r * 2 * 7, {rows, 2}), rep, ws.span());
        } catch (const loom::error& e) {
          err[static_cast<std::size_t>(r)] = e.what();
          throw;
        }
      });
    } catch (const std::exception&) {
    }
    CHECK_THAT(err[1], Catch::Contains("rnn::forward: h must be [7, 2]"));
  }
  {  // non-finite x on one rank is decided collectively: every rank throws
    std::vector<std::string> err(3);
    std::vector<double> bad = x;
    bad[13] = NAN;  // in rank 1's rows, x[12, 24)
    loom::comm::run_local(3, [&](loom::comm::local& comm) {
      const int r = comm.rank();
      try {
        const auto plan = lr::make_plan(loom::serial{}, comm, c, 2);
        loom::workspace_buffer ws(plan.workspace_bytes());
        lr::report rep(plan);
        lr::forward(loom::serial{}, comm, plan, c, view<const double, 2>(bad.data() + r * 6 * 2, {2, 6}),
                    view<const double, 2>{}, view<double, 2>(h.data() + r * 4, {2, 2}), rep, ws.span());
      } catch (const loom::error& e) {
        err[static_cast<std::size_t>(r)] = e.what();
      }
    });
    for (const auto& e : err) CHECK_THAT(e, Catch::Contains("x holds non-finite values (NaN or inf) on rank 1"));
  }
}

TEST_CASE("rnn over ranks: one agreement per plan, no allocation per call, reuse bitwise equal", "[rnn][comm][plan]") {
  const auto th = lt::uniform<double>(6 * 4, -1, 1, 9);
  const lr::para_gru<double> c{th.data(), 4};
  const index_t n = 600, d = 4, m = 12;
  const auto x = lt::uniform<double>(n * m, -1, 1, 10);
  const auto offs = crossing_offsets(n, 11);
  const auto segs = static_cast<index_t>(offs.size()) - 1;
  const auto h0 = lt::uniform<double>(segs * d, -0.5, 0.5, 12);
  const auto g = lt::uniform<double>(n * d, -1, 1, 13);
  const std::vector<std::int32_t> offs32(offs.begin(), offs.end());
  const loom::segments<> docs(std::span<const std::int32_t>(offs32.data(), offs32.size()));
  const int p = 3, calls = 3;
  const auto cut = slices(n, p, 14);
  lr::options opt;
  opt.abs_tol = 1e-10;
  opt.rel_tol = 0;
  // the reference: the convenience forms
  std::vector<double> want(static_cast<std::size_t>(n * d)), want_dth(th.size());
  loom::comm::run_local(p, [&](loom::comm::local& comm) {
    const int r = comm.rank();
    const index_t b = cut[r], len = cut[r + 1] - b;
    std::vector<double> dx(static_cast<std::size_t>(len * m)), dth(th.size());
    (void)lr::forward(loom::serial{}, comm, c, view<const double, 2>(x.data() + b * m, {len, m}),
                      view<const double, 2>(h0.data(), {segs, d}), view<double, 2>(want.data() + b * d, {len, d}), docs,
                      opt);
    lr::backward(loom::serial{}, comm, c, view<const double, 2>(x.data() + b * m, {len, m}),
                 view<const double, 2>(h0.data(), {segs, d}), view<const double, 2>(want.data() + b * d, {len, d}),
                 view<const double, 2>(g.data() + b * d, {len, d}), view<double, 2>(dx.data(), {len, m}),
                 view<double, 2>{}, view<double, 1>(dth.data(), {c.param_size()}), docs, opt);
    if (r == 0) want_dth = dth;
  });
  std::vector<double> got(want.size());
  std::vector<long long> heap(p, -1), temps(p, -1), plan_coll(p), first_coll(p), all_coll(p);
  std::vector<std::vector<double>> dths(p);
  loom::comm::run_local(p, [&](loom::comm::local& inner) {
    loom::comm::counting<lt::uncounted<loom::comm::local>> comm{lt::uncounted<loom::comm::local>(inner)};
    const int r = comm.rank();
    const index_t b = cut[r], len = cut[r + 1] - b;
    const auto plan = lr::make_plan(loom::serial{}, comm, c, len, docs, opt);
    plan_coll[r] = comm.counts().collectives.load();
    loom::workspace_buffer ws(plan.workspace_bytes());
    lr::report rep(plan);
    std::vector<double> dx(static_cast<std::size_t>(len * m)), dth(th.size());
    const view<const double, 2> xv(x.data() + b * m, {len, m}), h0v(h0.data(), {segs, d});
    const view<double, 2> hv(got.data() + b * d, {len, d});
    long long after_first = 0;
    const auto count = lt::count_allocations([&] {
      for (int k = 0; k < calls; ++k) {
        lr::forward(loom::serial{}, comm, plan, c, xv, h0v, hv, rep, ws.span());
        lr::backward(loom::serial{}, comm, plan, c, xv, h0v, view<const double, 2>(hv),
                     view<const double, 2>(g.data() + b * d, {len, d}), view<double, 2>(dx.data(), {len, m}),
                     view<double, 2>{}, view<double, 1>(dth.data(), {c.param_size()}), ws.span());
        if (k == 0) after_first = comm.counts().collectives.load();
      }
    });
    heap[r] = count.heap;
    temps[r] = count.temporaries;
    first_coll[r] = after_first - plan_coll[r];
    all_coll[r] = comm.counts().collectives.load() - plan_coll[r];
    dths[r] = dth;
  });
  for (int r = 0; r < p; ++r) {
    INFO("rank " << r);
    CHECK(heap[r] == 0);
    CHECK(temps[r] == 0);
    CHECK(plan_coll[r] == 1);                     // the agreement, once
    CHECK(all_coll[r] == calls * first_coll[r]);  // every call the same collectives, no agreement
    CHECK(std::memcmp(dths[r].data(), want_dth.data(), sizeof(double) * want_dth.size()) == 0);
  }
  CHECK(std::memcmp(got.data(), want.data(), sizeof(double) * want.size()) == 0);
}
