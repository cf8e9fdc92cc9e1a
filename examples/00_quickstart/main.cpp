// loom quick start: P ranks in one process (comm::local) compute a distributed inclusive prefix sum
// of a long vector that is sharded unevenly across them, the way a sequence is sharded in context
// parallelism: local reduce -> all_gather of the P partial sums -> exclusive offset -> local scan.
// The result is checked against a serial fp64 scan, and the run prints what it checked and how
// long each part took.
//
//   loom.example.quickstart [ranks = 4] [length = 16777259]

#include <loom/comm/local.hpp>
#include <loom/scan/distributed.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <vector>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4;
  const long long n = argc > 2 ? std::atoll(argv[2]) : 16777259;  // a prime: shards are uneven
  if (ranks < 1 || n < 1) {
    std::fprintf(stderr, "usage: %s [ranks >= 1] [length >= 1]\n", argv[0]);
    return 2;
  }

  std::vector<float> x(static_cast<std::size_t>(n));
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (auto& v : x) v = dist(gen);

  // The oracle: a serial fp64 scan.
  auto t0 = std::chrono::steady_clock::now();
  std::vector<double> oracle(x.size());
  std::inclusive_scan(x.begin(), x.end(), oracle.begin(), std::plus<>{}, 0.0);
  const double serial_s = seconds_since(t0);

  std::vector<double> y(x.size());
  t0 = std::chrono::steady_clock::now();
  const auto max_errors = loom::comm::run_local(ranks, [&](loom::comm::local& comm) {
    const int p = comm.size(), r = comm.rank();
    const long long lo = n * r / p, hi = n * (r + 1) / p;  // this rank's shard
    const std::span<const float> mine(x.data() + lo, static_cast<std::size_t>(hi - lo));

    // loom::scan over the communicator: local reduce, all_gather of the P partial sums, exclusive
    // offset in rank order, local scan from it (include/loom/scan/distributed.hpp).
    loom::scan::inclusive_scan(loom::serial{}, comm, loom::scan::plus<double>{},
                               loom::tensor_view<const float, 1>(mine.data(), {hi - lo}),
                               loom::tensor_view<double, 1>(y.data() + lo, {hi - lo}));

    // Every rank checks its shard; the worst error is agreed on by all_reduce(max).
    double err = 0;
    for (long long i = lo; i < hi; ++i) {
      const auto k = static_cast<std::size_t>(i);
      err = std::max(err, std::abs(y[k] - oracle[k]) / (1.0 + std::abs(oracle[k])));
    }
    comm.all_reduce(std::span<const double>(&err, 1), std::span<double>(&err, 1), loom::comm::reduce_op::max);
    return err;
  });
  const double dist_s = seconds_since(t0);

  const double err = max_errors[0];
  const bool ok = err <= 1e-9;
  std::printf("loom quick start: distributed inclusive scan over %d in-process ranks (comm::local)\n", ranks);
  std::printf("  length %lld (shards of %lld..%lld elements)\n", n, n / ranks, (n + ranks - 1) / ranks);
  std::printf("  checked every element against a serial fp64 scan: max relative error %.3g (tolerance 1e-9) %s\n", err,
              ok ? "OK" : "FAILED");
  std::printf("  time: distributed %.3f s, serial oracle %.3f s\n", dist_s, serial_s);
  return ok ? 0 : 1;
}
