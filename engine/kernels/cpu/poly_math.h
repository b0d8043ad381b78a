/* Vectorisable exp2 and tanh for the CPU attention kernels: plain arithmetic and bit moves that
 * the compiler turns into vector code inside a loop (libm's expf and tanhf are calls it cannot
 * vectorise). Included by the kernels' .c files; build.py hashes this header into each
 * library's build key, so a change here rebuilds them. */
#ifndef PDSERVE_POLY_MATH_H
#define PDSERVE_POLY_MATH_H

#include <math.h>
#include <stdint.h>

#define LOG2E 1.4426950408889634f

/* 2^x for x <= 128 (0 below -126, where no normal float is left): x = n + f with n the nearest
 * integer and |f| <= 0.5; 2^f by its Taylor series to degree 7 (truncation error < 1e-8). */
static inline float exp2_poly(float x) {
    const float clamped = x < -126.f ? -126.f : x;
    const float n = rintf(clamped);
    const float f = clamped - n;
    float p = 1.5252734e-5f;
    p = p * f + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.f;
    union {
        int32_t bits;
        float value;
    } scale = {.bits = ((int32_t)n + 127) << 23};
    return x < -126.f ? 0.f : p * scale.value;
}

/* tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2 |x|), through exp2_poly (vectorised, as
 * the softmax's exponentials are). Over every float32: within 1.12e-7 of tanh (glibc's tanhf is
 * within 1.04e-7), exactly odd, and exactly +-1 past |x| = 20. The error is absolute, not
 * relative: near 0, where tanh x ~ x, 1 - e loses x's low bits (below 1.5e-8, x gives 0). */
static inline float tanh_poly(float x) {
    const float e = exp2_poly(-2.f * LOG2E * fabsf(x));
    const float t = (1.f - e) / (1.f + e);
    return x < 0.f ? -t : t;
}

#endif
