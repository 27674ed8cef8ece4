/* Compute on GGML quantized blocks without expanding the tensor.
 *
 * Each block decoder reproduces gguf-py's reference dequantizer operation for operation (same
 * products, same order, compiled with -ffp-contract=off), so a decoded row is bit-identical to
 * gguf.quants.dequantize. The matmul decodes one block into an L1 buffer and multiplies it into
 * every activation row before moving on, so the weights are read once per call whatever the batch.
 * Portable C: the compiler vectorizes the loops for the machine it is built on (-march=native).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK_K 256
#define MAX_BLOCK 256
#define LANES 16

typedef void (*decode_fn)(const uint8_t *blk, float *y);

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__F16C__)
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float out;
    if (exp == 0) {
        out = (float)man * (1.0f / 16777216.0f); /* subnormal (or zero): man * 2^-24, exact */
        memcpy(&bits, &out, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&out, &bits, 4);
    return out;
}
#endif

static inline float rd_h(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f(h);
}

static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline void dec_f16(const uint8_t *b, float *y) {
    for (int i = 0; i < 32; i++) y[i] = rd_h(b + 2 * i);
}

static inline void dec_bf16(const uint8_t *b, float *y) {
    for (int i = 0; i < 32; i++) {
        uint16_t h;
        memcpy(&h, b + 2 * i, 2);
        uint32_t bits = (uint32_t)h << 16;
        memcpy(y + i, &bits, 4);
    }
}

static inline void dec_q4_0(const uint8_t *b, float *y) {
    const float d = rd_h(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)(qs[j] & 0xF) - 8);
        y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

static inline void dec_q4_1(const uint8_t *b, float *y) {
    const float d = rd_h(b), m = rd_h(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 0xF) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static inline void dec_q5_0(const uint8_t *b, float *y) {
    const float d = rd_h(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 0xF) | (((qh >> j) & 1u) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * (float)(lo - 16);
        y[j + 16] = d * (float)(hi - 16);
    }
}

static inline void dec_q5_1(const uint8_t *b, float *y) {
    const float d = rd_h(b), m = rd_h(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 0xF) | (((qh >> j) & 1u) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * (float)lo + m;
        y[j + 16] = d * (float)hi + m;
    }
}

static inline void dec_q8_0(const uint8_t *b, float *y) {
    const float d = rd_h(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

static inline void dec_iq4_nl(const uint8_t *b, float *y) {
    const float d = rd_h(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)kvalues_iq4nl[qs[j] & 0xF];
        y[j + 16] = d * (float)kvalues_iq4nl[qs[j] >> 4];
    }
}

/* Q2_K: scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin. */
static inline void dec_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = rd_h(b + 80), dmin = rd_h(b + 82);
#pragma GCC unroll 16
    for (int e = 0; e < QK_K; e += 16) {
        const int s = e / 16, half = e / 128, shift = 2 * ((e % 128) / 32), l0 = e % 32;
        const float dl = d * (float)(sc[s] & 0xF), ml = dmin * (float)(sc[s] >> 4);
        for (int l = 0; l < 16; l++) y[e + l] = dl * (float)((qs[half * 32 + l0 + l] >> shift) & 3) - ml;
    }
}

/* Q3_K: hmask[32], qs[64], 12 bytes of 6-bit signed scales, d. */
static inline void dec_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = rd_h(b + 108);
#pragma GCC unroll 16
    for (int e = 0; e < QK_K; e += 16) {
        const int s = e / 16, half = e / 128, shift = 2 * ((e % 128) / 32), hbit = e / 32, l0 = e % 32;
        const int low = (sc[s % 8] >> (4 * (s / 8))) & 0xF, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const float dl = d * (float)((low | (high << 4)) - 32);
        for (int l = 0; l < 16; l++) {
            const int q = ((qs[half * 32 + l0 + l] >> shift) & 3) - (((hm[l0 + l] >> hbit) & 1) ? 0 : 4);
            y[e + l] = dl * (float)q;
        }
    }
}

/* The 6-bit (scale, min) pairs of Q4_K / Q5_K. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit (scale, min); Q5_K adds a fifth bit from qh. */
static inline void dec_k45(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, float *y) {
    const float d = rd_h(b), dmin = rd_h(b + 2);
#pragma GCC unroll 16
    for (int s = 0; s < 8; s++) {
        int sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (s / 2);
        const int shift = 4 * (s % 2);
        for (int l = 0; l < 32; l++) {
            const int v = ((q[l] >> shift) & 0xF) | (qh ? ((qh[l] >> s) & 1) << 4 : 0);
            y[32 * s + l] = dl * (float)v - ml;
        }
    }
}

static inline void dec_q4_k(const uint8_t *b, float *y) { dec_k45(b, 0, b + 16, y); }

static inline void dec_q5_k(const uint8_t *b, float *y) { dec_k45(b, b + 16, b + 48, y); }

/* Q6_K: ql[128], qh[64], int8 scales[16], d; each 128-value half in four quadrants of 32. */
static inline void dec_q6_k(const uint8_t *b, float *y) {
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = rd_h(b + 208);
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        const int8_t *sc = scales + 8 * half;
        float *yh = y + 128 * half;
        for (int g = 0; g < 2; g++) {
            const float d0 = d * (float)sc[g], d1 = d * (float)sc[g + 2], d2 = d * (float)sc[g + 4], d3 = d * (float)sc[g + 6];
            for (int l = 16 * g; l < 16 * g + 16; l++) {
                yh[l] = d0 * (float)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                yh[l + 32] = d1 * (float)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                yh[l + 64] = d2 * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                yh[l + 96] = d3 * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

/* IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; non-linear 4-bit codebook. */
static inline void dec_iq4_xs(const uint8_t *b, float *y) {
    const float d = rd_h(b);
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
#pragma GCC unroll 16
    for (int ib = 0; ib < 8; ib++) {
        const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        for (int j = 0; j < 16; j++) {
            y[32 * ib + j] = dl * (float)kvalues_iq4nl[qs[16 * ib + j] & 0xF];
            y[32 * ib + j + 16] = dl * (float)kvalues_iq4nl[qs[16 * ib + j] >> 4];
        }
    }
}

/* Fused row . x for the common types, without a decode buffer: each block's integer values are
 * built in a vector register and converted 8 at a time (gcc scalarizes the int8 -> float conversion
 * of the plain loops), then scaled once per (sub-)block. Decode steps (one activation row) read the
 * whole model through these, so they get an AVX2 path; other CPUs and types use decode + dot. */
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_ROW_DOT 1

static inline __m256 cvt8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

/* sum_j q[j] * x[j] over 16 int8 values, as 8 float lanes. */
static inline __m256 dot16(__m128i q, const float *x) {
    return _mm256_fmadd_ps(cvt8(_mm_srli_si128(q, 8)), _mm256_loadu_ps(x + 8), _mm256_mul_ps(cvt8(q), _mm256_loadu_ps(x)));
}

static inline __m256 dot32(__m256i q, const float *x) {
    return _mm256_add_ps(dot16(_mm256_castsi256_si128(q), x), dot16(_mm256_extracti128_si256(q, 1), x + 16));
}

static inline __m256 sum32(const float *x) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                         _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
}

static inline float hsum(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* 16 packed bytes -> 32 values: low nibbles first, then high nibbles (the 32-block layout). */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
}

/* Byte j = 0x10 where bit j of `bits` is set: the fifth bit of Q5 values. */
static inline __m256i fifth_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* Signed values and (scale, offset) of one 32-value block: value = d * q + m. */
static inline __m256i block32(int type, const uint8_t *b, float *d, float *m) {
    uint32_t qh;
    *d = rd_h(b);
    *m = 0.0f;
    switch (type) {
    case 2: /* Q4_0 */
        return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    case 3: /* Q4_1 */
        *m = rd_h(b + 2);
        return nibbles32(b + 4);
    case 6: /* Q5_0 */
        memcpy(&qh, b + 2, 4);
        return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(qh)), _mm256_set1_epi8(16));
    case 7: /* Q5_1 */
        *m = rd_h(b + 2);
        memcpy(&qh, b + 4, 4);
        return _mm256_or_si256(nibbles32(b + 8), fifth_bits(qh));
    case 20: { /* IQ4_NL: nibbles index the non-linear codebook */
        const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl));
        return _mm256_shuffle_epi8(book, nibbles32(b + 2));
    }
    default: /* Q8_0 */
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
}

static inline float row_dot32(int type, int block_bytes, const uint8_t *row, const float *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps(), acc_m = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        float d, m;
        const __m256i q = block32(type, row + b * block_bytes, &d, &m);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), dot32(q, x + 32 * b), acc);
        if (type == 3 || type == 7) acc_m = _mm256_fmadd_ps(_mm256_set1_ps(m), sum32(x + 32 * b), acc_m);
    }
    return hsum(_mm256_add_ps(acc, acc_m));
}

/* Q4_K / Q5_K: 8 sub-blocks of 32, value = (d * sc) * q - dmin * m. */
static inline float row_dot_k45(int type, int block_bytes, const uint8_t *row, const float *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * block_bytes;
        const float d = rd_h(blk), dmin = rd_h(blk + 2);
        const uint8_t *qs = blk + (type == 12 ? 16 : 48);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const float *xb = x + QK_K * b;
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if (type == 13) {
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * j))), b1 = _mm256_set1_epi8((char)(1 << (2 * j + 1)));
                const __m256i sixteen = _mm256_set1_epi8(0x10);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
            }
            int sc, m;
            scale_min_k4(2 * j, blk + 4, &sc, &m);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc), dot32(lo, xb + 64 * j), acc);
            acc = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * (float)m), sum32(xb + 64 * j), acc);
            scale_min_k4(2 * j + 1, blk + 4, &sc, &m);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc), dot32(hi, xb + 64 * j + 32), acc);
            acc = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * (float)m), sum32(xb + 64 * j + 32), acc);
        }
    }
    return hsum(acc);
}

/* Q6_K: value = (d * sc[16-group]) * (q - 32), q six bits from ql nibbles and qh pairs. */
static inline float row_dot_q6_k(const uint8_t *row, const float *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 210 * b;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = rd_h(blk + 208);
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
            const __m256i quad[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4)),
                _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4)),
            };
            const float *xh = x + QK_K * b + 128 * half;
            const int8_t *sc = scales + 8 * half;
            for (int k = 0; k < 4; k++) {
                const __m256i q = _mm256_sub_epi8(quad[k], bias);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * k]), dot16(_mm256_castsi256_si128(q), xh + 32 * k), acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * k + 1]),
                                      dot16(_mm256_extracti128_si256(q, 1), xh + 32 * k + 16), acc);
            }
        }
    }
    return hsum(acc);
}

/* Whether `type` has a fused row dot here, and the dot itself. */
static inline int has_row_dot(int type) {
    return type == 2 || type == 3 || type == 6 || type == 7 || type == 8 || type == 20 || type == 12 || type == 13 ||
           type == 14;
}

static inline float row_dot(int type, int block_bytes, const uint8_t *row, const float *x, int64_t nb) {
    if (type == 12 || type == 13) return row_dot_k45(type, block_bytes, row, x, nb);
    if (type == 14) return row_dot_q6_k(row, x, nb);
    return row_dot32(type, block_bytes, row, x, nb);
}
#else
static inline int has_row_dot(int type) { (void)type; return 0; }
static inline float row_dot(int type, int block_bytes, const uint8_t *row, const float *x, int64_t nb) {
    (void)type; (void)block_bytes; (void)row; (void)x; (void)nb;
    return 0.0f;
}
#endif

/* One row range of y = x W^T for a block type: the decoder inlined, the block read once per call. */
#define DEFINE_MATMUL(NAME, DECODE, BE, TYPE)                                                                \
    static void mm_##NAME(const uint8_t *w, int64_t row_bytes, int block_bytes, int64_t n, int64_t k,    \
                          const float *x, int64_t m_rows, float *y, int64_t ldy, int threads) {          \
        const int64_t nb = k / (BE);                                                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                \
        for (int64_t r = 0; r < n; r++) {                                                                \
            float buf[BE];                                                                               \
            const uint8_t *row = w + r * row_bytes;                                                      \
            if (has_row_dot(TYPE)) { /* the row stays in L1 across the few activation rows */           \
                for (int64_t m = 0; m < m_rows; m++) y[m * ldy + r] = row_dot((TYPE), block_bytes, row, x + m * k, nb); \
                continue;                                                                                \
            }                                                                                            \
            if (m_rows == 1) { /* decode: keep the accumulator in registers */                           \
                enum { ACC = (BE) < 64 ? 16 : 64 };    /* independent FMA chains hide the latency */       \
                float a[ACC] = {0};                                                                      \
                for (int64_t b = 0; b < nb; b++) {                                                       \
                    DECODE(row + b * block_bytes, buf);                                                  \
                    const float *xb = x + b * (BE);                                                      \
                    for (int i = 0; i < (BE); i += ACC)                                                  \
                        for (int j = 0; j < ACC; j++) a[j] = fmaf(buf[i + j], xb[i + j], a[j]);         \
                }                                                                                        \
                float s = 0.0f;                                                                          \
                for (int j = 0; j < ACC; j++) s += a[j];                                                 \
                y[r] = s;                                                                                \
                continue;                                                                                \
            }                                                                                            \
            float acc[64][LANES];                                                                        \
            memset(acc, 0, sizeof(float) * LANES * (size_t)m_rows);                                     \
            for (int64_t b = 0; b < nb; b++) {                                                           \
                DECODE(row + b * block_bytes, buf);                                                      \
                for (int64_t m = 0; m < m_rows; m++) {                                                   \
                    const float *xm = x + m * k + b * (BE);                                              \
                    float *a = acc[m];                                                                   \
                    for (int i = 0; i < (BE); i += LANES)                                                \
                        for (int j = 0; j < LANES; j++) a[j] = fmaf(buf[i + j], xm[i + j], a[j]);       \
                }                                                                                        \
            }                                                                                            \
            for (int64_t m = 0; m < m_rows; m++) {                                                       \
                float s = 0.0f;                                                                          \
                for (int j = 0; j < LANES; j++) s += acc[m][j];                                          \
                y[m * ldy + r] = s;                                                                      \
            }                                                                                            \
        }                                                                                                \
    }

typedef void (*matmul_fn)(const uint8_t *, int64_t, int, int64_t, int64_t, const float *, int64_t, float *,
                          int64_t, int);

DEFINE_MATMUL(f16, dec_f16, 32, 1)
DEFINE_MATMUL(bf16, dec_bf16, 32, 30)
DEFINE_MATMUL(q4_0, dec_q4_0, 32, 2)
DEFINE_MATMUL(q4_1, dec_q4_1, 32, 3)
DEFINE_MATMUL(q5_0, dec_q5_0, 32, 6)
DEFINE_MATMUL(q5_1, dec_q5_1, 32, 7)
DEFINE_MATMUL(q8_0, dec_q8_0, 32, 8)
DEFINE_MATMUL(iq4_nl, dec_iq4_nl, 32, 20)
DEFINE_MATMUL(q2_k, dec_q2_k, QK_K, 10)
DEFINE_MATMUL(q3_k, dec_q3_k, QK_K, 11)
DEFINE_MATMUL(q4_k, dec_q4_k, QK_K, 12)
DEFINE_MATMUL(q5_k, dec_q5_k, QK_K, 13)
DEFINE_MATMUL(q6_k, dec_q6_k, QK_K, 14)
DEFINE_MATMUL(iq4_xs, dec_iq4_xs, QK_K, 23)

typedef struct {
    int type;        /* GGML type id */
    int block_elems; /* values per block (F16/BF16: a run of 32) */
    int block_bytes;
    decode_fn decode;
    matmul_fn matmul;
} Format;

static const Format FORMATS[] = {
    {1, 32, 64, dec_f16, mm_f16},          {2, 32, 18, dec_q4_0, mm_q4_0},      {3, 32, 20, dec_q4_1, mm_q4_1},
    {6, 32, 22, dec_q5_0, mm_q5_0},        {7, 32, 24, dec_q5_1, mm_q5_1},      {8, 32, 34, dec_q8_0, mm_q8_0},
    {10, 256, 84, dec_q2_k, mm_q2_k},      {11, 256, 110, dec_q3_k, mm_q3_k},   {12, 256, 144, dec_q4_k, mm_q4_k},
    {13, 256, 176, dec_q5_k, mm_q5_k},     {14, 256, 210, dec_q6_k, mm_q6_k},   {20, 32, 18, dec_iq4_nl, mm_iq4_nl},
    {23, 256, 136, dec_iq4_xs, mm_iq4_xs}, {30, 32, 64, dec_bf16, mm_bf16},
};

static const Format *find(int type) {
    for (size_t i = 0; i < sizeof(FORMATS) / sizeof(FORMATS[0]); i++)
        if (FORMATS[i].type == type) return &FORMATS[i];
    return 0;
}

/* (values, bytes) per block of `type`, or 0 when this library has no decoder for it. */
int vq_block_layout(int type, int *block_elems, int *block_bytes) {
    const Format *f = find(type);
    if (!f) return 0;
    *block_elems = f->block_elems;
    *block_bytes = f->block_bytes;
    return 1;
}

/* out[i, :] = row rows[i] of the packed [N, K] tensor, decoded. */
void vq_decode_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const int64_t *rows, int64_t n_rows,
                    float *out, int threads) {
    const Format *f = find(type);
    const int64_t nb = k / f->block_elems;
#pragma omp parallel for num_threads(threads) schedule(static) if (n_rows * k > 65536)
    for (int64_t i = 0; i < n_rows; i++) {
        const uint8_t *row = w + rows[i] * row_bytes;
        for (int64_t b = 0; b < nb; b++) f->decode(row + b * f->block_bytes, out + i * k + b * f->block_elems);
    }
}

/* out[i, :] = row (first + i) decoded, for i < n_rows: a slab for the dense-matmul path. */
void vq_decode_range(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t first, int64_t n_rows,
                     float *out, int threads) {
    const Format *f = find(type);
    const int64_t nb = k / f->block_elems;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_rows; i++) {
        const uint8_t *row = w + (first + i) * row_bytes;
        for (int64_t b = 0; b < nb; b++) f->decode(row + b * f->block_bytes, out + i * k + b * f->block_elems);
    }
}

/* Round-to-nearest-even float -> bfloat16 bits (NaN stays NaN). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* vq_decode_range, rounded to bfloat16: the slab for a bf16 matmul (native on AVX512-BF16 / AMX). */
void vq_decode_range_bf16(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t first, int64_t n_rows,
                          uint16_t *out, int threads) {
    const Format *f = find(type);
    const int64_t nb = k / f->block_elems;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_rows; i++) {
        float buf[MAX_BLOCK];
        const uint8_t *row = w + (first + i) * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            f->decode(row + b * f->block_bytes, buf);
            uint16_t *o = out + i * k + b * f->block_elems;
            for (int j = 0; j < f->block_elems; j++) o[j] = to_bf16(buf[j]);
        }
    }
}

/* y[m, n] = sum_k x[m, k] * W[n, k] for m < M (M <= 64), W packed [N, K]; y row stride ldy. */
void vq_matmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m_rows,
               float *y, int64_t ldy, int threads) {
    const Format *f = find(type);
    f->matmul(w, row_bytes, f->block_bytes, n, k, x, m_rows, y, ldy, threads);
}
