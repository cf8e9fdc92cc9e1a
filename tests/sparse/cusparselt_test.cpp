// sparse::cusparselt: 2:4 structured SpMM through cuSPARSELt under loom's call shape. [host] cases
// run anywhere (the checks made before the device is touched, the dense 2:4 form a plan
// compresses); the others need a GPU and compare cuSPARSELt's results with an fp64 dense oracle.

#define LOOM_TEST_BACKEND_CUDA 1
#include <loom/sparse/convert.hpp>
#include <loom/sparse/cusparselt.hpp>

#include <support/backends.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

using namespace loom;
namespace lt = loom::sparse::cusparselt;
using test::require_loom_error;

namespace {

// A random M x K weight with exactly 2 nonzeros in every group of 4 columns, as fp64 and as
// loom's 2:4 format of T.
template <class T>
struct weight {
  std::vector<double> dense;
  sparse::n_m<2, 4, T> a;
  weight(index_t m, index_t k, std::uint64_t stream) : dense(static_cast<std::size_t>(m * k)) {
    auto g = test::rng(stream);
    std::uniform_real_distribution<float> u(-1, 1);
    std::uniform_int_distribution<int> pick(0, 5);
    static constexpr int pairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
    std::vector<T> stored(dense.size(), T(0.0f));
    for (index_t r = 0; r < m; ++r)
      for (index_t g0 = 0; g0 < k; g0 += 4) {
        const int* pr = pairs[pick(g)];
        for (int s = 0; s < 2; ++s) {
          const T v = T(u(g));
          const auto at = static_cast<std::size_t>(r * k + g0 + pr[s]);
          stored[at] = v;
          dense[at] = static_cast<double>(static_cast<float>(v));
        }
      }
    a = sparse::to_n_m<2, 4>(tensor_view<const T, 2>(stored.data(), {m, k}));
  }
};

}  // namespace

TEST_CASE("sparse::cusparselt: make_plan rejects shapes, n, order and scalars before touching the device",
          "[sparse][cusparselt][host]") {
  const loom::cuda b{};
  const std::vector<loom::half> v(16, loom::half(0.5f));
  const std::vector<std::uint8_t> idx(16, 0);
  auto view = [&](index_t m, index_t k) { return sparse::n_m_view<2, 4, loom::half>{m, k, v.data(), idx.data()}; };
  constexpr auto call = "sparse::cusparselt::make_plan";
  require_loom_error([&] { (void)lt::make_plan(b, view(0, 8), 4); }, errc::invalid_argument,
                     {call, "A must have rows and columns", "0 x 8"});
  require_loom_error([&] { (void)lt::make_plan(b, view(4, 8), 0); }, errc::invalid_argument,
                     {call, "n (the columns of B and C) must be > 0", "got 0"});
  require_loom_error([&] { (void)lt::make_plan(b, view(2, 6), 4); }, errc::unsupported,
                     {call, "multiple of 4", "got 6"});
  require_loom_error([&] { (void)lt::make_plan(b, view(4, 8), 4, {.order = static_cast<sparse::order>(3)}); },
                     errc::invalid_argument, {call, "options.order"});
  require_loom_error([&] { (void)lt::make_plan(b, view(4, 8), 4, {.beta = std::numeric_limits<double>::quiet_NaN()}); },
                     errc::invalid_argument, {call, "must be finite", "nan"});
}

TEST_CASE("sparse::cusparselt: the dense 2:4 form a plan compresses", "[sparse][cusparselt][host]") {
  for (const index_t k : {index_t{4}, index_t{12}, index_t{64}}) {
    const weight<loom::bfloat16> w(7, k, static_cast<std::uint64_t>(k));
    const auto dense = lt::detail::expand(w.a.view());
    REQUIRE(dense.size() == w.dense.size());
    for (std::size_t i = 0; i < dense.size(); ++i)
      CHECK(static_cast<double>(static_cast<float>(dense[i])) == w.dense[i]);
  }
}

namespace {

template <class T>
void check_product(index_t m, index_t k, index_t n, sparse::order o, double alpha, double beta, std::uint64_t stream) {
  CAPTURE(m, k, n, o == sparse::order::row_major, alpha, beta);
  const weight<T> w(m, k, stream);
  auto g = test::rng(stream + 1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<T> bh(static_cast<std::size_t>(k * n)), c0(static_cast<std::size_t>(m * n));
  for (auto& x : bh) x = T(u(g));
  for (auto& x : c0) x = beta == 0 ? T(std::numeric_limits<float>::quiet_NaN()) : T(u(g));
  const bool rm = o == sparse::order::row_major;
  auto at = [&](index_t i, index_t j, index_t rows, index_t cols) {
    return static_cast<std::size_t>(rm ? i * cols + j : j * rows + i);
  };
  // want: alpha A B + beta C0; mag: |alpha| |A| |B| + |beta| |C0|, what the sums' rounding scales with
  std::vector<double> want(c0.size()), mag(c0.size());
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double s = 0, sa = 0;
      for (index_t l = 0; l < k; ++l) {
        const double x =
            w.dense[static_cast<std::size_t>(i * k + l)] * static_cast<double>(static_cast<float>(bh[at(l, j, k, n)]));
        s += x, sa += std::abs(x);
      }
      const double c = beta == 0 ? 0.0 : beta * static_cast<double>(static_cast<float>(c0[at(i, j, m, n)]));
      want[at(i, j, m, n)] = alpha * s + c;
      mag[at(i, j, m, n)] = std::abs(alpha) * sa + std::abs(c);
    }
  const test::buffer<T> bd(bh), cd(c0);
  auto view = [&](T* p, index_t rows, index_t cols) {
    return rm ? tensor_view<T, 2, cuda_memory>(p, {rows, cols})
              : tensor_view<T, 2, cuda_memory>(p, {rows, cols}, {1, rows});
  };
  const loom::cuda b{};
  const auto p = lt::make_plan(b, w.a, n, {.alpha = alpha, .beta = beta, .order = o});
  const test::workspace ws(p.workspace_bytes());
  lt::spmm(b, p, tensor_view<const T, 2, cuda_memory>(view(bd.data(), k, n)), view(cd.data(), m, n), ws.span());
  const auto got = cd.to_host();
  // Twice the unit roundoff: of the float accumulation per term of the k-term sums, and of C's storage.
  const double acc_eps = static_cast<double>(k + 2) * 0x1p-23;
  const double out_eps = std::is_same_v<T, loom::bfloat16> ? 0x1p-7 : 0x1p-10;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double x = static_cast<double>(static_cast<float>(got[i]));
    if (!(std::abs(x - want[i]) <= acc_eps * mag[i] + out_eps * std::abs(want[i]) + 1e-30)) {
      FAIL_CHECK("element " << i << ": got " << x << ", want " << want[i]);
      return;
    }
  }
}

}  // namespace

TEST_CASE("sparse::cusparselt: products against the fp64 oracle, both orders", "[sparse][cusparselt][gpu]") {
  std::uint64_t s = 300;
  for (const auto o : {sparse::order::row_major, sparse::order::col_major})
    for (const index_t n : {index_t{16}, index_t{64}, index_t{72}}) {
      check_product<loom::half>(64, 128, n, o, 1.0, 0.0, s += 3);
      check_product<loom::bfloat16>(128, 256, n, o, 0.5, 0.25, s += 3);
    }
}

TEST_CASE("sparse::cusparselt: calls reject operands that do not fit the plan", "[sparse][cusparselt][gpu]") {
  const weight<loom::half> w(64, 64, 9);
  const index_t m = 64, k = 64, n = 16;
  const test::buffer<loom::half> bd(static_cast<std::size_t>(k * n + 64)), cd(static_cast<std::size_t>(m * n + 64));
  const loom::cuda b{};
  const auto p = lt::make_plan(b, w.a, n);
  const test::workspace ws(p.workspace_bytes() + loom::workspace_alignment);
  using cv = tensor_view<const loom::half, 2, cuda_memory>;
  using v = tensor_view<loom::half, 2, cuda_memory>;
  constexpr auto call = "sparse::cusparselt::spmm";
  require_loom_error(
      [&] {
        lt::spmm(b, p, cv(bd.data(), {k, n + 1}), v(cd.data(), {m, n}), ws.span());
      },
      errc::shape_mismatch, {call, "B must be [64, 16] (K x N)"});
  require_loom_error(
      [&] {
        lt::spmm(b, p, cv(bd.data(), {k, n}), v(cd.data(), {m - 1, n}), ws.span());
      },
      errc::shape_mismatch, {call, "C must be [64, 16] (M x N)"});
  require_loom_error(
      [&] {
        lt::spmm(b, p, cv(bd.data(), {k, n}, {1, k}), v(cd.data(), {m, n}), ws.span());
      },
      errc::invalid_argument, {call, "B must be dense and row-major"});
  require_loom_error(
      [&] {
        lt::spmm(b, p, cv(bd.data() + 1, {k, n}), v(cd.data(), {m, n}), ws.span());
      },
      errc::invalid_argument, {call, "16-byte boundaries"});
  require_loom_error(
      [&] {
        lt::spmm(b, p, cv(bd.data(), {k, n}), v(bd.data() + 8 * 8, {m, n}), ws.span());
      },
      errc::invalid_argument, {call, "share memory"});
  require_loom_error(
      [&] {
        lt::spmm(b, lt::plan<loom::half>{}, cv(bd.data(), {k, n}), v(cd.data(), {m, n}), ws.span());
      },
      errc::invalid_argument, {call, "not made by sparse::cusparselt::make_plan"});
}
