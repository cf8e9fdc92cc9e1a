#pragma once

//! @file
//! comm::device_local: P ranks as threads of one process sharing ONE GPU, each with a
//! communication stream of its own, with comm::nccl's semantics (stream-ordered operations,
//! requests as events, a host wait polled against a timeout). NCCL refuses two ranks on one
//! device; this is how a single-GPU machine runs the distributed primitives, their tests and their
//! benchmarks. Link loom::cuda. Buffers are device pointers (loom::cuda_memory) of the shared GPU.
//!
//!   loom::comm::run_device_local(4, [](loom::comm::device_local& comm, loom::cuda b) {
//!     loom::comm::handoff(comm, b);        // transfers start after b's work so far
//!     comm.all_gather(mine, theirs);       // device spans; enqueued, returns without a device sync
//!     loom::comm::handback(comm, b);       // b's later work sees the result
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
#include <loom/backend/parallel.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/poll.hpp>
#include <loom/comm/local.hpp>
#include <loom/comm/stream_order.hpp>
#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::comm {

namespace detail {

inline void device_local_check(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    throw error(errc::comm_failure, std::string("comm::device_local ") + call + " failed: " + cudaGetErrorString(rc));
}

//! What a rank tells its peers about one buffer: where it is, how many bytes, and the event after
//! which it may be read (or, for "done", after which the reader has finished).
struct device_slot {
  const void* ptr = nullptr;
  std::size_t bytes = 0;
  cudaEvent_t event = nullptr;
};

//! dst[i] = src[i] (first) or op(dst[i], src[i]), in R (16-bit floats through float).
template <class R>
struct rank_reduce {
  R* dst;
  const R* src;
  reduce_op op;
  bool first;
  LOOM_HD void operator()(index_t i) const {
    if (first) {
      dst[i] = src[i];
      return;
    }
    if constexpr (std::is_same_v<R, half> || std::is_same_v<R, bfloat16>) {
      const float a = static_cast<float>(dst[i]), b = static_cast<float>(src[i]);
      dst[i] = R(combine(a, b));
    } else {
      dst[i] = combine(dst[i], src[i]);
    }
  }
  template <class V>
  LOOM_HD V combine(V a, V b) const {
    switch (op) {
      case reduce_op::sum:
        return static_cast<V>(a + b);
      case reduce_op::prod:
        return static_cast<V>(a * b);
      case reduce_op::min:
        return b < a ? b : a;
      case reduce_op::max:
        return a < b ? b : a;
    }
    return a;
  }
};

}  // namespace detail

//! Options of comm::device_local.
struct device_local_options {
  //! The host meetings' timeout (comm::local's) and the host waits' (polled events).
  local_options local{};
  //! The device of the ranks (cudaSetDevice in each rank thread of run_device_local).
  int device = 0;
};

class device_local {
  using event_ptr = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;
  //! Events recorded per operation are taken from a ring this long; an event is re-recorded only
  //! after this many later operations of the rank, by which time its readers have waited on it
  //! (each operation's peers wait on it before the host meeting that ends the operation).
  static constexpr std::size_t ring = 256;

 public:
  using memory_space = cuda_memory;

  //! The completion point of an isend / irecv on the communication stream.
  class request {
   public:
    request() = default;
    [[nodiscard]] bool valid() const noexcept { return event_ != nullptr; }

   private:
    friend class device_local;
    cudaEvent_t event_ = nullptr;
  };

  //! Wraps this rank's comm::local handle; `stream` is the communication stream (not owned).
  device_local(local inner, cudaStream_t stream, device_local_options opt = {})
      : s_(std::make_shared<state>(std::move(inner), stream, opt)) {}

  [[nodiscard]] int rank() const noexcept { return s_->inner.rank(); }
  [[nodiscard]] int size() const noexcept { return s_->inner.size(); }
  [[nodiscard]] cudaStream_t stream() const noexcept { return s_->stream; }

  //! The communication stream waits for the work enqueued on b.stream so far.
  void after(const loom::cuda& b) {
    cudaEvent_t e = s_->next();
    check(cudaEventRecord(e, b.stream), "cudaEventRecord");
    check(cudaStreamWaitEvent(s_->stream, e, 0), "cudaStreamWaitEvent");
  }
  //! b.stream waits for the communication enqueued so far.
  void before(const loom::cuda& b) {
    cudaEvent_t e = s_->next();
    check(cudaEventRecord(e, s_->stream), "cudaEventRecord");
    check(cudaStreamWaitEvent(b.stream, e, 0), "cudaStreamWaitEvent");
  }
  //! Blocks the host until every enqueued operation ran (polled against the timeout).
  void synchronize() {
    cudaEvent_t e = s_->next();
    check(cudaEventRecord(e, s_->stream), "cudaEventRecord");
    sync_event(e, "comm::device_local synchronize");
  }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    check_peer("isend", dest, tag);
    const detail::device_slot mine{data.data(), data.size_bytes(), record_ready()};
    send_host(mine, dest, 2 * tag);
    // The receiver's copy is done after its event: the request, and what later work here waits on.
    const cudaEvent_t done = recv_host(dest, 2 * tag + 1).event;
    check(cudaStreamWaitEvent(s_->stream, done, 0), "cudaStreamWaitEvent");
    return mark();
  }
  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    check_peer("irecv", src, tag);
    const detail::device_slot from = recv_host(src, 2 * tag);
    pull(data.data(), from, data.size_bytes(), "irecv");
    send_host({nullptr, 0, record_ready()}, src, 2 * tag + 1);
    return mark();
  }
  //! Blocks the host until the request's operation ran (polled against the timeout).
  void wait(request& r) {
    if (!r.event_) return;
    sync_event(r.event_, "comm::device_local wait");
    r.event_ = nullptr;
  }
  //! Makes b.stream wait for the request's operation (no host block).
  void wait(request& r, const loom::cuda& b) {
    if (!r.event_) return;
    check(cudaStreamWaitEvent(b.stream, r.event_, 0), "cudaStreamWaitEvent");
    r.event_ = nullptr;
  }

  //! One grouped send to dest and receive from src (the ring step): never blocks on the order in
  //! which the ranks issue it.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    check_peer("sendrecv", dest, tag);
    check_peer("sendrecv", src, tag);
    const detail::device_slot mine{send.data(), send.size_bytes(), record_ready()};
    const detail::device_slot from = swap_host(mine, dest, src, 2 * tag);
    pull(recv.data(), from, recv.size_bytes(), "sendrecv");
    const detail::device_slot read = swap_host({nullptr, 0, record_ready()}, src, dest, 2 * tag + 1);
    check(cudaStreamWaitEvent(s_->stream, read.event, 0), "cudaStreamWaitEvent");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    const auto p = static_cast<std::size_t>(size());
    LOOM_EXPECTS(recv.size() == send.size() * p, errc::shape_mismatch, "comm::device_local all_gather: recv holds ",
                 recv.size(), " elements, expected ", p, " x ", send.size());
    gather_slots({send.data(), send.size_bytes(), record_ready()});
    for (std::size_t q = 0; q < p; ++q)
      pull(recv.data() + q * send.size(), s_->board[q], send.size_bytes(), "all_gather");
    finish_reads();
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    const auto p = static_cast<std::size_t>(size());
    LOOM_EXPECTS(send.size() % p == 0 && recv.size() == send.size(), errc::shape_mismatch,
                 "comm::device_local all_to_all: send (", send.size(), ") and recv (", recv.size(),
                 ") must be equal multiples of ", p, " ranks");
    const std::size_t b = send.size() / p;
    const cudaEvent_t ready = record_ready();
    for (std::size_t q = 0; q < p; ++q) s_->out[q] = {send.data() + q * b, b * sizeof(R), ready};
    exchange_slots();
    for (std::size_t q = 0; q < p; ++q) pull(recv.data() + q * b, s_->in[q], b * sizeof(R), "all_to_all");
    finish_reads();
  }

  //! The counts and displacements are host arrays, read before the call returns.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    const auto p = static_cast<std::size_t>(size());
    LOOM_EXPECTS(
        send_counts.size() == p && send_displs.size() == p && recv_counts.size() == p && recv_displs.size() == p,
        errc::shape_mismatch, "comm::device_local all_to_allv: counts and displacements need one entry per rank (", p,
        ")");
    for (std::size_t q = 0; q < p; ++q)
      LOOM_EXPECTS(send_displs[q] + send_counts[q] <= send.size() && recv_displs[q] + recv_counts[q] <= recv.size(),
                   errc::shape_mismatch, "comm::device_local all_to_allv: the block for rank ", q,
                   " lies outside its buffer");
    const cudaEvent_t ready = record_ready();
    for (std::size_t q = 0; q < p; ++q) s_->out[q] = {send.data() + send_displs[q], send_counts[q] * sizeof(R), ready};
    exchange_slots();
    for (std::size_t q = 0; q < p; ++q)
      pull(recv.data() + recv_displs[q], s_->in[q], recv_counts[q] * sizeof(R), "all_to_allv");
    finish_reads();
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    LOOM_EXPECTS(recv.size() == send.size(), errc::shape_mismatch, "comm::device_local all_reduce: recv holds ",
                 recv.size(), " elements, expected ", send.size());
    reduce_rows(send.data(), send.size(), 0, recv.data(), recv.size(), op, "all_reduce");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    LOOM_EXPECTS(send.size() == recv.size() * static_cast<std::size_t>(size()), errc::shape_mismatch,
                 "comm::device_local reduce_scatter: send holds ", send.size(), " elements, expected ", size(), " x ",
                 recv.size());
    reduce_rows(send.data(), send.size(), static_cast<std::size_t>(rank()) * recv.size(), recv.data(), recv.size(), op,
                "reduce_scatter");
  }

  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    LOOM_EXPECTS(root >= 0 && root < size(), errc::invalid_argument,
                 "comm::device_local broadcast: root must be in [0, ", size(), "), got ", root);
    gather_slots({data.data(), data.size_bytes(), record_ready()});
    const auto& from = s_->board[static_cast<std::size_t>(root)];
    LOOM_EXPECTS(from.bytes == data.size_bytes(), errc::shape_mismatch, "comm::device_local broadcast: rank ", rank(),
                 " holds ", data.size_bytes(), " bytes, the root ", from.bytes);
    if (rank() != root) pull(data.data(), from, data.size_bytes(), "broadcast");
    finish_reads();
  }

  //! Blocks the host until every rank has reached the barrier and this stream's work is done.
  void barrier() {
    synchronize();
    s_->inner.barrier();
  }
  //! An all_gather of host memory, complete on return (comm::host_all_gather).
  template <class S, class R>
  void host_all_gather(std::span<S> send, std::span<R> recv) {
    s_->inner.all_gather(send, recv);
  }
  //! An all_reduce of host memory, complete on return (comm::host_all_reduce).
  template <class S, class R>
  void host_all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    s_->inner.all_reduce(send, recv, op);
  }
  //! Collective, complete on return: the ranks of the same color, ordered by (key, rank), on the
  //! same communication stream.
  device_local split(int color, int key) {
    synchronize();
    return device_local(s_->inner.split(color, key), s_->stream, s_->opt);
  }

 private:
  struct state {
    local inner;
    cudaStream_t stream;
    device_local_options opt;
    std::vector<event_ptr> events;
    std::size_t at = 0;
    //! Host boards of one operation (sized once: calls allocate nothing on the host).
    std::vector<detail::device_slot> board, out, in;
    state(local l, cudaStream_t s, device_local_options o) : inner(std::move(l)), stream(s), opt(o) {
      events.reserve(ring);
      for (std::size_t i = 0; i < ring; ++i) {
        cudaEvent_t e = nullptr;
        detail::device_local_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
        events.emplace_back(e, [](cudaEvent_t x) { cudaEventDestroy(x); });
      }
      const auto p = static_cast<std::size_t>(inner.size());
      board.resize(p);
      out.resize(p);
      in.resize(p);
    }
    cudaEvent_t next() { return events[at++ % ring].get(); }
  };
  std::shared_ptr<state> s_;

  static void check(cudaError_t rc, const char* call) { detail::device_local_check(rc, call); }

  void check_peer(const char* call, int peer, int tag) const {
    LOOM_EXPECTS(peer >= 0 && peer < size(), errc::invalid_argument, "comm::device_local ", call,
                 ": peer must be in [0, ", size(), "), got ", peer);
    LOOM_EXPECTS(tag >= 0 && tag < (1 << 29), errc::invalid_argument, "comm::device_local ", call,
                 ": tag must be in [0, 2^29), got ", tag);
  }
  //! An event marking the communication stream's work so far.
  cudaEvent_t record_ready() {
    cudaEvent_t e = s_->next();
    check(cudaEventRecord(e, s_->stream), "cudaEventRecord");
    return e;
  }
  request mark() {
    request r;
    r.event_ = record_ready();
    return r;
  }
  //! Copies `bytes` of a peer's buffer into dst once the peer's ready event has fired.
  void pull(void* dst, const detail::device_slot& from, std::size_t bytes, const char* call) {
    LOOM_EXPECTS(from.bytes == bytes, errc::shape_mismatch, "comm::device_local ", call, ": rank ", rank(), " expects ",
                 bytes, " bytes, the peer sends ", from.bytes);
    if (bytes == 0 || dst == from.ptr) return;
    check(cudaStreamWaitEvent(s_->stream, from.event, 0), "cudaStreamWaitEvent");
    check(cudaMemcpyAsync(dst, from.ptr, bytes, cudaMemcpyDeviceToDevice, s_->stream), "cudaMemcpyAsync");
  }
  // Host meetings over comm::local (host memory, complete on return).
  void send_host(const detail::device_slot& s, int dest, int tag) {
    auto r = s_->inner.isend(std::span<const detail::device_slot>(&s, 1), dest, tag);
    s_->inner.wait(r);
  }
  detail::device_slot recv_host(int src, int tag) {
    detail::device_slot s;
    auto r = s_->inner.irecv(std::span<detail::device_slot>(&s, 1), src, tag);
    s_->inner.wait(r);
    return s;
  }
  detail::device_slot swap_host(const detail::device_slot& mine, int dest, int src, int tag) {
    detail::device_slot theirs;
    s_->inner.sendrecv(std::span<const detail::device_slot>(&mine, 1), dest, std::span<detail::device_slot>(&theirs, 1),
                       src, tag);
    return theirs;
  }
  //! board[q] = rank q's slot.
  void gather_slots(const detail::device_slot& mine) {
    s_->inner.all_gather(std::span<const detail::device_slot>(&mine, 1), std::span<detail::device_slot>(s_->board));
  }
  //! in[q] = the slot rank q filled for this rank in its out[].
  void exchange_slots() {
    s_->inner.all_to_all(std::span<const detail::device_slot>(s_->out), std::span<detail::device_slot>(s_->in));
  }
  //! Every rank has issued its reads of the others' buffers: this stream's later work waits for
  //! all of them (so a buffer read by a peer is not overwritten before the read ran).
  void finish_reads() {
    gather_slots({nullptr, 0, record_ready()});
    for (const auto& d : s_->board) check(cudaStreamWaitEvent(s_->stream, d.event, 0), "cudaStreamWaitEvent");
  }
  //! recv = op over the ranks, in rank order, of elements [offset, offset + n) of their send
  //! buffers (count elements each), through a stream-ordered scratch.
  template <class R>
  void reduce_rows(const R* send, std::size_t count, std::size_t offset, R* recv, std::size_t n, reduce_op op,
                   const char* call) {
    gather_slots({send, count * sizeof(R), record_ready()});
    R* tmp = nullptr;
    if (n > 0) check(cudaMallocAsync(reinterpret_cast<void**>(&tmp), n * sizeof(R), s_->stream), "cudaMallocAsync");
    const loom::cuda on{s_->stream};
    for (std::size_t q = 0; q < s_->board.size(); ++q) {
      const auto& from = s_->board[q];
      LOOM_EXPECTS(from.bytes == count * sizeof(R), errc::shape_mismatch, "comm::device_local ", call, ": rank ", q,
                   " holds ", from.bytes, " bytes, rank ", rank(), " ", count * sizeof(R));
      if (n == 0) continue;
      check(cudaStreamWaitEvent(s_->stream, from.event, 0), "cudaStreamWaitEvent");
      for_each_index(on, static_cast<index_t>(n),
                     detail::rank_reduce<R>{tmp, static_cast<const R*>(from.ptr) + offset, op, q == 0});
    }
    finish_reads();
    if (n > 0) {
      check(cudaMemcpyAsync(recv, tmp, n * sizeof(R), cudaMemcpyDeviceToDevice, s_->stream), "cudaMemcpyAsync");
      check(cudaFreeAsync(tmp, s_->stream), "cudaFreeAsync");
    }
  }
  //! Waits on the host for event e, against the timeout.
  void sync_event(cudaEvent_t e, const char* call) {
    detail::poll_until_done(
        call, s_->opt.local.timeout,
        [&](std::string& m) {
          const cudaError_t q = cudaEventQuery(e);
          if (q == cudaSuccess) return detail::poll_state::done;
          if (q != cudaErrorNotReady) {
            m = std::string("CUDA reports ") + cudaGetErrorString(q);
            return detail::poll_state::failed;
          }
          return detail::poll_state::pending;
        },
        [] {});
  }
};

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
