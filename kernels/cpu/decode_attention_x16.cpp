// Paged decode attention with AVX-512 (F): ops.cpp's paged_decode_attention takes this path
// where it is compiled in and the head dim is a multiple of 16.
//
// B = query rows, Hq / Hkv = query / kv heads, G = Hq / Hkv, D = head dim, S = block size,
// M = blocks per row's table.
//
// Rows that share a sequence come together: a speculative verify is one row per guess, each
// with the same block table and a length one longer than the row before (ops.cpp's
// contract: row j's K/V are written before any row reads them). Consecutive such rows form
// a group, and a task is (group, partition of the context, kv head, its query heads): its
// queries read each key and value once from memory, so a verify of k guesses costs about
// one row's memory traffic, where ops.cpp's AVX2 path reads the context once per row. A
// partition is kPartition positions (flash-decoding's split of the keys): a lone sequence
// with a long context is shared among the threads by partitions, all of a kv head's query
// heads reading its keys once (splitting by query head instead, as this file did before,
// read the keys once per query head: 3x the traffic on a GQA-3 model, 1.8x slower at 1000
// positions). The block table scatters the context, so each chunk of keys prefetches the
// next one's and its own values (about 1.6x on one sequence, 1.2x on 16, measured on the
// default model's heads), and the keys two chunks past the next into L2 (16 sequences of
// 170 positions 1.4x more, of 500 1.6x; loadtest/bench_attention.py).
//
// Each query's arithmetic depends on nothing but its own row: partitions lie at absolute
// positions, keys are taken in chunks of whole blocks (a key outside the query's [first,
// len) is skipped), its scores reduce key by key in a fixed order, its exponentials, their
// sum and its weighted values run over its own range in the partition, and a row spanning
// several partitions joins their partial results in partition order (join_partials). So a
// row gives the same bits alone, in a group or beside other sequences, on any thread
// count, which is what keeps speculative greedy output equal to plain decoding
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
#include <utility>
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

// Cache elements: float32, or float16 / bfloat16 converted exactly to float32 on the load
// (16 elements to a register), so the arithmetic after the load is the same for all three.
struct F32 {
  using type = float;
  static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
};
struct F16 {
  using type = uint16_t;
  static __m512 load16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
struct BF16 {
  using type = uint16_t;
  static __m512 load16(const uint16_t* p) {  // bfloat16 is float32's top half
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
};

// A row's context is taken in partitions of kPartition positions at absolute positions
// (k kPartition, (k + 1) kPartition): a task reads one partition of one kv head's keys and
// values for every query head of the group, and a row whose context spans several
// partitions gets each partition's partial result (its max score, its sum of exponentials,
// its unnormalized weighted values), joined afterwards in partition order. Where a row is
// split depends on its own positions only, so its bits stay its own.
constexpr int64_t kPartition = 256;
// How far past the next chunk the keys are fetched into L2 (positions): a chunk's scores
// take about as long as one DRAM access, so the next chunk's keys fetched into L1 alone
// arrive late; fetched into L2 two chunks earlier still, they are there when the L1 fetch
// asks (16 sequences x 170 positions, float16 keys: 4.3-5.0 -> 3.0-3.2 ms a step, in a test
// of the distance 16, 32 and 48 measured alike).
constexpr int64_t kKeysAhead = 32;

struct Query {
  const float* q;  // [D]
  float* out;      // [D]: the result, where the row lies in one partition
  float* partial;  // [2 + D]: this partition's (m, l, o), where it spans several; else null
  int64_t first, len;  // the positions it attends in this partition, [first, len)
  float* scores;   // scratch: indexed by position - the partition's start
  float inv;       // 1 / the partition's sum of exps
};

// Scores of up to 16 keys at consecutive slots (from ``keys``, ``row`` elements apart) for
// one query: scale * q . k in lanes [0, count).
template <int NV, typename E>
inline __m512 chunk_scores(const float* q, const typename E::type* keys, int64_t row, int count,
                           float scale) {
  __m512 qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    if (j < count) {
      const typename E::type* k = keys + j * row;
      __m512 a = _mm512_mul_ps(qv[0], E::load16(k));
      for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(qv[c], E::load16(k + 16 * c), a);
      acc[j] = a;
    } else {
      acc[j] = _mm512_setzero_ps();
    }
  }
  return _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
}

// scores[0 : n] -> exp(s - max) in place, in a fixed order; returns (max, sum of the exps).
inline std::pair<float, float> exp_scores(float* scores, int64_t n) {
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
  return {mx, _mm512_reduce_add_ps(total)};
}

// Prefetches the head rows (16 NV elements each) of positions [p0, p1) through the block
// table: T0 for keys wanted next, T1 for values wanted after the scores.
template <int NV, typename E, int Hint>
inline void prefetch_rows(const typename E::type* cache, int64_t row, const int32_t* table,
                          int shift, int64_t p0, int64_t p1) {
  constexpr int kLines = (NV * 16 * static_cast<int>(sizeof(typename E::type)) + 63) / 64;
  const int64_t block = int64_t{1} << shift;
  for (int64_t p = p0; p < p1; ++p) {
    const char* at = reinterpret_cast<const char*>(
        cache + ((static_cast<int64_t>(table[p >> shift]) << shift) + (p & (block - 1))) * row);
    for (int c = 0; c < kLines; ++c) _mm_prefetch(at + 64 * c, static_cast<_mm_hint>(Hint));
  }
}

// One task: queries [0, n) (non-empty ranges) over one partition of a shared block table
// (positions of one sequence) starting at position ``base``; NV = D / 16.
template <int NV, typename E>
void attend(Query* queries, int n, int64_t base, const typename E::type* keys,
            const typename E::type* values, int64_t row, const int32_t* table, int shift,
            float scale) {
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
      // The block table scatters the context: the next chunk's keys (into L1), the keys
      // kKeysAhead positions past those (into L2) and this chunk's values (into L2) are
      // fetched while this chunk's scores are computed.
      const int64_t next = p0 + count;
      prefetch_rows<NV, E, _MM_HINT_T0>(keys, row, table, shift, next, std::min(next + 16, hi));
      prefetch_rows<NV, E, _MM_HINT_T1>(keys, row, table, shift, next + kKeysAhead,
                                        std::min(next + kKeysAhead + 16, hi));
      prefetch_rows<NV, E, _MM_HINT_T1>(values, row, table, shift, p0, next);
      for (int i = 0; i < n; ++i) {
        Query& qr = queries[i];
        const int64_t from = std::max(p0, qr.first), to = std::min(p0 + count, qr.len);
        if (from >= to) continue;
        // Lanes [from - p0, to - p0) land at their positions (masked lanes write nothing).
        const __mmask16 lanes = static_cast<__mmask16>(((1u << (to - p0)) - 1) &
                                                       ~((1u << (from - p0)) - 1));
        _mm512_mask_storeu_ps(qr.scores + (p0 - base), lanes,
                              chunk_scores<NV, E>(qr.q, keys + (slot0 + c) * row, row, count,
                                                  scale));
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    Query& qr = queries[i];
    const auto [mx, total] = exp_scores(qr.scores + (qr.first - base), qr.len - qr.first);
    qr.inv = 1.0f / total;
    if (qr.partial != nullptr) {
      qr.partial[0] = mx;
      qr.partial[1] = total;
    }
  }
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
      const typename E::type* v =
          values + ((static_cast<int64_t>(table[p >> shift]) << shift) + (p & (block - 1))) * row;
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = E::load16(v + 16 * c);
      for (int i = 0; i < kPass; ++i) {
        if (p < first[i] || p >= len[i]) continue;
        const __m512 w = _mm512_set1_ps(weights[i][p]);
        for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(w, vv[c], acc[i][c]);
      }
    }
    // A row in one partition: its result (as join_partials would make it of one partial:
    // o * 1 / (l * 1)). Else the partial, unnormalized.
    for (int i = 0; i < kPass && i0 + i < n; ++i) {
      const Query& qr = queries[i0 + i];
      if (qr.partial != nullptr) {
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(qr.partial + 2 + 16 * c, acc[i][c]);
      } else {
        const __m512 s = _mm512_set1_ps(qr.inv);
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(qr.out + 16 * c, _mm512_mul_ps(acc[i][c], s));
      }
    }
  }
}

// A row's partials over its partitions, in order: with M the largest max score and
// w_k = exp(m_k - M), out = (sum_k w_k o_k) / (sum_k w_k l_k).
void join_partials(const float* partials, int64_t count, int64_t d, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t k = 0; k < count; ++k) top = std::max(top, partials[k * (d + 2)]);
  float total = 0.0f;
  for (int64_t c = 0; c < d; ++c) out[c] = 0.0f;
  for (int64_t k = 0; k < count; ++k) {
    const float* part = partials + k * (d + 2);
    const float w = std::exp(part[0] - top);
    total = std::fma(w, part[1], total);
    for (int64_t c = 0; c < d; ++c) out[c] = std::fma(w, part[2 + c], out[c]);
  }
  const float inv = 1.0f / total;
  for (int64_t c = 0; c < d; ++c) out[c] *= inv;
}

#endif  // PDSERVE_ATTN16

}  // namespace

namespace pdserve_cpu {

bool attention_x16_takes(int64_t d) {
#ifdef PDSERVE_ATTN16
  return d % 16 == 0 && d / 16 <= kMaxVectors;
#else
  (void)d;
  return false;
#endif
}

bool decode_attention_x16(const float* q, int64_t q_row_stride, int64_t b, int64_t hq,
                          int64_t hkv, int64_t d, const void* k_cache, const void* v_cache,
                          KvElement element, int shift, const int32_t* tables, int64_t m,
                          const int32_t* lens, float scale, int64_t window, float* out) {
#ifdef PDSERVE_ATTN16
  if (!attention_x16_takes(d)) return false;
  const int nv = static_cast<int>(d / 16);
  const int64_t group = hq / hkv, row = hkv * d;
  const int64_t part = std::max<int64_t>(kPartition, int64_t{1} << shift);
  const auto first_of = [&](int64_t r) {
    return window > 0 ? std::max<int64_t>(0, lens[r] - window) : int64_t{0};
  };
  // Each row's partitions [part_lo, part_hi) and, for rows spanning several, where its
  // partials go (per query head, one per partition).
  std::vector<int64_t> part_lo(b), part_at(b + 1, 0);
  for (int64_t r = 0; r < b; ++r) {
    part_lo[r] = first_of(r) / part;
    const int64_t count = (lens[r] + part - 1) / part - part_lo[r];
    part_at[r + 1] = part_at[r] + (count > 1 ? count : 0);
  }
  // Groups of consecutive rows of one sequence: the same table, lengths one apart.
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t i = 0; i < b;) {
    int64_t j = i + 1;
    while (j < b && j - i < kMaxGroupRows && lens[j] == lens[j - 1] + 1 &&
           std::memcmp(tables + j * m, tables + i * m, m * sizeof(int32_t)) == 0)
      ++j;
    groups.emplace_back(i, j);
    i = j;
  }
  const auto parts_of = [&](int64_t r0, int64_t r1) {
    return (lens[r1 - 1] + part - 1) / part - part_lo[r0];
  };
  // A task is (group, partitions [p0, p1), query heads [h0, h1)). Two ways to share the work,
  // the same arithmetic for every row: where (group, kv head) tasks are enough for the
  // threads (several sequences, prefill chunks), a task runs all its group's partitions and
  // joins its split rows itself, their partials in a buffer of its own (rows x heads x
  // partitions: a prefill chunk's partials never all exist at once); else (one sequence, a
  // long context to share) a task is one partition, and the split rows are joined after all
  // tasks from partials of the whole call (few rows). The heads of a task are a kv head's
  // query heads, which read its keys and values once, or one query head where fewer tasks
  // would leave a thread without work. (Tasks of every kv head, reading each slot's whole
  // row, were tried: slower on 1 and 16 sequences, the threads fewer tasks to share.)
  struct Task {
    int64_t r0, r1, p0, p1, h0, h1;
  };
  const int64_t threads = at::get_num_threads();
  const bool whole = static_cast<int64_t>(groups.size()) * hkv >= 2 * threads;
  int64_t units = 0;  // (group, partition) pairs
  for (const auto& [r0, r1] : groups) units += parts_of(r0, r1);
  const int64_t heads_per_task = whole || units * hkv >= threads ? group : 1;
  std::vector<Task> tasks;
  for (const auto& [r0, r1] : groups) {
    const int64_t first = part_lo[r0], last = first + parts_of(r0, r1);
    for (int64_t p = first; p < last; p += whole ? last - first : 1)
      for (int64_t h0 = 0; h0 < hq; h0 += heads_per_task)
        tasks.push_back({r0, r1, p, whole ? last : p + 1, h0, h0 + heads_per_task});
  }
  std::vector<float> partials(whole ? 0 : part_at[b] * hq * (d + 2));
  pdserve_cpu::parallel_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scratch, own;
    std::vector<Query> queries;
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      const int64_t heads = task.h1 - task.h0, span = task.p1 - task.p0;
      if (whole) {
        const int64_t size = (task.r1 - task.r0) * heads * span * (d + 2);
        if (static_cast<int64_t>(own.size()) < size) own.resize(size);
      }
      // Where (r, h)'s partial of partition p goes: its partials lie together, in order.
      const auto partial_of = [&](int64_t r, int64_t h, int64_t p) -> float* {
        const int64_t parts = part_at[r + 1] - part_at[r];
        if (parts == 0) return nullptr;
        if (whole)
          return own.data() + (((r - task.r0) * heads + h - task.h0) * span + p - part_lo[r]) *
                                  (d + 2);
        return partials.data() + (part_at[r] * hq + h * parts + p - part_lo[r]) * (d + 2);
      };
      // A task's query heads are one kv head's (all of them, or one).
      const int64_t kvh = task.h0 / group;
      const int64_t count = (task.r1 - task.r0) * heads;
      if (static_cast<int64_t>(scratch.size()) < count * part) scratch.resize(count * part);
      for (int64_t p = task.p0; p < task.p1; ++p) {
        const int64_t base = p * part;
        queries.clear();
        for (int64_t r = task.r0; r < task.r1; ++r) {
          const int64_t from = std::max(first_of(r), base);
          const int64_t to = std::min<int64_t>(lens[r], base + part);
          if (from >= to) continue;  // the row's context ends before this partition
          for (int64_t h = task.h0; h < task.h1; ++h) {
            const int64_t i = static_cast<int64_t>(queries.size());
            queries.push_back(Query{q + r * q_row_stride + h * d, out + (r * hq + h) * d,
                                    partial_of(r, h, p), from, to, scratch.data() + i * part,
                                    0.0f});
          }
        }
        if (queries.empty()) continue;
        const auto run = [&](auto nv) {
          const auto with = [&](auto element_type) {
            using E = decltype(element_type);
            using T = typename E::type;
            attend<decltype(nv)::value, E>(
                queries.data(), static_cast<int>(queries.size()), base,
                static_cast<const T*>(k_cache) + kvh * d, static_cast<const T*>(v_cache) + kvh * d,
                row, tables + task.r0 * m, shift, scale);
          };
          switch (element) {
            case KvElement::kHalf: with(F16{}); break;
            case KvElement::kBFloat16: with(BF16{}); break;
            default: with(F32{}); break;
          }
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
      if (!whole) continue;
      for (int64_t r = task.r0; r < task.r1; ++r) {
        const int64_t parts = part_at[r + 1] - part_at[r];
        if (parts == 0) continue;
        for (int64_t h = task.h0; h < task.h1; ++h)
          join_partials(partial_of(r, h, part_lo[r]), parts, d, out + (r * hq + h) * d);
      }
    }
  });
  if (!whole && part_at[b] > 0) {  // join the split rows' partials
    std::vector<int64_t> split_rows;
    for (int64_t r = 0; r < b; ++r)
      if (part_at[r + 1] > part_at[r]) split_rows.push_back(r);
    const int64_t jobs = static_cast<int64_t>(split_rows.size()) * hq;
    pdserve_cpu::parallel_for(jobs, 4, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t r = split_rows[j / hq], h = j % hq;
        const int64_t parts = part_at[r + 1] - part_at[r];
        join_partials(partials.data() + (part_at[r] * hq + h * parts) * (d + 2), parts, d,
                      out + (r * hq + h) * d);
      }
    });
  }
  return true;
#else
  (void)q, (void)q_row_stride, (void)b, (void)hq, (void)hkv, (void)d, (void)k_cache;
  (void)v_cache, (void)element, (void)shift, (void)tables, (void)m, (void)lens, (void)scale;
  (void)window, (void)out;
  return false;
#endif
}

}  // namespace pdserve_cpu
