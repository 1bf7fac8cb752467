// The C++ CPU kernels as C++ functions (kernels/cpu/*.cpp define them), for the kernels that
// call others (decode_model.cpp). Shapes and contracts: each definition's comment and
// kernels/cpu/quant.py. Every function checks its arguments and raises (TORCH_CHECK) on bad
// input.

#pragma once

#include <torch/extension.h>

#include <functional>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Intel AMX (tiles and their int8 dot products) where the compiler targets it (kernels/cpu/
// __init__.py adds -mamx-tile -mamx-int8 on a CPU that lists both); whether the kernels take
// it is amx_on(), at run time.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PDSERVE_AMX 1
#endif

namespace pdserve_cpu {

// Whether the int8 wide tiles of 16 rows run on AMX: compiled in, the kernel let this process
// use the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM, asked once), PDSERVE_AMX is not 0
// and set_amx did not turn it off. Both paths give the same bits (the tile's int32 sums are the
// vector path's; the float work after them is the same).
bool amx_on();
bool amx_available();
void set_amx(bool on);

// A lone row reads a thread's n-blocks of x16 and KQx16 weights as kRowStreams runs at once
// (quant_x16.cpp says why); set_row_streams(false) makes it one run, for comparisons.
constexpr int kRowStreams = 4;
bool row_streams_on();

// A lone row against a thread's n-blocks [j0, j1) in kRowStreams runs of equal length read
// at once (tile(j, js) takes n-blocks j, j + js, ...): returns where the rest (fewer than
// kRowStreams blocks, or all of them when the runs are off) starts. A tile's blocks must
// each get a one-block tile's sums and float work, so the output is the same bits either way.
template <typename Tile>
int64_t row_streams(int64_t j0, int64_t j1, Tile&& tile) {
  const int64_t per = (j1 - j0) / kRowStreams;
  if (per == 0 || !row_streams_on()) return j0;
  for (int64_t i = 0; i < per; ++i) tile(j0 + i, per);
  return j0 + per * kRowStreams;
}

#ifdef PDSERVE_AMX
// LDTILECFG's 64-byte operand, palette 1: tile t is rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

#if defined(__AVX2__)
// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of a vector's 8 lanes.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// fn(begin, end) over chunks of [0, n) of at least ``grain`` on torch's thread count, the
// caller included (pool.cpp). fn must not throw.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, const torch::Tensor& mins,
                        int64_t group_size, int64_t act_bits);
torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                        const torch::Tensor& scales, int64_t group_size, int64_t act_bits);
torch::Tensor q4_dequantize(const torch::Tensor& qweight, const torch::Tensor& scales,
                            const torch::Tensor& mins, int64_t group_size, int64_t row_start,
                            int64_t row_end);
bool has_avx2();
// act_bits 16: x in int16 codes, one step per row; 8: int8 codes per 32 (x8_quantize_rows).
torch::Tensor q4x16_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                           const torch::Tensor& scales, const torch::Tensor& mins,
                           int64_t group_size, int64_t n, int64_t act_bits);
torch::Tensor q8x16_matmul(const torch::Tensor& x, const torch::Tensor& qweight,
                           const torch::Tensor& scales, int64_t group_size, int64_t n,
                           int64_t act_bits);
bool has_x16();

// x [M, K] as int16 codes with one step per row, as the x16 kernels quantize it
// (quant_x16.cpp): codes [M, K], dx [M], and with ``with_sums`` the float32 sum of x over
// each group of ``group_size`` divided by dx, [M, K / group_size]. With ``int8_tokens``,
// int8 codes per row as compressed-tensors' dynamic per-token activations take them
// (dx = max|x| / 127.5; xsum: the codes' sums). AVX-512 builds only.
struct RowCodes16 {
  std::vector<int16_t> codes;
  std::vector<float> dx;
  std::vector<float> xsum;
};
RowCodes16 x16_quantize_rows(const float* x, int64_t m, int64_t k, int64_t group_size,
                             bool with_sums, bool int8_tokens);
// x as int8 codes for vpdpbusd (AVX-512 VNNI; quant_x16.cpp): per row and sub-block of 32
// one step dx (max |x| / 127, round to nearest even), or with int8_tokens the row's one step
// (compressed-tensors' per-token int8); each sub-block's 32 codes as 8 quads (int32) in the
// order a kernel pairs them (order 4 or 2: kquant_x16.cpp's planes of that width; 8: as they
// come), and the sum of the codes per group of G (16 or 32).
struct RowCodes8 {
  std::vector<int32_t> quads;  // [M, K / 4]
  std::vector<float> dx;       // [M, K / 32]
  std::vector<int32_t> csum;   // [M, K / G]
};
RowCodes8 x8_quantize_rows(const float* x, int64_t m, int64_t k, int64_t group_size, int order,
                           bool int8_tokens);
// Rows [m0, m0 + tiles R) of x8_quantize_rows' codes laid out for the 8-bit kernels' wide
// tiles (R rows against one n-block, quant_x16.cpp and kquant_x16.cpp): per tile of R rows,
// a sub-block's quads row after row, so a tile reads them at fixed offsets from one pointer.
// ``start`` is minus ``bias`` times each group's code sum (where a kernel's int32 sums begin),
// ``csum`` the same code sums as floats.
struct WideRows {
  int64_t m0 = 0, rows = 0;  // rows [m0, m0 + rows) of x, in tiles of R
  int R = 0;
  std::vector<int32_t> quads;  // per tile [K / 32][R][8]
  std::vector<int32_t> start;  // per tile [K / G][R]
  std::vector<float> csum;     // per tile [K / G][R]
  std::vector<float> dx;       // per tile [K / 32][R]
};
WideRows wide_rows(const RowCodes8& qx, int64_t m0, int64_t tiles, int R, int bias, int64_t k,
                   int64_t group_size);
// kquant_x16.cpp: x [M, K] float32 @ a KQx16 weight [N, K]^T (kernels/cpu/kquant.py).
// fp8_matmul.cpp: x [M, K] float32 @ E4M3 codes, 16 rows interleaved [ceil(N / 16), K, 16]
// uint8 (each times 2^-120), times scale [N] (which carries the 2^120).
torch::Tensor fp8_x16_matmul(const torch::Tensor& x, const torch::Tensor& packed,
                             const torch::Tensor& scale, int64_t n);

torch::Tensor kq_x16_matmul(const torch::Tensor& x, const torch::Tensor& lo_plane,
                            const std::optional<torch::Tensor>& hi_plane, int64_t lo_width,
                            int64_t hi_width, int64_t bias, int64_t group_size,
                            int64_t block_size, const torch::Tensor& d,
                            const std::optional<torch::Tensor>& sc,
                            const std::optional<torch::Tensor>& dmin,
                            const std::optional<torch::Tensor>& m, double sign, int64_t n,
                            bool int8_tokens, int64_t act_bits);

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm_(const torch::Tensor& x, torch::Tensor& residual,
                            const torch::Tensor& weight, double eps);
void rotary_(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos_sin);
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
              torch::Tensor& v_cache, const torch::Tensor& slots);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window);
// decode_attention_x16.cpp: paged_decode_attention's AVX-512 path on raw pointers to caches
// of float32, float16 or bfloat16 elements; false (nothing written) where it is not compiled
// in or D is not a multiple of 16 up to 128.
enum class KvElement { kFloat, kHalf, kBFloat16 };
bool decode_attention_x16(const float* q, int64_t q_row_stride, int64_t b, int64_t hq,
                          int64_t hkv, int64_t d, const void* k_cache, const void* v_cache,
                          KvElement element, int shift, const int32_t* tables, int64_t m,
                          const int32_t* lens, float scale, int64_t window, float* out);
// Whether decode_attention_x16 serves head dim d (it is compiled in and d fits it).
bool attention_x16_takes(int64_t d);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);

}  // namespace pdserve_cpu
