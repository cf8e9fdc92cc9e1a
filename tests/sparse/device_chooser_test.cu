// sparse::device_chooser: the fastest of a dense cuBLAS GEMM, cuSPARSE's CSR SpMM and loom's bitmap
// kernel, measured on the GPU. [host] cases: the pick among measured times and the density key;
// [gpu] cases: a measurement on the device (every time positive, the pick the fastest, a second
// pick of the shape looked up, not measured).

#define LOOM_TEST_BACKEND_CUDA 1
#include <loom/sparse/convert.hpp>
#include <loom/sparse/device_chooser.cuh>

#include <support/backends.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

using namespace loom;
namespace sd = loom::sparse::detail;

TEST_CASE("sparse::device_chooser: the pick among measured times, ties to the vendors' paths",
          "[sparse][chooser][host]") {
  using sparse::device_path;
  CHECK(sd::fastest(1.0, 2.0, 3.0) == device_path::dense_cublas);
  CHECK(sd::fastest(2.0, 1.0, 3.0) == device_path::csr_cusparse);
  CHECK(sd::fastest(3.0, 2.0, 1.0) == device_path::bitmap_loom);
  CHECK(sd::fastest(1.0, 1.0, 1.0) == device_path::dense_cublas);
  CHECK(sd::fastest(2.0, 1.0, 1.0) == device_path::csr_cusparse);
  CHECK(sd::fastest(1.5, 2.0, 1.0) == device_path::bitmap_loom);
  CHECK(sd::density_percent(0, 10, 10) == 0);
  CHECK(sd::density_percent(10, 10, 10) == 10);
  CHECK(sd::density_percent(1004, 100, 100) == 10);  // 10.04 %
  CHECK(sd::density_percent(1051, 100, 100) == 11);  // 10.51 %
  CHECK(sd::density_percent(5, 0, 10) == 0);
}

TEST_CASE("sparse::device_chooser: measures each shape once on the device, picks the fastest",
          "[sparse][chooser][gpu]") {
  const index_t m = 512, k = 768;
  const auto dense = test::uniform<float>(m * k, -1, 1, 5);
  const auto pruned = sparse::prune_magnitude(tensor_view<const float, 2>(dense.data(), {m, k}), 0.9);
  const auto csr = sparse::to_csr(tensor_view<const float, 2>(pruned.data(), {m, k}));
  const auto bm = sparse::to_bitmap(tensor_view<const float, 2>(pruned.data(), {m, k}));
  const test::buffer<index_t> rp(csr.row_ptr());
  const test::buffer<std::int32_t> ci(csr.col_idx());
  const test::buffer<float> cv(csr.values()), bv(bm.values());
  const test::buffer<std::uint64_t> masks(bm.masks());
  const test::buffer<index_t> offs(bm.tile_offsets());
  const auto a_csr = sparse::make_csr_view<cuda_memory>(m, k, rp.data(), ci.data(), cv.data());
  const auto a_bm = sparse::make_bitmap_view<cuda_memory>(m, k, masks.data(), offs.data(), bv.data());
  sparse::device_chooser chooser;
  for (const index_t n : {index_t{1}, index_t{16}, index_t{64}}) {
    const auto c = chooser.pick(loom::cuda{}, a_csr, a_bm, csr.nnz(), n);
    CHECK(c.dense_seconds > 0);
    CHECK(c.csr_seconds > 0);
    CHECK(c.bitmap_seconds > 0);
    CHECK(c.pick == sd::fastest(c.dense_seconds, c.csr_seconds, c.bitmap_seconds));
    const auto again = chooser.pick(loom::cuda{}, a_csr, a_bm, csr.nnz(), n);
    CHECK(again.pick == c.pick);
    CHECK(again.dense_seconds == c.dense_seconds);
  }
  CHECK(chooser.measured() == 3);
  test::require_loom_error([&] { (void)sparse::measure_device_paths(loom::cuda{}, a_csr, a_bm, 0); },
                           errc::invalid_argument, {"sparse::measure_device_paths", "n must be > 0"});
}
