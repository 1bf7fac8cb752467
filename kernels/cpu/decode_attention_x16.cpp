// Paged decode attention with AVX-512 (F): ops.cpp's paged_decode_attention takes this path
// where it is compiled in and the head dim is a multiple of 16.
//
// B = query rows, Hq / Hkv = query / kv heads, G = Hq / Hkv, D = head dim, S = block size,
// M = blocks per row's table.
//
// Rows that share a sequence come together: a speculative verify is one row per guess, each
// with the same block table and a length one longer than the row before (ops.cpp's
// contract: row j's K/V are written before any row reads them). Consecutive such rows form
// a group, and a task is (group, kv head, some of its query heads): its queries read each
// key and value once from memory, so a verify of k guesses costs about one row's memory
// traffic, where ops.cpp's AVX2 path reads the context once per row.
//
// Each query's arithmetic depends on nothing but its own row: keys are taken in chunks of
// whole blocks at absolute positions (a key outside the query's [first, len) is skipped), its
// scores reduce key by key in a fixed order, its softmax and weighted sum run over its own
// range. So a row gives the same bits alone, in a group or beside other sequences, which is
// what keeps speculative greedy output equal to plain decoding
// (tests/kernels/test_cpu_ops.py checks it).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_ATTN16 1
#endif

namespace {

#ifdef PDSERVE_ATTN16

constexpr int64_t kMaxGroupRows = 16;  // rows of one sequence served by one task at most
constexpr int kMaxVectors = 8;         // D / 16 at most: head dims up to 128
// Queries whose outputs stay in registers while the values stream past: 16 registers.
// Queries whose outputs stay in registers while the values stream past (with the value row:
// at most 24 of the 32 registers).
template <int NV>
constexpr int kQueriesPerPass = NV >= 6 ? 2 : (NV >= 4 ? 4 : (NV == 3 ? 6 : 8));

// exp(x) for 16 floats: ops.cpp's exp256 on 512-bit registers (x = n ln2 + r, a degree-6
// polynomial for exp(r), 2^n in the exponent bits); inputs below -87.3 give 0.
inline __m512 exp512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.0f), lo = _mm512_set1_ps(-87.3365478515625f);
  const __mmask16 valid = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(valid, p, _mm512_castsi512_ps(bits));
}

// 16 vectors -> one: lane j = the sum of v[j]'s lanes (a fixed tree of adds).
inline __m512 transpose_sum16(__m512 v[16]) {
  // Each level adds pairs of lanes of one key and packs two keys' results together.
  for (int j = 0; j < 8; ++j) {
    const __m512 a = v[2 * j], b = v[2 * j + 1];
    v[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 a = v[2 * j], b = v[2 * j + 1];
    v[j] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
  }
  for (int j = 0; j < 2; ++j) {
    const __m512 a = v[2 * j], b = v[2 * j + 1];
    v[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // v[0] holds keys 0-7, v[1] keys 8-15, as 4-key quarters of partial sums (the first and
  // second halves of the lanes); adding the halves leaves keys 0-15 in order.
  const __m512 a = v[0], b = v[1];
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

struct Query {
  const float* q;  // [D]
  float* out;      // [D]
  int64_t first, len;  // the context positions it attends, [first, len)
  float* scores;   // [len - base]: scratch, indexed by position - base
};

// Scores of up to 16 keys at consecutive slots (from ``keys``, ``row`` floats apart) for one
// query: scale * q . k in lanes [0, count).
template <int NV>
inline __m512 chunk_scores(const float* q, const float* keys, int64_t row, int count,
                           float scale) {
  __m512 qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    if (j < count) {
      const float* k = keys + j * row;
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
      acc[j] = a;
    } else {
      acc[j] = _mm512_setzero_ps();
    }
  }
  return _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
}

// Softmax over scores[0 : n] in place: exp(s - max) / sum, in a fixed order.
inline void softmax(float* scores, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(scores + i));
  float mx = _mm512_reduce_max_ps(vmax);
  for (; i < n; ++i) mx = std::max(mx, scores[i]);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 total = _mm512_setzero_ps();
  i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + i), m));
    _mm512_storeu_ps(scores + i, e);
    total = _mm512_add_ps(total, e);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + i), m));
    _mm512_mask_storeu_ps(scores + i, tail, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (i = 0; i + 16 <= n; i += 16)
    _mm512_storeu_ps(scores + i, _mm512_mul_ps(_mm512_loadu_ps(scores + i), inv));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(scores + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, scores + i), inv));
  }
}

// One task: queries [0, n) over a shared block table (positions of one sequence); NV = D / 16.
template <int NV>
void attend(Query* queries, int n, int64_t base, const float* keys, const float* values,
            int64_t row, const int32_t* table, int shift, float scale) {
  constexpr int kPass = kQueriesPerPass<NV>;
  const int64_t block = int64_t{1} << shift;
  int64_t lo = queries[0].first, hi = queries[0].len;
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, queries[i].first);
    hi = std::max(hi, queries[i].len);
  }
  // Scores: whole blocks (16 slots at a time), each key read once for all queries.
  for (int64_t start = lo & ~(block - 1); start < hi; start += block) {
    const int64_t slot0 = static_cast<int64_t>(table[start >> shift]) << shift;
    for (int64_t c = 0; c < block; c += 16) {
      const int64_t p0 = start + c;
      if (p0 >= hi) break;
      const int count = static_cast<int>(std::min<int64_t>({16, block - c, hi - p0}));
      for (int i = 0; i < n; ++i) {
        Query& qr = queries[i];
        const int64_t from = std::max(p0, qr.first), to = std::min(p0 + count, qr.len);
        if (from >= to) continue;
        // Lanes [from - p0, to - p0) land at their positions (masked lanes write nothing).
        const __mmask16 lanes = static_cast<__mmask16>(((1u << (to - p0)) - 1) &
                                                       ~((1u << (from - p0)) - 1));
        _mm512_mask_storeu_ps(qr.scores + (p0 - base), lanes,
                              chunk_scores<NV>(qr.q, keys + (slot0 + c) * row, row, count, scale));
      }
    }
  }
  for (int i = 0; i < n; ++i)
    softmax(queries[i].scores + (queries[i].first - base), queries[i].len - queries[i].first);
  // Weighted values, kPass queries at a time with their outputs in registers (a pass's
  // missing queries get an empty range; every loop over them has a fixed trip count).
  for (int i0 = 0; i0 < n; i0 += kPass) {
    int64_t first[kPass], len[kPass];
    const float* weights[kPass];
    __m512 acc[kPass][NV];
    int64_t from = queries[i0].first, to = queries[i0].len;
    for (int i = 0; i < kPass; ++i) {
      const bool real = i0 + i < n;
      first[i] = real ? queries[i0 + i].first : 0;
      len[i] = real ? queries[i0 + i].len : 0;
      weights[i] = real ? queries[i0 + i].scores - base : nullptr;
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
      if (real) {
        from = std::min(from, first[i]);
        to = std::max(to, len[i]);
      }
    }
    for (int64_t p = from; p < to; ++p) {
      const float* v = values + ((static_cast<int64_t>(table[p >> shift]) << shift) +
                                 (p & (block - 1))) * row;
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
      for (int i = 0; i < kPass; ++i) {
        if (p < first[i] || p >= len[i]) continue;
        const __m512 w = _mm512_set1_ps(weights[i][p]);
        for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(w, vv[c], acc[i][c]);
      }
    }
    for (int i = 0; i < kPass && i0 + i < n; ++i)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(queries[i0 + i].out + 16 * c, acc[i][c]);
  }
}

#endif  // PDSERVE_ATTN16

}  // namespace

namespace pdserve_cpu {

bool decode_attention_x16(const float* q, int64_t q_row_stride, int64_t b, int64_t hq,
                          int64_t hkv, int64_t d, const float* k_cache, const float* v_cache,
                          int shift, const int32_t* tables, int64_t m, const int32_t* lens,
                          float scale, int64_t window, float* out) {
#ifdef PDSERVE_ATTN16
  if (d % 16 != 0 || d / 16 > kMaxVectors) return false;
  const int nv = static_cast<int>(d / 16);
  const int64_t group = hq / hkv, row = hkv * d;
  // Groups of consecutive rows of one sequence: the same table, lengths one apart.
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < b;) {
    int64_t j = i + 1;
    while (j < b && j - i < kMaxGroupRows && lens[j] == lens[j - 1] + 1 &&
           std::memcmp(tables + j * m, tables + i * m, m * sizeof(int32_t)) == 0)
      ++j;
    starts.push_back(i);
    i = j;
  }
  starts.push_back(b);
  const int64_t num_groups = static_cast<int64_t>(starts.size()) - 1;
  // Query heads of a kv head per task: all of them, or one each when that leaves the
  // threads too few tasks.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_task = num_groups * hkv >= 2 * threads ? group : 1;
  const int64_t splits = group / heads_per_task;
  const int64_t num_tasks = num_groups * hkv * splits;
  pdserve_cpu::parallel_for(num_tasks, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scratch;
    std::vector<Query> queries;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / (hkv * splits), kvh = (task / splits) % hkv;
      const int64_t h0 = kvh * group + (task % splits) * heads_per_task;
      const int64_t r0 = starts[g], r1 = starts[g + 1];
      const int64_t len_max = lens[r1 - 1];
      const int64_t base = window > 0 ? std::max<int64_t>(0, lens[r0] - window) : 0;
      const int64_t span = len_max - base;
      const int64_t count = (r1 - r0) * heads_per_task;
      if (static_cast<int64_t>(scratch.size()) < count * span) scratch.resize(count * span);
      queries.clear();
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t first = window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0;
        for (int64_t h = h0; h < h0 + heads_per_task; ++h) {
          const int64_t i = static_cast<int64_t>(queries.size());
          queries.push_back(Query{q + r * q_row_stride + h * d, out + (r * hq + h) * d, first,
                                  lens[r], scratch.data() + i * span});
        }
      }
      const auto run = [&](auto nv) {
        attend<decltype(nv)::value>(queries.data(), static_cast<int>(count), base,
                                    k_cache + kvh * d, v_cache + kvh * d, row, tables + r0 * m,
                                    shift, scale);
      };
      switch (nv) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 7: run(std::integral_constant<int, 7>{}); break;
        default: run(std::integral_constant<int, 8>{}); break;
      }
    }
  });
  return true;
#else
  (void)q, (void)q_row_stride, (void)b, (void)hq, (void)hkv, (void)d, (void)k_cache;
  (void)v_cache, (void)shift, (void)tables, (void)m, (void)lens, (void)scale, (void)window;
  (void)out;
  return false;
#endif
}

}  // namespace pdserve_cpu
