/* Sixteen floats in one vector for the CPU attention kernels (GCC's vector extension), the sum
 * of four such vectors' lanes at once, and dot products of query rows with four keys. Included
 * by the kernels' .c files; build.py hashes this header into each library's build key. */
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

/* p[r * stride + i] = q[r] . k_i (i < 4): ``rows`` query rows (head_dim floats each, one after
 * the other) against four keys, four rows by four keys at a time, sixteen vectors of partial
 * sums summed across their lanes at the end (sum4x16), the rows left over one at a time;
 * head_dim a multiple of 16. */
static inline __attribute__((always_inline)) void dots_of_four_keys(
    const float *restrict q, int64_t rows, const float *k0, const float *k1, const float *k2,
    const float *k3, float *restrict p, int64_t stride, int64_t head_dim) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *q0 = q + r * head_dim, *q1 = q0 + head_dim, *q2 = q1 + head_dim,
                    *q3 = q2 + head_dim;
        vec16 s00 = {0}, s01 = {0}, s02 = {0}, s03 = {0}, s10 = {0}, s11 = {0}, s12 = {0},
              s13 = {0}, s20 = {0}, s21 = {0}, s22 = {0}, s23 = {0}, s30 = {0}, s31 = {0},
              s32 = {0}, s33 = {0};
        for (int64_t d = 0; d < head_dim; d += 16) {
            const vec16 a = load16(k0 + d), b = load16(k1 + d), c = load16(k2 + d),
                        e = load16(k3 + d);
            vec16 x = load16(q0 + d);
            s00 += x * a, s01 += x * b, s02 += x * c, s03 += x * e;
            x = load16(q1 + d);
            s10 += x * a, s11 += x * b, s12 += x * c, s13 += x * e;
            x = load16(q2 + d);
            s20 += x * a, s21 += x * b, s22 += x * c, s23 += x * e;
            x = load16(q3 + d);
            s30 += x * a, s31 += x * b, s32 += x * c, s33 += x * e;
        }
        sum4x16(s00, s01, s02, s03, p + r * stride);
        sum4x16(s10, s11, s12, s13, p + (r + 1) * stride);
        sum4x16(s20, s21, s22, s23, p + (r + 2) * stride);
        sum4x16(s30, s31, s32, s33, p + (r + 3) * stride);
    }
    for (; r < rows; r++) { /* the heads left over, one at a time */
        const float *x = q + r * head_dim;
        vec16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int64_t d = 0; d < head_dim; d += 16) {
            const vec16 xd = load16(x + d);
            s0 += xd * load16(k0 + d), s1 += xd * load16(k1 + d);
            s2 += xd * load16(k2 + d), s3 += xd * load16(k3 + d);
        }
        sum4x16(s0, s1, s2, s3, p + r * stride);
    }
}

#endif
