#pragma once

//! @file
//! loom::cuda's scalar, diagonal and block-diagonal recurrences through CUB's single-pass scan by key
//! (DeviceScan::InclusiveScanByKey, decoupled look-back) over the affine steps of
//! detail/affine_recurrence.hpp: keys and elements come from index-mapped iterators over the
//! recurrence's views, outputs go through a tabulating iterator into h (or λ). Used when
//! options.reproducible is false. CUB reads each element before it writes that element's output
//! and no other's, so h may be b (in place), as on the engine's path. The workspace is CUB's
//! temporary storage, sized at plan time (bytes) and carved from the plan's workspace.

#include <loom/backend/cuda.hpp>
#include <loom/scan/detail/affine_recurrence.hpp>

#include <algorithm>
#include <cub/device/device_scan.cuh>
#include <span>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>

namespace loom::scan::detail {

template <class Map>
struct affine_key_of {
  Map m;
  LOOM_HD index_t operator()(index_t j) const { return m.key(j); }
};
template <class Map>
struct affine_element_of {
  Map m;
  LOOM_HD typename Map::value_type operator()(index_t j) const { return m.element(j); }
};
template <class Map>
struct affine_store {
  Map m;
  LOOM_HD void operator()(index_t j, const typename Map::value_type& x) const { m.store(j, x); }
};
//! The scan's binary operator: the structure's combine (op_type of affine_traits).
template <class Op>
struct affine_combine {
  using value_type = typename Op::value_type;
  LOOM_HD value_type operator()(const value_type& first, const value_type& second) const {
    return Op{}.combine(first, second);
  }
};

template <>
struct vendor_affine<cuda> {
  static constexpr bool available = true;

  //! Bytes of CUB temporary storage for a scan by key of n steps of structure St in Acc.
  template <class St, class Acc>
  static std::size_t bytes(index_t n) {
    using T = affine_traits<St, Acc>;
    using V = typename T::value_type;
    std::size_t b = 0;
    LOOM_CUDA_TRY(cub::DeviceScan::InclusiveScanByKey(
        nullptr, b, static_cast<const index_t*>(nullptr), static_cast<const V*>(nullptr), static_cast<V*>(nullptr),
        affine_combine<typename T::op_type>{}, n, ::cuda::std::equal_to<>{}, nullptr));
    return b;
  }

  //! The scan by key of m into CUB's temporary storage `ws` (sized by bytes() at plan time). No
  //! size query per call: CUB checks the bytes it is given and fails the call
  //! (cudaErrorInvalidValue, thrown as loom::error) should they be too few.
  template <class Map>
  static void run(const cuda& b, const Map& m, std::span<std::byte> ws) {
    using Op = affine_combine<typename Map::op_type>;
    const auto keys = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), affine_key_of<Map>{m});
    const auto in = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), affine_element_of<Map>{m});
    const auto out = thrust::make_tabulate_output_iterator(affine_store<Map>{m});
    const index_t n = m.count();
    std::size_t bytes = ws.size();
    LOOM_CUDA_TRY(cub::DeviceScan::InclusiveScanByKey(ws.data(), bytes, keys, in, out, Op{}, n,
                                                      ::cuda::std::equal_to<>{}, b.stream));
  }
};

}  // namespace loom::scan::detail
