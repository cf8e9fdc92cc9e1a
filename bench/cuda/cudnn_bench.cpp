// loom::attention::cudnn on the GPU of this machine against cuDNN called directly, in the same run:
// bf16, 16 query heads on 4 kv heads, head dim 128, causal, one document of N = 8192, 16384 and
// 32768 tokens (packed THD layout). The direct call is the cuDNN frontend graph a user would build
// for one sequence: dense THD without ragged offsets or a padding mask, lse in the packed
// [batch, heads, tokens] layout, the same scale, causal band, heuristics (A, then fallback) and
// non-deterministic backward; loom's call adds its plan (ragged tables, padding mask from the
// document lengths, token-major lse). Rows: median time
// (CUDA events, after warm-up), TFLOP/s over the visible (query, key) pairs (forward 4 d flops per
// pair and head, backward 2.5 times that), and loom's time-efficiency against the direct call
// (direct time / loom time; target >= 0.9). With --sdpa FILE (lines "N forward_ms backward_ms" from
// bench/cuda/sdpa_peer.py, PyTorch's scaled_dot_product_attention on the same shapes), a column
// of SDPA time / loom time (target >= 1.0).
//
//   loom.bench.cudnn [--quick] [--sdpa FILE]

#include <loom/attention/cudnn.hpp>
#include <loom/backend/cuda.hpp>

#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include "support.hpp"

namespace {

using loom::index_t;
using loom::bench::device_array;
namespace fe = cudnn_frontend;

void check(const fe::error_t& e, const char* what) {
  if (e.is_bad()) {
    std::fprintf(stderr, "cuDNN %s: %s\n", what, const_cast<fe::error_t&>(e).get_message().c_str());
    std::exit(1);
  }
}

enum : std::int64_t { u_q = 1, u_k, u_v, u_o, u_lse, u_do, u_dq, u_dk, u_dv };

// The direct graph: one sequence of n tokens in the THD layout, causal (top-left), lse out in the
// packed [batch, heads, tokens] layout cuDNN's backward reads on every version.
std::shared_ptr<fe::graph::Graph> direct_graph(cudnnHandle_t h, bool backward, index_t n, index_t hq, index_t hk,
                                               index_t d, float scale) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto thd = [&](std::int64_t id, const char* name, index_t heads) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(id)
                         .set_dim({1, heads, n, d})
                         .set_stride({n * heads * d, d, heads * d, 1}));
  };
  auto q = thd(u_q, "q", hq), k = thd(u_k, "k", hk), v = thd(u_v, "v", hk);
  if (!backward) {
    auto a =
        fe::graph::SDPA_attributes().set_name("direct").set_generate_stats(true).set_causal_mask(true).set_attn_scale(
            scale);
    auto [o, lse] = g->sdpa(q, k, v, a);
    o->set_output(true).set_uid(u_o).set_dim({1, hq, n, d}).set_stride({n * hq * d, d, hq * d, 1});
    lse->set_output(true)
        .set_uid(u_lse)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({1, hq, n, 1})
        .set_stride({hq * n, n, 1, 1});
  } else {
    auto o = thd(u_o, "o", hq), dout = thd(u_do, "dout", hq);
    auto lse = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("lse")
                             .set_uid(u_lse)
                             .set_dim({1, hq, n, 1})
                             .set_stride({hq * n, n, 1, 1})
                             .set_data_type(fe::DataType_t::FLOAT));
    auto a =
        fe::graph::SDPA_backward_attributes().set_name("direct_backward").set_causal_mask(true).set_attn_scale(scale);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, lse, a);
    dq->set_output(true).set_uid(u_dq).set_dim({1, hq, n, d}).set_stride({n * hq * d, d, hq * d, 1});
    dk->set_output(true).set_uid(u_dk).set_dim({1, hk, n, d}).set_stride({n * hk * d, d, hk * d, 1});
    dv->set_output(true).set_uid(u_dv).set_dim({1, hk, n, d}).set_stride({n * hk * d, d, hk * d, 1});
  }
  check(g->validate(), "validate");
  check(g->build_operation_graph(h), "operation graph");
  check(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "execution plans");
  check(g->check_support(h), "support");
  check(g->build_plans(h), "plans");
  return g;
}

// PyTorch SDPA times by N (forward, backward), from --sdpa FILE.
std::map<index_t, std::pair<double, double>> read_sdpa(const char* path) {
  std::map<index_t, std::pair<double, double>> out;
  if (std::FILE* f = std::fopen(path, "r")) {
    long n = 0;
    double fw = 0, bw = 0;
    while (std::fscanf(f, "%ld %lf %lf", &n, &fw, &bw) == 3) out[static_cast<index_t>(n)] = {fw, bw};
    std::fclose(f);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  const char* sdpa_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--sdpa") == 0 && i + 1 < argc) sdpa_path = argv[++i];
  }
  const auto sdpa = sdpa_path ? read_sdpa(sdpa_path) : std::map<index_t, std::pair<double, double>>{};
  cudaDeviceProp prop{};
  LOOM_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  std::printf("\n### Attention through cuDNN (loom.bench.cudnn): %s, cuDNN %zu, bf16, 16/4 heads, d = 128, causal\n\n",
              prop.name, cudnnGetVersion());
  std::printf("| N | pass | loom | cuDNN direct | loom TFLOP/s | direct / loom |%s\n",
              sdpa.empty() ? "" : " SDPA / loom |");
  std::printf("| --: | --- | --: | --: | --: | --: |%s\n", sdpa.empty() ? "" : " --: |");
  const index_t hq = 16, hk = 4, d = 128;
  const loom::cuda b{};
  cudnnHandle_t h;
  if (cudnnCreate(&h) != CUDNN_STATUS_SUCCESS) return 1;
  const std::vector<index_t> sizes = quick ? std::vector<index_t>{1024} : std::vector<index_t>{8192, 16384, 32768};
  for (index_t n : sizes) {
    std::vector<loom::bfloat16> host(static_cast<std::size_t>(n * hq * d));
    std::mt19937 g(7);
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto& x : host) x = loom::bfloat16(u(g));
    const auto rows = static_cast<std::size_t>(n);
    device_array<loom::bfloat16> q(rows * hq * d), k(rows * hk * d), v(rows * hk * d), o(rows * hq * d),
        dout(rows * hq * d), dq(rows * hq * d), dk(rows * hk * d), dv(rows * hk * d);
    device_array<float> lse(rows * hq);
    for (auto* p : {&q, &dout})
      LOOM_CUDA_TRY(cudaMemcpy(p->data(), host.data(), rows * hq * d * 2, cudaMemcpyHostToDevice));
    for (auto* p : {&k, &v})
      LOOM_CUDA_TRY(cudaMemcpy(p->data(), host.data(), rows * hk * d * 2, cudaMemcpyHostToDevice));
    std::vector<std::int64_t> cu = {0, n};
    const device_array<std::int64_t> offsets(cu);
    const loom::segments<loom::cuda_memory> docs(
        loom::tensor_view<const std::int64_t, 1, loom::cuda_memory>(offsets.data(), {2}));
    const auto plan = loom::attention::cudnn::make_plan<loom::bf16>(b, docs, {n, hq, hk, d, d});
    device_array<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    using cv3 = loom::tensor_view<const loom::bfloat16, 3, loom::cuda_memory>;
    using v3 = loom::tensor_view<loom::bfloat16, 3, loom::cuda_memory>;
    const cv3 qv(q.data(), {n, hq, d}), kv(k.data(), {n, hk, d}), vv(v.data(), {n, hk, d}), ov(o.data(), {n, hq, d}),
        dov(dout.data(), {n, hq, d});
    const loom::tensor_view<float, 2, loom::cuda_memory> lv(lse.data(), {n, hq});
    const double loom_fwd = loom::bench::median_ms([&] {
      loom::attention::cudnn::forward(b, plan, qv, kv, vv, v3(o.data(), {n, hq, d}), lv, ws.bytes());
    });
    const double loom_bwd = loom::bench::median_ms([&] {
      loom::attention::cudnn::backward(b, plan, qv, kv, vv, ov, lv, dov, v3(dq.data(), {n, hq, d}),
                                       v3(dk.data(), {n, hk, d}), v3(dv.data(), {n, hk, d}), ws.bytes());
    });
    const auto gf = direct_graph(h, false, n, hq, hk, d, plan.scale());
    const auto gb = direct_graph(h, true, n, hq, hk, d, plan.scale());
    device_array<std::byte> dws(static_cast<std::size_t>(std::max(gf->get_workspace_size(), gb->get_workspace_size())) +
                                1);
    std::unordered_map<std::int64_t, void*> pf = {
        {u_q, q.data()}, {u_k, k.data()}, {u_v, v.data()}, {u_o, o.data()}, {u_lse, lse.data()}};
    std::unordered_map<std::int64_t, void*> pb = {{u_q, q.data()},   {u_k, k.data()},     {u_v, v.data()},
                                                  {u_o, o.data()},   {u_lse, lse.data()}, {u_do, dout.data()},
                                                  {u_dq, dq.data()}, {u_dk, dk.data()},   {u_dv, dv.data()}};
    const double direct_fwd = loom::bench::median_ms([&] { check(gf->execute(h, pf, dws.data()), "execute"); });
    const double direct_bwd = loom::bench::median_ms([&] { check(gb->execute(h, pb, dws.data()), "execute"); });
    const double pairs = static_cast<double>(n) * static_cast<double>(n + 1) / 2.0;
    const double fwd_flops = 4.0 * static_cast<double>(d) * pairs * static_cast<double>(hq);
    const struct {
      const char* pass;
      double loom, direct, flops, peer;
    } out[] = {{"forward", loom_fwd, direct_fwd, fwd_flops, sdpa.count(n) ? sdpa.at(n).first : 0.0},
               {"backward", loom_bwd, direct_bwd, 2.5 * fwd_flops, sdpa.count(n) ? sdpa.at(n).second : 0.0}};
    for (const auto& r : out) {
      std::printf("| %ld | %s | %.3f ms | %.3f ms | %.1f | %.3f |", static_cast<long>(n), r.pass, r.loom, r.direct,
                  r.flops / (r.loom * 1e-3) * 1e-12, r.direct / r.loom);
      if (!sdpa.empty()) {
        if (r.peer > 0)
          std::printf(" %.3f |", r.peer / r.loom);
        else
          std::printf(" – |");
      }
      std::printf("\n");
    }
  }
  cudnnDestroy(h);
  return 0;
}
