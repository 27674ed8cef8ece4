/* Compute on GGML quantized blocks without expanding the tensor.
 *
 * Each block decoder reproduces gguf-py's reference dequantizer operation for operation (same
 * products, same order, compiled with -ffp-contract=off), so a decoded row is bit-identical to
 * gguf.quants.dequantize. The matmul decodes one block into an L1 buffer and multiplies it into
 * every activation row before moving on, so the weights are read once per call whatever the batch.
 * Portable C: the compiler vectorizes the loops for the machine it is built on (-march=native).
 * On AVX2 / AVX-512 machines the common types instead take integer row dots against a fixed-point
 * copy of x (see "Integer row dots" below), which keep float32 accuracy.
 */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK_K 256
#define MAX_BLOCK 256
#define LANES 16

typedef void (*decode_fn)(const uint8_t *blk, float *y);

#ifdef __AVX__ /* F16C and AVX2 imply it */
#include <immintrin.h>
#endif
#include "half.h"
#include "thread_pool.h"

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

/* Blocks repacked at load from safetensors quantization formats (GPTQ, AWQ, compressed-tensors, fp8;
 * vllmpy/loader/quantization/blocks.py writes them). Type ids 200+ are ours, never GGML's. Each decodes
 * with the one float32 product the format's reference dequantization takes, scale * (q - zero) or
 * e4m3(q) * scale, so the values are bit-identical to it. Q4_1's d * q + m cannot stand in for the integer
 * zero: m = -d * zero needs more bits than its fp16 has. The scale is fp16 where the checkpoint's scales
 * are fp16-exact (GPTQ / AWQ always), else float32 (the ...F types). */
static inline float rd_f(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* 32 values d * (q - z) from 4-bit codes laid out as Q4_0's (low nibbles values 0-15, high 16-31). */
static inline void dec_zero4(float d, int z, const uint8_t *qs, float *y) {
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)(qs[j] & 0xF) - z);
        y[j + 16] = d * (float)((int)(qs[j] >> 4) - z);
    }
}

/* 32 values d * (q - z) from int8 codes. */
static inline void dec_zero8(float d, int z, const int8_t *qs, float *y) {
    for (int j = 0; j < 32; j++) y[j] = d * (float)((int)qs[j] - z);
}

static inline int rd_i16(const uint8_t *p) {
    int16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Q4Z (200): d (f16), zero (u8: up to 16, GPTQ v1's stored 15 + 1), qs[16]. 19 bytes. */
static inline void dec_q4z(const uint8_t *b, float *y) { dec_zero4(rd_h(b), b[2], b + 3, y); }
/* Q8Z (201): d (f16), zero (i16: GPTQ v1's stored zero + 1 reaches 128 after the -128 shift), qs[32] (i8). */
static inline void dec_q8z(const uint8_t *b, float *y) { dec_zero8(rd_h(b), rd_i16(b + 2), (const int8_t *)(b + 4), y); }
/* Q4ZF (203): d (f32), zero (u8), 3 pad, qs[16]. */
static inline void dec_q4zf(const uint8_t *b, float *y) { dec_zero4(rd_f(b), b[4], b + 8, y); }
/* Q8ZF (204): d (f32), zero (i16), 2 pad, qs[32] (i8). */
static inline void dec_q8zf(const uint8_t *b, float *y) { dec_zero8(rd_f(b), rd_i16(b + 4), (const int8_t *)(b + 8), y); }
/* Q4Z128 (205): d (f16), zero (u8, as Q4Z), qs[64]: a whole group of 128 values, 67 bytes (0.523 bytes a weight
 * vs Q4Z's 0.594; a checkpoint's own int4 groups of 128 take 0.520). The codes are laid out as Q4_K's: byte
 * 32 h + l holds value 64 h + l (low nibble) and 64 h + 32 + l (high), so k45_pair builds two 32-value sub-blocks
 * from one 32-byte load (widen, mask, shift), where Q4_0's 16-byte runs take a broadcast, a widening, a shift
 * and a mask for each. */
static inline void dec_q4z128(const uint8_t *b, float *y) {
    const float d = rd_h(b);
    const int z = b[2];
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            y[64 * h + l] = d * (float)((int)(b[3 + 32 * h + l] & 0xF) - z);
            y[64 * h + 32 + l] = d * (float)((int)(b[3 + 32 * h + l] >> 4) - z);
        }
}

/* float8 e4m3fn (bias 7, no infinities, S.1111.111 NaN) as float: exact. */
static inline float e4m3_to_f(uint8_t v) {
    const int sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 7;
    float mag;
    if (exp == 0xF && man == 7)
        mag = NAN;
    else if (exp == 0)
        mag = (float)man * (1.0f / 512.0f); /* subnormal: man * 2^-9 */
    else
        mag = ldexpf(1.0f + (float)man * 0.125f, exp - 7);
    return sign ? -mag : mag;
}

static float e4m3_table[256];
__attribute__((constructor)) static void init_e4m3_table(void) {
    for (int i = 0; i < 256; i++) e4m3_table[i] = e4m3_to_f((uint8_t)i);
}

/* F8S (202): s (f32), qs[32] (e4m3fn): value = e4m3(q) * s. */
static inline void dec_f8s(const uint8_t *b, float *y) {
    const float s = rd_f(b);
    for (int j = 0; j < 32; j++) y[j] = e4m3_table[b[4 + j]] * s;
}

/* MXFP4 (39, OCP microscaling as GGML stores it): e (u8, an e8m0 exponent), qs[16] e2m1 codes laid out
 * as Q4_0's. value = k[code] * 2^(e - 128), k the e2m1 values doubled: gguf-py's kvalues and its
 * ggml_e8m0_to_fp32_half bit pattern (e < 2: the subnormals 2^-128, 2^-127), one exact float product. */
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void dec_mxfp4(const uint8_t *b, float *y) {
    const float d = e8m0_half(b[0]);
    const uint8_t *qs = b + 1;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)kvalues_mxfp4[qs[j] & 0xF];
        y[j + 16] = d * (float)kvalues_mxfp4[qs[j] >> 4];
    }
}

/* Integer row dots for the common types: decode steps read the whole model through these.
 *
 * Per call, each activation row is converted once to block fixed point (FixedRow): each 32-value
 * block b becomes integers X_i = round(x_i * 2^(30 - e_b)), where 2^e_b is the smallest power of two
 * above the block's largest |x_i|. The scaling is exact (a power of two), so the only rounding is
 * X_i's own: at most 2^(e_b - 31) <= 2^-30 of the block's largest |x|, and |X_i| < 2^30. Each X_i is
 * stored as two int16 halves, X = hi * 2^15 + lo with hi in [-2^15, 2^15) and lo in [0, 2^15), so a
 * weight block's quant integers q meet x in integer multiply-adds (vpdpwssd, pmaddwd without VNNI):
 *     sum_i q_i X_i = 2^15 * sum_i q_i hi_i + sum_i q_i lo_i,
 * both sums exact in int32 (bounds at group_dot). Unlike llama.cpp's 8-bit x this keeps float32
 * accuracy: the error vs exact arithmetic is at most 2^-30 * sum_b max|x_b| * sum_{i in b} |w_i| from
 * x's rounding, plus the float rounding of the sums (as in a float32 dot product).
 *
 * Block scales are relative to the row's largest block (2^(e_b - e_max) <= 1); the row's unit
 * 2^(e_max - 30) multiplies the final sum in double, so any finite x (1e-30 next to 1e30,
 * subnormals) keeps that precision. Only a block more than ~2^100 below the row's largest one
 * underflows to zero. Non-finite x gives NaN results for its activation row.
 *
 * The sums run over groups of 4 blocks: x is stored (x_piece) so that one 512-bit register of int16 (two
 * with AVX2) holds 8 values of each of 4 blocks, a slot of 4 int32 lanes per block, and each type's weight
 * integers are built in that order, so a group's 4 registers sum into one int32 vector of hi and one of lo
 * products, and one conversion pair and two multiply-adds (by the lanes' scales, d_b times x's block scale)
 * serve 4 blocks where each block paid them. The sums stay exact and a lane rounds as a float32 sum's term
 * does, so the bounds above hold unchanged. Q4_K / Q5_K's groups are a super-block's even and odd sub-blocks
 * (the low and high nibbles of the same bytes); Q6_K's pairs of 32-value chunks in 2 registers, a slot half a
 * chunk, so each 16-value scale has its own lanes and moves from the integers to the float scale (exactly);
 * Q4Z128's its own 4 sub-blocks. Figures: FEATURES.md, load.gguf-packed.
 * Other CPUs and types use decode + float dot. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_ROW_DOT 1
#define FORCE_INLINE static inline __attribute__((always_inline)) /* so constant arguments specialize the body */

typedef struct {
    const int16_t *q;   /* per group of blocks (x_piece): per register hi[32], then lo[32] */
    const float *scale; /* per block: 2^(e_b - e_max); 0 for an all-zero block, NaN for a non-finite one */
    const float *sum;   /* per block: scale * sum_i X_i, for the weights' min terms */
    double unit;        /* 2^(e_max - 30): x_i = unit * scale_b * X_i up to X_i's rounding */
} FixedRow;

static inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static inline float hmax(__m256 v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    return fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

/* 2^p for p in [-126, 127]. */
static inline float pow2f(int p) {
    const uint32_t bits = (uint32_t)(p + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 16 int32 (two registers, each < 2^15 in magnitude) -> 16 int16 in order. */
static inline __m256i pack16(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); /* packs interleaves 128-bit lanes */
}

/* x's layouts, each the order its row dots build the weights' integers in (see x_piece). */
enum { X32, XK45, XQ6K };

static inline int x_layout(int type) { return type == 12 || type == 13 ? XK45 : type == 14 ? XQ6K : X32; }

/* Where values 8o .. 8o + 7 (o < 4) of x's block b go: their hi halves at this int16 offset, lo 32 later.
 * X32: blocks 4g .. 4g + 3 are slots 0-3 of group g, register o holding their values 8o ..
 * XK45: super-block j's sub-blocks 0, 2, 4, 6 are group 2j's slots, 1, 3, 5, 7 group 2j + 1's, as in X32.
 * XQ6K: 32-value chunks 2G, 2G + 1 are group G, 2 registers: register o % 2 holds their values 8o ..
 * in slots o / 2 * 2 (chunk 2G) and o / 2 * 2 + 1, so slots 0-1 and 2-3 are the two 16-value scales. */
static inline int64_t x_piece(int layout, int64_t b, int o) {
    if (layout == XK45) return 256 * (2 * (b / 8) + b % 2) + 64 * o + 8 * (b % 8 / 2);
    if (layout == XQ6K) return 128 * (b / 2) + 64 * (o % 2) + 8 * (b % 2 + 2 * (o / 2));
    return 256 * (b / 4) + 64 * o + 8 * (b % 4);
}

/* x's k values (k a multiple of 32) in block fixed point, laid out for `layout`. q: 64 int16 per block,
 * blocks zero-padded to a multiple of 4 (64-byte aligned); scale and sum: one float per block, zero-padded
 * to a multiple of 4 blocks; expo: one int per block. */
static void fixed_row(const float *x, int64_t k, int layout, int16_t *q, float *scale, float *sum, int *expo,
                      FixedRow *out) {
    const int64_t nb = k / 32;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i low15 = _mm256_set1_epi32(0x7fff);
    int e_max = INT_MIN;
    if (nb % 4) memset(q + 64 * (nb - nb % 4), 0, 256 * sizeof(int16_t)); /* the last group's missing blocks */
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q)); /* max_ps may drop a NaN */
        }
        const float m = hmax(amax);
        expo[b] = INT_MIN;
        if (!_mm256_testz_ps(nan, nan) || m > FLT_MAX || m == 0.0f) { /* non-finite or all zero */
            for (int o = 0; o < 4; o++) {
                _mm_store_si128((__m128i *)(q + x_piece(layout, b, o)), _mm_setzero_si128());
                _mm_store_si128((__m128i *)(q + x_piece(layout, b, o) + 32), _mm_setzero_si128());
            }
            scale[b] = sum[b] = m == 0.0f && _mm256_testz_ps(nan, nan) ? 0.0f : NAN;
            continue;
        }
        uint32_t bits;
        memcpy(&bits, &m, 4);
        int e = (int)(bits >> 23) - 126; /* m < 2^e <= 2m */
        if (bits < 0x00800000u) frexpf(m, &e); /* subnormal */
        /* x * 2^(30 - e), exact: the power of two (up to 2^178 for subnormal x) in two float factors */
        const int shift = 30 - e;
        const __m256 f1 = _mm256_set1_ps(pow2f(shift / 2)), f2 = _mm256_set1_ps(pow2f(shift - shift / 2));
        __m256i hi[4], lo[4], sum_hi = _mm256_setzero_si256(), sum_lo = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i big = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[j], f1), f2)); /* |X| < 2^30 */
            hi[j] = _mm256_srai_epi32(big, 15);
            lo[j] = _mm256_and_si256(big, low15);
            sum_hi = _mm256_add_epi32(sum_hi, hi[j]);
            sum_lo = _mm256_add_epi32(sum_lo, lo[j]);
        }
        const __m256i halves[2][2] = {{pack16(hi[0], hi[1]), pack16(hi[2], hi[3])},
                                      {pack16(lo[0], lo[1]), pack16(lo[2], lo[3])}};
        for (int part = 0; part < 2; part++)
            for (int o = 0; o < 4; o++) {
                const __m256i h = halves[part][o / 2];
                _mm_store_si128((__m128i *)(q + x_piece(layout, b, o) + 32 * part),
                                o % 2 ? _mm256_extracti128_si256(h, 1) : _mm256_castsi256_si128(h));
            }
        sum[b] = (float)((int64_t)hsum_i32(sum_hi) * 32768 + hsum_i32(sum_lo));
        expo[b] = e;
        if (e > e_max) e_max = e;
    }
    if (e_max == INT_MIN) e_max = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (expo[b] == INT_MIN) continue;
        const int p = expo[b] - e_max;
        const float s = p >= -126 ? pow2f(p) : ldexpf(1.0f, p); /* exact down to 2^-149, then 0 */
        scale[b] = s;
        sum[b] *= s;
    }
    for (int64_t b = nb; b % 4; b++) scale[b] = sum[b] = 0.0f;
    out->q = q;
    out->scale = scale;
    out->sum = sum;
    out->unit = ldexp(1.0, e_max - 30);
}

/* SHARE: activation rows that share one build of each weight block's integers, their accumulators
 * in registers (4 with AVX-512's 32 vector registers, 2 with AVX2's 16); PAIRS: weight rows that share
 * each load of x for one activation row (2 with AVX-512; AVX2 has the registers for one). qv: a block's
 * 32 int16 weight integers in order (decoders); wv: one register of a group's weight integers for the
 * row dots (AVX2: kept as int8 and widened where used, half a group's register at a time, so that the
 * sums fit its 16 registers); gv: a group's 16 float lanes, 4 per slot.
 *
 * group_dot: acc[w] + s[w] * (q[w] . x) for W <= PAIRS weight rows' groups, each R <= 4 registers
 * q[w][0..R), against one group of x's integers: the hi and lo products summed exactly in int32
 * lanes, then converted and scaled once. A lane sums 2R <= 8 products, each a quant integer
 * (|q| <= 2^7: int8 values, the largest) times |hi| <= 2^15 or lo < 2^15, so |lane| < 2^25: no
 * overflow, and pmaddwd's one wrapping case (-2^15 * -2^15 twice) cannot occur. Converting a lane
 * rounds it (relative 2^-24) only past 2^24, like a float32 sum. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FX_512 1
#define SHARE 4
#define PAIRS 2
typedef __m512i qv;
typedef __m512i wv;
typedef __m512 fv; /* float values of the decoders */
typedef __m512 gv;

static inline qv qv_from_i8(__m256i q) { return _mm512_cvtepi8_epi16(q); }
static inline wv wv_from_i8(__m256i q) { return _mm512_cvtepi8_epi16(q); }

/* acc + the pairwise products of q and x: one instruction with AVX512-VNNI */
static inline __m512i dp16(__m512i acc, __m512i q, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, q, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(q, x));
#endif
}

FORCE_INLINE void group_dot(const wv q[][4], int W, int R, const int16_t *x, const gv *s, gv *acc) {
    __m512i hi[PAIRS], lo[PAIRS];
    for (int r = 0; r < R; r++) {
        __m512i xh = _mm512_load_si512(x + 64 * r), xl = _mm512_load_si512(x + 64 * r + 32);
        if (W > 1) __asm__("" : "+v"(xh), "+v"(xl)); /* one load for both rows, not one folded into each */
        for (int w = 0; w < W; w++) {
            hi[w] = r ? dp16(hi[w], q[w][r], xh) : _mm512_madd_epi16(q[w][r], xh);
            lo[w] = r ? dp16(lo[w], q[w][r], xl) : _mm512_madd_epi16(q[w][r], xl);
        }
    }
    for (int w = 0; w < W; w++) {
        const __m512 h = _mm512_cvtepi32_ps(hi[w]), l = _mm512_cvtepi32_ps(lo[w]);
        acc[w] = _mm512_fmadd_ps(_mm512_fmadd_ps(h, _mm512_set1_ps(32768.0f), l), s[w], acc[w]);
    }
}

/* The 4 slots' lanes set to s[a], s[b], s[c], s[d]. */
FORCE_INLINE gv gv_pick(__m256 s, int a, int b, int c, int d) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d),
                                 _mm512_castps256_ps512(s));
}

static inline gv gv_zero(void) { return _mm512_setzero_ps(); }
static inline float gv_sum(gv v) {
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), upper));
}
static inline fv fv_add(fv a, fv b) { return _mm512_add_ps(a, b); }
#else
#define SHARE 2
#define PAIRS 1
typedef struct { __m256i a, b; } qv; /* values 0-15 and 16-31 as int16 */
typedef __m256i wv;                  /* slots 0-1 in the low 128 bits, 2-3 in the high */
typedef __m256 fv;
typedef struct { __m256 a, b; } gv;  /* slots 0-1, 2-3 */

static inline qv qv_from_i8(__m256i q) {
    const qv r = {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
                  _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1))};
    return r;
}
static inline wv wv_from_i8(__m256i q) { return q; }

static inline __m256i dp16(__m256i acc, __m256i q, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, q, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(q, x));
#endif
}

/* Slots 0-1, then 2-3: each half's sums and conversion done before the other's. */
FORCE_INLINE void group_dot(const wv q[][4], int W, int R, const int16_t *x, const gv *s, gv *acc) {
    (void)W; /* PAIRS: 1 */
    __m256 *half_acc[2] = {&acc->a, &acc->b};
    const __m256 half_s[2] = {s->a, s->b};
    for (int h = 0; h < 2; h++) {
        __m256i hi = _mm256_setzero_si256(), lo = _mm256_setzero_si256();
        for (int r = 0; r < R; r++) {
            const __m128i q8 = h ? _mm256_extracti128_si256(q[0][r], 1) : _mm256_castsi256_si128(q[0][r]);
            const __m256i w = _mm256_cvtepi8_epi16(q8);
            const __m256i xh = _mm256_load_si256((const __m256i *)(x + 64 * r + 16 * h));
            const __m256i xl = _mm256_load_si256((const __m256i *)(x + 64 * r + 32 + 16 * h));
            hi = r ? dp16(hi, w, xh) : _mm256_madd_epi16(w, xh);
            lo = r ? dp16(lo, w, xl) : _mm256_madd_epi16(w, xl);
        }
        const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(32768.0f), _mm256_cvtepi32_ps(lo));
        *half_acc[h] = _mm256_fmadd_ps(t, half_s[h], *half_acc[h]);
    }
}

FORCE_INLINE gv gv_pick(__m256 s, int a, int b, int c, int d) {
    const gv r = {_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(a, a, a, a, b, b, b, b)),
                  _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(c, c, c, c, d, d, d, d))};
    return r;
}

static inline gv gv_zero(void) {
    const gv r = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return r;
}
static inline float gv_sum(gv v) { return hsum(_mm256_add_ps(v.a, v.b)); }
static inline fv fv_add(fv a, fv b) { return _mm256_add_ps(a, b); }
#endif

#ifdef FX_512
/* 16 packed bytes -> the 32 nibbles as int16, low nibbles first (the 32-block layout): one
 * zero-extension of the bytes twice over, a shift by 4 in the upper half, one mask. */
static inline __m512i nibbles32_i16(const uint8_t *qs) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(bytes, shift), _mm512_set1_epi16(0x0F));
}

/* One 32-value block's quant integers (the value is d * q, or d * q + m with a min), built
 * directly as int16: the fifth bits of Q5 as a mask register (bit j is value j's), the IQ4_NL
 * codebook as a word permutation. */
static inline qv block32_q(int type, const uint8_t *b) {
    uint32_t qh;
    switch (type) {
    case 2: return _mm512_sub_epi16(nibbles32_i16(b + 2), _mm512_set1_epi16(8));
    case 3: return nibbles32_i16(b + 4);
    case 6: /* (n | 16 * bit) - 16: subtract 16 where the bit is clear */
        memcpy(&qh, b + 2, 4);
        return _mm512_mask_sub_epi16(nibbles32_i16(b + 6), (__mmask32)~qh, nibbles32_i16(b + 6), _mm512_set1_epi16(16));
    case 7:
        memcpy(&qh, b + 4, 4);
        return _mm512_mask_add_epi16(nibbles32_i16(b + 8), (__mmask32)qh, nibbles32_i16(b + 8), _mm512_set1_epi16(16));
    case 20: {
        const __m128i book8 = _mm_loadu_si128((const __m128i *)kvalues_iq4nl);
        const __m512i book = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(book8));
        return _mm512_permutexvar_epi16(nibbles32_i16(b + 2), book);
    }
    default: return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2)));
    }
}
#else
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

/* The same as int8 (AVX2 has no word masks), then sign-extended. */
static inline __m256i block32_i8(int type, const uint8_t *b) {
    uint32_t qh;
    switch (type) {
    case 2: /* Q4_0 */
        return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    case 3: /* Q4_1 */
        return nibbles32(b + 4);
    case 6: /* Q5_0 */
        memcpy(&qh, b + 2, 4);
        return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(qh)), _mm256_set1_epi8(16));
    case 7: /* Q5_1 */
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

static inline qv block32_q(int type, const uint8_t *b) { return qv_from_i8(block32_i8(type, b)); }
#endif

static inline uint64_t rd_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The fp16 at p, p + stride, ... for n <= 4 blocks (zeros past n), read in general registers and
 * packed into one 64-bit word: a vector insert per block would cost as much as its dot. */
static inline __m128i halves4(const uint8_t *p, int stride, int n) {
    uint64_t w = 0;
    for (int i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + i * stride, 2);
        w |= (uint64_t)h << (16 * i);
    }
    __asm__("" : "+r"(w)); /* keep gcc from redoing this in vector shuffles */
    return _mm_cvtsi64_si128((int64_t)w);
}

/* The first 8 bytes of n <= 4 Q5_0 / Q5_1 blocks, a qword each (zeros past n): their fifth bits with the
 * scale (and min) beside them, so one vector holds all three. */
FORCE_INLINE __m256i heads4(const uint8_t *const blk[4], int n) {
    return _mm256_setr_epi64x((int64_t)rd_u64(blk[0]), n > 1 ? (int64_t)rd_u64(blk[1]) : 0,
                              n > 2 ? (int64_t)rd_u64(blk[2]) : 0, n > 3 ? (int64_t)rd_u64(blk[3]) : 0);
}

/* Word w (< 4) of each of heads4's qwords, as 4 int16. */
FORCE_INLINE __m128i head_words(__m256i head, int w) {
#ifdef FX_512
    return _mm256_castsi256_si128(_mm256_permutexvar_epi16(
        _mm256_setr_epi16(w, 4 + w, 8 + w, 12 + w, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), head));
#else /* each 128-bit lane's two words to its dword 0, then the lanes' dwords together */
    const int64_t pick = (int64_t)(0xFFFFFFFF00000000u | (0x09080100u + 0x02020202u * (unsigned)w)); /* bytes 0-3 */
    const __m256i words = _mm256_shuffle_epi8(head, _mm256_setr_epi64x(pick, -1, pick, -1));
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0)));
#endif
}

/* Q4Z / Q8Z: the min -d * zero of n <= 4 blocks (zeros past n), exact in float32 (an fp16 d times a zero
 * of at most 9 bits), so d * (q - zero) is computed as Q4_1's d * q + m. */
static inline __m128 zero_mins4(int type, const uint8_t *group, int block_bytes, int n, __m128 d) {
    float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < n; i++)
        z[i] = (float)(type == 200 ? group[i * block_bytes + 2] : rd_i16(group + i * block_bytes + 2));
    return _mm_mul_ps(d, _mm_sub_ps(_mm_setzero_ps(), _mm_loadu_ps(z)));
}

/* The n <= 4 blocks' scales d (zeros past n): fp16 at each block's start (Q5: from heads4); MXFP4's e8m0
 * byte, a power of two, so d times x's block scale is exact down to 2^-149 and the sums stay finite up to
 * scale byte 216 (|w| < 2^91), far past trained weights. */
FORCE_INLINE __m128 group_d(int type, const uint8_t *group, int block_bytes, int n, __m256i head) {
    if (type == 39) { /* in registers: four stores read back as one vector miss store forwarding */
        const float d0 = e8m0_half(group[0]), d1 = n > 1 ? e8m0_half(group[block_bytes]) : 0.0f;
        const float d2 = n > 2 ? e8m0_half(group[2 * block_bytes]) : 0.0f;
        const float d3 = n > 3 ? e8m0_half(group[3 * block_bytes]) : 0.0f;
        return _mm_setr_ps(d0, d1, d2, d3);
    }
    return _mm_cvtph_ps(type == 6 || type == 7 ? head_words(head, 0) : halves4(group, block_bytes, n));
}

/* 16 bytes at lo and 16 at hi in one register's two 128-bit lanes. */
static inline __m256i pair128(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

/* Bytes off .. off + 15 of 4 blocks in slot order (8 bytes a slot): *first their bytes off .. off + 7,
 * *second off + 8 .. off + 15. */
static inline void octets4(const uint8_t *const blk[4], int off, __m256i *first, __m256i *second) {
    const __m256i b02 = pair128(blk[0] + off, blk[2] + off), b13 = pair128(blk[1] + off, blk[3] + off);
    *first = _mm256_unpacklo_epi64(b02, b13);
    *second = _mm256_unpackhi_epi64(b02, b13);
}

/* t[k] = qword k of c[0], c[1], c[2], c[3] (a 4 x 4 transpose of qwords). */
static inline void transpose_qwords4(const __m256i c[4], __m256i t[4]) {
    const __m256i u0 = _mm256_unpacklo_epi64(c[0], c[1]), u1 = _mm256_unpackhi_epi64(c[0], c[1]);
    const __m256i u2 = _mm256_unpacklo_epi64(c[2], c[3]), u3 = _mm256_unpackhi_epi64(c[2], c[3]);
    t[0] = _mm256_permute2x128_si256(u0, u2, 0x20);
    t[1] = _mm256_permute2x128_si256(u1, u3, 0x20);
    t[2] = _mm256_permute2x128_si256(u0, u2, 0x31);
    t[3] = _mm256_permute2x128_si256(u1, u3, 0x31);
}

/* o's bytes plus 16 where v's byte has `bit` (one bit set per byte). */
static inline __m256i add16_where(__m256i o, __m256i v, __m256i bit) {
#ifdef FX_512
    return _mm256_mask_add_epi8(o, _mm256_test_epi8_mask(v, bit), o, _mm256_set1_epi8(16));
#else
    return _mm256_add_epi8(o, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(16)));
#endif
}

/* Q5_0 / Q5_1's fifth bits from heads4 (qh: 32 bits at byte qh_off of each qword): o[k]'s value i of slot s
 * (value 8k + i of block s) gets 16 more where bit 8k + i of block s's qh is set, or with `offset` (Q5_0's
 * (n | 16 * bit) - 16) 16 less where it is clear. */
FORCE_INLINE void fifth_bits4(__m256i head, int qh_off, int offset, __m256i o[4]) {
#ifdef __AVX512BITALG__ /* vpshufbitqmb: mask bit 8s + i = bit c[8s + i] of qword s */
    const __m256i v = offset ? _mm256_xor_si256(head, _mm256_set1_epi32(-1)) : head;
    for (int k = 0; k < 4; k++) {
        const __m256i c = _mm256_set1_epi64x(0x0706050403020100 + 0x0808080808080808 * (qh_off + k));
        const __mmask32 bits = _mm256_bitshuffle_epi64_mask(v, c);
        o[k] = offset ? _mm256_mask_sub_epi8(o[k], bits, o[k], _mm256_set1_epi8(16))
                      : _mm256_mask_add_epi8(o[k], bits, o[k], _mm256_set1_epi8(16));
    }
#else /* byte k of each block's qh spread over its slot, then tested bit by bit */
    const int64_t pick = 0x0B0A090803020100 + 0x0101010101010101 * qh_off; /* a lane's 2 qh to its bytes 0-7 */
    const __m256i qh = _mm256_shuffle_epi8(head, _mm256_setr_epi64x(pick, -1, pick, -1));
    const __m256i v = _mm256_permute4x64_epi64(qh, 0x88); /* qh of blocks 0-3 as dwords, in both lanes */
    const __m256i spread = _mm256_setr_epi64x(0, 0x0404040404040404, 0x0808080808080808, 0x0C0C0C0C0C0C0C0C);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    for (int k = 0; k < 4; k++) {
        o[k] = add16_where(o[k], _mm256_shuffle_epi8(v, _mm256_add_epi8(spread, _mm256_set1_epi8((char)k))), bit);
        if (offset) o[k] = _mm256_sub_epi8(o[k], _mm256_set1_epi8(16));
    }
#endif
}

/* A group of 32-value blocks' quant integers as int8: o[k] = values 8k .. 8k + 7 of blk[0..3] in slot order. */
FORCE_INLINE void group32_i8(int type, const uint8_t *const blk[4], __m256i head, __m256i o[4]) {
    if (type == 8 || type == 201) { /* Q8_0, Q8Z: the values themselves */
        const int off = type == 8 ? 2 : 4;
        octets4(blk, off, &o[0], &o[1]);
        octets4(blk, off + 16, &o[2], &o[3]);
        return;
    }
    /* 16 bytes of nibbles, value j and j + 16 in byte j: Q4_0, IQ4_NL, Q4_1, Q4Z, Q5_0, Q5_1, MXFP4 */
    const int off = type == 3 ? 4 : type == 200 ? 3 : type == 6 ? 6 : type == 7 ? 8 : type == 39 ? 1 : 2;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i first, second;
    octets4(blk, off, &first, &second);
    o[0] = _mm256_and_si256(first, low4);
    o[1] = _mm256_and_si256(second, low4);
    o[2] = _mm256_and_si256(_mm256_srli_epi16(first, 4), low4);
    o[3] = _mm256_and_si256(_mm256_srli_epi16(second, 4), low4);
    if (type == 6 || type == 7) fifth_bits4(head, type == 6 ? 2 : 4, type == 6, o);
    const __m256i book = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(type == 39 ? kvalues_mxfp4 : kvalues_iq4nl)));
    for (int k = 0; k < 4; k++) {
        if (type == 2) o[k] = _mm256_sub_epi8(o[k], _mm256_set1_epi8(8));
        if (type == 20 || type == 39) o[k] = _mm256_shuffle_epi8(book, o[k]);
    }
}

/* Blocks b0 .. b0 + n - 1 (n <= 4; a constant 4 but for a row's last group) of W weight rows (W > 1
 * only for one activation row) into acc[r * W + w] and mins[r * W + w]: sum_b d_b * scale_b * (q_b . X_b),
 * and for the types with a min m_b * (scale_b * sum X_b). */
FORCE_INLINE void group32(int type, int block_bytes, const uint8_t *group, int64_t row_bytes, int W, int n,
                          const FixedRow *x, int rows, int64_t b0, gv *acc, __m128 *mins) {
    const int has_min = type == 3 || type == 7 || type == 200 || type == 201;
    wv q[PAIRS][4];
    __m128 d[PAIRS];
    for (int w = 0; w < W; w++) {
        const uint8_t *g = group + w * row_bytes, *blk[4];
        for (int i = 0; i < 4; i++) blk[i] = g + (i < n ? i : 0) * block_bytes; /* past n x's integers are 0 */
        const __m256i head = type == 6 || type == 7 ? heads4(blk, n) : _mm256_setzero_si256();
        d[w] = group_d(type, g, block_bytes, n, head); /* x's scales and sums are zero-padded past nb */
        if (has_min) {
            const __m128 m = type == 200 || type == 201 ? zero_mins4(type, g, block_bytes, n, d[w])
                             : type == 7 ? _mm_cvtph_ps(head_words(head, 1))
                                         : _mm_cvtph_ps(halves4(g + 2, block_bytes, n));
            for (int r = 0; r < rows; r++)
                mins[r * W + w] = _mm_fmadd_ps(m, _mm_loadu_ps(x[r].sum + b0), mins[r * W + w]);
        }
        __m256i o[4];
        group32_i8(type, blk, head, o);
        for (int k = 0; k < 4; k++) q[w][k] = wv_from_i8(o[k]);
    }
    for (int r = 0; r < rows; r++) {
        const __m128 xs = _mm_loadu_ps(x[r].scale + b0);
        gv s[PAIRS];
        for (int w = 0; w < W; w++) s[w] = gv_pick(_mm256_castps128_ps256(_mm_mul_ps(d[w], xs)), 0, 1, 2, 3);
        group_dot(q, W, 4, x[r].q + 64 * b0, s, acc + r * W);
    }
}

/* Row . x over 32-value blocks for W weight rows (row_bytes apart) and `rows` activation rows x[0..rows)
 * sharing each group's integers: out[r * W + w]. */
FORCE_INLINE void rows_dot32(int type, int block_bytes, const uint8_t *row, int64_t row_bytes, int W,
                             const FixedRow *x, int rows, int64_t nb, float *out) {
    gv acc[SHARE];
    __m128 mins[SHARE];
    for (int i = 0; i < rows * W; i++) acc[i] = gv_zero(), mins[i] = _mm_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 4 <= nb; b0 += 4)
        group32(type, block_bytes, row + b0 * block_bytes, row_bytes, W, 4, x, rows, b0, acc, mins);
    if (b0 < nb)
        group32(type, block_bytes, row + b0 * block_bytes, row_bytes, W, (int)(nb - b0), x, rows, b0, acc, mins);
    for (int i = 0; i < rows * W; i++) {
        const __m128 m = _mm_add_ps(mins[i], _mm_movehl_ps(mins[i], mins[i]));
        out[i] = gv_sum(acc[i]) + (type == 3 || type == 7 || type == 200 || type == 201 ? m[0] + m[1] : 0.0f);
    }
}

/* One weight row's: out[r] = row . x[r]. */
FORCE_INLINE void row_dot32(int type, int block_bytes, const uint8_t *row, const FixedRow *x, int rows, int64_t nb,
                            float *out) {
    rows_dot32(type, block_bytes, row, 0, 1, x, rows, nb, out);
}

/* The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K block (the 12 bytes at `packed`, 4 into the block)
 * as bytes sc[0..7], m[0..7] of one vector: scale_min_k4 for all j at once, in 32-bit lanes. In vector
 * registers, as the row dots want them: 8 bytes stored and reloaded as one missed store forwarding and
 * took a quarter of a Q4_K row dot. */
static inline __m128i scales_mins_k4v(const uint8_t *packed) {
    const __m128i u = _mm_loadu_si128((const __m128i *)packed); /* u0, u1, u2 and 4 bytes of qs */
    const __m128i low6 = _mm_and_si128(u, _mm_set1_epi8(0x3f));  /* lanes 0, 1: sc[0..3], m[0..3] */
    const __m128i top2 = _mm_and_si128(_mm_srli_epi32(u, 6), _mm_set1_epi8(3));
    const __m128i u2 = _mm_srlv_epi32(_mm_shuffle_epi32(u, 0xAA), _mm_setr_epi32(0, 4, 0, 0)); /* u2, u2 >> 4 */
    const __m128i high = _mm_or_si128(_mm_and_si128(u2, _mm_set1_epi8(0x0f)), _mm_slli_epi32(top2, 4));
    return _mm_unpacklo_epi32(low6, high); /* sc[0..3], sc[4..7] (high lane 0), m[0..3], m[4..7] */
}

static inline void scales_mins_k4(const uint8_t *packed, uint8_t *sc, uint8_t *m) {
    const __m128i v = scales_mins_k4v(packed);
    _mm_storel_epi64((__m128i *)sc, v);
    _mm_storel_epi64((__m128i *)m, _mm_unpackhi_epi64(v, v));
}

/* Sub-blocks 2j (the low nibbles of 32 bytes qs) and 2j + 1 (the high nibbles) of a Q4_K / Q5_K
 * block; with qh (Q5_K) plus 16 where bit 2j / 2j + 1 of qh[l] is set for value l. */
static inline void k45_pair(const uint8_t *qs, const uint8_t *qh, int j, qv *lo, qv *hi) {
#ifdef FX_512 /* zero-extended bytes: a mask and a shift give both halves, the fifth bits a masked add */
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qs));
    *lo = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
    *hi = _mm512_srli_epi16(bytes, 4);
    if (qh) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)qh);
        const __mmask32 lo5 = _mm256_test_epi8_mask(bits, _mm256_set1_epi8((char)(1 << (2 * j))));
        const __mmask32 hi5 = _mm256_test_epi8_mask(bits, _mm256_set1_epi8((char)(2 << (2 * j))));
        *lo = _mm512_mask_add_epi16(*lo, lo5, *lo, _mm512_set1_epi16(16));
        *hi = _mm512_mask_add_epi16(*hi, hi5, *hi, _mm512_set1_epi16(16));
    }
#else
    const __m256i raw = _mm256_loadu_si256((const __m256i *)qs), low4 = _mm256_set1_epi8(0x0F);
    __m256i l = _mm256_and_si256(raw, low4), h = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    if (qh) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)qh), sixteen = _mm256_set1_epi8(0x10);
        const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * j))), b1 = _mm256_set1_epi8((char)(2 << (2 * j)));
        l = _mm256_or_si256(l, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, b0), b0), sixteen));
        h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, b1), b1), sixteen));
    }
    *lo = qv_from_i8(l);
    *hi = qv_from_i8(h);
#endif
}

/* A Q4_K / Q5_K block's 256 quant integers as int8 in its two groups: even[k] = values 8k .. 8k + 7 of
 * sub-blocks 0, 2, 4, 6 (the low nibbles of bytes 8k .. of qs's four 32-byte runs), odd[k] those of
 * sub-blocks 1, 3, 5, 7 (their high nibbles); with qh (Q5_K) plus 16 where bit s of qh[l] is set for
 * sub-block s's value l. */
static inline void k45_groups(const uint8_t *qs, const uint8_t *qh, __m256i even[4], __m256i odd[4]) {
    __m256i c[4], t[4];
    for (int j = 0; j < 4; j++) c[j] = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
    transpose_qwords4(c, t);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i even_bit = _mm256_setr_epi64x(0x0101010101010101, 0x0404040404040404, 0x1010101010101010,
                                                0x4040404040404040); /* slot s: sub-block 2s's bit */
    for (int k = 0; k < 4; k++) {
        even[k] = _mm256_and_si256(t[k], low4);
        odd[k] = _mm256_and_si256(_mm256_srli_epi16(t[k], 4), low4);
        if (qh) {
            const __m256i v = _mm256_set1_epi64x((int64_t)rd_u64(qh + 8 * k)); /* qh[8k + i] in each slot */
            even[k] = add16_where(even[k], v, even_bit);
            odd[k] = add16_where(odd[k], v, _mm256_add_epi8(even_bit, even_bit));
        }
    }
}

/* Q4_K / Q5_K: 8 sub-blocks of 32, value = (d * sc) * q - dmin * m; the min terms as one 8-lane
 * product with x's block sums. Rows as in row_dot32, one weight row at a time (row_pair_dots). */
FORCE_INLINE void row_dot_k45(int type, int block_bytes, const uint8_t *row, const FixedRow *x, int rows, int64_t nb,
                              float *out) {
    gv acc[SHARE];
    __m256 mins[SHARE];
    for (int r = 0; r < rows; r++) acc[r] = gv_zero(), mins[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * block_bytes;
        const __m128i scm = scales_mins_k4v(blk + 4);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scm));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(scm, scm)));
        const __m256 dsc = _mm256_mul_ps(sc, _mm256_set1_ps(rd_h(blk)));
        const __m256 dm = _mm256_mul_ps(m, _mm256_set1_ps(rd_h(blk + 2)));
        __m256i even8[4], odd8[4];
        k45_groups(blk + (type == 12 ? 16 : 48), type == 12 ? 0 : blk + 16, even8, odd8);
        wv even[1][4], odd[1][4];
        for (int k = 0; k < 4; k++) even[0][k] = wv_from_i8(even8[k]), odd[0][k] = wv_from_i8(odd8[k]);
        for (int r = 0; r < rows; r++) {
            const __m256 s = _mm256_mul_ps(dsc, _mm256_loadu_ps(x[r].scale + 8 * b)); /* d * sc * x's scale */
            const gv se = gv_pick(s, 0, 2, 4, 6), so = gv_pick(s, 1, 3, 5, 7);
            mins[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(x[r].sum + 8 * b), mins[r]);
            group_dot(even, 1, 4, x[r].q + 512 * b, &se, &acc[r]);
            group_dot(odd, 1, 4, x[r].q + 512 * b + 256, &so, &acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = gv_sum(acc[r]) - hsum(mins[r]);
}

/* The 128 values of Q6_K half `half` as int8 q - 32, in four quadrants of 32 (quadrant k: values
 * 128 * half + 32 * k + l, l < 32, scales sc[8 * half + 2 * k] and sc[8 * half + 2 * k + 1]). */
static inline void q6_quads(const uint8_t *blk, int half, __m256i quad[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
    /* qh's pair k moved to bits 4-5 by one 16-bit shift and a mask (what crosses bytes is masked off) */
    quad[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
    quad[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
    quad[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45));
    quad[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
    for (int k = 0; k < 4; k++) quad[k] = _mm256_sub_epi8(quad[k], bias);
}

/* Q6_K: value = (d * sc[16-group]) * (q - 32), q six bits from ql nibbles and qh pairs. Quadrants
 * 2p, 2p + 1 of a half are one group (XQ6K): their values 8k .. 8k + 7 interleaved by qwords, so a
 * slot is 8 values of one 16-value scale, whose float scale d * sc * (x's block scale) is exact.
 * One weight row at a time (row_pair_dots). */
FORCE_INLINE void row_dot_q6_k(const uint8_t *row, const FixedRow *x, int rows, int64_t nb, float *out) {
    gv acc[SHARE];
    for (int r = 0; r < rows; r++) acc[r] = gv_zero();
    const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3); /* a chunk's x scale for its 2 scales */
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 210 * b;
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(rd_h(blk + 208));
        for (int half = 0; half < 2; half++) {
            const __m128i sc8 = half ? _mm_unpackhi_epi64(sc, sc) : sc;
            const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))); /* d * sc[8 half + g] */
            __m256i quad[4];
            q6_quads(blk, half, quad);
            const wv p0[1][4] = {{wv_from_i8(_mm256_unpacklo_epi64(quad[0], quad[1])),
                                  wv_from_i8(_mm256_unpackhi_epi64(quad[0], quad[1]))}};
            const wv p1[1][4] = {{wv_from_i8(_mm256_unpacklo_epi64(quad[2], quad[3])),
                                  wv_from_i8(_mm256_unpackhi_epi64(quad[2], quad[3]))}};
            for (int r = 0; r < rows; r++) {
                const __m128 xs = _mm_loadu_ps(x[r].scale + 8 * b + 4 * half);
                const __m256 s = _mm256_mul_ps(dsc, _mm256_permutevar8x32_ps(_mm256_castps128_ps256(xs), twice));
                const gv s0 = gv_pick(s, 0, 2, 1, 3), s1 = gv_pick(s, 4, 6, 5, 7);
                const int16_t *xq = x[r].q + 512 * b + 256 * half;
                group_dot(p0, 1, 2, xq, &s0, &acc[r]);
                group_dot(p1, 1, 2, xq + 128, &s1, &acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r] = gv_sum(acc[r]);
}

/* Q4Z128's codes less the block's zero (decoders), exact in int16. */
static inline qv qv_less_zero(qv q, int z) {
#ifdef FX_512
    return _mm512_sub_epi16(q, _mm512_set1_epi16((short)z));
#else
    const __m256i zv = _mm256_set1_epi16((short)z);
    const qv r = {_mm256_sub_epi16(q.a, zv), _mm256_sub_epi16(q.b, zv)};
    return r;
#endif
}

/* A Q4Z128 block's 128 integers q - z as int8 in X32's group order (its 4 sub-blocks the slots): o[k] =
 * values 8k .. 8k + 7 of each, slot 2h + s from bytes 32h + 8k .. of qs, low nibbles (s = 0) or high. int8 holds
 * q - z exactly for z <= 128; the packer's 4-bit zeros are at most 16. */
static inline void q4z128_i8(const uint8_t *blk, __m256i o[4]) {
    const __m256i a = pair128(blk + 3, blk + 35), c = pair128(blk + 19, blk + 51);
    const __m256i t[4] = {_mm256_unpacklo_epi64(a, a), _mm256_unpackhi_epi64(a, a), _mm256_unpacklo_epi64(c, c),
                          _mm256_unpackhi_epi64(c, c)};
    const __m256i nibble = _mm256_setr_epi64x(0, 4, 0, 4), low4 = _mm256_set1_epi8(0x0F);
    const __m256i z = _mm256_set1_epi8((char)blk[2]);
    for (int k = 0; k < 4; k++) o[k] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srlv_epi64(t[k], nibble), low4), z);
}

/* Q4Z128: value = d * (q - z), the zero subtracted in the integers (no min term); block b is x's group b.
 * Rows as in row_dot32. */
FORCE_INLINE void row_dot_q4z128(const uint8_t *row, const FixedRow *x, int rows, int64_t nb, float *out) {
    gv acc[SHARE];
    for (int r = 0; r < rows; r++) acc[r] = gv_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 67 * b;
        const __m128 d = _mm_set1_ps(rd_h(blk));
        __m256i o[4];
        q4z128_i8(blk, o);
        wv q[1][4];
        for (int k = 0; k < 4; k++) q[0][k] = wv_from_i8(o[k]);
        for (int r = 0; r < rows; r++) {
            const gv s = gv_pick(_mm256_castps128_ps256(_mm_mul_ps(d, _mm_loadu_ps(x[r].scale + 4 * b))), 0, 1, 2, 3);
            group_dot(q, 1, 4, x[r].q + 256 * b, &s, &acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = gv_sum(acc[r]);
}

/* Whole-row decoders for the slab path (vq_decode_range and its bf16 twin): each block's integers
 * are built in registers as for the row dots above, converted with cvtepi32_ps, then given the
 * scalar decoder's own float operations in its order (separate mul / add / sub: nothing for the
 * compiler to contract), so every value stays bit-identical to dec_*. */
#ifdef FX_512
#define FVW 16 /* floats per fv */
static inline void qv_to_ps(qv q, fv f[32 / FVW]) {
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
}
static inline fv fv_set1(float s) { return _mm512_set1_ps(s); }
static inline fv fv_mul(fv a, fv b) { return _mm512_mul_ps(a, b); }
static inline fv fv_sub(fv a, fv b) { return _mm512_sub_ps(a, b); }
static inline void fv_store(float *y, fv v) { _mm512_storeu_ps(y, v); }
/* to_bf16 on 16 lanes: round to nearest even, a NaN quieted. AVX512-BF16's vcvtneps2bf16 rounds the
 * same way but reads subnormal inputs as zero and has its own NaN bits: it takes the lanes without
 * NaN, which is every lane here, as a decoded value is 0 or at least 2^-24 in magnitude (fp16 scales
 * times small integers, sums of such multiples of 2^-24) and so never subnormal. */
static inline void fv_store_bf16(uint16_t *y, fv v) {
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
#if defined(__AVX512BF16__)
    if (!nan) {
        _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
#endif
    const __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __m512i r = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(r));
}
#else
#define FVW 8
static inline void qv_to_ps(qv q, fv f[32 / FVW]) {
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.a)));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.a, 1)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q.b)));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q.b, 1)));
}
static inline fv fv_set1(float s) { return _mm256_set1_ps(s); }
static inline fv fv_mul(fv a, fv b) { return _mm256_mul_ps(a, b); }
static inline fv fv_sub(fv a, fv b) { return _mm256_sub_ps(a, b); }
static inline void fv_store(float *y, fv v) { _mm256_storeu_ps(y, v); }
static inline void fv_store_bf16(uint16_t *y, fv v) {
    const __m256i u = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    _mm_storeu_si128((__m128i *)y, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
#endif

/* Values i .. i + FVW of the output slab (float, or bfloat16 when bf16). */
FORCE_INLINE void fv_emit(int bf16, void *out, int64_t i, fv v) {
    if (bf16)
        fv_store_bf16((uint16_t *)out + i, v);
    else
        fv_store((float *)out + i, v);
}

/* dec_q4_0 / q4_1 / q5_0 / q5_1 / q8_0 / iq4_nl: d * q, then + m for the types with a min (Q8_0's
 * q * d is the same product). */
FORCE_INLINE void fast_block32(int type, int bf16, const uint8_t *b, void *out, int64_t i) {
    fv f[32 / FVW];
    qv_to_ps(block32_q(type, b), f);
    const fv d = fv_set1(rd_h(b));
    for (int c = 0; c < 32 / FVW; c++) {
        fv v = fv_mul(d, f[c]);
        if (type == 3 || type == 7) v = fv_add(v, fv_set1(rd_h(b + 2)));
        fv_emit(bf16, out, i + FVW * c, v);
    }
}

/* dec_k45: (d * sc) * q - dmin * m per 32-value sub-block. */
FORCE_INLINE void fast_block_k45(int type, int bf16, const uint8_t *b, void *out, int64_t i) {
    const uint8_t *qs = b + (type == 12 ? 16 : 48), *qh = type == 12 ? 0 : b + 16;
    uint8_t sc[8], m[8];
    scales_mins_k4(b + 4, sc, m);
    const float d = rd_h(b), dmin = rd_h(b + 2);
    for (int j = 0; j < 4; j++) {
        qv q[2];
        k45_pair(qs + 32 * j, qh, j, &q[0], &q[1]);
        for (int h = 0; h < 2; h++) {
            const int s = 2 * j + h;
            const fv dl = fv_set1(d * (float)sc[s]), ml = fv_set1(dmin * (float)m[s]);
            fv f[32 / FVW];
            qv_to_ps(q[h], f);
            for (int c = 0; c < 32 / FVW; c++) fv_emit(bf16, out, i + 32 * s + FVW * c, fv_sub(fv_mul(dl, f[c]), ml));
        }
    }
}

/* dec_q6_k: (d * sc[16-group]) * (q - 32). */
FORCE_INLINE void fast_block_q6_k(int bf16, const uint8_t *b, void *out, int64_t i) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = rd_h(b + 208);
    for (int half = 0; half < 2; half++) {
        __m256i quad[4];
        q6_quads(b, half, quad);
        for (int k = 0; k < 4; k++) {
            fv f[32 / FVW];
            qv_to_ps(qv_from_i8(quad[k]), f);
            for (int c = 0; c < 32 / FVW; c++) {
                const int g = 8 * half + 2 * k + FVW * c / 16;
                fv_emit(bf16, out, i + 128 * half + 32 * k + FVW * c, fv_mul(fv_set1(d * (float)sc[g]), f[c]));
            }
        }
    }
}

/* dec_q4z128: d * (q - z), the zero subtracted in the integers. */
FORCE_INLINE void fast_block_q4z128(int bf16, const uint8_t *b, void *out, int64_t i) {
    const fv d = fv_set1(rd_h(b));
    for (int h = 0; h < 2; h++) {
        qv q[2];
        k45_pair(b + 3 + 32 * h, 0, h, &q[0], &q[1]);
        for (int s = 0; s < 2; s++) {
            fv f[32 / FVW];
            qv_to_ps(qv_less_zero(q[s], b[2]), f);
            for (int c = 0; c < 32 / FVW; c++) fv_emit(bf16, out, i + 64 * h + 32 * s + FVW * c, fv_mul(d, f[c]));
        }
    }
}

/* Rows first .. first + n_rows of the packed [N, k] tensor into out (float or bf16), the block
 * type and output a constant per instance. */
FORCE_INLINE void fast_row(int type, int block_bytes, int bf16, const uint8_t *row, int64_t k, void *out, int64_t at) {
    const int block_elems = type == 12 || type == 13 || type == 14 ? QK_K : type == 205 ? 128 : 32;
    for (int64_t b = 0; b < k / block_elems; b++) {
        const uint8_t *blk = row + b * block_bytes;
        const int64_t i = at + b * block_elems;
        if (type == 205)
            fast_block_q4z128(bf16, blk, out, i);
        else if (type == 14)
            fast_block_q6_k(bf16, blk, out, i);
        else if (type == 12 || type == 13)
            fast_block_k45(type, bf16, blk, out, i);
        else
            fast_block32(type, bf16, blk, out, i);
    }
}

FORCE_INLINE void fast_range_of(int type, int block_bytes, int bf16, const uint8_t *w, int64_t row_bytes, int64_t k,
                                int64_t first, int64_t n_rows, void *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) fast_row(type, block_bytes, bf16, w + (first + r) * row_bytes, k, out, r * k);
}

/* The vectorized vq_decode_range(_bf16) for `type`; 0 when it has none here (the scalar decoders then). */
static int fast_decode_range(int type, int bf16, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t first,
                             int64_t n_rows, void *out, int threads) {
    switch (type) {
#define FAST_RANGE(T, BB)                                                                                  \
    case T:                                                                                                \
        if (bf16)                                                                                          \
            fast_range_of(T, BB, 1, w, row_bytes, k, first, n_rows, out, threads);                         \
        else                                                                                               \
            fast_range_of(T, BB, 0, w, row_bytes, k, first, n_rows, out, threads);                         \
        return 1;
    FAST_RANGE(2, 18) FAST_RANGE(3, 20) FAST_RANGE(6, 22) FAST_RANGE(7, 24) FAST_RANGE(8, 34) FAST_RANGE(20, 18)
    FAST_RANGE(12, 144) FAST_RANGE(13, 176) FAST_RANGE(14, 210)
    FAST_RANGE(205, 67)
#undef FAST_RANGE
    default: return 0;
    }
}

/* Whether `type` has an integer row dot here. */
static inline int has_row_dot(int type) {
    return type == 2 || type == 3 || type == 6 || type == 7 || type == 8 || type == 20 || type == 12 || type == 13 ||
           type == 14;
}

/* Whether the few-row matmuls take the row dots for `type`: MXFP4, Q4Z, Q8Z, Q4Z128 too (no small-batch panels). */
static inline int takes_row_dots(int type) {
    return has_row_dot(type) || type == 39 || type == 200 || type == 201 || type == 205;
}

/* out[r] = row . x[r] for r < rows, in units of x[r].unit; each case passes a constant type and
 * block size, and the callers a constant row count, so every dot is compiled for its case (no
 * switch per block, constant strides, the rows' accumulators in registers). */
FORCE_INLINE void row_dots(int type, const uint8_t *row, const FixedRow *x, int rows, int64_t k, float *out) {
    switch (type) {
    case 2: row_dot32(2, 18, row, x, rows, k / 32, out); break;
    case 3: row_dot32(3, 20, row, x, rows, k / 32, out); break;
    case 6: row_dot32(6, 22, row, x, rows, k / 32, out); break;
    case 7: row_dot32(7, 24, row, x, rows, k / 32, out); break;
    case 20: row_dot32(20, 18, row, x, rows, k / 32, out); break;
    case 200: row_dot32(200, 19, row, x, rows, k / 32, out); break;
    case 201: row_dot32(201, 36, row, x, rows, k / 32, out); break;
    case 12: row_dot_k45(12, 144, row, x, rows, k / QK_K, out); break;
    case 13: row_dot_k45(13, 176, row, x, rows, k / QK_K, out); break;
    case 14: row_dot_q6_k(row, x, rows, k / QK_K, out); break;
    case 39: row_dot32(39, 17, row, x, rows, k / 32, out); break;
    case 205: row_dot_q4z128(row, x, rows, k / 128, out); break;
    default: row_dot32(8, 34, row, x, rows, k / 32, out); break;
    }
}

/* out[w] = (weight row w) . x for w < 2, one activation row, the two weight rows row_bytes apart sharing
 * each load of x: the nibble types of 32-value blocks (0 for the others, nothing done). On a Zen 4 core
 * (1 thread, CPU time) pairs made Q5_0's dots 1.1x faster in cache and the layers in model order 1.03x;
 * Q4_K and Q6_K measured no faster in cache (1.0x, 0.98x), and the Q8_0 head, streamed from memory, took
 * 10.0 ms in pairs against 8.1 one row at a time. */
FORCE_INLINE int row_pair_dots(int type, const uint8_t *row, int64_t row_bytes, const FixedRow *x, int64_t k,
                               float *out) {
    switch (type) {
    case 2: rows_dot32(2, 18, row, row_bytes, 2, x, 1, k / 32, out); return 1;
    case 3: rows_dot32(3, 20, row, row_bytes, 2, x, 1, k / 32, out); return 1;
    case 6: rows_dot32(6, 22, row, row_bytes, 2, x, 1, k / 32, out); return 1;
    case 7: rows_dot32(7, 24, row, row_bytes, 2, x, 1, k / 32, out); return 1;
    case 20: rows_dot32(20, 18, row, row_bytes, 2, x, 1, k / 32, out); return 1;
    case 200: rows_dot32(200, 19, row, row_bytes, 2, x, 1, k / 32, out); return 1;
    case 39: rows_dot32(39, 17, row, row_bytes, 2, x, 1, k / 32, out); return 1;
    default: return 0;
    }
}

/* How far ahead of the row being read its weights are prefetched, into L1 and into L2: decode streams every
 * weight from DRAM (or a shared L3), and the hardware prefetchers alone left a core at 4.2 GB/s on the default
 * model's layers and 7.5 on its head; 2 KB ahead into L1 gives 7.1 and 9.5, plus 6 KB into L2 7.8 and 10.5
 * (1 thread, CPU time, an Intel Xeon; 0.5-8 KB single distances measured no better). */
#define PREFETCH_L1 2048
#define PREFETCH_L2 6144

/* Weight row r's bytes, PREFETCH_L1 ahead into L1 and PREFETCH_L2 into L2. */
static inline void prefetch_row(const uint8_t *w, int64_t row_bytes, int64_t r) {
    for (int64_t o = 0; o < row_bytes; o += 64) {
        _mm_prefetch((const char *)w + r * row_bytes + PREFETCH_L1 + o, _MM_HINT_T0);
        _mm_prefetch((const char *)w + r * row_bytes + PREFETCH_L2 + o, _MM_HINT_T1);
    }
}

/* y[m, r] for weight rows r in [r0, r1) and the `rows` activation rows from m (a constant per call);
 * one activation row takes the weight rows in pairs where row_pair_dots does. */
FORCE_INLINE void fixed_rows_n(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                               const FixedRow *x, int64_t m, int rows, float *y, int64_t ldy) {
    for (int64_t r = r0; r < r1; r++) {
        float dots[SHARE];
        if (m == 0) prefetch_row(w, row_bytes, r); /* later activation rows find the chunk in cache */
        if (PAIRS > 1 && rows == 1 && r + 1 < r1 && row_pair_dots(type, w + r * row_bytes, row_bytes, x + m, k, dots)) {
            if (m == 0) prefetch_row(w, row_bytes, r + 1); /* still PREFETCH_L1 ahead of the next pair */
            for (int i = 0; i < 2; i++) y[m * ldy + r + i] = (float)((double)dots[i] * x[m].unit);
            r++;
            continue;
        }
        row_dots(type, w + r * row_bytes, x + m, rows, k, dots);
        for (int i = 0; i < rows; i++) y[(m + i) * ldy + r] = (float)((double)dots[i] * x[m + i].unit);
    }
}

/* y[m, r] for weight rows r in [r0, r1), all activation rows, SHARE (or 2, or 1) at a time; the
 * weight rows in chunks that stay in cache across the activation rows. */
FORCE_INLINE void fixed_rows_of(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                                const FixedRow *x, int64_t m_rows, float *y, int64_t ldy) {
    for (int64_t c0 = r0; c0 < r1; c0 += 32) {
        const int64_t c1 = c0 + 32 < r1 ? c0 + 32 : r1;
        for (int64_t m = 0; m < m_rows;) {
            if (m_rows - m >= SHARE) {
                fixed_rows_n(type, w, row_bytes, c0, c1, k, x, m, SHARE, y, ldy);
                m += SHARE;
            } else if (m_rows - m >= 2) {
                fixed_rows_n(type, w, row_bytes, c0, c1, k, x, m, 2, y, ldy);
                m += 2;
            } else {
                fixed_rows_n(type, w, row_bytes, c0, c1, k, x, m, 1, y, ldy);
                m += 1;
            }
        }
    }
}

static void fixed_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                       const FixedRow *x, int64_t m_rows, float *y, int64_t ldy) {
    switch (type) {
#define FIXED_ROWS(T) case T: fixed_rows_of(T, w, row_bytes, r0, r1, k, x, m_rows, y, ldy); break;
    FIXED_ROWS(2) FIXED_ROWS(3) FIXED_ROWS(6) FIXED_ROWS(7) FIXED_ROWS(8) FIXED_ROWS(20) FIXED_ROWS(12) FIXED_ROWS(13)
    FIXED_ROWS(14) FIXED_ROWS(39) FIXED_ROWS(200) FIXED_ROWS(201)
    FIXED_ROWS(205)
#undef FIXED_ROWS
    }
}

/* Rows of x in fixed point into one scratch allocation (returned, for the caller to free; 0 when unavailable),
 * `fx[i]` pointing into it: row i = g * per + m at x + g * outer + m * inner (a group: a head's rows). */
static uint8_t *fixed_x(const float *x, int64_t count, int64_t per, int64_t outer, int64_t inner, int64_t k,
                        int layout, FixedRow *fx) {
    const int64_t nb = k / 32, padded = (nb + 3) / 4 * 4;
    const size_t q_bytes = (size_t)(64 * padded) * sizeof(int16_t), f_bytes = (size_t)padded * sizeof(float);
    const size_t per_row = q_bytes + 2 * f_bytes + (size_t)nb * sizeof(int);
    uint8_t *scratch = aligned_alloc(64, (per_row * (size_t)count + 63) / 64 * 64);
    if (!scratch) return 0;
    int16_t *q = (int16_t *)scratch; /* all rows' integers first: 128 bytes a block keep them aligned */
    float *f = (float *)(scratch + q_bytes * (size_t)count);
    int *expo = (int *)(f + 2 * padded * count);
    for (int64_t i = 0; i < count; i++) {
        float *scale = f + 2 * padded * i, *sum = scale + padded;
        fixed_row(x + i / per * outer + i % per * inner, k, layout, q + 64 * padded * i, scale, sum, expo + nb * i,
                  &fx[i]);
    }
    return scratch;
}

/* y = x W^T through the integer row dots: x converted once (scratch outside the parallel loop),
 * then each thread takes a contiguous range of weight rows, building each row's integers once per
 * SHARE activation rows. 0 when the scratch is unavailable. */
static int fixed_matmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                        int64_t m_rows, float *y, int64_t ldy, int threads) {
    FixedRow fx[64];
    uint8_t *scratch = fixed_x(x, m_rows, m_rows, 0, k, k, x_layout(type), fx);
    if (!scratch) return 0;
    const int64_t parts = threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t part = 0; part < parts; part++)
        fixed_rows(type, w, row_bytes, n * part / parts, n * (part + 1) / parts, k, fx, m_rows, y, ldy);
    free(scratch);
    return 1;
}

/* vq_matmul_heads through the integer row dots: every head's rows converted once, then the threads share
 * (head, weight-row chunk) items, a head split into chunks only where threads outnumber heads. */
static int fixed_matmul_heads(int type, const uint8_t *w, int64_t head_bytes, int64_t row_bytes, int64_t heads,
                              int64_t n, int64_t k, const float *x, int64_t x_head, int64_t x_row, int64_t m_rows,
                              float *y, int64_t y_head, int64_t y_row, int threads) {
    FixedRow *fx = malloc(sizeof(FixedRow) * (size_t)(heads * m_rows));
    uint8_t *scratch = fx ? fixed_x(x, heads * m_rows, m_rows, x_head, x_row, k, x_layout(type), fx) : 0;
    if (!scratch) {
        free(fx);
        return 0;
    }
    const int64_t chunks = threads > heads ? (threads + heads - 1) / heads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < heads * chunks; item++) {
        const int64_t h = item / chunks, c = item % chunks;
        fixed_rows(type, w + h * head_bytes, row_bytes, n * c / chunks, n * (c + 1) / chunks, k, fx + h * m_rows,
                   m_rows, y + h * y_head, y_row);
    }
    free(scratch);
    free(fx);
    return 1;
}
#else
static inline int has_row_dot(int type) { (void)type; return 0; }
static int fast_decode_range(int type, int bf16, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t first,
                             int64_t n_rows, void *out, int threads) {
    (void)type, (void)bf16, (void)w, (void)row_bytes, (void)k, (void)first, (void)n_rows, (void)out, (void)threads;
    return 0;
}
#endif

/* One row range of y = x W^T for a block type: the decoder inlined, the block read once per call. */
#define DEFINE_MATMUL(NAME, DECODE, BE)                                                                      \
    static void mm_##NAME(const uint8_t *w, int64_t row_bytes, int block_bytes, int64_t n, int64_t k,    \
                          const float *x, int64_t m_rows, float *y, int64_t ldy, int threads) {          \
        const int64_t nb = k / (BE);                                                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                \
        for (int64_t r = 0; r < n; r++) {                                                                \
            float buf[BE];                                                                               \
            const uint8_t *row = w + r * row_bytes;                                                      \
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

DEFINE_MATMUL(f16, dec_f16, 32)
DEFINE_MATMUL(bf16, dec_bf16, 32)
DEFINE_MATMUL(q4_0, dec_q4_0, 32)
DEFINE_MATMUL(q4_1, dec_q4_1, 32)
DEFINE_MATMUL(q5_0, dec_q5_0, 32)
DEFINE_MATMUL(q5_1, dec_q5_1, 32)
DEFINE_MATMUL(q8_0, dec_q8_0, 32)
DEFINE_MATMUL(iq4_nl, dec_iq4_nl, 32)
DEFINE_MATMUL(q2_k, dec_q2_k, QK_K)
DEFINE_MATMUL(q3_k, dec_q3_k, QK_K)
DEFINE_MATMUL(q4_k, dec_q4_k, QK_K)
DEFINE_MATMUL(q5_k, dec_q5_k, QK_K)
DEFINE_MATMUL(q6_k, dec_q6_k, QK_K)
DEFINE_MATMUL(iq4_xs, dec_iq4_xs, QK_K)
DEFINE_MATMUL(q4z, dec_q4z, 32)
DEFINE_MATMUL(q8z, dec_q8z, 32)
DEFINE_MATMUL(f8s, dec_f8s, 32)
DEFINE_MATMUL(q4zf, dec_q4zf, 32)
DEFINE_MATMUL(q8zf, dec_q8zf, 32)
DEFINE_MATMUL(q4z128, dec_q4z128, 128)
DEFINE_MATMUL(mxfp4, dec_mxfp4, 32)

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
    {200, 32, 19, dec_q4z, mm_q4z},        {201, 32, 36, dec_q8z, mm_q8z},      {202, 32, 36, dec_f8s, mm_f8s},
    {203, 32, 24, dec_q4zf, mm_q4zf},      {204, 32, 40, dec_q8zf, mm_q8zf},    {205, 128, 67, dec_q4z128, mm_q4z128},
    {39, 32, 17, dec_mxfp4, mm_mxfp4},
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

/* One packed row of nb blocks decoded with the type's scalar decoder. */
static inline void decode_row(const Format *f, const uint8_t *row, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++) f->decode(row + b * f->block_bytes, out + b * f->block_elems);
}

/* out[i, :] = row rows[i] of the packed [N, K] tensor, decoded. */
void vq_decode_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t k, const int64_t *rows, int64_t n_rows,
                    float *out, int threads) {
    const Format *f = find(type);
    const int64_t nb = k / f->block_elems;
#pragma omp parallel for num_threads(threads) schedule(static) if (n_rows * k > 65536)
    for (int64_t i = 0; i < n_rows; i++) {
        decode_row(f, w + rows[i] * row_bytes, nb, out + i * k);
    }
}

/* out[i, :] = row (first + i) decoded, for i < n_rows: a slab for the dense-matmul path. */
void vq_decode_range(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t first, int64_t n_rows,
                     float *out, int threads) {
    if (fast_decode_range(type, 0, w, row_bytes, k, first, n_rows, out, threads)) return;
    const Format *f = find(type);
    const int64_t nb = k / f->block_elems;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_rows; i++) {
        decode_row(f, w + (first + i) * row_bytes, nb, out + i * k);
    }
}

#ifdef __AVX__
/* The 8 x 8 floats at s (row stride ss) transposed into d (row stride ds). */
static inline void transpose8(const float *s, int64_t ss, float *d, int64_t ds) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(s + i * ss);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]); /* rows i, i+1 of columns 0 1 | 4 5, interleaved */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* columns 2 3 | 6 7 */
    }
    for (int h = 0; h < 8; h += 4) /* u[h + c]: rows h .. h+3 of columns c | c + 4 */
        for (int c = 0; c < 2; c++) {
            u[h + 2 * c] = _mm256_shuffle_ps(t[h + c], t[h + c + 2], _MM_SHUFFLE(1, 0, 1, 0));
            u[h + 2 * c + 1] = _mm256_shuffle_ps(t[h + c], t[h + c + 2], _MM_SHUFFLE(3, 2, 3, 2));
        }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(d + c * ds, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
        _mm256_storeu_ps(d + (c + 4) * ds, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
    }
}
#endif

/* dst[j * ld + i] = src[i * lds + j] for source rows i0 <= i < i1 and j < m. */
static void transpose_rows(const float *src, int64_t lds, int64_t i0, int64_t i1, int64_t m, float *dst, int64_t ld) {
    for (int64_t j = 0; j < m; j += 8) {
        int64_t i = i0;
#ifdef __AVX__
        if (j + 8 <= m)
            for (; i + 8 <= i1; i += 8) transpose8(src + i * lds + j, lds, dst + j * ld + i, ld);
#endif
        for (; i < i1; i++)
            for (int64_t c = j; c < j + 8 && c < m; c++) dst[c * ld + i] = src[i * lds + c];
    }
}

/* dst[j * ld + i] = src[i * m + j] for i < n, j < m. The slab path multiplies few activation rows as
 * W x^T, which oneDNN reads with the decoded weight in place instead of packing it first (~25% faster
 * at 64 rows); this puts each product back into x's row order, at its columns of the whole result. */
void vq_transpose(const float *src, int64_t n, int64_t m, float *dst, int64_t ld, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * m > 65536)
    for (int64_t i0 = 0; i0 < n; i0 += 64) /* 64 source rows at a time: 256-byte runs of each dst row */
        transpose_rows(src, m, i0, i0 + 64 < n ? i0 + 64 : n, m, dst, ld);
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
    if (fast_decode_range(type, 1, w, row_bytes, k, first, n_rows, out, threads)) return;
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

#if defined(HAVE_ROW_DOT) && defined(__AVX512F__)
/* Tiled x W^T for batches (11 to 128 activation rows): each thread decodes PANEL weight rows at a time into
 * its own buffer, which stays in cache, and multiplies them as W x^T in register tiles of MR weight rows by
 * up to 64 activation rows (x^T packed once per call, zero-padded to whole vectors). The slab path instead
 * writes the decoded weight to a scratch that the attention's KV stream evicts between layers, then
 * oneDNN packs it again; here the weight is decoded once and read from cache. Each output is one float32
 * FMA chain in order of k. */
#define MR 6     /* weight rows per register tile: MR x 4 accumulators of 16 */
#define PANEL 48 /* weight rows decoded at once by a thread */

static void decode_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t first, int64_t n,
                         float *out) {
    switch (type) {
#define PANEL_ROWS(T, BB)                                                                                  \
    case T:                                                                                                \
        for (int64_t r = 0; r < n; r++) fast_row(T, BB, 0, w + (first + r) * row_bytes, k, out, r * k);    \
        return;
    PANEL_ROWS(2, 18) PANEL_ROWS(3, 20) PANEL_ROWS(6, 22) PANEL_ROWS(7, 24) PANEL_ROWS(8, 34) PANEL_ROWS(20, 18)
    PANEL_ROWS(12, 144) PANEL_ROWS(13, 176) PANEL_ROWS(14, 210)
    PANEL_ROWS(205, 67)
#undef PANEL_ROWS
    default: {
        const Format *f = find(type);
        for (int64_t r = 0; r < n; r++) decode_row(f, w + (first + r) * row_bytes, k / f->block_elems, out + r * k);
    }
    }
}

/* c[i, 0 .. 16 nv) = sum_kk a[i, kk] * b[kk, 0 .. 16 nv) for i < MR; nv is a constant per inlined copy. */
FORCE_INLINE void tile_wx(const float *a, int64_t k, const float *b, int64_t ldb, int nv, float *c, int64_t ldc) {
    __m512 acc[MR][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 bv[4];
        for (int j = 0; j < nv; j++) bv[j] = _mm512_loadu_ps(b + kk * ldb + 16 * j);
        for (int i = 0; i < MR; i++) {
            const __m512 av = _mm512_set1_ps(a[i * k + kk]);
            for (int j = 0; j < nv; j++) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(c + i * ldc + 16 * j, acc[i][j]);
}

static int tiled_matmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                        int64_t m_rows, float *y, int64_t ldy, int threads) {
    const int64_t mp = (m_rows + 15) / 16 * 16;
    float *bt = aligned_alloc(64, sizeof(float) * (size_t)(k * mp));
    if (!bt) return 0;
    for (int64_t kk = 0; kk < k; kk++)
        for (int64_t m = 0; m < mp; m++) bt[kk * mp + m] = m < m_rows ? x[m * k + kk] : 0.0f;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *a = aligned_alloc(64, sizeof(float) * (size_t)(PANEL * k));
        float *c = aligned_alloc(64, sizeof(float) * PANEL * (size_t)mp);
        if (!a || !c) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r0 = 0; r0 < n; r0 += PANEL) {
            if (!a || !c) continue;
            const int64_t rows = n - r0 < PANEL ? n - r0 : PANEL, tiles = (rows + MR - 1) / MR;
            decode_panel(type, w, row_bytes, k, r0, rows, a);
            memset(a + rows * k, 0, sizeof(float) * (size_t)((tiles * MR - rows) * k)); /* a short last tile */
            for (int64_t t = 0; t < tiles; t++)
                for (int64_t m0 = 0; m0 < mp; m0 += 64) {
                    const float *at = a + t * MR * k, *b = bt + m0;
                    float *ct = c + t * MR * mp + m0;
                    switch ((mp - m0) / 16) {
                    case 1: tile_wx(at, k, b, mp, 1, ct, mp); break;
                    case 2: tile_wx(at, k, b, mp, 2, ct, mp); break;
                    case 3: tile_wx(at, k, b, mp, 3, ct, mp); break;
                    default: tile_wx(at, k, b, mp, 4, ct, mp); break;
                    }
                }
            transpose_rows(c, mp, 0, rows, m_rows, y + r0, ldy);
        }
        free(a);
        free(c);
    }
    free(bt);
    return !failed;
}
#undef MR
#undef PANEL
#endif

#ifdef HAVE_ROW_DOT
/* Small batches (2 to 32 activation rows): int16 dot products vectorized over weight rows.
 *
 * The tiled kernel vectorizes over activation rows (each weight value broadcast, starved at 11-16 rows)
 * and the row dots rebuild each block's integers per SHARE rows. Here each thread takes SB_LANES weight
 * rows at a time, decodes them once into int16 quant integers q with value = scale_g * q + offset_g per
 * group g of 16 (Q6_K) or 32 values, and interleaves them so a vector lane is a weight row and a 32-bit
 * word two consecutive values. Each activation row is rounded per 32-value block to int16 with a
 * power-of-two scale 2^(e_b - 15), 2^(e_b - 1) <= max|x_b| < 2^e_b: |error| <= 2^-14 * max|x_b| per value
 * (llama.cpp's int8 blocks err up to 2^-8, which moves the default model's logprobs past the gates'
 * 1e-3). One vpdpwssd (AVX512-VNNI / AVX-VNNI; else pmaddwd + add) then multiplies SB_LANES weight rows
 * by a broadcast pair of x; the group's 32-bit sums are exact (|q| <= 128, |x| <= 2^15, 32 products:
 * < 2^28), and cost one float multiply-add per group and activation row. As in fixed_row, block scales
 * are relative to the row's largest block and the row's unit multiplies the result. */
#ifdef FX_512
#define SB_LANES 16
#define SB_ROWS 8 /* activation rows whose accumulators stay in registers */
#define SBV(op) _mm512_##op
typedef __m512i sb_i;
typedef __m512 sb_f;
static inline sb_i sb_zero_i(void) { return _mm512_setzero_si512(); }
static inline sb_i sb_load_i(const int32_t *p) { return _mm512_load_si512(p); }
#ifdef __AVX512VNNI__
#define SB_DPWSSD _mm512_dpwssd_epi32
#endif
static inline void qv_store(int16_t *dst, qv q) { _mm512_storeu_si512(dst, q); }
#else
#define SB_LANES 8
#define SB_ROWS 4
#define SBV(op) _mm256_##op
typedef __m256i sb_i;
typedef __m256 sb_f;
static inline sb_i sb_zero_i(void) { return _mm256_setzero_si256(); }
static inline sb_i sb_load_i(const int32_t *p) { return _mm256_load_si256((const __m256i *)p); }
#ifdef __AVXVNNI__
#define SB_DPWSSD _mm256_dpwssd_avx_epi32
#endif
static inline void qv_store(int16_t *dst, qv q) {
    _mm256_storeu_si256((__m256i *)dst, q.a);
    _mm256_storeu_si256((__m256i *)(dst + 16), q.b);
}
#endif

/* Decoded codes into dst at index `at`: int16 (the VNNI panels) or, where `narrow`, int8 (AMX tiles; FX_512). */
static inline void sb_put(void *dst, int64_t at, qv q, int narrow) {
#ifdef FX_512
    if (narrow) {
        _mm256_storeu_si256((__m256i *)((int8_t *)dst + at), _mm512_cvtepi16_epi8(q));
        return;
    }
#endif
    (void)narrow;
    qv_store((int16_t *)dst + at, q);
}

/* acc + the pairwise products of w's int16 pairs with the broadcast pair x2, summed per 32-bit lane. */
static inline sb_i sb_dot(sb_i acc, sb_i w, int32_t x2) {
#ifdef SB_DPWSSD
    return SB_DPWSSD(acc, w, SBV(set1_epi32)(x2));
#else
    return SBV(add_epi32)(acc, SBV(madd_epi16)(w, SBV(set1_epi32)(x2)));
#endif
}
static inline sb_f sb_zero_f(void) { return SBV(setzero_ps)(); }
static inline sb_f sb_load_f(const float *p) { return SBV(load_ps)(p); }
static inline sb_f sb_scaled(sb_i dot, sb_f scale, float xs, sb_f acc) {
    return SBV(fmadd_ps)(SBV(cvtepi32_ps)(dot), SBV(mul_ps)(scale, SBV(set1_ps)(xs)), acc);
}
static inline sb_f sb_fma1(sb_f a, float b, sb_f acc) { return SBV(fmadd_ps)(a, SBV(set1_ps)(b), acc); }
static inline void sb_store(float *y, sb_f v, float unit) {
    SBV(store_ps)(y, unit ? SBV(mul_ps)(v, SBV(set1_ps)(unit)) : v);
}

typedef struct {
    const int32_t *q;  /* k / 2 words: int16 pairs of consecutive values */
    const float *rel;  /* per 32-value block: 2^(e_b - e_max); 0 for an all-zero block, NaN for a non-finite one */
    const float *sum;  /* per block: rel * sum of its integers, for the weights' offsets */
    double unit;       /* 2^(e_max - 15) */
    float unit_f;      /* unit where it is a normal float, else 0 (the result is then scaled in double) */
} SbRow;

/* One activation row x (k values) rounded per 32-value block to int16 (see above). */
static void sb_quantize(const float *x, int64_t k, int16_t *q, float *rel, float *sum, int *expo, SbRow *out) {
    const int64_t nb = k / 32;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int e_max = INT_MIN;
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
        }
        const float m = hmax(amax);
        int16_t *qb = q + 32 * b;
        if (!_mm256_testz_ps(nan, nan) || m > FLT_MAX || m == 0.0f) {
            memset(qb, 0, 32 * sizeof(int16_t));
            expo[b] = m == 0.0f && _mm256_testz_ps(nan, nan) ? INT_MIN : INT_MAX;
            continue;
        }
        uint32_t bits;
        memcpy(&bits, &m, 4);
        int e = (int)(bits >> 23) - 126; /* m < 2^e <= 2m */
        if (bits < 0x00800000u) frexpf(m, &e);
        const int shift = 15 - e; /* exact: the power of two in two float factors */
        const __m256 f1 = _mm256_set1_ps(pow2f(shift / 2)), f2 = _mm256_set1_ps(pow2f(shift - shift / 2));
        __m256i r[4];
        for (int j = 0; j < 4; j++) r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[j], f1), f2));
        const __m256i lo = pack16(r[0], r[1]), hi = pack16(r[2], r[3]); /* 2^15 saturates to 2^15 - 1 */
        _mm256_storeu_si256((__m256i *)qb, lo);
        _mm256_storeu_si256((__m256i *)(qb + 16), hi);
        const __m256i ones = _mm256_set1_epi16(1);
        sum[b] = (float)hsum_i32(_mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)));
        expo[b] = e;
        if (e > e_max) e_max = e;
    }
    if (e_max == INT_MIN) e_max = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (expo[b] == INT_MIN || expo[b] == INT_MAX) {
            rel[b] = sum[b] = expo[b] == INT_MIN ? 0.0f : NAN;
            continue;
        }
        const int p = expo[b] - e_max;
        rel[b] = p >= -126 ? pow2f(p) : ldexpf(1.0f, p);
        sum[b] *= rel[b];
    }
    out->q = (const int32_t *)q;
    out->rel = rel;
    out->sum = sum;
    out->unit = ldexp(1.0, e_max - 15);
    out->unit_f = out->unit >= FLT_MIN && out->unit <= FLT_MAX ? (float)out->unit : 0.0f;
}

/* Weight row `row` as int16 (or, where `narrow`, int8) q of k values, scale and (types with a min) offset per
 * group g at g * SB_LANES. */
FORCE_INLINE void sb_decode_row(int type, int block_bytes, const uint8_t *row, int64_t k, void *q, int narrow,
                                float *scale, float *offset) {
    if (type == 14) { /* Q6_K: groups of 16, value = (d * sc) * (q - 32) */
        for (int64_t b = 0; b < k / QK_K; b++) {
            const uint8_t *blk = row + b * block_bytes;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = rd_h(blk + 208);
            for (int half = 0; half < 2; half++) {
                __m256i quad[4];
                q6_quads(blk, half, quad);
                for (int j = 0; j < 4; j++) sb_put(q, QK_K * b + 128 * half + 32 * j, qv_from_i8(quad[j]), narrow);
            }
            for (int g = 0; g < 16; g++) scale[(16 * b + g) * SB_LANES] = d * (float)sc[g];
        }
    } else if (type == 12 || type == 13) { /* Q4_K / Q5_K: (d * sc) * q - dmin * m */
        for (int64_t b = 0; b < k / QK_K; b++) {
            const uint8_t *blk = row + b * block_bytes;
            const uint8_t *qs = blk + (type == 12 ? 16 : 48), *qh = type == 12 ? 0 : blk + 16;
            uint8_t sc[8], m[8];
            scales_mins_k4(blk + 4, sc, m);
            const float d = rd_h(blk), dmin = rd_h(blk + 2);
            for (int j = 0; j < 4; j++) {
                qv lo, hi;
                k45_pair(qs + 32 * j, qh, j, &lo, &hi);
                sb_put(q, QK_K * b + 64 * j, lo, narrow);
                sb_put(q, QK_K * b + 64 * j + 32, hi, narrow);
            }
            for (int s = 0; s < 8; s++) {
                scale[(8 * b + s) * SB_LANES] = d * (float)sc[s];
                offset[(8 * b + s) * SB_LANES] = -(dmin * (float)m[s]);
            }
        }
    } else { /* 32-value blocks: d * q, plus m for Q4_1 / Q5_1 */
        for (int64_t b = 0; b < k / 32; b++) {
            const uint8_t *blk = row + b * block_bytes;
            sb_put(q, 32 * b, block32_q(type, blk), narrow);
            scale[b * SB_LANES] = rd_h(blk);
            if (type == 3 || type == 7) offset[b * SB_LANES] = rd_h(blk + 2);
        }
    }
}

/* Per-thread buffers for one group of SB_LANES weight rows. */
typedef struct {
    int16_t *codes;  /* [SB_LANES][k]: the rows as decoded */
    int32_t *panel;  /* [k / 2][SB_LANES]: lane = weight row, word = two consecutive values */
    float *scale, *offset; /* [groups][SB_LANES] */
    float *tile;     /* [SB_ROWS][SB_LANES]: results before they go to y */
} SbScratch;

/* Weight rows r0 .. r0 + rows (rows <= SB_LANES; the other lanes zero) into s's panel; where `narrow`, only
 * into s->codes as int8 rows [SB_LANES][k] (the AMX tiles' A operand), untransposed. */
FORCE_INLINE void sb_panel_of(int type, int block_bytes, const uint8_t *w, int64_t row_bytes, int64_t r0,
                              int64_t rows, int64_t k, int group, int narrow, const SbScratch *s) {
    const size_t code_bytes = narrow ? 1 : sizeof(int16_t);
    for (int64_t i = 0; i < SB_LANES; i++) {
        uint8_t *codes = (uint8_t *)s->codes + code_bytes * (size_t)(i * k);
        if (i < rows) {
            sb_decode_row(type, block_bytes, w + (r0 + i) * row_bytes, k, codes, narrow, s->scale + i, s->offset + i);
            continue;
        }
        memset(codes, 0, code_bytes * (size_t)k);
        for (int64_t g = 0; g < k / group; g++) s->scale[g * SB_LANES + i] = s->offset[g * SB_LANES + i] = 0.0f;
    }
    if (!narrow) /* bits moved only */
        transpose_rows((const float *)s->codes, k / 2, 0, SB_LANES, k / 2, (float *)s->panel, SB_LANES);
}

static void sb_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t rows, int64_t k, int narrow,
                     const SbScratch *s) {
    switch (type) {
#define SB_PANEL(T, BB, G)                                                                                        \
    case T:                                                                                                       \
        if (narrow)                                                                                               \
            sb_panel_of(T, BB, w, row_bytes, r0, rows, k, G, 1, s);                                               \
        else                                                                                                      \
            sb_panel_of(T, BB, w, row_bytes, r0, rows, k, G, 0, s);                                               \
        break;
    SB_PANEL(2, 18, 32) SB_PANEL(3, 20, 32) SB_PANEL(6, 22, 32) SB_PANEL(7, 24, 32) SB_PANEL(8, 34, 32)
    SB_PANEL(20, 18, 32) SB_PANEL(12, 144, 32) SB_PANEL(13, 176, 32) SB_PANEL(14, 210, 16)
#undef SB_PANEL
    }
}

/* s->tile[r] = the panel's SB_LANES weight rows . x[r] for r < rows (a constant per inlined copy). */
FORCE_INLINE void sb_tile(int group, int has_min, int rows, const SbScratch *s, int64_t k, const SbRow *x) {
    sb_f acc[SB_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = sb_zero_f();
    for (int64_t g = 0; g < k / group; g++) {
        sb_i dot[SB_ROWS];
        for (int r = 0; r < rows; r++) dot[r] = sb_zero_i();
        const int32_t *wp = s->panel + g * (group / 2) * SB_LANES;
        for (int j = 0; j < group / 2; j++) {
            const sb_i wv = sb_load_i(wp + j * SB_LANES);
            for (int r = 0; r < rows; r++) dot[r] = sb_dot(dot[r], wv, x[r].q[g * (group / 2) + j]);
        }
        const sb_f scale = sb_load_f(s->scale + g * SB_LANES);
        for (int r = 0; r < rows; r++) acc[r] = sb_scaled(dot[r], scale, x[r].rel[g * group / 32], acc[r]);
        if (has_min) {
            const sb_f offset = sb_load_f(s->offset + g * SB_LANES);
            for (int r = 0; r < rows; r++) acc[r] = sb_fma1(offset, x[r].sum[g], acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) sb_store(s->tile + r * SB_LANES, acc[r], x[r].unit_f);
}

FORCE_INLINE void sb_tiles_of(int group, int has_min, int rows, const SbScratch *s, int64_t k, const SbRow *x) {
    switch (rows) {
#define SB_TILE(R) case R: sb_tile(group, has_min, R, s, k, x); break;
    SB_TILE(1) SB_TILE(2) SB_TILE(3) SB_TILE(4)
#if SB_ROWS > 4
    SB_TILE(5) SB_TILE(6) SB_TILE(7) SB_TILE(8)
#endif
#undef SB_TILE
    }
}

/* This thread's scratch for the small-batch chunks (codes, panel, scales, tile), kept across calls: the team's
 * threads persist, and every call's chunks need the same few tens of KB. NULL where the allocation failed. */
static _Thread_local struct {
    uint8_t *buf;
    size_t size;
} sb_scratch;

static uint8_t *sb_buffer(size_t size) {
    if (sb_scratch.size < size) {
        free(sb_scratch.buf);
        sb_scratch.buf = aligned_alloc(64, (size + 63) / 64 * 64);
        sb_scratch.size = sb_scratch.buf ? size : 0;
    }
    return sb_scratch.buf;
}

/* One call's operands, for chunks of chunk_rows weight rows: ~64 KB of weights, a multiple of 16 rows (whole
 * panels, and no two threads write one cache line of y). */
typedef struct {
    int type, group, has_min;
    const uint8_t *w;
    int64_t row_bytes, n, k, m_rows, ldy, chunk_rows;
    const SbRow *rows;
    float *y;
    const void *tiles;  /* the AMX path's activations (AmxX) */
    atomic_int *failed; /* a thread's scratch unavailable */
} SbJob;

/* Panels of chunk c's weight rows times every activation row, into y. */
static void sb_chunk(void *ctx, int64_t c) {
    const SbJob *j = ctx;
    const int64_t k = j->k, ng = k / j->group, end = (c + 1) * j->chunk_rows < j->n ? (c + 1) * j->chunk_rows : j->n;
    const size_t codes = sizeof(int16_t) * SB_LANES * (size_t)k, per_group = sizeof(float) * SB_LANES * (size_t)ng;
    uint8_t *buf = sb_buffer(2 * codes + 2 * per_group + sizeof(float) * SB_ROWS * SB_LANES);
    if (!buf) {
        atomic_store(j->failed, 1);
        return;
    }
    const SbScratch s = {(int16_t *)buf, (int32_t *)(buf + codes), (float *)(buf + 2 * codes),
                         (float *)(buf + 2 * codes + per_group), (float *)(buf + 2 * codes + 2 * per_group)};
    for (int64_t r0 = c * j->chunk_rows; r0 < end; r0 += SB_LANES) {
        const int64_t lanes = end - r0 < SB_LANES ? end - r0 : SB_LANES;
        sb_panel(j->type, j->w, j->row_bytes, r0, lanes, k, 0, &s);
        for (int64_t m0 = 0; m0 < j->m_rows; m0 += SB_ROWS) {
            const int rows_here = (int)(j->m_rows - m0 < SB_ROWS ? j->m_rows - m0 : SB_ROWS);
            if (j->group == 16)
                sb_tiles_of(16, 0, rows_here, &s, k, j->rows + m0);
            else if (j->has_min)
                sb_tiles_of(32, 1, rows_here, &s, k, j->rows + m0);
            else
                sb_tiles_of(32, 0, rows_here, &s, k, j->rows + m0);
            for (int r = 0; r < rows_here; r++) {
                const SbRow *x = j->rows + m0 + r;
                float *out = j->y + (m0 + r) * j->ldy + r0;
                const float *t = s.tile + r * SB_LANES;
                if (x->unit_f)
                    memcpy(out, t, sizeof(float) * (size_t)lanes);
                else
                    for (int64_t i = 0; i < lanes; i++) out[i] = (float)((double)t[i] * x->unit);
            }
        }
    }
}

#include "amx_small.h" /* AMX_SMALL where the build and the CPU have AMX-INT8 tiles */

/* From this many activation rows the AMX tiles (where usable) take the call, else the VNNI panels: Q8_0
 * from 4 (its quants load into tiles as stored), the others from 9, where the tiles overtake the panels'
 * cheaper decode (default model's weights, 1 thread: Q5_0 1024 x 640 0.95x at 8 rows, 1.07x at 10). */
#define AMX_MIN_ROWS(type) ((type) == 8 ? 4 : 9)

/* y = x W^T for 2 to 32 activation rows through the panels (or tiles) above, threads taking chunks of weight
 * rows; 0 when a buffer is unavailable. */
static int small_batch_matmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                              int64_t m_rows, float *y, int64_t ldy, int threads) {
    const int64_t nb = k / 32;
    const size_t x_bytes = (size_t)(2 * k + 12 * nb), pad = 64;
    uint8_t *xs = aligned_alloc(64, (x_bytes * (size_t)m_rows + pad) / 64 * 64);
    if (!xs) return 0;
    SbRow rows[32];
    for (int64_t m = 0; m < m_rows; m++) {
        uint8_t *base = xs + x_bytes * (size_t)m;
        int16_t *q = (int16_t *)base;
        float *rel = (float *)(base + 2 * k), *sum = rel + nb;
        sb_quantize(x + m * k, k, q, rel, sum, (int *)(sum + nb), &rows[m]);
    }
    atomic_int failed = 0;
    const int64_t chunk_rows = row_bytes >= 65536 / 16 ? 16 : 65536 / row_bytes / 16 * 16;
    SbJob job = {type, type == 14 ? 16 : 32, type == 3 || type == 7 || type == 12 || type == 13, w, row_bytes, n, k,
                 m_rows, ldy, chunk_rows, rows, y, 0, &failed};
    void (*task)(void *, int64_t) = sb_chunk;
#ifdef AMX_SMALL
    uint8_t *tiles = 0;
    if (m_rows >= AMX_MIN_ROWS(type) && amx_ready()) {
        if (!(tiles = amx_activations(rows, m_rows, k, &job))) failed = 1;
        task = amx_chunk;
    }
#endif
    if (!failed) {
        const int64_t chunks = (n + chunk_rows - 1) / chunk_rows;
        /* OpenMP's team, as the decode-path regions around it use: a pool worker spinning beside them would make
         * three busy threads on two cores (thread_pool.h) */
#pragma omp parallel for num_threads(threads) schedule(dynamic)
        for (int64_t c = 0; c < chunks; c++) task(&job, c);
    }
#ifdef AMX_SMALL
    free(tiles);
#endif
    free(xs);
    return !failed;
}
#endif

/* y = x W^T (W packed [n, k], y row stride ldy) for 2 to 32 activation rows through the small-batch kernel
 * above; 0 where it has no path for the type (or no AVX2 build) or memory ran out: the caller then takes
 * another kernel. */
int vq_matmul_small(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                    int64_t m_rows, float *y, int64_t ldy, int threads) {
#ifdef HAVE_ROW_DOT
    if (has_row_dot(type) && m_rows <= 32) return small_batch_matmul(type, w, row_bytes, n, k, x, m_rows, y, ldy, threads);
#endif
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)m_rows, (void)y, (void)ldy, (void)threads;
    return 0;
}

/* Whether the small-batch kernel takes AMX tiles from AMX_MIN_ROWS rows (built for AMX-INT8, CPU and OS
 * willing); on >= 0 first allows (1) or forbids (0) them, for A/B measurements and tests. */
int vq_matmul_small_amx(int on) {
#ifdef AMX_SMALL
    if (on >= 0) amx_allowed = on;
    return amx_ready();
#else
    (void)on;
    return 0;
#endif
}

/* Whether this build has the tiled kernel (AVX-512): asked once, not on every call. */
int vq_matmul_tiled_built(void) {
#if defined(HAVE_ROW_DOT) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* y = x W^T (W packed [n, k], y row stride ldy) for a batch of up to 128 activation rows, through the
 * tiled kernel above. 0 when this build has none (no AVX-512) or memory ran out: the caller then takes
 * the slab path. */
int vq_matmul_tiled(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                    int64_t m_rows, float *y, int64_t ldy, int threads) {
#if defined(HAVE_ROW_DOT) && defined(__AVX512F__)
    if (find(type) && m_rows <= 128) return tiled_matmul(type, w, row_bytes, n, k, x, m_rows, y, ldy, threads);
#endif
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)m_rows, (void)y, (void)ldy, (void)threads;
    return 0;
}

/* y[m, n] = sum_k x[m, k] * W[n, k] for m < M (M <= 64), W packed [N, K]; y row stride ldy. */
void vq_matmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m_rows,
               float *y, int64_t ldy, int threads) {
    const Format *f = find(type);
#ifdef HAVE_ROW_DOT
    if (takes_row_dots(type) && m_rows <= 64 && fixed_matmul(type, w, row_bytes, n, k, x, m_rows, y, ldy, threads))
        return;
#endif
    f->matmul(w, row_bytes, f->block_bytes, n, k, x, m_rows, y, ldy, threads);
}

/* y[h] = x[h] W[h]^T for each head h < heads, in one call (MLA's absorbed up-projections: a Python loop over 128
 * heads would cost more than the blocks it saves reading). W[h]: packed [n, k] at w + h * head_bytes, rows
 * row_bytes apart; x[h]'s row m: k floats at x + h * x_head + m * x_row; y[h]'s row m: n floats at
 * y + h * y_head + m * y_row (strides in floats). Row dots where the type has them, else each head's rows
 * copied contiguous (64 at a time) for its decode + float matmul. 0 when memory ran out. */
int vq_matmul_heads(int type, const uint8_t *w, int64_t head_bytes, int64_t row_bytes, int64_t heads, int64_t n,
                    int64_t k, const float *x, int64_t x_head, int64_t x_row, int64_t m_rows, float *y, int64_t y_head,
                    int64_t y_row, int threads) {
#ifdef HAVE_ROW_DOT
    if (takes_row_dots(type))
        return fixed_matmul_heads(type, w, head_bytes, row_bytes, heads, n, k, x, x_head, x_row, m_rows, y, y_head,
                                  y_row, threads);
#endif
    const Format *f = find(type);
    float *rows = malloc(sizeof(float) * 64 * (size_t)k);
    if (!rows) return 0;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t m0 = 0; m0 < m_rows; m0 += 64) {
            const int64_t count = m_rows - m0 < 64 ? m_rows - m0 : 64;
            for (int64_t m = 0; m < count; m++)
                memcpy(rows + m * k, x + h * x_head + (m0 + m) * x_row, sizeof(float) * (size_t)k);
            f->matmul(w + h * head_bytes, row_bytes, f->block_bytes, n, k, rows, count, y + h * y_head + m0 * y_row,
                      y_row, threads);
        }
    free(rows);
    return 1;
}

/* y = x W_e^T for the rows of each expert e < experts, in one call (a MoE layer's decode: one parallel region
 * instead of one call and barrier per active expert). x: the (token, expert) assignments' rows sorted by expert,
 * counts[e] of them for expert e, k floats each; y: their n outputs each, rows ldy floats apart. W_e: packed
 * [n, k] of types[e] at address weights[e], rows row_bytes[e] apart. Each expert's rows take the same integer
 * row dots as vq_matmul gives them (bit-identical); 0 (nothing written) where an active expert's type has none,
 * it has more than max_rows (<= 64) rows, the active types lay x out differently (x_layout), or memory ran out:
 * the caller then takes one call per expert. */
int vq_matmul_experts(const int32_t *types, const int64_t *weights, const int64_t *row_bytes, int64_t experts,
                      const int64_t *counts, int64_t max_rows, int64_t n, int64_t k, const float *x, float *y,
                      int64_t ldy, int threads) {
#ifdef HAVE_ROW_DOT
    int64_t rows = 0, active = 0;
    int layout = -1; /* x is laid out once, for every active expert's type */
    for (int64_t e = 0; e < experts; e++) {
        if (!counts[e]) continue;
        if (!takes_row_dots(types[e]) || counts[e] > max_rows || counts[e] > 64) return 0;
        if (layout >= 0 && x_layout(types[e]) != layout) return 0;
        layout = x_layout(types[e]);
        rows += counts[e];
        active++;
    }
    if (!active) return 1;
    FixedRow *fx = malloc(sizeof(FixedRow) * (size_t)rows);
    int64_t *item_expert = malloc(sizeof(int64_t) * 2 * (size_t)active);
    uint8_t *scratch = fx && item_expert ? fixed_x(x, rows, rows, 0, k, k, layout, fx) : 0;
    if (!scratch) {
        free(fx);
        free(item_expert);
        return 0;
    }
    int64_t *item_first = item_expert + active; /* each active expert and its first row */
    for (int64_t e = 0, i = 0, first = 0; e < experts; first += counts[e], e++)
        if (counts[e]) item_expert[i] = e, item_first[i++] = first;
    const int64_t chunks = threads > active ? (threads + active - 1) / active : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < active * chunks; item++) {
        const int64_t i = item / chunks, c = item % chunks, e = item_expert[i], first = item_first[i];
        fixed_rows(types[e], (const uint8_t *)(intptr_t)weights[e], row_bytes[e], n * c / chunks,
                   n * (c + 1) / chunks, k, fx + first, counts[e], y + first * ldy, ldy);
    }
    free(scratch);
    free(item_expert);
    free(fx);
    return 1;
#else
    (void)types, (void)weights, (void)row_bytes, (void)experts, (void)counts, (void)max_rows, (void)n, (void)k, (void)x;
    (void)y, (void)ldy, (void)threads;
    return 0;
#endif
}

static void pool_fill_chunk(void *ctx, int64_t c) { atomic_fetch_add((_Atomic int64_t *)ctx + c, c + 1); }

/* out[c] += c + 1 for each c < chunks through the worker pool (thread_pool.h) on `threads` threads: lets the
 * tests check on any CPU that every chunk runs exactly once (the pool's one kernel user, amx_small.h, needs AMX). */
void vq_pool_fill(int threads, int64_t chunks, int64_t *out) {
    pool_run(threads, chunks, pool_fill_chunk, out);
}
