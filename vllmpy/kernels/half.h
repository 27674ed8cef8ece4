/* fp16 -> float for the kernels' sources: F16C's instruction where the build has it, else an exact
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

#endif
