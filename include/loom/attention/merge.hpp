#pragma once

//! @file
//! loom::attention::merge: combines two partial attention results over disjoint key sets,
//! (out_a, lse_a) and (out_b, lse_b), into the result over their union, in place in a:
//!
//!   lse = max + log1p(exp(-|lse_a - lse_b|))        (max = max(lse_a, lse_b))
//!   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
//!
//! Every exponent is <= 0, so nothing overflows whatever the magnitudes (the naive
//! lse_a + log(1 + exp(lse_b - lse_a)) overflows once lse_b - lse_a exceeds ~88 in float). A row
//! with lse = -inf (no visible key) is the identity: merging it changes nothing, and two such rows
//! give out = 0, lse = -inf.

#include <loom/attention/local.hpp>

#include <cmath>

namespace loom::attention {

namespace detail {
template <class TA, class LA, class TB, class LB>
struct merge_kernel {
  rows3<TA> oa;
  rows2<LA> la;
  rows3<const TB> ob;
  rows2<const LB> lb;
  index_t h, d;
  LOOM_HD void operator()(index_t e) const {
    using Acc = LA;
    const index_t t = e / h, hh = e % h;
    const Acc a = la.at(t, hh), b = static_cast<Acc>(lb.at(t, hh));
    if (b == neg_inf<Acc>()) return;  // b is the identity
    TA* orow = oa.at(t, hh);
    const TB* brow = ob.at(t, hh);
    if (a == neg_inf<Acc>()) {
      for (index_t c = 0; c < d; ++c) orow[c] = static_cast<TA>(static_cast<Acc>(brow[c]));
      la.at(t, hh) = b;
      return;
    }
    const Acc mx = a > b ? a : b, diff = a > b ? b - a : a - b;
    const Acc lse = mx + static_cast<Acc>(std::log1p(std::exp(diff)));
    const Acc wa = static_cast<Acc>(std::exp(a - lse)), wb = static_cast<Acc>(std::exp(b - lse));
    for (index_t c = 0; c < d; ++c)
      orow[c] = static_cast<TA>(wa * static_cast<Acc>(orow[c]) + wb * static_cast<Acc>(brow[c]));
    la.at(t, hh) = lse;
  }
};
}  // namespace detail

//! (out_a, lse_a) <- merge((out_a, lse_a), (out_b, lse_b)). out_* are [T, H, Dv], lse_* [T, H];
//! lse_a has a floating accumulation type (float or double), computations use it.
//! @throws loom::error(shape_mismatch) if the shapes differ.
template <backend B, class OA, class LA, class OB, class LB>
void merge(const B& b, OA out_a, LA lse_a, OB out_b, LB lse_b) {
  constexpr std::string_view call = "attention::merge";
  static_assert(std::is_floating_point_v<typename LA::value_type>, "attention::merge: lse_a must be float or double");
  const index_t t = out_a.extent(0), h = out_a.extent(1), d = out_a.extent(2);
  expect_extents(out_a, {t, h, d}, call, "out_a");
  expect_extents(out_b, {t, h, d}, call, "out_b");
  expect_extents(lse_a, {t, h}, call, "lse_a");
  expect_extents(lse_b, {t, h}, call, "lse_b");
  for_each_index(
      b, t * h,
      detail::merge_kernel<typename OA::element_type, typename LA::element_type, typename OB::value_type,
                           typename LB::value_type>{
          detail::rows_of(out_a), detail::rows2_of(lse_a),
          detail::rows3<const typename OB::value_type>{out_b.data(), out_b.stride(0), out_b.stride(1)},
          detail::rows2<const typename LB::value_type>{lse_b.data(), lse_b.stride(0), lse_b.stride(1)}, h, d});
}

}  // namespace loom::attention
