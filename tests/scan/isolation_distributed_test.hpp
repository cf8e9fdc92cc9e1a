// Document isolation across ranks (P = 2..4, uneven slices, an empty one for P > 2,
// documents crossing slices): a NaN or an infinity in one document's A, b, initial state, g or
// final-state gradient leaves every other document's h, final state, λ and initial-state gradient
// with the same bits as the same distributed run with that document clean. Segmented scans too.
// Sanitizer builds run a subset of the recurrence sweep (the unblocked engine, one poison value
// per input and document, in turn).
// One body, run on host memory (serial, comm::local) and on the device stand-in (comm::standin).

#include <loom/backend/serial.hpp>
#include <loom/comm/local.hpp>
#include <loom/scan/distributed.hpp>

#include <support/distributed.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <mutex>
#include <string>
#include <vector>

#include "poison.hpp"

using loom::index_t;
namespace ls = loom::scan;
namespace lt = loom::test;
namespace lp = loom::test::poison;

namespace {

template <class T, std::size_t R>
using view = lt::dview_t<T, R>;

template <class T>
struct inputs {
  std::vector<T> a, b, init, g, dfin;
};
template <class T>
struct outputs {
  std::vector<T> h, fin, lambda, dinit;
};

//! The recurrence and its adjoint over p ranks; rank r holds rows [cut[r], cut[r + 1]).
template <class St, class T>
outputs<T> run(const inputs<T>& in, const std::vector<index_t>& off, const std::vector<index_t>& cut, index_t d,
               index_t block) {
  const index_t n = cut.back(), segs = lp::docs(off), as = St::a_size(d);
  const int p = static_cast<int>(cut.size()) - 1;
  outputs<T> out{std::vector<T>(static_cast<std::size_t>(n * d)), std::vector<T>(static_cast<std::size_t>(segs * d)),
                 std::vector<T>(static_cast<std::size_t>(n * d)), std::vector<T>(static_cast<std::size_t>(segs * d))};
  const auto ov = lt::docs_in_space(off);
  ls::options opt;
  opt.block = block;
  lt::run_ranks(p, [&](auto& comm, const auto& be) {
    const index_t b = cut[static_cast<std::size_t>(comm.rank())], e = cut[static_cast<std::size_t>(comm.rank()) + 1];
    // final states and initial-state gradients: each rank writes the rows it owns into its own copy
    std::vector<T> fin(out.fin.size(), T(0)), dinit(out.dinit.size(), T(0));
    const auto av = lp::a_view<St, lt::space>(in.a.data() + b * as, e - b, d);
    ls::linear_recurrence(
        be, comm, St{}, av, view<const T, 2>(in.b.data() + b * d, {e - b, d}),
        view<T, 2>(out.h.data() + b * d, {e - b, d}), ov,
        ls::states<T, lt::space>{view<const T, 2>(in.init.data(), {segs, d}), view<T, 2>(fin.data(), {segs, d})}, opt);
    ls::linear_recurrence_adjoint(be, comm, St{}, av, view<const T, 2>(in.g.data() + b * d, {e - b, d}),
                                  view<T, 2>(out.lambda.data() + b * d, {e - b, d}), ov,
                                  ls::adjoint_states<T, lt::space>{view<const T, 2>(in.dfin.data(), {segs, d}),
                                                                   view<T, 2>(dinit.data(), {segs, d})},
                                  opt);
    loom::fence(be);
    // rank r owns the final state of documents ending in its slice, the gradient of those starting
    // in it (empty documents: the rank holding their position, or the last rank)
    static std::mutex mu;
    const std::lock_guard<std::mutex> lock(mu);
    for (index_t s = 0; s < segs; ++s) {
      const index_t sb = off[static_cast<std::size_t>(s)], se = off[static_cast<std::size_t>(s) + 1];
      const bool last = comm.rank() == p - 1;
      const bool owns_end = sb == se ? (b <= sb && sb < e) || (sb == n && last) : (b < se && se <= e);
      const bool owns_start = sb == se ? owns_end : (b <= sb && sb < e);
      for (index_t c = 0; c < d; ++c) {
        if (owns_end) out.fin[static_cast<std::size_t>(s * d + c)] = fin[static_cast<std::size_t>(s * d + c)];
        if (owns_start) out.dinit[static_cast<std::size_t>(s * d + c)] = dinit[static_cast<std::size_t>(s * d + c)];
      }
    }
  });
  return out;
}

enum class input { a, b, init, g, d_final };

template <class St, class T>
void sweep(const std::string& what, index_t d) {
  const index_t n = 500;
  const auto off = lp::documents(n);
  const index_t segs = lp::docs(off), as = St::a_size(d);
  const double scale = 1.0 / static_cast<double>(as / d > 1 ? as / d : 1);
  const inputs<T> clean{lt::uniform<T>(n * as, -scale, scale, 41), lt::uniform<T>(n * d, -1, 1, 42),
                        lt::uniform<T>(segs * d, -1, 1, 43), lt::uniform<T>(n * d, -1, 1, 44),
                        lt::uniform<T>(segs * d, -1, 1, 45)};
  auto row_doc = [&](index_t r) { return lp::doc_of(off, r); };
  auto seg_doc = [](index_t r) { return r; };
  for (int p : {2, 3, 4})
    for (index_t block : {0, 16}) {
      if (lt::sanitized && block != 0) continue;  // sanitizer builds: one engine, one poison value per place
      const auto cut = lt::uneven_slices(n, p, 50 + static_cast<std::uint64_t>(p));
      const auto want = run<St>(clean, off, cut, d, block);
      int k = 0;
      for (input in : {input::a, input::b, input::init, input::g, input::d_final})
        for (index_t s : {1, 3, 4, 6, 7})
          for (lp::value v : lp::all_values) {
            if (lt::sanitized && v != lp::all_values[static_cast<std::size_t>((static_cast<index_t>(in) + s) % 3)])
              continue;
            ++k;
            const bool per_doc = in == input::init || in == input::d_final;
            const bool empty = off[static_cast<std::size_t>(s)] == off[static_cast<std::size_t>(s) + 1];
            if (empty && !per_doc) continue;
            auto dirty = clean;
            const index_t t = empty ? -1 : lp::row_in(off, s, k % 3), c = k % d;
            const T x = lp::make<T>(v);
            if (in == input::a) dirty.a[static_cast<std::size_t>(t * as + k % as)] = x;
            if (in == input::b) dirty.b[static_cast<std::size_t>(t * d + c)] = x;
            if (in == input::init) dirty.init[static_cast<std::size_t>(s * d + c)] = x;
            if (in == input::g) dirty.g[static_cast<std::size_t>(t * d + c)] = x;
            if (in == input::d_final) dirty.dfin[static_cast<std::size_t>(s * d + c)] = x;
            const auto got = run<St>(dirty, off, cut, d, block);
            INFO(what << ", P = " << p << ", block " << block << ": " << lp::name(v) << " in input "
                      << static_cast<int>(in) << " of document " << s << " (token " << t << ")");
            lp::require_others_equal(got.h, want.h, d, row_doc, s, "h");
            lp::require_others_equal(got.fin, want.fin, d, seg_doc, s, "final_state");
            lp::require_others_equal(got.lambda, want.lambda, d, row_doc, s, "lambda");
            lp::require_others_equal(got.dinit, want.dinit, d, seg_doc, s, "d_initial");
            const bool nan = v == lp::value::nan;
            if (in == input::a || in == input::b || in == input::init) CHECK(lp::rows_hold(got.fin, d, s, s + 1, !nan));
            if (in == input::a || in == input::g || in == input::d_final)
              CHECK(lp::rows_hold(got.dinit, d, s, s + 1, !nan));
          }
    }
}

}  // namespace

TEST_CASE("isolation over ranks: recurrences, a non-finite value in one document changes no other",
          "[scan][comm][isolation]") {
  sweep<ls::scalar, double>("scalar fp64", 4);
  sweep<ls::diagonal, double>("diagonal fp64", 4);
  sweep<ls::diagonal, float>("diagonal fp32", 16);
  sweep<ls::block_diagonal<2>, double>("block_diagonal<2> fp64", 4);
  sweep<ls::block_diagonal<3>, float>("block_diagonal<3> fp32", 6);
  sweep<ls::dense, double>("dense fp64", 3);
}

TEST_CASE("isolation over ranks: segmented scans, a non-finite element in one document changes no other",
          "[scan][comm][isolation]") {
  const index_t n = 20000;
  const auto off = lp::documents(n);
  const auto ov = lt::docs_in_space(off);
  const auto clean = lt::uniform<float>(n, -1, 1, 61);
  auto row_doc = [&](index_t r) { return lp::doc_of(off, r); };
  const ls::plus<float> m;
  for (int p : {2, 3, 4}) {
    const auto cut = lt::uneven_slices(n, p, 70 + static_cast<std::uint64_t>(p));
    for (int variant = 0; variant < 4; ++variant) {
      const bool exclusive = variant & 1, reverse = variant & 2;
      auto run_scan = [&](const std::vector<float>& x) {
        std::vector<float> out(x.size());
        ls::options opt;
        opt.dir = reverse ? ls::direction::reverse : ls::direction::forward;
        lt::run_ranks(p, [&](auto& comm, const auto& be) {
          const index_t b = cut[static_cast<std::size_t>(comm.rank())],
                        e = cut[static_cast<std::size_t>(comm.rank()) + 1];
          const view<const float, 1> in(x.data() + b, {e - b});
          const view<float, 1> o(out.data() + b, {e - b});
          if (exclusive)
            ls::exclusive_scan(be, comm, m, in, o, 0.5f, ov, opt);
          else
            ls::inclusive_scan(be, comm, m, in, o, ov, opt);
          loom::fence(be);
        });
        return out;
      };
      const auto want = run_scan(clean);
      int k = 0;
      for (index_t s : {1, 4, 6, 7})
        for (lp::value v : lp::all_values) {
          auto dirty = clean;
          const index_t t = lp::row_in(off, s, ++k % 3);
          dirty[static_cast<std::size_t>(t)] = lp::make<float>(v);
          const auto got = run_scan(dirty);
          INFO("P = " << p << ", exclusive " << exclusive << ", reverse " << reverse << ": " << lp::name(v)
                      << " at token " << t);
          lp::require_others_equal(got, want, 1, row_doc, s, "out");
          if (!exclusive) CHECK(!lp::is_finite(got[static_cast<std::size_t>(t)]));
        }
    }
  }
}
