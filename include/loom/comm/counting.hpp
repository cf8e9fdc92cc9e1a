#pragma once

//! @file
//! loom::comm::counting<C>: a communicator that forwards every call to C and records what moved,
//! for tests that assert communication volume and for benchmarks that report time spent waiting.
//!
//! Per rank (copies and split() children share one record):
//!   messages, bytes_out, bytes_in   point-to-point: isend / sendrecv sends, irecv / sendrecv
//!                                   receives (bytes of the payload)
//!   gathered_in                     bytes this rank receives from other ranks in all_gather,
//!                                   all_to_all and all_to_allv (its own block not counted)
//!   scattered_out                   bytes it sends to other ranks in all_to_all(v)
//!   reduced                         payload of all_reduce / reduce_scatter (the input size)
//!   collectives                     number of collective calls
//!   wait_ns                         wall time spent in wait()

#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>

namespace loom::comm {

struct traffic {
  std::atomic<std::int64_t> messages{0}, bytes_out{0}, bytes_in{0}, gathered_in{0}, scattered_out{0}, reduced{0},
      collectives{0}, wait_ns{0};
  [[nodiscard]] double wait_seconds() const { return static_cast<double>(wait_ns.load()) * 1e-9; }
};

template <communicator C>
class counting {
 public:
  using request = typename C::request;
  using memory_space = typename memory_of<C>::type;

  explicit counting(C inner, std::shared_ptr<traffic> record = std::make_shared<traffic>())
      : inner_(std::move(inner)), t_(std::move(record)) {}

  [[nodiscard]] const traffic& counts() const noexcept { return *t_; }
  [[nodiscard]] C& inner() noexcept { return inner_; }

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }

  template <class T>
  request isend(std::span<T> data, int dest, int tag) {
    ++t_->messages;
    t_->bytes_out += static_cast<std::int64_t>(data.size_bytes());
    return inner_.isend(data, dest, tag);
  }
  template <class T>
  request irecv(std::span<T> data, int src, int tag) {
    t_->bytes_in += static_cast<std::int64_t>(data.size_bytes());
    return inner_.irecv(data, src, tag);
  }
  void wait(request& req) {
    const auto t0 = std::chrono::steady_clock::now();
    inner_.wait(req);
    t_->wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }
  template <class S, class R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    ++t_->messages;
    t_->bytes_out += static_cast<std::int64_t>(send.size_bytes());
    t_->bytes_in += static_cast<std::int64_t>(recv.size_bytes());
    inner_.sendrecv(send, dest, recv, src, tag);
  }
  template <class S, class R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    ++t_->collectives;
    t_->gathered_in += static_cast<std::int64_t>(recv.size_bytes() - send.size_bytes());
    inner_.all_gather(send, recv);
  }
  //! The control-plane all_gather (comm::host_all_gather), counted as all_gather.
  template <class S, class R>
  void host_all_gather(std::span<S> send, std::span<R> recv) {
    ++t_->collectives;
    t_->gathered_in += static_cast<std::int64_t>(recv.size_bytes() - send.size_bytes());
    comm::host_all_gather(inner_, std::span<const R>(send), recv);
  }
  //! The control-plane all_reduce (comm::host_all_reduce), counted as all_reduce.
  template <class S, class R>
  void host_all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    ++t_->collectives;
    t_->reduced += static_cast<std::int64_t>(send.size_bytes());
    comm::host_all_reduce(inner_, std::span<const R>(send), recv, op);
  }
  //! Stream ordering (comm/stream_order.hpp), where the inner communicator has it.
  template <class B>
  requires requires(C& c, const B& b) { c.after(b); }
  void after(const B& b) { inner_.after(b); }
  template <class B>
  requires requires(C& c, const B& b) { c.before(b); }
  void before(const B& b) { inner_.before(b); }
  template <class B>
  requires requires(C& c, request& r, const B& b) { c.wait(r, b); }
  void wait(request& req, const B& b) { inner_.wait(req, b); }

  template <class S, class R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    ++t_->collectives;
    const auto own = static_cast<std::int64_t>(send.size_bytes()) / size();
    t_->scattered_out += static_cast<std::int64_t>(send.size_bytes()) - own;
    t_->gathered_in += static_cast<std::int64_t>(recv.size_bytes()) - own;
    inner_.all_to_all(send, recv);
  }
  template <class S, class R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    ++t_->collectives;
    const auto me = static_cast<std::size_t>(rank());
    for (std::size_t r = 0; r < send_counts.size(); ++r)
      if (r != me) {
        t_->scattered_out += static_cast<std::int64_t>(send_counts[r] * sizeof(R));
        if (r < recv_counts.size()) t_->gathered_in += static_cast<std::int64_t>(recv_counts[r] * sizeof(R));
      }
    inner_.all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }
  template <class S, class R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    ++t_->collectives;
    t_->reduced += static_cast<std::int64_t>(send.size_bytes());
    inner_.all_reduce(send, recv, op);
  }
  template <class S, class R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    ++t_->collectives;
    t_->reduced += static_cast<std::int64_t>(send.size_bytes());
    inner_.reduce_scatter(send, recv, op);
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    ++t_->collectives;
    if (rank() != root) t_->gathered_in += static_cast<std::int64_t>(data.size_bytes());
    inner_.broadcast(data, root);
  }
  void barrier() {
    ++t_->collectives;
    inner_.barrier();
  }
  counting split(int color, int key) { return counting(inner_.split(color, key), t_); }

 private:
  C inner_;
  std::shared_ptr<traffic> t_;
};

}  // namespace loom::comm
