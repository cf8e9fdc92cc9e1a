#pragma once

// Counting the heap allocations a call makes on the calling thread (every operator new of the test
// executable goes through the counter in catch_main.cpp), and a communicator adaptor whose calls
// are not counted: a plan-taking call must allocate nothing of its own, while the communicator it
// is handed (comm::local queues its messages on the heap) is not the primitive's.

#include <loom/backend/temporary.hpp>
#include <loom/comm/communicator.hpp>

#include <cstdint>
#include <span>
#include <utility>

namespace loom::test {

//! operator new calls on this thread since it started (while counting is not paused).
long long allocations_on_this_thread() noexcept;
//! Pauses (depth > 0) or resumes counting on this thread.
void pause_allocation_count(int delta) noexcept;

//! Pauses the count for its lifetime.
struct uncounted_scope {
  uncounted_scope() noexcept { pause_allocation_count(1); }
  ~uncounted_scope() { pause_allocation_count(-1); }
  uncounted_scope(const uncounted_scope&) = delete;
  uncounted_scope& operator=(const uncounted_scope&) = delete;
};

//! Heap allocations and temporary_buffer constructions made by f() on this thread.
struct allocation_report {
  long long heap = 0;
  long long temporaries = 0;
};
template <class F>
allocation_report count_allocations(F&& f) {
  const long long h0 = allocations_on_this_thread(), t0 = loom::temporary_allocations();
  f();
  return {allocations_on_this_thread() - h0, loom::temporary_allocations() - t0};
}

//! Forwards every call to C with the allocation count paused.
template <comm::communicator C>
class uncounted {
 public:
  using request = typename C::request;
  explicit uncounted(C inner) : inner_(std::move(inner)) {}
  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  template <class T>
  request isend(std::span<T> data, int dest, int tag) {
    uncounted_scope s;
    return inner_.isend(data, dest, tag);
  }
  template <class T>
  request irecv(std::span<T> data, int src, int tag) {
    uncounted_scope s;
    return inner_.irecv(data, src, tag);
  }
  void wait(request& req) {
    uncounted_scope s;
    inner_.wait(req);
  }
  template <class S, class R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    uncounted_scope s;
    inner_.sendrecv(send, dest, recv, src, tag);
  }
  template <class S, class R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    uncounted_scope s;
    inner_.all_gather(send, recv);
  }
  template <class S, class R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    uncounted_scope s;
    inner_.all_to_all(send, recv);
  }
  template <class S, class R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    uncounted_scope s;
    inner_.all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }
  template <class S, class R>
  void all_reduce(std::span<S> send, std::span<R> recv, comm::reduce_op op) {
    uncounted_scope s;
    inner_.all_reduce(send, recv, op);
  }
  template <class S, class R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, comm::reduce_op op) {
    uncounted_scope s;
    inner_.reduce_scatter(send, recv, op);
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    uncounted_scope s;
    inner_.broadcast(data, root);
  }
  void barrier() {
    uncounted_scope s;
    inner_.barrier();
  }
  uncounted split(int color, int key) {
    uncounted_scope s;
    return uncounted(inner_.split(color, key));
  }

 private:
  C inner_;
};

}  // namespace loom::test
