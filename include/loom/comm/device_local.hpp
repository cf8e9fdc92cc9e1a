#pragma once

//! @file
//! comm::device_local: P ranks as threads of one process sharing ONE GPU, each with a
//! communication stream of its own, with comm::nccl's semantics (stream-ordered operations,
//! requests as events, a host wait polled against a timeout). NCCL refuses two ranks on one
//! device; this is how a single-GPU machine runs the distributed primitives, their tests and their
//! benchmarks. Link loom::cuda. Buffers are device pointers (loom::cuda_memory) of the shared GPU.
//!
//!   loom::comm::run_device_local(4, [](loom::comm::device_local& comm, loom::cuda b) {
//!     loom::comm::handoff(b, comm);        // transfers start after b's work so far
//!     comm.all_gather(mine, theirs);       // device spans; enqueued, returns without a device sync
//!     loom::comm::handback(b, comm);       // b's later work sees the result
//!   });
//!
//! How a transfer runs (one device, so every rank can read every rank's memory): the ranks meet
//! on the host over comm::local (underneath) and swap (pointer, bytes, event) triples; a receiver
//! makes its communication stream wait for the sender's "ready" event (recorded on the sender's
//! communication stream when the operation was issued, so after what comm::handoff ordered before
//! it), copies device to device with cudaMemcpyAsync on its own stream and records a "done" event,
//! which the sender's stream waits for before its later work may overwrite the sent buffer. The
//! host meeting blocks a rank until its peers have issued the matching call (as an MPI rendezvous
//! would), never until device work has run. Reductions read every rank's buffer with a kernel, in
//! rank order (deterministic), into a stream-ordered scratch (so in-place calls are safe).
//!
//! - isend returns once the matching irecv has been issued (its request is the receiver's copy);
//!   irecv returns once the matching isend has been issued. Two ranks that both isend first wait
//!   for each other until the timeout (errc::timeout), as ungrouped NCCL sends hang: the ring step
//!   is sendrecv.
//! - after(b) / before(b) order the communication stream after / before b.stream (events);
//!   wait(req) blocks the host (polled against the timeout), wait(req, b) makes b.stream wait.
//! - barrier, split, host_all_gather and host_all_reduce (the control plane) complete on return.
//! - A peer that never arrives is comm::local's timeout error (errc::timeout) naming the call; a
//!   failed device operation is a loom::error (comm_failure) from the next host wait.

#include <loom/backend/cuda.hpp>
#include <loom/comm/detail/cuda_events.hpp>
#include <loom/comm/detail/device_local_impl.hpp>
#include <loom/comm/stream_order.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <vector>

namespace loom::comm {

namespace detail {
inline void device_local_check(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    throw error(errc::comm_failure, std::string("comm::device_local ") + call + " failed: " + cudaGetErrorString(rc));
}
}  // namespace detail

//! The device policy of comm::device_local on a GPU (comm/detail/device_local_impl.hpp): a CUDA
//! communication stream and a ring of events. An event is re-recorded only after `ring` later
//! operations of the rank, by which time its readers have waited on it (each operation's peers
//! wait on its events before the host meeting that ends the operation).
class cuda_device {
 public:
  using backend = loom::cuda;
  using memory_space = cuda_memory;
  using stream = cudaStream_t;
  using event = cudaEvent_t;
  static constexpr std::size_t ring = 256;

  explicit cuda_device(cudaStream_t s) : s_(s) {
    events_.reserve(ring);
    for (std::size_t i = 0; i < ring; ++i) events_.push_back(detail::make_cuda_event("comm::device_local"));
  }
  [[nodiscard]] cudaStream_t stream_of() const noexcept { return s_; }
  event record() { return record_at(s_); }
  event record_on(const loom::cuda& b) { return record_at(b.stream); }
  void wait(event e) { detail::device_local_check(cudaStreamWaitEvent(s_, e, 0), "cudaStreamWaitEvent"); }
  void wait_on(const loom::cuda& b, event e) {
    detail::device_local_check(cudaStreamWaitEvent(b.stream, e, 0), "cudaStreamWaitEvent");
  }
  void copy(void* dst, const void* src, std::size_t bytes) {
    detail::device_local_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s_), "cudaMemcpyAsync");
  }
  void* scratch(std::size_t bytes) {
    void* p = nullptr;
    detail::device_local_check(cudaMallocAsync(&p, bytes, s_), "cudaMallocAsync");
    return p;
  }
  void release(void* p) { detail::device_local_check(cudaFreeAsync(p, s_), "cudaFreeAsync"); }
  [[nodiscard]] loom::cuda on() const noexcept { return {s_}; }
  detail::poll_state state(event e, std::string& why) const { return detail::cuda_event_state(e, why); }

 private:
  event record_at(cudaStream_t s) {
    cudaEvent_t e = events_[at_++ % ring].get();
    detail::device_local_check(cudaEventRecord(e, s), "cudaEventRecord");
    return e;
  }
  cudaStream_t s_;
  std::vector<detail::cuda_event> events_;
  std::size_t at_ = 0;
};

//! One rank of P ranks sharing one GPU (see the file comment).
using device_local = basic_device_local<cuda_device>;

//! Runs fn(comm, b) on `ranks` rank threads sharing device opt.device: b is the rank's compute
//! policy (a stream of its own), comm its device_local communicator (a communication stream of its
//! own). Both streams are synchronized before the rank returns. Failures as in run_local.
template <class F>
void run_device_local(int ranks, F&& fn, device_local_options opt = {}) {
  run_local(
      ranks,
      [&](local& c) {
        detail::device_local_check(cudaSetDevice(opt.device), "cudaSetDevice");
        cudaStream_t compute = nullptr, transfer = nullptr;
        detail::device_local_check(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreate");
        detail::device_local_check(cudaStreamCreateWithFlags(&transfer, cudaStreamNonBlocking), "cudaStreamCreate");
        struct streams {
          cudaStream_t a, b;
          ~streams() {
            cudaStreamSynchronize(a);
            cudaStreamSynchronize(b);
            cudaStreamDestroy(a);
            cudaStreamDestroy(b);
          }
        } guard{compute, transfer};
        device_local comm(c, transfer, opt);
        fn(comm, loom::cuda{compute});
        comm.synchronize();
        detail::device_local_check(cudaStreamSynchronize(compute), "cudaStreamSynchronize");
      },
      opt.local);
}

}  // namespace loom::comm
