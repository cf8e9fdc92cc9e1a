// Sparse formats: exact round trips dense -> format -> dense and format -> format, pruning,
// byte sizes, and one test per rejection of the validating constructors.

#include <loom/sparse/chooser.hpp>
#include <loom/sparse/convert.hpp>
#include <loom/sparse/formats.hpp>

#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using loom::index_t;
namespace ls = loom::sparse;
namespace lt = loom::test;

namespace {

// A rows x cols matrix with about `sparsity` zeros, an empty row, and values that are distinct.
std::vector<float> random_sparse(index_t rows, index_t cols, double sparsity, std::uint64_t stream) {
  auto g = lt::rng(stream);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<float> d(static_cast<std::size_t>(rows * cols), 0.0f);
  for (index_t i = 0; i < rows * cols; ++i)
    if (u(g) >= sparsity && (rows < 3 || i / cols != 1)) d[i] = static_cast<float>(u(g) * 2 - 1) + 0.01f;
  return d;
}

loom::tensor_view<const float, 2> view(const std::vector<float>& d, index_t rows, index_t cols) {
  return {d.data(), {rows, cols}};
}

template <class E>
void require_error(E&& make, loom::errc code, const char* text) {
  try {
    make();
    FAIL("expected loom::error containing '" << text << "'");
  } catch (const loom::error& e) {
    CHECK(e.code() == code);
    CHECK_THAT(e.what(), Catch::Contains(text));
  }
}

}  // namespace

TEST_CASE("sparse formats: exact round trips dense -> format -> dense and between formats", "[sparse]") {
  const index_t shapes[][2] = {{0, 0}, {1, 1}, {1, 7}, {7, 1}, {7, 64}, {64, 65}, {9, 130}, {130, 129}};
  for (const auto& s : shapes) {
    for (double sp : {0.0, 0.5, 0.9, 1.0}) {
      const index_t r = s[0], c = s[1];
      const auto d = random_sparse(r, c, sp, 10 + static_cast<std::uint64_t>(r * 131 + c));
      INFO(r << " x " << c << " at sparsity " << sp);
      const auto a = ls::to_csr(view(d, r, c));
      const auto b = ls::to_bitmap(view(d, r, c));
      CHECK(ls::to_dense(a) == d);
      CHECK(ls::to_dense(b) == d);
      CHECK(a.nnz() == b.nnz());
      CHECK(ls::to_dense(ls::to_bitmap(a)) == d);
      CHECK(ls::to_dense(ls::to_csr(b)) == d);
      CHECK(ls::to_csr(b).col_idx() == a.col_idx());
      CHECK(ls::to_bitmap(a).masks() == b.masks());
      // N:M after N:M pruning
      const auto p = ls::prune_n_m<2, 4>(view(d, r, c));
      const auto nm = ls::to_n_m<2, 4>(view(p, r, c));
      CHECK(ls::to_dense(nm) == p);
      CHECK(ls::to_dense(ls::to_csr(nm)) == p);
      CHECK(ls::to_dense(ls::to_n_m<2, 4>(ls::to_bitmap(nm))) == p);
      const auto nm18 = ls::to_n_m<1, 8>(view(ls::prune_n_m<1, 8>(view(d, r, c)), r, c));
      CHECK(ls::to_dense(ls::to_csr(nm18)) == ls::to_dense(nm18));
    }
  }
}

TEST_CASE("sparse formats: explicit zeros survive csr <-> bitmap", "[sparse]") {
  const ls::csr<float> a(2, 70, {0, 2, 3}, {0, 69, 5}, {0.0f, 1.5f, 0.0f});
  const auto b = ls::to_bitmap(a);
  CHECK(b.nnz() == 3);
  const auto back = ls::to_csr(b);
  CHECK(back.row_ptr() == a.row_ptr());
  CHECK(back.col_idx() == a.col_idx());
  CHECK(back.values() == a.values());
}

TEST_CASE("sparse formats: byte sizes", "[sparse]") {
  const index_t r = 64, c = 256;
  const auto d = random_sparse(r, c, 0.9, 3);
  const auto a = ls::to_csr(view(d, r, c));
  const auto b = ls::to_bitmap(view(d, r, c));
  const auto nnz = static_cast<std::size_t>(a.nnz());
  CHECK(a.bytes() == (r + 1) * 8 + nnz * (4 + 4));
  const std::size_t tiles = (r / 8) * (c / 64);
  CHECK(b.bytes() == tiles * 8 * 8 + (tiles + 1) * 8 + nnz * 4);
  CHECK(static_cast<double>(b.bytes()) < 0.15 * static_cast<double>(d.size() * sizeof(float)));
  const auto nm = ls::to_n_m<2, 4>(view(ls::prune_n_m<2, 4>(view(d, r, c)), r, c));
  CHECK(nm.bytes() == static_cast<std::size_t>(r * c / 4 * 2 * (4 + 1)));
}

TEST_CASE("sparse pruning: magnitude, global and per row, to the target sparsity", "[sparse]") {
  const index_t r = 37, c = 101;
  const auto d = lt::uniform<float>(r * c, -1, 1, 7);
  for (double sp : {0.0, 0.5, 0.9, 0.99, 1.0}) {
    const auto per_row = ls::prune_magnitude(view(d, r, c), sp, ls::prune_scope::per_row);
    const auto global = ls::prune_magnitude(view(d, r, c), sp, ls::prune_scope::global);
    index_t zg = 0;
    for (index_t i = 0; i < r; ++i) {
      index_t z = 0;
      float kept_min = 2, cut_max = 0;
      for (index_t j = 0; j < c; ++j) {
        const float v = per_row[i * c + j], o = d[i * c + j];
        CHECK((v == 0.0f || v == o));
        z += v == 0.0f;
        if (v == 0.0f)
          cut_max = std::max(cut_max, std::fabs(o));
        else
          kept_min = std::min(kept_min, std::fabs(o));
      }
      CHECK(z == std::llround(sp * c));
      CHECK(cut_max <= kept_min);  // the smallest magnitudes went first
    }
    for (float v : global) zg += v == 0.0f;
    CHECK(zg == std::llround(sp * r * c));
  }
  const auto nm = ls::prune_n_m<2, 4>(view(d, r, c));
  CHECK_NOTHROW(ls::to_n_m<2, 4>(view(nm, r, c)));
}

// ---- rejections: one per malformed input --------------------------------------------------

TEST_CASE("sparse csr rejects non-monotone row pointers", "[sparse][reject]") {
  require_error(
      [] {
        ls::csr<float>(2, 4, {0, 2, 1}, {0, 1}, {1, 2});
      },
      loom::errc::invalid_argument, "row_ptr must be non-decreasing");
}
TEST_CASE("sparse csr rejects row_ptr of the wrong size or start", "[sparse][reject]") {
  require_error([] { ls::csr<float>(2, 4, {0, 1}, {0}, {1}); }, loom::errc::invalid_argument, "rows + 1 = 3");
  require_error([] { ls::csr<float>(1, 4, {1, 1}, {}, {}); }, loom::errc::invalid_argument, "row_ptr[0] must be 0");
  require_error([] { ls::csr<float>(1, 4, {0, 2}, {0}, {1}); }, loom::errc::invalid_argument, "row_ptr[rows] must");
}
TEST_CASE("sparse csr rejects out-of-range column indices", "[sparse][reject]") {
  require_error(
      [] {
        ls::csr<float>(1, 4, {0, 1}, {4}, {1});
      },
      loom::errc::invalid_argument, "must be in [0, cols = 4)");
  require_error([] { ls::csr<float>(1, 4, {0, 1}, {-1}, {1}); }, loom::errc::invalid_argument, "got -1");
}
TEST_CASE("sparse csr rejects unsorted column indices", "[sparse][reject]") {
  require_error(
      [] {
        ls::csr<float>(1, 4, {0, 2}, {2, 1}, {1, 2});
      },
      loom::errc::invalid_argument, "must be increasing");
}
TEST_CASE("sparse csr rejects duplicate column indices", "[sparse][reject]") {
  require_error(
      [] {
        ls::csr<float>(1, 4, {0, 2}, {1, 1}, {1, 2});
      },
      loom::errc::invalid_argument, "duplicate column 1");
}
TEST_CASE("sparse csr rejects a value count mismatch", "[sparse][reject]") {
  require_error(
      [] {
        ls::csr<float>(1, 4, {0, 2}, {0, 1}, {1});
      },
      loom::errc::invalid_argument, "values must hold as many entries as col_idx");
}
TEST_CASE("sparse csr rejects negative extents", "[sparse][reject]") {
  require_error([] { ls::csr<float>(-1, 4, {0}, {}, {}); }, loom::errc::invalid_argument, "must be >= 0");
}
TEST_CASE("sparse bitmap rejects masks of the wrong size", "[sparse][reject]") {
  require_error([] { ls::bitmap<float>(8, 64, {0}, {0, 0}, {}); }, loom::errc::invalid_argument, "masks must hold 8");
}
TEST_CASE("sparse bitmap rejects bits outside the matrix", "[sparse][reject]") {
  std::vector<std::uint64_t> m(8, 0);
  m[0] = std::uint64_t{1} << 10;  // column 10 of a 10-column matrix
  require_error([&] { ls::bitmap<float>(3, 10, m, {0, 1}, {1}); }, loom::errc::invalid_argument, "outside the 3 x 10");
  m[0] = 0;
  m[5] = 1;  // row 5 of a 3-row matrix
  require_error([&] { ls::bitmap<float>(3, 10, m, {0, 1}, {1}); }, loom::errc::invalid_argument, "outside the 3 x 10");
}
TEST_CASE("sparse bitmap rejects tile offsets that disagree with the masks", "[sparse][reject]") {
  std::vector<std::uint64_t> m(16, 0);
  m[0] = 3;
  require_error(
      [&] {
        ls::bitmap<float>(8, 128, m, {0, 1, 2}, {1, 2});
      },
      loom::errc::invalid_argument, "tile 0 sets 2 bits");
  require_error(
      [&] {
        ls::bitmap<float>(8, 128, m, {0, 2}, {1, 2});
      },
      loom::errc::invalid_argument, "tile_offsets must hold tiles + 1 = 3");
  require_error(
      [&] {
        ls::bitmap<float>(8, 128, m, {1, 3, 3}, {1, 2});
      },
      loom::errc::invalid_argument, "tile_offsets[0] must be 0");
}
TEST_CASE("sparse bitmap rejects a value count mismatch", "[sparse][reject]") {
  std::vector<std::uint64_t> m(8, 0);
  m[0] = 3;
  require_error(
      [&] {
        ls::bitmap<float>(8, 64, m, {0, 2}, {1, 2, 3});
      },
      loom::errc::invalid_argument, "values must hold tile_offsets[tiles] = 2");
}
TEST_CASE("sparse n_m rejects out-of-range in-group indices", "[sparse][reject]") {
  require_error([] { ls::n_m<2, 4, float>(1, 4, {1, 2}, {0, 4}); }, loom::errc::invalid_argument, "below M = 4");
  require_error(
      [] {
        ls::n_m<2, 4, float>(1, 5, {1, 2, 3, 4}, {0, 1, 0, 2});
      },
      loom::errc::invalid_argument, "past the last column");
}
TEST_CASE("sparse n_m rejects unsorted or duplicate in-group indices", "[sparse][reject]") {
  require_error(
      [] {
        ls::n_m<2, 4, float>(1, 4, {1, 2}, {2, 1});
      },
      loom::errc::invalid_argument, "strictly increasing");
  require_error(
      [] {
        ls::n_m<2, 4, float>(1, 4, {1, 2}, {1, 1});
      },
      loom::errc::invalid_argument, "strictly increasing");
}
TEST_CASE("sparse n_m rejects a value count mismatch", "[sparse][reject]") {
  require_error([] { ls::n_m<2, 4, float>(1, 4, {1}, {0, 1}); }, loom::errc::invalid_argument, "values must hold");
  require_error([] { ls::n_m<2, 4, float>(1, 4, {1, 2}, {0}); }, loom::errc::invalid_argument, "indices must hold");
}
TEST_CASE("sparse to_n_m rejects a group with too many nonzeros", "[sparse][reject]") {
  const std::vector<float> d{1, 2, 3, 0};
  require_error([&] { ls::to_n_m<2, 4>(view(d, 1, 4)); }, loom::errc::invalid_argument, "more than N = 2");
}
TEST_CASE("sparse prune_magnitude rejects a sparsity outside [0, 1]", "[sparse][reject]") {
  const std::vector<float> d{1, 2};
  require_error([&] { ls::prune_magnitude(view(d, 1, 2), 1.5); }, loom::errc::invalid_argument, "sparsity must be in");
}

TEST_CASE("sparse choose: the cost model's times, monotone in sparsity, consistent crossover", "[sparse][chooser]") {
  namespace ls = loom::sparse;
  const ls::cost_model model;
  // Dense at N = 1 is bound by reading A: e M K / dense bandwidth.
  const auto c1 = ls::choose(0.5, 512, 512, 1, 4);
  CHECK(c1.dense_seconds == Approx(4.0 * 512 * 512 / (model.dense_bandwidth_gbs * 1e9)));
  // Bitmap at N = 1 and s = 1: max(its bytes / bandwidth, tiles * tile_ns).
  const auto c2 = ls::choose(1.0, 512, 512, 1, 4);
  CHECK(c2.sparse_seconds == Approx(9.0 / 64 * 512 * 512 / (model.bandwidth_gbs * 1e9)));  // no tile holds a nonzero
  CHECK(c2.pick == ls::choice::path::bitmap_spmm);
  const auto c3 = ls::choose(0.5, 512, 512, 1, 4);  // every tile is expanded
  CHECK(c3.sparse_seconds == Approx(std::max((4.0 * 0.5 + 9.0 / 64) * 512 * 512 / (model.bandwidth_gbs * 1e9),
                                             512.0 * 512 / 512 * model.tile_ns * 1e-9)));
  for (index_t n : {index_t{1}, index_t{8}, index_t{16}, index_t{64}}) {
    double prev = 1e300;
    for (int pct = 0; pct <= 100; pct += 5) {
      const auto c = ls::choose(pct / 100.0, 4096, 11008, n, 4);
      CHECK(c.sparse_seconds <= prev);
      CHECK(c.dense_seconds == Approx(ls::choose(0.0, 4096, 11008, n, 4).dense_seconds));
      prev = c.sparse_seconds;
    }
  }
  // A machine whose GEMM is far faster than the sparse kernel: the crossover moves up, and it is
  // where the pick changes.
  ls::cost_model fast_gemm = model;
  fast_gemm.gemm_gflops = 1000;
  fast_gemm.dense_bandwidth_gbs = 100;
  const double x = ls::crossover_sparsity(4096, 4096, 64, 4, fast_gemm);
  CHECK(x > 0.5);
  CHECK(x < 1.0);
  CHECK(ls::choose(x, 4096, 4096, 64, 4, fast_gemm).pick == ls::choice::path::bitmap_spmm);
  CHECK(ls::choose(x - 0.005, 4096, 4096, 64, 4, fast_gemm).pick == ls::choice::path::dense_gemm);
}

TEST_CASE("sparse choose: the H100 model reproduces the measured times and picks", "[sparse][chooser][gpu]") {
  // docs/gpu.md, the H100 run of 2026-11-23 (commits 47efad8, d6dcb58): cublasSgemm and loom's bitmap kernel (fp32),
  // times in microseconds, for M = 4096, K, N and 50 / 90 % zeros.
  namespace ls = loom::sparse;
  struct cell {
    index_t k, n;
    double sgemm, bitmap50, bitmap90;
  };
  const cell cells[] = {{4096, 1, 36.2, 210, 209},  {4096, 16, 55.1, 279, 277},  {4096, 64, 72.6, 282, 280},
                        {11008, 1, 73.4, 655, 546}, {11008, 16, 111, 1169, 727}, {11008, 64, 152, 1245, 731}};
  const auto& model = ls::h100_fp32_model;
  for (const cell& c : cells)
    for (const auto& [sparsity, measured] : {std::pair{0.5, c.bitmap50}, std::pair{0.9, c.bitmap90}}) {
      INFO("K " << c.k << " N " << c.n << " sparsity " << sparsity);
      const auto got = ls::choose(sparsity, 4096, c.k, c.n, 4, model);
      CHECK(got.pick == ls::choice::path::dense_gemm);  // as measured: cublasSgemm 3.8-11x faster
      const double dense = got.dense_seconds * 1e6 / c.sgemm, sparse = got.sparse_seconds * 1e6 / measured;
      CHECK(dense >= 0.55);
      CHECK(dense <= 1.15);
      CHECK(sparse >= 0.55);
      CHECK(sparse <= 1.15);
    }
  // 64 columns per pass: N = 16 and N = 64 cost the bitmap kernel the same, as measured.
  CHECK(ls::choose(0.9, 4096, 4096, 16, 4, model).sparse_seconds ==
        Approx(ls::choose(0.9, 4096, 4096, 64, 4, model).sparse_seconds));
  // The bitmap kernel would need almost every tile empty to win there.
  CHECK(ls::crossover_sparsity(4096, 11008, 16, 4, model) > 0.99);
}

TEST_CASE("sparse choose rejects bad arguments", "[sparse][chooser][reject]") {
  namespace ls = loom::sparse;
  CHECK_THROWS_WITH(ls::choose(-0.1, 8, 8, 1, 4), Catch::Contains("sparsity must be in [0, 1]"));
  CHECK_THROWS_WITH(ls::choose(1.5, 8, 8, 1, 4), Catch::Contains("sparsity must be in [0, 1]"));
  CHECK_THROWS_WITH(ls::choose(std::nan(""), 8, 8, 1, 4), Catch::Contains("sparsity must be in [0, 1]"));
  CHECK_THROWS_WITH(ls::choose(0.5, 0, 8, 1, 4), Catch::Contains("m, k, n must be > 0"));
  CHECK_THROWS_WITH(ls::choose(0.5, 8, 8, 0, 4), Catch::Contains("m, k, n must be > 0"));
  CHECK_THROWS_WITH(ls::choose(0.5, 8, 8, 1, 0), Catch::Contains("element_bytes must be > 0"));
  ls::cost_model bad;
  bad.bandwidth_gbs = 0;
  CHECK_THROWS_WITH(ls::choose(0.5, 8, 8, 1, 4, bad), Catch::Contains("cost_model bandwidths"));
  CHECK_THROWS_AS(ls::crossover_sparsity(8, 8, 1, 4, bad), loom::error);
  ls::cost_model no_columns;
  no_columns.columns_per_pass = 0;
  CHECK_THROWS_WITH(ls::choose(0.5, 8, 8, 1, 4, no_columns), Catch::Contains("columns_per_pass >= 1"));
}

TEST_CASE("sparse formats and conversions reject sizes whose products overflow, naming them",
          "[sparse][reject][overflow]") {
  constexpr index_t two_62 = index_t{1} << 62, max = std::numeric_limits<index_t>::max();
  const auto inv = loom::errc::invalid_argument;
  // csr: rows + 1 offsets.
  require_error([] { ls::csr<float>(max, 4, {0}, {}, {}); }, inv, "csr: rows + 1 = 9223372036854775807 + 1 overflows");
  // bitmap: tiles, then mask words.
  require_error([] { ls::bitmap<float>(max, max, {}, {0}, {}); }, inv,
                "bitmap: tiles = ceil(rows / 8) * ceil(cols / 64) = 1152921504606846976 * 144115188075855872 "
                "overflows");
  require_error([] { ls::bitmap<float>(max, 64, {}, {0}, {}); }, inv,
                "bitmap: masks words = tiles * 8 = 1152921504606846976 * 8 overflows");
  // n_m: rows * groups * N slots (2^62 * 2 * 2 used to wrap to 0 and pass with empty arrays).
  require_error([] { ls::n_m<2, 4, float>(two_62, 8, {}, {}); }, inv,
                "n_m: rows * groups = 4611686018427387904 * 2 overflows");
  require_error([] { ls::n_m<4, 8, float>(index_t{1} << 61, 8, {}, {}); }, inv,
                "n_m: rows * groups * N = 2305843009213693952 * 4 overflows");
  // Conversions from dense views whose extents multiply past the index range (the views are
  // unchecked; no element is read before the check).
  float x = 1;
  const loom::tensor_view<const float, 2> tall(&x, {two_62, 4}, {0, 0});
  require_error(
      [&] {
        (void)ls::to_n_m<2, 4>(loom::tensor_view<const float, 2>(&x, {two_62, 8}, {0, 0}));
      },
      inv, "to_n_m: rows * groups = 4611686018427387904 * 2 overflows");
  require_error(
      [&] {
        (void)ls::to_n_m<4, 8>(loom::tensor_view<const float, 2>(&x, {index_t{1} << 61, 8}, {0, 0}));
      },
      inv, "to_n_m: rows * groups * N = 2305843009213693952 * 4 overflows");
  require_error([&] { (void)ls::to_dense(tall); }, inv, "to_dense: rows * cols = 4611686018427387904 * 4 overflows");
  require_error(
      [&] {
        (void)ls::to_csr(loom::tensor_view<const float, 2>(&x, {max, 1}, {0, 0}));
      },
      inv, "to_csr: rows + 1 = 9223372036854775807 + 1 overflows");
  require_error(
      [&] {
        (void)ls::to_bitmap(loom::tensor_view<const float, 2>(&x, {max, 64}, {0, 0}));
      },
      inv, "to_bitmap: tiles * 8 = 1152921504606846976 * 8 overflows");
  require_error([&] { (void)ls::prune_magnitude(tall, 0.5); }, inv,
                "prune_magnitude: rows * cols = 4611686018427387904 * 4 overflows");
  require_error([&] { (void)ls::prune_n_m<2, 4>(tall); }, inv,
                "prune_n_m: rows * cols = 4611686018427387904 * 4 overflows");
}

TEST_CASE("sparse measure_formats and format_chooser: a measured pick, kept per shape", "[sparse][chooser]") {
  const loom::serial be;
  const index_t m = 37, k = 131;
  const auto d = random_sparse(m, k, 0.9, 61);
  const auto c = ls::to_csr(view(d, m, k));
  const auto b = ls::to_bitmap(view(d, m, k));
  for (index_t n : {index_t{1}, index_t{13}}) {
    const auto r = ls::measure_formats(be, c, b, n, {.repetitions = 2});
    CHECK(r.csr_seconds > 0);
    CHECK(r.bitmap_seconds > 0);
    CHECK(r.pick == (r.bitmap_seconds < r.csr_seconds ? ls::format::bitmap : ls::format::csr));
  }
  ls::format_chooser chooser;
  const auto first = chooser.pick(be, c, b, 13);
  CHECK(chooser.measured() == 1);
  const auto again = chooser.pick(be, c, b, 13);  // looked up: the same answer, nothing measured
  CHECK(chooser.measured() == 1);
  CHECK(again.pick == first.pick);
  CHECK(again.csr_seconds == first.csr_seconds);
  CHECK(again.bitmap_seconds == first.bitmap_seconds);
  (void)chooser.pick(be, c, b, 14);  // another N: measured
  CHECK(chooser.measured() == 2);
  const auto denser = random_sparse(m, k, 0.5, 62);  // another density: measured
  (void)chooser.pick(be, ls::to_csr(view(denser, m, k)), ls::to_bitmap(view(denser, m, k)), 13);
  CHECK(chooser.measured() == 3);
}

TEST_CASE("sparse measure_formats rejects bad arguments", "[sparse][chooser][reject]") {
  const loom::serial be;
  const auto d = random_sparse(9, 20, 0.5, 63);
  const auto c = ls::to_csr(view(d, 9, 20));
  const auto b = ls::to_bitmap(view(d, 9, 20));
  const auto other = ls::to_bitmap(view(d, 10, 18));
  require_error([&] { ls::measure_formats(be, c, other, 4); }, loom::errc::shape_mismatch,
                "a_csr and a_bitmap must have the same extents");
  require_error([&] { ls::measure_formats(be, c, b, 0); }, loom::errc::invalid_argument, "n must be > 0");
  require_error([&] { ls::measure_formats(be, c, b, 4, {.repetitions = 0}); }, loom::errc::invalid_argument,
                "repetitions must be > 0");
  ls::format_chooser chooser;
  require_error([&] { chooser.pick(be, c, b, -1); }, loom::errc::invalid_argument, "n must be > 0");
  CHECK(chooser.measured() == 0);
}
