#pragma once

//! @file
//! loom::temporary_buffer<B, T>: scratch memory in the memory space of backend B, for the
//! convenience forms of primitives that were not handed a workspace. Host spaces use the heap;
//! the cuda backend specialises it (stream-ordered cudaMallocAsync) in backend/cuda.hpp.

#include <loom/backend/traits.hpp>
#include <loom/core/tensor_view.hpp>

#include <memory>

namespace loom {

//! `count` elements of trivially copyable T, uninitialised, in the memory space of B.
template <backend B, class T, class Space = typename backend_traits<B>::memory_space>
class temporary_buffer {
  static_assert(Space::host_accessible, "temporary_buffer: no allocator for this memory space; pass a workspace");

 public:
  temporary_buffer(const B&, index_t count) : data_(new T[static_cast<std::size_t>(count > 0 ? count : 1)]) {}
  T* data() const noexcept { return data_.get(); }

 private:
  std::unique_ptr<T[]> data_;
};

}  // namespace loom
