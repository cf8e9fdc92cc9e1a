#pragma once

//! @file
//! C = alpha * A * B + beta * C for a 2:4 structured weight A on loom::cuda through cuSPARSELt
//! (sparse tensor cores), with loom's call shape:
//!
//!   auto plan = loom::sparse::cusparselt::make_plan(b, a, n, {.order = loom::sparse::order::col_major});
//!   loom::temporary_buffer<loom::cuda, std::byte> ws(b, plan.workspace_bytes());   // or the caller's memory
//!   loom::sparse::cusparselt::spmm(b, plan, b_view, c_view, ws.bytes());           // allocates nothing
//!
//! Link loom::cusparselt (cuSPARSELt from the Python-registry package nvidia-cusparselt-cu13, found
//! by CMake; see cmake/LoomFindCusparselt.cmake). A is loom's 2:4 format (sparse::n_m<2, 4, T> or
//! its host view, T bfloat16 or half) with K a multiple of 4; B (K x N) and C (M x N) are dense
//! views of T in device memory, both row-major or both column-major (options::order; an LLM's
//! activations [tokens, K] are B in column-major), 16-byte aligned. Products accumulate in float.
//!
//! The plan holds the weight: make_plan expands A to its dense 2:4 form on the host, copies it to
//! the device, checks it with cuSPARSELt's prune check and compresses it into device memory the
//! plan owns (host syncs; the host arrays need not outlive make_plan). A call multiplies that
//! compressed weight by B; to change the weight, make a new plan. A plan owns its cuSPARSELt
//! handle, descriptors and compressed weight; it is immutable after make_plan and may be shared
//! by threads; calls must run with the plan's device current and the plan must outlive their
//! stream work.
//!
//! Workspace: cuSPARSELt's (plan.workspace_bytes()), device memory, loom::workspace_alignment.
//! Completion: stream-ordered on b.stream (no host sync); the convenience form fences.
//! Results: cuSPARSELt's order of summation. The [gpu] case of tests/sparse/cusparselt_test.cpp
//! compares them with the fp64 oracle; it passed on an H200 (docs/gpu.md, 2026-11-28, commit 29324c3), clean under
//! compute-sanitizer.

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
#include <cusparseLt.h>
#include <limits>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::sparse::cusparselt {

using sparse::order;

//! The numbers of a product. When beta == 0, C is not read.
struct options {
  double alpha = 1.0;
  double beta = 0.0;
  sparse::order order = order::row_major;
};

namespace detail {

template <class T>
inline constexpr bool storable = std::is_same_v<T, loom::bfloat16> || std::is_same_v<T, loom::half>;

using loom::detail::cuda_data_type;

inline void check_lt(cusparseStatus_t s, std::string_view call, std::string_view what) {
  if (s == CUSPARSE_STATUS_SUCCESS) return;
  const errc code = s == CUSPARSE_STATUS_NOT_SUPPORTED ? errc::unsupported : errc::internal;
  LOOM_EXPECTS(false, code, call, ": ", what, " failed: ", cusparseLtGetErrorName(s), ": ",
               cusparseLtGetErrorString(s));
}

//! The checks make_plan makes before touching the device.
inline void check_arguments(index_t m, index_t k, index_t n, const options& opt, std::string_view call) {
  LOOM_EXPECTS(m > 0 && k > 0, errc::invalid_argument, call, ": A must have rows and columns, got ", m, " x ", k);
  LOOM_EXPECTS(n > 0, errc::invalid_argument, call, ": n (the columns of B and C) must be > 0, got ", n);
  LOOM_EXPECTS(k % 4 == 0, errc::unsupported, call,
               ": A's column count must be a multiple of 4 for cuSPARSELt's 2:4 "
               "groups (loom's n_m allows a narrower last group; cuSPARSELt does not), got ",
               k);
  sparse::detail::check_options(opt.alpha, opt.beta, opt.order, call);
}

//! A's dense 2:4 form, row-major M x K (zeros where no slot points).
template <class T>
std::vector<T> expand(const n_m_view<2, 4, T>& a) {
  std::vector<T> dense(static_cast<std::size_t>(a.rows * a.cols), T(0.0f));
  const index_t groups = a.groups();
  for (index_t r = 0; r < a.rows; ++r)
    for (index_t g = 0; g < groups; ++g)
      for (index_t s = 0; s < 2; ++s) {
        const index_t slot = (r * groups + g) * 2 + s, col = g * 4 + a.indices[slot];
        if (col < a.cols) dense[static_cast<std::size_t>(r * a.cols + col)] = a.values[slot];
      }
  return dense;
}

//! What a plan owns on the device. cudaFree waits for the device's work in flight.
struct state {
  cusparseLtHandle_t handle{};
  cusparseLtMatDescriptor_t a{}, b{}, c{};
  cusparseLtMatmulDescriptor_t matmul{};
  cusparseLtMatmulAlgSelection_t alg{};
  cusparseLtMatmulPlan_t plan{};
  bool have_handle = false, have_a = false, have_b = false, have_c = false, have_alg = false, have_plan = false;
  void* compressed = nullptr;
  int device = -1;
  state() = default;
  state(const state&) = delete;
  state& operator=(const state&) = delete;
  ~state() {
    if (compressed) cudaFree(compressed);
    if (have_plan) cusparseLtMatmulPlanDestroy(&plan);
    if (have_alg) cusparseLtMatmulAlgSelectionDestroy(&alg);
    if (have_c) cusparseLtMatDescriptorDestroy(&c);
    if (have_b) cusparseLtMatDescriptorDestroy(&b);
    if (have_a) cusparseLtMatDescriptorDestroy(&a);
    if (have_handle) cusparseLtDestroy(&handle);
  }
};

//! Device memory freed on scope exit (make_plan's temporaries).
struct device_scratch {
  void* p = nullptr;
  explicit device_scratch(std::size_t bytes) { LOOM_CUDA_TRY(cudaMalloc(&p, bytes > 0 ? bytes : 1)); }
  device_scratch(const device_scratch&) = delete;
  device_scratch& operator=(const device_scratch&) = delete;
  ~device_scratch() { cudaFree(p); }
};

struct plan_access;

}  // namespace detail

//! A plan: the compressed 2:4 weight and cuSPARSELt's matmul plan for B of N columns (see the file
//! comment). T: bfloat16 or half.
template <class T>
class plan {
  static_assert(detail::storable<T>, "sparse::cusparselt: the 2:4 weights, B and C hold bfloat16 or half");

 public:
  using value_type = T;
  using backend_type = loom::cuda;
  [[nodiscard]] index_t rows() const noexcept { return m_; }
  [[nodiscard]] index_t cols() const noexcept { return k_; }
  [[nodiscard]] index_t n() const noexcept { return n_; }
  [[nodiscard]] const sparse::cusparselt::options& options() const noexcept { return opt_; }
  //! Bytes of device workspace spmm needs with this plan.
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return bytes_; }

 private:
  friend struct detail::plan_access;
  index_t m_ = 0, k_ = 0, n_ = 0;
  sparse::cusparselt::options opt_{};
  std::size_t bytes_ = 0;
  std::shared_ptr<detail::state> st_;
};

namespace detail {
struct plan_access {
  template <class T>
  static plan<T> make(const n_m_view<2, 4, T>& a, index_t n, const options& opt) {
    constexpr std::string_view call = "sparse::cusparselt::make_plan";
    check_arguments(a.rows, a.cols, n, opt, call);
    plan<T> p;
    p.m_ = a.rows, p.k_ = a.cols, p.n_ = n, p.opt_ = opt;
    p.st_ = std::make_shared<state>();
    state& st = *p.st_;
    st.device = loom::detail::current_cuda_device();
    const std::vector<T> dense = expand(a);
    const std::size_t dense_bytes = dense.size() * sizeof(T);
    const device_scratch dev(dense_bytes);
    LOOM_CUDA_TRY(cudaMemcpy(dev.p, dense.data(), dense_bytes, cudaMemcpyHostToDevice));
    check_lt(cusparseLtInit(&st.handle), call, "cusparseLtInit");
    st.have_handle = true;
    const bool rm = opt.order == order::row_major;
    const cusparseOrder_t ord = rm ? CUSPARSE_ORDER_ROW : CUSPARSE_ORDER_COL;
    constexpr std::uint32_t alignment = 16;
    check_lt(
        cusparseLtStructuredDescriptorInit(&st.handle, &st.a, a.rows, a.cols, a.cols, alignment, cuda_data_type<T>(),
                                           CUSPARSE_ORDER_ROW, CUSPARSELT_SPARSITY_50_PERCENT),
        call, "cusparseLtStructuredDescriptorInit (A)");
    st.have_a = true;
    check_lt(cusparseLtDenseDescriptorInit(&st.handle, &st.b, a.cols, n, rm ? n : a.cols, alignment,
                                           cuda_data_type<T>(), ord),
             call, "cusparseLtDenseDescriptorInit (B)");
    st.have_b = true;
    check_lt(cusparseLtDenseDescriptorInit(&st.handle, &st.c, a.rows, n, rm ? n : a.rows, alignment,
                                           cuda_data_type<T>(), ord),
             call, "cusparseLtDenseDescriptorInit (C)");
    st.have_c = true;
    check_lt(cusparseLtMatmulDescriptorInit(&st.handle, &st.matmul, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                            CUSPARSE_OPERATION_NON_TRANSPOSE, &st.a, &st.b, &st.c, &st.c,
                                            CUSPARSE_COMPUTE_32F),
             call, "cusparseLtMatmulDescriptorInit");
    check_lt(cusparseLtMatmulAlgSelectionInit(&st.handle, &st.alg, &st.matmul, CUSPARSELT_MATMUL_ALG_DEFAULT), call,
             "cusparseLtMatmulAlgSelectionInit");
    st.have_alg = true;
    check_lt(cusparseLtMatmulPlanInit(&st.handle, &st.plan, &st.matmul, &st.alg), call, "cusparseLtMatmulPlanInit");
    st.have_plan = true;
    check_lt(cusparseLtMatmulGetWorkspace(&st.handle, &st.plan, &p.bytes_), call, "cusparseLtMatmulGetWorkspace");
    // The weight must be 2:4 in cuSPARSELt's sense (loom's n_m guarantees it; checked all the same).
    const device_scratch valid(sizeof(int));
    check_lt(cusparseLtSpMMAPruneCheck(&st.handle, &st.matmul, dev.p, static_cast<int*>(valid.p), nullptr), call,
             "cusparseLtSpMMAPruneCheck");
    int invalid = 1;
    LOOM_CUDA_TRY(cudaMemcpy(&invalid, valid.p, sizeof(int), cudaMemcpyDeviceToHost));
    LOOM_EXPECTS(invalid == 0, errc::invalid_argument, call,
                 ": cuSPARSELt finds A not 2:4 sparse (more than 2 nonzeros in a group of 4 columns)");
    std::size_t compressed = 0, buffer = 0;
    check_lt(cusparseLtSpMMACompressedSize(&st.handle, &st.plan, &compressed, &buffer), call,
             "cusparseLtSpMMACompressedSize");
    LOOM_CUDA_TRY(cudaMalloc(&st.compressed, compressed > 0 ? compressed : 1));
    const device_scratch work(buffer);
    check_lt(cusparseLtSpMMACompress(&st.handle, &st.plan, dev.p, st.compressed, work.p, nullptr), call,
             "cusparseLtSpMMACompress");
    LOOM_CUDA_TRY(cudaStreamSynchronize(nullptr));  // before the scratch goes
    return p;
  }

  template <class T>
  static state& state_of(const plan<T>& p, std::string_view call) {
    LOOM_EXPECTS(p.st_ != nullptr, errc::invalid_argument, call,
                 ": the plan was not made by sparse::cusparselt::make_plan (default-constructed)");
    return *p.st_;
  }
};
}  // namespace detail

//! Plans C = alpha A B + beta C for the 2:4 weight `a` (host memory, bfloat16 or half) and a B of
//! `n` columns on the current device; compresses A into the plan.
//! @throws loom::error(invalid_argument) empty A, n <= 0, an invalid order, alpha or beta not
//!   finite, a weight cuSPARSELt's prune check rejects; (unsupported) K not a multiple of 4, or a
//!   shape or type cuSPARSELt does not take on this device (its reason quoted); (internal) a
//!   failing CUDA or cuSPARSELt call.
template <class T>
plan<T> make_plan(const loom::cuda&, const n_m_view<2, 4, T>& a, index_t n, const options& opt = {}) {
  return detail::plan_access::make<T>(a, n, opt);
}
template <class T>
plan<T> make_plan(const loom::cuda& b, const n_m<2, 4, T>& a, index_t n, const options& opt = {}) {
  return make_plan(b, a.view(), n, opt);
}

//! C = alpha A B + beta C with the plan's weight A and a caller's workspace (plan.workspace_bytes()
//! of device memory, aligned to loom::workspace_alignment). B: K x N, C: M x N, both dense in the
//! plan's order, 16-byte aligned, not sharing memory. Stream-ordered on b.stream; allocates nothing.
//! @throws loom::error(shape_mismatch) extents not the plan's; (invalid_argument) a view not dense
//!   in the plan's order or not 16-byte aligned, B and C overlapping, a short or misaligned
//!   workspace, a plan not made by make_plan, a device other than the plan's; (internal,
//!   unsupported) cuSPARSELt failing.
template <class T, class BV, class CV>
void spmm(const loom::cuda& b, const plan<T>& p, const BV& bm, const CV& c, std::span<std::byte> workspace) {
  constexpr std::string_view call = "sparse::cusparselt::spmm";
  static_assert(BV::rank == 2 && CV::rank == 2, "sparse::cusparselt::spmm: B and C must be rank-2 views");
  static_assert(std::is_same_v<typename BV::space, cuda_memory> && std::is_same_v<typename CV::space, cuda_memory>,
                "sparse::cusparselt::spmm: B and C must be views of device memory (loom::cuda_memory)");
  static_assert(std::is_same_v<typename BV::value_type, T> && std::is_same_v<typename CV::value_type, T> &&
                    !std::is_const_v<typename CV::element_type>,
                "sparse::cusparselt::spmm: B and C hold the plan's element type; C must be writable");
  detail::state& st = detail::plan_access::state_of(p, call);
  sparse::detail::check_dense_operands(bm, c, p.rows(), p.cols(), p.n(), p.options().order, call);
  LOOM_EXPECTS(
      reinterpret_cast<std::uintptr_t>(bm.data()) % 16 == 0 && reinterpret_cast<std::uintptr_t>(c.data()) % 16 == 0,
      errc::invalid_argument, call, ": B and C must start on 16-byte boundaries (cuSPARSELt's alignment)");
  check_workspace(workspace, p.workspace_bytes(), call);
  loom::detail::check_plan_device(st.device, call);
  const float alpha = static_cast<float>(p.options().alpha), beta = static_cast<float>(p.options().beta);
  cudaStream_t stream = b.stream;
  detail::check_lt(cusparseLtMatmul(&st.handle, &st.plan, &alpha, st.compressed, bm.data(), &beta, c.data(), c.data(),
                                    workspace.empty() ? nullptr : workspace.data(), &stream, 1),
                   call, "cusparseLtMatmul");
}

//! Convenience form: make_plan, a temporary workspace, the plan form, fence.
template <class T, class BV, class CV>
void spmm(const loom::cuda& b, const n_m<2, 4, T>& a, const BV& bm, const CV& c, const options& opt = {}) {
  const auto p = make_plan(b, a, bm.extent(1), opt);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { spmm(b, p, bm, c, ws); });
}

}  // namespace loom::sparse::cusparselt
