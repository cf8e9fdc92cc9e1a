#pragma once

//! @file
//! comm::nccl: one rank's handle on an NCCL communicator, with a communication stream of its own
//! (the GPU engine). Link loom::nccl. Buffers are device pointers (loom::cuda_memory).
//!
//! Stream order (comm/stream_order.hpp): every operation is enqueued on the communication stream
//! and returns at once. after(b) makes that stream wait for the work enqueued on b.stream so far,
//! before(b) makes b.stream wait for the communication enqueued so far (events; no host sync).
//! isend / irecv return a request holding the event recorded after the operation (after the
//! enclosing group_end when issued inside group_start / group_end): wait(req) blocks the host,
//! wait(req, b) makes b.stream wait. NCCL matches point-to-point messages in issue order and has
//! no tags (the tag is only checked for >= 0); separate isend / irecv must be grouped when both
//! peers send first, so the ring step is sendrecv, one grouped send and receive.
//!
//! Never a hang: every host wait (wait(req), synchronize(), barrier, split, host_all_gather,
//! host_all_reduce, init_rank) polls the event and ncclCommGetAsyncError against the timeout of nccl_options
//! (default: LOOM_COMM_TIMEOUT_MS, as the host communicators); on an asynchronous NCCL error or the
//! deadline it calls ncclCommAbort and throws loom::error (comm_failure or timeout) naming the call.
//! With nccl_options::check_signatures, each collective first exchanges its signature (call,
//! element type, count, root) in a small host all_gather and every rank throws the same error when
//! they differ (a mismatched collective would otherwise hang or corrupt memory).
//! Host-side misuse (sizes, roots, peers) throws loom::error before anything is enqueued.

#include <loom/backend/cuda.hpp>
#include <loom/comm/agreement.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/cuda_events.hpp>
#include <loom/comm/detail/poll.hpp>
#include <loom/comm/detail/timeout.hpp>
#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::comm {

namespace detail {

//! A failed NCCL call (ncclInProgress is the normal return of a non-blocking communicator).
inline void nccl_check(ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess && rc != ncclInProgress)
    throw error(errc::comm_failure, std::string("comm::nccl ") + call + " failed: " + ncclGetErrorString(rc));
}

inline void nccl_cuda_check(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    throw error(errc::comm_failure, std::string("comm::nccl ") + call + " failed: " + cudaGetErrorString(rc));
}

template <class T>
ncclDataType_t nccl_datatype() {
  // Indexed by dtype; other trivially copyable types (dtype::bytes) travel as bytes.
  constexpr ncclDataType_t types[] = {ncclUint8,  ncclInt8,    ncclUint8,    ncclInt32,   ncclUint32, ncclInt64,
                                      ncclUint64, ncclFloat16, ncclBfloat16, ncclFloat32, ncclFloat64};
  static_assert(std::size(types) == static_cast<std::size_t>(dtype::f64) + 1);
  return types[static_cast<int>(dtype_of<T>())];
}

template <class T>
std::size_t nccl_count(std::size_t n) {
  return dtype_of<T>() == dtype::bytes ? n * sizeof(T) : n;
}

inline ncclRedOp_t nccl_op(reduce_op op) {
  constexpr ncclRedOp_t ops[4] = {ncclSum, ncclProd, ncclMin, ncclMax};  // reduce_op's order
  return ops[static_cast<int>(op)];
}

}  // namespace detail

//! Options of comm::nccl.
struct nccl_options {
  //! How long a host wait polls before aborting the communicator (errc::timeout).
  std::chrono::milliseconds timeout = default_timeout();
  //! Exchange every collective's signature first (one small host all_gather per collective).
  bool check_signatures = false;
};

//! One rank's handle on an NCCL communicator and its communication stream. Copies share the
//! communicator, its events and its state.
class nccl {
  using event_ptr = detail::cuda_event;

 public:
  using memory_space = cuda_memory;

  //! The completion point of an isend / irecv on the communication stream.
  using request = basic_request<nccl, event_ptr>;

  //! Wraps `comm` (not owned) with the communication stream `stream`.
  nccl(ncclComm_t comm, cudaStream_t stream, nccl_options opt = {})
      : st_(std::make_shared<state>()), comm_(comm), stream_(stream), opt_(opt) {
    detail::nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    detail::nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
    st_->after = make_event();
    st_->before = make_event();
  }

  //! A new communicator of `ranks` ranks from `id` (ncclGetUniqueId on one rank, shared by the
  //! caller), initialised non-blocking: the wait for the other ranks polls against opt.timeout,
  //! then aborts and throws (errc::timeout) instead of hanging. Destroyed with its last copy.
  static nccl init_rank(int ranks, const ncclUniqueId& id, int rank, cudaStream_t stream, nccl_options opt = {}) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t c = nullptr;
    detail::nccl_check(ncclCommInitRankConfig(&c, ranks, id, rank, &config), "ncclCommInitRankConfig");
    detail::poll_until_done(
        "comm::nccl init_rank", opt.timeout, [&](std::string& m) { return async_state(c, m); },
        [&] { ncclCommAbort(c); });
    nccl out(c, stream, opt);
    out.own(c);
    return out;
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  //! ncclGroupStart / ncclGroupEnd: fuse the point-to-point calls in between. Requests issued
  //! inside get their events when the outermost group ends.
  void group_start() {
    detail::nccl_check(ncclGroupStart(), "ncclGroupStart");
    ++st_->group_depth;
  }
  void group_end() {
    detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd");
    if (--st_->group_depth == 0) {
      for (auto& e : st_->pending) detail::nccl_cuda_check(cudaEventRecord(e.get(), stream_), "cudaEventRecord");
      st_->pending.clear();
    }
  }

  //! The communication stream waits for the work enqueued on b.stream so far.
  void after(const loom::cuda& b) {
    detail::nccl_cuda_check(cudaEventRecord(st_->after.get(), b.stream), "cudaEventRecord");
    detail::nccl_cuda_check(cudaStreamWaitEvent(stream_, st_->after.get(), 0), "cudaStreamWaitEvent");
  }
  //! b.stream waits for the communication enqueued so far.
  void before(const loom::cuda& b) {
    detail::nccl_cuda_check(cudaEventRecord(st_->before.get(), stream_), "cudaEventRecord");
    detail::nccl_cuda_check(cudaStreamWaitEvent(b.stream, st_->before.get(), 0), "cudaStreamWaitEvent");
  }
  //! Blocks the host until every enqueued operation ran (polled against the timeout).
  void synchronize() {
    detail::nccl_cuda_check(cudaEventRecord(st_->before.get(), stream_), "cudaEventRecord");
    sync_event(st_->before.get(), "comm::nccl synchronize");
  }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    using U = std::remove_const_t<T>;
    check_peer("isend", dest, tag);
    detail::nccl_check(
        ncclSend(data.data(), detail::nccl_count<U>(data.size()), detail::nccl_datatype<U>(), dest, comm_, stream_),
        "ncclSend");
    return record();
  }

  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    check_peer("irecv", src, tag);
    detail::nccl_check(
        ncclRecv(data.data(), detail::nccl_count<T>(data.size()), detail::nccl_datatype<T>(), src, comm_, stream_),
        "ncclRecv");
    return record();
  }

  //! Blocks the host until the request's operation ran (polled against the timeout).
  void wait(request& r) {
    r.complete([&](auto& e) {
      check_not_grouped();
      sync_event(e.get(), "comm::nccl wait");
    });
  }
  //! Makes b.stream wait for the request's operation (no host block).
  void wait(request& r, const loom::cuda& b) {
    r.complete([&](auto& e) {
      check_not_grouped();
      detail::nccl_cuda_check(cudaStreamWaitEvent(b.stream, e.get(), 0), "cudaStreamWaitEvent");
    });
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    check_peer("sendrecv", dest, tag);
    check_peer("sendrecv", src, tag);
    group_start();
    detail::nccl_check(
        ncclSend(send.data(), detail::nccl_count<R>(send.size()), detail::nccl_datatype<R>(), dest, comm_, stream_),
        "ncclSend");
    detail::nccl_check(
        ncclRecv(recv.data(), detail::nccl_count<R>(recv.size()), detail::nccl_datatype<R>(), src, comm_, stream_),
        "ncclRecv");
    group_end();
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    LOOM_EXPECTS(recv.size() == send.size() * static_cast<std::size_t>(size_), errc::shape_mismatch,
                 "comm::nccl all_gather: recv holds ", recv.size(), " elements, expected ", size_, " x ", send.size());
    check_signature("all_gather", dtype_of<R>(), send.size());
    detail::nccl_check(ncclAllGather(send.data(), recv.data(), detail::nccl_count<R>(send.size()),
                                     detail::nccl_datatype<R>(), comm_, stream_),
                       "ncclAllGather");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    const auto p = static_cast<std::size_t>(size_);
    LOOM_EXPECTS(send.size() % p == 0 && recv.size() == send.size(), errc::shape_mismatch,
                 "comm::nccl all_to_all: send (", send.size(), ") and recv (", recv.size(),
                 ") must be equal multiples of ", size_, " ranks");
    const std::size_t b = send.size() / p;
    check_signature("all_to_all", dtype_of<R>(), send.size());
    group_start();
    for (std::size_t q = 0; q < p; ++q) {
      detail::nccl_check(ncclSend(send.data() + q * b, detail::nccl_count<R>(b), detail::nccl_datatype<R>(),
                                  static_cast<int>(q), comm_, stream_),
                         "ncclSend");
      detail::nccl_check(ncclRecv(recv.data() + q * b, detail::nccl_count<R>(b), detail::nccl_datatype<R>(),
                                  static_cast<int>(q), comm_, stream_),
                         "ncclRecv");
    }
    group_end();
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    const auto p = static_cast<std::size_t>(size_);
    LOOM_EXPECTS(
        send_counts.size() == p && send_displs.size() == p && recv_counts.size() == p && recv_displs.size() == p,
        errc::shape_mismatch, "comm::nccl all_to_allv: counts and displacements need one entry per rank (", p, ")");
    for (std::size_t q = 0; q < p; ++q)
      LOOM_EXPECTS(send_displs[q] + send_counts[q] <= send.size() && recv_displs[q] + recv_counts[q] <= recv.size(),
                   errc::shape_mismatch, "comm::nccl all_to_allv: the block for rank ", q, " lies outside its buffer");
    check_signature("all_to_allv", dtype_of<R>(), 0);
    group_start();
    for (std::size_t q = 0; q < p; ++q) {
      if (send_counts[q])
        detail::nccl_check(ncclSend(send.data() + send_displs[q], detail::nccl_count<R>(send_counts[q]),
                                    detail::nccl_datatype<R>(), static_cast<int>(q), comm_, stream_),
                           "ncclSend");
      if (recv_counts[q])
        detail::nccl_check(ncclRecv(recv.data() + recv_displs[q], detail::nccl_count<R>(recv_counts[q]),
                                    detail::nccl_datatype<R>(), static_cast<int>(q), comm_, stream_),
                           "ncclRecv");
    }
    group_end();
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    LOOM_EXPECTS(recv.size() == send.size(), errc::shape_mismatch, "comm::nccl all_reduce: recv holds ", recv.size(),
                 " elements, expected ", send.size());
    check_signature("all_reduce", dtype_of<R>(), send.size(), static_cast<int>(op));
    detail::nccl_check(ncclAllReduce(send.data(), recv.data(), recv.size(), detail::nccl_datatype<R>(),
                                     detail::nccl_op(op), comm_, stream_),
                       "ncclAllReduce");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    LOOM_EXPECTS(send.size() == recv.size() * static_cast<std::size_t>(size_), errc::shape_mismatch,
                 "comm::nccl reduce_scatter: send holds ", send.size(), " elements, expected ", size_, " x ",
                 recv.size());
    check_signature("reduce_scatter", dtype_of<R>(), recv.size(), static_cast<int>(op));
    detail::nccl_check(ncclReduceScatter(send.data(), recv.data(), recv.size(), detail::nccl_datatype<R>(),
                                         detail::nccl_op(op), comm_, stream_),
                       "ncclReduceScatter");
  }

  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    LOOM_EXPECTS(root >= 0 && root < size_, errc::invalid_argument, "comm::nccl broadcast: root must be in [0, ", size_,
                 "), got ", root);
    check_signature("broadcast", dtype_of<T>(), data.size(), root);
    detail::nccl_check(ncclBroadcast(data.data(), data.data(), detail::nccl_count<T>(data.size()),
                                     detail::nccl_datatype<T>(), root, comm_, stream_),
                       "ncclBroadcast");
  }

  //! Blocks the host until every rank has reached the barrier and this stream's work is done.
  void barrier() {
    if (!token_) {
      int* p = nullptr;
      detail::nccl_cuda_check(cudaMalloc(reinterpret_cast<void**>(&p), sizeof(int)), "cudaMalloc");
      token_ = std::shared_ptr<int>(p, [](int* q) { cudaFree(q); });
    }
    detail::nccl_check(ncclAllReduce(token_.get(), token_.get(), 1, ncclInt32, ncclSum, comm_, stream_),
                       "ncclAllReduce (barrier)");
    detail::nccl_cuda_check(cudaEventRecord(st_->before.get(), stream_), "cudaEventRecord");
    sync_event(st_->before.get(), "comm::nccl barrier");
  }

  //! An all_gather of host memory, complete on return (comm::host_all_gather: the agreement of
  //! make_plan): through a device bounce buffer on the communication stream.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void host_all_gather(std::span<S> send, std::span<R> recv) {
    LOOM_EXPECTS(recv.size() == send.size() * static_cast<std::size_t>(size_), errc::shape_mismatch,
                 "comm::nccl host_all_gather: recv holds ", recv.size(), " elements, expected ", size_, " x ",
                 send.size());
    const std::size_t sb = send.size_bytes(), rb = recv.size_bytes();
    std::byte* dev = nullptr;
    detail::nccl_cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&dev), sb + rb + 1, stream_), "cudaMallocAsync");
    const std::shared_ptr<std::byte> guard(dev, [s = stream_](std::byte* q) { cudaFreeAsync(q, s); });
    detail::nccl_cuda_check(cudaMemcpyAsync(dev, send.data(), sb, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    detail::nccl_check(ncclAllGather(dev, dev + sb, sb, ncclUint8, comm_, stream_), "ncclAllGather");
    detail::nccl_cuda_check(cudaMemcpyAsync(recv.data(), dev + sb, rb, cudaMemcpyDeviceToHost, stream_),
                            "cudaMemcpyAsync");
    synchronize();
  }

  //! An all_reduce of host memory, complete on return (comm::host_all_reduce: decisions every rank
  //! takes alike), through a device bounce buffer on the communication stream.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void host_all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    LOOM_EXPECTS(recv.size() == send.size(), errc::shape_mismatch, "comm::nccl host_all_reduce: recv holds ",
                 recv.size(), " elements, expected ", send.size());
    check_signature("host_all_reduce", dtype_of<R>(), send.size(), static_cast<int>(op));
    const std::size_t bytes = send.size_bytes();
    R* dev = nullptr;
    detail::nccl_cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&dev), bytes + sizeof(R), stream_),
                            "cudaMallocAsync");
    const std::shared_ptr<R> guard(dev, [s = stream_](R* q) { cudaFreeAsync(q, s); });
    detail::nccl_cuda_check(cudaMemcpyAsync(dev, send.data(), bytes, cudaMemcpyHostToDevice, stream_),
                            "cudaMemcpyAsync");
    detail::nccl_check(
        ncclAllReduce(dev, dev, send.size(), detail::nccl_datatype<R>(), detail::nccl_op(op), comm_, stream_),
        "ncclAllReduce");
    detail::nccl_cuda_check(cudaMemcpyAsync(recv.data(), dev, bytes, cudaMemcpyDeviceToHost, stream_),
                            "cudaMemcpyAsync");
    synchronize();
  }

  //! ncclCommSplit; the new communicator uses the same stream and is destroyed with its last copy.
  nccl split(int color, int key) {
    LOOM_EXPECTS(color >= 0, errc::invalid_argument, "comm::nccl split: color must be >= 0, got ", color);
    ncclComm_t out = nullptr;
    detail::nccl_check(ncclCommSplit(comm_, color, key, &out, nullptr), "ncclCommSplit");
    detail::poll_until_done(
        "comm::nccl split", opt_.timeout, [&](std::string& m) { return async_state(comm_, m); }, [&] { abort(); });
    nccl result(out, stream_, opt_);
    result.own(out);
    return result;
  }

 private:
  //! What copies share: the stream-order events, the open group and its requests, whether the
  //! communicator was aborted (then it is not destroyed again).
  struct state {
    event_ptr after, before;
    int group_depth = 0;
    std::vector<event_ptr> pending;
    bool aborted = false;
  };
  std::shared_ptr<state> st_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  nccl_options opt_;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<ncclComm> owned_;
  std::shared_ptr<int> token_;

  void own(ncclComm_t c) {
    owned_ = std::shared_ptr<ncclComm>(c, [st = st_](ncclComm_t x) {
      if (!st->aborted) ncclCommDestroy(x);
    });
  }
  void abort() {
    if (!st_->aborted) ncclCommAbort(comm_);
    st_->aborted = true;
  }
  static event_ptr make_event() { return detail::make_cuda_event("comm::nccl"); }
  //! The communicator's asynchronous state as a poll result.
  static detail::poll_state async_state(ncclComm_t c, std::string& message) {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(c, &st);
    if (rc != ncclSuccess) st = rc;
    if (st == ncclInProgress) return detail::poll_state::pending;
    if (st != ncclSuccess) {
      message = std::string("NCCL reports ") + ncclGetErrorString(st);
      return detail::poll_state::failed;
    }
    return detail::poll_state::done;
  }
  //! Waits on the host for event e, polling NCCL's asynchronous error, against the timeout.
  void sync_event(cudaEvent_t e, const char* call) {
    LOOM_EXPECTS(!st_->aborted, errc::comm_failure, call, ": the communicator was aborted by an earlier failure");
    detail::poll_until_done(
        call, opt_.timeout,
        [&](std::string& m) {
          const detail::poll_state q = detail::cuda_event_state(e, m);
          if (q != detail::poll_state::pending) return q;
          const detail::poll_state a = async_state(comm_, m);
          return a == detail::poll_state::failed ? a : detail::poll_state::pending;
        },
        [&] { abort(); });
  }
  //! With check_signatures: every rank's (call, element type, count, extra) gathered and compared.
  void check_signature(const char* call, dtype t, std::size_t count, int extra = 0) {
    if (!opt_.check_signatures) return;
    const std::array<std::uint64_t, 4> mine{hasher{}.add_string(call).value(), static_cast<std::uint64_t>(t),
                                            static_cast<std::uint64_t>(count), static_cast<std::uint64_t>(extra)};
    std::vector<std::uint64_t> all(4 * static_cast<std::size_t>(size_));
    host_all_gather(std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all));
    for (int r = 1; r < size_; ++r)
      for (std::size_t f = 0; f < 4; ++f)
        LOOM_EXPECTS(all[4 * static_cast<std::size_t>(r) + f] == all[f], errc::comm_failure, "comm::nccl ", call,
                     ": ranks disagree on the collective (rank ", r, " differs from rank 0 in its ",
                     f == 0   ? "call"
                     : f == 1 ? "element type"
                     : f == 2 ? "count"
                              : "root or operator",
                     ")");
  }

  void check_not_grouped() const {
    LOOM_EXPECTS(st_->group_depth == 0, errc::invalid_argument,
                 "comm::nccl wait: a request cannot be waited inside group_start / group_end");
  }
  void check_peer(const char* call, int peer, int tag) const {
    LOOM_EXPECTS(peer >= 0 && peer < size_, errc::invalid_argument, "comm::nccl ", call, ": peer must be in [0, ",
                 size_, "), got ", peer);
    LOOM_EXPECTS(tag >= 0, errc::invalid_argument, "comm::nccl ", call, ": tag must be >= 0, got ", tag);
  }

  //! A request whose event marks the operation just issued (at the outermost group_end when inside a group).
  request record() {
    request r;
    r.handle_ = make_event();
    if (st_->group_depth > 0)
      st_->pending.push_back(r.handle_);
    else
      detail::nccl_cuda_check(cudaEventRecord(r.handle_.get(), stream_), "cudaEventRecord");
    return r;
  }
};

}  // namespace loom::comm
