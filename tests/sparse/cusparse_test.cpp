// sparse::cusparse: CSR SpMM through cuSPARSE under loom's call shape. [host] cases run anywhere
// (the checks made before the device is touched, the 32-bit offsets, the dense-layout rule); the
// others need a GPU and compare cuSPARSE's results with an fp64 dense oracle.

#define LOOM_TEST_BACKEND_CUDA 1
#include <loom/sparse/convert.hpp>
#include <loom/sparse/cusparse.hpp>

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
namespace cs = loom::sparse::cusparse;
using test::require_loom_error;

namespace {

// A csr_view of device memory whose arrays are never read (the checks before the device).
sparse::csr_view<float, cuda_memory> unread(index_t m, index_t k) {
  return sparse::make_csr_view<cuda_memory, float>(m, k, nullptr, nullptr, nullptr);
}

}  // namespace

TEST_CASE("sparse::cusparse: make_plan rejects extents, n, order and scalars before touching the device",
          "[sparse][cusparse][host]") {
  const loom::cuda b{};
  require_loom_error([&] { (void)cs::make_plan(b, unread(-1, 4), 3); }, errc::invalid_argument,
                     {"sparse::cusparse::make_plan", "A's extents", "-1"});
  require_loom_error([&] { (void)cs::make_plan(b, unread(4, 5), -2); }, errc::invalid_argument,
                     {"sparse::cusparse::make_plan", "n (the columns of B and C)", "-2"});
  require_loom_error([&] { (void)cs::make_plan(b, unread(index_t{1} << 31, 5), 3); }, errc::unsupported,
                     {"sparse::cusparse::make_plan", "below 2^31", "2147483648"});
  require_loom_error([&] { (void)cs::make_plan(b, unread(4, 5), index_t{1} << 32); }, errc::unsupported,
                     {"sparse::cusparse::make_plan", "n must be below 2^31"});
  require_loom_error([&] { (void)cs::make_plan(b, unread(4, 5), 3, {.order = static_cast<cs::order>(7)}); },
                     errc::invalid_argument, {"sparse::cusparse::make_plan", "options.order"});
  require_loom_error(
      [&] { (void)cs::make_plan(b, unread(4, 5), 3, {.alpha = std::numeric_limits<double>::quiet_NaN()}); },
      errc::invalid_argument, {"sparse::cusparse::make_plan", "alpha and options.beta must be finite", "nan"});
  require_loom_error(
      [&] { (void)cs::make_plan(b, unread(4, 5), 3, {.beta = std::numeric_limits<double>::infinity()}); },
      errc::invalid_argument, {"sparse::cusparse::make_plan", "must be finite", "inf"});
}

TEST_CASE("sparse::cusparse: a plan with no rows or no columns of B runs nothing and needs no workspace",
          "[sparse][cusparse][host]") {
  const loom::cuda b{};
  const auto p = cs::make_plan(b, unread(0, 5), 3);
  CHECK(p.workspace_bytes() == 0);
  CHECK(p.nnz() == 0);
  const auto q = cs::make_plan(b, unread(7, 5), 0);
  CHECK(q.workspace_bytes() == 0);
  CHECK(q.rows() == 7);
  CHECK(q.cols() == 5);
}

TEST_CASE("sparse::cusparse: the 32-bit row offsets, and the offsets they refuse", "[sparse][cusparse][host]") {
  constexpr std::string_view call = "test";
  const std::vector<index_t> good = {0, 0, 3, 3, 7, 11};
  const auto narrow = cs::detail::narrow_offsets(good, call);
  REQUIRE(narrow.size() == good.size());
  for (std::size_t i = 0; i < good.size(); ++i) CHECK(narrow[i] == good[i]);
  require_loom_error(
      [&] {
        (void)cs::detail::narrow_offsets({1, 2, 3}, call);
      },
      errc::invalid_argument, {"test", "A.row_ptr[0] must be 0", "got 1"});
  require_loom_error(
      [&] {
        (void)cs::detail::narrow_offsets({0, 4, 3, 5}, call);
      },
      errc::invalid_argument, {"test", "non-decreasing", "A.row_ptr[2] = 3 < A.row_ptr[1] = 4"});
  const index_t big = index_t{1} << 31;
  require_loom_error(
      [&] {
        (void)cs::detail::narrow_offsets({0, 5, big}, call);
      },
      errc::unsupported, {"test", "2147483648 entries", "fewer than 2^31"});
  const auto top = cs::detail::narrow_offsets({0, big - 1}, call);  // the largest count it takes
  CHECK(top.back() == std::numeric_limits<std::int32_t>::max());
}

TEST_CASE("sparse::cusparse: dense views in each order, and the views that are not", "[sparse][cusparse][host]") {
  std::vector<float> mem(64);
  using V = tensor_view<float, 2>;
  const V rm(mem.data(), {5, 7});  // row-major strides (7, 1)
  CHECK(cs::detail::dense_in(rm, cs::order::row_major));
  CHECK_FALSE(cs::detail::dense_in(rm, cs::order::col_major));
  const V cm(mem.data(), {5, 7}, {1, 5});
  CHECK(cs::detail::dense_in(cm, cs::order::col_major));
  CHECK_FALSE(cs::detail::dense_in(cm, cs::order::row_major));
  const V padded(mem.data(), {5, 7}, {8, 1});  // row-major with a leading dimension of 8
  CHECK_FALSE(cs::detail::dense_in(padded, cs::order::row_major));
  const V column(mem.data(), {5, 1}, {1, 1});  // one column: dense in both orders
  CHECK(cs::detail::dense_in(column, cs::order::row_major));
  CHECK(cs::detail::dense_in(column, cs::order::col_major));
  const V strided_column(mem.data(), {5, 1}, {3, 1});
  CHECK_FALSE(cs::detail::dense_in(strided_column, cs::order::row_major));
}

namespace {

// A random M x K matrix with about `density` of its entries nonzero (row 1 left empty), in fp64
// and as CSR of T.
template <class T>
struct weight {
  std::vector<double> dense;
  sparse::csr<T> a;
  weight(index_t m, index_t k, double density, std::uint64_t stream)
      : dense(static_cast<std::size_t>(m * k)), a(make(m, k, density, stream, dense)) {}

  static sparse::csr<T> make(index_t m, index_t k, double density, std::uint64_t stream, std::vector<double>& dense) {
    auto g = test::rng(stream);
    std::uniform_real_distribution<double> u(-1, 1), keep(0, 1);
    std::vector<T> stored(dense.size(), T(0.0f));
    for (index_t i = 0; i < m; ++i)
      for (index_t j = 0; j < k; ++j) {
        if (i == 1 || keep(g) >= density) continue;
        const T v = T(static_cast<float>(u(g)));
        stored[static_cast<std::size_t>(i * k + j)] = v;
        dense[static_cast<std::size_t>(i * k + j)] = static_cast<double>(static_cast<float>(v));
      }
    return sparse::to_csr(tensor_view<const T, 2>(stored.data(), {m, k}));
  }
};

// The weight's arrays in device memory.
template <class T>
struct device_csr {
  test::buffer<index_t> row_ptr;
  test::buffer<std::int32_t> col_idx;
  test::buffer<T> values;
  index_t m, k;
  explicit device_csr(const sparse::csr<T>& a)
      : row_ptr(a.row_ptr()), col_idx(a.col_idx()), values(a.values()), m(a.rows()), k(a.cols()) {}
  sparse::csr_view<T, cuda_memory> view() const {
    return sparse::make_csr_view<cuda_memory, T>(m, k, row_ptr.data(), col_idx.data(), values.data());
  }
};

template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t stream) {
  auto g = test::rng(stream);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<T> v(n);
  for (auto& x : v) x = T(u(g));
  return v;
}

// Element (i, j) of a dense M x N matrix in `o`.
std::size_t at(index_t i, index_t j, index_t rows, index_t cols, cs::order o) {
  return static_cast<std::size_t>(o == cs::order::row_major ? i * cols + j : j * rows + i);
}

template <class T, std::size_t R>
tensor_view<T, R, cuda_memory> dense_view(T* p, index_t rows, index_t cols, cs::order o) {
  if (o == cs::order::row_major) return tensor_view<T, R, cuda_memory>(p, {rows, cols});
  return tensor_view<T, R, cuda_memory>(p, {rows, cols}, {1, rows});
}

// Runs one product through the plan form and the convenience form and compares both with the
// fp64 oracle at a tolerance for T's rounding over k terms.
template <class T, class TC>
void check_product(index_t m, index_t k, index_t n, double density, cs::order o, double alpha, double beta,
                   std::uint64_t stream) {
  CAPTURE(m, k, n, density, o == cs::order::row_major, alpha, beta);
  const weight<T> w(m, k, density, stream);
  const device_csr<T> da(w.a);
  const auto bh = random_values<T>(static_cast<std::size_t>(k * n), stream + 1);
  auto c0 = random_values<TC>(static_cast<std::size_t>(m * n), stream + 2);
  if (beta == 0)
    for (auto& x : c0) x = TC(std::numeric_limits<float>::quiet_NaN());  // not read when beta == 0
  // want: alpha A B + beta C0; mag: |alpha| |A| |B| + |beta| |C0|, what the sums' rounding scales with
  std::vector<double> want(c0.size()), mag(c0.size());
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double s = 0, sa = 0;
      for (index_t l = 0; l < k; ++l) {
        const double x = w.dense[static_cast<std::size_t>(i * k + l)] * static_cast<double>(bh[at(l, j, k, n, o)]);
        s += x, sa += std::abs(x);
      }
      const double c = beta == 0 ? 0.0 : static_cast<double>(c0[at(i, j, m, n, o)]);
      want[at(i, j, m, n, o)] = alpha * s + beta * c;
      mag[at(i, j, m, n, o)] = std::abs(alpha) * sa + std::abs(beta * c);
    }
  // Twice the unit roundoff: of the accumulation, per term of the k-term sums, and of C's storage.
  const double acc_eps = static_cast<double>(k + 2) * (std::is_same_v<T, double> ? 0x1p-52 : 0x1p-23);
  const double out_eps = std::is_same_v<TC, double>       ? 0
                         : std::is_same_v<TC, float>      ? 0x1p-23
                         : std::is_same_v<TC, loom::half> ? 0x1p-10
                                                          : 0x1p-7;
  // With a 16-bit C, cuSPARSE rounds partial sums to C's type (for N > 1; measured on an H200 with
  // CUDA 13.0, docs/gpu.md, 2026-11-28, commit 4661c69: up to 1.22 units of 2^-8 times the magnitudes for bfloat16,
  // 0.77 units of 2^-11 for half, docs/gpu.md): four such units of the magnitudes, on top of the float accumulation.
  constexpr bool narrow_c = std::is_same_v<TC, loom::half> || std::is_same_v<TC, loom::bfloat16>;
  const double partial_eps = !narrow_c ? 0 : 4 * (std::is_same_v<TC, loom::half> ? 0x1p-11 : 0x1p-8);
  const test::buffer<T> bd(bh);
  const loom::cuda b{};
  for (int form = 0; form < 2; ++form) {
    const test::buffer<TC> cd(c0);
    const auto bv = dense_view<const T, 2>(bd.data(), k, n, o);
    const auto cv = dense_view<TC, 2>(cd.data(), m, n, o);
    if (form == 0) {
      const auto p = cs::make_plan<TC>(b, da.view(), n, {.alpha = alpha, .beta = beta, .order = o});
      CHECK(p.nnz() == w.a.nnz());
      const test::workspace ws(p.workspace_bytes());
      cs::spmm(b, p, da.view(), bv, cv, ws.span());
      cs::spmm(b, p, da.view(), bv, cv, ws.span());  // again on the same plan: beta reads C's new values
    } else {
      cs::spmm(b, da.view(), bv, cv, {.alpha = alpha, .beta = beta, .order = o});
    }
    const auto got = cd.to_host();
    for (std::size_t i = 0; i < got.size(); ++i) {
      double expect = want[i], tol = (acc_eps + partial_eps) * mag[i] + out_eps * std::abs(want[i]);
      if (form == 0 && beta != 0) {  // the second call: alpha A B + beta (alpha A B + beta C0)
        const double first = want[i], ab = first - beta * static_cast<double>(c0[i]);
        expect = ab + beta * first;
        tol = (acc_eps + partial_eps) * (mag[i] + std::abs(beta) * mag[i]) +
              out_eps * (std::abs(expect) + 2 * std::abs(beta * first));  // C rounded after each call
      }
      const double got_i = static_cast<double>(got[i]);
      if (!(std::abs(got_i - expect) <= tol + 1e-30)) {
        FAIL_CHECK("form " << form << " element " << i << ": got " << got_i << ", want " << expect);
        return;
      }
    }
  }
}

}  // namespace

TEST_CASE("sparse::cusparse: products against the fp64 oracle, both orders, prime sizes", "[sparse][cusparse][gpu]") {
  std::uint64_t s = 100;
  for (const auto o : {cs::order::row_major, cs::order::col_major})
    for (const index_t n : {1, 5, 16, 67}) {
      check_product<float, float>(37, 53, n, 0.3, o, 1.0, 0.0, s += 3);
      check_product<float, float>(131, 29, n, 0.1, o, -0.5, 0.25, s += 3);
      check_product<double, double>(41, 97, n, 0.2, o, 1.5, 0.0, s += 3);
    }
}

TEST_CASE("sparse::cusparse: bfloat16 and half inputs, their own or float output", "[sparse][cusparse][gpu]") {
  std::uint64_t s = 500;
  for (const index_t n : {1, 13, 64}) {
    check_product<loom::bfloat16, loom::bfloat16>(61, 47, n, 0.25, cs::order::row_major, 1.0, 0.0, s += 3);
    check_product<loom::bfloat16, float>(61, 47, n, 0.25, cs::order::row_major, 1.0, 0.5, s += 3);
    check_product<loom::half, loom::half>(29, 83, n, 0.15, cs::order::col_major, 1.0, 0.0, s += 3);
    check_product<loom::half, float>(29, 83, n, 0.15, cs::order::row_major, 2.0, 0.0, s += 3);
  }
}

TEST_CASE("sparse::cusparse: a weight with no entries gives beta C", "[sparse][cusparse][gpu]") {
  check_product<float, float>(17, 23, 9, 0.0, cs::order::row_major, 1.0, 0.0, 900);
  check_product<float, float>(17, 23, 9, 0.0, cs::order::row_major, 1.0, 0.75, 903);
}

TEST_CASE("sparse::cusparse: calls reject operands that do not fit the plan", "[sparse][cusparse][gpu]") {
  const weight<float> w(19, 23, 0.3, 7);
  const device_csr<float> da(w.a), other(w.a);
  const index_t m = 19, k = 23, n = 6;
  const test::buffer<float> bd(static_cast<std::size_t>(k * n + m * n)), cd(static_cast<std::size_t>(m * n + 8));
  const loom::cuda b{};
  const auto p = cs::make_plan(b, da.view(), n);
  const test::workspace ws(p.workspace_bytes() + loom::workspace_alignment);
  const auto bv = dense_view<const float, 2>(bd.data(), k, n, cs::order::row_major);
  const auto cv = dense_view<float, 2>(cd.data(), m, n, cs::order::row_major);
  constexpr auto call = "sparse::cusparse::spmm";
  require_loom_error([&] { cs::spmm(b, p, other.view(), bv, cv, ws.span()); }, errc::invalid_argument,
                     {call, "A.row_ptr is not the one the plan was made from"});
  require_loom_error(
      [&] {
        cs::spmm(b, p, da.view(), dense_view<const float, 2>(bd.data(), k, n + 1, cs::order::row_major), cv, ws.span());
      },
      errc::shape_mismatch, {call, "B must be [23, 6] (K x N)", "got [23, 7]"});
  require_loom_error(
      [&] {
        cs::spmm(b, p, da.view(), bv, dense_view<float, 2>(cd.data(), m - 1, n, cs::order::row_major), ws.span());
      },
      errc::shape_mismatch, {call, "C must be [19, 6] (M x N)", "got [18, 6]"});
  require_loom_error(
      [&] {
        cs::spmm(b, p, da.view(), dense_view<const float, 2>(bd.data(), k, n, cs::order::col_major), cv, ws.span());
      },
      errc::invalid_argument, {call, "B must be dense and row-major"});
  require_loom_error(
      [&] {
        cs::spmm(b, p, da.view(), bv, tensor_view<float, 2, cuda_memory>(cd.data(), {m, n}, {n + 1, 1}), ws.span());
      },
      errc::invalid_argument, {call, "C must be dense and row-major"});
  require_loom_error(
      [&] {
        cs::spmm(b, p, da.view(), bv, tensor_view<float, 2, cuda_memory>(bd.data() + k * n - 3, {m, n}), ws.span());
      },
      errc::invalid_argument, {call, "B and C share memory"});
  if (p.workspace_bytes() > 0) {
    require_loom_error([&] { cs::spmm(b, p, da.view(), bv, cv, ws.span().first(p.workspace_bytes() - 1)); },
                       errc::invalid_argument, {call, "workspace"});
    require_loom_error([&] { cs::spmm(b, p, da.view(), bv, cv, ws.span(8)); }, errc::invalid_argument,
                       {call, "workspace"});
  }
  require_loom_error([&] { cs::spmm(b, cs::plan<float>{}, da.view(), bv, cv, ws.span()); }, errc::invalid_argument,
                     {call, "not made by sparse::cusparse::make_plan"});
}
