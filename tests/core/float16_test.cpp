// loom::bfloat16 and loom::half against an independent model of the formats
// (float16_reference.hpp): every encoding decoded, rounding at every boundary between adjacent
// values, random floats over the whole float range, and round trips.

#include <loom/core/float16.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "float16_reference.hpp"

namespace {

using namespace loom::test::f16;

template <class T>
struct format_of;
template <>
struct format_of<loom::bfloat16> {
  using type = bfloat16_format;
};
template <>
struct format_of<loom::half> {
  using type = half_format;
};

// Decoding must agree with the reference value exactly, including the sign of zero; every
// NaN encoding must decode to a NaN.
template <class T>
void check_decodes_all_encodings() {
  using ref = reference<typename format_of<T>::type>;
  mismatches bad;
  std::size_t nans = 0, infinities = 0, subnormals = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float got = T::from_bits(bits);
    const double want = ref::decode(bits);
    bool ok;
    if (std::isnan(want)) {
      ok = std::isnan(got);
      ++nans;
    } else {
      ok = static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
      if (std::isinf(want)) ++infinities;
      if (want != 0 && std::fabs(want) < ref::magnitude(1u << ref::mbits)) ++subnormals;
    }
    if (!ok) bad.add(hex16(bits) + " decodes to " + describe(got));
  }
  INFO(bad.first);
  CHECK(bad.count == 0);
  // The sweep really met every class of encoding.
  CHECK(nans == 2 * (ref::mantissa_mask));
  CHECK(infinities == 2);
  CHECK(subnormals == 2 * (ref::mantissa_mask));
}

template <class T>
void check_rounds_like_reference(const std::vector<float>& inputs) {
  using ref = reference<typename format_of<T>::type>;
  mismatches bad;
  for (const float x : inputs) {
    const std::uint16_t got = T(x).bits, want = ref::encode(x);
    if (got != want) bad.add(describe(x) + " -> " + hex16(got) + ", expected " + hex16(want));
  }
  INFO(inputs.size() << " inputs\n" << bad.first);
  CHECK(bad.count == 0);
}

template <class T>
void check_round_trips() {
  using ref = reference<typename format_of<T>::type>;
  mismatches bad;
  std::size_t tried = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    if (std::isnan(ref::decode(bits))) continue;
    ++tried;
    const float f = T::from_bits(bits);
    const std::uint16_t back = T(f).bits;
    if (back != bits) bad.add(hex16(bits) + " -> " + describe(f) + " -> " + hex16(back));
  }
  INFO(bad.first);
  CHECK(bad.count == 0);
  CHECK(tried == 0x10000u - 2 * ref::mantissa_mask);
}

template <class T>
void check_nan_inputs() {
  for (const std::uint32_t nan :
       {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu, 0x7f810000u, 0xffff0000u}) {
    INFO(describe(float_of(nan)));
    CHECK(T(float_of(nan)).bits == canonical_nan);
  }
}

}  // namespace

// Compile-time use: the conversions are constexpr, including NaN, subnormal and overflow paths.
static_assert(loom::bfloat16(1.0f).bits == 0x3f80);
static_assert(loom::bfloat16(-2.0f).bits == 0xc000);
static_assert(loom::bfloat16(1.00390625f).bits == 0x3f80);  // 1 + 2^-8: tie, stays even
static_assert(loom::bfloat16(1.01171875f).bits == 0x3f82);  // 1 + 3 * 2^-8: tie, up to even
static_assert(loom::bfloat16(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
static_assert(static_cast<float>(loom::bfloat16::from_bits(0x4049)) == 3.140625f);
static_assert(loom::half(1.0f).bits == 0x3c00);
static_assert(loom::half(65504.0f).bits == 0x7bff);
static_assert(loom::half(65520.0f).bits == 0x7c00);
static_assert(loom::half(-65519.996f).bits == 0xfbff);
static_assert(loom::half(0x1p-24f).bits == 0x0001);
static_assert(loom::half(0x1p-25f).bits == 0x0000);  // tie between 0 and the smallest subnormal
static_assert(loom::half(-std::numeric_limits<float>::infinity()).bits == 0xfc00);
static_assert(static_cast<float>(loom::half::from_bits(0x0001)) == 0x1p-24f);
static_assert(static_cast<float>(loom::half::from_bits(0x03ff)) == 0x1.ff8p-15f);
static_assert(static_cast<float>(loom::half::from_bits(0xc000)) == -2.0f);

static_assert(std::is_trivially_copyable_v<loom::bfloat16> && std::is_trivially_copyable_v<loom::half>);
static_assert(std::is_standard_layout_v<loom::bfloat16> && std::is_standard_layout_v<loom::half>);
static_assert(std::is_convertible_v<float, loom::half> && std::is_convertible_v<loom::half, float>);
static_assert(std::is_constructible_v<loom::half, double> && std::is_constructible_v<loom::bfloat16, double>);

TEST_CASE("core::float16 reference model matches the documented formats", "[core][float16]") {
  using bf = reference<bfloat16_format>;
  using hf = reference<half_format>;
  CHECK(hf::decode(0x7bff) == 65504.0);
  CHECK(hf::decode(0x0400) == std::ldexp(1.0, -14));
  CHECK(hf::decode(0x0001) == std::ldexp(1.0, -24));
  CHECK(hf::decode(0x3555) == 0.333251953125);
  CHECK(hf::decode(0x7c00) == std::numeric_limits<double>::infinity());
  CHECK(std::isnan(hf::decode(0x7e00)));
  CHECK(std::signbit(hf::decode(0x8000)));
  CHECK(bf::decode(0x7f7f) == static_cast<double>(0x1.fep127f));
  CHECK(bf::decode(0x0080) == static_cast<double>(std::numeric_limits<float>::min()));
  CHECK(bf::decode(0x0001) == std::ldexp(1.0, -133));
  CHECK(bf::decode(0xbf80) == -1.0);
  CHECK(std::isnan(bf::decode(0xff81)));
  CHECK(hf::encode(65519.996f) == 0x7bff);
  CHECK(hf::encode(65520.0f) == 0x7c00);
  CHECK(bf::encode(0x1.fep127f) == 0x7f7f);
  CHECK(bf::encode(0x1.ffp127f) == 0x7f80);  // halfway to 2^128: ties to even, i.e. Inf
  CHECK(bf::encode(std::nextafter(0x1.ffp127f, 0.0f)) == 0x7f7f);
  // The magnitudes are strictly increasing, so the nearest-value search is valid.
  for (const auto* t : {&bf::magnitudes(), &hf::magnitudes()}) {
    CHECK(std::adjacent_find(t->begin(), t->end(), std::greater_equal<>()) == t->end());
  }
}

TEST_CASE("core::bfloat16 layout and spot conversions", "[core][float16]") {
  CHECK(sizeof(loom::bfloat16) == 2);
  CHECK(loom::bfloat16(3.14159265f).bits == 0x4049);
  CHECK(static_cast<float>(loom::bfloat16(-0.0f)) == 0.0f);
  CHECK(std::signbit(static_cast<float>(loom::bfloat16(-0.0f))));
  CHECK(loom::bfloat16(std::numeric_limits<float>::max()).bits == 0x7f80);
  CHECK(loom::bfloat16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  // Explicit double construction equals construction from the float nearest the double.
  for (const double d : {0.1, -1e-40, 3.0e38, 1.0 / 3.0}) {
    CHECK(loom::bfloat16(d).bits == loom::bfloat16(static_cast<float>(d)).bits);
  }
  check_nan_inputs<loom::bfloat16>();
}

TEST_CASE("core::half layout and spot conversions", "[core][float16]") {
  CHECK(sizeof(loom::half) == 2);
  CHECK(loom::half(0.1f).bits == 0x2e66);
  CHECK(loom::half(-0.0f).bits == 0x8000);
  CHECK(loom::half(1e-8f).bits == 0x0000);
  CHECK(loom::half(-1e-8f).bits == 0x8000);
  CHECK(loom::half(70000.0f).bits == 0x7c00);
  CHECK(loom::half(-std::numeric_limits<float>::max()).bits == 0xfc00);
  for (const double d : {0.1, -6e-8, 65519.0, 1.0 / 3.0}) {
    CHECK(loom::half(d).bits == loom::half(static_cast<float>(d)).bits);
  }
  check_nan_inputs<loom::half>();
}

TEST_CASE("core::bfloat16 decodes all 65536 encodings exactly", "[core][float16]") {
  check_decodes_all_encodings<loom::bfloat16>();
}

TEST_CASE("core::half decodes all 65536 encodings exactly", "[core][float16]") {
  check_decodes_all_encodings<loom::half>();
}

TEST_CASE("core::bfloat16 rounds every boundary to nearest even", "[core][float16]") {
  check_rounds_like_reference<loom::bfloat16>(boundary_inputs<bfloat16_format>());
}

TEST_CASE("core::half rounds every boundary to nearest even", "[core][float16]") {
  check_rounds_like_reference<loom::half>(boundary_inputs<half_format>());
}

TEST_CASE("core::bfloat16 rounds random floats like the reference", "[core][float16]") {
  check_rounds_like_reference<loom::bfloat16>(random_inputs<bfloat16_format>(1'000'000, 0xbf16));
}

TEST_CASE("core::half rounds random floats like the reference", "[core][float16]") {
  check_rounds_like_reference<loom::half>(random_inputs<half_format>(1'000'000, 0xf16));
}

TEST_CASE("core::bfloat16 round-trips every non-NaN encoding", "[core][float16]") {
  check_round_trips<loom::bfloat16>();
}

TEST_CASE("core::half round-trips every non-NaN encoding", "[core][float16]") { check_round_trips<loom::half>(); }
