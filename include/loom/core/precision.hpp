#pragma once

//! @file
//! Precision policies: what a primitive stores (Storage) and what it accumulates in (Accum).

#include <loom/core/float16.hpp>

#include <concepts>
#include <string_view>
#include <type_traits>

namespace loom {

//! Floating-point types loom computes with: float, double, bfloat16, half.
template <class T>
concept floating_storage =
    std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bfloat16> || std::same_as<T, half>;

//! A precision policy. Accum must be float or double and at least as wide as Storage.
template <floating_storage Storage, floating_storage Accum>
requires(std::same_as<Accum, float> || std::same_as<Accum, double>) &&
    (sizeof(Accum) >= sizeof(Storage)) struct precision {
  using storage_type = Storage;  //!< element type of inputs and outputs in memory
  using accum_type = Accum;      //!< type of sums, softmax statistics and states
};

using fp64 = precision<double, double>;  //!< the oracle precision
using fp32 = precision<float, float>;
using bf16 = precision<bfloat16, float>;  //!< bfloat16 storage, float accumulation
using fp16 = precision<half, float>;      //!< binary16 storage, float accumulation

//! The accumulation type every family uses for storage T unless a precision policy overrides
//! it: double for double, float for float, bfloat16 and half.
template <class T>
using accum_t = std::conditional_t<std::is_same_v<std::remove_cv_t<T>, double>, double, float>;

//! The precision a family deduces from storage T: precision<T, accum_t<T>>.
template <floating_storage T>
using default_precision = precision<std::remove_cv_t<T>, accum_t<T>>;

//! Satisfied by loom::precision<S, A> and user types with the same two member types.
template <class P>
concept precision_policy = requires {
  typename P::storage_type;
  typename P::accum_type;
}
&&floating_storage<typename P::storage_type>&& std::floating_point<typename P::accum_type>;

//! The element types of a plan made for precision policy P (the plans derive from it).
template <precision_policy P>
struct precision_types {
  using precision = P;
  using storage_type = typename P::storage_type;
  using accum_type = typename P::accum_type;
};

//! A short name for reports: "fp64", "fp32", "bf16", "fp16" or "mixed".
template <precision_policy P>
constexpr std::string_view precision_name() noexcept {
  if constexpr (std::is_same_v<P, fp64>)
    return "fp64";
  else if constexpr (std::is_same_v<P, fp32>)
    return "fp32";
  else if constexpr (std::is_same_v<P, bf16>)
    return "bf16";
  else if constexpr (std::is_same_v<P, fp16>)
    return "fp16";
  else
    return "mixed";
}

}  // namespace loom
