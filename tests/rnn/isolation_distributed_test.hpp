// The sequence-parallel Newton solver (P = 2..4, uneven slices, an empty one for
// P > 2, sequences crossing slices): a NaN or an infinity in one sequence's x, h0 row or dh (input
// checks off) leaves every other sequence's solution, convergence, dx and dh0 with the same bits as
// the same distributed run with that sequence clean, and the report is the same on every rank. One
// body, run on host memory (serial, comm::local) and on the device stand-in (comm::standin).

#include <loom/backend/serial.hpp>
#include <loom/comm/local.hpp>
#include <loom/rnn/distributed.hpp>

#include <support/distributed.hpp>
#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "../scan/poison.hpp"

using loom::index_t;
namespace lr = loom::rnn;
namespace lt = loom::test;
namespace lp = loom::test::poison;

namespace {

template <class T, std::size_t R>
using view = lt::dview_t<T, R>;

struct rnn_problem {
  index_t n = 0, d = 0, m = 0, segs = 0;
  std::vector<double> x, h0, g;
  std::vector<index_t> off;
};

struct rnn_result {
  std::vector<double> h, dx, dh0;
  std::vector<lr::report> reps;
  std::vector<std::string> errors;
};

template <class Cell>
rnn_result run(const Cell& c, const rnn_problem& p, const std::vector<index_t>& cut, lr::options opt) {
  const int ranks = static_cast<int>(cut.size()) - 1;
  const index_t d = p.d, m = p.m;
  rnn_result r{std::vector<double>(static_cast<std::size_t>(p.n * d)), std::vector<double>(p.x.size()),
               std::vector<double>(p.h0.size()), std::vector<lr::report>(static_cast<std::size_t>(ranks)),
               std::vector<std::string>(static_cast<std::size_t>(ranks))};
  const auto docs = lt::docs_in_space(p.off);
  opt.check_inputs = false;
  lt::run_ranks(ranks, [&](auto& comm, const auto& be) {
    const auto q = static_cast<std::size_t>(comm.rank());
    const index_t b = cut[q], e = cut[q + 1];
    std::vector<double> dh0(p.h0.size()), dth(static_cast<std::size_t>(c.param_size()));
    try {
      const view<const double, 2> xv(p.x.data() + b * m, {e - b, m}), h0v(p.h0.data(), {p.segs, d});
      r.reps[q] = lr::forward(be, comm, c, xv, h0v, view<double, 2>(r.h.data() + b * d, {e - b, d}), docs, opt);
      lr::backward(be, comm, c, xv, h0v, view<const double, 2>(r.h.data() + b * d, {e - b, d}),
                   view<const double, 2>(p.g.data() + b * d, {e - b, d}),
                   view<double, 2>(r.dx.data() + b * m, {e - b, m}), view<double, 2>(dh0.data(), {p.segs, d}),
                   view<double, 1>(dth.data(), {c.param_size()}), docs, opt);
      loom::fence(be);
      if (q == 0) r.dh0 = dh0;  // complete on every rank
    } catch (const std::exception& ex) {
      r.errors[q] = ex.what();
      lt::drain(be);
    }
  });
  return r;
}

enum class input { x, h0, dh };

template <class Cell>
void isolation(const Cell& c, const std::string& what) {
  const index_t n = 200;
  rnn_problem clean;
  clean.n = n, clean.d = c.state_size(), clean.m = c.input_size();
  clean.off = lp::documents(n);
  clean.segs = lp::docs(clean.off);
  clean.x = lt::uniform<double>(n * clean.m, -1, 1, 81);
  clean.h0 = lt::uniform<double>(clean.segs * clean.d, -0.5, 0.5, 82);
  clean.g = lt::uniform<double>(n * clean.d, -1, 1, 83);
  const index_t d = clean.d, m = clean.m;
  lr::options opt;
  opt.abs_tol = 1e-10;
  opt.rel_tol = 0;
  auto row_doc = [&](index_t r) { return lp::doc_of(clean.off, r); };
  auto seg_doc = [](index_t r) { return r; };
  for (int ranks : {2, 3, 4}) {
    const auto cut = lt::uneven_slices(n, ranks, 84 + static_cast<std::uint64_t>(ranks));
    const auto want = run(c, clean, cut, opt);
    for (const auto& e : want.errors) REQUIRE(e.empty());
    REQUIRE(want.reps[0].all_converged());
    int k = 0;
    for (input in : {input::x, input::h0, input::dh})
      for (index_t s : {1, 4, 6, 7}) {
        const lp::value v = lp::all_values[++k % 3];
        rnn_problem p = clean;
        const index_t t = lp::row_in(clean.off, s, k % 3);
        const double x = lp::make<double>(v);
        if (in == input::x) p.x[static_cast<std::size_t>(t * m + k % m)] = x;
        if (in == input::h0) p.h0[static_cast<std::size_t>(s * d + k % d)] = x;
        if (in == input::dh) p.g[static_cast<std::size_t>(t * d + k % d)] = x;
        const auto got = run(c, p, cut, opt);
        INFO(what << ", P = " << ranks << ": " << lp::name(v) << " in input " << static_cast<int>(in) << " of sequence "
                  << s << " (row " << t << ")");
        for (const auto& e : got.errors) REQUIRE(e.empty());
        for (const auto& rep : got.reps) {
          CHECK(rep.converged == got.reps[0].converged);
          CHECK(rep.iterations == got.reps[0].iterations);
        }
        lp::require_others_equal(got.h, want.h, d, row_doc, s, "h");
        lp::require_others_equal(got.dx, want.dx, m, row_doc, s, "dx");
        lp::require_others_equal(got.dh0, want.dh0, d, seg_doc, s, "dh0");
        for (index_t o = 0; o < clean.segs; ++o)
          if (o != s) CHECK(got.reps[0].converged[static_cast<std::size_t>(o)]);
        const index_t b0 = clean.off[static_cast<std::size_t>(s)], b1 = clean.off[static_cast<std::size_t>(s) + 1];
        if (v == lp::value::nan && in != input::dh) {
          CHECK(lp::rows_hold(got.h, d, b0, b1, false));
          CHECK_FALSE(got.reps[0].converged[static_cast<std::size_t>(s)]);
        }
        if (v == lp::value::nan) CHECK((lp::rows_hold(got.dx, m, b0, b1, false)));
      }
  }
}

}  // namespace

TEST_CASE("rnn isolation over ranks: a non-finite input of one sequence changes no other", "[rnn][comm][isolation]") {
  const auto th_gru = lt::uniform<double>(6 * 4, -1, 1, 91);
  isolation(lr::para_gru<double>{th_gru.data(), 4}, "para_gru");
  const auto th_lstm = lt::uniform<double>(8 * 2, -1, 1, 92);
  isolation(lr::para_lstm_cifg<double>{th_lstm.data(), 2}, "para_lstm_cifg");
  const auto th_rnn = lt::uniform<double>(4 * 4 + 4, -0.4, 0.4, 93);
  isolation(lr::tanh_rnn<double>{th_rnn.data(), 4}, "tanh_rnn");
}
