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
// A bfloat16 head multiplies as a bfloat16 linear layer does: x rounded to bfloat16 (to
// nearest even), each product of two bfloat16 values exact in float32, float32 sums. With
// AVX512-BF16 (Zen 4, Sapphire Rapids) one vdpbf16ps adds the two products of a column pair
// into each of 16 lanes, twice the multiply-adds of an FMA (bf16_dot_matmul): SmolLM2's
// 49152-row head at 16 rows takes 2.8 ms where float32 x and FMAs (a float16 head of that
// size) take 5.6 (Zen 4, loadtest/bench_half_head.py). Splitting x into two bfloat16 parts
// to keep float32's precision takes two vdpbf16ps a pair, no faster than the FMAs (5.4-5.7
// ms against 5.5 in a standalone loop). Each output there is one chain over the column pairs
// in order, the two products of a pair summed as the instruction does (bfloat16 inputs and
// outputs below float32's normal range taken as zero). Without the instruction, the FMA
// path above runs on the rounded x: each product the same exact value.
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
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_FP8_512 1
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PDSERVE_BF16_DOT 1
#endif
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

// A float32 rounded to bfloat16, to nearest even (a NaN stays a NaN).
inline uint16_t round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(PDSERVE_BF16_DOT)
// Rows of x [i0, i0 + T) as bfloat16 pairs (xp: [M, P] words, column 2p in the low half,
// 2p + 1 in the high, a zero past an odd K) against the B blocks of 16 weight rows from
// block j0, into out [M, n]. Each output is one chain over the column pairs in order, so its
// bits do not depend on T or B; a vector of x's pair serves B blocks (Zen 4 issues a
// broadcast on the same pipes as vdpbf16ps: at one block a pass, half its slots went to
// broadcasts).
template <int T, int B>
void bf16_dot_tile(const uint32_t* xp, int64_t num_pairs, const uint16_t* wp, int64_t k,
                   int64_t i0, int64_t j0, int64_t n, float* out) {
  // word 2i: row i of the first column (word i), word 2i + 1: row i of the second (16 + i)
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // fmt: skip
  __m512 acc[T][B];
  for (int t = 0; t < T; ++t)
    for (int b = 0; b < B; ++b) acc[t][b] = _mm512_setzero_ps();
  const uint16_t* wb = wp + j0 * k * 16;
  auto pair = [&](int64_t p, const __m512i* w) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(interleave, w[b]));
    for (int t = 0; t < T; ++t) {
      const __m512bh xv = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int32_t>(xp[(i0 + t) * num_pairs + p])));
      for (int b = 0; b < B; ++b) acc[t][b] = _mm512_dpbf16_ps(acc[t][b], wv[b], xv);
    }
  };
  const int64_t whole = k / 2;  // pairs whose two columns are both in the block
  __m512i w[B];
  for (int64_t p = 0; p < whole; ++p) {
    for (int b = 0; b < B; ++b) w[b] = _mm512_loadu_si512(wb + b * k * 16 + p * 32);
    pair(p, w);
  }
  if (whole < num_pairs) {  // an odd K's last column: its 16 weights, then zeros
    for (int b = 0; b < B; ++b)
      w[b] = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + b * k * 16 + whole * 32)));
    pair(whole, w);
  }
  for (int b = 0; b < B; ++b) {
    const int64_t first = (j0 + b) * 16;
    const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - first)) - 1);
    for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + (i0 + t) * n + first, lanes, acc[t][b]);
  }
}

constexpr int kDotRows = 6;    // rows of x a pass takes: 6 x 4 blocks hold 24 accumulators
constexpr int kDotBlocks = 4;  // a lone row takes one block at a time (one stream)

// x [M, K] float32 rounded to bfloat16 @ bfloat16 weights [ceil(N / 16), K, 16]: tiles of
// 6 rows by 4 blocks took SmolLM2's head at 16 rows in 2.8 ms where 8 rows by one block with
// two chains took 3.6, 4 x 4 2.9, 8 x 2 3.1 (Zen 4, a standalone loop over the same layout).
void bf16_dot_matmul(const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t blocks,
                     int64_t n, float* out) {
  const int64_t num_pairs = (k + 1) / 2;
  std::vector<uint32_t> pairs(m * num_pairs, 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j)
      pairs[i * num_pairs + j / 2] |= static_cast<uint32_t>(round_bf16(x[i * k + j])) << (16 * (j % 2));
  const uint32_t* xp = pairs.data();
  const int64_t passes = (m + kDotRows - 1) / kDotRows;
  const int64_t group = m == 1 ? 1 : kDotBlocks;
  const int64_t num_groups = (blocks + group - 1) / group;
  pdserve_cpu::parallel_for(num_groups, 1, [&](int64_t g0, int64_t g1) {
    const int64_t j1 = std::min(blocks, g1 * group);
    for (int64_t j = g0 * group; j < j1;) {
      const bool whole = m > 1 && j + kDotBlocks <= j1;
      for (int64_t p = 0, i0 = 0; p < passes; ++p) {
        const int rows = static_cast<int>((m - i0) / (passes - p));
#define PDSERVE_DOT_TILE(R)                                                       \
  if (whole) {                                                                    \
    bf16_dot_tile<R, kDotBlocks>(xp, num_pairs, wp, k, i0, j, n, out);            \
  } else {                                                                        \
    bf16_dot_tile<R, 1>(xp, num_pairs, wp, k, i0, j, n, out);                     \
  }
        switch (rows) {
          case 6: PDSERVE_DOT_TILE(6) break;
          case 5: PDSERVE_DOT_TILE(5) break;
          case 4: PDSERVE_DOT_TILE(4) break;
          case 3: PDSERVE_DOT_TILE(3) break;
          case 2: PDSERVE_DOT_TILE(2) break;
          default: PDSERVE_DOT_TILE(1) break;
        }
#undef PDSERVE_DOT_TILE
        i0 += rows;
      }
      j += whole ? kDotBlocks : 1;
    }
  });
}
#endif

void check_x16(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous float32 [M, K] CPU matrix");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == 16 &&
                  packed.size(1) == x.size(1),
              "weights must be contiguous [ceil(N / 16), K, 16] with x's K");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(n > 16 * (blocks - 1) && n <= 16 * blocks, "n must fit the packed blocks");
}

template <Kind K>
torch::Tensor x16_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                         const float* scale) {
  check_x16(x, packed, n);
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  auto out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  const CodeOf<K>* wp = reinterpret_cast<const CodeOf<K>*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  std::vector<float> rounded;  // a bfloat16 head's x (the FMA path)
  if constexpr (K == Kind::kBf16) {
    rounded.resize(m * k);
    for (int64_t i = 0; i < m * k; ++i) {
      const uint32_t bits = static_cast<uint32_t>(round_bf16(xp[i])) << 16;
      std::memcpy(&rounded[i], &bits, 4);
    }
    xp = rounded.data();
  }
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
#if defined(PDSERVE_BF16_DOT)
  if (packed.scalar_type() == torch::kBFloat16) {
    check_x16(x, packed, n);
    auto out = torch::empty({x.size(0), n}, x.options());
    if (x.size(0) > 0 && n > 0)
      bf16_dot_matmul(x.data_ptr<float>(), x.size(0), x.size(1),
                      reinterpret_cast<const uint16_t*>(packed.data_ptr()), packed.size(0), n,
                      out.data_ptr<float>());
    return out;
  }
#endif
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
