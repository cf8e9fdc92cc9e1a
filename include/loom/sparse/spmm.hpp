#pragma once

//! @file
//! loom::sparse::spmm: C = alpha * A * B + beta * C (+ bias), A a sparse M x K weight (csr,
//! bitmap or n_m, owning or a view), B a dense K x N activation (N >= 1; N = 1 is decoding),
//! C dense M x N. B and C are row-major or column-major views of float, bfloat16 or half (or
//! double); products accumulate in float (double if any operand is double).
//!
//!   loom::sparse::spmm(loom::openmp{}, a, b_view, c_view);                // C = A B
//!   loom::sparse::spmm(loom::openmp{}, a, b_view, c_view, 1.f, 0.f, bias);  // C = A B + bias
//!
//! Kernel ("load as sparse, compute as dense"): work items are bands of 8 output rows x up to 64
//! output columns; each decodes A one tile at a time into L1 and runs a unit-stride micro-kernel
//! over a row-major B panel (see detail/kernels.hpp). B is packed once into such a panel of the
//! accumulation type (K * N values of scratch) unless it already is one and C does not overlap it. Work O(nnz * N + M *
//! N + tiles * N / 64); A is read once per 64 columns of N. Deterministic: each output element is summed in a fixed
//! order that does not depend on the backend or thread count. On loom::cuda the bitmap format runs a dedicated kernel
//! (detail/spmm_cuda.cuh; compiled, not run, in loom's CI); csr and n_m run the generic kernels, one thread per work
//! item.

#include <loom/sparse/detail/dispatch.hpp>
#include <loom/sparse/formats.hpp>

namespace loom::sparse {

//! C = alpha * A * B + beta * C. A: csr/bitmap/n_m (owning: host backends only) or a view in the
//! backend's memory space; B: K x N; C: M x N; both row- or column-major (a unit stride on one
//! side). When beta == 0, C is not read (NaN in C does not propagate). C may share memory with B
//! (C = A C in place for a square A): B is then first copied into the panel.
//! @throws loom::error(shape_mismatch) if B is not K x N or C not M x N; (invalid_argument) for a
//! layout with no unit stride, or sizes whose products overflow index_t (K * N, the work items,
//! A's slot or tile counts). Stream-ordered on cuda (returns before the kernel finishes).
template <backend Backend, class A, class BV, class CV>
void spmm(const Backend& b, const A& a, const BV& bm, const CV& c, double alpha = 1.0, double beta = 0.0) {
  const tensor_view<const typename CV::value_type, 1, typename CV::space>* none = nullptr;
  detail::spmm_impl(b, detail::as_view(a), bm, c, alpha, beta, none, detail::no_hook{});
}

//! As above with a fused bias epilogue: C(i, j) = alpha * (A B)(i, j) + beta * C(i, j) + bias(i).
//! bias: a contiguous rank-1 view of M values of C's element type, not overlapping C.
//! @throws loom::error(shape_mismatch) also if bias does not hold M values; (invalid_argument) if
//! bias shares memory with C.
template <backend Backend, class A, class BV, class CV, class BiasV>
void spmm(const Backend& b, const A& a, const BV& bm, const CV& c, double alpha, double beta, const BiasV& bias) {
  static_assert(BiasV::rank == 1, "spmm: bias must be a rank-1 view");
  const tensor_view<const typename CV::value_type, 1, typename CV::space> bv = bias;
  detail::spmm_impl(b, detail::as_view(a), bm, c, alpha, beta, &bv, detail::no_hook{});
}

}  // namespace loom::sparse

#if defined(__CUDACC__)
#include <loom/sparse/detail/spmm_cuda.cuh>
#endif
