#pragma once

//! @file
//! 16-bit storage types loom::bfloat16 and loom::half. Conversions from float round to nearest,
//! ties to even, and handle NaN (canonical quiet NaN 0x7FFF, as CUDA's conversions produce), Inf
//! and subnormals. Layout and rounding are bit-compatible with __nv_bfloat16 / __half.
//! Arithmetic promotes to float: these are storage types; accumulate in float or wider.

#include <loom/config.hpp>

#include <concepts>
#include <cstdint>

namespace loom {
namespace detail {

LOOM_HD constexpr std::uint32_t float_bits(float f) noexcept { return __builtin_bit_cast(std::uint32_t, f); }
LOOM_HD constexpr float bits_float(std::uint32_t u) noexcept { return __builtin_bit_cast(float, u); }

//! The bfloat16 encoding: a float's top 16 bits, rounded.
struct bf16_format {
  //! float -> bits, rounding to nearest even; NaN becomes 0x7FFF.
  LOOM_HD static constexpr std::uint16_t encode(float f) noexcept {
    const std::uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN
    // Round to nearest even on the 16 dropped bits; a carry walks into the exponent, and values
    // past the largest finite bf16 round to Inf, as IEEE requires.
    const std::uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>((u + rounding_bias) >> 16);
  }
  //! bits -> float (exact).
  LOOM_HD static constexpr float decode(std::uint16_t b) noexcept {
    return bits_float(static_cast<std::uint32_t>(b) << 16);
  }
};

//! The IEEE binary16 encoding.
struct half_format {
  //! float -> bits, rounding to nearest even; |f| >= 65520 becomes Inf, NaN becomes 0x7FFF.
  LOOM_HD static constexpr std::uint16_t encode(float f) noexcept {
    const std::uint32_t u = float_bits(f);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;                                      // NaN
    if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 -> Inf
    if (a >= 0x38800000u) {                                                   // normal half: >= 2^-14
      const std::uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - (112u << 23);
      return static_cast<std::uint16_t>(sign | (r >> 13));
    }
    if (a <= 0x33000000u) return static_cast<std::uint16_t>(sign);  // <= 2^-25: ties to +-0
    // Subnormal half: the result counts units of 2^-24.
    const std::uint32_t e = a >> 23;
    const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // in [14, 24]
    std::uint32_t r = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  //! bits -> float (exact; subnormals normalised).
  LOOM_HD static constexpr float decode(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    std::uint32_t e = (h >> 10) & 0x1fu;
    std::uint32_t m = h & 0x3ffu;
    if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));  // Inf / NaN
    if (e == 0) {
      if (m == 0) return bits_float(sign);
      e = 1;
      while ((m & 0x400u) == 0) {  // normalise the subnormal
        m <<= 1;
        --e;
      }
      m &= 0x3ffu;
    }
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  }
};

//! What bfloat16 and half share: the raw 16 bits, conversions from float through Format::encode and
//! to float through Format::decode. Derived is the storage type itself (from_bits returns it).
template <class Derived, class Format>
struct float16_storage {
  std::uint16_t bits;  //!< the raw encoding

  float16_storage() = default;
  //! Rounds as Format::encode does.
  LOOM_HD constexpr float16_storage(float f) noexcept : bits(Format::encode(f)) {}
  //! Via float (double rounding can differ from a direct rounding in rare ties).
  LOOM_HD constexpr explicit float16_storage(double d) noexcept : float16_storage(static_cast<float>(d)) {}
  template <std::integral I>
  LOOM_HD constexpr explicit float16_storage(I v) noexcept : float16_storage(static_cast<float>(v)) {}
  LOOM_HD constexpr operator float() const noexcept { return Format::decode(bits); }
  LOOM_HD static constexpr Derived from_bits(std::uint16_t b) noexcept {
    Derived r{};
    r.bits = b;
    return r;
  }
};

}  // namespace detail

//! bfloat16 storage: 1 sign, 8 exponent, 7 mantissa bits (the top half of a float). From float: round to nearest
//! even, NaN becomes the canonical quiet NaN 0x7FFF.
struct bfloat16 : detail::float16_storage<bfloat16, detail::bf16_format> {
  using float16_storage::float16_storage;
  bfloat16() = default;
};

//! IEEE binary16 storage: 1 sign, 5 exponent, 10 mantissa bits; max finite 65504. From float: round to nearest
//! even, |f| >= 65520 becomes Inf, NaN becomes 0x7FFF.
struct half : detail::float16_storage<half, detail::half_format> {
  using float16_storage::float16_storage;
  half() = default;
};

static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2, "bfloat16 must be 2 bytes");
static_assert(sizeof(half) == 2 && alignof(half) == 2, "half must be 2 bytes");

}  // namespace loom
