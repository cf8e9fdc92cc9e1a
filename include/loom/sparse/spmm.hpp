#pragma once

//! @file
//! loom::sparse::spmm: C = alpha * A * B + beta * C (+ bias), A a sparse M x K weight (csr,
//! bitmap or n_m, owning or a view), B a dense K x N activation (N >= 1; N = 1 is decoding),
//! C dense M x N. B and C are row-major or column-major views of float, bfloat16 or half (or
//! double).
//!
//!   auto plan = loom::sparse::make_plan(b, a, n, {.alpha = 1, .beta = 0});  // once per shape
//!   loom::workspace_buffer ws(plan.workspace_bytes());                       // or the caller's memory
//!   loom::sparse::spmm(b, plan, a, b_view, c_view, ws.span());               // C = A B, no allocation
//!   loom::sparse::spmm(b, plan, a, b_view, c_view, bias, ws.span());         // C = A B + bias
//!   loom::sparse::spmm(b, a, b_view, c_view);                                // convenience: plans, allocates
//!
//! Precision: the convenience form accumulates in float, or double if any operand is double. A
//! plan is templated on a precision policy whose accum_type is the accumulation type:
//! make_plan(b, a, n) deduces loom::default_precision of A's element type;
//! make_plan<loom::fp64>(b, a, n) (any loom::precision<S, A>) overrides it. The plan's accumulation
//! type must be at least as wide as the one the operands deduce (a compile-time check).
//!
//! Kernel ("load as sparse, compute as dense"): work items are bands of 8 output rows x up to 64
//! output columns (a host CSR product whose 64-column panel of B outgrows L2 takes 8 bands per
//! item, so that a block of B rows serves 64 rows; detail/kernels_avx2.hpp); each decodes A one
//! tile at a time into L1 and runs a unit-stride micro-kernel over a row-major B panel (see
//! detail/kernels.hpp). B is packed into such a panel of the accumulation type (the workspace:
//! K * N values) unless it already is one and C does not overlap it. Work
//! O(nnz * N + M * N + tiles * N / 64); A is read once per 64 columns of N.
//! Deterministic: each output element is summed in a fixed order that does not depend on the
//! backend or thread count. On loom::cuda the bitmap format runs a dedicated kernel
//! (detail/spmm_cuda.cuh; compiled, not run, in loom's CI); csr and n_m run the generic kernels,
//! one thread per work item. For CSR weights on loom::cuda, loom::sparse::cusparse (cusparse.hpp)
//! runs cuSPARSE's SpMM under the same call shape.
//! Completion: host backends complete on return; on device backends the plan form is
//! stream-ordered on the backend's stream (no host sync); the convenience form fences.

#include <loom/backend/temporary.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/workspace.hpp>
#include <loom/sparse/detail/dispatch.hpp>
#include <loom/sparse/formats.hpp>

#include <cstddef>
#include <span>
#include <type_traits>

namespace loom::sparse {

namespace detail {
struct plan_access;
}  // namespace detail

//! The numbers of a product: C = alpha * A B + beta * C. When beta == 0, C is not read (NaN in C
//! does not propagate).
struct options {
  double alpha = 1.0;
  double beta = 0.0;
};

//! A plan: A's extents, N, the options, the work decomposition and the workspace size (the packed
//! B panel, K * N values of P::accum_type, aligned to loom::workspace_alignment). Immutable; reuse
//! it for every product of the same shape (any A of those extents and format); shareable between
//! threads for reading (each call with its own workspace and C). Make it with make_plan.
template <precision_policy P>
class plan {
 public:
  using precision = P;
  using accum_type = typename P::accum_type;

  index_t rows() const noexcept { return g_.m; }  //!< M
  index_t cols() const noexcept { return g_.k; }  //!< K
  index_t n() const noexcept { return g_.n; }     //!< N, the columns of B and C
  const sparse::options& options() const noexcept { return opt_; }
  //! Bytes of workspace spmm needs with this plan.
  std::size_t workspace_bytes() const noexcept { return bytes_; }

 private:
  friend struct detail::plan_access;
  detail::geometry g_;
  sparse::options opt_;
  std::size_t bytes_ = 0;
};

namespace detail {
struct plan_access {
  template <class P>
  static const geometry& geometry_of(const plan<P>& p) noexcept {
    return p.g_;
  }
  template <class P, class A>
  static plan<P> make(const A& a, index_t n, const options& opt) {
    plan<P> p;
    p.g_ = plan_geometry(as_view(a), n);
    p.opt_ = opt;
    workspace_layout l;
    (void)l.add<typename P::accum_type>(p.g_.panel);
    p.bytes_ = l.bytes();
    return p;
  }
};
template <class A>
using element_of = typename decltype(as_view(std::declval<const A&>()))::value_type;
}  // namespace detail

//! Plans C = alpha A B + beta C for a sparse A (csr / bitmap / n_m, owning or a view; only its
//! extents are read) and a B of `n` columns, in precision P (default: loom::default_precision of
//! A's element type, i.e. float accumulation for float, bfloat16 and half, double for double).
//! Host work O(1); no communication.
//! @throws loom::error(invalid_argument) for negative extents or sizes whose products overflow
//!         index_t (K * N, the work items, A's slot or tile counts).
template <precision_policy P, backend B, class A>
plan<P> make_plan(const B&, const A& a, index_t n, const options& opt = {}) {
  return detail::plan_access::make<P>(a, n, opt);
}
template <backend B, class A>
plan<default_precision<detail::element_of<A>>> make_plan(const B&, const A& a, index_t n, const options& opt = {}) {
  return detail::plan_access::make<default_precision<detail::element_of<A>>>(a, n, opt);
}

namespace detail {
template <class P, class Backend, class AV, class BV, class CV, class Bias>
void spmm_plan_form(const Backend& b, const plan<P>& pl, const AV& a, const BV& bm, const CV& c, const Bias* bias,
                    std::span<std::byte> ws) {
  using Acc = typename P::accum_type;
  static_assert(
      sizeof(Acc) >= sizeof(deduced_accum<typename AV::value_type, typename BV::value_type, typename CV::value_type>),
      "spmm: the plan accumulates in float but an operand is double; make the plan with "
      "make_plan<loom::fp64>(...)");
  check_workspace(ws, pl.workspace_bytes(), "spmm");
  spmm_run<Acc>(b, plan_access::geometry_of(pl), a, bm, c, pl.options().alpha, pl.options().beta, bias, no_hook{},
                workspace_carver(ws).at<Acc>(0));
}
}  // namespace detail

//! C = alpha * A * B + beta * C with a plan and a caller's workspace (at least
//! plan.workspace_bytes(), in the backend's memory space, aligned to loom::workspace_alignment).
//! A: a view in the backend's memory space (or an owning format, host backends only) of the plan's
//! extents; B: K x N; C: M x N; both row- or column-major (a unit stride on one side). C may share
//! memory with B (C = A C in place for a square A): B is then first copied into the workspace.
//! Allocates nothing; stream-ordered on device backends (returns before the kernels finish).
//! @throws loom::error(shape_mismatch) if A is not the plan's M x K, B not K x N or C not M x N;
//!         (invalid_argument) for a layout with no unit stride, or a workspace that is too small
//!         or misaligned.
template <backend Backend, precision_policy P, class A, class BV, class CV>
void spmm(const Backend& b, const plan<P>& pl, const A& a, const BV& bm, const CV& c, std::span<std::byte> ws) {
  const tensor_view<const typename CV::value_type, 1, typename CV::space>* none = nullptr;
  detail::spmm_plan_form(b, pl, detail::as_view(a), bm, c, none, ws);
}

//! As above with a fused bias epilogue: C(i, j) = alpha * (A B)(i, j) + beta * C(i, j) + bias(i).
//! bias: a contiguous rank-1 view of M values of C's element type, not overlapping C.
//! @throws loom::error(shape_mismatch) also if bias does not hold M values; (invalid_argument) if
//! bias shares memory with C.
template <backend Backend, precision_policy P, class A, class BV, class CV, class BiasV>
void spmm(const Backend& b, const plan<P>& pl, const A& a, const BV& bm, const CV& c, const BiasV& bias,
          std::span<std::byte> ws) {
  static_assert(BiasV::rank == 1, "spmm: bias must be a rank-1 view");
  const tensor_view<const typename CV::value_type, 1, typename CV::space> bv = bias;
  detail::spmm_plan_form(b, pl, detail::as_view(a), bm, c, &bv, ws);
}

//! Convenience form: make_plan (accumulating as the operands deduce), a loom::temporary_buffer
//! workspace, the plan form, fence.
//! @throws as make_plan and the plan form.
template <backend Backend, class A, class BV, class CV>
void spmm(const Backend& b, const A& a, const BV& bm, const CV& c, const options& opt = {}) {
  using AV = decltype(detail::as_view(a));
  using P = default_precision<
      detail::deduced_accum<typename AV::value_type, typename BV::value_type, typename CV::value_type>>;
  const auto pl = make_plan<P>(b, a, bm.extent(1), opt);
  temporary_buffer<Backend, std::byte> ws(b, static_cast<index_t>(pl.workspace_bytes()));
  spmm(b, pl, a, bm, c, ws.bytes());
  fence(b);
}

//! Convenience form with a bias epilogue.
template <backend Backend, class A, class BV, class CV, class BiasV>
void spmm(const Backend& b, const A& a, const BV& bm, const CV& c, const BiasV& bias, const options& opt = {}) {
  using AV = decltype(detail::as_view(a));
  using P = default_precision<
      detail::deduced_accum<typename AV::value_type, typename BV::value_type, typename CV::value_type>>;
  const auto pl = make_plan<P>(b, a, bm.extent(1), opt);
  temporary_buffer<Backend, std::byte> ws(b, static_cast<index_t>(pl.workspace_bytes()));
  spmm(b, pl, a, bm, c, bias, ws.bytes());
  fence(b);
}

}  // namespace loom::sparse

#if defined(__CUDACC__)
#include <loom/sparse/detail/spmm_cuda.cuh>
#endif
