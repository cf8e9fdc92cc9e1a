// LASP-2 on P = 1..5 and 7 ranks against single-device chunked attention on the whole sequence
// (fp64, serial, itself checked against the oracle): documents crossing ranks, empty and
// single-token documents, every gating, both exchanges and (host memory) both forward schedules;
// bitwise exact on small integers; one agreement per plan, the exchange's traffic counted byte for
// byte and nothing allocated per plan-taking call; on host memory the same with both local steps
// as batched products (the reference provider), and those against the fp64 oracle and loom's
// kernels; on the stand-in, 50 seeds of stream delays give the same bits. One body, run on host memory (serial,
// comm::local) and on the device stand-in (comm::standin): support/distributed.hpp.

#include <loom/backend/serial.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/detail/gemm_engine.hpp>

#include <support/allocations.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/ranks.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <string>
#include <type_traits>
#include <vector>

#include "isolation_checks.hpp"
#include "lasp2_ranks.hpp"

using loom::index_t;
namespace lt = loom::test;
namespace lasp2 = loom::linear_attention::lasp2;
namespace lin = loom::linear_attention;
using lt::la::gating;
using lt::la::outputs;
using lt::la::problem;

namespace {

template <class T, std::size_t R>
loom::tensor_view<T, R> host_view(T* data, const index_t (&e)[R]) {
  return lt::la::view_in<loom::host_memory>(data, e);
}

template <class F>
auto with_host_gating(const problem& p, F&& f) {
  if (p.mode == gating::none) return f(lin::no_decay{});
  if (p.mode == gating::fixed) return f(lin::fixed_decay<double>{host_view(p.head_lg.data(), {p.H})});
  return f(lin::scalar_gate<double>{host_view(p.lg.data(), {p.T, p.H})});
}

//! The single-device reference: chunked, serial, fp64 (itself checked against the oracle).
outputs single(const problem& p, const std::vector<double>& d_o, const std::vector<double>& dfin, index_t chunk) {
  const index_t T = p.T, H = p.H, dk = p.dk, dv = p.dv, docs = p.docs();
  outputs r{std::vector<double>(p.v.size()),   std::vector<double>(p.init.size()), std::vector<double>(p.q.size()),
            std::vector<double>(p.k.size()),   std::vector<double>(p.v.size()),    std::vector<double>(p.lg.size()),
            std::vector<double>(p.init.size())};
  lin::operands<loom::fp64> x{host_view(p.q.data(), {T, H, dk}), host_view(p.k.data(), {T, H, dk}),
                              host_view(p.v.data(), {T, H, dv}), host_view(p.init.data(), {docs, H, dk, dv})};
  const lin::options opt{.chunk = chunk, .scale = p.scale};
  const loom::segments<> docs_v(std::span<const index_t>(p.cu));
  with_host_gating(p, [&](const auto& g) {
    lin::forward(loom::serial{}, docs_v, g, x, host_view(r.o.data(), {T, H, dv}),
                 host_view(r.fin.data(), {docs, H, dk, dv}), opt);
  });
  lin::gradients<loom::fp64> gr{host_view(r.dq.data(), {T, H, dk}), host_view(r.dk.data(), {T, H, dk}),
                                host_view(r.dv.data(), {T, H, dv})};
  if (p.mode == gating::scalar) gr.d_log_gate = host_view(r.dlg.data(), {T, H});
  gr.d_initial_state = host_view(r.dinit.data(), {docs, H, dk, dv});
  with_host_gating(p, [&](const auto& g) {
    lin::backward(loom::serial{}, docs_v, g, x, host_view(d_o.data(), {T, H, dv}),
                  host_view(dfin.data(), {docs, H, dk, dv}), gr, opt);
  });
  return r;
}

//! P slices of T tokens cut at random points (empty slices included).
std::vector<index_t> random_splits(index_t T, int P, std::uint64_t stream) {
  auto g = lt::rng(stream);
  std::vector<index_t> s{0, T};
  std::uniform_int_distribution<index_t> d(0, T);
  for (int i = 0; i < P - 1; ++i) s.push_back(d(g));
  std::sort(s.begin(), s.end());
  return s;
}

void compare(const outputs& got, const outputs& want, lt::tolerance tol, const std::string& what) {
  lt::require_close(got.o, want.o, tol, what + " o");
  lt::require_close(got.fin, want.fin, tol, what + " final state");
  lt::require_close(got.dq, want.dq, tol, what + " dq");
  lt::require_close(got.dk, want.dk, tol, what + " dk");
  lt::require_close(got.dv, want.dv, tol, what + " dv");
  lt::require_close(got.dlg, want.dlg, tol, what + " d log gate");
  lt::require_close(got.dinit, want.dinit, tol, what + " d initial state");
}

// Documents crossing ranks, a single-token and an empty document, and long ones.
const std::vector<index_t> mixed_docs{0, 40, 41, 41, 100, 157};

}  // namespace

TEST_CASE("lasp2 over ranks equals single-device chunked attention", "[linear_attention][lasp2][comm]") {
  // With loom's kernels as the forward's local step on the backend under test and, on host memory,
  // with batched products through the reference provider (the schedule LASP-2 runs on cuBLAS,
  // linear_attention::cublas::batched: chunk states before the exchange, document 0's again from
  // the incoming state, then the outputs), fp64 and fp32.
  const int P = GENERATE(1, 2, 3, 4, 5, 7);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const index_t T = 157;
  const auto p = lt::la::make_problem(T, 2, 4, 3, mode, mixed_docs, true, 40);
  const auto d_o = lt::uniform<double>(T * 2 * 3, -1, 1, 41);
  const auto dfin = lt::uniform<double>(p.docs() * 2 * 4 * 3, -1, 1, 42);
  const auto want = single(p, d_o, dfin, 64);
  for (const auto& sc : lt::la::schedules())
    for (const auto& splits : {random_splits(T, P, static_cast<std::uint64_t>(P)), random_splits(T, P, 99)}) {
      const std::string what = "P=" + std::to_string(P) + " exchange " + std::to_string(static_cast<int>(sc.ex)) +
                               (sc.fused ? " chunk-parallel" : "");
      compare(lt::la::run_lasp2<loom::fp64>(p, splits, d_o, dfin, sc), want, {1e-11, 1e-11}, what);
      if constexpr (std::is_same_v<lt::space, loom::host_memory>) {
        using products = lin::detail::host_products;
        compare(lt::la::run_lasp2<loom::fp64, lt::space, lt::la::ranks_under_test, products>(p, splits, d_o, dfin, sc),
                want, {1e-11, 1e-11}, what + ", batched products");
        compare(lt::la::run_lasp2<loom::fp32, lt::space, lt::la::ranks_under_test, products>(p, splits, d_o, dfin, sc),
                want, {2e-5, 2e-5}, what + ", batched products, fp32");
      }
    }
}

namespace {

//! LASP-2 with both local steps through batched products (the reference provider; on cuBLAS:
//! linear_attention::cublas::batched) on P ranks, documents crossing every slice boundary (P = 5:
//! rank 1's slice is empty, inside a document), against the fp64 oracle at the oracle checks'
//! tolerances and against LASP-2 on loom's kernels with the same plan inputs.
template <class Prec>
void check_products(int P, gating mode, const std::string& what) {
  using S = typename Prec::storage_type;
  using A = typename Prec::accum_type;
  using products = lin::detail::host_products;
  const index_t T = 157, H = 2, dk = 4, dv = 3;
  const problem p = lt::la::rounded<Prec>(lt::la::make_problem(T, H, dk, dv, mode, mixed_docs, true, 80));
  const auto d_o = lt::la::rounded_to<S>(lt::uniform<double>(T * H * dv, -1, 1, 81));
  const auto dfin = lt::la::rounded_to<A>(lt::uniform<double>(p.docs() * H * dk * dv, -1, 1, 82));
  const auto want = lt::la::oracle(p, &d_o, &dfin);
  const std::vector<index_t> cut = P == 1   ? std::vector<index_t>{0, T}
                                   : P == 2 ? std::vector<index_t>{0, 70, T}
                                   : P == 3 ? std::vector<index_t>{0, 20, 120, T}
                                            : std::vector<index_t>{0, 20, 20, 70, 130, T};
  REQUIRE(cut.size() == static_cast<std::size_t>(P) + 1);
  const lt::tolerance same = std::is_same_v<S, double> ? lt::tolerance{1e-11, 1e-11} : lt::tolerance{2e-5, 2e-5};
  for (const auto& sc : lt::la::schedules())
    for (index_t chunk : {7, 16}) {
      const auto got =
          lt::la::run_lasp2<Prec, lt::space, lt::la::ranks_under_test, products>(p, cut, d_o, dfin, sc, chunk);
      const auto kernels = lt::la::run_lasp2<Prec>(p, cut, d_o, dfin, sc, chunk);
      INFO(what << ", P = " << P << ", gating " << static_cast<int>(mode) << ", exchange " << static_cast<int>(sc.ex)
                << (sc.fused ? ", chunk-parallel" : "") << ", C = " << chunk);
      lt::la::require_oracle_close<Prec>(got, want, mode);
      compare(got, kernels, same, what + " against loom's kernels");
    }
}

}  // namespace

TEST_CASE("lasp2 over ranks through batched products: the backward against the oracle and loom's kernels",
          "[linear_attention][lasp2][comm][products]") {
  // Host memory only (the reference provider reads it); the forward runs on the products too.
  const int P = GENERATE(1, 2, 3, 5);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  if constexpr (std::is_same_v<lt::space, loom::host_memory>) {
    check_products<loom::fp64>(P, mode, "fp64");
    check_products<loom::fp32>(P, mode, "fp32");
  }
}

TEST_CASE("lasp2 over ranks is bitwise exact on small integers without decay", "[linear_attention][lasp2][comm]") {
  const int P = GENERATE(2, 3, 5, 7);
  const index_t T = 120;
  auto p = lt::la::make_problem(T, 1, 3, 2, gating::none, {0, 10, 90, 120}, true, 50);
  p.scale = 1;
  auto ints = [](index_t n, std::uint64_t s) {
    const auto f = lt::small_integers<float>(n, -2, 2, s);
    return std::vector<double>(f.begin(), f.end());
  };
  p.q = ints(T * 3, 1), p.k = ints(T * 3, 2), p.v = ints(T * 2, 3), p.init = ints(3 * 6, 4);
  const auto d_o = ints(T * 2, 5);
  const auto dfin = ints(3 * 6, 6);
  const auto want = single(p, d_o, dfin, 7);
  const auto got = lt::la::run_lasp2<loom::fp64>(p, random_splits(T, P, 7), d_o, dfin, {}, 7);
  CHECK(got.o == want.o);
  CHECK(got.fin == want.fin);
  CHECK(got.dq == want.dq);
  CHECK(got.dk == want.dk);
  CHECK(got.dv == want.dv);
  CHECK(got.dinit == want.dinit);
}

namespace {

//! Per-call traffic and allocations of `calls` forward + backward pairs with one plan, its local
//! steps on loom's kernels (Engine void) or through the products tag Engine.
template <class Engine>
void check_traffic(lasp2::exchange ex, const std::string& what) {
  INFO(what);
  const int P = 3, calls = 2;
  const index_t T = 61, H = 2, dk = 3, dv = 2, docs = 3;
  const std::vector<index_t> cu{0, 25, 25, T}, splits{0, 20, 41, T};
  const auto p = lt::la::make_problem(T, H, dk, dv, gating::scalar, cu, true, 90);
  const std::vector<float> q(p.q.begin(), p.q.end()), k(p.k.begin(), p.k.end()), v(p.v.begin(), p.v.end()),
      lg(p.lg.begin(), p.lg.end()), init(p.init.begin(), p.init.end()), dfin(init.size(), 0.5f);
  // Per rank: collectives, all_gather bytes in, messages and bytes out after make_plan and after
  // the calls; heap and temporary allocations during the calls.
  std::vector<std::array<long long, 9>> seen(P);
  lt::run_ranks(P, [&](auto& inner, const auto& b) {
    auto comm = lt::counted(inner);
    const auto r = static_cast<std::size_t>(comm.rank());
    const index_t from = splits[r], n = splits[r + 1] - from;
    const lasp2::options opt{.chunked = {.chunk = 8}, .exchange = ex};
    const auto pl = [&] {
      if constexpr (std::is_void_v<Engine>)
        return lasp2::make_plan(b, comm, loom::segments{std::span<const index_t>(cu)}, from, {n, H, dk, dv}, opt);
      else
        return lasp2::make_plan(b, comm, Engine{}, loom::segments{std::span<const index_t>(cu)}, from, {n, H, dk, dv},
                                opt);
    }();
    auto& mine = seen[r];
    const auto& t = comm.counts();
    mine[0] = t.collectives.load(), mine[1] = t.gathered_in.load(), mine[2] = t.messages.load();
    mine[3] = t.bytes_out.load();
    loom::workspace_buffer ws(pl.workspace_bytes());
    const lin::operands<loom::fp32, lt::space> x{
        lt::la::in_space(q.data() + from * H * dk, {n, H, dk}), lt::la::in_space(k.data() + from * H * dk, {n, H, dk}),
        lt::la::in_space(v.data() + from * H * dv, {n, H, dv}), lt::la::in_space(init.data(), {docs, H, dk, dv})};
    std::vector<float> o(static_cast<std::size_t>(n * H * dv)), fin(init.size()),
        xin(static_cast<std::size_t>(H * dk * dv)), dq(static_cast<std::size_t>(n * H * dk)), dkk(dq.size()),
        dvv(o.size()), dlg(static_cast<std::size_t>(n * H)), dinit(init.size());
    const lin::gradients<loom::fp32, lt::space> gr{
        lt::la::in_space(dq.data(), {n, H, dk}), lt::la::in_space(dkk.data(), {n, H, dk}),
        lt::la::in_space(dvv.data(), {n, H, dv}), lt::la::in_space(dlg.data(), {n, H}),
        lt::la::in_space(dinit.data(), {docs, H, dk, dv})};
    const lin::scalar_gate<float, lt::space> gate{lt::la::in_space(lg.data() + from * H, {n, H})};
    const auto counted = lt::count_allocations([&] {
      for (int c = 0; c < calls; ++c) {
        lasp2::forward(b, comm, pl, gate, x, lt::la::in_space(o.data(), {n, H, dv}),
                       lt::la::in_space(fin.data(), {docs, H, dk, dv}), lt::la::in_space(xin.data(), {H, dk, dv}),
                       ws.span());
        lasp2::backward(b, comm, pl, gate, x, lt::la::in_space(static_cast<const float*>(o.data()), {n, H, dv}),
                        lt::la::in_space(dfin.data(), {docs, H, dk, dv}),
                        lt::la::in_space(static_cast<const float*>(xin.data()), {H, dk, dv}), gr, ws.span());
      }
    });
    loom::fence(b);
    mine[4] = t.collectives.load(), mine[5] = t.gathered_in.load(), mine[6] = t.messages.load();
    mine[7] = t.bytes_out.load();
    mine[8] = counted.heap + counted.temporaries;
  });
  // One message per pass: H (1 + dk dv) + 1 floats, to each of the P - 1 peers.
  const long long msg = (H * (1 + dk * dv) + 1) * static_cast<long long>(sizeof(float)), passes = 2 * calls;
  // Over a stream-ordered communicator both exchanges are one all_gather.
  const bool gathered = ex == lasp2::exchange::all_gather || !lt::space::host_accessible;
  for (int r = 0; r < P; ++r) {
    INFO("rank " << r);
    const auto& m = seen[static_cast<std::size_t>(r)];
    CHECK(m[0] == 1);  // the agreement, in make_plan
    CHECK(m[4] - m[0] == (gathered ? passes : 0));
    CHECK(m[5] - m[1] == (gathered ? passes * (P - 1) * msg : 0));
    CHECK(m[6] - m[2] == (gathered ? 0 : passes * (P - 1)));
    CHECK(m[7] - m[3] == (gathered ? 0 : passes * (P - 1) * msg));
    CHECK(m[8] == 0);
  }
}

}  // namespace

TEST_CASE("lasp2 over ranks: one agreement per plan, the exchange's bytes per pass, nothing allocated per call",
          "[linear_attention][lasp2][comm][plan]") {
  // With loom's kernels and, on host memory, with both local steps through batched products (the
  // reference provider): the same traffic, nothing allocated.
  const auto ex = GENERATE(lasp2::exchange::all_gather, lasp2::exchange::posted);
  check_traffic<void>(ex, "loom's kernels");
  if constexpr (std::is_same_v<lt::space, loom::host_memory>)
    check_traffic<lin::detail::host_products>(ex, "batched products");
}

TEST_CASE(
    "lasp2 over ranks: a plan from a contiguous shard plan gives the bits of explicit slices, other shard "
    "plans are refused on every rank",
    "[linear_attention][lasp2][comm][shard]") {
  const index_t T = 157, H = 2, dk = 4, dv = 3;
  const auto p = lt::la::make_problem(T, H, dk, dv, gating::scalar, mixed_docs, true, 60);
  const auto d_o = lt::uniform<double>(T * H * dv, -1, 1, 61);
  const auto dfin = lt::uniform<double>(p.docs() * H * dk * dv, -1, 1, 62);
  const loom::segments<> docs{std::span<const index_t>(mixed_docs)};
  for (int P : {2, 3, 5}) {
    const auto sharding = loom::shard::make_plan(docs, P, loom::shard::contiguous{});
    std::vector<index_t> splits;
    for (int r = 0; r < P; ++r) splits.push_back(loom::shard::run_of(sharding, r).begin);
    splits.push_back(T);
    for (const auto& sc : lt::la::schedules()) {
      INFO("P = " << P << ", exchange " << static_cast<int>(sc.ex));
      const auto from_shards =
          lt::la::run_lasp2<loom::fp64, lt::space, lt::la::ranks_under_test, lt::la::from_shard_plan>(p, splits, d_o,
                                                                                                      dfin, sc);
      CHECK(lt::la::same_bits(from_shards, lt::la::run_lasp2<loom::fp64>(p, splits, d_o, dfin, sc)));
    }
  }
  const auto zigzag = loom::shard::make_plan(docs, 3, loom::shard::zigzag{});
  const auto interleaved = lt::errors_on_ranks_of(3, [&](auto& comm, const auto& b) {
    (void)lasp2::make_plan(b, comm, zigzag, {zigzag.rank(comm.rank()).tokens, H, dk, dv});
  });
  CHECK(lt::all_contain(interleaved, "lasp2::make_plan: the shard plan must give each rank one run of the sequence"));
  const auto contiguous = loom::shard::make_plan(docs, 3, loom::shard::contiguous{});
  const auto wrong_tokens = lt::errors_on_ranks_of(3, [&](auto& comm, const auto& b) {
    (void)lasp2::make_plan(b, comm, contiguous, {contiguous.rank(comm.rank()).tokens + 1, H, dk, dv});
  });
  CHECK(lt::all_contain(wrong_tokens, "slice.tokens must be this rank's tokens in the shard plan"));
}

TEST_CASE("lasp2 over ranks: a forward schedule the memory cannot run is rejected on every rank",
          "[linear_attention][lasp2][comm][errors]") {
  const index_t T = 20, H = 1, d = 2;
  const std::vector<index_t> cu{0, 7, T};
  const auto errors = lt::errors_on_ranks_of(2, [&](auto& comm, const auto& b) {
    (void)lasp2::make_plan(b, comm, loom::segments{std::span<const index_t>(cu)}, comm.rank() * 10, {10, H, d, d},
                           {.chunked = {.fused = true}});
  });
  for (const auto& e : errors) {
    if (lt::space::host_accessible)
      CHECK(e.empty());  // the fused schedule runs on host memory
    else
      CHECK_THAT(e, Catch::Matchers::Contains("lasp2::make_plan: options.chunked.fused: the fused LASP-2 schedule "
                                              "runs on host memory only"));
  }
}

#if defined(LOOM_TEST_BACKEND_STANDIN)
TEST_CASE("lasp2 over ranks on the stand-in gives the bits of the host path",
          "[linear_attention][lasp2][comm][standin]") {
  // The device schedule (chunk-parallel forward, the exchange issued on the communication stream)
  // runs the host chunk-parallel schedule's kernels in the same order: serial over comm::local.
  const int P = GENERATE(1, 2, 3, 4, 5);
  const auto mode = GENERATE(gating::none, gating::fixed, gating::scalar);
  const index_t T = 157;
  const auto p = lt::la::make_problem(T, 2, 4, 3, mode, mixed_docs, true, 46);
  const auto d_o = lt::uniform<double>(T * 2 * 3, -1, 1, 47);
  const auto dfin = lt::uniform<double>(p.docs() * 2 * 4 * 3, -1, 1, 48);
  const auto splits = random_splits(T, P, 70 + static_cast<std::uint64_t>(P));
  const auto dev = lt::la::run_lasp2<loom::fp64>(p, splits, d_o, dfin, {});
  const auto host = lt::la::run_lasp2<loom::fp64, loom::host_memory>(
      p, splits, d_o, dfin, {lasp2::exchange::all_gather, false}, 16, lt::la::host_ranks{});
  INFO("P = " << P << ", gating " << static_cast<int>(mode));
  CHECK(lt::la::same_bits(dev, host));
}

TEST_CASE("lasp2 over ranks on the stand-in: 50 seeds of random stream delays, the same bits every time",
          "[linear_attention][lasp2][comm][standin][delays]") {
  // The result depends on the schedule's order only, never on timing: for each P, every seed gives
  // the bits of the first one, which matches the single-device reference (P = 1..5).
  const index_t T = 157;
  const auto p = lt::la::make_problem(T, 2, 4, 3, gating::scalar, mixed_docs, true, 43);
  const auto d_o = lt::uniform<double>(T * 2 * 3, -1, 1, 44);
  const auto dfin = lt::uniform<double>(p.docs() * 2 * 4 * 3, -1, 1, 45);
  const auto want = single(p, d_o, dfin, 64);
  std::array<outputs, 6> first{};
  auto o = lt::standin_ranks();
  o.max_delay = std::chrono::microseconds(200);
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const int P = 1 + static_cast<int>(seed % 5);
    o.seed = seed;
    lt::standin_override() = o;
    const auto got =
        lt::la::run_lasp2<loom::fp64>(p, random_splits(T, P, 60 + static_cast<std::uint64_t>(P)), d_o, dfin, {});
    lt::standin_override().reset();
    INFO("seed " << seed << ", P = " << P);
    auto& ref = first[static_cast<std::size_t>(P)];
    if (seed < 5) {
      compare(got, want, {1e-11, 1e-11}, "the first seed of each P");
      ref = got;
    }
    REQUIRE(lt::la::same_bits(got, ref));
  }
}
#endif
