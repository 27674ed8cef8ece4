/* AMX-int8 tiles for the small-batch kernel (ggml_blocks.c includes this inside its small-batch region, after
 * sb_quantize and sb_panel: it reuses their activation rounding and weight decoders).
 *
 * The VNNI panels spend one vpdpwssd (32 products) per weight vector and activation row, and their int16
 * panels need a transpose per 16 weight rows. An AMX tile multiply (TMUL) takes 16 weight rows x 16 activation
 * rows x 32 values (8192 products) at once on int8 operands, and its A operand is the weight rows as stored,
 * row-major (Q8_0: straight from the file mapping). The activations keep the small-batch kernel's int16
 * rounding, split exactly into bytes, x = 256 * hi + lo (hi signed, lo unsigned): tdpbssd (hi) and tdpbsud
 * (lo) give each group's two int32 sums, and 256 * S_hi + S_lo is exactly the VNNI kernel's group sum
 * (|S_hi| <= 32 * 128 * 128 = 2^19). The float work per group is then the VNNI kernel's, operation for
 * operation (sum to float, times scale * rel, plus offset * block sum; then times the row's unit): the
 * result is bit-identical to it, so batches of any size between them agree exactly.
 *
 * Runtime: the build must target AMX (-march=native on a CPU with AMX-TILE and AMX-INT8), the CPU must say
 * so in CPUID, and Linux must grant the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process,
 * good for every thread). Otherwise, or after vq_matmul_small_amx(0), the VNNI panels run. */
#if defined(FX_512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define AMX_SMALL 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TILE 16 /* weight rows per A tile (SB_LANES), activation rows per B tile, int32 lanes of C */

static int amx_allowed = 1, amx_granted = -1; /* vq_matmul_small_amx; the OS's answer, asked once */

static int amx_ready(void) {
    if (amx_granted < 0) {
        unsigned a, b, c, d;
        const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
        amx_granted = cpu && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return amx_granted && amx_allowed;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* Tiles 0, 1 (and 5, 6): a group's int32 sums of hi and lo bytes; 2 (and 7): 16 weight rows x `group` int8
 * (A); 3, 4: the activations' hi and lo bytes, group / 4 rows of 16 activation rows x 4 values (B). */
static void amx_configure(int group) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = AMX_TILE, c.colsb[t] = 4 * AMX_TILE; /* C: 0, 1 and 5, 6 */
    c.colsb[2] = c.colsb[7] = (uint16_t)group;
    for (int t = 3; t < 5; t++) c.rows[t] = (uint8_t)(group / 4);
    _tile_loadconfig(&c);
}

/* The activation rows as B tiles: per 16-row tile, hi and lo bytes [k / 4][16 rows][4 values], the rows'
 * rel and block sums [nb][16] and units (unit_f, or 1 where the result is scaled in double afterwards);
 * absent rows of a last tile zero. */
typedef struct {
    int8_t *hi;
    uint8_t *lo;
    float *rel, *sum, *unit;
} AmxX;

static uint8_t *amx_activations(const SbRow *rows, int64_t m_rows, int64_t k, SbJob *job) {
    const int64_t tiles = (m_rows + AMX_TILE - 1) / AMX_TILE, nb = k / 32, bytes = k * AMX_TILE;
    uint8_t *buf = aligned_alloc(64, (size_t)(tiles * (2 * bytes + 4 * (2 * nb + 1) * AMX_TILE) + bytes * 2 +
                                              64 + sizeof(AmxX)));
    if (!buf) return 0;
    AmxX *out = (AmxX *)(buf + tiles * (2 * bytes + 4 * (2 * nb + 1) * AMX_TILE) + bytes * 2 + 64);
    out->hi = (int8_t *)buf;
    out->lo = buf + tiles * bytes;
    out->rel = (float *)(buf + 2 * tiles * bytes);
    out->sum = out->rel + tiles * nb * AMX_TILE;
    out->unit = out->sum + tiles * nb * AMX_TILE;
    int8_t *hi_rows = (int8_t *)(out->unit + tiles * AMX_TILE); /* [16][k] before the transpose */
    uint8_t *lo_rows = (uint8_t *)hi_rows + bytes;
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t j = 0; j < AMX_TILE; j++) {
            const int64_t m = t * AMX_TILE + j;
            float *rel = out->rel + t * nb * AMX_TILE + j, *sum = out->sum + t * nb * AMX_TILE + j;
            if (m >= m_rows) {
                memset(hi_rows + j * k, 0, (size_t)k), memset(lo_rows + j * k, 0, (size_t)k);
                for (int64_t b = 0; b < nb; b++) rel[b * AMX_TILE] = sum[b * AMX_TILE] = 0.0f;
                out->unit[t * AMX_TILE + j] = 1.0f;
                continue;
            }
            const int16_t *q = (const int16_t *)rows[m].q;
            for (int64_t i = 0; i < k; i += 32) {
                const __m512i v = _mm512_loadu_si512(q + i);
                _mm256_storeu_si256((__m256i *)(hi_rows + j * k + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
                _mm256_storeu_si256((__m256i *)(lo_rows + j * k + i), _mm512_cvtepi16_epi8(v)); /* low bytes */
            }
            for (int64_t b = 0; b < nb; b++) rel[b * AMX_TILE] = rows[m].rel[b], sum[b * AMX_TILE] = rows[m].sum[b];
            out->unit[t * AMX_TILE + j] = rows[m].unit_f ? rows[m].unit_f : 1.0f;
        }
        /* 4 consecutive bytes of a row are one 32-bit word: the word transpose makes B's layout */
        transpose_rows((const float *)hi_rows, k / 4, 0, AMX_TILE, k / 4, (float *)(out->hi + t * bytes), AMX_TILE);
        transpose_rows((const float *)lo_rows, k / 4, 0, AMX_TILE, k / 4, (float *)(out->lo + t * bytes), AMX_TILE);
    }
    job->tiles = out;
    return buf;
}

/* acc[i] += the group's sums (hi and lo halves at c, 16 x 16 int32 each) times scale[i] * rel, plus
 * offset[i] * the block sums: sb_tile's float operations, with weight rows as registers and activation
 * rows as lanes. */
FORCE_INLINE void amx_scale(int has_min, const int32_t *c, const float *scale, const float *offset, __m512 relv,
                            const float *sum, __m512 acc[AMX_TILE]) {
    for (int i = 0; i < AMX_TILE; i++) {
        const __m512i hi = _mm512_load_si512(c + AMX_TILE * i), lo = _mm512_load_si512(c + AMX_TILE * (AMX_TILE + i));
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(scale[i]), relv), acc[i]);
    }
    if (has_min) {
        const __m512 sumv = _mm512_load_ps(sum);
        for (int i = 0; i < AMX_TILE; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(offset[i]), sumv, acc[i]);
    }
}

/* Group g's two tile products into tiles C_HI, C_LO from A tile A_T (B in tiles 3, 4). */
#define AMX_ISSUE(C_HI, C_LO, A_T, g)                                                                            \
    do {                                                                                                         \
        _tile_zero(C_HI);                                                                                        \
        _tile_zero(C_LO);                                                                                        \
        _tile_loadd(A_T, a + (g) * a_step, a_stride);                                                            \
        _tile_loadd(3, bh + (g) * group * AMX_TILE, 4 * AMX_TILE);                                               \
        _tile_loadd(4, bl + (g) * group * AMX_TILE, 4 * AMX_TILE);                                               \
        _tile_dpbssd(C_HI, A_T, 3);                                                                              \
        _tile_dpbsud(C_LO, A_T, 4);                                                                              \
    } while (0)
#define AMX_STORE(C_HI, C_LO, buf)                                                                               \
    do {                                                                                                         \
        _tile_stored(C_HI, buf, 4 * AMX_TILE);                                                                   \
        _tile_stored(C_LO, (buf) + AMX_TILE * AMX_TILE, 4 * AMX_TILE);                                           \
    } while (0)
#define AMX_SCALE(buf, g)                                                                                        \
    amx_scale(has_min, buf, scale + (g) * AMX_TILE, offset + (g) * AMX_TILE,                                     \
              _mm512_load_ps(rel + ((g) * group / 32) * AMX_TILE), sum + (g) * AMX_TILE, acc)

/* acc[i] (lane j: activation row j of tile t) = weight row i . x_j over every group, as the VNNI kernel's
 * sb_tile computes it. a: weight row 0's first group, `a_step` bytes per group, rows `a_stride` apart;
 * scale / offset [ng][16]; c: 4 x 256 int32 of scratch. Two sets of C tiles (0, 1 and 5, 6; A in 2 and 7)
 * alternate, so the tiles multiply group g + 1 while the vector units scale group g. */
FORCE_INLINE void amx_tile(int group, int has_min, const uint8_t *a, int64_t a_step, int64_t a_stride,
                           int64_t ng, const float *scale, const float *offset, const AmxX *x, int64_t t, int64_t k,
                           int32_t *c, __m512 acc[AMX_TILE]) {
    const int64_t nb = k / 32;
    const int8_t *bh = x->hi + t * k * AMX_TILE;
    const uint8_t *bl = x->lo + t * k * AMX_TILE;
    const float *rel = x->rel + t * nb * AMX_TILE, *sum = x->sum + t * nb * AMX_TILE;
    int32_t *even = c, *odd = c + 2 * AMX_TILE * AMX_TILE;
    for (int i = 0; i < AMX_TILE; i++) acc[i] = _mm512_setzero_ps();
    AMX_ISSUE(0, 1, 2, 0);
    for (int64_t g = 0; g < ng; g += 2) {
        AMX_STORE(0, 1, even);
        if (g + 1 < ng) AMX_ISSUE(5, 6, 7, g + 1);
        AMX_SCALE(even, g);
        if (g + 1 == ng) break;
        AMX_STORE(5, 6, odd);
        if (g + 2 < ng) AMX_ISSUE(0, 1, 2, g + 2);
        AMX_SCALE(odd, g + 1);
    }
}
#undef AMX_ISSUE
#undef AMX_STORE
#undef AMX_SCALE

/* 16 weight rows r0 .. r0 + lanes against every activation tile, written into y. */
FORCE_INLINE void amx_rows(const SbJob *j, int64_t r0, int64_t lanes, const SbScratch *s, int32_t *c, float *out) {
    const int64_t k = j->k, ng = k / j->group, tiles = (j->m_rows + AMX_TILE - 1) / AMX_TILE;
    const AmxX *x = j->tiles;
    const uint8_t *a = (const uint8_t *)s->codes;
    int64_t a_step = j->group, a_stride = k;
    if (j->type == 8 && lanes == AMX_TILE) { /* Q8_0: the int8 quants as stored, after each block's scale */
        a = j->w + r0 * j->row_bytes + 2, a_step = 34, a_stride = j->row_bytes;
        for (int64_t i = 0; i < AMX_TILE; i++)
            for (int64_t b = 0; b < ng; b++) s->scale[b * AMX_TILE + i] = rd_h(j->w + (r0 + i) * j->row_bytes + 34 * b);
    } else {
        sb_panel(j->type, j->w, j->row_bytes, r0, lanes, k, 1, s);
    }
    for (int64_t t = 0; t < tiles; t++) {
        __m512 acc[AMX_TILE];
        if (j->group == 16)
            amx_tile(16, 0, a, a_step, a_stride, ng, s->scale, s->offset, x, t, k, c, acc);
        else if (j->has_min)
            amx_tile(32, 1, a, a_step, a_stride, ng, s->scale, s->offset, x, t, k, c, acc);
        else
            amx_tile(32, 0, a, a_step, a_stride, ng, s->scale, s->offset, x, t, k, c, acc);
        const __m512 unit = _mm512_load_ps(x->unit + t * AMX_TILE);
        for (int i = 0; i < AMX_TILE; i++) _mm512_store_ps(out + AMX_TILE * i, _mm512_mul_ps(acc[i], unit));
        const int64_t m0 = t * AMX_TILE, here = j->m_rows - m0 < AMX_TILE ? j->m_rows - m0 : AMX_TILE;
        transpose_rows(out, AMX_TILE, 0, lanes, here, j->y + m0 * j->ldy + r0, j->ldy);
        for (int64_t m = m0; m < m0 + here; m++)
            if (!j->rows[m].unit_f)
                for (int64_t i = 0; i < lanes; i++) {
                    float *v = j->y + m * j->ldy + r0 + i;
                    *v = (float)((double)*v * j->rows[m].unit);
                }
    }
}

/* sb_chunk's work through the tiles: chunk c's weight rows, 16 at a time. */
static void amx_chunk(void *ctx, int64_t chunk) {
    const SbJob *j = ctx;
    const int64_t k = j->k, ng = k / j->group, r_end = (chunk + 1) * j->chunk_rows < j->n ? (chunk + 1) * j->chunk_rows : j->n;
    const size_t codes = (size_t)(AMX_TILE * k), per_group = sizeof(float) * AMX_TILE * (size_t)ng;
    uint8_t *buf = sb_buffer(codes + 2 * per_group + sizeof(int32_t) * 5 * AMX_TILE * AMX_TILE);
    if (!buf) {
        atomic_store(j->failed, 1);
        return;
    }
    SbScratch s = {(int16_t *)buf, 0, (float *)(buf + codes), (float *)(buf + codes + per_group), 0};
    int32_t *c = (int32_t *)(buf + codes + 2 * per_group);
    amx_configure(j->group);
    for (int64_t r0 = chunk * j->chunk_rows; r0 < r_end; r0 += AMX_TILE)
        amx_rows(j, r0, r_end - r0 < AMX_TILE ? r_end - r0 : AMX_TILE, &s, c, (float *)(c + 4 * AMX_TILE * AMX_TILE));
    _tile_release();
}

#endif
