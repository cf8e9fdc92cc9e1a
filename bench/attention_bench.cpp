// Exact attention against its limits and baselines, in one run (fp32, 8 heads, dim 128):
//   attention.sgemm          the fastest sgemm installed (support/sgemm.hpp), 2048^3, same threads (the FLOP ceiling)
//   attention.loom           loom::attention::forward on a plan, openmp, N = 8192, causal and full
//   attention.materialised   the fastest sgemm's QKᵀ into an N x N score matrix per head, row softmax, PV
//   attention.loom_backward  loom::attention::backward at the same shape
//   attention.gqa            loom::attention forward / backward (pass 0 / 1) at the shapes of the
//                            PyTorch peer rows (bench/peers): H = 16 query heads over Hkv = 4, causal,
//                            T = 4096 and 8192 as one document (docs 1) or packed as 4 documents of
//                            fixed lengths (docs 4); backward rated at the forward's FLOP count
//   attention.decode         one query token per sequence over its K/V history (32 sequences x 32768
//                            keys, 16 query heads over 4 kv heads): the split-KV forward of a plan
//                            made with query and key segments. Counter GB/s: K and V bytes read per
//                            second.
//   attention.decode_memcpy  the memory-copy rate over the same K/V bytes, in the same process
//                            (GB/s = bytes read + written, as baseline.memcpy); threads 1 and 2.
//   attention.decode_read    the memory's read rate over the same K/V bytes (a sum of them): the
//                            limit of a pass that only reads them (GB/s = bytes read).
//   attention.ring           ring pass_kv over comm::local, one thread per rank, zigzag, causal;
//                            P = 1 is the local kernel on one thread. Counter wait_fraction: the
//                            share of each rank's time spent waiting on transfers.
// GFLOP/s counts 4 d flops per visible (query, key) pair (QKᵀ and PV), for every implementation,
// so the materialised baseline's rate is what it achieves on the useful work.

#include <loom/attention/hybrid.hpp>
#include <loom/attention/local.hpp>
#include <loom/attention/ring.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/openmp.hpp>
#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>

#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sgemm.hpp>
#include <string>
#include <vector>

namespace {

namespace la = loom::attention;
using loom::index_t;

constexpr index_t heads = 8, dim = 128;

std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

struct qkv {
  index_t n;
  std::vector<float> q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  explicit qkv(index_t n_)
      : n(n_),
        q(random_vector(static_cast<std::size_t>(n * heads * dim), 1)),
        k(random_vector(q.size(), 2)),
        v(random_vector(q.size(), 3)),
        out(q.size()),
        dout(random_vector(q.size(), 4)),
        dq(q.size()),
        dk(q.size()),
        dv(q.size()),
        lse(static_cast<std::size_t>(n * heads)) {}
  loom::tensor_view<const float, 3> c(const std::vector<float>& x) const { return {x.data(), {n, heads, dim}}; }
  loom::tensor_view<float, 3> m(std::vector<float>& x) const { return {x.data(), {n, heads, dim}}; }
};

qkv& data(index_t n) {
  static qkv d(n);
  return d;
}

double pairs(index_t n, bool causal) {
  return causal ? static_cast<double>(n) * static_cast<double>(n + 1) / 2
                : static_cast<double>(n) * static_cast<double>(n);
}

// call() once untimed (the workspace's pages are touched once, as the peer rows' warm-up call
// does), then in the timed loop.
template <class F>
void timed(benchmark::State& state, const F& call) {
  call();
  for (auto _ : state) call();
}

void set_flops(benchmark::State& state, double flops) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

void sgemm(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const index_t n = 2048;
  const auto a = random_vector(static_cast<std::size_t>(n * n), 5), b = random_vector(a.size(), 6);
  std::vector<float> c(a.size());
  const int ni = static_cast<int>(n);
  const auto* lib = loom::bench::fastest(ni, ni, ni, threads);
  lib->threads(threads);
  for (auto _ : state) lib->run(ni, ni, ni, a.data(), ni, b.data(), ni, c.data(), ni);
  lib->threads(1);
  state.SetLabel(lib->name);
  set_flops(state, 2.0 * n * n * n);
}

// The local kernel through a plan made once and a workspace allocated once, outside the timed
// loop (nothing allocates per call).
void loom_forward(benchmark::State& state) {
  const bool causal = state.range(0) != 0;
  const int threads = static_cast<int>(state.range(1));
  auto& d = data(8192);
  const std::vector<std::int32_t> cu{0, static_cast<std::int32_t>(d.n)};
  la::options opt;
  opt.causal = causal;
  const loom::openmp b{threads};
  const auto plan =
      la::make_plan(b, loom::segments(std::span<const std::int32_t>(cu)), {d.n, heads, heads, dim, dim}, opt);
  loom::workspace_buffer ws(plan.workspace_bytes());
  const auto fwd = [&] {
    la::forward(b, plan, d.c(d.q), d.c(d.k), d.c(d.v), d.m(d.out),
                loom::tensor_view<float, 2>(d.lse.data(), {d.n, heads}), ws.span());
  };
  timed(state, fwd);
  set_flops(state, 4.0 * dim * heads * pairs(d.n, causal));
}

void loom_backward(benchmark::State& state) {
  const bool causal = state.range(0) != 0;
  const int threads = static_cast<int>(state.range(1));
  auto& d = data(8192);
  const std::vector<std::int32_t> cu{0, static_cast<std::int32_t>(d.n)};
  la::options opt;
  opt.causal = causal;
  const loom::openmp b{threads};
  const auto plan =
      la::make_plan(b, loom::segments(std::span<const std::int32_t>(cu)), {d.n, heads, heads, dim, dim}, opt);
  loom::workspace_buffer ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  la::forward(b, plan, d.c(d.q), d.c(d.k), d.c(d.v), d.m(d.out),
              loom::tensor_view<float, 2>(d.lse.data(), {d.n, heads}), ws.span());
  const auto bwd = [&] {
    la::backward(b, plan, d.c(d.q), d.c(d.k), d.c(d.v), d.c(d.out),
                 loom::tensor_view<const float, 2>(d.lse.data(), {d.n, heads}), d.c(d.dout), d.m(d.dq), d.m(d.dk),
                 d.m(d.dv), ws.span());
  };
  timed(state, bwd);
  set_flops(state, 4.0 * dim * heads * pairs(d.n, causal));  // the forward's count: time ratios read directly
}

// Materialised: per head, S = Q Kᵀ (N x N) by sgemm, masked row softmax, O = P V by sgemm.
void materialised(benchmark::State& state) {
  const bool causal = state.range(0) != 0;
  const int threads = static_cast<int>(state.range(1));
  auto& d = data(8192);
  const index_t n = d.n;
  std::vector<float> s(static_cast<std::size_t>(n * n));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const int ld = static_cast<int>(heads * dim), ni = static_cast<int>(n), di = static_cast<int>(dim);
  const auto* scores = loom::bench::fastest(ni, ni, di, threads);  // Q Kᵀ
  const auto* values = loom::bench::fastest(ni, di, ni, threads);  // P V
  scores->threads(threads);
  values->threads(threads);
  for (auto _ : state) {
    for (index_t h = 0; h < heads; ++h) {
      scores->run(ni, ni, di, d.q.data() + h * dim, ld, d.k.data() + h * dim, ld, s.data(), ni, true, scale);
#pragma omp parallel for num_threads(threads) schedule(static)
      for (index_t i = 0; i < n; ++i) {
        float* row = s.data() + i * n;
        const index_t end = causal ? i + 1 : n;
        float mx = -INFINITY;
        for (index_t j = 0; j < end; ++j) mx = std::max(mx, row[j]);
        float sum = 0;
        for (index_t j = 0; j < end; ++j) sum += (row[j] = std::exp(row[j] - mx));
        const float inv = 1.0f / sum;
        for (index_t j = 0; j < end; ++j) row[j] *= inv;
        for (index_t j = end; j < n; ++j) row[j] = 0.0f;
      }
      values->run(ni, di, ni, s.data(), ni, d.v.data() + h * dim, ld, d.out.data() + h * dim, ld);
    }
  }
  scores->threads(1);
  values->threads(1);
  state.SetLabel(scores == values ? scores->name : scores->name + " / " + values->name);
  set_flops(state, 4.0 * dim * heads * pairs(n, causal));
  state.counters["extra_MiB"] = static_cast<double>(n * n * 4) / (1 << 20);
}

void ring(benchmark::State& state) {
  const int p = static_cast<int>(state.range(0));
  auto& d = data(8192);
  const std::vector<index_t> cu{0, d.n};
  const auto plan = loom::shard::make_plan(std::span<const index_t>(cu), p, loom::shard::zigzag{});
  // Each rank's rows, prepared once.
  std::vector<std::vector<float>> q(static_cast<std::size_t>(p)), k(q.size()), v(q.size()), o(q.size()), l(q.size());
  for (int r = 0; r < p; ++r) {
    const auto n = static_cast<std::size_t>(plan.rank(r).tokens);
    q[r].resize(n * heads * dim);
    k[r].resize(q[r].size());
    v[r].resize(q[r].size());
    o[r].resize(q[r].size());
    l[r].resize(n * heads);
    plan.scatter<float>(r, d.q, heads * dim, q[r]);
    plan.scatter<float>(r, d.k, heads * dim, k[r]);
    plan.scatter<float>(r, d.v, heads * dim, v[r]);
  }
  // One plan and one workspace per rank, made once outside the timed loop.
  using ring_plan = la::ring::plan<la::ring::pass_kv, loom::serial, loom::fp32>;
  std::vector<ring_plan> plans(static_cast<std::size_t>(p));
  std::vector<std::unique_ptr<loom::workspace_buffer>> ws(static_cast<std::size_t>(p));
  loom::comm::run_local(p, [&](loom::comm::local& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    plans[r] = la::ring::make_plan(loom::serial{}, comm, plan, {heads, heads, dim, dim});
    ws[r] = std::make_unique<loom::workspace_buffer>(plans[r].workspace_bytes());
  });
  double waited = 0, busy = 0;
  for (auto _ : state) {
    std::vector<double> w(static_cast<std::size_t>(p)), t(w.size());
    loom::comm::run_local(p, [&](loom::comm::local& lc) {
      const int r = lc.rank();
      loom::comm::counting<loom::comm::local> comm(lc);
      const index_t n = plan.rank(r).tokens;
      const auto t0 = std::chrono::steady_clock::now();
      la::ring::forward(loom::serial{}, comm, plans[static_cast<std::size_t>(r)],
                        loom::tensor_view<const float, 3>(q[r].data(), {n, heads, dim}),
                        loom::tensor_view<const float, 3>(k[r].data(), {n, heads, dim}),
                        loom::tensor_view<const float, 3>(v[r].data(), {n, heads, dim}),
                        loom::tensor_view<float, 3>(o[r].data(), {n, heads, dim}),
                        loom::tensor_view<float, 2>(l[r].data(), {n, heads}), ws[static_cast<std::size_t>(r)]->span());
      t[static_cast<std::size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      w[static_cast<std::size_t>(r)] = comm.counts().wait_seconds();
    });
    for (int r = 0; r < p; ++r) {
      waited += w[static_cast<std::size_t>(r)];
      busy += t[static_cast<std::size_t>(r)];
    }
  }
  set_flops(state, 4.0 * dim * heads * pairs(d.n, true));
  state.counters["wait_fraction"] = busy > 0 ? waited / busy : 0;
}

}  // namespace

BENCHMARK(sgemm)
    ->Name("attention.sgemm")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(loom_forward)
    ->Name("attention.loom")
    ->ArgNames({"causal", "threads"})
    ->Args({1, 2})
    ->Args({0, 2})
    ->Args({1, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(materialised)
    ->Name("attention.materialised")
    ->ArgNames({"causal", "threads"})
    ->Args({1, 2})
    ->Args({0, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(loom_backward)
    ->Name("attention.loom_backward")
    ->ArgNames({"causal", "threads"})
    ->Args({1, 2})
    ->Args({0, 2})
    ->Args({1, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(ring)
    ->Name("attention.ring")
    ->ArgName("P")
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// GQA at the peer rows' shapes: one document of T tokens or 4 packed documents (the lengths
// bench/peers uses), forward or backward (dO random), plan and workspace made outside the timing.
namespace {

struct gqa_data {
  static constexpr index_t hq = 16, hkv = 4;
  index_t t;
  std::vector<float> q, k, v, out, dout, dq, dk, dv, lse;
  explicit gqa_data(index_t t_)
      : t(t_),
        q(random_vector(static_cast<std::size_t>(t * hq * dim), 11)),
        k(random_vector(static_cast<std::size_t>(t * hkv * dim), 12)),
        v(random_vector(k.size(), 13)),
        out(q.size()),
        dout(random_vector(q.size(), 14)),
        dq(q.size()),
        dk(k.size()),
        dv(k.size()),
        lse(static_cast<std::size_t>(t * hq)) {}
};

gqa_data& gqa_inputs(index_t t) {
  static gqa_data d4096(4096), d8192(8192);
  return t == 8192 ? d8192 : d4096;
}

std::vector<std::int32_t> gqa_offsets(index_t t, bool packed) {
  if (!packed) return {0, static_cast<std::int32_t>(t)};
  const std::vector<std::int32_t> lengths =
      t == 8192 ? std::vector<std::int32_t>{3000, 2500, 1500, 1192} : std::vector<std::int32_t>{1500, 1250, 750, 596};
  std::vector<std::int32_t> cu{0};
  for (const auto l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

void gqa(benchmark::State& state) {
  const index_t t = state.range(0);
  const bool packed = state.range(1) != 1, backward = state.range(2) != 0;
  const int threads = static_cast<int>(state.range(3));
  gqa_data& d = gqa_inputs(t);
  using D = gqa_data;
  const auto cu = gqa_offsets(t, packed);
  if (cu.back() != t) state.SkipWithError("the document lengths do not sum to T");
  const loom::openmp b{threads};
  const auto plan = la::make_plan(b, loom::segments(std::span<const std::int32_t>(cu)), {t, D::hq, D::hkv, dim, dim});
  loom::workspace_buffer ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  const loom::tensor_view<const float, 3> q(d.q.data(), {t, D::hq, dim}), k(d.k.data(), {t, D::hkv, dim}),
      v(d.v.data(), {t, D::hkv, dim}), o(d.out.data(), {t, D::hq, dim}), dout(d.dout.data(), {t, D::hq, dim});
  const loom::tensor_view<float, 2> lse(d.lse.data(), {t, D::hq});
  const auto fwd = [&] {
    la::forward(b, plan, q, k, v, loom::tensor_view<float, 3>(d.out.data(), {t, D::hq, dim}), lse, ws.span());
  };
  const auto bwd = [&] {
    la::backward(b, plan, q, k, v, o, loom::tensor_view<const float, 2>(d.lse.data(), {t, D::hq}), dout,
                 loom::tensor_view<float, 3>(d.dq.data(), {t, D::hq, dim}),
                 loom::tensor_view<float, 3>(d.dk.data(), {t, D::hkv, dim}),
                 loom::tensor_view<float, 3>(d.dv.data(), {t, D::hkv, dim}), ws.span());
  };
  if (backward) {
    fwd();  // the lse the backward reads
    timed(state, bwd);
  } else {
    timed(state, fwd);
  }
  double visible = 0;
  for (std::size_t i = 0; i + 1 < cu.size(); ++i) visible += pairs(cu[i + 1] - cu[i], true);
  set_flops(state, 4.0 * dim * D::hq * visible);
}

// The forward of the same inputs stored as bfloat16 (float accumulation): against the float rows
// of attention.gqa, the gain of 16-bit storage (on CPUs with AVX512_BF16, bfloat16 pair products).
void gqa_bf16(benchmark::State& state) {
  const index_t t = state.range(0);
  const bool packed = state.range(1) != 1;
  const int threads = static_cast<int>(state.range(2));
  using D = gqa_data;
  const gqa_data& f = gqa_inputs(t);
  auto to16 = [](const std::vector<float>& x) { return std::vector<loom::bfloat16>(x.begin(), x.end()); };
  const std::vector<loom::bfloat16> q = to16(f.q), k = to16(f.k), v = to16(f.v);
  std::vector<loom::bfloat16> out(q.size());
  std::vector<float> lse(static_cast<std::size_t>(t * D::hq));
  const auto cu = gqa_offsets(t, packed);
  const loom::openmp b{threads};
  const auto plan = la::make_plan(b, loom::segments(std::span<const std::int32_t>(cu)), {t, D::hq, D::hkv, dim, dim});
  loom::workspace_buffer ws(plan.workspace_bytes());
  const auto fwd = [&] {
    la::forward(b, plan, loom::tensor_view<const loom::bfloat16, 3>(q.data(), {t, D::hq, dim}),
                loom::tensor_view<const loom::bfloat16, 3>(k.data(), {t, D::hkv, dim}),
                loom::tensor_view<const loom::bfloat16, 3>(v.data(), {t, D::hkv, dim}),
                loom::tensor_view<loom::bfloat16, 3>(out.data(), {t, D::hq, dim}),
                loom::tensor_view<float, 2>(lse.data(), {t, D::hq}), ws.span());
  };
  timed(state, fwd);
  double visible = 0;
  for (std::size_t i = 0; i + 1 < cu.size(); ++i) visible += pairs(cu[i + 1] - cu[i], true);
  set_flops(state, 4.0 * dim * D::hq * visible);
#if defined(LOOM_X86_KERNELS)
  const double pair_speedup = loom::detail::x86::bf16_pair_speedup();
  state.SetLabel(loom::detail::x86::avx512_bf16_pairs_available() ? "bfloat16 pair products (AVX512_BF16)"
                 : pair_speedup > 0 ? "float products over bfloat16 storage (AVX512_BF16 pairs at " +
                                          std::to_string(pair_speedup).substr(0, 4) + "x the FMA rate here)"
                                    : "float products over bfloat16 storage");
#endif
}

}  // namespace

BENCHMARK(gqa_bf16)
    ->Name("attention.gqa_bf16")
    ->ArgNames({"T", "docs", "threads"})
    ->ArgsProduct({{4096, 8192}, {1, 4}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(gqa)
    ->Name("attention.gqa")
    ->ArgNames({"T", "docs", "pass", "threads"})
    ->ArgsProduct({{4096, 8192}, {1, 4}, {0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Decode: every sequence's query token against its own keys (cu_seqlens_q = 0, 1, ..., 32 and
// cu_seqlens_k = 0, 32768, ...). K and V (4 GiB) are filled once, outside the timed loop, in
// loom::workspace_buffer memory, which starts on a cache line as tensor libraries' does (a
// std::vector this large starts 16 bytes past a line: then every K and V row straddles one line
// more, and decode on 1 thread took 180-185 ms against 164-167).
namespace {

struct decode_data {
  static constexpr index_t seqs = 32, keys = 32768, hq = 16, hkv = 4;
  static constexpr std::size_t kv_size = static_cast<std::size_t>(seqs * keys * hkv * dim);  // of K, of V
  std::vector<float> q;
  loom::workspace_buffer k_mem{kv_size * sizeof(float)}, v_mem{kv_size * sizeof(float)};  // aligned
  std::span<float> k{reinterpret_cast<float*>(k_mem.data()), kv_size},
      v{reinterpret_cast<float*>(v_mem.data()), kv_size};
  std::vector<float> out, lse;
  std::vector<std::int32_t> qcu, kcu;
  decode_data()
      : q(random_vector(static_cast<std::size_t>(seqs * hq * dim), 7)),
        out(q.size()),
        lse(static_cast<std::size_t>(seqs * hq)) {
    std::uint32_t x = 12345;  // a cheap generator: 2^30 values
    for (std::size_t i = 0; i < k.size(); ++i) {
      x = x * 1664525u + 1013904223u;
      k[i] = static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
      x = x * 1664525u + 1013904223u;
      v[i] = static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
    }
    for (index_t s = 0; s <= seqs; ++s) {
      qcu.push_back(static_cast<std::int32_t>(s));
      kcu.push_back(static_cast<std::int32_t>(s * keys));
    }
  }
};

//! The one set of decode inputs every decode row reads (4 GiB of K and V, made at first use).
decode_data& decode_inputs() {
  static decode_data d;
  return d;
}

void decode(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  decode_data& d = decode_inputs();
  using D = decode_data;
  const loom::openmp b{threads};
  const auto plan = la::make_plan(b, loom::segments(std::span<const std::int32_t>(d.qcu)),
                                  loom::segments(std::span<const std::int32_t>(d.kcu)),
                                  {D::seqs, D::hq, D::hkv, dim, dim, D::seqs * D::keys});
  if (!plan.split_keys()) state.SkipWithError("the plan does not split the keys");
  loom::workspace_buffer ws(plan.workspace_bytes());
  const index_t tk = D::seqs * D::keys;
  const auto fwd = [&] {
    la::forward(b, plan, loom::tensor_view<const float, 3>(d.q.data(), {D::seqs, D::hq, dim}),
                loom::tensor_view<const float, 3>(d.k.data(), {tk, D::hkv, dim}),
                loom::tensor_view<const float, 3>(d.v.data(), {tk, D::hkv, dim}),
                loom::tensor_view<float, 3>(d.out.data(), {D::seqs, D::hq, dim}),
                loom::tensor_view<float, 2>(d.lse.data(), {D::seqs, D::hq}), ws.span());
  };
  timed(state, fwd);
  const double kv_bytes = 2.0 * static_cast<double>(d.k.size()) * sizeof(float);
  state.counters["GB/s"] =
      benchmark::Counter(kv_bytes * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
  set_flops(state, 4.0 * dim * D::hq * static_cast<double>(tk));
  state.counters["splits"] = static_cast<double>(plan.split().splits);
}

// The memory-copy rate over the same K/V bytes, in the same process: K and V copied 64 MiB at a
// time into a 64 MiB buffer per thread (the source streams from memory as the decode's does).
// GB/s counts the bytes read and the bytes written (2x the K/V bytes), as baseline.memcpy.
void decode_memcpy(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  decode_data& d = decode_inputs();
  constexpr std::size_t chunk = std::size_t{64} << 20;
  std::vector<std::vector<char>> dst(static_cast<std::size_t>(threads), std::vector<char>(chunk, 1));
  const char* srcs[2] = {reinterpret_cast<const char*>(d.k.data()), reinterpret_cast<const char*>(d.v.data())};
  const std::size_t bytes = d.k.size() * sizeof(float), pieces = (bytes + chunk - 1) / chunk;
  for (auto _ : state) {
    for (const char* src : srcs) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (std::size_t i = 0; i < pieces; ++i) {
        const std::size_t n = std::min(chunk, bytes - i * chunk);
        std::memcpy(dst[static_cast<std::size_t>(omp_get_thread_num())].data(), src + i * chunk, n);
      }
    }
    benchmark::DoNotOptimize(dst.data());
  }
  state.counters["GB/s"] = benchmark::Counter(
      4.0 * static_cast<double>(bytes) * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// The memory's read rate over the same K/V bytes, in the same process: each thread sums its share
// of K, then of V (64 partial sums, which compilers vectorise into independent chains): what a pass
// that only reads them could reach. GB/s counts the bytes read (the K/V bytes).
void decode_read(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  decode_data& d = decode_inputs();
  const std::size_t n = d.k.size();
  for (auto _ : state) {
    float sink = 0;
    for (const float* src : {d.k.data(), d.v.data()}) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
      {
        const auto t = static_cast<std::size_t>(omp_get_thread_num()), nt = static_cast<std::size_t>(threads);
        const std::size_t b = n / nt * t / 64 * 64, e = t + 1 == nt ? n : n / nt * (t + 1) / 64 * 64;
        float part[64] = {};
        std::size_t i = b;
        for (; i + 64 <= e; i += 64)
          for (std::size_t u = 0; u < 64; ++u) part[u] += src[i + u];
        for (; i < e; ++i) part[0] += src[i];
        for (const float x : part) sink += x;
      }
    }
    benchmark::DoNotOptimize(sink);
  }
  state.counters["GB/s"] =
      benchmark::Counter(2.0 * static_cast<double>(n * sizeof(float)) * static_cast<double>(state.iterations()) * 1e-9,
                         benchmark::Counter::kIsRate);
}

}  // namespace

BENCHMARK(decode_read)
    ->Name("attention.decode_read")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(decode_memcpy)
    ->Name("attention.decode_memcpy")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(decode)
    ->Name("attention.decode")
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Sequence parallel (sp.*): Ulysses and ring pass_kv at P = 2 on comm::local (one thread per
// rank, loom::serial inside each), against the local kernel on one thread; fp32, N = 8192,
// 16 heads, dim 128, causal. Speedup = sp.local time / sp.<impl> time.
namespace {

constexpr index_t sp_heads = 16;

struct sp_data {
  index_t n = 8192;
  std::vector<float> q, k, v;
  sp_data()
      : q(random_vector(static_cast<std::size_t>(n * sp_heads * dim), 11)),
        k(random_vector(q.size(), 12)),
        v(random_vector(q.size(), 13)) {}
};
const sp_data& sp_inputs() {
  static const sp_data d;
  return d;
}

// Each rank's rows of q, k, v under a plan, and room for out and lse.
struct sp_shards {
  std::vector<std::vector<float>> q, k, v, o, l;
  sp_shards(const loom::shard::plan& plan, const sp_data& d) {
    const int p = plan.ranks();
    for (auto* x : {&q, &k, &v, &o, &l}) x->resize(static_cast<std::size_t>(p));
    for (int r = 0; r < p; ++r) {
      const auto n = static_cast<std::size_t>(plan.rank(r).tokens), row = static_cast<std::size_t>(sp_heads * dim);
      for (auto* x : {&q, &k, &v, &o}) (*x)[static_cast<std::size_t>(r)].resize(n * row);
      l[static_cast<std::size_t>(r)].resize(n * static_cast<std::size_t>(sp_heads));
      plan.scatter<float>(r, d.q, sp_heads * dim, q[static_cast<std::size_t>(r)]);
      plan.scatter<float>(r, d.k, sp_heads * dim, k[static_cast<std::size_t>(r)]);
      plan.scatter<float>(r, d.v, sp_heads * dim, v[static_cast<std::size_t>(r)]);
    }
  }
  loom::tensor_view<const float, 3> in(const std::vector<std::vector<float>>& x, int r, index_t n) const {
    return {x[static_cast<std::size_t>(r)].data(), {n, sp_heads, dim}};
  }
};

void sp_local(benchmark::State& state) {
  const auto& d = sp_inputs();
  std::vector<float> out(d.q.size()), lse(static_cast<std::size_t>(d.n * sp_heads));
  const auto plan = la::make_plan(loom::serial{}, loom::segments<>::whole(d.n), {d.n, sp_heads, sp_heads, dim, dim});
  loom::workspace_buffer ws(plan.workspace_bytes());
  for (auto _ : state)
    la::forward(loom::serial{}, plan, loom::tensor_view<const float, 3>(d.q.data(), {d.n, sp_heads, dim}),
                loom::tensor_view<const float, 3>(d.k.data(), {d.n, sp_heads, dim}),
                loom::tensor_view<const float, 3>(d.v.data(), {d.n, sp_heads, dim}),
                loom::tensor_view<float, 3>(out.data(), {d.n, sp_heads, dim}),
                loom::tensor_view<float, 2>(lse.data(), {d.n, sp_heads}), ws.span());
  set_flops(state, 4.0 * dim * sp_heads * pairs(d.n, true));
}

// Plans made once per rank (make_plan is collective: the agreement runs here, not in the timed
// loop) and workspaces allocated outside it; each timed iteration is one forward on every rank.
void sp_parallel(benchmark::State& state, bool ulysses) {
  const int p = static_cast<int>(state.range(0));
  const auto& d = sp_inputs();
  const std::vector<index_t> cu{0, d.n};
  const loom::segments docs{std::span<const index_t>(cu)};
  const auto plan = ulysses ? loom::shard::make_plan(docs, p, loom::shard::contiguous{})
                            : loom::shard::make_plan(docs, p, loom::shard::zigzag{});
  sp_shards s(plan, d);
  const la::head_shape shape{sp_heads, sp_heads, dim, dim};
  std::vector<std::optional<la::ulysses::plan<loom::serial, loom::fp32>>> up(static_cast<std::size_t>(p));
  std::vector<std::optional<la::ring::plan<la::ring::pass_kv, loom::serial, loom::fp32>>> rp(up.size());
  std::vector<std::unique_ptr<loom::workspace_buffer>> ws(up.size());
  loom::comm::run_local(p, [&](loom::comm::local& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    if (ulysses) {
      up[r].emplace(la::ulysses::make_plan<loom::fp32>(loom::serial{}, comm, plan, shape));
      ws[r] = std::make_unique<loom::workspace_buffer>(up[r]->workspace_bytes());
    } else {
      rp[r].emplace(la::ring::make_plan<loom::fp32>(loom::serial{}, comm, plan, shape));
      ws[r] = std::make_unique<loom::workspace_buffer>(rp[r]->workspace_bytes());
    }
  });
  for (auto _ : state)
    loom::comm::run_local(p, [&](loom::comm::local& comm) {
      const int r = comm.rank();
      const auto i = static_cast<std::size_t>(r);
      const index_t n = plan.rank(r).tokens;
      const loom::tensor_view<float, 3> o(s.o[i].data(), {n, sp_heads, dim});
      const loom::tensor_view<float, 2> l(s.l[i].data(), {n, sp_heads});
      if (ulysses)
        la::ulysses::forward(loom::serial{}, comm, *up[i], s.in(s.q, r, n), s.in(s.k, r, n), s.in(s.v, r, n), o, l,
                             ws[i]->span());
      else
        la::ring::forward(loom::serial{}, comm, *rp[i], s.in(s.q, r, n), s.in(s.k, r, n), s.in(s.v, r, n), o, l,
                          ws[i]->span());
    });
  set_flops(state, 4.0 * dim * sp_heads * pairs(d.n, true));
}
void sp_ulysses(benchmark::State& state) { sp_parallel(state, true); }
void sp_ring(benchmark::State& state) { sp_parallel(state, false); }

}  // namespace

BENCHMARK(sp_local)->Name("sp.local")->Iterations(1)->Repetitions(3)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(sp_ulysses)
    ->Name("sp.ulysses")
    ->ArgName("P")
    ->Arg(2)
    ->Iterations(1)
    ->Repetitions(3)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(sp_ring)->Name("sp.ring")->ArgName("P")->Arg(2)->Iterations(1)->Repetitions(3)->UseRealTime()->Unit(
    benchmark::kMillisecond);

// Bytes each rank sends per layer (the most any rank sends) at P = U x R = 8, N = 128K tokens,
// 32 query / 8 kv heads, dim 128, bf16 storage, fp32 accumulators: from the plans' byte formulas,
// which the tests check byte-exactly against a counting communicator. No data moves here.
void sp_bytes(benchmark::State& state) {
  const int u = static_cast<int>(state.range(0)), r = static_cast<int>(state.range(1));
  const std::vector<index_t> cu{0, 131072};
  const auto ring = loom::shard::make_plan(loom::segments(std::span<const index_t>(cu)), r, loom::shard::zigzag{});
  double fwd = 0, bwd = 0;
  std::mutex mu;
  // The hybrid plans of the U x R grid (made on in-process ranks; rank 0's answers for all).
  loom::comm::run_local(u * r, [&](loom::comm::local& comm) {
    const auto hp = la::hybrid::make_plan<loom::bf16>(loom::serial{}, comm, ring, {32, 8, 128, 128});
    if (comm.rank() != 0) return;
    const std::lock_guard<std::mutex> lock(mu);
    for (int rank = 0; rank < u * r; ++rank) {
      const auto t = hp.bytes_sent(rank, 2, 4, 2);
      fwd = std::max(fwd, static_cast<double>(t.forward));
      bwd = std::max(bwd, static_cast<double>(t.backward));
    }
  });
  for (auto _ : state) benchmark::DoNotOptimize(&fwd);
  state.counters["forward_MB"] = fwd * 1e-6;
  state.counters["backward_MB"] = bwd * 1e-6;
}
BENCHMARK(sp_bytes)
    ->Name("sp.bytes")
    ->ArgNames({"U", "R"})
    ->Args({1, 8})
    ->Args({8, 1})
    ->Args({2, 4})
    ->Args({4, 2})
    ->Iterations(1);
