// Ring attention across ranks, checked against single-device attention. A packed batch of causal
// documents is sharded over the ranks by the per-document plan (every document balanced across
// ranks on its own, padding-free), each rank makes a ring plan (pass_kv: K/V passed around the
// ring; the ranks' agreement runs once, here), allocates one workspace for both passes, then runs
// loom::attention::ring::forward and backward on it; the gathered outputs and gradients are
// compared with loom::attention::forward / backward on the whole sequence.
//
//   loom.example.ring_attention [ranks = 4]        in-process ranks (comm::local)
//   mpiexec -n 4 loom.example.ring_attention_mpi   the same code over MPI (comm::mpi)

#include <loom/attention/ring.hpp>
#include <loom/shard/plan.hpp>

#include <common/attention_check.hpp>

#if defined(LOOM_EXAMPLE_MPI)
#include <loom/comm/mpi.hpp>
#else
#include <loom/comm/local.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

namespace la = loom::attention;
using example::index_t;

template <class Comm>
void run(Comm& comm, const example::batch& in, example::results& r) {
  const auto sharding =
      loom::shard::make_plan(std::span<const index_t>(in.cu), comm.size(), loom::shard::per_document{});
  const auto rp =
      la::ring::make_plan(loom::serial{}, comm, la::ring::pass_kv{}, sharding, {in.s.hq, in.s.hkv, in.s.dim, in.s.dim});
  loom::workspace_buffer ws(std::max(rp.workspace_bytes(), rp.backward_workspace_bytes()));
  example::run_rank(
      comm.rank(), in, sharding, rp.tokens(), r,
      [&](auto q, auto k, auto v, auto o, auto l) {
        la::ring::forward(loom::serial{}, comm, rp, q, k, v, o, l, ws.span());
      },
      [&](auto q, auto k, auto v, auto o, auto l, auto d, auto dq, auto dk, auto dv) {
        la::ring::backward(loom::serial{}, comm, rp, q, k, v, o, l, d, dq, dk, dv, ws.span());
      });
}

}  // namespace

int main(int argc, char** argv) {
  // documents of 700, 1, 1311, 88, 1019 tokens; 8 query heads, 2 kv heads, dim 64
  const example::batch in({8, 2, 64}, {0, 700, 701, 2012, 2100, 3119}, 3);
  example::results ring(in);
  const auto t0 = std::chrono::steady_clock::now();
#if defined(LOOM_EXAMPLE_MPI)
  MPI_Init(&argc, &argv);
  int ranks = 0, me = 0;
  {
    loom::comm::mpi comm(MPI_COMM_WORLD);
    ranks = comm.size();
    me = comm.rank();
    run(comm, in, ring);
    example::sum_over_ranks(comm, ring);
  }
  MPI_Finalize();
  const char* kind = "MPI ranks (comm::mpi)";
#else
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4, me = 0;
  if (ranks < 1) {
    std::fprintf(stderr, "usage: %s [ranks >= 1]\n", argv[0]);
    return 2;
  }
  loom::comm::run_local(ranks, [&](loom::comm::local& comm) { run(comm, in, ring); });
  const char* kind = "in-process ranks (comm::local)";
#endif
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double err = example::max_rel_error(ring, example::single_device(in));
  const bool ok = err <= 2e-5;
  if (me == 0) {
    std::printf("loom ring attention: pass_kv over %d %s, per-document sharding\n", ranks, kind);
    std::printf("  %lld tokens in %zu causal documents, %lld q heads / %lld kv heads, dim %lld, fp32\n",
                static_cast<long long>(in.tokens()), in.cu.size() - 1, static_cast<long long>(in.s.hq),
                static_cast<long long>(in.s.hkv), static_cast<long long>(in.s.dim));
    std::printf(
        "  out, dq, dk, dv checked against single-device attention: max relative error %.3g (tolerance "
        "2e-5) %s\n",
        err, ok ? "OK" : "FAILED");
    std::printf("  time (forward + backward, all ranks): %.3f s\n", secs);
  }
  return ok ? 0 : 1;
}
