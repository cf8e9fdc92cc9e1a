#pragma once

// A fused band-mask attention engine made of loom kernels, for the fused ring runner
// (attention/detail/ring_fused.hpp): it reads the ragged tables a cuDNN graph reads (the
// element offsets of q, k, v, out and lse rows, the int32 query and key counts) and the batch's
// bounds (key j visible to query i iff j > i - left_bound and j <= i + right_bound; -1:
// unbounded), and computes each entry in the accumulation type with a two-pass softmax and the
// analytic backward, on any backend (kernels over (entry, head, row) and (entry, kv head, key)).
// Independent of loom's tile kernels and of the fp64 oracle.

#include <loom/attention/detail/ring_fused.hpp>
#include <loom/backend/parallel.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace loom::test {

inline constexpr index_t band_max_dim = 256;

//! What every kernel of the engine reads: one batch's tables, bounds and sizes.
template <class Acc>
struct band_batch {
  const std::int64_t* tab = nullptr;
  std::size_t region = 0;
  index_t hq = 0, hkv = 0, dk = 0, dv = 0, left = -1, right = -1;
  Acc scale = 0;
  LOOM_HD bool visible(index_t i, index_t j) const {
    return (left < 0 || j > i - left) && (right < 0 || j <= i + right);
  }
  LOOM_HD index_t q_count(index_t e) const { return reinterpret_cast<const std::int32_t*>(tab + 5 * region)[e]; }
  LOOM_HD index_t k_count(index_t e) const { return reinterpret_cast<const std::int32_t*>(tab + 6 * region)[e]; }
  //! Element offset of entry e's row `row` in region w (0 q, 1 k, 2 v, 3 out, 4 lse), head h.
  LOOM_HD std::int64_t at(int w, index_t e, index_t row, index_t h) const {
    const index_t heads = (w == 1 || w == 2) ? hkv : hq;
    const index_t dim = w == 0 || w == 1 ? dk : w == 4 ? 1 : dv;
    return tab[static_cast<std::size_t>(w) * region + static_cast<std::size_t>(e)] + (row * heads + h) * dim;
  }
  template <class T>
  LOOM_HD Acc dot(const T* a, const T* b, index_t n) const {
    Acc s = 0;
    for (index_t c = 0; c < n; ++c) s += static_cast<Acc>(a[c]) * static_cast<Acc>(b[c]);
    return s;
  }
};

template <class T, class Acc>
struct band_forward_kernel {
  band_batch<Acc> bb;
  index_t max_q;
  const T *q, *k, *v;
  T* o;
  Acc* lse;
  LOOM_HD void operator()(index_t item) const {
    const index_t i = item % max_q, h = (item / max_q) % bb.hq, e = item / (max_q * bb.hq);
    const index_t nk = bb.k_count(e), hk = h / (bb.hq / bb.hkv);
    if (i >= bb.q_count(e)) return;
    const T* qr = q + bb.at(0, e, i, h);
    Acc m = -INFINITY;
    for (index_t j = 0; j < nk; ++j)
      if (bb.visible(i, j)) {
        const Acc s = bb.scale * bb.dot(qr, k + bb.at(1, e, j, hk), bb.dk);
        m = s > m ? s : m;
      }
    Acc acc[band_max_dim] = {};
    Acc sum = 0;
    for (index_t j = 0; j < nk; ++j)
      if (bb.visible(i, j)) {
        const Acc p = std::exp(bb.scale * bb.dot(qr, k + bb.at(1, e, j, hk), bb.dk) - m);
        sum += p;
        const T* vr = v + bb.at(2, e, j, hk);
        for (index_t c = 0; c < bb.dv; ++c) acc[c] += p * static_cast<Acc>(vr[c]);
      }
    T* orow = o + bb.at(3, e, i, h);
    for (index_t c = 0; c < bb.dv; ++c) orow[c] = static_cast<T>(sum > 0 ? acc[c] / sum : Acc(0));
    lse[bb.at(4, e, i, h)] = sum > 0 ? m + std::log(sum) : Acc(-INFINITY);
  }
};

//! The backward's terms of query row i (head h) against key j of entry e: P_ij and dS_ij.
template <class T, class Acc>
struct band_backward_terms {
  band_batch<Acc> bb;
  const T *q, *k, *v, *o, *dout;
  const Acc* lse;
  LOOM_HD void operator()(index_t e, index_t i, index_t h, index_t j, Acc& p, Acc& ds) const {
    const index_t hk = h / (bb.hq / bb.hkv);
    const T* qr = q + bb.at(0, e, i, h);
    const T* dr = dout + bb.at(3, e, i, h);
    const Acc d = bb.dot(dr, o + bb.at(3, e, i, h), bb.dv);  // D_i = dO_i . O_i
    p = std::exp(bb.scale * bb.dot(qr, k + bb.at(1, e, j, hk), bb.dk) - lse[bb.at(4, e, i, h)]);
    ds = p * (bb.dot(dr, v + bb.at(2, e, j, hk), bb.dv) - d);
  }
};

template <class T, class Acc>
struct band_dq_kernel {
  band_backward_terms<T, Acc> t;
  index_t max_q;
  T* dq;
  LOOM_HD void operator()(index_t item) const {
    const auto& bb = t.bb;
    const index_t i = item % max_q, h = (item / max_q) % bb.hq, e = item / (max_q * bb.hq);
    if (i >= bb.q_count(e)) return;
    const index_t nk = bb.k_count(e), hk = h / (bb.hq / bb.hkv);
    Acc acc[band_max_dim] = {};
    for (index_t j = 0; j < nk; ++j)
      if (bb.visible(i, j)) {
        Acc p, ds;
        t(e, i, h, j, p, ds);
        const T* kr = t.k + bb.at(1, e, j, hk);
        for (index_t c = 0; c < bb.dk; ++c) acc[c] += ds * static_cast<Acc>(kr[c]);
      }
    T* out = dq + bb.at(0, e, i, h);
    for (index_t c = 0; c < bb.dk; ++c) out[c] = static_cast<T>(bb.scale * acc[c]);
  }
};

template <class T, class Acc>
struct band_dkv_kernel {
  band_backward_terms<T, Acc> t;
  index_t max_k;
  T *dk, *dv;
  LOOM_HD void operator()(index_t item) const {
    const auto& bb = t.bb;
    const index_t j = item % max_k, hk = (item / max_k) % bb.hkv, e = item / (max_k * bb.hkv);
    if (j >= bb.k_count(e)) return;
    const index_t nq = bb.q_count(e), group = bb.hq / bb.hkv;
    Acc gk[band_max_dim] = {}, gv[band_max_dim] = {};
    for (index_t h = hk * group; h < (hk + 1) * group; ++h)
      for (index_t i = 0; i < nq; ++i)
        if (bb.visible(i, j)) {
          Acc p, ds;
          t(e, i, h, j, p, ds);
          const T* qr = t.q + bb.at(0, e, i, h);
          const T* dr = t.dout + bb.at(3, e, i, h);
          for (index_t c = 0; c < bb.dk; ++c) gk[c] += ds * static_cast<Acc>(qr[c]);
          for (index_t c = 0; c < bb.dv; ++c) gv[c] += p * static_cast<Acc>(dr[c]);
        }
    T* ko = dk + bb.at(1, e, j, hk);
    T* vo = dv + bb.at(2, e, j, hk);
    for (index_t c = 0; c < bb.dk; ++c) ko[c] = static_cast<T>(bb.scale * gk[c]);
    for (index_t c = 0; c < bb.dv; ++c) vo[c] = static_cast<T>(gv[c]);
  }
};

//! The engine: one batch of a fused program per call, no workspace of its own.
template <class T, class Acc>
class band_engine {
 public:
  band_engine(const attention::detail::fused_program& prog, const attention::head_shape& s, Acc scale) {
    LOOM_EXPECTS(s.dim_qk <= band_max_dim && s.dim_v <= band_max_dim, errc::unsupported,
                 "test::band_engine: head dims up to ", band_max_dim);
    for (const auto& fb : prog.batches) {
      band_batch<Acc> bb;
      bb.region = attention::detail::fused_tables::region(static_cast<index_t>(fb.blocks.size()));
      bb.hq = s.heads_q, bb.hkv = s.heads_kv, bb.dk = s.dim_qk, bb.dv = s.dim_v;
      bb.left = fb.blocks.front().left_bound, bb.right = fb.blocks.front().right_bound;
      bb.scale = scale;
      batches_.push_back({bb, static_cast<index_t>(fb.blocks.size()), fb.max_q, fb.max_k});
    }
  }
  [[nodiscard]] std::size_t workspace_bytes(attention::detail::fused_pass) const { return 0; }
  void check_call(attention::detail::fused_pass, std::string_view) const {}
  template <backend B>
  void forward(const B& b, std::size_t i, const std::int64_t* tables, const T* q, const T* k, const T* v, T* o,
               Acc* lse, std::span<std::byte>) const {
    const auto& m = batches_[i];
    auto bb = m.bb;
    bb.tab = tables;
    for_each_index(b, m.entries * bb.hq * m.max_q, band_forward_kernel<T, Acc>{bb, m.max_q, q, k, v, o, lse});
  }
  template <backend B>
  void backward(const B& b, std::size_t i, const std::int64_t* tables, const T* q, const T* k, const T* v, const T* o,
                const Acc* lse, const T* dout, T* dq, T* dk, T* dv, std::span<std::byte>) const {
    const auto& m = batches_[i];
    band_backward_terms<T, Acc> t{m.bb, q, k, v, o, dout, lse};
    t.bb.tab = tables;
    for_each_index(b, m.entries * t.bb.hq * m.max_q, band_dq_kernel<T, Acc>{t, m.max_q, dq});
    for_each_index(b, m.entries * t.bb.hkv * m.max_k, band_dkv_kernel<T, Acc>{t, m.max_k, dk, dv});
  }

 private:
  struct meta {
    band_batch<Acc> bb;
    index_t entries, max_q, max_k;
  };
  std::vector<meta> batches_;
};

}  // namespace loom::test
