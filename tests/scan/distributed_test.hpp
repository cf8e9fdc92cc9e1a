// Cross-rank scans (P ranks as threads): monoid scans and linear recurrences, forward and adjoint,
// with segments that cross rank boundaries and uneven (also empty) slices, against the fp64 serial
// oracles of tests/scan/oracle.hpp. One body, run on host memory (serial, comm::local) and on the
// device stand-in (comm::standin, streams with random delays): see support/distributed.hpp.

#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>
#include <loom/scan/distributed.hpp>

#include <support/allocations.hpp>
#include <support/distributed.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/ranks.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "oracle.hpp"

using loom::index_t;
namespace ls = loom::scan;
namespace lt = loom::test;

namespace {

const auto slices = lt::uneven_slices;

std::vector<index_t> crossing_offsets(index_t n, std::uint64_t stream) {
  auto g = lt::rng(stream);
  std::vector<index_t> o{0, 0};
  while (o.back() < n) o.push_back(std::min<index_t>(n, o.back() + 1 + static_cast<index_t>(g() % (n / 4 + 1))));
  o.push_back(n);
  return o;
}

}  // namespace

TEST_CASE("scan over ranks: non-commutative segmented scans, every variant, exact" LOOM_BACKEND_TAG, "[scan][comm]") {
  const lt::mat2_product m;
  const index_t n = 1021;
  auto g = lt::rng(1);
  std::vector<lt::mat2> x(static_cast<std::size_t>(n));
  for (auto& e : x) e = {g() % 5, g() % 3, g() % 3, g() % 5};
  const auto offsets = crossing_offsets(n, 2);
  const lt::mat2 init{2, 1, 1, 1};
  for (int p : {1, 2, 3, 4, 7}) {
    const auto cut = slices(n, p, 3 + static_cast<std::uint64_t>(p));
    for (int variant = 0; variant < 8; ++variant) {
      const bool exclusive = variant & 1, reverse = variant & 2, segmented = variant & 4;
      // The oracle: the single-rank scan (itself checked against the loop in scan_test).
      std::vector<lt::mat2> want(x.size());
      const std::vector<std::int32_t> off32(offsets.begin(), offsets.end());
      // int64 offsets for even P, int32 for odd P
      const loom::segments<> docs = !segmented ? loom::segments<>{}
                                    : p % 2    ? loom::segments<>(std::span<const std::int32_t>(off32))
                                               : loom::segments<>(std::span<const index_t>(offsets));
      const ls::options opt{reverse ? ls::direction::reverse : ls::direction::forward, 16};
      const loom::tensor_view<const lt::mat2, 1> all(x.data(), {n});
      const loom::tensor_view<lt::mat2, 1> wv(want.data(), {n});
      if (exclusive)
        ls::exclusive_scan(loom::serial{}, m, all, wv, init, docs, opt);
      else
        ls::inclusive_scan(loom::serial{}, m, all, wv, docs, opt);
      std::vector<lt::mat2> got(x.size()), again(x.size());
      lt::run_ranks(p, [&](auto& comm, const auto& be) {
        const index_t b = cut[comm.rank()], e = cut[comm.rank() + 1];
        const auto in = lt::dview<const lt::mat2, 1>(x.data() + b, {e - b});
        const loom::segments<lt::space> rank_docs = !segmented ? loom::segments<lt::space>{}
                                                    : p % 2    ? lt::docs_in_space(off32)
                                                               : lt::docs_in_space(offsets);
        const auto plan = ls::make_plan(be, comm, m, e - b, rank_docs, opt);
        loom::workspace_buffer ws(plan.workspace_bytes());
        for (auto* dst : {&got, &again}) {  // two calls with one plan
          const auto out = lt::dview<lt::mat2, 1>(dst->data() + b, {e - b});
          if (exclusive)
            ls::exclusive_scan(be, comm, plan, in, out, init, ws.span());
          else
            ls::inclusive_scan(be, comm, plan, in, out, ws.span());
        }
        loom::fence(be);
      });
      INFO("P = " << p << ", exclusive " << exclusive << ", reverse " << reverse << ", segmented " << segmented);
      REQUIRE(got == want);
      REQUIRE(again == want);
    }
  }
}

namespace {

template <class St>
void distributed_recurrence(lt::shape s, index_t n, index_t d, int p, bool exact) {
  const index_t as = lt::a_size(s, d);
  auto g = lt::rng(10 + static_cast<std::uint64_t>(p));
  std::vector<double> a(static_cast<std::size_t>(n * as)), bv(static_cast<std::size_t>(n * d));
  const double width = s == lt::shape::dense ? 0.9 / static_cast<double>(d) : 0.9;
  if (exact) {
    for (auto& v : a) v = g() % 2 ? 1.0 : -1.0;
    for (auto& v : bv) v = static_cast<double>(static_cast<int>(g() % 3) - 1);
  } else {
    a = lt::uniform<double>(n * as, -width, width, 11);
    bv = lt::uniform<double>(n * d, -1, 1, 12);
  }
  const auto offsets = crossing_offsets(n, 13 + static_cast<std::uint64_t>(p));
  const index_t segs = static_cast<index_t>(offsets.size()) - 1;
  const auto init =
      exact ? std::vector<double>(static_cast<std::size_t>(segs * d), 1.0) : lt::uniform<double>(segs * d, -1, 1, 14);
  const auto fwd = lt::forward_oracle(s, n, d, a, bv, offsets, init);
  const auto adj = lt::adjoint_oracle(s, n, d, a, bv, offsets, init);  // g = b, d_final = init
  const auto cut = slices(n, p, 15 + static_cast<std::uint64_t>(p));
  using T = std::conditional_t<St::a_rank == 3, double, double>;
  std::vector<T> h(static_cast<std::size_t>(n * d)), lam(h.size());
  std::vector<T> finals(static_cast<std::size_t>(segs * d), -9.0), dinit(finals);
  std::mutex mu;
  lt::run_ranks(p, [&](auto& comm, const auto& be) {
    const index_t b = cut[comm.rank()], e = cut[comm.rank() + 1], len = e - b;
    std::array<index_t, St::a_rank> ext{};
    ext[0] = len;
    if constexpr (St::a_rank == 2) ext[1] = d;
    if constexpr (St::a_rank == 3) ext[1] = ext[2] = d;
    if constexpr (St::a_rank == 4) {
      ext[1] = d / St::block;
      ext[2] = ext[3] = St::block;
    }
    const auto av = lt::dview<const double, St::a_rank>(a.data() + b * as, ext);
    const auto bvv = lt::dview<const double, 2>(bv.data() + b * d, {len, d});
    const std::vector<std::int32_t> off32(offsets.begin(), offsets.end());
    const loom::segments<lt::space> docs = p % 2 ? lt::docs_in_space(off32) : lt::docs_in_space(offsets);
    const auto iv = lt::dview<const double, 2>(init.data(), {segs, d});
    std::vector<double> my_final(finals.size(), -9.0), my_dinit(finals.size(), -9.0);
    ls::options opt;
    opt.block = 5;
    const auto plan = ls::make_plan(be, comm, St{}, len, d, docs, opt);
    loom::workspace_buffer ws(plan.workspace_bytes());
    ls::linear_recurrence(be, comm, plan, av, bvv, lt::dview<double, 2>(h.data() + b * d, {len, d}),
                          ls::states<double, lt::space>{iv, lt::dview<double, 2>(my_final.data(), {segs, d})},
                          ws.span());
    ls::linear_recurrence_adjoint(
        be, comm, plan, av, bvv, lt::dview<double, 2>(lam.data() + b * d, {len, d}),
        ls::adjoint_states<double, lt::space>{iv, lt::dview<double, 2>(my_dinit.data(), {segs, d})}, ws.span());
    loom::fence(be);
    std::lock_guard<std::mutex> lock(mu);  // every final row is written by exactly one rank
    for (std::size_t i = 0; i < finals.size(); ++i) {
      if (my_final[i] != -9.0) finals[i] = my_final[i];
      if (my_dinit[i] != -9.0) dinit[i] = my_dinit[i];
    }
  });
  INFO("P = " << p << ", n = " << n << ", d = " << d);
  if (exact) {
    REQUIRE(h == fwd.h);
    REQUIRE(lam == adj.h);
    REQUIRE(finals == fwd.finals);
    REQUIRE(dinit == adj.finals);
  } else {
    const lt::tolerance tol = lt::tolerance_for<loom::fp64>();
    lt::require_close(h, fwd.h, tol, "h");
    lt::require_close(finals, fwd.finals, tol, "final states");
    lt::require_close(lam, adj.h, tol, "lambda");
    lt::require_close(dinit, adj.finals, tol, "d initial");
  }
}

}  // namespace

TEST_CASE("linear recurrence over ranks: documents crossing ranks, forward and adjoint" LOOM_BACKEND_TAG,
          "[scan][comm][recurrence]") {
  for (int p : {1, 2, 3, 4, 7}) {
    distributed_recurrence<ls::diagonal>(lt::shape::diagonal, 16323, 3, p, false);
    distributed_recurrence<ls::diagonal>(lt::shape::diagonal, 1021, 3, p, true);
    distributed_recurrence<ls::block_diagonal<2>>(lt::shape::block2, 1021, 4, p, true);
    distributed_recurrence<ls::dense>(lt::shape::dense, 257, 4, p, false);
  }
}

TEST_CASE("linear recurrence over ranks: no segments, an initial state, empty ranks" LOOM_BACKEND_TAG,
          "[scan][comm][recurrence]") {
  const index_t n = 100, d = 2;
  const auto a = lt::uniform<double>(n * d, -0.9, 0.9, 20);
  const auto bv = lt::uniform<double>(n * d, -1, 1, 21);
  const std::vector<double> init{0.5, -2.0};
  const auto want = lt::forward_oracle(lt::shape::diagonal, n, d, a, bv, {}, init);
  for (int p : {1, 3, 4}) {
    const auto cut = slices(n, p, 22);
    std::vector<double> h(static_cast<std::size_t>(n * d)), fin(2, -9.0);
    lt::run_ranks(p, [&](auto& comm, const auto& be) {
      const index_t b = cut[comm.rank()], len = cut[comm.rank() + 1] - b;
      std::vector<double> my_fin(2, -9.0);
      ls::linear_recurrence(be, comm, ls::diagonal{}, lt::dview<const double, 2>(a.data() + b * d, {len, d}),
                            lt::dview<const double, 2>(bv.data() + b * d, {len, d}),
                            lt::dview<double, 2>(h.data() + b * d, {len, d}), loom::segments<lt::space>{},
                            ls::states<double, lt::space>{lt::dview<const double, 2>(init.data(), {1, d}),
                                                          lt::dview<double, 2>(my_fin.data(), {1, d})});
      loom::fence(be);
      if (cut[comm.rank() + 1] == n && len > 0) fin = my_fin;
    });
    lt::require_close(h, want.h, lt::tolerance_for<loom::fp64>(), "h");
    lt::require_close(fin, want.finals, lt::tolerance_for<loom::fp64>(), "final");
  }
}

TEST_CASE("scan over ranks: rejections" LOOM_BACKEND_TAG, "[scan][comm][errors]") {
  // offsets that do not end at the global length (sum of the slices) are refused on every rank
  // (offsets in device memory are the caller's contract: check_segments).
  if constexpr (lt::space::host_accessible) {
    const auto what = lt::errors_on_ranks_of(3, [&](auto& comm, const auto& be) {
      std::vector<float> x(5, 1.0f), y(5);
      const std::vector<std::int32_t> off{0, 3, 14};
      ls::inclusive_scan(be, comm, ls::plus<float>{}, lt::dview<const float, 1>(x.data(), {5}),
                         lt::dview<float, 1>(y.data(), {5}), lt::docs_in_space(off));
    });
    for (const auto& w : what) INFO(w);
    CHECK(lt::all_contain(what, "must equal the token count 15, got 14"));
  }
  // ranks giving different documents disagree, on every rank, when the plan is made
  const auto differ = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& be) {
    const std::vector<index_t> off{0, comm.rank() == 0 ? index_t{4} : index_t{6}, 10};
    (void)ls::make_plan(be, comm, ls::diagonal{}, 5, 2, lt::docs_in_space(off));
  });
  CHECK(lt::all_contain(differ, "ranks disagree on the document offsets"));
}

TEST_CASE(
    "scan over ranks: plans from a contiguous shard plan, other shard plans refused on every rank" LOOM_BACKEND_TAG,
    "[scan][comm][shard]") {
  if constexpr (lt::space::host_accessible) {  // a shard plan's offsets are host memory
    const index_t n = 1013, d = 3;
    const int p = 3;
    const auto offsets = crossing_offsets(n, 31);
    const auto sharding =
        loom::shard::make_plan(loom::segments<>(std::span<const index_t>(offsets)), p, loom::shard::contiguous{});
    const auto x = lt::uniform<double>(n, -1, 1, 32);
    const auto a = lt::uniform<double>(n * d, -0.9, 0.9, 33);
    const auto bv = lt::uniform<double>(n * d, -1, 1, 34);
    std::vector<double> y(static_cast<std::size_t>(n)), y_ref(y.size()), h(static_cast<std::size_t>(n * d)),
        h_ref(h.size());
    lt::run_ranks(p, [&](auto& comm, const auto& be) {
      const auto run = loom::shard::run_of(sharding, comm.rank());
      const index_t b = run.begin, len = run.tokens;
      const auto mp = ls::make_plan(be, comm, ls::plus<double>{}, sharding);
      const auto mp_ref = ls::make_plan(be, comm, ls::plus<double>{}, len, sharding.segments());
      const auto rp = ls::make_plan(be, comm, ls::diagonal{}, sharding, d);
      const auto rp_ref = ls::make_plan(be, comm, ls::diagonal{}, len, d, sharding.segments());
      loom::workspace_buffer ws(
          std::max({mp.workspace_bytes(), mp_ref.workspace_bytes(), rp.workspace_bytes(), rp_ref.workspace_bytes()}));
      const auto xv = lt::dview<const double, 1>(x.data() + b, {len});
      ls::inclusive_scan(be, comm, mp, xv, lt::dview<double, 1>(y.data() + b, {len}), ws.span());
      ls::inclusive_scan(be, comm, mp_ref, xv, lt::dview<double, 1>(y_ref.data() + b, {len}), ws.span());
      const auto av = lt::dview<const double, 2>(a.data() + b * d, {len, d});
      const auto bvv = lt::dview<const double, 2>(bv.data() + b * d, {len, d});
      ls::linear_recurrence(be, comm, rp, av, bvv, lt::dview<double, 2>(h.data() + b * d, {len, d}), ws.span());
      ls::linear_recurrence(be, comm, rp_ref, av, bvv, lt::dview<double, 2>(h_ref.data() + b * d, {len, d}), ws.span());
      loom::fence(be);
    });
    CHECK(std::memcmp(y.data(), y_ref.data(), sizeof(double) * y.size()) == 0);
    CHECK(std::memcmp(h.data(), h_ref.data(), sizeof(double) * h.size()) == 0);
    lt::require_close(h, lt::forward_oracle(lt::shape::diagonal, n, d, a, bv, offsets, {}).h,
                      lt::tolerance_for<loom::fp64>(), "h");
    // zigzag interleaves the ranks; a plan for 3 ranks does not fit 2
    const auto zz =
        loom::shard::make_plan(loom::segments<>(std::span<const index_t>(offsets)), p, loom::shard::zigzag{});
    const auto interleaved = lt::errors_on_ranks_of(
        p, [&](auto& comm, const auto& be) { (void)ls::make_plan(be, comm, ls::plus<double>{}, zz); });
    CHECK(lt::all_contain(interleaved, "scan::make_plan: the shard plan must give each rank one run of the sequence"));
    const auto other_size = lt::errors_on_ranks_of(
        2, [&](auto& comm, const auto& be) { (void)ls::make_plan(be, comm, ls::diagonal{}, sharding, d); });
    CHECK(lt::all_contain(other_size, "scan::make_plan: the shard plan is for 3 ranks, the communicator has 2"));
  }
}

TEST_CASE("scan over ranks: one agreement per plan, no allocation per call, plan reuse across threads" LOOM_BACKEND_TAG,
          "[scan][comm][plan]") {
  const index_t n = 4099, d = 3;
  const int p = 3;
  const auto x = lt::uniform<double>(n, -1, 1, 40);
  const auto a = lt::uniform<double>(n * d, -0.9, 0.9, 41);
  const auto bv = lt::uniform<double>(n * d, -1, 1, 42);
  const auto offsets = crossing_offsets(n, 43);
  const std::vector<std::int32_t> off32(offsets.begin(), offsets.end());
  const auto docs = lt::docs_in_space(off32);
  const auto cut = slices(n, p, 44);
  // references: the convenience forms (a fresh plan per call)
  std::vector<double> want(static_cast<std::size_t>(n)), want_h(static_cast<std::size_t>(n * d));
  lt::run_ranks(p, [&](auto& comm, const auto& be) {
    const index_t b = cut[comm.rank()], len = cut[comm.rank() + 1] - b;
    ls::inclusive_scan(be, comm, ls::plus<double>{}, lt::dview<const double, 1>(x.data() + b, {len}),
                       lt::dview<double, 1>(want.data() + b, {len}), docs);
    ls::linear_recurrence(be, comm, ls::diagonal{}, lt::dview<const double, 2>(a.data() + b * d, {len, d}),
                          lt::dview<const double, 2>(bv.data() + b * d, {len, d}),
                          lt::dview<double, 2>(want_h.data() + b * d, {len, d}), docs, ls::states<double, lt::space>{});
  });
  const int calls = 4;
  std::vector<double> got(want.size()), got_h(want_h.size());
  std::vector<long long> heap(p, -1), temps(p, -1), agree_collectives(p), call_collectives(p);
  lt::run_ranks(p, [&](auto& inner, const auto& be) {
    auto comm = lt::counted(inner);
    const int r = comm.rank();
    const index_t b = cut[r], len = cut[r + 1] - b;
    const auto plan = ls::make_plan(be, comm, ls::plus<double>{}, len, docs);
    const auto rplan = ls::make_plan(be, comm, ls::diagonal{}, len, d, docs);
    agree_collectives[r] = comm.counts().collectives.load();
    loom::workspace_buffer ws(plan.workspace_bytes()), rws(rplan.workspace_bytes());
    const auto in = lt::dview<const double, 1>(x.data() + b, {len});
    const auto out = lt::dview<double, 1>(got.data() + b, {len});
    const auto av = lt::dview<const double, 2>(a.data() + b * d, {len, d});
    const auto bvv = lt::dview<const double, 2>(bv.data() + b * d, {len, d});
    const auto hv = lt::dview<double, 2>(got_h.data() + b * d, {len, d});
    const auto count = lt::count_allocations([&] {
      for (int c = 0; c < calls; ++c) {
        ls::inclusive_scan(be, comm, plan, in, out, ws.span());
        ls::linear_recurrence(be, comm, rplan, av, bvv, hv, rws.span());
      }
    });
    loom::fence(be);
    heap[r] = count.heap;
    temps[r] = count.temporaries;
    call_collectives[r] = comm.counts().collectives.load() - agree_collectives[r];
  });
  for (int r = 0; r < p; ++r) {
    INFO("rank " << r);
    CHECK(heap[r] == 0);
    CHECK(temps[r] == 0);
    CHECK(agree_collectives[r] == 2);         // one agreement per plan, nothing else
    CHECK(call_collectives[r] == 2 * calls);  // one all_gather of aggregates per call
  }
  REQUIRE(std::memcmp(got.data(), want.data(), sizeof(double) * want.size()) == 0);
  REQUIRE(std::memcmp(got_h.data(), want_h.data(), sizeof(double) * want_h.size()) == 0);
  // Every rank's plan shared by two threads, each with its own communicator, workspace and output.
  std::vector<double> t0(want.size()), t1(want.size());
  lt::run_ranks(p, [&](auto& comm0, const auto& be) {
    const int r = comm0.rank();
    const index_t b = cut[r], len = cut[r + 1] - b;
    const auto plan = ls::make_plan(be, comm0, ls::plus<double>{}, len, docs);
    auto comm1 = comm0.split(0, r);
    std::thread other([&] {
      lt::thread_backend own;
      loom::workspace_buffer ws(plan.workspace_bytes());
      ls::inclusive_scan(own.policy(), comm1, plan, lt::dview<const double, 1>(x.data() + b, {len}),
                         lt::dview<double, 1>(t1.data() + b, {len}), ws.span());
      loom::fence(own.policy());
    });
    loom::workspace_buffer ws(plan.workspace_bytes());
    ls::inclusive_scan(be, comm0, plan, lt::dview<const double, 1>(x.data() + b, {len}),
                       lt::dview<double, 1>(t0.data() + b, {len}), ws.span());
    loom::fence(be);
    other.join();
  });
  REQUIRE(std::memcmp(t0.data(), want.data(), sizeof(double) * want.size()) == 0);
  REQUIRE(std::memcmp(t1.data(), want.data(), sizeof(double) * want.size()) == 0);
  // A workspace too small, or views that do not fit the plan, are refused on the calling rank.
  lt::run_ranks(1, [&](auto& comm, const auto& be) {
    const auto plan = ls::make_plan(be, comm, ls::plus<double>{}, n);
    loom::workspace_buffer ws(plan.workspace_bytes());
    lt::require_loom_error(
        [&] {
          ls::inclusive_scan(be, comm, plan, lt::dview<const double, 1>(x.data(), {n}),
                             lt::dview<double, 1>(got.data(), {n}), ws.span().first(8));
        },
        loom::errc::invalid_argument, {"inclusive_scan: workspace must hold at least"});
    lt::require_loom_error(
        [&] {
          ls::inclusive_scan(be, comm, plan, lt::dview<const double, 1>(x.data(), {n - 1}),
                             lt::dview<double, 1>(got.data(), {n - 1}), ws.span());
        },
        loom::errc::shape_mismatch, {"inclusive_scan: in must be [4099] (the plan's elements)"});
  });
}

#if defined(LOOM_TEST_BACKEND_STANDIN)
TEST_CASE("scan over ranks on the stand-in: 50 seeds of random stream delays, every result exact",
          "[scan][comm][standin][delays]") {
  // Exact inputs (integer matrices, +-1 recurrences), so every result is compared bit for bit with
  // the fp64 oracle whatever the order in which the streams ran.
  const lt::mat2_product m;
  const index_t n = 613, d = 3;
  auto g = lt::rng(70);
  std::vector<lt::mat2> x(static_cast<std::size_t>(n));
  for (auto& e : x) e = {g() % 5, g() % 3, g() % 3, g() % 5};
  std::vector<double> a(static_cast<std::size_t>(n * d)), bv(a.size());
  for (auto& v : a) v = g() % 2 ? 1.0 : -1.0;
  for (auto& v : bv) v = static_cast<double>(static_cast<int>(g() % 3) - 1);
  const auto offsets = crossing_offsets(n, 71);
  const index_t segs = static_cast<index_t>(offsets.size()) - 1;
  const std::vector<double> init(static_cast<std::size_t>(segs * d), 1.0);
  std::vector<lt::mat2> want(x.size());
  ls::inclusive_scan(loom::serial{}, m, loom::tensor_view<const lt::mat2, 1>(x.data(), {n}),
                     loom::tensor_view<lt::mat2, 1>(want.data(), {n}),
                     loom::segments<>(std::span<const index_t>(offsets)), ls::options{ls::direction::forward, 16});
  const auto fwd = lt::forward_oracle(lt::shape::diagonal, n, d, a, bv, offsets, init);
  const auto adj = lt::adjoint_oracle(lt::shape::diagonal, n, d, a, bv, offsets, init);
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const int p = 1 + static_cast<int>(seed % 5);
    const auto cut = slices(n, p, 72 + seed);
    std::vector<lt::mat2> got(x.size());
    std::vector<double> h(a.size()), lam(a.size());
    auto opt = lt::standin_ranks(seed);
    opt.max_delay = std::chrono::microseconds(200);
    lt::run_ranks(
        p,
        [&](auto& comm, const auto& be) {
          const index_t b = cut[comm.rank()], len = cut[comm.rank() + 1] - b;
          const auto docs = lt::docs_in_space(offsets);
          const auto plan = ls::make_plan(be, comm, m, len, docs, ls::options{ls::direction::forward, 16});
          const auto rplan = ls::make_plan(be, comm, ls::diagonal{}, len, d, docs, ls::options{.block = 7});
          loom::workspace_buffer ws(plan.workspace_bytes()), rws(rplan.workspace_bytes());
          const auto av = lt::dview<const double, 2>(a.data() + b * d, {len, d});
          const auto bvv = lt::dview<const double, 2>(bv.data() + b * d, {len, d});
          const auto iv = lt::dview<const double, 2>(init.data(), {segs, d});
          ls::inclusive_scan(be, comm, plan, lt::dview<const lt::mat2, 1>(x.data() + b, {len}),
                             lt::dview<lt::mat2, 1>(got.data() + b, {len}), ws.span());
          ls::linear_recurrence(be, comm, rplan, av, bvv, lt::dview<double, 2>(h.data() + b * d, {len, d}),
                                ls::states<double, lt::space>{iv, {}}, rws.span());
          ls::linear_recurrence_adjoint(be, comm, rplan, av, bvv, lt::dview<double, 2>(lam.data() + b * d, {len, d}),
                                        ls::adjoint_states<double, lt::space>{iv, {}}, rws.span());
          loom::fence(be);
        },
        opt);
    INFO("seed " << seed << ", P = " << p);
    REQUIRE(got == want);
    REQUIRE(h == fwd.h);
    REQUIRE(lam == adj.h);
  }
}
#endif
