#pragma once

//! @file
//! Segment lookup in cu_seqlens-style offsets (S + 1 values, offsets[0] = 0, non-decreasing),
//! shared by every module that packs sequences: which segment a position belongs to.

#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>

namespace loom {

//! The segment holding position t: the last s in [0, S) with offsets[s] <= t, so among empty
//! segments that start at t the non-empty one that follows them. O(log S). Requires S >= 1 and
//! offsets[0] <= t.
LOOM_HD inline index_t segment_of(const index_t* offsets, index_t segments, index_t t) {
  index_t lo = 0, hi = segments - 1;
  while (lo < hi) {
    const index_t mid = lo + (hi - lo + 1) / 2;
    if (offsets[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace loom
