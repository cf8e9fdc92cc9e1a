#pragma once

//! @file
//! The per-tile building blocks of exact attention, shared by every backend: a vectorisable exp, a
//! register-blocked tile product, and the mask of a (query tile, key tile) pair. Everything is
//! LOOM_HD and works on small dense tiles in the accumulation type.

#include <loom/attention/detail/attention_x86.hpp>
#include <loom/backend/detail/x86_gemm.hpp>
#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

//! The tiled kernels take the vector forms of their hot loops on x86 hosts, chosen at run time
//! whatever the build targets: the tile products loom::detail::x86::gemm (AVX-512 or AVX2 blocks),
//! the softmax rows attention_x86.hpp (AVX2).
#if defined(LOOM_X86_KERNELS) && !LOOM_IN_DEVICE_CODE
#define LOOM_ATTENTION_X86_TILES 1
#endif

namespace loom::attention::detail {

inline constexpr index_t tile_q = 64;  //!< query rows per tile
inline constexpr index_t tile_k = 64;  //!< key rows per tile

template <class Acc>
LOOM_HD constexpr Acc neg_inf() {
  return -std::numeric_limits<Acc>::infinity();
}

LOOM_HD inline float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

LOOM_HD inline std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

//! e^x for float, relative error below 3e-7 on (-87, 88.37): 0 at and below -87 (and for -inf),
//! +inf above (where float overflows), NaN for NaN, so a stale or non-finite exponent shows
//! instead of wrapping the exponent bits. Plain arithmetic and two selects, no float-to-int
//! conversion (k is read from the bits of t + 1.5 * 2^23), so loops over it vectorise and no
//! input is undefined behaviour. Double uses the library exp (the oracle precision).
LOOM_HD inline float fast_exp(float x) {
  constexpr float magic = 12582912.0f;               // 1.5 * 2^23: t + magic holds round(t) in its low bits
  const float z = x * 1.44269504088896341f + magic;  // x = k ln2 + r, k integer, |r| <= ln2 / 2
  const float kf = z - magic;
  const std::uint32_t k = float_to_bits(z) - float_to_bits(magic);  // round(t) mod 2^32 (unsigned: no overflow)
  const float r = (x - kf * 0.693145752f) - kf * 1.42860677e-6f;    // ln 2 split in two (Cody-Waite)
  // e^r: Taylor terms up to r^7 (error below 1e-8 for |r| <= 0.35); NaN stays NaN
  float p = 1.9841270e-4f;
  p = p * r + 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float e = p * bits_to_float((k + 127u) << 23);
  const float hi = x > 88.37f ? std::numeric_limits<float>::infinity() : e;
  return x <= -87.0f ? 0.0f : hi;  // NaN compares false both times: e, which is NaN
}
LOOM_HD inline double fast_exp(double x) { return x == neg_inf<double>() ? 0.0 : std::exp(x); }

//! s itself when finite, NaN when s is +-inf or NaN: a score that overflowed, or came from a
//! non-finite q or k, must poison its row instead of reading as "masked" (-inf) or dominating it.
template <class Acc>
LOOM_HD Acc finite_or_nan(Acc s) {
  return s - s == Acc(0) ? s : std::numeric_limits<Acc>::quiet_NaN();
}

//! True when the n x d block (leading dimension ld) holds only finite values: no element, converted
//! to float or double, has every exponent bit set (an or of integer compares, which vectorises; no
//! branch per element). T is the accumulation type or a storage type.
template <class T>
LOOM_HD bool all_finite(const T* x, index_t n, index_t d, index_t ld) {
  using A = std::conditional_t<std::is_same_v<std::remove_cv_t<T>, double>, double, float>;
  using U = std::conditional_t<sizeof(A) == 4, std::uint32_t, std::uint64_t>;
  constexpr U ones = sizeof(A) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  U bad = 0;
  for (index_t i = 0; i < n; ++i)
    for (index_t c = 0; c < d; ++c) {
      const A a = static_cast<A>(x[i * ld + c]);
      U u;
      std::memcpy(&u, &a, sizeof u);
      bad |= (u & ones) == ones ? U(1) : U(0);
    }
  return bad == 0;
}

//! C[i][j] (+)= sum_l A(i, l) B[l][j] for i < m, j < n, l < kd. A(i, l) = a[i * lda + l], or
//! a[l * lda + i] when `trans_a`. B, C row-major with leading dimensions ldb, ldc. Blocks of 8 rows
//! by 32 columns keep their sums in registers (16 vector registers of 16 floats with AVX-512); the
//! inner loop runs over contiguous j.
//! On x86 hosts (LOOM_ATTENTION_X86_TILES) with AVX2, float products take loom::detail::x86::gemm
//! instead: AVX-512 blocks where the CPU has them, else AVX2 ones, the same bits either way.
template <bool TransA, class Acc>
LOOM_HD void gemm(index_t m, index_t n, index_t kd, const Acc* a, index_t lda, const Acc* b, index_t ldb, Acc* c,
                  index_t ldc, bool accumulate) {
#if defined(LOOM_ATTENTION_X86_TILES)
  if constexpr (std::is_same_v<Acc, float>)
    if (loom::detail::x86::avx2_available())
      return loom::detail::x86::gemm(m, n, kd, a, TransA ? 1 : lda, TransA ? lda : 1, b, ldb, c, ldc, accumulate);
#endif
  constexpr index_t rb = 8, cb = 32;
  const index_t m_full = m - m % rb, n_full = n - n % cb;
  auto at = [&](index_t i, index_t l) { return TransA ? a[l * lda + i] : a[i * lda + l]; };
  for (index_t i0 = 0; i0 < m_full; i0 += rb) {
    for (index_t j0 = 0; j0 < n_full; j0 += cb) {
      Acc s[rb][cb];
      for (index_t r = 0; r < rb; ++r)
        for (index_t j = 0; j < cb; ++j) s[r][j] = accumulate ? c[(i0 + r) * ldc + j0 + j] : Acc(0);
      for (index_t l = 0; l < kd; ++l) {
        const Acc* brow = b + l * ldb + j0;
        Acc av[rb];
        for (index_t r = 0; r < rb; ++r) av[r] = at(i0 + r, l);
        for (index_t r = 0; r < rb; ++r)
          for (index_t j = 0; j < cb; ++j) s[r][j] += av[r] * brow[j];
      }
      for (index_t r = 0; r < rb; ++r)
        for (index_t j = 0; j < cb; ++j) c[(i0 + r) * ldc + j0 + j] = s[r][j];
    }
  }
  // The rows and columns the blocks left: one row at a time, contiguous j inner.
  auto row_range = [&](index_t i, index_t j_begin, index_t j_end) {
    Acc* crow = c + i * ldc;
    if (!accumulate)
      for (index_t j = j_begin; j < j_end; ++j) crow[j] = Acc(0);
    for (index_t l = 0; l < kd; ++l) {
      const Acc ail = at(i, l);
      const Acc* brow = b + l * ldb;
      for (index_t j = j_begin; j < j_end; ++j) crow[j] += ail * brow[j];
    }
  };
  if (n_full < n)
    for (index_t i = 0; i < m_full; ++i) row_range(i, n_full, n);
  for (index_t i = m_full; i < m; ++i) row_range(i, 0, n);
}

//! gemm() restricted to visible pairs: C row i (+)= sum over l with visible(i, l) of A(i, l) B[l].
//! Used when B holds a non-finite value and some (i, l) are masked: there A(i, l) is an exact 0,
//! and 0 * inf = NaN would carry one document's value into another's rows. Skipped terms are
//! exact zeros in gemm(), and the kept terms are added in gemm()'s order with its expression (a
//! fused multiply-add where gemm() runs x86::gemm), so every row whose visible B rows are finite
//! comes out bitwise as gemm() computes it.
template <bool TransA, class Acc, class Visible>
LOOM_HD void gemm_visible(index_t m, index_t n, index_t kd, const Acc* a, index_t lda, const Acc* b, index_t ldb,
                          Acc* c, index_t ldc, bool accumulate, const Visible& visible) {
  // Where gemm() takes x86::gemm, each of its terms is one fused multiply-add: so are these.
  bool fused = false;
#if defined(LOOM_ATTENTION_X86_TILES)
  if constexpr (std::is_same_v<Acc, float>) fused = loom::detail::x86::avx2_available();
#endif
  for (index_t i = 0; i < m; ++i) {
    Acc* crow = c + i * ldc;
    if (!accumulate)
      for (index_t j = 0; j < n; ++j) crow[j] = Acc(0);
    for (index_t l = 0; l < kd; ++l) {
      if (!visible(i, l)) continue;
      const Acc ail = TransA ? a[l * lda + i] : a[i * lda + l];
      const Acc* brow = b + l * ldb;
      if (fused)
        for (index_t j = 0; j < n; ++j) crow[j] = std::fma(ail, brow[j], crow[j]);
      else
        for (index_t j = 0; j < n; ++j) crow[j] += ail * brow[j];
    }
  }
}

//! Document and position range of a tile of tokens.
struct tile_bounds {
  index_t doc_min, doc_max, pos_min, pos_max;
  LOOM_HD bool one_doc() const { return doc_min == doc_max; }
};

LOOM_HD inline tile_bounds bounds_of(const index_t* doc, index_t doc_stride, const index_t* pos, index_t pos_stride,
                                     index_t begin, index_t count) {
  tile_bounds b{doc[begin * doc_stride], doc[begin * doc_stride], pos[begin * pos_stride], pos[begin * pos_stride]};
  for (index_t i = 1; i < count; ++i) {
    const index_t d = doc[(begin + i) * doc_stride], p = pos[(begin + i) * pos_stride];
    b.doc_min = d < b.doc_min ? d : b.doc_min;
    b.doc_max = d > b.doc_max ? d : b.doc_max;
    b.pos_min = p < b.pos_min ? p : b.pos_min;
    b.pos_max = p > b.pos_max ? p : b.pos_max;
  }
  return b;
}

enum class tile_kind { skip, full, partial };

//! How a (query tile, key tile) pair is masked, from the tiles' bounds alone (conservative:
//! "partial" means check every element). Window (left, right) as in options.hpp, -1 unbounded:
//! a pair is skipped when every (i, j) has j > i (causal), i - j > left or j - i > right, and is
//! full when every pair is inside all of them.
LOOM_HD inline tile_kind classify(const tile_bounds& q, const tile_bounds& k, bool causal, index_t left,
                                  index_t right) {
  if (k.doc_max < q.doc_min || k.doc_min > q.doc_max) return tile_kind::skip;
  const bool same = q.one_doc() && k.one_doc() && q.doc_min == k.doc_min;
  if (same) {
    if (causal && k.pos_min > q.pos_max) return tile_kind::skip;
    if (left >= 0 && q.pos_min - k.pos_max > left) return tile_kind::skip;
    if (right >= 0 && k.pos_min - q.pos_max > right) return tile_kind::skip;
    const bool causal_ok = !causal || k.pos_max <= q.pos_min;
    const bool left_ok = left < 0 || q.pos_max - k.pos_min <= left;
    const bool right_ok = right < 0 || k.pos_max - q.pos_min <= right;
    if (causal_ok && left_ok && right_ok) return tile_kind::full;
  }
  return tile_kind::partial;
}

//! The rows [r0, r1) and keys [c0, c1) of a partial (query tile, key tile) pair outside which
//! nothing is visible, from each token's coordinates against the other tile's bounds (necessary
//! conditions of `visible`, so the hull may hold masked pairs, never drops a visible one): a
//! query tile straddling two documents against a key tile of one of them keeps that document's
//! rows. Empty (r0 == r1 or c0 == c1) when no pair can be visible.
struct tile_hull {
  index_t r0, r1, c0, c1;
  LOOM_HD bool empty() const { return r0 >= r1 || c0 >= c1; }
};
template <class Coords>
LOOM_HD tile_hull hull_of(const Coords& qc, const Coords& kc, const tile_bounds& qb, const tile_bounds& kb, index_t q0,
                          index_t nq, index_t k0, index_t nk, bool causal, index_t left, index_t right) {
  const auto row_may_see = [&](index_t i) {
    const index_t d = qc.d(q0 + i), p = qc.p(q0 + i);
    return d >= kb.doc_min && d <= kb.doc_max && (!causal || p >= kb.pos_min) && (left < 0 || p - kb.pos_max <= left) &&
           (right < 0 || kb.pos_min - p <= right);
  };
  const auto key_may_be_seen = [&](index_t j) {
    const index_t d = kc.d(k0 + j), p = kc.p(k0 + j);
    return d >= qb.doc_min && d <= qb.doc_max && (!causal || p <= qb.pos_max) && (left < 0 || qb.pos_min - p <= left) &&
           (right < 0 || p - qb.pos_max <= right);
  };
  tile_hull h{0, nq, 0, nk};
  while (h.r0 < h.r1 && !row_may_see(h.r0)) ++h.r0;
  while (h.r1 > h.r0 && !row_may_see(h.r1 - 1)) --h.r1;
  while (h.c0 < h.c1 && !key_may_be_seen(h.c0)) ++h.c0;
  while (h.c1 > h.c0 && !key_may_be_seen(h.c1 - 1)) --h.c1;
  return h;
}

//! Whether query (qd, qp) sees key (kd, kp): same document, j <= i when causal, and
//! i - left <= j <= i + right (-1: unbounded).
LOOM_HD inline bool visible(index_t qd, index_t qp, index_t kd, index_t kp, bool causal, index_t left, index_t right) {
  return qd == kd && (!causal || kp <= qp) && (left < 0 || qp - kp <= left) && (right < 0 || kp - qp <= right);
}

}  // namespace loom::attention::detail
