#pragma once

//! @file
//! comm::mpi: wraps an MPI_Comm (the CPU cluster engine). Link loom::mpi. The caller owns
//! MPI_Init / MPI_Finalize (MPI_THREAD_FUNNELED or higher is enough: one thread per rank calls it).
//!
//! - MPI errors become loom::error(comm_failure): the wrapper sets MPI_ERRORS_RETURN on the comm.
//! - No wait is unbounded: every call posts nonblocking MPI operations (MPI_Isend / MPI_Irecv,
//!   MPI_Iallreduce, MPI_Iallgather, MPI_Ialltoall(v), MPI_Ireduce_scatter_block, MPI_Ibcast,
//!   MPI_Ibarrier) and polls them with MPI_Test until options.timeout; past it the call throws
//!   loom::error(timeout) naming the call (or, with options.abort_on_timeout, MPI_Aborts).
//!   After a timeout the communicator and its copies are unusable except for abort() and
//!   destruction: later calls throw comm_failure. An abandoned receive is cancelled, an abandoned
//!   send is freed (MPI may still read its buffer if the peer receives it late); an abandoned
//!   collective cannot be cancelled and may still complete into its buffers.
//! - A receive whose posted count differs from the message is an error (MPI would silently accept a
//!   shorter message).
//! - With options.check_collectives (default on), every collective first agrees on (call, element
//!   type, count, op, root, argument errors) with one small allreduce, so ranks that disagree, or
//!   one rank's bad arguments, throw on every rank instead of corrupting memory or hanging;
//!   all_to_allv also exchanges its per-peer counts, so a sender and receiver that disagree throw
//!   on every rank.
//! - bfloat16 / half reductions use MPI_Op_create operators (reduced through float).

#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/mpi_support.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::comm {

//! One rank's handle on an MPI communicator. Copies share the underlying MPI_Comm and its state
//! (a timeout makes every copy unusable); use them from one thread per rank.
class mpi {
 public:
  //! A pending isend / irecv. Copies share it: once any copy is waited, waiting again is a no-op.
  class request {
   public:
    request() = default;
    [[nodiscard]] bool valid() const noexcept { return p_ && p_->req != MPI_REQUEST_NULL; }

   private:
    friend class mpi;
    std::shared_ptr<detail::mpi_p2p> p_;
  };

  //! Wraps `comm` without owning it and sets MPI_ERRORS_RETURN on it.
  //! @throws loom::error(comm_failure) if MPI is not initialised; loom::error(invalid_argument) if
  //! options.timeout <= 0.
  explicit mpi(MPI_Comm comm = MPI_COMM_WORLD, mpi_options options = {}) : s_(std::make_shared<detail::mpi_state>()) {
    int init = 0;
    MPI_Initialized(&init);
    LOOM_EXPECTS(init, errc::comm_failure, "comm::mpi: MPI_Init has not been called");
    LOOM_EXPECTS(options.timeout.count() > 0, errc::invalid_argument, "comm::mpi: options.timeout must be > 0 ms, got ",
                 options.timeout.count());
    s_->comm = comm;
    s_->options = options;
    detail::mpi_check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    detail::mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] MPI_Comm native() const noexcept { return s_->comm; }
  [[nodiscard]] const mpi_options& options() const noexcept { return s_->options; }
  //! False once a call timed out: every call but abort() then throws comm_failure.
  [[nodiscard]] bool usable() const noexcept { return s_->broken.empty(); }

  //! MPI_Abort(native(), errorcode): ends every process of this communicator (OpenMPI ends the
  //! whole job). Never returns. The way out after a timeout when the peers cannot be trusted to
  //! finish (a rank that skipped a collective, a rank stuck outside MPI).
  [[noreturn]] void abort(int errorcode = 1) const noexcept {
    MPI_Abort(s_->comm, errorcode);
    std::abort();  // MPI_Abort does not return; this only satisfies [[noreturn]]
  }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    using U = std::remove_const_t<T>;
    ensure_usable("isend");
    request r = make_request<U>(true, data.size(), dest, tag);
    detail::mpi_check(MPI_Isend(const_cast<U*>(data.data()), detail::mpi_count<U>(data.size(), "isend"), r.p_->type,
                                dest, tag, s_->comm, &r.p_->req),
                      "isend", "MPI_Isend");
    return r;
  }

  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    ensure_usable("irecv");
    request r = make_request<T>(false, data.size(), src, tag);
    r.p_->expected = detail::mpi_count<T>(data.size(), "irecv");
    detail::mpi_check(MPI_Irecv(data.data(), r.p_->expected, r.p_->type, src, tag, s_->comm, &r.p_->req), "irecv",
                      "MPI_Irecv");
    return r;
  }

  //! Completes the request, waiting at most options().timeout for the peer.
  //! @throws loom::error: timeout (naming the isend / irecv and the peer; the receive is cancelled,
  //! the send freed, the communicator unusable), comm_failure (a receive whose message holds another
  //! count, an MPI error, a communicator already unusable: the request is then cancelled or freed
  //! too). An empty or already waited request returns at once.
  void wait(request& r) {
    if (!r.valid()) return;
    auto& q = *r.p_;
    MPI_Status status;
    if (!usable()) {  // nobody will complete it: release it, so nothing stays pending
      release(r);
      ensure_usable("wait");
    }
    bool done = false;
    if (const int rc = detail::mpi_poll(q.req, &status, detail::deadline_after(s_->options.timeout), done);
        rc != MPI_SUCCESS)
      throw error(errc::comm_failure, describe(q) + ": " + (q.is_send ? "MPI_Isend" : "MPI_Irecv") +
                                          " failed: " + detail::mpi_error_text(rc));
    if (!done && !abandon(q, status))
      timed_out(describe(q) + ": timed out after " + std::to_string(s_->options.timeout.count()) +
                " ms waiting for rank " + std::to_string(q.peer));
    if (q.expected >= 0) {
      int got = 0;
      MPI_Get_count(&status, q.type, &got);
      LOOM_EXPECTS(got == q.expected, errc::comm_failure, "comm::mpi: irecv on rank ", rank_, " from rank ", q.peer,
                   " (tag ", q.tag, ") expects ", q.expected, " elements, but the message held ", got);
    }
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    request rr = irecv(recv, src, tag);
    request sr = isend(send, dest, tag);
    try {
      wait(sr);
    } catch (...) {
      if (!usable()) release(rr);  // the send timed out: cancel the receive rather than leave it posted
      throw;
    }
    wait(rr);
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    const std::size_t n = send.size();
    arg_error bad;
    if (recv.size() != n * static_cast<std::size_t>(size_))
      bad.set(errc::shape_mismatch, "recv holds ", recv.size(), " elements, expected ", size_, " x ", n);
    fits<R>(bad, n);
    agree(k_all_gather, type_code<R>(), n, 0, 0, bad);
    const int c = detail::mpi_count<R>(n);
    // Rank r's own block already in place is MPI_IN_PLACE; any other overlap is staged aside.
    const void* s = n && static_cast<const void*>(send.data()) == recv.data() + static_cast<std::size_t>(rank_) * n
                        ? MPI_IN_PLACE
                        : stage(send, recv);
    run("all_gather", "MPI_Iallgather", [&](MPI_Request* q) {
      return MPI_Iallgather(s, c, detail::mpi_datatype<R>(), recv.data(), c, detail::mpi_datatype<R>(), s_->comm, q);
    });
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    arg_error bad;
    if (send.size() % static_cast<std::size_t>(size_) != 0 || recv.size() != send.size())
      bad.set(errc::shape_mismatch, "send (", send.size(), ") and recv (", recv.size(), ") must be equal multiples of ",
              size_, " ranks");
    const std::size_t block = send.size() / static_cast<std::size_t>(size_);
    fits<R>(bad, block);
    agree(k_all_to_all, type_code<R>(), send.size(), 0, 0, bad);
    const int c = detail::mpi_count<R>(block);
    const void* s = stage(send, recv);
    run("all_to_all", "MPI_Ialltoall", [&](MPI_Request* q) {
      return MPI_Ialltoall(s, c, detail::mpi_datatype<R>(), recv.data(), c, detail::mpi_datatype<R>(), s_->comm, q);
    });
  }

  //! Counts and displacements are in elements, one per rank. With options.check_collectives the
  //! per-peer counts are exchanged first (one MPI_Ialltoall of P integers and one small
  //! MPI_Iallreduce): a rank that sends n elements to a peer that expects m != n throws
  //! comm_failure on every rank, naming both ranks and both counts.
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    const auto p = static_cast<std::size_t>(size_);
    arg_error bad;
    check_v<R>(bad, "send", send.size(), send_counts, send_displs);
    check_v<R>(bad, "recv", recv.size(), recv_counts, recv_displs);
    agree(k_all_to_allv, type_code<R>(), 0, 0, 0, bad);
    if (s_->options.check_collectives && size_ > 1) agree_counts(send_counts, recv_counts);
    auto& ints = s_->ints;
    ints.resize(4 * p);
    for (std::size_t q = 0; q < p; ++q) {
      ints[q] = detail::mpi_count<R>(send_counts[q]);
      ints[p + q] = detail::mpi_count<R>(send_displs[q]);
      ints[2 * p + q] = detail::mpi_count<R>(recv_counts[q]);
      ints[3 * p + q] = detail::mpi_count<R>(recv_displs[q]);
    }
    const void* s = stage(send, recv);
    run("all_to_allv", "MPI_Ialltoallv", [&](MPI_Request* q) {
      return MPI_Ialltoallv(s, ints.data(), ints.data() + p, detail::mpi_datatype<R>(), recv.data(),
                            ints.data() + 2 * p, ints.data() + 3 * p, detail::mpi_datatype<R>(), s_->comm, q);
    });
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    arg_error bad;
    if (recv.size() != send.size())
      bad.set(errc::shape_mismatch, "recv holds ", recv.size(), " elements, expected ", send.size());
    fits<R>(bad, recv.size());
    agree(k_all_reduce, type_code<R>(), send.size(), static_cast<long long>(op), 0, bad);
    const bool in_place = static_cast<const void*>(send.data()) == static_cast<const void*>(recv.data());
#if defined(OPEN_MPI)
    // OpenMPI 4.1's MPI_Iallreduce runs twice as long in place as out of place on 2 ranks once the
    // message is large (51 vs 21 ms for 64 MiB on one node); a staged copy costs ~3 ms of that.
    const bool stage_in_place = in_place && size_ == 2 && recv.size_bytes() >= (std::size_t{1} << 16);
#else
    const bool stage_in_place = false;
#endif
    const void* s = in_place && !stage_in_place ? MPI_IN_PLACE : stage(send, recv);
    run("all_reduce", "MPI_Iallreduce", [&](MPI_Request* q) {
      return MPI_Iallreduce(s, recv.data(), detail::mpi_count<R>(recv.size()), detail::mpi_datatype<R>(),
                            detail::mpi_op<R>(op), s_->comm, q);
    });
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    arg_error bad;
    if (send.size() != recv.size() * static_cast<std::size_t>(size_))
      bad.set(errc::shape_mismatch, "send holds ", send.size(), " elements, expected ", size_, " x ", recv.size());
    fits<R>(bad, recv.size());
    agree(k_reduce_scatter, type_code<R>(), send.size(), static_cast<long long>(op), 0, bad);
    const void* s = stage(send, recv);
    run("reduce_scatter", "MPI_Ireduce_scatter_block", [&](MPI_Request* q) {
      return MPI_Ireduce_scatter_block(s, recv.data(), detail::mpi_count<R>(recv.size()), detail::mpi_datatype<R>(),
                                       detail::mpi_op<R>(op), s_->comm, q);
    });
  }

  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    arg_error bad;
    if (root < 0 || root >= size_) bad.set(errc::invalid_argument, "root must be in [0, ", size_, "), got ", root);
    fits<T>(bad, data.size());
    agree(k_broadcast, type_code<T>(), data.size(), 0, root, bad);
    run("broadcast", "MPI_Ibcast", [&](MPI_Request* q) {
      return MPI_Ibcast(data.data(), detail::mpi_count<T>(data.size()), detail::mpi_datatype<T>(), root, s_->comm, q);
    });
  }

  void barrier() {
    agree(k_barrier, 0, 0, 0, 0, {});
    run("barrier", "MPI_Ibarrier", [&](MPI_Request* q) { return MPI_Ibarrier(s_->comm, q); });
  }

  //! MPI_Comm_split; the new communicator is freed when the last copy goes (before MPI_Finalize)
  //! and inherits the options. The ranks always agree first (even without check_collectives), so
  //! the blocking MPI_Comm_split starts only once every rank has called split.
  mpi split(int color, int key) {
    arg_error bad;
    if (color < 0) bad.set(errc::invalid_argument, "color must be >= 0, got ", color);
    agree(k_split, 0, 0, 0, 0, bad, /*always=*/true);
    MPI_Comm out = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_split(s_->comm, color, key, &out), "split", "MPI_Comm_split");
    mpi result(out, s_->options);
    result.s_->owned = true;
    return result;
  }

 private:
  std::shared_ptr<detail::mpi_state> s_;
  int rank_ = 0, size_ = 1;

  enum call_kind : int {
    k_none,
    k_all_gather,
    k_all_to_all,
    k_all_to_allv,
    k_all_reduce,
    k_reduce_scatter,
    k_broadcast,
    k_barrier,
    k_split
  };
  static constexpr const char* call_name(long long k) {
    constexpr const char* names[] = {"?",           "all_gather", "all_to_all",
                                     "all_to_allv", "all_reduce", "reduce_scatter",
                                     "broadcast",   "barrier",    "split"};
    return k >= 0 && k <= k_split ? names[k] : "?";
  }

  //! An argument error found on this rank alone: reported on every rank by agree().
  struct arg_error {
    errc code = errc::invalid_argument;
    std::string what;
    template <class... Parts>
    void set(errc c, const Parts&... parts) {
      if (!what.empty()) return;
      code = c;
      what = loom::detail::concat(parts...);
    }
  };

  template <class T>
  static void fits(arg_error& bad, std::size_t n) {
    if (!detail::mpi_fits<T>(n)) bad.set(errc::unsupported, n, " elements exceed MPI's int count; split the message");
  }

  template <class T>
  static long long type_code() {
    return static_cast<long long>(dtype_of<T>()) * 1000 + static_cast<long long>(sizeof(T));
  }

  template <class T>
  request make_request(bool is_send, std::size_t n, int peer, int tag) const {
    LOOM_EXPECTS(peer >= 0 && peer < size_, errc::invalid_argument, "comm::mpi ",
                 is_send ? "isend: dest" : "irecv: src", " must be in [0, ", size_, "), got ", peer);
    LOOM_EXPECTS(tag >= 0, errc::invalid_argument, "comm::mpi ", is_send ? "isend" : "irecv",
                 ": tag must be >= 0, got ", tag);
    request r;
    r.p_ = std::make_shared<detail::mpi_p2p>();
    r.p_->type = detail::mpi_datatype<T>();
    r.p_->is_send = is_send;
    r.p_->peer = peer;
    r.p_->tag = tag;
    r.p_->elem = dtype_of<T>();
    r.p_->count = n;
    return r;
  }

  std::string describe(const detail::mpi_p2p& q) const {
    return "comm::mpi wait on rank " + std::to_string(rank_) + " for " + (q.is_send ? "isend(dest=" : "irecv(src=") +
           std::to_string(q.peer) + ", tag=" + std::to_string(q.tag) + ", " + std::to_string(q.count) + " x " +
           std::string(to_string(q.elem)) + ")";
  }

  void ensure_usable(const char* call) const {
    if (!s_->broken.empty())
      throw error(errc::comm_failure, std::string("comm::mpi ") + call + " on rank " + std::to_string(rank_) +
                                          ": the communicator is unusable after an earlier timeout (" + s_->broken +
                                          "); destroy it or call abort()");
  }

  //! A p2p request that missed its deadline: a receive is cancelled (true if the message arrived
  //! meanwhile: the wait succeeds after all), a send is freed; false means timed out.
  bool abandon(detail::mpi_p2p& q, MPI_Status& status) const {
    if (!q.is_send && MPI_Cancel(&q.req) == MPI_SUCCESS) {
      const auto grace = detail::deadline_after(std::min(s_->options.timeout, std::chrono::milliseconds(1000)));
      int done = 0;
      while (!done && detail::clock::now() < grace)
        if (MPI_Test(&q.req, &done, &status) != MPI_SUCCESS) break;
      if (done) {
        int cancelled = 0;
        MPI_Test_cancelled(&status, &cancelled);
        return !cancelled;
      }
    }
    if (q.req != MPI_REQUEST_NULL) MPI_Request_free(&q.req);
    return false;
  }

  //! Cancels (receive) or frees (send) a pending request.
  void release(request& r) const {
    MPI_Status status;
    if (r.valid()) (void)abandon(*r.p_, status);
  }

  //! Marks the communicator unusable and throws errc::timeout (or aborts, if so configured).
  [[noreturn]] void timed_out(const std::string& what) const {
    s_->broken = what;
    detail::mpi_keep_alive(s_);
    if (s_->options.abort_on_timeout) {
      std::fprintf(stderr, "loom::timeout: %s; aborting (mpi_options::abort_on_timeout)\n", what.c_str());
      std::fflush(stderr);
      abort(1);
    }
    throw error(errc::timeout, what + "; the communicator is unusable now: destroy it or call abort()");
  }

  //! Posts one nonblocking collective and completes it within the timeout.
  template <class Post>
  void run(const char* op, const char* call, Post&& post) {
    MPI_Request q = MPI_REQUEST_NULL;
    detail::mpi_check(post(&q), op, call);
    bool done = false;
    detail::mpi_check(detail::mpi_poll(q, MPI_STATUS_IGNORE, detail::deadline_after(s_->options.timeout), done), op,
                      call);
    if (done) return;
    s_->orphans.push_back(q);  // a started collective can be neither cancelled nor freed
    timed_out("comm::mpi " + std::string(op) + " on rank " + std::to_string(rank_) + " (communicator of " +
              std::to_string(size_) + " ranks): " + call + " did not complete within " +
              std::to_string(s_->options.timeout.count()) +
              " ms; a rank has not entered this call (it skipped it, or an earlier one, or is stuck)");
  }

  //! The send buffer, or a copy of it when it overlaps recv (MPI forbids aliasing other than
  //! MPI_IN_PLACE).
  template <class S, class R>
  const void* stage(std::span<S> send, std::span<R> recv) {
    if (!detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes())) return send.data();
    s_->scratch.resize(send.size_bytes());
    std::memcpy(s_->scratch.data(), send.data(), send.size_bytes());
    return s_->scratch.data();
  }

  template <class R>
  void check_v(arg_error& bad, const char* which, std::size_t n, std::span<const std::size_t> counts,
               std::span<const std::size_t> displs) const {
    const auto p = static_cast<std::size_t>(size_);
    if (counts.size() != p || displs.size() != p) {
      bad.set(errc::shape_mismatch, which, "_counts and ", which, "_displs must hold one entry per rank (", p,
              "), got ", counts.size(), " and ", displs.size());
      return;
    }
    for (std::size_t q = 0; q < p; ++q) {
      if (displs[q] > n || counts[q] > n - displs[q])
        bad.set(errc::shape_mismatch, which, " block for rank ", q, " [", displs[q], ", ", displs[q] + counts[q],
                ") lies outside the buffer of ", n, " elements");
      else if (!detail::mpi_fits<R>(displs[q] + counts[q]))
        bad.set(errc::unsupported, which, " block for rank ", q, " ends at element ", displs[q] + counts[q],
                ", beyond MPI's int count; split the message");
    }
  }

  //! All ranks agree on the call's signature and on whether some rank rejected its arguments, or
  //! all throw. Skipped (the local error alone is thrown) without check_collectives or on 1 rank.
  void agree(long long call, long long type, std::size_t count, long long op, long long root, const arg_error& bad,
             bool always = false) {
    const char* name = call_name(call);
    ensure_usable(name);
    const auto local_failure = [&] {
      return error(bad.code, std::string("comm::mpi ") + name + " on rank " + std::to_string(rank_) + ": " + bad.what);
    };
    if ((!s_->options.check_collectives && !always) || size_ == 1) {
      if (!bad.what.empty()) throw local_failure();
      return;
    }
    // The lowest failing rank wins the max: (size - rank) * 16 + code.
    const long long err = bad.what.empty() ? 0 : (size_ - rank_) * 16LL + static_cast<long long>(bad.code);
    const long long mine[6] = {call, type, static_cast<long long>(count), op, root, err};
    long long* both = s_->check;
    for (int i = 0; i < 6; ++i) {
      both[i] = mine[i];
      both[6 + i] = -mine[i];
    }
    run(name, "MPI_Iallreduce (signature check)",
        [&](MPI_Request* q) { return MPI_Iallreduce(MPI_IN_PLACE, both, 12, MPI_LONG_LONG, MPI_MAX, s_->comm, q); });
    static constexpr const char* fields[5] = {"call", "element type", "element count", "reduce op", "root"};
    const auto disagree = [&](int i) {
      return error(errc::comm_failure, std::string("comm::mpi ") + name + " on rank " + std::to_string(rank_) +
                                           ": ranks disagree on the " + fields[i] +
                                           " (this rank: " + std::to_string(mine[i]) + ", range over ranks: [" +
                                           std::to_string(-both[6 + i]) + ", " + std::to_string(both[i]) + "])");
    };
    if (both[0] != -both[6]) throw disagree(0);
    if (!bad.what.empty()) throw local_failure();
    if (both[5] > 0) {
      const long long failing = size_ - both[5] / 16;
      const auto code = static_cast<errc>(both[5] % 16);
      throw error(code, std::string("comm::mpi ") + name + " on rank " + std::to_string(rank_) + ": rank " +
                            std::to_string(failing) + " rejected its arguments (" + std::string(to_string(code)) +
                            "; its own error says why)");
    }
    for (int i = 1; i < 5; ++i)
      if (both[i] != -both[6 + i]) throw disagree(i);
  }

  //! all_to_allv: each rank learns what every peer will send it and compares with its recv_counts;
  //! the lowest rank that finds a mismatch is reported on every rank.
  void agree_counts(std::span<const std::size_t> send_counts, std::span<const std::size_t> recv_counts) {
    const auto p = static_cast<std::size_t>(size_);
    auto& c = s_->counts;
    c.resize(2 * p);
    for (std::size_t q = 0; q < p; ++q) c[q] = static_cast<long long>(send_counts[q]);
    run("all_to_allv", "MPI_Ialltoall (count check)", [&](MPI_Request* q) {
      return MPI_Ialltoall(c.data(), 1, MPI_LONG_LONG, c.data() + p, 1, MPI_LONG_LONG, s_->comm, q);
    });
    int* v = s_->verdict;  // three (value, index) pairs under MPI_MINLOC: value = the reporting rank
    for (int i = 0; i < 6; i += 2) v[i] = INT_MAX, v[i + 1] = 0;
    for (std::size_t q = 0; q < p; ++q)
      if (c[p + q] != static_cast<long long>(recv_counts[q])) {
        // Counts passed agree(), so they fit an int.
        const int at[3] = {static_cast<int>(q), static_cast<int>(c[p + q]), static_cast<int>(recv_counts[q])};
        for (int i = 0; i < 3; ++i) v[2 * i] = rank_, v[2 * i + 1] = at[i];
        break;
      }
    run("all_to_allv", "MPI_Iallreduce (count check)",
        [&](MPI_Request* q) { return MPI_Iallreduce(MPI_IN_PLACE, v, 3, MPI_2INT, MPI_MINLOC, s_->comm, q); });
    if (v[0] != INT_MAX)
      throw error(errc::comm_failure, "comm::mpi all_to_allv on rank " + std::to_string(rank_) +
                                          ": the counts of a pair disagree: rank " + std::to_string(v[1]) + " sends " +
                                          std::to_string(v[3]) + " elements to rank " + std::to_string(v[0]) +
                                          ", which expects " + std::to_string(v[5]) + " from it");
  }
};

}  // namespace loom::comm
