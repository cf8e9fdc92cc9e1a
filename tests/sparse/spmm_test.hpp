// SpMM: one body, instantiated per backend by loom_add_backend_test. Every result is compared
// with a dense fp64 oracle evaluated on the stored matrix (tolerances from support/tolerance.hpp),
// small-integer inputs must match it exactly, and an instrumented run proves that every stored
// nonzero is read exactly once per 64-column chunk of N.

#include <loom/sparse/convert.hpp>
#include <loom/sparse/spmm.hpp>

#include <support/allocations.hpp>
#include <support/backends.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

using loom::index_t;
using loom::test::backend_under_test;
using loom::test::buffer;
using loom::test::make_backend;
using loom::test::workspace;
namespace ls = loom::sparse;
namespace lt = loom::test;

namespace {

using space = loom::backend_traits<backend_under_test>::memory_space;

// The arrays of a format copied into the backend's memory space, and a view of them.
template <class T>
struct on_device_csr {
  buffer<index_t> ptr;
  buffer<std::int32_t> idx;
  buffer<T> val;
  ls::csr_view<T, space> v;
  explicit on_device_csr(const ls::csr<T>& a)
      : ptr(a.row_ptr()),
        idx(a.col_idx()),
        val(a.values()),
        v(ls::make_csr_view<space>(a.rows(), a.cols(), ptr.data(), idx.data(), val.data())) {}
};
template <class T>
struct on_device_bitmap {
  buffer<std::uint64_t> masks;
  buffer<index_t> off;
  buffer<T> val;
  ls::bitmap_view<T, space> v;
  explicit on_device_bitmap(const ls::bitmap<T>& a)
      : masks(a.masks()),
        off(a.tile_offsets()),
        val(a.values()),
        v(ls::make_bitmap_view<space>(a.rows(), a.cols(), masks.data(), off.data(), val.data())) {}
};
template <int N, int M, class T>
struct on_device_n_m {
  buffer<T> val;
  buffer<std::uint8_t> idx;
  ls::n_m_view<N, M, T, space> v;
  explicit on_device_n_m(const ls::n_m<N, M, T>& a)
      : val(a.values()),
        idx(a.indices()),
        v(ls::make_n_m_view<space, N, M>(a.rows(), a.cols(), val.data(), idx.data())) {}
};

// A dense rows x cols matrix with about `sparsity` zeros drawn from `values`; rows of band 1
// (rows 8..15) are empty (empty tiles) and tile (0, 0) is fully dense, when the shape has them.
template <class T>
std::vector<T> make_matrix(index_t rows, index_t cols, double sparsity, bool integers, std::uint64_t stream) {
  auto g = lt::rng(stream);
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<int> small(-3, 3);
  std::vector<T> d(static_cast<std::size_t>(rows * cols), T(0.0f));
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < cols; ++j) {
      const bool dense_tile = rows >= 16 && cols >= 64 && i < 8 && j < 64 && sparsity < 1.0;
      if (rows >= 16 && i >= 8 && i < 16) continue;
      if (!dense_tile && u(g) < sparsity) continue;
      double v = integers ? small(g) : u(g) * 2 - 1;
      if (v == 0) v = 1;
      d[i * cols + j] = static_cast<T>(static_cast<float>(v));
    }
  return d;
}

// A K x N matrix stored row-major (col_major = false) or column-major, and its view.
template <class T>
struct dense_operand {
  std::vector<T> host;  // element (r, c) at r * rs + c * cs
  index_t rows, cols, rs, cs;
  dense_operand(index_t r, index_t c, bool col_major, std::vector<T> values)
      : host(std::move(values)), rows(r), cols(c), rs(col_major ? 1 : c), cs(col_major ? r : 1) {}
  double at(index_t r, index_t c) const { return static_cast<double>(static_cast<float>(host[r * rs + c * cs])); }
};

template <class TA, class TB, class TC>
std::vector<double> oracle(const std::vector<TA>& a, index_t m, index_t k, const dense_operand<TB>& b,
                           const dense_operand<TC>& c0, double alpha, double beta, const std::vector<TC>* bias) {
  const index_t n = b.cols;
  std::vector<double> out(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      double s = 0;
      for (index_t p = 0; p < k; ++p) {
        const auto x = static_cast<double>(static_cast<float>(a[i * k + p]));
        if (x != 0) s += x * b.at(p, j);
      }
      double r = alpha * s + (beta != 0 ? beta * c0.at(i, j) : 0.0);
      if (bias) r += static_cast<double>(static_cast<float>((*bias)[i]));
      out[i * n + j] = r;
    }
  return out;
}

// Runs spmm with A in format `fmt` (0 csr, 1 bitmap, 2 n_m<2, 4>) on the backend under test; returns C
// as doubles in row-major order.
template <class TA, class TB, class TC>
std::vector<double> run(int fmt, const std::vector<TA>& dense_a, index_t m, index_t k, const dense_operand<TB>& b,
                        const dense_operand<TC>& c0, double alpha, double beta, const std::vector<TC>* bias) {
  const auto b_ = make_backend();
  const index_t n = b.cols;
  buffer<TB> bb(b.host);
  buffer<TC> cc(c0.host);
  buffer<TC> bias_buf(bias ? *bias : std::vector<TC>{});
  const loom::tensor_view<const TB, 2, space> bv(bb.data(), {k, n}, {b.rs, b.cs});
  const loom::tensor_view<TC, 2, space> cv(cc.data(), {m, n}, {c0.rs, c0.cs});
  const loom::tensor_view<const TC, 1, space> biasv(bias_buf.data(), {m});
  const loom::tensor_view<const TA, 2> av(dense_a.data(), {m, k});
  auto call = [&](const auto& a) {  // the plan form, with a workspace of the plan's size
    const auto pl = ls::make_plan(b_, a, n, {.alpha = alpha, .beta = beta});
    workspace ws(pl.workspace_bytes());
    if (bias)
      ls::spmm(b_, pl, a, bv, cv, biasv, ws.span());
    else
      ls::spmm(b_, pl, a, bv, cv, ws.span());
  };
  if (fmt == 0) {
    on_device_csr<TA> d(ls::to_csr(av));
    call(d.v);
  } else if (fmt == 1) {
    on_device_bitmap<TA> d(ls::to_bitmap(av));
    call(d.v);
  } else {
    on_device_n_m<2, 4, TA> d(ls::to_n_m<2, 4>(av));
    call(d.v);
  }
  const auto h = cc.to_host();
  std::vector<double> out(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) out[i * n + j] = static_cast<double>(static_cast<float>(h[i * c0.rs + j * c0.cs]));
  return out;
}

const char* format_name(int f) { return f == 0 ? "csr" : f == 1 ? "bitmap" : "n_m<2,4>"; }

// (M, K) pairs: every size of the issue, crossed fully below 1000 and sparsely above.
const index_t shapes[][2] = {{1, 1},    {1, 7},    {7, 1},     {7, 7},     {7, 64},   {64, 7},   {64, 64},
                             {1, 1003}, {1003, 1}, {64, 1000}, {1000, 64}, {7, 1003}, {1003, 7}, {1000, 1003}};
const index_t widths[] = {1, 7, 16, 33, 64};
const double sparsities[] = {0.0, 0.5, 0.9, 0.99, 1.0};

template <class TA, class TB, class TC>
void sweep(bool integers, loom::test::tolerance tol, bool exact, bool largest = true) {
  std::uint64_t stream = 1;
  for (const auto& s : shapes) {
    const index_t m = s[0], k = s[1];
    const bool big = m * k >= 1000 * 1000;
    if (big && !largest) continue;
    for (index_t n : widths) {
      if (big && n != 1 && n != 33) continue;  // keep the largest shape to two widths
      for (double sp : sparsities) {
        if (big && sp != 0.9) continue;
        auto a = make_matrix<TA>(m, k, sp, integers, ++stream);
        const auto a24 = ls::prune_n_m<2, 4>(loom::tensor_view<const TA, 2>(a.data(), {m, k}));
        const bool col_major = stream % 2 == 0;
        const dense_operand<TB> b(
            k, n, col_major,
            integers ? lt::small_integers<TB>(k * n, -4, 4, ++stream) : lt::uniform<TB>(k * n, -1, 1, ++stream));
        const dense_operand<TC> c0(m, n, !col_major, lt::small_integers<TC>(m * n, -2, 2, ++stream));
        for (int f = 0; f < 3; ++f) {
          const auto& am = f == 2 ? a24 : a;
          {
            const int epi = static_cast<int>((stream + static_cast<std::uint64_t>(f)) % 2);
            const double alpha = epi ? 0.5 : 1.0, beta = epi ? -2.0 : 0.0;
            const auto bias = lt::small_integers<TC>(m, -3, 3, ++stream);
            const auto* bp = epi ? &bias : nullptr;
            INFO(format_name(f) << " M=" << m << " K=" << k << " N=" << n << " sparsity=" << sp
                                << (col_major ? " B col-major" : " B row-major") << " epilogue=" << epi);
            const auto got = run(f, am, m, k, b, c0, alpha, beta, bp);
            const auto want = oracle(am, m, k, b, c0, alpha, beta, bp);
            if (exact)
              REQUIRE(got == want);
            else  // fp32 sums of k terms: the rounding error grows like sqrt(k)
              lt::require_close(got, want, {tol.rel, tol.abs * (1 + std::sqrt(static_cast<double>(k)))}, "spmm");
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("spmm fp32: every format against the fp64 oracle" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  sweep<float, float, float>(false, lt::tolerance_for<loom::fp32>(), false);
}

TEST_CASE("spmm fp32: small integers give exactly the oracle's result" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  sweep<float, float, float>(true, {}, true);
}

#if defined(LOOM_SPARSE_X86_KERNELS)
// On a CPU with AVX-512 the cases above run the vector kernels of detail/kernels_x86.hpp for
// bitmap fp32, on one with AVX2 those of detail/kernels_avx2.hpp for bitmap and CSR; these run the
// portable kernels that every other CPU takes.
namespace {
struct portable_only {  // vector kernels off for the scope (the switch of every family)
  portable_only() { ls::detail::x86::avx512_allowed() = false; }
  ~portable_only() { ls::detail::x86::avx512_allowed() = true; }
};
}  // namespace

TEST_CASE("spmm fp32 with the portable kernels (vector kernels switched off)" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  const portable_only guard;
  REQUIRE_FALSE(ls::detail::x86::avx512_available());
  REQUIRE_FALSE(ls::detail::x86::avx2_available());
  sweep<float, float, float>(false, lt::tolerance_for<loom::fp32>(), false);
  sweep<float, float, float>(true, {}, true);
}
#endif

// B panels that outgrow L2 (K * nb above 2^18 floats for a chunk of nb columns). With more than 32
// columns the host CSR product takes 8 bands (64 rows) per work item and the AVX2 kernel walks A's
// columns 128 at a time: 139 x 4111 x 67 (two full items and one of 11 rows; 33 blocks, the last of
// 15 columns; N = 67 adds a 3-column chunk taken in one pass) and 139 x 8209 x 37 (a masked last
// vector). With 32 columns or fewer it keeps one band per item and walks 2048 columns at a time:
// 11 x 8209 x 32 (five blocks, the last of 17 columns).
namespace {
void wide_k_cases() {
  static_assert(ls::detail::csr_grouped(4111, 64) && ls::detail::csr_grouped(8209, 37) &&
                !ls::detail::csr_grouped(8209, 32) && !ls::detail::csr_grouped(4111, 3));
  static_assert(ls::detail::csr_block(4111, 64) == 128 && ls::detail::csr_block(8209, 32) == 2048 &&
                ls::detail::csr_block(4111, 3) == 4111);
  using ls::detail::list_form;
  static_assert(ls::detail::csr_list_form(4111, 64, true) == list_form::lanes16 &&
                ls::detail::csr_list_form(1009, 64, true) == list_form::lanes16_prefetch &&
                ls::detail::csr_list_form(97, 45, true) == list_form::lanes16_prefetch &&
                ls::detail::csr_list_form(1009, 32, true) == list_form::lanes8 &&
                ls::detail::csr_list_form(4111, 64, false) == list_form::lanes8);
  struct shape {
    index_t m, k, n;
  };
  // 37 x 1009 x 67 and 23 x 97 x 45: on AVX-512 CPUs, 16 lanes with the B panel prefetched for
  // their 64- and 45-column chunks (rows longer and shorter than the prefetch distance, a
  // 13-column masked vector); the 3-column chunk of 67 takes the 8-lane product
  for (const auto [m, k, n] :
       {shape{139, 4111, 67}, shape{139, 8209, 37}, shape{11, 8209, 32}, shape{37, 1009, 67}, shape{23, 97, 45}})
    for (double sp : {0.9, 0.3}) {
      const auto a = make_matrix<float>(m, k, sp, false, 301);
      const dense_operand<float> b(k, n, false, lt::uniform<float>(k * n, -1, 1, 302));
      const dense_operand<float> c0(m, n, false, lt::small_integers<float>(m * n, -2, 2, 303));
      for (int f = 0; f < 2; ++f) {
        INFO(format_name(f) << " " << m << " x " << k << " x " << n << " sparsity=" << sp);
        const auto got = run(f, a, m, k, b, c0, 1.0, 0.0, static_cast<const std::vector<float>*>(nullptr));
        const auto want = oracle(a, m, k, b, c0, 1.0, 0.0, static_cast<const std::vector<float>*>(nullptr));
        const auto tol = lt::tolerance_for<loom::fp32>();
        lt::require_close(got, want, {tol.rel, tol.abs * (1 + std::sqrt(static_cast<double>(k)))}, "spmm");
      }
    }
}

}  // namespace

TEST_CASE("spmm fp32: a wide K (the CSR kernel's column blocks)" LOOM_BACKEND_TAG, "[sparse][spmm]") { wide_k_cases(); }

#if defined(LOOM_SPARSE_X86_KERNELS)
TEST_CASE("spmm fp32: a wide K with the portable kernels (vector kernels switched off)" LOOM_BACKEND_TAG,
          "[sparse][spmm]") {
  const portable_only guard;
  wide_k_cases();
}

TEST_CASE("spmm fp32: a wide K with the AVX2 kernels (AVX-512 forms switched off)" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  struct avx2_only {  // the 8-lane list products where the CPU has the 16-lane ones too
    avx2_only() { loom::detail::x86::avx512_kernels_allowed() = false; }
    ~avx2_only() { loom::detail::x86::avx512_kernels_allowed() = true; }
  } const guard;
  REQUIRE_FALSE(ls::detail::x86::avx512_available());
  wide_k_cases();
}
#endif

TEST_CASE("spmm bf16 and fp16 storage, fp32 accumulation" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  sweep<loom::bfloat16, loom::bfloat16, loom::bfloat16>(false, lt::tolerance_for<loom::bf16>(), false);
  sweep<loom::half, loom::half, loom::half>(false, lt::tolerance_for<loom::fp16>(), false, false);
  // 16-bit weights and activations, fp32 output: small integers stay exact
  sweep<loom::bfloat16, loom::bfloat16, float>(true, {}, true, false);
  sweep<loom::half, loom::half, float>(true, {}, true, false);
}

TEST_CASE("spmm: beta == 0 does not read C (NaN does not propagate)" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  const index_t m = 9, k = 70, n = 5;
  const auto a = make_matrix<float>(m, k, 0.5, true, 77);
  const dense_operand<float> b(k, n, false, lt::small_integers<float>(k * n, -2, 2, 78));
  const dense_operand<float> c0(
      m, n, false, std::vector<float>(static_cast<std::size_t>(m * n), std::numeric_limits<float>::quiet_NaN()));
  for (int f = 0; f < 3; ++f) {
    const auto got = run(f, f == 2 ? ls::prune_n_m<2, 4>(loom::tensor_view<const float, 2>(a.data(), {m, k})) : a, m, k,
                         b, c0, 1.0, 0.0, static_cast<const std::vector<float>*>(nullptr));
    for (double x : got) REQUIRE(std::isfinite(x));
  }
}

TEST_CASE("spmm: B = identity reproduces A, so every nonzero lands once in its place" LOOM_BACKEND_TAG,
          "[sparse][spmm]") {
  const index_t m = 70, k = 130;
  const auto a = make_matrix<float>(m, k, 0.7, true, 91);
  std::vector<float> eye(static_cast<std::size_t>(k * k), 0.0f);
  for (index_t i = 0; i < k; ++i) eye[i * k + i] = 1.0f;
  const dense_operand<float> b(k, k, false, eye);
  const dense_operand<float> c0(m, k, false, std::vector<float>(static_cast<std::size_t>(m * k), 0.0f));
  const auto a24 = ls::prune_n_m<2, 4>(loom::tensor_view<const float, 2>(a.data(), {m, k}));
  for (int f = 0; f < 3; ++f) {
    const auto& am = f == 2 ? a24 : a;
    const auto got = run(f, am, m, k, b, c0, 1.0, 0.0, static_cast<const std::vector<float>*>(nullptr));
    for (index_t i = 0; i < m * k; ++i) REQUIRE(got[i] == static_cast<double>(am[i]));
  }
}

#if !defined(LOOM_TEST_BACKEND_CUDA) && !defined(LOOM_TEST_BACKEND_STANDIN)
namespace {
struct counting_hook {
  int* counts;
  void operator()(index_t p) const { std::atomic_ref<int>(counts[p]).fetch_add(1, std::memory_order_relaxed); }
};
}  // namespace

TEST_CASE("spmm coverage: every stored nonzero is read exactly once per 64-column chunk" LOOM_BACKEND_TAG,
          "[sparse][spmm]") {
  const auto b_ = make_backend();
  const index_t m = 83, k = 200;
  const auto a = make_matrix<float>(m, k, 0.8, true, 5);
  const auto a24 = ls::prune_n_m<2, 4>(loom::tensor_view<const float, 2>(a.data(), {m, k}));
  const loom::tensor_view<const float, 2> av(a.data(), {m, k}), a24v(a24.data(), {m, k});
  for (index_t n : {index_t{1}, index_t{7}, index_t{64}, index_t{130}}) {
    const auto bvals = lt::small_integers<float>(k * n, -2, 2, 6);
    std::vector<float> c(static_cast<std::size_t>(m * n));
    const loom::tensor_view<const float, 2> bv(bvals.data(), {k, n});
    const loom::tensor_view<float, 2> cv(c.data(), {m, n});
    const int chunks = static_cast<int>((n + 63) / 64);
    auto check = [&](const auto& view, index_t stored, const char* what) {
      INFO(what);
      std::vector<int> counts(static_cast<std::size_t>(stored), 0);
      const loom::tensor_view<const float, 1>* none = nullptr;
      std::vector<float> panel(static_cast<std::size_t>(k * n));
      ls::detail::spmm_run<float>(b_, ls::detail::plan_geometry(view, n), view, bv, cv, 1.0, 0.0, none,
                                  counting_hook{counts.data()}, panel.data());
      return counts;
    };
    INFO("N = " << n);
    const auto csr = ls::to_csr(av);
    for (int x : check(csr.view(), csr.nnz(), "csr")) REQUIRE(x == chunks);
    const auto bm = ls::to_bitmap(av);
    for (int x : check(bm.view(), bm.nnz(), "bitmap")) REQUIRE(x == chunks);
    const auto nm = ls::to_n_m<2, 4>(a24v);
    const auto counts = check(nm.view(), nm.slots(), "n_m");
    for (index_t s = 0; s < nm.slots(); ++s) REQUIRE(counts[s] == chunks);  // K % 4 == 0: every slot is read
  }
}

namespace {
// C = A B on this backend and on loom::serial (A: a csr or bitmap, B: K x n uniform in [-1, 1) from
// `seed`), required to be the same bits; returns this backend's C.
template <class A>
std::vector<float> same_bits_as_serial(const A& a, index_t n, std::uint64_t seed) {
  const index_t m = a.rows(), k = a.cols();
  const auto bvals = lt::uniform<float>(k * n, -1, 1, seed);
  std::vector<float> c1(static_cast<std::size_t>(m * n)), c2(c1.size());
  const loom::tensor_view<const float, 2> bv(bvals.data(), {k, n});
  ls::spmm(make_backend(), a, bv, loom::tensor_view<float, 2>(c1.data(), {m, n}));
  ls::spmm(loom::serial{}, a, bv, loom::tensor_view<float, 2>(c2.data(), {m, n}));
  REQUIRE(std::memcmp(c1.data(), c2.data(), sizeof(float) * c1.size()) == 0);
  return c1;
}
}  // namespace

TEST_CASE("spmm: same bits as the serial backend" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  // above two grains of work (loom::parallel_grain_bytes): a host backend runs it on its threads
  const index_t m = 1001, k = 1009, n = 19;
  const auto a = make_matrix<float>(m, k, 0.6, false, 8);
  (void)same_bits_as_serial(ls::to_bitmap(loom::tensor_view<const float, 2>(a.data(), {m, k})), n, 9);
}

TEST_CASE("spmm csr with 8 bands per work item: same bits as the serial backend" LOOM_BACKEND_TAG, "[sparse][spmm]") {
  const index_t m = 211, k = 4111, n = 67;  // csr_grouped(k, 64): items of 64 rows, the last of 19
  const auto a = make_matrix<float>(m, k, 0.8, false, 10);
  const auto cs = ls::to_csr(loom::tensor_view<const float, 2>(a.data(), {m, k}));
  REQUIRE(ls::detail::bands_per_item<decltype(cs.view())>(k, n) == ls::detail::csr_group_bands);
  const auto c1 = same_bits_as_serial(cs, n, 11);
  const auto bvals = lt::uniform<float>(k * n, -1, 1, 11);
  const loom::tensor_view<const float, 2> bv(bvals.data(), {k, n});
  // a plan holds extents only: one made from the same matrix as a bitmap runs CSR the same way
  const auto be = make_backend();
  const auto pl = ls::make_plan(be, ls::to_bitmap(loom::tensor_view<const float, 2>(a.data(), {m, k})), n);
  loom::workspace_buffer ws(pl.workspace_bytes());
  std::vector<float> c3(c1.size());
  ls::spmm(be, pl, cs, bv, loom::tensor_view<float, 2>(c3.data(), {m, n}), ws.span());
  REQUIRE(std::memcmp(c1.data(), c3.data(), sizeof(float) * c1.size()) == 0);
}
#endif

TEST_CASE("spmm rejects a B whose rows are not A's columns" LOOM_BACKEND_TAG, "[sparse][spmm][reject]") {
  const ls::csr_view<float, space> a{4, 5, nullptr, nullptr, nullptr};
  buffer<float> b(30), c(24);
  const loom::tensor_view<const float, 2, space> bv(b.data(), {6, 5});
  const loom::tensor_view<float, 2, space> cv(c.data(), {4, 6});
  REQUIRE_THROWS_WITH(ls::spmm(make_backend(), a, bv, cv),
                      Catch::Contains("spmm: B must be [5, 5] (A.cols x the plan's N), got [6, 5]"));
}

TEST_CASE("spmm rejects a C that is not M x N" LOOM_BACKEND_TAG, "[sparse][spmm][reject]") {
  const ls::csr_view<float, space> a{4, 5, nullptr, nullptr, nullptr};
  buffer<float> b(30), c(30);
  const loom::tensor_view<const float, 2, space> bv(b.data(), {5, 6});
  const loom::tensor_view<float, 2, space> cv(c.data(), {5, 6});
  REQUIRE_THROWS_WITH(ls::spmm(make_backend(), a, bv, cv),
                      Catch::Contains("spmm: C must be [4, 6] (A.rows x the plan's N), got [5, 6]"));
}

TEST_CASE("spmm rejects a bias that does not hold M values" LOOM_BACKEND_TAG, "[sparse][spmm][reject]") {
  const ls::csr_view<float, space> a{4, 5, nullptr, nullptr, nullptr};
  buffer<float> b(30), c(24), bias(3);
  const loom::tensor_view<const float, 2, space> bv(b.data(), {5, 6});
  const loom::tensor_view<float, 2, space> cv(c.data(), {4, 6});
  const loom::tensor_view<const float, 1, space> biasv(bias.data(), {3});
  REQUIRE_THROWS_WITH(ls::spmm(make_backend(), a, bv, cv, biasv),
                      Catch::Contains("spmm: bias must be [4] (A.rows values), got [3]"));
}

TEST_CASE("spmm rejects a B with no unit stride" LOOM_BACKEND_TAG, "[sparse][spmm][reject]") {
  const ls::csr_view<float, space> a{4, 5, nullptr, nullptr, nullptr};
  buffer<float> b(60), c(24);
  const loom::tensor_view<const float, 2, space> bv(b.data(), {5, 6}, {12, 2});
  const loom::tensor_view<float, 2, space> cv(c.data(), {4, 6});
  REQUIRE_THROWS_WITH(ls::spmm(make_backend(), a, bv, cv), Catch::Contains("B must be row-major"));
}

// ---------------------------------------------------------------------------------------------
// C sharing memory with B, a bias overlapping C, and sizes that overflow

namespace {

// Runs f and requires a loom::error with `code` whose message contains `text`.
template <class F>
void require_loom_error(F&& f, loom::errc code, const char* text) {
  try {
    f();
    FAIL("expected a loom::error containing '" << text << "'");
  } catch (const loom::error& e) {
    CHECK(e.code() == code);
    CHECK_THAT(e.what(), Catch::Contains(text));
  }
}

// C = alpha A B + beta C with B and C in one buffer of (M + 1) x N (row-major or column-major):
// B at element 0, C `shift` rows (row-major) or elements (column-major) further on. Returns C.
template <class AV>
std::vector<float> run_shared(const AV& a, index_t n, bool col_major, index_t shift, double beta,
                              const std::vector<float>& init) {
  const index_t m = a.rows;  // = K
  buffer<float> io(init);
  const index_t rs = col_major ? 1 : n, cs = col_major ? m + 1 : 1;
  const loom::tensor_view<const float, 2, space> bv(io.data(), {m, n}, {rs, cs});
  const loom::tensor_view<float, 2, space> cv(io.data() + shift * rs, {m, n}, {rs, cs});
  ls::spmm(make_backend(), a, bv, cv, {.beta = beta});
  const auto h = io.to_host();
  std::vector<float> c(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) c[i * n + j] = h[(i + shift) * rs + j * cs];
  return c;
}

// The same product into a separate C that starts as the shared run's C did.
template <class AV>
std::vector<float> run_separate(const AV& a, index_t n, bool col_major, index_t shift, double beta,
                                const std::vector<float>& init) {
  const index_t m = a.rows;
  const index_t rs = col_major ? 1 : n, cs = col_major ? m + 1 : 1;
  buffer<float> bb(init), cc(init);
  const loom::tensor_view<const float, 2, space> bv(bb.data(), {m, n}, {rs, cs});
  const loom::tensor_view<float, 2, space> cv(cc.data() + shift * rs, {m, n}, {rs, cs});
  ls::spmm(make_backend(), a, bv, cv, {.beta = beta});
  const auto h = cc.to_host();
  std::vector<float> c(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) c[i * n + j] = h[(i + shift) * rs + j * cs];
  return c;
}

}  // namespace

TEST_CASE(
    "spmm: C may share memory with B (C = A C in place, or shifted), same bits as separate buffers" LOOM_BACKEND_TAG,
    "[sparse][spmm][alias]") {
  const index_t m = 70;  // square A: K = M
  const auto dense = make_matrix<float>(m, m, 0.7, true, 40);
  const auto d24 = ls::prune_n_m<2, 4>(loom::tensor_view<const float, 2>(dense.data(), {m, m}));
  const on_device_csr<float> a0(ls::to_csr(loom::tensor_view<const float, 2>(dense.data(), {m, m})));
  const on_device_bitmap<float> a1(ls::to_bitmap(loom::tensor_view<const float, 2>(dense.data(), {m, m})));
  const on_device_n_m<2, 4, float> a2(ls::to_n_m<2, 4>(loom::tensor_view<const float, 2>(d24.data(), {m, m})));
  for (index_t n : {index_t{1}, index_t{5}, index_t{70}})
    for (bool col_major : {false, true})
      for (index_t shift : {index_t{0}, index_t{1}})
        for (double beta : {0.0, 2.0}) {
          INFO("N = " << n << (col_major ? " column-major" : " row-major") << ", C " << shift << " rows after B, beta "
                      << beta);
          const auto init = lt::small_integers<float>((m + 1) * n, -3, 3, static_cast<std::uint64_t>(n + shift));
          REQUIRE(run_shared(a0.v, n, col_major, shift, beta, init) ==
                  run_separate(a0.v, n, col_major, shift, beta, init));
          REQUIRE(run_shared(a1.v, n, col_major, shift, beta, init) ==
                  run_separate(a1.v, n, col_major, shift, beta, init));
          REQUIRE(run_shared(a2.v, n, col_major, shift, beta, init) ==
                  run_separate(a2.v, n, col_major, shift, beta, init));
        }
}

TEST_CASE("spmm rejects a bias that shares memory with C" LOOM_BACKEND_TAG, "[sparse][spmm][reject]") {
  const ls::csr_view<float, space> a{4, 5, nullptr, nullptr, nullptr};
  buffer<float> b(30), c(24);
  const loom::tensor_view<const float, 2, space> bv(b.data(), {5, 6});
  const loom::tensor_view<float, 2, space> cv(c.data(), {4, 6}, {1, 4});  // column-major
  const loom::tensor_view<const float, 1, space> column0(c.data(), {4});
  require_loom_error([&] { ls::spmm(make_backend(), a, bv, cv, column0); }, loom::errc::invalid_argument,
                     "spmm: bias and C share memory; bias must not overlap C");
}

TEST_CASE("spmm rejects sizes whose products overflow, naming them" LOOM_BACKEND_TAG, "[sparse][spmm][reject]") {
  // Unchecked views with absurd extents: no element is touched before the checks throw.
  constexpr index_t two_62 = index_t{1} << 62, max = std::numeric_limits<index_t>::max();
  buffer<float> x(1);
  float* p = x.data();
  const auto inv = loom::errc::invalid_argument;
  {  // n_m: rows * groups * N slots
    const auto a = ls::make_n_m_view<space, 2, 4>(two_62, index_t{8}, static_cast<const float*>(p),
                                                  static_cast<const std::uint8_t*>(nullptr));
    const loom::tensor_view<const float, 2, space> bv(p, {8, 1}, {1, 1});
    const loom::tensor_view<float, 2, space> cv(p, {two_62, 1}, {1, 1});
    require_loom_error([&] { ls::spmm(make_backend(), a, bv, cv); }, inv,
                       "spmm: A.rows * A.groups() = 4611686018427387904 * 2 overflows");
  }
  {  // bitmap: mask words
    const auto a = ls::make_bitmap_view<space>(max, index_t{64}, static_cast<const std::uint64_t*>(nullptr),
                                               static_cast<const index_t*>(nullptr), static_cast<const float*>(p));
    const loom::tensor_view<const float, 2, space> bv(p, {64, 1}, {1, 1});
    const loom::tensor_view<float, 2, space> cv(p, {max, 1}, {1, 1});
    require_loom_error([&] { ls::spmm(make_backend(), a, bv, cv); }, inv,
                       "spmm: A's mask words (tiles * 8) = 1152921504606846976 * 8 overflows");
  }
  {  // the packed B panel: K * N
    const ls::csr_view<float, space> a{1, index_t{1} << 31, nullptr, nullptr, nullptr};
    const loom::tensor_view<const float, 2, space> bv(p, {index_t{1} << 31, index_t{1} << 33}, {1, 1});
    const loom::tensor_view<float, 2, space> cv(p, {1, index_t{1} << 33}, {1, 1});
    require_loom_error([&] { ls::spmm(make_backend(), a, bv, cv); }, inv,
                       "spmm: A.cols * B.cols (the packed B panel) = 2147483648 * 8589934592 overflows");
  }
  {  // work items: bands of 8 rows times chunks of 64 columns
    const ls::csr_view<float, space> a{two_62, 1, nullptr, nullptr, nullptr};
    const loom::tensor_view<const float, 2, space> bv(p, {1, index_t{1} << 20}, {1, 1});
    const loom::tensor_view<float, 2, space> cv(p, {two_62, index_t{1} << 20}, {1, 1});
    require_loom_error([&] { ls::spmm(make_backend(), a, bv, cv); }, inv,
                       "spmm: work items (A.rows / 8 * B.cols / 64) = 576460752303423488 * 16384 overflows");
  }
}

// ---------------------------------------------------------------------------------------------
// The plan form: no allocation, one plan reused across calls and threads, rejections

TEST_CASE(
    "spmm plan form: allocates nothing, one plan reused across calls and threads gives the bits of fresh "
    "plans" LOOM_BACKEND_TAG,
    "[sparse][spmm][plan]") {
  const auto b_ = make_backend();
  const index_t m = 37, k = 131, n = 9;
  const auto dense = make_matrix<float>(m, k, 0.7, false, 200);
  const on_device_bitmap<float> a1(ls::to_bitmap(loom::tensor_view<const float, 2>(dense.data(), {m, k})));
  const on_device_csr<float> a0(ls::to_csr(loom::tensor_view<const float, 2>(dense.data(), {m, k})));
  const auto pl = ls::make_plan(b_, a1.v, n, {.alpha = 0.5, .beta = 0.0});
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(pl)>, ls::plan<loom::fp32>>);
  REQUIRE(pl.rows() == m);
  REQUIRE(pl.cols() == k);
  REQUIRE(pl.n() == n);
  REQUIRE(pl.workspace_bytes() >= sizeof(float) * static_cast<std::size_t>(k * n));
  REQUIRE(pl.workspace_bytes() % loom::workspace_alignment == 0);
  constexpr int calls = 3;
  std::vector<buffer<float>*> bs;
  std::vector<std::unique_ptr<buffer<float>>> keep;
  for (int c = 0; c < calls; ++c)  // column-major B: always packed into the workspace
    keep.push_back(
        std::make_unique<buffer<float>>(lt::uniform<float>(k * n, -1, 1, 210 + static_cast<std::uint64_t>(c))));
  auto bview = [&](int c) {
    return loom::tensor_view<const float, 2, space>(keep[static_cast<std::size_t>(c)]->data(), {k, n}, {1, k});
  };
  // Fresh plans (the convenience form), one call each.
  std::vector<std::vector<float>> want;
  for (int c = 0; c < calls; ++c) {
    buffer<float> cc(static_cast<std::size_t>(m * n));
    ls::spmm(b_, a1.v, bview(c), loom::tensor_view<float, 2, space>(cc.data(), {m, n}), {.alpha = 0.5});
    want.push_back(cc.to_host());
  }
  // One plan, one workspace, every call: no heap allocation and no temporary.
  {
    workspace ws(pl.workspace_bytes());
    std::vector<std::unique_ptr<buffer<float>>> outs;
    for (int c = 0; c < calls; ++c) outs.push_back(std::make_unique<buffer<float>>(static_cast<std::size_t>(m * n)));
    for (int c = 0; c < calls; ++c) {
      const loom::tensor_view<float, 2, space> cv(outs[static_cast<std::size_t>(c)]->data(), {m, n});
      const auto counted = lt::count_allocations([&] { ls::spmm(b_, pl, a1.v, bview(c), cv, ws.span()); });
      CHECK(counted.heap == 0);
      CHECK(counted.temporaries == 0);
    }
    for (int c = 0; c < calls; ++c)
      REQUIRE(outs[static_cast<std::size_t>(c)]->to_host() == want[static_cast<std::size_t>(c)]);
  }
  // One const plan shared by two threads, each with its own workspace and C.
#if !defined(LOOM_TEST_BACKEND_CUDA) && !defined(LOOM_TEST_BACKEND_STANDIN)
  std::vector<float> got0(static_cast<std::size_t>(m * n)), got1(got0.size());
  auto worker = [&](std::vector<float>& out, int c) {
    workspace ws(pl.workspace_bytes());
    for (int rep = 0; rep < 4; ++rep)
      ls::spmm(loom::serial{}, pl, a1.v, bview(c), loom::tensor_view<float, 2, space>(out.data(), {m, n}), ws.span());
  };
  std::thread t0(worker, std::ref(got0), 0), t1(worker, std::ref(got1), 1);
  t0.join();
  t1.join();
  REQUIRE(got0 == want[0]);
  REQUIRE(got1 == want[1]);
#endif
  // The same plan serves any A of the same extents (another format).
  buffer<float> c0(static_cast<std::size_t>(m * n)), c1(static_cast<std::size_t>(m * n));
  workspace ws(pl.workspace_bytes());
  ls::spmm(b_, pl, a0.v, bview(0), loom::tensor_view<float, 2, space>(c0.data(), {m, n}), ws.span());
  ls::spmm(b_, a0.v, bview(0), loom::tensor_view<float, 2, space>(c1.data(), {m, n}), {.alpha = 0.5});
  REQUIRE(c0.to_host() == c1.to_host());
}

TEST_CASE("spmm plan form rejects a too-small or misaligned workspace and operands of other extents" LOOM_BACKEND_TAG,
          "[sparse][spmm][plan][reject]") {
  const auto b_ = make_backend();
  const index_t m = 4, k = 5, n = 6;
  const ls::csr_view<float, space> a{m, k, nullptr, nullptr, nullptr};
  const auto pl = ls::make_plan(b_, a, n);
  buffer<float> b(60), c(48);
  const loom::tensor_view<const float, 2, space> bv(b.data(), {k, n}, {1, k});
  const loom::tensor_view<float, 2, space> cv(c.data(), {m, n});
  const auto inv = loom::errc::invalid_argument, shape = loom::errc::shape_mismatch;
  {
    workspace ws(pl.workspace_bytes() - 1);
    lt::require_loom_error([&] { ls::spmm(b_, pl, a, bv, cv, ws.span()); }, inv,
                           {"spmm: workspace must hold at least", "plan.workspace_bytes()"});
  }
  {
    workspace ws(pl.workspace_bytes());
    lt::require_loom_error([&] { ls::spmm(b_, pl, a, bv, cv, ws.span(8)); }, inv,
                           {"spmm: workspace must start on a 64-byte boundary"});
  }
  workspace ws(pl.workspace_bytes());
  const ls::csr_view<float, space> other{m, k + 1, nullptr, nullptr, nullptr};
  lt::require_loom_error([&] { ls::spmm(b_, pl, other, bv, cv, ws.span()); }, shape,
                         {"spmm: A must be 4 x 5 (the plan's), got 4 x 6"});
  const loom::tensor_view<const float, 2, space> narrow(b.data(), {k, n - 1}, {1, k});
  const loom::tensor_view<float, 2, space> cnarrow(c.data(), {m, n - 1});
  lt::require_loom_error([&] { ls::spmm(b_, pl, a, narrow, cnarrow, ws.span()); }, shape,
                         {"spmm: B must be [5, 6] (A.cols x the plan's N), got [5, 5]"});
  lt::require_loom_error([&] { (void)ls::make_plan(b_, a, -1); }, inv, {"spmm: B's column count must be >= 0"});
}

// The team body that loom::cuda runs for the bitmap format (bitmap_team_kernel through
// for_each_team, teams of 64 there), run here on this backend with every team size it takes up to
// 32 (1 on serial), against the fp64 oracle: the device kernel's logic, tested on the CPU.
TEST_CASE("spmm bitmap: the cuda team body on this backend's teams" LOOM_BACKEND_TAG, "[sparse][spmm][team]") {
  const auto be = make_backend();
  const int max = loom::team_size_max(be) < 32 ? loom::team_size_max(be) : 32;
  for (const auto& s : {std::pair<index_t, index_t>{7, 1}, std::pair<index_t, index_t>{83, 200},
                        std::pair<index_t, index_t>{64, 129}}) {
    const index_t m = s.first, k = s.second;
    for (index_t n : {index_t{1}, index_t{13}, index_t{67}}) {
      const auto a = make_matrix<float>(m, k, 0.8, false, 401);
      const auto bvals = lt::uniform<float>(k * n, -1, 1, 402);
      const auto bm = ls::to_bitmap(loom::tensor_view<const float, 2>(a.data(), {m, k}));
      on_device_bitmap<float> d(bm);
      buffer<float> bb(bvals);
      const dense_operand<float> bo(k, n, false, bvals);
      const dense_operand<float> c0(m, n, false, std::vector<float>(static_cast<std::size_t>(m * n), 0.0f));
      const auto want = oracle(a, m, k, bo, c0, 1.0, 0.0, static_cast<const std::vector<float>*>(nullptr));
      for (int size : {1, 3, 8, max}) {
        if (size > max) continue;
        INFO("M=" << m << " K=" << k << " N=" << n << " team_size=" << size);
        // C starts as NaN for every team size: an output the body does not write shows.
        buffer<float> cc(std::vector<float>(static_cast<std::size_t>(m * n), std::numeric_limits<float>::quiet_NaN()));
        ls::detail::spmm_common<float, float> common;
        common.b = bb.data();
        common.ldb = n;
        common.n = n;
        common.n_chunks = (n + ls::detail::n_block - 1) / ls::detail::n_block;
        common.out = {cc.data(), n, 1, 1.0f, 0.0f, nullptr, m};
        const auto g = ls::detail::plan_geometry(d.v, n);
        ls::detail::run_bitmap_teams(
            be,
            ls::detail::bitmap_kernel<float, decltype(d.v)::space, float, float, ls::detail::no_hook>{d.v, common, {}},
            g.items, size);
        const auto h = cc.to_host();
        const std::vector<double> got(h.begin(), h.end());
        const auto tol = lt::tolerance_for<loom::fp32>();
        lt::require_close(got, want, {tol.rel, tol.abs * (1 + std::sqrt(static_cast<double>(k)))}, "team spmm");
      }
    }
  }
}
