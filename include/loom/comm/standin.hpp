#pragma once

//! @file
//! comm::standin: the stream-ordered communicator of the device stand-in (backend/standin.hpp),
//! with the semantics comm::nccl has on GPUs, so device schedules of distributed primitives run
//! and are checked on the CPU. P ranks are threads of one process (comm::local underneath).
//!
//!   loom::comm::run_standin(4, [](loom::comm::standin& comm, loom::standin b) {
//!     // b: this rank's compute stream; comm: its communication stream
//!     loom::comm::handoff(b, comm);                 // transfers start after b's work so far
//!     comm.all_gather(mine, theirs);                // enqueued; returns at once
//!     loom::comm::handback(b, comm);                // b's later work sees the result
//!   });
//!
//! - Buffers are in loom::standin_memory (or host memory kept valid until the operation ran).
//! - Every operation is enqueued on the rank's communication stream, runs in issue order, and
//!   returns at once. isend / irecv return a request holding the event recorded after the
//!   operation: wait(req) blocks the host, wait(req, b) makes b's stream wait. As with NCCL, an
//!   isend and an irecv are separate operations of one stream, so two ranks that both send first
//!   block each other (until the timeout): the ring step is sendrecv, which is one grouped operation.
//! - after(b) / before(b) order the communication stream after / before b's stream (what
//!   comm::handoff / comm::handback call); synchronize() waits for the communication stream.
//! - barrier, split, host_all_gather and host_all_reduce (the control plane) complete on return.
//! - A failure inside an operation (a peer that never arrives within the timeout, mismatched
//!   collectives, an aborted run) is sticky on the communication stream and is thrown, naming the
//!   call, by the next wait on it: a request, synchronize(), a control-plane call.

#include <loom/backend/standin.hpp>
#include <loom/comm/local.hpp>
#include <loom/comm/stream_order.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <utility>

namespace loom::comm {

//! A modelled link for comm::standin: every transfer keeps the communication stream busy for
//! latency + bytes / bytes_per_second after it has moved the data (0: no modelled time). Bytes
//! are what the rank receives (a sendrecv: the larger of its two directions, the link being
//! full-duplex; collectives: the bytes from other ranks; all_reduce: twice the buffer).
struct standin_link {
  std::chrono::nanoseconds latency{0};
  double bytes_per_second = 0;
  [[nodiscard]] std::chrono::nanoseconds time_of(std::size_t bytes) const {
    if (bytes_per_second <= 0 && latency.count() == 0) return std::chrono::nanoseconds(0);
    const double s = bytes_per_second > 0 ? static_cast<double>(bytes) / bytes_per_second : 0.0;
    return latency + std::chrono::nanoseconds(static_cast<long long>(s * 1e9));
  }
};

class standin {
  struct state {
    local inner;
    loom::standin_delays delays;
    standin_link link;
    loom::standin_stream stream;
    state(local l, loom::standin_delays d, standin_link k) : inner(std::move(l)), delays(d), link(k), stream(d) {}
    //! The modelled time of a transfer of `bytes`, spent on the communication stream.
    void busy(std::size_t bytes) const {
      const auto t = link.time_of(bytes);
      if (t.count() > 0) std::this_thread::sleep_for(t);
    }
  };

 public:
  using memory_space = loom::standin_memory;

  //! A pending isend / irecv: the point of the communication stream after it.
  using request = basic_request<standin, std::optional<loom::standin_event>>;

  //! Wraps this rank's comm::local handle; the communication stream gets `delays`, transfers the
  //! modelled `link`.
  explicit standin(local inner, loom::standin_delays delays = {}, standin_link link = {})
      : s_(std::make_shared<state>(std::move(inner), delays, link)) {}

  [[nodiscard]] int rank() const noexcept { return s_->inner.rank(); }
  [[nodiscard]] int size() const noexcept { return s_->inner.size(); }
  //! This rank's communication stream.
  [[nodiscard]] loom::standin_stream& stream() const noexcept { return s_->stream; }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    return post<true>(data, dest, tag);
  }
  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    return post<false>(data, src, tag);
  }
  //! Blocks the host until the request's operation ran; throws its failure. Empty: returns at once.
  void wait(request& req) {
    req.complete([](auto& e) { e->synchronize(); });
  }
  //! Makes b's stream wait for the request's operation (no host block).
  void wait(request& req, const loom::standin& b) {
    req.complete([&](auto& e) { b.queue().wait_event(*e); });
  }

  template <class S, class R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    check_peer("sendrecv", "dest", dest, tag);
    check_peer("sendrecv", "src", src, tag);
    enqueue([send, dest, recv, src, tag](local& c) { c.sendrecv(send, dest, recv, src, tag); },
            std::max(send.size_bytes(), recv.size_bytes()));
  }
  template <class S, class R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    enqueue([send, recv](local& c) { c.all_gather(send, recv); }, recv.size_bytes() - send.size_bytes());
  }
  template <class S, class R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    enqueue([send, recv](local& c) { c.all_to_all(send, recv); },
            recv.size_bytes() - recv.size_bytes() / static_cast<std::size_t>(size()));
  }
  //! The counts and displacements are host arrays read when the operation runs.
  template <class S, class R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    std::size_t bytes = 0;
    for (std::size_t r = 0; r < recv_counts.size(); ++r)
      if (static_cast<int>(r) != rank()) bytes += recv_counts[r] * sizeof(R);
    enqueue([=](local& c) { c.all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs); }, bytes);
  }
  template <class S, class R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    enqueue([send, recv, op](local& c) { c.all_reduce(send, recv, op); }, 2 * send.size_bytes());
  }
  template <class S, class R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    enqueue([send, recv, op](local& c) { c.reduce_scatter(send, recv, op); }, send.size_bytes() - recv.size_bytes());
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    enqueue([data, root](local& c) { c.broadcast(data, root); }, data.size_bytes());
  }

  //! Complete on return (after the stream's earlier operations).
  void barrier() {
    enqueue([](local& c) { c.barrier(); });
    synchronize();
  }
  //! An all_gather of host memory, complete on return (comm::host_all_gather).
  template <class S, class R>
  void host_all_gather(std::span<S> send, std::span<R> recv) {
    all_gather(send, recv);
    synchronize();
  }
  //! An all_reduce of host memory, complete on return (comm::host_all_reduce).
  template <class S, class R>
  void host_all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    all_reduce(send, recv, op);
    synchronize();
  }
  //! Collective, complete on return: the communicator of the ranks with the same color, ordered
  //! by (key, rank), with a communication stream of its own.
  standin split(int color, int key) {
    auto out = std::make_shared<std::optional<local>>();
    enqueue([out, color, key](local& c) { *out = c.split(color, key); });
    synchronize();
    loom::standin_delays d = s_->delays;
    d.seed = d.seed * 31 + static_cast<std::uint64_t>(color) + 1;
    return standin(std::move(**out), d, s_->link);
  }

  //! The communication stream waits for the work enqueued on b so far.
  void after(const loom::standin& b) {
    loom::standin_event e;
    e.record(b.queue());
    s_->stream.wait_event(e);
  }
  //! b's stream waits for the communication enqueued so far.
  void before(const loom::standin& b) {
    loom::standin_event e;
    e.record(s_->stream);
    b.queue().wait_event(e);
  }
  //! Blocks the host until every enqueued operation ran; throws the stream's failure.
  void synchronize() const { s_->stream.synchronize(); }

 private:
  template <class F>
  void enqueue(F&& f, std::size_t bytes = 0) {
    s_->stream.enqueue([st = s_.get(), f = std::forward<F>(f), bytes] {
      f(st->inner);
      st->busy(bytes);
    });
  }
  //! isend (Send) or irecv on the communication stream: the inner handle's call, waited there.
  template <bool Send, class T>
  request post(std::span<T> data, int peer, int tag) {
    check_peer(Send ? "isend" : "irecv", Send ? "dest" : "src", peer, tag);
    s_->stream.enqueue([st = s_.get(), data, peer, tag] {
      local::request r;
      if constexpr (Send)
        r = st->inner.isend(data, peer, tag);
      else
        r = st->inner.irecv(data, peer, tag);
      st->inner.wait(r);
      st->busy(data.size_bytes());
    });
    return record();
  }
  //! A request whose event marks the operation just enqueued.
  request record() {
    request r;
    r.handle_.emplace().record(s_->stream);
    return r;
  }
  void check_peer(const char* call, const char* name, int peer, int tag) const {
    LOOM_EXPECTS(peer >= 0 && peer < size(), errc::invalid_argument, "comm::standin ", call, ": ", name,
                 " must be in [0, ", size(), "), got ", peer);
    LOOM_EXPECTS(tag >= 0, errc::invalid_argument, "comm::standin ", call, ": tag must be >= 0, got ", tag);
  }

  std::shared_ptr<state> s_;
};

//! Options of run_standin.
struct standin_options {
  local_options local{};                   //!< the timeout of every wait
  std::uint64_t seed = 0;                  //!< each rank's streams get seeds derived from it
  std::chrono::microseconds max_delay{0};  //!< random delay per operation, on every stream
  standin_link link{};                     //!< the modelled time of every transfer
};

//! Runs fn(comm, b) on `ranks` ranks (threads): b is the rank's compute policy (a stream of its
//! own), comm its stand-in communicator (a communication stream of its own). Both streams are
//! synchronized before the rank returns. Failures as in run_local.
template <class F>
void run_standin(int ranks, F&& fn, standin_options opt = {}) {
  run_local(
      ranks,
      [&](local& c) {
        const auto r = static_cast<std::uint64_t>(c.rank());
        loom::standin_stream compute({.seed = opt.seed * 1000003 + 2 * r, .max_delay = opt.max_delay});
        standin comm(c, {.seed = opt.seed * 1000003 + 2 * r + 1, .max_delay = opt.max_delay}, opt.link);
        // The compute stream may wait on the communication stream: it drains first, on every path.
        struct drain_first {
          loom::standin_stream& s;
          ~drain_first() { s.drain(); }
        } guard{compute};
        fn(comm, loom::standin{&compute});
        comm.synchronize();
        compute.synchronize();
      },
      opt.local);
}

}  // namespace loom::comm
