// loom's CUDA primitives on the GPU of this machine, against the vendor baselines measured in the
// same run (CUDA events, median of the timed calls after warm-up):
//   scan      loom::scan::inclusive_scan(plus<float>) of 64M fp32, against cub::DeviceScan::InclusiveSum
//             (not bitwise deterministic for floats) and a device-to-device copy of the same bytes;
//   recurrence  loom::scan::linear_recurrence, diagonal A, fp32, T = 262144 steps of d = 64 (one
//             document), reproducible = false (CUB's scan by key of affine pairs behind loom's API)
//             and the default blocked engine, against CUB's own call on the same formulation: one
//             cub::DeviceScan::InclusiveScanByKey of the pairs (a, b) in channel-major order, the key
//             of an element its channel, written by the caller's iterators into h;
//   spmm      loom::sparse::spmm on the tiled bitmap format (magnitude-pruned random weights) and,
//             where loom::cusparse is built, loom::sparse::cusparse::spmm on the same weight as CSR,
//             against cublasSgemm on the dense matrix of the same shape, M = K = 4096 and 4096 x 11008;
//   overlap   ring pass-KV forward (fp32, full attention, contiguous shards, 8 heads, dim 64) on
//             P = 2, 3, 4 ranks sharing this GPU over comm::device_local: the wall time of the ring
//             (T_ring), of the same compute without communication (each rank P local attention
//             calls of its block, T_comp) and of the same transfers without compute (P - 1 ring
//             shifts of a K/V block, T_xfer), all ranks at once, slowest rank, median of 7;
//             hidden = 1 - (T_ring - T_comp) / T_xfer, the share of the transfer time that did not
//             lengthen the call (target >= 0.9 where a step's compute outlasts its transfer).
//   ring      (where loom::cudnn is built) ring pass-KV through cuDNN (ring_cudnn.cuh) on P = 1, 2,
//             4 ranks sharing this GPU, bf16, 16/4 heads, d = 128, causal, 16384 tokens in zigzag
//             shards, against attention::cudnn on the whole sequence on one rank: T_one / T_ring
//             (the same work on the same GPU: 1.0 means the ring's blocks, merges and transfers
//             cost nothing); printed with the overlap rows;
//   linear    chunked linear attention forward through linear_attention::cublas (cuBLAS strided-batched
//             products), bf16 storage, fixed decay, H = 16, dk = dv = 128, C = 64, T = 8192 and 32768:
//             TFLOP/s of the chunked algorithm's useful work (per chunk of c tokens and head,
//             c(c+1)/2 (dk + dv) 2 + 2 c dk dv 2) and its share of the GPU's dense bf16 peak (SMs x
//             clock x 2048 FLOP per cycle per SM on sm_80, 4096 on sm_90; target >= 0.40 at T = 32768).
//             Then where the call's time goes: each of its four strided-batched products timed by
//             CUDA events around it, and the engine's two phases (gates, gathers, L = Ks^T V and the
//             pass over chunk states; the output products with their mask and row scale) and the
//             scatter, each timed alone; the elementwise passes are a phase's time less its products.
// Prints markdown tables. Needs a GPU; built with the cuda presets (compiled in CI, never run there).
//
//   loom.bench.cuda [--quick | --scan | --overlap | --linear]   (--quick: small sizes; the others: those rows only;
//                                                                 --scan includes the recurrence rows)

#include <loom/attention/ring.hpp>
#if LOOM_BENCH_CUDNN
#include <loom/attention/ring_cudnn.cuh>
#endif
#include <loom/backend/cuda.hpp>
#include <loom/comm/device_local.hpp>
#include <loom/linear_attention/cublas.cuh>
#include <loom/scan/recurrence.hpp>
#include <loom/scan/scan.hpp>
#include <loom/sparse/convert.hpp>
#include <loom/sparse/spmm.hpp>
#if LOOM_BENCH_CUSPARSE
#include <loom/sparse/cusparse.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cub/device/device_scan.cuh>
#include <cublas_v2.h>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <vector>

#include "support.hpp"

namespace {

using loom::index_t;
using loom::bench::device_array;
using loom::bench::median_ms;

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s failed: %d\n", what, static_cast<int>(s));
    std::exit(1);
  }
}

void scan_rows(std::size_t n) {
  std::vector<float> h(n);
  std::mt19937 g(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : h) x = u(g);
  device_array<float> in(h), out(n), out_cub(n);
  const loom::cuda b{};
  const loom::tensor_view<const float, 1, loom::cuda_memory> iv(in.data(), {static_cast<index_t>(n)});
  const loom::tensor_view<float, 1, loom::cuda_memory> ov(out.data(), {static_cast<index_t>(n)});
  // Plans and workspaces made once, outside the timed calls.
  // loom with its defaults (reproducible: the blocked engine), with shorter blocks (more of them
  // in flight), and with reproducible = false (CUB's scan behind loom's API).
  struct variant {
    const char* name;
    loom::scan::options opt;
  };
  variant vs[] = {{"loom::scan::inclusive_scan, reproducible (default)", {}},
                  {"loom::scan::inclusive_scan, reproducible, block = 1024", {.block = 1024}},
                  {"loom::scan::inclusive_scan, reproducible = false", {.reproducible = false}}};
  std::vector<double> loom_ms;
  for (auto& v : vs) {
    const auto plan = loom::scan::make_plan(b, loom::scan::plus<float>{}, static_cast<index_t>(n), {}, v.opt);
    const device_array<std::byte> ws(plan.workspace_bytes());
    loom_ms.push_back(median_ms([&] { loom::scan::inclusive_scan(b, plan, iv, ov, ws.bytes()); }));
  }
  std::size_t cub_bytes = 0;
  LOOM_CUDA_TRY(cub::DeviceScan::InclusiveSum(nullptr, cub_bytes, in.data(), out_cub.data(), static_cast<int>(n)));
  device_array<std::byte> cub_ws(cub_bytes);
  const double cub_ms = median_ms([&] {
    LOOM_CUDA_TRY(
        cub::DeviceScan::InclusiveSum(cub_ws.data(), cub_bytes, in.data(), out_cub.data(), static_cast<int>(n)));
  });
  const double copy_ms = median_ms(
      [&] { LOOM_CUDA_TRY(cudaMemcpyAsync(out_cub.data(), in.data(), sizeof(float) * n, cudaMemcpyDeviceToDevice)); });
  // Agreement with CUB (different summation orders: relative to the running magnitude).
  std::vector<float> a(n), c(n);
  LOOM_CUDA_TRY(
      cub::DeviceScan::InclusiveSum(cub_ws.data(), cub_bytes, in.data(), out_cub.data(), static_cast<int>(n)));
  LOOM_CUDA_TRY(cudaMemcpy(a.data(), out.data(), sizeof(float) * n, cudaMemcpyDeviceToHost));
  LOOM_CUDA_TRY(cudaMemcpy(c.data(), out_cub.data(), sizeof(float) * n, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (std::size_t i = 0; i < n; i += 997) worst = std::max(worst, static_cast<double>(std::abs(a[i] - c[i])));
  const double gb = 8.0 * static_cast<double>(n) * 1e-9;
  std::printf("\n### Scan, plus<float>, n = %zu\n\n", n);
  std::printf("| row | time | GB/s (read + write) | time / CUB's |\n| --- | --: | --: | --: |\n");
  for (std::size_t i = 0; i < loom_ms.size(); ++i)
    std::printf("| %s | %.3f ms | %.0f | %.2f |\n", vs[i].name, loom_ms[i], gb / loom_ms[i] * 1e3, loom_ms[i] / cub_ms);
  std::printf("| cub::DeviceScan::InclusiveSum | %.3f ms | %.0f | 1 |\n", cub_ms, gb / cub_ms * 1e3);
  std::printf("| cudaMemcpy device to device (same bytes) | %.3f ms | %.0f | %.2f |\n", copy_ms, gb / copy_ms * 1e3,
              copy_ms / cub_ms);
  std::printf("\nlast loom row vs CUB: largest |difference| over every 997th element %.3g\n", worst);
}

//! The steps (a, b) of a diagonal recurrence's channels and their composition: loom::scan's affine
//! pair and the combine functor its own CUB path passes (detail/affine_recurrence_cuda.cuh).
using step = loom::scan::affine_pair<float>;
using compose = loom::scan::detail::affine_combine<loom::scan::affine<float>>;
//! Element j of the channel-major order: channel j / T, time j % T, read from row-major [T, d].
struct step_at {
  const float *a, *b;
  index_t steps, d;
  __host__ __device__ step operator()(index_t j) const {
    const index_t c = j / steps, t = j % steps;
    return {a[t * d + c], b[t * d + c]};
  }
};
struct channel_of {
  index_t steps;
  __host__ __device__ index_t operator()(index_t j) const { return j / steps; }
};
struct store_h {
  float* h;
  index_t steps, d;
  __host__ __device__ void operator()(index_t j, const step& x) const { h[(j % steps) * d + j / steps] = x.b; }
};

void recurrence_rows(index_t steps, index_t d) {
  const auto n = static_cast<std::size_t>(steps * d);
  std::vector<float> ah(n), bh(n);
  std::mt19937 g(9);
  std::uniform_real_distribution<float> ua(0.5f, 1.0f), ub(-1, 1);
  for (auto& x : ah) x = ua(g);
  for (auto& x : bh) x = ub(g);
  device_array<float> a(ah), bv(bh), h(n), h_cub(n);
  const loom::cuda b{};
  using cview = loom::tensor_view<const float, 2, loom::cuda_memory>;
  const cview av(a.data(), {steps, d}), bvv(bv.data(), {steps, d});
  const loom::tensor_view<float, 2, loom::cuda_memory> hv(h.data(), {steps, d});
  struct variant {
    const char* name;
    loom::scan::options opt;
  };
  variant vs[] = {{"loom::scan::linear_recurrence, reproducible (default)", {}},
                  {"loom::scan::linear_recurrence, reproducible = false", {.reproducible = false}}};
  std::vector<double> loom_ms;
  for (auto& v : vs) {
    const auto plan =
        loom::scan::make_plan(b, loom::scan::diagonal{}, steps, d, loom::segments<loom::cuda_memory>{}, v.opt);
    const device_array<std::byte> ws(plan.workspace_bytes());
    loom_ms.push_back(median_ms([&] { loom::scan::linear_recurrence(b, plan, av, bvv, hv, ws.bytes()); }));
  }
  const auto keys = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), channel_of{steps});
  const auto in =
      thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), step_at{a.data(), bv.data(), steps, d});
  const auto out = thrust::make_tabulate_output_iterator(store_h{h_cub.data(), steps, d});
  const auto count = static_cast<index_t>(n);
  std::size_t cub_bytes = 0;
  LOOM_CUDA_TRY(cub::DeviceScan::InclusiveScanByKey(nullptr, cub_bytes, keys, in, out, compose{}, count));
  device_array<std::byte> cub_ws(cub_bytes);
  const double cub_ms = median_ms([&] {
    LOOM_CUDA_TRY(cub::DeviceScan::InclusiveScanByKey(cub_ws.data(), cub_bytes, keys, in, out, compose{}, count));
  });
  std::vector<float> x(n), y(n);
  LOOM_CUDA_TRY(cudaMemcpy(x.data(), h.data(), sizeof(float) * n, cudaMemcpyDeviceToHost));
  LOOM_CUDA_TRY(cudaMemcpy(y.data(), h_cub.data(), sizeof(float) * n, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (std::size_t i = 0; i < n; i += 997) worst = std::max(worst, static_cast<double>(std::abs(x[i] - y[i])));
  const double gb = 12.0 * static_cast<double>(n) * 1e-9;
  std::printf("\n### Diagonal recurrence, fp32, T = %ld, d = %ld (one document)\n\n", static_cast<long>(steps),
              static_cast<long>(d));
  std::printf("| row | time | GB/s (a, b read, h written) | time / CUB's |\n| --- | --: | --: | --: |\n");
  for (std::size_t i = 0; i < loom_ms.size(); ++i)
    std::printf("| %s | %.3f ms | %.0f | %.2f |\n", vs[i].name, loom_ms[i], gb / loom_ms[i] * 1e3, loom_ms[i] / cub_ms);
  std::printf("| cub::DeviceScan::InclusiveScanByKey, (a, b) pairs keyed by channel | %.3f ms | %.0f | 1 |\n", cub_ms,
              gb / cub_ms * 1e3);
  std::printf(
      "\nlast loom row vs CUB: largest |difference| over every 997th element %.3g (target: CUB's time / "
      "loom's >= 0.95, time / CUB's <= 1.05, for reproducible = false)\n",
      worst);
}

void spmm_rows(index_t m, index_t k, const std::vector<int>& pcts, const std::vector<index_t>& ns, cublasHandle_t h) {
  std::vector<float> dense(static_cast<std::size_t>(m * k));
  std::mt19937 g(11);
  std::normal_distribution<float> nd(0, 1);
  for (auto& x : dense) x = nd(g);
  const index_t nmax = *std::max_element(ns.begin(), ns.end());
  std::vector<float> bh(static_cast<std::size_t>(k * nmax));
  for (auto& x : bh) x = nd(g);
  device_array<float> bd(bh), cd(static_cast<std::size_t>(m * nmax)), ad(dense);
  std::printf("\n### SpMM, M = %ld, K = %ld (row-major B and C; cublasSgemm on the dense A)\n\n", static_cast<long>(m),
              static_cast<long>(k));
  std::printf("| N | cublasSgemm |");
  for (int s : pcts) {
    std::printf(" %d %%: loom bitmap · sgemm/loom |", s);
    if (LOOM_BENCH_CUSPARSE) std::printf(" %d %%: cuSPARSE CSR (loom::sparse::cusparse) · sgemm/it |", s);
  }
  std::printf("\n| --- | --: |");
  for (std::size_t i = 0; i < pcts.size() * (LOOM_BENCH_CUSPARSE ? 2 : 1); ++i) std::printf(" --: |");
  std::printf("\n");
  std::vector<std::vector<double>> loom_ms(pcts.size(), std::vector<double>(ns.size()));
  std::vector<std::vector<double>> csr_ms(pcts.size(), std::vector<double>(ns.size()));
  for (std::size_t si = 0; si < pcts.size(); ++si) {
    const auto pruned =
        loom::sparse::prune_magnitude(loom::tensor_view<const float, 2>(dense.data(), {m, k}), pcts[si] / 100.0);
    const auto bm = loom::sparse::to_bitmap(loom::tensor_view<const float, 2>(pruned.data(), {m, k}));
    device_array<std::uint64_t> masks(bm.masks());
    device_array<index_t> off(bm.tile_offsets());
    device_array<float> val(bm.values());
    const auto av = loom::sparse::make_bitmap_view<loom::cuda_memory>(m, k, masks.data(), off.data(), val.data());
    for (std::size_t ni = 0; ni < ns.size(); ++ni) {
      const index_t n = ns[ni];
      const loom::tensor_view<const float, 2, loom::cuda_memory> bv(bd.data(), {k, n});
      const loom::tensor_view<float, 2, loom::cuda_memory> cv(cd.data(), {m, n});
      const auto plan = loom::sparse::make_plan(loom::cuda{}, av, n);
      device_array<std::byte> ws(plan.workspace_bytes());  // the packed B panel; no allocation per call
      loom_ms[si][ni] = median_ms([&] { loom::sparse::spmm(loom::cuda{}, plan, av, bv, cv, ws.bytes()); });
    }
#if LOOM_BENCH_CUSPARSE
    const auto csr = loom::sparse::to_csr(loom::tensor_view<const float, 2>(pruned.data(), {m, k}));
    device_array<index_t> rp(csr.row_ptr());
    device_array<std::int32_t> ci(csr.col_idx());
    device_array<float> cv_(csr.values());
    const auto ac = loom::sparse::make_csr_view<loom::cuda_memory>(m, k, rp.data(), ci.data(), cv_.data());
    for (std::size_t ni = 0; ni < ns.size(); ++ni) {
      const index_t n = ns[ni];
      const loom::tensor_view<const float, 2, loom::cuda_memory> bv(bd.data(), {k, n});
      const loom::tensor_view<float, 2, loom::cuda_memory> cv(cd.data(), {m, n});
      const auto plan = loom::sparse::cusparse::make_plan(loom::cuda{}, ac, n);
      device_array<std::byte> ws(plan.workspace_bytes());
      csr_ms[si][ni] = median_ms([&] { loom::sparse::cusparse::spmm(loom::cuda{}, plan, ac, bv, cv, ws.bytes()); });
    }
#endif
  }
  for (std::size_t ni = 0; ni < ns.size(); ++ni) {
    const index_t n = ns[ni];
    const float one = 1, zero = 0;
    // Row-major C (M x N) = A (M x K) B (K x N) is column-major C^T = B^T A^T.
    const double sgemm_ms = median_ms([&] {
      check_cublas(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                               static_cast<int>(k), &one, bd.data(), static_cast<int>(n), ad.data(),
                               static_cast<int>(k), &zero, cd.data(), static_cast<int>(n)),
                   "cublasSgemm");
    });
    std::printf("| %ld | %.1f µs |", static_cast<long>(n), sgemm_ms * 1e3);
    for (std::size_t si = 0; si < pcts.size(); ++si) {
      std::printf(" %.1f µs · %.2fx |", loom_ms[si][ni] * 1e3, sgemm_ms / loom_ms[si][ni]);
      if (LOOM_BENCH_CUSPARSE) std::printf(" %.1f µs · %.2fx |", csr_ms[si][ni] * 1e3, sgemm_ms / csr_ms[si][ni]);
    }
    std::printf("\n");
  }
}

//! linear_attention::cublas's product provider with CUDA events around each product (the default
//! stream, as the rows' calls), and each product's FLOPs, in the order the engine enqueues them.
struct timed_gemm {
  loom::linear_attention::cublas::detail::cublas_gemm inner;
  struct mark {
    cudaEvent_t begin, end;
    double flop;
  };
  std::vector<mark>* marks;
  template <class TS, class TC>
  void operator()(loom::linear_attention::detail::gemm_op ta, loom::linear_attention::detail::gemm_op tb, index_t m,
                  index_t n, index_t k, TC alpha, const TS* a, index_t lda, index_t sa, const TS* b, index_t ldb,
                  index_t sb, TC beta, TC* c, index_t ldc, index_t sc, index_t batch) const {
    mark mk{
        nullptr, nullptr,
        2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * static_cast<double>(batch)};
    LOOM_CUDA_TRY(cudaEventCreate(&mk.begin));
    LOOM_CUDA_TRY(cudaEventCreate(&mk.end));
    LOOM_CUDA_TRY(cudaEventRecord(mk.begin));
    inner(ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, batch);
    LOOM_CUDA_TRY(cudaEventRecord(mk.end));
    marks->push_back(mk);
  }
};

//! One forward's time split into the engine's parts (ms).
struct linear_split {
  double call = 0, states = 0, outputs = 0, scatter = 0;
  double product[4] = {0, 0, 0, 0}, flop[4] = {0, 0, 0, 0};
};

//! The parts of linear_attention::cublas::forward(b, pl, gate, x, o, {}, ws) whose whole call took
//! call_ms: the engine's phases called one by one (detail/gemm_engine.hpp), each timed alone, and
//! its products timed inside whole calls.
template <class Plan, class Gate, class X, class O>
linear_split linear_parts(const Plan& pl, const Gate& gate, const X& x, O o, std::span<std::byte> ws, double call_ms) {
  namespace la = loom::linear_attention;
  const loom::cuda b{};
  constexpr std::string_view call = "loom.bench.cuda";
  auto& st = pl.device_state(call);
  const auto lock = st.enter(b, call);  // the plan's cuBLAS handle, on b's stream
  const la::cublas::detail::cublas_gemm gemm{st.handle.get(), call};
  const auto g = la::detail::gemm_setup(b, pl.base(), pl.layout(), gate, x, o, {}, ws, call);
  linear_split r;
  r.call = call_ms;
  r.states = median_ms([&] { la::detail::gemm_states(b, gemm, pl.base(), pl.layout(), g); }, 2, 7);
  r.outputs = median_ms([&] { la::detail::gemm_output_products(b, gemm, pl.base(), pl.layout(), g); }, 2, 7);
  r.scatter = median_ms([&] { la::detail::gemm_outputs(b, gemm, pl.base(), pl.layout(), g, o); }, 2, 7) - r.outputs;
  std::vector<std::vector<double>> each(4);
  for (int rep = -2; rep < 7; ++rep) {
    std::vector<timed_gemm::mark> marks;
    la::detail::gemm_forward(b, timed_gemm{gemm, &marks}, pl.base(), pl.layout(), gate, x, o, {}, ws, call);
    LOOM_CUDA_TRY(cudaDeviceSynchronize());
    for (std::size_t i = 0; i < marks.size(); ++i) {
      float t = 0;
      LOOM_CUDA_TRY(cudaEventElapsedTime(&t, marks[i].begin, marks[i].end));
      if (rep >= 0 && i < 4) each[i].push_back(t), r.flop[i] = marks[i].flop;
      cudaEventDestroy(marks[i].begin);
      cudaEventDestroy(marks[i].end);
    }
  }
  for (std::size_t i = 0; i < 4; ++i) {
    std::sort(each[i].begin(), each[i].end());
    r.product[i] = each[i].empty() ? 0.0 : each[i][each[i].size() / 2];
  }
  return r;
}

void linear_rows(const std::vector<index_t>& tokens) {
  namespace la = loom::linear_attention;
  constexpr index_t H = 16, D = 128, C = 64;
  int device = 0, sms = 0, clock_khz = 0;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LOOM_CUDA_TRY(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  cudaDeviceProp prop{};
  LOOM_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
  const double per_sm = prop.major == 8 && prop.minor == 0 ? 2048 : prop.major == 9 ? 4096 : 0;
  const double peak = per_sm * sms * clock_khz * 1e3;  // FLOP/s; 0: not known for this architecture
  std::printf(
      "\n### Chunked linear attention forward, linear_attention::cublas (bf16, fixed decay, H = %ld, "
      "dk = dv = %ld, C = %ld)\n\n",
      static_cast<long>(H), static_cast<long>(D), static_cast<long>(C));
  std::printf("dense bf16 peak: %.0f TFLOP/s (%d SMs x %.2f GHz x %.0f FLOP/cycle/SM)\n\n", peak * 1e-12, sms,
              clock_khz * 1e-6, per_sm);
  std::printf("| T | time | TFLOP/s | share of peak |\n| --: | --: | --: | --: |\n");
  std::vector<linear_split> parts;
  for (const index_t T : tokens) {
    std::mt19937 g(5);
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<loom::bfloat16> h(static_cast<std::size_t>(T * H * D));
    for (auto& x : h) x = loom::bfloat16(u(g));
    std::vector<float> lg(H);
    for (index_t i = 0; i < H; ++i) lg[i] = std::log(1.0f - std::pow(2.0f, -5.0f - static_cast<float>(i)));
    device_array<loom::bfloat16> q(h), k(h), v(h), o(h.size());
    device_array<float> lgd(lg);
    using view = loom::tensor_view<const loom::bfloat16, 3, loom::cuda_memory>;
    const la::operands<loom::bf16, loom::cuda_memory> x{view(q.data(), {T, H, D}), view(k.data(), {T, H, D}),
                                                        view(v.data(), {T, H, D})};
    const la::fixed_decay<float, loom::cuda_memory> gate{
        loom::tensor_view<const float, 1, loom::cuda_memory>(lgd.data(), {H})};
    const auto pl = la::cublas::make_plan<loom::bf16>(loom::cuda{}, loom::segments<>{}, {T, H, D, D}, {.chunk = C});
    device_array<std::byte> ws(pl.workspace_bytes());
    const loom::tensor_view<loom::bfloat16, 3, loom::cuda_memory> ov(o.data(), {T, H, D});
    const double ms = median_ms([&] { la::cublas::forward(loom::cuda{}, pl, gate, x, ov, {}, ws.bytes()); }, 2, 7);
    double flop = 0;
    for (index_t b0 = 0; b0 < T; b0 += C) {
      const double c = static_cast<double>(std::min(C, T - b0));
      flop += c * (c + 1) / 2 * 2 * D * 2 + 2 * c * D * D * 2;
    }
    flop *= H;
    const double rate = flop / (ms * 1e-3);
    std::printf("| %ld | %.3f ms | %.1f | %s |\n", static_cast<long>(T), ms, rate * 1e-12,
                peak > 0 ? (std::to_string(rate / peak).substr(0, 5)).c_str() : "(peak not known)");
    parts.push_back(linear_parts(pl, gate, x, ov, ws.bytes(), ms));
  }
  const char* names[] = {"L = Ks^T V (chunk states)", "Pf = Q K^T (scores)", "O = Q S0 (inter-chunk)",
                         "O += Pm V (intra-chunk)"};
  std::printf(
      "\nWhere the time goes (products: events around each, median of 7 calls; phases: each timed alone, "
      "median of 7; passes: a phase less its products)\n\n| part |");
  for (const index_t T : tokens) std::printf(" T = %ld: ms | share | TFLOP/s |", static_cast<long>(T));
  std::printf("\n| --- |");
  for (std::size_t i = 0; i < tokens.size(); ++i) std::printf(" --: | --: | --: |");
  std::printf("\n");
  const auto row = [&](const char* name, auto ms_of, auto flop_of) {
    std::printf("| %s |", name);
    for (const auto& pt : parts) {
      const double t = ms_of(pt), f = flop_of(pt);
      if (f > 0)
        std::printf(" %.3f | %.2f | %.1f |", t, t / pt.call, f / (t * 1e-3) * 1e-12);
      else
        std::printf(" %.3f | %.2f | |", t, t / pt.call);
    }
    std::printf("\n");
  };
  for (std::size_t i = 0; i < 4; ++i)
    row(
        names[i], [i](const linear_split& pt) { return pt.product[i]; },
        [i](const linear_split& pt) { return pt.flop[i]; });
  row(
      "passes of the first phase (gates, gathers, the pass over chunk states)",
      [](const linear_split& pt) { return pt.states - pt.product[0]; }, [](const linear_split&) { return 0.0; });
  row(
      "passes of the second phase (mask, row scale)",
      [](const linear_split& pt) { return pt.outputs - pt.product[1] - pt.product[2] - pt.product[3]; },
      [](const linear_split&) { return 0.0; });
  row(
      "scatter into o", [](const linear_split& pt) { return pt.scatter; }, [](const linear_split&) { return 0.0; });
}

}  // namespace

//! The median over `reps` rounds of the slowest rank's wall time of one call, P ranks over
//! comm::device_local. body(comm, b, timed) sets the rank up (plans, buffers: not timed) and calls
//! timed(work): two warm-up rounds, then `reps` rounds, each started together (a barrier) and
//! ended by the rank's streams drained.
template <class F>
double ranks_median_ms(int p, int reps, F&& body) {
  std::vector<std::vector<double>> t(static_cast<std::size_t>(reps), std::vector<double>(static_cast<std::size_t>(p)));
  loom::comm::run_device_local(p, [&](loom::comm::device_local& comm, loom::cuda b) {
    body(comm, b, [&](auto&& work) {
      for (int i = -2; i < reps; ++i) {
        LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
        comm.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        work();
        LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
        comm.synchronize();
        if (i >= 0)
          t[static_cast<std::size_t>(i)][static_cast<std::size_t>(comm.rank())] =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      }
    });
  });
  std::vector<double> slowest;
  for (const auto& r : t) slowest.push_back(*std::max_element(r.begin(), r.end()));
  std::sort(slowest.begin(), slowest.end());
  return slowest[slowest.size() / 2];
}

//! One rank's q, k, v, o [rows, 8, 64] (zero-filled: the timing does not depend on the values)
//! and lse [rows, 8], in device memory ordered on b.
struct ring_buffers {
  loom::temporary_buffer<loom::cuda, float> q, k, v, o, lse;
  ring_buffers(const loom::cuda& b, index_t rows)
      : q(b, rows * 512), k(b, rows * 512), v(b, rows * 512), o(b, rows * 512), lse(b, rows * 8) {
    for (const auto* x : {&q, &k, &v, &o})
      LOOM_CUDA_TRY(cudaMemsetAsync(x->data(), 0, sizeof(float) * static_cast<std::size_t>(rows * 512), b.stream));
  }
};

void overlap_rows(index_t per_rank) {
  namespace la = loom::attention;
  constexpr index_t heads = 8, dim = 64;
  const index_t block = per_rank * heads * dim;
  std::printf("\n### overlap: ring pass-KV forward over comm::device_local (one GPU), %lld tokens per rank\n\n",
              static_cast<long long>(per_rank));
  std::printf("| P | T_comp ms | T_xfer ms | T_ring ms | hidden |\n|---|---|---|---|---|\n");
  la::options full;
  full.causal = false;
  for (int p : {2, 3, 4}) {
    const std::vector<index_t> docs{0, per_rank * p};
    const auto shard = loom::shard::make_plan(std::span<const index_t>(docs), p, loom::shard::contiguous{});
    using cview = loom::tensor_view<const float, 3, loom::cuda_memory>;
    using view = loom::tensor_view<float, 3, loom::cuda_memory>;
    using lview = loom::tensor_view<float, 2, loom::cuda_memory>;
    const double ring = ranks_median_ms(p, 7, [&](loom::comm::device_local& comm, const loom::cuda& b, auto&& timed) {
      const auto rp = la::ring::make_plan(b, comm, shard, {heads, heads, dim, dim}, full);
      const ring_buffers x(b, per_rank);
      const loom::temporary_buffer<loom::cuda, std::byte> ws(b, static_cast<index_t>(rp.workspace_bytes()));
      timed([&] {
        la::ring::forward(b, comm, rp, cview(x.q.data(), {per_rank, heads, dim}),
                          cview(x.k.data(), {per_rank, heads, dim}), cview(x.v.data(), {per_rank, heads, dim}),
                          view(x.o.data(), {per_rank, heads, dim}), lview(x.lse.data(), {per_rank, heads}), ws.bytes());
      });
    });
    const double comp = ranks_median_ms(p, 7, [&](loom::comm::device_local&, const loom::cuda& b, auto&& timed) {
      const auto lp = la::make_plan<loom::fp32>(b, loom::segments<loom::cuda_memory>{},
                                                la::shape{per_rank, heads, heads, dim, dim}, full);
      const ring_buffers x(b, per_rank);
      const loom::temporary_buffer<loom::cuda, std::byte> ws(b, static_cast<index_t>(lp.workspace_bytes()));
      timed([&] {
        for (int s = 0; s < p; ++s)
          la::forward(b, lp, cview(x.q.data(), {per_rank, heads, dim}), cview(x.k.data(), {per_rank, heads, dim}),
                      cview(x.v.data(), {per_rank, heads, dim}), view(x.o.data(), {per_rank, heads, dim}),
                      lview(x.lse.data(), {per_rank, heads}), ws.bytes());
      });
    });
    const double xfer = ranks_median_ms(p, 7, [&](loom::comm::device_local& comm, const loom::cuda& b, auto&& timed) {
      const loom::temporary_buffer<loom::cuda, float> a(b, 2 * block), c(b, 2 * block);
      const int r = comm.rank();
      const auto n = static_cast<std::size_t>(2 * block);
      timed([&] {
        for (int s = 0; s + 1 < p; ++s) {
          loom::comm::handoff(b, comm);
          comm.sendrecv(std::span<const float>(s % 2 ? c.data() : a.data(), n), (r + 1) % p,
                        std::span<float>(s % 2 ? a.data() : c.data(), n), (r + p - 1) % p, 11);
          loom::comm::handback(b, comm);
        }
      });
    });
    std::printf("| %d | %.3f | %.3f | %.3f | %.3f |\n", p, comp, xfer, ring, 1.0 - (ring - comp) / xfer);
  }
}

#if LOOM_BENCH_CUDNN
//! Ring pass-KV with cuDNN as its local step, P ranks sharing this GPU over comm::device_local,
//! against attention::cudnn on the whole sequence on one rank: bf16, 16 query heads on 4 kv heads,
//! d = 128, causal, one document of `tokens` tokens in zigzag shards. The ranks share one GPU, so
//! the work is the same as the single call's: the ratio T_one / T_ring is what the ring's blocks,
//! merges and transfers cost (1.0: nothing).
void ring_cudnn_rows(index_t tokens) {
  namespace la = loom::attention;
  using bf = loom::bfloat16;
  constexpr index_t hq = 16, hkv = 4, dim = 128;
  la::options causal;
  causal.causal = true;
  const std::vector<index_t> docs{0, tokens};
  using cview = loom::tensor_view<const bf, 3, loom::cuda_memory>;
  using view = loom::tensor_view<bf, 3, loom::cuda_memory>;
  using lview = loom::tensor_view<float, 2, loom::cuda_memory>;
  struct buffers {
    loom::temporary_buffer<loom::cuda, bf> q, k, v, o;
    loom::temporary_buffer<loom::cuda, float> lse;
    buffers(const loom::cuda& b, index_t rows)
        : q(b, rows * hq * dim),
          k(b, rows * hkv * dim),
          v(b, rows * hkv * dim),
          o(b, rows * hq * dim),
          lse(b, rows * hq) {
      for (const auto* x : {&q, &k, &v}) LOOM_CUDA_TRY(cudaMemsetAsync(x->data(), 0, x->bytes().size(), b.stream));
    }
  };
  std::printf(
      "\n### ring pass-KV through cuDNN over comm::device_local (one GPU), bf16, %lld tokens, 16/4 heads, "
      "d = 128, causal, zigzag\n\n| P | T_one ms | T_ring ms | T_one / T_ring |\n|---|---|---|---|\n",
      static_cast<long long>(tokens));
  const double one = ranks_median_ms(1, 7, [&](loom::comm::device_local&, const loom::cuda& b, auto&& timed) {
    const auto lp = la::cudnn::make_plan<loom::bf16>(b, loom::segments{std::span<const index_t>(docs)},
                                                     {tokens, hq, hkv, dim, dim}, causal);
    const buffers x(b, tokens);
    const loom::temporary_buffer<loom::cuda, std::byte> ws(b, static_cast<index_t>(lp.workspace_bytes()));
    timed([&] {
      la::cudnn::forward(b, lp, cview(x.q.data(), {tokens, hq, dim}), cview(x.k.data(), {tokens, hkv, dim}),
                         cview(x.v.data(), {tokens, hkv, dim}), view(x.o.data(), {tokens, hq, dim}),
                         lview(x.lse.data(), {tokens, hq}), ws.bytes());
    });
  });
  for (int p : {1, 2, 4}) {
    const auto shard = loom::shard::make_plan(std::span<const index_t>(docs), p, loom::shard::zigzag{});
    const double ring = ranks_median_ms(p, 7, [&](loom::comm::device_local& comm, const loom::cuda& b, auto&& timed) {
      const auto rp = la::ring::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, shard, {hq, hkv, dim, dim}, causal);
      const index_t n = rp.tokens();
      const buffers x(b, n);
      const loom::temporary_buffer<loom::cuda, std::byte> ws(b, static_cast<index_t>(rp.workspace_bytes()));
      timed([&] {
        la::ring::forward(b, comm, rp, cview(x.q.data(), {n, hq, dim}), cview(x.k.data(), {n, hkv, dim}),
                          cview(x.v.data(), {n, hkv, dim}), view(x.o.data(), {n, hq, dim}),
                          lview(x.lse.data(), {n, hq}), ws.bytes());
      });
    });
    std::printf("| %d | %.3f | %.3f | %.3f |\n", p, one, ring, one / ring);
  }
}
#endif

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool scan_only = argc > 1 && std::strcmp(argv[1], "--scan") == 0;
  const bool overlap_only = argc > 1 && std::strcmp(argv[1], "--overlap") == 0;
  const bool linear_only = argc > 1 && std::strcmp(argv[1], "--linear") == 0;
  cudaDeviceProp prop{};
  LOOM_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("## loom.bench.cuda: %s, %d SMs, driver %d, runtime %d\n", prop.name, prop.multiProcessorCount, driver,
              runtime);
  if (linear_only) {
    linear_rows({8192, 32768});
    return 0;
  }
  if (!overlap_only) {
    scan_rows(quick ? (std::size_t{1} << 20) : (std::size_t{64} << 20));
    recurrence_rows(quick ? 4096 : 262144, 64);
  }
  overlap_rows(quick ? 1024 : 8192);
#if LOOM_BENCH_CUDNN
  ring_cudnn_rows(quick ? 2048 : 16384);
#endif
  if (overlap_only) return 0;
  if (scan_only) return 0;
  cublasHandle_t h;
  check_cublas(cublasCreate(&h), "cublasCreate");
  const std::vector<int> pcts = {50, 70, 80, 90};
  const std::vector<index_t> ns = {1, 8, 16, 32, 64};
  spmm_rows(quick ? 256 : 4096, quick ? 256 : 4096, pcts, ns, h);
  if (!quick) spmm_rows(4096, 11008, pcts, ns, h);
  cublasDestroy(h);
  linear_rows(quick ? std::vector<index_t>{1024} : std::vector<index_t>{8192, 32768});
  return 0;
}
