#pragma once

//! @file
//! loom::segments: the one sequence vocabulary of every family. A packed batch of documents is
//! described by cu_seqlens-style offsets: S + 1 values, offsets[0] = 0, non-decreasing, the last
//! equal to the token count; document s holds tokens [offsets[s], offsets[s + 1]). The offsets may
//! be int32 (FlashAttention's convention) or int64, in host or device memory; the view never
//! copies them. An empty `segments` (default-constructed) means one document of every token.
//!
//!   std::vector<std::int32_t> cu = {0, 5, 12};
//!   loom::segments docs{std::span<const std::int32_t>(cu)};   // two documents, 12 tokens
//!
//! check_segments() is the one validation every family runs (host memory: every offset is
//! checked; device memory: the count is, the values are the caller's contract).

#include <loom/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/memory_space.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

namespace loom {

//! The segment holding position t: the last s in [0, S) with offsets[s] <= t, so among empty
//! segments that start at t the non-empty one that follows them. O(log S). Requires S >= 1 and
//! offsets[0] <= t.
template <class Offsets>
LOOM_HD index_t segment_of(const Offsets& offsets, index_t segments, index_t t) {
  index_t lo = 0, hi = segments - 1;
  while (lo < hi) {
    const index_t mid = lo + (hi - lo + 1) / 2;
    if (static_cast<index_t>(offsets[mid]) <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

//! Document offsets (int32 or int64) in memory space Space; see the file comment.
template <memory_space Space = host_memory>
class segments {
 public:
  using space = Space;

  //! One document of every token (no offsets held).
  constexpr segments() noexcept = default;

  //! Offsets in a contiguous int64 view (S + 1 values).
  segments(tensor_view<const std::int64_t, 1, Space> offsets) : data_(offsets.data()), offsets_(offsets.extent(0)) {
    expect_contiguous(offsets.stride(0), offsets.extent(0));
  }
  //! Offsets in a contiguous int32 view (S + 1 values).
  segments(tensor_view<const std::int32_t, 1, Space> offsets)
      : data_(offsets.data()), offsets_(offsets.extent(0)), wide_(false) {
    expect_contiguous(offsets.stride(0), offsets.extent(0));
  }
  //! Host offsets held in a span.
  segments(std::span<const std::int64_t> offsets) requires(Space::host_accessible)
      : data_(offsets.data()), offsets_(static_cast<index_t>(offsets.size())) {}
  segments(std::span<const std::int32_t> offsets) requires(Space::host_accessible)
      : data_(offsets.data()), offsets_(static_cast<index_t>(offsets.size())), wide_(false) {}

  //! A single document of n tokens, with no offsets in memory.
  static constexpr segments whole(index_t n) noexcept {
    segments s;
    s.total_ = n;
    return s;
  }

  //! True when no offsets are held (one document of every token).
  LOOM_HD constexpr bool implicit() const noexcept { return offsets_ < 0; }
  //! Number of documents S (1 when implicit).
  LOOM_HD constexpr index_t count() const noexcept { return offsets_ < 0 ? 1 : offsets_ - 1; }
  //! Number of offset values held (S + 1; 0 when implicit).
  LOOM_HD constexpr index_t size() const noexcept { return offsets_ < 0 ? 0 : offsets_; }
  //! True for int64 offsets, false for int32.
  LOOM_HD constexpr bool wide() const noexcept { return wide_; }
  //! The offsets' memory (int64 or int32 per wide()), null when implicit.
  LOOM_HD constexpr const void* data() const noexcept { return data_; }
  //! offsets[i], 0 <= i <= count(). Implicit segments must have been bound to a token count
  //! (whole(n) or check_segments).
  LOOM_HD constexpr index_t operator[](index_t i) const noexcept {
    if (offsets_ < 0) return i == 0 ? 0 : total_;
    return wide_ ? static_cast<const std::int64_t*>(data_)[i]
                 : static_cast<index_t>(static_cast<const std::int32_t*>(data_)[i]);
  }
  //! The document holding token t (see loom::segment_of). O(log S).
  LOOM_HD constexpr index_t of(index_t t) const noexcept {
    return offsets_ < 0 ? 0 : loom::segment_of(*this, count(), t);
  }
  //! Tokens of document s.
  LOOM_HD constexpr index_t length(index_t s) const noexcept { return (*this)[s + 1] - (*this)[s]; }

 private:
  template <memory_space>
  friend class segments;
  static void expect_contiguous(index_t stride, index_t n) {
    LOOM_EXPECTS(stride == 1 || n <= 1, errc::invalid_argument,
                 "segments: the offsets must be contiguous (stride 1), got stride ", stride);
  }
  const void* data_ = nullptr;
  index_t offsets_ = -1;  // values held; -1: implicit
  index_t total_ = -1;
  bool wide_ = true;
};

segments(std::span<const std::int64_t>)->segments<host_memory>;
segments(std::span<const std::int32_t>)->segments<host_memory>;
template <class T, memory_space S>
segments(tensor_view<T, 1, S>) -> segments<S>;

//! Validates `seg` as the documents of n tokens and returns it bound to n (implicit segments
//! become whole(n)). Host memory: offsets[0] == 0, non-decreasing, last == n. Device memory:
//! at least one offset; the values are the caller's contract. Throws loom::error(invalid_argument)
//! naming `call` and `name`.
template <memory_space Space>
segments<Space> check_segments(const segments<Space>& seg, index_t n, std::string_view call,
                               std::string_view name = "cu_seqlens") {
  if (seg.implicit()) return segments<Space>::whole(n);
  LOOM_EXPECTS(seg.size() >= 1, errc::invalid_argument, call, ": ", name,
               " must hold at least one offset (documents + 1), got none");
  if constexpr (Space::host_accessible) {
    const index_t s = seg.count();
    LOOM_EXPECTS(seg[0] == 0, errc::invalid_argument, call, ": ", name, "[0] must be 0, got ", seg[0]);
    for (index_t i = 0; i < s; ++i)
      LOOM_EXPECTS(seg[i + 1] >= seg[i], errc::invalid_argument, call, ": ", name, " must be non-decreasing, but ",
                   name, "[", i + 1, "] = ", seg[i + 1], " < ", name, "[", i, "] = ", seg[i]);
    LOOM_EXPECTS(seg[s] == n, errc::invalid_argument, call, ": ", name, "[", s,
                 "] (the last offset) must equal the token count ", n, ", got ", seg[s]);
  }
  return seg;
}

}  // namespace loom
