#pragma once

//! @file
//! loom::temporary_buffer<B, T>: scratch memory in the memory space of backend B, for the
//! convenience forms of primitives (which plan, allocate a workspace and call the plan-taking
//! form). Host spaces use the aligned heap; the cuda backend specialises it (stream-ordered
//! cudaMallocAsync) in backend/cuda.hpp. Every construction, on every backend, is counted by
//! loom::temporary_allocations(), so tests can assert that plan-taking calls allocate nothing.

#include <loom/backend/traits.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/core/workspace.hpp>

#include <atomic>
#include <cstddef>
#include <new>
#include <span>

namespace loom {

namespace detail {
inline std::atomic<long long>& temporary_counter() noexcept {
  static std::atomic<long long> n{0};
  return n;
}
}  // namespace detail

//! How many temporary_buffer objects were constructed in this process so far (all threads).
inline long long temporary_allocations() noexcept {
  return detail::temporary_counter().load(std::memory_order_relaxed);
}

//! `count` elements of trivially copyable T, uninitialised, in the memory space of B, starting on
//! loom::workspace_alignment.
template <backend B, class T, class Space = typename backend_traits<B>::memory_space>
class temporary_buffer {
  static_assert(Space::host_accessible, "temporary_buffer: no allocator for this memory space; pass a workspace");

 public:
  temporary_buffer(const B&, index_t count)
      : count_(count > 0 ? count : 0),
        data_(static_cast<T*>(::operator new (sizeof(T) * static_cast<std::size_t>(count_ > 0 ? count_ : 1),
                                              std::align_val_t{workspace_alignment}))) {
    detail::temporary_counter().fetch_add(1, std::memory_order_relaxed);
  }
  temporary_buffer(const temporary_buffer&) = delete;
  temporary_buffer& operator=(const temporary_buffer&) = delete;
  ~temporary_buffer() { ::operator delete (data_, std::align_val_t{workspace_alignment}); }
  T* data() const noexcept { return data_; }
  //! The buffer as bytes (a workspace for a plan-taking call).
  std::span<std::byte> bytes() const noexcept {
    return {reinterpret_cast<std::byte*>(data_), sizeof(T) * static_cast<std::size_t>(count_)};
  }

 private:
  index_t count_;
  T* data_;
};

namespace detail {
//! The body of every convenience form: a temporary workspace of `bytes` bytes, the plan-taking
//! form run on it by call(ws), then fence (before the workspace is released).
template <backend B, class F>
void with_temporary_workspace(const B& b, std::size_t bytes, F&& call) {
  const temporary_buffer<B, std::byte> tmp(b, static_cast<index_t>(bytes));
  call(tmp.bytes());
  fence(b);
}
}  // namespace detail

}  // namespace loom
