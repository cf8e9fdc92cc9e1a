#pragma once

//! @file
//! C = alpha * A * B + beta * C for a CSR weight A on loom::cuda through cuSPARSE's generic SpMM,
//! with loom's call shape:
//!
//!   auto plan = loom::sparse::cusparse::make_plan(b, a, n, {.alpha = 1, .beta = 0});   // once per weight
//!   loom::temporary_buffer<loom::cuda, std::byte> ws(b, plan.workspace_bytes());      // or the caller's memory
//!   loom::sparse::cusparse::spmm(b, plan, a, b_view, c_view, ws.bytes());              // allocates nothing
//!   loom::sparse::cusparse::spmm(b, a, b_view, c_view);                                 // convenience
//!
//! Link loom::cusparse (present when CMake finds the CUDA toolkit's cuSPARSE). A is a
//! csr_view<T, cuda_memory> (loom's CSR: int64 row offsets, int32 column indices); B (K x N) and C
//! (M x N) are dense views in device memory, both row-major (the default) or both column-major
//! (options::order). T: float, double, bfloat16 or half; C may be float where T is bfloat16 or
//! half (make_plan<T, float>); B holds T. Products accumulate in float (double for double).
//!
//! How it runs: make_plan reads A's row offsets to the host once (checks them: 0 first,
//! non-decreasing, fewer than 2^31 entries) and keeps a 32-bit copy in device memory (cuSPARSE's
//! CSR takes one index type for offsets and columns), creates a cuSPARSE handle and the three
//! matrix descriptors on the current device and asks cuSPARSE for its buffer size. The plan is
//! bound to A's sparsity pattern: a call takes A's column indices and values as given (they may
//! change between calls) but its row offsets must be the ones the plan was made from (the same
//! device pointer, unchanged). Calls on one plan are serialised on its handle while they are
//! enqueued (the descriptors take the call's pointers); a plan is immutable otherwise, may be
//! shared by threads, and must outlive the stream work of its calls. Calls must run with the
//! plan's device current.
//!
//! Workspace: cuSPARSE's buffer, in device memory, aligned to loom::workspace_alignment.
//! Completion: stream-ordered on b.stream, no host sync; the convenience form fences.
//! Results: cuSPARSE's order of summation, not loom's (loom::sparse::spmm sums in a fixed order on
//! every backend). With float or double C the sums are one rounding from the exact product; with a
//! bfloat16 or half C, cuSPARSE rounds partial sums to C's type when N > 1 (docs/gpu.md, run of
//! 2026-11-28 on an H200, commit 4661c69: up to 1.22 units of 2^-8 of sum |a b| for bfloat16, against 0.5 for one
//! rounding): plan a float C (make_plan<float>) for one rounding. The [gpu] cases of
//! tests/sparse/cusparse_test.cpp compare with the fp64 oracle at those bounds.

#include <loom/backend/cuda.hpp>
#include <loom/backend/detail/cuda_vendor.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/core/memory_space.hpp>
#include <loom/core/overlap.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/core/workspace.hpp>
#include <loom/sparse/detail/dense_layout.hpp>
#include <loom/sparse/formats.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cusparse.h>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::sparse::cusparse {

//! The layout of B and C (sparse::order): both row-major (the default) or both column-major.
using sparse::order;

//! The numbers of a product. When beta == 0, C is not read.
struct options {
  double alpha = 1.0;
  double beta = 0.0;
  cusparse::order order = order::row_major;
  //! cuSPARSE's algorithm (CUSPARSE_SPMM_ALG_DEFAULT, CUSPARSE_SPMM_CSR_ALG1, _ALG2, _ALG3); see
  //! cuSPARSE's documentation for the layouts each takes and which are deterministic.
  cusparseSpMMAlg_t algorithm = CUSPARSE_SPMM_ALG_DEFAULT;
};

namespace detail {

template <class T>
inline constexpr bool storable = loom::detail::cuda_library_type<T>;

//! The (A and B, C) element types cuSPARSE's SpMM takes: uniform, or 16-bit inputs with float C.
template <class T, class TC>
inline constexpr bool supported_pair = storable<T> && (std::is_same_v<T, TC> || (std::is_same_v<TC, float> &&
                                                                                 (std::is_same_v<T, loom::bfloat16> ||
                                                                                  std::is_same_v<T, loom::half>)));

using loom::detail::cuda_data_type;

//! The accumulation type: double for double, float otherwise.
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

inline void check_cusparse(cusparseStatus_t s, std::string_view call, std::string_view what) {
  if (s == CUSPARSE_STATUS_SUCCESS) return;
  const errc code = s == CUSPARSE_STATUS_NOT_SUPPORTED ? errc::unsupported : errc::internal;
  LOOM_EXPECTS(false, code, call, ": ", what, " failed: ", cusparseGetErrorName(s), ": ", cusparseGetErrorString(s));
}

//! The checks make_plan makes before touching the device.
struct sizes {
  index_t m, k, n;
};
inline void check_arguments(const sizes& s, const options& opt, std::string_view call) {
  constexpr index_t int32_max = std::numeric_limits<std::int32_t>::max();
  LOOM_EXPECTS(s.m >= 0 && s.k >= 0, errc::invalid_argument, call, ": A's extents must be >= 0, got ", s.m, " x ", s.k);
  LOOM_EXPECTS(s.n >= 0, errc::invalid_argument, call, ": n (the columns of B and C) must be >= 0, got ", s.n);
  LOOM_EXPECTS(s.m <= int32_max && s.k <= int32_max, errc::unsupported, call,
               ": A's extents must each be below 2^31 (cuSPARSE's 32-bit indices), got ", s.m, " x ", s.k);
  LOOM_EXPECTS(s.n <= int32_max, errc::unsupported, call, ": n must be below 2^31, got ", s.n);
  sparse::detail::check_options(opt.alpha, opt.beta, opt.order, call);
}

//! The 32-bit copy of A's row offsets, from the int64 ones read to the host.
//! @throws loom::error(invalid_argument) offsets not starting at 0 or decreasing;
//!   (unsupported) 2^31 entries or more.
inline std::vector<std::int32_t> narrow_offsets(const std::vector<index_t>& row_ptr, std::string_view call) {
  sparse::detail::check_row_offsets(row_ptr, call, "A.row_ptr");
  LOOM_EXPECTS(row_ptr.back() <= std::numeric_limits<std::int32_t>::max(), errc::unsupported, call, ": A holds ",
               row_ptr.back(), " entries; cuSPARSE's 32-bit CSR takes fewer than 2^31");
  return std::vector<std::int32_t>(row_ptr.begin(), row_ptr.end());
}

using sparse::detail::dense_in;

//! What a plan owns on the device. cudaFree waits for the device's work in flight.
struct state {
  cusparseHandle_t handle = nullptr;
  cusparseSpMatDescr_t a = nullptr;
  cusparseDnMatDescr_t b = nullptr, c = nullptr;
  std::int32_t* offsets = nullptr;          // the 32-bit row offsets (rows + 1)
  const index_t* source_offsets = nullptr;  // A.row_ptr at make_plan (the pattern the plan is bound to)
  int device = -1;
  std::mutex enqueue;  // cusparseSetStream, the descriptors' pointers and cusparseSpMM on the shared handle
  state() = default;
  state(const state&) = delete;
  state& operator=(const state&) = delete;
  ~state() {
    if (a) cusparseDestroySpMat(a);
    if (b) cusparseDestroyDnMat(b);
    if (c) cusparseDestroyDnMat(c);
    if (offsets) cudaFree(offsets);
    if (handle) cusparseDestroy(handle);
  }
};

struct plan_access;

}  // namespace detail

//! A plan of C = alpha A B + beta C through cuSPARSE (see the file comment): A's extents and row
//! offsets, N, the options, the handle and descriptors, the buffer size. T: A's and B's elements;
//! TC: C's.
template <class T, class TC = T>
class plan {
  static_assert(detail::supported_pair<T, TC>,
                "sparse::cusparse: A and B hold float, double, bfloat16 or half; C holds the same type, or float "
                "for bfloat16 and half inputs");

 public:
  using value_type = T;
  using output_type = TC;
  using backend_type = loom::cuda;
  [[nodiscard]] index_t rows() const noexcept { return m_; }
  [[nodiscard]] index_t cols() const noexcept { return k_; }
  [[nodiscard]] index_t n() const noexcept { return n_; }
  [[nodiscard]] index_t nnz() const noexcept { return nnz_; }
  [[nodiscard]] const sparse::cusparse::options& options() const noexcept { return opt_; }
  //! Bytes of device workspace spmm needs with this plan.
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return bytes_; }

 private:
  friend struct detail::plan_access;
  index_t m_ = 0, k_ = 0, n_ = 0, nnz_ = 0;
  sparse::cusparse::options opt_{};
  std::size_t bytes_ = 0;
  std::shared_ptr<detail::state> st_;
};

namespace detail {
struct plan_access {
  template <class T, class TC>
  static plan<T, TC> make(const csr_view<T, cuda_memory>& a, index_t n, const options& opt) {
    constexpr std::string_view call = "sparse::cusparse::make_plan";
    check_arguments({a.rows, a.cols, n}, opt, call);
    plan<T, TC> p;
    p.m_ = a.rows, p.k_ = a.cols, p.n_ = n, p.opt_ = opt;
    p.st_ = std::make_shared<state>();
    state& st = *p.st_;
    st.source_offsets = a.row_ptr;
    if (a.rows == 0 || n == 0) return p;  // C is empty: nothing to run
    LOOM_EXPECTS(a.row_ptr != nullptr, errc::invalid_argument, call, ": A.row_ptr is null");
    std::vector<index_t> host(static_cast<std::size_t>(a.rows) + 1);
    LOOM_CUDA_TRY(cudaMemcpy(host.data(), a.row_ptr, host.size() * sizeof(index_t), cudaMemcpyDefault));
    const std::vector<std::int32_t> narrow = narrow_offsets(host, call);
    p.nnz_ = host.back();
    LOOM_EXPECTS(p.nnz_ == 0 || (a.col_idx != nullptr && a.values != nullptr), errc::invalid_argument, call,
                 ": A holds ", p.nnz_, " entries but A.col_idx or A.values is null");
    st.device = loom::detail::current_cuda_device();
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&st.offsets), narrow.size() * sizeof(std::int32_t)));
    LOOM_CUDA_TRY(cudaMemcpy(st.offsets, narrow.data(), narrow.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
    check_cusparse(cusparseCreate(&st.handle), call, "cusparseCreate");
    check_cusparse(cusparseCreateCsr(&st.a, a.rows, a.cols, p.nnz_, st.offsets, const_cast<std::int32_t*>(a.col_idx),
                                     const_cast<T*>(a.values), CUSPARSE_INDEX_32I, CUSPARSE_INDEX_32I,
                                     CUSPARSE_INDEX_BASE_ZERO, cuda_data_type<T>()),
                   call, "cusparseCreateCsr");
    // B and C get their pointers at each call; until then they point at the plan's offsets (device
    // memory cuSPARSE only sizes against here, never reads).
    const bool rm = opt.order == order::row_major;
    const cusparseOrder_t ord = rm ? CUSPARSE_ORDER_ROW : CUSPARSE_ORDER_COL;
    const index_t ldb = rm ? n : std::max<index_t>(a.cols, 1), ldc = rm ? n : a.rows;
    check_cusparse(cusparseCreateDnMat(&st.b, a.cols, n, ldb, st.offsets, cuda_data_type<T>(), ord), call,
                   "cusparseCreateDnMat (B)");
    check_cusparse(cusparseCreateDnMat(&st.c, a.rows, n, ldc, st.offsets, cuda_data_type<TC>(), ord), call,
                   "cusparseCreateDnMat (C)");
    using S = compute_t<T>;
    const S alpha = static_cast<S>(opt.alpha), beta = static_cast<S>(opt.beta);
    std::size_t bytes = 0;
    check_cusparse(
        cusparseSpMM_bufferSize(st.handle, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &alpha,
                                st.a, st.b, &beta, st.c, cuda_data_type<S>(), opt.algorithm, &bytes),
        call, "cusparseSpMM_bufferSize");
    p.bytes_ = bytes;
    return p;
  }

  template <class T, class TC>
  static state& state_of(const plan<T, TC>& p, std::string_view call) {
    LOOM_EXPECTS(p.st_ != nullptr, errc::invalid_argument, call,
                 ": the plan was not made by sparse::cusparse::make_plan (default-constructed)");
    return *p.st_;
  }
};
}  // namespace detail

//! Plans C = alpha A B + beta C for the CSR weight `a` (device memory) and a B of `n` columns;
//! TC: C's element type (default: A's). Reads A's row offsets once (a host sync).
//! @throws loom::error(invalid_argument) negative extents or n, an invalid order, alpha or beta
//!   not finite, row offsets not starting at 0 or decreasing, null arrays; (unsupported) extents or
//!   entries of 2^31 or more; (internal, unsupported) a failing CUDA or cuSPARSE call (its name
//!   and cuSPARSE's reason quoted).
template <class TC = void, class T>
auto make_plan(const loom::cuda&, const csr_view<T, cuda_memory>& a, index_t n, const options& opt = {}) {
  using C = std::conditional_t<std::is_void_v<TC>, T, TC>;
  return detail::plan_access::make<T, C>(a, n, opt);
}

//! C = alpha A B + beta C with a plan and a caller's workspace (plan.workspace_bytes() of device
//! memory, aligned to loom::workspace_alignment). A: the plan's extents and row offsets; B: K x N
//! of A's element type, C: M x N of the plan's output type, both dense in the plan's order, not
//! sharing memory. Stream-ordered on b.stream; allocates nothing.
//! @throws loom::error(shape_mismatch) extents not the plan's; (invalid_argument) A's row offsets
//!   not those of the plan, a view not dense in the plan's order, B and C overlapping, a short or
//!   misaligned workspace, a plan not made by make_plan, a device other than the plan's;
//!   (internal, unsupported) cuSPARSE failing.
template <class T, class TC, class BV, class CV>
void spmm(const loom::cuda& b, const plan<T, TC>& p, const csr_view<T, cuda_memory>& a, const BV& bm, const CV& c,
          std::span<std::byte> workspace) {
  constexpr std::string_view call = "sparse::cusparse::spmm";
  static_assert(BV::rank == 2 && CV::rank == 2, "sparse::cusparse::spmm: B and C must be rank-2 views");
  static_assert(std::is_same_v<typename BV::space, cuda_memory> && std::is_same_v<typename CV::space, cuda_memory>,
                "sparse::cusparse::spmm: B and C must be views of device memory (loom::cuda_memory)");
  static_assert(std::is_same_v<std::remove_cv_t<typename BV::value_type>, T>,
                "sparse::cusparse::spmm: B must hold A's element type");
  static_assert(std::is_same_v<typename CV::value_type, TC> && !std::is_const_v<typename CV::element_type>,
                "sparse::cusparse::spmm: C must be a writable view of the plan's output type");
  detail::state& st = detail::plan_access::state_of(p, call);
  LOOM_EXPECTS(a.rows == p.rows() && a.cols == p.cols(), errc::shape_mismatch, call, ": A must be ", p.rows(), " x ",
               p.cols(), " (the plan's), got ", a.rows, " x ", a.cols);
  LOOM_EXPECTS(a.row_ptr == st.source_offsets, errc::invalid_argument, call,
               ": A.row_ptr is not the one the plan was made from (a plan is bound to A's sparsity pattern; make "
               "a plan per pattern)");
  sparse::detail::check_dense_operands(bm, c, p.rows(), p.cols(), p.n(), p.options().order, call);
  check_workspace(workspace, p.workspace_bytes(), call);
  if (st.handle == nullptr) return;  // M == 0 or N == 0
  loom::detail::check_plan_device(st.device, call);
  using S = detail::compute_t<T>;
  const S alpha = static_cast<S>(p.options().alpha), beta = static_cast<S>(p.options().beta);
  std::lock_guard lock(st.enqueue);
  detail::check_cusparse(cusparseSetStream(st.handle, b.stream), call, "cusparseSetStream");
  detail::check_cusparse(
      cusparseCsrSetPointers(st.a, st.offsets, const_cast<std::int32_t*>(a.col_idx), const_cast<T*>(a.values)), call,
      "cusparseCsrSetPointers");
  detail::check_cusparse(cusparseDnMatSetValues(st.b, const_cast<void*>(static_cast<const void*>(bm.data()))), call,
                         "cusparseDnMatSetValues (B)");
  detail::check_cusparse(cusparseDnMatSetValues(st.c, static_cast<void*>(c.data())), call,
                         "cusparseDnMatSetValues (C)");
  detail::check_cusparse(cusparseSpMM(st.handle, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                      &alpha, st.a, st.b, &beta, st.c, detail::cuda_data_type<S>(),
                                      p.options().algorithm, workspace.empty() ? nullptr : workspace.data()),
                         call, "cusparseSpMM");
}

//! Convenience form: make_plan (C's element type from c), a temporary workspace, the plan form,
//! fence. @throws as make_plan and the plan form.
template <class T, class BV, class CV>
void spmm(const loom::cuda& b, const csr_view<T, cuda_memory>& a, const BV& bm, const CV& c, const options& opt = {}) {
  const auto p = make_plan<typename CV::value_type>(b, a, bm.extent(1), opt);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { spmm(b, p, a, bm, c, ws); });
}

}  // namespace loom::sparse::cusparse
