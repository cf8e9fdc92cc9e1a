#pragma once

//! @file
//! The tile geometry of loom::sparse::bitmap and the per-tile decode steps shared by the CPU
//! kernels and the CUDA kernel (all LOOM_HD): a tile is tile_rows x tile_cols elements, one 64-bit
//! mask per tile row (bit j = column j of the tile), and the tile's nonzeros packed row-major.

#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstdint>
#include <type_traits>

namespace loom::sparse::detail {

inline constexpr index_t tile_rows = 8;   //!< rows of a bitmap tile
inline constexpr index_t tile_cols = 64;  //!< columns of a bitmap tile (bits of one mask word)

LOOM_HD constexpr int popcount64(std::uint64_t m) noexcept {
#if LOOM_IN_DEVICE_CODE
  return __popcll(m);
#else
  return __builtin_popcountll(m);
#endif
}

LOOM_HD constexpr int ctz64(std::uint64_t m) noexcept {
#if LOOM_IN_DEVICE_CODE
  return __ffsll(static_cast<long long>(m)) - 1;
#else
  return __builtin_ctzll(m);
#endif
}

//! Calls f(std::integral_constant<int, V>{}) for the first V of Vs equal to x, or with Fallback
//! when none is: a run-time count turned into a compile-time one (register blocks, unrolled widths).
template <int Fallback, int... Vs, class F>
LOOM_HD void with_constant(index_t x, F&& f) {
  const bool hit = ((x == Vs ? (f(std::integral_constant<int, Vs>{}), true) : false) || ...);
  if (!hit) f(std::integral_constant<int, Fallback>{});
}

//! Mask of the valid bits of a tile row whose tile starts at column c0 of a matrix with `cols`.
LOOM_HD constexpr std::uint64_t valid_bits(index_t c0, index_t cols) noexcept {
  const index_t w = cols - c0;
  return w >= 64 ? ~std::uint64_t{0} : ((std::uint64_t{1} << w) - 1);
}

//! Position in the tile's packed values of the nonzero at bit j of `mask` (which must be set):
//! the number of set bits below j. The lane-parallel form of the decode (one thread per bit).
LOOM_HD constexpr int packed_position(std::uint64_t mask, int j) noexcept {
  return popcount64(mask & ((std::uint64_t{1} << j) - 1));
}

//! Decodes one tile row: for each set bit j of `mask`, in increasing j, calls
//! f(j, values[p]) with p = 0, 1, ... the packed position. Returns the number of nonzeros.
template <class T, class F>
LOOM_HD int decode_row(std::uint64_t mask, const T* values, F&& f) {
  int p = 0;
  while (mask != 0) {
    f(ctz64(mask), values[p]);
    ++p;
    mask &= mask - 1;
  }
  return p;
}

}  // namespace loom::sparse::detail
