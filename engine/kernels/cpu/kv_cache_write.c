/* Scatter the step's new K/V rows into their cache slots, straight from the qkv projection's
 * output (rows row_stride elements apart): into a float32 or bfloat16 cache one row copy per
 * token and K/V (the rows of the cache's type); into a quantized cache (float8 e4m3 or int8,
 * kv_elements.h) each KV head's float32 values divided by its scale and rounded as torch stores
 * them, bit for bit.
 * Returns 0, or -(1 + t) when token t's slot is outside [0, num_slots): nothing from t on is
 * written. A negative slot is padding and is skipped. */
#include <stdint.h>
#include <string.h>

#include "kv_elements.h"

/* Rows of token_numel elements of element_size bytes each, copied as they are. */
int64_t kv_cache_write_copy(char *key_cache, char *value_cache, int64_t num_slots, const char *key,
                            int64_t key_stride, const char *value, int64_t value_stride,
                            const int64_t *slots, int64_t num_tokens, int64_t token_numel,
                            int64_t element_size) {
    const int64_t row_bytes = token_numel * element_size;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return -(1 + t);
        memcpy(key_cache + slot * row_bytes, key + t * key_stride * element_size, row_bytes);
        memcpy(value_cache + slot * row_bytes, value + t * value_stride * element_size,
               row_bytes);
    }
    return 0;
}

/* One token's row of num_kv_heads * head_dim values into its slot's bytes, head h by scales[h]. */
static inline __attribute__((always_inline)) void quantize_row(
    uint8_t *restrict slot, const float *restrict row, const float *restrict scales,
    int64_t num_kv_heads, int64_t head_dim, int kind) {
    for (int64_t h = 0; h < num_kv_heads; h++) {
        const float scale = scales[h];
        uint8_t *restrict out = slot + h * head_dim;
        const float *restrict in = row + h * head_dim;
        if (kind == KV_FP8_E4M3)
            for (int64_t d = 0; d < head_dim; d++) out[d] = e4m3_from_float(in[d] / scale);
        else
            for (int64_t d = 0; d < head_dim; d++)
                out[d] = (uint8_t)int8_from_float(in[d] / scale);
    }
}

static inline __attribute__((always_inline)) int64_t write_quantized(
    uint8_t *key_cache, uint8_t *value_cache, int64_t num_slots, const float *key,
    int64_t key_stride, const float *value, int64_t value_stride, const int64_t *slots,
    int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, const float *scales, int kind) {
    const int64_t token_numel = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return -(1 + t);
        quantize_row(key_cache + slot * token_numel, key + t * key_stride, scales, num_kv_heads,
                     head_dim, kind);
        quantize_row(value_cache + slot * token_numel, value + t * value_stride,
                     scales + num_kv_heads, num_kv_heads, head_dim, kind);
    }
    return 0;
}

/* Into a quantized cache of ``kind`` (KV_FP8_E4M3 or KV_INT8) elements: scales is
 * [2][num_kv_heads] float32, the keys' per head, then the values'. */
int64_t kv_cache_write_quantized(uint8_t *key_cache, uint8_t *value_cache, int64_t num_slots,
                                 const float *key, int64_t key_stride, const float *value,
                                 int64_t value_stride, const int64_t *slots, int64_t num_tokens,
                                 int64_t num_kv_heads, int64_t head_dim, const float *scales,
                                 int64_t kind) {
    if (kind == KV_FP8_E4M3)
        return write_quantized(key_cache, value_cache, num_slots, key, key_stride, value,
                               value_stride, slots, num_tokens, num_kv_heads, head_dim, scales,
                               KV_FP8_E4M3);
    return write_quantized(key_cache, value_cache, num_slots, key, key_stride, value,
                           value_stride, slots, num_tokens, num_kv_heads, head_dim, scales,
                           KV_INT8);
}
