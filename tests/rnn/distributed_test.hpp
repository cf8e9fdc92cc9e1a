// The sequence-parallel Newton solver, P = 1..5, with uneven and empty slices and packed sequences
// crossing rank boundaries: forward against the sequential fp64 loop, backward against the
// single-device backward, the report identical on every rank, fallbacks and rejections reaching
// every rank. One body, run on host memory (serial, comm::local) and on the device stand-in
// (comm::standin): support/distributed.hpp.

#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>
#include <loom/rnn/distributed.hpp>

#include <support/allocations.hpp>
#include <support/distributed.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using loom::index_t;
namespace lr = loom::rnn;
namespace lt = loom::test;

namespace {

template <class T, std::size_t R>
using view = loom::tensor_view<T, R>;  // host views (the single-device reference)
template <class T, std::size_t R>
using dview = lt::dview_t<T, R>;  // views in the space of the backend under test

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

// One sequence-parallel forward and backward on p ranks (slices `cut`; int32 offsets on odd P,
// int64 on even), gathered: h and dx over the sequence, each rank's dtheta, dh0 and report.
struct sp_result {
  std::vector<double> h, dx;
  std::vector<std::vector<double>> dth, dh0;
  std::vector<rank_result> res;
};
template <class Cell>
sp_result run_sp(const Cell& c, int p, const std::vector<index_t>& cut, const std::vector<double>& x,
                 const std::vector<double>& h0, const std::vector<double>& g, const std::vector<index_t>& offs,
                 const lr::options& opt) {
  const index_t d = c.state_size(), m = c.input_size(), n = cut.back();
  const auto segs = static_cast<index_t>(offs.size()) - 1;
  const std::vector<std::int32_t> offs32(offs.begin(), offs.end());
  sp_result out{std::vector<double>(static_cast<std::size_t>(n * d)), std::vector<double>(x.size()),
                std::vector<std::vector<double>>(static_cast<std::size_t>(p)),
                std::vector<std::vector<double>>(static_cast<std::size_t>(p)),
                std::vector<rank_result>(static_cast<std::size_t>(p))};
  lt::run_ranks(p, [&](auto& comm, const auto& be) {
    const int r = comm.rank();
    const index_t b = cut[r], e = cut[r + 1];
    auto& mine = out.res[static_cast<std::size_t>(r)];
    auto& dth = out.dth[static_cast<std::size_t>(r)];
    auto& dh0 = out.dh0[static_cast<std::size_t>(r)];
    dth.assign(static_cast<std::size_t>(c.param_size()), 0);
    dh0.assign(h0.size(), 0);
    try {
      // one plan for forward and backward
      const auto& offsets = p % 2 ? lt::docs_in_space(offs32) : lt::docs_in_space(offs);
      const auto plan = lr::make_plan(be, comm, c, e - b, offsets, opt);
      loom::workspace_buffer ws(plan.workspace_bytes());
      mine.rep = lr::report(plan);
      try {
        lr::forward(be, comm, plan, c, dview<const double, 2>(x.data() + b * m, {e - b, m}),
                    dview<const double, 2>(h0.data(), {segs, d}), dview<double, 2>(out.h.data() + b * d, {e - b, d}),
                    mine.rep, ws.span());
        lr::backward(
            be, comm, plan, c, dview<const double, 2>(x.data() + b * m, {e - b, m}),
            dview<const double, 2>(h0.data(), {segs, d}), dview<const double, 2>(out.h.data() + b * d, {e - b, d}),
            dview<const double, 2>(g.data() + b * d, {e - b, d}), dview<double, 2>(out.dx.data() + b * m, {e - b, m}),
            dview<double, 2>(dh0.data(), {segs, d}), dview<double, 1>(dth.data(), {c.param_size()}), ws.span());
        loom::fence(be);
      } catch (...) {
        lt::drain(be);  // the rank's work may still read ws
        throw;
      }
    } catch (const std::exception& ex) {
      mine.error = ex.what();
    }
  });
  return out;
}

// The bits of two runs (the delay test compares seeds with them).
[[maybe_unused]] bool same_bits(const sp_result& a, const sp_result& b) {
  auto eq = [](const std::vector<double>& u, const std::vector<double>& v) {
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(double)) == 0;
  };
  bool ok = eq(a.h, b.h) && eq(a.dx, b.dx) && a.dth.size() == b.dth.size();
  for (std::size_t r = 0; ok && r < a.dth.size(); ++r) ok = eq(a.dth[r], b.dth[r]) && eq(a.dh0[r], b.dh0[r]);
  return ok;
}

// The fp64 references of a problem: the sequential loop's h, the single-device backward.
struct reference {
  std::vector<double> h, dx, dh0, dth;
};
template <class Cell>
reference reference_of(const Cell& c, const std::vector<double>& x, const std::vector<double>& h0,
                       const std::vector<double>& g, const std::vector<index_t>& offs, index_t n,
                       const lr::options& opt) {
  const index_t d = c.state_size(), m = c.input_size();
  const auto segs = static_cast<index_t>(offs.size()) - 1;
  reference ref{sequential(c, x, h0, offs, n), std::vector<double>(x.size()), std::vector<double>(h0.size()),
                std::vector<double>(static_cast<std::size_t>(c.param_size()))};
  const loom::segments<> docs64(std::span<const index_t>(offs.data(), offs.size()));
  lr::backward(loom::serial{}, c, view<const double, 2>(x.data(), {n, m}), view<const double, 2>(h0.data(), {segs, d}),
               view<const double, 2>(ref.h.data(), {n, d}), view<const double, 2>(g.data(), {n, d}),
               view<double, 2>(ref.dx.data(), {n, m}), view<double, 2>(ref.dh0.data(), {segs, d}),
               view<double, 1>(ref.dth.data(), {c.param_size()}), docs64, opt);
  return ref;
}

void check_against(const sp_result& got, const reference& ref, const std::string& what) {
  lt::require_close(got.h, ref.h, {1e-9, 1e-10}, what + " forward");
  lt::require_close(got.dx, ref.dx, {1e-8, 1e-10}, what + " dx");
  for (std::size_t r = 0; r < got.dth.size(); ++r) {
    lt::require_close(got.dth[r], ref.dth, {1e-8, 1e-10}, what + " dtheta");
    lt::require_close(got.dh0[r], ref.dh0, {1e-8, 1e-10}, what + " dh0");
  }
}

// A ParaGRU problem of n steps, state size d, documents crossing ranks: the cell's parameters, x,
// h0 and the output gradient g (seeds from `seed`).
struct gru_problem {
  index_t n, d, m;
  std::vector<double> th, x;
  std::vector<index_t> offs;
  index_t segs;
  std::vector<double> h0, g;
  lr::para_gru<double> cell() const { return {th.data(), d}; }
};
gru_problem gru_problem_of(index_t n, index_t d, std::uint64_t seed) {
  auto offs = crossing_offsets(n, seed + 2);
  const auto segs = static_cast<index_t>(offs.size()) - 1;
  return {n,
          d,
          3 * d,
          lt::uniform<double>(6 * d, -1, 1, seed),
          lt::uniform<double>(n * 3 * d, -1, 1, seed + 1),
          std::move(offs),
          segs,
          lt::uniform<double>(segs * d, -0.5, 0.5, seed + 3),
          lt::uniform<double>(n * d, -1, 1, seed + 4)};
}

template <class Cell>
void check_cell(const Cell& c, index_t n, double x_scale, lr::options opt, const std::string& what,
                bool expect_fallback = false) {
  const index_t d = c.state_size(), m = c.input_size();
  const auto x = lt::uniform<double>(n * m, -x_scale, x_scale, 5);
  const auto offs = crossing_offsets(n, 6);
  const auto segs = static_cast<index_t>(offs.size()) - 1;
  const auto h0 = lt::uniform<double>(segs * d, -0.5, 0.5, 7);
  const auto g = lt::uniform<double>(n * d, -1, 1, 8);
  const auto ref = reference_of(c, x, h0, g, offs, n, opt);
  for (int p : {1, 2, 3, 4, 5}) {
    if (lt::sanitized && p == 4) continue;  // sanitizer builds: P = 1, 2, 3, 5
    const auto got = run_sp(c, p, slices(n, p, 10 + static_cast<std::uint64_t>(p)), x, h0, g, offs, opt);
    const auto& res = got.res;
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
    check_against(got, ref, what);
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

#if defined(LOOM_TEST_BACKEND_STANDIN)
TEST_CASE("rnn over ranks on the stand-in: 50 seeds of random stream delays, the same bits every time",
          "[rnn][comm][standin][delays]") {
  // The result depends on the schedule's order only, never on timing: for each P, every seed gives
  // the bits of the first one, which matches the fp64 references (the Newton iteration, its
  // fallbacks and the backward, P = 1..5).
  const auto pb = gru_problem_of(211, 3, 21);
  const auto c = pb.cell();
  const auto& [n, d, m, th, x, offs, segs, h0, g] = pb;
  lr::options opt;
  opt.abs_tol = 1e-11;
  opt.rel_tol = 0;
  const auto ref = reference_of(c, x, h0, g, offs, n, opt);
  std::array<sp_result, 6> first{};
  auto o = lt::standin_ranks();
  o.max_delay = std::chrono::microseconds(200);
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const int p = 1 + static_cast<int>(seed % 5);
    o.seed = seed;
    lt::standin_override() = o;
    const auto got = run_sp(c, p, slices(n, p, 30 + static_cast<std::uint64_t>(p)), x, h0, g, offs, opt);
    lt::standin_override().reset();
    INFO("seed " << seed << ", P = " << p);
    for (const auto& r : got.res) REQUIRE(r.error.empty());
    auto& want = first[static_cast<std::size_t>(p)];
    if (seed < 5) {
      REQUIRE(got.res[0].rep.all_converged());
      check_against(got, ref, "the first seed of each P");
      want = got;
    }
    REQUIRE(same_bits(got, want));
  }
}
#endif

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
    lt::run_ranks(3, [&](auto& comm, const auto& be) {
      const int r = comm.rank();
      try {
        lr::options opt;
        if (r == 1) opt.max_iterations = -1;
        (void)lr::make_plan(be, comm, c, 7, loom::segments<lt::space>{}, opt);
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
    lt::run_ranks(2, [&](auto& comm, const auto& be) {
      const int r = comm.rank();
      const std::vector<index_t> off{0, r == 0 ? index_t{3} : index_t{4}, 14};
      try {
        (void)lr::make_plan(be, comm, c, 7, lt::docs_in_space(off));
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
      lt::run_ranks(3, [&](auto& comm, const auto& be) {
        const int r = comm.rank();
        const auto plan = lr::make_plan(be, comm, c, 7);
        loom::workspace_buffer ws(plan.workspace_bytes());
        try {
          lr::report rep(plan);
          const index_t rows = r == 1 ? 5 : 7;  // rank 1's h has the wrong length
          lr::forward(be, comm, plan, c, dview<const double, 2>(x.data() + r * 6, {7, 6}), dview<const double, 2>{},
                      dview<double, 2>(h.data() + r * 2 * 7, {rows, 2}), rep, ws.span());
          loom::fence(be);
        } catch (const loom::error& e) {
          err[static_cast<std::size_t>(r)] = e.what();
          lt::drain(be);  // the other ranks' work may still read ws
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
    lt::run_ranks(3, [&](auto& comm, const auto& be) {
      const int r = comm.rank();
      const auto plan = lr::make_plan(be, comm, c, 2);
      loom::workspace_buffer ws(plan.workspace_bytes());
      try {
        lr::report rep(plan);
        lr::forward(be, comm, plan, c, dview<const double, 2>(bad.data() + r * 6 * 2, {2, 6}), dview<const double, 2>{},
                    dview<double, 2>(h.data() + r * 4, {2, 2}), rep, ws.span());
        loom::fence(be);
      } catch (const loom::error& e) {
        err[static_cast<std::size_t>(r)] = e.what();
        lt::drain(be);
      }
    });
    for (const auto& e : err) CHECK_THAT(e, Catch::Contains("x holds non-finite values (NaN or inf) on rank 1"));
  }
}

TEST_CASE(
    "rnn over ranks: one agreement per plan, no allocation per call, reuse across calls and threads bitwise equal",
    "[rnn][comm][plan]") {
  const auto pb = gru_problem_of(600, 4, 9);
  const auto c = pb.cell();
  const auto& [n, d, m, th, x, offs, segs, h0, g] = pb;
  const std::vector<std::int32_t> offs32(offs.begin(), offs.end());
  const auto docs = lt::docs_in_space(offs32);
  const int p = 3, calls = 3;
  const auto cut = slices(n, p, 14);
  lr::options opt;
  opt.abs_tol = 1e-10;
  opt.rel_tol = 0;
  // the reference: the convenience forms
  std::vector<double> want(static_cast<std::size_t>(n * d)), want_dth(th.size());
  lt::run_ranks(p, [&](auto& comm, const auto& be) {
    const int r = comm.rank();
    const index_t b = cut[r], len = cut[r + 1] - b;
    std::vector<double> dx(static_cast<std::size_t>(len * m)), dth(th.size());
    (void)lr::forward(be, comm, c, dview<const double, 2>(x.data() + b * m, {len, m}),
                      dview<const double, 2>(h0.data(), {segs, d}), dview<double, 2>(want.data() + b * d, {len, d}),
                      docs, opt);
    lr::backward(be, comm, c, dview<const double, 2>(x.data() + b * m, {len, m}),
                 dview<const double, 2>(h0.data(), {segs, d}), dview<const double, 2>(want.data() + b * d, {len, d}),
                 dview<const double, 2>(g.data() + b * d, {len, d}), dview<double, 2>(dx.data(), {len, m}),
                 dview<double, 2>{}, dview<double, 1>(dth.data(), {c.param_size()}), docs, opt);
    loom::fence(be);
    if (r == 0) want_dth = dth;
  });
  std::vector<double> got(want.size());
  std::vector<long long> heap(p, -1), temps(p, -1), plan_coll(p), first_coll(p), all_coll(p);
  std::vector<std::vector<double>> dths(p);
  std::vector<char> other_thread_same(p, 0);
  lt::run_ranks(p, [&](auto& inner, const auto& be) {
    auto comm = lt::counted(inner);
    const int r = comm.rank();
    const index_t b = cut[r], len = cut[r + 1] - b;
    const auto plan = lr::make_plan(be, comm, c, len, docs, opt);
    plan_coll[r] = comm.counts().collectives.load();
    loom::workspace_buffer ws(plan.workspace_bytes());
    lr::report rep(plan);
    std::vector<double> dx(static_cast<std::size_t>(len * m)), dth(th.size());
    const dview<const double, 2> xv(x.data() + b * m, {len, m}), h0v(h0.data(), {segs, d});
    const dview<double, 2> hv(got.data() + b * d, {len, d});
    long long after_first = 0;
    const auto count = lt::count_allocations([&] {
      for (int k = 0; k < calls; ++k) {
        lr::forward(be, comm, plan, c, xv, h0v, hv, rep, ws.span());
        lr::backward(be, comm, plan, c, xv, h0v, dview<const double, 2>(hv),
                     dview<const double, 2>(g.data() + b * d, {len, d}), dview<double, 2>(dx.data(), {len, m}),
                     dview<double, 2>{}, dview<double, 1>(dth.data(), {c.param_size()}), ws.span());
        if (k == 0) after_first = comm.counts().collectives.load();
      }
    });
    loom::fence(be);
    heap[r] = count.heap;
    temps[r] = count.temporaries;
    first_coll[r] = after_first - plan_coll[r];
    all_coll[r] = comm.counts().collectives.load() - plan_coll[r];
    dths[r] = dth;
    // The same plan read from a thread of its own (the rank thread waits for it).
    std::vector<double> h2(static_cast<std::size_t>(len * d)), dx2(dx.size()), dth2(th.size());
    std::thread other([&] {
      lr::report rep2(plan);
      lr::forward(be, comm, plan, c, xv, h0v, dview<double, 2>(h2.data(), {len, d}), rep2, ws.span());
      lr::backward(be, comm, plan, c, xv, h0v, dview<const double, 2>(h2.data(), {len, d}),
                   dview<const double, 2>(g.data() + b * d, {len, d}), dview<double, 2>(dx2.data(), {len, m}),
                   dview<double, 2>{}, dview<double, 1>(dth2.data(), {c.param_size()}), ws.span());
      loom::fence(be);
    });
    other.join();
    const auto same = [](const double* first, const double* second, std::size_t elems) {  // empty: equal
      return elems == 0 || std::memcmp(first, second, sizeof(double) * elems) == 0;
    };
    other_thread_same[r] = same(h2.data(), got.data() + b * d, h2.size()) && same(dx2.data(), dx.data(), dx.size()) &&
                           same(dth2.data(), dth.data(), dth.size());
  });
  for (int r = 0; r < p; ++r) {
    INFO("rank " << r);
    CHECK(heap[r] == 0);
    CHECK(temps[r] == 0);
    CHECK(plan_coll[r] == 1);                     // the agreement, once
    CHECK(all_coll[r] == calls * first_coll[r]);  // every call the same collectives, no agreement
    CHECK(std::memcmp(dths[r].data(), want_dth.data(), sizeof(double) * want_dth.size()) == 0);
    CHECK(other_thread_same[r] == 1);
  }
  CHECK(std::memcmp(got.data(), want.data(), sizeof(double) * want.size()) == 0);
}
