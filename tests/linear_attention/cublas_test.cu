// linear_attention::cublas: chunked linear attention's forward through cuBLAS's strided-batched
// products on a GPU, against the fp64 token-by-token oracle, and its backward against loom's
// backward on the same device; LASP-2 with cuBLAS as its local step, forward and backward (the
// same engine runs on the CPU in gemm_engine_test.cpp and the LASP-2 tests). Needs a GPU:
// registered by the cuda-gpu presets, compiled by the cuda presets.

#define LOOM_TEST_BACKEND_CUDA 1
#include <loom/comm/device_local.hpp>
#include <loom/linear_attention/cublas.cuh>
#include <loom/linear_attention/lasp2.hpp>

#include <support/backends.hpp>
#include <support/convert.hpp>
#include <support/errors.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "oracle.hpp"

namespace la = loom::linear_attention;
using loom::cuda_memory;
using loom::index_t;
using loom::test::buffer;
using loom::test::la::gating;
using loom::test::la::problem;

using loom::test::cast;
using loom::test::widen;

namespace {

template <class T, std::size_t R>
loom::tensor_view<T, R, cuda_memory> dv(T* p, const std::array<index_t, R>& e) {
  return loom::tensor_view<T, R, cuda_memory>(p, e);
}

// cuBLAS's forward of p, plan form (convenience = false) or convenience form.
template <class P>
std::pair<std::vector<double>, std::vector<double>> run_cublas(const problem& p, index_t chunk, bool convenience) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = p.T, H = p.H, docs = p.docs();
  buffer<S> q(cast<S>(p.q)), k(cast<S>(p.k)), v(cast<S>(p.v)), o(std::vector<S>(p.q.size() / p.dk * p.dv, S(-7.0f)));
  buffer<A> lg(cast<A>(p.lg)), hlg(cast<A>(p.head_lg)), init(cast<A>(p.init)),
      fin(static_cast<std::size_t>(docs * H * p.dk * p.dv));
  la::operands<P, cuda_memory> x{dv<const S, 3>(q.data(), {T, H, p.dk}), dv<const S, 3>(k.data(), {T, H, p.dk}),
                                 dv<const S, 3>(v.data(), {T, H, p.dv})};
  if (!p.init.empty()) x.initial_state = dv<const A, 4>(init.data(), {docs, H, p.dk, p.dv});
  const loom::segments<> seg{std::span<const index_t>(p.cu)};
  const la::options opt{.chunk = chunk, .scale = p.scale};
  const auto ov = dv<S, 3>(o.data(), {T, H, p.dv});
  const auto fv = dv<A, 4>(fin.data(), {docs, H, p.dk, p.dv});
  const loom::cuda b{};
  auto call = [&](const auto& gate) {
    if (convenience) {
      la::cublas::forward(b, seg, gate, x, ov, fv, opt);
    } else {
      const auto pl = la::cublas::make_plan<P>(b, seg, {T, H, p.dk, p.dv}, opt);
      const loom::test::workspace ws(pl.workspace_bytes());
      la::cublas::forward(b, pl, gate, x, ov, fv, ws.span());
      loom::fence(b);
    }
  };
  if (p.mode == gating::none)
    call(la::no_decay{});
  else if (p.mode == gating::fixed)
    call(la::fixed_decay<A, cuda_memory>{dv<const A, 1>(hlg.data(), {H})});
  else
    call(la::scalar_gate<A, cuda_memory>{dv<const A, 2>(lg.data(), {T, H})});
  return {widen(o.to_host()), widen(fin.to_host())};
}

template <class P>
void check(const problem& p0, index_t chunk, const std::string& what) {
  const problem p = loom::test::la::rounded<P>(p0);
  const auto want = loom::test::la::oracle(p);
  const auto tol_o = loom::test::la::scaled_tol<P>(want.o), tol_f = loom::test::la::scaled_tol<P>(want.fin);
  for (const bool convenience : {false, true}) {
    const auto [o, fin] = run_cublas<P>(p, chunk, convenience);
    const std::string w = what + (convenience ? " convenience" : " plan");
    loom::test::require_close(o, want.o, tol_o, w + " o");
    loom::test::require_close(fin, want.fin, tol_f, w + " final state");
  }
}

// LASP-2's forward with cuBLAS as its local step on P ranks of comm::device_local (one GPU),
// slices of about T / P tokens: o gathered, the final states summed (each written by one rank).
template <class P>
std::pair<std::vector<double>, std::vector<double>> run_lasp2(const problem& p, int ranks, index_t chunk) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = p.T, H = p.H, docs = p.docs(), sz = p.dk * p.dv;
  std::vector<double> o(static_cast<std::size_t>(T * H * p.dv)), fin(static_cast<std::size_t>(docs * H * sz));
  std::mutex mu;
  loom::comm::run_device_local(ranks, [&](loom::comm::device_local& comm, loom::cuda b) {
    const int r = comm.rank();
    const index_t from = T * r / ranks, n = T * (r + 1) / ranks - from;
    auto slice = [&](const std::vector<double>& x, index_t row) {
      return std::vector<double>(x.begin() + from * row, x.begin() + (from + n) * row);
    };
    buffer<S> q(cast<S>(slice(p.q, H * p.dk))), k(cast<S>(slice(p.k, H * p.dk))), v(cast<S>(slice(p.v, H * p.dv))),
        od(static_cast<std::size_t>(n * H * p.dv));
    buffer<A> lg(cast<A>(slice(p.lg, H))), hlg(cast<A>(p.head_lg)), init(cast<A>(p.init)),
        fd(std::vector<A>(static_cast<std::size_t>(docs * H * sz), A(0))), xin(static_cast<std::size_t>(H * sz));
    la::operands<P, cuda_memory> x{dv<const S, 3>(q.data(), {n, H, p.dk}), dv<const S, 3>(k.data(), {n, H, p.dk}),
                                   dv<const S, 3>(v.data(), {n, H, p.dv})};
    if (!p.init.empty()) x.initial_state = dv<const A, 4>(init.data(), {docs, H, p.dk, p.dv});
    const auto pl =
        la::lasp2::make_plan<P>(b, comm, la::cublas::batched{}, loom::segments<>{std::span<const index_t>(p.cu)}, from,
                                {n, H, p.dk, p.dv}, {.chunked = {.chunk = chunk, .scale = p.scale}});
    const loom::test::workspace ws(pl.forward_workspace_bytes());
    auto call = [&](const auto& gate) {
      la::lasp2::forward(b, comm, pl, gate, x, dv<S, 3>(od.data(), {n, H, p.dv}),
                         dv<A, 4>(fd.data(), {docs, H, p.dk, p.dv}), dv<A, 3>(xin.data(), {H, p.dk, p.dv}), ws.span());
    };
    if (p.mode == gating::none)
      call(la::no_decay{});
    else if (p.mode == gating::fixed)
      call(la::fixed_decay<A, cuda_memory>{dv<const A, 1>(hlg.data(), {H})});
    else
      call(la::scalar_gate<A, cuda_memory>{dv<const A, 2>(lg.data(), {n, H})});
    loom::fence(b);
    const auto oh = widen(od.to_host()), fh = widen(fd.to_host());
    const std::lock_guard lock(mu);
    std::copy(oh.begin(), oh.end(), o.begin() + from * H * p.dv);
    for (std::size_t i = 0; i < fh.size(); ++i) fin[i] += fh[i];
  });
  return {o, fin};
}

struct grads {
  std::vector<double> dq, dk, dv, dlg, dinit;
};

// The backward of p on the GPU: cuBLAS's plan form (convenience = false), its convenience form, or
// loom's own backward on the same plan (tiled).
template <class P>
grads run_backward(const problem& p, index_t chunk, const std::vector<double>& d_o, const std::vector<double>& dfin,
                   int path) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = p.T, H = p.H, docs = p.docs(), sz = p.dk * p.dv;
  buffer<S> q(cast<S>(p.q)), k(cast<S>(p.k)), v(cast<S>(p.v)), dob(cast<S>(d_o)),
      dq(std::vector<S>(p.q.size(), S(-7.0f))), dk(std::vector<S>(p.k.size(), S(-7.0f))),
      dvb(std::vector<S>(p.v.size(), S(-7.0f)));
  buffer<A> lg(cast<A>(p.lg)), hlg(cast<A>(p.head_lg)), init(cast<A>(p.init)), dfb(cast<A>(dfin)),
      dlg(std::vector<A>(static_cast<std::size_t>(T * H), A(-7))),
      dinit(std::vector<A>(static_cast<std::size_t>(docs * H * sz), A(-7)));
  la::operands<P, cuda_memory> x{dv<const S, 3>(q.data(), {T, H, p.dk}), dv<const S, 3>(k.data(), {T, H, p.dk}),
                                 dv<const S, 3>(v.data(), {T, H, p.dv})};
  if (!p.init.empty()) x.initial_state = dv<const A, 4>(init.data(), {docs, H, p.dk, p.dv});
  la::gradients<P, cuda_memory> g{dv<S, 3>(dq.data(), {T, H, p.dk}), dv<S, 3>(dk.data(), {T, H, p.dk}),
                                  dv<S, 3>(dvb.data(), {T, H, p.dv})};
  g.d_initial_state = dv<A, 4>(dinit.data(), {docs, H, p.dk, p.dv});
  if (p.mode == gating::scalar) g.d_log_gate = dv<A, 2>(dlg.data(), {T, H});
  loom::tensor_view<const A, 4, cuda_memory> dfv;
  if (!dfin.empty()) dfv = dv<const A, 4>(dfb.data(), {docs, H, p.dk, p.dv});
  const auto dov = dv<const S, 3>(dob.data(), {T, H, p.dv});
  const loom::segments<> seg{std::span<const index_t>(p.cu)};
  const la::options opt{.chunk = chunk, .scale = p.scale};
  const loom::cuda b{};
  auto call = [&](const auto& gate) {
    if (path == 1) {
      la::cublas::backward(b, seg, gate, x, dov, dfv, g, opt);
      return;
    }
    const auto pl = la::cublas::make_plan<P>(b, seg, {T, H, p.dk, p.dv}, opt);
    const loom::test::workspace ws(path == 0 ? pl.backward_workspace_bytes() : pl.base().backward_workspace_bytes());
    if (path == 0)
      la::cublas::backward(b, pl, gate, x, dov, dfv, g, ws.span());
    else
      la::backward(b, pl.base(), gate, x, dov, dfv, g, ws.span());
    loom::fence(b);
  };
  if (p.mode == gating::none)
    call(la::no_decay{});
  else if (p.mode == gating::fixed)
    call(la::fixed_decay<A, cuda_memory>{dv<const A, 1>(hlg.data(), {H})});
  else
    call(la::scalar_gate<A, cuda_memory>{dv<const A, 2>(lg.data(), {T, H})});
  grads r{widen(dq.to_host()), widen(dk.to_host()), widen(dvb.to_host()), {}, widen(dinit.to_host())};
  if (p.mode == gating::scalar) r.dlg = widen(dlg.to_host());
  return r;
}

template <class P>
void check_backward(const problem& p0, index_t chunk, const std::string& what) {
  const problem p = loom::test::la::rounded<P>(p0);
  const auto d_o = widen(cast<typename P::storage_type>(loom::test::uniform<double>(p.T * p.H * p.dv, -1, 1, 77)));
  const auto dfin =
      widen(cast<typename P::accum_type>(loom::test::uniform<double>(p.docs() * p.H * p.dk * p.dv, -1, 1, 78)));
  const auto want = run_backward<P>(p, chunk, d_o, dfin, 2);
  for (const int path : {0, 1}) {
    const auto got = run_backward<P>(p, chunk, d_o, dfin, path);
    const std::string w = what + (path == 1 ? " convenience" : " plan");
    loom::test::la::require_gradients_close<P>(got, want, true, w);
  }
}

// LASP-2's forward then backward on P ranks of comm::device_local (one GPU), slices of about T / P
// tokens, both local steps on cuBLAS (products = true) or on loom's kernels: the gradients
// gathered, the initial-state gradients summed (each written by one rank).
template <class P>
grads run_lasp2_backward(const problem& p, int ranks, index_t chunk, const std::vector<double>& d_o,
                         const std::vector<double>& dfin, bool products) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t T = p.T, H = p.H, docs = p.docs(), sz = p.dk * p.dv;
  grads r{std::vector<double>(p.q.size()), std::vector<double>(p.k.size()), std::vector<double>(p.v.size()),
          std::vector<double>(p.mode == gating::scalar ? p.lg.size() : 0), std::vector<double>(p.init.size())};
  std::mutex mu;
  loom::comm::run_device_local(ranks, [&](loom::comm::device_local& comm, loom::cuda b) {
    const int rk = comm.rank();
    const index_t from = T * rk / ranks, n = T * (rk + 1) / ranks - from;
    auto slice = [&](const std::vector<double>& x, index_t row) {
      return std::vector<double>(x.begin() + from * row, x.begin() + (from + n) * row);
    };
    buffer<S> q(cast<S>(slice(p.q, H * p.dk))), k(cast<S>(slice(p.k, H * p.dk))), v(cast<S>(slice(p.v, H * p.dv))),
        od(static_cast<std::size_t>(n * H * p.dv)), dob(cast<S>(slice(d_o, H * p.dv))),
        dq(static_cast<std::size_t>(n * H * p.dk)), dk(static_cast<std::size_t>(n * H * p.dk)),
        dvb(static_cast<std::size_t>(n * H * p.dv));
    buffer<A> lg(cast<A>(slice(p.lg, H))), hlg(cast<A>(p.head_lg)), init(cast<A>(p.init)), dfb(cast<A>(dfin)),
        fd(std::vector<A>(static_cast<std::size_t>(docs * H * sz), A(0))), xin(static_cast<std::size_t>(H * sz)),
        dlg(static_cast<std::size_t>(n * H)), dinit(std::vector<A>(static_cast<std::size_t>(docs * H * sz), A(0)));
    la::operands<P, cuda_memory> x{dv<const S, 3>(q.data(), {n, H, p.dk}), dv<const S, 3>(k.data(), {n, H, p.dk}),
                                   dv<const S, 3>(v.data(), {n, H, p.dv})};
    if (!p.init.empty()) x.initial_state = dv<const A, 4>(init.data(), {docs, H, p.dk, p.dv});
    la::gradients<P, cuda_memory> g{dv<S, 3>(dq.data(), {n, H, p.dk}), dv<S, 3>(dk.data(), {n, H, p.dk}),
                                    dv<S, 3>(dvb.data(), {n, H, p.dv})};
    g.d_initial_state = dv<A, 4>(dinit.data(), {docs, H, p.dk, p.dv});
    if (p.mode == gating::scalar) g.d_log_gate = dv<A, 2>(dlg.data(), {n, H});
    const loom::segments<> seg{std::span<const index_t>(p.cu)};
    const la::lasp2::options opt{.chunked = {.chunk = chunk, .scale = p.scale}};
    auto both = [&](const auto& pl, const auto& gate) {
      const loom::test::workspace ws(pl.workspace_bytes());
      la::lasp2::forward(b, comm, pl, gate, x, dv<S, 3>(od.data(), {n, H, p.dv}),
                         dv<A, 4>(fd.data(), {docs, H, p.dk, p.dv}), dv<A, 3>(xin.data(), {H, p.dk, p.dv}), ws.span());
      la::lasp2::backward(b, comm, pl, gate, x, dv<const S, 3>(dob.data(), {n, H, p.dv}),
                          dv<const A, 4>(dfb.data(), {docs, H, p.dk, p.dv}),
                          dv<const A, 3>(xin.data(), {H, p.dk, p.dv}), g, ws.span());
      loom::fence(b);
    };
    auto call = [&](const auto& gate) {
      if (products)
        both(la::lasp2::make_plan<P>(b, comm, la::cublas::batched{}, seg, from, {n, H, p.dk, p.dv}, opt), gate);
      else
        both(la::lasp2::make_plan<P>(b, comm, seg, from, {n, H, p.dk, p.dv}, opt), gate);
    };
    if (p.mode == gating::none)
      call(la::no_decay{});
    else if (p.mode == gating::fixed)
      call(la::fixed_decay<A, cuda_memory>{dv<const A, 1>(hlg.data(), {H})});
    else
      call(la::scalar_gate<A, cuda_memory>{dv<const A, 2>(lg.data(), {n, H})});
    const auto qh = widen(dq.to_host()), kh = widen(dk.to_host()), vh = widen(dvb.to_host()), gh = widen(dlg.to_host()),
               ih = widen(dinit.to_host());
    const std::lock_guard lock(mu);
    std::copy(qh.begin(), qh.end(), r.dq.begin() + from * H * p.dk);
    std::copy(kh.begin(), kh.end(), r.dk.begin() + from * H * p.dk);
    std::copy(vh.begin(), vh.end(), r.dv.begin() + from * H * p.dv);
    if (p.mode == gating::scalar) std::copy(gh.begin(), gh.end(), r.dlg.begin() + from * H);
    for (std::size_t i = 0; i < ih.size(); ++i) r.dinit[i] += ih[i];
  });
  return r;
}

const char* name(gating g) {
  return g == gating::none ? "no_decay" : g == gating::fixed ? "fixed_decay" : "scalar_gate";
}

}  // namespace

TEST_CASE("linear_attention::cublas: forward against the recurrent oracle", "[linear_attention][cublas][gpu]") {
  for (const index_t T : {index_t{1}, index_t{65}, index_t{131}, index_t{1009}})
    for (const auto mode : {gating::none, gating::fixed, gating::scalar})
      for (const bool packed : {false, true}) {
        const auto cu =
            packed ? loom::test::la::random_docs(T, 4, static_cast<std::uint64_t>(T)) : std::vector<index_t>{0, T};
        const auto p = loom::test::la::make_problem(T, 3, 16, 24, mode, cu, packed, 70 + static_cast<std::uint64_t>(T));
        for (const index_t chunk : {index_t{7}, index_t{64}}) {
          const std::string what = std::string(name(mode)) + " T=" + std::to_string(T) + " C=" + std::to_string(chunk);
          check<loom::fp64>(p, chunk, what + " fp64");
          check<loom::fp32>(p, chunk, what + " fp32");
          check<loom::bf16>(p, chunk, what + " bf16");
          check<loom::fp16>(p, chunk, what + " fp16");
        }
      }
}

TEST_CASE("linear_attention::cublas: backward against loom's backward on the same device",
          "[linear_attention][cublas][backward][gpu]") {
  for (const index_t T : {index_t{1}, index_t{131}, index_t{1009}})
    for (const auto mode : {gating::none, gating::fixed, gating::scalar}) {
      const auto p = loom::test::la::make_problem(T, 3, 16, 24, mode,
                                                  loom::test::la::random_docs(T, 4, static_cast<std::uint64_t>(T)),
                                                  true, 80 + static_cast<std::uint64_t>(T));
      for (const index_t chunk : {index_t{7}, index_t{64}}) {
        const std::string what = std::string(name(mode)) + " T=" + std::to_string(T) + " C=" + std::to_string(chunk);
        check_backward<loom::fp64>(p, chunk, what + " fp64");
        check_backward<loom::fp32>(p, chunk, what + " fp32");
        check_backward<loom::bf16>(p, chunk, what + " bf16");
        check_backward<loom::fp16>(p, chunk, what + " fp16");
      }
    }
}

TEST_CASE("linear_attention::cublas: a plan not made by make_plan is rejected", "[linear_attention][cublas][gpu]") {
  buffer<float> q(std::vector<float>(8 * 2 * 4, 0.5f)), o(std::size_t{8 * 2 * 4});
  const la::operands<loom::fp32, cuda_memory> x{dv<const float, 3>(q.data(), {8, 2, 4}),
                                                dv<const float, 3>(q.data(), {8, 2, 4}),
                                                dv<const float, 3>(q.data(), {8, 2, 4})};
  const loom::test::workspace ws(1024);
  loom::test::require_loom_error(
      [&] {
        la::cublas::forward(loom::cuda{}, la::cublas::plan<loom::fp32>{}, la::no_decay{}, x,
                            dv<float, 3>(o.data(), {8, 2, 4}), {}, ws.span());
      },
      loom::errc::invalid_argument, {"linear_attention::cublas::forward", "not made by"});
  buffer<float> dq(std::size_t{8 * 2 * 4}), dk(std::size_t{8 * 2 * 4}), dvb(std::size_t{8 * 2 * 4});
  const la::gradients<loom::fp32, cuda_memory> g{dv<float, 3>(dq.data(), {8, 2, 4}), dv<float, 3>(dk.data(), {8, 2, 4}),
                                                 dv<float, 3>(dvb.data(), {8, 2, 4})};
  loom::test::require_loom_error(
      [&] {
        la::cublas::backward(loom::cuda{}, la::cublas::plan<loom::fp32>{}, la::no_decay{}, x,
                             dv<const float, 3>(q.data(), {8, 2, 4}), {}, g, ws.span());
      },
      loom::errc::invalid_argument, {"linear_attention::cublas::backward", "not made by"});
}

TEST_CASE("linear_attention::cublas: LASP-2's forward with cuBLAS as its local step against the recurrent oracle",
          "[linear_attention][cublas][lasp2][gpu]") {
  const index_t T = 1009;
  for (const auto mode : {gating::none, gating::fixed, gating::scalar}) {
    const auto p0 = loom::test::la::make_problem(T, 3, 16, 24, mode, loom::test::la::random_docs(T, 4, 90), true, 91);
    for (const int ranks : {1, 2, 3, 4}) {
      const std::string what = std::string(name(mode)) + " P=" + std::to_string(ranks);
      auto one = [&]<class P>(P, const char* prec) {
        const problem p = loom::test::la::rounded<P>(p0);
        const auto want = loom::test::la::oracle(p);
        const auto [o, fin] = run_lasp2<P>(p, ranks, 64);
        loom::test::require_close(o, want.o, loom::test::la::scaled_tol<P>(want.o), what + prec + " o");
        loom::test::require_close(fin, want.fin, loom::test::la::scaled_tol<P>(want.fin), what + prec + " final state");
      };
      one(loom::fp32{}, " fp32");
      one(loom::bf16{}, " bf16");
    }
  }
}

TEST_CASE("linear_attention::cublas: LASP-2's backward with cuBLAS as its local step against the oracle",
          "[linear_attention][cublas][lasp2][backward][gpu]") {
  // Against the fp64 oracle and against LASP-2's backward on loom's kernels on the same device.
  const index_t T = 1009;
  for (const auto mode : {gating::none, gating::fixed, gating::scalar}) {
    const auto p0 = loom::test::la::make_problem(T, 3, 16, 24, mode, loom::test::la::random_docs(T, 4, 92), true, 93);
    for (const int ranks : {1, 2, 3, 4}) {
      const std::string what = std::string(name(mode)) + " P=" + std::to_string(ranks);
      auto one = [&]<class P>(P, const char* prec) {
        const problem p = loom::test::la::rounded<P>(p0);
        const auto d_o =
            widen(cast<typename P::storage_type>(loom::test::uniform<double>(p.T * p.H * p.dv, -1, 1, 94)));
        const auto dfin =
            widen(cast<typename P::accum_type>(loom::test::uniform<double>(p.docs() * p.H * p.dk * p.dv, -1, 1, 95)));
        const auto want = loom::test::la::oracle(p, &d_o, &dfin);
        const auto got = run_lasp2_backward<P>(p, ranks, 64, d_o, dfin, true);
        const auto kernels = run_lasp2_backward<P>(p, ranks, 64, d_o, dfin, false);
        const std::string w = what + prec;
        loom::test::la::require_gradients_close<P>(got, want, mode == gating::scalar, w);
        loom::test::la::require_gradients_close<P>(got, kernels, mode == gating::scalar, w + " against loom's kernels");
      };
      one(loom::fp64{}, " fp64");
      one(loom::fp32{}, " fp32");
    }
  }
}
