#pragma once

// The communicator conformance suite: one body per operation, written against the communicator
// concept, run on comm::local for P = 1..8, on comm::mpi under mpiexec, through comm::any, on the
// device stand-in's comm::standin, and compiled for comm::device_local and comm::nccl (whose
// buffers are device memory: the stream-ordered cases move them through `mirror`). Ranks never
// call Catch2 macros (they are not thread-safe); each rank fills a report that the test's main
// thread checks.

#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>
#include <loom/core/error.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace loom::test {

struct rank_report {
  int checks = 0;
  std::vector<std::string> failures;
  void check(bool ok, const std::string& what) {
    ++checks;
    if (!ok && failures.size() < 20) failures.push_back(what);
  }
};

#define LOOM_RANK_CHECK(report, cond, ...) (report).check((cond), ::loom::detail::concat(#cond, " [", __VA_ARGS__, "]"))

// A value that depends on who sent it and where, exact in every type used below.
inline double pattern(int src, int dst, std::size_t i) {
  return static_cast<double>((src * 131 + dst * 17 + static_cast<int>(i % 97)) % 251);
}

template <class T>
std::span<const T> cspan(const std::vector<T>& v) {
  return {v.data(), v.size()};
}
template <class T>
std::span<T> mspan(std::vector<T>& v) {
  return {v.data(), v.size()};
}

//! How the suite reaches memory of a space: the primary template serves spaces whose pointers are
//! host pointers (host memory, the stand-in's); a device space specialises it (allocate, free,
//! upload, download; tests/comm/device_memory.hpp for cuda_memory).
template <class Space>
struct device_memory {
  static constexpr bool separate = false;
};

//! n elements of T where communicator C moves them, with a host copy: the host writes and checks
//! operator[]; push() before a call, pull() after settle(). On host memory both are one array.
template <class C, class T>
class mirror {
  using space = typename comm::memory_of<C>::type;
  using memory = device_memory<space>;

 public:
  explicit mirror(std::size_t n, T v = T{}) : h_(n, v) {
    if constexpr (memory::separate) d_ = static_cast<T*>(memory::allocate(n * sizeof(T) + 1));
  }
  mirror(const mirror&) = delete;
  mirror& operator=(const mirror&) = delete;
  ~mirror() {
    if constexpr (memory::separate) memory::free(d_);
  }
  T& operator[](std::size_t i) { return h_[i]; }
  const T& operator[](std::size_t i) const { return h_[i]; }
  [[nodiscard]] std::size_t size() const { return h_.size(); }
  [[nodiscard]] const std::vector<T>& host() const { return h_; }
  //! Elements [at, at + n) (all by default) as the communicator takes them.
  std::span<const T> in(std::size_t at = 0, std::size_t n = npos) const { return {ptr() + at, len(at, n)}; }
  std::span<T> out(std::size_t at = 0, std::size_t n = npos) { return {ptr() + at, len(at, n)}; }
  void push() {
    if constexpr (memory::separate) memory::upload(d_, h_.data(), h_.size() * sizeof(T));
  }
  void pull() {
    if constexpr (memory::separate) memory::download(h_.data(), d_, h_.size() * sizeof(T));
  }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  std::size_t len(std::size_t at, std::size_t n) const { return n == npos ? h_.size() - at : n; }
  T* ptr() const {
    if constexpr (memory::separate)
      return d_;
    else
      return const_cast<T*>(h_.data());
  }
  std::vector<T> h_;
  T* d_ = nullptr;
};

//! A stream-ordered communicator (comm::standin, comm::nccl) returns before its operations ran:
//! the host waits for them before it reads a result. Host communicators complete on return.
template <class C>
void settle(C& c) {
  if constexpr (requires { c.synchronize(); }) c.synchronize();
}

template <class C>
void conf_rank_size(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  LOOM_RANK_CHECK(r, me >= 0 && me < p, "rank ", me, " size ", p);
  mirror<C, int> mine(1, me), all(static_cast<std::size_t>(p), -1);
  mine.push();
  all.push();
  c.all_gather(mine.in(), all.out());
  settle(c);
  all.pull();
  for (int q = 0; q < p; ++q) LOOM_RANK_CHECK(r, all[static_cast<std::size_t>(q)] == q, "q=", q);
}

// Ring exchange with sendrecv on an odd, prime length, in both directions.
template <class C>
void conf_sendrecv_ring(C& c, rank_report& r, std::size_t n = 1021) {
  const int p = c.size(), me = c.rank(), right = (me + 1) % p, left = (me + p - 1) % p;
  mirror<C, double> send(n), recv(n, -1);
  for (std::size_t i = 0; i < n; ++i) send[i] = pattern(me, right, i);
  send.push();
  recv.push();
  c.sendrecv(send.in(), right, recv.out(), left, 7);
  settle(c);
  recv.pull();
  for (std::size_t i = 0; i < n; ++i) LOOM_RANK_CHECK(r, recv[i] == pattern(left, me, i), "i=", i);
  for (std::size_t i = 0; i < n; ++i) send[i] = pattern(me, left, i);
  send.push();
  c.sendrecv(send.in(), left, recv.out(), right, 8);
  settle(c);
  recv.pull();
  for (std::size_t i = 0; i < n; ++i) LOOM_RANK_CHECK(r, recv[i] == pattern(right, me, i), "i=", i);
}

// 64 MiB messages around the ring.
template <class C>
void conf_large(C& c, rank_report& r) {
  const std::size_t n = (std::size_t{64} << 20) / sizeof(float);
  const int p = c.size(), me = c.rank(), right = (me + 1) % p, left = (me + p - 1) % p;
  std::vector<float> send(n), recv(n, -1.f);
  for (std::size_t i = 0; i < n; ++i) send[i] = static_cast<float>(pattern(me, right, i));
  c.sendrecv(cspan(send), right, mspan(recv), left, 1);
  settle(c);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += recv[i] != static_cast<float>(pattern(left, me, i));
  LOOM_RANK_CHECK(r, bad == 0, bad, " wrong elements of ", n);
  // And a 64 MiB all_reduce, in place.
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>((me + 1) * (i % 7));
  c.all_reduce(cspan(x), mspan(x), comm::reduce_op::sum);
  settle(c);
  const float ranks_sum = static_cast<float>(p * (p + 1) / 2);
  bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += x[i] != ranks_sum * static_cast<float>(i % 7);
  LOOM_RANK_CHECK(r, bad == 0, bad, " wrong sums of ", n);
}

// Zero-size messages and collectives complete and touch nothing.
template <class C>
void conf_zero_size(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  std::vector<double> empty;
  auto rq = c.irecv(mspan(empty), (me + p - 1) % p, 3);
  auto sq = c.isend(cspan(empty), (me + 1) % p, 3);
  c.wait(sq);
  c.wait(rq);
  std::vector<double> gathered;
  c.all_gather(cspan(empty), mspan(gathered));
  settle(c);
  c.all_reduce(cspan(empty), mspan(empty), comm::reduce_op::sum);
  settle(c);
  c.all_to_all(cspan(empty), mspan(empty));
  settle(c);
  c.broadcast(mspan(empty), 0);
  settle(c);
  LOOM_RANK_CHECK(r, empty.empty() && gathered.empty(), "zero-size calls");
}

// Many outstanding requests: every pair exchanges `k` tagged messages, receives posted in reverse
// tag order before the sends, and `k` same-tag messages that must arrive in order.
template <class C>
void conf_many_outstanding(C& c, rank_report& r, int k = 24) {
  const int p = c.size(), me = c.rank();
  const auto uk = static_cast<std::size_t>(k);
  std::vector<std::vector<std::int64_t>> in(static_cast<std::size_t>(p) * uk, std::vector<std::int64_t>(3, -1));
  std::vector<std::vector<std::int64_t>> out(static_cast<std::size_t>(p) * uk);
  std::vector<typename C::request> reqs;
  for (int q = 0; q < p; ++q)
    for (int t = k - 1; t >= 0; --t)
      reqs.push_back(c.irecv(mspan(in[static_cast<std::size_t>(q) * uk + static_cast<std::size_t>(t)]), q, t));
  for (int q = 0; q < p; ++q)
    for (int t = 0; t < k; ++t) {
      auto& o = out[static_cast<std::size_t>(q) * uk + static_cast<std::size_t>(t)];
      o = {me, q, t};
      reqs.push_back(c.isend(cspan(o), q, t));
    }
  comm::wait_all(c, std::span<typename C::request>(reqs));
  for (int q = 0; q < p; ++q)
    for (int t = 0; t < k; ++t) {
      const auto& v = in[static_cast<std::size_t>(q) * uk + static_cast<std::size_t>(t)];
      LOOM_RANK_CHECK(r, v[0] == q && v[1] == me && v[2] == t, "from ", q, " tag ", t);
    }
  // Same tag, same pair: non-overtaking.
  const int right = (me + 1) % p, left = (me + p - 1) % p;
  std::vector<std::int32_t> got(uk, -1), sent(uk);
  std::vector<typename C::request> ordered;
  for (std::size_t i = 0; i < uk; ++i) ordered.push_back(c.irecv(std::span<std::int32_t>(&got[i], 1), left, 99));
  for (std::size_t i = 0; i < uk; ++i) {
    sent[i] = static_cast<std::int32_t>(i);
    ordered.push_back(c.isend(std::span<const std::int32_t>(&sent[i], 1), right, 99));
  }
  comm::wait_all(c, std::span<typename C::request>(ordered));
  for (std::size_t i = 0; i < uk; ++i) LOOM_RANK_CHECK(r, got[i] == static_cast<std::int32_t>(i), "order ", i);
}

template <class C>
void conf_all_gather(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  const auto up = static_cast<std::size_t>(p);
  const std::size_t n = 7;
  mirror<C, double> send(n), recv(up * n, -1);
  for (std::size_t i = 0; i < n; ++i) send[i] = pattern(me, 0, i);
  send.push();
  recv.push();
  c.all_gather(send.in(), recv.out());
  settle(c);
  recv.pull();
  for (std::size_t q = 0; q < up; ++q)
    for (std::size_t i = 0; i < n; ++i)
      LOOM_RANK_CHECK(r, recv[q * n + i] == pattern(static_cast<int>(q), 0, i), "q=", q, " i=", i);
  // In place: this rank's block of recv is its send.
  mirror<C, bfloat16> all(up * 3);
  for (std::size_t i = 0; i < 3; ++i)
    all[static_cast<std::size_t>(me) * 3 + i] = bfloat16(static_cast<float>(me * 3 + i));
  all.push();
  c.all_gather(all.in(static_cast<std::size_t>(me) * 3, 3), all.out());
  settle(c);
  all.pull();
  for (std::size_t j = 0; j < up * 3; ++j)
    LOOM_RANK_CHECK(r, static_cast<float>(all[j]) == static_cast<float>(j), "j=", j);
  // A struct travels as bytes.
  struct item {
    std::int32_t a;
    float b;
    std::int16_t c;
  };
  mirror<C, item> mine(1, item{me, 0.5f * static_cast<float>(me), static_cast<std::int16_t>(-me)}), items(up);
  mine.push();
  c.all_gather(mine.in(), items.out());
  settle(c);
  items.pull();
  for (int q = 0; q < p; ++q) {
    const auto& it = items[static_cast<std::size_t>(q)];
    LOOM_RANK_CHECK(r, it.a == q && it.b == 0.5f * static_cast<float>(q) && it.c == -q, "item ", q);
  }
}

template <class C>
void conf_all_to_all(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  const auto up = static_cast<std::size_t>(p);
  const std::size_t b = 3;
  mirror<C, float> send(up * b), recv(up * b, -1.f);
  for (std::size_t q = 0; q < up; ++q)
    for (std::size_t i = 0; i < b; ++i) send[q * b + i] = static_cast<float>(pattern(me, static_cast<int>(q), i));
  send.push();
  recv.push();
  c.all_to_all(send.in(), recv.out());
  settle(c);
  recv.pull();
  for (std::size_t q = 0; q < up; ++q)
    for (std::size_t i = 0; i < b; ++i)
      LOOM_RANK_CHECK(r, recv[q * b + i] == static_cast<float>(pattern(static_cast<int>(q), me, i)), "q=", q);
  // In place.
  c.all_to_all(send.in(), send.out());
  settle(c);
  send.pull();
  LOOM_RANK_CHECK(r, send.host() == recv.host(), "in-place all_to_all");
}

template <class C>
void conf_all_to_allv(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  const auto up = static_cast<std::size_t>(p);
  // Rank s sends (s + 2 d + 1) % 4 elements to rank d: uneven, some blocks empty.
  auto count = [](int s, int d) { return static_cast<std::size_t>((s + 2 * d + 1) % 4); };
  std::vector<std::size_t> sc(up), sd(up), rc(up), rd(up);
  std::size_t st = 0, rt = 0;
  for (int q = 0; q < p; ++q) {
    const auto uq = static_cast<std::size_t>(q);
    sc[uq] = count(me, q);
    sd[uq] = st;
    st += sc[uq];
    rc[uq] = count(q, me);
    rd[uq] = rt;
    rt += rc[uq];
  }
  mirror<C, std::int64_t> send(st), recv(rt, -1);
  for (int q = 0; q < p; ++q)
    for (std::size_t i = 0; i < sc[static_cast<std::size_t>(q)]; ++i)
      send[sd[static_cast<std::size_t>(q)] + i] = static_cast<std::int64_t>(pattern(me, q, i));
  send.push();
  recv.push();
  c.all_to_allv(send.in(), cspan(sc), cspan(sd), recv.out(), cspan(rc), cspan(rd));
  settle(c);
  recv.pull();
  for (int q = 0; q < p; ++q)
    for (std::size_t i = 0; i < rc[static_cast<std::size_t>(q)]; ++i)
      LOOM_RANK_CHECK(r, recv[rd[static_cast<std::size_t>(q)] + i] == static_cast<std::int64_t>(pattern(q, me, i)),
                      "from ", q, " i=", i);
}

template <class C>
void conf_all_reduce(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  const std::size_t n = 131;
  mirror<C, double> x(n), y(n, -1);
  mirror<C, std::int32_t> xi(n), yi(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = pattern(me, 0, i) - 100;
    xi[i] = static_cast<std::int32_t>(x[i]);
  }
  double sum_expect[131], min_expect[131], max_expect[131];
  for (std::size_t i = 0; i < n; ++i) {
    sum_expect[i] = 0;
    min_expect[i] = 1e300;
    max_expect[i] = -1e300;
    for (int q = 0; q < p; ++q) {
      const double v = pattern(q, 0, i) - 100;
      sum_expect[i] += v;
      min_expect[i] = std::min(min_expect[i], v);
      max_expect[i] = std::max(max_expect[i], v);
    }
  }
  x.push();
  y.push();
  xi.push();
  yi.push();
  c.all_reduce(x.in(), y.out(), comm::reduce_op::sum);
  settle(c);
  y.pull();
  for (std::size_t i = 0; i < n; ++i) LOOM_RANK_CHECK(r, y[i] == sum_expect[i], "sum i=", i);
  c.all_reduce(xi.in(), yi.out(), comm::reduce_op::min);
  settle(c);
  yi.pull();
  for (std::size_t i = 0; i < n; ++i)
    LOOM_RANK_CHECK(r, yi[i] == static_cast<std::int32_t>(min_expect[i]), "min i=", i);
  c.all_reduce(xi.in(), xi.out(), comm::reduce_op::max);  // in place
  settle(c);
  xi.pull();
  for (std::size_t i = 0; i < n; ++i)
    LOOM_RANK_CHECK(r, xi[i] == static_cast<std::int32_t>(max_expect[i]), "max i=", i);
  mirror<C, float> f(5, me % 2 ? -1.f : 1.f);
  f.push();
  c.all_reduce(f.in(), f.out(), comm::reduce_op::prod);
  settle(c);
  f.pull();
  const float prod_expect = (p / 2) % 2 ? -1.f : 1.f;
  for (float v : f.host()) LOOM_RANK_CHECK(r, v == prod_expect, "prod");
  mirror<C, half> h(9, half(0.5f));
  h.push();
  c.all_reduce(h.in(), h.out(), comm::reduce_op::sum);
  settle(c);
  h.pull();
  for (half v : h.host()) LOOM_RANK_CHECK(r, static_cast<float>(v) == 0.5f * static_cast<float>(p), "half sum");
}

template <class C>
void conf_reduce_scatter(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  const auto up = static_cast<std::size_t>(p);
  const std::size_t n = 5;
  mirror<C, double> send(up * n), recv(n, -1);
  for (std::size_t j = 0; j < up * n; ++j) send[j] = pattern(me, 0, j);
  send.push();
  recv.push();
  c.reduce_scatter(send.in(), recv.out(), comm::reduce_op::sum);
  settle(c);
  recv.pull();
  for (std::size_t i = 0; i < n; ++i) {
    double e = 0;
    for (int q = 0; q < p; ++q) e += pattern(q, 0, static_cast<std::size_t>(me) * n + i);
    LOOM_RANK_CHECK(r, recv[i] == e, "i=", i);
  }
}

template <class C>
void conf_broadcast(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  for (int root = 0; root < p; ++root) {
    mirror<C, std::uint8_t> v(13);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint8_t>(me == root ? pattern(root, 1, i) : 255);
    v.push();
    c.broadcast(v.out(), root);
    settle(c);
    v.pull();
    for (std::size_t i = 0; i < v.size(); ++i)
      LOOM_RANK_CHECK(r, v[i] == static_cast<std::uint8_t>(pattern(root, 1, i)), "root ", root, " i=", i);
  }
}

// A barrier separates phases: a message sent before it is observable after it by a probe-free
// protocol (each rank posts its receive only after the barrier).
template <class C>
void conf_barrier(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  for (int i = 0; i < 20; ++i) c.barrier();
  std::int32_t token = me, got = -1;
  auto s = c.isend(std::span<const std::int32_t>(&token, 1), (me + 1) % p, 5);
  c.barrier();
  auto q = c.irecv(std::span<std::int32_t>(&got, 1), (me + p - 1) % p, 5);
  c.wait(q);
  c.wait(s);
  LOOM_RANK_CHECK(r, got == (me + p - 1) % p, "token");
}

template <class C>
void conf_split(C& c, rank_report& r) {
  const int p = c.size(), me = c.rank();
  // Two colors, reversed key order.
  C sub = c.split(me % 2, -me);
  std::vector<int> members;
  for (int q = 0; q < p; ++q)
    if (q % 2 == me % 2) members.push_back(q);
  std::reverse(members.begin(), members.end());
  LOOM_RANK_CHECK(r, sub.size() == static_cast<int>(members.size()), "size ", sub.size());
  const auto pos = std::find(members.begin(), members.end(), me) - members.begin();
  LOOM_RANK_CHECK(r, sub.rank() == static_cast<int>(pos), "rank ", sub.rank());
  mirror<C, std::int64_t> v(1, me), total(1, 0);
  v.push();
  total.push();
  sub.all_reduce(v.in(), total.out(), comm::reduce_op::sum);
  settle(sub);
  total.pull();
  LOOM_RANK_CHECK(r, total[0] == std::accumulate(members.begin(), members.end(), std::int64_t{0}), "sum ", total[0]);
  conf_sendrecv_ring(sub, r, 31);
  // Nested: split the split into singletons.
  C single = sub.split(sub.rank(), 0);
  LOOM_RANK_CHECK(r, single.size() == 1 && single.rank() == 0, "singleton");
  // The parent still works after its children.
  c.barrier();
}

//! The cases a stream-ordered communicator with NCCL's semantics (no tags, point-to-point
//! matched in issue order on one stream) must pass: every collective and the grouped sendrecv.
template <class C>
void stream_conformance_suite(C& c, rank_report& r) {
  conf_rank_size(c, r);
  conf_sendrecv_ring(c, r);
  conf_all_gather(c, r);
  conf_all_to_all(c, r);
  conf_all_to_allv(c, r);
  conf_all_reduce(c, r);
  conf_reduce_scatter(c, r);
  conf_broadcast(c, r);
  conf_split(c, r);
}

//! Runs every case on `c`: the stream-ordered cases, then those that need tags, any order of
//! point-to-point calls, or host completion.
template <class C>
void conformance_suite(C& c, rank_report& r, bool include_large = true) {
  stream_conformance_suite(c, r);
  conf_zero_size(c, r);
  conf_many_outstanding(c, r);
  conf_barrier(c, r);
  if (include_large) conf_large(c, r);
}

}  // namespace loom::test
