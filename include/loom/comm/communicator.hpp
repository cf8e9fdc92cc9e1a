#pragma once

//! @file
//! The communicator concept, element type tags (dtype) and reduction operators. Every loom
//! primitive that spans ranks is written against this concept, so the same code runs over
//! comm::local (threads), comm::mpi, comm::nccl and comm::any.
//!
//! Semantics shared by every communicator (element counts, never bytes):
//! - isend(data, dest, tag) / irecv(data, src, tag) return a request; buffers stay untouched by
//!   the caller until wait(request). Messages between a pair with the same tag arrive in order.
//!   A receive must be posted with exactly the sent count: a mismatch is a loom::error, never a
//!   truncation. Tags are >= 0.
//! - sendrecv(send, dest, recv, src, tag): both directions at once (the ring step).
//! - all_gather(send[n], recv[P*n]): block q of recv is rank q's send.
//! - all_to_all(send[P*n], recv[P*n]): block q of send goes to rank q; block q of recv came from q.
//! - all_to_allv(send, send_counts[P], send_displs[P], recv, recv_counts[P], recv_displs[P]).
//! - all_reduce(send[n], recv[n], op): element-wise op over ranks; send and recv may alias.
//! - reduce_scatter(send[P*n], recv[n], op): recv = block `rank` of the element-wise reduction.
//! - broadcast(data[n], root); barrier(); split(color >= 0, key) -> the communicator of the ranks
//!   with the same color, ordered by (key, old rank).

#include <loom/config.hpp>
#include <loom/core/float16.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

namespace loom::comm {

//! Element type of a message, as communicators see it. `bytes` is any other trivially copyable
//! type: it can be moved but not reduced.
enum class dtype : std::uint8_t { bytes, i8, u8, i32, u32, i64, u64, f16, bf16, f32, f64 };

template <class T>
constexpr dtype dtype_of() noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, std::int8_t>)
    return dtype::i8;
  else if constexpr (std::is_same_v<U, std::uint8_t>)
    return dtype::u8;
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 4)
    return dtype::i32;
  else if constexpr (std::is_integral_v<U> && std::is_unsigned_v<U> && sizeof(U) == 4)
    return dtype::u32;
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 8)
    return dtype::i64;
  else if constexpr (std::is_integral_v<U> && std::is_unsigned_v<U> && sizeof(U) == 8)
    return dtype::u64;
  else if constexpr (std::is_same_v<U, half>)
    return dtype::f16;
  else if constexpr (std::is_same_v<U, bfloat16>)
    return dtype::bf16;
  else if constexpr (std::is_same_v<U, float>)
    return dtype::f32;
  else if constexpr (std::is_same_v<U, double>)
    return dtype::f64;
  else
    return dtype::bytes;
}

constexpr std::string_view to_string(dtype t) noexcept {
  constexpr std::string_view names[] = {"bytes", "i8", "u8", "i32", "u32", "i64", "u64", "f16", "bf16", "f32", "f64"};
  return names[static_cast<int>(t)];
}

//! Element types a communicator can move: anything trivially copyable.
template <class T>
concept transferable = std::is_trivially_copyable_v<T>;

//! Element types a communicator can reduce: the arithmetic types of dtype.
template <class T>
concept reducible = transferable<T> &&(dtype_of<T>() != dtype::bytes);

//! Element-wise reduction operators.
enum class reduce_op : std::uint8_t { sum, prod, min, max };

constexpr std::string_view to_string(reduce_op op) noexcept {
  constexpr std::string_view names[] = {"sum", "prod", "min", "max"};
  return names[static_cast<int>(op)];
}

//! Applies op to two values of a reducible type (16-bit floats through float); host and device.
template <reducible T>
LOOM_HD constexpr T apply(reduce_op op, T a, T b) noexcept {
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
    return T(apply(op, static_cast<float>(a), static_cast<float>(b)));
  } else {
    switch (op) {
      case reduce_op::sum:
        return static_cast<T>(a + b);
      case reduce_op::prod:
        return static_cast<T>(a * b);
      case reduce_op::min:
        return b < a ? b : a;
      case reduce_op::max:
        return a < b ? b : a;
    }
    return a;
  }
}

//! A communicator: P ranks that exchange typed buffers. See the file comment for the contract.
template <class C>
concept communicator = std::copy_constructible<C> &&
    requires(C& c, const C& cc, std::span<const float> s, std::span<float> r, std::span<const std::size_t> counts,
             typename C::request& req) {
  typename C::request;
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { c.isend(s, 0, 0) } -> std::same_as<typename C::request>;
  { c.irecv(r, 0, 0) } -> std::same_as<typename C::request>;
  c.wait(req);
  c.sendrecv(s, 0, r, 0, 0);
  c.all_gather(s, r);
  c.all_to_all(s, r);
  c.all_to_allv(s, counts, counts, r, counts, counts);
  c.all_reduce(s, r, reduce_op::sum);
  c.reduce_scatter(s, r, reduce_op::sum);
  c.broadcast(r, 0);
  c.barrier();
  { c.split(0, 0) } -> std::same_as<C>;
};

//! A communicator's request type: a handle H on a pending isend / irecv (a pointer or an optional;
//! empty when default-constructed or waited) that only the communicator Owner reads and writes.
template <class Owner, class H>
class basic_request {
 public:
  basic_request() = default;
  [[nodiscard]] bool valid() const noexcept { return static_cast<bool>(handle_); }

 private:
  friend Owner;
  explicit basic_request(H h) : handle_(std::move(h)) {}
  //! f(handle) when the request is pending, then empty (left pending when f throws).
  template <class F>
  void complete(F&& f) {
    if (!handle_) return;
    f(handle_);
    handle_ = H{};
  }
  H handle_{};
};

//! Waits for every request in `reqs` (in order; the first failure is thrown after all are waited).
template <class C>
void wait_all(C& c, std::span<typename C::request> reqs) {
  std::exception_ptr first;
  for (auto& r : reqs) {
    try {
      c.wait(r);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace loom::comm
