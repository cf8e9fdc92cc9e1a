#pragma once

//! @file
//! Non-temporal stores for scan outputs on x86 hosts: an output line written with them is not read
//! from memory first (as an ordinary store's line is), so a scan that streams its outputs moves the
//! bytes of a copy (input once, output once). LOOM_SCAN_STREAM_STORES is 1 where they exist (host
//! compilers targeting x86-64; not nvcc, whose device code never takes this path).

#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstdint>
#include <type_traits>

#if defined(__SSE2__) && !defined(__CUDACC__)
#include <emmintrin.h>
#define LOOM_SCAN_STREAM_STORES 1
#else
#define LOOM_SCAN_STREAM_STORES 0
#endif

namespace loom::scan::detail {

//! Whether values of T can be streamed 16 bytes at a time.
template <class T>
inline constexpr bool streamable = std::is_trivially_copyable_v<T> && sizeof(T) <= 16 && 16 % sizeof(T) == 0;

#if LOOM_SCAN_STREAM_STORES
//! The 16 * chunks bytes at s to d (16-byte aligned) with non-temporal 16-byte stores.
template <int chunks>
inline void stream_bytes(void* d, const void* s) {
  for (int q = 0; q < chunks; ++q)
    _mm_stream_si128(static_cast<__m128i*>(d) + q, _mm_loadu_si128(static_cast<const __m128i*>(s) + q));
}

//! d[0, n) = s[0, n): ordinary stores up to d's first 16-byte boundary and after its last one,
//! non-temporal 16-byte stores between. Call stream_fence() before other threads read d.
template <class T>
void stream_copy(const T* s, T* d, index_t n) {
  static_assert(streamable<T>);
  index_t i = 0;
  while (i < n && reinterpret_cast<std::uintptr_t>(d + i) % 16 != 0) d[i] = s[i], ++i;
  constexpr index_t per = 16 / static_cast<index_t>(sizeof(T));
  for (; i + per <= n; i += per) stream_bytes<1>(d + i, s + i);
  for (; i < n; ++i) d[i] = s[i];
}

inline void stream_fence() { _mm_sfence(); }
#endif

}  // namespace loom::scan::detail
