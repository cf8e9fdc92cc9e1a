#pragma once

//! @file
//! What loom's calls into NVIDIA's libraries share (cuDNN, cuBLAS, cuSPARSE, cuSPARSELt): the
//! library data type of an element type, and the check that a call runs on its plan's device.

#include <loom/backend/cuda.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>

#include <library_types.h>
#include <string_view>
#include <type_traits>

namespace loom::detail {

template <class T>
inline constexpr bool cuda_library_type = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                          std::is_same_v<T, loom::bfloat16> || std::is_same_v<T, loom::half>;

//! The cudaDataType of float, double, bfloat16 or half.
template <class T>
constexpr cudaDataType cuda_data_type() {
  static_assert(cuda_library_type<T>, "a library data type of float, double, bfloat16 or half only");
  if constexpr (std::is_same_v<T, float>)
    return CUDA_R_32F;
  else if constexpr (std::is_same_v<T, double>)
    return CUDA_R_64F;
  else if constexpr (std::is_same_v<T, loom::bfloat16>)
    return CUDA_R_16BF;
  else
    return CUDA_R_16F;
}

//! The device current now, the one a plan is made on.
inline int current_cuda_device() {
  int device = -1;
  LOOM_CUDA_TRY(cudaGetDevice(&device));
  return device;
}

//! @throws loom::error(invalid_argument) naming `call` unless the current device is `plan_device`
//!   (a plan's handles, tables and buffers live on the device it was made on).
inline void check_plan_device(int plan_device, std::string_view call) {
  const int current = current_cuda_device();
  LOOM_EXPECTS(current == plan_device, errc::invalid_argument, call, ": the current CUDA device (", current,
               ") is not the one the plan was made on (", plan_device, ")");
}

}  // namespace loom::detail
