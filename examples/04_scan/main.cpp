// A gated linear recurrence scanned across ranks: h_t = a_t ⊙ h_{t-1} + b_t (diagonal A, the
// recurrence of Mamba/GLA-style layers and of each Newton step of a parallel RNN solver) over a
// packed batch of documents whose boundaries reset the state. The packed sequence is sharded
// unevenly over the ranks, documents cross rank boundaries, and every rank gets its slice of the
// result from one all_gather of per-rank aggregates (loom::scan::linear_recurrence over a
// communicator, through a plan made once). The backward pass runs the adjoint recurrence the same way. Both are checked
// against the sequential loop.
//
//   loom.example.scan [ranks = 4]                 in-process ranks (comm::local)
//   mpiexec -n 4 loom.example.scan_mpi            the same code over MPI (comm::mpi)

#include <loom/scan/distributed.hpp>

#if defined(LOOM_EXAMPLE_MPI)
#include <loom/comm/mpi.hpp>
#else
#include <loom/comm/local.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

constexpr loom::index_t d = 16;  // state channels

struct problem {
  std::vector<loom::index_t> cu_seqlens;
  std::vector<float> a, b, g;  // [T, d]
  loom::index_t tokens() const { return cu_seqlens.back(); }
};

problem make_problem() {
  problem p{{0}, {}, {}, {}};
  std::mt19937 gen(11);
  std::lognormal_distribution<double> len(7.0, 1.0);
  while (p.cu_seqlens.back() < 200000)
    p.cu_seqlens.push_back(p.cu_seqlens.back() + 1 + static_cast<loom::index_t>(len(gen)));
  const auto n = static_cast<std::size_t>(p.tokens() * d);
  std::uniform_real_distribution<float> gate(0.9f, 1.0f), x(-1.f, 1.f);
  p.a.resize(n);
  p.b.resize(n);
  p.g.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    p.a[i] = gate(gen);
    p.b[i] = x(gen);
    p.g[i] = x(gen);
  }
  return p;
}

// The sequential loops, in double: forward h and the adjoint λ_t = g_t + a_{t+1} ⊙ λ_{t+1}.
void oracle(const problem& p, std::vector<double>& h, std::vector<double>& lam) {
  h.assign(p.a.size(), 0.0);
  lam.assign(p.a.size(), 0.0);
  for (std::size_t s = 0; s + 1 < p.cu_seqlens.size(); ++s) {
    for (loom::index_t t = p.cu_seqlens[s]; t < p.cu_seqlens[s + 1]; ++t)
      for (loom::index_t c = 0; c < d; ++c) {
        const double prev = t > p.cu_seqlens[s] ? h[(t - 1) * d + c] : 0.0;
        h[t * d + c] = p.a[t * d + c] * prev + p.b[t * d + c];
      }
    for (loom::index_t t = p.cu_seqlens[s + 1] - 1; t >= p.cu_seqlens[s]; --t)
      for (loom::index_t c = 0; c < d; ++c) {
        const double next = t + 1 < p.cu_seqlens[s + 1] ? p.a[(t + 1) * d + c] * lam[(t + 1) * d + c] : 0.0;
        lam[t * d + c] = p.g[t * d + c] + next;
      }
  }
}

// One rank's work; returns this rank's worst relative error against the oracle.
template <class Comm>
double run_rank(Comm& comm, const problem& p, const std::vector<double>& h_ref, const std::vector<double>& lam_ref) {
  const loom::index_t T = p.tokens(), ranks = comm.size(), r = comm.rank();
  const loom::index_t lo = T * r * r / (ranks * ranks), hi = T * (r + 1) * (r + 1) / (ranks * ranks);  // uneven
  const loom::index_t n = hi - lo;
  std::vector<float> h(static_cast<std::size_t>(n * d)), lam(h.size());
  // FlashAttention-style int32 offsets work as they are (int64 too): no copy.
  const std::vector<std::int32_t> cu32(p.cu_seqlens.begin(), p.cu_seqlens.end());
  const loom::segments docs{std::span<const std::int32_t>(cu32)};
  const loom::tensor_view<const float, 2> a(p.a.data() + lo * d, {n, d});
  namespace ls = loom::scan;
  // One plan (the cross-rank agreement runs here, once), one workspace, any number of calls.
  const auto plan = ls::make_plan(loom::serial{}, comm, ls::diagonal{}, n, d, docs);
  loom::workspace_buffer ws(plan.workspace_bytes());
  ls::linear_recurrence(loom::serial{}, comm, plan, a, loom::tensor_view<const float, 2>(p.b.data() + lo * d, {n, d}),
                        loom::tensor_view<float, 2>(h.data(), {n, d}), ws.span());
  ls::linear_recurrence_adjoint(loom::serial{}, comm, plan, a,
                                loom::tensor_view<const float, 2>(p.g.data() + lo * d, {n, d}),
                                loom::tensor_view<float, 2>(lam.data(), {n, d}), ws.span());
  double err = 0;
  for (loom::index_t i = 0; i < n * d; ++i) {
    const auto k = static_cast<std::size_t>(lo * d + i);
    err = std::max(err, std::abs(h[static_cast<std::size_t>(i)] - h_ref[k]) / (1.0 + std::abs(h_ref[k])));
    err = std::max(err, std::abs(lam[static_cast<std::size_t>(i)] - lam_ref[k]) / (1.0 + std::abs(lam_ref[k])));
  }
  comm.all_reduce(std::span<const double>(&err, 1), std::span<double>(&err, 1), loom::comm::reduce_op::max);
  return err;
}

}  // namespace

int main(int argc, char** argv) {
  const problem p = make_problem();
  std::vector<double> h_ref, lam_ref;
  oracle(p, h_ref, lam_ref);
  const auto t0 = std::chrono::steady_clock::now();
#if defined(LOOM_EXAMPLE_MPI)
  MPI_Init(&argc, &argv);
  double err = 0;
  int ranks = 0, me = 0;
  {
    loom::comm::mpi comm(MPI_COMM_WORLD);
    ranks = comm.size();
    me = comm.rank();
    err = run_rank(comm, p, h_ref, lam_ref);
  }
  MPI_Finalize();
  const char* kind = "MPI ranks (comm::mpi)";
#else
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4;
  if (ranks < 1) {
    std::fprintf(stderr, "usage: %s [ranks >= 1]\n", argv[0]);
    return 2;
  }
  const int me = 0;
  const double err =
      loom::comm::run_local(ranks, [&](loom::comm::local& comm) { return run_rank(comm, p, h_ref, lam_ref); })[0];
  const char* kind = "in-process ranks (comm::local)";
#endif
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool ok = err <= 1e-4;  // float storage and state against the double loop
  if (me == 0) {
    std::printf("loom scan example: gated linear recurrence over %d %s\n", ranks, kind);
    std::printf("  %lld tokens in %zu packed documents, d = %lld, documents cross rank boundaries\n",
                static_cast<long long>(p.tokens()), p.cu_seqlens.size() - 1, static_cast<long long>(d));
    std::printf(
        "  forward h and adjoint lambda checked against the sequential loop: max relative error %.3g "
        "(tolerance 1e-4) %s\n",
        err, ok ? "OK" : "FAILED");
    std::printf("  time (both passes, all ranks): %.3f s\n", secs);
  }
  return ok ? 0 : 1;
}
