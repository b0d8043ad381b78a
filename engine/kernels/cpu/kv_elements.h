/* The KV cache's element types for the CPU kernels: float32, bfloat16 (a bfloat16 model's
 * cache: an element is read as the float32 of its bits, exactly), and the quantized float8
 * e4m3 and int8 of engine/kv_cache/kv_quantization.py, where a stored element q stands for
 * q * scale (one scale per KV head for K and one for V). Storing divides by the scale and
 * rounds as torch does, bit for bit: to e4m3 as ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``
 * (nearest, ties to even, subnormals included, NaN kept as NaN), to int8 as
 * ``x.round().clamp(-127, 127)`` (half to even). Reading gives a stored element's exact value,
 * the one torch reads (without the scale: the kernels apply it to a dot product or a sum). All
 * of it is plain arithmetic and bit moves that the compiler vectorises in a loop, but for rows
 * of e4m3, read 16 at a time through the CPU's float16 conversion where it has one (F16C with
 * AVX2; PDSERVE_PORTABLE_E4M3 defined turns it off, for tests). Included by the kernels' .c
 * files; build.py hashes this header into each library's build key. */
#ifndef PDSERVE_KV_ELEMENTS_H
#define PDSERVE_KV_ELEMENTS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX2__) && !defined(PDSERVE_PORTABLE_E4M3)
#define PDSERVE_E4M3_BY_FLOAT16 1
#include <immintrin.h>
#endif

/* the element type codes the kernels take (engine/kernels/cpu/kv_elements.py) */
#define KV_FLOAT32 0
#define KV_FP8_E4M3 1
#define KV_INT8 2
#define KV_BFLOAT16 3

static inline int64_t kv_element_size(int kind) {
    return kind == KV_FLOAT32 ? 4 : kind == KV_BFLOAT16 ? 2 : 1;
}

/* whether elements of ``kind`` stand for themselves times a scale (float8 e4m3, int8) */
static inline int kv_is_quantized(int kind) { return kind == KV_FP8_E4M3 || kind == KV_INT8; }

/* ``base`` (of ``kind`` elements) advanced by ``index`` elements */
static inline const void *kv_at(const void *base, int64_t index, int kind) {
    return (const char *)base + index * kv_element_size(kind);
}

static inline uint32_t float_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

static inline float bits_float(uint32_t bits) {
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* x's e4m3 byte after clamping to +-448: torch's (c10's fp8e4m3fn_from_fp32_value), whose
 * subnormal step rounds by a float addition where this multiplies by 2^9 and rounds to the
 * nearest integer (both exact, both ties to even). */
static inline uint8_t e4m3_from_float(float x) {
    x = x > 448.f ? 448.f : x; /* a comparison with NaN is false: NaN stays */
    x = x < -448.f ? -448.f : x;
    const uint32_t bits = float_bits(x);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    uint32_t byte;
    if (magnitude > 0x7F800000u) /* NaN */
        byte = 0x7Fu;
    else if (magnitude < (121u << 23)) /* below 2^-6: a subnormal of e4m3 (8 is 2^-6) */
        byte = (uint32_t)(int32_t)nearbyintf(bits_float(magnitude) * 512.f);
    else /* rebias the exponent, round the mantissa's low 20 bits to nearest even */
        byte = (magnitude + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((magnitude >> 20) & 1u)) >>
               20;
    return (uint8_t)(byte | sign);
}

/* x as int8: rounded half to even (the default rounding mode), clamped to +-127; NaN gives 0 */
static inline int8_t int8_from_float(float x) {
    float rounded = nearbyintf(x);
    rounded = rounded > 127.f ? 127.f : rounded;
    rounded = rounded < -127.f ? -127.f : rounded;
    return (int8_t)(rounded == rounded ? (int32_t)rounded : 0);
}

/* an e4m3 byte's value: a normal one's exponent rebiased into float32's, a subnormal one
 * (exponent field 0) its mantissa times 2^-9; 0x7F and 0xFF are NaN */
static inline float e4m3_value(uint8_t byte) {
    const uint32_t magnitude = byte & 0x7Fu;
    const float normal = bits_float((magnitude << 20) + (120u << 23));
    const float subnormal = (float)(int32_t)magnitude * 0x1p-9f;
    float value = magnitude < 8u ? subnormal : normal;
    value = magnitude == 0x7Fu ? NAN : value;
    return bits_float(float_bits(value) | (uint32_t)(byte & 0x80u) << 24);
}

/* element ``index`` of a quantized row (without its scale) */
static inline float kv_quantized_value(const void *row, int64_t index, int kind) {
    return kind == KV_FP8_E4M3 ? e4m3_value(((const uint8_t *)row)[index])
                               : (float)((const int8_t *)row)[index];
}

#ifdef PDSERVE_E4M3_BY_FLOAT16
/* 16 e4m3 bytes as floats through float16, whose conversion the CPU does in one instruction:
 * an e4m3 byte's sign, exponent and mantissa bits, moved into float16's places (exponent field
 * widened, bias 7 against 15), make a float16 of 2^-8 times its value (subnormals included:
 * float16's are exact in float32). The NaN bytes would make 1.875: they are set to NaN. */
static inline void e4m3_values16(const uint8_t *restrict bytes, float *restrict out) {
    __m128i packed;
    memcpy(&packed, bytes, sizeof packed);
    /* sign-extended, shifted by 7: the sign at bit 15 (and 14, cleared), the rest at 13..7 */
    __m256i halves = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(packed), 7),
                                      _mm256_set1_epi16((short)0xBF80));
    const __m256i nan = _mm256_cmpeq_epi16(
        _mm256_and_si256(halves, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x3F80));
    halves = _mm256_or_si256(halves, _mm256_and_si256(nan, _mm256_set1_epi16(0x7C00)));
    const __m256 scale = _mm256_set1_ps(256.f);
    const __m256 low = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), scale);
    const __m256 high = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), scale);
    memcpy(out, &low, sizeof low);
    memcpy(out + 8, &high, sizeof high);
}
#endif

/* n bfloat16 elements as floats: each one's bits are a float32's upper half (a loop the
 * compiler vectorises into widening moves and shifts) */
static inline void kv_widen_bfloat16_row(const uint16_t *restrict row, float *restrict out,
                                         int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bits_float((uint32_t)row[i] << 16);
}

/* n elements of a bfloat16 or quantized row as floats (a quantized one's without its scale) */
static inline void kv_row_as_floats(const void *restrict row, float *restrict out, int64_t n,
                                    int kind) {
    if (kind == KV_BFLOAT16) {
        kv_widen_bfloat16_row((const uint16_t *)row, out, n);
        return;
    }
    int64_t i = 0;
#ifdef PDSERVE_E4M3_BY_FLOAT16
    if (kind == KV_FP8_E4M3)
        for (; i + 16 <= n; i += 16) e4m3_values16((const uint8_t *)row + i, out + i);
#endif
    for (; i < n; i++) out[i] = kv_quantized_value(row, i, kind);
}

#endif
