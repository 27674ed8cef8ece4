/* Small per-token layer ops (RMSNorm, rotary) in one call each.
 *
 * At batch-1 decode these tensors are a few hundred floats: torch spends 10-15 us of dispatch on
 * the seven ops of an RMSNorm and the six of a rotary, ~100 times per token, against well under a
 * microsecond of arithmetic here. Float32, row-major, contiguous; every row independent, so large
 * inputs (prefill) split rows across threads.
 */
#include <math.h>
#include <stdint.h>

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w: `w` already holds Gemma's (1 + weight). The sum of
 * squares is accumulated in double so the result does not depend on the summation order (torch's
 * vectorized float reduction and this loop then agree to the last bit in nearly every row). */
void vq_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        double lanes[8] = {0};  /* independent chains: the loop vectorizes instead of waiting on one sum */
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8)
            for (int j = 0; j < 8; j++) lanes[j] += (double)xr[i + j] * (double)xr[i + j];
        double sum = 0.0;
        for (; i < dim; i++) sum += (double)xr[i] * (double)xr[i];
        for (int j = 0; j < 8; j++) sum += lanes[j];
        const float inv = 1.0f / sqrtf((float)(sum / (double)dim) + eps);
        for (i = 0; i < dim; i++) yr[i] = (xr[i] * inv) * w[i];
    }
}

/* out [tokens, heads, dim] = x rotated: the first `rot` dims of every head turned by the angles of
 * cos/sin [tokens, rot] (already in the layout they apply to: halves repeated for rotate-half, pairs
 * repeated for interleaved), the rest copied. Rotate-half pairs dim i with i + rot/2, interleaved 2i
 * with 2i + 1. x may be a view with a row stride (q or k inside the fused qkv output). The products
 * and sums are torch's (x * cos + rotated * sin), so the result is bit-identical to the torch path. */
void vq_rope(const float *x, int64_t x_token_stride, const float *cos, const float *sin, float *out,
             int64_t tokens, int64_t heads, int64_t dim, int64_t rot, int interleaved, int threads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * dim > 65536)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * rot, *s = sin + t * rot;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = x + t * x_token_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
            if (interleaved) {
                for (int64_t i = 0; i < rot; i += 2) {
                    o[i] = v[i] * c[i] + (-v[i + 1]) * s[i];
                    o[i + 1] = v[i + 1] * c[i + 1] + v[i] * s[i + 1];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    o[i] = v[i] * c[i] + (-v[i + half]) * s[i];
                    o[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
                }
            }
            for (int64_t i = rot; i < dim; i++) o[i] = v[i];
        }
    }
}
