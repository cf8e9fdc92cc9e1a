#pragma once

//! @file
//! comm::mpi: wraps an MPI_Comm (the CPU cluster engine). Link loom::mpi. The caller owns
//! MPI_Init / MPI_Finalize (MPI_THREAD_FUNNELED or higher is enough: one thread per rank calls it).
//!
//! - MPI errors become loom::error(comm_failure): the wrapper sets MPI_ERRORS_RETURN on the comm.
//! - A receive whose posted count differs from the message is an error (MPI would silently accept a
//!   shorter message).
//! - With options.check_collectives (default on), every collective first agrees on (call, element
//!   type, count, op, root) with one small MPI_Allreduce, so ranks that disagree throw on every
//!   rank instead of corrupting memory or hanging. all_to_allv checks (call, type) only.
//! - bfloat16 / half reductions use MPI_Op_create operators (reduced through float).

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>

// Only MPI's C API is used: keep the deprecated C++ bindings (and their warnings) out.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <climits>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::comm {

namespace detail {

inline void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw error(errc::comm_failure,
              std::string("comm::mpi ") + call + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

template <class T>
MPI_Datatype mpi_datatype() {
  constexpr dtype t = dtype_of<T>();
  if constexpr (t == dtype::i8)
    return MPI_INT8_T;
  else if constexpr (t == dtype::u8)
    return MPI_UINT8_T;
  else if constexpr (t == dtype::i32)
    return MPI_INT32_T;
  else if constexpr (t == dtype::u32)
    return MPI_UINT32_T;
  else if constexpr (t == dtype::i64)
    return MPI_INT64_T;
  else if constexpr (t == dtype::u64)
    return MPI_UINT64_T;
  else if constexpr (t == dtype::f16 || t == dtype::bf16)
    return MPI_UINT16_T;
  else if constexpr (t == dtype::f32)
    return MPI_FLOAT;
  else if constexpr (t == dtype::f64)
    return MPI_DOUBLE;
  else
    return MPI_BYTE;
}

//! Elements as MPI sees them: T's own datatype, or sizeof(T) bytes for other trivially copyable T.
template <class T>
int mpi_count(std::size_t n, const char* call) {
  const std::size_t c = dtype_of<T>() == dtype::bytes ? n * sizeof(T) : n;
  LOOM_EXPECTS(c <= static_cast<std::size_t>(INT_MAX), errc::unsupported, "comm::mpi ", call, ": ", c,
               " elements exceed MPI's int count; split the message");
  return static_cast<int>(c);
}

template <class T, reduce_op Op>
void mpi_user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = apply(Op, a[i], b[i]);
}

template <class T>
MPI_Op mpi_op(reduce_op op) {
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
    // MPI has no 16-bit floats: user operators over the 2-byte carrier, created once.
    static const MPI_Op ops[4] = {[] {
                                    MPI_Op o;
                                    MPI_Op_create(&mpi_user_reduce<T, reduce_op::sum>, 1, &o);
                                    return o;
                                  }(),
                                  [] {
                                    MPI_Op o;
                                    MPI_Op_create(&mpi_user_reduce<T, reduce_op::prod>, 1, &o);
                                    return o;
                                  }(),
                                  [] {
                                    MPI_Op o;
                                    MPI_Op_create(&mpi_user_reduce<T, reduce_op::min>, 1, &o);
                                    return o;
                                  }(),
                                  [] {
                                    MPI_Op o;
                                    MPI_Op_create(&mpi_user_reduce<T, reduce_op::max>, 1, &o);
                                    return o;
                                  }()};
    return ops[static_cast<int>(op)];
  } else {
    switch (op) {
      case reduce_op::sum:
        return MPI_SUM;
      case reduce_op::prod:
        return MPI_PROD;
      case reduce_op::min:
        return MPI_MIN;
      case reduce_op::max:
        return MPI_MAX;
    }
    return MPI_SUM;
  }
}

inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

}  // namespace detail

//! Options of comm::mpi.
struct mpi_options {
  //! Agree on every collective's signature first (one extra small allreduce per collective).
  bool check_collectives = true;
};

//! One rank's handle on an MPI communicator. Copies share the underlying MPI_Comm.
class mpi {
 public:
  //! A pending isend / irecv.
  class request {
   public:
    request() = default;
    [[nodiscard]] bool valid() const noexcept { return req_ != MPI_REQUEST_NULL; }

   private:
    friend class mpi;
    MPI_Request req_ = MPI_REQUEST_NULL;
    MPI_Datatype type_ = MPI_BYTE;
    int expected_ = -1;  // receives: the posted count, checked against the message
    int peer_ = 0, tag_ = 0;
  };

  //! Wraps `comm` without owning it and sets MPI_ERRORS_RETURN on it.
  //! @throws loom::error(comm_failure) if MPI is not initialised.
  explicit mpi(MPI_Comm comm = MPI_COMM_WORLD, mpi_options options = {}) : comm_(comm), options_(options) {
    int init = 0;
    MPI_Initialized(&init);
    LOOM_EXPECTS(init, errc::comm_failure, "comm::mpi: MPI_Init has not been called");
    detail::mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    detail::mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    using U = std::remove_const_t<T>;
    request r;
    r.type_ = detail::mpi_datatype<U>();
    detail::mpi_check(MPI_Isend(const_cast<U*>(data.data()), detail::mpi_count<U>(data.size(), "isend"), r.type_, dest,
                                tag, comm_, &r.req_),
                      "MPI_Isend");
    return r;
  }

  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    request r;
    r.type_ = detail::mpi_datatype<T>();
    r.expected_ = detail::mpi_count<T>(data.size(), "irecv");
    r.peer_ = src;
    r.tag_ = tag;
    detail::mpi_check(MPI_Irecv(data.data(), r.expected_, r.type_, src, tag, comm_, &r.req_), "MPI_Irecv");
    return r;
  }

  void wait(request& r) {
    if (r.req_ == MPI_REQUEST_NULL) return;
    MPI_Status status;
    detail::mpi_check(MPI_Wait(&r.req_, &status), "MPI_Wait");
    if (r.expected_ >= 0) {
      int got = 0;
      MPI_Get_count(&status, r.type_, &got);
      LOOM_EXPECTS(got == r.expected_, errc::comm_failure, "comm::mpi: irecv on rank ", rank_, " from rank ", r.peer_,
                   " (tag ", r.tag_, ") expects ", r.expected_, " elements, but the message held ", got);
    }
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    request rr = irecv(recv, src, tag);
    request sr = isend(send, dest, tag);
    wait(sr);
    wait(rr);
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    agree(1, detail_type<R>(), send.size(), 0, 0);
    LOOM_EXPECTS(recv.size() == send.size() * static_cast<std::size_t>(size_), errc::shape_mismatch,
                 "comm::mpi all_gather: recv holds ", recv.size(), " elements, expected ", size_, " x ", send.size());
    const void* s = stage(send);
    detail::mpi_check(
        MPI_Allgather(s, detail::mpi_count<R>(send.size(), "all_gather"), detail::mpi_datatype<R>(), recv.data(),
                      detail::mpi_count<R>(send.size(), "all_gather"), detail::mpi_datatype<R>(), comm_),
        "MPI_Allgather");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    agree(2, detail_type<R>(), send.size(), 0, 0);
    LOOM_EXPECTS(send.size() % static_cast<std::size_t>(size_) == 0 && recv.size() == send.size(), errc::shape_mismatch,
                 "comm::mpi all_to_all: send (", send.size(), ") and recv (", recv.size(),
                 ") must be equal multiples of ", size_, " ranks");
    const std::size_t block = send.size() / static_cast<std::size_t>(size_);
    const void* s = detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()) ? stage(send, true)
                                                                                                     : send.data();
    detail::mpi_check(MPI_Alltoall(s, detail::mpi_count<R>(block, "all_to_all"), detail::mpi_datatype<R>(), recv.data(),
                                   detail::mpi_count<R>(block, "all_to_all"), detail::mpi_datatype<R>(), comm_),
                      "MPI_Alltoall");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    agree(3, detail_type<R>(), 0, 0, 0);
    const auto p = static_cast<std::size_t>(size_);
    LOOM_EXPECTS(
        send_counts.size() == p && send_displs.size() == p && recv_counts.size() == p && recv_displs.size() == p,
        errc::shape_mismatch, "comm::mpi all_to_allv: counts and displacements need one entry per rank (", p, ")");
    ints_.resize(4 * p);
    for (std::size_t q = 0; q < p; ++q) {
      LOOM_EXPECTS(send_displs[q] + send_counts[q] <= send.size() && recv_displs[q] + recv_counts[q] <= recv.size(),
                   errc::shape_mismatch, "comm::mpi all_to_allv: the block for rank ", q, " lies outside its buffer");
      ints_[q] = detail::mpi_count<R>(send_counts[q], "all_to_allv");
      ints_[p + q] = detail::mpi_count<R>(send_displs[q], "all_to_allv");
      ints_[2 * p + q] = detail::mpi_count<R>(recv_counts[q], "all_to_allv");
      ints_[3 * p + q] = detail::mpi_count<R>(recv_displs[q], "all_to_allv");
    }
    const void* s = detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()) ? stage(send, true)
                                                                                                     : send.data();
    detail::mpi_check(MPI_Alltoallv(s, ints_.data(), ints_.data() + p, detail::mpi_datatype<R>(), recv.data(),
                                    ints_.data() + 2 * p, ints_.data() + 3 * p, detail::mpi_datatype<R>(), comm_),
                      "MPI_Alltoallv");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    agree(4, detail_type<R>(), send.size(), static_cast<long long>(op), 0);
    LOOM_EXPECTS(recv.size() == send.size(), errc::shape_mismatch, "comm::mpi all_reduce: recv holds ", recv.size(),
                 " elements, expected ", send.size());
    const void* s = static_cast<const void*>(send.data()) == static_cast<const void*>(recv.data()) ? MPI_IN_PLACE
                    : detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes())
                        ? stage(send, true)
                        : send.data();
    detail::mpi_check(MPI_Allreduce(s, recv.data(), detail::mpi_count<R>(recv.size(), "all_reduce"),
                                    detail::mpi_datatype<R>(), detail::mpi_op<R>(op), comm_),
                      "MPI_Allreduce");
  }

  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    agree(5, detail_type<R>(), send.size(), static_cast<long long>(op), 0);
    LOOM_EXPECTS(send.size() == recv.size() * static_cast<std::size_t>(size_), errc::shape_mismatch,
                 "comm::mpi reduce_scatter: send holds ", send.size(), " elements, expected ", size_, " x ",
                 recv.size());
    const void* s = detail::overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()) ? stage(send, true)
                                                                                                     : send.data();
    detail::mpi_check(MPI_Reduce_scatter_block(s, recv.data(), detail::mpi_count<R>(recv.size(), "reduce_scatter"),
                                               detail::mpi_datatype<R>(), detail::mpi_op<R>(op), comm_),
                      "MPI_Reduce_scatter_block");
  }

  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    agree(6, detail_type<T>(), data.size(), 0, root);
    detail::mpi_check(
        MPI_Bcast(data.data(), detail::mpi_count<T>(data.size(), "broadcast"), detail::mpi_datatype<T>(), root, comm_),
        "MPI_Bcast");
  }

  void barrier() {
    agree(7, 0, 0, 0, 0);
    detail::mpi_check(MPI_Barrier(comm_), "MPI_Barrier");
  }

  //! MPI_Comm_split; the new communicator is freed when the last copy goes (before MPI_Finalize).
  mpi split(int color, int key) {
    LOOM_EXPECTS(color >= 0, errc::invalid_argument, "comm::mpi split: color must be >= 0, got ", color);
    agree(8, 0, 0, 0, 0);
    MPI_Comm out = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_split(comm_, color, key, &out), "MPI_Comm_split");
    mpi result(out, options_);
    result.owned_ = std::shared_ptr<MPI_Comm>(new MPI_Comm(out), [](MPI_Comm* c) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Comm_free(c);
      delete c;
    });
    return result;
  }

 private:
  MPI_Comm comm_;
  mpi_options options_;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<MPI_Comm> owned_;
  std::vector<int> ints_;
  std::vector<std::byte> scratch_;

  template <class T>
  static long long detail_type() {
    return static_cast<long long>(dtype_of<T>()) * 1000 + static_cast<long long>(sizeof(T));
  }

  //! Copies send aside when it overlaps recv (MPI forbids aliasing other than MPI_IN_PLACE).
  template <class S>
  const void* stage(std::span<S> send, bool copy = false) {
    if (!copy) return send.data();
    scratch_.resize(send.size_bytes());
    if (!send.empty()) std::memcpy(scratch_.data(), send.data(), send.size_bytes());
    return scratch_.data();
  }

  //! All ranks agree on the call's signature, or all throw.
  void agree(long long call, long long type, std::size_t count, long long op, long long root) {
    if (!options_.check_collectives || size_ == 1) return;
    const long long mine[5] = {call, type, static_cast<long long>(count), op, root};
    long long both[10];
    for (int i = 0; i < 5; ++i) {
      both[i] = mine[i];
      both[5 + i] = -mine[i];
    }
    detail::mpi_check(MPI_Allreduce(MPI_IN_PLACE, both, 10, MPI_LONG_LONG, MPI_MAX, comm_), "MPI_Allreduce (check)");
    static constexpr const char* fields[5] = {"call", "element type", "element count", "reduce op", "root"};
    static constexpr const char* calls[9] = {"?",           "all_gather", "all_to_all",
                                             "all_to_allv", "all_reduce", "reduce_scatter",
                                             "broadcast",   "barrier",    "split"};
    for (int i = 0; i < 5; ++i)
      LOOM_EXPECTS(both[i] == -both[5 + i], errc::comm_failure, "comm::mpi ", calls[call], " on rank ", rank_,
                   ": ranks disagree on the ", fields[i], " (this rank: ", mine[i], ", range over ranks: [",
                   -both[5 + i], ", ", both[i], "])");
  }
};

}  // namespace loom::comm
