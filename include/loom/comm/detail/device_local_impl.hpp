#pragma once

//! @file
//! The protocol of comm::device_local (comm/device_local.hpp), written once over a device policy
//! so that it runs on a GPU (cuda_device, device_local.hpp) and on the CPU device stand-in (the
//! tests' standin_device): P ranks as threads of one process sharing one device, each with a
//! communication stream, meeting on the host over comm::local to swap (pointer, bytes, event)
//! triples; the device work is ordered by events only.
//!
//! A device policy D (one per communicator, on its communication stream):
//!   D::backend, D::memory_space, D::stream, D::event (a trivially copyable handle)
//!   D(stream s); s = d.stream_of()
//!   event d.record()                      after the work enqueued on the stream so far
//!   event d.record_on(const backend& b)   after the work enqueued on b so far
//!   d.wait(event e)                       the stream waits for e (no host block)
//!   d.wait_on(const backend& b, event e)  b waits for e
//!   d.copy(void* dst, const void* src, bytes)        stream-ordered, device to device
//!   void* d.scratch(bytes); d.release(void*)         stream-ordered scratch memory
//!   backend d.on()                        a backend policy on the stream (for kernels)
//!   poll_state d.state(event e, std::string& why)    whether e's work has run

#include <loom/backend/parallel.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/poll.hpp>
#include <loom/comm/local.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::comm {

//! Options of comm::device_local.
struct device_local_options {
  //! The host meetings' timeout (comm::local's) and the host waits' (polled events).
  local_options local{};
  //! The device of the ranks (cudaSetDevice in each rank thread of run_device_local).
  int device = 0;
};

namespace detail {

//! What a rank tells its peers about one buffer: where it is, how many bytes, and the event after
//! which it may be read (or, for "done", after which the reader has finished).
template <class Event>
struct device_slot {
  const void* ptr = nullptr;
  std::size_t bytes = 0;
  Event event{};
};

//! dst[i] = src[i] (first) or comm::apply(op, dst[i], src[i]).
template <class R>
struct rank_reduce {
  R* dst;
  const R* src;
  reduce_op op;
  bool first;
  LOOM_HD void operator()(index_t i) const { dst[i] = first ? src[i] : apply(op, dst[i], src[i]); }
};

}  // namespace detail

//! One rank of P ranks sharing one device (see the file comment and comm/device_local.hpp).
//! Copies share the rank's state.
template <class Device>
class basic_device_local {
  using event = typename Device::event;
  using slot = detail::device_slot<event>;

 public:
  using memory_space = typename Device::memory_space;
  using backend_type = typename Device::backend;

  //! The completion point of an isend / irecv on the communication stream.
  using request = basic_request<basic_device_local, std::optional<event>>;

  //! Wraps this rank's comm::local handle; `stream` is the communication stream (not owned).
  basic_device_local(local inner, typename Device::stream stream, device_local_options opt = {})
      : s_(std::make_shared<state>(std::move(inner), stream, opt)) {}

  [[nodiscard]] int rank() const noexcept { return s_->inner.rank(); }
  [[nodiscard]] int size() const noexcept { return s_->inner.size(); }
  [[nodiscard]] typename Device::stream stream() const noexcept { return s_->dev.stream_of(); }

  //! The communication stream waits for the work enqueued on b so far.
  void after(const backend_type& b) { s_->dev.wait(s_->dev.record_on(b)); }
  //! b waits for the communication enqueued so far.
  void before(const backend_type& b) { s_->dev.wait_on(b, s_->dev.record()); }
  //! Blocks the host until every enqueued operation ran (polled against the timeout).
  void synchronize() { sync_event(s_->dev.record(), "comm::device_local synchronize"); }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    check_peer("isend", dest, tag);
    send_host({data.data(), data.size_bytes(), s_->dev.record()}, dest, 2 * tag);
    // The receiver's copy is done after its event: the request, and what later work here waits on.
    s_->dev.wait(recv_host(dest, 2 * tag + 1).event);
    return mark();
  }
  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    check_peer("irecv", src, tag);
    const slot from = recv_host(src, 2 * tag);
    pull(data.data(), from, data.size_bytes(), "irecv");
    send_host({nullptr, 0, s_->dev.record()}, src, 2 * tag + 1);
    return mark();
  }
  //! Blocks the host until the request's operation ran (polled against the timeout).
  void wait(request& r) {
    r.complete([&](auto& e) { sync_event(*e, "comm::device_local wait"); });
  }
  //! Makes b wait for the request's operation (no host block).
  void wait(request& r, const backend_type& b) {
    r.complete([&](auto& e) { s_->dev.wait_on(b, *e); });
  }

  //! One grouped send to dest and receive from src (the ring step): never blocks on the order in
  //! which the ranks issue it.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    check_peer("sendrecv", dest, tag);
    check_peer("sendrecv", src, tag);
    const slot from = swap_host({send.data(), send.size_bytes(), s_->dev.record()}, dest, src, 2 * tag);
    pull(recv.data(), from, recv.size_bytes(), "sendrecv");
    // Tell src its buffer was read; learn when dest has read this rank's.
    s_->dev.wait(swap_host({nullptr, 0, s_->dev.record()}, src, dest, 2 * tag + 1).event);
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    const auto p = static_cast<std::size_t>(size());
    LOOM_EXPECTS(recv.size() == send.size() * p, errc::shape_mismatch, "comm::device_local all_gather: recv holds ",
                 recv.size(), " elements, expected ", p, " x ", send.size());
    gather_slots({send.data(), send.size_bytes(), s_->dev.record()});
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
    const event ready = s_->dev.record();
    for (std::size_t q = 0; q < p; ++q) s_->out[q] = {send.data() + q * b, b * sizeof(R), ready};
    exchange_slots();
    // In place (send and recv the same array): a block is overwritten only after every rank has
    // read it, so each rank first pulls into the scratch, then copies out after the reads.
    const bool in_place = static_cast<const void*>(send.data()) == static_cast<const void*>(recv.data());
    R* to = in_place && b > 0 ? static_cast<R*>(s_->dev.scratch(send.size_bytes())) : recv.data();
    for (std::size_t q = 0; q < p; ++q) pull(to + q * b, s_->in[q], b * sizeof(R), "all_to_all");
    finish_reads();
    if (to != recv.data()) {
      s_->dev.copy(recv.data(), to, send.size_bytes());
      s_->dev.release(to);
    }
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
    const auto s0 = reinterpret_cast<std::uintptr_t>(send.data()), r0 = reinterpret_cast<std::uintptr_t>(recv.data());
    LOOM_EXPECTS(send.empty() || recv.empty() || s0 + send.size_bytes() <= r0 || r0 + recv.size_bytes() <= s0,
                 errc::invalid_argument, "comm::device_local all_to_allv: send and recv must not overlap");
    const event ready = s_->dev.record();
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
    gather_slots({data.data(), data.size_bytes(), s_->dev.record()});
    const slot from = s_->board[static_cast<std::size_t>(root)];
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
  basic_device_local split(int color, int key) {
    synchronize();
    return basic_device_local(s_->inner.split(color, key), s_->dev.stream_of(), s_->opt);
  }

 private:
  struct state {
    local inner;
    Device dev;
    device_local_options opt;
    //! Host boards of one operation (sized once: calls allocate nothing on the host).
    std::vector<slot> board, out, in;
    state(local l, typename Device::stream s, device_local_options o) : inner(std::move(l)), dev(s), opt(o) {
      const auto p = static_cast<std::size_t>(inner.size());
      board.resize(p);
      out.resize(p);
      in.resize(p);
    }
  };
  std::shared_ptr<state> s_;

  void check_peer(const char* call, int peer, int tag) const {
    LOOM_EXPECTS(peer >= 0 && peer < size(), errc::invalid_argument, "comm::device_local ", call,
                 ": peer must be in [0, ", size(), "), got ", peer);
    LOOM_EXPECTS(tag >= 0 && tag < (1 << 29), errc::invalid_argument, "comm::device_local ", call,
                 ": tag must be in [0, 2^29), got ", tag);
  }
  request mark() { return request(s_->dev.record()); }
  //! Copies `bytes` of a peer's buffer into dst once the peer's ready event has fired.
  void pull(void* dst, const slot& from, std::size_t bytes, const char* call) {
    LOOM_EXPECTS(from.bytes == bytes, errc::shape_mismatch, "comm::device_local ", call, ": rank ", rank(), " expects ",
                 bytes, " bytes, the peer sends ", from.bytes);
    if (bytes == 0 || dst == from.ptr) return;
    s_->dev.wait(from.event);
    s_->dev.copy(dst, from.ptr, bytes);
  }
  // Host meetings over comm::local (host memory, complete on return).
  void send_host(const slot& s, int dest, int tag) {
    auto r = s_->inner.isend(std::span<const slot>(&s, 1), dest, tag);
    s_->inner.wait(r);
  }
  slot recv_host(int src, int tag) {
    slot s;
    auto r = s_->inner.irecv(std::span<slot>(&s, 1), src, tag);
    s_->inner.wait(r);
    return s;
  }
  slot swap_host(const slot& mine, int dest, int src, int tag) {
    slot theirs;
    s_->inner.sendrecv(std::span<const slot>(&mine, 1), dest, std::span<slot>(&theirs, 1), src, tag);
    return theirs;
  }
  //! board[q] = rank q's slot.
  void gather_slots(const slot& mine) {
    s_->inner.all_gather(std::span<const slot>(&mine, 1), std::span<slot>(s_->board));
  }
  //! in[q] = the slot rank q filled for this rank in its out[].
  void exchange_slots() { s_->inner.all_to_all(std::span<const slot>(s_->out), std::span<slot>(s_->in)); }
  //! Every rank has issued its reads of the others' buffers: this stream's later work waits for
  //! all of them (so a buffer read by a peer is not overwritten before the read ran).
  void finish_reads() {
    gather_slots({nullptr, 0, s_->dev.record()});
    for (const auto& d : s_->board) s_->dev.wait(d.event);
  }
  //! recv = op over the ranks, in rank order, of elements [offset, offset + n) of their send
  //! buffers (count elements each), through a stream-ordered scratch (in place is safe).
  template <class R>
  void reduce_rows(const R* send, std::size_t count, std::size_t offset, R* recv, std::size_t n, reduce_op op,
                   const char* call) {
    gather_slots({send, count * sizeof(R), s_->dev.record()});
    R* tmp = n > 0 ? static_cast<R*>(s_->dev.scratch(n * sizeof(R))) : nullptr;
    for (std::size_t q = 0; q < s_->board.size(); ++q) {
      const slot from = s_->board[q];
      LOOM_EXPECTS(from.bytes == count * sizeof(R), errc::shape_mismatch, "comm::device_local ", call, ": rank ", q,
                   " holds ", from.bytes, " bytes, rank ", rank(), " ", count * sizeof(R));
      if (n == 0) continue;
      s_->dev.wait(from.event);
      for_each_index(s_->dev.on(), static_cast<index_t>(n),
                     detail::rank_reduce<R>{tmp, static_cast<const R*>(from.ptr) + offset, op, q == 0});
    }
    finish_reads();
    if (n > 0) {
      s_->dev.copy(recv, tmp, n * sizeof(R));
      s_->dev.release(tmp);
    }
  }
  //! Waits on the host for event e, against the timeout.
  void sync_event(event e, const char* call) {
    detail::poll_until_done(
        call, s_->opt.local.timeout, [&](std::string& m) { return s_->dev.state(e, m); }, [] {});
  }
};

}  // namespace loom::comm
