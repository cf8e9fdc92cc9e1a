#pragma once

// The fp64 oracle of linear attention: the token-by-token recurrence S_t = g_t S_{t-1} + k_t v_t^T,
// o_t = scale S_t^T q_t, and its adjoint run backwards token by token. Written independently of
// include/loom/linear_attention (no chunks). Plus a generator of test problems.

#include <loom/core/tensor_view.hpp>

#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::test::la {

enum class gating { none, fixed, scalar };

//! A problem in fp64: q, k [T, H, dk], v [T, H, dv], log-gates per token and head [T, H]
//! (constant per head for `fixed`, 0 for `none`), per-head log-decays [H], documents, states.
struct problem {
  index_t T = 0, H = 1, dk = 1, dv = 1;
  gating mode = gating::none;
  double scale = 1;
  std::vector<index_t> cu;
  std::vector<double> q, k, v, lg, head_lg, init;  // init: [docs, H, dk, dv] or empty
  index_t docs() const { return static_cast<index_t>(cu.size()) - 1; }
  double log_gate(index_t t, index_t h) const { return lg[static_cast<std::size_t>(t * H + h)]; }
};

//! Document lengths summing to T: random, with empty and single-token documents mixed in.
inline std::vector<index_t> random_docs(index_t T, int max_docs, std::uint64_t stream) {
  auto g = rng(stream);
  std::vector<index_t> cuts{0, T};
  std::uniform_int_distribution<index_t> pos(0, T);
  for (int i = 0; i < max_docs - 1; ++i) cuts.push_back(pos(g));
  if (T > 3) {
    cuts.push_back(1);  // a single-token document at the front
    cuts.push_back(1);  // and an empty one
  }
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

inline problem make_problem(index_t T, index_t H, index_t dk, index_t dv, gating mode, std::vector<index_t> cu,
                            bool with_init, std::uint64_t stream) {
  problem p;
  p.T = T, p.H = H, p.dk = dk, p.dv = dv, p.mode = mode, p.cu = std::move(cu);
  p.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  p.q = uniform<double>(T * H * dk, -1, 1, stream * 8 + 1);
  p.k = uniform<double>(T * H * dk, -1, 1, stream * 8 + 2);
  p.v = uniform<double>(T * H * dv, -1, 1, stream * 8 + 3);
  p.head_lg.resize(static_cast<std::size_t>(H));
  for (index_t h = 0; h < H; ++h)
    p.head_lg[static_cast<std::size_t>(h)] = std::log(1.0 - std::pow(2.0, -3.0 - static_cast<double>(h)));
  p.lg.assign(static_cast<std::size_t>(T * H), 0.0);
  if (mode == gating::fixed)
    for (index_t t = 0; t < T; ++t)
      for (index_t h = 0; h < H; ++h)
        p.lg[static_cast<std::size_t>(t * H + h)] = p.head_lg[static_cast<std::size_t>(h)];
  if (mode == gating::scalar) p.lg = uniform<double>(T * H, -0.7, 0.0, stream * 8 + 4);
  if (with_init) p.init = uniform<double>(p.docs() * H * dk * dv, -1, 1, stream * 8 + 5);
  return p;
}

struct result {
  std::vector<double> o, fin;                  // [T, H, dv], [docs, H, dk, dv]
  std::vector<double> dq, dk, dv, dlg, dinit;  // gradients
};

//! Forward token by token, and (when d_o is given) the adjoint backwards token by token.
inline result oracle(const problem& p, const std::vector<double>* d_o = nullptr,
                     const std::vector<double>* dfin = nullptr) {
  const index_t H = p.H, dk = p.dk, dv = p.dv, sz = dk * dv;
  result r;
  r.o.assign(static_cast<std::size_t>(p.T * H * dv), 0.0);
  r.fin.assign(static_cast<std::size_t>(p.docs() * H * sz), 0.0);
  if (d_o) {
    r.dq.assign(p.q.size(), 0.0), r.dk.assign(p.k.size(), 0.0), r.dv.assign(p.v.size(), 0.0);
    r.dlg.assign(static_cast<std::size_t>(p.T * H), 0.0), r.dinit.assign(r.fin.size(), 0.0);
  }
  auto at = [](const std::vector<double>& x, index_t i) { return x[static_cast<std::size_t>(i)]; };
  for (index_t d = 0; d < p.docs(); ++d)
    for (index_t h = 0; h < H; ++h) {
      const index_t b = p.cu[static_cast<std::size_t>(d)], e = p.cu[static_cast<std::size_t>(d) + 1];
      // states[t - b + 1] = S_t; states[0] = the initial state.
      std::vector<std::vector<double>> states(static_cast<std::size_t>(e - b + 1), std::vector<double>(sz, 0.0));
      if (!p.init.empty())
        for (index_t x = 0; x < sz; ++x) states[0][x] = at(p.init, (d * H + h) * sz + x);
      for (index_t t = b; t < e; ++t) {
        const double g = std::exp(p.log_gate(t, h));
        auto& s = states[static_cast<std::size_t>(t - b + 1)];
        const auto& prev = states[static_cast<std::size_t>(t - b)];
        for (index_t i = 0; i < dk; ++i)
          for (index_t j = 0; j < dv; ++j)
            s[i * dv + j] = g * prev[i * dv + j] + at(p.k, (t * H + h) * dk + i) * at(p.v, (t * H + h) * dv + j);
        for (index_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (index_t i = 0; i < dk; ++i) acc += s[i * dv + j] * at(p.q, (t * H + h) * dk + i);
          r.o[static_cast<std::size_t>((t * H + h) * dv + j)] = p.scale * acc;
        }
      }
      for (index_t x = 0; x < sz; ++x) r.fin[(d * H + h) * sz + x] = states.back()[x];
      if (!d_o) continue;
      // Adjoint: D = adjoint of S_t, carried as g_{t+1} D_{t+1} from the right.
      std::vector<double> D(sz, 0.0);
      double dlg_acc = 0;
      if (dfin)
        for (index_t x = 0; x < sz; ++x) D[x] = at(*dfin, (d * H + h) * sz + x);
      for (index_t t = e; t-- > b;) {
        const auto& s = states[static_cast<std::size_t>(t - b + 1)];
        const auto& prev = states[static_cast<std::size_t>(t - b)];
        for (index_t i = 0; i < dk; ++i)
          for (index_t j = 0; j < dv; ++j)
            D[i * dv + j] += p.scale * at(p.q, (t * H + h) * dk + i) * at(*d_o, (t * H + h) * dv + j);
        for (index_t i = 0; i < dk; ++i) {
          double dq = 0, dkk = 0;
          for (index_t j = 0; j < dv; ++j) {
            dq += p.scale * s[i * dv + j] * at(*d_o, (t * H + h) * dv + j);
            dkk += D[i * dv + j] * at(p.v, (t * H + h) * dv + j);
          }
          r.dq[static_cast<std::size_t>((t * H + h) * dk + i)] = dq;
          r.dk[static_cast<std::size_t>((t * H + h) * dk + i)] = dkk;
        }
        for (index_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (index_t i = 0; i < dk; ++i) acc += D[i * dv + j] * at(p.k, (t * H + h) * dk + i);
          r.dv[static_cast<std::size_t>((t * H + h) * dv + j)] = acc;
        }
        const double g = std::exp(p.log_gate(t, h));
        double dg = 0;  // dL/dg_t = <D_t, S_{t-1}>; d log g = g dL/dg
        for (index_t x = 0; x < sz; ++x) dg += D[x] * prev[x];
        dlg_acc = g * dg;
        r.dlg[static_cast<std::size_t>(t * H + h)] = dlg_acc;
        for (index_t x = 0; x < sz; ++x) D[x] *= g;
      }
      for (index_t x = 0; x < sz; ++x) r.dinit[(d * H + h) * sz + x] = D[x];
    }
  return r;
}

//! The loss L = sum o . d_o + sum fin . dfin of the oracle (for finite differences).
inline double loss(const problem& p, const std::vector<double>& d_o, const std::vector<double>& dfin) {
  const auto r = oracle(p);
  double l = 0;
  for (std::size_t i = 0; i < r.o.size(); ++i) l += r.o[i] * d_o[i];
  for (std::size_t i = 0; i < r.fin.size(); ++i) l += r.fin[i] * dfin[i];
  return l;
}

//! The problem with its inputs rounded to precision P's storage (q, k, v) and accumulation (gates,
//! initial state) types, so the oracle sees exactly what the implementation reads.
template <class P>
problem rounded(problem p) {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  for (auto* x : {&p.q, &p.k, &p.v})
    for (double& y : *x) y = static_cast<double>(static_cast<S>(y));
  for (auto* x : {&p.lg, &p.head_lg, &p.init})
    for (double& y : *x) y = static_cast<double>(static_cast<A>(y));
  if (p.mode == gating::fixed)
    for (index_t t = 0; t < p.T; ++t)
      for (index_t h = 0; h < p.H; ++h)
        p.lg[static_cast<std::size_t>(t * p.H + h)] = p.head_lg[static_cast<std::size_t>(h)];
  return p;
}

//! Tolerance of precision P, its absolute part scaled by the RMS of the oracle values: the
//! outputs are sums of O(chunk + state) products, so their rounding scales with that magnitude.
template <class P>
tolerance scaled_tol(const std::vector<double>& oracle) {
  auto tol = tolerance_for<P>();
  double ss = 0;
  for (double x : oracle) ss += x * x;
  const double rms = oracle.empty() ? 0 : std::sqrt(ss / static_cast<double>(oracle.size()));
  tol.abs *= (rms > 1 ? rms : 1) * (std::is_same_v<typename P::storage_type, double> ? 1 : 4);
  return tol;
}

//! The gradients of `got` against `want` (dq, dk, dv, d initial state, and d log g where
//! `gate_gradient`) at precision P's scaled tolerances (scaled_tol of want's), each named by
//! `what` and the output.
template <class P, class Got, class Want>
void require_gradients_close(const Got& got, const Want& want, bool gate_gradient, const std::string& what = "") {
  auto name = [&](const char* x) { return what.empty() ? std::string(x) : what + " " + x; };
  loom::test::require_close(got.dq, want.dq, scaled_tol<P>(want.dq), name("dq"));
  loom::test::require_close(got.dk, want.dk, scaled_tol<P>(want.dk), name("dk"));
  loom::test::require_close(got.dv, want.dv, scaled_tol<P>(want.dv), name("dv"));
  loom::test::require_close(got.dinit, want.dinit, scaled_tol<P>(want.dinit), name("d initial state"));
  if (gate_gradient) loom::test::require_close(got.dlg, want.dlg, scaled_tol<P>(want.dlg), name("d log gate"));
}

}  // namespace loom::test::la
