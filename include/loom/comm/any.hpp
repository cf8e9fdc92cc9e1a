#pragma once

//! @file
//! comm::any: a type-erased communicator for ABI and plugin boundaries. It holds any model of the
//! communicator concept and forwards each call through one virtual function; the cost is one
//! indirect call per operation, small next to a message. Element types are carried as dtype, so
//! reductions keep their type and other trivially copyable types travel as bytes.

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::comm {

namespace detail {

//! A buffer seen without its type.
struct erased_span {
  void* data;
  std::size_t count;
  dtype type;
  std::size_t elem_size;
};

template <class T>
erased_span erase(std::span<T> s) {
  using U = std::remove_const_t<T>;
  return {const_cast<U*>(s.data()), s.size(), dtype_of<U>(), sizeof(U)};
}

//! The element type of each dtype, in dtype's order (bytes: std::byte).
using dtype_types = std::tuple<std::byte, std::int8_t, std::uint8_t, std::int32_t, std::uint32_t, std::int64_t,
                               std::uint64_t, half, bfloat16, float, double>;

//! Calls f(std::span<T>) with T recovered from the dtype (bytes: std::byte, count scaled).
template <std::size_t I = 1, class F>
decltype(auto) with_type(const erased_span& s, F&& f) {
  if constexpr (I < std::tuple_size_v<dtype_types>) {
    using T = std::tuple_element_t<I, dtype_types>;
    static_assert(dtype_of<T>() == static_cast<dtype>(I));
    if (s.type == static_cast<dtype>(I)) return f(std::span<T>(static_cast<T*>(s.data), s.count));
    return with_type<I + 1>(s, std::forward<F>(f));
  } else {
    return f(std::span<std::byte>(static_cast<std::byte*>(s.data), s.count * s.elem_size));
  }
}

template <class T>
std::span<T> retype(const erased_span& s) {
  return {static_cast<T*>(s.data), s.count * s.elem_size / sizeof(T)};
}

struct any_request_base {
  virtual ~any_request_base() = default;
  virtual void wait() = 0;
};

enum class any_call : std::uint8_t { all_gather, all_to_all, all_reduce, reduce_scatter };

struct any_base {
  virtual ~any_base() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::shared_ptr<any_request_base> isend(erased_span s, int dest, int tag) = 0;
  virtual std::shared_ptr<any_request_base> irecv(erased_span s, int src, int tag) = 0;
  virtual void sendrecv(erased_span s, int dest, erased_span r, int src, int tag) = 0;
  virtual void collective(any_call call, erased_span s, erased_span r, reduce_op op) = 0;
  virtual void all_to_allv(erased_span s, std::span<const std::size_t> sc, std::span<const std::size_t> sd,
                           erased_span r, std::span<const std::size_t> rc, std::span<const std::size_t> rd) = 0;
  virtual void broadcast(erased_span s, int root) = 0;
  virtual void barrier() = 0;
  virtual std::unique_ptr<any_base> split(int color, int key) = 0;
};

template <communicator C>
struct any_model final : any_base {
  explicit any_model(C c) : comm(std::move(c)) {}
  C comm;

  struct request_model final : any_request_base {
    request_model(C* c, typename C::request r) : comm(c), req(std::move(r)) {}
    C* comm;
    typename C::request req;
    void wait() override { comm->wait(req); }
  };

  int rank() const override { return comm.rank(); }
  int size() const override { return comm.size(); }
  std::shared_ptr<any_request_base> isend(erased_span s, int dest, int tag) override {
    return with_type(s, [&](auto sp) -> std::shared_ptr<any_request_base> {
      return std::make_shared<request_model>(
          &comm, comm.isend(std::span<const typename decltype(sp)::value_type>(sp), dest, tag));
    });
  }
  std::shared_ptr<any_request_base> irecv(erased_span s, int src, int tag) override {
    return with_type(s, [&](auto sp) -> std::shared_ptr<any_request_base> {
      return std::make_shared<request_model>(&comm, comm.irecv(sp, src, tag));
    });
  }
  void sendrecv(erased_span s, int dest, erased_span r, int src, int tag) override {
    with_type(r, [&](auto rp) {
      using T = typename decltype(rp)::value_type;
      comm.sendrecv(std::span<const T>(retype<T>(s)), dest, rp, src, tag);
    });
  }
  void collective(any_call call, erased_span s, erased_span r, reduce_op op) override {
    with_type(r, [&](auto rp) {
      using T = typename decltype(rp)::value_type;
      const std::span<const T> sp(retype<T>(s));
      switch (call) {
        case any_call::all_gather:
          comm.all_gather(sp, rp);
          break;
        case any_call::all_to_all:
          comm.all_to_all(sp, rp);
          break;
        case any_call::all_reduce:
        case any_call::reduce_scatter:
          if constexpr (reducible<T>) {
            if (call == any_call::all_reduce)
              comm.all_reduce(sp, rp, op);
            else
              comm.reduce_scatter(sp, rp, op);
          }
          break;
      }
    });
  }
  void all_to_allv(erased_span s, std::span<const std::size_t> sc, std::span<const std::size_t> sd, erased_span r,
                   std::span<const std::size_t> rc, std::span<const std::size_t> rd) override {
    with_type(r, [&](auto rp) {
      using T = typename decltype(rp)::value_type;
      if constexpr (std::is_same_v<T, std::byte>) {
        // Counts are in elements of the caller's type: scale them to bytes.
        const std::size_t es = r.elem_size;
        std::vector<std::size_t> v(4 * sc.size());
        for (std::size_t q = 0; q < sc.size(); ++q) {
          v[q] = sc[q] * es;
          v[sc.size() + q] = sd[q] * es;
          v[2 * sc.size() + q] = rc[q] * es;
          v[3 * sc.size() + q] = rd[q] * es;
        }
        const std::size_t p = sc.size();
        comm.all_to_allv(std::span<const T>(retype<T>(s)), std::span<const std::size_t>(v.data(), p),
                         std::span<const std::size_t>(v.data() + p, p), rp,
                         std::span<const std::size_t>(v.data() + 2 * p, p),
                         std::span<const std::size_t>(v.data() + 3 * p, p));
      } else {
        comm.all_to_allv(std::span<const T>(retype<T>(s)), sc, sd, rp, rc, rd);
      }
    });
  }
  void broadcast(erased_span s, int root) override {
    with_type(s, [&](auto sp) { comm.broadcast(sp, root); });
  }
  void barrier() override { comm.barrier(); }
  std::unique_ptr<any_base> split(int color, int key) override {
    return std::make_unique<any_model<C>>(comm.split(color, key));
  }
};

}  // namespace detail

//! A communicator of any concrete type behind one interface. Copies share the wrapped communicator.
class any {
 public:
  //! A pending isend / irecv of the wrapped communicator.
  using request = basic_request<any, std::shared_ptr<detail::any_request_base>>;

  //! Wraps a copy of `comm`.
  template <communicator C>
  requires(!std::is_same_v<std::remove_cvref_t<C>, any>) explicit any(C comm)
      : impl_(std::make_shared<detail::any_model<C>>(std::move(comm))) {}

  [[nodiscard]] int rank() const { return impl_->rank(); }
  [[nodiscard]] int size() const { return impl_->size(); }

  template <class T>
  requires transferable<std::remove_const_t<T>> request isend(std::span<T> data, int dest, int tag) {
    return request(impl_->isend(detail::erase(data), dest, tag));
  }
  template <transferable T>
  request irecv(std::span<T> data, int src, int tag) {
    return request(impl_->irecv(detail::erase(data), src, tag));
  }
  void wait(request& r) {
    if (!r.handle_) return;
    auto impl = std::move(r.handle_);
    impl->wait();
  }
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R>
  void sendrecv(std::span<S> send, int dest, std::span<R> recv, int src, int tag) {
    impl_->sendrecv(detail::erase(send), dest, detail::erase(recv), src, tag);
  }
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_gather(std::span<S> send, std::span<R> recv) {
    impl_->collective(detail::any_call::all_gather, detail::erase(send), detail::erase(recv), reduce_op::sum);
  }
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_all(std::span<S> send, std::span<R> recv) {
    impl_->collective(detail::any_call::all_to_all, detail::erase(send), detail::erase(recv), reduce_op::sum);
  }
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && transferable<R>
  void all_to_allv(std::span<S> send, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, std::span<R> recv,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    impl_->all_to_allv(detail::erase(send), send_counts, send_displs, detail::erase(recv), recv_counts, recv_displs);
  }
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void all_reduce(std::span<S> send, std::span<R> recv, reduce_op op) {
    impl_->collective(detail::any_call::all_reduce, detail::erase(send), detail::erase(recv), op);
  }
  template <class S, class R>
  requires std::same_as<std::remove_const_t<S>, R> && reducible<R>
  void reduce_scatter(std::span<S> send, std::span<R> recv, reduce_op op) {
    impl_->collective(detail::any_call::reduce_scatter, detail::erase(send), detail::erase(recv), op);
  }
  template <transferable T>
  void broadcast(std::span<T> data, int root) {
    impl_->broadcast(detail::erase(data), root);
  }
  void barrier() { impl_->barrier(); }
  any split(int color, int key) { return any(std::shared_ptr<detail::any_base>(impl_->split(color, key))); }

 private:
  explicit any(std::shared_ptr<detail::any_base> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::any_base> impl_;
};

}  // namespace loom::comm
