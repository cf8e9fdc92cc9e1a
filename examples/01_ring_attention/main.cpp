// Ring attention across ranks, checked against single-device attention. A packed batch of causal
// documents is sharded over the ranks by the per-document plan (every document balanced across
// ranks on its own, padding-free), each rank runs loom::attention::ring::forward with K/V passed
// around the ring (pass_kv), then the backward; the gathered outputs and gradients are compared
// with loom::attention::forward / backward on the whole sequence.
//
//   loom.example.ring_attention [ranks = 4]        in-process ranks (comm::local)
//   mpiexec -n 4 loom.example.ring_attention_mpi   the same code over MPI (comm::mpi)

#include <loom/attention/ring.hpp>
#include <loom/attention/shard.hpp>
#include <loom/backend/serial.hpp>

#if defined(LOOM_EXAMPLE_MPI)
#include <loom/comm/mpi.hpp>
#else
#include <loom/comm/local.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

namespace la = loom::attention;
using loom::index_t;
constexpr index_t hq = 8, hkv = 2, dim = 64;

struct batch {
  std::vector<index_t> cu{0, 700, 701, 2012, 2100, 3119};  // documents of 700, 1, 1311, 88, 1019 tokens
  std::vector<float> q, k, v, dout;
  index_t tokens() const { return cu.back(); }
  batch() {
    std::mt19937 g(3);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    auto fill = [&](std::vector<float>& x, index_t heads) {
      x.resize(static_cast<std::size_t>(tokens() * heads * dim));
      for (auto& e : x) e = d(g);
    };
    fill(q, hq);
    fill(k, hkv);
    fill(v, hkv);
    fill(dout, hq);
  }
};

struct results {
  std::vector<float> out, dq, dk, dv;
};

// One rank's part: its rows from the plan, the ring forward and backward, its rows written back.
template <class Comm>
void run_rank(Comm& comm, const batch& in, const loom::shard::plan& plan, results& r) {
  const int me = comm.rank();
  const index_t n = plan.rank(me).tokens;
  auto take = [&](const std::vector<float>& global, index_t heads) {
    std::vector<float> local(static_cast<std::size_t>(n * heads * dim));
    plan.scatter<float>(me, global, heads * dim, local);
    return local;
  };
  const auto q = take(in.q, hq), k = take(in.k, hkv), v = take(in.v, hkv), dout = take(in.dout, hq);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(n * hq)), dq(q.size()), dk(k.size()), dv(v.size());
  const loom::tensor_view<const float, 3> qv(q.data(), {n, hq, dim}), kv(k.data(), {n, hkv, dim}),
      vv(v.data(), {n, hkv, dim});
  la::ring::forward(loom::serial{}, comm, la::ring::pass_kv{}, plan, qv, kv, vv,
                    loom::tensor_view<float, 3>(out.data(), {n, hq, dim}),
                    loom::tensor_view<float, 2>(lse.data(), {n, hq}));
  la::ring::backward(loom::serial{}, comm, la::ring::pass_kv{}, plan, qv, kv, vv,
                     loom::tensor_view<const float, 3>(out.data(), {n, hq, dim}),
                     loom::tensor_view<const float, 2>(lse.data(), {n, hq}),
                     loom::tensor_view<const float, 3>(dout.data(), {n, hq, dim}),
                     loom::tensor_view<float, 3>(dq.data(), {n, hq, dim}),
                     loom::tensor_view<float, 3>(dk.data(), {n, hkv, dim}),
                     loom::tensor_view<float, 3>(dv.data(), {n, hkv, dim}));
  plan.gather<float>(me, out, hq * dim, r.out);
  plan.gather<float>(me, dq, hq * dim, r.dq);
  plan.gather<float>(me, dk, hkv * dim, r.dk);
  plan.gather<float>(me, dv, hkv * dim, r.dv);
}

double max_rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) e = std::max(e, std::abs(double(a[i]) - b[i]) / (1.0 + std::abs(b[i])));
  return e;
}

}  // namespace

int main(int argc, char** argv) {
  const batch in;
  const index_t t = in.tokens();
  results ring{std::vector<float>(in.q.size()), std::vector<float>(in.q.size()), std::vector<float>(in.k.size()),
               std::vector<float>(in.v.size())};
#if defined(LOOM_EXAMPLE_MPI)
  MPI_Init(&argc, &argv);
  int ranks = 0, me = 0;
  double secs = 0;
  {
    loom::comm::mpi comm(MPI_COMM_WORLD);
    ranks = comm.size();
    me = comm.rank();
    const auto plan = loom::shard::make_plan(std::span<const index_t>(in.cu), ranks, loom::shard::per_document{});
    const auto t0 = std::chrono::steady_clock::now();
    run_rank(comm, in, plan, ring);
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // every rank filled its own rows: sum the (otherwise zero) rows onto every rank
    for (auto* x : {&ring.out, &ring.dq, &ring.dk, &ring.dv})
      comm.all_reduce(std::span<const float>(*x), std::span<float>(*x), loom::comm::reduce_op::sum);
  }
  MPI_Finalize();
  const char* kind = "MPI ranks (comm::mpi)";
#else
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4, me = 0;
  if (ranks < 1) {
    std::fprintf(stderr, "usage: %s [ranks >= 1]\n", argv[0]);
    return 2;
  }
  const auto plan = loom::shard::make_plan(std::span<const index_t>(in.cu), ranks, loom::shard::per_document{});
  const auto t0 = std::chrono::steady_clock::now();
  loom::comm::run_local(ranks, [&](loom::comm::local& comm) { run_rank(comm, in, plan, ring); });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const char* kind = "in-process ranks (comm::local)";
#endif
  // Single-device reference on the whole packed sequence.
  results one{std::vector<float>(in.q.size()), std::vector<float>(in.q.size()), std::vector<float>(in.k.size()),
              std::vector<float>(in.v.size())};
  std::vector<float> lse(static_cast<std::size_t>(t * hq));
  const loom::tensor_view<const index_t, 1> cu(in.cu.data(), {static_cast<index_t>(in.cu.size())});
  const loom::tensor_view<const float, 3> q(in.q.data(), {t, hq, dim}), k(in.k.data(), {t, hkv, dim}),
      v(in.v.data(), {t, hkv, dim});
  la::forward(loom::serial{}, q, k, v, cu, loom::tensor_view<float, 3>(one.out.data(), {t, hq, dim}),
              loom::tensor_view<float, 2>(lse.data(), {t, hq}));
  la::backward(loom::serial{}, q, k, v, cu, loom::tensor_view<const float, 3>(one.out.data(), {t, hq, dim}),
               loom::tensor_view<const float, 2>(lse.data(), {t, hq}),
               loom::tensor_view<const float, 3>(in.dout.data(), {t, hq, dim}),
               loom::tensor_view<float, 3>(one.dq.data(), {t, hq, dim}),
               loom::tensor_view<float, 3>(one.dk.data(), {t, hkv, dim}),
               loom::tensor_view<float, 3>(one.dv.data(), {t, hkv, dim}));
  const double err = std::max({max_rel_error(ring.out, one.out), max_rel_error(ring.dq, one.dq),
                               max_rel_error(ring.dk, one.dk), max_rel_error(ring.dv, one.dv)});
  const bool ok = err <= 2e-5;
  if (me == 0) {
    std::printf("loom ring attention: pass_kv over %d %s, per-document sharding\n", ranks, kind);
    std::printf("  %lld tokens in %zu causal documents, %lld q heads / %lld kv heads, dim %lld, fp32\n",
                static_cast<long long>(t), in.cu.size() - 1, static_cast<long long>(hq), static_cast<long long>(hkv),
                static_cast<long long>(dim));
    std::printf(
        "  out, dq, dk, dv checked against single-device attention: max relative error %.3g (tolerance "
        "2e-5) %s\n",
        err, ok ? "OK" : "FAILED");
    std::printf("  time (forward + backward, all ranks): %.3f s\n", secs);
  }
  return ok ? 0 : 1;
}
