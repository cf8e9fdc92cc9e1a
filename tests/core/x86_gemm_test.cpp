// The small dense products of loom's CPU kernels (backend/detail/x86_gemm.hpp). The float product's
// AVX-512 and AVX2 forms against the contract they share, each output summed over l ascending by
// fused multiply-adds from C (or zero), i.e. bit for bit the scalar loop below, and within fp32
// tolerance of an fp64 oracle; the bfloat16 pair product (AVX512_BF16) against an fp64 oracle.
// Odd and prime shapes exercise every row block, column block and masked tail; nothing outside
// the m x n block of C is written, and NaN in B's row padding never reaches C.

#include <loom/backend/detail/x86_gemm.hpp>
#include <loom/core/float16.hpp>

#include <support/random.hpp>
#include <support/vector_switch.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(LOOM_X86_KERNELS)

namespace {

using loom::index_t;
namespace x86 = loom::detail::x86;

struct shape {
  index_t m, n, kd;
  bool trans_a;
};

constexpr float sentinel = -12345.0f;

//! C (m rows of ldc) with its columns past n holding the sentinel, the others from `values`.
std::vector<float> with_sentinels(std::vector<float> values, index_t m, index_t n, index_t ldc) {
  for (index_t i = 0; i < m; ++i)
    for (index_t j = n; j < ldc; ++j) values[static_cast<std::size_t>(i * ldc + j)] = sentinel;
  return values;
}

//! Requires the sentinels past column n unchanged and calls check(i, j, C[i][j]) for the others.
template <class Check>
void check_outputs(const std::vector<float>& c, index_t m, index_t n, index_t ldc, const Check& check) {
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < ldc; ++j) {
      const float got = c[static_cast<std::size_t>(i * ldc + j)];
      if (j >= n)
        REQUIRE(got == sentinel);
      else
        check(i, j, got);
    }
}

}  // namespace

TEST_CASE("x86 gemm: AVX-512 and AVX2 blocks give the scalar fused multiply-add sums bit for bit", "[core][x86]") {
  if (!x86::avx2_cpu()) {
    SUCCEED("this CPU has no AVX2: the portable products run instead");
    return;
  }
  const shape s =
      GENERATE(shape{1, 1, 1, false}, shape{5, 7, 3, false}, shape{6, 64, 128, false}, shape{64, 64, 128, false},
               shape{64, 128, 64, true}, shape{13, 131, 37, true}, shape{7, 63, 29, false}, shape{17, 49, 11, true},
               shape{11, 17, 0, false}, shape{23, 97, 5, true});
  const bool accumulate = GENERATE(false, true);
  const loom::test::vector_mode mode = GENERATE(loom::test::vector_mode::widest, loom::test::vector_mode::avx2);
  const loom::test::vector_switch switched(mode);
  INFO("m " << s.m << ", n " << s.n << ", kd " << s.kd << ", A transposed " << s.trans_a << ", accumulate "
            << accumulate);
  const index_t lda = (s.trans_a ? s.m : s.kd) + 3, ldb = s.n + 5, ldc = s.n + 7;
  const index_t ar = s.trans_a ? 1 : lda, ak = s.trans_a ? lda : 1;
  auto a = loom::test::uniform<float>((s.trans_a ? s.kd : s.m) * lda + 1, -1.0, 1.0, 1);
  auto b = loom::test::uniform<float>(s.kd * ldb + 1, -1.0, 1.0, 2);
  // The padding of B's rows holds NaN: a lane read past n and kept would show.
  for (index_t l = 0; l < s.kd; ++l)
    for (index_t j = s.n; j < ldb; ++j)
      b[static_cast<std::size_t>(l * ldb + j)] = std::numeric_limits<float>::quiet_NaN();
  const auto c0 = with_sentinels(loom::test::uniform<float>(s.m * ldc, -1.0, 1.0, 3), s.m, s.n, ldc);
  auto c = c0;
  x86::gemm(s.m, s.n, s.kd, a.data(), ar, ak, b.data(), ldb, c.data(), ldc, accumulate);
  check_outputs(c, s.m, s.n, ldc, [&](index_t i, index_t j, float got) {
    float x = accumulate ? c0[static_cast<std::size_t>(i * ldc + j)] : 0.0f;
    double oracle = x;
    for (index_t l = 0; l < s.kd; ++l) {
      const float ail = a[static_cast<std::size_t>(i * ar + l * ak)], blj = b[static_cast<std::size_t>(l * ldb + j)];
      x = std::fma(ail, blj, x);
      oracle += static_cast<double>(ail) * blj;
    }
    std::uint32_t gb, xb;
    std::memcpy(&gb, &got, 4);
    std::memcpy(&xb, &x, 4);
    INFO("C[" << i << "][" << j << "] = " << got << ", scalar fused sum " << x);
    REQUIRE(gb == xb);
    REQUIRE(std::abs(got - oracle) <= 1e-5 * (1.0 + std::sqrt(static_cast<double>(s.kd))));
  });
}

TEST_CASE("x86 gemm: the bfloat16 pair product against an fp64 oracle, masked tails, nothing written past n",
          "[core][x86]") {
  if (!x86::avx512_bf16_cpu()) {
    SUCCEED("this CPU has no AVX512_BF16: the float products run instead");
    return;
  }
  const shape s = GENERATE(shape{1, 1, 1, false}, shape{5, 7, 3, false}, shape{64, 64, 64, false},
                           shape{64, 128, 32, false}, shape{13, 131, 37, false}, shape{7, 63, 29, false},
                           shape{17, 49, 11, false}, shape{11, 17, 0, false}, shape{23, 20, 18, false});
  const bool accumulate = GENERATE(false, true);
  const float mul = accumulate ? 1.0f : 0.125f;
  INFO("m " << s.m << ", n " << s.n << ", pairs " << s.kd << ", accumulate " << accumulate);
  const index_t lda = 2 * s.kd + 2, ldb = 2 * s.n + 6, ldc = s.n + 7;
  auto bits = [](const std::vector<float>& x) {
    std::vector<std::uint16_t> b(x.size());
    for (std::size_t e = 0; e < x.size(); ++e) b[e] = loom::bfloat16(x[e]).bits;
    return b;
  };
  const auto a = bits(loom::test::uniform<float>(s.m * lda + 1, -1.0, 1.0, 4));
  auto bf = loom::test::uniform<float>(s.kd * ldb + 1, -1.0, 1.0, 5);
  for (index_t p = 0; p < s.kd; ++p)  // the padding of B's rows holds NaN
    for (index_t j = 2 * s.n; j < ldb; ++j)
      bf[static_cast<std::size_t>(p * ldb + j)] = std::numeric_limits<float>::quiet_NaN();
  const auto b = bits(bf);
  const auto c0 = with_sentinels(loom::test::uniform<float>(s.m * ldc, -1.0, 1.0, 6), s.m, s.n, ldc);
  auto c = c0;
  {
    const loom::test::vector_switch on(loom::test::vector_mode::widest);
    x86::gemm_bf16(s.m, s.n, s.kd, a.data(), lda, b.data(), ldb, c.data(), ldc, accumulate, mul);
  }
  auto f = [](std::uint16_t u) { return static_cast<double>(loom::bfloat16::from_bits(u)); };
  check_outputs(c, s.m, s.n, ldc, [&](index_t i, index_t j, float got) {
    double sum = 0;
    for (index_t l = 0; l < 2 * s.kd; ++l)
      sum +=
          f(a[static_cast<std::size_t>(i * lda + l)]) * f(b[static_cast<std::size_t>((l / 2) * ldb + 2 * j + l % 2)]);
    const double want = accumulate ? c0[static_cast<std::size_t>(i * ldc + j)] + sum : mul * sum;
    INFO("C[" << i << "][" << j << "] = " << got << ", oracle " << want);
    REQUIRE(std::abs(got - want) <= 1e-5 * (1.0 + std::sqrt(static_cast<double>(2 * s.kd))));
  });
}

#endif
