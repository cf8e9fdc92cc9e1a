#pragma once

// fp64 serial oracles for the scan tests: the token-by-token loops, written independently of
// loom's engine, with transitions expanded to full d x d matrices.

#include <loom/core/tensor_view.hpp>

#include <cstdint>
#include <vector>

namespace loom::test {

// 2 x 2 matrices over the integers mod 2^64: an exact, associative, non-commutative monoid.
struct mat2 {
  std::uint64_t a, b, c, d;
  friend bool operator==(const mat2&, const mat2&) = default;
};
struct mat2_product {
  using value_type = mat2;
  LOOM_HD mat2 identity() const { return {1, 0, 0, 1}; }
  LOOM_HD mat2 combine(const mat2& x, const mat2& y) const {
    return {x.a * y.a + x.b * y.c, x.a * y.b + x.b * y.d, x.c * y.a + x.d * y.c, x.c * y.b + x.d * y.d};
  }
};

// Full d x d matrix of step t for each structure, from a flat per-step array.
enum class shape { scalar, diagonal, block2, block3, block4, dense };

inline index_t block_of(shape s) {
  return s == shape::block2 ? 2 : s == shape::block3 ? 3 : s == shape::block4 ? 4 : 0;
}

inline index_t a_size(shape s, index_t d) {
  switch (s) {
    case shape::scalar:
      return 1;
    case shape::diagonal:
      return d;
    case shape::dense:
      return d * d;
    default:
      return d * block_of(s);
  }
}

inline std::vector<double> full_matrix(shape s, index_t d, const double* a) {
  std::vector<double> m(static_cast<std::size_t>(d * d), 0.0);
  if (s == shape::scalar) {
    for (index_t i = 0; i < d; ++i) m[i * d + i] = a[0];
  } else if (s == shape::diagonal) {
    for (index_t i = 0; i < d; ++i) m[i * d + i] = a[i];
  } else if (s == shape::dense) {
    for (index_t e = 0; e < d * d; ++e) m[e] = a[e];
  } else {
    const index_t k = block_of(s);
    for (index_t blk = 0; blk < d / k; ++blk)
      for (index_t i = 0; i < k; ++i)
        for (index_t j = 0; j < k; ++j) m[(blk * k + i) * d + blk * k + j] = a[(blk * k + i) * k + j];
  }
  return m;
}

// Forward oracle: h [T, d], finals [S, d]; offsets empty = one segment; init empty = zeros.
struct recurrence_oracle {
  std::vector<double> h, finals;
};

inline recurrence_oracle forward_oracle(shape s, index_t n, index_t d, const std::vector<double>& a,
                                        const std::vector<double>& b, std::vector<index_t> offsets,
                                        const std::vector<double>& init) {
  if (offsets.empty()) offsets = {0, n};
  const index_t segs = static_cast<index_t>(offsets.size()) - 1, as = a_size(s, d);
  recurrence_oracle r{std::vector<double>(static_cast<std::size_t>(n * d)),
                      std::vector<double>(static_cast<std::size_t>(segs * d))};
  for (index_t g = 0; g < segs; ++g) {
    std::vector<double> x(static_cast<std::size_t>(d), 0.0);
    if (!init.empty())
      for (index_t c = 0; c < d; ++c) x[c] = init[g * d + c];
    for (index_t t = offsets[g]; t < offsets[g + 1]; ++t) {
      const auto m = full_matrix(s, d, a.data() + t * as);
      std::vector<double> y(static_cast<std::size_t>(d));
      for (index_t i = 0; i < d; ++i) {
        double acc = b[t * d + i];
        for (index_t j = 0; j < d; ++j) acc += m[i * d + j] * x[j];
        y[i] = acc;
      }
      x = y;
      for (index_t c = 0; c < d; ++c) r.h[t * d + c] = x[c];
    }
    for (index_t c = 0; c < d; ++c) r.finals[g * d + c] = x[c];
  }
  return r;
}

// Adjoint oracle: lambda [T, d] and d_initial [S, d] from g [T, d] and d_final [S, d] (or empty).
inline recurrence_oracle adjoint_oracle(shape s, index_t n, index_t d, const std::vector<double>& a,
                                        const std::vector<double>& g, std::vector<index_t> offsets,
                                        const std::vector<double>& d_final) {
  if (offsets.empty()) offsets = {0, n};
  const index_t segs = static_cast<index_t>(offsets.size()) - 1, as = a_size(s, d);
  recurrence_oracle r{std::vector<double>(static_cast<std::size_t>(n * d)),
                      std::vector<double>(static_cast<std::size_t>(segs * d))};
  for (index_t q = 0; q < segs; ++q) {
    std::vector<double> next(static_cast<std::size_t>(d), 0.0);  // λ_{t+1} contribution: A_{t+1}ᵀ λ_{t+1}
    if (!d_final.empty())
      for (index_t c = 0; c < d; ++c) next[c] = d_final[q * d + c];
    for (index_t t = offsets[q + 1] - 1; t >= offsets[q]; --t) {
      std::vector<double> lam(static_cast<std::size_t>(d));
      for (index_t c = 0; c < d; ++c) lam[c] = g[t * d + c] + next[c];
      for (index_t c = 0; c < d; ++c) r.h[t * d + c] = lam[c];
      const auto m = full_matrix(s, d, a.data() + t * as);
      for (index_t j = 0; j < d; ++j) {
        double acc = 0;
        for (index_t i = 0; i < d; ++i) acc += m[i * d + j] * lam[i];
        next[j] = acc;
      }
    }
    for (index_t c = 0; c < d; ++c) r.finals[q * d + c] = next[c];
  }
  return r;
}

}  // namespace loom::test
