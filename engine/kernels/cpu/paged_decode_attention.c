/* Decode attention on CPU, reading K/V in place from the paged cache: float32, bfloat16, or
 * float8 e4m3 or int8 elements with a float32 scale per KV head for K and one for V
 * (kv_elements.h).
 *
 * One query token per sequence attends over the sequence's context, block by block through
 * its block table, with an online softmax (running max and sum per head), so no block is ever
 * copied out. With a sliding window W (``sliding_window`` > 0) the query, at position
 * seq_len - 1, sees only positions from seq_len - W on: the walk starts there, so the blocks
 * wholly before it are neither read nor checked (their table entries may hold anything). With
 * a logit soft-cap c (``logit_softcap`` > 0) each logit scale * q . k becomes c tanh(logit / c)
 * (tanh_poly of poly_math.h: within c * 1.12e-7 of it, and vectorised over a block's logits);
 * with attention sinks (``sinks`` not NULL) head h's logit sinks[h] joins its softmax's
 * denominator as a position with no value, seen first (the running max starts at it, the sum
 * at 1). The next block's K and V are prefetched while the current one is computed: the
 * kernel is bound by memory latency otherwise (blocks lie anywhere in the cache). Sequences are
 * shared out over ``num_threads`` OpenMP threads (the engine's torch threads): one core
 * reaches a fraction of the memory bandwidth (about 14 of 50-70 GB/s on the 2-core EPYC), so
 * a second thread nearly halves the time.
 *
 * On a float32 or bfloat16 cache with head_dim a multiple of 16 (attend_blocked) a block is
 * computed four positions at a time, every KV head of them (their rows lie together: walking
 * one KV head's rows down a block, a page apart each, stalled on the cache's misses): each KV
 * head's query heads' scores against four keys at once, four heads by four keys of vector
 * partial sums (no horizontal sum per dot product), the block's softmax in base 2 with
 * poly_math.h's vectorised exp2, then the values four query heads at a time per V row loaded;
 * a bfloat16 block is widened to float32 into scratch first. 1.3-1.45x the row-by-row walk's
 * speed at 32 query heads of 128 over 8 KV heads (one core, the 2-core Xeon; session 71).
 *
 * Otherwise a bfloat16 or quantized cache's elements are read as floats row by row (a K or V
 * row of one KV head, into a head_dim buffer the group's query heads share; everything after is
 * float32 arithmetic, as for a float32 cache), and a quantized cache's scales are applied where
 * they factor out: K's to each logit (scale * k_scale * q . k), V's to the output
 * (v_scale * sum_t p_t v_t / sum_t p_t), one rounding each. It reads a quarter of a float32
 * cache's bytes for the same context.
 *
 * Layouts (all contiguous but the block table's rows):
 *   query, out    [num_seqs, num_heads, head_dim]
 *   key, value    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, table_stride] (the first ceil(seq_len / block_size) entries used,
 *                 from the window's first block on)
 *   seq_lens      [num_seqs]
 *   sinks         [num_heads], or NULL
 *   kv_scales     [2][num_kv_heads] (K's, then V's) for a quantized cache, or NULL
 * Returns 0, or -(1 + s) when sequence s has a length outside [1, capacity] or a block id
 * outside [0, num_blocks) among those it reads (nothing is written then), or -(1 + num_seqs)
 * when scratch memory ran out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_elements.h"
#include "poly_math.h"
#include "vec16.h"

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void prefetch(const void *start, int64_t num_bytes) {
    const char *bytes = (const char *)start;
    for (int64_t offset = 0; offset < num_bytes; offset += 64)
        __builtin_prefetch(bytes + offset, 0, 3);
}

/* A walk's running state before its first block: no output, and each head's max and sum at no
 * position, or at its sink (a position seen before the first: its logit, times ``sink_scale``
 * for base-2 logits, and a sum of 1). */
static inline void start_walk(float *restrict acc, float *restrict maxes, float *restrict sums,
                              int64_t num_heads, int64_t head_dim, const float *sinks,
                              float sink_scale) {
    for (int64_t i = 0; i < num_heads * head_dim; i++) acc[i] = 0.f;
    for (int64_t h = 0; h < num_heads; h++) {
        maxes[h] = sinks ? sinks[h] * sink_scale : -INFINITY;
        sums[h] = sinks ? 1.f : 0.f;
    }
}

/* Block ``block``'s K and V on their way into the CPU's caches. */
static inline void prefetch_block(const void *key, const void *value, int64_t block,
                                  int64_t block_numel, int kind) {
    const int64_t block_bytes = block_numel * kv_element_size(kind);
    prefetch(kv_at(key, block * block_numel, kind), block_bytes);
    prefetch(kv_at(value, block * block_numel, kind), block_bytes);
}

/* The first position a query at position seq_len - 1 sees: 0, or its window's start. */
static inline int64_t window_start(int64_t seq_len, int64_t sliding_window) {
    return sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
}

static int64_t check_seq(const int64_t *table, int64_t seq_len, int64_t capacity,
                         int64_t block_size, int64_t num_blocks, int64_t sliding_window) {
    if (seq_len < 1 || seq_len > capacity) return 0;
    const int64_t first_block = window_start(seq_len, sliding_window) / block_size;
    for (int64_t j = first_block; j < (seq_len + block_size - 1) / block_size; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return 0;
    return 1;
}

/* Scratch for one thread: running output, max and sum per head, a block's probabilities and
 * each head's rescaling of its running output, one K or V row of a quantized cache read as
 * floats, and a block of a bfloat16 cache's K and V read as floats (NULL for other caches). */
typedef struct {
    float *acc;         /* [num_heads][head_dim] */
    float *maxes;       /* [num_heads] */
    float *sums;        /* [num_heads] */
    float *probs;       /* [num_heads][block_size] */
    float *corrections; /* [num_heads] */
    float *row;         /* [head_dim] */
    float *k_block;     /* [block_size][num_kv_heads][head_dim] (bfloat16 caches) */
    float *v_block;     /* [block_size][num_kv_heads][head_dim] (bfloat16 caches) */
} scratch_t;

static int scratch_alloc(scratch_t *scratch, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int kind) {
    const int64_t block_numel = kind == KV_BFLOAT16 ? block_size * num_kv_heads * head_dim : 0;
    scratch->acc = malloc(sizeof(float) * num_heads * head_dim);
    scratch->maxes = malloc(sizeof(float) * num_heads);
    scratch->sums = malloc(sizeof(float) * num_heads);
    scratch->probs = malloc(sizeof(float) * num_heads * block_size);
    scratch->corrections = malloc(sizeof(float) * num_heads);
    scratch->row = malloc(sizeof(float) * head_dim);
    scratch->k_block = block_numel ? malloc(sizeof(float) * block_numel) : NULL;
    scratch->v_block = block_numel ? malloc(sizeof(float) * block_numel) : NULL;
    return scratch->acc && scratch->maxes && scratch->sums && scratch->probs &&
           scratch->corrections && scratch->row &&
           (!block_numel || (scratch->k_block && scratch->v_block));
}

static void scratch_free(scratch_t *scratch) {
    free(scratch->acc);
    free(scratch->maxes);
    free(scratch->sums);
    free(scratch->probs);
    free(scratch->corrections);
    free(scratch->row);
    free(scratch->k_block);
    free(scratch->v_block);
}

/* Sequence s's query attends over its context from position ``first`` on; its row of ``out``
 * is written. ``softcap``: 0, or the logits' soft-cap; ``sinks``: NULL, or a logit per head;
 * ``kind``: the cache's element type (KV_*), ``kv_scales`` a quantized one's. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *key, const void *value, const int64_t *table, int64_t seq_len,
    int64_t first, float *o, const scratch_t *scratch, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float softcap, const float *sinks,
    int kind, const float *kv_scales) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_numel = num_kv_heads * head_dim;
    const int64_t block_numel = block_size * token_numel;
    /* restrict: the compiler vectorises the head_dim loops only knowing these never overlap */
    float *restrict acc = scratch->acc, *restrict maxes = scratch->maxes;
    float *restrict sums = scratch->sums, *restrict probs = scratch->probs;
    float *restrict row = scratch->row;
    start_walk(acc, maxes, sums, num_heads, head_dim, sinks, 1.f);
    const int64_t first_block = first / block_size;
    prefetch_block(key, value, table[first_block], block_numel, kind);
    /* block j holds the walk's positions [start, end): from ``first`` on in the first block */
    for (int64_t j = first_block, start = first; start < seq_len; start = ++j * block_size) {
        const int64_t end = (j + 1) * block_size < seq_len ? (j + 1) * block_size : seq_len;
        const int64_t n = end - start;
        const int64_t offset = table[j] * block_numel + (start - j * block_size) * token_numel;
        const void *k_block = kv_at(key, offset, kind);
        const void *v_block = kv_at(value, offset, kind);
        if (end < seq_len) prefetch_block(key, value, table[j + 1], block_numel, kind);
        for (int64_t t = 0; t < n; t++)
            for (int64_t kv_head = 0, h = 0; kv_head < num_kv_heads; kv_head++) {
                const void *k = kv_at(k_block, t * token_numel + kv_head * head_dim, kind);
                if (kind == KV_FLOAT32) {
                    for (int64_t g = 0; g < group; g++, h++)
                        probs[h * block_size + t] = scale * dot(q + h * head_dim, k, head_dim);
                } else {
                    const float logit_scale =
                        kv_is_quantized(kind) ? scale * kv_scales[kv_head] : scale;
                    kv_row_as_floats(k, row, head_dim, kind);
                    for (int64_t g = 0; g < group; g++, h++)
                        probs[h * block_size + t] =
                            logit_scale * dot(q + h * head_dim, row, head_dim);
                }
            }
        for (int64_t h = 0; h < num_heads; h++) {
            float *p = probs + h * block_size;
            if (softcap > 0.f) /* a loop of its own, so that it is vectorised */
                for (int64_t t = 0; t < n; t++) p[t] = softcap * tanh_poly(p[t] / softcap);
            float block_max = maxes[h];
            for (int64_t t = 0; t < n; t++) block_max = p[t] > block_max ? p[t] : block_max;
            /* 0 on the first block without a sink */
            const float correction = expf(maxes[h] - block_max);
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
                const void *stored = kv_at(v_block, t * token_numel + kv_head * head_dim, kind);
                const float *v = stored;
                if (kind != KV_FLOAT32) {
                    kv_row_as_floats(stored, row, head_dim, kind);
                    v = row;
                }
                for (int64_t g = 0; g < group; g++, h++) {
                    const float p = probs[h * block_size + t];
                    float *a = acc + h * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
                }
            }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inverse =
            kv_is_quantized(kind) ? kv_scales[num_kv_heads + h / group] / sums[h] : 1.f / sums[h];
        for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] = acc[h * head_dim + d] * inverse;
    }
}

/* acc[r] += sum_t p[r * stride + t] v_t for the ``rows`` query heads of one KV head, its n
 * value rows v_t ``v_stride`` floats apart: four heads at a time share each load of a V row; a
 * head left over alone takes its keys two at a time into two sums (two chains of additions, not
 * one). head_dim a multiple of 16. */
static inline __attribute__((always_inline)) void values_of_block(
    float *restrict acc, const float *restrict p, int64_t stride, int64_t rows, const float *v,
    int64_t v_stride, int64_t n, int64_t head_dim) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
        for (int64_t d = 0; d < head_dim; d += 16) {
            float *a = acc + r * head_dim + d;
            const float *pr = p + r * stride;
            vec16 a0 = load16(a), a1 = load16(a + head_dim);
            vec16 a2 = load16(a + 2 * head_dim), a3 = load16(a + 3 * head_dim);
            for (int64_t t = 0; t < n; t++) {
                const vec16 vt = load16(v + t * v_stride + d);
                a0 += pr[t] * vt, a1 += pr[stride + t] * vt;
                a2 += pr[2 * stride + t] * vt, a3 += pr[3 * stride + t] * vt;
            }
            store16(a, a0), store16(a + head_dim, a1);
            store16(a + 2 * head_dim, a2), store16(a + 3 * head_dim, a3);
        }
    for (; r < rows; r++)
        for (int64_t d = 0; d < head_dim; d += 16) {
            float *a = acc + r * head_dim + d;
            const float *pr = p + r * stride;
            vec16 even = load16(a), odd = {0};
            int64_t t = 0;
            for (; t + 2 <= n; t += 2) {
                even += pr[t] * load16(v + t * v_stride + d);
                odd += pr[t + 1] * load16(v + (t + 1) * v_stride + d);
            }
            if (t < n) even += pr[t] * load16(v + t * v_stride + d);
            store16(a, even + odd);
        }
}

/* ``attend`` on a float32 or bfloat16 cache, head_dim a multiple of 16, a block at a time: the
 * block's scores of each KV head's query heads four keys at a time (dots_of_four_keys), its
 * softmax in base 2 with the vectorised exp2 of poly_math.h, its values four heads at a time
 * (values_of_block). A bfloat16 block's K and V are widened to float32 first, into scratch,
 * so both caches run the same arithmetic. Soft-cap and sinks as ``attend``. */
static inline __attribute__((always_inline)) void attend_blocked(
    const float *q, const void *key, const void *value, const int64_t *table, int64_t seq_len,
    int64_t first, float *o, const scratch_t *scratch, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float softcap, const float *sinks,
    int kind) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_numel = num_kv_heads * head_dim;
    const int64_t block_numel = block_size * token_numel;
    float *restrict acc = scratch->acc, *restrict maxes = scratch->maxes;
    float *restrict sums = scratch->sums, *restrict probs = scratch->probs;
    float *restrict corrections = scratch->corrections;
    const float logit_scale = scale * LOG2E;     /* logits in base 2 */
    const float softcap_log2 = softcap * LOG2E; /* the cap in base-2 units */
    start_walk(acc, maxes, sums, num_heads, head_dim, sinks, LOG2E);
    const int64_t first_block = first / block_size;
    prefetch_block(key, value, table[first_block], block_numel, kind);
    for (int64_t j = first_block, start = first; start < seq_len; start = ++j * block_size) {
        const int64_t end = (j + 1) * block_size < seq_len ? (j + 1) * block_size : seq_len;
        const int64_t n = end - start;
        const int64_t offset = table[j] * block_numel + (start - j * block_size) * token_numel;
        const float *k_block, *v_block;
        if (kind == KV_BFLOAT16) {
            kv_widen_bfloat16_row((const uint16_t *)key + offset, scratch->k_block,
                                  n * token_numel);
            kv_widen_bfloat16_row((const uint16_t *)value + offset, scratch->v_block,
                                  n * token_numel);
            k_block = scratch->k_block, v_block = scratch->v_block;
        } else {
            k_block = (const float *)key + offset, v_block = (const float *)value + offset;
        }
        if (end < seq_len) prefetch_block(key, value, table[j + 1], block_numel, kind);
        /* four positions at a time, every KV head of them (their rows lie together) */
        int64_t t = 0;
        for (; t + 4 <= n; t += 4)
            for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
                const float *k = k_block + t * token_numel + kv_head * head_dim;
                dots_of_four_keys(q + kv_head * group * head_dim, group, k, k + token_numel,
                                    k + 2 * token_numel, k + 3 * token_numel,
                                    probs + kv_head * group * block_size + t, block_size,
                                    head_dim);
            }
        if (t < n) /* the last keys, the first of them standing in for the missing ones */
            for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
                const float *k0 = k_block + t * token_numel + kv_head * head_dim;
                const float *k1 = t + 1 < n ? k0 + token_numel : k0;
                const float *k2 = t + 2 < n ? k0 + 2 * token_numel : k0;
                for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
                    float last[4];
                    dots_of_four_keys(q + h * head_dim, 1, k0, k1, k2, k0, last, 0, head_dim);
                    for (int64_t i = 0; t + i < n; i++) probs[h * block_size + t + i] = last[i];
                }
            }
        for (int64_t h = 0; h < num_heads; h++) {
            float *p = probs + h * block_size;
            for (int64_t t = 0; t < n; t++) p[t] *= logit_scale;
            if (softcap > 0.f) /* a loop of its own, so that it is vectorised */
                for (int64_t t = 0; t < n; t++)
                    p[t] = softcap_log2 * tanh_poly(p[t] / softcap_log2);
            float block_max = maxes[h];
            for (int64_t t = 0; t < n; t++) block_max = p[t] > block_max ? p[t] : block_max;
            float sum = 0.f;
            for (int64_t t = 0; t < n; t++) {
                p[t] = exp2_poly(p[t] - block_max);
                sum += p[t];
            }
            /* 0 on the first block without a sink */
            corrections[h] = exp2_poly(maxes[h] - block_max);
            maxes[h] = block_max;
            sums[h] = sums[h] * corrections[h] + sum;
        }
        for (int64_t h = 0; h < num_heads; h++) /* 0 on the first block without a sink */
            if (corrections[h] != 1.f)
                for (int64_t d = 0; d < head_dim; d++) acc[h * head_dim + d] *= corrections[h];
        /* four positions at a time, every KV head of them */
        for (int64_t t = 0; t < n; t += 4)
            for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++) {
                const int64_t h = kv_head * group;
                values_of_block(acc + h * head_dim, probs + h * block_size + t, block_size, group,
                                v_block + t * token_numel + kv_head * head_dim, token_numel,
                                n - t < 4 ? n - t : 4, head_dim);
            }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inverse = 1.f / sums[h];
        for (int64_t d = 0; d < head_dim; d++)
            o[h * head_dim + d] = acc[h * head_dim + d] * inverse;
    }
}

/* ``attend`` compiled for the common head sizes (loops over head_dim fully unrolled and
 * vectorised), the general one for others; on a float32 cache each for a walk from position 0
 * (no window, or one the context fits in: the code of a kernel without windows) and from a
 * window's start, both without soft-cap or sinks (the code of a kernel without them), and for
 * any walk with them; on a bfloat16 cache the same three; on a quantized cache (float8 e4m3,
 * int8) for any walk (fewer copies of the code to build). The choice is made per sequence,
 * inside the parallel loop: a constant head_dim passed into an OpenMP region reaches it as a
 * variable. */
static void attend_any(const float *q, const void *key, const void *value,
                       const int64_t *table, int64_t seq_len, int64_t first, float *o,
                       const scratch_t *scratch, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, float scale, float softcap,
                       const float *sinks, int kind, const float *kv_scales) {
#define ATTEND(HEAD_DIM, FIRST, SOFTCAP, SINKS, KIND)                                        \
    attend(q, key, value, table, seq_len, FIRST, o, scratch, num_heads, num_kv_heads,       \
           HEAD_DIM, block_size, scale, SOFTCAP, SINKS, KIND, kv_scales)
/* a walk (ATTEND or BLOCKED) from position 0 or from ``first``, with soft-cap and sinks or not */
#define FROM_FIRST(WALK, HEAD_DIM, KIND)                                                     \
    if (softcap > 0.f || sinks)                                                              \
        WALK(HEAD_DIM, first, softcap, sinks, KIND);                                         \
    else if (first == 0)                                                                     \
        WALK(HEAD_DIM, 0, 0.f, NULL, KIND);                                                  \
    else                                                                                     \
        WALK(HEAD_DIM, first, 0.f, NULL, KIND)
#define ATTEND_OF_HEAD_DIM(HEAD_DIM_CASE)                                                    \
    switch (head_dim) {                                                                      \
    case 64: HEAD_DIM_CASE(64); break;                                                       \
    case 128: HEAD_DIM_CASE(128); break;                                                     \
    default: HEAD_DIM_CASE(head_dim);                                                        \
    }
#define BLOCKED(HEAD_DIM, FIRST, SOFTCAP, SINKS, KIND)                                       \
    attend_blocked(q, key, value, table, seq_len, FIRST, o, scratch, num_heads, num_kv_heads, \
                   HEAD_DIM, block_size, scale, SOFTCAP, SINKS, KIND)
#define FLOAT32_CASE(HEAD_DIM)                                                               \
    if (head_dim % 16 == 0) {                                                                \
        FROM_FIRST(BLOCKED, HEAD_DIM, KV_FLOAT32);                                            \
    } else {                                                                                 \
        FROM_FIRST(ATTEND, HEAD_DIM, KV_FLOAT32);                                             \
    }
#define BFLOAT16_CASE(HEAD_DIM)                                                              \
    if (head_dim % 16 == 0) {                                                                \
        FROM_FIRST(BLOCKED, HEAD_DIM, KV_BFLOAT16);                                           \
    } else {                                                                                 \
        ATTEND(HEAD_DIM, first, softcap, sinks, KV_BFLOAT16);                                \
    }
#define FP8_E4M3_CASE(HEAD_DIM) ATTEND(HEAD_DIM, first, softcap, sinks, KV_FP8_E4M3)
#define INT8_CASE(HEAD_DIM) ATTEND(HEAD_DIM, first, softcap, sinks, KV_INT8)
    switch (kind) {
    case KV_FP8_E4M3: ATTEND_OF_HEAD_DIM(FP8_E4M3_CASE); break;
    case KV_INT8: ATTEND_OF_HEAD_DIM(INT8_CASE); break;
    case KV_BFLOAT16: ATTEND_OF_HEAD_DIM(BFLOAT16_CASE); break;
    default: ATTEND_OF_HEAD_DIM(FLOAT32_CASE);
    }
#undef INT8_CASE
#undef BFLOAT16_CASE
#undef FP8_E4M3_CASE
#undef FLOAT32_CASE
#undef ATTEND_OF_HEAD_DIM
#undef FROM_FIRST
#undef ATTEND
#undef BLOCKED
}

int64_t paged_decode_attention(
    const float *query, const void *key, const void *value, const int64_t *block_tables,
    int64_t table_stride, const int64_t *seq_lens, float *out, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_blocks, int64_t sliding_window, float scale, float logit_softcap,
    const float *sinks, int64_t kv_kind, const float *kv_scales, int64_t num_threads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (!check_seq(block_tables + s * table_stride, seq_lens[s], table_stride * block_size,
                       block_size, num_blocks, sliding_window))
            return -(1 + s);
    int out_of_memory = 0;
    /* Sequences are shared out one at a time (their lengths differ); each is computed by one
     * thread alone, so the result does not depend on the number of threads. */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_seqs > 1)
    {
        scratch_t scratch;
        if (!scratch_alloc(&scratch, num_heads, num_kv_heads, head_dim, block_size, (int)kv_kind)) {
#pragma omp atomic write
            out_of_memory = 1;
        }
#pragma omp barrier
        int stop;
#pragma omp atomic read
        stop = out_of_memory;
        if (!stop) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t s = 0; s < num_seqs; s++)
                attend_any(query + s * num_heads * head_dim, key, value,
                           block_tables + s * table_stride, seq_lens[s],
                           window_start(seq_lens[s], sliding_window),
                           out + s * num_heads * head_dim, &scratch, num_heads, num_kv_heads,
                           head_dim, block_size, scale, logit_softcap, sinks, (int)kv_kind,
                           kv_scales);
        }
        scratch_free(&scratch);
    }
    return out_of_memory ? -(1 + num_seqs) : 0;
}
