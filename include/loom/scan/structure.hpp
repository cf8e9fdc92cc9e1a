#pragma once

//! @file
//! Structure tags for the transition A_t of a linear recurrence h_t = A_t h_{t-1} + b_t, with the
//! few products the scans need. For a state of size d, A_t is stored per time step as
//!   scalar               1 value           (A_t = a_t I)
//!   diagonal             d values          (A_t = diag(a_t))
//!   block_diagonal<K>    d/K blocks of K x K, row-major (d must be a multiple of K)
//!   dense                d x d, row-major
//! The products are LOOM_HD, out of place, and take A either as stored (any element type) or as
//! an accumulated aggregate (the same layout in the accumulation type).

#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>

#include <string_view>

namespace loom::scan {

struct scalar {
  static constexpr std::string_view name() noexcept { return "scalar"; }
  static constexpr std::size_t a_rank = 1;  //!< A is [T]
  LOOM_HD static constexpr index_t a_size(index_t) noexcept { return 1; }
  //! y = A x (tr: Aᵀ x)
  template <class X, class Acc>
  LOOM_HD static void matvec(const X* a, bool, index_t d, const Acc* x, Acc* y) {
    const Acc s = static_cast<Acc>(a[0]);
    for (index_t c = 0; c < d; ++c) y[c] = s * x[c];
  }
  //! out = A M, M and out aggregates of this structure
  template <class X, class Acc>
  LOOM_HD static void matmat(const X* a, bool, index_t, const Acc* m, Acc* out) {
    out[0] = static_cast<Acc>(a[0]) * m[0];
  }
  template <class Acc>
  LOOM_HD static void identity(index_t, Acc* m) {
    m[0] = Acc(1);
  }
};

struct diagonal {
  static constexpr std::string_view name() noexcept { return "diagonal"; }
  static constexpr std::size_t a_rank = 2;  //!< A is [T, d]
  LOOM_HD static constexpr index_t a_size(index_t d) noexcept { return d; }
  template <class X, class Acc>
  LOOM_HD static void matvec(const X* a, bool, index_t d, const Acc* x, Acc* y) {
    for (index_t c = 0; c < d; ++c) y[c] = static_cast<Acc>(a[c]) * x[c];
  }
  template <class X, class Acc>
  LOOM_HD static void matmat(const X* a, bool, index_t d, const Acc* m, Acc* out) {
    for (index_t c = 0; c < d; ++c) out[c] = static_cast<Acc>(a[c]) * m[c];
  }
  template <class Acc>
  LOOM_HD static void identity(index_t d, Acc* m) {
    for (index_t c = 0; c < d; ++c) m[c] = Acc(1);
  }
};

template <int K>
struct block_diagonal {
  static_assert(K >= 1 && K <= 16, "block_diagonal<K>: K must be in [1, 16]");
  static constexpr int block = K;
  static constexpr std::string_view name() noexcept { return "block_diagonal"; }
  static constexpr std::size_t a_rank = 4;  //!< A is [T, d / K, K, K]
  LOOM_HD static constexpr index_t a_size(index_t d) noexcept { return d * K; }
  template <class X, class Acc>
  LOOM_HD static void matvec(const X* a, bool tr, index_t d, const Acc* x, Acc* y) {
    for (index_t blk = 0; blk < d / K; ++blk) {
      const X* ab = a + blk * K * K;
      for (int i = 0; i < K; ++i) {
        Acc s = Acc(0);
        for (int j = 0; j < K; ++j) s += static_cast<Acc>(tr ? ab[j * K + i] : ab[i * K + j]) * x[blk * K + j];
        y[blk * K + i] = s;
      }
    }
  }
  template <class X, class Acc>
  LOOM_HD static void matmat(const X* a, bool tr, index_t d, const Acc* m, Acc* out) {
    for (index_t blk = 0; blk < d / K; ++blk) {
      const X* ab = a + blk * K * K;
      const Acc* mb = m + blk * K * K;
      for (int i = 0; i < K; ++i)
        for (int j = 0; j < K; ++j) {
          Acc s = Acc(0);
          for (int l = 0; l < K; ++l) s += static_cast<Acc>(tr ? ab[l * K + i] : ab[i * K + l]) * mb[l * K + j];
          out[blk * K * K + i * K + j] = s;
        }
    }
  }
  template <class Acc>
  LOOM_HD static void identity(index_t d, Acc* m) {
    for (index_t e = 0; e < d * K; ++e) m[e] = ((e % (K * K)) % (K + 1) == 0) ? Acc(1) : Acc(0);
  }
};

struct dense {
  static constexpr std::string_view name() noexcept { return "dense"; }
  static constexpr std::size_t a_rank = 3;  //!< A is [T, d, d]
  LOOM_HD static constexpr index_t a_size(index_t d) noexcept { return d * d; }
  template <class X, class Acc>
  LOOM_HD static void matvec(const X* a, bool tr, index_t d, const Acc* x, Acc* y) {
    if (tr) {
      for (index_t i = 0; i < d; ++i) y[i] = Acc(0);
      for (index_t j = 0; j < d; ++j) {
        const Acc xj = x[j];
        for (index_t i = 0; i < d; ++i) y[i] += static_cast<Acc>(a[j * d + i]) * xj;
      }
    } else {
      for (index_t i = 0; i < d; ++i) {
        Acc s = Acc(0);
        for (index_t j = 0; j < d; ++j) s += static_cast<Acc>(a[i * d + j]) * x[j];
        y[i] = s;
      }
    }
  }
  template <class X, class Acc>
  LOOM_HD static void matmat(const X* a, bool tr, index_t d, const Acc* m, Acc* out) {
    for (index_t e = 0; e < d * d; ++e) out[e] = Acc(0);
    for (index_t i = 0; i < d; ++i)
      for (index_t l = 0; l < d; ++l) {
        const Acc ail = static_cast<Acc>(tr ? a[l * d + i] : a[i * d + l]);
        for (index_t j = 0; j < d; ++j) out[i * d + j] += ail * m[l * d + j];
      }
  }
  template <class Acc>
  LOOM_HD static void identity(index_t d, Acc* m) {
    for (index_t i = 0; i < d; ++i)
      for (index_t j = 0; j < d; ++j) m[i * d + j] = i == j ? Acc(1) : Acc(0);
  }
};

//! One of the structure tags above (or a user type with the same members).
template <class S>
concept structure = requires(index_t d) {
  { S::a_size(d) } -> std::convertible_to<index_t>;
  { S::name() } -> std::convertible_to<std::string_view>;
  S::a_rank;
};

}  // namespace loom::scan
