// The device communicators on GPUs: comm::device_local (P ranks sharing one GPU) and comm::nccl
// (one GPU per rank, ranks as threads of this process). For each: the stream-ordered conformance
// suite, and the distributed primitives on device memory (ring pass-KV, all-gather-KV and the
// bidirectional ring forward and backward, pass-Q forward, Ulysses forward and backward, the
// hybrid, a cross-rank scan, the sequence-parallel Newton solver, LASP-2) against the same
// computation on one device. Needs a GPU (comm::nccl: two); CI
// compiles this unit only.

#include <loom/attention/bidirectional.hpp>
#include <loom/attention/hybrid.hpp>
#include <loom/attention/ring.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/cuda.hpp>
#include <loom/comm/device_local.hpp>
#include <loom/comm/nccl.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/lasp2.hpp>
#include <loom/rnn/distributed.hpp>
#include <loom/scan/distributed.hpp>

#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <comm/device_memory.hpp>
#include <cstddef>
#include <mutex>
#include <span>
#include <string>
#include <vector>

using loom::index_t;
namespace la = loom::attention;
namespace lt = loom::test;
namespace shard = loom::shard;

namespace {

int gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// fn(comm, b) on p ranks over comm::nccl, rank r on device r (threads of this process).
template <class F>
void run_nccl(int p, F&& fn) {
  ncclUniqueId id;
  loom::comm::detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  loom::comm::run_local(p, [&](loom::comm::local& lc) {
    LOOM_CUDA_TRY(cudaSetDevice(lc.rank()));
    cudaStream_t compute = nullptr, transfer = nullptr;
    LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    LOOM_CUDA_TRY(cudaStreamCreateWithFlags(&transfer, cudaStreamNonBlocking));
    {
      auto comm = loom::comm::nccl::init_rank(p, id, lc.rank(), transfer);
      fn(comm, loom::cuda{compute});
      comm.synchronize();
      LOOM_CUDA_TRY(cudaStreamSynchronize(compute));
    }
    cudaStreamDestroy(compute);
    cudaStreamDestroy(transfer);
  });
}

template <class Run>
void conformance(Run run, int p) {
  std::vector<lt::rank_report> reports(static_cast<std::size_t>(p));
  run(p, [&](auto& comm, loom::cuda) {
    lt::stream_conformance_suite(comm, reports[static_cast<std::size_t>(comm.rank())]);
  });
  for (int q = 0; q < p; ++q) {
    const auto& r = reports[static_cast<std::size_t>(q)];
    INFO("P = " << p << ", rank " << q << (r.failures.empty() ? std::string() : ": " + r.failures[0]));
    CHECK(r.checks > 0);
    CHECK(r.failures.empty());
  }
}

template <class T, std::size_t R>
using dview = loom::tensor_view<T, R, loom::cuda_memory>;

// A workspace in device memory (cudaMalloc aligns to 256 bytes).
struct device_workspace {
  lt::device_array<std::byte> a;
  explicit device_workspace(std::size_t bytes) : a(bytes) {}
  std::span<std::byte> span() const { return {a.data(), a.size()}; }
};

const std::vector<index_t> docs{0, 1, 8, 138, 141, 301};  // T = 301
constexpr index_t hq = 4, hkv = 2, dim = 16;

struct attention_case {
  std::vector<float> q, k, v, dout;
  std::vector<float> out, lse, dq, dk, dv;  // one device's results
};

// The reference: forward and backward of the whole sequence on one device.
attention_case reference(const la::options& opt) {
  const index_t t = docs.back();
  attention_case c;
  c.q = lt::uniform<float>(t * hq * dim, -1, 1, 1);
  c.k = lt::uniform<float>(t * hkv * dim, -1, 1, 2);
  c.v = lt::uniform<float>(t * hkv * dim, -1, 1, 3);
  c.dout = lt::uniform<float>(t * hq * dim, -1, 1, 4);
  const loom::cuda b{};
  lt::device_array<float> q(c.q), k(c.k), v(c.v), dout(c.dout), out(static_cast<std::size_t>(t * hq * dim)),
      lse(static_cast<std::size_t>(t * hq)), dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
  lt::device_array<index_t> offsets(docs);
  const loom::segments<loom::cuda_memory> seg(
      dview<const index_t, 1>(offsets.data(), {static_cast<index_t>(docs.size())}));
  const auto plan = la::make_plan<loom::fp32>(b, seg, la::shape{t, hq, hkv, dim, dim}, opt);
  device_workspace ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  la::forward(b, plan, dview<const float, 3>(q.data(), {t, hq, dim}), dview<const float, 3>(k.data(), {t, hkv, dim}),
              dview<const float, 3>(v.data(), {t, hkv, dim}), dview<float, 3>(out.data(), {t, hq, dim}),
              dview<float, 2>(lse.data(), {t, hq}), ws.span());
  la::backward(b, plan, dview<const float, 3>(q.data(), {t, hq, dim}), dview<const float, 3>(k.data(), {t, hkv, dim}),
               dview<const float, 3>(v.data(), {t, hkv, dim}), dview<const float, 3>(out.data(), {t, hq, dim}),
               dview<const float, 2>(lse.data(), {t, hq}), dview<const float, 3>(dout.data(), {t, hq, dim}),
               dview<float, 3>(dq.data(), {t, hq, dim}), dview<float, 3>(dk.data(), {t, hkv, dim}),
               dview<float, 3>(dv.data(), {t, hkv, dim}), ws.span());
  c.out = out.to_host();
  c.lse = lse.to_host();
  c.dq = dq.to_host();
  c.dk = dk.to_host();
  c.dv = dv.to_host();
  return c;
}

// Which rows of the sequence each rank holds: a shard plan's.
struct shard_rows {
  const shard::plan& sp;
  index_t tokens(int r) const { return sp.rank(r).tokens; }
  void scatter(int r, const std::vector<float>& g, index_t row, std::vector<float>& l) const {
    sp.scatter<float>(r, g, row, l);
  }
  void gather(int r, const std::vector<float>& l, index_t row, std::vector<float>& g) const {
    sp.gather<float>(r, l, row, g);
  }
};
// The hybrid's on U x 1 ranks: rank u holds rows [T u / U, T (u + 1) / U) in sequence order.
struct split_rows {
  index_t t;
  int p;
  index_t begin(int r) const { return t * r / p; }
  index_t tokens(int r) const { return begin(r + 1) - begin(r); }
  void scatter(int r, const std::vector<float>& g, index_t row, std::vector<float>& l) const {
    std::copy(g.begin() + begin(r) * row, g.begin() + begin(r + 1) * row, l.begin());
  }
  void gather(int r, const std::vector<float>& l, index_t row, std::vector<float>& g) const {
    std::copy(l.begin(), l.end(), g.begin() + begin(r) * row);
  }
};

// One rank's rows of a global array.
template <class Rows>
std::vector<float> rows_of(const Rows& rows, int r, const std::vector<float>& global, index_t row) {
  std::vector<float> local(static_cast<std::size_t>(rows.tokens(r) * row));
  rows.scatter(r, global, row, local);
  return local;
}

// A distributed attention method on p ranks: make(b, comm) makes the rank's plan; forward and
// (when bwd) backward run on it; the results are gathered and compared with one device's.
template <class Run, class Rows, class Make, class Fwd, class Bwd>
void check_attention(Run run, int p, const Rows& rows, const attention_case& want, bool bwd, Make make, Fwd fwd,
                     Bwd bwd_fn, const char* what) {
  const index_t t = docs.back();
  std::vector<float> out(want.out.size()), lse(want.lse.size()), dq(want.dq.size()), dk(want.dk.size()),
      dv(want.dv.size());
  std::mutex mu;
  run(p, [&](auto& comm, loom::cuda b) {
    const int r = comm.rank();
    const index_t n = rows.tokens(r);
    lt::device_array<float> q(rows_of(rows, r, want.q, hq * dim)), k(rows_of(rows, r, want.k, hkv * dim)),
        v(rows_of(rows, r, want.v, hkv * dim)), dout(rows_of(rows, r, want.dout, hq * dim)),
        o(static_cast<std::size_t>(n * hq * dim)), l(static_cast<std::size_t>(n * hq)),
        gq(static_cast<std::size_t>(n * hq * dim)), gk(static_cast<std::size_t>(n * hkv * dim)),
        gv(static_cast<std::size_t>(n * hkv * dim));
    const auto plan = make(b, comm);
    // One workspace for both passes: the backward's may be the larger (ring::backward's is).
    std::size_t bytes = plan.workspace_bytes();
    if constexpr (requires { plan.backward_workspace_bytes(); })
      if (bwd) bytes = std::max(bytes, plan.backward_workspace_bytes());
    device_workspace ws(bytes);
    fwd(b, comm, plan, dview<const float, 3>(q.data(), {n, hq, dim}), dview<const float, 3>(k.data(), {n, hkv, dim}),
        dview<const float, 3>(v.data(), {n, hkv, dim}), dview<float, 3>(o.data(), {n, hq, dim}),
        dview<float, 2>(l.data(), {n, hq}), ws.span());
    if (bwd)
      bwd_fn(b, comm, plan, dview<const float, 3>(q.data(), {n, hq, dim}),
             dview<const float, 3>(k.data(), {n, hkv, dim}), dview<const float, 3>(v.data(), {n, hkv, dim}),
             dview<const float, 3>(o.data(), {n, hq, dim}), dview<const float, 2>(l.data(), {n, hq}),
             dview<const float, 3>(dout.data(), {n, hq, dim}), dview<float, 3>(gq.data(), {n, hq, dim}),
             dview<float, 3>(gk.data(), {n, hkv, dim}), dview<float, 3>(gv.data(), {n, hkv, dim}), ws.span());
    LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
    comm.synchronize();
    const std::lock_guard<std::mutex> lock(mu);
    rows.gather(r, o.to_host(), hq * dim, out);
    rows.gather(r, l.to_host(), hq, lse);
    if (bwd) {
      rows.gather(r, gq.to_host(), hq * dim, dq);
      rows.gather(r, gk.to_host(), hkv * dim, dk);
      rows.gather(r, gv.to_host(), hkv * dim, dv);
    }
  });
  INFO(what << ", P = " << p << ", T = " << t);
  const lt::tolerance tol{2e-4, 2e-5};
  auto widen = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  lt::require_close(widen(out), widen(want.out), tol, "out");
  lt::require_close(widen(lse), widen(want.lse), tol, "lse");
  if (!bwd) return;
  lt::require_close(widen(dq), widen(want.dq), tol, "dq");
  lt::require_close(widen(dk), widen(want.dk), tol, "dk");
  lt::require_close(widen(dv), widen(want.dv), tol, "dv");
}

// Every distributed primitive on device memory over the communicator `run` makes, P ranks.
template <class Run>
void primitives(Run run, int p) {
  namespace lr = loom::attention::ring;
  namespace lu = loom::attention::ulysses;
  namespace lh = loom::attention::hybrid;
  la::options opt;
  opt.causal = true;
  const auto want = reference(opt);
  const la::head_shape hs{hq, hkv, dim, dim};
  const auto zig = shard::make_plan(std::span<const index_t>(docs), p, shard::zigzag{});
  const shard_rows zr{zig};
  const auto fwd = [](const auto& b, auto& c, const auto& plan, auto... a) { lr::forward(b, c, plan, a...); };
  const auto bwd = [](const auto& b, auto& c, const auto& plan, auto... a) { lr::backward(b, c, plan, a...); };
  check_attention(
      run, p, zr, want, true,
      [&](const loom::cuda& b, auto& c) { return lr::make_plan<loom::fp32>(b, c, lr::pass_kv{}, zig, hs, opt); }, fwd,
      bwd, "ring pass-KV");
  check_attention(
      run, p, zr, want, false,
      [&](const loom::cuda& b, auto& c) { return lr::make_plan<loom::fp32>(b, c, lr::pass_q{}, zig, hs, opt); }, fwd,
      bwd, "ring pass-Q");
  check_attention(
      run, p, zr, want, true,
      [&](const loom::cuda& b, auto& c) { return lr::make_plan<loom::fp32>(b, c, lr::all_gather_kv{}, zig, hs, opt); },
      fwd, bwd, "ring all-gather-KV");
  check_attention(
      run, p, zr, want, true,
      [&](const loom::cuda& b, auto& c) {
        return lr::make_plan<loom::fp32>(b, c, lr::bidirectional_kv{}, zig, hs, opt);
      },
      fwd, bwd, "bidirectional ring");
  const auto ufwd = [](const auto& b, auto& c, const auto& plan, auto... a) { lu::forward(b, c, plan, a...); };
  const auto ubwd = [](const auto& b, auto& c, const auto& plan, auto... a) { lu::backward(b, c, plan, a...); };
  check_attention(
      run, p, zr, want, true,
      [&](const loom::cuda& b, auto& c) { return lu::make_plan<loom::fp32>(b, c, zig, hs, opt); }, ufwd, ubwd,
      "Ulysses");
  // The hybrid on U x R = p x 1: the one ring shard (the whole sequence in order) split over the
  // Ulysses group.
  const auto ring1 = shard::make_plan(std::span<const index_t>(docs), 1, shard::contiguous{});
  check_attention(
      run, p, split_rows{docs.back(), p}, want, false,
      [&](const loom::cuda& b, auto& c) { return lh::make_plan<loom::fp32>(b, c, ring1, hs, opt); },
      [](const auto& b, auto& c, const auto& plan, auto... a) { lh::forward(b, c, plan, a...); },
      [](const auto&, auto&, const auto&, auto...) {}, "hybrid");

  // A cross-rank inclusive scan (plus, packed documents) against one device's.
  const index_t n = 20011;
  const auto x = lt::uniform<float>(n, -1, 1, 5);
  const std::vector<index_t> cu{0, 17, 9000, 9001, n};
  std::vector<float> one(x.size()), got(x.size());
  {
    lt::device_array<float> in(x), out(x.size());
    lt::device_array<index_t> off(cu);
    const loom::segments<loom::cuda_memory> seg(dview<const index_t, 1>(off.data(), {static_cast<index_t>(cu.size())}));
    loom::scan::inclusive_scan(loom::cuda{}, loom::scan::plus<float>{}, dview<const float, 1>(in.data(), {n}),
                               dview<float, 1>(out.data(), {n}), seg);
    one = out.to_host();
  }
  run(p, [&](auto& comm, loom::cuda b) {
    const int r = comm.rank();
    const index_t lo = n * r / p, hi = n * (r + 1) / p;
    lt::device_array<float> in(std::vector<float>(x.begin() + lo, x.begin() + hi)),
        out(static_cast<std::size_t>(hi - lo));
    lt::device_array<index_t> off(cu);
    const loom::segments<loom::cuda_memory> seg(dview<const index_t, 1>(off.data(), {static_cast<index_t>(cu.size())}));
    loom::scan::inclusive_scan(b, comm, loom::scan::plus<float>{}, dview<const float, 1>(in.data(), {hi - lo}),
                               dview<float, 1>(out.data(), {hi - lo}), seg);
    LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
    const auto h = out.to_host();
    std::copy(h.begin(), h.end(), got.begin() + lo);
  });
  {
    INFO("cross-rank scan, P = " << p);
    lt::require_close(std::vector<double>(got.begin(), got.end()), std::vector<double>(one.begin(), one.end()),
                      {1e-4, 1e-5}, "scan");
  }

  // The sequence-parallel Newton solver (ParaGRU, d = 4) against one device's.
  const index_t d = 4, steps = 503;
  const auto theta = lt::uniform<float>(6 * d, -1, 1, 6);
  const auto xs = lt::uniform<float>(steps * 3 * d, -1, 1, 7);
  const std::vector<index_t> sq{0, 100, 101, 400, steps};
  const index_t segs = static_cast<index_t>(sq.size()) - 1;
  const auto h0 = lt::uniform<float>(segs * d, -0.5, 0.5, 8);
  loom::rnn::options ro;
  ro.abs_tol = 1e-6f;
  std::vector<float> h1, hp(static_cast<std::size_t>(steps * d));
  {
    lt::device_array<float> th(theta), xv(xs), h0v(h0), h(static_cast<std::size_t>(steps * d));
    lt::device_array<index_t> off(sq);
    const loom::segments<loom::cuda_memory> seg(dview<const index_t, 1>(off.data(), {segs + 1}));
    (void)loom::rnn::forward(
        loom::cuda{}, loom::rnn::para_gru<float>{th.data(), d}, dview<const float, 2>(xv.data(), {steps, 3 * d}),
        dview<const float, 2>(h0v.data(), {segs, d}), dview<float, 2>(h.data(), {steps, d}), seg, ro);
    h1 = h.to_host();
  }
  run(p, [&](auto& comm, loom::cuda b) {
    const int r = comm.rank();
    const index_t lo = steps * r / p, hi = steps * (r + 1) / p;
    lt::device_array<float> th(theta), xv(std::vector<float>(xs.begin() + lo * 3 * d, xs.begin() + hi * 3 * d)),
        h0v(h0), h(static_cast<std::size_t>((hi - lo) * d));
    lt::device_array<index_t> off(sq);
    const loom::segments<loom::cuda_memory> seg(dview<const index_t, 1>(off.data(), {segs + 1}));
    (void)loom::rnn::forward(
        b, comm, loom::rnn::para_gru<float>{th.data(), d}, dview<const float, 2>(xv.data(), {hi - lo, 3 * d}),
        dview<const float, 2>(h0v.data(), {segs, d}), dview<float, 2>(h.data(), {hi - lo, d}), seg, ro);
    LOOM_CUDA_TRY(cudaStreamSynchronize(b.stream));
    const auto hh = h.to_host();
    std::copy(hh.begin(), hh.end(), hp.begin() + lo * d);
  });
  {
    INFO("sequence-parallel Newton, P = " << p);
    lt::require_close(std::vector<double>(hp.begin(), hp.end()), std::vector<double>(h1.begin(), h1.end()),
                      {1e-4, 1e-5}, "h");
  }

  // LASP-2 (scalar gates, fp32, chunk 16) against chunked linear attention on one device: the
  // outputs and every document's final state.
  namespace lin = loom::linear_attention;
  const index_t t = docs.back(), nh = 2, w = 8, nd = static_cast<index_t>(docs.size()) - 1, st = nd * nh * w * w;
  const auto lq = lt::uniform<float>(t * nh * w, -1, 1, 9), lk = lt::uniform<float>(t * nh * w, -1, 1, 10),
             lv = lt::uniform<float>(t * nh * w, -1, 1, 11), lg = lt::uniform<float>(t * nh, -0.2, 0, 12);
  const lin::options lo_opt{.chunk = 16};
  std::vector<float> o1, f1, op(lv.size()), fp(static_cast<std::size_t>(st), 0.f);
  {
    lt::device_array<float> q(lq), k(lk), v(lv), g(lg), o(lv.size()), f(static_cast<std::size_t>(st));
    const lin::operands<loom::fp32, loom::cuda_memory> ops{dview<const float, 3>(q.data(), {t, nh, w}),
                                                           dview<const float, 3>(k.data(), {t, nh, w}),
                                                           dview<const float, 3>(v.data(), {t, nh, w})};
    lin::forward(loom::cuda{}, loom::segments{std::span<const index_t>(docs)},
                 lin::scalar_gate<float, loom::cuda_memory>{dview<const float, 2>(g.data(), {t, nh})}, ops,
                 dview<float, 3>(o.data(), {t, nh, w}), dview<float, 4>(f.data(), {nd, nh, w, w}), lo_opt);
    o1 = o.to_host();
    f1 = f.to_host();
  }
  std::mutex mu;
  run(p, [&](auto& comm, loom::cuda b) {
    const int r = comm.rank();
    const index_t lo = t * r / p, hi = t * (r + 1) / p, len = hi - lo;
    auto part = [&](const std::vector<float>& a, index_t width) {
      return std::vector<float>(a.begin() + lo * width, a.begin() + hi * width);
    };
    lt::device_array<float> q(part(lq, nh * w)), k(part(lk, nh * w)), v(part(lv, nh * w)), g(part(lg, nh)),
        o(static_cast<std::size_t>(len * nh * w)), f(std::vector<float>(static_cast<std::size_t>(st), 0.f));
    const lin::operands<loom::fp32, loom::cuda_memory> ops{dview<const float, 3>(q.data(), {len, nh, w}),
                                                           dview<const float, 3>(k.data(), {len, nh, w}),
                                                           dview<const float, 3>(v.data(), {len, nh, w})};
    lin::lasp2::forward(b, comm, loom::segments{std::span<const index_t>(docs)}, lo,
                        lin::scalar_gate<float, loom::cuda_memory>{dview<const float, 2>(g.data(), {len, nh})}, ops,
                        dview<float, 3>(o.data(), {len, nh, w}), dview<float, 4>(f.data(), {nd, nh, w, w}), {},
                        {.chunked = lo_opt});
    const auto oh = o.to_host(), fh = f.to_host();
    const std::lock_guard lk_(mu);
    std::copy(oh.begin(), oh.end(), op.begin() + lo * nh * w);
    for (std::size_t i = 0; i < fh.size(); ++i) fp[i] += fh[i];
  });
  INFO("LASP-2, P = " << p);
  lt::require_close(std::vector<double>(op.begin(), op.end()), std::vector<double>(o1.begin(), o1.end()), {1e-4, 1e-5},
                    "o");
  lt::require_close(std::vector<double>(fp.begin(), fp.end()), std::vector<double>(f1.begin(), f1.end()), {1e-4, 1e-5},
                    "final states");
}

const auto on_device_local = [](int p, auto&& fn) {
  loom::comm::run_device_local(p, [&](loom::comm::device_local& c, loom::cuda b) { fn(c, b); });
};
const auto on_nccl = [](int p, auto&& fn) { run_nccl(p, [&](loom::comm::nccl& c, loom::cuda b) { fn(c, b); }); };

}  // namespace

TEST_CASE("device_local: the stream-ordered conformance suite on one GPU, P = 1..5", "[comm][device_local][gpu]") {
  if (gpus() < 1) {
    WARN("no GPU: comm::device_local not run");
    return;
  }
  for (int p = 1; p <= 5; ++p) conformance(on_device_local, p);
}

TEST_CASE("nccl: the stream-ordered conformance suite, one GPU per rank", "[comm][nccl][gpu]") {
  const int n = gpus();
  if (n < 2) {
    WARN("fewer than two GPUs: comm::nccl not run");
    return;
  }
  for (int p = 2; p <= std::min(n, 4); ++p) conformance(on_nccl, p);
}

TEST_CASE("device_local: the distributed primitives on one GPU match one device, P = 1..4",
          "[comm][device_local][gpu]") {
  if (gpus() < 1) {
    WARN("no GPU: comm::device_local not run");
    return;
  }
  for (int p = 1; p <= 4; ++p) primitives(on_device_local, p);
}

TEST_CASE("nccl: the distributed primitives match one device, one GPU per rank", "[comm][nccl][gpu]") {
  const int n = gpus();
  if (n < 2) {
    WARN("fewer than two GPUs: comm::nccl not run");
    return;
  }
  for (int p = 2; p <= std::min(n, 4); ++p) primitives(on_nccl, p);
}
