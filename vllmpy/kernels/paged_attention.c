/* Decode attention read in place from the paged KV cache.
 *
 * A decode row has one query token; its keys and values lie in the cache blocks its block table
 * lists. The torch path gathers those blocks into a contiguous copy per layer and step; this kernel
 * walks the block table instead and reads every K/V row where it lies. The query heads sharing a KV
 * head (GQA) are attended together, so each K/V row is loaded (and converted from bf16/f16, or
 * decoded from fp8 / int8, into one L1-resident row buffer) once; no widened copy of the cache exists.
 * A float cache of the model's dtype also takes the step's new K/V rows in the same call: no torch
 * index_copy_ per layer (dearer in dispatch than the copy at decode), so a decode layer is kernel calls alone
 * and can be replayed as them (vllmpy/layers/decode_replay.py).
 *
 * Quantized caches (vllmpy/attention/kv_storage.py): fp8 e4m3 / e5m2 values times a per-tensor scale
 * (one for K, one for V); int8 values times an fp16 scale per `group` values of a row, read from a
 * separate scale plane laid out as the values with head_dim / group entries per row. Both fp8 kinds
 * widen to fp16 bit patterns with integer shifts (e5m2 is fp16's top byte; e4m3 lands 8 binades low,
 * folded into the scale) and convert with F16C, so fp8 subnormals come out exact.
 *
 * Softmax is computed online over tiles of positions (running max and sum, as in flash attention)
 * in fp32, so no buffer grows with the context. When there are fewer (row, KV head) pairs than
 * threads, each pair's positions are split into ranges attended by different threads and merged
 * afterwards (flash decoding), so batch-1 decode uses every core.
 * Portable C that the compiler vectorizes for the machine it is built on (-march=native); only the
 * q . k reduction has AVX-512 / AVX2 intrinsics (under #if), since compilers keep a float sum in order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32           /* positions per online-softmax step: one accumulator rescale per TILE keys */
#define MIN_SPLIT 64      /* fewest positions worth handing to a thread of their own */
#define PARALLEL_WORK 32768 /* below this many query-key products a thread wake-up costs more than it saves */

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2, CACHE_FP8_E4M3 = 3, CACHE_FP8_E5M2 = 4, CACHE_INT8 = 5 };

/* fmaf is one instruction with FMA hardware but a slow libm call without (the no -march=native build). */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "half.h"

/* One decode call's geometry: shared read-only by every thread. */
typedef struct {
    const float *q;          /* query of decode row b: q + tokens[b] * q_stride, [heads, dim] */
    int64_t q_stride;
    const int64_t *tokens;   /* [rows] token index of each decode row in q and out */
    const char *k, *v;       /* [num_blocks, block_size, kv_heads, dim] each */
    int dtype;
    int64_t elem_bytes;
    const int64_t *tables;   /* row b's block ids: tables + b * bt_stride */
    int64_t bt_stride;
    const int64_t *seq_lens; /* [rows] context length including the new token */
    int64_t block_size, heads, kv_heads, dim, group;
    float scale, soft_cap;   /* soft_cap 0: none */
    int64_t window;          /* 0: full attention */
    const float *sinks;      /* [heads] logit in each query head's softmax denominator (gpt-oss); NULL: none */
    int64_t chunk;           /* > 0: keys of the token's own chunk of `chunk` positions only (Llama 4) */
    float *out;              /* output of decode row b: out + tokens[b] * out_stride, [heads, dim] */
    int64_t out_stride;
    /* The quantized caches' fields last: between elem_bytes and tables (2b2c642) they made the float32 decode
     * of Gemma 3 270M's shapes ~20% slower (same-process A/B of the two builds, 64 rows x 160 positions). */
    float k_mult, v_mult;    /* fp8: what a widened value is multiplied by (the per-tensor scale) */
    const uint16_t *k_scales, *v_scales; /* int8: fp16 [num_blocks, block_size, kv_heads, dim / q_group] */
    int64_t q_group;         /* int8: values per scale */
} Job;

/* First visible position of a row: keys p with p > seq_len - 1 - window (all when window is 0), and
 * from the start of the token's chunk when chunk > 0. */
static inline int64_t first_visible(const Job *j, int64_t n) {
    int64_t lo = j->window > 0 && n > j->window ? n - j->window : 0;
    if (j->chunk > 0 && (n - 1) / j->chunk * j->chunk > lo) lo = (n - 1) / j->chunk * j->chunk;
    return lo;
}

/* 1 / softmax denominator of query head hq, given the running max m and sum l of exp(score - m):
 * with sinks the head's sink logit joins the sum (and takes no value). */
static inline float inv_denominator(const Job *j, int64_t hq, float m, float l) {
    return 1.0f / (j->sinks ? l + expf(j->sinks[hq] - m) : l);
}

/* Element offsets of positions [t, t + n) of decode row b, KV head h, in the cache: one division per
 * tile, then the block table is walked (a row's blocks are anywhere in the cache). K and V share them. */
static inline void row_offsets(const Job *j, int64_t b, int64_t h, int64_t t, int64_t n, int64_t *at) {
    const int64_t *table = j->tables + b * j->bt_stride, bs = j->block_size;
    int64_t idx = t / bs, off = t % bs;
    for (int64_t i = 0; i < n; i++) {
        at[i] = ((table[idx] * bs + off) * j->kv_heads + h) * j->dim;
        if (++off == bs) off = 0, idx++;
    }
}

/* fp8 bytes -> the fp16 bit patterns of the same values (e4m3: 2^-8 times them). */
static inline uint16_t fp8_to_half_bits(uint8_t b, int e4m3) {
    return e4m3 ? (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)) : (uint16_t)(b << 8);
}

/* n fp8 values times mult into buf. */
static void fp8_row(const uint8_t *s, int64_t n, int e4m3, float mult, float *buf) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX2__)
    const __m512 m = _mm512_set1_ps(mult);
    for (; i + 16 <= n; i += 16) {
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(s + i)));
        w = e4m3 ? _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                   _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7))
                 : _mm256_slli_epi16(w, 8);
        _mm512_storeu_ps(buf + i, _mm512_mul_ps(_mm512_cvtph_ps(w), m));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256 m = _mm256_set1_ps(mult);
    for (; i + 8 <= n; i += 8) {
        __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(s + i)));
        w = e4m3 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7))
                 : _mm_slli_epi16(w, 8);
        _mm256_storeu_ps(buf + i, _mm256_mul_ps(_mm256_cvtph_ps(w), m));
    }
#endif
    for (; i < n; i++) buf[i] = h2f(fp8_to_half_bits(s[i], e4m3)) * mult;
}

/* n int8 values, each group of `group` times its fp16 scale, into buf. */
static void int8_row(const int8_t *s, const uint16_t *scales, int64_t n, int64_t group, float *buf) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (group % 16 == 0)
        for (; i + 16 <= n; i += 16) {
            const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + i))));
            _mm512_storeu_ps(buf + i, _mm512_mul_ps(x, _mm512_set1_ps(h2f(scales[i / group]))));
        }
#elif defined(__AVX2__)
    if (group % 8 == 0)
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + i))));
            _mm256_storeu_ps(buf + i, _mm256_mul_ps(x, _mm256_set1_ps(h2f(scales[i / group]))));
        }
#endif
    for (; i < n; i++) buf[i] = (float)s[i] * h2f(scales[i / group]);
}

/* The K (which 0) or V (1) cache row at element offset `at` as floats: in place for fp32, else
 * converted into buf. */
static inline const float *as_floats(const Job *j, int which, int64_t at, float *buf) {
    const int64_t d = j->dim;
    const char *cache = which ? j->v : j->k;
    if (j->dtype == CACHE_F32) return (const float *)(cache + at * j->elem_bytes);
    if (j->dtype == CACHE_FP8_E4M3 || j->dtype == CACHE_FP8_E5M2) {
        fp8_row((const uint8_t *)cache + at, d, j->dtype == CACHE_FP8_E4M3, which ? j->v_mult : j->k_mult, buf);
        return buf;
    }
    if (j->dtype == CACHE_INT8) {
        int8_row((const int8_t *)cache + at, (which ? j->v_scales : j->k_scales) + at / j->q_group, d, j->q_group, buf);
        return buf;
    }
    const uint16_t *s = (const uint16_t *)(cache + at * j->elem_bytes);
    if (j->dtype == CACHE_BF16) {
        for (int64_t i = 0; i < d; i++) { /* bf16 is the top half of an fp32 */
            uint32_t bits = (uint32_t)s[i] << 16;
            memcpy(buf + i, &bits, 4);
        }
        return buf;
    }
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < d; i++) buf[i] = h2f(s[i]);
    return buf;
}

/* Cache rows are dim * elem_bytes apart only within a block: the hardware prefetcher loses the stream at
 * every block boundary, so the rows a tile reads are requested ahead of use. */
#define PREFETCH_AHEAD 4
static inline void prefetch_row(const Job *j, const char *cache, int64_t at) {
    const char *row = cache + at * j->elem_bytes;
    for (int64_t off = 0; off < j->dim * j->elem_bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
}

/* q . k with four independent FMA chains (latency hidden); the tail in order. */
#if defined(__AVX512F__)
static inline float dot(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    for (; i < n; i++) s = MADD(a[i], b[i], s);
    return s;
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    const __m256 v = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    float s = _mm_cvtss_f32(x);
    for (; i < n; i++) s = MADD(a[i], b[i], s);
    return s;
}
#else
/* Portable: `omp simd reduction` lets the compiler reorder the sum, so it vectorizes (SSE, NEON). */
static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
#endif

/* y += w * x */
static inline void axpy(float *restrict y, float w, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = MADD(w, x[i], y[i]);
}

/* Query heads [h*group, (h+1)*group) of decode row b against positions [p0, p1): the unnormalized
 * output into acc [group, dim], the running max into m and the sum of exp(score - m) into l
 * (m = -inf, l = 0, acc = 0 for an empty range). */
static void attend_range(const Job *j, int64_t b, int64_t h, int64_t p0, int64_t p1, float *acc, float *m, float *l) {
    const int64_t g_n = j->group, d = j->dim;
    const float *q = j->q + j->tokens[b] * j->q_stride + h * g_n * d;
    float scores[g_n * TILE], buf[d]; /* C99 variable-length arrays: small, sized by the model */
    int64_t at[TILE];
    memset(acc, 0, sizeof(float) * (size_t)(g_n * d));
    for (int64_t g = 0; g < g_n; g++) m[g] = -INFINITY, l[g] = 0.0f;
    for (int64_t t = p0; t < p1; t += TILE) {
        const int64_t n = p1 - t < TILE ? p1 - t : TILE;
        row_offsets(j, b, h, t, n, at);
        for (int64_t i = 0; i < n; i++) {
            if (i + PREFETCH_AHEAD < n) prefetch_row(j, j->k, at[i + PREFETCH_AHEAD]);
            prefetch_row(j, j->v, at[i]); /* this tile's V rows arrive while K is being scored */
            const float *k = as_floats(j, 0, at[i], buf);
            for (int64_t g = 0; g < g_n; g++) {
                float s = dot(q + g * d, k, d) * j->scale; /* same operation order as the torch path */
                if (j->soft_cap != 0.0f) s = tanhf(s / j->soft_cap) * j->soft_cap;
                scores[g * TILE + i] = s;
            }
        }
        for (int64_t g = 0; g < g_n; g++) {
            float *s = scores + g * TILE, top = m[g];
            for (int64_t i = 0; i < n; i++) top = s[i] > top ? s[i] : top;
            if (top > m[g]) { /* a new maximum: bring what was summed so far to its scale */
                const float c = expf(m[g] - top);
                for (int64_t i = 0; i < d; i++) acc[g * d + i] *= c;
                l[g] *= c;
                m[g] = top;
            }
            for (int64_t i = 0; i < n; i++) {
                s[i] = expf(s[i] - top);
                l[g] += s[i];
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const float *v = as_floats(j, 1, at[i], buf);
            for (int64_t g = 0; g < g_n; g++) axpy(acc + g * d, scores[g * TILE + i], v, d);
        }
    }
}

/* Partial results of the split ranges of one (row, KV head) pair, combined into its output. */
static void merge(const Job *j, int64_t pair, int64_t splits, const float *acc, const float *m, const float *l) {
    const int64_t g_n = j->group, d = j->dim, b = pair / j->kv_heads, h = pair % j->kv_heads;
    float *out = j->out + j->tokens[b] * j->out_stride + h * g_n * d;
    for (int64_t g = 0; g < g_n; g++) {
        float top = -INFINITY, sum = 0.0f;
        for (int64_t s = 0; s < splits; s++) {
            const int64_t at = (pair * splits + s) * g_n + g;
            if (l[at] > 0.0f && m[at] > top) top = m[at];
        }
        memset(out + g * d, 0, sizeof(float) * (size_t)d);
        for (int64_t s = 0; s < splits; s++) {
            const int64_t at = (pair * splits + s) * g_n + g;
            if (l[at] == 0.0f) continue; /* an empty range */
            const float c = expf(m[at] - top);
            sum += c * l[at];
            axpy(out + g * d, c, acc + at * d, d);
        }
        const float inv = inv_denominator(j, h * g_n + g, top, sum);
        for (int64_t i = 0; i < d; i++) out[g * d + i] *= inv;
    }
}

/* How many ranges each pair's positions are split into: enough for every thread to have work when
 * pairs are fewer than threads, none shorter than MIN_SPLIT positions. */
static int64_t choose_splits(int64_t pairs, int64_t longest, int threads, int parallel) {
    if (!parallel || pairs >= threads) return 1;
    int64_t splits = (threads + pairs - 1) / pairs, most = (longest + MIN_SPLIT - 1) / MIN_SPLIT;
    return splits < most ? splits : (most > 1 ? most : 1);
}

/* This step's K/V rows new_k / new_v [new_tokens, kv_heads, dim] (token strides in elements, heads contiguous
 * within a token), already in the cache's element type, copied to their cache slots: the write that
 * precedes the attention of the same layer, in the same call. */
static void write_rows(char *k_cache, char *v_cache, const char *new_k, int64_t k_stride, const char *new_v,
                       int64_t v_stride, const int64_t *slots, int64_t new_tokens, int64_t row, int64_t elem_bytes,
                       int threads) {
    const size_t bytes = (size_t)(row * elem_bytes);
#pragma omp parallel for num_threads(threads) schedule(static) if (new_tokens * row > 262144)
    for (int64_t t = 0; t < new_tokens; t++) {
        memcpy(k_cache + slots[t] * (int64_t)bytes, new_k + t * k_stride * elem_bytes, bytes);
        memcpy(v_cache + slots[t] * (int64_t)bytes, new_v + t * v_stride * elem_bytes, bytes);
    }
}

/* out[tokens[b], h] = softmax(scale * q[tokens[b], h] . K_b^T [, sinks[h]]) V_b for each decode row b and query
 * head h, where K_b/V_b are KV head h / (heads / kv_heads) at the row's visible positions, read
 * through its block table. cache_dtype: 0 float32, 1 bfloat16, 2 float16, 3 fp8 e4m3, 4 fp8 e5m2 (times
 * k_scale / v_scale), 5 int8 (times k_scales / v_scales: fp16, one per group = gcd(dim, 32) values); q and
 * out are float32 with [heads, dim] contiguous per token. new_tokens > 0 (float caches only): first this step's
 * K/V rows are written to their slots (write_rows), so every row also sees its own new key. Returns 0, or -1
 * for an unknown cache dtype, an int8 cache without scales or new rows for a quantized cache. */
int vq_paged_decode(const float *q, int64_t q_stride, const int64_t *tokens, void *k_cache, void *v_cache,
                    int cache_dtype, float k_scale, float v_scale, const void *k_scales, const void *v_scales,
                    const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                    int64_t rows, int64_t block_size, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                    float soft_cap, int64_t window, const float *sinks, int64_t chunk, float *out,
                    int64_t out_stride, const void *new_k, int64_t new_k_stride, const void *new_v,
                    int64_t new_v_stride, const int64_t *slots, int64_t new_tokens, int threads) {
    static const int64_t elem_bytes[] = {4, 2, 2, 1, 1, 1};
    if (cache_dtype < CACHE_F32 || cache_dtype > CACHE_INT8) return -1;
    if (cache_dtype == CACHE_INT8 && (!k_scales || !v_scales)) return -1;
    if (new_tokens > 0 && cache_dtype > CACHE_F16) return -1;
    if (new_tokens > 0)
        write_rows(k_cache, v_cache, new_k, new_k_stride, new_v, new_v_stride, slots, new_tokens, kv_heads * dim,
                   elem_bytes[cache_dtype], threads);
    int64_t q_group = 32;
    while (dim % q_group) q_group /= 2; /* gcd(dim, 32), as the writer groups */
    const float widen = cache_dtype == CACHE_FP8_E4M3 ? 256.0f : 1.0f; /* e4m3 widens 2^-8 low */
    const Job j = {q, q_stride, tokens, (const char *)k_cache, (const char *)v_cache, cache_dtype,
                   elem_bytes[cache_dtype], block_tables, bt_stride, seq_lens, block_size, heads, kv_heads, dim,
                   heads / kv_heads, scale, soft_cap, window, sinks, chunk, out, out_stride, k_scale * widen,
                   v_scale * widen, (const uint16_t *)k_scales, (const uint16_t *)v_scales, q_group};
    int64_t longest = 0, keys = 0;
    for (int64_t b = 0; b < rows; b++) {
        const int64_t n = seq_lens[b] - first_visible(&j, seq_lens[b]);
        longest = n > longest ? n : longest;
        keys += n;
    }
    const int parallel = threads > 1 && keys * heads * dim >= PARALLEL_WORK;
    const int64_t pairs = rows * kv_heads, g_n = j.group;
    int64_t splits = choose_splits(pairs, longest, threads, parallel);
    float *part = splits > 1 ? malloc(sizeof(float) * (size_t)(pairs * splits * g_n * (dim + 2))) : 0;
    if (!part) splits = 1; /* no memory for the partials: one range per pair still gives the answer */
    float *part_m = part ? part + pairs * splits * g_n * dim : 0, *part_l = part ? part_m + pairs * splits * g_n : 0;

#pragma omp parallel num_threads(threads) if (parallel)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < pairs * splits; item++) {
            const int64_t pair = item / splits, s = item % splits, b = pair / kv_heads, h = pair % kv_heads;
            const int64_t n = seq_lens[b], lo = first_visible(&j, n), chunk = (n - lo + splits - 1) / splits;
            const int64_t p0 = lo + s * chunk < n ? lo + s * chunk : n, p1 = p0 + chunk < n ? p0 + chunk : n;
            if (splits > 1) {
                attend_range(&j, b, h, p0, p1, part + item * g_n * dim, part_m + item * g_n, part_l + item * g_n);
                continue;
            }
            float m[g_n], l[g_n], *o = out + tokens[b] * out_stride + h * g_n * dim; /* accumulate in place */
            attend_range(&j, b, h, p0, p1, o, m, l);
            for (int64_t g = 0; g < g_n; g++) {
                const float inv = inv_denominator(&j, h * g_n + g, m[g], l[g]);
                for (int64_t i = 0; i < dim; i++) o[g * dim + i] *= inv;
            }
        }
        if (splits > 1) {
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < pairs; pair++) merge(&j, pair, splits, part, part_m, part_l);
        }
    }
    free(part);
    return 0;
}
