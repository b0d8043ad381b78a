/* Decode attention on CPU, reading K/V in place from the paged cache (float32).
 *
 * One query token per sequence attends over the sequence's whole context, block by block
 * through its block table, with an online softmax (running max and sum per head), so no
 * block is ever copied out. The next block's K and V are prefetched while the current one
 * is computed: the kernel is bound by memory latency otherwise (blocks lie anywhere in the
 * cache). Single-threaded; the engine runs one step at a time on its own core.
 *
 * Layouts (all contiguous but the block table's rows):
 *   query, out    [num_seqs, num_heads, head_dim]
 *   key, value    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, table_stride] (the first ceil(seq_len / block_size) entries used)
 *   seq_lens      [num_seqs]
 * Returns 0, or -(1 + s) when sequence s has a length outside [1, capacity] or a block id
 * outside [0, num_blocks): nothing past that sequence is written.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void prefetch(const float *start, int64_t numel) {
    const char *bytes = (const char *)start;
    for (int64_t offset = 0; offset < numel * (int64_t)sizeof(float); offset += 64)
        __builtin_prefetch(bytes + offset, 0, 3);
}

static int64_t check_seq(const int64_t *table, int64_t seq_len, int64_t capacity,
                         int64_t block_size, int64_t num_blocks) {
    if (seq_len < 1 || seq_len > capacity) return 0;
    for (int64_t j = 0; j < (seq_len + block_size - 1) / block_size; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return 0;
    return 1;
}

static inline __attribute__((always_inline)) int64_t decode_f32(
    const float *query, const float *key, const float *value, const int64_t *block_tables,
    int64_t table_stride, const int64_t *seq_lens, float *out, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_numel = num_kv_heads * head_dim;
    const int64_t block_numel = block_size * token_numel;
    float *acc = malloc(sizeof(float) * num_heads * head_dim);
    float *maxes = malloc(sizeof(float) * num_heads);
    float *sums = malloc(sizeof(float) * num_heads);
    float *probs = malloc(sizeof(float) * num_heads * block_size);  /* [head][token] */
    int64_t status = (acc && maxes && sums && probs) ? 0 : -(1 + num_seqs);
    for (int64_t s = 0; s < num_seqs && status == 0; s++) {
        const int64_t *table = block_tables + s * table_stride;
        const int64_t seq_len = seq_lens[s];
        if (!check_seq(table, seq_len, table_stride * block_size, block_size, num_blocks)) {
            status = -(1 + s);
            break;
        }
        const float *q = query + s * num_heads * head_dim;
        for (int64_t i = 0; i < num_heads * head_dim; i++) acc[i] = 0.f;
        for (int64_t h = 0; h < num_heads; h++) {
            maxes[h] = -INFINITY;
            sums[h] = 0.f;
        }
        prefetch(key + table[0] * block_numel, block_numel);
        prefetch(value + table[0] * block_numel, block_numel);
        for (int64_t start = 0, j = 0; start < seq_len; start += block_size, j++) {
            const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
            const float *k_block = key + table[j] * block_numel;
            const float *v_block = value + table[j] * block_numel;
            if (start + block_size < seq_len) {
                prefetch(key + table[j + 1] * block_numel, block_numel);
                prefetch(value + table[j + 1] * block_numel, block_numel);
            }
            for (int64_t t = 0; t < n; t++)
                for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; kv_head++) {
                    const float *k = k_block + t * token_numel + kv_head * head_dim;
                    for (int64_t g = 0; g < group; g++, h++)
                        probs[h * block_size + t] = scale * dot(q + h * head_dim, k, head_dim);
                }
            for (int64_t h = 0; h < num_heads; h++) {
                float *p = probs + h * block_size;
                float block_max = maxes[h];
                for (int64_t t = 0; t < n; t++) block_max = p[t] > block_max ? p[t] : block_max;
                const float correction = expf(maxes[h] - block_max);  /* 0 on the first block */
                float sum = sums[h] * correction;
                for (int64_t t = 0; t < n; t++) {
                    p[t] = expf(p[t] - block_max);
                    sum += p[t];
                }
                maxes[h] = block_max;
                sums[h] = sum;
                if (correction != 1.f) {
                    float *a = acc + h * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) a[d] *= correction;
                }
            }
            for (int64_t t = 0; t < n; t++)
                for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; kv_head++) {
                    const float *v = v_block + t * token_numel + kv_head * head_dim;
                    for (int64_t g = 0; g < group; g++, h++) {
                        const float p = probs[h * block_size + t];
                        float *a = acc + h * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
                    }
                }
        }
        float *o = out + s * num_heads * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            const float inverse = 1.f / sums[h];
            for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] = acc[h * head_dim + d] * inverse;
        }
    }
    free(acc);
    free(maxes);
    free(sums);
    free(probs);
    return status;
}

/* The exported entry: the common head sizes get a copy of the body compiled for that size
 * (loops over head_dim fully unrolled and vectorised), others the general one. */
int64_t paged_decode_attention_f32(
    const float *query, const float *key, const float *value, const int64_t *block_tables,
    int64_t table_stride, const int64_t *seq_lens, float *out, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, float scale) {
#define DECODE(HEAD_DIM)                                                                     \
    decode_f32(query, key, value, block_tables, table_stride, seq_lens, out, num_seqs,      \
               num_heads, num_kv_heads, HEAD_DIM, block_size, num_blocks, scale)
    switch (head_dim) {
    case 64: return DECODE(64);
    case 128: return DECODE(128);
    default: return DECODE(head_dim);
    }
#undef DECODE
}
