#pragma once

//! @file
//! Workspaces: the scratch memory a plan-taking call works in. Every plan reports
//! plan.workspace_bytes(); the caller passes a std::span<std::byte> of at least that many bytes,
//! in the backend's memory space, whose start is aligned to loom::workspace_alignment. Nothing
//! allocates on a plan-taking call. loom::workspace_buffer is an aligned host allocation for
//! callers who have none of their own:
//!
//!   loom::workspace_buffer ws(plan.workspace_bytes());
//!   loom::attention::forward(b, plan, q, k, v, out, lse, ws.span());
//!
//! Inside loom, a plan lays its buffers out once with workspace_layout and carves them from the
//! caller's span on every call with workspace_carver; every buffer starts on the alignment.

#include <loom/core/checked.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string_view>

namespace loom {

//! Alignment, in bytes, of every workspace and of every buffer loom carves from one.
inline constexpr std::size_t workspace_alignment = 64;

//! Rounds `bytes` up to a multiple of workspace_alignment.
constexpr std::size_t workspace_round(std::size_t bytes) noexcept {
  return (bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
}

//! Throws loom::error(invalid_argument) naming `call` unless `ws` holds at least `need` bytes and
//! starts on workspace_alignment; the message names `size_call`, the plan's call that gives `need`.
inline void check_workspace(std::span<std::byte> ws, std::size_t need, std::string_view call,
                            std::string_view size_call = "plan.workspace_bytes()") {
  LOOM_EXPECTS(ws.size() >= need, errc::invalid_argument, call, ": workspace must hold at least ", need, " bytes (",
               size_call, "), got ", ws.size());
  LOOM_EXPECTS(need == 0 || reinterpret_cast<std::uintptr_t>(ws.data()) % workspace_alignment == 0,
               errc::invalid_argument, call, ": workspace must start on a ", workspace_alignment,
               "-byte boundary (loom::workspace_alignment)");
}

//! Byte layout of a workspace: buffers appended in order, each starting on the alignment.
class workspace_layout {
 public:
  //! Reserves `count` elements of T; returns the buffer's byte offset.
  template <class T>
  std::size_t add(index_t count) {
    const std::size_t at = bytes_;
    const std::size_t n = static_cast<std::size_t>(count > 0 ? count : 0);
    bytes_ =
        detail::checked_add(at, workspace_round(detail::checked_mul(n, sizeof(T), "workspace size")), "workspace size");
    return at;
  }
  //! Total bytes reserved so far (a multiple of the alignment).
  constexpr std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::size_t bytes_ = 0;
};

//! Hands out typed buffers from a caller's workspace at the offsets of a workspace_layout.
class workspace_carver {
 public:
  constexpr explicit workspace_carver(std::span<std::byte> ws) noexcept : ws_(ws) {}
  //! The buffer reserved at byte `offset`, as T*.
  template <class T>
  T* at(std::size_t offset) const noexcept {
    return reinterpret_cast<T*>(ws_.data() + offset);
  }
  //! The next `count` elements of T after what was taken so far (layout order).
  template <class T>
  T* take(index_t count) noexcept {
    T* p = at<T>(used_.add<T>(count));
    return p;
  }
  constexpr std::span<std::byte> rest() const noexcept { return ws_.subspan(used_.bytes()); }

 private:
  std::span<std::byte> ws_;
  workspace_layout used_;
};

//! An owning, aligned host workspace for callers who have no allocator of their own.
class workspace_buffer {
 public:
  explicit workspace_buffer(std::size_t bytes)
      : bytes_(bytes),
        data_(static_cast<std::byte*>(::operator new (bytes > 0 ? bytes : 1, std::align_val_t{workspace_alignment}))) {}
  workspace_buffer(const workspace_buffer&) = delete;
  workspace_buffer& operator=(const workspace_buffer&) = delete;
  ~workspace_buffer() { ::operator delete (data_, std::align_val_t{workspace_alignment}); }
  std::span<std::byte> span() const noexcept { return {data_, bytes_}; }
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }

 private:
  std::size_t bytes_;
  std::byte* data_;
};

}  // namespace loom
