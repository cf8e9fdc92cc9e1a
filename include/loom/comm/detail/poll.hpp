#pragma once

//! @file
//! Waiting for asynchronous work against a deadline: what a device communicator does instead of
//! a blocking synchronise (which would hang forever on a missing rank). The query and the abort
//! are callables, so the logic is the same for NCCL and is unit-tested on the CPU.

#include <loom/comm/detail/timeout.hpp>
#include <loom/core/error.hpp>

#include <chrono>
#include <string>
#include <string_view>
#include <thread>

namespace loom::comm::detail {

//! What one poll saw.
enum class poll_state { done, pending, failed };

//! Calls query(message) until it returns done. On failed (query set `message`), or when the
//! deadline `timeout` after the first poll passes while it is still pending, calls abort() once
//! and throws loom::error naming `call`: comm_failure with the message, or timeout. Polls back off
//! from yielding to sleeping up to 1 ms, so a long wait does not burn a core.
template <class Query, class Abort>
void poll_until_done(std::string_view call, std::chrono::milliseconds timeout, Query&& query, Abort&& abort) {
  const auto deadline = deadline_after(timeout);
  std::chrono::microseconds nap{0};
  for (;;) {
    std::string message;
    const poll_state s = query(message);
    if (s == poll_state::done) return;
    if (s == poll_state::failed) {
      abort();
      throw error(errc::comm_failure, std::string(call) + ": " + message);
    }
    if (clock::now() >= deadline) {
      abort();
      throw error(errc::timeout, std::string(call) + ": timed out after " + std::to_string(timeout.count()) +
                                     " ms (a rank missing, or ranks issuing different collectives); the "
                                     "communicator was aborted");
    }
    if (nap.count() == 0) {
      std::this_thread::yield();
      nap = std::chrono::microseconds(10);
    } else {
      std::this_thread::sleep_for(nap);
      if (nap < std::chrono::microseconds(1000)) nap *= 2;
    }
  }
}

}  // namespace loom::comm::detail
