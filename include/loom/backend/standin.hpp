#pragma once

//! @file
//! loom::standin: a device stand-in on the CPU. It behaves as a GPU does towards the code that
//! drives it, so device schedules (stream order, events, workspaces in device memory, distributed
//! calls over a stream-ordered communicator) run and are checked on any machine:
//! - its memory space, loom::standin_memory, is not host-accessible, so every primitive takes its
//!   device path (and the host paths that read memory directly are rejected at compile time);
//! - a loom::standin_stream executes the work enqueued on it asynchronously, in order, on a worker
//!   thread of its own, after a random delay per operation (seeded; standin_delays), with the items
//!   of a for_each_index in a scrambled order;
//! - a loom::standin_event marks a point of a stream; the host can wait for it and another stream
//!   can be made to wait for it (a real cross-thread completion);
//! - an exception inside an operation is sticky, as a device error is: later operations on that
//!   stream are skipped, and every wait on the stream (fence, event, reduce) rethrows it.
//! A missing wait becomes a data race (reported by ThreadSanitizer) or a wrong result, every run.
//!
//!   loom::standin_stream s({.seed = 7, .max_delay = std::chrono::microseconds(50)});
//!   loom::standin b{&s};
//!   loom::for_each_index(b, n, f);      // returns at once; f runs on s's worker thread
//!   loom::fence(b);                     // waits for it (and rethrows its error, if any)

#include <loom/backend/detail/blocking.hpp>
#include <loom/backend/detail/team.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/backend/traits.hpp>
#include <loom/core/error.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom {

//! The stand-in's device memory: bytes only its streams' operations may touch.
struct standin_memory {
  static constexpr bool host_accessible = false;
  static constexpr std::string_view name() noexcept { return "standin"; }
};

//! Random delays of a stand-in stream: each operation first sleeps a time drawn uniformly from
//! [0, max_delay] (no sleep when max_delay is 0). `seed` also fixes the scrambled item order of
//! for_each_index, so a run is repeatable up to thread scheduling.
struct standin_delays {
  std::uint64_t seed = 0;
  std::chrono::microseconds max_delay{0};
};

class standin_stream;

//! A point in a stand-in stream's order: everything enqueued on it before record().
class standin_event {
 public:
  standin_event() = default;
  //! Marks the work enqueued on `s` so far.
  inline void record(standin_stream& s);
  //! Blocks the host until the marked work has run; rethrows the stream's error. No-op if never recorded.
  inline void synchronize() const;
  //! True when the marked work has run (or nothing was recorded).
  [[nodiscard]] inline bool query() const;

 private:
  friend class standin_stream;
  standin_stream* stream_ = nullptr;
  std::uint64_t ticket_ = 0;
};

//! An in-order queue of operations run by a worker thread of its own (the stand-in's stream).
//! enqueue() may be called from any thread; the destructor waits for the queued work.
class standin_stream {
 public:
  explicit standin_stream(standin_delays delays = {}) : delays_(delays), rng_(delays.seed * 2 + 1) {
    worker_ = std::thread([this] { run(); });
  }
  standin_stream(const standin_stream&) = delete;
  standin_stream& operator=(const standin_stream&) = delete;
  ~standin_stream() {
    {
      std::unique_lock lk(m_);
      cv_.wait(lk, [&] { return done_ == queued_; });
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  //! Appends the callable `op` (run once, on the worker thread, after every earlier operation);
  //! returns its ticket (1, 2, ...). Operations live in a fixed ring of slots allocated with the
  //! stream (a launch allocates nothing; one larger than a slot is boxed on the heap); enqueue
  //! blocks while the ring is full, as a device's launch queue does.
  template <class F>
  std::uint64_t enqueue(F&& op) {
    using D = std::decay_t<F>;
    std::uint64_t t;
    {
      std::unique_lock lk(m_);
      cv_.wait(lk, [&] { return queued_ - done_ < ring_slots; });
      slot& sl = ring_[queued_ % ring_slots];
      if constexpr (sizeof(D) <= slot_bytes && alignof(D) <= alignof(std::max_align_t)) {
        ::new (static_cast<void*>(sl.storage)) D(std::forward<F>(op));
        sl.call = [](void* p) { (*static_cast<D*>(p))(); };
        sl.destroy = [](void* p) { static_cast<D*>(p)->~D(); };
      } else {
        D* boxed = new D(std::forward<F>(op));
        ::new (static_cast<void*>(sl.storage)) D*(boxed);
        sl.call = [](void* p) { (**static_cast<D**>(p))(); };
        sl.destroy = [](void* p) { delete *static_cast<D**>(p); };
      }
      t = ++queued_;
    }
    cv_.notify_all();
    return t;
  }
  //! The ticket of the latest enqueued operation (0 if none).
  [[nodiscard]] std::uint64_t last() const {
    std::lock_guard lk(m_);
    return queued_;
  }
  //! Blocks the calling thread until operation `t` has run, then rethrows the stream's error.
  void wait(std::uint64_t t) const {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return done_ >= t; });
    if (error_) std::rethrow_exception(error_);
  }
  //! Waits for everything enqueued so far (the host side of loom::fence).
  void synchronize() const { wait(last()); }
  //! Waits for everything enqueued so far without looking at the stream's error (for destructors).
  void drain() const noexcept {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return done_ == queued_; });
  }
  //! Makes this stream's later operations wait for the point `e` marks on its stream.
  void wait_event(const standin_event& e) {
    if (e.stream_ == nullptr || e.stream_ == this) return;
    const standin_stream* s = e.stream_;
    const std::uint64_t t = e.ticket_;
    enqueue([s, t] { s->reached(t); });
  }
  //! A random draw from the stream's generator (host side, under the stream's lock).
  std::uint64_t draw() {
    std::lock_guard lk(m_);
    return next();
  }
  [[nodiscard]] bool reached_without_wait(std::uint64_t t) const {
    std::lock_guard lk(m_);
    return done_ >= t;
  }

 private:
  //! Blocks until operation t has run, without looking at this stream's error (a wait of another stream).
  void reached(std::uint64_t t) const {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return done_ >= t; });
  }
  std::uint64_t next() {  // splitmix64
    std::uint64_t z = (rng_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  void run() {
    for (;;) {
      slot* sl = nullptr;
      std::chrono::microseconds delay{0};
      bool skip = false;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || queued_ > done_; });
        if (queued_ == done_) return;
        sl = &ring_[done_ % ring_slots];
        if (delays_.max_delay.count() > 0)
          delay = std::chrono::microseconds(
              static_cast<long long>(next() % static_cast<std::uint64_t>(delays_.max_delay.count() + 1)));
        skip = error_ != nullptr;
      }
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      std::exception_ptr err;
      if (!skip) {
        try {
          sl->call(sl->storage);
        } catch (...) {
          err = std::current_exception();
        }
      }
      sl->destroy(sl->storage);
      {
        std::lock_guard lk(m_);
        if (err && !error_) error_ = err;
        ++done_;
      }
      cv_.notify_all();
    }
  }

  static constexpr std::size_t slot_bytes = 1024, ring_slots = 128;
  struct slot {
    alignas(std::max_align_t) std::byte storage[slot_bytes];
    void (*call)(void*) = nullptr;
    void (*destroy)(void*) = nullptr;
  };

  standin_delays delays_;
  std::uint64_t rng_;
  mutable std::mutex m_;
  mutable std::condition_variable cv_;
  std::unique_ptr<slot[]> ring_ = std::make_unique<slot[]>(ring_slots);
  std::uint64_t queued_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;
};

inline void standin_event::record(standin_stream& s) {
  stream_ = &s;
  ticket_ = s.last();
}
inline void standin_event::synchronize() const {
  if (stream_ != nullptr) stream_->wait(ticket_);
}
inline bool standin_event::query() const { return stream_ == nullptr || stream_->reached_without_wait(ticket_); }

//! The stream of a stand-in policy that names none (as CUDA's default stream): one per process.
inline standin_stream& standin_default_stream() {
  static standin_stream s;
  return s;
}

//! The backend policy: work is enqueued on `stream` (nullptr: standin_default_stream()). Data must
//! be in loom::standin_memory (test buffers, temporary_buffer<standin, T>, a workspace).
struct standin {
  standin_stream* stream = nullptr;
  [[nodiscard]] standin_stream& queue() const { return stream != nullptr ? *stream : standin_default_stream(); }
};

template <>
struct backend_traits<standin> {
  using memory_space = standin_memory;
  static constexpr std::string_view name() noexcept { return "standin"; }
  static void fence(const standin& b) { b.queue().synchronize(); }
  static int concurrency(const standin&) noexcept { return 1; }
  //! loom::copy_bytes: a stream-ordered memcpy (standin_memcpy).
  static void copy(const standin& b, void* dst, const void* src, std::size_t bytes);
};

//! Copies `bytes` bytes from `src` to `dst` in stream order on b (as cudaMemcpyAsync): either side
//! may be host or stand-in memory; host memory must stay valid until the copy has run.
inline void standin_memcpy(const standin& b, void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  b.queue().enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
}

inline void backend_traits<standin>::copy(const standin& b, void* dst, const void* src, std::size_t bytes) {
  standin_memcpy(b, dst, src, bytes);
}

namespace detail {
template <>
struct parallel_impl<standin> {
  //! f over [0, n) as one operation of the stream; the items run in the order
  //! (start + k * stride) mod n, start and stride drawn from the stream (stride coprime to n).
  template <class F>
  static void for_each(const standin& b, index_t n, const F& f) {
    if (n <= 0) return;
    standin_stream& s = b.queue();
    const auto un = static_cast<std::uint64_t>(n);
    const auto start = static_cast<index_t>(s.draw() % un);
    index_t stride = n == 1 ? 1 : static_cast<index_t>(1 + s.draw() % (un - 1));
    while (gcd(stride, n) != 1) --stride;
    s.enqueue([n, f, start, stride] {
      index_t i = start;
      for (index_t k = 0; k < n; ++k) {
        f(i);
        i += stride;
        if (i >= n) i -= n;
      }
    });
  }

  //! Teams as a device runs them, in stream order: one team at a time on team_size threads of
  //! their own (the stream's thread and team_size - 1 started for the operation), with a barrier
  //! that truly waits, so a body that misses one shows.
  static int team_size_max(const standin&) noexcept { return 32; }
  static int team_size_recommended(const standin&) noexcept { return 4; }
  static std::size_t team_scratch_max(const standin&) noexcept { return std::size_t{48} << 10; }
  template <class F>
  static void for_each_team(const standin& b, const team_policy& p, int size, const F& f) {
    const index_t league = p.league_size;
    const std::size_t bytes = p.scratch_bytes;
    b.queue().enqueue([league, bytes, size, f] {
      host_team_state st;
      st.barrier.reset(size);
      st.scratch = host_team_scratch(bytes);
      if (bytes > 0) std::memset(st.scratch, 0xFF, bytes);  // as stand-in scratch: a read before a write shows
      std::atomic<index_t> next{0};
      std::vector<std::thread> members;
      for (int r = 1; r < size; ++r)
        members.emplace_back([&st, &next, league, r, size, &f] { host_team_loop(st, next, league, r, size, f); });
      host_team_loop(st, next, league, 0, size, f);
      for (auto& m : members) m.join();
    });
  }

  //! The fixed blocking of loom::reduce (same bits as serial), run in stream order; the host waits.
  template <class T, class Op, class F>
  static T reduce(const standin& b, index_t n, T init, const Op& op, const F& f) {
    T result = init;
    standin_stream& s = b.queue();
    const std::uint64_t t = s.enqueue([&result, n, op, f] {
      const reduce_blocking blk(n);
      for (index_t k = 0; k < blk.blocks; ++k) result = op(result, fold_block(blk, k, op, f));
    });
    s.wait(t);
    return result;
  }

 private:
  static index_t gcd(index_t a, index_t b) noexcept {
    while (b != 0) {
      const index_t r = a % b;
      a = b;
      b = r;
    }
    return a;
  }
};
}  // namespace detail

//! Stream-ordered stand-in scratch: handed out at once, its bytes set to 0xFF (NaN for every
//! floating-point type, so a read before a write shows), released in stream order after the work
//! enqueued before the destructor.
template <class T>
class temporary_buffer<standin, T, standin_memory> {
 public:
  temporary_buffer(const standin& b, index_t count) : stream_(&b.queue()), count_(count > 0 ? count : 0) {
    const auto bytes = sizeof(T) * static_cast<std::size_t>(count_ > 0 ? count_ : 1);
    data_ = static_cast<T*>(::operator new (bytes, std::align_val_t{workspace_alignment}));
    std::memset(static_cast<void*>(data_), 0xFF, bytes);
    detail::temporary_counter().fetch_add(1, std::memory_order_relaxed);
  }
  temporary_buffer(const temporary_buffer&) = delete;
  temporary_buffer& operator=(const temporary_buffer&) = delete;
  ~temporary_buffer() {
    T* p = data_;
    stream_->enqueue([p] { ::operator delete (static_cast<void*>(p), std::align_val_t{workspace_alignment}); });
  }
  T* data() const noexcept { return data_; }
  std::span<std::byte> bytes() const noexcept {
    return {reinterpret_cast<std::byte*>(data_), sizeof(T) * static_cast<std::size_t>(count_)};
  }

 private:
  standin_stream* stream_;
  index_t count_;
  T* data_ = nullptr;
};

}  // namespace loom
