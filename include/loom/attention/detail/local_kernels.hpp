#pragma once

//! @file
//! The tiled exact-attention kernels (online softmax, never the full score matrix): the forward
//! over (query tile, head) work items (on host backends, (query tile, query heads of one kv head),
//! each key tile read once for them), and the backward in two passes, one over (key tile, kv
//! head) items for dK and dV and one over (query tile, head) items for dQ, so that no two items
//! write the same output (deterministic, no atomics); or, on host backends, fused: one pass over
//! (key stripe, kv head) items that also sums dQ per stripe, then a sum over the stripes, in the
//! same order as the two-pass dQ. Items are dealt round-robin to `slots` (one per thread on the
//! host), each with its own scratch; the host forward's slots take them from a shared counter.

#include <loom/attention/detail/tile.hpp>
#include <loom/backend/detail/item_counter.hpp>

#include <cstdint>
#include <type_traits>

namespace loom::attention::detail {

//! A rank-3 [T, H, D] operand as pointer and strides (unit stride inside a row).
template <class T>
struct rows3 {
  T* p;
  index_t st, sh;
  LOOM_HD T* at(index_t t, index_t h) const { return p + t * st + h * sh; }
};

//! A [T, H] operand.
template <class T>
struct rows2 {
  T* p;
  index_t st, sh;
  LOOM_HD T& at(index_t t, index_t h) const { return p[t * st + h * sh]; }
};

struct token_coords {
  const index_t *doc, *pos;
  index_t sdoc, spos;
  LOOM_HD index_t d(index_t t) const { return doc[t * sdoc]; }
  LOOM_HD index_t p(index_t t) const { return pos[t * spos]; }
  LOOM_HD tile_bounds bounds(index_t begin, index_t count) const {
    return bounds_of(doc, sdoc, pos, spos, begin, count);
  }
};

//! Shapes and mask shared by the kernels.
struct problem {
  index_t tq, tk, hq, hkv, dk, dv;
  bool causal;
  index_t left, right;  //!< window (options.hpp), -1: unbounded
  LOOM_HD index_t group() const { return hq / hkv; }
  LOOM_HD index_t q_tiles() const { return (tq + tile_q - 1) / tile_q; }
  LOOM_HD index_t k_tiles() const { return (tk + tile_k - 1) / tile_k; }
};

//! Loads rows [r0, r0 + n) of head h into a row-major [n][d] tile (times `mul`).
template <class T, class Acc>
LOOM_HD void load_rows(const rows3<const T>& x, index_t r0, index_t n, index_t h, index_t d, Acc mul, Acc* out) {
  for (index_t i = 0; i < n; ++i) {
    const T* row = x.at(r0 + i, h);
    for (index_t c = 0; c < d; ++c) out[i * d + c] = static_cast<Acc>(row[c]) * mul;
  }
}

//! K and V of every kv head in the layouts the tile products read, in the accumulation type,
//! padded with zeros to whole key tiles: built once per call, so no (query tile, key tile) pair
//! transposes or converts anything. Any of the four may be absent (null).
//!   kt [hkv][k tiles][dk][tile_k]   vt [hkv][k tiles][dv][tile_k]   kr [hkv][tk_pad][dk]   vr [hkv][tk_pad][dv]
//! The transposed layouts keep each key tile's block contiguous (row stride tile_k, ld_t()): with
//! rows tk_pad apart, a tile product's column reads would all fall in one L1 set.
template <class Acc>
struct prepared_kv {
  Acc *kt = nullptr, *vt = nullptr, *kr = nullptr, *vr = nullptr;
  index_t tk_pad = 0, dk = 0, dv = 0;
  LOOM_HD const Acc* kt_tile(index_t hk, index_t k0) const { return kt + (hk * tk_pad + k0) * dk; }
  LOOM_HD const Acc* vt_tile(index_t hk, index_t k0) const { return vt + (hk * tk_pad + k0) * dv; }
  //! Row stride of a kt / vt tile block.
  LOOM_HD static constexpr index_t ld_t() { return tile_k; }
  //! Offset of element (c, t) of kv head hk in a transposed layout of d rows.
  LOOM_HD index_t t_at(index_t hk, index_t c, index_t t, index_t d) const {
    return (hk * tk_pad + t - t % tile_k) * d + c * tile_k + t % tile_k;
  }
  LOOM_HD const Acc* kr_tile(index_t hk, index_t k0) const { return kr + (hk * tk_pad + k0) * dk; }
  LOOM_HD const Acc* vr_tile(index_t hk, index_t k0) const { return vr + (hk * tk_pad + k0) * dv; }
  //! Elements needed for the layouts selected.
  LOOM_HD static index_t size(index_t hkv, index_t tk_pad, index_t dk, index_t dv, bool t, bool vt_, bool r, bool vr_) {
    return hkv * tk_pad * ((t ? dk : 0) + (vt_ ? dv : 0) + (r ? dk : 0) + (vr_ ? dv : 0));
  }
};

//! Fills one key tile of one kv head in every selected layout (one item per (kv head, key tile)).
template <class TK, class TV, class Acc>
struct prepare_kv_kernel {
  problem pb;
  rows3<const TK> k;
  rows3<const TV> v;
  prepared_kv<Acc> out;
  LOOM_HD void operator()(index_t item) const {
    const index_t hk = item / pb.k_tiles(), k0 = (item % pb.k_tiles()) * tile_k;
    for (index_t j = 0; j < tile_k; ++j) {
      const index_t t = k0 + j;
      const TK* krow = t < pb.tk ? k.at(t, hk) : nullptr;
      const TV* vrow = t < pb.tk ? v.at(t, hk) : nullptr;
      // Element (c, t) of a transposed layout sits at t_at(hk, c, t, d) = t_at(hk, 0, t, d) + c * tile_k.
      if (out.kt) fill_row(krow, pb.dk, out.kt + out.t_at(hk, 0, t, pb.dk), tile_k);
      if (out.kr) fill_row(krow, pb.dk, out.kr + (hk * out.tk_pad + t) * pb.dk, 1);
      if (out.vt) fill_row(vrow, pb.dv, out.vt + out.t_at(hk, 0, t, pb.dv), tile_k);
      if (out.vr) fill_row(vrow, pb.dv, out.vr + (hk * out.tk_pad + t) * pb.dv, 1);
    }
  }
  //! dst[c * stride] = row[c] in the accumulation type for c < d; zeros for a padding key (null row).
  template <class T>
  LOOM_HD static void fill_row(const T* row, index_t d, Acc* dst, index_t stride) {
    if (row)
      for (index_t c = 0; c < d; ++c) dst[c * stride] = static_cast<Acc>(row[c]);
    else
      for (index_t c = 0; c < d; ++c) dst[c * stride] = Acc(0);
  }
};

//! K and V of every kv head as bfloat16 bits in the pair layouts of loom::detail::x86::gemm_bf16,
//! padded with zeros to whole key tiles (host backends, bfloat16 storage, CPUs with AVX512_BF16):
//! a prepared_kv<std::uint16_t> whose tiles sit where prepared_kv puts them, each tile's block
//! pair-interleaved instead of transposed:
//!   kt [hkv][k tiles][dk / 2][tile_k][2]   the scores' B: pairs of the head dim per key
//!   vr [hkv][k tiles][tile_k / 2][dv][2]   P V's B: pairs of keys per value column
//! Null kt: the forward runs the float products.
using pair_kv = prepared_kv<std::uint16_t>;

//! Fills one key tile of one kv head in the pair layouts (one item per (kv head, key tile)).
template <class TK, class TV>
struct prepare_pairs_kernel {
  problem pb;
  rows3<const TK> k;
  rows3<const TV> v;
  pair_kv out;
  LOOM_HD void operator()(index_t item) const {
    const index_t hk = item / pb.k_tiles(), k0 = (item % pb.k_tiles()) * tile_k;
    std::uint16_t *kt2 = out.kt + (hk * out.tk_pad + k0) * pb.dk, *vr2 = out.vr + (hk * out.tk_pad + k0) * pb.dv;
    for (index_t j = 0; j < tile_k; ++j) {
      const index_t t = k0 + j;
      const bool in = t < pb.tk;
      for (index_t c = 0; c < pb.dk; ++c)
        kt2[((c / 2) * tile_k + j) * 2 + c % 2] = in ? k.at(t, hk)[c].bits : std::uint16_t{0};
      for (index_t c = 0; c < pb.dv; ++c)
        vr2[((j / 2) * pb.dv + c) * 2 + j % 2] = in ? v.at(t, hk)[c].bits : std::uint16_t{0};
    }
  }
};

//! max(init, row[0..tile_k)) and sum(row[0..tile_k)) over `lanes` interleaved partial results, so
//! the loops vectorise (a plain float reduction would not without reassociation); the order is
//! fixed, so results do not depend on the machine. NaN elements are passed over by the max (a
//! NaN-propagating max does not vectorise as well); the exp of a NaN score is NaN, so it still
//! poisons its row's sum, and a row of only NaN and masked scores is caught by its caller.
inline constexpr index_t lanes = 16;
template <class Acc>
LOOM_HD Acc row_max(const Acc* row, Acc init) {
#if defined(LOOM_ATTENTION_X86_TILES)
  if constexpr (std::is_same_v<Acc, float>) {
    if (loom::detail::x86::avx512_available()) return x86::row_max16(row, tile_k, init);
    if (loom::detail::x86::avx2_available()) return x86::row_max(row, tile_k, init);
  }
#endif
  Acc part[lanes];
  for (index_t u = 0; u < lanes; ++u) part[u] = init;
  for (index_t j0 = 0; j0 < tile_k; j0 += lanes)
    for (index_t u = 0; u < lanes; ++u) part[u] = row[j0 + u] > part[u] ? row[j0 + u] : part[u];
  Acc mx = part[0];
  for (index_t u = 1; u < lanes; ++u) mx = part[u] > mx ? part[u] : mx;
  return mx;
}
template <class Acc>
LOOM_HD Acc row_sum(const Acc* row) {
  Acc part[lanes] = {};
  for (index_t j0 = 0; j0 < tile_k; j0 += lanes)
    for (index_t u = 0; u < lanes; ++u) part[u] += row[j0 + u];
  Acc sum = Acc(0);
  for (index_t u = 0; u < lanes; ++u) sum += part[u];
  return sum;
}

//! row[j] = e^(row[j] - mx) over a tile row (masked scores are -inf: 0); where `full` (every key
//! visible) a score of +-inf or NaN makes its entry NaN and entries past nk are 0. Returns the
//! row's sum. x86 hosts with AVX2 take the 8-lane form (float; its own fixed order; see
//! LOOM_ATTENTION_X86_TILES).
template <class Acc>
LOOM_HD Acc exp_row(Acc* row, index_t nk, bool full, Acc mx) {
#if defined(LOOM_ATTENTION_X86_TILES)
  if constexpr (std::is_same_v<Acc, float>) {
    if (loom::detail::x86::avx512_available()) return x86::exp_row16(row, tile_k, nk, full, mx);
    if (loom::detail::x86::avx2_available()) return x86::exp_row(row, tile_k, nk, full, mx);
  }
#endif
  if (full)  // every key visible: a score of +-inf or NaN makes its row NaN
    for (index_t j = 0; j < tile_k; ++j) row[j] = j < nk ? fast_exp(finite_or_nan(row[j]) - mx) : Acc(0);
  else
    for (index_t j = 0; j < tile_k; ++j) row[j] = fast_exp(row[j] - mx);
  return row_sum(row);
}

//! all_finite of one score row's first n entries (AVX-512: 16 lanes a step).
template <class Acc>
LOOM_HD bool finite_row(const Acc* row, index_t n) {
#if defined(LOOM_ATTENTION_X86_TILES)
  if constexpr (std::is_same_v<Acc, float>) {
    if (loom::detail::x86::avx512_available()) return x86::finite_row16(row, n);
    if (loom::detail::x86::avx2_available()) return x86::finite_row8(row, n);
  }
#endif
  return all_finite(row, 1, n, tile_k);
}

//! row[0, n) *= alpha (an accumulator row rescaled by the new max; AVX-512: 16 lanes a step).
template <class Acc>
LOOM_HD void scale_row(Acc* row, index_t n, Acc alpha) {
#if defined(LOOM_ATTENTION_X86_TILES)
  if constexpr (std::is_same_v<Acc, float>) {
    if (loom::detail::x86::avx512_available()) return x86::scale_row16(row, n, alpha);
    if (loom::detail::x86::avx2_available()) return x86::scale_row8(row, n, alpha);
  }
#endif
  for (index_t c = 0; c < n; ++c) row[c] *= alpha;
}

//! The end of a row's online-softmax step: its new max mx, the rescale alpha = e^(m - mx) of what
//! it had summed, the sum of its new probabilities; the accumulator row (dv values) rescaled.
template <class Acc>
LOOM_HD void commit_row(Acc mx, Acc alpha, Acc sum, Acc& m, Acc& l, Acc* acc, index_t dv) {
  l = l * alpha + sum;
  m = mx;
#if !LOOM_IN_DEVICE_CODE
  if (alpha == Acc(1)) return;  // the max held: the accumulators stay (x * 1 is x)
#endif
  scale_row(acc, dv, alpha);
}

//! The online-softmax step of rows [0, nq) of a (query rows, key tile) block: s holds the rows'
//! scores (tile_k wide, the first nk valid; masked ones -inf, visible non-finite ones NaN, as
//! apply_mask leaves them). Each row's running max m and sum l are updated and its accumulator
//! (dv wide, row stride dv) rescaled; s is left holding the probabilities (an exact 0 where masked
//! or past nk), ready for the P V product. `full`: every key of the block is visible to every row.
template <class Acc>
LOOM_HD void softmax_update(index_t nq, index_t nk, bool full, Acc* s, Acc* m, Acc* l, Acc* acc, index_t dv) {
  index_t i = 0;
#if defined(LOOM_ATTENTION_X86_TILES)
  // AVX-512 or AVX2, every key visible: four rows at a time while their scores are finite (the
  // same operations per row as below, so the same bits; the rows' chains of dependent operations
  // overlap). A group with a score that is not finite, and the rows after it, take the loop below.
  if constexpr (std::is_same_v<Acc, float>) {
    const bool wide = loom::detail::x86::avx512_available();
    if (full && (wide || loom::detail::x86::avx2_available()))
      for (; i + 4 <= nq; i += 4) {
        Acc mx[4], alpha[4], sum[4];
        Acc* rows = s + i * tile_k;
        if (!(wide ? x86::rows_max4<tile_k>(rows, nk, m + i, mx) : x86::rows_max4_avx2<tile_k>(rows, nk, m + i, mx)))
          break;
        for (index_t r = 0; r < 4; ++r) alpha[r] = fast_exp(m[i + r] - mx[r]);
        for (index_t r = 0; r < 4; ++r) sum[r] = exp_row(rows + r * tile_k, tile_k, false, mx[r]);  // -inf past nk
        for (index_t r = 0; r < 4; ++r) commit_row(mx[r], alpha[r], sum[r], m[i + r], l[i + r], acc + (i + r) * dv, dv);
      }
  }
#endif
  for (; i < nq; ++i) {
    Acc* row = s + i * tile_k;
    // Where every key is visible, a score of +-inf or NaN must make its entry NaN (exp_row's full
    // form). On the host a row of finite scores takes the plain form, which with -inf past nk
    // gives the same bits for less work; device code keeps the full form (no extra pass).
#if LOOM_IN_DEVICE_CODE
    const bool poison = full;
#else
    const bool poison = full && !finite_row(row, nk);
#endif
    for (index_t j = nk; j < tile_k; ++j) row[j] = neg_inf<Acc>();
    const Acc mx = row_max(row, m[i]);
    if (mx == neg_inf<Acc>()) {
      // No finite score in this row yet: nothing visible, or visible scores that are all
      // -inf or NaN (then the row is NaN, never the merge identity out = 0, lse = -inf).
      bool poisoned = full && nk > 0;
      for (index_t j = 0; j < tile_k; ++j) {
        poisoned |= row[j] != row[j];
        row[j] = Acc(0);
      }
      if (poisoned) m[i] = l[i] = std::numeric_limits<Acc>::quiet_NaN();
      continue;
    }
    const Acc alpha = fast_exp(m[i] - mx);
    commit_row(mx, alpha, exp_row(row, nk, poison, mx), m[i], l[i], acc + i * dv, dv);
  }
}

//! Writes a finished row: out = acc / l (dv values, converted to TO) and returns its lse, m + log l.
//! A row that saw no key gives out = 0 and lse = -inf (the merge identity); a poisoned row (m NaN)
//! gives NaN in both.
template <class Acc, class TO>
LOOM_HD Acc finish_row(Acc m, Acc l, const Acc* acc, index_t dv, TO* out) {
  const bool any = m != neg_inf<Acc>();  // NaN (a poisoned row) counts as seen: out and lse NaN
  const Acc inv = any ? Acc(1) / l : Acc(0);
  for (index_t c = 0; c < dv; ++c) out[c] = static_cast<TO>(acc[c] * inv);
  return any ? m + static_cast<Acc>(std::log(l)) : neg_inf<Acc>();
}

//! The hull the forward and both backward passes run a (query tile, key tile) pair over: a partial
//! pair's (tile_hull) on host backends, the whole pair in device code (no extra registers in
//! kernels that spill). Rows left out see no key of the tile and keys left out are masked for every
//! row: they add exact zeros to every sum, so the bits do not depend on the hull. `a` holds the
//! problem and the coordinates (pb, qc, kc).
template <class Args>
LOOM_HD tile_hull hull_on_host(const Args& a, tile_kind kind, const tile_bounds& qb, const tile_bounds& kb, index_t q0,
                               index_t nq, index_t k0, index_t nk) {
#if !LOOM_IN_DEVICE_CODE
  if (kind == tile_kind::partial)
    return hull_of(a.qc, a.kc, qb, kb, q0, nq, k0, nk, a.pb.causal, a.pb.left, a.pb.right);
#else
  (void)a, (void)kind, (void)qb, (void)kb, (void)q0, (void)k0;
#endif
  return tile_hull{0, nq, 0, nk};
}
//! Rows [r0, r1) of a partial (query tile, key tile) pair's hull split into bands that each run
//! the score and P V products over their own keys [c0, c1), on host backends: a band covers up to
//! hull_band_rows rows (one register block of the products) and takes the hull of its rows
//! (hull_of; consecutive bands with the same keys are joined), so a tile on the causal diagonal
//! skips most of its masked upper triangle. Keys a band leaves out are masked for each of its rows:
//! their scores are written -inf by apply_mask (which does not read them) and their probabilities
//! are exact zeros that the P V product would have added, so the bits are those of the whole hull.
//! A full pair is one band, the hull; device code runs the whole hull (no extra registers in
//! kernels that spill). Returns the number of bands written to `bands`.
inline constexpr index_t hull_band_rows = 6;
inline constexpr int max_hull_bands = static_cast<int>((tile_q + hull_band_rows - 1) / hull_band_rows);
template <class Args>
int hull_bands(const Args& a, tile_kind kind, const tile_bounds& kb, const tile_hull& hull, index_t q0, index_t k0,
               index_t nk, tile_hull* bands) {
  bands[0] = hull;
  if (kind != tile_kind::partial) return 1;
  int n = 0;
  for (index_t b0 = hull.r0; b0 < hull.r1; b0 += hull_band_rows) {
    const index_t nb = hull.r1 - b0 < hull_band_rows ? hull.r1 - b0 : hull_band_rows;
    tile_hull h =
        hull_of(a.qc, a.kc, a.qc.bounds(q0 + b0, nb), kb, q0 + b0, nb, k0, nk, a.pb.causal, a.pb.left, a.pb.right);
    h.r0 = b0, h.r1 = b0 + nb;  // every row of the band (a row that sees none of its keys adds nothing)
    if (h.c0 >= h.c1) h.c0 = h.c1 = hull.c0;
    if (n > 0 && bands[n - 1].c0 == h.c0 && bands[n - 1].c1 == h.c1)
      bands[n - 1].r1 = h.r1;
    else
      bands[n++] = h;
  }
  return n;
}

//! Columns of the score products over a hull of nc keys: nc on host backends' partial pairs,
//! else the whole tile (as the device kernels always ran them).
LOOM_HD inline index_t score_columns(tile_kind kind, index_t nc) {
  return kind == tile_kind::partial && !LOOM_IN_DEVICE_CODE ? nc : tile_k;
}

//! Whether query q0 + i sees key k0 + l, for gemm_visible.
struct pair_visible {
  const problem& pb;
  const token_coords &qc, &kc;
  index_t q0, k0;
  LOOM_HD bool operator()(index_t i, index_t l) const {
    return visible(qc.d(q0 + i), qc.p(q0 + i), kc.d(k0 + l), kc.p(k0 + l), pb.causal, pb.left, pb.right);
  }
};
//! The same with the roles swapped: row i of the product is key k0 + i, l runs over queries.
struct pair_visible_by_key {
  pair_visible v;
  LOOM_HD bool operator()(index_t i, index_t l) const { return v(l, i); }
};

//! Sets masked scores to -inf and visible ones that are not finite to NaN (finite_or_nan), so that
//! after it -inf means "masked" and nothing else (partial tiles only).
template <class Acc>
LOOM_HD void apply_mask(const problem& pb, const token_coords& qc, const token_coords& kc, index_t q0, index_t nq,
                        index_t k0, index_t nk, Acc* s) {
  for (index_t i = 0; i < nq; ++i) {
    const index_t qd = qc.d(q0 + i), qp = qc.p(q0 + i);
    for (index_t j = 0; j < nk; ++j)
      s[i * tile_k + j] = visible(qd, qp, kc.d(k0 + j), kc.p(k0 + j), pb.causal, pb.left, pb.right)
                              ? finite_or_nan(s[i * tile_k + j])
                              : neg_inf<Acc>();
  }
}

using loom::detail::take_items;  // a launch's items: from a shared counter on host backends

//! The forward: one item per (query tile, head), or on host backends (Grouped) per (query tile,
//! `heads` query heads of one kv head): each key tile is then read from memory once for all of
//! them and reused from the cache (the heads' tiles and sums take `heads` times the scratch).
//! Each head's arithmetic is the same either way, so the bits do not depend on the grouping.
template <class TQ, class TK, class TV, class TO, class Acc, bool Grouped = false>
struct forward_kernel {
  problem pb;
  rows3<const TQ> q;
  prepared_kv<Acc> kv;  //!< kt and vr
  rows3<TO> o;
  rows2<Acc> lse;
  token_coords qc, kc;
  Acc scale;
  Acc* ws;
  index_t slots;
  index_t heads = 1;  //!< query heads per item (Grouped only; divides pb.group())
  //! Host bfloat16 storage where the pair products run (set by forward_on when
  //! avx512_bf16_pairs_available()): the scores and P V by
  //! bfloat16 pairs (vdpbf16ps), the probabilities rounded to bfloat16 for P V; kv then holds vr
  //! only (the float P V of partial tiles whose V is not finite, which skips masked keys).
  pair_kv pairs{};
  //! Host backends (Grouped): the next item to take, 0 before the call; the slots take items from
  //! it in turn instead of every slots-th one. Each item computes alone: the bits do not change.
  index_t* next = nullptr;
  static constexpr bool pair_types = Grouped && std::is_same_v<Acc, float> && std::is_same_v<TQ, bfloat16> &&
                                     std::is_same_v<TK, bfloat16> && std::is_same_v<TV, bfloat16>;

  //! Scratch elements of one slot for `heads` query heads per item: the scores of one tile, then
  //! each head's query tile, accumulators and running max and sum, then (pair products) a key
  //! tile's V pairs with the values that are not finite made zeros.
  LOOM_HD static index_t scratch(index_t dk, index_t dv, index_t heads = 1) {
    return tile_q * tile_k + heads * (tile_q * dk + tile_q * dv + 2 * tile_q) + (tile_k * dv + 1) / 2;
  }
  LOOM_HD index_t per_item() const {
    if constexpr (Grouped)
      return heads;
    else
      return 1;
  }
  LOOM_HD index_t items() const { return pb.q_tiles() * (pb.hq / per_item()); }

  LOOM_HD void operator()(index_t slot) const {
    Acc* w = ws + slot * scratch(pb.dk, pb.dv, per_item());
    take_items(Grouped ? next : nullptr, slot, slots, items(), [&](index_t item) { run(item, w); });
  }

  LOOM_HD void run(index_t item, Acc* w) const {
    const index_t g = per_item(), h0 = (item / pb.q_tiles()) * g, qt = item % pb.q_tiles(), hk = h0 / pb.group();
    const index_t q0 = qt * tile_q, nq = pb.tq - q0 < tile_q ? pb.tq - q0 : tile_q;
    const index_t dk = pb.dk, dv = pb.dv, head_size = tile_q * dk + tile_q * dv + 2 * tile_q;
    Acc* s = w;
    // Head u's query tile, accumulators, running max and sum.
    auto qs_of = [&](index_t u) { return s + tile_q * tile_k + u * head_size; };
    auto acc_of = [&](index_t u) { return qs_of(u) + tile_q * dk; };
    auto m_of = [&](index_t u) { return acc_of(u) + tile_q * dv; };
    auto l_of = [&](index_t u) { return m_of(u) + tile_q; };
    const bool by_pairs = pair_types && pairs.kt != nullptr;
    for (index_t u = 0; u < g; ++u) {
      if (by_pairs)
        load_pair_rows(q0, nq, h0 + u, qs_of(u));
      else
        load_rows(q, q0, nq, h0 + u, dk, scale, qs_of(u));
      Acc *m = m_of(u), *l = l_of(u), *acc = acc_of(u);
      for (index_t i = 0; i < nq; ++i) {
        m[i] = neg_inf<Acc>();
        l[i] = Acc(0);
      }
      for (index_t e = 0; e < nq * dv; ++e) acc[e] = Acc(0);
    }
    const tile_bounds qb = qc.bounds(q0, nq);
    for (index_t ktile = 0; ktile < pb.k_tiles(); ++ktile) {
      const index_t k0 = ktile * tile_k, nk = pb.tk - k0 < tile_k ? pb.tk - k0 : tile_k;
      const tile_bounds kb = kc.bounds(k0, nk);
      const tile_kind kind = classify(qb, kb, pb.causal, pb.left, pb.right);
      if (kind == tile_kind::skip) continue;
      const bool full = kind == tile_kind::full;
      const tile_hull hull = hull_on_host(*this, kind, qb, kb, q0, nq, k0, nk);  // float and pair products
      if (!LOOM_IN_DEVICE_CODE && hull.empty()) continue;                        // (a device's never is)
      // A masked probability is an exact 0; with a non-finite v in the tile it must be skipped,
      // not multiplied (0 * inf = NaN would cross into another document's rows).
      const bool skip_masked = kind == tile_kind::partial && !all_finite(kv.vr_tile(hk, k0), nk, dv, dv);
      // The pair products' V of this tile, for every head of the item.
      const std::uint16_t* v_pairs =
          by_pairs ? pair_values(hk, k0, skip_masked, s + tile_q * tile_k + g * head_size) : nullptr;
      // Rows [r0, r0 + nr) of the tile (the hull's) in bands (hull_bands), each band's scores over
      // its keys [c0, c0 + nc) (apply_mask writes -inf over the others without reading them: they
      // are masked), the softmax step over the hull's rows, then each band's P V over its keys.
#if !LOOM_IN_DEVICE_CODE
      tile_hull bands[max_hull_bands];
      const int n_bands = hull_bands(*this, kind, kb, hull, q0, k0, nk, bands);
#else
      const tile_hull bands[1] = {hull};  // one band (no extra registers in kernels that spill)
      constexpr int n_bands = 1;
#endif
      const index_t r0 = hull.r0, nr = hull.r1 - hull.r0;
      Acc* sr = s + r0 * tile_k;
      for (index_t u = 0; u < g; ++u) {
        for (int bi = 0; bi < n_bands; ++bi) {
          const tile_hull& bd = bands[bi];
          const index_t br = bd.r0, bn = bd.r1 - bd.r0, c0 = bd.c0, ns = score_columns(kind, bd.c1 - bd.c0);
          if (by_pairs)
            pair_scores(hk, k0, bn, c0, ns, qs_of(u), br, s + br * tile_k);
          else
            gemm<false>(bn, ns, dk, qs_of(u) + br * dk, dk, kv.kt_tile(hk, k0) + c0, kv.ld_t(), s + br * tile_k + c0,
                        tile_k, false);
        }
        if (!full) apply_mask(pb, qc, kc, q0 + r0, nr, k0, nk, sr);  // visible scores made finite or NaN
        softmax_update(nr, nk, full, sr, m_of(u) + r0, l_of(u) + r0, acc_of(u) + r0 * dv, dv);
        for (int bi = 0; bi < n_bands; ++bi) {
          const tile_hull& bd = bands[bi];
          const index_t br = bd.r0, bn = bd.r1 - bd.r0, c0 = bd.c0, nc = bd.c1 - bd.c0;
          Acc *sb = s + br * tile_k, *acc = acc_of(u) + br * dv;
          if (!LOOM_IN_DEVICE_CODE && nc == 0) continue;  // a band that sees none of the keys
          if (by_pairs)
            pair_pv(hk, k0, bn, nk, c0, c0 + nc, sb, acc, v_pairs, skip_masked, pair_visible{pb, qc, kc, q0 + br, k0});
          else if (skip_masked)
            gemm_visible<false>(bn, dv, nc, sb + c0, tile_k, kv.vr_tile(hk, k0) + c0 * dv, dv, acc, dv, true,
                                pair_visible{pb, qc, kc, q0 + br, k0 + c0});
          else
            gemm<false>(bn, dv, nc, sb + c0, tile_k, kv.vr_tile(hk, k0) + c0 * dv, dv, acc, dv, true);
        }
      }
    }
    for (index_t u = 0; u < g; ++u)
      for (index_t i = 0; i < nq; ++i) {
        TO* orow = o.at(q0 + i, h0 + u);
        lse.at(q0 + i, h0 + u) = finish_row(m_of(u)[i], l_of(u)[i], acc_of(u) + i * dv, dv, orow);
      }
  }

  //! The pair products (by_pairs only): rows [q0, q0 + nq) of head h as bfloat16 bits, unscaled;
  //! the scores of a key tile, scale * (Q Kᵀ); acc += bfloat16(P) V over the tile's nk keys.
  LOOM_HD void load_pair_rows(index_t q0, index_t nq, index_t h, Acc* at) const {
    (void)q0, (void)nq, (void)h, (void)at;
    if constexpr (pair_types) {
      auto* dst = reinterpret_cast<std::uint16_t*>(at);
      for (index_t i = 0; i < nq; ++i) {
        const TQ* row = q.at(q0 + i, h);
        for (index_t c = 0; c < pb.dk; ++c) dst[i * pb.dk + c] = row[c].bits;
      }
    }
  }
  //! Scores of rows [r0, r0 + nq) of the query tile qs (row r0 written at s) against keys
  //! [c0, c0 + ns) of the tile (written from s + c0).
  LOOM_HD void pair_scores(index_t hk, index_t k0, index_t nq, index_t c0, index_t ns, const Acc* qs, index_t r0,
                           Acc* s) const {
#if defined(LOOM_ATTENTION_X86_TILES)
    if constexpr (pair_types)
      loom::detail::x86::gemm_bf16(nq, ns, pb.dk / 2, reinterpret_cast<const std::uint16_t*>(qs) + r0 * pb.dk, pb.dk,
                                   pairs.kt_tile(hk, k0) + 2 * c0, 2 * tile_k, s + c0, tile_k, false, scale);
#else
    (void)hk, (void)k0, (void)nq, (void)c0, (void)ns, (void)qs, (void)r0, (void)s;
#endif
  }
  //! The pair products' V of key tile k0: the prepared pairs, or with `not_finite` (a partial tile
  //! whose V holds a value that is not finite) a copy in `spare` with those values made zeros.
  LOOM_HD const std::uint16_t* pair_values(index_t hk, index_t k0, bool not_finite, Acc* spare) const {
    const std::uint16_t* v2 = pairs.vr_tile(hk, k0);
    if (!not_finite) return v2;
    auto* clean = reinterpret_cast<std::uint16_t*>(spare);
    for (index_t e = 0; e < tile_k * pb.dv; ++e) clean[e] = bf16_finite(v2[e]) ? v2[e] : std::uint16_t{0};
    return clean;
  }
  LOOM_HD static bool bf16_finite(std::uint16_t bits) { return (bits & 0x7f80u) != 0x7f80u; }
  //! acc += bfloat16(P) v_pairs over the key pairs holding keys [c0, c1) (the keys outside are
  //! masked: their P is 0) of the tile's nk. With `skip_masked`, v_pairs has V's
  //! non-finite values made zeros (pair_values), which adds exact zeros where P is 0, as the clean
  //! tile does (so other documents' rows keep their bits); then P V is added for each non-finite
  //! value of V to the rows that see its key (those rows are not finite either way).
  LOOM_HD void pair_pv(index_t hk, index_t k0, index_t nq, index_t nk, index_t c0, index_t c1, Acc* s, Acc* acc,
                       const std::uint16_t* v_pairs, bool skip_masked, const pair_visible& visible) const {
#if defined(LOOM_ATTENTION_X86_TILES)
    if constexpr (pair_types) {
      const index_t dv = pb.dv, p0 = c0 / 2;
      const std::uint16_t* p = x86::probs_to_bf16<tile_k>(s, nq);  // past nk: exact zeros, as V's padding
      loom::detail::x86::gemm_bf16(nq, dv, (c1 + 1) / 2 - p0, p + 2 * p0, tile_k, v_pairs + p0 * 2 * dv, 2 * dv, acc,
                                   dv, true);
      if (!skip_masked) return;
      const std::uint16_t* v2 = pairs.vr_tile(hk, k0);
      for (index_t j = 0; j < nk; ++j)
        for (index_t c = 0; c < dv; ++c) {
          const std::uint16_t vb = v2[((j / 2) * dv + c) * 2 + j % 2];
          if (bf16_finite(vb)) continue;
          for (index_t i = 0; i < nq; ++i)
            if (visible(i, j))
              acc[i * dv + c] += static_cast<float>(bfloat16::from_bits(p[i * tile_k + j])) *
                                 static_cast<float>(bfloat16::from_bits(vb));
        }
    }
#else
    (void)hk, (void)k0, (void)nq, (void)nk, (void)c0, (void)c1, (void)s, (void)acc, (void)v_pairs, (void)skip_masked,
        (void)visible;
#endif
  }
};

//! delta[t][h] = sum_c dO[t][h][c] * O[t][h][c], the row term of the softmax backward.
template <class TO, class TD, class Acc>
struct delta_kernel {
  rows3<const TO> o;
  rows3<const TD> dout;
  Acc* delta;  //!< [tq][hq]
  index_t hq, dv;
  LOOM_HD void operator()(index_t e) const {
    const index_t t = e / hq, h = e % hq;
    const TO* orow = o.at(t, h);
    const TD* drow = dout.at(t, h);
    Acc sum = Acc(0);
    for (index_t c = 0; c < dv; ++c) sum += static_cast<Acc>(orow[c]) * static_cast<Acc>(drow[c]);
    delta[e] = sum;
  }
};

//! Shared by both backward passes: for one (query tile, key tile) pair already loaded, computes
//! P = exp(S - lse) (masked) into s and dS = P (dP - delta) into dp. Masked entries are selected
//! as exact zeros, whatever dP holds there (a non-finite v or dout of another document). A lse of
//! +inf or NaN gives NaN, and one too small for the scores overflows to +inf: a stale lse shows.
//! The products run over columns [c0, c0 + ns) only (a partial pair's hull, tile_hull): the
//! columns outside are masked, and apply_mask writes them without reading them.
template <class Acc>
LOOM_HD void backward_scores(const problem& pb, const token_coords& qc, const token_coords& kc, tile_kind kind,
                             index_t q0, index_t nq, index_t k0, index_t nk, index_t c0, index_t ns, const Acc* qs,
                             const Acc* kt, const Acc* dos, const Acc* vt, index_t ld, const Acc* lse_rows,
                             const Acc* delta_rows, Acc* s, Acc* dp) {
  gemm<false>(nq, ns, pb.dk, qs, pb.dk, kt + c0, ld, s + c0, tile_k, false);
  const bool full = kind == tile_kind::full;
  if (!full) apply_mask(pb, qc, kc, q0, nq, k0, nk, s);  // visible scores made finite or NaN
  gemm<false>(nq, ns, pb.dv, dos, pb.dv, vt + c0, ld, dp + c0, tile_k, false);
  for (index_t i = 0; i < nq; ++i) {
    Acc* srow = s + i * tile_k;
    Acc* drow = dp + i * tile_k;
    const Acc delta = delta_rows[i];
    const Acc lse = lse_rows[i] == -neg_inf<Acc>() ? std::numeric_limits<Acc>::quiet_NaN() : lse_rows[i];
#if defined(LOOM_ATTENTION_X86_TILES)
    if constexpr (std::is_same_v<Acc, float>)
      if (loom::detail::x86::avx2_available()) {
        if (loom::detail::x86::avx512_available())
          x86::backward_row16(srow, drow, tile_k, nk, full, lse, delta);
        else
          x86::backward_row(srow, drow, tile_k, nk, full, lse, delta);
        continue;
      }
#endif
    for (index_t j = 0; j < tile_k; ++j) {
      const bool seen = j < nk && (full || srow[j] != neg_inf<Acc>());
      const Acc p = seen ? fast_exp(finite_or_nan(srow[j]) - lse) : Acc(0);
      srow[j] = p;
      drow[j] = seen ? p * (drow[j] - delta) : Acc(0);
    }
  }
}

template <class T, class Acc>
LOOM_HD void store_rows(const rows3<T>& x, index_t r0, index_t n, index_t h, index_t d, const Acc* tile, Acc mul,
                        bool accumulate) {
  for (index_t i = 0; i < n; ++i) {
    T* row = x.at(r0 + i, h);
    for (index_t c = 0; c < d; ++c) {
      const Acc val = tile[i * d + c] * mul;
      row[c] = static_cast<T>(accumulate ? static_cast<Acc>(row[c]) + val : val);
    }
  }
}

//! The query side of the backward packed once per call, so that no (key tile, query tile) pair
//! gathers it again from rows hq * dk apart (one page each at 16 heads of 128 floats: a TLB miss a
//! row): q [hq][tq][dk] times the scale and dout [hq][tq][dv], in the accumulation type. Null q:
//! not packed (device backends, or too large for the workspace bound, local.hpp), each pair loads
//! its tiles. Device code never reads it (the branch would only add registers to spilling kernels).
template <class Acc>
struct packed_query {
  Acc *q = nullptr, *dout = nullptr;
  index_t tq = 0, dk = 0, dv = 0;
  LOOM_HD const Acc* q_tile(index_t h, index_t q0) const { return q + (h * tq + q0) * dk; }
  LOOM_HD const Acc* dout_tile(index_t h, index_t q0) const { return dout + (h * tq + q0) * dv; }
  LOOM_HD static index_t size(index_t tq, index_t hq, index_t dk, index_t dv) { return tq * hq * (dk + dv); }
};

//! Fills row (t, h) of a packed_query (one item per (t, h)); the same values load_rows gives. The
//! item also computes that row's delta (delta_kernel), while its dO row is in the cache.
template <class TQ, class TO, class TD, class Acc>
struct pack_query_kernel {
  rows3<const TQ> q;
  rows3<const TD> dout;
  packed_query<Acc> out;
  delta_kernel<TO, TD, Acc> delta;
  Acc scale;
  LOOM_HD void operator()(index_t e) const {
    const index_t t = e / delta.hq, h = e % delta.hq;
    load_rows(q, t, 1, h, out.dk, scale, out.q + (h * out.tq + t) * out.dk);
    load_rows(dout, t, 1, h, out.dv, Acc(1), out.dout + (h * out.tq + t) * out.dv);
    delta(e);
  }
};

//! Common operands of the backward passes.
template <class TQ, class TK, class TV, class TD, class TG, class Acc>
struct backward_args {
  problem pb;
  rows3<const TQ> q;
  rows3<const TK> k;
  rows3<const TV> v;
  rows3<const TD> dout;
  rows2<const Acc> lse;
  const Acc* delta;  //!< [tq][hq]
  rows3<TG> dq, dk, dv;
  token_coords qc, kc;
  Acc scale;
  bool accumulate;      //!< add into dq, dk, dv instead of overwriting them
  prepared_kv<Acc> kv;  //!< kt, vt and kr
  packed_query<Acc> pq{};

  struct query_tiles {
    const Acc *q, *dout;  //!< [nq][dk] (times the scale), [nq][dv]
  };
  //! lse and delta of rows [q0, q0 + nq) of head h into lrow and drow, and the query and dO tiles:
  //! pq's where packed, else loaded into qs and dos.
  LOOM_HD query_tiles load_query_side(index_t q0, index_t nq, index_t h, Acc* qs, Acc* dos, Acc* lrow,
                                      Acc* drow) const {
    query_tiles r{qs, dos};
#if !LOOM_IN_DEVICE_CODE
    if (pq.q) {
      r = {pq.q_tile(h, q0), pq.dout_tile(h, q0)};
    } else
#endif
    {
      load_rows(q, q0, nq, h, pb.dk, scale, qs);
      load_rows(dout, q0, nq, h, pb.dv, Acc(1), dos);
    }
    for (index_t i = 0; i < nq; ++i) {
      lrow[i] = lse.at(q0 + i, h);
      drow[i] = delta[(q0 + i) * pb.hq + h];
    }
    return r;
  }
};

//! dQ += dS K for one (query tile, key tile) pair into rows of stride ldq; masked entries of dS
//! are skipped where K is not finite. Both schedules call it, so their products agree bit for bit.
template <class Acc>
LOOM_HD void dq_product(const problem& pb, const token_coords& qc, const token_coords& kc, tile_kind kind,
                        bool k_finite, index_t q0, index_t nq, index_t k0, index_t nk, const Acc* ds, const Acc* kr,
                        Acc* gq, index_t ldq) {
  if (kind == tile_kind::partial && !k_finite)
    gemm_visible<false>(nq, pb.dk, nk, ds, tile_k, kr, pb.dk, gq, ldq, true, pair_visible{pb, qc, kc, q0, k0});
  else
    gemm<false>(nq, pb.dk, nk, ds, tile_k, kr, pb.dk, gq, ldq, true);
}

//! Stripes of key tiles that dQ is summed over: key tile t is in stripe t % stripes, dQ of a query
//! row is (((sum over stripe 0) + sum over stripe 1) + ...), each stripe's sum taken over its key
//! tiles in ascending order. Both backward schedules sum in this order, so their bits agree. The
//! count depends on the key tiles only.
inline constexpr index_t backward_stripes = 4;
LOOM_HD inline index_t stripes_of(const problem& pb) {
  const index_t t = pb.k_tiles();
  return t < backward_stripes ? (t > 0 ? t : 1) : backward_stripes;
}

//! dK and dV: one item per (key tile, kv head), over every query head of its group and every
//! query tile. Fused: one item per (stripe, kv head) instead, over the stripe's key tiles in
//! ascending order, also adding dS K into dq_part[stripe][h][t][:] (zeros before the call), which
//! dq_reduce_kernel sums over the stripes. A fused item takes its key tiles kv_group at a time:
//! their dK and dV sums held together, each query and dO tile read once for the group and each
//! dq_part tile visited once (in cache for the group's products; the query side of a kv head is
//! megabytes, streamed from memory once per visit: a visit per key tile cost the products 8-10 %
//! of their rate, measured).
//! Every sum still takes its terms in the same order (a dq_part row its key tiles ascending, a
//! key tile's dK and dV their query heads and tiles ascending), so the bits do not change.
template <class TQ, class TK, class TV, class TD, class TG, class Acc, bool Fused = false>
struct backward_kv_kernel {
  backward_args<TQ, TK, TV, TD, TG, Acc> a;
  Acc* ws;
  index_t slots;
  Acc* dq_part = nullptr;   //!< Fused: [stripes][hq][tq][dk] (a tile's rows contiguous, not a page apart)
  index_t* next = nullptr;  //!< host backends: the shared item counter, 0 before the call (take_items)

  static constexpr index_t kv_group = Fused ? 4 : 1;
  LOOM_HD static index_t scratch(index_t dk, index_t dv) {
    return tile_q * dk + tile_q * dv + 2 * tile_q * tile_k + kv_group * (tile_k * dk + tile_k * dv) + 2 * tile_q;
  }
  LOOM_HD index_t items() const { return (Fused ? stripes_of(a.pb) : a.pb.k_tiles()) * a.pb.hkv; }
  LOOM_HD void operator()(index_t slot) const {
    Acc* w = ws + slot * scratch(a.pb.dk, a.pb.dv);
    take_items(next, slot, slots, items(), [&](index_t item) { run(item, w); });
  }
  LOOM_HD void run(index_t item, Acc* w) const {
    if constexpr (!Fused) {
      key_tiles(item / a.pb.k_tiles(), item % a.pb.k_tiles(), 1, 1, w);
    } else {
      const index_t stripes = stripes_of(a.pb), hk = item / stripes, stripe = item % stripes, tiles = a.pb.k_tiles();
      for (index_t ktile = stripe; ktile < tiles; ktile += stripes * kv_group) {
        const index_t left = (tiles - ktile + stripes - 1) / stripes;
        key_tiles(hk, ktile, left < kv_group ? left : kv_group, stripes, w);
      }
    }
  }
  //! Key tiles first, first + step, ... (count of them, at most kv_group; fused: all in the stripe
  //! of `first`) of kv head hk.
  LOOM_HD void key_tiles(index_t hk, index_t first, index_t count, index_t step, Acc* w) const {
    const problem& pb = a.pb;
    const index_t stripe = Fused ? first % stripes_of(pb) : 0;
    const index_t dk = pb.dk, dv = pb.dv;
    Acc *qw = w, *dw = qw + tile_q * dk, *s = dw + tile_q * dv, *dp = s + tile_q * tile_k, *gk0 = dp + tile_q * tile_k,
        *gv0 = gk0 + kv_group * tile_k * dk, *lrow = gv0 + kv_group * tile_k * dv, *drow = lrow + tile_q;
    index_t k0[kv_group] = {}, nk[kv_group] = {};
    tile_bounds kb[kv_group];
    bool k_finite[kv_group];
    for (index_t u = 0; u < count; ++u) {
      k0[u] = (first + u * step) * tile_k;
      nk[u] = pb.tk - k0[u] < tile_k ? pb.tk - k0[u] : tile_k;
      kb[u] = a.kc.bounds(k0[u], nk[u]);
      k_finite[u] = true;
      if constexpr (Fused) k_finite[u] = all_finite(a.kv.kr_tile(hk, k0[u]), nk[u], dk, dk);
    }
    for (index_t e = 0; e < count * tile_k * dk; ++e) gk0[e] = Acc(0);
    for (index_t e = 0; e < count * tile_k * dv; ++e) gv0[e] = Acc(0);
    for (index_t h = hk * pb.group(); h < (hk + 1) * pb.group(); ++h)
      for (index_t qtile = 0; qtile < pb.q_tiles(); ++qtile) {
        const index_t q0 = qtile * tile_q, nq = pb.tq - q0 < tile_q ? pb.tq - q0 : tile_q;
        const tile_bounds qb = a.qc.bounds(q0, nq);
        // Fused: the query side of the whole tile, loaded (or found packed) at its first pair that
        // runs, once for the group; each pair takes the rows of its hull from it. One key tile
        // (the two-pass kernel, device code): the hull's rows alone.
        typename backward_args<TQ, TK, TV, TD, TG, Acc>::query_tiles side{};
        for (index_t u = 0; u < count; ++u) {
          const tile_kind kind = classify(qb, kb[u], pb.causal, pb.left, pb.right);
          if (kind == tile_kind::skip) continue;
          // Rows [qa, qa + na) and keys [k0 + c0, k0 + c0 + nc) of the pair: its hull (host).
          const tile_hull hull = hull_on_host(a, kind, qb, kb[u], q0, nq, k0[u], nk[u]);
          if (hull.empty()) continue;
          const index_t r0 = hull.r0, qa = q0 + r0, na = hull.r1 - r0, c0 = hull.c0, nc = hull.c1 - hull.c0;
          const Acc *kt = a.kv.kt_tile(hk, k0[u]), *vt = a.kv.vt_tile(hk, k0[u]);
          Acc *gk = gk0 + u * tile_k * dk, *gv = gv0 + u * tile_k * dv;
          index_t rs = r0;  // the pair's first row in `side`
          if constexpr (Fused) {
            if (!side.q) side = a.load_query_side(q0, nq, h, qw, dw, lrow, drow);
          } else {
            side = a.load_query_side(qa, na, h, qw, dw, lrow, drow);
            rs = 0;
          }
          const Acc *qs = side.q + rs * dk, *dos = side.dout + rs * dv;
          backward_scores(pb, a.qc, a.kc, kind, qa, na, k0[u], nk[u], c0, score_columns(kind, nc), qs, kt, dos, vt,
                          a.kv.ld_t(), lrow + rs, drow + rs, s, dp);
          // Masked entries of P and dS are exact zeros: skip them where dO or Q is not finite.
          const pair_visible_by_key vis{pair_visible{pb, a.qc, a.kc, qa, k0[u] + c0}};
          if (kind == tile_kind::partial && !all_finite(dos, na, dv, dv))
            gemm_visible<true>(nc, dv, na, s + c0, tile_k, dos, dv, gv + c0 * dv, dv, true, vis);
          else
            gemm<true>(nc, dv, na, s + c0, tile_k, dos, dv, gv + c0 * dv, dv, true);  // dV += Pᵀ dO
          if (kind == tile_kind::partial && !all_finite(qs, na, dk, dk))
            gemm_visible<true>(nc, dk, na, dp + c0, tile_k, qs, dk, gk + c0 * dk, dk, true, vis);
          else
            gemm<true>(nc, dk, na, dp + c0, tile_k, qs, dk, gk + c0 * dk, dk, true);  // dK += dSᵀ (scale Q)
          if constexpr (Fused)
            dq_product(pb, a.qc, a.kc, kind, k_finite[u], qa, na, k0[u] + c0, nc, dp + c0,
                       a.kv.kr_tile(hk, k0[u]) + c0 * dk, dq_part + ((stripe * pb.hq + h) * pb.tq + qa) * dk, dk);
        }
      }
    for (index_t u = 0; u < count; ++u) {
      store_rows(a.dk, k0[u], nk[u], hk, dk, gk0 + u * tile_k * dk, Acc(1), a.accumulate);
      store_rows(a.dv, k0[u], nk[u], hk, dv, gv0 + u * tile_k * dv, Acc(1), a.accumulate);
    }
  }
};

//! dQ: one item per (query tile, head). Striped (host backends, where the fused schedule may run
//! instead): the key tiles stripe by stripe (stripes_of), each stripe's sum in a tile of its own,
//! added to the total in stripe order; else every key tile in ascending order into one sum.
template <class TQ, class TK, class TV, class TD, class TG, class Acc, bool Striped = true>
struct backward_q_kernel {
  backward_args<TQ, TK, TV, TD, TG, Acc> a;
  Acc* ws;
  index_t slots;
  index_t* next = nullptr;  //!< host backends: the shared item counter, 0 before the call (take_items)

  LOOM_HD static index_t scratch(index_t dk, index_t dv) {
    return tile_q * dk + tile_q * dv + 2 * tile_q * tile_k + 2 * tile_q * dk + 2 * tile_q;
  }
  LOOM_HD index_t items() const { return a.pb.q_tiles() * a.pb.hq; }
  LOOM_HD void operator()(index_t slot) const {
    Acc* w = ws + slot * scratch(a.pb.dk, a.pb.dv);
    take_items(next, slot, slots, items(), [&](index_t item) { run(item, w); });
  }
  LOOM_HD void run(index_t item, Acc* w) const {
    const problem& pb = a.pb;
    const index_t h = item / pb.q_tiles(), qtile = item % pb.q_tiles(), hk = h / pb.group();
    const index_t q0 = qtile * tile_q, nq = pb.tq - q0 < tile_q ? pb.tq - q0 : tile_q;
    const index_t dk = pb.dk, dv = pb.dv;
    Acc *qw = w, *dw = qw + tile_q * dk, *s = dw + tile_q * dv, *dp = s + tile_q * tile_k, *gq = dp + tile_q * tile_k,
        *part = gq + tile_q * dk, *lrow = part + tile_q * dk, *drow = lrow + tile_q;
    const auto [qs, dos] = a.load_query_side(q0, nq, h, qw, dw, lrow, drow);
    const tile_bounds qb = a.qc.bounds(q0, nq);
    const index_t stripes = Striped ? stripes_of(pb) : 1;
    Acc* sum = Striped ? part : gq;  // a stripe's sum
    if constexpr (!Striped)
      for (index_t e = 0; e < tile_q * dk; ++e) gq[e] = Acc(0);
    for (index_t stripe = 0; stripe < stripes; ++stripe) {
      if constexpr (Striped)
        for (index_t e = 0; e < tile_q * dk; ++e) part[e] = Acc(0);
      for (index_t ktile = stripe; ktile < pb.k_tiles(); ktile += stripes) {
        const index_t k0 = ktile * tile_k, nk = pb.tk - k0 < tile_k ? pb.tk - k0 : tile_k;
        const tile_bounds kb = a.kc.bounds(k0, nk);
        const tile_kind kind = classify(qb, kb, pb.causal, pb.left, pb.right);
        if (kind == tile_kind::skip) continue;
        const tile_hull hull = hull_on_host(a, kind, qb, kb, q0, nq, k0, nk);
        if (hull.empty()) continue;
        const index_t r0 = hull.r0, na = hull.r1 - hull.r0, c0 = hull.c0, nc = hull.c1 - hull.c0;
        backward_scores(pb, a.qc, a.kc, kind, q0 + r0, na, k0, nk, c0, score_columns(kind, nc), qs + r0 * dk,
                        a.kv.kt_tile(hk, k0), dos + r0 * dv, a.kv.vt_tile(hk, k0), a.kv.ld_t(), lrow + r0, drow + r0, s,
                        dp);
        const Acc* kr = a.kv.kr_tile(hk, k0);
        const bool k_finite = kind != tile_kind::partial || all_finite(kr, nk, dk, dk);
        dq_product(pb, a.qc, a.kc, kind, k_finite, q0 + r0, na, k0 + c0, nc, dp + c0, kr + c0 * dk, sum + r0 * dk, dk);
      }
      if constexpr (Striped)
        for (index_t e = 0; e < nq * dk; ++e) gq[e] = stripe == 0 ? part[e] : gq[e] + part[e];
    }
    store_rows(a.dq, q0, nq, h, dk, gq, a.scale, a.accumulate);
  }
};

//! dQ of the fused schedule: row (t, h) = (((dq_part[0] + dq_part[1]) + ...) * scale, added to dq
//! with `accumulate`; the same operations as backward_q_kernel's. One item per (t, h).
template <class TG, class Acc>
struct dq_reduce_kernel {
  const Acc* dq_part;
  rows3<TG> dq;
  index_t tq, hq, dk, stripes;
  Acc scale;
  bool accumulate;
  LOOM_HD void operator()(index_t e) const {
    const index_t t = e / hq, h = e % hq;
    TG* row = dq.at(t, h);
    for (index_t c = 0; c < dk; ++c) {
      const Acc* part = dq_part + (h * tq + t) * dk + c;  // stripe s at part[s * hq * tq * dk]
      Acc x = part[0];
      for (index_t s = 1; s < stripes; ++s) x = x + part[s * hq * tq * dk];
      const Acc val = x * scale;
      row[c] = static_cast<TG>(accumulate ? static_cast<Acc>(row[c]) + val : val);
    }
  }
};

}  // namespace loom::attention::detail
