#pragma once

//! @file
//! What loom's calls into cuBLAS share (linear_attention::cublas, sparse::device_chooser): a
//! status check that names cuBLAS's reason, and an owned handle.

#include <loom/core/error.hpp>

#include <cublas_v2.h>
#include <string_view>

namespace loom::detail {

//! @throws loom::error naming `call` and `what` unless s is success: (unsupported) for a
//!   configuration cuBLAS does not take here, (internal) otherwise.
inline void check_cublas(cublasStatus_t s, std::string_view call, std::string_view what) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  const errc code =
      s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_ARCH_MISMATCH ? errc::unsupported : errc::internal;
  LOOM_EXPECTS(false, code, call, ": ", what, " failed: ", cublasGetStatusName(s), ": ", cublasGetStatusString(s));
}

//! A cuBLAS handle on the current device, destroyed with its owner.
class cublas_handle {
 public:
  explicit cublas_handle(std::string_view call) { check_cublas(cublasCreate(&h_), call, "cublasCreate"); }
  cublas_handle(const cublas_handle&) = delete;
  cublas_handle& operator=(const cublas_handle&) = delete;
  ~cublas_handle() { cublasDestroy(h_); }
  [[nodiscard]] cublasHandle_t get() const noexcept { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

}  // namespace loom::detail
