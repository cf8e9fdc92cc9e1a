#pragma once

//! @file
//! CUDA events of the device communicators (comm::nccl, comm::device_local): owned events and an
//! event's state as a poll result (comm/detail/poll.hpp).

#include <loom/comm/detail/poll.hpp>
#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <type_traits>

namespace loom::comm::detail {

//! An event without timing, destroyed with its last copy.
using cuda_event = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;

//! A new cuda_event; a failure is a loom::error(comm_failure) naming `owner`.
inline cuda_event make_cuda_event(const char* owner) {
  cudaEvent_t e = nullptr;
  const cudaError_t rc = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (rc != cudaSuccess)
    throw error(errc::comm_failure, std::string(owner) + " cudaEventCreate failed: " + cudaGetErrorString(rc));
  return cuda_event(e, [](cudaEvent_t x) { cudaEventDestroy(x); });
}

//! Whether the work before e has run (done), not yet (pending), or failed (message set).
inline poll_state cuda_event_state(cudaEvent_t e, std::string& message) {
  const cudaError_t q = cudaEventQuery(e);
  if (q == cudaSuccess) return poll_state::done;
  if (q == cudaErrorNotReady) return poll_state::pending;
  message = std::string("CUDA reports ") + cudaGetErrorString(q);
  return poll_state::failed;
}

}  // namespace loom::comm::detail
