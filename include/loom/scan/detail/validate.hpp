#pragma once

//! @file
//! Argument checks and workspace handling shared by the scan entry points.

#include <loom/backend/temporary.hpp>
#include <loom/core/concepts.hpp>
#include <loom/core/error.hpp>
#include <loom/scan/options.hpp>

#include <cstdint>
#include <optional>
#include <string_view>

namespace loom::scan::detail {

//! Runs fn(T* ws) with `count` elements of scratch: the caller's workspace from `opt` when given
//! (checked for size and alignment), else a temporary in B's memory space.
template <class T, backend B, class Fn>
void with_workspace(const B& b, const options& opt, index_t count, std::string_view call, Fn&& fn) {
  const auto need = sizeof(T) * static_cast<std::size_t>(count);
  if (opt.workspace != nullptr) {
    LOOM_EXPECTS(opt.workspace_bytes >= need, errc::invalid_argument, call,
                 ": options.workspace_bytes must be >= ", need, ", got ", opt.workspace_bytes);
    LOOM_EXPECTS(reinterpret_cast<std::uintptr_t>(opt.workspace) % alignof(T) == 0, errc::invalid_argument, call,
                 ": options.workspace must be aligned to ", alignof(T), " bytes");
    fn(static_cast<T*>(opt.workspace));
    return;
  }
  temporary_buffer<B, T> tmp(b, count);
  fn(tmp.data());
  fence(b);  // the temporary dies here: the work must be done with it
}

//! Checks that `offsets` is a valid segmentation of n elements: offsets[0] == 0, non-decreasing,
//! offsets[S] == n. Only host-accessible offsets can be checked; device offsets are trusted.
template <class V>
void check_offsets(const V& offsets, index_t n, std::string_view call, std::string_view name = "offsets") {
  LOOM_EXPECTS(offsets.extent(0) >= 1, errc::invalid_argument, call, ": ", name,
               " must hold at least one offset (segments + 1), got none");
  if constexpr (V::space::host_accessible) {
    const index_t s = offsets.extent(0) - 1;
    LOOM_EXPECTS(offsets(0) == 0, errc::invalid_argument, call, ": ", name, "[0] must be 0, got ", offsets(0));
    for (index_t i = 0; i < s; ++i)
      LOOM_EXPECTS(offsets(i + 1) >= offsets(i), errc::invalid_argument, call, ": ", name,
                   " must be non-decreasing, but ", name, "[", i + 1, "] = ", offsets(i + 1), " < ", name, "[", i,
                   "] = ", offsets(i));
    LOOM_EXPECTS(offsets(s) == n, errc::invalid_argument, call, ": ", name, "[", s,
                 "] (the last offset) must equal the sequence length ", n, ", got ", offsets(s));
  }
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
