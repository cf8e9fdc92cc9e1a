#pragma once

//! @file
//! Split-KV attention for short query blocks against long key histories (decode, and prefill
//! against a persistent KV cache): the queries of a document are few, so parallelism comes from
//! the keys. A work item is (document, group of kv heads, key split): every query row of the
//! document that reads those kv heads (its query tokens times the heads of each GQA group) against
//! one contiguous split of the document's keys, read once in their storage layout (no prepared
//! copies: the pass is bound by the K/V bytes). On the host a group is every kv head, and the
//! scores of a key tile run key by key over every head, so an item reads its K rows in address
//! order, a stream the hardware prefetchers follow (head by head, rows a kv-head stride apart, was
//! measured 2x slower; head by head within a tile, 1.14x slower); on a device a group is one kv
//! head (more items). Each split gives a partial (out, lse); a
//! second pass merges a document's partials in split order with the stable log-sum-exp. The
//! split size depends on the shapes only (not on the thread count), so the bits do too.
//!
//! Queries are bottom-right aligned with their document's keys, as FlashAttention's varlen form
//! with a KV cache: query i of a document of Lq queries and Lk keys sits at position Lk - Lq + i.

#include <loom/attention/detail/attention_x86.hpp>
#include <loom/attention/detail/local_kernels.hpp>
#include <loom/core/segments.hpp>

namespace loom::attention::detail {

//! Query rows per register block of the split-KV products.
inline constexpr index_t decode_rows = 4;
//! Lanes of the dot products and of the P V columns (one AVX-512 register of float).
inline constexpr index_t decode_lanes = 16;
//! The most query tokens per document for which a plan takes the split-KV path.
inline constexpr index_t decode_max_queries = 16;

//! The scores of every register block of a key tile (lay: the layout), key by key as
//! x86::decode_scores: s[(x * blocks + b) * decode_rows * tile_k + r * tile_k + j] = q . k_j for
//! query row 4 b + r of kv head x (row-major, row stride dk) and key j < nk (row stride ldk,
//! converted from the storage type). Per (row, key), decode_lanes partial sums over the dimension,
//! added in a fixed tree: the bits depend on nothing but the operands. (The portable form: one row
//! at a time, so compilers vectorise the lanes, not the rows.) Prefetches as x86::decode_scores:
//! each key's V rows (`v_bytes` each).
template <class Acc, class TK, class TV>
LOOM_HD void decode_scores(const Acc* q, const decode_blocks& lay, const TK* k, index_t ldk, index_t nk, index_t dk,
                           Acc* s, const TV* v, index_t ldv, std::size_t v_bytes) {
  constexpr index_t W = decode_lanes;
  const index_t full = dk - dk % W;
  for (index_t j = 0; j < nk; ++j) {
    for (index_t x = 0; x < lay.heads; ++x) prefetch_row(v + j * ldv + x * lay.v_head, v_bytes);
    for (index_t x = 0; x < lay.heads; ++x) {
      const TK* kr = k + j * ldk + x * lay.k_head;
      for (index_t rb = 0; rb < lay.blocks * decode_rows; ++rb) {
        const Acc* qr = q + x * lay.q_head + rb * dk;
        Acc part[W];
        for (index_t u = 0; u < W; ++u) part[u] = Acc(0);
        for (index_t c0 = 0; c0 < full; c0 += W)
          for (index_t u = 0; u < W; ++u) part[u] += qr[c0 + u] * static_cast<Acc>(kr[c0 + u]);
        for (index_t c = full; c < dk; ++c) part[c - full] += qr[c] * static_cast<Acc>(kr[c]);
        for (index_t w = W / 2; w > 0; w /= 2)
          for (index_t u = 0; u < w; ++u) part[u] += part[u + w];
        s[(x * lay.blocks * decode_rows + rb) * tile_k + j] = part[0];
      }
    }
  }
}

//! acc[r][:] += sum_{j < nk} p[r][j] v_j for decode_rows rows (p row stride tile_k, acc row stride
//! dv), keys j ascending; v rows of stride ldv converted from the storage type (decode_scores asked
//! for them). A column block of decode_lanes sums stays in registers over the keys (no conditions
//! inside it, so compilers keep it there). One line of `ahead` is asked for per key and column block.
template <class Acc, class TV>
LOOM_HD void decode_pv(const Acc* p, const TV* v, index_t ldv, index_t nk, index_t dv, Acc* acc,
                       prefetch_cursor& ahead) {
  constexpr index_t W = decode_lanes;
  const index_t full = dv - dv % W;
  for (index_t r = 0; r < decode_rows; ++r) {
    Acc* ar = acc + r * dv;
    const Acc* pr = p + r * tile_k;
    for (index_t c0 = 0; c0 < full; c0 += W) {
      Acc a[W];
      for (index_t u = 0; u < W; ++u) a[u] = ar[c0 + u];
      for (index_t j = 0; j < nk; ++j) {
        ahead.step();
        const TV* vr = v + j * ldv + c0;
        for (index_t u = 0; u < W; ++u) a[u] += pr[j] * static_cast<Acc>(vr[u]);
      }
      for (index_t u = 0; u < W; ++u) ar[c0 + u] = a[u];
    }
    for (index_t c = full; c < dv; ++c) {
      Acc a = ar[c];
      for (index_t j = 0; j < nk; ++j) a += pr[j] * static_cast<Acc>(v[j * ldv + c]);
      ar[c] = a;
    }
  }
}

//! The same sum restricted to visible (row, key) pairs, for a block whose masked probabilities
//! meet a non-finite v: a masked key must not turn its exact 0 into 0 * inf = NaN.
template <class Acc, class TV, class Visible>
LOOM_HD void decode_pv_visible(const Acc* p, const TV* v, index_t ldv, index_t nk, index_t dv, Acc* acc,
                               const Visible& visible) {
  for (index_t r = 0; r < decode_rows; ++r)
    for (index_t j = 0; j < nk; ++j) {
      if (!visible(r, j)) continue;
      const Acc pr = p[r * tile_k + j];
      const TV* vr = v + j * ldv;
      for (index_t c = 0; c < dv; ++c) acc[r * dv + c] += pr * static_cast<Acc>(vr[c]);
    }
}

//! Position of query token t of document d among the document's keys: its queries are the last
//! positions (query i of Lq over Lk keys sits at Lk - Lq + i).
template <class Space>
LOOM_HD index_t bottom_right_pos(const segments<Space>& qs, const segments<Space>& ks, index_t d, index_t t) {
  return ks.length(d) - qs.length(d) + (t - qs[d]);
}

//! How a plan splits the keys: the documents' query and key offsets, the most queries of a
//! document, `chunk` keys per split (a multiple of tile_k; document d has max(1, ceil(Lk_d /
//! chunk)) splits, at most `splits`), and the kv heads of a work item (a divisor of the kv heads).
template <class Space>
struct decode_split {
  segments<Space> qs, ks;
  index_t docs = 0, max_q = 0, chunk = tile_k, splits = 1;
  index_t heads = 1;  //!< kv heads per work item (all of them on the host: keys read in address order)
  LOOM_HD index_t splits_of(index_t d) const {
    const index_t lk = ks.length(d);
    return lk > chunk ? (lk + chunk - 1) / chunk : 1;
  }
  //! Position of query token t of document d (bottom-right alignment).
  LOOM_HD index_t query_pos(index_t d, index_t t) const { return bottom_right_pos(qs, ks, d, t); }
};

//! One split of one document for a group of g.heads kv heads: every query row of the document
//! reading those kv heads, online softmax over the split's keys in tiles of tile_k. Writes the split's (out, lse) into
//! the partials, or straight into out / lse when the document has one split.
template <class TQ, class TK, class TV, class TO, class Acc, class Space>
struct decode_kernel {
  problem pb;
  decode_split<Space> g;
  rows3<const TQ> q;
  rows3<const TK> k;
  rows3<const TV> v;
  rows3<TO> o;
  rows2<Acc> lse;
  Acc scale;
  Acc* part_out;  //!< [tq][hq][splits][dv]
  Acc* part_lse;  //!< [tq][hq][splits]
  Acc* ws;
  index_t slots;
  index_t* next = nullptr;  //!< host backends: the shared item counter, 0 before the call (take_items)

  //! Query rows of one kv head of a work item (its documents' query tokens times the heads of the
  //! GQA group), padded to whole register blocks so that no block spans two kv heads.
  LOOM_HD static index_t rows(index_t max_q, index_t group) {
    return (max_q * group + decode_rows - 1) / decode_rows * decode_rows;
  }
  LOOM_HD static index_t scratch(index_t max_q, index_t group, index_t heads, index_t dk, index_t dv) {
    const index_t r = heads * rows(max_q, group);
    return r * dk + r * dv + 2 * r + r * tile_k;
  }
  LOOM_HD index_t items() const { return g.docs * (pb.hkv / g.heads) * g.splits; }

  LOOM_HD void operator()(index_t slot) const {
    Acc* w = ws + slot * scratch(g.max_q, pb.group(), g.heads, pb.dk, pb.dv);
    take_items(next, slot, slots, items(), [&](index_t item) { run(item, w); });
  }

  LOOM_HD void run(index_t item, Acc* w) const {
    const index_t groups = pb.hkv / g.heads;
    const index_t sp = item % g.splits, hk0 = (item / g.splits) % groups * g.heads, d = item / (g.splits * groups);
    const index_t nq = g.qs.length(d);
    if (nq == 0 || sp >= g.splits_of(d)) return;
    const index_t G = pb.group(), R = nq * G, dk = pb.dk, dv = pb.dv;
    const index_t Rh = (R + decode_rows - 1) / decode_rows * decode_rows, Rp = g.heads * Rh;
    Acc *qr = w, *acc = qr + Rp * dk, *m = acc + Rp * dv, *l = m + Rp, *s = l + Rp;
    const index_t q_first = g.qs[d], k_first = g.ks[d], lk = g.ks.length(d);
    const index_t pos0 = g.query_pos(d, q_first);  // position of the document's first query
    // Row x * Rh + r reads kv head hk0 + x: query token q_first + r / G of head (hk0 + x) G + r % G;
    // rows past R of each head are zeros.
    for (index_t x = 0; x < g.heads; ++x)
      for (index_t r = 0; r < Rh; ++r) {
        const index_t row = x * Rh + r;
        const TQ* src = r < R ? q.at(q_first + r / G, (hk0 + x) * G + r % G) : nullptr;
        for (index_t c = 0; c < dk; ++c) qr[row * dk + c] = src ? static_cast<Acc>(src[c]) * scale : Acc(0);
        for (index_t c = 0; c < dv; ++c) acc[row * dv + c] = Acc(0);
        m[row] = neg_inf<Acc>();
        l[row] = Acc(0);
      }
    const bool vec = vectorised();
    const index_t kb = sp * g.chunk, ke = lk < kb + g.chunk ? lk : kb + g.chunk;  // positions [kb, ke)
    // Key tiles outer; within a tile the scores go key by key over every kv head and row block,
    // so the item reads its K rows in address order, then each (head, block) runs its softmax and
    // P V over the tile (the V rows were asked for with the scores).
    const decode_blocks lay{g.heads, Rh / decode_rows, Rh * dk, k.sh, v.sh};
    for (index_t k0 = kb; k0 < ke; k0 += tile_k) {
      const index_t nk = ke - k0 < tile_k ? ke - k0 : tile_k;
      const tile_bounds kbd{d, d, k0, k0 + nk - 1};
      auto kind_of = [&](index_t r0) {
        const index_t rn = R - r0 < decode_rows ? R - r0 : decode_rows;
        return classify(tile_bounds{d, d, pos0 + r0 / G, pos0 + (r0 + rn - 1) / G}, kbd, pb.causal, pb.left, pb.right);
      };
      bool any = false;
      for (index_t r0 = 0; r0 < R && !any; r0 += decode_rows) any = kind_of(r0) != tile_kind::skip;
      if (!any) continue;  // the kinds depend on the rows, not on the head
      const TK* kt = k.at(k_first + k0, hk0);
      const TV* vt0 = v.at(k_first + k0, hk0);
      scores(vec, qr, lay, kt, k.st, nk, dk, s, vt0, v.st, static_cast<std::size_t>(dv) * sizeof(TV));
      // The next tile's K rows, asked for while the P V products compute from the cache.
      const index_t k1 = k0 + tile_k, nk1 = ke - k1 < tile_k ? ke - k1 : tile_k;
      prefetch_cursor ahead;
      if (nk1 > 0)
        ahead = {reinterpret_cast<const char*>(k.at(k_first + k1, hk0)),
                 k.st * index_t{sizeof(TK)},
                 k.sh * index_t{sizeof(TK)},
                 nk1,
                 g.heads,
                 dk * index_t{sizeof(TK)}};
      for (index_t x = 0; x < g.heads; ++x) {
        const TV* vt = v.at(k_first + k0, hk0 + x);
        bool v_finite = true, v_checked = false;
        for (index_t r0 = 0; r0 < R; r0 += decode_rows) {
          const index_t rn = R - r0 < decode_rows ? R - r0 : decode_rows, row0 = x * Rh + r0;
          const tile_kind kind = kind_of(r0);
          if (kind == tile_kind::skip) continue;
          Acc* sb = s + row0 * tile_k;  // this block's scores
          auto seen = [&](index_t r, index_t j) {
            return r < rn && visible(d, pos0 + (r0 + r) / G, d, k0 + j, pb.causal, pb.left, pb.right);
          };
          if (kind == tile_kind::partial)
            for (index_t r = 0; r < decode_rows; ++r)
              for (index_t j = 0; j < nk; ++j)
                sb[r * tile_k + j] = seen(r, j) ? finite_or_nan(sb[r * tile_k + j]) : neg_inf<Acc>();
          softmax_update(rn, nk, kind == tile_kind::full, sb, m + row0, l + row0, acc + row0 * dv, dv);
          for (index_t r = rn; r < decode_rows; ++r)  // rows past R: no probabilities
            for (index_t j = 0; j < tile_k; ++j) sb[r * tile_k + j] = Acc(0);
          if (kind == tile_kind::partial && !v_checked) {
            v_finite = all_finite(vt, nk, dv, v.st);
            v_checked = true;
          }
          if (kind == tile_kind::partial && !v_finite)
            decode_pv_visible(sb, vt, v.st, nk, dv, acc + row0 * dv, seen);
          else
            pv(vec, sb, vt, v.st, nk, dv, acc + row0 * dv, ahead);
        }
      }
      while (ahead.pending()) ahead.step();
    }
    const bool one = g.splits_of(d) == 1;
    for (index_t x = 0; x < g.heads; ++x)
      for (index_t r = 0; r < R; ++r) {
        const index_t t = q_first + r / G, h = (hk0 + x) * G + r % G, row = x * Rh + r;
        if (one) {
          lse.at(t, h) = finish_row(m[row], l[row], acc + row * dv, dv, o.at(t, h));
        } else {
          const index_t e = (t * pb.hq + h) * g.splits + sp;
          part_lse[e] = finish_row(m[row], l[row], acc + row * dv, dv, part_out + e * dv);
        }
      }
  }

  //! Whether the host's vector products run (x86 with AVX2, float accumulation, head dims
  //! multiples of 8; never in device code).
  LOOM_HD bool vectorised() const {
#if defined(LOOM_X86_KERNELS) && !LOOM_IN_DEVICE_CODE
    return x86::vector_products<Acc, TK, TV>(pb.dk, pb.dv);
#else
    return false;
#endif
  }
  //! The products: every block of `lay` against nk keys, and `v_bytes` of each key's V rows at v
  //! asked for the P V products after the scores.
  LOOM_HD static void scores(bool vec, const Acc* q, const decode_blocks& lay, const TK* k, index_t ldk, index_t nk,
                             index_t dk, Acc* s, const TV* v, index_t ldv, std::size_t v_bytes) {
#if defined(LOOM_X86_KERNELS) && !LOOM_IN_DEVICE_CODE
    if constexpr (std::is_same_v<Acc, float> && x86::vector_storage<TK>)
      if (vec) return x86::decode_scores(q, lay, k, ldk, nk, dk, s, tile_k, v, ldv, v_bytes);
#endif
    (void)vec;
    decode_scores(q, lay, k, ldk, nk, dk, s, v, ldv, v_bytes);
  }
  LOOM_HD static void pv(bool vec, const Acc* p, const TV* v, index_t ldv, index_t nk, index_t dv, Acc* acc,
                         prefetch_cursor& ahead) {
#if defined(LOOM_X86_KERNELS) && !LOOM_IN_DEVICE_CODE
    if constexpr (std::is_same_v<Acc, float> && x86::vector_storage<TV>)
      if (vec) return x86::decode_pv(p, tile_k, v, ldv, nk, dv, acc, ahead);
#endif
    (void)vec;
    decode_pv(p, v, ldv, nk, dv, acc, ahead);
  }
};

//! out, lse of (query token t, head h) from its document's split partials, in split order:
//! lse = M + log sum_s exp(lse_s - M), out = sum_s exp(lse_s - lse) out_s with M the largest
//! lse_s (every exponent <= 0). Splits that saw no key (lse_s = -inf) are the identity; a NaN
//! partial makes the row NaN. One item per (t, h); documents of one split were written already.
template <class TO, class Acc, class Space>
struct decode_merge_kernel {
  decode_split<Space> g;
  rows3<TO> o;
  rows2<Acc> lse;
  const Acc* part_out;
  const Acc* part_lse;
  index_t hq, dv;
  LOOM_HD void operator()(index_t e) const {
    const index_t t = e / hq, h = e % hq, d = g.qs.of(t), n = g.splits_of(d);
    if (n == 1) return;
    const Acc* pl = part_lse + e * g.splits;
    const Acc* po = part_out + e * g.splits * dv;
    Acc mx = neg_inf<Acc>();
    bool nan = false;
    for (index_t s = 0; s < n; ++s) {
      nan |= pl[s] != pl[s];
      mx = pl[s] > mx ? pl[s] : mx;
    }
    TO* out = o.at(t, h);
    if (nan || mx == neg_inf<Acc>()) {
      const Acc fill = nan ? std::numeric_limits<Acc>::quiet_NaN() : Acc(0);
      for (index_t c = 0; c < dv; ++c) out[c] = static_cast<TO>(fill);
      lse.at(t, h) = nan ? fill : neg_inf<Acc>();
      return;
    }
    Acc sum = Acc(0);
    for (index_t s = 0; s < n; ++s) sum += fast_exp(pl[s] - mx);
    const Acc total = mx + static_cast<Acc>(std::log(sum));
    for (index_t c = 0; c < dv; ++c) {
      Acc x = Acc(0);
      for (index_t s = 0; s < n; ++s)
        if (pl[s] != neg_inf<Acc>()) x += fast_exp(pl[s] - total) * po[s * dv + c];
      out[c] = static_cast<TO>(x);
    }
    lse.at(t, h) = total;
  }
};

//! (document, bottom-right aligned position) of every query token of a cross plan.
template <class Space>
struct query_coords {
  segments<Space> qs, ks;
  index_t* doc;
  index_t* pos;
  LOOM_HD void operator()(index_t t) const {
    const index_t d = qs.of(t);
    doc[t] = d;
    pos[t] = bottom_right_pos(qs, ks, d, t);
  }
};

}  // namespace loom::attention::detail
