/* MXFP4 weights dequantized into float32 (engine/quantization/mxfp4_experts.py): each byte
 * holds two e2m1 weights, the even one in the low nibble, and each run of 32 weights (16
 * bytes) shares a scale byte, 2^(scale - 127). A weight is its e2m1 value times that power of
 * two, as transformers' ldexp computes it: exactly, rounded once to float32. For the bytes up
 * to 254 the power is a float32 and the product exact (subnormal ones included); the byte 255's
 * 2^128 is no float32, so its run is multiplied in double and rounded (to infinity, or for
 * +-0.5, to +-2^127). */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_GROUPS 4096

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* out[g * 32 + i] = e2m1(weight i of run g) * 2^(scales[g] - 127), for runs 0 .. groups - 1 */
void mxfp4_dequantize_f32(const uint8_t *blocks, const uint8_t *scales, float *out,
                          int64_t groups) {
#pragma omp parallel for schedule(static) if (groups >= PARALLEL_MIN_GROUPS)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *bytes = blocks + g * 16;
        float *row = out + g * 32;
        if (scales[g] == 255) {
            for (int j = 0; j < 16; j++) {
                row[2 * j] = (float)((double)E2M1[bytes[j] & 15] * 0x1p128);
                row[2 * j + 1] = (float)((double)E2M1[bytes[j] >> 4] * 0x1p128);
            }
            continue;
        }
        const float scale = ldexpf(1.0f, (int)scales[g] - 127);
        for (int j = 0; j < 16; j++) {
            row[2 * j] = E2M1[bytes[j] & 15] * scale;
            row[2 * j + 1] = E2M1[bytes[j] >> 4] * scale;
        }
    }
}
