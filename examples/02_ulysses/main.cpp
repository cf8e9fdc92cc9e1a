// Ulysses and hybrid Ulysses x ring sequence parallel attention, checked against single-device
// attention. A packed batch of causal documents (12 query heads, 2 kv heads: GQA with fewer kv
// heads than ranks) is sharded over the ranks; Ulysses turns sequence shards into head shards with
// one all-to-all, runs the local kernel and turns the output back. The hybrid splits the ranks
// into Ulysses groups of 2 and a ring across them (when the rank count is even and >= 4). Both run
// forward and backward; the gathered outputs and gradients are compared with
// loom::attention::forward / backward on the whole sequence. The planner's choice for a larger
// layer is printed with its explanation.
//
//   loom.example.ulysses [ranks = 4]        in-process ranks (comm::local)
//   mpiexec -n 4 loom.example.ulysses_mpi   the same code over MPI (comm::mpi)

#include <loom/attention/hybrid.hpp>
#include <loom/attention/planner.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/serial.hpp>

#include <common/attention_check.hpp>

#if defined(LOOM_EXAMPLE_MPI)
#include <loom/comm/mpi.hpp>
#else
#include <loom/comm/local.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

namespace la = loom::attention;
using example::index_t;
using example::results;
using example::run_rank;
constexpr index_t hq = 12, hkv = 2, dim = 32;

// Both methods on one rank.
template <class Comm>
void run_both(Comm& comm, const example::batch& in, results& uly, results& hyb, bool hybrid_too) {
  const int me = comm.rank(), p = comm.size();
  const auto plan = loom::shard::make_plan(std::span<const index_t>(in.cu), p, loom::shard::contiguous{});
  run_rank(
      me, in, plan, plan.rank(me).tokens, uly,
      [&](auto q, auto k, auto v, auto o, auto l) { la::ulysses::forward(loom::serial{}, comm, plan, q, k, v, o, l); },
      [&](auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk, auto dv) {
        la::ulysses::backward(loom::serial{}, comm, plan, q, k, v, o, l, d, dq, dk, dv);
      });
  if (!hybrid_too) return;
  const la::hybrid::plan hp(std::span<const index_t>(in.cu), {2, p / 2}, loom::shard::zigzag{}, {hq, hkv, dim, dim});
  auto groups = la::hybrid::split(comm, hp);
  std::vector<std::max_align_t> ws(hp.workspace_bytes<float>() / sizeof(std::max_align_t) + 1);
  const auto wsb = std::as_writable_bytes(std::span(ws));
  run_rank(
      me, in, hp, hp.tokens(me), hyb,
      [&](auto q, auto k, auto v, auto o, auto l) {
        la::hybrid::forward(loom::serial{}, groups, hp, q, k, v, o, l, {}, wsb);
      },
      [&](auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk, auto dv) {
        la::hybrid::backward(loom::serial{}, groups, hp, q, k, v, o, l, d, dq, dk, dv, {}, wsb);
      });
}

}  // namespace

int main(int argc, char** argv) {
  // documents of 700, 1, 799, 88, 433 tokens
  const example::batch in({hq, hkv, dim}, {0, 700, 701, 1500, 1588, 2021}, 5);
  const index_t t = in.tokens();
  results uly(in), hyb(in);
#if defined(LOOM_EXAMPLE_MPI)
  MPI_Init(&argc, &argv);
  int ranks = 0, me = 0;
  {
    loom::comm::mpi comm(MPI_COMM_WORLD);
    ranks = comm.size();
    me = comm.rank();
    run_both(comm, in, uly, hyb, ranks >= 4 && ranks % 2 == 0);
    for (auto* r : {&uly, &hyb}) example::sum_over_ranks(comm, *r);
  }
  MPI_Finalize();
  const char* kind = "MPI ranks (comm::mpi)";
#else
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4, me = 0;
  if (ranks < 1 || ranks > hq) {
    std::fprintf(stderr, "usage: %s [1 <= ranks <= %lld]\n", argv[0], static_cast<long long>(hq));
    return 2;
  }
  loom::comm::run_local(ranks,
                        [&](loom::comm::local& comm) { run_both(comm, in, uly, hyb, ranks >= 4 && ranks % 2 == 0); });
  const char* kind = "in-process ranks (comm::local)";
#endif
  const bool hybrid_too = ranks >= 4 && ranks % 2 == 0;
  const results one = example::single_device(in);
  const double eu = example::max_rel_error(uly, one), eh = hybrid_too ? example::max_rel_error(hyb, one) : 0.0;
  const bool ok = eu <= 2e-5 && eh <= 2e-5;
  if (me == 0) {
    std::printf("loom sequence parallel attention over %d %s\n", ranks, kind);
    std::printf("  %lld tokens in %zu causal documents, %lld q heads / %lld kv heads, dim %lld, fp32\n",
                static_cast<long long>(t), in.cu.size() - 1, static_cast<long long>(hq), static_cast<long long>(hkv),
                static_cast<long long>(dim));
    std::printf("  ulysses (P = %d): out, dq, dk, dv max relative error %.3g vs single device (tolerance 2e-5)\n",
                ranks, eu);
    if (hybrid_too) std::printf("  hybrid 2 x %d (zigzag ring): max relative error %.3g\n", ranks / 2, eh);
    const auto c = la::planner::choose({131072, 0, 32, 8, 128, 128, 8, 2, true}, {400e12, 50e9, 8, 450e9});
    std::printf("  planner, 128K tokens, 32/8 heads, P = 8, 8 ranks per node:\n%s", c.explain().c_str());
    std::printf("  %s\n", ok ? "OK" : "FAILED");
  }
  return ok ? 0 : 1;
}
