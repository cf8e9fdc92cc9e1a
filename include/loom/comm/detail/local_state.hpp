#pragma once

//! @file
//! Shared state of comm::local: the world of one run_local call and the groups (communicators)
//! inside it. One mutex and condition variable per world keep the protocol simple and let an abort
//! reach every waiting rank; element data is always copied outside the lock.

#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/timeout.hpp>
#include <loom/core/error.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace loom::comm::detail {

//! Everything one run_local call shares: abort state and which ranks have returned.
struct world {
  explicit world(int p, std::chrono::milliseconds t)
      : size(p), timeout(t), finished(static_cast<std::size_t>(p), 0), outstanding(static_cast<std::size_t>(p), 0) {}
  int size;
  std::chrono::milliseconds timeout;
  std::mutex m;
  std::condition_variable cv;
  bool aborted = false;
  std::string abort_reason;
  clock::time_point aborted_at{};  // when the first failure happened: run_local's wait is bounded from it
  std::thread::id aborted_by{};    // the thread that raised it: its error is the cause, the others' follow
  std::vector<char> finished;      // by global rank: its function has returned
  std::vector<int> outstanding;    // by global rank: requests posted and not yet waited on

  void abort(std::string reason) {  // caller holds m
    if (!aborted) {
      aborted = true;
      abort_reason = std::move(reason);
      aborted_at = clock::now();
      aborted_by = std::this_thread::get_id();
    }
    cv.notify_all();
  }
};

enum class coll_kind : std::uint8_t {
  barrier,
  all_gather,
  all_to_all,
  all_to_allv,
  all_reduce,
  reduce_scatter,
  broadcast,
  split
};

constexpr const char* to_string(coll_kind k) noexcept {
  constexpr const char* names[] = {"barrier",    "all_gather",     "all_to_all", "all_to_allv",
                                   "all_reduce", "reduce_scatter", "broadcast",  "split"};
  return names[static_cast<int>(k)];
}

using reduce_fn = void (*)(std::byte* acc, const std::byte* x, std::size_t n, reduce_op op);

template <reducible T>
void reduce_into(std::byte* acc, const std::byte* x, std::size_t n, reduce_op op) {
  auto* a = reinterpret_cast<T*>(acc);
  const auto* b = reinterpret_cast<const T*>(x);
  for (std::size_t i = 0; i < n; ++i) a[i] = apply(op, a[i], b[i]);
}

//! What a rank brings to a collective; compared across ranks before any data moves.
struct coll_desc {
  coll_kind kind = coll_kind::barrier;
  dtype type = dtype::bytes;
  std::size_t elem_size = 0;
  reduce_op op = reduce_op::sum;
  reduce_fn reduce = nullptr;
  int root = 0, color = 0, key = 0;
  const std::byte* send = nullptr;
  std::size_t send_count = 0;
  std::byte* recv = nullptr;
  std::size_t recv_count = 0;
  const std::size_t *send_counts = nullptr, *send_displs = nullptr, *recv_counts = nullptr, *recv_displs = nullptr;
  std::string local_error;  // an argument error found on this rank alone: reported on every rank
  std::uint64_t seq = 0;    // how many collectives this rank has entered on this group
};

//! A posted isend or irecv.
struct p2p_op {
  p2p_op(bool send, int self_, int peer_, int tag_, dtype t, std::size_t es, std::size_t n, const std::byte* s,
         std::byte* r)
      : is_send(send), self(self_), peer(peer_), tag(tag_), type(t), elem_size(es), count(n), sbuf(s), rbuf(r) {}
  bool is_send;
  int self, peer, tag;  // group ranks
  dtype type;
  std::size_t elem_size, count;
  const std::byte* sbuf;
  std::byte* rbuf;
  bool done = false;
  bool waited = false;             // wait() has returned or thrown for it: waiting again is a no-op
  errc code = errc::comm_failure;  // what wait() throws when error is set
  std::string error;
};

struct group;

struct split_entry {
  std::shared_ptr<group> g;
  int takers = 0;
};

//! The ranks of one communicator: members (global ranks), collective slots, p2p queues.
struct group {
  group(std::shared_ptr<world> w_, std::vector<int> members_)
      : w(std::move(w_)),
        members(std::move(members_)),
        size(static_cast<int>(members.size())),
        slots(members.size()),
        seq(members.size(), 0),
        sends_to(members.size()),
        recvs_at(members.size()),
        scratch(members.size()) {}

  std::shared_ptr<world> w;
  std::vector<int> members;  // group rank -> global rank
  int size;
  // collectives
  std::vector<coll_desc> slots;
  std::vector<std::uint64_t> seq;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::map<std::pair<std::uint64_t, int>, split_entry> splits;
  // point to point: unmatched sends by destination, unmatched receives by receiver
  std::vector<std::list<std::shared_ptr<p2p_op>>> sends_to, recvs_at;
  std::vector<std::vector<std::byte>> scratch;  // per rank, reused: results that alias inputs

  std::string describe_missing(std::uint64_t my_seq) const {
    std::string s;
    for (int r = 0; r < size; ++r)
      if (seq[static_cast<std::size_t>(r)] < my_seq) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  }
};

}  // namespace loom::comm::detail
