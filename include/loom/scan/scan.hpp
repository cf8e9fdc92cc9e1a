#pragma once

//! @file
//! Scans over a monoid on any backend: inclusive and exclusive, forward and reverse, plain or
//! segmented (reset at offsets such as cu_seqlens).
//!
//!   loom::scan::inclusive_scan(loom::openmp{}, loom::scan::plus<float>{}, in, out);
//!   loom::scan::segmented_inclusive_scan(b, m, in, out, cu_seqlens, {.dir = loom::scan::direction::reverse});
//!
//! Determinism: the combine tree is fixed by n and options.block, so the result has the same bits
//! on every backend and thread count (see detail/engine.hpp). Work O(n) combines plus O(n / block)
//! for the carries; the data is read about twice and written once. On loom::cuda,
//! options.reproducible = false (and integer plus / minimum / maximum always) runs CUB's device
//! scan instead (detail/monoid_cuda.cuh): fast, but for floating-point monoids its bits may vary
//! from run to run.

#include <loom/scan/detail/engine.hpp>
#include <loom/scan/detail/monoid_kernel.hpp>
#include <loom/scan/detail/validate.hpp>
#include <loom/scan/monoid.hpp>
#include <loom/scan/options.hpp>

#include <type_traits>

namespace loom::scan {

namespace detail {
template <monoid M>
constexpr index_t monoid_bytes_per_element() {
  return static_cast<index_t>(2 * sizeof(typename M::value_type));  // one read, one write
}

template <class In>
constexpr const tensor_view<const index_t, 1, typename In::space>* no_offsets() {
  return nullptr;
}

//! Builds the monoid kernel for the window `w` of the global sequence and runs fn(kernel, blocking).
template <monoid M, class In, class Out, class Offsets, class Fn>
void with_monoid_kernel(const M& m, In in, Out out, const Offsets* offsets, bool exclusive, typename M::value_type init,
                        const options& opt, window w, std::string_view call, Fn&& fn) {
  static_assert(In::rank == 1 && Out::rank == 1, "scan: in and out must be rank-1 views");
  static_assert(std::is_same_v<typename Out::value_type, typename M::value_type>,
                "scan: out's element type must be the monoid's value_type");
  const index_t n = in.extent(0);
  LOOM_EXPECTS(out.extent(0) == n, errc::shape_mismatch, call, ": out must have ", n, " elements (as in), got ",
               out.extent(0));
  check_options(opt, call);
  check_no_overlap(out, "out", in, "in", !exclusive, call);
  if (offsets) check_no_overlap(out, "out", *offsets, "offsets", false, call);
  const bool reverse = opt.dir == direction::reverse;
  heads hd{nullptr, 0, w.total, reverse ? w.total - w.begin - w.count : w.begin, w.count, reverse};
  if (offsets) {
    check_offsets(*offsets, w.total, call);
    LOOM_EXPECTS(offsets->stride(0) == 1, errc::invalid_argument, call, ": offsets must be contiguous");
    hd.offsets = offsets->data();
    hd.segments = offsets->extent(0) - 1;
  }
  const blocking blk = make_blocking(n, opt.block, monoid_bytes_per_element<M>());
  if (reverse)
    fn(monoid_kernel<flipped<M>, In, Out>(flipped<M>{m}, in, out, hd, exclusive, init), blk);
  else
    fn(monoid_kernel<M, In, Out>(m, in, out, hd, exclusive, init), blk);
}

//! Monoid scans a device backend runs with its vendor's library instead of the blocked engine
//! (specialised for loom::cuda by detail/monoid_cuda.cuh, included when nvcc compiles the unit).
template <class B>
struct vendor_scan {
  static constexpr bool available = false;
};

//! Monoids whose combine is exact, so that every combine order gives the same bits.
template <class M>
inline constexpr bool exact_combine = false;
template <class T>
inline constexpr bool exact_combine<plus<T>> = std::is_integral_v<T>;
template <class T>
inline constexpr bool exact_combine<maximum<T>> = std::is_integral_v<T>;
template <class T>
inline constexpr bool exact_combine<minimum<T>> = std::is_integral_v<T>;

template <class B, monoid M>
bool use_vendor_scan(const options& opt) {
  return vendor_scan<B>::available && (!opt.reproducible || exact_combine<M>);
}

template <backend B, monoid M, class In, class Out, class Offsets>
void run_monoid(const B& b, const M& m, In in, Out out, const Offsets* offsets, bool exclusive,
                typename M::value_type init, const options& opt, std::string_view call) {
  check_space<B, In>();
  check_space<B, Out>();
  const index_t n = in.extent(0);
  if constexpr (vendor_scan<B>::available) {
    if (use_vendor_scan<B, M>(opt)) {
      // with_monoid_kernel validates the call; the kernel it builds is not used.
      with_monoid_kernel(m, in, out, offsets, exclusive, init, opt, window{n, 0, n}, call,
                         [&](const auto&, const blocking&) {
                           if (n > 0) vendor_scan<B>::run(b, m, in, out, offsets, exclusive, init, opt, call);
                         });
      return;
    }
  }
  with_monoid_kernel(
      m, in, out, offsets, exclusive, init, opt, window{n, 0, n}, call, [&](const auto& k, const blocking& blk) {
        if (n == 0) return;
        using A = typename std::remove_cvref_t<decltype(k)>::agg_type;
        with_workspace<A>(b, opt, workspace_size(b, k, blk), call, [&](A* ws) { run_scan(b, k, blk, ws); });
      });
}
}  // namespace detail

//! Bytes of workspace a scan of n elements of monoid M needs on backend b with these options.
template <backend B, monoid M>
std::size_t workspace_bytes(const B& b, const M& m, index_t n, const options& opt = {}) {
  detail::check_options(opt, "workspace_bytes");
  if constexpr (detail::vendor_scan<B>::available)
    if (detail::use_vendor_scan<B, M>(opt)) return detail::vendor_scan<B>::bytes(m, n);
  using agg = flagged<typename M::value_type>;
  const auto blk = detail::make_blocking(n, opt.block, detail::monoid_bytes_per_element<M>());
  const detail::layout lay{detail::tile_of(b, blk), 1, 1, 0};
  return sizeof(agg) * static_cast<std::size_t>(lay.size());
}

//! out[i] = x[0] op x[1] op ... op x[i] (reverse: x[i] op ... op x[n-1]). in and out are rank-1
//! views of the same length in b's memory space. out may be in itself (the same view: in place);
//! otherwise it must not overlap in. The same holds for segmented_inclusive_scan.
//! @throws loom::error(shape_mismatch) if the lengths differ; (invalid_argument) for a bad
//! workspace, options.block < 0, or out overlapping in (or offsets) without being in.
template <backend B, monoid M, class In, class Out>
void inclusive_scan(const B& b, const M& m, In in, Out out, const options& opt = {}) {
  detail::run_monoid(b, m, in, out, detail::no_offsets<In>(), false, m.identity(), opt, "inclusive_scan");
}

//! out[i] = init op x[0] op ... op x[i-1]; out[0] = init (reverse: init op x[i+1] op ... is not
//! what is computed: the reverse form gives out[i] = x[i+1] op ... op x[n-1] op init).
//! out must not overlap in, not even as the same view: the exclusive scans do not run in place
//! (a kernel may write out[i] before it reads x[i]). @throws as inclusive_scan.
template <backend B, monoid M, class In, class Out>
void exclusive_scan(const B& b, const M& m, In in, Out out, typename M::value_type init, const options& opt = {}) {
  detail::run_monoid(b, m, in, out, detail::no_offsets<In>(), true, init, opt, "exclusive_scan");
}

//! Inclusive scan that restarts at every segment: offsets (S + 1 values, offsets[0] = 0,
//! non-decreasing, offsets[S] = n; e.g. cu_seqlens) delimit segments [offsets[s], offsets[s+1]).
//! Empty segments are allowed. Reverse scans restart at each segment's last element.
//! @throws loom::error(invalid_argument) for offsets that are not such a segmentation.
template <backend B, monoid M, class In, class Out, class Offsets>
void segmented_inclusive_scan(const B& b, const M& m, In in, Out out, Offsets offsets, const options& opt = {}) {
  detail::run_monoid(b, m, in, out, &offsets, false, m.identity(), opt, "segmented_inclusive_scan");
}

//! Exclusive scan per segment: the first output of every segment is `init`. out must not overlap
//! in (as for exclusive_scan).
template <backend B, monoid M, class In, class Out, class Offsets>
void segmented_exclusive_scan(const B& b, const M& m, In in, Out out, Offsets offsets, typename M::value_type init,
                              const options& opt = {}) {
  detail::run_monoid(b, m, in, out, &offsets, true, init, opt, "segmented_exclusive_scan");
}

}  // namespace loom::scan

#if defined(__CUDACC__)
#include <loom/scan/detail/monoid_cuda.cuh>
#endif
