#pragma once

//! @file
//! Argument checks and workspace handling shared by the scan entry points.

#include <loom/backend/temporary.hpp>
#include <loom/core/concepts.hpp>
#include <loom/core/error.hpp>
#include <loom/core/overlap.hpp>
#include <loom/core/segments.hpp>
#include <loom/scan/options.hpp>

#include <cstdint>
#include <optional>
#include <string_view>

namespace loom::scan::detail {

//! The bytes of a segments' offsets as a view (for overlap checks; empty when implicit).
template <memory_space Space>
tensor_view<const std::byte, 1, Space> offsets_bytes(const loom::segments<Space>& docs) {
  if (docs.implicit()) return {};
  const index_t e = docs.wide() ? index_t{8} : index_t{4};
  return tensor_view<const std::byte, 1, Space>(static_cast<const std::byte*>(docs.data()), {docs.size() * e});
}

//! Rejects an output view that shares memory with an input view: the result would depend on the
//! order of reads and writes. With `in_place`, the output may be exactly the input (same address,
//! extents, strides and element size), which the scans support.
template <class Out, class In>
void check_no_overlap(const Out& out, std::string_view out_name, const In& in, std::string_view in_name, bool in_place,
                      std::string_view call) {
  if (in_place && same_elements(out, in)) return;
  LOOM_EXPECTS(!overlaps(out, in), errc::invalid_argument, call, ": ", out_name, " and ", in_name, " share memory; ",
               out_name, " must ", in_place ? "be the same view as " : "not overlap ", in_name,
               in_place ? " (in place: same data, extents and strides) or not overlap it" : "");
}

//! The outputs of a linear recurrence (h and final_state; lambda and d_initial for the adjoint)
//! against its inputs: the forward h may be b itself (in place); no other pair of an output and an
//! input, or of the two outputs, may share memory. Empty optional views share nothing. (The
//! adjoint kernel writes λ_t before it reads g_t for the last time, so lambda may not be g.)
template <class AV, class BV, class HV, class OffV, class InitV, class FinV>
void check_recurrence_overlaps(const AV& a, const BV& bv, const HV& h, const OffV& offsets, const InitV& init,
                               const FinV& fin, bool adjoint, std::string_view call) {
  const std::string_view hn = adjoint ? "lambda" : "h", bn = adjoint ? "g" : "b";
  const std::string_view in = adjoint ? "d_final" : "initial", fn = adjoint ? "d_initial" : "final_state";
  check_no_overlap(h, hn, bv, bn, !adjoint, call);
  check_no_overlap(h, hn, a, "A", false, call);
  check_no_overlap(h, hn, offsets, "offsets", false, call);
  check_no_overlap(h, hn, init, in, false, call);
  check_no_overlap(fin, fn, a, "A", false, call);
  check_no_overlap(fin, fn, bv, bn, false, call);
  check_no_overlap(fin, fn, offsets, "offsets", false, call);
  check_no_overlap(fin, fn, init, in, false, call);
  check_no_overlap(fin, fn, h, hn, false, call);
}

template <backend B, class V>
constexpr void check_space() {
  static_assert(std::is_same_v<typename V::space, typename backend_traits<B>::memory_space> ||
                    (V::space::host_accessible && backend_traits<B>::memory_space::host_accessible),
                "scan: the views must live in the backend's memory space");
}

template <class V>
void check_contiguous_rows(const V& v, std::string_view call, std::string_view name) {
  for (std::size_t d = 1; d < V::rank; ++d) {
    index_t expect = 1;
    for (std::size_t e = d + 1; e < V::rank; ++e) expect *= v.extent(e);
    LOOM_EXPECTS(v.stride(d) == expect || v.extent(d) <= 1, errc::invalid_argument, call, ": ", name,
                 " must be contiguous within a time step (stride of dimension ", d, " must be ", expect, ", got ",
                 v.stride(d), ")");
  }
}

}  // namespace loom::scan::detail
