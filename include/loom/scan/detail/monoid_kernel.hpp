#pragma once

//! @file
//! The engine kernel of monoid scans: inclusive or exclusive, forward or reverse, with optional
//! segment heads. Aggregates and carries are segmented values (value, head), so a head inside a
//! block or on another rank resets the scan exactly as it does in the sequential loop.

#include <loom/core/segments.hpp>
#include <loom/scan/detail/stream.hpp>
#include <loom/scan/monoid.hpp>
#include <loom/scan/options.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace loom::scan::detail {

//! The offsets of a loom::segments (int32 or int64, any memory space) as a value kernels copy:
//! null when there are none.
struct offsets_ref {
  const void* data = nullptr;
  bool wide = true;
  LOOM_HD index_t operator[](index_t i) const {
    return wide ? static_cast<const std::int64_t*>(data)[i]
                : static_cast<index_t>(static_cast<const std::int32_t*>(data)[i]);
  }
  LOOM_HD explicit operator bool() const { return data != nullptr; }
};

template <memory_space Space>
offsets_ref ref_of(const loom::segments<Space>& s) {
  return s.implicit() ? offsets_ref{} : offsets_ref{s.data(), s.wide()};
}

//! Segment heads as positions in processing order. `offsets` (S + 1 values) segment a global
//! sequence of `total` elements; this rank (or call) processes the window of `count` elements that
//! starts `base` elements into the global processing order. Global head positions: forward, the
//! segment starts offsets[0..S); reverse, total - offsets[S..1] (each segment's last element).
//! Head indices are ascending in position; a run of equal positions (empty segments) is
//! represented by its last index, the one non-empty segment there.
struct heads {
  offsets_ref offsets{};
  index_t segments = 0;  //!< S; 0 means no segments (no heads)
  index_t total = 0;
  index_t base = 0;
  index_t count = 0;
  bool reverse = false;

  LOOM_HD index_t at(index_t s) const { return (reverse ? total - offsets[segments - s] : offsets[s]) - base; }
  //! The segment (as numbered by offsets) of head index s.
  LOOM_HD index_t segment(index_t s) const { return reverse ? segments - 1 - s : s; }
  //! The head index of the last head at or before local position p (the segment holding p), or -1.
  LOOM_HD index_t last_at_or_before(index_t p) const {
    index_t lo = 0, hi = segments;  // first index with at() > p
    while (lo < hi) {
      const index_t mid = lo + (hi - lo) / 2;
      if (at(mid) <= p)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo - 1;
  }
  //! The position of the first head after local position p (count if none in the window).
  LOOM_HD index_t next_after(index_t p) const {
    const index_t s = last_at_or_before(p) + 1;
    if (s >= segments) return count;
    const index_t q = at(s);
    return q < count ? q : count;
  }
  //! The first head position >= p, or count.
  LOOM_HD index_t first_at_or_after(index_t p) const { return next_after(p - 1); }
};

#if LOOM_SCAN_STREAM_STORES
//! Sums and prefix sums of float / double in 64-byte vectors (GCC / clang vector extensions; the
//! compiler picks the instructions the build targets). Used by scans with loom::scan::plus on
//! contiguous data: the order of the additions is a fixed function of the run, as elsewhere.
// 64-byte vectors cross no function boundary (every helper below is always inlined), so the
// psabi note about passing them without AVX-512 enabled does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#define LOOM_SCAN_INLINE [[gnu::always_inline]] inline

typedef float plus_v16f __attribute__((vector_size(64)));
typedef double plus_v8d __attribute__((vector_size(64)));

template <class T>
struct plus_vectors {
  static constexpr int n = 64 / static_cast<int>(sizeof(T));
  using V = std::conditional_t<std::is_same_v<T, float>, plus_v16f, plus_v8d>;

  LOOM_SCAN_INLINE static V load(const T* p) {
    V v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
  }
  LOOM_SCAN_INLINE static void store(T* p, const V& v) { __builtin_memcpy(p, &v, sizeof v); }
  LOOM_SCAN_INLINE static V splat(T x) {
    V v = {};
    return v + x;
  }
  template <int K, int... I>
  LOOM_SCAN_INLINE static V shift_up(const V& x,
                                     std::integer_sequence<int, I...>) {  // lane i <- lane i - K, zeros below K
    const V z = {};
    return __builtin_shufflevector(x, z, (I >= K ? I - K : n + I)...);
  }
  template <int... I>
  LOOM_SCAN_INLINE static V last(const V& x, std::integer_sequence<int, I...>) {  // every lane <- lane n - 1
    return __builtin_shufflevector(x, x, (I * 0 + n - 1)...);
  }
  //! Inclusive prefix sums inside the vector (log2(n) shifted adds).
  LOOM_SCAN_INLINE static V prefix(V x) {
    constexpr auto idx = std::make_integer_sequence<int, n>{};
    x += shift_up<1>(x, idx);
    x += shift_up<2>(x, idx);
    x += shift_up<4>(x, idx);
    if constexpr (n > 8) x += shift_up<8>(x, idx);
    return x;
  }
  LOOM_SCAN_INLINE static V last(const V& x) { return last(x, std::make_integer_sequence<int, n>{}); }
  LOOM_SCAN_INLINE static V shift1(const V& x) { return shift_up<1>(x, std::make_integer_sequence<int, n>{}); }

  //! acc + x[0] + ... + x[len - 1]: four vector partial sums, then a fixed-order reduction.
  LOOM_SCAN_INLINE static T sum(const T* x, index_t len, T acc) {
    V s[4] = {};
    index_t i = 0;
    for (; i + 4 * n <= len; i += 4 * n)
      for (int k = 0; k < 4; ++k) s[k] += load(x + i + k * n);
    for (; i + n <= len; i += n) s[0] += load(x + i);
    const V t = (s[0] + s[1]) + (s[2] + s[3]);
    T r = T(0);
    for (int k = 0; k < n; ++k) r += t[k];
    for (; i < len; ++i) r += x[i];
    return acc + r;
  }

  //! Lane 0 <- p[n - 1], lane i <- x[i - 1]: the exclusive form of an inclusive prefix x whose
  //! preceding prefix ends in p.
  template <int... I>
  LOOM_SCAN_INLINE static V shift_in(const V& x, const V& p, std::integer_sequence<int, I...>) {
    return __builtin_shufflevector(x, p, (I == 0 ? 2 * n - 1 : I - 1)...);
  }
  LOOM_SCAN_INLINE static V shift_in(const V& x, const V& p) {
    return shift_in(x, p, std::make_integer_sequence<int, n>{});
  }

  //! out[i] = acc + x[0] + ... + x[i] (inclusive) or acc + x[0] + ... + x[i - 1] (exclusive), i < len;
  //! returns acc + the sum of all len. `stream`: with out 16-byte aligned, the vectors go to
  //! memory with non-temporal stores (the sums are the same either way).
  LOOM_SCAN_INLINE static T scan(const T* x, T* out, index_t len, T acc, bool exclusive, bool stream) {
    const bool nt = stream && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
    auto put = [&](T* to, const V& v) {
      if (nt)
        stream_bytes<4>(to, &v);
      else
        store(to, v);
    };
    V carry = splat(acc);
    const V zero = {};
    index_t i = 0;
    // Four vectors at a time: their prefixes, offset by the sums of the vectors before them in the
    // group, do not depend on the carry, so the carry chain is one add per 4 n elements.
    for (; i + 4 * n <= len; i += 4 * n) {
      V t[4];
      for (int k = 0; k < 4; ++k) t[k] = prefix(load(x + i + k * n));
      for (int k = 1; k < 4; ++k) t[k] += last(t[k - 1]);
      for (int k = 0; k < 4; ++k)
        put(out + i + k * n, carry + (exclusive ? shift_in(t[k], k ? t[k - 1] : zero) : t[k]));
      carry += last(t[3]);
    }
    for (; i + n <= len; i += n) {
      const V y = prefix(load(x + i));
      put(out + i, carry + (exclusive ? shift1(y) : y));
      carry += last(y);
    }
    T a = carry[0];
    for (; i < len; ++i) {
      const T after = a + x[i];
      out[i] = exclusive ? a : after;
      a = after;
    }
    return a;
  }
};

template <class M, class In, class Out>
inline constexpr bool vector_plus = (std::is_same_v<M, plus<float>> || std::is_same_v<M, plus<double>>)&&std::is_same_v<
    std::remove_const_t<typename In::element_type>, typename M::value_type>&& std::is_same_v<typename Out::element_type,
                                                                                             typename M::value_type>;
#endif

template <class M, class In, class Out>
struct monoid_kernel {
  using value_type = typename M::value_type;
  using agg_type = flagged<value_type>;
  using in_type = typename In::element_type;
  using out_type = typename Out::element_type;
  M m;
  heads hd;
  bool exclusive;
  value_type init;  //!< exclusive: the value before each segment (and before position 0)
  // Position p (processing order) lives at src[p * src_step] and dst[p * dst_step]; a reverse scan
  // starts at the last element with a negative step.
  in_type* src;
  index_t src_step;
  out_type* dst;
  index_t dst_step;
  index_t carry_size = 1, agg_size = 1, scratch_size = 0;

  monoid_kernel(const M& m_, In in, Out out, heads hd_, bool excl, value_type init_)
      : m(m_), hd(hd_), exclusive(excl), init(init_) {
    const index_t last = in.extent(0) > 0 ? in.extent(0) - 1 : 0;
    src = hd.reverse ? in.data() + last * in.stride(0) : in.data();
    src_step = hd.reverse ? -in.stride(0) : in.stride(0);
    dst = hd.reverse ? out.data() + last * out.stride(0) : out.data();
    dst_step = hd.reverse ? -out.stride(0) : out.stride(0);
  }

  LOOM_HD value_type load(index_t p) const { return static_cast<value_type>(src[p * src_step]); }
  //! The running value just after a segment head x (exclusive scans start each segment at init).
  LOOM_HD value_type head_value(const value_type& x) const { return exclusive ? m.combine(init, x) : x; }

  LOOM_HD void identity_agg(agg_type* agg) const { *agg = {m.identity(), false}; }
  LOOM_HD void global_init_carry(agg_type* c) const { init_carry(c); }
  LOOM_HD void init_carry(agg_type* c) const { *c = {exclusive ? init : m.identity(), false}; }

  // A run of positions without heads is cut into `lanes` contiguous pieces folded side by side,
  // so the combines of different pieces do not wait on each other; the pieces' results are then
  // combined in order. Any associative combine allows it, and the order is fixed by the run alone.
  static constexpr index_t lanes = 8;
  static constexpr index_t min_laned = 16 * lanes;

  //! Elements per piece of a run of len >= min_laned. Pieces whose byte distance is close to a
  //! multiple of 4 KiB would make the side-by-side loads and stores alias in the L1 (and stall on
  //! false store-to-load dependencies), so such a length is shortened a little (the last piece
  //! takes the rest). A function of len alone, so the combine order stays fixed.
  LOOM_HD static index_t lane_piece(index_t len) {
    index_t piece = len / lanes;
    const index_t bytes = (piece * static_cast<index_t>(sizeof(in_type))) % 4096;
    if (bytes < 512 || bytes > 4096 - 512)
      piece -=
          (1024 / static_cast<index_t>(sizeof(in_type))) < piece / 2 ? 1024 / static_cast<index_t>(sizeof(in_type)) : 0;
    return piece;
  }

  //! acc op x[lo] op ... op x[hi - 1] (hi > lo).
  LOOM_HD value_type fold_run(index_t lo, index_t hi, value_type acc) const {
    const index_t len = hi - lo;
#if LOOM_SCAN_STREAM_STORES && !LOOM_IN_DEVICE_CODE
    if constexpr (vector_plus<M, In, Out>)
      if (src_step == 1) return plus_vectors<value_type>::sum(src + lo, len, acc);
#endif
    if (len < min_laned) {
      for (index_t p = lo; p < hi; ++p) acc = m.combine(acc, load(p));
      return acc;
    }
    const index_t piece = lane_piece(len);
    value_type part[lanes];
    for (index_t k = 0; k < lanes; ++k) part[k] = load(lo + k * piece);
    const index_t lane_step = piece * src_step;
    const in_type* base = src + lo * src_step;
    for (index_t i = 1; i < piece; ++i) {
      const in_type* at = base + i * src_step;
      for (index_t k = 0; k < lanes; ++k) part[k] = m.combine(part[k], static_cast<value_type>(at[k * lane_step]));
    }
    for (index_t p = lo + lanes * piece; p < hi; ++p) part[lanes - 1] = m.combine(part[lanes - 1], load(p));
    for (index_t k = 0; k < lanes; ++k) acc = m.combine(acc, part[k]);
    return acc;
  }

  //! Runs longer than this are scanned in consecutive chunks of this many elements (each with the
  //! lane scheme above), on every backend and output layout alike, so the combine order depends on
  //! the run alone. 16 KiB of input: the lanes' pieces are 2 KiB apart (no 4 KiB aliasing), and a
  //! chunk's outputs fit in L1 on the way to memory (see scan_run).
  static constexpr index_t chunk = 16384 / static_cast<index_t>(sizeof(in_type)) > 4 * min_laned
                                       ? 16384 / static_cast<index_t>(sizeof(in_type))
                                       : 4 * min_laned;

  //! Writes the outputs of [lo, hi) (no heads inside) starting from the running value acc.
  //! On x86 hosts, a contiguous forward output of 4, 8 or 16-byte values is written a chunk at a
  //! time into an L1 buffer and streamed to memory with non-temporal stores: the output lines are
  //! not read before being overwritten (as ordinary stores do), so the scan moves the bytes of a
  //! copy: the input once, the output once.
  LOOM_HD void scan_run(index_t lo, index_t hi, value_type acc) const {
#if LOOM_SCAN_STREAM_STORES && !LOOM_IN_DEVICE_CODE
    if constexpr (vector_plus<M, In, Out>) {  // vector sums, streamed straight from the registers
      if (src_step == 1 && dst_step == 1 && hi - lo >= chunk) {
        plus_vectors<value_type>::scan(src + lo, dst + lo, hi - lo, acc, exclusive, true);
        stream_fence();
        return;
      }
    }
    if constexpr (streamable<out_type>) {
      if (dst_step == 1 && hi - lo >= chunk) {
        alignas(64) out_type stage[chunk];
        for (index_t c = lo; c < hi; c += chunk) {
          const index_t e = hi - c < chunk ? hi : c + chunk;
          acc = scan_chunk(c, e, acc, stage, 1);
          stream_copy(stage, dst + c, e - c);
        }
        stream_fence();  // the streamed lines are visible before the engine's next phase
        return;
      }
    }
#endif
    for (index_t c = lo; c < hi; c += chunk) {
      const index_t e = hi - c < chunk ? hi : c + chunk;
      acc = scan_chunk(c, e, acc, dst + c * dst_step, dst_step);
    }
  }

  //! Writes the outputs of [lo, hi) to out[(p - lo) * out_step] starting from the running value acc;
  //! returns the running value after hi - 1.
  LOOM_HD value_type scan_chunk(index_t lo, index_t hi, value_type acc, out_type* out, index_t out_step) const {
    const index_t len = hi - lo;
#if LOOM_SCAN_STREAM_STORES && !LOOM_IN_DEVICE_CODE
    if constexpr (vector_plus<M, In, Out>)
      if (src_step == 1 && out_step == 1)
        return plus_vectors<value_type>::scan(src + lo, out, len, acc, exclusive, false);
#endif
    if (len < min_laned) {
      for (index_t p = lo; p < hi; ++p) {
        const value_type after = m.combine(acc, load(p));
        out[(p - lo) * out_step] = exclusive ? acc : after;
        acc = after;
      }
      return acc;
    }
    const index_t piece = lane_piece(len);
    value_type carry[lanes];
    carry[0] = acc;
    for (index_t k = 0; k + 1 < lanes; ++k) carry[k + 1] = fold_run(lo + k * piece, lo + (k + 1) * piece, carry[k]);
    const index_t in_lane = piece * src_step, out_lane = piece * out_step;
    if (exclusive) {
      for (index_t i = 0; i < piece; ++i) {
        const in_type* from = src + (lo + i) * src_step;
        out_type* to = out + i * out_step;
        for (index_t k = 0; k < lanes; ++k) {
          to[k * out_lane] = carry[k];
          carry[k] = m.combine(carry[k], static_cast<value_type>(from[k * in_lane]));
        }
      }
    } else {
      for (index_t i = 0; i < piece; ++i) {
        const in_type* from = src + (lo + i) * src_step;
        out_type* to = out + i * out_step;
        for (index_t k = 0; k < lanes; ++k) {
          carry[k] = m.combine(carry[k], static_cast<value_type>(from[k * in_lane]));
          to[k * out_lane] = carry[k];
        }
      }
    }
    value_type last = carry[lanes - 1];
    for (index_t p = lo + lanes * piece; p < hi; ++p) {
      const value_type after = m.combine(last, load(p));
      out[(p - lo) * out_step] = exclusive ? last : after;
      last = after;
    }
    return last;
  }

  LOOM_HD void reduce(index_t begin, index_t end, agg_type* agg, agg_type*) const {
    value_type acc = m.identity();
    bool head = false;
    index_t next = hd.first_at_or_after(begin);
    if (next >= end) {  // no head: fold from the first element (no identity needed)
      *agg = {fold_run(begin + 1, end, load(begin)), false};
      return;
    }
    // Everything before the first head is discarded by it.
    for (index_t p = next; p < end;) {
      acc = head_value(load(p));
      head = true;
      next = hd.next_after(p);
      ++p;
      const index_t stop = next < end ? next : end;
      if (p < stop) acc = fold_run(p, stop, acc);
      p = stop;
    }
    *agg = {acc, head};
  }

  LOOM_HD void advance(const agg_type* carry, const agg_type* agg, agg_type* next) const {
    *next = agg->head ? *agg : agg_type{m.combine(carry->value, agg->value), carry->head};
  }
  LOOM_HD void compose(const agg_type* first, const agg_type* second, agg_type* result) const {
    advance(first, second, result);
  }

  LOOM_HD void scan(index_t begin, index_t end, const agg_type* carry, agg_type*) const {
    index_t next = hd.first_at_or_after(begin);
    index_t stop = next < end ? next : end;
    if (begin < stop) scan_run(begin, stop, carry->value);
    for (index_t p = stop; p < end;) {
      const value_type x = load(p);
      dst[p * dst_step] = exclusive ? init : x;
      const value_type acc = head_value(x);
      next = hd.next_after(p);
      ++p;
      stop = next < end ? next : end;
      if (p < stop) scan_run(p, stop, acc);
      p = stop;
    }
  }
};

}  // namespace loom::scan::detail
