#pragma once

//! @file
//! Checked arithmetic on sizes. Sums and products of user-given extents, counts and offsets go
//! through checked_add / checked_mul, which throw loom::error(invalid_argument) naming the
//! operands instead of wrapping around (signed overflow is undefined behaviour; a wrapped size
//! allocates too little and the code that follows reads or writes out of bounds).
//!
//!   const index_t slots = checked_mul(checked_mul(rows, groups, "n_m: rows * groups"), index_t{N},
//!                                     "n_m: rows * groups * N");
//!
//! The error reads "<what> = <a> * <b> overflows a 64-bit signed integer" and points at the line
//! of the caller, not at this header.

#include <loom/config.hpp>
#include <loom/core/error.hpp>

#include <concepts>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <version>

#if defined(__cpp_lib_source_location)
#include <source_location>
#endif

namespace loom::detail {

#if defined(__cpp_lib_source_location)
using call_site = std::source_location;  //!< where a checked operation was called from
#else
//! Stand-in for compilers without std::source_location (the error then names this header).
struct call_site {
  static constexpr call_site current() noexcept { return {}; }
  constexpr const char* file_name() const noexcept { return __FILE__; }
  constexpr unsigned line() const noexcept { return __LINE__; }
};
#endif

template <std::integral I>
std::string integer_type_name() {
  constexpr int bits = std::numeric_limits<I>::digits + (std::is_signed_v<I> ? 1 : 0);
  return (bits == 8 ? "an " : "a ") + std::to_string(bits) + "-bit " + (std::is_signed_v<I> ? "signed" : "unsigned") +
         " integer";
}

template <std::integral I>
[[noreturn]] void overflow(std::string_view what, I a, char op, I b, const call_site& at) {
  fail(errc::invalid_argument,
       concat(what, " = ", +a, ' ', op, ' ', +b, " overflows ", integer_type_name<I>(), " (max ",
              +std::numeric_limits<I>::max(), ")"),
       at.file_name(), static_cast<int>(at.line()));
}

//! True if a * b does not fit I (portable: no compiler builtins, usable in constant expressions).
template <std::integral I>
constexpr bool mul_overflows(I a, I b) noexcept {
  constexpr I hi = std::numeric_limits<I>::max(), lo = std::numeric_limits<I>::min();
  if (a == 0 || b == 0) return false;
  if constexpr (std::is_signed_v<I>) {
    if (a > 0) return b > 0 ? a > hi / b : b < lo / a;
    return b > 0 ? a < lo / b : b < hi / a;
  } else {
    return a > hi / b;
  }
}

//! True if a + b does not fit I.
template <std::integral I>
constexpr bool add_overflows(I a, I b) noexcept {
  constexpr I hi = std::numeric_limits<I>::max(), lo = std::numeric_limits<I>::min();
  if constexpr (std::is_signed_v<I>)
    return b > 0 ? a > hi - b : a < lo - b;
  else
    return a > hi - b;
}

//! a * b. `what` names the product for the error, e.g. "shard::make_plan: ranks * cu_seqlens.back()".
//! @throws loom::error(invalid_argument) "<what> = a * b overflows ..." if the product does not fit I.
template <std::integral I>
constexpr I checked_mul(I a, I b, std::string_view what, const call_site& at = call_site::current()) {
  if (mul_overflows(a, b)) [[unlikely]]
    overflow(what, a, '*', b, at);
  return static_cast<I>(a * b);
}

//! a + b. `what` names the sum for the error, e.g. "csr: rows + 1".
//! @throws loom::error(invalid_argument) "<what> = a + b overflows ..." if the sum does not fit I.
template <std::integral I>
constexpr I checked_add(I a, I b, std::string_view what, const call_site& at = call_site::current()) {
  if (add_overflows(a, b)) [[unlikely]]
    overflow(what, a, '+', b, at);
  return static_cast<I>(a + b);
}

//! ceil(a / b) for a >= 0 and b > 0, without forming a + b - 1 (which overflows near the maximum).
template <std::integral I>
LOOM_HD constexpr I ceil_div(I a, I b) noexcept {
  return a / b + (a % b != 0 ? 1 : 0);
}

}  // namespace loom::detail
