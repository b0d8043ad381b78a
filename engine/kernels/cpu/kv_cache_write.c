/* Scatter the step's new K/V rows into their cache slots (float32): one row copy per token
 * and K/V, straight from the qkv projection's output (rows row_stride floats apart).
 * Returns 0, or -(1 + t) when token t's slot is outside [0, num_slots): nothing from t on is
 * written. A negative slot is padding and is skipped. */
#include <stdint.h>
#include <string.h>

int64_t kv_cache_write_f32(float *key_cache, float *value_cache, int64_t num_slots,
                           const float *key, int64_t key_stride, const float *value,
                           int64_t value_stride, const int64_t *slots, int64_t num_tokens,
                           int64_t token_numel) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return -(1 + t);
        memcpy(key_cache + slot * token_numel, key + t * key_stride, token_numel * sizeof(float));
        memcpy(value_cache + slot * token_numel, value + t * value_stride,
               token_numel * sizeof(float));
    }
    return 0;
}
