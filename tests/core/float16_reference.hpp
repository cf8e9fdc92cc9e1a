#pragma once

// An independent model of the two 16-bit formats for the float16 tests. Values come from the
// sign, exponent and mantissa fields through std::ldexp in double, and rounding picks the nearer
// of the two neighbouring representable values by comparing distances, so nothing here shares
// bit tricks with include/loom/core/float16.hpp. Also the input sets the tests sweep.

#include <support/random.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace loom::test::f16 {

struct bfloat16_format {
  static constexpr int exponent_bits = 8;
  static constexpr int mantissa_bits = 7;
};

struct half_format {
  static constexpr int exponent_bits = 5;
  static constexpr int mantissa_bits = 10;
};

inline constexpr std::uint16_t canonical_nan = 0x7fff;
inline constexpr std::uint16_t sign_bit = 0x8000;

template <class Format>
struct reference {
  static constexpr int mbits = Format::mantissa_bits;
  static constexpr std::uint32_t mantissa_mask = (1u << mbits) - 1u;
  static constexpr std::uint32_t exponent_max = (1u << Format::exponent_bits) - 1u;
  static constexpr int bias = (1 << (Format::exponent_bits - 1)) - 1;
  static constexpr std::uint16_t inf_bits = static_cast<std::uint16_t>(exponent_max << mbits);
  static constexpr std::uint16_t max_finite_bits = static_cast<std::uint16_t>(inf_bits - 1u);

  //! The magnitude of an encoding's low 15 bits, reading the all-ones exponent as an ordinary
  //! one: for inf_bits this is the first value past the largest finite one (2^(emax+1)), which
  //! is what round-to-nearest compares against at the overflow boundary.
  static double magnitude(std::uint32_t bits) {
    const std::uint32_t exponent = (bits >> mbits) & exponent_max;
    const std::uint32_t mantissa = bits & mantissa_mask;
    if (exponent == 0) return std::ldexp(static_cast<double>(mantissa), 1 - bias - mbits);  // subnormal
    return std::ldexp(static_cast<double>(mantissa + (1u << mbits)), static_cast<int>(exponent) - bias - mbits);
  }

  static double decode(std::uint16_t bits) {
    const bool negative = (bits & sign_bit) != 0;
    const std::uint32_t exponent = (static_cast<std::uint32_t>(bits) >> mbits) & exponent_max;
    if (exponent == exponent_max && (bits & mantissa_mask) != 0) return std::numeric_limits<double>::quiet_NaN();
    const double m = exponent == exponent_max ? std::numeric_limits<double>::infinity() : magnitude(bits);
    return std::copysign(m, negative ? -1.0 : 1.0);  // keeps the sign of zero
  }

  //! magnitude(0 .. inf_bits): the non-negative values in increasing order, then the sentinel.
  static const std::vector<double>& magnitudes() {
    static const std::vector<double> table = [] {
      std::vector<double> t(inf_bits + 1u);
      for (std::uint32_t b = 0; b <= inf_bits; ++b) t[b] = magnitude(b);
      return t;
    }();
    return table;
  }

  //! Round to nearest, ties to the even encoding; NaN becomes the canonical NaN.
  static std::uint16_t encode(float x) {
    if (std::isnan(x)) return canonical_nan;
    const std::uint16_t sign = std::signbit(x) ? sign_bit : std::uint16_t{0};
    const double a = std::fabs(static_cast<double>(x));
    const auto& t = magnitudes();
    // t[lo] <= a < t[lo + 1]; at or past the sentinel (Inf included) the result is Inf.
    const auto above = std::upper_bound(t.begin(), t.end(), a);
    if (above == t.end()) return static_cast<std::uint16_t>(sign | inf_bits);
    const auto lo = static_cast<std::uint32_t>(above - t.begin() - 1);
    // Both distances are exact near a tie (the operands are within a factor of two), which is
    // the only place an inexact difference could change the comparison.
    const double below_distance = a - t[lo];
    const double above_distance = t[lo + 1u] - a;
    std::uint32_t pick = lo;
    if (above_distance < below_distance || (above_distance == below_distance && (lo & 1u) != 0)) pick = lo + 1u;
    return static_cast<std::uint16_t>(sign | pick);  // pick == inf_bits: overflow to Inf
  }
};

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

//! "0x1.8p+1 (0x40400000)": exact, and readable next to the bit patterns in a failure.
inline std::string describe(float f) {
  std::ostringstream os;
  os << std::hexfloat << f << " (0x" << std::hex << std::setw(8) << std::setfill('0') << bits_of(f) << ")";
  return os.str();
}

inline std::string hex16(std::uint16_t b) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setw(4) << std::setfill('0') << b;
  return os.str();
}

//! Floats that stress rounding: for every pair of adjacent non-negative finite values of the
//! format (the last pair being the largest finite value and the overflow sentinel), the lower
//! value, the exact midpoint, and one float ulp either side of each; both signs; then zeros,
//! infinities, NaNs of several payloads and the float extremes.
template <class Format>
std::vector<float> boundary_inputs() {
  using ref = reference<Format>;
  std::vector<float> v;
  v.reserve(12u * (ref::max_finite_bits + 1u) + 32u);
  const float inf = std::numeric_limits<float>::infinity();
  auto both_signs = [&v](float f) {
    v.push_back(f);
    v.push_back(-f);
  };
  for (std::uint32_t b = 0; b <= ref::max_finite_bits; ++b) {
    const double lower = ref::magnitude(b), upper = ref::magnitude(b + 1u);
    const auto value = static_cast<float>(lower);
    const auto mid = static_cast<float>((lower + upper) / 2);  // exact: one more bit than the format
    both_signs(value);
    both_signs(std::nextafter(value, inf));
    if (value > 0) both_signs(std::nextafter(value, 0.0f));
    both_signs(mid);
    both_signs(std::nextafter(mid, 0.0f));
    both_signs(std::nextafter(mid, inf));
  }
  both_signs(inf);
  both_signs(std::numeric_limits<float>::max());
  both_signs(std::numeric_limits<float>::min());
  both_signs(std::numeric_limits<float>::denorm_min());
  both_signs(std::numeric_limits<float>::quiet_NaN());
  both_signs(std::numeric_limits<float>::signaling_NaN());
  for (std::uint32_t nan : {0x7f800001u, 0x7fc00000u, 0x7fc00001u, 0x7fffffffu, 0x7f810000u, 0x7fff0000u})
    both_signs(float_of(nan));
  return v;
}

//! n floats from uniformly random bit patterns (every exponent, NaNs and infinities included),
//! then n more whose exponent lies where the format's finite values and their rounding
//! boundaries are (for half this is a narrow slice of the float range).
template <class Format>
std::vector<float> random_inputs(std::size_t n, std::uint64_t stream) {
  using ref = reference<Format>;
  auto g = rng(stream);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  // Float exponent fields of the smallest subnormal's neighbourhood .. the overflow boundary.
  const int lowest = 127 - ref::bias - ref::mbits - 2, highest = 127 + ref::bias + 1;
  std::uniform_int_distribution<int> exponent(std::max(lowest, 0), std::min(highest, 254));
  std::vector<float> v;
  v.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) v.push_back(float_of(any_bits(g)));
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t u = any_bits(g);
    const auto e = static_cast<std::uint32_t>(exponent(g));
    v.push_back(float_of((u & 0x807fffffu) | (e << 23)));
  }
  return v;
}

//! Counts failures and keeps the first few descriptions, so a sweep of many inputs makes one
//! assertion with a readable message instead of one assertion per input.
struct mismatches {
  std::size_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ < 8) first += what + "\n";
  }
};

}  // namespace loom::test::f16
