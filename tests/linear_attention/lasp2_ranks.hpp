#pragma once

// LASP-2 on P ranks for the distributed bodies (lasp2_distributed_test.hpp,
// lasp2_isolation_test.hpp), on the backend under test (support/distributed.hpp: serial over
// comm::local, or the device stand-in over comm::standin): one plan per rank, one forward and one
// backward with it, every rank's outputs gathered in fp64.

#include <loom/backend/serial.hpp>
#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>
#include <loom/linear_attention/lasp2.hpp>

#include <support/distributed.hpp>

#include <array>
#include <cstddef>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

#include "oracle.hpp"

namespace loom::test::la {

namespace lasp2 = loom::linear_attention::lasp2;
namespace lin = loom::linear_attention;

//! How a run is scheduled: the exchange, and the slice plan's forward schedule (unset: make_plan's
//! choice, fused on one thread of host memory; false: the chunk-parallel schedule).
struct schedule {
  lasp2::exchange ex = lasp2::exchange::all_gather;
  std::optional<bool> fused{};
};

//! The schedules of the backend under test: both exchanges (one all_gather issued at once over a
//! stream-ordered communicator), and on host memory both forward schedules.
inline std::vector<schedule> schedules() {
  std::vector<schedule> s{{lasp2::exchange::all_gather, {}}, {lasp2::exchange::posted, {}}};
  if (space::host_accessible) s.push_back({lasp2::exchange::posted, false});
  return s;
}

//! A run's outputs (oracle.hpp's result): per-token ones in their rows; per-document ones summed
//! over the ranks (each written by one rank, zeros elsewhere).
using outputs = result;

//! A row-major view of host storage typed in memory space Space.
template <class Space, class T, std::size_t R>
tensor_view<T, R, Space> view_in(T* data, const index_t (&e)[R]) {
  std::array<index_t, R> a;
  for (std::size_t i = 0; i < R; ++i) a[i] = e[i];
  return tensor_view<T, R, Space>(data, a);
}

//! The same, typed in the memory space of the backend under test.
template <class T, std::size_t R>
tensor_view<T, R, space> in_space(T* data, const index_t (&e)[R]) {
  return view_in<space>(data, e);
}

//! Runs fn(comm, b) on p ranks of the backend under test (support/distributed.hpp).
struct ranks_under_test {
  template <class F>
  void operator()(int p, F&& fn) const {
    run_ranks(p, fn);
  }
};

//! Runs fn(comm, loom::serial) on p ranks over comm::local: the host path.
struct host_ranks {
  template <class F>
  void operator()(int p, F&& fn) const {
    loom::comm::run_local(p, [&](loom::comm::local& c) { fn(c, loom::serial{}); });
  }
};

template <class T>
std::vector<T> cast_to(const double* x, std::size_t n) {
  std::vector<T> r(n);
  for (std::size_t i = 0; i < n; ++i) r[i] = static_cast<T>(x[i]);
  return r;
}

//! The bits of two runs (the delay test compares seeds with them).
inline bool same_bits(const outputs& a, const outputs& b) {
  auto eq = [](const std::vector<double>& u, const std::vector<double>& v) {
    return u.size() == v.size() && (u.empty() || std::memcmp(u.data(), v.data(), u.size() * sizeof(double)) == 0);
  };
  return eq(a.o, b.o) && eq(a.fin, b.fin) && eq(a.dq, b.dq) && eq(a.dk, b.dk) && eq(a.dv, b.dv) && eq(a.dlg, b.dlg) &&
         eq(a.dinit, b.dinit);
}

//! run_lasp2's Engine for loom's kernels on a plan made from a shard::contiguous plan of the
//! documents (lasp2::make_plan(b, comm, shard_plan, slice, opt)); the splits must be its runs.
struct from_shard_plan {};

//! LASP-2 forward then backward in precision P on the slices (on the backend under test, or with
//! Space = host_memory and host_ranks on the host path) `splits` (tokens [splits[r],
//! splits[r + 1]) on rank r), chunk `chunk`, one plan and one workspace per rank for both passes.
//! Engine: void (loom's kernels) or a products tag given to make_plan (the forward's local step).
template <class P, class Space = space, class Ranks = ranks_under_test, class Engine = void>
outputs run_lasp2(const problem& p, const std::vector<index_t>& splits, const std::vector<double>& d_o,
                  const std::vector<double>& dfin, schedule sc, index_t chunk = 16, Ranks ranks = {}) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  const index_t H = p.H, dk = p.dk, dv = p.dv, docs = p.docs(), sz = dk * dv;
  outputs out{std::vector<double>(p.v.size()),   std::vector<double>(p.init.size()), std::vector<double>(p.q.size()),
              std::vector<double>(p.k.size()),   std::vector<double>(p.v.size()),    std::vector<double>(p.lg.size()),
              std::vector<double>(p.init.size())};
  std::mutex mu;
  const auto init = cast_to<A>(p.init.data(), p.init.size()), hlg = cast_to<A>(p.head_lg.data(), p.head_lg.size());
  const auto df = cast_to<A>(dfin.data(), dfin.size());
  ranks(static_cast<int>(splits.size()) - 1, [&](auto& comm, const auto& b) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const index_t from = splits[r], n = splits[r + 1] - from;
    const auto q = cast_to<S>(p.q.data() + from * H * dk, static_cast<std::size_t>(n * H * dk));
    const auto k = cast_to<S>(p.k.data() + from * H * dk, static_cast<std::size_t>(n * H * dk));
    const auto v = cast_to<S>(p.v.data() + from * H * dv, static_cast<std::size_t>(n * H * dv));
    const auto lg = cast_to<A>(p.lg.data() + from * H, static_cast<std::size_t>(n * H));
    const auto dob = cast_to<S>(d_o.data() + from * H * dv, static_cast<std::size_t>(n * H * dv));
    std::vector<S> o(static_cast<std::size_t>(n * H * dv)), dq(q.size()), dkk(k.size()), dvv(v.size());
    std::vector<A> fin(init.size(), A(0)), xin(static_cast<std::size_t>(H * sz)), dlg(lg.size()),
        dinit(init.size(), A(0));
    lin::operands<P, Space> x{view_in<Space>(q.data(), {n, H, dk}), view_in<Space>(k.data(), {n, H, dk}),
                              view_in<Space>(v.data(), {n, H, dv})};
    if (!init.empty()) x.initial_state = view_in<Space>(init.data(), {docs, H, dk, dv});
    lin::gradients<P, Space> gr{view_in<Space>(dq.data(), {n, H, dk}), view_in<Space>(dkk.data(), {n, H, dk}),
                                view_in<Space>(dvv.data(), {n, H, dv})};
    gr.d_initial_state = view_in<Space>(dinit.data(), {docs, H, dk, dv});
    if (p.mode == gating::scalar) gr.d_log_gate = view_in<Space>(dlg.data(), {n, H});
    const lasp2::options opt{.chunked = {.chunk = chunk, .scale = p.scale, .fused = sc.fused}, .exchange = sc.ex};
    // The global offsets in the backend's memory (on the stand-in: not host-readable; make_plan
    // reads them with a copy and a fence).
    const loom::segments<Space> docs_view(
        view_in<Space>(static_cast<const index_t*>(p.cu.data()), {static_cast<index_t>(p.cu.size())}));
    const auto pl = [&] {
      if constexpr (std::is_same_v<Engine, from_shard_plan>)
        return lasp2::make_plan<P>(
            b, comm,
            loom::shard::make_plan(loom::segments<>(std::span<const index_t>(p.cu)),
                                   static_cast<int>(splits.size()) - 1, loom::shard::contiguous{}),
            {n, H, dk, dv}, opt);
      else if constexpr (std::is_void_v<Engine>)
        return lasp2::make_plan<P>(b, comm, docs_view, from, {n, H, dk, dv}, opt);
      else
        return lasp2::make_plan<P>(b, comm, Engine{}, docs_view, from, {n, H, dk, dv}, opt);
    }();
    loom::workspace_buffer ws(pl.workspace_bytes());
    auto both = [&](const auto& g) {
      lasp2::forward(b, comm, pl, g, x, view_in<Space>(o.data(), {n, H, dv}),
                     view_in<Space>(fin.data(), {docs, H, dk, dv}), view_in<Space>(xin.data(), {H, dk, dv}), ws.span());
      lasp2::backward(b, comm, pl, g, x, view_in<Space>(static_cast<const S*>(dob.data()), {n, H, dv}),
                      view_in<Space>(df.data(), {docs, H, dk, dv}),
                      view_in<Space>(static_cast<const A*>(xin.data()), {H, dk, dv}), gr, ws.span());
    };
    try {
      if (p.mode == gating::none)
        both(lin::no_decay{});
      else if (p.mode == gating::fixed)
        both(lin::fixed_decay<A, Space>{view_in<Space>(hlg.data(), {H})});
      else
        both(lin::scalar_gate<A, Space>{view_in<Space>(lg.data(), {n, H})});
      loom::fence(b);
    } catch (...) {
      drain(b);  // the rank's work may still read its buffers
      throw;
    }
    const std::lock_guard lk(mu);
    auto put = [](std::vector<double>& dst, const auto& src, index_t at) {
      for (std::size_t i = 0; i < src.size(); ++i) dst[static_cast<std::size_t>(at) + i] = static_cast<double>(src[i]);
    };
    put(out.o, o, from * H * dv), put(out.dq, dq, from * H * dk), put(out.dk, dkk, from * H * dk);
    put(out.dv, dvv, from * H * dv), put(out.dlg, dlg, from * H);
    for (std::size_t i = 0; i < fin.size(); ++i)
      out.fin[i] += static_cast<double>(fin[i]), out.dinit[i] += static_cast<double>(dinit[i]);
  });
  return out;
}

}  // namespace loom::test::la
