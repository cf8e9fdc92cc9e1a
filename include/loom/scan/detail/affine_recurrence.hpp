#pragma once

//! @file
//! Scalar and diagonal linear recurrences, forward and adjoint, as ONE inclusive scan by key of
//! scan::affine pairs: what a device backend runs through its vendor's scan (CUB's single-pass
//! scan by key on loom::cuda, detail/affine_recurrence_cuda.cuh) when options.reproducible is
//! false, instead of the blocked engine.
//!
//! The d x T (channel, step) elements are visited channel by channel, each channel's steps in the
//! recurrence's processing order (rows ascending forward, descending adjoint). Element p of
//! channel c is the step x -> a x + v that takes the value of the previous processed row to this
//! row's output:
//!   forward   (a_t[c], b_t[c]);                      at a segment head (a_t[c] init[s][c] + b_t[c])
//!   adjoint   (a_{t+1}[c], g_t[c]) (A of the row processed before);  at a head (g_t[c] + init[s][c])
//! and the key of an element is (channel, segment), so the scan restarts at every head and in every
//! channel: nothing is ever combined across documents (a non-finite value stays in its document)
//! or across channels. The scan's .b member is the output row: h_t forward, λ_t adjoint. The final
//! values (fin) follow from the outputs: forward h at the segment's last row, adjoint
//! a_start λ_start, the gradient of the initial state.
//!
//! The mapping (affine_map, affine_finals_step) is shared by every executor of the scan: the
//! vendor's on a device, scan_by_key_sequential here (the reference the host tests run through the
//! same functors). Work: O(T d) combines; the combine order is the vendor's, so results are exact
//! to rounding but not bitwise reproducible across runs or devices.

#include <loom/scan/detail/recurrence_kernel.hpp>
#include <loom/scan/monoid.hpp>
#include <loom/scan/structure.hpp>

#include <type_traits>

namespace loom::scan::detail {

//! Structures whose recurrence is one affine pair per (channel, step).
template <class St>
inline constexpr bool affine_structure = std::is_same_v<St, scalar> || std::is_same_v<St, diagonal>;

//! The elements, keys and outputs of the scan by key, over a recurrence kernel K (scalar or
//! diagonal; one window holding the whole sequence).
template <class K, class St>
struct affine_map {
  using accum_type = typename K::agg_type;
  using value_type = affine_pair<accum_type>;
  K k;

  LOOM_HD index_t count() const { return k.hd.count * k.d; }
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
  LOOM_HD void store(index_t j, const value_type& x) const {
    const index_t c = channel(j), t = k.row(position(j));
    k.h[t * k.h_stride + c] = static_cast<typename std::remove_pointer_t<decltype(k.h)>>(x.b);
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
      const auto lambda = static_cast<typename K::agg_type>(k.h[first * k.h_stride + c]);
      k.fin[s * k.fin_stride + c] = static_cast<TH>(m.a_at(first, c) * lambda);
    } else {
      k.fin[s * k.fin_stride + c] = k.h[last * k.h_stride + c];
    }
  }
};

//! The scan by key on the calling thread, in element order, through the same functors as the
//! vendor's: the reference for the host tests.
template <class Map>
void scan_by_key_sequential(const Map& m) {
  const affine<typename Map::accum_type> op{};
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
