// A ParaGRU-style layer (loom::rnn::para_gru: GRU gates with a diagonal recurrence, inputs
// pre-projected) over a packed batch of sequences whose boundaries reset the state to their own
// h0. Nothing is trained: the point is that the whole sequence is solved at once by Newton's
// method (each iteration one parallel linear-recurrence scan, loom::rnn::forward on openmp, with
// a plan made once and a workspace the caller owns) and that it matches the step-by-step loop
// (loom::rnn::sequential). The solver's report
// (iterations, residual history, termination reason, fallback) and the timings are printed.
// Then the same layer is solved sequence-parallel: the packed sequence is sharded unevenly over
// ranks, sequences cross rank boundaries, every Newton step's linear solve is the cross-rank scan
// and convergence is decided globally.
//
//   loom.example.rnn [ranks = 4]           in-process ranks (comm::local)
//   mpiexec -n 4 loom.example.rnn_mpi      the sequence-parallel part over MPI (comm::mpi)

#include <loom/backend/openmp.hpp>
#include <loom/backend/serial.hpp>
#include <loom/rnn/distributed.hpp>
#include <loom/rnn/newton.hpp>

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
#include <span>
#include <string>
#include <vector>

namespace {

namespace lr = loom::rnn;
using loom::index_t;

constexpr index_t d = 16;            // hidden size
constexpr double solver_tol = 1e-5;  // abs and rel tolerance of the residual
constexpr double check_tol = 1e-4;   // max relative error against the sequential loop (fp32)

struct problem {
  std::vector<index_t> cu_seqlens;
  std::vector<float> theta;  // [6d]: recurrent weights of z, r, c, then their biases
  std::vector<float> x;      // [T, 3d]: x_z, x_r, x_c already projected (W_x x_t)
  std::vector<float> h0;     // [S, d]
  index_t tokens() const { return cu_seqlens.back(); }
  index_t sequences() const { return static_cast<index_t>(cu_seqlens.size()) - 1; }
  lr::para_gru<float> cell() const { return {theta.data(), d}; }
  lr::options opts() const {
    lr::options o;
    o.abs_tol = solver_tol;
    o.rel_tol = solver_tol;
    o.max_iterations = 30;
    return o;
  }
  //! The packed sequences (global offsets, int64; int32 offsets work as well).
  loom::segments<> docs() const { return loom::segments{std::span<const index_t>(cu_seqlens)}; }
};

problem make_problem() {
  problem p{{0}, std::vector<float>(6 * d), {}, {}};
  std::mt19937 gen(7);
  std::lognormal_distribution<double> len(7.0, 1.0);  // median ~1100 tokens
  while (p.cu_seqlens.back() < 60000) p.cu_seqlens.push_back(p.cu_seqlens.back() + 1 + static_cast<index_t>(len(gen)));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& v : p.theta) v = u(gen);
  p.x.resize(static_cast<std::size_t>(p.tokens() * 3 * d));
  for (auto& v : p.x) v = u(gen);
  p.h0.resize(static_cast<std::size_t>(p.sequences() * d));
  for (auto& v : p.h0) v = 0.5f * u(gen);
  return p;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Largest |a - b| / (1 + |b|) over rows [lo, lo + n) of the reference.
double max_error(const float* h, const std::vector<float>& ref, index_t lo, index_t n) {
  double err = 0;
  for (index_t i = 0; i < n * d; ++i) {
    const double want = ref[static_cast<std::size_t>(lo * d + i)];
    err = std::max(err, std::abs(static_cast<double>(h[i]) - want) / (1.0 + std::abs(want)));
  }
  return err;
}

std::string history(const lr::report& rep) {
  std::string s;
  char buf[32];
  for (double r : rep.residual_history) {
    std::snprintf(buf, sizeof buf, "%s%.3g", s.empty() ? "" : " ", r);
    s += buf;
  }
  return s;
}

void print_report(const lr::report& rep) {
  const auto converged = std::count(rep.converged.begin(), rep.converged.end(), true);
  std::printf("    method %s: %d iterations, termination %s, fallback %s",
              std::string(lr::to_string(rep.requested)).c_str(), rep.iterations,
              std::string(lr::to_string(rep.reason)).c_str(), std::string(lr::to_string(rep.fallback)).c_str());
  if (rep.fallback != lr::fallback_taken::none)
    std::printf(" (on %lld sequences)", static_cast<long long>(rep.fallback_sequences));
  std::printf("\n    residual history (max |r| / (abs_tol + rel_tol |h|), <= 1 is converged): %s\n",
              history(rep).c_str());
  std::printf("    sequences converged: %lld of %zu\n", static_cast<long long>(converged), rep.converged.size());
}

struct rank_result {
  lr::report rep;
  double err = 0;
  double secs = 0;
};

// One rank's share of the sequence-parallel solve: an uneven contiguous slice of the packed
// sequence (cu_seqlens and h0 stay global), checked against the sequential reference.
template <class Comm>
rank_result run_rank(Comm& comm, const problem& p, const std::vector<float>& ref) {
  const index_t T = p.tokens(), ranks = comm.size(), r = comm.rank();
  const index_t lo = T * r * r / (ranks * ranks), hi = T * (r + 1) * (r + 1) / (ranks * ranks);
  const index_t n = hi - lo;
  std::vector<float> h(static_cast<std::size_t>(n * d));
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  rank_result out;
  const auto plan = lr::make_plan(loom::serial{}, comm, p.cell(), n, p.docs(), p.opts());  // agrees once
  loom::workspace_buffer ws(plan.workspace_bytes());
  out.rep = lr::report(plan);
  lr::forward(loom::serial{}, comm, plan, p.cell(),
              loom::tensor_view<const float, 2>(p.x.data() + lo * 3 * d, {n, 3 * d}),
              loom::tensor_view<const float, 2>(p.h0.data(), {p.sequences(), d}),
              loom::tensor_view<float, 2>(h.data(), {n, d}), out.rep, ws.span());
  comm.barrier();
  out.secs = seconds_since(t0);
  out.err = max_error(h.data(), ref, lo, n);
  comm.all_reduce(std::span<const double>(&out.err, 1), std::span<double>(&out.err, 1), loom::comm::reduce_op::max);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const problem p = make_problem();
  const index_t T = p.tokens(), S = p.sequences();
  const loom::tensor_view<const float, 2> x(p.x.data(), {T, 3 * d});
  const loom::tensor_view<const float, 2> h0(p.h0.data(), {S, d});

  // The reference: the step-by-step loop, one thread.
  std::vector<float> ref(static_cast<std::size_t>(T * d));
  lr::sequential(loom::serial{}, p.cell(), x, h0, loom::tensor_view<float, 2>(ref.data(), {T, d}), p.docs(), p.opts());

  // The sequence-parallel solve over ranks.
#if defined(LOOM_EXAMPLE_MPI)
  MPI_Init(&argc, &argv);
  rank_result dist;
  int ranks = 0, me = 0;
  {
    loom::comm::mpi comm(MPI_COMM_WORLD);
    ranks = comm.size();
    me = comm.rank();
    dist = run_rank(comm, p, ref);
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
  const rank_result dist =
      loom::comm::run_local(ranks, [&](loom::comm::local& comm) { return run_rank(comm, p, ref); })[0];
  const char* kind = "in-process ranks (comm::local)";
#endif
  if (me != 0) return dist.err <= check_tol && dist.rep.all_converged() ? 0 : 1;

  // The single-device parallel solve (rank 0 only, after the other ranks are done), timed next
  // to the sequential loop.
  std::vector<float> h(static_cast<std::size_t>(T * d));
  auto t0 = std::chrono::steady_clock::now();
  lr::sequential(loom::serial{}, p.cell(), x, h0, loom::tensor_view<float, 2>(h.data(), {T, d}), p.docs(), p.opts());
  const double seq_secs = seconds_since(t0);
  const loom::openmp omp{};
  const auto plan = lr::make_plan(omp, p.cell(), T, p.docs(), p.opts());
  loom::workspace_buffer ws(plan.workspace_bytes());
  lr::report rep(plan);
  t0 = std::chrono::steady_clock::now();
  lr::forward(omp, plan, p.cell(), x, h0, loom::tensor_view<float, 2>(h.data(), {T, d}), rep, ws.span());
  const double newton_secs = seconds_since(t0);
  const double err = max_error(h.data(), ref, 0, T);
  const bool ok = err <= check_tol && rep.all_converged();
  const bool dist_ok = dist.err <= check_tol && dist.rep.all_converged();

  std::printf("loom rnn example: a ParaGRU-style layer solved in parallel by Newton's method\n");
  std::printf("  %lld tokens in %lld packed sequences (state reset to each sequence's h0), hidden size %lld, fp32\n",
              static_cast<long long>(T), static_cast<long long>(S), static_cast<long long>(d));
  std::printf("  rnn::forward (Newton) on openmp (%d threads), tolerance %.0e abs + %.0e rel:\n",
              loom::backend_traits<loom::openmp>::concurrency(omp), solver_tol, solver_tol);
  print_report(rep);
  std::printf("    against rnn::sequential: max relative error %.3g (tolerance %.0e) %s\n", err, check_tol,
              ok ? "OK" : "FAILED");
  std::printf("    time: rnn::forward %.1f ms, sequential loop (1 thread) %.1f ms, newton / loop %.2f\n",
              newton_secs * 1e3, seq_secs * 1e3, newton_secs / seq_secs);
  std::printf("  sequence parallel over %d %s, uneven slices, sequences crossing ranks:\n", ranks, kind);
  print_report(dist.rep);
  std::printf("    against rnn::sequential: max relative error %.3g (tolerance %.0e) %s\n", dist.err, check_tol,
              dist_ok ? "OK" : "FAILED");
  std::printf("    time (all ranks): %.1f ms\n", dist.secs * 1e3);
  std::printf(
      "  each Newton iteration is a linearization of every step plus one parallel scan: on a few cores\n"
      "  it does several times the loop's work; it pays off where many cores (or a GPU) run the scan.\n");
  return ok && dist_ok ? 0 : 1;
}
