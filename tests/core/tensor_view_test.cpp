// loom::tensor_view (indexing, strides, const conversion, slices, contiguity), the validated
// make_view / expect_extents entry points, loom::error, and the precision vocabulary.

#include <loom/core/error.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/tensor_view.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using loom::index_t;

// Matches a loom::error by code and by substrings of what(): the message must name the argument.
class error_matcher : public Catch::MatcherBase<loom::error> {
 public:
  error_matcher(loom::errc code, std::vector<std::string> parts) : code_(code), parts_(std::move(parts)) {}

  bool match(const loom::error& e) const override {
    if (e.code() != code_) return false;
    const std::string what = e.what();
    for (const auto& p : parts_)
      if (what.find(p) == std::string::npos) return false;
    return true;
  }

  std::string describe() const override {
    std::string d = "is a loom::error with code " + std::string(loom::to_string(code_)) + " whose message contains";
    for (const auto& p : parts_) d += " \"" + p + "\"";
    return d;
  }

 private:
  loom::errc code_;
  std::vector<std::string> parts_;
};

error_matcher is_error(loom::errc code, std::vector<std::string> parts) { return {code, std::move(parts)}; }

// 0, 1, 2, ... so an element's value is its row-major linear index.
std::vector<float> iota_buffer(std::size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 0.0f);
  return v;
}

template <class V, class... I>
concept indexable_with = requires(V v, I... i) {
  v(i...);
};

// A precision the user spells out, satisfying the concept without being loom::precision.
struct user_precision {
  using storage_type = loom::half;
  using accum_type = double;
};
struct no_accum {
  using storage_type = float;
};
struct int_storage {
  using storage_type = int;
  using accum_type = float;
};
struct bf16_accum {
  using storage_type = float;
  using accum_type = loom::bfloat16;
};

template <class S, class A>
concept valid_precision = requires {
  typename loom::precision<S, A>;
};

// Indexing, slicing and conversion work in constant evaluation (the LOOM_HD members are constexpr).
constexpr float constexpr_view_sum() {
  float data[12] = {};
  for (int i = 0; i < 12; ++i) data[i] = static_cast<float>(i);
  const loom::tensor_view<float, 2> v(data, {3, 4});
  const loom::tensor_view<const float, 2> c = v.slice(1, 3);
  return c(0, 0) + c(1, 3) + static_cast<float>(c.size());
}
static_assert(constexpr_view_sum() == 4.0f + 11.0f + 8.0f);

}  // namespace

TEST_CASE("core::tensor_view row-major indexing of an odd 3x5x7 shape", "[core][tensor_view]") {
  auto buf = iota_buffer(3 * 5 * 7);
  const loom::tensor_view<float, 3> v(buf.data(), {3, 5, 7});
  CHECK(v.data() == buf.data());
  CHECK(v.extent(0) == 3);
  CHECK(v.extent(1) == 5);
  CHECK(v.extent(2) == 7);
  CHECK(v.stride(0) == 35);
  CHECK(v.stride(1) == 7);
  CHECK(v.stride(2) == 1);
  CHECK(v.size() == 105);
  CHECK_FALSE(v.empty());
  CHECK(v.is_contiguous());
  int wrong = 0;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j)
      for (int k = 0; k < 7; ++k)
        if (v(i, j, k) != static_cast<float>(i * 35 + j * 7 + k)) ++wrong;
  CHECK(wrong == 0);
  // Any integral index type works; writes go through to the buffer.
  v(std::size_t{2}, short{4}, index_t{6}) = -1.0f;
  CHECK(buf.back() == -1.0f);
}

TEST_CASE("core::tensor_view custom strides", "[core][tensor_view]") {
  auto buf = iota_buffer(3 * 5 * 7);

  SECTION("column-major strides address the transposed layout") {
    const loom::tensor_view<float, 3> v(buf.data(), {3, 5, 7}, {1, 3, 15});
    CHECK_FALSE(v.is_contiguous());
    CHECK(v.size() == 105);
    int wrong = 0;
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 5; ++j)
        for (int k = 0; k < 7; ++k)
          if (v(i, j, k) != static_cast<float>(i + j * 3 + k * 15)) ++wrong;
    CHECK(wrong == 0);
  }

  SECTION("a padded leading stride views a sub-block") {
    // Rows of 7 inside rows of 9: a 5x7 window of a 5x9 buffer (45 of the 105 elements).
    const loom::tensor_view<float, 2> v(buf.data() + 1, {5, 7}, {9, 1});
    CHECK_FALSE(v.is_contiguous());
    CHECK(v(0, 0) == 1.0f);
    CHECK(v(4, 6) == static_cast<float>(1 + 4 * 9 + 6));
    CHECK(v(2, 3) == static_cast<float>(1 + 2 * 9 + 3));
  }

  SECTION("every other element of the last dimension") {
    const loom::tensor_view<float, 2> v(buf.data(), {3, 4}, {35, 2});
    CHECK_FALSE(v.is_contiguous());
    CHECK(v(1, 3) == 41.0f);
    CHECK(v(2, 0) == 70.0f);
  }

  SECTION("a zero stride broadcasts one row") {
    const loom::tensor_view<float, 2> v(buf.data() + 7, {4, 7}, {0, 1});
    CHECK_FALSE(v.is_contiguous());
    CHECK(v(3, 2) == 9.0f);
    CHECK(v(0, 2) == 9.0f);
  }

  SECTION("strides of unit extents do not affect contiguity") {
    CHECK(loom::tensor_view<float, 3>(buf.data(), {1, 5, 7}, {999, 7, 1}).is_contiguous());
    CHECK(loom::tensor_view<float, 3>(buf.data(), {3, 1, 7}, {7, 123, 1}).is_contiguous());
    CHECK(loom::tensor_view<float, 3>(buf.data(), {3, 5, 1}, {5, 1, 42}).is_contiguous());
    CHECK_FALSE(loom::tensor_view<float, 3>(buf.data(), {3, 5, 2}, {5, 1, 42}).is_contiguous());
  }
}

TEST_CASE("core::tensor_view converts to a view of const", "[core][tensor_view]") {
  auto buf = iota_buffer(3 * 5 * 7);
  const loom::tensor_view<float, 3> v(buf.data(), {3, 5, 7}, {1, 3, 15});
  const loom::tensor_view<const float, 3> c = v;
  CHECK(c.data() == v.data());
  for (std::size_t d = 0; d < 3; ++d) {
    CHECK(c.extent(d) == v.extent(d));
    CHECK(c.stride(d) == v.stride(d));
  }
  CHECK(c(2, 4, 6) == v(2, 4, 6));
  static_assert(std::is_same_v<decltype(c(0, 0, 0)), const float&>);
  static_assert(std::is_same_v<decltype(v(0, 0, 0)), float&>);

  using view = loom::tensor_view<float, 3>;
  using const_view = loom::tensor_view<const float, 3>;
  static_assert(std::is_nothrow_convertible_v<view, const_view>);
  static_assert(!std::is_convertible_v<const_view, view>);
  static_assert(!std::is_constructible_v<view, const_view>);
  // Neither the rank nor the memory space changes by conversion.
  static_assert(!std::is_convertible_v<view, loom::tensor_view<const float, 2>>);
  static_assert(!std::is_convertible_v<view, loom::tensor_view<const float, 3, loom::cuda_memory>>);
  static_assert(!std::is_convertible_v<loom::tensor_view<float, 3, loom::cuda_memory>, const_view>);
  static_assert(std::is_trivially_copyable_v<view>);
}

TEST_CASE("core::tensor_view indexing takes exactly rank integral indices", "[core][tensor_view]") {
  using view = loom::tensor_view<float, 3>;
  static_assert(indexable_with<view, int, long, std::size_t>);
  static_assert(!indexable_with<view, int, int>);
  static_assert(!indexable_with<view, int, int, int, int>);
  static_assert(!indexable_with<view, int, double, int>);
  static_assert(view::rank == 3);
  static_assert(std::is_same_v<view::value_type, float>);
  static_assert(std::is_same_v<loom::tensor_view<const float, 1>::value_type, float>);
  static_assert(std::is_same_v<view::space, loom::host_memory>);
  SUCCEED("constraints checked at compile time");
}

TEST_CASE("core::tensor_view slice of the leading dimension", "[core][tensor_view]") {
  auto buf = iota_buffer(3 * 5 * 7);
  const loom::tensor_view<float, 3> v(buf.data(), {3, 5, 7});

  SECTION("rows of a row-major view stay contiguous") {
    const auto s = v.slice(1, 3);
    CHECK(s.data() == buf.data() + 35);
    CHECK(s.extent(0) == 2);
    CHECK(s.extent(1) == 5);
    CHECK(s.extent(2) == 7);
    CHECK(s.stride(0) == 35);
    CHECK(s.is_contiguous());
    CHECK(s(0, 0, 0) == v(1, 0, 0));
    CHECK(s(1, 4, 6) == v(2, 4, 6));
  }

  SECTION("an empty slice") {
    const auto s = v.slice(2, 2);
    CHECK(s.size() == 0);
    CHECK(s.empty());
  }

  SECTION("a slice of a strided view keeps the strides") {
    const loom::tensor_view<float, 3> t(buf.data(), {3, 5, 7}, {1, 3, 15});
    const auto s = t.slice(1, 2);
    CHECK(s.extent(0) == 1);
    CHECK(s.stride(1) == 3);
    CHECK(s.stride(2) == 15);
    CHECK_FALSE(s.is_contiguous());
    for (int j = 0; j < 5; ++j) CHECK(s(0, j, 6) == t(1, j, 6));
  }

  SECTION("a slice of a const view is a const view") {
    const loom::tensor_view<const float, 3> c = v;
    static_assert(std::is_same_v<decltype(c.slice(0, 1)), loom::tensor_view<const float, 3>>);
    CHECK(c.slice(2, 3)(0, 1, 2) == 70.0f + 7.0f + 2.0f);
  }
}

TEST_CASE("core::tensor_view default and empty views", "[core][tensor_view]") {
  constexpr loom::tensor_view<double, 2> none;
  static_assert(none.data() == nullptr && none.size() == 0 && none.empty());
  const loom::tensor_view<double, 2> zero_rows(nullptr, {0, 5});
  CHECK(zero_rows.size() == 0);
  CHECK(zero_rows.empty());
  CHECK(zero_rows.stride(0) == 5);
  CHECK(zero_rows.is_contiguous());
}

TEST_CASE("core::make_view validates its arguments", "[core][tensor_view][error]") {
  auto buf = iota_buffer(3 * 5 * 7);

  SECTION("a valid view is row-major") {
    const auto v = loom::make_view(buf.data(), std::array<index_t, 3>{3, 5, 7}, "x");
    static_assert(std::is_same_v<decltype(v), const loom::tensor_view<float, 3>>);
    CHECK(v.is_contiguous());
    CHECK(v.stride(0) == 35);
    CHECK(v(2, 4, 6) == 104.0f);
    const float* cdata = buf.data();
    const auto c = loom::make_view<loom::cuda_managed_memory>(cdata, std::array<index_t, 1>{105});
    static_assert(std::is_same_v<decltype(c), const loom::tensor_view<const float, 1, loom::cuda_managed_memory>>);
    CHECK(c(104) == 104.0f);
  }

  SECTION("a negative extent names the argument and the dimension") {
    CHECK_THROWS_MATCHES(
        loom::make_view(buf.data(), std::array<index_t, 3>{3, -5, 7}, "weights"), loom::error,
        is_error(loom::errc::invalid_argument, {"loom::invalid_argument: ", "weights: extent 1 must be >= 0, got -5"}));
    CHECK_THROWS_MATCHES(loom::make_view(buf.data(), std::array<index_t, 1>{-1}), loom::error,
                         is_error(loom::errc::invalid_argument, {"view: extent 0 must be >= 0, got -1"}));
  }

  SECTION("null data with a non-zero size is rejected") {
    float* null = nullptr;
    CHECK_THROWS_MATCHES(loom::make_view(null, std::array<index_t, 2>{2, 3}, "bias"), loom::error,
                         is_error(loom::errc::invalid_argument, {"bias: null data with 6 elements"}));
  }

  SECTION("null data with a zero size is a valid empty view") {
    float* null = nullptr;
    loom::tensor_view<float, 2> v;
    CHECK_NOTHROW(v = loom::make_view(null, std::array<index_t, 2>{4, 0}, "empty"));
    CHECK(v.empty());
  }

  SECTION("the error is reported through loom::error's accessors") {
    try {
      (void)loom::make_view(buf.data(), std::array<index_t, 2>{-2, 3}, "keys");
      FAIL("make_view accepted a negative extent");
    } catch (const loom::error& e) {
      CHECK(e.code() == loom::errc::invalid_argument);
      const std::string what = e.what();
      CHECK(what.rfind("loom::invalid_argument: keys: extent 0", 0) == 0);
    }
  }
}

TEST_CASE("core::expect_extents reports a shape_mismatch", "[core][tensor_view][error]") {
  auto buf = iota_buffer(3 * 5 * 7);
  const loom::tensor_view<float, 3> v(buf.data(), {3, 5, 7});
  CHECK_NOTHROW(loom::expect_extents(v, {3, 5, 7}, "q"));
  CHECK_THROWS_MATCHES(
      loom::expect_extents(v, {3, 5, 6}, "q"), loom::error,
      is_error(loom::errc::shape_mismatch, {"loom::shape_mismatch: q: expected extents [3, 5, 6], got [3, 5, 7]"}));
  // The first dimension is checked like the others.
  CHECK_THROWS_MATCHES(loom::expect_extents(v.slice(0, 2), {3, 5, 7}, "k"), loom::error,
                       is_error(loom::errc::shape_mismatch, {"k: expected extents [3, 5, 7], got [2, 5, 7]"}));
  const loom::tensor_view<const float, 1> flat(buf.data(), {105});
  CHECK_THROWS_MATCHES(loom::expect_extents(flat, {104}, "flat"), loom::error,
                       is_error(loom::errc::shape_mismatch, {"flat: expected extents [104], got [105]"}));
}

TEST_CASE("core::error what() reads loom::<code>: <message>", "[core][error]") {
  using loom::errc;
  CHECK(std::string(loom::error(errc::timeout, "peer 3 did not arrive").what()) ==
        "loom::timeout: peer 3 did not arrive");
  CHECK(loom::error(errc::timeout, "x").code() == errc::timeout);

  const std::pair<errc, const char*> names[] = {
      {errc::invalid_argument, "invalid_argument"},
      {errc::shape_mismatch, "shape_mismatch"},
      {errc::unsupported, "unsupported"},
      {errc::comm_failure, "comm_failure"},
      {errc::timeout, "timeout"},
      {errc::not_converged, "not_converged"},
      {errc::internal, "internal"},
  };
  for (const auto& [code, name] : names) {
    CHECK(loom::to_string(code) == name);
    CHECK(std::string(loom::error(code, "m").what()) == std::string("loom::") + name + ": m");
  }
  static_assert(loom::to_string(errc::shape_mismatch) == "shape_mismatch");
  static_assert(std::is_base_of_v<std::runtime_error, loom::error>);

  SECTION("LOOM_EXPECTS builds its message only on failure and records the location") {
    int built = 0;
    auto part = [&built] {
      ++built;
      return "n";
    };
    LOOM_EXPECTS(1 + 1 == 2, errc::invalid_argument, part(), " must hold");
    CHECK(built == 0);
    const int n = -2;
    try {
      LOOM_EXPECTS(n >= 0, errc::invalid_argument, part(), " must be >= 0, got ", n);
      FAIL("LOOM_EXPECTS did not throw");
    } catch (const loom::error& e) {
      CHECK(built == 1);
      CHECK(e.code() == errc::invalid_argument);
      const std::string what = e.what();
      CHECK(what.rfind("loom::invalid_argument: n must be >= 0, got -2 [", 0) == 0);
      CHECK(what.find("tensor_view_test.cpp:") != std::string::npos);
    }
    CHECK_THROWS_MATCHES(LOOM_FAIL(errc::not_converged, "gmres: ", 40, " iterations"), loom::error,
                         is_error(errc::not_converged, {"loom::not_converged: gmres: 40 iterations ["}));
  }
}

TEST_CASE("core::precision aliases and names", "[core][precision]") {
  static_assert(std::is_same_v<loom::fp64::storage_type, double> && std::is_same_v<loom::fp64::accum_type, double>);
  static_assert(std::is_same_v<loom::fp32::storage_type, float> && std::is_same_v<loom::fp32::accum_type, float>);
  static_assert(std::is_same_v<loom::bf16::storage_type, loom::bfloat16> &&
                std::is_same_v<loom::bf16::accum_type, float>);
  static_assert(std::is_same_v<loom::fp16::storage_type, loom::half> && std::is_same_v<loom::fp16::accum_type, float>);

  static_assert(loom::precision_name<loom::fp64>() == "fp64");
  static_assert(loom::precision_name<loom::fp32>() == "fp32");
  static_assert(loom::precision_name<loom::bf16>() == "bf16");
  static_assert(loom::precision_name<loom::fp16>() == "fp16");
  static_assert(loom::precision_name<loom::precision<loom::half, double>>() == "mixed");
  static_assert(loom::precision_name<loom::precision<float, double>>() == "mixed");
  static_assert(loom::precision_name<user_precision>() == "mixed");

  static_assert(loom::floating_storage<float> && loom::floating_storage<double>);
  static_assert(loom::floating_storage<loom::bfloat16> && loom::floating_storage<loom::half>);
  static_assert(!loom::floating_storage<long double> && !loom::floating_storage<int>);
  static_assert(!loom::floating_storage<const float>);

  // Accumulation is float or double and never narrower than storage.
  static_assert(valid_precision<loom::bfloat16, double>);
  static_assert(!valid_precision<double, float>);
  static_assert(!valid_precision<float, loom::half>);
  static_assert(!valid_precision<int, float>);

  CHECK(loom::precision_name<loom::bf16>() == "bf16");
}

TEST_CASE("core::precision_policy concept", "[core][precision]") {
  static_assert(loom::precision_policy<loom::fp64>);
  static_assert(loom::precision_policy<loom::fp32>);
  static_assert(loom::precision_policy<loom::bf16>);
  static_assert(loom::precision_policy<loom::fp16>);
  static_assert(loom::precision_policy<loom::precision<loom::half, double>>);
  static_assert(loom::precision_policy<user_precision>);

  static_assert(!loom::precision_policy<float>);
  static_assert(!loom::precision_policy<no_accum>);
  static_assert(!loom::precision_policy<int_storage>);
  static_assert(!loom::precision_policy<bf16_accum>);
  SUCCEED("concept checked at compile time");
}
