// libFuzzer target for the validating constructors of the sparse formats. The input bytes become
// a format (csr, bitmap or n_m<2, 4>), its extents and its arrays; construction must either
// succeed or throw loom::error. A constructed matrix must then convert to every other format and
// back, and multiply, without a crash or a sanitizer report. Built and run by run.sh.

#include <loom/backend/serial.hpp>
#include <loom/sparse/convert.hpp>
#include <loom/sparse/formats.hpp>
#include <loom/sparse/spmm.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct reader {
  const std::uint8_t* p;
  std::size_t n;
  template <class T>
  T take() {
    T v{};
    const std::size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
  template <class T>
  std::vector<T> many(std::size_t count) {
    std::vector<T> v(count);
    for (auto& x : v) x = take<T>();
    return v;
  }
};

template <class A>
void exercise(const A& a) {
  namespace ls = loom::sparse;
  const auto dense = ls::to_dense(a);
  auto same = [&](const std::vector<float>& x) {  // bitwise: NaN payloads and -0 must survive too
    return x.size() == dense.size() && (x.empty() || std::memcmp(x.data(), dense.data(), 4 * x.size()) == 0);
  };
  if (!same(ls::to_dense(ls::to_csr(a))) || !same(ls::to_dense(ls::to_bitmap(a)))) __builtin_trap();
  std::vector<float> b(static_cast<std::size_t>(a.cols() * 3), 1.0f), c(static_cast<std::size_t>(a.rows() * 3));
  ls::spmm(loom::serial{}, a, loom::tensor_view<const float, 2>(b.data(), {a.cols(), 3}),
           loom::tensor_view<float, 2>(c.data(), {a.rows(), 3}));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace ls = loom::sparse;
  reader in{data, size};
  const int kind = in.take<std::uint8_t>() % 3;
  // Small signed extents (negative ones must be rejected too) and array lengths near the valid ones.
  const loom::index_t rows = static_cast<std::int8_t>(in.take<std::uint8_t>()) % 40;
  const loom::index_t cols = static_cast<std::int8_t>(in.take<std::uint8_t>()) % 140;
  const int slack = static_cast<int>(in.take<std::uint8_t>() % 5) - 2;
  auto len = [&](loom::index_t want) {
    const loom::index_t n = want + slack;
    return static_cast<std::size_t>(n > 0 ? (n < 4096 ? n : 4096) : 0);
  };
  try {
    if (kind == 0) {
      const auto ptr = in.many<std::int16_t>(len(rows + 1));
      std::vector<loom::index_t> row_ptr(ptr.begin(), ptr.end());
      const loom::index_t nnz = row_ptr.empty() ? 0 : (row_ptr.back() > 0 ? row_ptr.back() % 512 : 0);
      auto idx = in.many<std::int16_t>(len(nnz));
      std::vector<std::int32_t> col_idx(idx.begin(), idx.end());
      auto values = in.many<float>(len(nnz));
      exercise(ls::csr<float>(rows, cols, row_ptr, col_idx, values));
    } else if (kind == 1) {
      const loom::index_t tiles = rows >= 0 && cols >= 0 ? ((rows + 7) / 8) * ((cols + 63) / 64) : 0;
      auto masks = in.many<std::uint64_t>(len(tiles * 8));
      const auto off = in.many<std::uint16_t>(len(tiles + 1));
      std::vector<loom::index_t> offsets(off.begin(), off.end());
      auto values = in.many<float>(offsets.empty() ? 0 : len(offsets.back() % 2048));
      exercise(ls::bitmap<float>(rows, cols, masks, offsets, values));
    } else {
      const loom::index_t slots = rows >= 0 && cols >= 0 ? rows * ((cols + 3) / 4) * 2 : 0;
      auto values = in.many<float>(len(slots));
      auto indices = in.many<std::uint8_t>(len(slots));
      exercise(ls::n_m<2, 4, float>(rows, cols, values, indices));
    }
  } catch (const loom::error&) {
    // rejected: the expected outcome for malformed input
  }
  return 0;
}
