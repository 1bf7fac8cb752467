// Matmuls over packed 4-bit and 8-bit weights in a 16-row interleaved layout, for CPUs with
// AVX-512 (F, BW, VL) and VNNI; activations float32 in and out, quantized inside to int16
// codes with one step per row, as quant_matmul.cpp's act_bits 16, or with act_bits 8 to
// int8 codes with a step per 32 (see "The 8-bit activation path" below).
//
// M = activation rows, K = input features, N = output features (weight rows), G = group size,
// NB = N / 16 (blocks of 16 weight rows), SB = K / 32 (sub-blocks of 32 elements).
//
// Why another layout: quant_matmul.cpp walks one weight row at a time and sums its products
// across a vector's lanes at the end (a horizontal sum per output). Here the 16 lanes of a
// 512-bit register are 16 weight rows: x's pair of int16 codes (x[k], x[k+1]) is broadcast
// to every lane and one vpdpwssd adds w[n, k] x[k] + w[n, k+1] x[k+1] into lane n, so a
// register of sums is 16 outputs, stored as they are, and the codes unpack with shifts and
// masks. The integer sums of each sub-block are exact, as in quant_matmul.cpp; only the
// float32 order of the per-sub-block sums differs (each lane adds its own in order).
//
// Q4x16: qweight uint8 [NB, SB, 4, 64]. In chunk c (0..3) of n-block j, sub-block b, the
//   64 bytes are 32 little-endian 16-bit words; word 2i + h (lane i, h = 0 / 1) holds in its
//   nibble t (bits 4t..4t+3) the code q[16j + i, 32b + 8c + 2t + h].
//   scales, mins float16 [NB, K / G, 16]: lane i of group g is row 16j + i's; mins may be
//   empty where every min is -8 x its scale (symmetric codes), and are then not held.
//   w[n, k] = q * scale + min (GGUF's Q4_1; quant_matmul.cpp's Q4).
// Q8x16: qweight int8 [NB, SB, 16, 32]. In chunk c (0..15), byte 2i + h holds
//   q[16j + i, 32b + 2c + h]. scales float16 [NB, K / G, 16] (G = K: one scale per row).
//   w[n, k] = q * scale.
// kernels/cpu/quant.py packs both from quant_matmul.cpp's layout (pack_q4_x16 / pack_q8_x16).
//
// y[m, n] = dx[m] * (sum_b scale[n, g(b)] * S[m, n, b] + sum_g min[n, g] * xsum[m, g] / dx[m])
// with S the exact int32 sum of sub-block b's code products, dx the row's step and xsum the
// float32 sum of x over group g (Q4's min term, folded into the same accumulator).
//
// Tiles: R rows of x times T n-blocks; the sums of a tile live in registers
// (R * T int32 + R * T float32 vectors), and each unpacked weight vector serves R rows.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef PDSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define PDSERVE_X16 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_X8_AVX2 1  // x8_quantize_rows only: kquant_x16.cpp's AVX2 8-bit path reads it
#endif

namespace {

constexpr int64_t kSub = 32;
constexpr int64_t kLanes = 16;
// n-blocks per pass: a lone row takes 1 (its sums in two chains), tiles of 2-4 rows take 2 (8
// chains at 4 rows, with 16 accumulators and the unpacked codes in 32 registers), where a
// thread's share is too short for the runs below.
constexpr int kSingleRowBlocks = 1;
constexpr int kTileBlocks = 2;
// A lone row reads a thread's n-blocks as pdserve_cpu::kRowStreams (4) runs at once (4
// independent chains of sums), since it is bound by how fast its weights stream from memory
// and one stream of loads a thread reads far below the machine's rate. On an Intel Xeon
// with AMX (one thread's single stream reads 11 GB/s, four 14) the 30 layers of Q8_0 weights
// of one row took 4.8-5.0 ms a step in place of 6.3 (Q4x16 measured alike there); on an
// Intel Xeon without (Ice Lake, two threads reading 25 GB/s in one run each, 30 in four)
// SmolLM2's 30 layers of Q4_0-shaped Q4x16 weights read from DRAM took 3.68 ms in place of
// 4.24 (8-bit codes) and 4.86 in place of 5.54 (16-bit), and the Q4_1 file's decode step's
// layers 4.7 ms in place of 5.2 (docs/benchmarks/2026-12-04-quant/README.md, fifteenth and
// sixteenth sessions). Whether it does (set_row_streams: for comparisons; the same bits).
std::atomic<bool>& row_streams_switch() {
  static std::atomic<bool> on{true};
  return on;
}
// Rows of x per pass over the weights: 5-8 rows take one n-block at a time (8 int32 and 8
// float32 accumulators), so a speculative verify of up to 7 guesses unpacks each weight once
// (3-7 % faster at 5-9 rows than a 4-row and a 1-row pass, loadtest/bench_quant.py).
constexpr int kMaxTileRows = 8;

struct Dims16 {
  int64_t M, K, N, G;
  int64_t num_sub() const { return K / kSub; }
  int64_t num_groups() const { return K / G; }
  int64_t num_blocks() const { return N / kLanes; }
};

Dims16 check_x16(const torch::Tensor& x, const torch::Tensor& qweight,
                 const torch::Tensor& scales, int64_t group_size, int64_t n,
                 int64_t block_bytes) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] matrix");
  const Dims16 d{x.size(0), x.size(1), n, group_size};
  TORCH_CHECK(d.K % kSub == 0, "K must be a multiple of 32, got ", d.K);
  TORCH_CHECK(d.N % kLanes == 0 && d.N > 0, "N must be a positive multiple of 16, got ", d.N);
  TORCH_CHECK(d.G >= kSub && d.K % d.G == 0 && (d.G == d.K || (d.G & (d.G - 1)) == 0),
              "group_size must be a power of two >= 32 dividing K = ", d.K, " (or K), got ",
              d.G);
  TORCH_CHECK(qweight.is_contiguous() && qweight.numel() == d.num_blocks() * d.num_sub() * block_bytes,
              "qweight must be contiguous [N/16, K/32, ", block_bytes, "] bytes for N = ", d.N,
              ", K = ", d.K);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                  scales.numel() == d.num_blocks() * d.num_groups() * kLanes,
              "scales must be contiguous float16 [N/16, K/G, 16]");
  return d;
}

// x as int16 codes, one step per row (dx = the row's largest |x| / 32767, round to nearest
// even), with Q4's group sums of x divided by dx.
struct CodesX {
  std::vector<int16_t> codes;  // [M, K]
  std::vector<float> dx;       // [M]
  std::vector<float> xsum;     // [M, K / G], each / dx (zero when dx is)
};

#if defined(PDSERVE_X16) || defined(PDSERVE_X8_AVX2)
// One sub-block's 32 codes in the quad order of planes of width 4 or 2 (kquant_x16.cpp's
// pairing: within each 16 bytes, bytes 2p, 2p2, 2p + 1, 2p2 + 1 per quad; vpshufb's indices,
// per 128-bit lane), or as they are (order 8).
inline __m256i quad_order(__m256i codes, int order) {
  if (order == 8) return codes;
  const __m256i indices = order == 4
      ? _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
      : _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm256_shuffle_epi8(codes, indices);
}

// x8_quantize_rows' arguments checked and its vectors sized (both builds' versions).
pdserve_cpu::RowCodes8 x8_codes_sized(int64_t M, int64_t K, int64_t G, int order) {
  TORCH_CHECK(order == 2 || order == 4 || order == 8, "quad order 2, 4 or 8, got ", order);
  TORCH_CHECK((G == 16 || G == 32) && K % 32 == 0, "int8 codes: K a multiple of 32, G 16 or 32");
  pdserve_cpu::RowCodes8 q;
  q.quads.resize(M * K / 4);
  q.dx.resize(M * (K / kSub));
  q.csum.resize(M * (K / G));
  return q;
}
#endif

#ifdef PDSERVE_X16

// int8 codes per token as compressed-tensors' dynamic symmetric activations compute them:
// scale = max|x| / 127.5 (float32's epsilon where that is 0), code = x / scale rounded half
// to even and clamped to [-128, 127]; xsum is the sum of each group's codes.
void quantize_row_int8(const float* row, const Dims16& d, int16_t* out, float* dx, float* xsum) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < d.K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
  float scale = _mm512_reduce_max_ps(vmax) / 127.5f;
  if (scale == 0.f) scale = FLT_EPSILON;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
  for (int64_t k = 0; k < d.K; k += 16) {
    __m512i c = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + k), vscale));
    c = _mm512_min_epi32(_mm512_max_epi32(c, lo), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtsepi32_epi16(c));
  }
  if (xsum != nullptr) {
    for (int64_t g = 0; g < d.num_groups(); ++g) {
      int32_t s = 0;
      for (int64_t k = g * d.G; k < (g + 1) * d.G; ++k) s += out[k];
      xsum[g] = static_cast<float>(s);
    }
  }
  *dx = scale;
}

CodesX quantize_rows(const float* x, const Dims16& d, bool with_sums, bool int8_tokens = false) {
  CodesX q;
  q.codes.resize(d.M * d.K);
  q.dx.resize(d.M);
  if (with_sums) q.xsum.assign(d.M * d.num_groups(), 0.f);
  for (int64_t m = 0; m < d.M; ++m) {
    const float* row = x + m * d.K;
    int16_t* out = q.codes.data() + m * d.K;
    if (int8_tokens) {
      quantize_row_int8(row, d, out, q.dx.data() + m,
                        with_sums ? q.xsum.data() + m * d.num_groups() : nullptr);
      continue;
    }
    // K is a multiple of 32: whole vectors. Group sums add the group's vectors in order,
    // then their lanes (a fixed order, whatever the row's place in the batch).
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < d.K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    const float absmax = _mm512_reduce_max_ps(vmax);
    const float dx = absmax / 32767.f;
    const __m512 vinv = _mm512_set1_ps(absmax > 0.f ? 32767.f / absmax : 0.f);
    for (int64_t k = 0; k < d.K; k += 16) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), vinv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtsepi32_epi16(c));
    }
    if (with_sums) {
      for (int64_t g = 0; g < d.num_groups(); ++g) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t k = g * d.G; k < (g + 1) * d.G; k += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(row + k));
        q.xsum[m * d.num_groups() + g] = absmax > 0.f ? _mm512_reduce_add_ps(s) / dx : 0.f;
      }
    }
    q.dx[m] = dx;
  }
  return q;
}


}  // namespace

namespace pdserve_cpu {

RowCodes8 x8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int order,
                           bool int8_tokens) {
  RowCodes8 q = x8_codes_sized(M, K, G, order);
  const int64_t num_sub = K / kSub, groups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float row_scale = 0.f;
    if (int8_tokens) {  // compressed-tensors' dynamic per-token int8 (quant_x16.cpp)
      __m512 top = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
      row_scale = _mm512_reduce_max_ps(top) / 127.5f;
      if (row_scale == 0.f) row_scale = FLT_EPSILON;
    }
    for (int64_t b = 0; b < num_sub; ++b) {
      const __m512 x0 = _mm512_loadu_ps(row + b * kSub), x1 = _mm512_loadu_ps(row + b * kSub + 16);
      __m512i c0, c1;
      float step;
      if (int8_tokens) {  // nearbyint(x / scale), clamped to int8 (the saturating narrowing)
        step = row_scale;
        const __m512 s = _mm512_set1_ps(step);
        c0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, s));
        c1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, s));
      } else {
        const float absmax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        step = absmax / 127.f;
        const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
        c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));  // round to nearest even
        c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      }
      q.dx[m * num_sub + b] = step;
      const __m256i codes = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm512_cvtsepi32_epi8(c0)), _mm512_cvtsepi32_epi8(c1), 1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.quads.data() + (m * K + b * kSub) / 4),
                          quad_order(codes, order));
      // The group sums from the clamped codes.
      const __m512i s0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes));
      const __m512i s1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1));
      if (G == 32) {
        q.csum[m * groups + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
      } else {
        q.csum[m * groups + 2 * b] = _mm512_reduce_add_epi32(s0);
        q.csum[m * groups + 2 * b + 1] = _mm512_reduce_add_epi32(s1);
      }
    }
  }
  return q;
}

WideRows wide_rows(const RowCodes8& qx, int64_t m0, int64_t tiles, int R, int bias, int64_t K,
                   int64_t G) {
  WideRows wr;
  wr.m0 = m0;
  wr.rows = tiles * R;
  wr.R = R;
  const int64_t num_sub = K / kSub, groups = K / G;
  wr.quads.resize(wr.rows * num_sub * 8);
  wr.start.resize(wr.rows * groups);
  wr.csum.resize(wr.rows * groups);
  wr.dx.resize(wr.rows * num_sub);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + t * R + r;
      for (int64_t b = 0; b < num_sub; ++b) {
        std::memcpy(&wr.quads[((t * num_sub + b) * R + r) * 8], &qx.quads[m * K / 4 + b * 8],
                    8 * sizeof(int32_t));
        wr.dx[(t * num_sub + b) * R + r] = qx.dx[m * num_sub + b];
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int32_t c = qx.csum[m * groups + g];
        wr.start[(t * groups + g) * R + r] = -bias * c;
        wr.csum[(t * groups + g) * R + r] = static_cast<float>(c);
      }
    }
  }
  return wr;
}

}  // namespace pdserve_cpu

namespace {

inline __m512i pair_of(const int16_t* p) {  // (p[0], p[1]) in every 32-bit lane
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm512_set1_epi32(bits);
}

inline __m512 halves16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A group's 16 mins: the weight's float16 mins, or where it holds none (symmetric codes:
// GGUF's Q4_0, GPTQ's sym, every min -8 x its scale) -8 x the scales sv, the same floats.
inline __m512 mins16(const uint16_t* mins, int64_t at, __m512 sv) {
  return mins != nullptr ? halves16(mins + at) : _mm512_mul_ps(sv, _mm512_set1_ps(-8.0f));
}

// R rows of x (from m0) against T n-blocks (from j0) of Q4x16 weights.
template <int R, int T>
void q4_tile(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, const CodesX& qx,
             int64_t m0, int64_t j0, const Dims16& d, float* out, int64_t js = 1) {
  const int64_t num_sub = d.num_sub(), num_groups = d.num_groups();
  const int64_t block_stride = num_sub * 256;  // bytes per n-block
  const int64_t subs_per_group = d.G / kSub;
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  constexpr bool kSplit = R * T <= 2;  // a small tile: two chains (even and odd c)
  for (int64_t b = 0; b < num_sub; ++b) {
    __m512i sum[R][T], odd[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) sum[r][t] = odd[r][t] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      for (int t = 0; t < T; ++t) {
        const __m512i w = _mm512_loadu_si512(qw + (j0 + t * js) * block_stride + b * 256 + c * 64);
        const __m512i v0 = _mm512_and_si512(w, low4);
        const __m512i v1 = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        const __m512i v2 = _mm512_and_si512(_mm512_srli_epi16(w, 8), low4);
        const __m512i v3 = _mm512_srli_epi16(w, 12);
        for (int r = 0; r < R; ++r) {
          const int16_t* xp = qx.codes.data() + (m0 + r) * d.K + b * kSub + c * 8;
          __m512i& chain = kSplit && c % 2 ? odd[r][t] : sum[r][t];
          __m512i s = chain;
          s = _mm512_dpwssd_epi32(s, v0, pair_of(xp));
          s = _mm512_dpwssd_epi32(s, v1, pair_of(xp + 2));
          s = _mm512_dpwssd_epi32(s, v2, pair_of(xp + 4));
          s = _mm512_dpwssd_epi32(s, v3, pair_of(xp + 6));
          chain = s;
        }
      }
    }
    if constexpr (kSplit)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) sum[r][t] = _mm512_add_epi32(sum[r][t], odd[r][t]);
    const int64_t g = b / subs_per_group;
    const bool group_end = (b + 1) % subs_per_group == 0;
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((j0 + t * js) * num_groups + g) * kLanes;
      const __m512 sv = halves16(scales + at);
      __m512 mv = _mm512_setzero_ps();
      if (group_end) mv = mins16(mins, at, sv);
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][t]), sv, acc[r][t]);
        if (group_end)
          acc[r][t] = _mm512_fmadd_ps(
              mv, _mm512_set1_ps(qx.xsum[(m0 + r) * num_groups + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(out + (m0 + r) * d.N + (j0 + t * js) * kLanes,
                       _mm512_mul_ps(acc[r][t], _mm512_set1_ps(qx.dx[m0 + r])));
}

// R rows of x (from m0) against T n-blocks (from j0) of Q8x16 weights.
template <int R, int T>
void q8_tile(const uint8_t* qw, const uint16_t* scales, const CodesX& qx, int64_t m0,
             int64_t j0, const Dims16& d, float* out, int64_t js = 1) {
  const int64_t num_sub = d.num_sub(), num_groups = d.num_groups();
  const int64_t block_stride = num_sub * 512;
  const int64_t subs_per_group = d.G / kSub;
  const bool per_row = d.G == d.K;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  // With one scale per row, the int32 sums are converted every 8 sub-blocks: each is at
  // most 256 * 32767 * 127 < 2^31.
  const int64_t flush_every = per_row ? 8 : subs_per_group;
  constexpr bool kSplit = R * T <= 2;  // a small tile: two chains (even and odd c)
  __m512i sum[R][T], odd[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) sum[r][t] = odd[r][t] = _mm512_setzero_si512();
  for (int64_t b = 0; b < num_sub; ++b) {
    for (int c = 0; c < 16; ++c) {
      for (int t = 0; t < T; ++t) {
        const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            qw + (j0 + t * js) * block_stride + b * 512 + c * 32)));
        for (int r = 0; r < R; ++r) {
          const int16_t* xp = qx.codes.data() + (m0 + r) * d.K + b * kSub + c * 2;
          __m512i& chain = kSplit && c % 2 ? odd[r][t] : sum[r][t];
          chain = _mm512_dpwssd_epi32(chain, v, pair_of(xp));
        }
      }
    }
    if ((b + 1) % flush_every == 0 || b + 1 == num_sub) {
      if constexpr (kSplit)
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < T; ++t) {
            sum[r][t] = _mm512_add_epi32(sum[r][t], odd[r][t]);
            odd[r][t] = _mm512_setzero_si512();
          }
      const int64_t g = per_row ? 0 : b / subs_per_group;
      for (int t = 0; t < T; ++t) {
        const __m512 sv =
            per_row ? _mm512_set1_ps(1.f) : halves16(scales + ((j0 + t * js) * num_groups + g) * kLanes);
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][t]), sv, acc[r][t]);
          sum[r][t] = _mm512_setzero_si512();
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m512 row_scale =
        per_row ? halves16(scales + (j0 + t * js) * kLanes) : _mm512_set1_ps(1.f);
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + (m0 + r) * d.N + (j0 + t * js) * kLanes,
                       _mm512_mul_ps(_mm512_mul_ps(acc[r][t], row_scale),
                                     _mm512_set1_ps(qx.dx[m0 + r])));
  }
}

// Rows of x in a tile of up to kMaxTileRows against n-blocks [j0, j1).
template <bool Q4>
void run_rows(int rows, int64_t j0, int64_t j1, const uint8_t* qw, const uint16_t* scales,
              const uint16_t* mins, const CodesX& qx, int64_t m0, const Dims16& d, float* out) {
#define PDSERVE_X16_TILE(R, T)                                                          \
  if constexpr (Q4) {                                                                   \
    q4_tile<R, T>(qw, scales, mins, qx, m0, j, d, out);                                 \
  } else {                                                                              \
    q8_tile<R, T>(qw, scales, qx, m0, j, d, out);                                       \
  }
  int64_t j = j0;
  switch (rows) {
    case 1:
      j = pdserve_cpu::row_streams(j0, j1, [&](int64_t jj, int64_t js) {
        if constexpr (Q4) {
          q4_tile<1, pdserve_cpu::kRowStreams>(qw, scales, mins, qx, m0, jj, d, out, js);
        } else {
          q8_tile<1, pdserve_cpu::kRowStreams>(qw, scales, qx, m0, jj, d, out, js);
        }
      });
      for (; j + kSingleRowBlocks <= j1; j += kSingleRowBlocks) { PDSERVE_X16_TILE(1, kSingleRowBlocks) }
      break;
    case 2:
      for (; j + kTileBlocks <= j1; j += kTileBlocks) { PDSERVE_X16_TILE(2, kTileBlocks) }
      break;
    case 3:
      for (; j + kTileBlocks <= j1; j += kTileBlocks) { PDSERVE_X16_TILE(3, kTileBlocks) }
      break;
    case 4:
      for (; j + kTileBlocks <= j1; j += kTileBlocks) { PDSERVE_X16_TILE(4, kTileBlocks) }
      break;
    default:
      break;
  }
  for (; j < j1; ++j) {
    switch (rows) {
      case 1: { PDSERVE_X16_TILE(1, 1) } break;
      case 2: { PDSERVE_X16_TILE(2, 1) } break;
      case 3: { PDSERVE_X16_TILE(3, 1) } break;
      case 4: { PDSERVE_X16_TILE(4, 1) } break;
      case 5: { PDSERVE_X16_TILE(5, 1) } break;
      case 6: { PDSERVE_X16_TILE(6, 1) } break;
      case 7: { PDSERVE_X16_TILE(7, 1) } break;
      default: { PDSERVE_X16_TILE(8, 1) } break;
    }
  }
#undef PDSERVE_X16_TILE
}


// The 8-bit activation path (act_bits 8): x as int8 codes with a step per sub-block of 32
// (x8_quantize_rows), 4 codes per vpdpbusd. Q4x16's nibble chunks are kquant_x16.cpp's
// 4-bit plane: a mask keeps nibbles t and t + 2 of each word, a shift and the mask nibbles
// t + 1 and t + 3 (x's codes in that order, quad order 4). Q8x16's 16-row chunks of 2 codes
// each come in twos (64 bytes, one load); vpermw interleaves their words so that lane i holds
// row i's 4 codes, and a flip of the top bit makes them unsigned (q + 128: 128 times the
// sum of x's codes comes off after). Per sub-block b, in float32:
//   Q4: acc += dx_b * (S_b * scale_g + min_g * C_b);  Q8: acc += dx_b * S_b * scale_g
// with S_b the exact int32 sum of the code products and C_b the sum of x's codes.
template <int R, int T>
void q4_tile_i8(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins,
                const pdserve_cpu::RowCodes8& qx, int64_t m0, int64_t j0, const Dims16& d,
                float* out, int64_t js = 1) {
  constexpr bool kSplit = R * T <= 2;
  const int64_t num_sub = d.num_sub(), num_groups = d.num_groups();
  const int64_t block_stride = num_sub * 256;
  const int64_t subs_per_group = d.G / kSub;
  const __m512i nibbles = _mm512_set1_epi16(0x0F0F);
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    __m512i sum[R][T], odd[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) sum[r][t] = odd[r][t] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      for (int t = 0; t < T; ++t) {
        const __m512i w = _mm512_loadu_si512(qw + (j0 + t * js) * block_stride + b * 256 + c * 64);
        const __m512i v0 = _mm512_and_si512(w, nibbles);
        const __m512i v1 = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibbles);
        for (int r = 0; r < R; ++r) {  // a small tile: two chains, joined after the sub-block
          const int32_t* xq = qx.quads.data() + ((m0 + r) * d.K + b * kSub) / 4 + 2 * c;
          sum[r][t] = _mm512_dpbusd_epi32(sum[r][t], v0, _mm512_set1_epi32(xq[0]));
          __m512i& second = kSplit ? odd[r][t] : sum[r][t];
          second = _mm512_dpbusd_epi32(second, v1, _mm512_set1_epi32(xq[1]));
        }
      }
    }
    const int64_t g = b / subs_per_group;
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((j0 + t * js) * num_groups + g) * kLanes;
      const __m512 sv = halves16(scales + at), mv = mins16(mins, at, sv);
      for (int r = 0; r < R; ++r) {
        const int64_t row_sub = (m0 + r) * num_sub + b;
        const __m512i s = kSplit ? _mm512_add_epi32(sum[r][t], odd[r][t]) : sum[r][t];
        const __m512 inner = _mm512_fmadd_ps(
            mv, _mm512_set1_ps(static_cast<float>(qx.csum[row_sub])),
            _mm512_mul_ps(_mm512_cvtepi32_ps(s), sv));
        acc[r][t] = _mm512_fmadd_ps(inner, _mm512_set1_ps(qx.dx[row_sub]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(out + (m0 + r) * d.N + (j0 + t * js) * kLanes, acc[r][t]);
}

template <int R, int T>
void q8_tile_i8(const uint8_t* qw, const uint16_t* scales, const pdserve_cpu::RowCodes8& qx,
                int64_t m0, int64_t j0, const Dims16& d, float* out, int64_t js = 1) {
  constexpr bool kSplit = R * T <= 2;
  const int64_t num_sub = d.num_sub(), num_groups = d.num_groups();
  const int64_t block_stride = num_sub * 512;
  const int64_t subs_per_group = d.G / kSub;
  const bool per_row = d.G == d.K;
  // word 2i of the result: word i of the first chunk; word 2i + 1: word i of the second
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // fmt: skip
  const __m512i top_bits = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    __m512i sum[R][T][2];  // a small tile: two chains (even and odd c), joined after
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) sum[r][t][0] = sum[r][t][1] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      for (int t = 0; t < T; ++t) {
        const __m512i w = _mm512_loadu_si512(qw + (j0 + t * js) * block_stride + b * 512 + c * 64);
        const __m512i u = _mm512_xor_si512(_mm512_permutexvar_epi16(interleave, w), top_bits);
        for (int r = 0; r < R; ++r) {
          const int32_t* xq = qx.quads.data() + ((m0 + r) * d.K + b * kSub) / 4;
          const int chain = kSplit ? c % 2 : 0;
          sum[r][t][chain] = _mm512_dpbusd_epi32(sum[r][t][chain], u, _mm512_set1_epi32(xq[c]));
        }
      }
    }
    const int64_t g = per_row ? 0 : b / subs_per_group;
    for (int t = 0; t < T; ++t) {
      const __m512 sv = halves16(scales + ((j0 + t * js) * num_groups + g) * kLanes);
      for (int r = 0; r < R; ++r) {
        const int64_t row_sub = (m0 + r) * num_sub + b;
        const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(sum[r][t][0], sum[r][t][1]),
                                           _mm512_set1_epi32(128 * qx.csum[row_sub]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), sv),
                                    _mm512_set1_ps(qx.dx[row_sub]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(out + (m0 + r) * d.N + (j0 + t * js) * kLanes, acc[r][t]);
}

// Wide tiles of the 8-bit path, for batches of 8 or more rows: R rows (16 or 8) against one
// n-block, their codes laid out by wide_rows. A sub-block's 8 unsigned code vectors are made
// once (Q4: the two nibble masks of each chunk; Q8: vpermw and the flipped top bit) and every
// row's sums taken against them, where the small tiles remake them for each pass of at most
// 8 rows. A row's sum starts at wide_rows' start (Q8: minus 128 times its code sum, the same
// integers as q8_tile_i8's subtraction after), and its float work is the small tiles', in the
// same order: a row's bits do not depend on its tile.
template <bool Q4, int R>
void x16_wide_i8(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins,
                 const pdserve_cpu::WideRows& wr, int64_t tile, int64_t j, const Dims16& d,
                 float* out) {
  const int64_t num_sub = d.num_sub(), num_groups = d.num_groups();
  const int64_t block_stride = num_sub * (Q4 ? 256 : 512);
  const int64_t subs_per_group = d.G / kSub;
  const bool per_row = d.G == d.K;
  const __m512i nibbles = _mm512_set1_epi16(0x0F0F);
  // word 2i of the result: word i of the first chunk; word 2i + 1: word i of the second
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // fmt: skip
  const __m512i top_bits = _mm512_set1_epi8(static_cast<char>(0x80));
  const int32_t* xq = wr.quads.data() + tile * num_sub * R * 8;
  const int32_t* start = wr.start.data() + tile * num_sub * R;
  const float* csum = wr.csum.data() + tile * num_sub * R;
  const float* dx = wr.dx.data() + tile * num_sub * R;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    __m512i u[8];
    const uint8_t* wb = qw + j * block_stride + b * (Q4 ? 256 : 512);
    for (int c = 0; c < (Q4 ? 4 : 8); ++c) {
      const __m512i w = _mm512_loadu_si512(wb + c * 64);
      if constexpr (Q4) {
        u[2 * c] = _mm512_and_si512(w, nibbles);
        u[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibbles);
      } else {
        u[c] = _mm512_xor_si512(_mm512_permutexvar_epi16(interleave, w), top_bits);
      }
    }
    const int64_t g = per_row ? 0 : b / subs_per_group;
    const int64_t at = (j * num_groups + g) * kLanes;
    const __m512 sv = halves16(scales + at);
    __m512 mv = _mm512_setzero_ps();
    if constexpr (Q4) mv = mins16(mins, at, sv);
    const int32_t* xb = xq + b * R * 8;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512i s = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(start[b * R + r]);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) s = _mm512_dpbusd_epi32(s, u[c], _mm512_set1_epi32(xb[r * 8 + c]));
      const __m512 dxr = _mm512_set1_ps(dx[b * R + r]);
      if constexpr (Q4) {
        const __m512 inner = _mm512_fmadd_ps(mv, _mm512_set1_ps(csum[b * R + r]),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(s), sv));
        acc[r] = _mm512_fmadd_ps(inner, dxr, acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), sv), dxr, acc[r]);
      }
    }
  }
  const int64_t m0 = wr.m0 + tile * R;
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (m0 + r) * d.N + j * kLanes, acc[r]);
}

#ifdef PDSERVE_AMX
// x16_wide_i8's 16-row tiles on AMX, for n-blocks [j0, j1): a sub-block's 8 unsigned code
// vectors, made as there, are stored as a tile B of 8 rows (quad c of 16 columns, 4 bytes a
// column: the layout of vpdpbusd's operand is the layout AMX's B takes), the 16 rows' codes
// of the sub-block as tile A (wide_rows lays each row's 8 quads out in 32 bytes), and one
// TDPBSUD (signed x, unsigned codes) makes the 16 x 16 int32 sums that 128 vpdpbusd make
// there. The sums are the same integers (Q8's start added after: integer addition), and each
// row's float work is x16_wide_i8's, in the same order: the same bits.
//
// NJ (1-3) n-blocks a pass share tile A (0): their B tiles are 1..NJ, their C tiles 4..3+NJ,
// so the NJ products are independent work for the tile unit; the accumulators live in
// memory (48 vectors would not fit in registers).
template <bool Q4>
inline void amx_unpack(const uint8_t* wb, uint8_t* codes) {
  const __m512i nibbles = _mm512_set1_epi16(0x0F0F);
  // word 2i of the result: word i of the first chunk; word 2i + 1: word i of the second
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // fmt: skip
  const __m512i top_bits = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int c = 0; c < (Q4 ? 4 : 8); ++c) {
    const __m512i w = _mm512_loadu_si512(wb + c * 64);
    if constexpr (Q4) {
      _mm512_store_si512(codes + 2 * c * 64, _mm512_and_si512(w, nibbles));
      _mm512_store_si512(codes + (2 * c + 1) * 64,
                         _mm512_and_si512(_mm512_srli_epi16(w, 4), nibbles));
    } else {
      _mm512_store_si512(codes + c * 64,
                         _mm512_xor_si512(_mm512_permutexvar_epi16(interleave, w), top_bits));
    }
  }
}

template <bool Q4, int NJ>
void x16_wide_i8_amx_pass(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins,
                          const pdserve_cpu::WideRows& wr, int64_t tile, int64_t j,
                          const Dims16& d, float* out) {
  constexpr int R = 16;
  const int64_t num_sub = d.num_sub(), num_groups = d.num_groups();
  constexpr int64_t sub_bytes = Q4 ? 256 : 512;
  const int64_t block_stride = num_sub * sub_bytes;
  const int64_t subs_per_group = d.G / kSub;
  const bool per_row = d.G == d.K;
  const int32_t* xq = wr.quads.data() + tile * num_sub * R * 8;
  const int32_t* start = wr.start.data() + tile * num_sub * R;
  const float* csum = wr.csum.data() + tile * num_sub * R;
  const float* dx = wr.dx.data() + tile * num_sub * R;
  alignas(64) uint8_t codes[NJ][8 * 64];
  alignas(64) int32_t sums[NJ][R * kLanes];
  alignas(64) float acc[NJ][R * kLanes] = {};
  for (int64_t b = 0; b < num_sub; ++b) {
    for (int q = 0; q < NJ; ++q) amx_unpack<Q4>(qw + (j + q) * block_stride + b * sub_bytes, codes[q]);
    // (GCC's tile intrinsics paste the tile's number into the assembly: literals only)
    _tile_loadd(0, xq + b * R * 8, kSub);
    _tile_loadd(1, codes[0], 64);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 1);
    if constexpr (NJ > 1) {
      _tile_loadd(2, codes[1], 64);
      _tile_zero(5);
      _tile_dpbsud(5, 0, 2);
    }
    if constexpr (NJ > 2) {
      _tile_loadd(3, codes[2], 64);
      _tile_zero(6);
      _tile_dpbsud(6, 0, 3);
    }
    _tile_stored(4, sums[0], 64);
    if constexpr (NJ > 1) _tile_stored(5, sums[1], 64);
    if constexpr (NJ > 2) _tile_stored(6, sums[2], 64);
    const int64_t g = per_row ? 0 : b / subs_per_group;
    for (int q = 0; q < NJ; ++q) {
      const int64_t at = ((j + q) * num_groups + g) * kLanes;
      const __m512 sv = halves16(scales + at);
      __m512 mv = _mm512_setzero_ps();
      if constexpr (Q4) mv = mins16(mins, at, sv);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512i s = _mm512_load_si512(sums[q] + r * kLanes);
        if constexpr (!Q4) s = _mm512_add_epi32(s, _mm512_set1_epi32(start[b * R + r]));
        const __m512 dxr = _mm512_set1_ps(dx[b * R + r]);
        float* a = acc[q] + r * kLanes;
        if constexpr (Q4) {
          const __m512 inner = _mm512_fmadd_ps(mv, _mm512_set1_ps(csum[b * R + r]),
                                               _mm512_mul_ps(_mm512_cvtepi32_ps(s), sv));
          _mm512_store_ps(a, _mm512_fmadd_ps(inner, dxr, _mm512_load_ps(a)));
        } else {
          _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), sv), dxr,
                                             _mm512_load_ps(a)));
        }
      }
    }
  }
  const int64_t m0 = wr.m0 + tile * R;
  for (int q = 0; q < NJ; ++q)
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + (m0 + r) * d.N + (j + q) * kLanes, _mm512_load_ps(acc[q] + r * kLanes));
}

template <bool Q4>
void x16_wide_i8_amx(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins,
                     const pdserve_cpu::WideRows& wr, int64_t tile, int64_t j0, int64_t j1,
                     const Dims16& d, float* out) {
  pdserve_cpu::TileConfig config;
  config.rows[0] = 16, config.colsb[0] = kSub;  // A: the rows' codes
  for (int t = 1; t <= 3; ++t) config.rows[t] = 8, config.colsb[t] = 64;  // B: 8 quads of 16 columns
  for (int t = 4; t <= 6; ++t) config.rows[t] = 16, config.colsb[t] = 64;  // C: 16 x 16 int32 sums
  _tile_loadconfig(&config);
  int64_t j = j0;
  for (; j + 3 <= j1; j += 3) x16_wide_i8_amx_pass<Q4, 3>(qw, scales, mins, wr, tile, j, d, out);
  if (j1 - j == 2) x16_wide_i8_amx_pass<Q4, 2>(qw, scales, mins, wr, tile, j, d, out);
  if (j1 - j == 1) x16_wide_i8_amx_pass<Q4, 1>(qw, scales, mins, wr, tile, j, d, out);
  _tile_release();
}
#endif  // PDSERVE_AMX

template <bool Q4>
void run_rows_i8(int rows, int64_t j0, int64_t j1, const uint8_t* qw, const uint16_t* scales,
                 const uint16_t* mins, const pdserve_cpu::RowCodes8& qx, int64_t m0,
                 const Dims16& d, float* out) {
#define PDSERVE_X16_TILE(R, T)                                                          \
  if constexpr (Q4) {                                                                   \
    q4_tile_i8<R, T>(qw, scales, mins, qx, m0, j, d, out);                              \
  } else {                                                                              \
    q8_tile_i8<R, T>(qw, scales, qx, m0, j, d, out);                                    \
  }
  int64_t j = j0;
  switch (rows) {
    case 1:
      j = pdserve_cpu::row_streams(j0, j1, [&](int64_t jj, int64_t js) {
        if constexpr (Q4) {
          q4_tile_i8<1, pdserve_cpu::kRowStreams>(qw, scales, mins, qx, m0, jj, d, out, js);
        } else {
          q8_tile_i8<1, pdserve_cpu::kRowStreams>(qw, scales, qx, m0, jj, d, out, js);
        }
      });
      for (; j + kSingleRowBlocks <= j1; j += kSingleRowBlocks) { PDSERVE_X16_TILE(1, kSingleRowBlocks) }
      break;
    case 2:
      for (; j + kTileBlocks <= j1; j += kTileBlocks) { PDSERVE_X16_TILE(2, kTileBlocks) }
      break;
    case 3:
      for (; j + kTileBlocks <= j1; j += kTileBlocks) { PDSERVE_X16_TILE(3, kTileBlocks) }
      break;
    case 4:
      for (; j + kTileBlocks <= j1; j += kTileBlocks) { PDSERVE_X16_TILE(4, kTileBlocks) }
      break;
    default:
      break;
  }
  for (; j < j1; ++j) {
    switch (rows) {
      case 1: { PDSERVE_X16_TILE(1, 1) } break;
      case 2: { PDSERVE_X16_TILE(2, 1) } break;
      case 3: { PDSERVE_X16_TILE(3, 1) } break;
      case 4: { PDSERVE_X16_TILE(4, 1) } break;
      case 5: { PDSERVE_X16_TILE(5, 1) } break;
      case 6: { PDSERVE_X16_TILE(6, 1) } break;
      case 7: { PDSERVE_X16_TILE(7, 1) } break;
      default: { PDSERVE_X16_TILE(8, 1) } break;
    }
  }
#undef PDSERVE_X16_TILE
}

#endif  // PDSERVE_X16

template <bool Q4>
torch::Tensor x16_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                         const torch::Tensor& scales, const uint16_t* mins, const Dims16& d,
                         int64_t act_bits) {
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "act_bits must be 8 or 16, got ", act_bits);
  auto out = torch::empty({d.M, d.N}, x.options());
  if (d.M == 0) return out;
#ifdef PDSERVE_X16
  const auto* qw = qweight.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  // Chunks of 4 n-blocks (64 outputs) so every tile's pass is whole.
  // Rows in passes of near-equal size, none over kMaxTileRows: 9 rows go as 5 + 4, not as
  // 8 and a lone row (whose pass unpacks every weight for one row).
  const int64_t num_quads = (d.num_blocks() + 3) / 4;
  const int64_t passes = (d.M + kMaxTileRows - 1) / kMaxTileRows;
  auto each_pass = [&](auto&& run) {
    pdserve_cpu::parallel_for(num_quads, 1, [&](int64_t q0, int64_t q1) {
      const int64_t j0 = q0 * 4, j1 = std::min(d.num_blocks(), q1 * 4);
      for (int64_t p = 0, m0 = 0; p < passes; ++p) {
        const int rows = static_cast<int>((d.M - m0) / (passes - p));
        run(rows, j0, j1, m0);
        m0 += rows;
      }
    });
  };
  if (act_bits == 8) {
    const pdserve_cpu::RowCodes8 qx =
        pdserve_cpu::x8_quantize_rows(x.data_ptr<float>(), d.M, d.K, kSub, Q4 ? 4 : 8, false);
    // Rows in wide tiles of 16, then one of 8 if 8 or more are left, the rest in passes.
    const int64_t tiles16 = d.M / 16, tiles8 = (d.M % 16) / 8;
    const int64_t rest = tiles16 * 16 + tiles8 * 8;
    const int bias = Q4 ? 0 : 128;
    const pdserve_cpu::WideRows wide16 = pdserve_cpu::wide_rows(qx, 0, tiles16, 16, bias, d.K, kSub);
    const pdserve_cpu::WideRows wide8 = pdserve_cpu::wide_rows(qx, tiles16 * 16, tiles8, 8, bias, d.K, kSub);
    const int64_t left = d.M - rest;
    const int64_t rest_passes = (left + kMaxTileRows - 1) / kMaxTileRows;
    [[maybe_unused]] const bool amx = pdserve_cpu::amx_on();
    pdserve_cpu::parallel_for(num_quads, 1, [&](int64_t q0, int64_t q1) {
      const int64_t j0 = q0 * 4, j1 = std::min(d.num_blocks(), q1 * 4);
#ifdef PDSERVE_AMX
      if (amx) {
        for (int64_t t = 0; t < tiles16; ++t) x16_wide_i8_amx<Q4>(qw, sp, mins, wide16, t, j0, j1, d, op);
      } else  // the AVX-512 tiles below
#endif
      {
        for (int64_t t = 0; t < tiles16; ++t)
          for (int64_t j = j0; j < j1; ++j) x16_wide_i8<Q4, 16>(qw, sp, mins, wide16, t, j, d, op);
      }
      for (int64_t t = 0; t < tiles8; ++t)
        for (int64_t j = j0; j < j1; ++j) x16_wide_i8<Q4, 8>(qw, sp, mins, wide8, t, j, d, op);
      for (int64_t p = 0, m0 = rest; p < rest_passes; ++p) {
        const int rows = static_cast<int>((d.M - m0) / (rest_passes - p));
        run_rows_i8<Q4>(rows, j0, j1, qw, sp, mins, qx, m0, d, op);
        m0 += rows;
      }
    });
    return out;
  }
  const CodesX qx = quantize_rows(x.data_ptr<float>(), d, Q4);
  each_pass([&](int rows, int64_t j0, int64_t j1, int64_t m0) {
    run_rows<Q4>(rows, j0, j1, qw, sp, mins, qx, m0, d, op);
  });
#else
  (void)qweight;
  (void)scales;
  (void)mins;
  TORCH_CHECK(false, "the x16 kernels need AVX-512 F/BW/VL and VNNI (this build has none)");
#endif
  return out;
}

}  // namespace

#ifdef PDSERVE_X8_AVX2
namespace {

inline __m256 abs_of(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

}  // namespace

namespace pdserve_cpu {

// The AVX-512 build's x8_quantize_rows (above) in 256-bit registers: the same steps, the
// same rounding (vcvtps2dq, to nearest even) and the same saturation to int8 (two packs,
// through int16, clamp as one), so the codes, steps and sums are the same numbers.
RowCodes8 x8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int order,
                           bool int8_tokens) {
  RowCodes8 q = x8_codes_sized(M, K, G, order);
  const int64_t num_sub = K / kSub, groups = K / G;
  // packs_epi32 then packs_epi16 leave each 128-bit lane's dwords interleaved: back in order.
  const __m256i unmix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float row_scale = 0.f;
    if (int8_tokens) {
      __m256 top = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) top = _mm256_max_ps(top, abs_of(_mm256_loadu_ps(row + k)));
      row_scale = pdserve_cpu::hmax(top) / 127.5f;
      if (row_scale == 0.f) row_scale = FLT_EPSILON;
    }
    for (int64_t b = 0; b < num_sub; ++b) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(row + b * kSub + 8 * i);
      __m256i c[4];
      float step;
      if (int8_tokens) {
        step = row_scale;
        const __m256 s = _mm256_set1_ps(step);
        for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], s));
      } else {
        const float absmax =
            pdserve_cpu::hmax(_mm256_max_ps(_mm256_max_ps(abs_of(v[0]), abs_of(v[1])),
                                            _mm256_max_ps(abs_of(v[2]), abs_of(v[3]))));
        step = absmax / 127.f;
        const __m256 inv = _mm256_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
        for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      }
      q.dx[m * num_sub + b] = step;
      const __m256i codes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
          unmix);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.quads.data() + (m * K + b * kSub) / 4),
                          quad_order(codes, order));
      // The group sums from the clamped codes: vpsadbw of the codes + 128 sums each 8, less
      // 8 x 128.
      const __m256i sums = _mm256_sad_epu8(_mm256_xor_si256(codes, flip), _mm256_setzero_si256());
      int64_t eights[4];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(eights), sums);
      const int32_t first = static_cast<int32_t>(eights[0] + eights[1]) - 2048;
      const int32_t second = static_cast<int32_t>(eights[2] + eights[3]) - 2048;
      if (G == 32) {
        q.csum[m * groups + b] = first + second;
      } else {
        q.csum[m * groups + 2 * b] = first;
        q.csum[m * groups + 2 * b + 1] = second;
      }
    }
  }
  return q;
}

}  // namespace pdserve_cpu
#endif  // PDSERVE_X8_AVX2

namespace pdserve_cpu {

torch::Tensor q4x16_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                           const torch::Tensor& scales, const torch::Tensor& mins,
                           int64_t group_size, int64_t n, int64_t act_bits) {
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8, "Q4x16 qweight must be uint8");
  const Dims16 d = check_x16(x, qweight, scales, group_size, n, 256);
  TORCH_CHECK(mins.scalar_type() == torch::kFloat16 && mins.is_contiguous() &&
                  (mins.sizes() == scales.sizes() || mins.numel() == 0),
              "mins must be contiguous float16 shaped like scales, or empty (symmetric)");
  const auto* mp = mins.numel() == 0 ? nullptr
                                     : reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  return x16_matmul<true>(x, qweight, scales, mp, d, act_bits);
}

torch::Tensor q8x16_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                           const torch::Tensor& scales, int64_t group_size, int64_t n,
                           int64_t act_bits) {
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8, "Q8x16 qweight must be int8");
  const Dims16 d = check_x16(x, qweight, scales, group_size, n, 512);
  return x16_matmul<false>(x, qweight.view(torch::kUInt8), scales, nullptr, d, act_bits);
}

RowCodes16 x16_quantize_rows(const float* x, int64_t m, int64_t k, int64_t group_size,
                             bool with_sums, bool int8_tokens) {
#ifdef PDSERVE_X16
  const Dims16 d{m, k, kLanes, group_size};
  CodesX q = quantize_rows(x, d, with_sums, int8_tokens);
  return RowCodes16{std::move(q.codes), std::move(q.dx), std::move(q.xsum)};
#else
  (void)x;
  (void)m;
  (void)k;
  (void)group_size;
  (void)with_sums;
  (void)int8_tokens;
  TORCH_CHECK(false, "the x16 kernels need AVX-512 F/BW/VL and VNNI (this build has none)");
#endif
}

namespace {

// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: Linux hands a process the tile registers' 8 KiB
// of state only when asked (arch/x86/include/uapi/asm/prctl.h, 0x1023; the feature is 18).
bool ask_for_tiles() {
#ifdef PDSERVE_AMX
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("PDSERVE_AMX");
    return env == nullptr || std::string(env) != "0";
  }()};
  return on;
}

}  // namespace

bool amx_available() {
  static const bool ok = ask_for_tiles();
  return ok;
}

bool amx_on() { return amx_switch().load(std::memory_order_relaxed) && amx_available(); }

void set_amx(bool on) { amx_switch().store(on, std::memory_order_relaxed); }

void set_row_streams(bool on) { row_streams_switch().store(on, std::memory_order_relaxed); }

bool row_streams_on() { return row_streams_switch().load(std::memory_order_relaxed); }

bool has_x16() {
#ifdef PDSERVE_X16
  return true;
#else
  return false;
#endif
}

}  // namespace pdserve_cpu

void register_quant_x16(pybind11::module& m) {
  using namespace pdserve_cpu;
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("q4x16_matmul", &q4x16_matmul, release(),
        "x [M, K] float32 @ Q4x16 weights [N, K]^T -> [M, N] float32");
  m.def("q8x16_matmul", &q8x16_matmul, release(),
        "x [M, K] float32 @ Q8x16 weights [N, K]^T -> [M, N] float32");
  m.def("has_x16", &has_x16, "whether the AVX-512 VNNI x16 kernels were compiled in");
  m.def("amx_available", &amx_available,
        "whether AMX tiles were compiled in and this process may use them");
  m.def("amx_on", &amx_on, "whether the int8 tiles of 16 rows run on AMX now");
  m.def("set_row_streams", &set_row_streams, pybind11::arg("on"),
        "a lone row's Q4x16, Q8x16 and 4-bit-plane KQx16 weights read in 4 runs at once (on) "
        "or in one (the same results either way; for comparisons)");
  m.def("set_amx", &set_amx, pybind11::arg("on"),
        "turn the AMX tiles on or off (the same results either way; for comparisons)");
}
