#pragma once

// fp64 serial oracle of exact attention: the scores of every (query, key) pair materialised, the
// softmax per row, and the analytic backward. Independent of loom's tiled kernels.

#include <loom/attention/options.hpp>
#include <loom/core/tensor_view.hpp>

#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace loom::test {

struct attn_shape {
  index_t tq, tk, hq, hkv, dk, dv;
  bool causal = true;
  loom::attention::window_size window{};  // (left, right), -1: unbounded
  std::optional<double> scale{};
  double sc() const { return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(dk)); }
};

struct attn_coords {
  std::vector<index_t> doc, pos;
};

// Coordinates of packed documents.
inline attn_coords packed(const std::vector<index_t>& cu) {
  attn_coords c;
  for (std::size_t s = 0; s + 1 < cu.size(); ++s)
    for (index_t t = cu[s]; t < cu[s + 1]; ++t) {
      c.doc.push_back(static_cast<index_t>(s));
      c.pos.push_back(t - cu[s]);
    }
  return c;
}

struct attn_result {
  std::vector<double> out, lse, dq, dk, dv;
};

inline bool attn_visible(const attn_shape& s, const attn_coords& qc, index_t i, const attn_coords& kc, index_t j) {
  // FlashAttention's window: i - left <= j <= i + right within one document.
  const index_t qi = qc.pos[i], kj = kc.pos[j];
  return qc.doc[i] == kc.doc[j] && (!s.causal || kj <= qi) && (s.window.left < 0 || kj >= qi - s.window.left) &&
         (s.window.right < 0 || kj <= qi + s.window.right);
}

// q [tq, hq, dk], k [tk, hkv, dk], v [tk, hkv, dv]; dout [tq, hq, dv] or empty (no backward).
inline attn_result attention_oracle(const attn_shape& s, const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v, const attn_coords& qc, const attn_coords& kc,
                                    const std::vector<double>& dout = {}) {
  attn_result r;
  r.out.assign(static_cast<std::size_t>(s.tq * s.hq * s.dv), 0.0);
  r.lse.assign(static_cast<std::size_t>(s.tq * s.hq), -std::numeric_limits<double>::infinity());
  const bool bwd = !dout.empty();
  if (bwd) {
    r.dq.assign(static_cast<std::size_t>(s.tq * s.hq * s.dk), 0.0);
    r.dk.assign(static_cast<std::size_t>(s.tk * s.hkv * s.dk), 0.0);
    r.dv.assign(static_cast<std::size_t>(s.tk * s.hkv * s.dv), 0.0);
  }
  const index_t group = s.hq / s.hkv;
  std::vector<double> sc(static_cast<std::size_t>(s.tk)), p(sc.size());
  for (index_t h = 0; h < s.hq; ++h) {
    const index_t hk = h / group;
    for (index_t i = 0; i < s.tq; ++i) {
      double mx = -std::numeric_limits<double>::infinity();
      for (index_t j = 0; j < s.tk; ++j) {
        if (!attn_visible(s, qc, i, kc, j)) {
          sc[j] = -std::numeric_limits<double>::infinity();
          continue;
        }
        double dot = 0;
        for (index_t c = 0; c < s.dk; ++c) dot += q[(i * s.hq + h) * s.dk + c] * k[(j * s.hkv + hk) * s.dk + c];
        sc[j] = dot * s.sc();
        mx = std::max(mx, sc[j]);
      }
      if (mx == -std::numeric_limits<double>::infinity()) continue;
      double sum = 0;
      for (index_t j = 0; j < s.tk; ++j) sum += (p[j] = std::exp(sc[j] - mx));
      r.lse[i * s.hq + h] = mx + std::log(sum);
      double* o = &r.out[(i * s.hq + h) * s.dv];
      for (index_t j = 0; j < s.tk; ++j) {
        p[j] /= sum;
        if (p[j] != 0)
          for (index_t c = 0; c < s.dv; ++c) o[c] += p[j] * v[(j * s.hkv + hk) * s.dv + c];
      }
      if (!bwd) continue;
      const double* g = &dout[(i * s.hq + h) * s.dv];
      double delta = 0;
      for (index_t c = 0; c < s.dv; ++c) delta += g[c] * o[c];
      for (index_t j = 0; j < s.tk; ++j) {
        if (p[j] == 0) continue;
        double dp = 0;
        for (index_t c = 0; c < s.dv; ++c) dp += g[c] * v[(j * s.hkv + hk) * s.dv + c];
        const double ds = p[j] * (dp - delta) * s.sc();
        for (index_t c = 0; c < s.dk; ++c) {
          r.dq[(i * s.hq + h) * s.dk + c] += ds * k[(j * s.hkv + hk) * s.dk + c];
          r.dk[(j * s.hkv + hk) * s.dk + c] += ds * q[(i * s.hq + h) * s.dk + c];
        }
        for (index_t c = 0; c < s.dv; ++c) r.dv[(j * s.hkv + hk) * s.dv + c] += p[j] * g[c];
      }
    }
  }
  return r;
}

// A whole packed sequence of random inputs and its fp64 oracle result (forward and backward), from
// which the distributed tests take each rank's rows.
struct sharded_inputs {
  attn_shape s;
  std::vector<index_t> cu;
  std::vector<double> q, k, v, dout;
  attn_result want;
};

inline sharded_inputs make_inputs_for(attn_shape s, std::vector<index_t> cu, std::uint64_t seed) {
  s.tq = s.tk = cu.back();
  sharded_inputs g{s,
                   cu,
                   uniform<double>(s.tq * s.hq * s.dk, -1, 1, seed),
                   uniform<double>(s.tk * s.hkv * s.dk, -1, 1, seed + 1),
                   uniform<double>(s.tk * s.hkv * s.dv, -1, 1, seed + 2),
                   uniform<double>(s.tq * s.hq * s.dv, -1, 1, seed + 3),
                   {}};
  const auto c = packed(cu);
  g.want = attention_oracle(s, g.q, g.k, g.v, c, c, g.dout);
  return g;
}

// Every token of [0, T) outside [begin, end), `per` values each: bitwise equal to the clean run
// (and finite there).
inline void require_same_outside(const std::vector<double>& got, const std::vector<double>& clean, index_t per,
                                 index_t begin, index_t end, const char* what) {
  REQUIRE(got.size() == clean.size());
  std::size_t differ = 0, non_finite = 0;
  for (std::size_t e = 0; e < got.size(); ++e) {
    const auto t = static_cast<index_t>(e) / per;
    if (t >= begin && t < end) continue;
    differ += std::memcmp(&got[e], &clean[e], sizeof(double)) != 0;
    non_finite += !std::isfinite(clean[e]);
  }
  INFO(what << ": tokens outside [" << begin << ", " << end << ")");
  CHECK(differ == 0);
  CHECK(non_finite == 0);
}

// Input `which` (0: q, 1: k, 2: v, 3: dout), token t, head 1, element 0 set to `bad`.
inline void poison(sharded_inputs& g, int which, index_t t, double bad) {
  const auto& s = g.s;
  if (which == 0) g.q[static_cast<std::size_t>((t * s.hq + 1) * s.dk)] = bad;
  if (which == 1) g.k[static_cast<std::size_t>((t * s.hkv + 1) * s.dk)] = bad;
  if (which == 2) g.v[static_cast<std::size_t>((t * s.hkv + 1) * s.dv)] = bad;
  if (which == 3) g.dout[static_cast<std::size_t>((t * s.hq + 1) * s.dv)] = bad;
}

}  // namespace loom::test
