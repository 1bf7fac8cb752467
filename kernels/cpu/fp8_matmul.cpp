// Matmuls over weights stored as 8-bit FP8 E4M3 codes (common/models/quant/fp8.py) or as
// bfloat16 / float16 (a checkpoint's float output head, common/models/quant/half.py) for the
// few rows of a decode step: each weight converted to float32 as it is read, exactly, and
// multiplied in float32.
//
// M = activation rows, K = input features, N = output features (weight rows).
//
// Layout: 16 rows interleaved, [ceil(N / 16), K, 16] (the 16 rows' weights at column j side
// by side, the last block padded with zero rows). A vector of 16 weights meets one activation
// broadcast, so each 16 rows are one sequential stream and the sums need no reduction across
// lanes; the activation rows a pass holds (up to 8) share every weight load. Row-major, four
// rows a pass read as four streams, the same work got half the memory bandwidth on Zen 4
// (SmolLM2's bfloat16 head: 3.1 ms a row against 1.5, 13.8 ms at 16 rows against 6.6).
//
// Each output is two float32 chains over its row's columns (even and odd columns, fused
// multiply-adds in column order), their sum, then the row's scale (FP8; none for half
// weights): the same operations whatever the batch and the tile, so a row of x gets the same
// bits alone or beside others.
//
// Conversions: an E4M3 byte s eeee mmm placed in a float32's bits as s at bit 31 and eeee mmm
// at bits 26..20 is a float32 of the same significand with exponent e - 127 instead of e - 7
// (E4M3's subnormals land on float32's subnormals the same way): the code times 2^-120,
// exactly; the 2^120 goes into the row's scale (Fp8Weight.kernel_scale). A bfloat16's bits
// are a float32's top half; float16 converts with vcvtph2ps.

#include <c10/util/Half.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_FP8_512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_HALF_256 1
#endif

namespace {

enum class Kind { kFp8, kBf16, kF16 };

template <Kind K>
using CodeOf = std::conditional_t<K == Kind::kFp8, uint8_t, uint16_t>;

template <Kind K>
inline float scalar(CodeOf<K> c) {
  uint32_t bits;
  if constexpr (K == Kind::kFp8) {
    bits = (static_cast<uint32_t>(c & 0x80) << 24) | (static_cast<uint32_t>(c & 0x7F) << 20);
  } else if constexpr (K == Kind::kBf16) {
    bits = static_cast<uint32_t>(c) << 16;
  } else {
    return static_cast<float>(c10::Half(c, c10::Half::from_bits()));
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// 16 lanes of float32: one zmm on AVX-512, two ymm on AVX2, else an array (std::fma, so
// every path rounds as the fused multiply-add does).
#if defined(PDSERVE_FP8_512)
struct Lanes16 {
  __m512 v;
  static Lanes16 zero() { return {_mm512_setzero_ps()}; }
  template <Kind K>
  static Lanes16 load(const CodeOf<K>* p) {
    if constexpr (K == Kind::kFp8) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
      const __m512i rest = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
      return {_mm512_castsi512_ps(_mm512_or_si512(sign, rest))};
    } else if constexpr (K == Kind::kBf16) {
      const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return {_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))};
    } else {
      return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
    }
  }
  void fma(const Lanes16& w, float x) { v = _mm512_fmadd_ps(w.v, _mm512_set1_ps(x), v); }
  void store_sum(const Lanes16& other, float* out) const { _mm512_storeu_ps(out, _mm512_add_ps(v, other.v)); }
};
#elif defined(PDSERVE_HALF_256)
struct Lanes16 {
  __m256 lo, hi;
  static Lanes16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  template <Kind K>
  static __m256 load8(const CodeOf<K>* p) {
    if constexpr (K == Kind::kFp8) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
      const __m256i rest = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
      return _mm256_castsi256_ps(_mm256_or_si256(sign, rest));
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (K == Kind::kF16) return _mm256_cvtph_ps(h);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  template <Kind K>
  static Lanes16 load(const CodeOf<K>* p) { return {load8<K>(p), load8<K>(p + 8)}; }
  void fma(const Lanes16& w, float x) {
    const __m256 xv = _mm256_set1_ps(x);
    lo = _mm256_fmadd_ps(w.lo, xv, lo);
    hi = _mm256_fmadd_ps(w.hi, xv, hi);
  }
  void store_sum(const Lanes16& other, float* out) const {
    _mm256_storeu_ps(out, _mm256_add_ps(lo, other.lo));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(hi, other.hi));
  }
};
#else
struct Lanes16 {
  float v[16];
  static Lanes16 zero() { return Lanes16{}; }
  template <Kind K>
  static Lanes16 load(const CodeOf<K>* p) {
    Lanes16 r;
    for (int l = 0; l < 16; ++l) r.v[l] = scalar<K>(p[l]);
    return r;
  }
  void fma(const Lanes16& w, float x) {
    for (int l = 0; l < 16; ++l) v[l] = std::fma(w.v[l], x, v[l]);
  }
  void store_sum(const Lanes16& other, float* out) const {
    for (int l = 0; l < 16; ++l) out[l] = v[l] + other.v[l];
  }
};
#endif

// Weight rows [16 b, 16 b + 16) (wb: their block) against activation rows [i0, i0 + T) into
// out16 (T x 16).
template <Kind K, int T>
void x16_tile(const float* x, const CodeOf<K>* wb, int64_t k, int64_t i0, float* out16) {
  Lanes16 even[T], odd[T];
  for (int t = 0; t < T; ++t) even[t] = odd[t] = Lanes16::zero();
  int64_t j = 0;
  for (; j + 2 <= k; j += 2) {
    const Lanes16 we = Lanes16::load<K>(wb + j * 16), wo = Lanes16::load<K>(wb + (j + 1) * 16);
    for (int t = 0; t < T; ++t) {
      const float* xr = x + (i0 + t) * k + j;
      even[t].fma(we, xr[0]);
      odd[t].fma(wo, xr[1]);
    }
  }
  if (j < k) {
    const Lanes16 we = Lanes16::load<K>(wb + j * 16);
    for (int t = 0; t < T; ++t) even[t].fma(we, x[(i0 + t) * k + j]);
  }
  for (int t = 0; t < T; ++t) even[t].store_sum(odd[t], out16 + t * 16);
}

constexpr int kTile = 8;  // rows of x a pass holds in registers

template <Kind K>
torch::Tensor x16_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                         const float* scale) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous float32 [M, K] CPU matrix");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == 16 &&
                  packed.size(1) == x.size(1),
              "weights must be contiguous [ceil(N / 16), K, 16] with x's K");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(n > 16 * (blocks - 1) && n <= 16 * blocks, "n must fit the packed blocks");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  const CodeOf<K>* wp = reinterpret_cast<const CodeOf<K>*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  pdserve_cpu::parallel_for(blocks, 4, [&](int64_t b0, int64_t b1) {
    float tile[kTile * 16];
    for (int64_t b = b0; b < b1; ++b) {
      const CodeOf<K>* wb = wp + b * k * 16;
      const int64_t lanes = std::min<int64_t>(16, n - b * 16);
      for (int64_t i0 = 0; i0 < m; i0 += kTile) {
        const int64_t rows = std::min<int64_t>(kTile, m - i0);
        switch (rows) {
          case 8: x16_tile<K, 8>(xp, wb, k, i0, tile); break;
          case 7: x16_tile<K, 7>(xp, wb, k, i0, tile); break;
          case 6: x16_tile<K, 6>(xp, wb, k, i0, tile); break;
          case 5: x16_tile<K, 5>(xp, wb, k, i0, tile); break;
          case 4: x16_tile<K, 4>(xp, wb, k, i0, tile); break;
          case 3: x16_tile<K, 3>(xp, wb, k, i0, tile); break;
          case 2: x16_tile<K, 2>(xp, wb, k, i0, tile); break;
          default: x16_tile<K, 1>(xp, wb, k, i0, tile); break;
        }
        for (int64_t t = 0; t < rows; ++t) {
          float* row = op + (i0 + t) * n + b * 16;
          if (scale == nullptr) {
            std::memcpy(row, tile + t * 16, lanes * sizeof(float));
          } else {
            for (int64_t l = 0; l < lanes; ++l) row[l] = tile[t * 16 + l] * scale[b * 16 + l];
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace pdserve_cpu {

torch::Tensor fp8_x16_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                             const torch::Tensor& scale, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "FP8 codes must be uint8 (E4M3 bytes)");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == n,
              "scale must be float32 [N]");
  return x16_matmul<Kind::kFp8>(x, packed, n, scale.data_ptr<float>());
}

torch::Tensor half_x16_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  if (packed.scalar_type() == torch::kBFloat16) return x16_matmul<Kind::kBf16>(x, packed, n, nullptr);
  TORCH_CHECK(packed.scalar_type() == torch::kHalf, "weights must be bfloat16 or float16");
  return x16_matmul<Kind::kF16>(x, packed, n, nullptr);
}

}  // namespace pdserve_cpu

void register_fp8(pybind11::module& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("fp8_x16_matmul", &pdserve_cpu::fp8_x16_matmul, release(),
        "x [M, K] float32 @ (E4M3 codes, 16 rows interleaved [ceil(N / 16), K, 16] uint8, "
        "each times 2^-120)^T * scale [N] -> [M, N] float32");
  m.def("half_x16_matmul", &pdserve_cpu::half_x16_matmul, release(),
        "x [M, K] float32 @ bfloat16 / float16 weights, 16 rows interleaved [ceil(N / 16), K, 16] "
        "-> [M, N] float32");
}
