// Checked size arithmetic (core/checked.hpp), the header paths error messages print
// (core/error.hpp), and the overlap tests of views (core/overlap.hpp).

#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/core/overlap.hpp>
#include <loom/core/tensor_view.hpp>

#include <support/errors.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace {

using loom::index_t;
using loom::detail::checked_add;
using loom::detail::checked_mul;
using loom::test::require_loom_error;

constexpr index_t max = std::numeric_limits<index_t>::max();
constexpr index_t min = std::numeric_limits<index_t>::min();

}  // namespace

TEST_CASE("checked_mul and checked_add: exact results up to the limits", "[core][checked]") {
  STATIC_REQUIRE(checked_mul(index_t{3037000499}, index_t{3037000499}, "x") == index_t{9223372030926249001});
  STATIC_REQUIRE(checked_mul(max, index_t{1}, "x") == max);
  STATIC_REQUIRE(checked_mul(min, index_t{1}, "x") == min);
  STATIC_REQUIRE(checked_mul(index_t{-1}, max, "x") == -max);
  STATIC_REQUIRE(checked_mul(index_t{0}, min, "x") == 0);
  STATIC_REQUIRE(checked_mul(min / 2, index_t{2}, "x") == min);
  STATIC_REQUIRE(checked_add(max - 5, index_t{5}, "x") == max);
  STATIC_REQUIRE(checked_add(min, max, "x") == -1);
  STATIC_REQUIRE(checked_add(min + 1, index_t{-1}, "x") == min);
  STATIC_REQUIRE(checked_mul(std::size_t{1} << 32, (std::size_t{1} << 32) - 1, "x") ==
                 std::numeric_limits<std::size_t>::max() - (std::size_t{1} << 32) + 1);
  STATIC_REQUIRE(checked_add(std::numeric_limits<std::size_t>::max() - 1, std::size_t{1}, "x") ==
                 std::numeric_limits<std::size_t>::max());
  STATIC_REQUIRE(loom::detail::ceil_div(max, index_t{2}) == max / 2 + 1);
  STATIC_REQUIRE(loom::detail::ceil_div(index_t{0}, index_t{7}) == 0);
  STATIC_REQUIRE(loom::detail::ceil_div(index_t{14}, index_t{7}) == 2);
  STATIC_REQUIRE(loom::detail::ceil_div(index_t{15}, index_t{7}) == 3);
  // Every sign combination one step past the limit overflows; one step inside does not.
  CHECK(loom::detail::mul_overflows(index_t{3037000500}, index_t{3037000500}));
  CHECK(loom::detail::mul_overflows(index_t{-3037000500}, index_t{-3037000500}));
  CHECK(loom::detail::mul_overflows(index_t{-3037000500}, index_t{3037000500}));
  CHECK(!loom::detail::mul_overflows(index_t{-3037000499}, index_t{3037000499}));
  CHECK(loom::detail::mul_overflows(min, index_t{-1}));
  CHECK(loom::detail::mul_overflows(index_t{-1}, min));
  CHECK(loom::detail::mul_overflows(min / 2 - 1, index_t{2}));
  CHECK(loom::detail::mul_overflows(index_t{2}, min / 2 - 1));
  CHECK(!loom::detail::mul_overflows(index_t{2}, min / 2));
  CHECK(loom::detail::mul_overflows(max / 2 + 1, index_t{2}));
  CHECK(!loom::detail::mul_overflows(max / 2, index_t{2}));
  CHECK(loom::detail::add_overflows(max, index_t{1}));
  CHECK(loom::detail::add_overflows(min, index_t{-1}));
  CHECK(!loom::detail::add_overflows(max, index_t{0}));
  CHECK(loom::detail::mul_overflows(std::size_t{1} << 32, std::size_t{1} << 32));
  CHECK(loom::detail::add_overflows(std::numeric_limits<std::size_t>::max(), std::size_t{1}));
}

TEST_CASE("checked_mul and checked_add: an overflow is a loom::error naming the operands", "[core][checked]") {
  const std::string what = require_loom_error(
      [] { (void)checked_mul(max / 2 + 1, index_t{2}, "f: rows * cols"); }, loom::errc::invalid_argument,
      {"loom::invalid_argument: f: rows * cols = 4611686018427387904 * 2 overflows "
       "a 64-bit signed integer (max 9223372036854775807)"});
  // The location is the caller's: this file, not the header.
  CHECK(what.find("checked_test.cpp:") != std::string::npos);
  CHECK(what.find("checked.hpp") == std::string::npos);
  require_loom_error([] { (void)checked_add(max, index_t{1}, "g: rows + 1"); }, loom::errc::invalid_argument,
                     {"g: rows + 1 = 9223372036854775807 + 1 overflows a 64-bit signed integer"});
  require_loom_error([] { (void)checked_mul(std::size_t{1} << 40, std::size_t{1} << 30, "h: bytes"); },
                     loom::errc::invalid_argument,
                     {"h: bytes = 1099511627776 * 1073741824 overflows a 64-bit unsigned integer (max "
                      "18446744073709551615)"});
  // Narrow types print as numbers.
  require_loom_error([] { (void)checked_mul(std::uint8_t{16}, std::uint8_t{16}, "k: bytes"); },
                     loom::errc::invalid_argument,
                     {"k: bytes = 16 * 16 overflows an 8-bit unsigned integer (max 255)"});
}

TEST_CASE("error messages name loom headers relative to include/", "[core][error]") {
  using loom::detail::source_path;
  STATIC_REQUIRE(std::string_view(source_path("/home/user/src/include/loom/scan/scan.hpp")) == "loom/scan/scan.hpp");
  STATIC_REQUIRE(std::string_view(source_path("/opt/include/a/include/loom/core/error.hpp")) == "loom/core/error.hpp");
  STATIC_REQUIRE(std::string_view(source_path("C:\\src\\include\\loom\\core\\error.hpp")) == "loom\\core\\error.hpp");
  STATIC_REQUIRE(std::string_view(source_path("include/loom/x.hpp")) == "loom/x.hpp");
  STATIC_REQUIRE(std::string_view(source_path("/a/myinclude/loom/x.hpp")) == "/a/myinclude/loom/x.hpp");
  STATIC_REQUIRE(std::string_view(source_path("/a/include")) == "/a/include");
  STATIC_REQUIRE(std::string_view(source_path("tests/core/checked_test.cpp")) == "tests/core/checked_test.cpp");
  // A precondition inside a header: the message ends with "[loom/core/tensor_view.hpp:<line>]".
  const std::string what =
      require_loom_error([] { (void)loom::make_view(static_cast<float*>(nullptr), std::array<index_t, 1>{-1}, "x"); },
                         loom::errc::invalid_argument, {"x: extent 0 must be >= 0, got -1"});
  CHECK(what.find(" [loom/core/tensor_view.hpp:") != std::string::npos);
  CHECK(what.find("include/") == std::string::npos);
}

TEST_CASE("make_view rejects extents whose product overflows, naming the view", "[core][checked]") {
  float x = 0;
  require_loom_error(
      [&] {
        (void)loom::make_view(&x, std::array<index_t, 3>{1 << 20, 1 << 22, 1 << 22}, "q");
      },
      loom::errc::invalid_argument,
      {"q: extents [1048576, 4194304, 4194304] hold more elements than a 64-bit signed index can count"});
  require_loom_error(
      [&] {
        (void)loom::make_view(&x, std::array<index_t, 2>{max, 2}, "k");
      },
      loom::errc::invalid_argument, {"k: extents [9223372036854775807, 2]"});
  // A zero extent makes the size 0 whatever the others.
  CHECK(loom::make_view(&x, std::array<index_t, 3>{max, 0, max}, "z").size() == 0);
}

TEST_CASE("overlaps and same_elements compare the memory of two views", "[core][overlap]") {
  std::vector<float> buf(100);
  float* p = buf.data();
  using v1 = loom::tensor_view<float, 1>;
  using v2 = loom::tensor_view<const float, 2>;
  // Disjoint, adjacent, overlapping by one element.
  CHECK(!loom::overlaps(v1(p, {10}), v1(p + 10, {10})));
  CHECK(loom::overlaps(v1(p, {10}), v1(p + 9, {10})));
  CHECK(loom::overlaps(v1(p + 9, {10}), v1(p, {10})));
  // Empty views overlap nothing, whatever their pointer.
  CHECK(!loom::overlaps(v1(p, {0}), v1(p, {10})));
  CHECK(!loom::overlaps(v1(), v1(p, {10})));
  // Interleaved rank-1 views with one stride share no element; shifted by a whole stride they do.
  CHECK(!loom::overlaps(v1(p, {50}, {2}), v1(p + 1, {50}, {2})));
  CHECK(loom::overlaps(v1(p, {40}, {2}), v1(p + 2, {40}, {2})));
  CHECK(!loom::overlaps(v1(p + 98, {50}, {-2}), v1(p + 1, {50}, {2})));
  CHECK(!loom::overlaps(v1(p, {25}, {4}), v1(p + 2, {25}, {4})));
  // Elements of different sizes are compared by byte ranges: two doubles over floats 2-3 and 6-7
  // span floats 2 to 7 (conservatively: float 5 lies between them).
  auto* d = reinterpret_cast<double*>(p + 2);
  CHECK(loom::overlaps(loom::tensor_view<double, 1>(d, {2}, {2}), v1(p + 5, {1})));
  CHECK(!loom::overlaps(loom::tensor_view<double, 1>(d, {1}), v1(p + 4, {10})));
  // Negative strides: the range runs from the last element to the first.
  CHECK(loom::overlaps(v1(p + 9, {10}, {-1}), v1(p, {1})));
  CHECK(!loom::overlaps(v1(p + 9, {10}, {-1}), v1(p + 10, {1})));
  // Rank 2: a column block and the rows below it.
  CHECK(loom::overlaps(v2(p, {4, 5}, {10, 1}), v2(p + 30, {1, 10})));
  CHECK(!loom::overlaps(v2(p, {4, 5}, {10, 1}), v2(p + 40, {1, 10})));
  // same_elements: the in-place case.
  CHECK(loom::same_elements(v1(p, {10}), loom::tensor_view<const float, 1>(p, {10})));
  CHECK(!loom::same_elements(v1(p, {10}), v1(p, {10}, {2})));
  CHECK(!loom::same_elements(v1(p, {10}), v1(p + 1, {10})));
  CHECK(!loom::same_elements(v1(p, {10}), v1(p, {9})));
  CHECK(loom::same_elements(v1(p, {1}, {3}), v1(p, {1}, {1})));  // the stride of one element does not matter
  CHECK(loom::same_elements(v1(p, {10}), loom::tensor_view<std::int32_t, 1>(reinterpret_cast<std::int32_t*>(p), {10})));
  CHECK(!loom::same_elements(v1(p, {5}), loom::tensor_view<double, 1>(reinterpret_cast<double*>(p), {5})));
}
