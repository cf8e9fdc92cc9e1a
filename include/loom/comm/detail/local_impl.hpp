#pragma once

//! @file
//! Out-of-class definitions of comm::local: the p2p matching, the collective protocol and run_local.

#include <loom/comm/local.hpp>

namespace loom::comm {

inline void local::throw_if_aborted(const char* call) const {
  const auto& w = *g_->w;
  if (w.aborted)
    throw error(errc::comm_failure, std::string("comm::local ") + call + " on rank " + std::to_string(rank_) +
                                        ": aborted: " + w.abort_reason);
}

inline void local::post(const std::shared_ptr<detail::p2p_op>& op) {
  auto& g = *g_;
  auto& w = *g.w;
  std::unique_lock lk(w.m);
  throw_if_aborted(op->is_send ? "isend" : "irecv");
  ++w.outstanding[global_rank()];
  // Receives wait at the receiver for a send from (src, tag); sends wait at the destination.
  auto& queue =
      op->is_send ? g.recvs_at[static_cast<std::size_t>(op->peer)] : g.sends_to[static_cast<std::size_t>(rank_)];
  auto it = std::find_if(queue.begin(), queue.end(), [&](const auto& other) {
    return (op->is_send ? other->peer == rank_ : other->self == op->peer) && other->tag == op->tag;
  });
  if (it == queue.end()) {
    (op->is_send ? g.sends_to[static_cast<std::size_t>(op->peer)] : g.recvs_at[static_cast<std::size_t>(rank_)])
        .push_back(op);
    return;
  }
  const std::shared_ptr<detail::p2p_op> other = *it;
  queue.erase(it);
  detail::p2p_op& s = op->is_send ? *op : *other;
  detail::p2p_op& r = op->is_send ? *other : *op;
  if (s.type != r.type || s.elem_size != r.elem_size || s.count != r.count) {
    const std::string msg =
        "comm::local: irecv on rank " + std::to_string(r.self) + " from rank " + std::to_string(s.self) + " (tag " +
        std::to_string(s.tag) + ") expects " + std::to_string(r.count) + " x " + std::string(to_string(r.type)) + " (" +
        std::to_string(r.elem_size) + " B each), but the matching isend sent " + std::to_string(s.count) + " x " +
        std::string(to_string(s.type)) + " (" + std::to_string(s.elem_size) + " B each)";
    s.error = r.error = msg;
  } else if (const std::size_t bytes = s.count * s.elem_size;
             bytes && s.sbuf < r.rbuf + bytes && r.rbuf < s.sbuf + bytes) {
    // memcpy of overlapping ranges is undefined; ranks of one process may share memory, and a
    // rank may send to itself.
    const std::string msg = "comm::local: isend(dest=" + std::to_string(r.self) + ", tag=" + std::to_string(s.tag) +
                            ") on rank " + std::to_string(s.self) +
                            " and the matching irecv(src=" + std::to_string(s.self) + ") on rank " +
                            std::to_string(r.self) + ": the receive buffer overlaps the send buffer (" +
                            std::to_string(bytes) + " B each); use separate buffers";
    s.error = r.error = msg;
    s.code = r.code = errc::invalid_argument;
  } else if (s.count) {
    // Both buffers stay put until the ops are done; copy without holding the world lock.
    lk.unlock();
    std::memcpy(r.rbuf, s.sbuf, s.count * s.elem_size);
    lk.lock();
  }
  s.done = r.done = true;
  w.cv.notify_all();
}

inline void local::barrier_wait(std::unique_lock<std::mutex>& lk, const detail::coll_desc& d, bool arrival) const {
  auto& g = *g_;
  auto& w = *g.w;
  const auto gen = g.generation;
  if (++g.arrived == g.size) {
    g.arrived = 0;
    ++g.generation;
    w.cv.notify_all();
    return;
  }
  const auto deadline = detail::deadline_after(w.timeout);
  const std::string call = std::string("comm::local ") + detail::to_string(d.kind) + " (collective #" +
                           std::to_string(d.seq) + " on a communicator of " + std::to_string(g.size) +
                           " ranks) on rank " + std::to_string(rank_);
  while (g.generation == gen) {
    if (w.aborted) throw error(errc::comm_failure, call + ": aborted: " + w.abort_reason);
    if (arrival) {
      for (int q = 0; q < g.size; ++q) {
        const auto uq = static_cast<std::size_t>(q);
        if (g.seq[uq] < d.seq && w.finished[static_cast<std::size_t>(g.members[uq])]) {
          const std::string msg = call + ": rank " + std::to_string(q) + " returned without calling it";
          w.abort(msg);
          throw error(errc::comm_failure, msg);
        }
      }
    }
    if (w.cv.wait_until(lk, deadline) == std::cv_status::timeout && g.generation == gen) {
      const std::string missing = arrival ? g.describe_missing(d.seq) : std::string("some");
      const std::string msg = call + ": timed out after " + std::to_string(w.timeout.count()) + " ms; rank(s) " +
                              missing + " did not arrive";
      w.abort(msg);
      throw error(errc::timeout, msg);
    }
  }
}

inline std::string local::validate(const std::vector<detail::coll_desc>& slots) const {
  const auto& s0 = slots[0];
  const std::string call =
      std::string("comm::local ") + detail::to_string(s0.kind) + " (collective #" + std::to_string(s0.seq) + ")";
  const auto n = [](std::size_t v) { return std::to_string(v); };
  const int p = size();
  for (int q = 1; q < p; ++q)
    if (slot(slots, q).kind != s0.kind)
      return "comm::local collective #" + n(s0.seq) + " mismatch: rank 0 called " + detail::to_string(s0.kind) +
             " but rank " + std::to_string(q) + " called " + detail::to_string(slot(slots, q).kind);
  for (int q = 0; q < p; ++q)
    if (!slot(slots, q).local_error.empty())
      return call + ": rank " + std::to_string(q) + ": " + slot(slots, q).local_error;
  if (s0.kind == detail::coll_kind::barrier || s0.kind == detail::coll_kind::split) return {};
  for (int q = 1; q < p; ++q) {
    const auto& s = slot(slots, q);
    if (s.type != s0.type || s.elem_size != s0.elem_size)
      return call + ": rank 0 passes " + std::string(to_string(s0.type)) + " elements of " + n(s0.elem_size) +
             " B but rank " + std::to_string(q) + " passes " + std::string(to_string(s.type)) + " elements of " +
             n(s.elem_size) + " B";
    if (s.op != s0.op)
      return call + ": rank 0 reduces with " + std::string(to_string(s0.op)) + " but rank " + std::to_string(q) +
             " with " + std::string(to_string(s.op));
    if (s.root != s0.root)
      return call + ": rank 0 names root " + std::to_string(s0.root) + " but rank " + std::to_string(q) +
             " names root " + std::to_string(s.root);
    if (s0.kind != detail::coll_kind::all_to_allv && s.send_count != s0.send_count)
      return call + ": rank 0 contributes " + n(s0.send_count) + " elements but rank " + std::to_string(q) +
             " contributes " + n(s.send_count);
  }
  const auto up = static_cast<std::size_t>(p);
  for (int q = 0; q < p; ++q) {
    const auto& s = slot(slots, q);
    if (s0.kind == detail::coll_kind::all_gather && s.recv_count != up * s0.send_count)
      return call + ": rank " + std::to_string(q) + "'s recv holds " + n(s.recv_count) + " elements, expected " +
             std::to_string(p) + " x " + n(s0.send_count) + " = " + n(up * s0.send_count);
    if (s0.kind == detail::coll_kind::broadcast && s.recv_count != s0.recv_count)
      return call + ": rank 0 broadcasts " + n(s0.recv_count) + " elements but rank " + std::to_string(q) + " passes " +
             n(s.recv_count);
    if (s0.kind == detail::coll_kind::all_to_allv)
      for (int r = 0; r < p; ++r) {
        const auto ur = static_cast<std::size_t>(r), uq = static_cast<std::size_t>(q);
        if (s.send_counts[ur] != slot(slots, r).recv_counts[uq])
          return call + ": rank " + std::to_string(q) + " sends " + n(s.send_counts[ur]) + " elements to rank " +
                 std::to_string(r) + ", which expects " + n(slot(slots, r).recv_counts[uq]) + " from it";
      }
  }
  return {};
}

template <class Work>
void local::collective(detail::coll_desc& d, Work&& work) {
  auto& g = *g_;
  auto& w = *g.w;
  std::unique_lock lk(w.m);
  throw_if_aborted(detail::to_string(d.kind));
  d.seq = ++g.seq[static_cast<std::size_t>(rank_)];
  g.slots[static_cast<std::size_t>(rank_)] = d;
  barrier_wait(lk, d, true);
  // Every rank reads the same slots under the lock, so every rank reaches the same verdict.
  if (std::string err = validate(g.slots); !err.empty()) {
    barrier_wait(lk, d, false);  // nobody may overwrite a slot before all have read them
    throw error(errc::comm_failure, err);
  }
  // A result that overlaps this rank's input is built in scratch: peers read the input until the
  // second meeting.
  const std::size_t out_bytes = d.recv_count * d.elem_size;
  const auto lo = reinterpret_cast<std::uintptr_t>(d.recv), hi = lo + out_bytes;
  const auto slo = reinterpret_cast<std::uintptr_t>(d.send), shi = slo + d.send_count * d.elem_size;
  const bool alias = out_bytes && d.send_count && lo < shi && slo < hi && d.kind != detail::coll_kind::broadcast;
  std::byte* out = d.recv;
  if (alias) {
    auto& scratch = g.scratch[static_cast<std::size_t>(rank_)];
    if (scratch.size() < out_bytes) scratch.resize(out_bytes);
    out = scratch.data();
  }
  lk.unlock();
  work(g.slots, out);
  lk.lock();
  barrier_wait(lk, d, false);
  lk.unlock();
  if (alias) std::memcpy(d.recv, out, out_bytes);
}

namespace detail {
inline std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}
}  // namespace detail

//! Runs fn(local&) on `ranks` threads, one per rank, and waits for all of them. Returns nothing
//! if fn returns void, else a std::vector of the per-rank results (index = rank).
//!
//! While no rank has failed, run_local waits for the ranks as long as they run (a rank may compute
//! for as long as it needs). Once one has failed (thrown, or timed out waiting for a peer), the
//! others are released and run_local waits at most options.timeout more: a rank still running then
//! (spinning, or blocked outside loom) is reported, and its thread is detached. A detached thread
//! keeps running fn; it must not use anything that dies with run_local's caller, and its comm
//! calls throw at once (the run is aborted).
//! @throws the first exception a rank raised that was not a consequence of another rank's failure
//! (the others were released with comm_failure); loom::error(timeout) naming the ranks still
//! running one timeout after the first failure (the message carries that failure);
//! loom::error(invalid_argument) if ranks < 1 or options.timeout <= 0.
template <class F>
auto run_local(int ranks, F&& fn, local_options options) {
  LOOM_EXPECTS(ranks >= 1, errc::invalid_argument, "run_local: ranks must be >= 1, got ", ranks);
  LOOM_EXPECTS(options.timeout.count() > 0, errc::invalid_argument, "run_local: timeout must be > 0 ms, got ",
               options.timeout.count());
  using R = std::invoke_result_t<F&, local&>;
  constexpr bool returns_void = std::is_void_v<R>;
  using slot_t = std::conditional_t<returns_void, char, std::optional<R>>;

  const auto p = static_cast<std::size_t>(ranks);
  auto w = std::make_shared<detail::world>(ranks, options.timeout);
  std::vector<int> members(p);
  std::iota(members.begin(), members.end(), 0);
  auto g = std::make_shared<detail::group>(w, std::move(members));

  // Shared with the rank threads, so a thread detached past the deadline never touches this frame.
  struct outcome {
    explicit outcome(std::size_t n) : results(n), errors(n), primary(n, 0), exited(n, 0) {}
    std::vector<slot_t> results;
    std::vector<std::exception_ptr> errors;
    std::vector<char> primary, exited;  // exited: the thread is past fn and every shared write
  };
  auto out = std::make_shared<outcome>(p);
  auto body = [out, w, g, &fn](int r) {
    const auto ur = static_cast<std::size_t>(r);
    try {
      local comm(g, r);
      if constexpr (returns_void) {
        fn(comm);
      } else {
        out->results[ur] = fn(comm);
      }
      std::lock_guard lk(w->m);
      if (const int n = w->outstanding[ur]; n > 0)
        throw error(errc::comm_failure, "comm::local: rank " + std::to_string(r) + " returned with " +
                                            std::to_string(n) + " request(s) it never waited on");
      w->finished[ur] = 1;
      out->exited[ur] = 1;
      w->cv.notify_all();
    } catch (...) {
      std::lock_guard lk(w->m);
      out->errors[ur] = std::current_exception();
      // Primary: the first failure, whether this rank raised it here or inside a call that aborted
      // the world before throwing (a timeout); errors raised because of another rank's abort follow.
      out->primary[ur] = !w->aborted || w->aborted_by == std::this_thread::get_id();
      w->finished[ur] = 1;
      out->exited[ur] = 1;
      w->abort("rank " + std::to_string(r) + " failed: " + detail::what_of(out->errors[ur]));
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(p);
  for (int r = 0; r < ranks; ++r) threads.emplace_back(body, r);

  std::string stuck;  // ranks still running one timeout after the first failure
  std::string first_failure;
  {
    std::unique_lock lk(w->m);
    const auto all_exited = [&] {
      return std::all_of(out->exited.begin(), out->exited.end(), [](char e) { return e; });
    };
    while (!all_exited()) {
      if (!w->aborted) {
        w->cv.wait(lk);
      } else if (w->cv.wait_until(lk, detail::deadline_after(w->timeout, w->aborted_at)) == std::cv_status::timeout &&
                 !all_exited()) {
        for (std::size_t r = 0; r < p; ++r)
          if (!out->exited[r]) stuck += (stuck.empty() ? "" : ", ") + std::to_string(r);
        first_failure = w->abort_reason;
        break;
      }
    }
  }
  for (std::size_t r = 0; r < p; ++r) {
    // Exited threads finish at once; the others are left to themselves (they own their state).
    bool exited;
    {
      std::lock_guard lk(w->m);
      exited = out->exited[r];
    }
    if (exited || stuck.empty())
      threads[r].join();
    else
      threads[r].detach();
  }
  if (!stuck.empty())
    throw error(errc::timeout, "run_local: rank(s) " + stuck + " still running " + std::to_string(w->timeout.count()) +
                                   " ms after the first failure (" + first_failure +
                                   "); their threads were detached and are still running");

  for (std::size_t r = 0; r < p; ++r)
    if (out->errors[r] && out->primary[r]) std::rethrow_exception(out->errors[r]);
  for (std::size_t r = 0; r < p; ++r)
    if (out->errors[r]) std::rethrow_exception(out->errors[r]);
  if constexpr (!returns_void) {
    std::vector<R> values;
    values.reserve(p);
    for (auto& x : out->results) values.push_back(std::move(*x));
    return values;
  }
}

}  // namespace loom::comm
