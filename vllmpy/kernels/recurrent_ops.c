/* Decode-step updates of the recurrent layers (vllmpy/layers/mamba2.py, gated_delta_net.py, short_conv.py) for a
 * batch of rows, each reading and writing its own seat of the [seats, ...] state tensors in place.
 *
 * As torch ops a step gathers the rows' seats (index_select), widens them, builds the decayed state, adds the
 * write, reads the output and scatters the seats back: five or six passes over a state that is the layer's
 * largest tensor (a Granite-4.0-H-350M Mamba2 layer keeps 768 KiB per sequence), plus ~25 dispatches. Here each
 * (row, head) reads its state once and writes it once where it lies, with the gates (softplus, exp, sigmoid,
 * l2 norm) computed on the way. States are float32 or bf16 (rounded to nearest even on store, as torch's .to);
 * every other input is float32 with a row stride, so column slices of a fused projection pass as they are.
 * Portable C that the compiler vectorizes for the machine it is built on (-march=native); the one reduction
 * (Mamba2's C . state) has AVX-512 / AVX2 intrinsics under #if, since compilers keep a float sum in order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "half.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define PARALLEL_WORK 65536 /* below this many state values a thread wake-up costs more than it saves */

/* A state row of n values as float: the row itself (float32 states) or `tmp` filled from bf16. */
static inline float *row_in(void *state, int bf16, int64_t at, int64_t n, float *tmp) {
    if (!bf16) return (float *)state + at;
    const uint16_t *src = (const uint16_t *)state + at;
    for (int64_t i = 0; i < n; i++) tmp[i] = bf16_load(src[i]);
    return tmp;
}

/* Writes a row row_in handed out back to a bf16 state (float32 rows were updated in place). */
static inline void row_out(void *state, int bf16, int64_t at, int64_t n, const float *row) {
    if (!bf16) return;
    uint16_t *dst = (uint16_t *)state + at;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_store(row[i]);
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold 20 */

/* (a) Causal depthwise conv1d, one new input per row: x [rows, channels] (row stride x_stride), the seat's
 * window states[seat] [width - 1, channels] (the previous inputs, oldest first), weight [channels, width], bias
 * [channels] or NULL -> out [rows, channels] = sum_w weight[c, w] window'[w, c] + bias (SiLU applied when
 * silu), window' = (window, x); the seat keeps window'[1:]. */
void vq_conv_update(const float *x, int64_t x_stride, void *states, int state_bf16, const int64_t *seats,
                    const float *weight, const float *bias, float *out, int64_t rows, int64_t channels, int64_t width,
                    int silu, int threads) {
    const int64_t keep = width - 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * channels * width > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * channels;
        const int64_t base = seats[r] * keep * channels;
        float window[keep + 1];
        for (int64_t c = 0; c < channels; c++) {
            for (int64_t w = 0; w < keep; w++) {
                const int64_t at = base + w * channels + c;
                window[w] = state_bf16 ? bf16_load(((const uint16_t *)states)[at]) : ((const float *)states)[at];
            }
            window[keep] = xr[c];
            const float *wc = weight + c * width;
            float acc = 0.0f;
            for (int64_t w = 0; w < width; w++) acc += wc[w] * window[w];
            if (bias) acc += bias[c];
            o[c] = silu ? acc / (1.0f + expf(-acc)) : acc;
            for (int64_t w = 0; w < keep; w++) {
                const int64_t at = base + w * channels + c;
                if (state_bf16) ((uint16_t *)states)[at] = bf16_store(window[w + 1]);
                else ((float *)states)[at] = window[w + 1];
            }
        }
    }
}

/* s <- s * decay + xdt * b over n values, returning sum(s * c): one head-dim row of a Mamba2 state. */
static inline float ssm_row(float *s, const float *b, const float *c, float decay, float xdt, int64_t n) {
    int64_t i = 0;
    float sum;
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(decay), vx = _mm512_set1_ps(xdt);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        const __m512 s0 = _mm512_fmadd_ps(_mm512_loadu_ps(s + i), vd, _mm512_mul_ps(vx, _mm512_loadu_ps(b + i)));
        const __m512 s1 = _mm512_fmadd_ps(_mm512_loadu_ps(s + i + 16), vd,
                                          _mm512_mul_ps(vx, _mm512_loadu_ps(b + i + 16)));
        _mm512_storeu_ps(s + i, s0);
        _mm512_storeu_ps(s + i + 16, s1);
        acc0 = _mm512_fmadd_ps(s0, _mm512_loadu_ps(c + i), acc0);
        acc1 = _mm512_fmadd_ps(s1, _mm512_loadu_ps(c + i + 16), acc1);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vd = _mm256_set1_ps(decay), vx = _mm256_set1_ps(xdt);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m256 s0 = _mm256_fmadd_ps(_mm256_loadu_ps(s + i), vd, _mm256_mul_ps(vx, _mm256_loadu_ps(b + i)));
        const __m256 s1 = _mm256_fmadd_ps(_mm256_loadu_ps(s + i + 8), vd,
                                          _mm256_mul_ps(vx, _mm256_loadu_ps(b + i + 8)));
        _mm256_storeu_ps(s + i, s0);
        _mm256_storeu_ps(s + i + 8, s1);
        acc0 = _mm256_fmadd_ps(s0, _mm256_loadu_ps(c + i), acc0);
        acc1 = _mm256_fmadd_ps(s1, _mm256_loadu_ps(c + i + 8), acc1);
    }
    const __m256 v = _mm256_add_ps(acc0, acc1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    sum = _mm_cvtss_f32(h);
#else
    float lanes[8] = {0}; /* independent chains: the loop vectorizes instead of waiting on one sum */
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            s[i + j] = s[i + j] * decay + xdt * b[i + j];
            lanes[j] += s[i + j] * c[i + j];
        }
    sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; i < n; i++) {
        s[i] = s[i] * decay + xdt * b[i];
        sum += s[i] * c[i];
    }
    return sum;
}

/* (b) Mamba2's single-step SSM update. x [rows, heads * head_dim], b and c [rows, groups * d_state] (all three
 * with row stride in_stride: slices of the conv output), dt [rows, heads] (stride dt_stride, before the bias),
 * dt_bias, a_log, d_skip [heads]; per (row, head h of group h / (heads / groups)):
 * dt' = softplus(dt + dt_bias), S <- exp(-exp(a_log) dt') S + dt' x B^T, y = S C + D x -> y [rows, heads,
 * head_dim]; S = states[seat][h] [head_dim, d_state]. */
void vq_mamba2_step(const float *x, const float *b, const float *c, int64_t in_stride, const float *dt,
                    int64_t dt_stride, const float *dt_bias, const float *a_log, const float *d_skip, void *states,
                    int state_bf16, const int64_t *seats, float *y, int64_t rows, int64_t heads, int64_t head_dim,
                    int64_t groups, int64_t d_state, int threads) {
    const int64_t per_group = heads / groups, head_size = head_dim * d_state;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if (rows * heads * head_size > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const float step = softplus(dt[r * dt_stride + h] + dt_bias[h]);
            const float decay = expf(step * -expf(a_log[h]));
            const float *xh = x + r * in_stride + h * head_dim;
            const int64_t g = h / per_group;
            const float *bg = b + r * in_stride + g * d_state, *cg = c + r * in_stride + g * d_state;
            float *yh = y + (r * heads + h) * head_dim;
            const int64_t base = (seats[r] * heads + h) * head_size;
            float tmp[state_bf16 ? d_state : 1];
            for (int64_t p = 0; p < head_dim; p++) {
                float *s = row_in(states, state_bf16, base + p * d_state, d_state, tmp);
                yh[p] = ssm_row(s, bg, cg, decay, xh[p] * step, d_state) + d_skip[h] * xh[p];
                row_out(states, state_bf16, base + p * d_state, d_state, s);
            }
        }
}

/* x scaled by `scale` / sqrt(sum(x^2) + 1e-6) into out (FLA's l2norm). */
static inline void l2_normalized(const float *x, float *out, int64_t n, float scale) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += x[i + j] * x[i + j];
    float sum = 0.0f;
    for (; i < n; i++) sum += x[i] * x[i];
    for (int j = 0; j < 8; j++) sum += lanes[j];
    const float inv = 1.0f / sqrtf(sum + 1e-6f);
    for (i = 0; i < n; i++) out[i] = x[i] * inv * scale;
}

/* (c) The gated delta rule's single step (Qwen3.5 / Qwen3-Next). mixed [rows, (2 k_heads k_dim + v_heads v_dim)]
 * is the SiLU'd conv output [q | k | v] (row stride mixed_stride); a, b [rows, v_heads] the raw decay and
 * write-strength inputs (strides a_stride, b_stride); a_log, dt_bias [v_heads]. Per (row, value head h, key head
 * h / (v_heads / k_heads)): q = l2norm(q) scale, k = l2norm(k), g = -exp(a_log) softplus(a + dt_bias), beta =
 * sigmoid(b); with e = exp(g): delta = beta (v - e S^T k), out = e S^T q + (q . k) delta, S <- e S + k delta^T
 * (the same as S <- e S; S += k (beta (v - S^T k))^T; out = S^T q) -> out [rows, v_heads, v_dim];
 * S = states[seat][h] [k_dim, v_dim]. */
void vq_gated_delta_step(const float *mixed, int64_t mixed_stride, const float *a, int64_t a_stride, const float *b,
                         int64_t b_stride, const float *a_log, const float *dt_bias, void *states, int state_bf16,
                         const int64_t *seats, float *out, int64_t rows, int64_t k_heads, int64_t v_heads,
                         int64_t k_dim, int64_t v_dim, float scale, int threads) {
    const int64_t repeat = v_heads / k_heads, head_size = k_dim * v_dim, key_width = k_heads * k_dim;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if (rows * v_heads * head_size > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < v_heads; h++) {
            const float *row = mixed + r * mixed_stride, *v = row + 2 * key_width + h * v_dim;
            float q[k_dim], k[k_dim], read_k[v_dim], read_q[v_dim], delta[v_dim], tmp[state_bf16 ? v_dim : 1];
            l2_normalized(row + (h / repeat) * k_dim, q, k_dim, scale);
            l2_normalized(row + key_width + (h / repeat) * k_dim, k, k_dim, 1.0f);
            const float decay = expf(-expf(a_log[h]) * softplus(a[r * a_stride + h] + dt_bias[h]));
            const float beta = 1.0f / (1.0f + expf(-b[r * b_stride + h]));
            const int64_t base = (seats[r] * v_heads + h) * head_size;
            float qk = 0.0f;
            for (int64_t j = 0; j < v_dim; j++) read_k[j] = read_q[j] = 0.0f;
            for (int64_t i = 0; i < k_dim; i++) {
                const float *s = row_in(states, state_bf16, base + i * v_dim, v_dim, tmp);
                for (int64_t j = 0; j < v_dim; j++) {
                    read_k[j] += s[j] * k[i];
                    read_q[j] += s[j] * q[i];
                }
                qk += q[i] * k[i];
            }
            float *o = out + (r * v_heads + h) * v_dim;
            for (int64_t j = 0; j < v_dim; j++) {
                delta[j] = (v[j] - decay * read_k[j]) * beta;
                o[j] = decay * read_q[j] + qk * delta[j];
            }
            for (int64_t i = 0; i < k_dim; i++) {
                float *s = row_in(states, state_bf16, base + i * v_dim, v_dim, tmp);
                for (int64_t j = 0; j < v_dim; j++) s[j] = s[j] * decay + k[i] * delta[j];
                row_out(states, state_bf16, base + i * v_dim, v_dim, s);
            }
        }
}
