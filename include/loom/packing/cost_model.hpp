#pragma once

//! @file
//! The cost model shared by the packers, the context-parallel shard plans and the parallel-degree
//! planner: a document of length l costs alpha * (causal pairs of l) + beta * l + gamma.
//! Pair counts are exact integers; the causal pairs of a document include the diagonal.

#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <cmath>
#include <cstdint>
#include <span>

namespace loom::packing {

//! The longest document whose causal pairs n (n + 1) / 2 fit a 64-bit count: 2^32 - 1 tokens.
inline constexpr index_t max_causal_length = 4294967295;

//! Causal (query, key) pairs of a document of n tokens, diagonal included: n (n + 1) / 2.
//! @throws loom::error(invalid_argument) if n < 0 or n > max_causal_length (the count would
//! overflow a 64-bit integer).
constexpr std::int64_t causal_pairs(index_t n) {
  LOOM_EXPECTS(n >= 0, errc::invalid_argument, "causal_pairs: length must be >= 0, got ", n);
  LOOM_EXPECTS(n <= max_causal_length, errc::invalid_argument, "causal_pairs: length must be <= ", max_causal_length,
               " (its n (n + 1) / 2 pairs must fit a 64-bit count), got ", n);
  return n % 2 == 0 ? (n / 2) * (n + 1) : n * ((n + 1) / 2);
}

//! Causal pairs whose query lies in the chunk [offset, offset + length) of one document: every
//! query attends to the offset earlier tokens and to its own prefix inside the chunk,
//! length * offset + length (length + 1) / 2. Summed over a partition of the document into chunks
//! it equals causal_pairs of the document.
//! @throws loom::error(invalid_argument) if offset or length is negative or the count overflows
//! a 64-bit integer.
constexpr std::int64_t chunk_causal_pairs(index_t offset, index_t length) {
  LOOM_EXPECTS(offset >= 0 && length >= 0, errc::invalid_argument,
               "chunk_causal_pairs: offset and length must be >= 0, got ", offset, " and ", length);
  LOOM_EXPECTS(length <= max_causal_length, errc::invalid_argument,
               "chunk_causal_pairs: length must be <= ", max_causal_length,
               " (its length (length + 1) / 2 pairs must fit a 64-bit count), got ", length);
  return detail::checked_add(detail::checked_mul(length, offset, "chunk_causal_pairs: length * offset"),
                             causal_pairs(length), "chunk_causal_pairs: length * offset + length (length + 1) / 2");
}

//! cost(l) = alpha * causal_pairs(l) + beta * l + gamma (gamma once per document or piece).
//! alpha models attention, beta the per-token (GEMM, communication) work, gamma fixed overheads.
//! The pair counts are formed in long double, exact below 2^64 on x86 (2^53 at least anywhere),
//! and rounded once to double; they never overflow, so any length has a cost.
struct cost_model {
  double alpha = 1.0;
  double beta = 0.0;
  double gamma = 0.0;

  //! Cost of a whole document of `length` tokens (>= 0).
  [[nodiscard]] double operator()(index_t length) const { return chunk(0, length) + (length > 0 ? 0.0 : gamma); }
  //! Cost of the queries [offset, offset + length) of a document (one piece of it on some rank).
  [[nodiscard]] double chunk(index_t offset, index_t length) const {
    const auto l = static_cast<long double>(length), o = static_cast<long double>(offset);
    const auto pairs = static_cast<double>(l * o + l * (l + 1.0L) / 2.0L);
    return alpha * pairs + beta * static_cast<double>(length) + (length > 0 ? gamma : 0.0);
  }
};

//! One measurement for fit_cost_model: a document of `length` tokens took `seconds`.
struct cost_sample {
  index_t length;
  double seconds;
};

//! Least-squares fit of alpha, beta, gamma to measured samples (normal equations on the
//! features causal_pairs(l), l, 1, solved with partial pivoting in long double).
//! @throws loom::error(invalid_argument) for fewer than three distinct lengths, a length < 1, or a
//! non-finite time.
inline cost_model fit_cost_model(std::span<const cost_sample> samples) {
  long double a[3][4] = {};
  index_t distinct[3] = {-1, -1, -1};
  int seen = 0;
  for (const auto& s : samples) {
    LOOM_EXPECTS(s.length >= 1, errc::invalid_argument, "fit_cost_model: sample lengths must be >= 1, got ", s.length);
    LOOM_EXPECTS(std::isfinite(s.seconds), errc::invalid_argument, "fit_cost_model: sample time must be finite");
    if (seen < 3 && s.length != distinct[0] && s.length != distinct[1]) distinct[seen++] = s.length;
    const auto l = static_cast<long double>(s.length);
    const long double f[3] = {l * (l + 1.0L) / 2.0L, l, 1.0L};  // causal pairs, exact below 2^32 tokens
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) a[i][j] += f[i] * f[j];
      a[i][3] += f[i] * static_cast<long double>(s.seconds);
    }
  }
  LOOM_EXPECTS(seen >= 3, errc::invalid_argument,
               "fit_cost_model: need samples of at least 3 distinct lengths to fit alpha, beta and gamma, got ", seen);
  // Scale the columns so the pivoting compares like with like (pairs grow as l^2).
  long double scale[3];
  for (int j = 0; j < 3; ++j) {
    scale[j] = std::sqrt(a[j][j]);
    for (int i = 0; i < 3; ++i) a[i][j] /= scale[j];
  }
  for (int c = 0; c < 3; ++c) {
    int p = c;
    for (int r = c + 1; r < 3; ++r)
      if (std::fabs(a[r][c]) > std::fabs(a[p][c])) p = r;
    for (int k = 0; k < 4; ++k) std::swap(a[c][k], a[p][k]);
    LOOM_EXPECTS(a[c][c] != 0.0L, errc::invalid_argument, "fit_cost_model: the samples do not determine the model");
    for (int r = 0; r < 3; ++r) {
      if (r == c) continue;
      const long double m = a[r][c] / a[c][c];
      for (int k = c; k < 4; ++k) a[r][k] -= m * a[c][k];
    }
  }
  return {static_cast<double>(a[0][3] / a[0][0] / scale[0]), static_cast<double>(a[1][3] / a[1][1] / scale[1]),
          static_cast<double>(a[2][3] / a[2][2] / scale[2])};
}

}  // namespace loom::packing
