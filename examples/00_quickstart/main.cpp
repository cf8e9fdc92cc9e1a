// loom quick start: P ranks in one process (comm::local) compute a distributed inclusive prefix sum
// of a long vector that is sharded unevenly across them, the way a sequence is sharded in context
// parallelism: local reduce -> all_gather of the P partial sums -> exclusive offset -> local scan.
// Then the same ranks run ring attention over a zigzag-sharded causal document. Each result is
// checked (against a serial fp64 scan, and against single-device attention), and the run prints
// what it checked and how long each part took.
//
//   loom.example.quickstart [ranks = 4] [length = 16777259]

#include <loom/attention/ring.hpp>
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

// Ring attention on the same in-process ranks: one causal document of 4099 tokens sharded zigzag
// (rank r holds chunks r and 2P - 1 - r), K/V passed around the ring; the gathered output is
// compared with single-device attention on the whole sequence.
bool ring_attention_demo(int ranks) {
  namespace la = loom::attention;
  const loom::index_t t = 4099, h = 4, d = 64;
  const std::vector<loom::index_t> cu{0, t};
  std::mt19937 gen(9);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> q(static_cast<std::size_t>(t * h * d)), k(q.size()), v(q.size());
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = dist(gen);
  const auto plan = loom::shard::make_plan(std::span<const loom::index_t>(cu), ranks, loom::shard::zigzag{});
  std::vector<float> ring_out(q.size()), one_out(q.size()), lse(static_cast<std::size_t>(t * h));
  auto t0 = std::chrono::steady_clock::now();
  loom::comm::run_local(ranks, [&](loom::comm::local& comm) {
    const int r = comm.rank();
    const loom::index_t n = plan.rank(r).tokens;
    std::vector<float> lq(static_cast<std::size_t>(n * h * d)), lk(lq.size()), lv(lq.size()), lo(lq.size()),
        ll(static_cast<std::size_t>(n * h));
    plan.scatter<float>(r, q, h * d, lq);
    plan.scatter<float>(r, k, h * d, lk);
    plan.scatter<float>(r, v, h * d, lv);
    // Plan once (the ranks agree on sharding, shapes and options here), then run on a workspace.
    const auto rp = la::ring::make_plan(loom::serial{}, comm, plan, {h, h, d, d});
    loom::workspace_buffer ws(rp.workspace_bytes());
    la::ring::forward(loom::serial{}, comm, rp, loom::tensor_view<const float, 3>(lq.data(), {n, h, d}),
                      loom::tensor_view<const float, 3>(lk.data(), {n, h, d}),
                      loom::tensor_view<const float, 3>(lv.data(), {n, h, d}),
                      loom::tensor_view<float, 3>(lo.data(), {n, h, d}), loom::tensor_view<float, 2>(ll.data(), {n, h}),
                      ws.span());
    plan.gather<float>(r, lo, h * d, ring_out);  // disjoint rows per rank
  });
  const double ring_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  // The convenience form: plans, allocates its workspace and runs in one call.
  la::forward(loom::serial{}, loom::segments{std::span<const loom::index_t>(cu)},
              loom::tensor_view<const float, 3>(q.data(), {t, h, d}),
              loom::tensor_view<const float, 3>(k.data(), {t, h, d}),
              loom::tensor_view<const float, 3>(v.data(), {t, h, d}),
              loom::tensor_view<float, 3>(one_out.data(), {t, h, d}), loom::tensor_view<float, 2>(lse.data(), {t, h}));
  const double one_s = seconds_since(t0);
  double err = 0;
  for (std::size_t i = 0; i < q.size(); ++i)
    err = std::max(err, std::abs(double(ring_out[i]) - one_out[i]) / (1.0 + std::abs(one_out[i])));
  const bool ok = err <= 2e-5;
  std::printf("loom quick start: ring attention (pass_kv, zigzag) over %d in-process ranks\n", ranks);
  std::printf("  one causal document of %lld tokens, %lld heads, dim %lld, fp32\n", static_cast<long long>(t),
              static_cast<long long>(h), static_cast<long long>(d));
  std::printf("  checked against single-device attention: max relative error %.3g (tolerance 2e-5) %s\n", err,
              ok ? "OK" : "FAILED");
  std::printf("  time: ring %.3f s (one thread per rank), single device %.3f s (one thread)\n", ring_s, one_s);
  return ok;
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
  const bool ring_ok = ring_attention_demo(ranks);
  return ok && ring_ok ? 0 : 1;
}
