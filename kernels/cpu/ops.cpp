// The elementwise ops and decode attention of a CPU step, fused (float32; the KV cache
// float32, float16 or bfloat16).
//
// T = tokens, H = hidden size, Hq / Hkv = query / kv heads, D = head dim, N = cache blocks,
// S = block size, B = decode sequences, M = max blocks per sequence, P = rotary positions,
// I = MLP intermediate size.
//
// Each op replaces a chain of several torch ops (and their allocations) by one pass over the
// data; the torch references are common/engine/attention/torch_backend.py's. Vectorized with
// AVX2/FMA where compiled in; the scalar loops below compute the same values otherwise.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor");
}

#ifdef PDSERVE_AVX2

using pdserve_cpu::hmax;
using pdserve_cpu::hsum;

// exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for exactness),
// exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7 on that range), 2^n
// built in the exponent bits. Inputs below -87.3 give 0, as softmax wants.
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), valid);
}

#endif  // PDSERVE_AVX2

float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef PDSERVE_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// -- RMS norm ---------------------------------------------------------------------------------

// out = x * rsqrt(mean(x^2) + eps) * weight, one row of H.
void rms_norm_row(const float* x, const float* w, float eps, int64_t h, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, h) / static_cast<float>(h) + eps);
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  const __m256 vi = _mm256_set1_ps(inv);
  for (; i + 8 <= h; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi),
                                            _mm256_loadu_ps(w + i)));
#endif
  for (; i < h; ++i) out[i] = x[i] * inv * w[i];
}

void check_norm_args(const torch::Tensor& x, const torch::Tensor& weight) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be contiguous [H] with H = ", x.size(1));
}

}  // namespace

namespace pdserve_cpu {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  const int64_t t = x.size(0), h = x.size(1);
  auto out = torch::empty({t, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = x.stride(0);
  pdserve_cpu::parallel_for(t, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      rms_norm_row(xp + r * ld, wp, static_cast<float>(eps), h, op + r * h);
  });
  return out;
}

// residual += x (in place), then returns rms_norm(residual).
torch::Tensor add_rms_norm_(const torch::Tensor& x, torch::Tensor& residual,
                            const torch::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  check_f32(residual, "residual");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(),
              "residual must be contiguous and shaped like x");
  const int64_t t = x.size(0), h = x.size(1);
  auto out = torch::empty({t, h}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = x.stride(0);
  pdserve_cpu::parallel_for(t, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = rp + r * h;
      const float* xr = xp + r * ld;
      int64_t i = 0;
#ifdef PDSERVE_AVX2
      for (; i + 8 <= h; i += 8)
        _mm256_storeu_ps(row + i, _mm256_add_ps(_mm256_loadu_ps(row + i),
                                                _mm256_loadu_ps(xr + i)));
#endif
      for (; i < h; ++i) row[i] += xr[i];
      rms_norm_row(row, wp, static_cast<float>(eps), h, op + r * h);
    }
  });
  return out;
}

// -- rotary embedding, in place ---------------------------------------------------------------

// x: [T, heads, D] with any row stride, D contiguous; cos_sin [P, D] (cos | sin halves).
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (the rotate_half convention).
void rotary_(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos_sin) {
  check_f32(x, "x");
  check_f32(cos_sin, "cos_sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with contiguous D");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == x.size(0), "positions must be contiguous int64 [T]");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.dim() == 2 && cos_sin.size(1) == x.size(2),
              "cos_sin must be contiguous [P, D]");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t num_positions = cos_sin.size(0);
  float* xp = x.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(0 <= pp[i] && pp[i] < num_positions, "position ", pp[i], " is outside the ",
                "rotary table (", num_positions, " positions)");
  pdserve_cpu::parallel_for(t, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* cos = table + pp[r] * d;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + r * x.stride(0) + h * x.stride(1);
        float* x2 = x1 + half;
        int64_t i = 0;
#ifdef PDSERVE_AVX2
        for (; i + 8 <= half; i += 8) {
          const __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
          const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
          _mm256_storeu_ps(x1 + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
          _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
        }
#endif
        for (; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * cos[i] - b * sin[i];
          x2[i] = b * cos[i] + a * sin[i];
        }
      }
    }
  });
}

// -- KV write ---------------------------------------------------------------------------------

// k, v: [T, Hkv, D] (rows may be strided); caches [N, S, Hkv, D] contiguous; slots [T] int64.
namespace {

// The caches' element type: float32, or float16 / bfloat16 (half the bytes; values are
// rounded to nearest even on the write, as torch's .to() rounds them, and read exactly).
pdserve_cpu::KvElement check_kv_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  (type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16),
              "k_cache must be a float32, float16 or bfloat16 CPU tensor");
  TORCH_CHECK(v_cache.scalar_type() == type, "k_cache and v_cache must have one dtype");
  return type == torch::kFloat16    ? pdserve_cpu::KvElement::kHalf
         : type == torch::kBFloat16 ? pdserve_cpu::KvElement::kBFloat16
                                    : pdserve_cpu::KvElement::kFloat;
}

// f(k, v) with the caches' data as pointers to their element type (float, at::Half or
// at::BFloat16).
template <typename F>
void with_cache_elements(pdserve_cpu::KvElement element, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, F&& f) {
  switch (element) {
    case pdserve_cpu::KvElement::kHalf:
      f(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
      break;
    case pdserve_cpu::KvElement::kBFloat16:
      f(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
      break;
    default:
      f(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
}

template <typename T>
void store_row(const float* from, int64_t n, T* to) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(from, n, to);
  } else {
    int64_t i = 0;
#if defined(PDSERVE_AVX2) && defined(__F16C__)
    if constexpr (std::is_same_v<T, at::Half>) {
      // vcvtps2ph rounds to nearest even, as c10::Half's conversion does, 8 at a time: a
      // 1024-token prefill wrote its float16 KV in 45 ms one value at a time.
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), h);
      }
    }
#endif
    for (; i < n; ++i) to[i] = static_cast<T>(from[i]);
  }
}

}  // namespace

void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
              torch::Tensor& v_cache, const torch::Tensor& slots) {
  check_f32(k, "k");
  check_f32(v, "v");
  const pdserve_cpu::KvElement element = check_kv_caches(k_cache, v_cache);
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && k.stride(1) == k.size(2) && v.dim() == 3 &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2) && k.sizes() == v.sizes(),
              "k and v must be [T, Hkv, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4,
              "caches must be contiguous [N, S, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == k.size(0),
              "slot_mapping must be int64 [T]");
  const int64_t t = k.size(0), row = k.size(1) * k.size(2);
  TORCH_CHECK(row == k_cache.size(2) * k_cache.size(3), "k's heads do not match the cache's");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const auto write = [&](auto* kc, auto* vc) {
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(0 <= sp[i] && sp[i] < num_slots, "slot ", sp[i], " is outside the cache");
      store_row(kp + i * k.stride(0), row, kc + sp[i] * row);
      store_row(vp + i * v.stride(0), row, vc + sp[i] * row);
    }
  };
  with_cache_elements(element, k_cache, v_cache, write);
}

}  // namespace pdserve_cpu

namespace {

// -- paged decode attention -------------------------------------------------------------------

#ifdef PDSERVE_AVX2
// The sums of 8 vectors, as one vector: [sum(v[0]), ..., sum(v[7])].
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  // u0 = [v0 v1 v2 v3 | v0' v1' v2' v3'] (partial sums of the low and high halves).
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// Calls f(index, slot, count) for each run of consecutive context positions in [first, len)
// that share a block: index = pos - first, slot = the cache slot of pos (the run's slots
// follow it). Blocks hold 2^shift slots. (Prefetching the next block's rows by hand was
// tried: no measurable gain.)
template <typename F>
inline void for_each_run(const int32_t* table, int shift, int64_t first, int64_t len, F&& f) {
  const int64_t block = int64_t{1} << shift;
  for (int64_t pos = first; pos < len;) {
    const int64_t offset = pos & (block - 1);
    const int64_t count = std::min(block - offset, len - pos);
    f(pos - first, (static_cast<int64_t>(table[pos >> shift]) << shift) + offset, count);
    pos += count;
  }
}

// A cache's elements (T: float, at::Half or at::BFloat16) as float32: float16 and bfloat16
// widen exactly, so a half cache attends as a float32 cache of the same values, bit for bit.
#ifdef PDSERVE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
inline __m256 load8(const at::BFloat16* p) {  // the 16 bits above 16 zero bits
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

// dot (above) and y += a * x with b / x a cache row of T, float32 included, in one body: the
// tails' multiply-adds are explicit fmas, so no instantiation rounds differently from
// another (a float16 cache then attends bit for bit as a float32 cache of its values).
template <typename T>
float dot_kv(const float* a, const T* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef PDSERVE_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s = std::fma(a[i], static_cast<float>(b[i]), s);
  return s;
}

template <typename T>
void axpy_kv(float a, const T* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] = std::fma(a, static_cast<float>(x[i]), y[i]);
}

// scores[i] = scale * q . keys[i * row] for i < count (consecutive slots).
template <typename T>
inline void scores_run(const float* q, const T* keys, int64_t row, int64_t count, int64_t d,
                       float scale, float* scores) {
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  if (d % 8 == 0) {
    // 8 keys at a time: 8 independent FMA chains hide the FMA latency.
    for (; i + 8 <= count; i += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qv, load8(keys + (i + j) * row + c), acc[j]);
      }
      _mm256_storeu_ps(scores + i, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    }
  }
#endif
  for (; i < count; ++i) scores[i] = dot_kv(q, keys + i * row, d) * scale;
}

// In place: scores -> exp(scores - max); returns their sum.
float softmax_numerators(float* scores, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, scores[i]);
  float total = 0.f;
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vt = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vmx));
    _mm256_storeu_ps(scores + i, e);
    vt = _mm256_add_ps(vt, e);
  }
  total = hsum(vt);
#endif
  for (; i < n; ++i) {
    scores[i] = std::exp(scores[i] - mx);
    total += scores[i];
  }
  return total;
}

#ifdef PDSERVE_AVX2
// out[offset : offset + 8L] = sum over the runs of weight * value row (8L dims in registers).
template <int L, typename T, typename Runs>
void weighted_values_lanes(const float* weights, const T* values, int64_t row,
                           int64_t offset, const Runs& runs, float* out) {
  __m256 acc[L];
  for (int i = 0; i < L; ++i) acc[i] = _mm256_setzero_ps();
  runs([&](int64_t index, int64_t slot, int64_t count) {
    for (int64_t j = 0; j < count; ++j) {
      const __m256 w = _mm256_broadcast_ss(weights + index + j);
      const T* v = values + (slot + j) * row + offset;
      for (int i = 0; i < L; ++i) acc[i] = _mm256_fmadd_ps(w, load8(v + 8 * i), acc[i]);
    }
  });
  for (int i = 0; i < L; ++i) _mm256_storeu_ps(out + offset + 8 * i, acc[i]);
}
#endif

// out[0:d] = sum over the context of weight * value. runs(f) calls f(index, slot, count) for
// each run of consecutive slots (see for_each_run); values + slot * row is a slot's row.
template <typename T, typename Runs>
void weighted_values(const float* weights, const T* values, int64_t row, int64_t d,
                     const Runs& runs, float* out) {
#ifdef PDSERVE_AVX2
  if (d % 8 == 0) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) weighted_values_lanes<8>(weights, values, row, c, runs, out);
    for (; c + 16 <= d; c += 16) weighted_values_lanes<2>(weights, values, row, c, runs, out);
    for (; c < d; c += 8) weighted_values_lanes<1>(weights, values, row, c, runs, out);
    return;
  }
#endif
  std::fill_n(out, d, 0.f);
  runs([&](int64_t index, int64_t slot, int64_t count) {
    for (int64_t j = 0; j < count; ++j) axpy_kv(weights[index + j], values + (slot + j) * row, out, d);
  });
}

// The G query heads of one kv head over one sequence's context: scores [G, ctx], softmax,
// and out[g] = sum weight * value. Chunks of 8 consecutive slots are read from L2 once and
// serve every head of the group from L1.
template <typename T>
void group_attention(const float* q, int64_t q_head_stride, int64_t group, const T* keys,
                     const T* values, int64_t row, int64_t d, const int32_t* table,
                     int shift, int64_t first, int64_t len, float scale, float* scores,
                     float* out, int64_t out_head_stride) {
  const int64_t ctx = len - first;
  for_each_run(table, shift, first, len, [&](int64_t index, int64_t slot, int64_t count) {
    for (int64_t c = 0; c < count; c += 8) {
      const int64_t n = std::min<int64_t>(8, count - c);
      for (int64_t g = 0; g < group; ++g)
        scores_run(q + g * q_head_stride, keys + (slot + c) * row, row, n, d, scale,
                   scores + g * ctx + index + c);
    }
  });
  // Values one head at a time, the output in registers (weighted_values): a head's values
  // are re-read from L2 by the next head, which costs less than keeping all heads' outputs
  // in memory across positions.
  const auto runs = [&](auto&& f) { for_each_run(table, shift, first, len, f); };
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * ctx;
    const float inv = 1.0f / softmax_numerators(sc, ctx);
    for (int64_t i = 0; i < ctx; ++i) sc[i] *= inv;
    weighted_values(sc, values, row, d, runs, out + g * out_head_stride);
  }
}

// paged_decode_attention's rows on this file's path, over a cache of T (float, at::Half or
// at::BFloat16; q and out float32).
template <typename T>
void attend_rows(const float* qp, int64_t q_stride, int64_t b, int64_t hq, int64_t hkv,
                 int64_t d, const T* kc, const T* vc, int shift, const int32_t* tables,
                 int64_t m, const int32_t* lens, int64_t longest, float fscale, int64_t window,
                 float* op) {
  const int64_t group = hq / hkv;
  const int64_t row = hkv * d;  // elements per cache slot
  int64_t threads = at::get_num_threads();
  if (b * hkv >= 2 * threads) {
    // Enough (sequence, kv head) tasks to share out: each serves its whole query group.
    pdserve_cpu::parallel_for(b * hkv, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores(group * longest);
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t seq = task / hkv, kvh = task % hkv, len = lens[seq];
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        group_attention(qp + seq * q_stride + kvh * group * d, d, group, kc + kvh * d,
                        vc + kvh * d, row, d, tables + seq * m, shift, first, len, fscale,
                        scores.data(), op + (seq * hq + kvh * group) * d, d);
      }
    });
    return;
  }
  // Few sequences: one task per (sequence, query head), so every thread has work.
  pdserve_cpu::parallel_for(b * hq, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(longest);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t seq = task / hq, head = task % hq, kvh = head / group;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int32_t* table = tables + seq * m;
      const T* kh = kc + kvh * d;
      const T* vh = vc + kvh * d;
      const auto runs = [&](auto&& f) { for_each_run(table, shift, first, len, f); };
      const float* qh = qp + seq * q_stride + head * d;
      float* sc = scores.data();
      for_each_run(table, shift, first, len, [&](int64_t index, int64_t slot, int64_t count) {
        scores_run(qh, kh + slot * row, row, count, d, fscale, sc + index);
      });
      const float inv = 1.0f / softmax_numerators(sc, len - first);
      for (int64_t i = 0; i < len - first; ++i) sc[i] *= inv;
      weighted_values(sc, vh, row, d, runs, op + (seq * hq + head) * d);
    }
  });
}

}  // namespace

namespace pdserve_cpu {

// One query token per sequence (at position seq_len - 1) over its paged context, every query
// head against its kv head's keys (GQA). q [B, Hq, D] (rows may be strided), caches
// [N, S, Hkv, D], block_tables [B, M] int32, seq_lens [B] int32 -> out [B, Hq, D]. Keys before
// a sliding window (window > 0) are skipped. Per (sequence, query head): scores, softmax,
// weighted sum of values, each one pass over the context read through the block table in
// runs of consecutive slots. Built with AVX-512 and D a multiple of 16 (up to 128), the
// work goes to decode_attention_x16.cpp instead, which serves a verify's rows of one
// sequence together and computes every row as it would alone. The caches may be float32,
// float16 or bfloat16 on either path (half elements widen exactly as they are loaded).
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     int64_t window) {
  check_f32(q, "q");
  const pdserve_cpu::KvElement element = check_kv_caches(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [B, Hq, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [N, S, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(), "block_tables must be contiguous int32 [B, M]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0), "seq_lens must be contiguous int32 [B]");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t n = k_cache.size(0), s = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0, "q's heads do not fit the cache's");
  TORCH_CHECK(block_tables.size(0) == b, "block_tables must have a row per sequence");
  // Block sizes are powers of two (EngineConfig checks them): table lookups are shifts.
  TORCH_CHECK(s > 0 && (s & (s - 1)) == 0, "block size must be a power of two, got ", s);
  const int shift = __builtin_ctzll(s);
  const int64_t group = hq / hkv, m = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(0 < lens[i] && lens[i] <= m * s, "seq_len ", lens[i], " of sequence ", i,
                " does not fit its block table (", m, " blocks of ", s, ")");
    for (int64_t j = 0; j < (lens[i] + s - 1) / s; ++j)
      TORCH_CHECK(0 <= tables[i * m + j] && tables[i * m + j] < n, "block id ",
                  tables[i * m + j], " is outside the cache");
    longest = std::max<int64_t>(longest, lens[i]);
  }
  auto out = torch::empty({b, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  if (pdserve_cpu::decode_attention_x16(qp, q.stride(0), b, hq, hkv, d, k_cache.data_ptr(),
                                        v_cache.data_ptr(), element, shift, tables, m, lens,
                                        fscale, window, op))
    return out;
  const auto attend = [&](const auto* kc, const auto* vc) {
    attend_rows(qp, q.stride(0), b, hq, hkv, d, kc, vc, shift, tables, m, lens, longest,
                fscale, window, op);
  };
  with_cache_elements(element, k_cache, v_cache, attend);
  return out;
}

// -- SwiGLU -----------------------------------------------------------------------------------

// gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [T, 2I]");
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({t, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pdserve_cpu::parallel_for(t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = gp + r * 2 * inter;
      const float* up = gate + inter;
      float* o = op + r * inter;
      int64_t i = 0;
#ifdef PDSERVE_AVX2
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; i + 8 <= inter; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < inter; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// Each row's argmax of x [n, V] (rows may be strided, each contiguous) -> int64 [n]: the first
// index of the row's largest value, or of its first NaN if it has one, as torch.argmax
// picks them. A pass for the maximum, then one for where it first is: a 49152-wide row in
// a few microseconds, where torch's argmax takes 70.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "x must be [n, V] with V > 0 and contiguous rows");
  const int64_t n = x.size(0), v = x.size(1), stride = x.stride(0);
  auto out = torch::empty({n}, torch::dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  pdserve_cpu::parallel_for(n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * stride;
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#ifdef PDSERVE_AVX2
      __m256 vmax = _mm256_set1_ps(best);
      __m256 unordered = _mm256_setzero_ps();
      for (; i + 8 <= v; i += 8) {
        const __m256 e = _mm256_loadu_ps(row + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, e);
      }
      nan = _mm256_movemask_ps(unordered) != 0;
      best = hmax(vmax);
#endif
      for (; i < v; ++i) {
        nan = nan || std::isnan(row[i]);
        best = std::max(best, row[i]);
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(row[at])) ++at;
      } else {
#ifdef PDSERVE_AVX2
        const __m256 target = _mm256_set1_ps(best);
        for (; at + 8 <= v; at += 8) {
          const int hit = _mm256_movemask_ps(
              _mm256_cmp_ps(_mm256_loadu_ps(row + at), target, _CMP_EQ_OQ));
          if (hit) {
            at += __builtin_ctz(hit);
            break;
          }
        }
#endif
        while (row[at] != best) ++at;  // best is one of the row's values
      }
      op[r] = at;
    }
  });
  return out;
}

// Rows ids [T] of a Q8x16 weight (kernels/cpu/quant.py: codes int8 [N/16, K/32, 16, 32],
// byte 2i + h of chunk c of n-block j, sub-block b is q[16j + i, 32b + 2c + h]; scales
// float16 [N/16, K/G, 16]) dequantized to float32 [T, K]: each value float(q) * float(scale),
// one rounding, as dequantize_q8_ref computes it. An embedding lookup: a few microseconds
// for a decode step's rows, where gathering them with torch's indexing took about 100.
torch::Tensor q8x16_rows(const torch::Tensor& packed, const torch::Tensor& scales,
                         int64_t group_size, const torch::Tensor& ids) {
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 32,
              "packed must be contiguous int8 [N/16, K/32, 16, 32]");
  const int64_t blocks = packed.size(0), num_sub = packed.size(1), k = num_sub * 32;
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0,
              "group_size must be a multiple of 32 dividing K = ", k);
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.numel() == blocks * (k / group_size) * 16,
              "scales must be contiguous float16 [N/16, K/G, 16]");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "ids must be int64 [T]");
  const torch::Tensor idc = ids.contiguous();
  const int64_t t = idc.size(0), groups = k / group_size;
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < blocks * 16, "row id ", ip[r], " out of range for ",
                blocks * 16, " rows");
  auto out = torch::empty({t, k}, torch::dtype(torch::kFloat32));
  const int8_t* codes = packed.data_ptr<int8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    const int64_t j = ip[r] / 16, i = ip[r] % 16;
    float* row = op + r * k;
    for (int64_t b = 0; b < num_sub; ++b) {
      const int8_t* chunks = codes + (j * num_sub + b) * 512 + 2 * i;
      const float scale = static_cast<float>(sp[(j * groups + b * 32 / group_size) * 16 + i]);
      for (int64_t c = 0; c < 16; ++c) {
        row[b * 32 + 2 * c] = static_cast<float>(chunks[c * 32]) * scale;
        row[b * 32 + 2 * c + 1] = static_cast<float>(chunks[c * 32 + 1]) * scale;
      }
    }
  }
  return out;
}

}  // namespace pdserve_cpu

// Attention lets go of the GIL while it runs (as the matmuls do); the small ops keep it,
// since releasing costs about what they take.
void register_ops(pybind11::module& m) {
  using namespace pdserve_cpu;
  m.def("rms_norm", &rms_norm, "x [T, H] -> rms_norm(x) * weight");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; returns rms_norm(residual) * weight");
  m.def("rotary_", &rotary_, "rotates x [T, heads, D] in place by its positions");
  m.def("write_kv", &write_kv, "stores k and v [T, Hkv, D] at their cache slots");
  m.def("attention_takes",
        [](const torch::Tensor& cache) {
          const auto type = cache.scalar_type();
          return type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kBFloat16;
        },
        "whether write_kv and paged_decode_attention take this KV cache [N, S, Hkv, D] "
        "(float32, float16 and bfloat16)");
  m.def("paged_decode_attention", &paged_decode_attention,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "one query per sequence over its paged context");
  m.def("silu_and_mul", &silu_and_mul, "gate_up [T, 2I] -> silu(gate) * up");
  m.def("q8x16_rows", &q8x16_rows,
        "rows ids [T] of a Q8x16 weight (codes, float16 scales) dequantized, float32 [T, K]");
  m.def("argmax_rows", &argmax_rows, "x [n, V] -> each row's first index of its maximum");
}
