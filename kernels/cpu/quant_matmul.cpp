// Matmuls over packed 4-bit and 8-bit weights for the CPU; activations float32 in and out.
//
// M = activation rows, K = input features, N = output features (weight rows), G = group size.
//
// Q4 weights: qweight uint8 [N, K/2], scales and mins float16 [N, K/G]. K is split into
// sub-blocks of 32; byte j of sub-block b holds element 32b + j in its low nibble and element
// 32b + 16 + j in its high nibble (GGUF's Q4_0 / Q4_1 order), and
//     w[n, k] = q[n, k] * scales[n, k / G] + mins[n, k / G],   q in [0, 15]
// which is GGUF's Q4_1 dequantization exactly (Q4_0 is mins = -8 * scales).
// Q8 weights: qweight int8 [N, K], scales float16 [N, K/G], w = q * scales[n, k / G]
// (G = 32 is GGUF's Q8_0; G = K is one scale per output channel).
//
// How y[m, n] = sum_k x[m, k] w[n, k] is computed (AVX2):
// - Each row of x is quantized once per call: to int16 with one step for the row (act_bits
//   16, dx = the row's absmax / 32767: each element within dx / 2, 1.5e-5 of the row's
//   largest |x|), or to int8 per sub-block of 32 (act_bits 8, dx = absmax / 127: llama.cpp's
//   Q8 activations, about 4e-3). A step per row leaves each sub-block's sum one multiply by
//   the weight's scale; with a step per sub-block (tried) that multiply also loaded the
//   code's step, and the int16 kernels ran 25-45 % slower.
// - Codes meet in integer multiply-adds, summed exactly in int32 per sub-block: vpmaddwd for
//   int16 x (with AVX512-VNNI, half of them as vpdpwssd, which adds into the sum: 5-10 %
//   faster at 5-16 rows on Zen 4; 512-bit registers, tried, were not faster there);
//   vpmaddubsw for int8 x (the 4-bit codes as the unsigned operand, or int8 codes'
//   signs moved onto x). The x copy is stored permuted to the order in which the weight bytes
//   fall apart, so unpacking codes takes only shifts and masks, no shuffles.
// - Each sub-block's sum is converted and scaled by the weight's scale (times dx for int8
//   codes; int16 codes' dx multiplies the row's total once), FMA into 8 lanes; Q4's min
//   term, mins . (float32 sums of x per group), is one dot product per row at the end.
// The portable fallback (no AVX2) computes the same sums in float32 from unquantized x.
//
// Work splits over N in chunks (pool.cpp: torch.set_num_threads governs the thread count). A
// weight row is unpacked once per tile of up to kTileRows rows of x.
// loadtest/bench_quant.py measures every path; the variants tried are in its docstring.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif
#if defined(PDSERVE_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PDSERVE_VNNI 1
#endif

namespace {

constexpr int64_t kSub = 32;  // elements per sub-block
constexpr int kTileRows = 4;  // rows of x per pass over a weight row

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The problem's sizes, checked once.
struct Dims {
  int64_t M, K, N, G;
  int64_t num_groups() const { return K / G; }
  int64_t num_sub() const { return K / kSub; }
  int64_t num_pairs() const { return (num_sub() + 1) / 2; }
};

Dims check_args(const torch::Tensor& x, const torch::Tensor& qweight,
                const torch::Tensor& scales, int64_t group_size, int64_t elems_per_byte,
                int64_t act_bits) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be contiguous 2-D");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "act_bits must be 8 or 16, got ", act_bits);
  const Dims d{x.size(0), x.size(1), qweight.size(0), group_size};
  TORCH_CHECK(qweight.size(1) * elems_per_byte == d.K, "qweight has ", qweight.size(1),
              " columns; x's K = ", d.K, " needs ", d.K / elems_per_byte);
  TORCH_CHECK(d.K % kSub == 0, "K must be a multiple of 32, got ", d.K);
  const bool per_row = elems_per_byte == 1 && d.G == d.K;  // Q8 with one scale per row
  TORCH_CHECK(per_row || (d.G >= kSub && (d.G & (d.G - 1)) == 0 && d.K % d.G == 0),
              "group_size must be a power of two >= 32 that divides K = ", d.K,
              " (or K itself for Q8), got ", d.G);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == d.N &&
                  scales.size(1) == d.num_groups(),
              "scales must be contiguous float16 [N, K / group_size] = [", d.N, ", ",
              d.num_groups(), "]");
  return d;
}

#ifdef PDSERVE_AVX2
using pdserve_cpu::hsum;
#endif

// -- x, quantized per call ------------------------------------------------------------------

// Where element e (0..31) of sub-block b sits in x's code copy (one row).
// Q4, int16: a pair of sub-blocks is 32 code bytes, read as 16 words w whose four nibbles
//   (w & 15, w >> 4 & 15, w >> 8 & 15, w >> 12) are four vectors of 16 lanes.
// Q4, int8: a pair is [low nibbles of its 32 bytes | high nibbles]: [A0-15 B0-15 A16-31 B16-31].
// Q8, int16: a sub-block is its even bytes then its odd bytes; Q8, int8: element order.
inline int64_t x_slot(bool q4, bool x8, int64_t b, int64_t e) {
  if (!q4) return x8 ? b * 32 + e : b * 32 + (e % 2) * 16 + e / 2;
  const int64_t pair = b / 2, half = b % 2;
  if (x8) return pair * 64 + (e / 16) * 32 + half * 16 + e % 16;
  const int64_t byte = half * 16 + e % 16;  // byte of the pair's 32 holding element e
  const int64_t lane = byte / 2, odd = byte % 2, nibble = e / 16;
  return pair * 64 + (odd * 2 + nibble) * 16 + lane;
}

struct QuantizedX {
  std::vector<int8_t> q8;    // act_bits 8: [M, row_len]
  std::vector<int16_t> q16;  // act_bits 16: [M, row_len]
  // Q4: [M, num_pairs, 8], dx of each lane's sub-block (lanes 0-3 the pair's first, 4-7 its
  // second); Q8: [M, num_sub].
  std::vector<float> dx;
  std::vector<float> sums;   // Q4: [M, sums_len], float32 sums of x per weight group
  int64_t row_len = 0;       // codes per row: K rounded up to whole pairs (Q4)
  int64_t sums_len = 0;      // num_groups rounded up to a multiple of 8 (zero-padded)
};

// slots[kind][b % 2][e]: x_slot(q4, x8, b, e) relative to the sub-block's pair (Q4) or
// sub-block (Q8), for kind = q4 * 2 + x8.
struct SlotTables {
  int16_t slots[4][2][kSub];
  SlotTables() {
    for (int kind = 0; kind < 4; ++kind)
      for (int half = 0; half < 2; ++half)
        for (int e = 0; e < kSub; ++e) {
          const bool q4 = kind >= 2, x8 = kind % 2;
          const int64_t base = q4 ? 0 : half * 32;
          slots[kind][half][e] = static_cast<int16_t>(x_slot(q4, x8, half, e) - base);
        }
  }
};

QuantizedX quantize_x(const float* x, const Dims& d, bool q4, bool x8) {
  static const SlotTables tables;
  QuantizedX qx;
  const int64_t num_sub = d.num_sub(), num_pairs = d.num_pairs();
  qx.row_len = q4 ? num_pairs * 64 : d.K;
  if (x8) {
    qx.q8.assign(d.M * qx.row_len, 0);
  } else {
    qx.q16.assign(d.M * qx.row_len, 0);
  }
  qx.dx.assign(!x8 ? d.M : q4 ? d.M * num_pairs * 8 : d.M * num_sub, 0.f);
  qx.sums_len = (d.num_groups() + 7) / 8 * 8;
  if (q4) qx.sums.assign(d.M * qx.sums_len, 0.f);
  const float qmax = x8 ? 127.f : 32767.f;
  const int kind = q4 * 2 + x8;
  alignas(32) int32_t codes[kSub];
  for (int64_t m = 0; m < d.M; ++m) {
    // int16 codes: one step for the whole row (its largest |x| / 32767).
    float row_absmax = 0.f;
    if (!x8) {
      for (int64_t k = 0; k < d.K; ++k) row_absmax = std::max(row_absmax, std::fabs(x[m * d.K + k]));
      qx.dx[m] = row_absmax / qmax;
    }
    for (int64_t b = 0; b < num_sub; ++b) {
      const float* p = x + m * d.K + b * kSub;
      float absmax = 0.f, sum = 0.f;
#ifdef PDSERVE_AVX2
      __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(p + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        total = _mm256_add_ps(total, v[i]);
      }
      __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      a = _mm_max_ps(a, _mm_movehl_ps(a, a));
      absmax = _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
      sum = hsum(total);
      if (!x8) absmax = row_absmax;
      const __m256 inv = _mm256_set1_ps(absmax > 0.f ? qmax / absmax : 0.f);
      for (int i = 0; i < 4; ++i)  // rounds to nearest, ties to even (MXCSR's default)
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i),
                           _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
#else
      for (int64_t e = 0; e < kSub; ++e) {
        absmax = std::max(absmax, std::fabs(p[e]));
        sum += p[e];
      }
      if (!x8) absmax = row_absmax;
      const float inv = absmax > 0.f ? qmax / absmax : 0.f;
      for (int64_t e = 0; e < kSub; ++e) codes[e] = static_cast<int32_t>(std::nearbyint(p[e] * inv));
#endif
      const int64_t base = m * qx.row_len + (q4 ? (b / 2) * 64 : b * 32);
      const int16_t* slots = tables.slots[kind][b % 2];
      if (x8) {
        int8_t* row = qx.q8.data() + base;
        for (int e = 0; e < kSub; ++e) row[slots[e]] = static_cast<int8_t>(codes[e]);
      } else {
        int16_t* row = qx.q16.data() + base;
        for (int e = 0; e < kSub; ++e) row[slots[e]] = static_cast<int16_t>(codes[e]);
      }
      if (q4) qx.sums[m * qx.sums_len + b * kSub / d.G] += sum;
      if (x8 && q4) {
        std::fill_n(qx.dx.data() + (m * num_pairs + b / 2) * 8 + (b % 2) * 4, 4, absmax / qmax);
      } else if (x8) {
        qx.dx[m * num_sub + b] = absmax / qmax;
      }
    }
  }
  return qx;
}

// -- the AVX2 kernels -----------------------------------------------------------------------

#ifdef PDSERVE_AVX2

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Two consecutive float16 values -> [p[0] x 4, p[1] x 4].
inline __m256 pair_of_halves(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// mins . sums over a row's n groups (sums zero-padded to a multiple of 8).
inline float min_term(const uint16_t* mins, const float* sums, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + i)));
    acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums + i), acc);
  }
  float total = hsum(acc);
  for (; i < n; ++i) total += _cvtsh_ss(mins[i]) * sums[i];
  return total;
}

// R rows of x (from row m0) against one Q4 weight row. group_shift = log2(G).
template <int R, bool X8>
void q4_tile(const uint8_t* qrow, const uint16_t* scales, const uint16_t* mins,
             const QuantizedX& qx, int64_t m0, int group_shift, const Dims& d, float* out) {
  const int64_t num_sub = d.num_sub(), whole_pairs = num_sub / 2, num_pairs = d.num_pairs();
  const bool pair_scales = group_shift == 5;  // G = 32: the pair's sub-blocks differ
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    // A lone last sub-block reads 16 bytes; its pair's missing half has zero x codes.
    const __m256i w = p < whole_pairs ? load256(qrow + p * 32)
                                      : _mm256_zextsi128_si256(_mm_loadu_si128(
                                            reinterpret_cast<const __m128i*>(qrow + p * 32)));
    const __m256 sv = pair_scales && p < whole_pairs
                          ? pair_of_halves(scales + 2 * p)
                          : _mm256_set1_ps(_cvtsh_ss(scales[(p << 6) >> group_shift]));
    __m256i v[4];
    if constexpr (X8) {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      v[0] = _mm256_and_si256(w, low4);
      v[1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
    } else {
      const __m256i low4 = _mm256_set1_epi16(0x000F);
      v[0] = _mm256_and_si256(w, low4);
      v[1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      v[2] = _mm256_and_si256(_mm256_srli_epi16(w, 8), low4);
      v[3] = _mm256_srli_epi16(w, 12);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * qx.row_len + p * 64;
      __m256i s;
      if constexpr (X8) {
        // 4-bit code x int8 pairs stay within int16: 2 * 15 * 127, twice.
        const int8_t* xp = qx.q8.data() + at;
        s = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(v[0], load256(xp)),
                                               _mm256_maddubs_epi16(v[1], load256(xp + 32))),
                              _mm256_set1_epi16(1));
      } else {
        const int16_t* xp = qx.q16.data() + at;
#ifdef PDSERVE_VNNI
        s = _mm256_dpwssd_epi32(_mm256_madd_epi16(v[0], load256(xp)), v[1], load256(xp + 16));
        const __m256i t =
            _mm256_dpwssd_epi32(_mm256_madd_epi16(v[2], load256(xp + 32)), v[3], load256(xp + 48));
        s = _mm256_add_epi32(s, t);
#else
        s = _mm256_add_epi32(_mm256_madd_epi16(v[0], load256(xp)),
                             _mm256_madd_epi16(v[1], load256(xp + 16)));
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(v[2], load256(xp + 32)),
                                                 _mm256_madd_epi16(v[3], load256(xp + 48))));
#endif
      }
      if constexpr (X8) {
        const __m256 scale =
            _mm256_mul_ps(sv, _mm256_loadu_ps(qx.dx.data() + ((m0 + r) * num_pairs + p) * 8));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
      } else {  // int16 codes share one dx per row: applied once, at the end
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sv, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = hsum(acc[r]) * (X8 ? 1.0f : qx.dx[m0 + r]) +
             min_term(mins, qx.sums.data() + (m0 + r) * qx.sums_len, d.num_groups());
}

// R rows of x against one Q8 weight row. group_shift = log2(G), or -1: one scale per row.
template <int R, bool X8>
void q8_tile(const uint8_t* qrow, const uint16_t* scales, const QuantizedX& qx, int64_t m0,
             int group_shift, const Dims& d, float* out) {
  const int64_t num_sub = d.num_sub();
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const float row_scale = _cvtsh_ss(scales[0]);
  for (int64_t b = 0; b < num_sub; ++b) {
    const __m256i w = load256(qrow + b * 32);
    const float sw = group_shift < 0 ? 1.0f : _cvtsh_ss(scales[(b << 5) >> group_shift]);
    __m256i v[2];
    if constexpr (X8) {
      v[0] = _mm256_sign_epi8(w, w);  // |w|: w's signs move onto x below
    } else {
      v[0] = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);  // even bytes
      v[1] = _mm256_srai_epi16(w, 8);                        // odd bytes
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * qx.row_len + b * 32;
      __m256i s;
      if constexpr (X8) {
        const __m256i sx = _mm256_sign_epi8(load256(qx.q8.data() + at), w);
        s = _mm256_madd_epi16(_mm256_maddubs_epi16(v[0], sx), _mm256_set1_epi16(1));
      } else {
        const int16_t* xp = qx.q16.data() + at;
#ifdef PDSERVE_VNNI
        s = _mm256_dpwssd_epi32(_mm256_madd_epi16(v[0], load256(xp)), v[1], load256(xp + 16));
#else
        s = _mm256_add_epi32(_mm256_madd_epi16(v[0], load256(xp)),
                             _mm256_madd_epi16(v[1], load256(xp + 16)));
#endif
      }
      const float dx = X8 ? qx.dx[(m0 + r) * num_sub + b] : 1.0f;  // int16: per row, below
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(sw * dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = hsum(acc[r]) * (group_shift < 0 ? row_scale : 1.0f) * (X8 ? 1.0f : qx.dx[m0 + r]);
}

template <bool Q4, bool X8>
void run_tile(int rows, const uint8_t* qrow, const uint16_t* scales, const uint16_t* mins,
              const QuantizedX& qx, int64_t m0, int group_shift, const Dims& d, float* out) {
  switch (rows) {
#define PDSERVE_TILE(R)                                                                     \
  case R:                                                                                   \
    if constexpr (Q4) {                                                                     \
      return q4_tile<R, X8>(qrow, scales, mins, qx, m0, group_shift, d, out);               \
    } else {                                                                                \
      return q8_tile<R, X8>(qrow, scales, qx, m0, group_shift, d, out);                     \
    }
    PDSERVE_TILE(4)
    PDSERVE_TILE(3)
    PDSERVE_TILE(2)
    default:
      PDSERVE_TILE(1)
#undef PDSERVE_TILE
  }
}

#endif  // PDSERVE_AVX2

// Float32 reference of one weight row against one x row (no AVX2).
template <bool Q4>
float row_dot_scalar(const uint8_t* qrow, const uint16_t* scales, const uint16_t* mins,
                     const float* x, const Dims& d) {
  float total = 0.f;
  for (int64_t b = 0; b < d.num_sub(); ++b) {
    float s = 0.f, sx = 0.f;
    for (int64_t e = 0; e < kSub; ++e) {
      int q;
      if constexpr (Q4) {
        const uint8_t byte = qrow[b * 16 + e % 16];
        q = e < 16 ? (byte & 15) : (byte >> 4);
      } else {
        q = reinterpret_cast<const int8_t*>(qrow)[b * kSub + e];
      }
      s += static_cast<float>(q) * x[b * kSub + e];
      sx += x[b * kSub + e];
    }
    const int64_t g = b * kSub / d.G;
    total += s * half_to_float(scales[g]);
    if constexpr (Q4) total += sx * half_to_float(mins[g]);
  }
  return total;
}

template <bool Q4>
torch::Tensor packed_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                            const torch::Tensor& scales, const uint16_t* mins, const Dims& d,
                            int64_t act_bits) {
  auto out = torch::empty({d.M, d.N}, x.options());
  if (d.M == 0 || d.N == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto* qp = qweight.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const int64_t row_bytes = Q4 ? d.K / 2 : d.K;
  const int64_t num_groups = d.num_groups();
#ifdef PDSERVE_AVX2
  const bool x8 = act_bits == 8;
  const QuantizedX qx = quantize_x(xp, d, Q4, x8);
  // Group sizes are powers of two (checked): sub-block -> group is a shift, not a division.
  const int group_shift = (!Q4 && d.G == d.K) ? -1 : __builtin_ctzll(d.G);
  pdserve_cpu::parallel_for(d.N, 16, [&](int64_t n0, int64_t n1) {
    float acc[kTileRows];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qrow = qp + n * row_bytes;
      const uint16_t* row_scales = sp + n * num_groups;
      const uint16_t* row_mins = Q4 ? mins + n * num_groups : nullptr;
      for (int64_t m0 = 0; m0 < d.M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, d.M - m0));
        if (x8) {
          run_tile<Q4, true>(rows, qrow, row_scales, row_mins, qx, m0, group_shift, d, acc);
        } else {
          run_tile<Q4, false>(rows, qrow, row_scales, row_mins, qx, m0, group_shift, d, acc);
        }
        for (int r = 0; r < rows; ++r) op[(m0 + r) * d.N + n] = acc[r];
      }
    }
  });
#else
  (void)act_bits;
  pdserve_cpu::parallel_for(d.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < d.M; ++m)
        op[m * d.N + n] = row_dot_scalar<Q4>(qp + n * row_bytes, sp + n * num_groups,
                                             Q4 ? mins + n * num_groups : nullptr,
                                             xp + m * d.K, d);
  });
#endif
  return out;
}

}  // namespace

namespace pdserve_cpu {

torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const torch::Tensor& mins,
                        int64_t group_size, int64_t act_bits) {
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8, "Q4 qweight must be uint8");
  const Dims d = check_args(x, qweight, scales, group_size, 2, act_bits);
  TORCH_CHECK(mins.scalar_type() == torch::kFloat16 && mins.is_contiguous() &&
                  mins.sizes() == scales.sizes(),
              "mins must be contiguous float16 shaped like scales");
  const auto* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  return packed_matmul<true>(x, qweight, scales, mp, d, act_bits);
}

torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, int64_t group_size, int64_t act_bits) {
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8, "Q8 qweight must be int8");
  const Dims d = check_args(x, qweight, scales, group_size, 1, act_bits);
  return packed_matmul<false>(x, qweight.view(torch::kUInt8), scales, nullptr, d, act_bits);
}

// Rows [row_start, row_end) of Q4 weights as float32 [rows, K]: for large M, a chunk is
// dequantized and multiplied by one float32 GEMM.
torch::Tensor q4_dequantize(const torch::Tensor& qweight, const torch::Tensor& scales,
                            const torch::Tensor& mins, int64_t group_size, int64_t row_start,
                            int64_t row_end) {
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && qweight.dim() == 2 &&
                  qweight.is_contiguous(), "Q4 qweight must be contiguous uint8 [N, K/2]");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, G = group_size;
  TORCH_CHECK(0 <= row_start && row_start <= row_end && row_end <= N, "bad row range [",
              row_start, ", ", row_end, ") of ", N);
  TORCH_CHECK(G > 0 && G % kSub == 0 && K % G == 0, "bad group_size ", G, " for K = ", K);
  const int64_t num_groups = K / G;
  TORCH_CHECK(scales.numel() == N * num_groups && mins.numel() == N * num_groups,
              "scales and mins must be [N, K / group_size]");
  auto out = torch::empty({row_end - row_start, K}, torch::dtype(torch::kFloat32));
  const auto* qp = qweight.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  pdserve_cpu::parallel_for(row_end - row_start, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t n = row_start + r0; n < row_start + r1; ++n) {
      const uint8_t* qrow = qp + n * (K / 2);
      float* orow = op + (n - row_start) * K;
      for (int64_t b = 0; b < K / kSub; ++b) {
        const int64_t g = n * num_groups + b * kSub / G;
        const float scale = half_to_float(sp[g]), min = half_to_float(mp[g]);
        float* o = orow + b * kSub;
        const uint8_t* q = qrow + b * 16;
#ifdef PDSERVE_AVX2
        // q * scale + min in one FMA: q * scale is exact in float32 (4 x 11 significant
        // bits), so this rounds once, as the reference's product-then-sum does.
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        const __m128i low4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(bytes, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(min);
        const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
        for (int i = 0; i < 4; ++i) {
          const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
          _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(codes, vs, vm));
        }
#else
        for (int j = 0; j < 16; ++j) {
          o[j] = static_cast<float>(q[j] & 15) * scale + min;
          o[16 + j] = static_cast<float>(q[j] >> 4) * scale + min;
        }
#endif
      }
    }
  });
  return out;
}

bool has_avx2() {
#ifdef PDSERVE_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace pdserve_cpu

// The kernels touch no Python object: they let go of the GIL, so a service's asyncio thread
// (gRPC streams) runs while the engine thread computes.
void register_quant(pybind11::module& m) {
  using namespace pdserve_cpu;
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("q4_matmul", &q4_matmul, release(),
        "x [M, K] float32 @ Q4 weights [N, K]^T -> [M, N] float32");
  m.def("q8_matmul", &q8_matmul, release(),
        "x [M, K] float32 @ Q8 weights [N, K]^T -> [M, N] float32");
  m.def("q4_dequantize", &q4_dequantize, release(), "rows of Q4 weights -> float32 [rows, K]");
  m.def("has_avx2", &has_avx2, "whether the AVX2 / FMA / F16C code was compiled in");
}
