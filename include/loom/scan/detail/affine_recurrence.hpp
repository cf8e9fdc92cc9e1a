#pragma once

//! @file
//! Scalar, diagonal and block-diagonal linear recurrences, forward and adjoint, as ONE inclusive
//! scan by key of affine steps: what a device backend runs through its vendor's scan (CUB's
//! single-pass scan by key on loom::cuda, detail/affine_recurrence_cuda.cuh) when
//! options.reproducible is false, instead of the blocked engine.
//!
//! The channels (the d elements of the state; for block_diagonal<K>, its d / K blocks of K) are
//! visited one by one, each channel's steps in the recurrence's processing order (rows ascending
//! forward, descending adjoint). Element p of channel c is the step x -> a x + v that takes the value
//! of the previous processed row to this row's output (a a number, or a K x K block, v a number or
//! K of them):
//!   forward   (A_t[c], b_t[c]);                      at a segment head (A_t[c] init[s][c] + b_t[c])
//!   adjoint   (A_{t+1}[c]^T, g_t[c]) (A of the row processed before);  at a head (g_t[c] + init[s][c])
//! and the key of an element is (channel, segment), so the scan restarts at every head and in every
//! channel: nothing is ever combined across documents (a non-finite value stays in its document)
//! or across channels. The scan's .b member is the output row: h_t forward, λ_t adjoint. The final
//! values (fin) follow from the outputs: forward h at the segment's last row, adjoint
//! A_start^T λ_start, the gradient of the initial state.
//!
//! The mapping (affine_map, affine_finals_step) is shared by every executor of the scan: the
//! vendor's on a device, scan_by_key_sequential here (the reference the host tests run through the
//! same functors). Work: O(T d) combines (O(T d K^2) block-diagonal); the combine order is the
//! vendor's, so results are exact to rounding but not bitwise reproducible across runs or devices.

#include <loom/scan/detail/recurrence_kernel.hpp>
#include <loom/scan/monoid.hpp>
#include <loom/scan/structure.hpp>

#include <type_traits>

namespace loom::scan::detail {

//! One step of a block-diagonal recurrence on one block of W: x -> a x + b (a row-major W x W).
template <class T, int W>
struct block_affine_pair {
  T a[W * W];
  T b[W];
};

//! The composition of block steps: first, then second (x -> a2 (a1 x + b1) + b2), through
//! block_diagonal<W>'s own products (each sum over the inner index in ascending order).
template <class T, int W>
struct block_affine {
  using value_type = block_affine_pair<T, W>;
  LOOM_HD value_type combine(const value_type& first, const value_type& second) const {
    value_type r;
    block_diagonal<W>::matmat(second.a, false, W, first.a, r.a);
    block_diagonal<W>::matvec(second.a, false, W, first.b, r.b);
    for (int i = 0; i < W; ++i) r.b[i] += second.b[i];
    return r;
  }
};

//! The element type and combine of a structure's scan: affine pairs of numbers (scalar,
//! diagonal; width 1) or of K x K blocks (block_diagonal<K>; width K).
template <class St, class Acc>
struct affine_traits {
  using value_type = affine_pair<Acc>;
  using op_type = affine<Acc>;
  static constexpr int width = 1;
};
template <int K, class Acc>
struct affine_traits<block_diagonal<K>, Acc> {
  using value_type = block_affine_pair<Acc, K>;
  using op_type = block_affine<Acc, K>;
  static constexpr int width = K;
};

template <class St>
inline constexpr bool is_block_diagonal = false;
template <int K>
inline constexpr bool is_block_diagonal<block_diagonal<K>> = true;

//! Structures whose recurrence is one affine step per (channel, step).
template <class St>
inline constexpr bool affine_structure =
    std::is_same_v<St, scalar> || std::is_same_v<St, diagonal> || is_block_diagonal<St>;

//! The elements, keys and outputs of the scan by key, over a recurrence kernel K (scalar,
//! diagonal or block-diagonal; one window holding the whole sequence).
template <class K, class St>
struct affine_map {
  using accum_type = typename K::agg_type;
  using traits = affine_traits<St, accum_type>;
  using value_type = typename traits::value_type;
  using op_type = typename traits::op_type;
  static constexpr int width = traits::width;
  K k;

  LOOM_HD index_t channels() const { return k.d / width; }
  LOOM_HD index_t count() const { return k.hd.count * channels(); }
  LOOM_HD index_t steps() const { return k.hd.count; }
  LOOM_HD index_t channel(index_t j) const { return j / k.hd.count; }
  LOOM_HD index_t position(index_t j) const { return j % k.hd.count; }
  //! Head index (processing order) of the segment holding processing position p; -1: none.
  LOOM_HD index_t head_of(index_t p) const { return k.hd.segments == 0 ? -1 : k.hd.last_at_or_before(p); }
  LOOM_HD index_t key(index_t j) const {
    const index_t s = head_of(position(j));
    const index_t per_channel = k.hd.segments > 0 ? k.hd.segments : 1;
    return channel(j) * per_channel + (s < 0 ? 0 : k.hd.segment(s));
  }
  LOOM_HD accum_type a_at(index_t row, index_t c) const {
    if constexpr (std::is_same_v<St, scalar>)
      return static_cast<accum_type>(k.a[row * k.a_stride]);
    else
      return static_cast<accum_type>(k.a[row * k.a_stride + c]);
  }
  LOOM_HD value_type element(index_t j) const {
    if constexpr (width > 1) {
      return block_element(j);
    } else {
      return pair_element(j);
    }
  }
  LOOM_HD value_type pair_element(index_t j) const {
    const index_t c = channel(j), p = position(j), t = k.row(p);
    const accum_type v = static_cast<accum_type>(k.b[t * k.b_stride + c]);
    const index_t hs = head_of(p);
    if (hs < 0 ? p == 0 : k.hd.at(hs) == p) {  // a segment head
      // The scan restarts here: a is never read (nothing comes before in this key's run).
      if (k.init == nullptr) return {accum_type(0), v};
      const index_t s = hs < 0 ? 0 : k.hd.segment(hs);
      const auto x0 = static_cast<accum_type>(k.init[s * k.init_stride + c]);
      return {accum_type(0), k.adjoint ? v + x0 : a_at(t, c) * x0 + v};
    }
    return {k.adjoint ? a_at(k.row(p - 1), c) : a_at(t, c), v};
  }
  //! Block c's step (block_diagonal<W>): A_t's block (transposed, of the row processed before, in
  //! the adjoint) and W values of b; at a head a of zeros (never read) and the start folded in.
  LOOM_HD value_type block_element(index_t j) const {
    const index_t c = channel(j), p = position(j), t = k.row(p), e0 = c * width;
    value_type x;
    for (int i = 0; i < width; ++i) x.b[i] = static_cast<accum_type>(k.b[t * k.b_stride + e0 + i]);
    const index_t hs = head_of(p);
    const bool head = hs < 0 ? p == 0 : k.hd.at(hs) == p;
    const index_t arow = head || !k.adjoint ? t : k.row(p - 1);
    for (int i = 0; i < width; ++i)
      for (int l = 0; l < width; ++l) x.a[i * width + l] = head ? accum_type(0) : a_block(arow, c, i, l, k.adjoint);
    if (head && k.init != nullptr) {
      const index_t s = hs < 0 ? 0 : k.hd.segment(hs);
      accum_type x0[width], ax0[width] = {};
      for (int i = 0; i < width; ++i) x0[i] = static_cast<accum_type>(k.init[s * k.init_stride + e0 + i]);
      if (!k.adjoint) block_diagonal<width>::matvec(block_of(t, c), false, width, x0, ax0);
      for (int i = 0; i < width; ++i) x.b[i] += k.adjoint ? x0[i] : ax0[i];
    }
    return x;
  }
  //! Block c of A_row (row-major width x width, in A's storage type).
  LOOM_HD auto block_of(index_t row, index_t c) const { return k.a + row * k.a_stride + c * width * width; }
  //! Entry (i, l) of block c of A_row, or of its transpose.
  LOOM_HD accum_type a_block(index_t row, index_t c, int i, int l, bool transposed) const {
    const auto ab = block_of(row, c);
    return static_cast<accum_type>(transposed ? ab[l * width + i] : ab[i * width + l]);
  }

  LOOM_HD void store(index_t j, const value_type& x) const {
    const index_t c = channel(j), t = k.row(position(j));
    using TH = std::remove_pointer_t<decltype(k.h)>;
    if constexpr (width > 1) {
      for (int i = 0; i < width; ++i) k.h[t * k.h_stride + c * width + i] = static_cast<TH>(x.b[i]);
    } else {
      k.h[t * k.h_stride + c] = static_cast<TH>(x.b);
    }
  }
};

//! fin[s][c] of every non-empty segment from the scan's outputs (empty ones: fill_empty_segments).
template <class K, class St>
struct affine_finals_step {
  affine_map<K, St> m;
  LOOM_HD void operator()(index_t i) const {
    const K& k = m.k;
    const index_t s = i / k.d, c = i % k.d;
    // rows [first, last] of segment s (no segments: the whole sequence)
    index_t first = 0, last = k.hd.count - 1;
    if (k.hd.segments > 0) {
      first = k.hd.offsets[s];
      last = k.hd.offsets[s + 1] - 1;
    }
    if (last < first) return;
    using TH = std::remove_pointer_t<decltype(k.fin)>;
    if (k.adjoint) {
      using Acc = typename K::agg_type;
      if constexpr (affine_map<K, St>::width > 1) {  // element c of A_first^T lambda_first
        constexpr int W = affine_map<K, St>::width;
        const index_t blk = c / W;
        Acc lambda[W], out[W];
        for (int l = 0; l < W; ++l) lambda[l] = static_cast<Acc>(k.h[first * k.h_stride + blk * W + l]);
        block_diagonal<W>::matvec(m.block_of(first, blk), true, W, lambda, out);
        k.fin[s * k.fin_stride + c] = static_cast<TH>(out[c % W]);
      } else {
        const auto lambda = static_cast<Acc>(k.h[first * k.h_stride + c]);
        k.fin[s * k.fin_stride + c] = static_cast<TH>(m.a_at(first, c) * lambda);
      }
    } else {
      k.fin[s * k.fin_stride + c] = k.h[last * k.h_stride + c];
    }
  }
};

//! The scan by key on the calling thread, in element order, through the same functors as the
//! vendor's: the reference for the host tests.
template <class Map>
void scan_by_key_sequential(const Map& m) {
  const typename Map::op_type op{};
  typename Map::value_type acc{};
  index_t prev = -1;
  const index_t n = m.count();
  for (index_t j = 0; j < n; ++j) {
    const index_t key = m.key(j);
    const auto e = m.element(j);
    acc = j == 0 || key != prev ? e : op.combine(acc, e);
    m.store(j, acc);
    prev = key;
  }
}

//! Recurrences a device backend runs with its vendor's scan by key (specialised for loom::cuda by
//! detail/affine_recurrence_cuda.cuh, included when nvcc compiles the unit).
template <class B>
struct vendor_affine {
  static constexpr bool available = false;
};

}  // namespace loom::scan::detail
