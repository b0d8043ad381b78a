/* Sixteen floats in one vector for the CPU attention kernels (GCC's vector extension), and the
 * sum of four such vectors' lanes at once. Included by the kernels' .c files; build.py hashes
 * this header into each library's build key. */
#ifndef PDSERVE_VEC16_H
#define PDSERVE_VEC16_H

#include <stdint.h>
#include <string.h>

/* Sixteen floats in one vector (GCC's vector extension: one AVX-512 register, or two AVX2
 * ones). Loads and stores go through memcpy, which makes them unaligned-safe. */
typedef float vec16 __attribute__((vector_size(64)));

static inline vec16 load16(const float *p) {
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, vec16 v) { memcpy(p, &v, sizeof v); }

typedef int32_t lanes16 __attribute__((vector_size(64)));

/* out[0:4] = the sums of a's, b's, c's and d's sixteen lanes, by halving them together: four
 * sums of sixteen in ten shuffles and five adds. */
static inline void sum4x16(vec16 a, vec16 b, vec16 c, vec16 d, float *out) {
    const lanes16 low = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const lanes16 high = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vec16 ab = __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
    const vec16 cd = __builtin_shuffle(c, d, low) + __builtin_shuffle(c, d, high);
    /* ab: a's eight partial sums then b's; cd: c's then d's */
    const lanes16 even = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const lanes16 odd = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    vec16 x = __builtin_shuffle(ab, cd, even) + __builtin_shuffle(ab, cd, odd);
    /* x: four partial sums each of a, b, c, d */
    const lanes16 pairs = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    x += __builtin_shuffle(x, pairs);
    const lanes16 neighbours = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    x += __builtin_shuffle(x, neighbours);
    out[0] = x[0], out[1] = x[4], out[2] = x[8], out[3] = x[12];
}

#endif
