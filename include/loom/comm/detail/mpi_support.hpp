#pragma once

//! @file
//! Building blocks of comm::mpi: MPI datatypes and operators for loom's element types, error
//! translation, the shared state of a communicator and its copies, and the bounded completion of
//! a nonblocking MPI call (MPI_Test polled until a deadline).

#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/timeout.hpp>
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
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace loom::comm {

//! Options of comm::mpi.
struct mpi_options {
  //! Agree on every collective's signature first (one extra small allreduce per collective;
  //! all_to_allv also exchanges its per-peer counts), so ranks that disagree, or one rank's bad
  //! arguments, throw on every rank.
  bool check_collectives = true;
  //! How long any call waits for its peers before failing with errc::timeout. Must be > 0. The
  //! default reads LOOM_COMM_TIMEOUT_MS (see default_timeout(), which throws on a malformed value).
  std::chrono::milliseconds timeout = default_timeout();
  //! On a timeout, print the error to stderr and MPI_Abort the communicator (ending every rank)
  //! instead of throwing: for jobs where a rank left behind must not keep the others alive.
  bool abort_on_timeout = false;
};

namespace detail {

inline std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

inline void mpi_check(int rc, const char* call) {
  if (rc != MPI_SUCCESS)
    throw error(errc::comm_failure, std::string("comm::mpi ") + call + " failed: " + mpi_error_text(rc));
}

inline void mpi_check(int rc, const char* op, const char* call) {
  if (rc != MPI_SUCCESS)
    throw error(errc::comm_failure, std::string("comm::mpi ") + op + ": " + call + " failed: " + mpi_error_text(rc));
}

template <class T>
MPI_Datatype mpi_datatype() {
  // Indexed by dtype; 16-bit floats travel as their 2-byte carrier, other types as bytes.
  const MPI_Datatype types[] = {MPI_BYTE,     MPI_INT8_T,   MPI_UINT8_T,  MPI_INT32_T, MPI_UINT32_T, MPI_INT64_T,
                                MPI_UINT64_T, MPI_UINT16_T, MPI_UINT16_T, MPI_FLOAT,   MPI_DOUBLE};
  static_assert(std::size(types) == static_cast<std::size_t>(dtype::f64) + 1);
  return types[static_cast<int>(dtype_of<T>())];
}

//! Whether n elements fit MPI's int count (T's own datatype, or sizeof(T) bytes each).
template <class T>
bool mpi_fits(std::size_t n) {
  const std::size_t limit = static_cast<std::size_t>(INT_MAX) / (dtype_of<T>() == dtype::bytes ? sizeof(T) : 1);
  return n <= limit;
}

//! Elements as MPI sees them; the caller has checked mpi_fits.
template <class T>
int mpi_count(std::size_t n) {
  return static_cast<int>(dtype_of<T>() == dtype::bytes ? n * sizeof(T) : n);
}

//! Elements as MPI sees them, or loom::error(unsupported) naming the call.
template <class T>
int mpi_count(std::size_t n, const char* call) {
  LOOM_EXPECTS(mpi_fits<T>(n), errc::unsupported, "comm::mpi ", call, ": ", n,
               " elements exceed MPI's int count; split the message");
  return mpi_count<T>(n);
}

template <class T, reduce_op Op>
void mpi_user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = apply(Op, a[i], b[i]);
}

//! A new MPI operator applying Op elementwise over T (for types MPI has no operators for).
template <class T, reduce_op Op>
MPI_Op mpi_user_op() {
  MPI_Op o;
  MPI_Op_create(&mpi_user_reduce<T, Op>, 1, &o);
  return o;
}

template <class T>
MPI_Op mpi_op(reduce_op op) {
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
    // MPI has no 16-bit floats: user operators over the 2-byte carrier, created once.
    static const MPI_Op ops[4] = {mpi_user_op<T, reduce_op::sum>(), mpi_user_op<T, reduce_op::prod>(),
                                  mpi_user_op<T, reduce_op::min>(), mpi_user_op<T, reduce_op::max>()};
    return ops[static_cast<int>(op)];
  } else {
    const MPI_Op ops[4] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};  // reduce_op's order
    return ops[static_cast<int>(op)];
  }
}

inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

//! What one wrapped MPI_Comm and all copies of its comm::mpi share. The buffers that MPI reads or
//! writes on the library's behalf live here, so a timed-out call's request may outlive the call.
struct mpi_state {
  MPI_Comm comm = MPI_COMM_NULL;
  mpi_options options;
  bool owned = false;                // a split result: freed with the last copy (unless kept alive after a timeout)
  std::string broken;                // why the communicator is unusable (a timeout); empty while usable
  long long check[12] = {};          // the signature agreement: fields and their negations
  std::vector<long long> counts;     // all_to_allv: send counts, then what each peer sends
  int verdict[6] = {};               // all_to_allv: (rank, peer), (rank, sent), (rank, expected)
  std::vector<int> ints;             // all_to_allv: MPI's int counts and displacements
  std::vector<std::byte> scratch;    // a send staged aside when it overlaps the receive buffer
  std::vector<MPI_Request> orphans;  // collective requests abandoned by a timeout

  ~mpi_state() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned && !finalized) MPI_Comm_free(&comm);  // operations still pending on it complete normally
  }
};

//! Keeps the state of a timed-out communicator alive until the process exits: MPI may still
//! complete its abandoned collectives into the state's buffers.
inline void mpi_keep_alive(std::shared_ptr<mpi_state> s) {
  static std::mutex m;
  static auto* kept = new std::vector<std::shared_ptr<mpi_state>>;  // never freed, on purpose
  std::lock_guard lk(m);
  kept->push_back(std::move(s));
}

//! Polls req with MPI_Test until it completes (done = true) or the deadline passes (done = false,
//! req still active). Spins briefly, then yields between tests (ranks may outnumber cores).
//! Returns MPI's error code (MPI_SUCCESS, or e.g. MPI_ERR_TRUNCATE with done = true).
inline int mpi_poll(MPI_Request& req, MPI_Status* status, clock::time_point deadline, bool& done) {
  for (unsigned spins = 0;; ++spins) {
    int flag = 0;
    const int rc = MPI_Test(&req, &flag, status);
    done = flag != 0;
    if (rc != MPI_SUCCESS) {
      done = true;
      return rc;
    }
    if (done || clock::now() >= deadline) return MPI_SUCCESS;
    if (spins >= 64) std::this_thread::yield();
  }
}

//! A pending isend / irecv; shared by the copies of a comm::mpi::request.
struct mpi_p2p {
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Datatype type = MPI_BYTE;
  bool is_send = false;
  int expected = -1;  // receives: the posted count (MPI's units), checked against the message
  int peer = 0, tag = 0;
  dtype elem = dtype::bytes;
  std::size_t count = 0;  // elements
};

}  // namespace detail
}  // namespace loom::comm
