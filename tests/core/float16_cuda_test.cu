// Bit compatibility of loom::bfloat16 / loom::half with CUDA's __nv_bfloat16 / __half. CUDA's
// conversion intrinsics are host-callable, so the comparisons run (and must pass) on machines
// without a GPU; where a GPU is present, a kernel repeats them in device code.

#include <loom/core/float16.hpp>

#include <catch2/catch.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "float16_reference.hpp"

static_assert(sizeof(loom::bfloat16) == sizeof(__nv_bfloat16) && alignof(loom::bfloat16) == alignof(__nv_bfloat16));
static_assert(sizeof(loom::half) == sizeof(__half) && alignof(loom::half) == alignof(__half));
static_assert(std::is_trivially_copyable_v<__nv_bfloat16> && std::is_trivially_copyable_v<__half>);

namespace {

using namespace loom::test::f16;

struct bf16_pair {
  using loom_type = loom::bfloat16;
  static constexpr const char* name = "bfloat16";
  static std::uint16_t cuda_encode(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
  static float cuda_decode(std::uint16_t b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  static std::vector<float> inputs() {
    auto v = boundary_inputs<bfloat16_format>();
    const auto r = random_inputs<bfloat16_format>(500'000, 0xcbf16);
    v.insert(v.end(), r.begin(), r.end());
    return v;
  }
};

struct half_pair {
  using loom_type = loom::half;
  static constexpr const char* name = "half";
  static std::uint16_t cuda_encode(float f) { return __half_as_ushort(__float2half_rn(f)); }
  static float cuda_decode(std::uint16_t b) { return __half2float(__ushort_as_half(b)); }
  static std::vector<float> inputs() {
    auto v = boundary_inputs<half_format>();
    const auto r = random_inputs<half_format>(500'000, 0xcf16);
    v.insert(v.end(), r.begin(), r.end());
    return v;
  }
};

// Decoded floats agree bit for bit, except that CUDA's host path canonicalises NaN payloads:
// there, both must be NaN.
bool same_decoding(float a, float b) { return std::isnan(a) ? std::isnan(b) : bits_of(a) == bits_of(b); }

template <class P>
void check_host_decoding() {
  mismatches bad;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float ours = P::loom_type::from_bits(bits), theirs = P::cuda_decode(bits);
    if (!same_decoding(ours, theirs)) bad.add(hex16(bits) + ": loom " + describe(ours) + ", CUDA " + describe(theirs));
  }
  INFO(P::name << " decoding\n" << bad.first);
  CHECK(bad.count == 0);
}

// Encodings agree bit for bit, NaN included (both give the canonical 0x7FFF).
template <class P>
void check_host_encoding() {
  const auto inputs = P::inputs();
  mismatches bad;
  for (const float x : inputs) {
    const std::uint16_t ours = typename P::loom_type(x).bits, theirs = P::cuda_encode(x);
    if (ours != theirs) bad.add(describe(x) + ": loom " + hex16(ours) + ", CUDA " + hex16(theirs));
  }
  INFO(P::name << " rounding of " << inputs.size() << " floats\n" << bad.first);
  CHECK(bad.count == 0);
}

// One thread per input: float -> 16 bit with loom and with CUDA, and the 16-bit pattern `i`
// (for i < 65536) decoded both ways.
__global__ void convert_on_device(const float* in, std::size_t n, std::uint16_t* loom_bf16, std::uint16_t* cuda_bf16,
                                  std::uint16_t* loom_half, std::uint16_t* cuda_half, float* decoded) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = in[i];
    loom_bf16[i] = loom::bfloat16(x).bits;
    cuda_bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    loom_half[i] = loom::half(x).bits;
    cuda_half[i] = __half_as_ushort(__float2half_rn(x));
    if (i < 0x10000u) {
      const auto b = static_cast<std::uint16_t>(i);
      decoded[4 * i + 0] = loom::bfloat16::from_bits(b);
      decoded[4 * i + 1] = __bfloat162float(__ushort_as_bfloat16(b));
      decoded[4 * i + 2] = loom::half::from_bits(b);
      decoded[4 * i + 3] = __half2float(__ushort_as_half(b));
    }
  }
}

// Owns one device allocation of n T.
template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n) : n_(n) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)) == cudaSuccess);
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { cudaFree(p_); }
  T* get() const { return p_; }
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    REQUIRE(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }

 private:
  std::size_t n_;
  T* p_ = nullptr;
};

bool have_gpu() {
  int count = 0;
  // No driver, no device, or a driver too old for this runtime all mean: nothing to run on.
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace

TEST_CASE("core::bfloat16 decodes like __bfloat162float on the host", "[core][float16][cuda]") {
  check_host_decoding<bf16_pair>();
}

TEST_CASE("core::half decodes like __half2float on the host", "[core][float16][cuda]") {
  check_host_decoding<half_pair>();
}

TEST_CASE("core::bfloat16 rounds like __float2bfloat16_rn on the host", "[core][float16][cuda]") {
  check_host_encoding<bf16_pair>();
}

TEST_CASE("core::half rounds like __float2half_rn on the host", "[core][float16][cuda]") {
  check_host_encoding<half_pair>();
}

TEST_CASE("core::float16 conversions match CUDA in device code", "[core][float16][cuda]") {
  if (!have_gpu()) {
    (void)cudaGetLastError();  // clear the sticky error of the failed device query
    WARN("no GPU: device comparison skipped");
    return;
  }
  // Both formats' boundary sets, padded so every 16-bit pattern also gets a decoding thread.
  auto inputs = bf16_pair::inputs();
  const auto h = half_pair::inputs();
  inputs.insert(inputs.end(), h.begin(), h.end());
  if (inputs.size() < 0x10000u) inputs.resize(0x10000u, 0.0f);
  const std::size_t n = inputs.size();

  device_array<float> in(n), decoded(4 * 0x10000u);
  device_array<std::uint16_t> loom_bf16(n), cuda_bf16(n), loom_half(n), cuda_half(n);
  REQUIRE(cudaMemcpy(in.get(), inputs.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  convert_on_device<<<256, 256>>>(in.get(), n, loom_bf16.get(), cuda_bf16.get(), loom_half.get(), cuda_half.get(),
                                  decoded.get());
  REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);

  const auto lb = loom_bf16.to_host(), cb = cuda_bf16.to_host(), lh = loom_half.to_host(), ch = cuda_half.to_host();
  mismatches bad;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = inputs[i];
    // Device results must also equal the host's: one body serves both.
    if (lb[i] != cb[i] || lb[i] != loom::bfloat16(x).bits)
      bad.add("bfloat16 " + describe(x) + ": loom " + hex16(lb[i]) + ", CUDA " + hex16(cb[i]));
    if (lh[i] != ch[i] || lh[i] != loom::half(x).bits)
      bad.add("half " + describe(x) + ": loom " + hex16(lh[i]) + ", CUDA " + hex16(ch[i]));
  }
  const auto d = decoded.to_host();
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    if (!same_decoding(d[4 * b], d[4 * b + 1]) || !same_decoding(d[4 * b], loom::bfloat16::from_bits(bits)))
      bad.add("bfloat16 " + hex16(bits) + ": loom " + describe(d[4 * b]) + ", CUDA " + describe(d[4 * b + 1]));
    if (!same_decoding(d[4 * b + 2], d[4 * b + 3]) || !same_decoding(d[4 * b + 2], loom::half::from_bits(bits)))
      bad.add("half " + hex16(bits) + ": loom " + describe(d[4 * b + 2]) + ", CUDA " + describe(d[4 * b + 3]));
  }
  INFO(n << " floats and 65536 encodings on the device\n" << bad.first);
  CHECK(bad.count == 0);
}
