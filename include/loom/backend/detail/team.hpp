#pragma once

//! @file
//! What every backend's for_each_team shares: the policy, and the host side of a team (a barrier
//! that sleeps instead of spinning, the member handle, a grow-only scratch per thread). See
//! loom/backend/parallel.hpp for the contract.

#include <loom/config.hpp>
#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

namespace loom {

//! A cooperative launch: `league_size` teams of `team_size` members each (0: the backend's choice,
//! team_size_recommended), each team with `scratch_bytes` of memory its members share (aligned
//! to team_scratch_alignment).
struct team_policy {
  index_t league_size = 0;
  int team_size = 0;
  std::size_t scratch_bytes = 0;
};

//! Alignment of a team's scratch on every backend.
inline constexpr std::size_t team_scratch_alignment = 16;

namespace detail {

//! The checks every backend's for_each_team makes; returns the team size it runs.
inline int checked_team_size(const team_policy& p, int recommended, int max, std::size_t max_scratch) {
  LOOM_EXPECTS(p.league_size >= 0, errc::invalid_argument, "for_each_team: league_size must be >= 0, got ",
               p.league_size);
  LOOM_EXPECTS(p.team_size >= 0 && p.team_size <= max, errc::invalid_argument,
               "for_each_team: team_size must be in [0, ", max, "] on this backend (0: its choice), got ", p.team_size);
  LOOM_EXPECTS(p.scratch_bytes <= max_scratch, errc::invalid_argument,
               "for_each_team: scratch_bytes must be <= ", max_scratch, " on this backend, got ", p.scratch_bytes);
  return p.team_size == 0 ? recommended : p.team_size;
}

//! A barrier for the threads of one host team: the last to arrive opens the next phase; the others
//! sleep on it (std::atomic::wait), so a team whose member lost its core does not burn the others'.
class host_barrier {
 public:
  void reset(int size) noexcept {
    size_ = size;
    arrived_.store(0, std::memory_order_relaxed);
  }
  void wait() noexcept {
    const std::uint32_t phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.fetch_add(1, std::memory_order_release);
      phase_.notify_all();
    } else {
      while (phase_.load(std::memory_order_acquire) == phase) phase_.wait(phase, std::memory_order_acquire);
    }
  }

 private:
  std::atomic<int> arrived_{0};
  std::atomic<std::uint32_t> phase_{0};
  int size_ = 1;
};

//! The handle a member of a host team gets.
class host_team_member {
 public:
  host_team_member(index_t league_rank, index_t league_size, int rank, int size, void* scratch,
                   host_barrier* barrier) noexcept
      : league_rank_(league_rank),
        league_size_(league_size),
        rank_(rank),
        size_(size),
        scratch_(scratch),
        barrier_(barrier) {}
  index_t league_rank() const noexcept { return league_rank_; }
  index_t league_size() const noexcept { return league_size_; }
  int team_rank() const noexcept { return rank_; }
  int team_size() const noexcept { return size_; }
  //! The team's shared scratch (the policy's scratch_bytes, aligned to team_scratch_alignment).
  void* scratch() const noexcept { return scratch_; }
  //! Every member waits here until all have arrived; writes before it are visible after it.
  void barrier() const noexcept {
    if (size_ > 1) barrier_->wait();
  }

 private:
  index_t league_rank_, league_size_;
  int rank_, size_;
  void* scratch_;
  host_barrier* barrier_;
};

//! This thread's team scratch of at least `bytes` bytes: grows, never shrinks, so a run of
//! for_each_team calls allocates only when a call asks for more than any before it on the thread.
inline void* host_team_scratch(std::size_t bytes) {
  struct block {
    void* p = nullptr;
    std::size_t size = 0;
    ~block() { ::operator delete (p, std::align_val_t{64}); }
  };
  thread_local block b;
  if (bytes > b.size) {
    ::operator delete (b.p, std::align_val_t{64});
    b.p = nullptr;
    b.size = 0;
    b.p = ::operator new (bytes, std::align_val_t{64});
    b.size = bytes;
  }
  return b.p;
}

//! Teams of one member on the calling thread, one after another (backends that run on one thread:
//! their team_size_max is 1).
template <class F>
void run_single_member_teams(index_t league, std::size_t scratch_bytes, const F& f) {
  void* s = host_team_scratch(scratch_bytes);
  for (index_t l = 0; l < league; ++l) f(host_team_member(l, league, 0, 1, s, nullptr));
}

//! One team's shared state on the host: its barrier, the league rank its leader took, its scratch.
struct alignas(64) host_team_state {
  host_barrier barrier;
  std::atomic<index_t> league{0};
  void* scratch = nullptr;
};

//! The loop of member `rank` of a host team of `size` threads (state initialised, every member
//! started): the leader takes the next league rank from `next` and publishes it behind a barrier;
//! all members run it, then meet again before the leader takes another (the scratch is reused).
template <class F>
void host_team_loop(host_team_state& st, std::atomic<index_t>& next, index_t league, int rank, int size, const F& f) {
  for (;;) {
    if (rank == 0) st.league.store(next.fetch_add(1, std::memory_order_relaxed), std::memory_order_relaxed);
    st.barrier.wait();
    const index_t l = st.league.load(std::memory_order_relaxed);
    if (l >= league) return;  // every member read the same l: they leave together
    f(host_team_member(l, league, rank, size, st.scratch, &st.barrier));
    st.barrier.wait();
  }
}

}  // namespace detail
}  // namespace loom
