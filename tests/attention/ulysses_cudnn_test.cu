// Ulysses attention with cuDNN's fused attention as its local step (ulysses_cudnn.cuh).
// [host]: which head splits give every rank one dense GQA block (the condition of the cuDNN local
// step), against an independent count of the kv groups a rank's heads touch. [gpu]: forward and
// backward over comm::device_local (P ranks sharing one GPU, zigzag shards of packed documents)
// against one device's attention::cudnn over the same documents.

#include <loom/attention/ulysses_cudnn.cuh>
#include <loom/comm/device_local.hpp>
#include <loom/shard/plan.hpp>

#include <support/convert.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <comm/device_memory.hpp>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace la = loom::attention;
namespace lt = loom::test;
using loom::index_t;

namespace {

// The oracle of the condition: rank j's query heads [q0, q1) either lie inside one kv group or
// cover whole groups only.
bool one_block(index_t hq, index_t hkv, int p, int j) {
  const index_t g = hq / hkv, q0 = j * hq / p, q1 = (j + 1) * hq / p;
  if (q1 - q0 == 0) return true;
  const index_t first = q0 / g, last = (q1 - 1) / g;
  if (first == last) return true;
  return q0 % g == 0 && q1 % g == 0;
}

}  // namespace

TEST_CASE("ulysses with cuDNN: the head splits whose shards are one dense GQA block", "[attention][cudnn][host]") {
  for (index_t hkv : {1, 2, 3, 4, 8})
    for (index_t g : {1, 2, 3, 4, 6})
      for (int p = 1; p <= 9; ++p) {
        const index_t hq = hkv * g;
        if (p > hq) continue;
        const la::detail::head_split h{hq, hkv, p};
        for (int j = 0; j < p; ++j) {
          const std::string why = la::ulysses::detail::fused_heads_problem(h, j);
          INFO("heads " << hq << " / " << hkv << ", P = " << p << ", rank " << j << ": " << why);
          CHECK(why.empty() == one_block(hq, hkv, p, j));
          if (!why.empty()) CHECK(why.find("rank " + std::to_string(j) + " computes query heads") != std::string::npos);
        }
      }
}

namespace {

int gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

template <class T, std::size_t R>
using dview = loom::tensor_view<T, R, loom::cuda_memory>;

std::vector<loom::bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<loom::bfloat16> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = loom::bfloat16(x[i]);
  return y;
}

// Rank r's rows (its local order) of a [T, width] global array.
template <class T>
std::vector<T> rows_of(const loom::shard::plan& sp, int r, const std::vector<T>& global, index_t width) {
  std::vector<T> local(static_cast<std::size_t>(sp.rank(r).tokens * width));
  sp.scatter<T>(r, global, width, local);
  return local;
}

}  // namespace

TEST_CASE("ulysses with cuDNN: forward and backward equal one device's cuDNN attention, P = 1, 2, 4; P = 3 is refused",
          "[attention][cudnn][gpu]") {
  if (gpus() < 1) {
    WARN("no GPU: not run");
    return;
  }
  using bf = loom::bfloat16;
  const std::vector<index_t> docs{0, 37, 38, 201, 202, 331};  // one-token documents included
  const index_t t = docs.back(), hq = 8, hkv = 2, d = 64;
  const la::head_shape hs{hq, hkv, d, d};
  la::options opt;
  opt.causal = true;
  const auto q = to_bf16(lt::uniform<float>(t * hq * d, -1, 1, 1)),
             k = to_bf16(lt::uniform<float>(t * hkv * d, -1, 1, 2)),
             v = to_bf16(lt::uniform<float>(t * hkv * d, -1, 1, 3)),
             g = to_bf16(lt::uniform<float>(t * hq * d, -1, 1, 4));
  // One device: attention::cudnn over the same documents.
  std::vector<bf> out1, dq1, dk1, dv1;
  std::vector<float> lse1;
  {
    const loom::cuda b{};
    lt::device_array<bf> qd(q), kd(k), vd(v), gd(g), od(q.size()), dqd(q.size()), dkd(k.size()), dvd(v.size());
    lt::device_array<float> ld(static_cast<std::size_t>(t * hq));
    const auto p =
        la::cudnn::make_plan<loom::bf16>(b, loom::segments{std::span<const index_t>(docs)}, {t, hq, hkv, d, d}, opt);
    lt::device_array<std::byte> ws(std::max(p.workspace_bytes(), p.backward_workspace_bytes()) + 64);
    const std::span<std::byte> wsp(ws.data(), ws.size());
    la::cudnn::forward(b, p, dview<const bf, 3>(qd.data(), {t, hq, d}), dview<const bf, 3>(kd.data(), {t, hkv, d}),
                       dview<const bf, 3>(vd.data(), {t, hkv, d}), dview<bf, 3>(od.data(), {t, hq, d}),
                       dview<float, 2>(ld.data(), {t, hq}), wsp);
    la::cudnn::backward(b, p, dview<const bf, 3>(qd.data(), {t, hq, d}), dview<const bf, 3>(kd.data(), {t, hkv, d}),
                        dview<const bf, 3>(vd.data(), {t, hkv, d}), dview<const bf, 3>(od.data(), {t, hq, d}),
                        dview<const float, 2>(ld.data(), {t, hq}), dview<const bf, 3>(gd.data(), {t, hq, d}),
                        dview<bf, 3>(dqd.data(), {t, hq, d}), dview<bf, 3>(dkd.data(), {t, hkv, d}),
                        dview<bf, 3>(dvd.data(), {t, hkv, d}), wsp);
    LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
    out1 = od.to_host(), lse1 = ld.to_host(), dq1 = dqd.to_host(), dk1 = dkd.to_host(), dv1 = dvd.to_host();
  }
  // P = 3 splits the 8 query heads 2, 3, 3: rank 1's heads straddle two kv groups, which the cuDNN
  // local step does not take; every rank gets the same error.
  {
    const auto sp = loom::shard::make_plan(std::span<const index_t>(docs), 3, loom::shard::zigzag{});
    std::vector<std::string> what(3);
    loom::comm::run_device_local(3, [&](loom::comm::device_local& comm, loom::cuda b) {
      try {
        (void)la::ulysses::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, sp, hs, opt);
      } catch (const loom::error& e) {
        what[static_cast<std::size_t>(comm.rank())] =
            std::string(e.what()) + (e.code() == loom::errc::unsupported ? "" : " (not unsupported)");
      }
    });
    for (const auto& w : what) {
      INFO(w);
      CHECK(w.find("rank 1 computes query heads [2, 5) of 8 over 2 kv heads") != std::string::npos);
      CHECK(w.find("(not unsupported)") == std::string::npos);
    }
  }
  for (int p : {1, 2, 4}) {
    const auto sp = loom::shard::make_plan(std::span<const index_t>(docs), p, loom::shard::zigzag{});
    std::vector<bf> out(out1.size()), dq(dq1.size()), dk(dk1.size()), dv(dv1.size());
    std::vector<float> lse(lse1.size());
    std::mutex mu;
    loom::comm::run_device_local(p, [&](loom::comm::device_local& comm, loom::cuda b) {
      const int r = comm.rank();
      const index_t n = sp.rank(r).tokens;
      lt::device_array<bf> qd(rows_of(sp, r, q, hq * d)), kd(rows_of(sp, r, k, hkv * d)),
          vd(rows_of(sp, r, v, hkv * d)), gd(rows_of(sp, r, g, hq * d)), od(static_cast<std::size_t>(n * hq * d)),
          dqd(static_cast<std::size_t>(n * hq * d)), dkd(static_cast<std::size_t>(n * hkv * d)),
          dvd(static_cast<std::size_t>(n * hkv * d));
      lt::device_array<float> ld(static_cast<std::size_t>(n * hq));
      const auto up = la::ulysses::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, sp, hs, opt);
      lt::device_array<std::byte> ws(up.workspace_bytes() + 64);
      const std::span<std::byte> wsp(ws.data(), up.workspace_bytes());
      la::ulysses::forward(b, comm, up, dview<const bf, 3>(qd.data(), {n, hq, d}),
                           dview<const bf, 3>(kd.data(), {n, hkv, d}), dview<const bf, 3>(vd.data(), {n, hkv, d}),
                           dview<bf, 3>(od.data(), {n, hq, d}), dview<float, 2>(ld.data(), {n, hq}), wsp);
      la::ulysses::backward(b, comm, up, dview<const bf, 3>(qd.data(), {n, hq, d}),
                            dview<const bf, 3>(kd.data(), {n, hkv, d}), dview<const bf, 3>(vd.data(), {n, hkv, d}),
                            dview<const bf, 3>(od.data(), {n, hq, d}), dview<const float, 2>(ld.data(), {n, hq}),
                            dview<const bf, 3>(gd.data(), {n, hq, d}), dview<bf, 3>(dqd.data(), {n, hq, d}),
                            dview<bf, 3>(dkd.data(), {n, hkv, d}), dview<bf, 3>(dvd.data(), {n, hkv, d}), wsp);
      LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
      comm.synchronize();
      const std::lock_guard lock(mu);
      sp.gather<bf>(r, od.to_host(), hq * d, out);
      sp.gather<float>(r, ld.to_host(), hq, lse);
      sp.gather<bf>(r, dqd.to_host(), hq * d, dq);
      sp.gather<bf>(r, dkd.to_host(), hkv * d, dk);
      sp.gather<bf>(r, dvd.to_host(), hkv * d, dv);
    });
    // The same cuDNN kernels on fewer heads per call: bf16 storage tolerances (the partial dK/dV of
    // kv heads that several ranks hold are summed once more, in float, then rounded).
    INFO("P = " << p);
    constexpr lt::tolerance tol = lt::tolerance_for<loom::bf16>();
    lt::require_close(lt::widen(out), lt::widen(out1), tol, "out");
    lt::require_close(lt::widen(lse), lt::widen(lse1), lt::tolerance_for<loom::fp32>(), "lse");
    lt::require_close(lt::widen(dq), lt::widen(dq1), tol, "dq");
    lt::require_close(lt::widen(dk), lt::widen(dk1), tol, "dk");
    lt::require_close(lt::widen(dv), lt::widen(dv1), tol, "dv");
  }
}
