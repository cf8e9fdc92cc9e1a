#pragma once

//! @file
//! loom::cuda's monoid scans through CUB's single-pass device scan (decoupled look-back): used when
//! options.reproducible is false, or when the monoid's combine is exact (integer plus, minimum,
//! maximum), where every combine order gives the same bits. Every variant maps onto one CUB call:
//!   - forward / reverse: elements are visited through an index map (i or n - 1 - i, times the
//!     view's stride); a reverse scan combines with the operands swapped, so that the result is
//!     still x[i] op x[i+1] op ... in sequence order (monoids need not commute);
//!   - inclusive / exclusive: DeviceScan::InclusiveScan / ExclusiveScan (init first);
//!   - segmented: Inclusive/ExclusiveScanByKey with the key of an element its segment, found by a
//!     binary search of the offsets (empty segments hold no element, so they need no key).
//! CUB reads each element before it writes the element's output and no other element's, so the
//! scan may run in place. The workspace is CUB's temporary storage, carved from the plan's workspace
//! (vendor_scan::bytes, CUB's size query over every variant, at plan time).

#include <loom/backend/cuda.hpp>
#include <loom/scan/scan.hpp>

#include <cuda/functional>
#include <cuda/std/functional>

#include <algorithm>
#include <cub/device/device_scan.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/permutation_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <type_traits>

namespace loom::scan::detail {

//! Position j of the scan order -> element offset in memory.
struct scan_order {
  index_t n, stride;
  bool reverse;
  LOOM_HD index_t operator()(index_t j) const { return (reverse ? n - 1 - j : j) * stride; }
};

//! Position j of the scan order -> the segment of its element (the last offset <= the element).
struct segment_key {
  offsets_ref offsets;
  index_t segments;
  scan_order order;  //!< with stride 1: the element at position j
  LOOM_HD index_t operator()(index_t j) const {
    const index_t i = order(j);
    index_t lo = 0, hi = segments;  // offsets[lo] <= i < offsets[hi] for a valid segmentation
    while (hi - lo > 1) {
      const index_t mid = lo + (hi - lo) / 2;
      if (offsets[mid] <= i)
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  }
};

template <class M, bool Swap>
struct combine_op {
  M m;
  LOOM_HD typename M::value_type operator()(const typename M::value_type& a, const typename M::value_type& b) const {
    if constexpr (Swap)
      return m.combine(b, a);
    else
      return m.combine(a, b);
  }
};

//! The binary operator CUB is given for monoid m (operands swapped when Swap): CUB's own operator
//! where it computes loom's bits in either operand order, so that CUB takes the policies it tunes
//! for its operators (CCCL's tuning tables key on the operator type; any other functor gets the
//! generic policy), else combine_op:
//!   - plus<T> over an arithmetic T: cuda::std::plus<T> (a + b and b + a are the same bits);
//!   - minimum<T>, maximum<T> over an integral T: cuda::minimum<T>, cuda::maximum<T> (for floats
//!     they differ from loom's on ties of signed zeros and on NaN in one operand order, so floats
//!     keep combine_op).
template <bool Swap, class M>
auto cub_operator(const M& m) {
  using T = typename M::value_type;
  if constexpr (std::is_same_v<M, plus<T>> && std::is_arithmetic_v<T>)
    return ::cuda::std::plus<T>{};
  else if constexpr (std::is_same_v<M, minimum<T>> && std::is_integral_v<T>)
    return ::cuda::minimum<T>{};
  else if constexpr (std::is_same_v<M, maximum<T>> && std::is_integral_v<T>)
    return ::cuda::maximum<T>{};
  else
    return combine_op<M, Swap>{m};
}

//! One CUB call for the variant (temp == null: only sizes `bytes`).
template <bool Swap, class M, class InIt, class OutIt>
cudaError_t cub_monoid_scan(void* temp, std::size_t& bytes, const M& m, InIt in, OutIt out, index_t n,
                            offsets_ref offsets, index_t segments, bool reverse, bool exclusive,
                            typename M::value_type init, cudaStream_t stream) {
  const auto op = cub_operator<Swap>(m);
  if (!offsets) {
    if (exclusive) return cub::DeviceScan::ExclusiveScan(temp, bytes, in, out, op, init, n, stream);
    return cub::DeviceScan::InclusiveScan(temp, bytes, in, out, op, n, stream);
  }
  const auto keys = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0),
                                                    segment_key{offsets, segments, scan_order{n, 1, reverse}});
  if (exclusive)
    return cub::DeviceScan::ExclusiveScanByKey(temp, bytes, keys, in, out, op, init, n, ::cuda::std::equal_to<>{},
                                               stream);
  return cub::DeviceScan::InclusiveScanByKey(temp, bytes, keys, in, out, op, n, ::cuda::std::equal_to<>{}, stream);
}

//! p's elements in scan order (const or not: the same iterator serves input and output).
template <class T>
auto in_scan_order(T* p, index_t n, index_t stride, bool reverse) {
  return thrust::make_permutation_iterator(
      p, thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), scan_order{n, stride, reverse}));
}

template <>
struct vendor_scan<cuda> {
  static constexpr bool available = true;

  //! One CUB call; forward scans of unit-stride views pass raw pointers (vectorised loads and
  //! stores), every other one the index-mapped iterators.
  template <monoid M, class In, class Out>
  static cudaError_t call(void* temp, std::size_t& bytes, const M& m, const In& in, const Out& out, index_t n,
                          offsets_ref off, index_t segments, bool reverse, bool exclusive, typename M::value_type init,
                          cudaStream_t stream) {
    if (!reverse && in.stride(0) == 1 && out.stride(0) == 1)
      return cub_monoid_scan<false>(temp, bytes, m, in.data(), out.data(), n, off, segments, false, exclusive, init,
                                    stream);
    const auto src = in_scan_order(in.data(), n, in.stride(0), reverse);
    const auto dst = in_scan_order(out.data(), n, out.stride(0), reverse);
    if (reverse)
      return cub_monoid_scan<true>(temp, bytes, m, src, dst, n, off, segments, true, exclusive, init, stream);
    return cub_monoid_scan<false>(temp, bytes, m, src, dst, n, off, segments, false, exclusive, init, stream);
  }

  //! Bytes of CUB temporary storage for a scan of n elements of M: the most any variant needs.
  template <monoid M>
  static std::size_t bytes(const M& m, index_t n) {
    using T = typename M::value_type;
    static const std::int64_t fake[2] = {0, 0};
    const offsets_ref fake_offsets{fake, true};
    std::size_t most = 0;
    // v: bit 0 exclusive, bit 1 segmented, v / 4: forward raw pointers, forward mapped, reverse.
    for (int v = 0; v < 12; ++v) {
      const index_t stride = v / 4 == 1 ? 2 : 1;
      const tensor_view<const T, 1, cuda_memory> in(nullptr, {n}, {stride});
      const tensor_view<T, 1, cuda_memory> out(nullptr, {n}, {stride});
      std::size_t b = 0;
      LOOM_CUDA_TRY(call(nullptr, b, m, in, out, n, v & 2 ? fake_offsets : offsets_ref{}, 1, v / 4 == 2, v & 1,
                         m.identity(), nullptr));
      most = std::max(most, b);
    }
    return most;
  }

  //! The scan into CUB's temporary storage `ws` (sized by bytes() at plan time, the most any
  //! variant of the plan's n asks for). No size query per call: CUB checks the bytes it is given
  //! and fails the call (cudaErrorInvalidValue, thrown as loom::error) should they be too few.
  template <monoid M, class In, class Out>
  static void run(const cuda& b, const M& m, In in, Out out, offsets_ref off, index_t segments, bool exclusive,
                  typename M::value_type init, bool reverse, std::span<std::byte> ws) {
    std::size_t bytes = ws.size();
    LOOM_CUDA_TRY(call(ws.data(), bytes, m, in, out, in.extent(0), off, segments, reverse, exclusive, init, b.stream));
  }
};

}  // namespace loom::scan::detail
