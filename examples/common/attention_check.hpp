#pragma once

// What the distributed attention examples share: a packed batch of random inputs, one rank's
// forward and backward on the rows a plan gives it, the single-device reference, and the check.

#include <loom/attention/local.hpp>
#include <loom/backend/serial.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/core/workspace.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <vector>

namespace example {

using loom::index_t;

struct shape {
  index_t hq, hkv, dim;
};

//! Packed causal documents (cu_seqlens) with random q, k, v and dout.
struct batch {
  shape s;
  std::vector<index_t> cu;
  std::vector<float> q, k, v, dout;
  [[nodiscard]] index_t tokens() const { return cu.back(); }
  batch(shape s_, std::vector<index_t> cu_, unsigned seed) : s(s_), cu(std::move(cu_)) {
    std::mt19937 g(seed);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    auto fill = [&](std::vector<float>& x, index_t heads) {
      x.resize(static_cast<std::size_t>(tokens() * heads * s.dim));
      for (auto& e : x) e = d(g);
    };
    fill(q, s.hq);
    fill(k, s.hkv);
    fill(v, s.hkv);
    fill(dout, s.hq);
  }
};

struct results {
  std::vector<float> out, dq, dk, dv;
  explicit results(const batch& in) : out(in.q.size()), dq(in.q.size()), dk(in.k.size()), dv(in.v.size()) {}
};

//! One rank's part: its n rows from the plan (anything with scatter/gather of rows), forward and
//! backward through `fwd` / `bwd`, its rows written back into `r`.
template <class Plan, class Fwd, class Bwd>
void run_rank(int me, const batch& in, const Plan& plan, index_t n, results& r, Fwd fwd, Bwd bwd) {
  const auto [hq, hkv, dim] = in.s;
  auto take = [&](const std::vector<float>& global, index_t heads) {
    std::vector<float> local(static_cast<std::size_t>(n * heads * dim));
    plan.template scatter<float>(me, global, heads * dim, local);
    return local;
  };
  const auto q = take(in.q, hq), k = take(in.k, hkv), v = take(in.v, hkv), dout = take(in.dout, hq);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(n * hq)), dq(q.size()), dk(k.size()), dv(v.size());
  const loom::tensor_view<const float, 3> qv(q.data(), {n, hq, dim}), kv(k.data(), {n, hkv, dim}),
      vv(v.data(), {n, hkv, dim});
  fwd(qv, kv, vv, loom::tensor_view<float, 3>(out.data(), {n, hq, dim}),
      loom::tensor_view<float, 2>(lse.data(), {n, hq}));
  bwd(qv, kv, vv, loom::tensor_view<const float, 3>(out.data(), {n, hq, dim}),
      loom::tensor_view<const float, 2>(lse.data(), {n, hq}),
      loom::tensor_view<const float, 3>(dout.data(), {n, hq, dim}),
      loom::tensor_view<float, 3>(dq.data(), {n, hq, dim}), loom::tensor_view<float, 3>(dk.data(), {n, hkv, dim}),
      loom::tensor_view<float, 3>(dv.data(), {n, hkv, dim}));
  plan.template gather<float>(me, out, hq * dim, r.out);
  plan.template gather<float>(me, dq, hq * dim, r.dq);
  plan.template gather<float>(me, dk, hkv * dim, r.dk);
  plan.template gather<float>(me, dv, hkv * dim, r.dv);
}

//! Every rank filled its own rows (zeros elsewhere): the sum over ranks is the whole result.
template <loom::comm::communicator C>
void sum_over_ranks(C& comm, results& r) {
  for (auto* x : {&r.out, &r.dq, &r.dk, &r.dv})
    comm.all_reduce(std::span<const float>(*x), std::span<float>(*x), loom::comm::reduce_op::sum);
}

//! Single-device attention on the whole packed sequence, forward and backward: one plan over the
//! documents, one workspace for both passes.
inline results single_device(const batch& in) {
  namespace la = loom::attention;
  const auto [hq, hkv, dim] = in.s;
  const index_t t = in.tokens();
  results one(in);
  std::vector<float> lse(static_cast<std::size_t>(t * hq));
  const loom::segments docs{std::span<const index_t>(in.cu)};
  const auto plan = la::make_plan(loom::serial{}, docs, {t, hq, hkv, dim, dim});
  loom::workspace_buffer ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
  const loom::tensor_view<const float, 3> q(in.q.data(), {t, hq, dim}), k(in.k.data(), {t, hkv, dim}),
      v(in.v.data(), {t, hkv, dim});
  la::forward(loom::serial{}, plan, q, k, v, loom::tensor_view<float, 3>(one.out.data(), {t, hq, dim}),
              loom::tensor_view<float, 2>(lse.data(), {t, hq}), ws.span());
  la::backward(loom::serial{}, plan, q, k, v, loom::tensor_view<const float, 3>(one.out.data(), {t, hq, dim}),
               loom::tensor_view<const float, 2>(lse.data(), {t, hq}),
               loom::tensor_view<const float, 3>(in.dout.data(), {t, hq, dim}),
               loom::tensor_view<float, 3>(one.dq.data(), {t, hq, dim}),
               loom::tensor_view<float, 3>(one.dk.data(), {t, hkv, dim}),
               loom::tensor_view<float, 3>(one.dv.data(), {t, hkv, dim}), ws.span());
  return one;
}

//! Worst |a - b| / (1 + |b|) over out, dq, dk and dv.
inline double max_rel_error(const results& a, const results& b) {
  double e = 0;
  auto cmp = [&](const std::vector<float>& x, const std::vector<float>& y) {
    for (std::size_t i = 0; i < x.size(); ++i) e = std::max(e, std::abs(double(x[i]) - y[i]) / (1.0 + std::abs(y[i])));
  };
  cmp(a.out, b.out);
  cmp(a.dq, b.dq);
  cmp(a.dk, b.dk);
  cmp(a.dv, b.dv);
  return e;
}

}  // namespace example
