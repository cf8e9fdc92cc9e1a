#pragma once

//! @file
//! AVX2 products of exact attention. The split-KV path (decode_kernels.hpp), float accumulation over
//! float, bfloat16 or half storage, read straight from K and V in their [tokens, kv heads, dim]
//! layout:
//!  - scores: key by key over every kv head and block of four query rows; four rows against one
//!    key at a time, 8 lanes of the dimension per FMA (the
//!    key's lanes loaded once for the four rows, two accumulators per row), the four sums reduced
//!    together by one horizontal-add tree;
//!  - P V: for 16 output columns, eight register accumulators (four rows x two halves) over every
//!    key of the block: two loads of V per key, one broadcast of p per row;
//! and the tiled kernels' softmax and probability rows. (Their tile product gemm() takes
//! loom::detail::x86::gemm, backend/detail/x86_gemm.hpp, AVX-512 or AVX2 blocks at run time: the
//! portable 8 x 32 blocks need 32 AVX2 registers; compiled for AVX2 they spill, measured 0.29x the
//! sgemm rate.)
//! AVX2 with FMA and F16C is the vector floor of x86-64 (every CPU loom's users run). Taken at run
//! time when the CPU has the instructions and vector kernels are allowed (loom::detail::x86), for
//! head dims that are multiples of 8; the portable LOOM_HD products of decode_kernels.hpp are the
//! fallback, the reference and the device code. Each sum is taken in a fixed order, so results are
//! identical on one machine for any backend and thread count, and within the tolerance of the
//! portable ones.

#include <loom/backend/detail/x86.hpp>
#include <loom/core/tensor_view.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace loom::attention::detail {

//! Asks for the cache lines of `bytes` bytes at p (host only; a hint, never a fault).
LOOM_HD inline void prefetch_row(const void* p, std::size_t bytes) {
#if !LOOM_IN_DEVICE_CODE && (defined(__GNUC__) || defined(__clang__))
  const char* c = static_cast<const char*>(p);
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
#else
  (void)p;
  (void)bytes;
#endif
}

//! Asks for the cache lines of `keys` x `heads` rows of `row_bytes` each (key k, head x at
//! base + k key_stride + x head_stride bytes), one line per step(), keys outer: the split-KV P V
//! products walk the next key tile's K rows with it, so the memory keeps streaming while they
//! compute from the cache (the scores pass streams K and V; the P V pass reads neither).
struct prefetch_cursor {
  const char* base = nullptr;
  index_t key_stride = 0, head_stride = 0, keys = 0, heads = 0, row_bytes = 0;
  index_t key = 0, head = 0, off = 0;
  // Device code has no prefetch: the cursor is empty there, so its steps cost nothing.
  LOOM_HD bool pending() const { return !LOOM_IN_DEVICE_CODE && key < keys; }
  LOOM_HD void step() {
    if (!pending()) return;
    prefetch_row(base + key * key_stride + head * head_stride + off, 1);
    if ((off += 64) < row_bytes) return;
    off = 0;
    if (++head < heads) return;
    head = 0;
    ++key;
  }
};

//! The register blocks of a split-KV work item that one key tile's scores cover: `heads` kv heads
//! of `blocks` blocks of four query rows each. Block b of head x reads the query rows at
//! q + x q_head + 4 b dk and the K rows at k + x k_head; each key's V rows are at v + x v_head.
struct decode_blocks {
  index_t heads = 1, blocks = 1;
  index_t q_head = 0;              //!< floats between two heads' query rows
  index_t k_head = 0, v_head = 0;  //!< elements between two kv heads' K (V) rows of one key
};

}  // namespace loom::attention::detail

#if defined(LOOM_X86_KERNELS)

namespace loom::attention::detail::x86 {

using loom::detail::x86::load8;

//! Storage types the vector products read.
template <class T>
inline constexpr bool vector_storage =
    std::is_same_v<T, float> || std::is_same_v<T, bfloat16> || std::is_same_v<T, half>;

//! Whether the vector products run for accumulation Acc, storage TK, TV and head dims dk, dv on
//! this CPU now.
template <class Acc, class TK, class TV>
inline bool vector_products(index_t dk, index_t dv) {
  if constexpr (std::is_same_v<Acc, float> && vector_storage<TK> && vector_storage<TV>)
    return dk % 8 == 0 && dv % 8 == 0 && loom::detail::x86::avx2_available();
  return false;
}

//! s[r * ld_s] = q_r . k for rows r < 4 (q row-major, row stride dk, a multiple of 8) and one key
//! row: 8 lanes of the dimension per FMA, the key's lanes loaded once for the four rows, two
//! accumulators per row, the four sums reduced together by one horizontal-add tree.
template <class TK>
LOOM_X86_AVX2 inline void dot4(const float* q, const TK* kr, index_t dk, float* s, index_t ld_s) {
  __m256 a[4][2];
  for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  index_t c0 = 0;
  for (; c0 + 16 <= dk; c0 += 16) {
    const __m256 k0 = load8(kr + c0), k1 = load8(kr + c0 + 8);
    for (int r = 0; r < 4; ++r) {
      a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dk + c0), k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dk + c0 + 8), k1, a[r][1]);
    }
  }
  if (c0 < dk) {  // a last 8
    const __m256 k0 = load8(kr + c0);
    for (int r = 0; r < 4; ++r) a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dk + c0), k0, a[r][0]);
  }
  const __m256 t0 = _mm256_hadd_ps(_mm256_add_ps(a[0][0], a[0][1]), _mm256_add_ps(a[1][0], a[1][1]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_add_ps(a[2][0], a[2][1]), _mm256_add_ps(a[3][0], a[3][1]));
  const __m256 t2 = _mm256_hadd_ps(t0, t1);  // [r0, r1, r2, r3] in each 128-bit half
  alignas(16) float out[4];
  _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1)));
  s[0] = out[0];
  s[ld_s] = out[1];
  s[2 * ld_s] = out[2];
  s[3 * ld_s] = out[3];
}

//! The scores of every register block of a key tile, key by key (decode_blocks: the layout):
//! s[(x * blocks + b) * 4 * ld_s + r * ld_s + j] = q_{x, 4 b + r} . k_{x, j} for kv heads x, row
//! blocks b, rows r < 4 and keys j < nk. For each key the heads' K rows are read one after the
//! other (address order in a [tokens, kv heads, dim] layout, a stream the hardware prefetchers
//! follow: asking for K rows ahead as well was measured 12 % slower), and each key asks for the
//! heads' V rows (`v_bytes` each) that the P V products after the tile read (without it, 1.6x
//! slower).
template <class TK, class TV>
LOOM_X86_AVX2 inline void decode_scores(const float* q, const decode_blocks& lay, const TK* k, index_t ldk, index_t nk,
                                        index_t dk, float* s, index_t ld_s, const TV* v, index_t ldv,
                                        std::size_t v_bytes) {
  for (index_t j = 0; j < nk; ++j) {
    const TK* kr = k + j * ldk;
    for (index_t x = 0; x < lay.heads; ++x) prefetch_row(v + j * ldv + x * lay.v_head, v_bytes);
    for (index_t x = 0; x < lay.heads; ++x)
      for (index_t b = 0; b < lay.blocks; ++b)
        dot4(q + x * lay.q_head + b * 4 * dk, kr + x * lay.k_head, dk, s + ((x * lay.blocks + b) * 4) * ld_s + j, ld_s);
  }
}

//! Forces v into a register: decode_pv uses each loaded V vector for four rows, and GCC folded the
//! load into every row's FMA, one load turned into four (the product over cached tiles then ran at
//! 0.55x its rate, AMD EPYC family 25).
LOOM_X86_AVX2 inline void in_register(__m256& v) { __asm__("" : "+x"(v)); }

//! acc[r * dv + c] += sum_{j < nk} p[r * ld_p + j] v_j[c] for rows r < 4 (dv a multiple of 8, v
//! rows of stride ldv), keys j ascending (decode_scores asked for the rows); one line of `ahead`
//! asked for per key and 16 columns.
template <class TV>
LOOM_X86_AVX2 inline void decode_pv(const float* p, index_t ld_p, const TV* v, index_t ldv, index_t nk, index_t dv,
                                    float* acc, prefetch_cursor& ahead) {
  index_t c0 = 0;
  for (; c0 + 16 <= dv; c0 += 16) {
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) {
      a[r][0] = _mm256_loadu_ps(acc + r * dv + c0);
      a[r][1] = _mm256_loadu_ps(acc + r * dv + c0 + 8);
    }
    for (index_t j = 0; j < nk; ++j) {
      ahead.step();
      const TV* vr = v + j * ldv + c0;
      __m256 v0 = load8(vr), v1 = load8(vr + 8);
      in_register(v0);
      in_register(v1);
      for (int r = 0; r < 4; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p + r * ld_p + j);
        a[r][0] = _mm256_fmadd_ps(pr, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pr, v1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_storeu_ps(acc + r * dv + c0, a[r][0]);
      _mm256_storeu_ps(acc + r * dv + c0 + 8, a[r][1]);
    }
  }
  if (c0 < dv) {  // a last 8 columns
    __m256 a[4];
    for (int r = 0; r < 4; ++r) a[r] = _mm256_loadu_ps(acc + r * dv + c0);
    for (index_t j = 0; j < nk; ++j) {
      const __m256 v0 = load8(v + j * ldv + c0);
      for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * ld_p + j), v0, a[r]);
    }
    for (int r = 0; r < 4; ++r) _mm256_storeu_ps(acc + r * dv + c0, a[r]);
  }
}

//! max(init, row[0..width)) (width a multiple of 16), where a NaN element is passed over
//! (local_kernels.hpp's row_max: each step keeps x > m ? x : m, which is what maxps computes).
//! The max of row_max's two 8-lane partial maxima a (even vectors) and b (odd ones), in its order.
LOOM_X86_AVX2 inline float reduce_max8(__m256 a, __m256 b) {
  a = _mm256_max_ps(b, a);
  __m128 h = _mm_max_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  h = _mm_max_ps(_mm_movehl_ps(h, h), h);
  return _mm_cvtss_f32(_mm_max_ss(_mm_shuffle_ps(h, h, 1), h));
}
LOOM_X86_AVX2 inline float row_max(const float* row, index_t width, float init) {
  __m256 a = _mm256_set1_ps(init), b = a;
  for (index_t j = 0; j < width; j += 16) {
    a = _mm256_max_ps(_mm256_loadu_ps(row + j), a);
    b = _mm256_max_ps(_mm256_loadu_ps(row + j + 8), b);
  }
  return reduce_max8(a, b);
}

//! e^x in 8 lanes (exp8): tile.hpp's fast_exp (the same range reduction and polynomial, relative
//! error below 3e-7 on (-87, 88.37); 0 at and below -87, +inf above 88.37, NaN for NaN), in parts:
//! the reduction and polynomial times 2^k (exp8_unclamped), then the two range tests.
LOOM_X86_AVX2 inline __m256 exp8_unclamped(__m256 x) {
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 kf = _mm256_sub_ps(z, magic);
  const __m256i k = _mm256_sub_epi32(_mm256_castps_si256(z), _mm256_castps_si256(magic));
  const __m256 r =
      _mm256_fnmadd_ps(kf, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(kf, _mm256_set1_ps(0.693145752f), x));
  __m256 p = _mm256_set1_ps(1.9841270e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3888889e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)));
}
//! e where x > -87 (or NaN), 0 where x <= -87.
LOOM_X86_AVX2 inline __m256 exp8_underflow(__m256 x, __m256 e) {
  return _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LE_OQ));
}
LOOM_X86_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_blendv_ps(exp8_unclamped(x), _mm256_set1_ps(__builtin_inff()),
                                     _mm256_cmp_ps(x, _mm256_set1_ps(88.37f), _CMP_GT_OQ));
  return exp8_underflow(x, hi);
}
//! exp8 of an x that is <= 0, -inf or NaN (a score minus its row's max): the same bits without the
//! overflow test (nothing overflows).
LOOM_X86_AVX2 inline __m256 exp8_nonpositive(__m256 x) { return exp8_underflow(x, exp8_unclamped(x)); }

//! y[i] = exp8(x[i]) for i < n (a multiple of 8): the vector exp on an array (its tests).
LOOM_X86_AVX2 inline void exp_array(const float* x, float* y, index_t n) {
  for (index_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
}

//! x where finite, NaN where x is +-inf or NaN (tile.hpp's finite_or_nan).
LOOM_X86_AVX2 inline __m256 finite_or_nan8(__m256 x) {
  return _mm256_blendv_ps(_mm256_set1_ps(__builtin_nanf("")), x,
                          _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_EQ_OQ));
}

//! Lanes j < n of 8 lanes starting at j0 (j0 + lane < n).
LOOM_X86_AVX2 inline __m256 lanes_below(index_t j0, index_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j0)), lane));
}

//! The probabilities of one softmax row of `width` scores (a multiple of 8) against its new max
//! mx (finite): row[j] = e^(row[j] - mx), where `full` (every key visible) a non-finite score is
//! NaN first and entries j >= nk are 0. Returns the row's sum (8 lanes, then their fixed tree).
LOOM_X86_AVX2 inline float exp_row(float* row, index_t width, index_t nk, bool full, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (index_t j = 0; j < width; j += 8) {
    __m256 x = _mm256_loadu_ps(row + j);
    if (full) x = finite_or_nan8(x);
    __m256 e = exp8_nonpositive(_mm256_sub_ps(x, m));  // x <= m, the row's max
    if (full) e = _mm256_and_ps(e, lanes_below(j, nk));
    _mm256_storeu_ps(row + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

//! One row of the backward's probabilities and score gradients (local_kernels.hpp's
//! backward_scores): p = e^(finite_or_nan(s) - lse) and ds = p (dp - delta) where seen, exact 0
//! elsewhere; seen: j < nk and (full or s != -inf). lse is not +inf (the caller made it NaN).
LOOM_X86_AVX2 inline void backward_row(float* srow, float* drow, index_t width, index_t nk, bool full, float lse,
                                       float delta) {
  const __m256 l = _mm256_set1_ps(lse), dl = _mm256_set1_ps(delta), ninf = _mm256_set1_ps(-__builtin_inff());
  for (index_t j = 0; j < width; j += 8) {
    const __m256 s = _mm256_loadu_ps(srow + j);
    __m256 seen = lanes_below(j, nk);
    if (!full) seen = _mm256_and_ps(seen, _mm256_cmp_ps(s, ninf, _CMP_NEQ_UQ));
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(finite_or_nan8(s), l)), seen);
    const __m256 ds = _mm256_and_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(drow + j), dl)), seen);
    _mm256_storeu_ps(srow + j, p);
    _mm256_storeu_ps(drow + j, ds);
  }
}

//! The lanes of v that are not finite (all exponent bits set: +-inf or NaN), as all-ones lanes.
//! (The four-row steps test a whole row by the FMA test instead: z = v * 0 + z stays +0
//! from z = +0 while every v is finite, since v * 0 is an exact +-0, and is NaN from the first
//! +-inf or NaN on, since inf * 0 is NaN.)
LOOM_X86_AVX2 inline __m256i nonfinite_lanes8(__m256 v) {
  const __m256i ones = _mm256_set1_epi32(0x7f800000);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), ones), ones);
}

//! Whether row[0, n) holds only finite values (tile.hpp's all_finite of one row), 8 lanes a step.
LOOM_X86_AVX2 inline bool finite_row8(const float* row, index_t n) {
  __m256i bad = _mm256_setzero_si256();
  index_t j = 0;
  for (; j + 8 <= n; j += 8) bad = _mm256_or_si256(bad, nonfinite_lanes8(_mm256_loadu_ps(row + j)));
  if (j < n) {  // masked lanes load as 0, a finite value
    const __m256i tail = _mm256_castps_si256(lanes_below(j, n));
    bad = _mm256_or_si256(bad, nonfinite_lanes8(_mm256_maskload_ps(row + j, tail)));
  }
  return _mm256_testz_si256(bad, bad) != 0;
}

//! rows_max4 (below) in 8 lanes: four rows' finiteness tests of [0, nk) and their maxima from m[r],
//! each in row_max's order (two partial maxima, reduce_max8), in one pass over the four.
template <int W>
LOOM_X86_AVX2 inline bool rows_max4_avx2(float* s, index_t nk, const float* m, float* mx) {
  static_assert(W % 16 == 0, "row_max's order takes 16 scores a step");
  __m256 a[4], b[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    for (index_t j = nk; j < W; ++j) s[r * W + j] = -__builtin_inff();
    a[r] = b[r] = _mm256_set1_ps(m[r]);
  }
  if (nk == W) {  // every entry tested: one FMA a vector (the FMA test, nonfinite_lanes8) instead of a compare
    const __m256 zero = _mm256_setzero_ps();
    __m256 z[4] = {zero, zero, zero, zero};
    for (index_t j = 0; j < W; j += 16)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 v0 = _mm256_loadu_ps(s + r * W + j), v1 = _mm256_loadu_ps(s + r * W + j + 8);
        z[r] = _mm256_fmadd_ps(v1, zero, _mm256_fmadd_ps(v0, zero, z[r]));
        a[r] = _mm256_max_ps(v0, a[r]);
        b[r] = _mm256_max_ps(v1, b[r]);
      }
    const __m256 t = _mm256_add_ps(_mm256_add_ps(z[0], z[1]), _mm256_add_ps(z[2], z[3]));
    if (_mm256_movemask_ps(_mm256_cmp_ps(t, t, _CMP_UNORD_Q)) != 0) return false;
  } else {
    __m256i bad = _mm256_setzero_si256();
    for (index_t j = 0; j < W; j += 16) {
      const __m256i valid0 = _mm256_castps_si256(lanes_below(j, nk)),
                    valid1 = _mm256_castps_si256(lanes_below(j + 8, nk));
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 v0 = _mm256_loadu_ps(s + r * W + j), v1 = _mm256_loadu_ps(s + r * W + j + 8);
        bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_and_si256(nonfinite_lanes8(v0), valid0),
                                                   _mm256_and_si256(nonfinite_lanes8(v1), valid1)));
        a[r] = _mm256_max_ps(v0, a[r]);
        b[r] = _mm256_max_ps(v1, b[r]);
      }
    }
    if (_mm256_testz_si256(bad, bad) == 0) return false;
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) mx[r] = reduce_max8(a[r], b[r]);
  return true;
}

//! row[0, n) *= alpha, 8 lanes a step.
LOOM_X86_AVX2 inline void scale_row8(float* row, index_t n, float alpha) {
  const __m256 a = _mm256_set1_ps(alpha);
  index_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), a));
  if (j < n) {
    const __m256i tail = _mm256_castps_si256(lanes_below(j, n));
    _mm256_maskstore_ps(row + j, tail, _mm256_mul_ps(_mm256_maskload_ps(row + j, tail), a));
  }
}

// GCC 12's AVX-512 intrinsics build their pass-through operands from _mm512_undefined_*(), which
// -Wmaybe-uninitialized reports once inlined into a function with a target attribute.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

//! The 16-lane (AVX-512) forms of row_max, exp8 and exp_row, lane for lane the same operations,
//! so the same bits: exp_row16 adds each 16-lane vector's halves into exp_row's 8-lane sum in
//! exp_row's order. On an Intel Xeon (family 6, model 207) the 8-lane softmax rows took 21 % of
//! the float forward's time (T = 4096, 16 / 4 heads, d = 128, causal, 1 thread).
LOOM_X86_AVX512 inline float row_max16(const float* row, index_t width, float init) {
  __m512 a = _mm512_set1_ps(init);
  for (index_t j = 0; j < width; j += 16) a = _mm512_max_ps(_mm512_loadu_ps(row + j), a);
  return _mm512_reduce_max_ps(a);
}

//! exp16's range reduction: z = x log2(e) + exp16_shift holds k = round(x log2(e)) in its low
//! mantissa bits, and kf = z - exp16_shift is k as a float (exp16_kf).
inline constexpr float exp16_shift = 12582912.0f;  // 1.5 * 2^23
LOOM_X86_AVX512 inline __m512 exp16_z(__m512 x) {
  return _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(exp16_shift));
}
LOOM_X86_AVX512 inline __m512 exp16_kf(__m512 z) { return _mm512_sub_ps(z, _mm512_set1_ps(exp16_shift)); }
//! p(r) ~ e^r for r = x - k ln 2 (Cody-Waite), the polynomial of tile.hpp's fast_exp.
LOOM_X86_AVX512 inline __m512 exp16_poly(__m512 x, __m512 kf) {
  const __m512 r =
      _mm512_fnmadd_ps(kf, _mm512_set1_ps(1.42860677e-6f), _mm512_fnmadd_ps(kf, _mm512_set1_ps(0.693145752f), x));
  __m512 p = _mm512_set1_ps(1.9841270e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3888889e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
}

LOOM_X86_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 z = exp16_z(x);
  const __m512i k = _mm512_sub_epi32(_mm512_castps_si512(z), _mm512_castps_si512(_mm512_set1_ps(exp16_shift)));
  const __m512 two_k = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, _mm512_set1_epi32(127)), 23));
  const __m512 e = _mm512_mul_ps(exp16_poly(x, exp16_kf(z)), two_k);
  const __m512 hi = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.37f), _CMP_GT_OQ), e,
                                         _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LE_OQ), hi, _mm512_setzero_ps());
}

//! exp16 of an x that is <= 0, -inf or NaN (a score minus its row's max): the same bits in fewer
//! operations. Nothing overflows, and p(r) 2^k is one vscalefps: every x > -87 has k >= -126, so
//! 2^k is a normal float and vscalefps rounds p(r) 2^k once, as exp16's multiply does.
LOOM_X86_AVX512 inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 kf = exp16_kf(exp16_z(x));
  const __m512 e = _mm512_scalef_ps(exp16_poly(x, kf), kf);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LE_OQ), e, _mm512_setzero_ps());
}

//! finite_or_nan8 and lanes_below in 16 lanes.
LOOM_X86_AVX512 inline __m512 finite_or_nan16(__m512 x) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_EQ_OQ),
                              _mm512_set1_ps(__builtin_nanf("")), x);
}
LOOM_X86_AVX512 inline __mmask16 lanes_below16(index_t j0, index_t n) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(n - j0)), lane);
}

LOOM_X86_AVX512 inline float exp_row16(float* row, index_t width, index_t nk, bool full, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (index_t j = 0; j < width; j += 16) {
    __m512 x = _mm512_loadu_ps(row + j);
    if (full) x = finite_or_nan16(x);
    __m512 e = exp16_nonpositive(_mm512_sub_ps(x, m));           // x <= m, the row's max
    if (full) e = _mm512_maskz_mov_ps(lanes_below16(j, nk), e);  // entries j >= nk are 0
    _mm512_storeu_ps(row + j, e);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
    sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

//! backward_row in 16 lanes (the same operations lane for lane, so the same bits).
LOOM_X86_AVX512 inline void backward_row16(float* srow, float* drow, index_t width, index_t nk, bool full, float lse,
                                           float delta) {
  const __m512 l = _mm512_set1_ps(lse), dl = _mm512_set1_ps(delta), ninf = _mm512_set1_ps(-__builtin_inff());
  for (index_t j = 0; j < width; j += 16) {
    const __m512 s = _mm512_loadu_ps(srow + j);
    __mmask16 seen = lanes_below16(j, nk);
    if (!full) seen &= _mm512_cmp_ps_mask(s, ninf, _CMP_NEQ_UQ);
    const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(finite_or_nan16(s), l)));
    const __m512 ds = _mm512_maskz_mov_ps(seen, _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(drow + j), dl)));
    _mm512_storeu_ps(srow + j, p);
    _mm512_storeu_ps(drow + j, ds);
  }
}

//! The lanes of `lanes` whose value in v is not finite (all exponent bits set: +-inf or NaN).
LOOM_X86_AVX512 inline __mmask16 nonfinite_lanes16(__m512 v, __mmask16 lanes) {
  const __m512i ones = _mm512_set1_epi32(0x7f800000);
  return _mm512_mask_cmpeq_epi32_mask(lanes, _mm512_and_si512(_mm512_castps_si512(v), ones), ones);
}

//! Whether row[0, n) holds only finite values (tile.hpp's all_finite of one row), 16 lanes a step.
LOOM_X86_AVX512 inline bool finite_row16(const float* row, index_t n) {
  __mmask16 bad = 0;
  index_t j = 0;
  for (; j + 16 <= n; j += 16) bad |= nonfinite_lanes16(_mm512_loadu_ps(row + j), 0xffff);
  if (j < n) {
    const __mmask16 tail = loom::detail::x86::first_lanes(static_cast<unsigned>(n - j));
    bad |= nonfinite_lanes16(_mm512_maskz_loadu_ps(tail, row + j), tail);
  }
  return bad == 0;
}

//! Four rows of a tile whose keys are all visible (softmax_update's `full`), W scores a row, the
//! first nk valid: the first step of the online softmax for the four at once, so that their chains
//! of dependent operations overlap. Per row one pass over its W scores (the entries past nk set to
//! -inf first, as the per-row path does) takes finite_row16's test of [0, nk) (nonfinite_lanes16) and row_max16's max
//! from init m[r], in row_max16's order. Returns false when a row holds a score that is not finite
//! (the caller then takes its per-row path, which makes such a row NaN; the scores are unchanged
//! apart from the -inf past nk). Otherwise mx[r] is row r's new max.
template <int W>
LOOM_X86_AVX512 inline bool rows_max4(float* s, index_t nk, const float* m, float* mx) {
  __m512 a[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    for (index_t j = nk; j < W; ++j) s[r * W + j] = -__builtin_inff();
    a[r] = _mm512_set1_ps(m[r]);
  }
  if (nk == W) {  // every entry tested: one FMA a vector (the FMA test, nonfinite_lanes8) instead of a compare
    const __m512 zero = _mm512_setzero_ps();
    __m512 z[4] = {zero, zero, zero, zero};
    for (index_t j = 0; j < W; j += 16)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m512 v = _mm512_loadu_ps(s + r * W + j);
        z[r] = _mm512_fmadd_ps(v, zero, z[r]);
        a[r] = _mm512_max_ps(v, a[r]);
      }
    const __m512 t = _mm512_add_ps(_mm512_add_ps(z[0], z[1]), _mm512_add_ps(z[2], z[3]));
    if (_mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q) != 0) return false;
  } else {
    __mmask16 bad = 0;
    for (index_t j = 0; j < W; j += 16) {
      const __mmask16 valid = lanes_below16(j, nk);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m512 v = _mm512_loadu_ps(s + r * W + j);
        bad |= nonfinite_lanes16(v, valid);
        a[r] = _mm512_max_ps(v, a[r]);
      }
    }
    if (bad != 0) return false;
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) mx[r] = _mm512_reduce_max_ps(a[r]);
  return true;
}

//! row[0, n) *= alpha, 16 lanes a step.
LOOM_X86_AVX512 inline void scale_row16(float* row, index_t n, float alpha) {
  const __m512 a = _mm512_set1_ps(alpha);
  index_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), a));
  if (j < n) {
    const __mmask16 tail = loom::detail::x86::first_lanes(static_cast<unsigned>(n - j));
    _mm512_mask_storeu_ps(row + j, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + j), a));
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

//! Rows [0, nq) of a probability tile (W floats a row) as bfloat16 rows of W values (rounded to
//! nearest even), written in place from the start of s: each row's floats are read before its
//! bfloat16 values are stored, which overwrite rows already read only. Returns the bfloat16 rows.
template <int W>
LOOM_X86_AVX512_BF16 inline const std::uint16_t* probs_to_bf16(float* s, index_t nq) {
  static_assert(W % 16 == 0, "whole vectors of 16 floats a row");
  auto* out = reinterpret_cast<std::uint16_t*>(s);
  for (index_t i = 0; i < nq; ++i) {
    __m256i h[W / 16];
#pragma GCC unroll 4
    for (int v = 0; v < W / 16; ++v) h[v] = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i * W + 16 * v));
#pragma GCC unroll 4
    for (int v = 0; v < W / 16; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * W + 16 * v), h[v]);
  }
  return out;
}

}  // namespace loom::attention::detail::x86

#endif
