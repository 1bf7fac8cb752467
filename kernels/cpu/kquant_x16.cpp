// Matmuls over KQx16 weights (kernels/cpu/kquant.py): GGUF's K-quants and Q5_0 / Q5_1 at
// their own bit widths, 16 weight rows in the lanes of a 512-bit register, for CPUs with
// AVX-512 (F, BW, VL) and VNNI; for CPUs with AVX2 only, the same layout in two 256-bit
// halves (PDSERVE_KQ8, below). Activations float32 in and out, quantized inside to int16
// codes with one step per row, as quant_x16.cpp does for Q4x16, or (int8_tokens) to int8
// codes per row as compressed-tensors' W8A8 checkpoints quantize their activations, or
// (act_bits 8, AVX-512 VNNI only; the AVX2 path keeps int16) to int8 codes per 32 values as
// llama.cpp quantizes them: see "The 8-bit activation path" below.
//
// M = activation rows, K = input features, N = output features, NB = N / 16, SB = K / 32,
// G = group size (16 or 32), L = the float block (256, or 32 for Q5_0 / Q5_1; a checkpoint's
// quantization group for the integer codes of GPTQ, AWQ and compressed-tensors, whose zero
// point is the min term's m with dmin = d).
//
// A weight is (u - bias) * (d * sc) + sign * (dmin * m). Per sub-block of 32 and each of its
// 16 pairs of elements p, the code planes unpack into one int16 vector per pair (lane i,
// h = 0 / 1: u[16j + i, 32b + 2p + h]) and one vpdpwssd adds u x[2p] + u' x[2p + 1] into
// lane i; per group the bias's term, bias times the group's sum of x codes, is subtracted:
// the int32 sum S of (u - bias) x over each group is exact. Then per group, in float32:
// acc += S * (d * sc), and with mins acc += sign * (dmin * m) * xsum_g / dx; y = acc * dx.
// d * sc and dmin * m are exact products (an 11-bit significand times at most 8 bits).
// Half scales (Q5_0, Q5_1: one float per group, sc and m all 1) hold d and dmin as float16
// and no sc or m; vcvtph2ps widens them exactly, so the terms are the same floats.
//
// Plane of width w, chunk c = p / (16 / w), position t = p % (16 / w): the pair's bits are
// (word >> w t) & (2^w - 1) of each 16-bit word; a second plane's bits go above the first's.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define PDSERVE_KQ16 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PDSERVE_KQ8 1  // the AVX2 path: each 16-lane vector as two halves of 8 lanes
#endif

namespace {

constexpr int64_t kSub = 32;
constexpr int64_t kLanes = 16;
constexpr int kMaxRows = 4;  // rows of x per pass over the weights
constexpr int kWideRows16 = 8;  // rows of the 16-bit path's wide tiles (kq_wide16)

struct KqWeight {
  const uint8_t* lo;
  const uint8_t* hi;  // nullptr: one plane
  int lo_w, hi_w, bias;
  int64_t G, L;
  const float* d;
  const int8_t* sc;
  const float* dmin;  // nullptr: no min term
  const int8_t* m;
  float sign;
  // Half scales (kernels/cpu/kquant.py): d and dmin float16, one per group, sc and m all 1;
  // then d and sc (dmin and m) above are nullptr.
  const uint16_t* d16 = nullptr;
  const uint16_t* dmin16 = nullptr;
  bool has_min() const { return dmin != nullptr || dmin16 != nullptr; }
};

struct Dims {
  int64_t M, K, N;
  int64_t num_sub() const { return K / kSub; }
  int64_t num_blocks() const { return N / kLanes; }
};

// Rows [m0, m0 + rows) (at most kMaxRows) against units [j0, j1) (n-blocks, or the AVX2
// path's halves of them), tile by tile: a lone row takes Single units a pass, 2-4 rows take
// 2, and the remainder goes one unit at a time; tile.operator()<R, T>(j) runs one tile.
template <int Single, typename Tile>
void each_tile(int rows, int64_t j0, int64_t j1, const Tile& tile) {
  int64_t j = j0;
#define PDSERVE_TILE(R, T) tile.template operator()<R, T>(j)
  switch (rows) {
    case 1: for (; j + Single <= j1; j += Single) PDSERVE_TILE(1, Single); break;
    case 2: for (; j + 2 <= j1; j += 2) PDSERVE_TILE(2, 2); break;
    case 3: for (; j + 2 <= j1; j += 2) PDSERVE_TILE(3, 2); break;
    default: for (; j + 2 <= j1; j += 2) PDSERVE_TILE(4, 2); break;
  }
  for (; j < j1; ++j) {
    switch (rows) {
      case 1: PDSERVE_TILE(1, 1); break;
      case 2: PDSERVE_TILE(2, 1); break;
      case 3: PDSERVE_TILE(3, 1); break;
      default: PDSERVE_TILE(4, 1); break;
    }
  }
#undef PDSERVE_TILE
}

// The quad order of the 8-bit activation paths (both builds) for low planes of width LO:
// quad q holds pairs P and P2 (see "The 8-bit activation path" below).
constexpr int quad_pair(int lo_w, int q) {
  const int per = 16 / lo_w, half = per / 2;
  return (q / half) * per + q % half;
}

#ifdef PDSERVE_KQ16

inline __m512i pair_of(const int16_t* p) {  // (p[0], p[1]) in every 32-bit lane
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm512_set1_epi32(bits);
}

inline __m512 scales16(const float* d, const int8_t* s) {
  const __m512 small =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
  return _mm512_mul_ps(_mm512_loadu_ps(d), small);
}

inline __m512 halves16(const uint16_t* h) {  // 16 float16 values widened (exactly)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// A group's 16 lanes of d * sc and of sign * dmin * m (zero without mins).
inline __m512 group_scale(const KqWeight& w, int64_t at_block, int64_t at_group) {
  return w.d16 ? halves16(w.d16 + at_block) : scales16(w.d + at_block, w.sc + at_group);
}

inline __m512 group_min(const KqWeight& w, int64_t at_block, int64_t at_group) {
  if (!w.has_min()) return _mm512_setzero_ps();
  const __m512 v = w.dmin16 ? halves16(w.dmin16 + at_block) : scales16(w.dmin + at_block, w.m + at_group);
  return w.sign < 0 ? _mm512_sub_ps(_mm512_setzero_ps(), v) : v;
}

// The int16 codes of pair P from a plane of width W held in registers (its W chunks): the
// word shifted down (the top field needs no mask).
template <int W, int P>
inline __m512i plane_bits(const __m512i* chunks) {
  constexpr int per_word = 16 / W, at = W * (P % per_word);
  const __m512i word = chunks[P / per_word];
  const __m512i down = at ? _mm512_srli_epi16(word, at) : word;
  if constexpr (at + W == 16) return down;
  return _mm512_and_si512(down, _mm512_set1_epi16(static_cast<int16_t>((1 << W) - 1)));
}

// Pair P's code from a low plane of width LO and a high plane of width HI above it: the low
// field shifted down unmasked, the high field moved to bits LO.. and masked, then one
// vpternlogd keeps (low & (2^LO - 1)) | high.
template <int LO, int HI, int P>
inline __m512i joined_bits(const __m512i* lo, const __m512i* hi) {
  constexpr int lo_per = 16 / LO, lo_at = LO * (P % lo_per);
  constexpr int hi_per = 16 / HI, hi_at = HI * (P % hi_per);
  const __m512i lw = lo[P / lo_per], hw = hi[P / hi_per];
  const __m512i low = lo_at ? _mm512_srli_epi16(lw, lo_at) : lw;
  __m512i high = hw;
  if constexpr (hi_at > LO) high = _mm512_srli_epi16(hw, hi_at - LO);
  if constexpr (hi_at < LO) high = _mm512_slli_epi16(hw, LO - hi_at);
  high = _mm512_and_si512(high, _mm512_set1_epi16(static_cast<int16_t>(((1 << HI) - 1) << LO)));
  // imm 0xEC: (A & C) | B with A = low, B = high, C = the low field's mask.
  return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi16(static_cast<int16_t>((1 << LO) - 1)),
                                   0xEC);
}

// Sums of one sub-block: R rows against T n-blocks, the unsigned codes of planes LO (+ HI
// above it), groups of G; widths and pair positions are compile-time, so every shift is an
// immediate. The code bias is taken off per group afterwards (bias times the group's sum of
// x codes: the same integers), not per pair.
template <int LO, int HI, int G, int R, int T>
struct SubBlock {
  static constexpr int kHi = HI > 0 ? HI : 1;
  // With one group a sub-block (G = 32) and at most 2 sums in the tile, the pairs alternate
  // between two sums (two chains of vpdpwssd, joined after the sub-block), as SubBlockI8's.
  static constexpr bool kSplit = G == 32 && R * T <= 2;
  __m512i lo[T][LO];
  __m512i hi[T][kHi];
  __m512i sum[R][T][2];
  const int16_t* x[R];

  template <int P>
  inline void pair() {
    const int half = kSplit ? P % 2 : P / (G / 2);
    for (int t = 0; t < T; ++t) {
      __m512i v;
      if constexpr (HI > 0) {
        v = joined_bits<LO, kHi, P>(lo[t], hi[t]);
      } else {
        v = plane_bits<LO, P>(lo[t]);
      }
      for (int r = 0; r < R; ++r)
        sum[r][t][half] = _mm512_dpwssd_epi32(sum[r][t][half], v, pair_of(x[r] + 2 * P));
    }
  }

  template <int... P>
  inline void pairs(std::integer_sequence<int, P...>) {
    (pair<P>(), ...);
  }
};

// R rows of x (from m0) against T n-blocks (from j0).
template <int LO, int HI, int G, int R, int T>
void kq_tile(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, const int32_t* csum,
             int64_t m0, int64_t j0, const Dims& dims, float* out) {
  const int64_t num_sub = dims.num_sub();
  const int64_t groups = dims.K / G, blocks = dims.K / w.L;
  constexpr int64_t lo_stride = LO * 64, hi_stride = (HI > 0 ? HI : 1) * 64;
  constexpr int groups_per_sub = static_cast<int>(kSub / G);  // 1 or 2
  SubBlock<LO, HI, G, R, T> sb;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    for (int t = 0; t < T; ++t) {
      const uint8_t* lo = w.lo + ((j0 + t) * num_sub + b) * lo_stride;
      for (int c = 0; c < LO; ++c) sb.lo[t][c] = _mm512_loadu_si512(lo + c * 64);
      if constexpr (HI > 0) {
        const uint8_t* hi = w.hi + ((j0 + t) * num_sub + b) * hi_stride;
        for (int c = 0; c < HI; ++c) sb.hi[t][c] = _mm512_loadu_si512(hi + c * 64);
      }
    }
    for (int r = 0; r < R; ++r) {
      sb.x[r] = qx.codes.data() + (m0 + r) * dims.K + b * kSub;
      for (int t = 0; t < T; ++t) sb.sum[r][t][0] = sb.sum[r][t][1] = _mm512_setzero_si512();
    }
    sb.pairs(std::make_integer_sequence<int, 16>{});
    if constexpr (SubBlock<LO, HI, G, R, T>::kSplit)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) sb.sum[r][t][0] = _mm512_add_epi32(sb.sum[r][t][0], sb.sum[r][t][1]);
    for (int q = 0; q < groups_per_sub; ++q) {
      const int64_t g = b * groups_per_sub + q;
      if (csum != nullptr) {  // sum (u - bias) x = sum u x - bias * sum x, in integers
        for (int r = 0; r < R; ++r) {
          const __m512i off = _mm512_set1_epi32(w.bias * csum[(m0 + r) * groups + g]);
          for (int t = 0; t < T; ++t) sb.sum[r][t][q] = _mm512_sub_epi32(sb.sum[r][t][q], off);
        }
      }
      for (int t = 0; t < T; ++t) {
        const int64_t at_block = ((j0 + t) * blocks + g * G / w.L) * kLanes;
        const int64_t at_group = ((j0 + t) * groups + g) * kLanes;
        const __m512 scale = group_scale(w, at_block, at_group);
        const __m512 min_term = group_min(w, at_block, at_group);
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb.sum[r][t][q]), scale, acc[r][t]);
          if (w.has_min())
            acc[r][t] = _mm512_fmadd_ps(min_term, _mm512_set1_ps(qx.xsum[(m0 + r) * groups + g]),
                                        acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(out + (m0 + r) * dims.N + (j0 + t) * kLanes,
                       _mm512_mul_ps(acc[r][t], _mm512_set1_ps(qx.dx[m0 + r])));
}

// Rows [m0, m0 + rows) (at most kMaxRows) against n-blocks [j0, j1): a lone row takes one
// n-block a pass (its sums in two chains: kSplit), 2-4 rows take 2. A lone row is bound by
// how fast its weights stream from memory; one n-block at a time, a thread reads each plane
// as one run of addresses, where several n-blocks a pass read several runs a few KB apart
// (measured 7-15 % faster per step, loadtest/bench_kquant.py --rows 1 --layers 36).
template <int LO, int HI, int G>
void kq_rows(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, const int32_t* csum,
             int64_t m0, int rows, int64_t j0, int64_t j1, const Dims& dims, float* out) {
  each_tile<1>(rows, j0, j1, [&]<int R, int T>(int64_t j) {
    kq_tile<LO, HI, G, R, T>(w, qx, csum, m0, j, dims, out);
  });
}

using RowsFn = void (*)(const KqWeight&, const pdserve_cpu::RowCodes16&, const int32_t*,
                        int64_t, int, int64_t, int64_t, const Dims&, float*);

// f(std::true_type) for a weight with mins, f(std::false_type) without: the wide tiles'
// MINS decided once per call, not per n-block.
template <class F>
void with_mins(const KqWeight& w, F&& f) {
  if (w.has_min()) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Group g's 16 lanes of d * sc and of the min term (zero without MINS) for n-block j, as the
// wide tiles take them.
template <int G, bool MINS>
inline std::pair<__m512, __m512> wide_group_terms(const KqWeight& w, int64_t j, int64_t g,
                                                  int64_t blocks, int64_t groups) {
  const int64_t at_block = (j * blocks + g * G / w.L) * kLanes;
  const int64_t at_group = (j * groups + g) * kLanes;
  const __m512 min_term = MINS ? group_min(w, at_block, at_group) : _mm512_setzero_ps();
  return {group_scale(w, at_block, at_group), min_term};
}

// Wide tiles of the 16-bit path, for batches of 8 or more rows: 8 rows against one n-block.
// A sub-block's 16 pair vectors are unpacked once into registers and each row's sums taken
// against them (kq_tile unpacks them again for every pass of at most 4 rows). A row's sum
// starts at minus the code bias times its group's code sum, the same integers as kq_tile's
// subtraction after, and its float work is kq_tile's, in the same order: a row's bits do not
// depend on its tile.
template <int LO, int HI, int G, bool MINS>
void kq_wide16(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, const int32_t* csum,
               int64_t m0, int64_t j, const Dims& dims, float* out) {
  constexpr int R = kWideRows16;
  const int64_t num_sub = dims.num_sub();
  const int64_t groups = dims.K / G, blocks = dims.K / w.L;
  constexpr int64_t lo_stride = LO * 64, hi_stride = (HI > 0 ? HI : 1) * 64;
  constexpr int groups_per_sub = static_cast<int>(kSub / G);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    __m512i v[16];
    {
      __m512i lo[LO], hi[HI > 0 ? HI : 1];
      const uint8_t* lp = w.lo + (j * num_sub + b) * lo_stride;
      for (int c = 0; c < LO; ++c) lo[c] = _mm512_loadu_si512(lp + c * 64);
      if constexpr (HI > 0) {
        const uint8_t* hp = w.hi + (j * num_sub + b) * hi_stride;
        for (int c = 0; c < HI; ++c) hi[c] = _mm512_loadu_si512(hp + c * 64);
      }
      [&]<int... P>(std::integer_sequence<int, P...>) {
        if constexpr (HI > 0) {
          ((v[P] = joined_bits<LO, (HI > 0 ? HI : 1), P>(lo, hi)), ...);
        } else {
          ((v[P] = plane_bits<LO, P>(lo)), ...);
        }
      }(std::make_integer_sequence<int, 16>{});
    }
    const int16_t* xb = qx.codes.data() + m0 * dims.K + b * kSub;
    for (int q = 0; q < groups_per_sub; ++q) {
      const int64_t g = b * groups_per_sub + q;
      const auto [scale, min_term] = wide_group_terms<G, MINS>(w, j, g, blocks, groups);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i s = csum != nullptr ? _mm512_set1_epi32(-w.bias * csum[(m0 + r) * groups + g])
                                    : _mm512_setzero_si512();
        const int16_t* x = xb + r * dims.K;
#pragma GCC unroll 16
        for (int P = 0; P < 16; ++P)
          if (P / (G / 2) == q) s = _mm512_dpwssd_epi32(s, v[P], pair_of(x + 2 * P));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
        if constexpr (MINS)
          acc[r] = _mm512_fmadd_ps(min_term, _mm512_set1_ps(qx.xsum[(m0 + r) * groups + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(out + (m0 + r) * dims.N + j * kLanes,
                     _mm512_mul_ps(acc[r], _mm512_set1_ps(qx.dx[m0 + r])));
}

// Rows [m0, m0 + kWideRows16) against n-blocks [j0, j1).
template <int LO, int HI, int G>
void kq_wide16_rows(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, const int32_t* csum,
                    int64_t m0, int64_t j0, int64_t j1, const Dims& dims, float* out) {
  with_mins(w, [&](auto mins) {
    for (int64_t j = j0; j < j1; ++j)
      kq_wide16<LO, HI, G, decltype(mins)::value>(w, qx, csum, m0, j, dims, out);
  });
}

using Wide16Fn = void (*)(const KqWeight&, const pdserve_cpu::RowCodes16&, const int32_t*, int64_t,
                          int64_t, int64_t, const Dims&, float*);

// The types whose wide tiles measured faster than kq_tile's passes (loadtest/bench_kquant.py
// --act-bits 16, 12 layers): Q3_K 13-15 % at 8-104 rows in every alternation, Q6_K 8-10 % in
// the medians of five (16 rows 5.83 -> 5.22 ms, 104 rows 33.3 -> 30.7; one alternation slower).
// Q2_K measured alike, and Q4_K / Q5_0 8-17 % slower (the 16 pair vectors and 8 sums crowd
// the registers where kq_tile's two n-blocks keep its chains busy): those keep the passes.
Wide16Fn wide16_fn(int lo_w, int hi_w, int64_t group) {
  if (lo_w == 2 && hi_w == 1 && group == 16) return kq_wide16_rows<2, 1, 16>;  // Q3_K
  if (lo_w == 4 && hi_w == 2 && group == 16) return kq_wide16_rows<4, 2, 16>;  // Q6_K
  return nullptr;
}

constexpr int64_t kUnitsPerBlock = 1;  // a tile's unit: an n-block

pdserve_cpu::RowCodes16 quantize_kq(const float* x, const Dims& dims, int64_t G, bool with_sums,
                                    bool int8_tokens) {
  return pdserve_cpu::x16_quantize_rows(x, dims.M, dims.K, G, with_sums, int8_tokens);
}

// The instantiation for a type's planes and group (kernels/cpu/kquant.py's KQ_LAYOUTS).
RowsFn rows_fn(int lo_w, int hi_w, int64_t group) {
  if (lo_w == 2 && hi_w == 0 && group == 16) return kq_rows<2, 0, 16>;  // Q2_K
  if (lo_w == 2 && hi_w == 1 && group == 16) return kq_rows<2, 1, 16>;  // Q3_K
  if (lo_w == 4 && hi_w == 0 && group == 32) return kq_rows<4, 0, 32>;  // Q4_K
  if (lo_w == 4 && hi_w == 1 && group == 32) return kq_rows<4, 1, 32>;  // Q5_K, Q5_0, Q5_1
  if (lo_w == 4 && hi_w == 2 && group == 16) return kq_rows<4, 2, 16>;  // Q6_K
  if (lo_w == 4 && hi_w == 4 && group == 32) return kq_rows<4, 4, 32>;  // 8-bit integer codes
  return nullptr;
}


// The 8-bit activation path (AVX-512 VNNI; act_bits 8): x in int8 codes with one
// step per sub-block of 32 (dx_b = max |x| / 127 over it, round to nearest even), as
// llama.cpp's Q8_0 codes activations, or for int8_tokens the checkpoint's one step per row.
// vpdpbusd multiplies 4 unsigned weight codes by 4 signed x codes per 32-bit lane, twice the
// work of a vpdpwssd, from the same planes: pairs P and P2 = P + 16 / (2 LO) lie in one low
// chunk, LO * (P2 - P) = 8 bits apart, so one shift and one mask leave pair P's codes in the
// low bytes of lane i's two words and pair P2's in the high bytes: bytes u[2P], u[2P2],
// u[2P + 1], u[2P2 + 1]. x's codes are stored in that order (a quad per 32-bit word), 8 quads
// per sub-block (x8_quantize_rows, quant_x16.cpp). A high plane's fields are moved to bits LO and LO + 8 with one shift when
// they lie 8 bits apart (8-bit codes), else two shifts and a blend. Per group g of sub-block
// b, in float32: acc += dx_b * (S_g * (d * sc) + sign * (dmin * m) * C_g), where S_g is the
// exact int32 sum of (u - bias) x and C_g the sum of x's codes over the group.

template <int S>
inline __m512i shift16(__m512i v) {  // left by S bits (right when S < 0), per 16-bit word
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  return v;
}

// Quad Q's unsigned byte codes (pairs P and P2) from planes LO (+ HI above it).
template <int LO, int HI, int Q>
inline __m512i quad_bits(const __m512i* lo, const __m512i* hi) {
  constexpr int per = 16 / LO, half = per / 2;
  constexpr int P = quad_pair(LO, Q), P2 = P + half;
  constexpr int lo_mask = (1 << LO) - 1;
  const __m512i low = _mm512_and_si512(shift16<-LO * (P % per)>(lo[P / per]),
                                       _mm512_set1_epi16(static_cast<int16_t>(lo_mask * 0x101)));
  if constexpr (HI == 0) {
    return low;
  } else {
    constexpr int hi_per = 16 / HI, hm = (1 << HI) - 1;
    constexpr int at = HI * (P % hi_per), at2 = HI * (P2 % hi_per);
    constexpr int16_t both = static_cast<int16_t>((hm << LO) | (hm << (LO + 8)));
    const __m512i a = shift16<LO - at>(hi[P / hi_per]);
    __m512i high = a;
    if constexpr (P / hi_per != P2 / hi_per || LO - at != LO + 8 - at2) {
      const __m512i b = shift16<LO + 8 - at2>(hi[P2 / hi_per]);
      // imm 0xE4: C ? A : B per bit, C = the first field's place.
      high = _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi16(static_cast<int16_t>(hm << LO)),
                                       0xE4);
    }
    // imm 0xF8: A | (B & C).
    return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi16(both), 0xF8);
  }
}

// 5-bit codes (4 + 1: Q5_0, Q5_1, Q5_K): the one-bit plane's word H holds pair P's bit at
// P. Spread once per sub-block into two words, for pairs P < 8 and P >= 8 (P' = P % 8):
// bit P' of the pair's own, bit P' + 8 of its partner's (P + 2), so each quad's high bits
// need one shift (to bits 4 and 12) instead of two and a blend.
inline void spread_q5(__m512i h, __m512i* out) {
  const __m512i low_byte = _mm512_set1_epi16(0x00FF);
  // imm 0xE4: C ? A : B.
  out[0] = _mm512_ternarylogic_epi32(h, _mm512_slli_epi16(h, 6), low_byte, 0xE4);
  out[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(h, 8), _mm512_srli_epi16(h, 2), low_byte,
                                     0xE4);
}

template <int Q>
inline __m512i quad_bits_q5(const __m512i* lo, const __m512i* spread) {
  constexpr int P = quad_pair(4, Q);
  const __m512i low = _mm512_and_si512(shift16<-4 * (P % 4)>(lo[P / 4]),
                                       _mm512_set1_epi16(0x0F0F));
  const __m512i high = shift16<4 - P % 8>(spread[P / 8]);
  return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi16(0x1010), 0xF8);  // A | (B & C)
}

template <int LO, int HI, int G, int R, int T>
struct SubBlockI8 {
  static constexpr int kHi = HI > 0 ? HI : 1;
  static constexpr bool kQ5 = LO == 4 && HI == 1;
  static constexpr bool kSplit = G == 32 && R * T <= 2;
  __m512i lo[T][LO];
  __m512i hi[T][kHi];
  __m512i spread[T][2];
  __m512i sum[R][T][2];
  const int32_t* x[R];

  template <int Q>
  inline void quad() {
    // Both pairs lie in one group; with one group a sub-block (G = 32) and at most 2 sums
    // in the tile, the quads alternate between two sums, two chains of vpdpbusd instead of
    // one (bigger tiles have chains enough, and no registers to spare).
    constexpr int group = kSplit ? Q % 2 : quad_pair(LO, Q) / (G / 2);
    for (int t = 0; t < T; ++t) {
      __m512i v;
      if constexpr (kQ5) {
        v = quad_bits_q5<Q>(lo[t], spread[t]);
      } else {
        v = quad_bits<LO, HI, Q>(lo[t], hi[t]);
      }
      for (int r = 0; r < R; ++r)
        sum[r][t][group] = _mm512_dpbusd_epi32(sum[r][t][group], v, _mm512_set1_epi32(x[r][Q]));
    }
  }

  template <int... Q>
  inline void quads(std::integer_sequence<int, Q...>) {
    (quad<Q>(), ...);
  }
};

template <int LO, int HI, int G, int R, int T>
void kq_tile_i8(const KqWeight& w, const pdserve_cpu::RowCodes8& qx, int64_t m0, int64_t j0,
                const Dims& dims, float* out, int64_t js = 1) {
  const int64_t num_sub = dims.num_sub();
  const int64_t groups = dims.K / G, blocks = dims.K / w.L;
  constexpr int64_t lo_stride = LO * 64, hi_stride = (HI > 0 ? HI : 1) * 64;
  constexpr int groups_per_sub = static_cast<int>(kSub / G);
  SubBlockI8<LO, HI, G, R, T> sb;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    for (int t = 0; t < T; ++t) {
      const uint8_t* lo = w.lo + ((j0 + t * js) * num_sub + b) * lo_stride;
      for (int c = 0; c < LO; ++c) sb.lo[t][c] = _mm512_loadu_si512(lo + c * 64);
      if constexpr (HI > 0) {
        const uint8_t* hi = w.hi + ((j0 + t * js) * num_sub + b) * hi_stride;
        for (int c = 0; c < HI; ++c) sb.hi[t][c] = _mm512_loadu_si512(hi + c * 64);
        if constexpr (SubBlockI8<LO, HI, G, R, T>::kQ5) spread_q5(sb.hi[t][0], sb.spread[t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      sb.x[r] = qx.quads.data() + ((m0 + r) * dims.K + b * kSub) / 4;
      for (int t = 0; t < T; ++t) sb.sum[r][t][0] = sb.sum[r][t][1] = _mm512_setzero_si512();
    }
    sb.quads(std::make_integer_sequence<int, 8>{});
    if constexpr (SubBlockI8<LO, HI, G, R, T>::kSplit)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) sb.sum[r][t][0] = _mm512_add_epi32(sb.sum[r][t][0], sb.sum[r][t][1]);
    for (int q = 0; q < groups_per_sub; ++q) {
      const int64_t g = b * groups_per_sub + q;
      for (int t = 0; t < T; ++t) {
        const int64_t at_block = ((j0 + t * js) * blocks + g * G / w.L) * kLanes;
        const int64_t at_group = ((j0 + t * js) * groups + g) * kLanes;
        const __m512 scale = group_scale(w, at_block, at_group);
        const __m512 min_term = group_min(w, at_block, at_group);
        for (int r = 0; r < R; ++r) {
          const int32_t c = qx.csum[(m0 + r) * groups + g];
          __m512i s = sb.sum[r][t][q];
          if (w.bias != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(w.bias * c));
          __m512 inner = _mm512_mul_ps(_mm512_cvtepi32_ps(s), scale);
          if (w.has_min())
            inner = _mm512_fmadd_ps(min_term, _mm512_set1_ps(static_cast<float>(c)), inner);
          acc[r][t] = _mm512_fmadd_ps(inner, _mm512_set1_ps(qx.dx[(m0 + r) * num_sub + b]),
                                      acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_storeu_ps(out + (m0 + r) * dims.N + (j0 + t * js) * kLanes, acc[r][t]);
}

template <int LO, int HI, int G>
void kq_rows_i8(const KqWeight& w, const pdserve_cpu::RowCodes8& qx, int64_t m0, int rows, int64_t j0,
                int64_t j1, const Dims& dims, float* out) {
  if constexpr (LO == 4) {
    // A lone row reads a thread's n-blocks in kRowStreams runs at once (kernels.h's
    // row_streams). Types with 4-bit low planes only: on an Intel Xeon (Ice Lake, 2 cores)
    // 30 layers' down projections read from DRAM took Q6_K 1.66 -> 1.52 ms, Q5_0's four
    // projections 6.25 -> 5.86, Q4_K / Q5_K / Q5_1 alike, but Q2_K 1.38 -> 1.61 and Q3_K
    // 1.35 -> 1.57 (2-bit planes: four tiles' planes and scales crowd the registers).
    if (rows == 1) {
      j0 = pdserve_cpu::row_streams(j0, j1, [&](int64_t j, int64_t js) {
        kq_tile_i8<LO, HI, G, 1, pdserve_cpu::kRowStreams>(w, qx, m0, j, dims, out, js);
      });
    }
  }
  each_tile<1>(rows, j0, j1, [&]<int R, int T>(int64_t j) {
    kq_tile_i8<LO, HI, G, R, T>(w, qx, m0, j, dims, out);
  });
}

// Wide tiles, for batches of 8 or more rows: R rows (16 or 8) against one n-block. A
// sub-block's 8 quads are unpacked once into registers and every row's sums are taken
// against them, so the unpacking is shared by R rows instead of kq_tile_i8's 4. The rows'
// codes are laid out once per call so that a tile reads them at fixed offsets from one
// pointer a sub-block (WideRows); each row's sum starts at minus the code bias times its
// group's code sum (the same exact integers as kq_tile_i8's subtraction after), and its float
// work is kq_tile_i8's, in the same order: a row's bits do not depend on its tile.
template <int LO, int HI, int G, int R, bool MINS>
void kq_wide_i8(const KqWeight& w, const pdserve_cpu::WideRows& wr, int64_t tile, int64_t j, const Dims& dims,
                float* out) {
  const int64_t num_sub = dims.num_sub();
  const int64_t groups = dims.K / G, blocks = dims.K / w.L;
  constexpr int64_t lo_stride = LO * 64, hi_stride = (HI > 0 ? HI : 1) * 64;
  constexpr int groups_per_sub = static_cast<int>(kSub / G);
  const int32_t* xq = wr.quads.data() + tile * num_sub * R * 8;
  const int32_t* start = wr.start.data() + tile * groups * R;
  const float* csum = wr.csum.data() + tile * groups * R;
  const float* dx = wr.dx.data() + tile * num_sub * R;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    __m512i v[8];
    {
      __m512i lo[LO], hi[HI > 0 ? HI : 1], spread[2];
      const uint8_t* lp = w.lo + (j * num_sub + b) * lo_stride;
      for (int c = 0; c < LO; ++c) lo[c] = _mm512_loadu_si512(lp + c * 64);
      if constexpr (HI > 0) {
        const uint8_t* hp = w.hi + (j * num_sub + b) * hi_stride;
        for (int c = 0; c < HI; ++c) hi[c] = _mm512_loadu_si512(hp + c * 64);
        if constexpr (LO == 4 && HI == 1) spread_q5(hi[0], spread);
      }
      [&]<int... Q>(std::integer_sequence<int, Q...>) {
        if constexpr (LO == 4 && HI == 1) {
          ((v[Q] = quad_bits_q5<Q>(lo, spread)), ...);
        } else {
          ((v[Q] = quad_bits<LO, HI, Q>(lo, hi)), ...);
        }
      }(std::make_integer_sequence<int, 8>{});
    }
    const int32_t* xb = xq + b * R * 8;
    const float* dxb = dx + b * R;
    for (int q = 0; q < groups_per_sub; ++q) {
      const int64_t g = b * groups_per_sub + q;
      const auto [scale, min_term] = wide_group_terms<G, MINS>(w, j, g, blocks, groups);
      const int32_t* sg = start + g * R;
      const float* cg = csum + g * R;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512i s = _mm512_set1_epi32(sg[r]);
#pragma GCC unroll 8
        for (int Q = 0; Q < 8; ++Q)
          if (G == 32 || quad_pair(LO, Q) / (G / 2) == q)
            s = _mm512_dpbusd_epi32(s, v[Q], _mm512_set1_epi32(xb[r * 8 + Q]));
        __m512 inner = _mm512_mul_ps(_mm512_cvtepi32_ps(s), scale);
        if constexpr (MINS) inner = _mm512_fmadd_ps(min_term, _mm512_set1_ps(cg[r]), inner);
        acc[r] = _mm512_fmadd_ps(inner, _mm512_set1_ps(dxb[r]), acc[r]);
      }
    }
  }
  const int64_t m0 = wr.m0 + tile * R;
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (m0 + r) * dims.N + j * kLanes, acc[r]);
}

// Every tile of ``wr`` (R rows each) against n-blocks [j0, j1).
template <int LO, int HI, int G, int R>
void kq_wide_tiles_i8(const KqWeight& w, const pdserve_cpu::WideRows& wr, int64_t j0, int64_t j1,
                      const Dims& dims, float* out) {
  with_mins(w, [&](auto mins) {
    for (int64_t t = 0; t * R < wr.rows; ++t)
      for (int64_t j = j0; j < j1; ++j) kq_wide_i8<LO, HI, G, R, decltype(mins)::value>(w, wr, t, j, dims, out);
  });
}

// Rows of x against n-blocks [j0, j1): the wide tiles (wide16, then wide8: their rows laid
// out by wide_rows), the rest (under 8 rows, from `rest`) in kq_tile_i8's passes of at most
// kMaxRows.
template <int LO, int HI, int G>
void kq_all_rows_i8(const KqWeight& w, const pdserve_cpu::RowCodes8& qx, const pdserve_cpu::WideRows& wide16,
                    const pdserve_cpu::WideRows& wide8, int64_t rest, int64_t j0, int64_t j1, const Dims& dims,
                    float* out) {
  kq_wide_tiles_i8<LO, HI, G, 16>(w, wide16, j0, j1, dims, out);
  kq_wide_tiles_i8<LO, HI, G, 8>(w, wide8, j0, j1, dims, out);
  const int64_t left = dims.M - rest;
  const int64_t passes = (left + kMaxRows - 1) / kMaxRows;
  for (int64_t p = 0, m0 = rest; p < passes; ++p) {
    const int n = static_cast<int>((dims.M - m0) / (passes - p));
    kq_rows_i8<LO, HI, G>(w, qx, m0, n, j0, j1, dims, out);
    m0 += n;
  }
}

using RowsI8Fn = void (*)(const KqWeight&, const pdserve_cpu::RowCodes8&, const pdserve_cpu::WideRows&,
                          const pdserve_cpu::WideRows&, int64_t, int64_t, int64_t, const Dims&, float*);

RowsI8Fn rows_i8_fn(int lo_w, int hi_w, int64_t group) {
  if (lo_w == 2 && hi_w == 0 && group == 16) return kq_all_rows_i8<2, 0, 16>;
  if (lo_w == 2 && hi_w == 1 && group == 16) return kq_all_rows_i8<2, 1, 16>;
  if (lo_w == 4 && hi_w == 0 && group == 32) return kq_all_rows_i8<4, 0, 32>;
  if (lo_w == 4 && hi_w == 1 && group == 32) return kq_all_rows_i8<4, 1, 32>;
  if (lo_w == 4 && hi_w == 2 && group == 16) return kq_all_rows_i8<4, 2, 16>;
  if (lo_w == 4 && hi_w == 4 && group == 32) return kq_all_rows_i8<4, 4, 32>;
  return nullptr;
}

#endif  // PDSERVE_KQ16

#ifdef PDSERVE_KQ8

// The AVX2 path reads the same layout: the 64 bytes of a chunk are two 256-bit halves, lanes
// 0-7 then 8-15, each 32-bit element one lane's pair of 16-bit words. A half unpacks with the
// same shifts and masks (AND and OR for vpternlogd) and vpmaddwd + vpaddd stand for vpdpwssd:
// the same exact int32 sums. Activations are coded here as quant_x16.cpp codes them (one
// int16 step per row, round to nearest even; or int8 per token), in scalar code.

pdserve_cpu::RowCodes16 quantize_rows8(const float* x, const Dims& dims, int64_t G,
                                       bool with_sums, bool int8_tokens) {
  pdserve_cpu::RowCodes16 q;
  const int64_t groups = dims.K / G;
  q.codes.resize(dims.M * dims.K);
  q.dx.resize(dims.M);
  if (with_sums) q.xsum.assign(dims.M * groups, 0.f);
  for (int64_t m = 0; m < dims.M; ++m) {
    const float* row = x + m * dims.K;
    int16_t* out = q.codes.data() + m * dims.K;
    float absmax = 0.f;
    for (int64_t k = 0; k < dims.K; ++k) absmax = std::max(absmax, std::fabs(row[k]));
    if (int8_tokens) {  // compressed-tensors' dynamic per-token int8 (quant_x16.cpp)
      float scale = absmax / 127.5f;
      if (scale == 0.f) scale = FLT_EPSILON;
      for (int64_t k = 0; k < dims.K; ++k) {
        const float c = std::nearbyint(row[k] / scale);
        out[k] = static_cast<int16_t>(std::min(127.f, std::max(-128.f, c)));
      }
      if (with_sums) {
        for (int64_t g = 0; g < groups; ++g) {
          int32_t s = 0;
          for (int64_t k = g * G; k < (g + 1) * G; ++k) s += out[k];
          q.xsum[m * groups + g] = static_cast<float>(s);
        }
      }
      q.dx[m] = scale;
      continue;
    }
    const float dx = absmax / 32767.f;
    const float inv = absmax > 0.f ? 32767.f / absmax : 0.f;
    for (int64_t k = 0; k < dims.K; ++k) out[k] = static_cast<int16_t>(std::nearbyint(row[k] * inv));
    if (with_sums && absmax > 0.f) {
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) s += row[k];
        q.xsum[m * groups + g] = s / dx;
      }
    }
    q.dx[m] = dx;
  }
  return q;
}

inline __m256i pair_of8(const int16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm256_set1_epi32(bits);
}

template <int W, int P>
inline __m256i plane_bits8(const __m256i* chunks) {
  constexpr int per_word = 16 / W, at = W * (P % per_word);
  const __m256i word = chunks[P / per_word];
  const __m256i down = at ? _mm256_srli_epi16(word, at) : word;
  if constexpr (at + W == 16) return down;
  return _mm256_and_si256(down, _mm256_set1_epi16(static_cast<int16_t>((1 << W) - 1)));
}

template <int LO, int HI, int P>
inline __m256i joined_bits8(const __m256i* lo, const __m256i* hi) {
  constexpr int hi_per = 16 / HI, hi_at = HI * (P % hi_per);
  const __m256i low = plane_bits8<LO, P>(lo);
  const __m256i hw = hi[P / hi_per];
  __m256i high = hw;
  if constexpr (hi_at > LO) high = _mm256_srli_epi16(hw, hi_at - LO);
  if constexpr (hi_at < LO) high = _mm256_slli_epi16(hw, LO - hi_at);
  high = _mm256_and_si256(high, _mm256_set1_epi16(static_cast<int16_t>(((1 << HI) - 1) << LO)));
  return _mm256_or_si256(low, high);
}

// One sub-block's sums on the AVX2 path: R rows against T halves (SubBlock's shape).
template <int LO, int HI, int G, int R, int T>
struct SubBlock8 {
  static constexpr int kHi = HI > 0 ? HI : 1;
  __m256i lo[T][LO];
  __m256i hi[T][kHi];
  __m256i sum[R][T][2];
  const int16_t* x[R];

  template <int P>
  inline void pair() {
    const int half = P / (G / 2);
    for (int t = 0; t < T; ++t) {
      __m256i v;
      if constexpr (HI > 0) {
        v = joined_bits8<LO, kHi, P>(lo[t], hi[t]);
      } else {
        v = plane_bits8<LO, P>(lo[t]);
      }
      for (int r = 0; r < R; ++r)
        sum[r][t][half] =
            _mm256_add_epi32(sum[r][t][half], _mm256_madd_epi16(v, pair_of8(x[r] + 2 * P)));
    }
  }

  template <int... P>
  inline void pairs(std::integer_sequence<int, P...>) {
    (pair<P>(), ...);
  }
};

inline __m256 small_scales8(const int8_t* s8) {
  int64_t bits;
  std::memcpy(&bits, s8, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
}

inline __m256 halves8(const uint16_t* h) {  // 8 float16 values widened (exactly; F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// group_scale and group_min (the AVX-512 path's) for 8 lanes.
inline __m256 group_scale8(const KqWeight& w, int64_t at_block, int64_t at_group) {
  return w.d16 ? halves8(w.d16 + at_block)
               : _mm256_mul_ps(_mm256_loadu_ps(w.d + at_block), small_scales8(w.sc + at_group));
}

inline __m256 group_min8(const KqWeight& w, int64_t at_block, int64_t at_group) {
  if (!w.has_min()) return _mm256_setzero_ps();
  const __m256 v = w.dmin16 ? halves8(w.dmin16 + at_block)
                            : _mm256_mul_ps(_mm256_loadu_ps(w.dmin + at_block),
                                            small_scales8(w.m + at_group));
  return w.sign < 0 ? _mm256_sub_ps(_mm256_setzero_ps(), v) : v;
}

// R rows of x against T halves (8 lanes each) from half h0 (half 2j + e is n-block j's
// lanes 8e..8e+7).
template <int LO, int HI, int G, int R, int T>
void kq_tile8(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, const int32_t* csum,
              int64_t m0, int64_t h0, const Dims& dims, float* out) {
  constexpr int groups_per_sub = static_cast<int>(kSub / G);
  const int64_t num_sub = dims.num_sub();
  const int64_t groups = dims.K / G, blocks = dims.K / w.L;
  SubBlock8<LO, HI, G, R, T> sb;
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    for (int t = 0; t < T; ++t) {
      const int64_t j = (h0 + t) / 2, e = (h0 + t) % 2;
      const uint8_t* lp = w.lo + (j * num_sub + b) * LO * 64 + e * 32;
      for (int c = 0; c < LO; ++c)
        sb.lo[t][c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lp + c * 64));
      if constexpr (HI > 0) {
        const uint8_t* hp = w.hi + (j * num_sub + b) * HI * 64 + e * 32;
        for (int c = 0; c < HI; ++c)
          sb.hi[t][c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp + c * 64));
      }
    }
    for (int r = 0; r < R; ++r) {
      sb.x[r] = qx.codes.data() + (m0 + r) * dims.K + b * kSub;
      for (int t = 0; t < T; ++t) sb.sum[r][t][0] = sb.sum[r][t][1] = _mm256_setzero_si256();
    }
    sb.pairs(std::make_integer_sequence<int, 16>{});
    for (int q = 0; q < groups_per_sub; ++q) {
      const int64_t g = b * groups_per_sub + q;
      if (csum != nullptr) {
        for (int r = 0; r < R; ++r) {
          const __m256i off = _mm256_set1_epi32(w.bias * csum[(m0 + r) * groups + g]);
          for (int t = 0; t < T; ++t) sb.sum[r][t][q] = _mm256_sub_epi32(sb.sum[r][t][q], off);
        }
      }
      for (int t = 0; t < T; ++t) {
        const int64_t j = (h0 + t) / 2, e = (h0 + t) % 2;
        const int64_t at_block = (j * blocks + g * G / w.L) * kLanes + e * 8;
        const int64_t at_group = (j * groups + g) * kLanes + e * 8;
        const __m256 scale = group_scale8(w, at_block, at_group);
        const __m256 min_term = group_min8(w, at_block, at_group);
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb.sum[r][t][q]), scale, acc[r][t]);
          if (w.has_min())
            acc[r][t] = _mm256_fmadd_ps(min_term, _mm256_set1_ps(qx.xsum[(m0 + r) * groups + g]),
                                        acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const int64_t j = (h0 + t) / 2, e = (h0 + t) % 2;
      _mm256_storeu_ps(out + (m0 + r) * dims.N + j * kLanes + e * 8,
                       _mm256_mul_ps(acc[r][t], _mm256_set1_ps(qx.dx[m0 + r])));
    }
}

// Rows [m0, m0 + rows) against halves [h0, h1): a tile is 2 halves, one n-block (a lone row
// reads each plane as one run of addresses, as on the AVX-512 path; kq_rows above).
template <int LO, int HI, int G>
void kq_rows8(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, const int32_t* csum,
              int64_t m0, int rows, int64_t h0, int64_t h1, const Dims& dims, float* out) {
  each_tile<2>(rows, h0, h1, [&]<int R, int T>(int64_t h) {
    kq_tile8<LO, HI, G, R, T>(w, qx, csum, m0, h, dims, out);
  });
}

using RowsFn = void (*)(const KqWeight&, const pdserve_cpu::RowCodes16&, const int32_t*,
                        int64_t, int, int64_t, int64_t, const Dims&, float*);

constexpr int64_t kUnitsPerBlock = 2;  // a tile's unit: half an n-block

pdserve_cpu::RowCodes16 quantize_kq(const float* x, const Dims& dims, int64_t G, bool with_sums,
                                    bool int8_tokens) {
  return quantize_rows8(x, dims, G, with_sums, int8_tokens);
}

RowsFn rows_fn(int lo_w, int hi_w, int64_t group) {
  if (lo_w == 2 && hi_w == 0 && group == 16) return kq_rows8<2, 0, 16>;
  if (lo_w == 2 && hi_w == 1 && group == 16) return kq_rows8<2, 1, 16>;
  if (lo_w == 4 && hi_w == 0 && group == 32) return kq_rows8<4, 0, 32>;
  if (lo_w == 4 && hi_w == 1 && group == 32) return kq_rows8<4, 1, 32>;
  if (lo_w == 4 && hi_w == 2 && group == 16) return kq_rows8<4, 2, 16>;
  if (lo_w == 4 && hi_w == 4 && group == 32) return kq_rows8<4, 4, 32>;
  return nullptr;
}


// The 8-bit activation path on AVX2 (act_bits 8, or int8_tokens): x in int8 codes per sub-block of 32 as the AVX-512 path codes them
// (x8_quantize_rows, quant_x16.cpp's AVX2 build), weights unpacked into quads as there
// (quad_bits, above the AVX-512 path: bytes u[2P], u[2P2], u[2P + 1], u[2P2 + 1] per lane,
// ANDs and ORs where that path has vpternlogd). vpmaddubsw multiplies the unsigned codes by
// the signed x codes and adds pairs into int16; a run of such products still adds up in
// int16 exactly (at most 32767 / (255 x 2^B) quads for codes of B bits: a product pair is at
// most (2^B - 1) x 128 x 2), and one vpmaddwd by ones widens each run into the int32 sum. A
// half of an n-block's sub-block is unpacked once for all the tile's rows. 8-bit codes
// (W8: two 4-bit planes) would overflow the pairs: each plane goes as 4-bit codes, the high
// plane's sums widened by a vpmaddwd by 16s (u = 16 h + l, exactly). Per group the float
// work is kq_tile_i8's, in its order: the same floats as the AVX-512 path.

template <int S>
inline __m256i shift16_8(__m256i v) {  // left by S bits (right when S < 0), per 16-bit word
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  return v;
}

template <int LO, int HI, int Q>
inline __m256i quad_bits8(const __m256i* lo, const __m256i* hi) {
  constexpr int per = 16 / LO, half = per / 2;
  constexpr int P = quad_pair(LO, Q), P2 = P + half;
  constexpr int lo_mask = (1 << LO) - 1;
  const __m256i low = _mm256_and_si256(shift16_8<-LO * (P % per)>(lo[P / per]),
                                       _mm256_set1_epi16(static_cast<int16_t>(lo_mask * 0x101)));
  if constexpr (HI == 0) {
    return low;
  } else {
    constexpr int hi_per = 16 / HI, hm = (1 << HI) - 1;
    constexpr int at = HI * (P % hi_per), at2 = HI * (P2 % hi_per);
    const __m256i a = shift16_8<LO - at>(hi[P / hi_per]);
    if constexpr (P / hi_per != P2 / hi_per || LO - at != LO + 8 - at2) {
      const __m256i b = shift16_8<LO + 8 - at2>(hi[P2 / hi_per]);
      const __m256i high = _mm256_or_si256(
          _mm256_and_si256(a, _mm256_set1_epi16(static_cast<int16_t>(hm << LO))),
          _mm256_and_si256(b, _mm256_set1_epi16(static_cast<int16_t>(hm << (LO + 8)))));
      return _mm256_or_si256(low, high);
    } else {
      constexpr int16_t both = static_cast<int16_t>((hm << LO) | (hm << (LO + 8)));
      return _mm256_or_si256(low, _mm256_and_si256(a, _mm256_set1_epi16(both)));
    }
  }
}

// spread_q5 (the AVX-512 path's) with a byte blend: 5-bit codes' high bits one shift away.
inline void spread_q5_8(__m256i h, __m256i* out) {
  const __m256i low_byte = _mm256_set1_epi16(0x00FF);
  out[0] = _mm256_blendv_epi8(_mm256_slli_epi16(h, 6), h, low_byte);
  out[1] = _mm256_blendv_epi8(_mm256_srli_epi16(h, 2), _mm256_srli_epi16(h, 8), low_byte);
}

template <int Q>
inline __m256i quad_bits_q5_8(const __m256i* lo, const __m256i* spread) {
  constexpr int P = quad_pair(4, Q);
  const __m256i low = _mm256_and_si256(shift16_8<-4 * (P % 4)>(lo[P / 4]), _mm256_set1_epi16(0x0F0F));
  const __m256i high = shift16_8<4 - P % 8>(spread[P / 8]);
  return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi16(0x1010)));
}

// 6-bit codes (4 + 2: Q6_K): a 2-bit chunk's word H holds pair P's bits at 2 (P % 8), and a
// quad's partner pair P2 = P + 2 sits 4 bits above, where the quad wants 8. Spread once per
// sub-block into two words per chunk, low bytes from H (then H >> 8) and high bytes from
// H << 4 (then H >> 4): pairs P % 8 in {0, 1} (then {4, 5}) lie at 2 (P % 4) and their
// partners 8 above, so each quad's high bits take one shift and a mask.
inline void spread_q6_8(const __m256i* hi, __m256i* out) {
  const __m256i low_byte = _mm256_set1_epi16(0x00FF);
  for (int c = 0; c < 2; ++c) {
    const __m256i h = hi[c];
    out[2 * c] = _mm256_blendv_epi8(_mm256_slli_epi16(h, 4), h, low_byte);
    out[2 * c + 1] = _mm256_blendv_epi8(_mm256_srli_epi16(h, 4), _mm256_srli_epi16(h, 8), low_byte);
  }
}

template <int Q>
inline __m256i quad_bits_q6_8(const __m256i* lo, const __m256i* spread) {
  constexpr int P = quad_pair(4, Q);
  const __m256i low = _mm256_and_si256(shift16_8<-4 * (P % 4)>(lo[P / 4]), _mm256_set1_epi16(0x0F0F));
  const __m256i high = shift16_8<4 - 2 * (P % 4)>(spread[2 * (P / 8) + (P % 8) / 4]);
  return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi16(0x3030)));
}

// Quads whose vpmaddubsw products add up in int16 exactly, for codes of `bits` bits.
constexpr int int16_run(int bits) { return 32767 / (((1 << bits) - 1) * 256); }

// R rows (from m0) against n-block j, both its halves, on the 8-bit path.
template <int LO, int HI, int G, int R>
void kq_block_i8_8(const KqWeight& w, const pdserve_cpu::RowCodes8& qx, int64_t m0, int64_t j,
                   const Dims& dims, float* out) {
  // 8-bit codes (4 + 4): each nibble plane as 4-bit codes, the high one's sums weighted by
  // 16 in the widening vpmaddwd (exact: u = 16 h + l).
  constexpr bool kW8 = LO == 4 && HI == 4;
  constexpr int groups_per_sub = static_cast<int>(kSub / G), quads_per_group = 8 / groups_per_sub;
  constexpr int run = std::min(int16_run(kW8 ? 4 : LO + HI), quads_per_group);
  static_assert(run >= 1, "codes too wide for int16 runs");
  const int64_t num_sub = dims.num_sub(), groups = dims.K / G, blocks = dims.K / w.L;
  const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  // Loop invariants held in registers: the weight's fields are read once, not per group.
  const bool has_min = w.has_min();
  const int32_t bias = w.bias;
  const bool has_bias = bias != 0;
  // The float block of sub-block b is b / (L / 32) (L is a multiple of 32, so a sub-block's
  // groups share it): counted along, not divided per group.
  const int64_t subs_per_block = w.L / kSub;
  int64_t block = 0, sub_in_block = 0;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_sub; ++b) {
    const int64_t block_base = (j * blocks + block) * kLanes;
    if (++sub_in_block == subs_per_block) {
      sub_in_block = 0;
      ++block;
    }
    for (int e = 0; e < 2; ++e) {
      __m256i v[8], vh[kW8 ? 8 : 1];
      {
        __m256i lo[LO], hi[HI > 0 ? HI : 1], spread[4];
        const uint8_t* lp = w.lo + (j * num_sub + b) * LO * 64 + e * 32;
        for (int c = 0; c < LO; ++c) lo[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lp + c * 64));
        if constexpr (HI > 0) {
          const uint8_t* hp = w.hi + (j * num_sub + b) * HI * 64 + e * 32;
          for (int c = 0; c < HI; ++c) hi[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp + c * 64));
          if constexpr (LO == 4 && HI == 1) spread_q5_8(hi[0], spread);
          if constexpr (LO == 4 && HI == 2) spread_q6_8(hi, spread);
        }
        [&]<int... Q>(std::integer_sequence<int, Q...>) {
          if constexpr (LO == 4 && HI == 1) {
            ((v[Q] = quad_bits_q5_8<Q>(lo, spread)), ...);
          } else if constexpr (LO == 4 && HI == 2) {
            ((v[Q] = quad_bits_q6_8<Q>(lo, spread)), ...);
          } else if constexpr (kW8) {
            ((v[Q] = quad_bits8<4, 0, Q>(lo, hi)), ...);
            ((vh[Q] = quad_bits8<4, 0, Q>(hi, hi)), ...);
          } else {
            ((v[Q] = quad_bits8<LO, HI, Q>(lo, hi)), ...);
          }
        }(std::make_integer_sequence<int, 8>{});
      }
      for (int q = 0; q < groups_per_sub; ++q) {
        const int64_t g = b * groups_per_sub + q;
        const int64_t at_block = block_base + e * 8;
        const int64_t at_group = (j * groups + g) * kLanes + e * 8;
        const __m256 scale = group_scale8(w, at_block, at_group);
        // group_min8 checks for mins itself; testing the local first keeps the check on a
        // register (the form measured in d989612).
        const __m256 min_term = has_min ? group_min8(w, at_block, at_group) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xq = qx.quads.data() + ((m0 + r) * dims.K + b * kSub) / 4;
          __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int Q0 = q * quads_per_group; Q0 < (q + 1) * quads_per_group; Q0 += run) {
            __m256i p = _mm256_maddubs_epi16(v[Q0], _mm256_set1_epi32(xq[Q0]));
#pragma GCC unroll 8
            for (int Q = Q0 + 1; Q < Q0 + run; ++Q)
              p = _mm256_add_epi16(p, _mm256_maddubs_epi16(v[Q], _mm256_set1_epi32(xq[Q])));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
            if constexpr (kW8) {
              __m256i ph = _mm256_maddubs_epi16(vh[Q0], _mm256_set1_epi32(xq[Q0]));
#pragma GCC unroll 8
              for (int Q = Q0 + 1; Q < Q0 + run; ++Q)
                ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(vh[Q], _mm256_set1_epi32(xq[Q])));
              s = _mm256_add_epi32(s, _mm256_madd_epi16(ph, sixteens));
            }
          }
          const int32_t c = qx.csum[(m0 + r) * groups + g];
          if (has_bias) s = _mm256_sub_epi32(s, _mm256_set1_epi32(bias * c));
          __m256 inner = _mm256_mul_ps(_mm256_cvtepi32_ps(s), scale);
          if (has_min)
            inner = _mm256_fmadd_ps(min_term, _mm256_set1_ps(static_cast<float>(c)), inner);
          acc[r][e] = _mm256_fmadd_ps(inner, _mm256_set1_ps(qx.dx[(m0 + r) * num_sub + b]),
                                      acc[r][e]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int e = 0; e < 2; ++e)
      _mm256_storeu_ps(out + (m0 + r) * dims.N + j * kLanes + e * 8, acc[r][e]);
}

constexpr int kMaxRowsI8 = 8;  // rows of x per pass on the AVX2 8-bit path

// Rows [m0, m0 + rows) (at most kMaxRowsI8) against n-blocks [j0, j1).
template <int LO, int HI, int G>
void kq_rows_i8_8(const KqWeight& w, const pdserve_cpu::RowCodes8& qx, int64_t m0, int rows,
                  int64_t j0, int64_t j1, const Dims& dims, float* out) {
  auto each = [&]<int R>() {
    for (int64_t j = j0; j < j1; ++j) kq_block_i8_8<LO, HI, G, R>(w, qx, m0, j, dims, out);
  };
  switch (rows) {
    case 1: each.template operator()<1>(); break;
    case 2: each.template operator()<2>(); break;
    case 3: each.template operator()<3>(); break;
    case 4: each.template operator()<4>(); break;
    case 5: each.template operator()<5>(); break;
    case 6: each.template operator()<6>(); break;
    case 7: each.template operator()<7>(); break;
    default: each.template operator()<8>(); break;
  }
}

using RowsI8Fn8 = void (*)(const KqWeight&, const pdserve_cpu::RowCodes8&, int64_t, int,
                           int64_t, int64_t, const Dims&, float*);

RowsI8Fn8 rows_i8_fn8(int lo_w, int hi_w, int64_t group) {
  if (lo_w == 2 && hi_w == 0 && group == 16) return kq_rows_i8_8<2, 0, 16>;
  if (lo_w == 2 && hi_w == 1 && group == 16) return kq_rows_i8_8<2, 1, 16>;
  if (lo_w == 4 && hi_w == 0 && group == 32) return kq_rows_i8_8<4, 0, 32>;
  if (lo_w == 4 && hi_w == 1 && group == 32) return kq_rows_i8_8<4, 1, 32>;
  if (lo_w == 4 && hi_w == 2 && group == 16) return kq_rows_i8_8<4, 2, 16>;
  if (lo_w == 4 && hi_w == 4 && group == 32) return kq_rows_i8_8<4, 4, 32>;
  return nullptr;
}

#endif  // PDSERVE_KQ8

#if defined(PDSERVE_KQ16) || defined(PDSERVE_KQ8)
// Each row's sum of x codes per group of G, [M, K / G]: the code bias's term.
std::vector<int32_t> code_sums(const pdserve_cpu::RowCodes16& qx, const Dims& dims, int64_t G) {
  const int64_t groups = dims.K / G;
  std::vector<int32_t> sums(static_cast<size_t>(dims.M * groups));
  for (int64_t m = 0; m < dims.M; ++m) {
    const int16_t* row = qx.codes.data() + m * dims.K;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t s = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) s += row[k];
      sums[m * groups + g] = s;
    }
  }
  return sums;
}
#endif

}  // namespace

namespace pdserve_cpu {

torch::Tensor kq_x16_matmul(const torch::Tensor& x, const torch::Tensor& lo_plane,
                            const std::optional<torch::Tensor>& hi_plane, int64_t lo_width,
                            int64_t hi_width, int64_t bias, int64_t group_size,
                            int64_t block_size, const torch::Tensor& d,
                            const std::optional<torch::Tensor>& sc,
                            const std::optional<torch::Tensor>& dmin,
                            const std::optional<torch::Tensor>& m, double sign, int64_t n,
                            bool int8_tokens, int64_t act_bits) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous float32 [M, K] CPU matrix");
  const Dims dims{x.size(0), x.size(1), n};
  TORCH_CHECK(group_size == 16 || group_size == 32, "group_size must be 16 or 32, got ", group_size);
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "act_bits must be 8 or 16, got ", act_bits);
  TORCH_CHECK(block_size % group_size == 0 && block_size % kSub == 0 && dims.K % block_size == 0,
              "K = ", dims.K, " must be a multiple of the float block ", block_size);
  TORCH_CHECK(n > 0 && n % kLanes == 0, "N must be a positive multiple of 16, got ", n);
  auto check_plane = [&](const torch::Tensor& t, int64_t width, const char* what) {
    TORCH_CHECK(width == 1 || width == 2 || width == 4, what, " width must be 1, 2 or 4");
    TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous() &&
                    t.numel() == dims.num_blocks() * dims.num_sub() * width * 64,
                what, " must be contiguous uint8 [N/16, K/32, ", width, ", 64]");
  };
  check_plane(lo_plane, lo_width, "the low plane");
  if (hi_plane.has_value()) check_plane(*hi_plane, hi_width, "the high plane");
  TORCH_CHECK(lo_width + (hi_plane.has_value() ? hi_width : 0) <= 8, "codes of at most 8 bits");
  auto check_scales = [&](const torch::Tensor& t, torch::ScalarType type, int64_t per, const char* what) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() &&
                    t.numel() == dims.num_blocks() * (dims.K / per) * kLanes,
                what, " must be contiguous [N/16, K/", per, ", 16] of ", c10::toString(type));
  };
  // Half scales: d (and dmin) float16 one per group, no sc (and no m).
  const bool half = d.scalar_type() == torch::kHalf;
  if (half) {
    TORCH_CHECK(block_size == group_size, "float16 d needs one d per group (block ", block_size,
                ", group ", group_size, ")");
    TORCH_CHECK(!sc.has_value() && !m.has_value(), "float16 d comes without sc and m");
  } else {
    TORCH_CHECK(sc.has_value(), "float32 d needs sc");
    TORCH_CHECK(dmin.has_value() == m.has_value(), "dmin and m come together");
  }
  const torch::ScalarType float_type = half ? torch::kHalf : torch::kFloat32;
  check_scales(d, float_type, block_size, "d");
  if (sc.has_value()) check_scales(*sc, torch::kInt8, group_size, "sc");
  if (dmin.has_value()) check_scales(*dmin, float_type, block_size, "dmin");
  if (m.has_value()) check_scales(*m, torch::kInt8, group_size, "m");
  auto out = torch::empty({dims.M, dims.N}, x.options());
  if (dims.M == 0) return out;
#if defined(PDSERVE_KQ16) || defined(PDSERVE_KQ8)
  KqWeight w{lo_plane.data_ptr<uint8_t>(),
             hi_plane.has_value() ? hi_plane->data_ptr<uint8_t>() : nullptr,
             static_cast<int>(lo_width), static_cast<int>(hi_width), static_cast<int>(bias),
             group_size, block_size, half ? nullptr : d.data_ptr<float>(),
             sc.has_value() ? sc->data_ptr<int8_t>() : nullptr,
             dmin.has_value() && !half ? dmin->data_ptr<float>() : nullptr,
             m.has_value() ? m->data_ptr<int8_t>() : nullptr, static_cast<float>(sign)};
  if (half) {
    w.d16 = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
    if (dmin.has_value()) w.dmin16 = reinterpret_cast<const uint16_t*>(dmin->data_ptr<at::Half>());
  }
  const int hi_w = w.hi ? w.hi_w : 0;
  const RowsFn run = rows_fn(w.lo_w, hi_w, group_size);
  TORCH_CHECK(run != nullptr, "no KQx16 kernel for planes of ", lo_width, " + ",
              hi_plane.has_value() ? hi_width : 0, " bits in groups of ", group_size);
  float* op = out.data_ptr<float>();
#ifdef PDSERVE_KQ16
  if (act_bits == 8 || int8_tokens) {  // the same codes either way for int8 tokens
    const RowsI8Fn run8 = rows_i8_fn(w.lo_w, hi_w, group_size);
    const RowCodes8 q8 = x8_quantize_rows(x.data_ptr<float>(), dims.M, dims.K, group_size,
                                          w.lo_w, int8_tokens);
    // Rows in wide tiles of 16, then one of 8 if 8 or more are left, the rest in passes.
    const int64_t tiles16 = dims.M / 16, tiles8 = (dims.M % 16) / 8;
    const WideRows wide16 = wide_rows(q8, 0, tiles16, 16, w.bias, dims.K, group_size);
    const WideRows wide8 = wide_rows(q8, tiles16 * 16, tiles8, 8, w.bias, dims.K, group_size);
    const int64_t rest = tiles16 * 16 + tiles8 * 8;
    // Chunks of 2 n-blocks, a tile's width: a 192-row projection is 6 chunks, not 3 of 4
    // (one thread would run two of them while the other waits).
    const int64_t num_pairs = (dims.num_blocks() + 1) / 2;
    parallel_for(num_pairs, 1, [&](int64_t q0, int64_t q1) {
      const int64_t u0 = q0 * 2, u1 = std::min(dims.num_blocks(), q1 * 2);
      run8(w, q8, wide16, wide8, rest, u0, u1, dims, op);
    });
    return out;
  }
#endif
#ifdef PDSERVE_KQ8
  if (act_bits == 8 || int8_tokens) {  // the same codes either way for int8 tokens
    const RowsI8Fn8 run8 = rows_i8_fn8(w.lo_w, hi_w, group_size);
    if (run8 != nullptr) {
      const RowCodes8 q8 = x8_quantize_rows(x.data_ptr<float>(), dims.M, dims.K, group_size,
                                            w.lo_w, int8_tokens);
      const int64_t passes = (dims.M + kMaxRowsI8 - 1) / kMaxRowsI8;
      parallel_for(dims.num_blocks(), 1, [&](int64_t j0, int64_t j1) {
        for (int64_t p = 0, m0 = 0; p < passes; ++p) {
          const int rows = static_cast<int>((dims.M - m0) / (passes - p));
          run8(w, q8, m0, rows, j0, j1, dims, op);
          m0 += rows;
        }
      });
      return out;
    }
  }
#endif
  const RowCodes16 qx =
      quantize_kq(x.data_ptr<float>(), dims, group_size, w.has_min(), int8_tokens);
  std::vector<int32_t> csum;
  if (w.bias != 0) csum = code_sums(qx, dims, group_size);
  const int32_t* cs = csum.empty() ? nullptr : csum.data();
  // Chunks of 4 units (n-blocks, or the AVX2 path's halves of them) so a lone row's passes
  // are whole; rows in passes of near-equal size, none over kMaxRows.
  const int64_t units = kUnitsPerBlock * dims.num_blocks();
  const int64_t num_quads = (units + 3) / 4;
  // With AVX-512, rows in wide tiles of kWideRows16 while they fill; the rest in passes.
  int64_t wide_rows16 = 0;
#ifdef PDSERVE_KQ16
  const Wide16Fn wide = wide16_fn(w.lo_w, hi_w, group_size);
  wide_rows16 = wide != nullptr ? dims.M / kWideRows16 * kWideRows16 : 0;
#endif
  const int64_t passes = (dims.M - wide_rows16 + kMaxRows - 1) / kMaxRows;
  parallel_for(num_quads, 1, [&](int64_t q0, int64_t q1) {
    const int64_t u0 = q0 * 4, u1 = std::min(units, q1 * 4);
#ifdef PDSERVE_KQ16
    for (int64_t m0 = 0; m0 < wide_rows16; m0 += kWideRows16) wide(w, qx, cs, m0, u0, u1, dims, op);
#endif
    for (int64_t p = 0, m0 = wide_rows16; p < passes; ++p) {
      const int rows = static_cast<int>((dims.M - m0) / (passes - p));
      run(w, qx, cs, m0, rows, u0, u1, dims, op);
      m0 += rows;
    }
  });
#else
  TORCH_CHECK(false, "the KQx16 kernels need AVX2 and FMA, or AVX-512 F/BW/VL and VNNI "
              "(this build has neither)");
#endif
  return out;
}

bool has_kq() {
#if defined(PDSERVE_KQ16) || defined(PDSERVE_KQ8)
  return true;
#else
  return false;
#endif
}

}  // namespace pdserve_cpu

void register_kquant_x16(pybind11::module& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("kq_x16_matmul", &pdserve_cpu::kq_x16_matmul, release(),
        "x [M, K] float32 @ KQx16 weights [N, K]^T -> [M, N] float32 (kernels/cpu/kquant.py)");
  m.def("has_kq", &pdserve_cpu::has_kq,
        "whether the KQx16 kernels were compiled in (AVX-512 VNNI, or the AVX2 path)");
}
