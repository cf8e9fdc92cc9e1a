// Ulysses and hybrid Ulysses x ring sequence parallel attention, checked against single-device
// attention. A packed batch of causal documents (12 query heads, 2 kv heads: GQA with fewer kv
// heads than ranks) is sharded over the ranks; Ulysses turns sequence shards into head shards with
// one all-to-all, runs the local kernel and turns the output back. The hybrid splits the ranks
// into Ulysses groups of 2 and a ring across them (when the rank count is even and >= 4). Both run
// forward and backward; the gathered outputs and gradients are compared with
// loom::attention::forward / backward on the whole sequence. Every method is planned once
// (make_plan: the agreement across ranks, the head split, the workspace layout) and then run on
// a caller-owned workspace, allocating nothing per call. Finally loom::sequence_parallel picks a
// strategy for this layer with the planner's cost model and runs the pick; its choice for a larger
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
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace {

namespace la = loom::attention;
using example::index_t;
using example::results;
using example::run_rank;
constexpr index_t hq = 12, hkv = 2, dim = 32;

// Ulysses, the hybrid (when the rank count is even and >= 4) and the planner's pick on one rank.
template <class Comm>
void run_all(Comm& comm, const example::batch& in, results& uly, results& hyb, results& pick, bool hybrid_too,
             std::string& choice) {
  const loom::serial b{};
  const int me = comm.rank(), p = comm.size();
  const la::head_shape s{hq, hkv, dim, dim};
  const loom::segments docs{std::span<const index_t>(in.cu)};

  // Ulysses: the sequence sharded contiguously; one plan, one workspace for forward and backward.
  const auto seq = loom::shard::make_plan(docs, p, loom::shard::contiguous{});
  const auto up = la::ulysses::make_plan<loom::fp32>(b, comm, seq, s);
  loom::workspace_buffer ws(up.workspace_bytes());
  run_rank(
      me, in, seq, seq.rank(me).tokens, uly,
      [&](auto q, auto k, auto v, auto o, auto l) { la::ulysses::forward(b, comm, up, q, k, v, o, l, ws.span()); },
      [&](auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk, auto dv) {
        la::ulysses::backward(b, comm, up, q, k, v, o, l, d, dq, dk, dv, ws.span());
      });

  // Hybrid 2 x (P / 2): the ring sharding (zigzag over P / 2 ring ranks) fixes the grid.
  if (hybrid_too) {
    const auto ring = loom::shard::make_plan(docs, p / 2, loom::shard::zigzag{});
    const auto hp = la::hybrid::make_plan<loom::fp32>(b, comm, ring, s);
    loom::workspace_buffer hws(hp.workspace_bytes());
    run_rank(
        me, in, hp, hp.tokens(me), hyb,
        [&](auto q, auto k, auto v, auto o, auto l) { la::hybrid::forward(b, comm, hp, q, k, v, o, l, hws.span()); },
        [&](auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk, auto dv) {
          la::hybrid::backward(b, comm, hp, q, k, v, o, l, d, dq, dk, dv, hws.span());
        });
  }

  // The planner's pick for this layer, on a machine model of 400 TFLOP/s, 50 GB/s links and
  // 450 GB/s inside nodes of 8 ranks; the rows each rank holds depend on the pick.
  loom::sequence_parallel::options o;
  o.machine = {400e12, 50e9, 8, 450e9};
  const auto sp = loom::sequence_parallel::make_plan<loom::fp32>(b, comm, docs, s, o);
  loom::workspace_buffer sws(sp.workspace_bytes());
  run_rank(
      me, in, sp, sp.tokens(me), pick,
      [&](auto q, auto k, auto v, auto o2, auto l) {
        loom::sequence_parallel::forward(b, comm, sp, q, k, v, o2, l, sws.span());
      },
      [&](auto q, auto k, auto v, auto o2, auto l, auto d, auto dq, auto dk, auto dv) {
        loom::sequence_parallel::backward(b, comm, sp, q, k, v, o2, l, d, dq, dk, dv, sws.span());
      });
  choice = sp.choice().explain();
}

}  // namespace

int main(int argc, char** argv) {
  // documents of 700, 1, 799, 88, 433 tokens
  const example::batch in({hq, hkv, dim}, {0, 700, 701, 1500, 1588, 2021}, 5);
  const index_t t = in.tokens();
  results uly(in), hyb(in), pick(in);
  std::string choice;
#if defined(LOOM_EXAMPLE_MPI)
  MPI_Init(&argc, &argv);
  int ranks = 0, me = 0;
  {
    loom::comm::mpi comm(MPI_COMM_WORLD);
    ranks = comm.size();
    me = comm.rank();
    run_all(comm, in, uly, hyb, pick, ranks >= 4 && ranks % 2 == 0, choice);
    for (auto* r : {&uly, &hyb, &pick}) example::sum_over_ranks(comm, *r);
  }
  MPI_Finalize();
  const char* kind = "MPI ranks (comm::mpi)";
#else
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4, me = 0;
  if (ranks < 1 || ranks > hq) {
    std::fprintf(stderr, "usage: %s [1 <= ranks <= %lld]\n", argv[0], static_cast<long long>(hq));
    return 2;
  }
  std::mutex mu;
  loom::comm::run_local(ranks, [&](loom::comm::local& comm) {
    std::string mine;
    run_all(comm, in, uly, hyb, pick, ranks >= 4 && ranks % 2 == 0, mine);
    const std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) choice = mine;
  });
  const char* kind = "in-process ranks (comm::local)";
#endif
  const bool hybrid_too = ranks >= 4 && ranks % 2 == 0;
  const results one = example::single_device(in);
  const double eu = example::max_rel_error(uly, one), eh = hybrid_too ? example::max_rel_error(hyb, one) : 0.0;
  const double ep = example::max_rel_error(pick, one);
  const bool ok = eu <= 2e-5 && eh <= 2e-5 && ep <= 2e-5;
  if (me == 0) {
    std::printf("loom sequence parallel attention over %d %s\n", ranks, kind);
    std::printf("  %lld tokens in %zu causal documents, %lld q heads / %lld kv heads, dim %lld, fp32\n",
                static_cast<long long>(t), in.cu.size() - 1, static_cast<long long>(hq), static_cast<long long>(hkv),
                static_cast<long long>(dim));
    std::printf("  ulysses (P = %d): out, dq, dk, dv max relative error %.3g vs single device (tolerance 2e-5)\n",
                ranks, eu);
    if (hybrid_too) std::printf("  hybrid 2 x %d (zigzag ring): max relative error %.3g\n", ranks / 2, eh);
    std::printf("  sequence_parallel's pick for this layer: max relative error %.3g\n%s", ep, choice.c_str());
    const auto c = la::planner::choose({131072, 0, 32, 8, 128, 128, 8, 2, true}, {400e12, 50e9, 8, 450e9});
    std::printf("  planner, 128K tokens, 32/8 heads, P = 8, 8 ranks per node:\n%s", c.explain().c_str());
    std::printf("  %s\n", ok ? "OK" : "FAILED");
  }
  return ok ? 0 : 1;
}
