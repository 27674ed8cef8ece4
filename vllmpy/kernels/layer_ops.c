/* Small per-token layer ops (RMSNorm, rotary with an optional q/k norm, a sandwich layer's norm + residual add
 * + next norm, gated activation) and the sampler's row max and categorical draw in one call each.
 *
 * At batch-1 decode these tensors are a few hundred floats: torch spends 10-15 us of dispatch on
 * the seven ops of an RMSNorm and the six of a rotary, ~100 times per token, against well under a
 * microsecond of arithmetic here. Float32, row-major, contiguous; every row independent, so large
 * inputs (prefill) split rows across threads. The *_bf16 variants take and give bfloat16 (a bf16 model's
 * activations), compute in float32 and round to nearest even where the torch path rounds, so a bf16 step
 * does not fall back to a dozen small torch ops per norm.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

/* 1 / sqrt(mean(x^2) + eps) of one row, which norm_row scales by w (Gemma's (1 + weight)). The sum of
 * squares is accumulated in double so the result does not depend on the summation order (torch's
 * vectorized float reduction and this loop then agree to the last bit in nearly every row). */
static inline float norm_inv(const float *x, int64_t dim, float eps) {
    double lanes[8] = {0};  /* independent chains: the loop vectorizes instead of waiting on one sum */
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += (double)x[i + j] * (double)x[i + j];
    double sum = 0.0;
    for (; i < dim; i++) sum += (double)x[i] * (double)x[i];
    for (int j = 0; j < 8; j++) sum += lanes[j];
    return 1.0f / sqrtf((float)(sum / (double)dim) + eps);
}

static inline void norm_row(const float *x, const float *w, float *y, int64_t dim, float eps) {
    const float inv = norm_inv(x, dim, eps);
    for (int64_t i = 0; i < dim; i++) y[i] = (x[i] * inv) * w[i];
}

/* norm_row on a bf16 row. A float32 scale `w` (Gemma's 1 + weight) multiplies before the one rounding;
 * a bf16 one (w_bf16: Llama's weight in a bf16 model) multiplies the normalized row rounded to bf16, as
 * torch's `weight * normalized.to(bf16)` does. */
static inline void norm_row_bf16(const uint16_t *x, const void *w, int w_bf16, uint16_t *y, int64_t dim,
                                 float eps) {
    float xf[dim];
    for (int64_t i = 0; i < dim; i++) xf[i] = bf16_load(x[i]);
    const float inv = norm_inv(xf, dim, eps);
    if (w_bf16) {
        const uint16_t *wb = w;
        for (int64_t i = 0; i < dim; i++) y[i] = bf16_store(bf16_load(bf16_store(xf[i] * inv)) * bf16_load(wb[i]));
    } else {
        const float *wf = w;
        for (int64_t i = 0; i < dim; i++) y[i] = bf16_store((xf[i] * inv) * wf[i]);
    }
}

void vq_rms_norm_bf16(const uint16_t *x, const void *w, int w_bf16, uint16_t *y, int64_t rows, int64_t dim,
                      float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) norm_row_bf16(x + r * dim, w, w_bf16, y + r * dim, dim, eps);
}

/* vq_add_rms_norm on bf16 rows, rounding where the modules' outputs and torch's bf16 add round; both
 * scales of one dtype (w_bf16). */
void vq_add_rms_norm_bf16(const uint16_t *x, const uint16_t *branch, const void *w_branch, const void *w_next,
                          int w_bf16, uint16_t *x_out, uint16_t *y, int64_t rows, int64_t dim, float eps,
                          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xo = x_out + r * dim;
        const uint16_t *b = branch + r * dim;
        if (w_branch) {
            norm_row_bf16(b, w_branch, w_bf16, xo, dim, eps);
            b = xo;
        }
        for (int64_t i = 0; i < dim; i++) xo[i] = bf16_store(bf16_load(x[r * dim + i]) + bf16_load(b[i]));
        if (w_next) norm_row_bf16(xo, w_next, w_bf16, y + r * dim, dim, eps);
    }
}

void vq_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * dim, w, y + r * dim, dim, eps);
}

/* A residual step in one pass: x_out = x + norm(branch) * w_branch (a sandwich layer's post-norm; w_branch
 * NULL: x + branch, a pre-norm layer's add), then (w_next not NULL) y = norm(x_out) * w_next, the next
 * branch's input. The same float operations as the norm kernel and torch's add, so the results are
 * bit-identical to those calls. */
void vq_add_rms_norm(const float *x, const float *branch, const float *w_branch, const float *w_next, float *x_out,
                     float *y, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *xo = x_out + r * dim;
        const float *b = branch + r * dim;
        if (w_branch) {
            norm_row(b, w_branch, xo, dim, eps);
            b = xo;
        }
        for (int64_t i = 0; i < dim; i++) xo[i] = x[r * dim + i] + b[i];
        if (w_next) norm_row(xo, w_next, y + r * dim, dim, eps);
    }
}

/* v rounded to bf16 and back where `bf16`: a bf16 kernel rounds each product and sum as torch's bf16 ops
 * do, so it gives the torch path's tensors (a constant 0 compiles to nothing in the float32 kernels). */
static inline float rounded(float v, int bf16) { return bf16 ? bf16_load(bf16_store(v)) : v; }

/* One head's rotation (torch's products and sums, each rounded to bf16 where `bf16`), for both dtypes. */
static inline void rotate_head(const float *v, const float *c, const float *s, float *o, int64_t dim, int64_t rot,
                               int interleaved, int bf16) {
    const int64_t half = rot / 2;
    if (interleaved) {
        for (int64_t i = 0; i < rot; i += 2) {
            o[i] = rounded(v[i] * c[i], bf16) + rounded((-v[i + 1]) * s[i], bf16);
            o[i + 1] = rounded(v[i + 1] * c[i + 1], bf16) + rounded(v[i] * s[i + 1], bf16);
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            o[i] = rounded(v[i] * c[i], bf16) + rounded((-v[i + half]) * s[i], bf16);
            o[i + half] = rounded(v[i + half] * c[i + half], bf16) + rounded(v[i] * s[i + half], bf16);
        }
    }
    for (int64_t i = rot; i < dim; i++) o[i] = v[i];
}

/* out [tokens, heads, dim] = x rotated: the first `rot` dims of every head turned by the angles of
 * cos/sin [tokens, rot] (already in the layout they apply to: halves repeated for rotate-half, pairs
 * repeated for interleaved), the rest copied. Rotate-half pairs dim i with i + rot/2, interleaved 2i
 * with 2i + 1. x may be a view with a row stride (q or k inside the fused qkv output). The products
 * and sums are torch's (x * cos + rotated * sin), so the result is bit-identical to the torch path.
 * norm_w not NULL: each head is first normalized as vq_rms_norm does with weight norm_w [dim] (q/k norm,
 * fused: at decode one call instead of two per tensor). norm_w2 not NULL: heads from norm_heads on take it
 * instead (q's heads, then k's right after them in x: both tensors' norms and rotations in one call). */
void vq_rope(const float *x, int64_t x_token_stride, const float *norm_w, const float *norm_w2, int64_t norm_heads,
             float eps, const float *cos, const float *sin, float *out, int64_t tokens, int64_t heads, int64_t dim,
             int64_t rot, int interleaved, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * dim > 65536)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * rot, *s = sin + t * rot;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = x + t * x_token_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
            float normed[norm_w ? dim : 1];  /* the normalized head, when norm_w is given */
            if (norm_w) {
                norm_row(v, norm_w2 && h >= norm_heads ? norm_w2 : norm_w, normed, dim, eps);
                v = normed;
            }
            rotate_head(v, c, s, o, dim, rot, interleaved, 0);
        }
    }
}

/* vq_rope on bf16 x, cos, sin and out: each head (normalized first and rounded to bf16, as the norm
 * module's output, when norm_w is given; w_bf16 as in norm_row_bf16, for both weights) rotated as torch's
 * bf16 ops do. */
void vq_rope_bf16(const uint16_t *x, int64_t x_token_stride, const void *norm_w, const void *norm_w2,
                  int64_t norm_heads, int w_bf16, float eps, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                  int64_t tokens, int64_t heads, int64_t dim, int64_t rot, int interleaved, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * dim > 65536)
    for (int64_t t = 0; t < tokens; t++) {
        float c[rot], s[rot], v[dim], o[dim];
        for (int64_t i = 0; i < rot; i++) {
            c[i] = bf16_load(cos[t * rot + i]);
            s[i] = bf16_load(sin[t * rot + i]);
        }
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *head = x + t * x_token_stride + h * dim;
            uint16_t normed[norm_w ? dim : 1];
            if (norm_w) {
                norm_row_bf16(head, norm_w2 && h >= norm_heads ? norm_w2 : norm_w, w_bf16, normed, dim, eps);
                head = normed;
            }
            for (int64_t i = 0; i < dim; i++) v[i] = bf16_load(head[i]);
            rotate_head(v, c, s, o, dim, rot, interleaved, 1);
            uint16_t *oh = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < dim; i++) oh[i] = bf16_store(o[i]);
        }
    }
}

/* Per row of x [rows, n]: the largest value (NaN if any entry is NaN) and the first index holding it
 * (the first NaN in a NaN row), as torch's amax and argmax give them, in one pass: each 64-value chunk's
 * max is vectorized and only the first chunk holding the row's max is scanned for its index. torch's
 * argmax tracks an index per element: ~5 ms for 64 rows of a 262k vocabulary. */
void vq_row_max(const float *x, int64_t rows, int64_t n, float *max_out, int64_t *index_out, int threads) {
    enum { CHUNK = 64 };
    /* rows split across threads; one row stays on this thread (a team would only wait at the barrier) */
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > 65536 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float best = -INFINITY;
        int64_t best_chunk = 0, nan_chunk = -1;
        for (int64_t start = 0; start < n && nan_chunk < 0; start += CHUNK) {
            const int64_t len = start + CHUNK <= n ? CHUNK : n - start;
            float lanes[16];
            int nan = 0;
            for (int j = 0; j < 16; j++) lanes[j] = -INFINITY;
            int64_t k = 0;
            for (; k + 16 <= len; k += 16)
                for (int j = 0; j < 16; j++) {
                    const float v = xr[start + k + j];
                    lanes[j] = v > lanes[j] ? v : lanes[j];
                    nan |= v != v;
                }
            float chunk_max = -INFINITY;
            for (; k < len; k++) {
                const float v = xr[start + k];
                chunk_max = v > chunk_max ? v : chunk_max;
                nan |= v != v;
            }
            for (int j = 0; j < 16; j++) chunk_max = lanes[j] > chunk_max ? lanes[j] : chunk_max;
            if (nan) nan_chunk = start;
            else if (chunk_max > best) { best = chunk_max; best_chunk = start; }
        }
        const int64_t from = nan_chunk >= 0 ? nan_chunk : best_chunk;
        int64_t found = from;  /* a row of only -inf: its first entry, as torch */
        for (int64_t k = from; k < n && k < from + CHUNK; k++)
            if (nan_chunk >= 0 ? xr[k] != xr[k] : xr[k] == best) { found = k; break; }
        max_out[r] = nan_chunk >= 0 ? NAN : best;
        index_out[r] = found;
    }
}

/* Per row of w [rows, n] (non-negative weights, any total): the token i whose cumulative interval
 * [W_<i, W_<=i) holds u[r] * total, u[r] uniform in [0, 1): token i comes with probability w_i / total
 * from one random number per row. (torch's exponential race draws one Exp(1) per entry: ~4 ms for a
 * 262k vocabulary, against ~0.05 ms for this pass.) The sums run in double per 64-entry chunk, stored,
 * so the scan for the target chunk sees the same partial sums as the total; within the chunk a rounding
 * miss falls back to its last positive entry (the row's, where u * total rounds up to the total), so a
 * zero-weight token is never returned. A row with no positive weight returns 0. */
void vq_sample_rows(const float *w, int64_t rows, int64_t n, const double *u, int64_t *out, int threads) {
    enum { CHUNK = 64 };
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(threads) if (rows * n > 65536 && rows > 1)
    {
        double *sums = malloc((size_t)chunks * sizeof(double));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *wr = w + r * n;
            double total = 0.0;
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t start = c * CHUNK, len = start + CHUNK <= n ? CHUNK : n - start;
                double lanes[16] = {0};
                int64_t k = 0;
                for (; k + 16 <= len; k += 16)
                    for (int j = 0; j < 16; j++) lanes[j] += (double)wr[start + k + j];
                double s = 0.0;
                for (; k < len; k++) s += (double)wr[start + k];
                for (int j = 0; j < 16; j++) s += lanes[j];
                sums[c] = s;
                total += s;
            }
            const double target = u[r] * total;
            double acc = 0.0;
            int64_t found = -1;
            for (int64_t c = 0; c < chunks; c++) {
                if (!(acc + sums[c] > target)) { acc += sums[c]; continue; }
                const int64_t start = c * CHUNK, end = start + CHUNK <= n ? start + CHUNK : n;
                found = -1;
                for (int64_t k = start; k < end && found < 0; k++) {
                    acc += (double)wr[k];
                    if (wr[k] > 0.0f && acc > target) found = k;
                }
                for (int64_t k = end - 1; found < 0 && k >= start; k--)
                    if (wr[k] > 0.0f) found = k;
                break;
            }
            for (int64_t k = n - 1; found < 0 && k >= 0; k--)  /* u * total rounded up to the total */
                if (wr[k] > 0.0f) found = k;
            out[r] = found < 0 ? 0 : found;
        }
        free(sums);
    }
}

/* e^x to ~1 ulp in branch-free float arithmetic the compiler vectorizes (Cephes' expf polynomial):
 * x rounded to n ln2 + r with |r| <= ln2/2, e^r by its polynomial, 2^n put in the exponent bits.
 * Overflow gives +inf and underflow 0 (results below the normal range are flushed), as the callers'
 * divisions want; NaN stays NaN. */
static inline float exp_vec(float x) {
    const float xc = x > 88.0f ? 88.0f : (x < -87.0f ? -87.0f : x);
    const float shifter = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to the nearest integer */
    const float n = (xc * 1.44269504088896341f + shifter) - shifter;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float er = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    const float y = er * scale.f;
    return x > 88.72283f ? INFINITY : (x < -87.33654f ? 0.0f : y);
}

/* out [rows, inter] = act(gate) * up for a fused gate_up [rows, 2 * inter]: the gated MLP's activation in
 * one pass instead of torch's split, activation and product (three passes over a 2048 x 4096 prefill
 * tensor). act 0: SiLU, g / (1 + e^-g). act 1: GELU's tanh form, written g / (1 + e^(-2u)) with
 * u = sqrt(2/pi) (g + 0.044715 g^3), which equals 0.5 g (1 + tanh u) without its cancellation for g < 0.
 * Results differ from torch's in the last bits (its exp/tanh are other approximations). */
static inline void gated_row(const float *g, const float *u, float *o, int64_t inter, int act, int bf16) {
    if (act == 0) {
        for (int64_t i = 0; i < inter; i++) o[i] = rounded(g[i] / (1.0f + exp_vec(-g[i])), bf16) * u[i];
    } else {
        for (int64_t i = 0; i < inter; i++) {
            const float x = g[i];
            const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
            o[i] = rounded(x / (1.0f + exp_vec(-2.0f * inner)), bf16) * u[i];
        }
    }
}

void vq_gated_act(const float *gate_up, float *out, int64_t rows, int64_t inter, int act, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++) gated_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter,
                                                 out + r * inter, inter, act, 0);
}

/* vq_gated_act on bf16 gate_up and out: the activation and the product each rounded to bf16, as torch's
 * bf16 ops round them. */
void vq_gated_act_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int act, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter > 32768)
    for (int64_t r = 0; r < rows; r++) {
        float row[2 * inter], o[inter];
        for (int64_t i = 0; i < 2 * inter; i++) row[i] = bf16_load(gate_up[r * 2 * inter + i]);
        gated_row(row, row + inter, o, inter, act, 1);
        for (int64_t i = 0; i < inter; i++) out[r * inter + i] = bf16_store(o[i]);
    }
}
