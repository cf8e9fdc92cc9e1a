#pragma once

//! @file
//! loom::copy_bytes: bytes between memory spaces in a backend's order, and the host copy of
//! document offsets that plans need where the offsets live in device memory.

#include <loom/backend/traits.hpp>
#include <loom/core/segments.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

namespace loom {

//! Copies `bytes` bytes from src to dst, either side host or the backend's memory: stream-ordered
//! on device backends (host memory must stay valid until the copy has run; fence to observe it),
//! complete on return on host backends.
//! The backend names a copy between host memory and its own (backend_traits<B>::copy).
template <class B>
inline constexpr bool has_copy = requires(const B& b, void* d, const void* s, std::size_t n) {
  backend_traits<B>::copy(b, d, s, n);
};

template <backend B>
void copy_bytes(const B& b, void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if constexpr (has_copy<B>) {
    backend_traits<B>::copy(b, dst, src, bytes);
  } else {
    static_assert(backend_traits<B>::memory_space::host_accessible,
                  "copy_bytes: this backend names no copy for its memory space");
    std::memcpy(dst, src, bytes);
  }
}

namespace detail {
//! The offsets of `seg` as host int64 values (empty when implicit). On a device space: a copy and
//! a fence of b (plan time only).
template <backend B, memory_space Space>
std::vector<index_t> host_offsets(const B& b, const segments<Space>& seg) {
  std::vector<index_t> out(static_cast<std::size_t>(seg.size()));
  if (seg.implicit()) return out;
  if constexpr (Space::host_accessible) {
    for (index_t i = 0; i < seg.size(); ++i) out[static_cast<std::size_t>(i)] = seg[i];
  } else if (seg.wide()) {
    copy_bytes(b, out.data(), seg.data(), out.size() * sizeof(std::int64_t));
    fence(b);
  } else {
    std::vector<std::int32_t> narrow(out.size());
    copy_bytes(b, narrow.data(), seg.data(), narrow.size() * sizeof(std::int32_t));
    fence(b);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = narrow[i];
  }
  return out;
}

//! Calls f with `seg` as host segments (loom::segments<host_memory>) and returns what f returns:
//! seg itself on host memory; otherwise a host copy of its offsets (host_offsets: a copy and a
//! fence of b, plan time only), so a plan made from device offsets checks every value like one
//! made from host offsets. Implicit segments stay implicit (bound to the same token count).
template <backend B, memory_space Space, class F>
decltype(auto) with_host_segments(const B& b, const segments<Space>& seg, F&& f) {
  static_assert(Space::host_accessible || std::is_same_v<Space, typename backend_traits<B>::memory_space>,
                "the document offsets must be in host memory or in the backend's memory");
  if constexpr (std::is_same_v<Space, host_memory>) {
    return f(seg);
  } else {
    if (seg.implicit()) return f(seg[1] >= 0 ? segments<host_memory>::whole(seg[1]) : segments<host_memory>{});
    const std::vector<index_t> host = host_offsets(b, seg);
    return f(segments<host_memory>(std::span<const std::int64_t>(host)));
  }
}
}  // namespace detail

}  // namespace loom
