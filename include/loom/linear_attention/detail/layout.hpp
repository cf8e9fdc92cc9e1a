#pragma once

//! @file
//! Internals of chunked linear attention: the chunk table (chunks are cut at multiples of the chunk
//! size from each document's start and at document ends), the per-lane scratch layout and the
//! workspace carving shared by the forward and backward passes.

#include <loom/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

namespace loom::linear_attention::detail {

//! Tokens [begin, end) of one chunk, inside document `doc`.
struct chunk_info {
  index_t begin, end, doc;
};

//! Chunks of every document, in order; doc_chunk[d] .. doc_chunk[d + 1] are document d's chunks.
struct chunk_table {
  std::vector<chunk_info> chunks;
  std::vector<index_t> doc_chunk;
};

//! Cuts the chunks of documents `cu` (validated by loom::check_segments; chunk > 0).
inline chunk_table make_chunk_table(std::span<const index_t> cu, index_t chunk) {
  chunk_table t;
  const index_t docs = static_cast<index_t>(cu.size()) - 1;
  t.doc_chunk.reserve(static_cast<std::size_t>(docs) + 1);
  for (index_t d = 0; d < docs; ++d) {
    t.doc_chunk.push_back(static_cast<index_t>(t.chunks.size()));
    for (index_t b = cu[d]; b < cu[d + 1]; b += chunk)
      t.chunks.push_back({b, b + chunk < cu[d + 1] ? b + chunk : cu[d + 1], d});
  }
  t.doc_chunk.push_back(static_cast<index_t>(t.chunks.size()));
  return t;
}

//! The register tile of the forward products: tile_rows x tile_cols accumulators (for fp32, 8 rows
//! of two 512-bit or four 256-bit vectors). The forward scratch pads C, dk and dv to tile_cols.
inline constexpr index_t tile_rows = 8;
inline constexpr index_t tile_cols = 32;

LOOM_HD constexpr index_t round_up(index_t x, index_t m) { return (x + m - 1) / m * m; }

//! "No bound" for the chunk ranges of the kernels.
inline constexpr index_t max_index = static_cast<index_t>(~std::size_t(0) >> 1);

//! Heads a forward work item handles at most (their rows are staged together).
inline constexpr index_t max_head_group = 8;

//! Accum elements of one head slot of the forward scratch (see lane_tiles in forward_kernels.hpp):
//! Q [cp kp], K^T [kp cp], V, O [cp vp], S0 [kp vp], b, exp(b), exp(-b) [cp], K [cp kp]; cp = C, kp = dk,
//! vp = dv rounded up to tile_cols.
LOOM_HD constexpr index_t forward_slot_floats(index_t c, index_t dk, index_t dv) {
  const index_t cp = round_up(c, tile_cols), kp = round_up(dk, tile_cols), vp = round_up(dv, tile_cols);
  return 3 * cp * kp + 2 * cp * vp + kp * vp + round_up(3 * cp, tile_cols);
}

//! Accum elements of one lane's scratch (forward and backward use the same size, a multiple of
//! tile_cols), for forward items of `group` heads.
//! Forward: P [cp cp], L [kp vp], then `group` head slots.
//! Backward: Q[C dk], K^T[dk C], V[C dv], P[C C], b[C], O[C dv], dO[C dv], V^T[dv C], K[C dk],
//! dP[C C], dQ[C dk], dK[C dk], dV[C dv], two transposed states S^T[dv dk] and E^T[dv dk], the
//! epochs of the log-gates [C], and a running state [dk dv].
inline index_t lane_floats(index_t c, index_t dk, index_t dv, index_t group = 1) {
  const index_t cp = round_up(c, tile_cols), kp = round_up(dk, tile_cols), vp = round_up(dv, tile_cols);
  const index_t fwd = cp * cp + kp * vp + group * forward_slot_floats(c, dk, dv);
  const index_t bwd =
      (c * dk * 2 + c * dv * 2 + c * c + c) + (c * dv * 3 + c * dk * 3 + c * c + c * dk + 2 * dv * dk) + c + dk * dv;
  return round_up(fwd > bwd ? fwd : bwd, tile_cols);
}

}  // namespace loom::linear_attention::detail
