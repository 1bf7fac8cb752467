// Matmuls over KQx16 weights (kernels/cpu/kquant.py): GGUF's K-quants and Q5_0 / Q5_1 at
// their own bit widths, 16 weight rows in the lanes of a 512-bit register, for CPUs with
// AVX-512 (F, BW, VL) and VNNI. Activations float32 in and out, quantized inside to int16
// codes with one step per row, as quant_x16.cpp does for Q4x16.
//
// M = activation rows, K = input features, N = output features, NB = N / 16, SB = K / 32,
// G = group size (16 or 32), L = the float block (256, or 32 for Q5_0 / Q5_1).
//
// A weight is (u - bias) * (d * sc) + sign * (dmin * m). Per sub-block of 32 and each of its
// 16 pairs of elements p, the code planes unpack into one int16 vector per pair (lane i,
// h = 0 / 1: u[16j + i, 32b + 2p + h]), the bias is subtracted (codes become signed), and
// one vpdpwssd adds u x[2p] + u' x[2p + 1] into lane i: the int32 sum S of each group is
// exact. Then per group, in float32: acc += S * (d * sc), and with mins
// acc += sign * (dmin * m) * xsum_g / dx; y = acc * dx. d * sc and dmin * m are exact
// products (an 11-bit significand times at most 8 bits).
//
// Plane of width w, chunk c = p / (16 / w), position t = p % (16 / w): the pair's bits are
// (word >> w t) & (2^w - 1) of each 16-bit word; a second plane's bits go above the first's.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define PDSERVE_KQ16 1
#endif

namespace {

constexpr int64_t kSub = 32;
constexpr int64_t kLanes = 16;
constexpr int kMaxRows = 4;  // rows of x per pass over the weights

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
};

struct Dims {
  int64_t M, K, N;
  int64_t num_sub() const { return K / kSub; }
  int64_t num_blocks() const { return N / kLanes; }
};

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

// The int16 codes of pair P from a plane of width W held in registers (its W chunks).
template <int W, int P>
inline __m512i plane_bits(const __m512i* chunks) {
  constexpr int per_word = 16 / W;
  return _mm512_and_si512(_mm512_srli_epi16(chunks[P / per_word], W * (P % per_word)),
                          _mm512_set1_epi16(static_cast<int16_t>((1 << W) - 1)));
}

// Sums of one sub-block: R rows against T n-blocks, the codes of planes LO (+ HI above it),
// groups of G; widths and pair positions are compile-time, so every shift is an immediate.
template <int LO, int HI, int G, int R, int T>
struct SubBlock {
  static constexpr int kHi = HI > 0 ? HI : 1;
  __m512i lo[T][LO];
  __m512i hi[T][kHi];
  __m512i sum[R][T][2];
  const int16_t* x[R];
  __m512i bias;
  bool biased;

  template <int P>
  inline void pair() {
    const int half = P / (G / 2);
    for (int t = 0; t < T; ++t) {
      __m512i v = plane_bits<LO, P>(lo[t]);
      if constexpr (HI > 0) v = _mm512_or_si512(v, _mm512_slli_epi16(plane_bits<kHi, P>(hi[t]), LO));
      if (biased) v = _mm512_sub_epi16(v, bias);
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
void kq_tile(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, int64_t m0, int64_t j0,
             const Dims& dims, float* out) {
  const int64_t num_sub = dims.num_sub();
  const int64_t groups = dims.K / G, blocks = dims.K / w.L;
  constexpr int64_t lo_stride = LO * 64, hi_stride = (HI > 0 ? HI : 1) * 64;
  constexpr int groups_per_sub = static_cast<int>(kSub / G);  // 1 or 2
  SubBlock<LO, HI, G, R, T> sb;
  sb.bias = _mm512_set1_epi16(static_cast<int16_t>(w.bias));
  sb.biased = w.bias != 0;
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
    for (int q = 0; q < groups_per_sub; ++q) {
      const int64_t g = b * groups_per_sub + q;
      for (int t = 0; t < T; ++t) {
        const int64_t at_block = ((j0 + t) * blocks + g * G / w.L) * kLanes;
        const int64_t at_group = ((j0 + t) * groups + g) * kLanes;
        const __m512 scale = scales16(w.d + at_block, w.sc + at_group);
        __m512 min_term = _mm512_setzero_ps();
        if (w.dmin) {
          min_term = scales16(w.dmin + at_block, w.m + at_group);
          if (w.sign < 0) min_term = _mm512_sub_ps(_mm512_setzero_ps(), min_term);
        }
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb.sum[r][t][q]), scale, acc[r][t]);
          if (w.dmin)
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

// Rows [m0, m0 + rows) (at most kMaxRows) against n-blocks [j0, j1): a lone row takes 4
// n-blocks a pass (4 independent chains of vpdpwssd), 2-4 rows take 2.
template <int LO, int HI, int G>
void kq_rows(const KqWeight& w, const pdserve_cpu::RowCodes16& qx, int64_t m0, int rows,
             int64_t j0, int64_t j1, const Dims& dims, float* out) {
  int64_t j = j0;
#define PDSERVE_KQ_TILE(R, T) kq_tile<LO, HI, G, R, T>(w, qx, m0, j, dims, out)
  switch (rows) {
    case 1: for (; j + 4 <= j1; j += 4) PDSERVE_KQ_TILE(1, 4); break;
    case 2: for (; j + 2 <= j1; j += 2) PDSERVE_KQ_TILE(2, 2); break;
    case 3: for (; j + 2 <= j1; j += 2) PDSERVE_KQ_TILE(3, 2); break;
    default: for (; j + 2 <= j1; j += 2) PDSERVE_KQ_TILE(4, 2); break;
  }
  for (; j < j1; ++j) {
    switch (rows) {
      case 1: PDSERVE_KQ_TILE(1, 1); break;
      case 2: PDSERVE_KQ_TILE(2, 1); break;
      case 3: PDSERVE_KQ_TILE(3, 1); break;
      default: PDSERVE_KQ_TILE(4, 1); break;
    }
  }
#undef PDSERVE_KQ_TILE
}

using RowsFn = void (*)(const KqWeight&, const pdserve_cpu::RowCodes16&, int64_t, int, int64_t,
                        int64_t, const Dims&, float*);

// The instantiation for a type's planes and group (kernels/cpu/kquant.py's KQ_LAYOUTS).
RowsFn rows_fn(int lo_w, int hi_w, int64_t group) {
  if (lo_w == 2 && hi_w == 0 && group == 16) return kq_rows<2, 0, 16>;  // Q2_K
  if (lo_w == 2 && hi_w == 1 && group == 16) return kq_rows<2, 1, 16>;  // Q3_K
  if (lo_w == 4 && hi_w == 0 && group == 32) return kq_rows<4, 0, 32>;  // Q4_K
  if (lo_w == 4 && hi_w == 1 && group == 32) return kq_rows<4, 1, 32>;  // Q5_K, Q5_0, Q5_1
  if (lo_w == 4 && hi_w == 2 && group == 16) return kq_rows<4, 2, 16>;  // Q6_K
  return nullptr;
}

#endif  // PDSERVE_KQ16

}  // namespace

namespace pdserve_cpu {

torch::Tensor kq_x16_matmul(const torch::Tensor& x, const torch::Tensor& lo_plane,
                            const std::optional<torch::Tensor>& hi_plane, int64_t lo_width,
                            int64_t hi_width, int64_t bias, int64_t group_size,
                            int64_t block_size, const torch::Tensor& d, const torch::Tensor& sc,
                            const std::optional<torch::Tensor>& dmin,
                            const std::optional<torch::Tensor>& m, double sign, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous float32 [M, K] CPU matrix");
  const Dims dims{x.size(0), x.size(1), n};
  TORCH_CHECK(group_size == 16 || group_size == 32, "group_size must be 16 or 32, got ", group_size);
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
  check_scales(d, torch::kFloat32, block_size, "d");
  check_scales(sc, torch::kInt8, group_size, "sc");
  TORCH_CHECK(dmin.has_value() == m.has_value(), "dmin and m come together");
  if (dmin.has_value()) {
    check_scales(*dmin, torch::kFloat32, block_size, "dmin");
    check_scales(*m, torch::kInt8, group_size, "m");
  }
  auto out = torch::empty({dims.M, dims.N}, x.options());
  if (dims.M == 0) return out;
#ifdef PDSERVE_KQ16
  const KqWeight w{lo_plane.data_ptr<uint8_t>(),
                   hi_plane.has_value() ? hi_plane->data_ptr<uint8_t>() : nullptr,
                   static_cast<int>(lo_width), static_cast<int>(hi_width),
                   static_cast<int>(bias), group_size, block_size, d.data_ptr<float>(),
                   sc.data_ptr<int8_t>(), dmin.has_value() ? dmin->data_ptr<float>() : nullptr,
                   m.has_value() ? m->data_ptr<int8_t>() : nullptr, static_cast<float>(sign)};
  const RowsFn run = rows_fn(w.lo_w, w.hi ? w.hi_w : 0, group_size);
  TORCH_CHECK(run != nullptr, "no KQx16 kernel for planes of ", lo_width, " + ",
              hi_plane.has_value() ? hi_width : 0, " bits in groups of ", group_size);
  const RowCodes16 qx = x16_quantize_rows(x.data_ptr<float>(), dims.M, dims.K, group_size,
                                          dmin.has_value());
  float* op = out.data_ptr<float>();
  // Chunks of 4 n-blocks (64 outputs) so a lone row's passes are whole; rows in passes of
  // near-equal size, none over kMaxRows.
  const int64_t num_quads = (dims.num_blocks() + 3) / 4;
  const int64_t passes = (dims.M + kMaxRows - 1) / kMaxRows;
  parallel_for(num_quads, 1, [&](int64_t q0, int64_t q1) {
    const int64_t j0 = q0 * 4, j1 = std::min(dims.num_blocks(), q1 * 4);
    for (int64_t p = 0, m0 = 0; p < passes; ++p) {
      const int rows = static_cast<int>((dims.M - m0) / (passes - p));
      run(w, qx, m0, rows, j0, j1, dims, op);
      m0 += rows;
    }
  });
#else
  TORCH_CHECK(false, "the KQx16 kernels need AVX-512 F/BW/VL and VNNI (this build has none)");
#endif
  return out;
}

}  // namespace pdserve_cpu

void register_kquant_x16(pybind11::module& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("kq_x16_matmul", &pdserve_cpu::kq_x16_matmul, release(),
        "x [M, K] float32 @ KQx16 weights [N, K]^T -> [M, N] float32 (kernels/cpu/kquant.py)");
}
