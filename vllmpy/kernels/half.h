/* bfloat16 <-> float and fp16 -> float for the kernels' sources: bf16 by its bits (stores round to nearest
 * even, as torch's .to); fp16 F16C's instruction where the build has it, else an exact
 * portable conversion (the libraries are also built without -march=native). */
#ifndef VLLMPY_HALF_H
#define VLLMPY_HALF_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
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

static inline float bf16_load(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays a quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif
