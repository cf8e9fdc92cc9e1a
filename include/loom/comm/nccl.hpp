#pragma once

//! @file
//! comm::nccl: wraps an ncclComm_t and a cudaStream_t (the GPU engine). Link loom::nccl. Buffers
//! are device pointers. Every operation is stream-ordered on `stream`: wait() orders later work on
//! the stream after the request (it does not block the host); fence the stream to observe results
//! on the host. Host-side misuse (sizes, roots) throws loom::error before anything is enqueued.
//!
//! NCCL has no tags: messages between a pair are matched in issue order, and the tag argument is
//! only checked for >= 0. Separate isend / irecv calls must be grouped (group_start / group_end)
//! when both peers send first, or NCCL serialises them into a deadlock; sendrecv groups itself.
//! Collective-signature checks across ranks are not performed (they would cost a device sync).

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <span>
#include <string>
#include <type_traits>

namespace loom::comm {

namespace detail {

inline void nccl_check(ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess)
    throw error(errc::comm_failure, std::string("comm::nccl ") + call + " failed: " + ncclGetErrorString(rc));
}

inline void nccl_cuda_check(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    throw error(errc::comm_failure, std::string("comm::nccl ") + call + " failed: " + cudaGetErrorString(rc));
}

template <class T>
ncclDataType_t nccl_datatype() {
  constexpr dtype t = dtype_of<T>();
  if constexpr (t == dtype::i8)
    return ncclInt8;
  else if constexpr (t == dtype::u8)
    return ncclUint8;
  else if constexpr (t == dtype::i32)
    return ncclInt32;
  else if constexpr (t == dtype::u32)
    return ncclUint32;
  else if constexpr (t == dtype::i64)
    return ncclInt64;
  else if constexpr (t == dtype::u64)
    return ncclUint64;
  else if constexpr (t == dtype::f16)
    return ncclFloat16;
  else if constexpr (t == dtype::bf16)
    return ncclBfloat16;
  else if constexpr (t == dtype::f32)
    return ncclFloat32;
  else if constexpr (t == dtype::f64)
    return ncclFloat64;
  else
    return ncclUint8;  // other trivially copyable types travel as bytes
}

template <class T>
std::size_t nccl_count(std::size_t n) {
  return dtype_of<T>() == dtype::bytes ? n * sizeof(T) : n;
}

inline ncclRedOp_t nccl_op(reduce_op op) {
  switch (op) {
    case reduce_op::sum:
      return ncclSum;
    case reduce_op::prod:
      return ncclProd;
    case reduce_op::min:
      return ncclMin;
    case reduce_op::max:
      return ncclMax;
  }
  return ncclSum;
}

}  // namespace detail

//! One rank's handle on an NCCL communicator and the stream its operations are ordered on.
class nccl {
 public:
  //! The completion point of an isend / irecv on the stream.
  class request {
   public:
    request() = default;
    [[nodiscard]] bool valid() const noexcept { return event_ != nullptr; }

   private:
    friend class nccl;
    std::shared_ptr<std::remove_pointer_t<cudaEvent_t>> event_;
  };

  //! Wraps `comm` (not owned) with `stream`.
  nccl(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream) {
    detail::nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    detail::nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount");
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  //! ncclGroupStart / ncclGroupEnd: fuse the point-to-point calls in between.
  static void group_start() { detail::nccl_check(ncclGroupStart(), "ncclGroupStart"); }
  static void group_end() { detail::nccl_check(ncclGroupEnd(), "ncclGroupEnd"); }

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

  void wait(request& r) {
    if (!r.event_) return;
    detail::nccl_cuda_check(cudaStreamWaitEvent(stream_, r.event_.get(), 0), "cudaStreamWaitEvent");
    r.event_.reset();
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
    detail::nccl_check(ncclReduceScatter(send.data(), recv.data(), recv.size(), detail::nccl_datatype<R>(),
                                         detail::nccl_op(op), comm_, stream_),
                       "ncclReduceScatter");
  }

  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    LOOM_EXPECTS(root >= 0 && root < size_, errc::invalid_argument, "comm::nccl broadcast: root must be in [0, ", size_,
                 "), got ", root);
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
    detail::nccl_cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  //! ncclCommSplit; the new communicator uses the same stream and is destroyed with its last copy.
  nccl split(int color, int key) {
    LOOM_EXPECTS(color >= 0, errc::invalid_argument, "comm::nccl split: color must be >= 0, got ", color);
    ncclComm_t out = nullptr;
    detail::nccl_check(ncclCommSplit(comm_, color, key, &out, nullptr), "ncclCommSplit");
    nccl result(out, stream_);
    result.owned_ = std::shared_ptr<ncclComm>(out, [](ncclComm_t c) { ncclCommDestroy(c); });
    return result;
  }

 private:
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<ncclComm> owned_;
  std::shared_ptr<int> token_;

  void check_peer(const char* call, int peer, int tag) const {
    LOOM_EXPECTS(peer >= 0 && peer < size_, errc::invalid_argument, "comm::nccl ", call, ": peer must be in [0, ",
                 size_, "), got ", peer);
    LOOM_EXPECTS(tag >= 0, errc::invalid_argument, "comm::nccl ", call, ": tag must be >= 0, got ", tag);
  }

  request record() {
    cudaEvent_t e = nullptr;
    detail::nccl_cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    request r;
    r.event_ = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>(e, [](cudaEvent_t x) { cudaEventDestroy(x); });
    detail::nccl_cuda_check(cudaEventRecord(e, stream_), "cudaEventRecord");
    return r;
  }
};

}  // namespace loom::comm
