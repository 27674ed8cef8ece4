/* y = x W^T for a few activation rows on the block types the block library (ggml_blocks.c) has no vector
 * decoder or small-batch panels for: each weight block is decoded into float registers, bit-identical to the
 * library's decoder for it, and multiplied (FMA) into up to ROW_GROUP activation rows at once.
 *
 *   F8S (202, fp8 e4m3 safetensors: f32 scale s, 32 e4m3fn codes; value e4m3(q) * s)
 *   Q4Z (200) / Q8Z (201): f16 d, integer zero z, 4- / 8-bit codes q; value d * (q - z)
 *   Q4ZF (203) / Q8ZF (204): the same with an f32 d
 *   MXFP4 (39): e8m0 exponent e, 16 bytes of e2m1 codes; value k[code] * 2^(e - 128) (k: e2m1 doubled)
 *   F16 (1) / BF16 (30): runs of 32 values (a quantized safetensors checkpoint's embedding / LM head, GGUF's)
 *
 * e4m3 -> float without a table: the byte S.EEEE.MMM becomes the fp16 bit pattern S.0EEEE.MMM0000000
 * (zero-extend, shift left 8, arithmetic shift right 1, clear bit 14), which is e4m3(q) / 256 for every
 * finite code, subnormals included (fp16's exponent bias 15 vs e4m3's 7); vcvtph2ps makes it a float. The
 * value is then h * (256 s) where 256 s is exact (|s| < 2^119), else (h * 256) * s with h * 256 exact: one
 * rounding of the real product dec_f8s rounds once. The NaN codes (0x7F, 0xFF) would read as 480 / 256: a
 * weight row holding one gets NaN results instead, as any product with NaN would. The integer types' codes
 * (the zero subtracted, MXFP4's k[code] by byte shuffle) convert to float exactly and take the one product
 * by d their decoders take; F16 / BF16 convert exactly. So every value multiplied is the block library's
 * decoded value.
 *
 * Every activation row keeps one accumulator per vector of a block (AVX-512: 2 x 16 lanes, AVX2: 4 x 8),
 * reduced at the end, so its result does not depend on how many rows share the call. Error vs exact
 * arithmetic on the decoded values: a float32 dot of length k, at most k * 2^-24 * sum_i |w_i x_i|.
 * Builds without AVX2 + F16C + FMA decline every call (the block library's paths serve those CPUs).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCK_FMA 1
#endif

#define BLOCK 32
enum { Q4Z = 200, Q8Z = 201, F8S = 202, Q4ZF = 203, Q8ZF = 204, MXFP4 = 39, F16 = 1, BF16 = 30 };

#ifdef BLOCK_FMA
#define FORCE_INLINE static inline __attribute__((always_inline))

/* VW floats per vector; ROW_GROUP activation rows per pass over a weight row, their accumulators in
 * registers (<= 8). The row ranges each type takes are at vq_block_fma_rows. */
#if defined(__AVX512F__)
#define VW 16
#define ROW_GROUP 8
typedef __m512 vf;
typedef __m512i vi;
FORCE_INLINE vi vi_u8(__m128i b, int j) { (void)j; return _mm512_cvtepu8_epi32(b); } /* bytes 16 j .. */
FORCE_INLINE vi vi_i8(__m128i b, int j) { (void)j; return _mm512_cvtepi8_epi32(b); }
FORCE_INLINE vf vf_i32(vi a, int z) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(a, _mm512_set1_epi32(z))); }
FORCE_INLINE vf v_half(__m128i b, int j) { /* fp16 lanes from the 16-bit pattern of 16 bytes' worth */
    (void)j;
    __m256i h = _mm256_cvtepu8_epi16(b);
    h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(h, 8), 1), _mm256_set1_epi16((short)0xBFFF));
    return _mm512_cvtph_ps(h);
}
FORCE_INLINE vf v_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
FORCE_INLINE vf v_bf16(const uint8_t *p) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
FORCE_INLINE vf v_set(float a) { return _mm512_set1_ps(a); }
FORCE_INLINE vf v_zero(void) { return _mm512_setzero_ps(); }
FORCE_INLINE vf v_load(const float *p) { return _mm512_loadu_ps(p); }
FORCE_INLINE vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
FORCE_INLINE vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
FORCE_INLINE vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
FORCE_INLINE float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
#else
#define VW 8
#define ROW_GROUP 2 /* 4 accumulators a row: 8 of AVX2's 16 registers */
typedef __m256 vf;
typedef __m256i vi;
FORCE_INLINE __m128i half_of(__m128i b, int j) { return j ? _mm_srli_si128(b, 8) : b; } /* bytes 8 j .. */
FORCE_INLINE vi vi_u8(__m128i b, int j) { return _mm256_cvtepu8_epi32(half_of(b, j)); }
FORCE_INLINE vi vi_i8(__m128i b, int j) { return _mm256_cvtepi8_epi32(half_of(b, j)); }
FORCE_INLINE vf vf_i32(vi a, int z) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(a, _mm256_set1_epi32(z))); }
FORCE_INLINE vf v_half(__m128i b, int j) {
    __m128i h = _mm_cvtepu8_epi16(half_of(b, j));
    h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(h, 8), 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}
FORCE_INLINE vf v_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
FORCE_INLINE vf v_bf16(const uint8_t *p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
FORCE_INLINE vf v_set(float a) { return _mm256_set1_ps(a); }
FORCE_INLINE vf v_zero(void) { return _mm256_setzero_ps(); }
FORCE_INLINE vf v_load(const float *p) { return _mm256_loadu_ps(p); }
FORCE_INLINE vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
FORCE_INLINE vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
FORCE_INLINE vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
FORCE_INLINE float v_sum(vf a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    return (s[0] + s[1]) + (s[2] + s[3]);
}
#endif
#define VPB (BLOCK / VW) /* vectors per block */
#define VPH (16 / VW)    /* vectors per 16 bytes of codes */

FORCE_INLINE float rd_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}
FORCE_INLINE float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
FORCE_INLINE int rd_i16(const uint8_t *p) {
    int16_t v;
    memcpy(&v, p, 2);
    return v;
}
FORCE_INLINE __m128i load16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }

/* e8m0 as the block library's e8m0_half: 2^(e - 128), e < 2 the subnormals 2^-128 and 2^-127. */
FORCE_INLINE float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* d * (q - z) for 4-bit codes laid out as Q4_0's: low nibbles values 0-15, high nibbles 16-31. */
FORCE_INLINE void zero4(float d, int z, const uint8_t *qs, vf w[VPB]) {
    const __m128i b = load16(qs), low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const vf dv = v_set(d);
    for (int j = 0; j < VPH; j++) {
        w[j] = v_mul(dv, vf_i32(vi_u8(lo, j), z));
        w[VPH + j] = v_mul(dv, vf_i32(vi_u8(hi, j), z));
    }
}

/* d * (q - z) for 32 int8 codes. */
FORCE_INLINE void zero8(float d, int z, const uint8_t *qs, vf w[VPB]) {
    const vf dv = v_set(d);
    for (int h = 0; h < 2; h++) {
        const __m128i b = load16(qs + 16 * h);
        for (int j = 0; j < VPH; j++) w[h * VPH + j] = v_mul(dv, vf_i32(vi_i8(b, j), z));
    }
}

FORCE_INLINE void mxfp4(const uint8_t *blk, vf w[VPB]) {
    const __m128i k = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i b = load16(blk + 1), low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_shuffle_epi8(k, _mm_and_si128(b, low));
    const __m128i hi = _mm_shuffle_epi8(k, _mm_and_si128(_mm_srli_epi16(b, 4), low));
    const vf dv = v_set(e8m0_half(blk[0]));
    for (int j = 0; j < VPH; j++) {
        w[j] = v_mul(dv, vf_i32(vi_i8(lo, j), 0));
        w[VPH + j] = v_mul(dv, vf_i32(vi_i8(hi, j), 0));
    }
}

FORCE_INLINE void f8s(const uint8_t *blk, vf w[VPB]) {
    const float s = rd_f32(blk);
    const int exact = fabsf(s) < 0x1p119f; /* 256 s exact: one product */
    const vf a = v_set(exact ? s * 256.0f : 256.0f);
    for (int h = 0; h < 2; h++) {
        const __m128i b = load16(blk + 4 + 16 * h);
        for (int j = 0; j < VPH; j++) {
            const vf v = v_mul(v_half(b, j), a);
            w[h * VPH + j] = exact ? v : v_mul(v, v_set(s));
        }
    }
}

/* The block's 32 values as the block library decodes them (F8S's NaN codes aside: row_has_nan). */
FORCE_INLINE void decode_block(int type, const uint8_t *b, vf w[VPB]) {
    switch (type) {
    case F8S: f8s(b, w); break;
    case F16: for (int j = 0; j < VPB; j++) w[j] = v_f16(b + 2 * VW * j); break;
    case BF16: for (int j = 0; j < VPB; j++) w[j] = v_bf16(b + 2 * VW * j); break;
    case Q4Z: zero4(rd_f16(b), b[2], b + 3, w); break;
    case Q8Z: zero8(rd_f16(b), rd_i16(b + 2), b + 4, w); break;
    case Q4ZF: zero4(rd_f32(b), b[4], b + 8, w); break;
    case Q8ZF: zero8(rd_f32(b), rd_i16(b + 4), b + 8, w); break;
    default: mxfp4(b, w); break;
    }
}

/* Whether an F8S row holds a NaN code (0x7F or 0xFF): q | 0x80 == 0xFF for some byte. */
static int row_has_nan(const uint8_t *row, int64_t nb, int block_bytes) {
    __m256i top = _mm256_setzero_si256();
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(row + b * block_bytes + 4));
        top = _mm256_max_epu8(top, _mm256_or_si256(q, sign));
    }
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(top, _mm256_set1_epi8((char)0xFF))) != 0;
}

/* y[m * ldy] = row . x[m] for the `count` (<= ROW_GROUP) activation rows starting at x; inlined with
 * constant type and count (row_group_dots), so the accumulators live in registers. */
FORCE_INLINE void row_dots(int type, int block_bytes, const uint8_t *row, int64_t nb, const float *x, int64_t k,
                           int count, float *y, int64_t ldy) {
    vf acc[ROW_GROUP][VPB];
    for (int m = 0; m < count; m++)
        for (int j = 0; j < VPB; j++) acc[m][j] = v_zero();
    for (int64_t b = 0; b < nb; b++) {
        vf w[VPB];
        decode_block(type, row + b * block_bytes, w);
        for (int m = 0; m < count; m++) {
            const float *xb = x + m * k + b * BLOCK;
            for (int j = 0; j < VPB; j++) acc[m][j] = v_fma(w[j], v_load(xb + j * VW), acc[m][j]);
        }
    }
    for (int m = 0; m < count; m++) {
        vf s = acc[m][0];
        for (int j = 1; j < VPB; j++) s = v_add(s, acc[m][j]);
        y[m * ldy] = v_sum(s);
    }
}

FORCE_INLINE void row_group_dots(int type, int block_bytes, const uint8_t *row, int64_t nb, const float *x,
                                 int64_t k, int count, float *y, int64_t ldy) {
    switch (count) {
#define ROWS_CASE(C) \
    case C: if (C <= ROW_GROUP) row_dots(type, block_bytes, row, nb, x, k, C, y, ldy); break;
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
    }
}

#define ROW_TILE 16 /* weight rows per pass over a group of activation rows: reused from L1 / L2 */

/* Weight rows [r0, r1) against every activation row, in groups of ROW_GROUP. */
FORCE_INLINE void tile(int type, int block_bytes, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                       int64_t k, const float *x, int64_t m_rows, float *y, int64_t ldy) {
    const int64_t nb = k / BLOCK;
    for (int64_t m0 = 0; m0 < m_rows; m0 += ROW_GROUP) {
        const int count = m_rows - m0 < ROW_GROUP ? (int)(m_rows - m0) : ROW_GROUP;
        for (int64_t r = r0; r < r1; r++)
            row_group_dots(type, block_bytes, w + r * row_bytes, nb, x + m0 * k, k, count, y + m0 * ldy + r, ldy);
    }
    if (type == F8S)
        for (int64_t r = r0; r < r1; r++)
            if (row_has_nan(w + r * row_bytes, nb, block_bytes))
                for (int64_t m = 0; m < m_rows; m++) y[m * ldy + r] = NAN;
}

typedef void (*tile_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *, int64_t, float *, int64_t);
#define TILE(NAME, T, BYTES)                                                                                  \
    static void tile_##NAME(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,           \
                            const float *x, int64_t m_rows, float *y, int64_t ldy) {                          \
        tile(T, BYTES, w, row_bytes, r0, r1, k, x, m_rows, y, ldy);                                           \
    }
TILE(f8s, F8S, 36)
TILE(q4z, Q4Z, 19)
TILE(q8z, Q8Z, 36)
TILE(q4zf, Q4ZF, 24)
TILE(q8zf, Q8ZF, 40)
TILE(mxfp4, MXFP4, 17)
TILE(f16, F16, 64)
TILE(bf16, BF16, 64)
#undef TILE

#endif

/* The activation rows this build takes for `type` (where it beats the block library's path for them), as
 * [*lo, *hi]; 0 for a type it has no decoder for, and in builds without AVX2 + F16C + FMA. Measured on
 * 4864 x 896 weights, 1 thread, best of 15-25 runs (shared AVX-512 Xeon), the library's time / this one's:
 * AVX-512: F8S 1.6 / 0.5 ms at 1 row, 2.3 / 1.6 at 11 (its tiled kernel), 3.3 / 2.7 at 24, 2.9 / 3.3 at 32;
 * Q4Z / Q8Z against the library's integer row dots 0.45 / 0.35 and 0.43 / 0.32 at 1 row, 1.6 / 0.9 and
 * 1.6 / 0.8 at 8; MXFP4 0.31 / 0.32 at 1 row, 1.7 / 0.7 at 8, 3.5 / 1.2 at 11 (tiled); BF16 32768 x 896
 * at 1 row 46.7 / 10.6 ms (float32 dense: 15.9). AVX2 (-mno-avx512f): F8S 3.4 vs 9.4 ms (decode + dense
 * matmul) at 12 rows, 8.7 vs 3.0 at 16; Q4Z / Q8Z / MXFP4 within 15% of the integer row dots at 1-10 rows.
 * Those keep the row dots up to 10 rows: end to end (benchmarks/quantized_formats.py, GPTQ int4 asym, the
 * 0.5B shape, batch-1 decode, 3 interleaved rounds on a host at load 14-17) this kernel there was 0.79-0.93x. */
int vq_block_fma_rows(int type, int64_t *lo, int64_t *hi) {
#ifdef BLOCK_FMA
#if defined(__AVX512F__)
    *hi = 24;
#else
    *hi = 12;
#endif
    switch (type) {
    case F8S: case Q4ZF: case Q8ZF: case F16: case BF16: *lo = 1; return 1; /* the library: scalar decode */
    case Q4Z: case Q8Z: case MXFP4: *lo = 11; return 1; /* up to 10 rows: the library's integer row dots */
    default: return 0;
    }
#else
    (void)type, (void)lo, (void)hi;
    return 0;
#endif
}

/* y[m, c] = sum_i W[c, i] x[m, i] for the packed [n, k] weight W of `type` (row stride row_bytes), the
 * float32 [m_rows, k] x and the float32 y (row stride ldy). Returns 0, writing nothing, for a type or a row
 * count this build does not take (vq_block_fma_rows; the caller keeps its own path), else 1. The signature
 * is the block library's vq_matmul_small's. */
int vq_block_fma_matmul(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                        int64_t m_rows, float *y, int64_t ldy, int threads) {
    int64_t lo, hi;
    if (!vq_block_fma_rows(type, &lo, &hi) || m_rows < lo || m_rows > hi || k % BLOCK) return 0;
#ifdef BLOCK_FMA
    const tile_fn run = type == F8S ? tile_f8s : type == Q4Z ? tile_q4z : type == Q8Z ? tile_q8z
                      : type == Q4ZF ? tile_q4zf : type == Q8ZF ? tile_q8zf : type == F16 ? tile_f16
                      : type == BF16 ? tile_bf16 : tile_mxfp4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r0 = 0; r0 < n; r0 += ROW_TILE) /* a tile of weight rows meets each group of x rows */
        run(w, row_bytes, r0, r0 + ROW_TILE < n ? r0 + ROW_TILE : n, k, x, m_rows, y, ldy);
    return 1;
#else
    (void)w, (void)row_bytes, (void)n, (void)x, (void)y, (void)ldy, (void)threads;
    return 0;
#endif
}
