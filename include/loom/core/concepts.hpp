#pragma once

//! @file
//! The vocabulary concepts of loom, gathered in one place. Each lives beside its types; this header
//! lets a user write constrained code against all of them with one include.

#include <loom/core/memory_space.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/tensor_view.hpp>

#include <concepts>
#include <type_traits>

namespace loom {

//! A tensor_view-like type: element type, rank, memory space, extents and strides.
template <class V>
concept tensor_view_like = requires(const V& v, std::size_t d) {
  typename V::element_type;
  typename V::space;
  { V::rank } -> std::convertible_to<std::size_t>;
  { v.data() } -> std::same_as<typename V::element_type*>;
  { v.extent(d) } -> std::convertible_to<index_t>;
  { v.stride(d) } -> std::convertible_to<index_t>;
};

//! A view whose memory the host may dereference.
template <class V>
concept host_view = tensor_view_like<V> && V::space::host_accessible;

//! Element types that can be copied as bytes through communicators and workspaces.
template <class T>
concept trivially_copyable = std::is_trivially_copyable_v<T>;

}  // namespace loom
