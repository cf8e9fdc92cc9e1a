// Ulysses, ring (every variant) and hybrid attention with cuDNN's fused attention as their local
// step (ulysses_cudnn.cuh, ring_cudnn.cuh). [host]: which head splits give every rank one dense GQA
// block (the condition of Ulysses' cuDNN local step), against an independent count of the kv
// groups a rank's heads touch. [gpu]: forward and backward over comm::device_local (P ranks
// sharing one GPU, zigzag and per-document shards of packed documents) against one device's
// attention::cudnn over the same documents. (The ring runner itself is tested on the CPU with a
// reference engine: ring_test.hpp.)

#include <loom/attention/ring_cudnn.cuh>
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

// Which rows each rank holds: a shard plan's ranks (Ulysses, ring), or the hybrid grid's (ring
// shard g = r / U of `sp`, split contiguously over its U ranks).
struct row_layout {
  loom::shard::plan sp;
  int ulysses = 1;
  [[nodiscard]] index_t begin(int r) const {
    const index_t n = sp.rank(r / ulysses).tokens;
    return n * (r % ulysses) / ulysses;
  }
  [[nodiscard]] index_t tokens(int r) const {
    const index_t n = sp.rank(r / ulysses).tokens;
    return n * (r % ulysses + 1) / ulysses - begin(r);
  }
  [[nodiscard]] index_t global_row(int r, index_t i) const { return sp.to_global(r / ulysses, begin(r) + i); }
  template <class T>
  [[nodiscard]] std::vector<T> scatter(int r, const std::vector<T>& global, index_t width) const {
    std::vector<T> local(static_cast<std::size_t>(tokens(r) * width));
    for (index_t i = 0; i < tokens(r); ++i)
      std::copy_n(global.begin() + global_row(r, i) * width, width, local.begin() + i * width);
    return local;
  }
  template <class T>
  void gather(int r, const std::vector<T>& local, index_t width, std::vector<T>& global) const {
    for (index_t i = 0; i < tokens(r); ++i)
      std::copy_n(local.begin() + i * width, width, global.begin() + global_row(r, i) * width);
  }
};

// Packed documents (one-token documents included), causal or windowed, and one device's
// attention::cudnn results over them.
struct problem {
  using bf = loom::bfloat16;
  std::vector<index_t> docs{0, 37, 38, 201, 202, 331};
  index_t t = 331, hq = 8, hkv = 2, d = 64;
  la::options opt{};
  std::vector<bf> q, k, v, g, out, dq, dk, dv;
  std::vector<float> lse;
  [[nodiscard]] la::head_shape heads() const { return {hq, hkv, d, d}; }

  explicit problem(la::options o) : opt(o) {
    q = to_bf16(lt::uniform<float>(t * hq * d, -1, 1, 1));
    k = to_bf16(lt::uniform<float>(t * hkv * d, -1, 1, 2));
    v = to_bf16(lt::uniform<float>(t * hkv * d, -1, 1, 3));
    g = to_bf16(lt::uniform<float>(t * hq * d, -1, 1, 4));
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
    out = od.to_host(), lse = ld.to_host(), dq = dqd.to_host(), dk = dkd.to_host(), dv = dvd.to_host();
  }

  // Forward and backward on P ranks of comm::device_local through the plans `make(b, comm)`
  // returns, gathered, against the one-device results: bf16 storage tolerances (the ranks sum
  // partial results once more, in float, then round).
  template <class Make>
  void check_distributed(int p, const row_layout& sp, Make&& make) const {
    std::vector<bf> o2(out.size()), dq2(dq.size()), dk2(dk.size()), dv2(dv.size());
    std::vector<float> l2(lse.size());
    std::mutex mu;
    loom::comm::run_device_local(p, [&](loom::comm::device_local& comm, loom::cuda b) {
      const int r = comm.rank();
      const index_t n = sp.tokens(r);
      lt::device_array<bf> qd(sp.scatter(r, q, hq * d)), kd(sp.scatter(r, k, hkv * d)), vd(sp.scatter(r, v, hkv * d)),
          gd(sp.scatter(r, g, hq * d)), od(static_cast<std::size_t>(n * hq * d)),
          dqd(static_cast<std::size_t>(n * hq * d)), dkd(static_cast<std::size_t>(n * hkv * d)),
          dvd(static_cast<std::size_t>(n * hkv * d));
      lt::device_array<float> ld(static_cast<std::size_t>(n * hq));
      const auto plan = make(b, comm);
      std::size_t bytes = plan.workspace_bytes();
      if constexpr (requires { plan.backward_workspace_bytes(); })
        bytes = std::max(bytes, plan.backward_workspace_bytes());
      lt::device_array<std::byte> ws(bytes + 64);
      const std::span<std::byte> wsp(ws.data(), bytes);
      forward(b, comm, plan, dview<const bf, 3>(qd.data(), {n, hq, d}), dview<const bf, 3>(kd.data(), {n, hkv, d}),
              dview<const bf, 3>(vd.data(), {n, hkv, d}), dview<bf, 3>(od.data(), {n, hq, d}),
              dview<float, 2>(ld.data(), {n, hq}), wsp);
      backward(b, comm, plan, dview<const bf, 3>(qd.data(), {n, hq, d}), dview<const bf, 3>(kd.data(), {n, hkv, d}),
               dview<const bf, 3>(vd.data(), {n, hkv, d}), dview<const bf, 3>(od.data(), {n, hq, d}),
               dview<const float, 2>(ld.data(), {n, hq}), dview<const bf, 3>(gd.data(), {n, hq, d}),
               dview<bf, 3>(dqd.data(), {n, hq, d}), dview<bf, 3>(dkd.data(), {n, hkv, d}),
               dview<bf, 3>(dvd.data(), {n, hkv, d}), wsp);
      LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
      comm.synchronize();
      const std::lock_guard lock(mu);
      sp.gather(r, od.to_host(), hq * d, o2);
      sp.gather(r, ld.to_host(), hq, l2);
      sp.gather(r, dqd.to_host(), hq * d, dq2);
      sp.gather(r, dkd.to_host(), hkv * d, dk2);
      sp.gather(r, dvd.to_host(), hkv * d, dv2);
    });
    constexpr lt::tolerance tol = lt::tolerance_for<loom::bf16>();
    lt::require_close(lt::widen(o2), lt::widen(out), tol, "out");
    lt::require_close(lt::widen(l2), lt::widen(lse), lt::tolerance_for<loom::fp32>(), "lse");
    lt::require_close(lt::widen(dq2), lt::widen(dq), tol, "dq");
    lt::require_close(lt::widen(dk2), lt::widen(dk), tol, "dk");
    lt::require_close(lt::widen(dv2), lt::widen(dv), tol, "dv");
  }
};

la::options causal() {
  la::options o;
  o.causal = true;
  return o;
}

}  // namespace

TEST_CASE(
    "ulysses with cuDNN: forward and backward equal one device's cuDNN attention, P = 1, 2, 4, and P = 3 is refused",
    "[attention][cudnn][gpu]") {
  if (gpus() < 1) {
    WARN("no GPU: not run");
    return;
  }
  const problem pb(causal());
  // P = 3 splits the 8 query heads 2, 3, 3: rank 1's heads straddle two kv groups, which the cuDNN
  // local step does not take; every rank gets the same error.
  {
    const auto sp = loom::shard::make_plan(std::span<const index_t>(pb.docs), 3, loom::shard::zigzag{});
    std::vector<std::string> what(3);
    loom::comm::run_device_local(3, [&](loom::comm::device_local& comm, loom::cuda b) {
      try {
        (void)la::ulysses::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, sp, pb.heads(), pb.opt);
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
    INFO("P = " << p);
    const auto sp = loom::shard::make_plan(std::span<const index_t>(pb.docs), p, loom::shard::zigzag{});
    pb.check_distributed(p, {sp}, [&](const loom::cuda& b, loom::comm::device_local& comm) {
      return la::ulysses::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, sp, pb.heads(), pb.opt);
    });
  }
}

TEST_CASE(
    "ring with cuDNN, every variant: forward and backward equal one device's cuDNN attention, P = 1..4, causal and "
    "windowed",
    "[attention][cudnn][gpu]") {
  if (gpus() < 1) {
    WARN("no GPU: not run");
    return;
  }
  la::options window;
  window.causal = true;
  window.window = {29, 0};
  for (const auto& opt : {causal(), window}) {
    const problem pb(opt);
    for (int p : {1, 2, 3, 4})
      for (int strategy : {0, 1}) {
        INFO("P = " << p << ", window left " << opt.window.left << ", strategy " << strategy);
        const auto sp = strategy == 0
                            ? loom::shard::make_plan(std::span<const index_t>(pb.docs), p, loom::shard::zigzag{})
                            : loom::shard::make_plan(std::span<const index_t>(pb.docs), p, loom::shard::per_document{});
        pb.check_distributed(p, {sp}, [&](const loom::cuda& b, loom::comm::device_local& comm) {
          return la::ring::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, sp, pb.heads(), pb.opt);
        });
        pb.check_distributed(p, {sp}, [&](const loom::cuda& b, loom::comm::device_local& comm) {
          return la::ring::make_plan<loom::bf16>(b, comm, la::ring::all_gather_kv{}, la::cudnn::fused{}, sp, pb.heads(),
                                                 pb.opt);
        });
        pb.check_distributed(p, {sp}, [&](const loom::cuda& b, loom::comm::device_local& comm) {
          return la::ring::make_plan<loom::bf16>(b, comm, la::ring::pass_q{}, la::cudnn::fused{}, sp, pb.heads(),
                                                 pb.opt);
        });
        pb.check_distributed(p, {sp}, [&](const loom::cuda& b, loom::comm::device_local& comm) {
          return la::ring::make_plan<loom::bf16>(b, comm, la::ring::bidirectional_kv{}, la::cudnn::fused{}, sp,
                                                 pb.heads(), pb.opt);
        });
      }
  }
}

TEST_CASE(
    "hybrid with cuDNN's ring inside: forward and backward equal one device's cuDNN attention, U x R in "
    "{1x2, 2x1, 2x2}, and U = 3 is refused",
    "[attention][cudnn][gpu]") {
  if (gpus() < 1) {
    WARN("no GPU: not run");
    return;
  }
  const problem pb(causal());
  for (const auto& [u, r] : {std::pair{1, 2}, std::pair{2, 1}, std::pair{2, 2}}) {
    INFO("U x R = " << u << " x " << r);
    const auto ring = loom::shard::make_plan(std::span<const index_t>(pb.docs), r, loom::shard::zigzag{});
    pb.check_distributed(u * r, {ring, u}, [&](const loom::cuda& b, loom::comm::device_local& comm) {
      return la::hybrid::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, ring, pb.heads(), pb.opt);
    });
  }
  // U = 3 over 8 query heads on 2 kv heads: rank 1's heads straddle two kv groups.
  const auto ring = loom::shard::make_plan(std::span<const index_t>(pb.docs), 1, loom::shard::zigzag{});
  std::vector<std::string> what(3);
  loom::comm::run_device_local(3, [&](loom::comm::device_local& comm, loom::cuda b) {
    try {
      (void)la::hybrid::make_plan<loom::bf16>(b, comm, la::cudnn::fused{}, ring, pb.heads(), pb.opt);
    } catch (const loom::error& e) {
      what[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& w : what) {
    INFO(w);
    CHECK(w.find("dense head shards: Ulysses rank 1 computes query heads [2, 5)") != std::string::npos);
  }
}

TEST_CASE(
    "sequence_parallel with cuDNN: every strategy the planner can pick, forced, equals one device's cuDNN attention, "
    "P = 4",
    "[attention][cudnn][gpu]") {
  if (gpus() < 1) {
    WARN("no GPU: not run");
    return;
  }
  namespace lsp = loom::sequence_parallel;
  using strategy = la::planner::strategy;
  const problem pb(causal());
  const int p = 4;
  for (const auto& [only, u] :
       {std::pair{strategy::ring_pass_kv, 1}, std::pair{strategy::ring_pass_q, 1},
        std::pair{strategy::all_gather_kv, 1}, std::pair{strategy::ulysses, 1}, std::pair{strategy::hybrid, 2}}) {
    INFO(la::planner::to_string(only));
    lsp::options o;
    o.attention = pb.opt;
    o.layout = lsp::sharding::zigzag;
    o.only = only;
    o.ulysses = only == strategy::hybrid ? u : 0;
    // The rows every rank holds: zigzag over the P ranks, or over the R = P / U ring ranks (hybrid).
    const auto sp = loom::shard::make_plan(std::span<const index_t>(pb.docs), p / u, loom::shard::zigzag{});
    std::vector<int> picked(p, -1);
    pb.check_distributed(p, {sp, u}, [&](const loom::cuda& b, loom::comm::device_local& comm) {
      auto plan = lsp::make_plan<loom::bf16>(b, comm, la::cudnn::fused{},
                                             loom::segments{std::span<const index_t>(pb.docs)}, pb.heads(), o);
      picked[static_cast<std::size_t>(comm.rank())] = static_cast<int>(plan.kind());
      return plan;
    });
    for (int k : picked) CHECK(k == static_cast<int>(only));
  }
}
