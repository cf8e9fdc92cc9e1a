#pragma once

//! @file
//! comm::local: P ranks as threads of one process. The communicator of tests and of one machine.
//!
//!   loom::comm::run_local(4, [](loom::comm::local& comm) { ... comm.all_reduce(x, x, sum); ... });
//!
//! Safety net (each a loom::error, never a hang or a silent truncation):
//! - a collective whose ranks disagree (different call, element type, count, op or root) throws
//!   comm_failure on every rank, naming the call and the ranks that differ;
//! - a rank that does not arrive within the timeout makes the waiting ranks throw errc::timeout
//!   naming the call; a rank whose function returned is reported at once;
//! - an exception in one rank releases the others and run_local rethrows the original exception;
//!   a rank still running one timeout after the first failure is reported by number (run_local
//!   never waits longer than that for it);
//! - a rank that returns with requests it never waited on is an error; waiting a request twice
//!   (or a copy of a waited one) is a no-op;
//! - a send and its matching receive whose buffers overlap throw invalid_argument.
//! Collectives combine ranks in rank order, so reductions are bitwise reproducible.

#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/local_state.hpp>
#include <loom/comm/detail/timeout.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace loom::comm {

//! Options of run_local.
struct local_options {
  //! How long a rank waits for its peers in any call before failing with errc::timeout, and how
  //! long run_local waits for the remaining ranks after the first failure. Must be > 0. The
  //! default reads LOOM_COMM_TIMEOUT_MS (see default_timeout(), which throws on a malformed value).
  std::chrono::milliseconds timeout = default_timeout();
};

class local;
template <class F>
auto run_local(int ranks, F&& fn, local_options options = {});

//! One rank's handle. Cheap to copy; use it from the rank's own thread only.
class local {
 public:
  //! A pending isend / irecv. Default-constructed: an empty request (wait returns at once).
  using request = basic_request<local, std::shared_ptr<detail::p2p_op>>;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return g_->size; }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    using U = std::remove_const_t<T>;
    check_peer("isend", "dest", dest, tag);
    auto op = std::make_shared<detail::p2p_op>(true, rank_, dest, tag, dtype_of<U>(), sizeof(U), data.size(),
                                               as_bytes_ptr(data.data()), nullptr);
    post(op);
    return request(std::move(op));
  }

  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    check_peer("irecv", "src", src, tag);
    auto op = std::make_shared<detail::p2p_op>(false, rank_, src, tag, dtype_of<T>(), sizeof(T), data.size(), nullptr,
                                               reinterpret_cast<std::byte*>(data.data()));
    post(op);
    return request(std::move(op));
  }

  //! Completes the request. Waits at most the run's timeout for the peer.
  //! @throws loom::error: comm_failure (the counts or types of the pair differ, the peer returned
  //! without a matching call, the run was aborted by another rank's failure), invalid_argument (the
  //! send and receive buffers overlap), timeout (no matching peer within the timeout: the run is
  //! aborted). An empty request, or one that was already waited (through any copy), returns at once.
  void wait(request& req) {
    if (!req.handle_) return;
    auto& w = *g_->w;
    std::unique_lock lk(w.m);
    const auto op = req.handle_;
    if (op->waited) {  // a copy of this request was waited already: it counts once
      req.handle_.reset();
      return;
    }
    const auto deadline = detail::deadline_after(w.timeout);
    while (!op->done) {
      const std::string what = describe(*op);
      if (w.aborted) throw error(errc::comm_failure, what + ": aborted: " + w.abort_reason);
      if (w.finished[static_cast<std::size_t>(g_->members[static_cast<std::size_t>(op->peer)])]) {
        const std::string msg = what + ": rank " + std::to_string(op->peer) + " returned without a matching " +
                                (op->is_send ? "irecv" : "isend");
        w.abort(msg);
        throw error(errc::comm_failure, msg);
      }
      if (w.cv.wait_until(lk, deadline) == std::cv_status::timeout && !op->done) {
        const std::string msg = what + ": timed out after " + std::to_string(w.timeout.count()) +
                                " ms waiting for rank " + std::to_string(op->peer);
        w.abort(msg);
        throw error(errc::timeout, msg);
      }
    }
    op->waited = true;
    --w.outstanding[global_rank()];
    req.handle_.reset();
    if (!op->error.empty()) throw error(op->code, op->error);
  }

  //! Sends to dest and receives from src at once; the step of a ring.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    request r = irecv(recv, src, tag);
    request s = isend(send, dest, tag);
    wait(s);
    wait(r);
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    auto d = desc<R>(detail::coll_kind::all_gather, send, recv);
    collective(d, [&](const std::vector<detail::coll_desc>& slots, std::byte* out) {
      const std::size_t bytes = send.size_bytes();
      for (int q = 0; q < size(); ++q)
        if (bytes) std::memcpy(out + static_cast<std::size_t>(q) * bytes, slot(slots, q).send, bytes);
    });
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    auto d = desc<R>(detail::coll_kind::all_to_all, send, recv);
    if (send.size() % static_cast<std::size_t>(size()) != 0)
      d.local_error = "all_to_all: send holds " + std::to_string(send.size()) +
                      " elements, which is not a multiple of the " + std::to_string(size()) + " ranks";
    else if (recv.size() != send.size())
      d.local_error = "all_to_all: recv holds " + std::to_string(recv.size()) + " elements, expected " +
                      std::to_string(send.size()) + " (the size of send)";
    collective(d, [&](const std::vector<detail::coll_desc>& slots, std::byte* out) {
      const std::size_t block = send.size_bytes() / static_cast<std::size_t>(size());
      for (int q = 0; q < size(); ++q)
        if (block)
          std::memcpy(out + static_cast<std::size_t>(q) * block,
                      slot(slots, q).send + static_cast<std::size_t>(rank_) * block, block);
    });
  }

  //! Counts and displacements are in elements, one per rank.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    auto d = desc<R>(detail::coll_kind::all_to_allv, send, recv);
    d.local_error = check_v("send", send.size(), send_counts, send_displs);
    if (d.local_error.empty()) d.local_error = check_v("recv", recv.size(), recv_counts, recv_displs);
    if (d.local_error.empty()) {
      d.send_counts = send_counts.data();
      d.send_displs = send_displs.data();
      d.recv_counts = recv_counts.data();
      d.recv_displs = recv_displs.data();
    }
    collective(d, [&](const std::vector<detail::coll_desc>& slots, std::byte* out) {
      const auto me = static_cast<std::size_t>(rank_);
      for (int q = 0; q < size(); ++q) {
        const auto& s = slot(slots, q);
        const std::size_t n = recv_counts[static_cast<std::size_t>(q)] * sizeof(R);
        if (n)
          std::memcpy(out + recv_displs[static_cast<std::size_t>(q)] * sizeof(R),
                      s.send + s.send_displs[me] * sizeof(R), n);
      }
    });
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    reduction(detail::coll_kind::all_reduce, send, recv, op, 0, send.size(),
              recv.size() == send.size()
                  ? std::string{}
                  : "all_reduce: recv holds " + std::to_string(recv.size()) + " elements, expected " +
                        std::to_string(send.size()) + " (the size of send)");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    reduction(detail::coll_kind::reduce_scatter, send, recv, op, static_cast<std::size_t>(rank_) * recv.size(),
              recv.size(),
              send.size() == recv.size() * static_cast<std::size_t>(size())
                  ? std::string{}
                  : "reduce_scatter: send holds " + std::to_string(send.size()) + " elements, expected " +
                        std::to_string(size()) + " x " + std::to_string(recv.size()) + " (ranks x recv size)");
  }

  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    auto d = desc<T>(detail::coll_kind::broadcast, std::span<const T>(data), data);
    d.root = root;
    if (root < 0 || root >= size())
      d.local_error = "broadcast: root must be in [0, " + std::to_string(size()) + "), got " + std::to_string(root);
    collective(d, [&](const std::vector<detail::coll_desc>& slots, std::byte* out) {
      if (rank_ != root && data.size()) std::memcpy(out, slot(slots, root).send, data.size_bytes());
    });
  }

  void barrier() {
    detail::coll_desc d;
    d.kind = detail::coll_kind::barrier;
    collective(d, [](const std::vector<detail::coll_desc>&, std::byte*) {});
  }

  //! The ranks with the same color, ordered by (key, rank). Collective over this communicator.
  local split(int color, int key) {
    detail::coll_desc d;
    d.kind = detail::coll_kind::split;
    d.color = color;
    d.key = key;
    if (color < 0) d.local_error = "split: color must be >= 0, got " + std::to_string(color);
    local result;
    collective(d, [&](const std::vector<detail::coll_desc>& slots, std::byte*) {
      std::vector<std::pair<std::pair<int, int>, int>> same;  // ((key, old rank), old rank)
      for (int q = 0; q < size(); ++q)
        if (slot(slots, q).color == color) same.push_back({{slot(slots, q).key, q}, q});
      std::sort(same.begin(), same.end());
      int new_rank = 0;
      std::vector<int> globals;
      for (std::size_t i = 0; i < same.size(); ++i) {
        if (same[i].second == rank_) new_rank = static_cast<int>(i);
        globals.push_back(g_->members[static_cast<std::size_t>(same[i].second)]);
      }
      std::lock_guard lk(g_->w->m);
      auto& entry = g_->splits[{slot(slots, rank_).seq, color}];
      if (!entry.g) entry.g = std::make_shared<detail::group>(g_->w, std::move(globals));
      result = local(entry.g, new_rank);
      if (++entry.takers == entry.g->size) g_->splits.erase({slot(slots, rank_).seq, color});
    });
    return result;
  }

 private:
  template <class F>
  friend auto run_local(int, F&&, local_options);

  local() = default;
  local(std::shared_ptr<detail::group> g, int rank) : g_(std::move(g)), rank_(rank) {}

  std::shared_ptr<detail::group> g_;
  int rank_ = 0;

  template <class T>
  static const std::byte* as_bytes_ptr(T* p) {
    return reinterpret_cast<const std::byte*>(p);
  }
  static const detail::coll_desc& slot(const std::vector<detail::coll_desc>& s, int q) {
    return s[static_cast<std::size_t>(q)];
  }

  void check_peer(const char* call, const char* name, int peer, int tag) const {
    LOOM_EXPECTS(peer >= 0 && peer < size(), errc::invalid_argument, "comm::local ", call, ": ", name,
                 " must be in [0, ", size(), "), got ", peer);
    LOOM_EXPECTS(tag >= 0, errc::invalid_argument, "comm::local ", call, ": tag must be >= 0, got ", tag);
  }

  std::string describe(const detail::p2p_op& op) const {
    return "comm::local wait on rank " + std::to_string(rank_) + " for " + (op.is_send ? "isend(dest=" : "irecv(src=") +
           std::to_string(op.peer) + ", tag=" + std::to_string(op.tag) + ", " + std::to_string(op.count) + " x " +
           std::string(to_string(op.type)) + ")";
  }

  std::string check_v(const char* which, std::size_t n, std::span<const std::size_t> counts,
                      std::span<const std::size_t> displs) const {
    const auto p = static_cast<std::size_t>(size());
    const std::string call = std::string("all_to_allv: ") + which;
    if (counts.size() != p || displs.size() != p)
      return call + "_counts and " + which + "_displs must hold one entry per rank (" + std::to_string(p) + "), got " +
             std::to_string(counts.size()) + " and " + std::to_string(displs.size());
    for (std::size_t q = 0; q < p; ++q)
      if (displs[q] > n || counts[q] > n - displs[q])
        return call + " block for rank " + std::to_string(q) + " [" + std::to_string(displs[q]) + ", " +
               std::to_string(displs[q] + counts[q]) + ") lies outside the buffer of " + std::to_string(n) +
               " elements";
    return {};
  }

  template <class R, class S>
  detail::coll_desc desc(detail::coll_kind kind, std::span<S> send, std::span<R> recv) const {
    detail::coll_desc d;
    d.kind = kind;
    d.type = dtype_of<R>();
    d.elem_size = sizeof(R);
    d.send = as_bytes_ptr(send.data());
    d.send_count = send.size();
    d.recv = reinterpret_cast<std::byte*>(recv.data());
    d.recv_count = recv.size();
    return d;
  }

  void reduce_block(const std::vector<detail::coll_desc>& slots, std::byte* out, std::size_t offset, std::size_t n,
                    reduce_op op) const {
    if (n == 0) return;
    const std::size_t es = slots[0].elem_size;
    std::memcpy(out, slots[0].send + offset * es, n * es);
    for (int q = 1; q < size(); ++q) slots[0].reduce(out, slot(slots, q).send + offset * es, n, op);
  }

  //! all_reduce and reduce_scatter: recv = op over the ranks' send elements [offset, offset + n), or every rank
  //! throws when a rank's `error` is not empty.
  template <class S, class R>
  void reduction(detail::coll_kind kind, std::span<S> send, std::span<R> recv, reduce_op op, std::size_t offset,
                 std::size_t n, std::string error) {
    auto d = desc<R>(kind, send, recv);
    d.op = op;
    d.reduce = &detail::reduce_into<R>;
    d.local_error = std::move(error);
    collective(d, [&](const std::vector<detail::coll_desc>& slots, std::byte* out) {
      reduce_block(slots, out, offset, n, op);
    });
  }

  std::size_t global_rank() const { return static_cast<std::size_t>(g_->members[static_cast<std::size_t>(rank_)]); }
  void post(const std::shared_ptr<detail::p2p_op>& op);
  void throw_if_aborted(const char* call) const;
  void barrier_wait(std::unique_lock<std::mutex>& lk, const detail::coll_desc& d, bool arrival) const;
  std::string validate(const std::vector<detail::coll_desc>& slots) const;

  //! The collective protocol: publish, meet, validate everywhere, move data, meet again.
  template <class Work>
  void collective(detail::coll_desc& d, Work&& work);
};

}  // namespace loom::comm

#include <loom/comm/detail/local_impl.hpp>
