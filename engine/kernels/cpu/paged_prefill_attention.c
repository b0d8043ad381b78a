/* Prefill attention on CPU, reading K/V in place from the paged cache: float32, bfloat16, or
 * float8 e4m3 or int8 elements with a float32 scale per KV head for K and one for V
 * (kv_elements.h).
 *
 * Each prefill sequence's new tokens attend causally over its context: the cached prefix (a
 * prefix-cache hit, or the earlier chunks of a chunked prefill) and the new tokens, whose K/V
 * are already written. New token i of a sequence of seq_len positions, query_len of them new,
 * sits at position p = seq_len - query_len + i and sees positions up to its own; with a
 * sliding window W (``sliding_window`` > 0) only those from p - W + 1 on. The blocks wholly
 * before the first new token's window are neither read nor checked (their table entries may
 * hold anything). With a logit soft-cap c (``logit_softcap`` > 0) each logit scale * q . k
 * becomes c tanh(logit / c); with attention sinks (``sinks`` not NULL) head h's logit sinks[h]
 * joins its softmax's denominator as a position with no value, seen first (a row's running max
 * starts at it, its sum at 1).
 *
 * Work is cut into items of one sequence, one KV head and a tile of up to Q_TILE new tokens;
 * an item's rows are its tokens times the query heads of that KV head (GQA: each K/V row is
 * read once per group). It walks the context in tiles of KV_TILE positions from its first
 * token's window start, whichever blocks they lie in (a row skips the tiles wholly before its
 * own window, and masks the positions before it in the tile that straddles it): K is copied
 * transposed into a small buffer (so a row of scores is one vector wide), V is read in place.
 * An item of fewer than IN_PLACE_ROWS rows, or of entries wider than IN_PLACE_HEAD_DIM, on a
 * float32 or bfloat16 cache (a decode row's query heads; a latent cache's wide entries) reads K
 * in place too (a bfloat16 tile's rows widened to float32 first, a latent cache's once for its
 * keys and values): its scores are dot products summed across vector lanes, where the
 * transposed copy of each tile took longer than the products (or than the products out of a
 * tile past L1); it prefetches the next tile's entries while computing one (such an item reads
 * each entry of its context once, for few products: the cache's reads weigh as much as they
 * do).
 * Scores are in base 2 (the query is pre-scaled by scale * log2 e) with an online softmax per
 * row; exp2 is a polynomial the compiler vectorises (within an ulp or two of exp2f). Items are
 * shared out over ``num_threads`` OpenMP threads; each is computed by one thread alone, so the
 * result does not depend on the number of threads.
 *
 * A bfloat16 or quantized cache's elements are read as floats as a tile is loaded: K into the
 * transposed tile, V into a tile of its own (read by every row of the item, where a float32
 * cache's V is read in place); all arithmetic after is float32's. An item is one KV head, so a
 * quantized cache's scales factor out: K's joins the queries' pre-scale, V's the output's
 * 1 / sum.
 *
 * Layouts (all contiguous but the block table's rows):
 *   query, out        [num_tokens, num_heads, head_dim] (the prefill sequences' rows, in order)
 *   key, value        [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, table_stride]
 *   query_start_loc   [num_seqs + 1] row offsets of each sequence in query
 *   seq_lens          [num_seqs] context length after this step (cached + new)
 *   sinks             [num_heads], or NULL
 *   kv_scales         [2][num_kv_heads] (K's, then V's) for a quantized cache, or NULL
 * Returns 0, or -(1 + s) when sequence s has no new token, more new tokens than positions, a
 * length over its block table's capacity or a block id outside [0, num_blocks) among those it
 * reads (nothing is written then), or -(1 + num_seqs) when scratch memory ran out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_elements.h"
#include "poly_math.h"
#include "vec16.h"

#define Q_TILE 64
#define KV_TILE 32
/* an item of fewer rows, or of entries wider than IN_PLACE_HEAD_DIM, computes its scores with
 * K in place (tile_scores_in_place) */
#define IN_PLACE_ROWS 128
#define IN_PLACE_HEAD_DIM 128

/* One sequence's KV head over new tokens [first_token, first_token + num_tokens) (rows of
 * query), the first at context position first_position. */
typedef struct {
    int64_t seq, kv_head, first_token, num_tokens, first_position;
} item_t;

typedef struct {
    float *q;      /* [rows][head_dim] the item's queries, scaled */
    float *acc;    /* [rows][head_dim] running output */
    float *scores; /* [rows][KV_TILE] */
    float *maxes;  /* [rows] running max (base 2) */
    float *sums;   /* [rows] */
    float *corrections; /* [rows] this tile's rescaling of the running output */
    float *k_t;    /* [head_dim][KV_TILE] one tile of K, transposed */
    float *k_row;  /* [head_dim] a bfloat16 or quantized cache's K row, as floats */
    float *k_tile; /* [KV_TILE][head_dim] one tile of a bfloat16 cache's K, as floats */
    float *v_tile; /* [KV_TILE][head_dim] one tile of a bfloat16 or quantized cache's V */
} scratch_t;

static int scratch_alloc(scratch_t *s, int64_t rows, int64_t head_dim) {
    s->q = malloc(sizeof(float) * rows * head_dim);
    s->acc = malloc(sizeof(float) * rows * head_dim);
    s->scores = malloc(sizeof(float) * rows * KV_TILE);
    s->maxes = malloc(sizeof(float) * rows);
    s->sums = malloc(sizeof(float) * rows);
    s->corrections = malloc(sizeof(float) * rows);
    s->k_t = malloc(sizeof(float) * head_dim * KV_TILE);
    s->k_row = malloc(sizeof(float) * head_dim);
    s->k_tile = malloc(sizeof(float) * KV_TILE * head_dim);
    s->v_tile = malloc(sizeof(float) * KV_TILE * head_dim);
    return s->q && s->acc && s->scores && s->maxes && s->sums && s->corrections && s->k_t &&
           s->k_row && s->k_tile && s->v_tile;
}

static void scratch_free(scratch_t *s) {
    free(s->q);
    free(s->acc);
    free(s->scores);
    free(s->maxes);
    free(s->sums);
    free(s->corrections);
    free(s->k_t);
    free(s->k_row);
    free(s->k_tile);
    free(s->v_tile);
}

/* scores[r][0:KV_TILE] = q[r] . k_t for rows [first, rows): four rows share each load of k_t,
 * and their eight vectors of partial sums hide the FMA latency. */
static inline __attribute__((always_inline)) void tile_scores(
    const float *restrict q, const float *restrict k_t, float *restrict scores, int64_t first,
    int64_t rows, int64_t head_dim) {
    int64_t r = first;
    for (; r + 4 <= rows; r += 4) {
        const float *q0 = q + r * head_dim;
        vec16 s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0}, s20 = {0}, s21 = {0}, s30 = {0},
              s31 = {0};
        for (int64_t d = 0; d < head_dim; d++) {
            const vec16 k0 = load16(k_t + d * KV_TILE), k1 = load16(k_t + d * KV_TILE + 16);
            const float x0 = q0[d], x1 = q0[head_dim + d], x2 = q0[2 * head_dim + d],
                        x3 = q0[3 * head_dim + d];
            s00 += x0 * k0, s01 += x0 * k1, s10 += x1 * k0, s11 += x1 * k1;
            s20 += x2 * k0, s21 += x2 * k1, s30 += x3 * k0, s31 += x3 * k1;
        }
        float *o = scores + r * KV_TILE;
        store16(o, s00), store16(o + 16, s01), store16(o + 32, s10), store16(o + 48, s11);
        store16(o + 64, s20), store16(o + 80, s21), store16(o + 96, s30), store16(o + 112, s31);
    }
    for (; r < rows; r++) {
        vec16 s0 = {0}, s1 = {0};
        for (int64_t d = 0; d < head_dim; d++) {
            const float x = q[r * head_dim + d];
            s0 += x * load16(k_t + d * KV_TILE), s1 += x * load16(k_t + d * KV_TILE + 16);
        }
        store16(scores + r * KV_TILE, s0), store16(scores + r * KV_TILE + 16, s1);
    }
}

/* scores[r][0:KV_TILE] = q[r] . k_rows[t] for rows [first, rows), K read in place where it lies
 * (no transposed copy): four rows by four keys at a time, sixteen vectors of partial sums
 * summed across their lanes at the end (sum4x16). For an item of few rows over wide entries
 * (a decode row's query heads over a latent cache's one entry a position) the transposed copy
 * of each tile took longer than the products it served. head_dim a multiple of 16. */
static inline __attribute__((always_inline)) void tile_scores_in_place(
    const float *restrict q, const float *const *k_rows, float *restrict scores, int64_t first,
    int64_t rows, int64_t head_dim) {
    if (first >= rows) return;
    for (int t = 0; t < KV_TILE; t += 4)
        dots_of_four_keys(q + first * head_dim, rows - first, k_rows[t], k_rows[t + 1],
                          k_rows[t + 2], k_rows[t + 3], scores + first * KV_TILE + t, KV_TILE,
                          head_dim);
}

/* acc[r] = acc[r] * corrections[r] + probs[r] . V for rows [first, rows): 32 columns of four
 * rows at a time (eight vectors), sharing each load of a V row. */
static inline __attribute__((always_inline)) void tile_values(
    float *restrict acc, const float *restrict probs, const float *const *v_rows,
    const float *restrict corrections, int64_t first, int64_t rows, int64_t head_dim) {
    int64_t r = first;
    for (; r + 4 <= rows && head_dim % 32 == 0; r += 4)
        for (int64_t d = 0; d < head_dim; d += 32) {
            float *a = acc + r * head_dim + d;
            const float *p = probs + r * KV_TILE;
            const float c0 = corrections[r], c1 = corrections[r + 1], c2 = corrections[r + 2],
                        c3 = corrections[r + 3];
            vec16 a00 = load16(a) * c0, a01 = load16(a + 16) * c0;
            vec16 a10 = load16(a + head_dim) * c1, a11 = load16(a + head_dim + 16) * c1;
            vec16 a20 = load16(a + 2 * head_dim) * c2, a21 = load16(a + 2 * head_dim + 16) * c2;
            vec16 a30 = load16(a + 3 * head_dim) * c3, a31 = load16(a + 3 * head_dim + 16) * c3;
            for (int t = 0; t < KV_TILE; t++) {
                const vec16 v0 = load16(v_rows[t] + d), v1 = load16(v_rows[t] + d + 16);
                const float p0 = p[t], p1 = p[KV_TILE + t], p2 = p[2 * KV_TILE + t],
                            p3 = p[3 * KV_TILE + t];
                a00 += p0 * v0, a01 += p0 * v1, a10 += p1 * v0, a11 += p1 * v1;
                a20 += p2 * v0, a21 += p2 * v1, a30 += p3 * v0, a31 += p3 * v1;
            }
            store16(a, a00), store16(a + 16, a01);
            store16(a + head_dim, a10), store16(a + head_dim + 16, a11);
            store16(a + 2 * head_dim, a20), store16(a + 2 * head_dim + 16, a21);
            store16(a + 3 * head_dim, a30), store16(a + 3 * head_dim + 16, a31);
        }
    for (; r < rows && head_dim % 32 == 0; r++) /* the rows left over, one at a time */
        for (int64_t d = 0; d < head_dim; d += 32) {
            float *a = acc + r * head_dim + d;
            const float *p = probs + r * KV_TILE;
            vec16 a0 = load16(a) * corrections[r], a1 = load16(a + 16) * corrections[r];
            for (int t = 0; t < KV_TILE; t++)
                a0 += p[t] * load16(v_rows[t] + d), a1 += p[t] * load16(v_rows[t] + d + 16);
            store16(a, a0), store16(a + 16, a1);
        }
    for (; r < rows; r++) /* any head_dim */
        for (int64_t d = 0; d < head_dim; d++) {
            float a = acc[r * head_dim + d] * corrections[r];
            for (int t = 0; t < KV_TILE; t++) a += probs[r * KV_TILE + t] * v_rows[t][d];
            acc[r * head_dim + d] = a;
        }
}

/* The element index in K and V of context ``position``'s entry for KV head ``kv_head``, its
 * block found in the sequence's ``table``. */
static inline int64_t entry_index(const int64_t *table, int64_t position, int64_t block_size,
                                  int64_t token_numel, int64_t kv_head, int64_t head_dim) {
    const int64_t row = table[position / block_size] * block_size + position % block_size;
    return row * token_numel + kv_head * head_dim;
}

/* The first position a token at ``position`` sees: 0, or its window's start. */
static inline int64_t window_start(int64_t position, int64_t sliding_window) {
    return sliding_window > 0 && position >= sliding_window ? position - sliding_window + 1 : 0;
}

/* One item: its rows attend over context positions [their window's start, their position].
 * ``softcap``: 0, or the logits' soft-cap; ``sinks``: NULL, or a logit per head; ``kind``: the
 * cache's element type (KV_*), ``kv_scales`` a quantized one's; ``in_place``: K read where it
 * lies for the scores (``in_place_item``), else copied transposed tile by tile. */
static inline __attribute__((always_inline)) void attend_item(
    const item_t *item, const float *query, const void *key, const void *value,
    const int64_t *table, float *out, const scratch_t *scratch, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t sliding_window,
    float scale, float softcap, const float *sinks, int kind, const float *kv_scales,
    int in_place) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t rows = item->num_tokens * group; /* row r: token r / group, head r % group */
    const int64_t token_numel = num_kv_heads * head_dim;
    float *restrict q = scratch->q, *restrict acc = scratch->acc;
    float *restrict scores = scratch->scores, *restrict k_t = scratch->k_t;
    float *restrict maxes = scratch->maxes, *restrict sums = scratch->sums;
    float *restrict corrections = scratch->corrections;
    float *restrict k_row = scratch->k_row, *restrict v_tile = scratch->v_tile;
    float *restrict k_tile = scratch->k_tile;
    const float q_scale =
        kv_is_quantized(kind) ? scale * kv_scales[item->kv_head] * LOG2E : scale * LOG2E;
    const float softcap_log2 = softcap * LOG2E; /* the cap in the scores' base-2 units */
    for (int64_t r = 0; r < rows; r++) {
        const float *src = query + (item->first_token + r / group) * num_heads * head_dim +
                           (item->kv_head * group + r % group) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) {
            q[r * head_dim + d] = src[d] * q_scale;
            acc[r * head_dim + d] = 0.f;
        }
        /* a sink: a position seen before the first */
        maxes[r] = sinks ? sinks[item->kv_head * group + r % group] * LOG2E : -INFINITY;
        sums[r] = sinks ? 1.f : 0.f;
    }
    const int64_t first_position = item->first_position;
    const int64_t end = first_position + item->num_tokens; /* the last token sees below end */
    const float *v_rows[KV_TILE], *k_rows[KV_TILE];
    for (int64_t start = window_start(first_position, sliding_window); start < end;
         start += KV_TILE) {
        const int64_t n = end - start < KV_TILE ? end - start : KV_TILE;
        if (in_place) { /* the next tile's entries on their way while this one is computed */
            const int64_t next_end = start + 2 * KV_TILE < end ? start + 2 * KV_TILE : end;
            for (int64_t position = start + KV_TILE; position < next_end; position++) {
                const char *entry = kv_at(key,
                                          entry_index(table, position, block_size, token_numel,
                                                      item->kv_head, head_dim),
                                          kind);
                for (int64_t byte = 0; byte < head_dim * kv_element_size(kind); byte += 64)
                    __builtin_prefetch(entry + byte);
            }
        }
        /* positions past n repeat the tile's first: finite values their zero weights cancel */
        for (int64_t t = 0; t < KV_TILE; t++) {
            const int64_t position = start + (t < n ? t : 0);
            const int64_t index =
                entry_index(table, position, block_size, token_numel, item->kv_head, head_dim);
            if (kind == KV_FLOAT32) {
                const float *k = (const float *)key + index;
                v_rows[t] = (const float *)value + index;
                if (in_place)
                    k_rows[t] = k;
                else
                    for (int64_t d = 0; d < head_dim; d++) k_t[d * KV_TILE + t] = k[d];
            } else if (in_place) { /* bfloat16: the tile's rows widened where the scores read */
                float *k = k_tile + t * head_dim;
                kv_row_as_floats(kv_at(key, index, kind), k, head_dim, kind);
                k_rows[t] = k;
                if (value == key) { /* a latent cache: its entries are the values too */
                    v_rows[t] = k;
                } else {
                    kv_row_as_floats(kv_at(value, index, kind), v_tile + t * head_dim, head_dim,
                                     kind);
                    v_rows[t] = v_tile + t * head_dim;
                }
            } else {
                kv_row_as_floats(kv_at(key, index, kind), k_row, head_dim, kind);
                for (int64_t d = 0; d < head_dim; d++) k_t[d * KV_TILE + t] = k_row[d];
                kv_row_as_floats(kv_at(value, index, kind), v_tile + t * head_dim, head_dim, kind);
                v_rows[t] = v_tile + t * head_dim;
            }
        }
        /* rows whose token's position is below start see nothing of this tile, nor do those
         * whose window starts past it (tokens from seen_by on): the tile's rows are
         * [first_row, last_row) */
        const int64_t first_token = start > first_position ? start - first_position : 0;
        const int64_t seen_by = sliding_window > 0 ? start + n + sliding_window - 1 - first_position
                                                   : item->num_tokens;
        const int64_t last_token = seen_by < item->num_tokens ? seen_by : item->num_tokens;
        const int64_t first_row = first_token * group, last_row = last_token * group;
        if (in_place)
            tile_scores_in_place(q, k_rows, scores, first_row, last_row, head_dim);
        else
            tile_scores(q, k_t, scores, first_row, last_row, head_dim);
        for (int64_t r = first_row; r < last_row; r++) {
            float *s = scores + r * KV_TILE;
            if (softcap > 0.f)
                for (int t = 0; t < KV_TILE; t++)
                    s[t] = softcap_log2 * tanh_poly(s[t] / softcap_log2);
            const int64_t position = first_position + r / group;
            const int64_t visible = position - start + 1; /* positions seen, from start */
            for (int64_t t = visible < n ? visible : n; t < KV_TILE; t++) s[t] = -INFINITY;
            const int64_t hidden = window_start(position, sliding_window) - start; /* below it */
            for (int64_t t = 0; t < hidden; t++) s[t] = -INFINITY;
            float tile_max = maxes[r];
            for (int t = 0; t < KV_TILE; t++) tile_max = s[t] > tile_max ? s[t] : tile_max;
            float sum = 0.f;
            for (int t = 0; t < KV_TILE; t++) {
                s[t] = exp2_poly(s[t] - tile_max);
                sum += s[t];
            }
            /* 0 on the row's first tile without a sink */
            corrections[r] = exp2_poly(maxes[r] - tile_max);
            maxes[r] = tile_max;
            sums[r] = sums[r] * corrections[r] + sum;
        }
        tile_values(acc, scores, v_rows, corrections, first_row, last_row, head_dim);
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + (item->first_token + r / group) * num_heads * head_dim +
                     (item->kv_head * group + r % group) * head_dim;
        const float inverse = kv_is_quantized(kind)
                                  ? kv_scales[num_kv_heads + item->kv_head] / sums[r]
                                  : 1.f / sums[r];
        for (int64_t d = 0; d < head_dim; d++) dst[d] = acc[r * head_dim + d] * inverse;
    }
}

/* Whether an item computes its scores with K in place: on a float32 or bfloat16 cache (a
 * bfloat16 tile's rows widened first), head_dim a multiple of 16, where few rows share each
 * tile (the products cost less than a transposed copy) or its entries are wide (a transposed
 * tile of 32 positions past 16 KB: measured faster in place at every row count, 1-1024, for
 * head dims of 192-576). */
static int in_place_item(const item_t *item, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int kind) {
    const int64_t rows = item->num_tokens * (num_heads / num_kv_heads);
    return (kind == KV_FLOAT32 || kind == KV_BFLOAT16) && head_dim % 16 == 0 &&
           (rows < IN_PLACE_ROWS || head_dim > IN_PLACE_HEAD_DIM);
}

/* ``attend_item`` compiled for the common head sizes, the general one for others; on a float32
 * cache each with no window (the code of a kernel without windows) and with one, both without
 * soft-cap or sinks (the code of a kernel without them), and for any window with them, and once
 * with K in place (``in_place_item``: few rows, or wide entries; any window, soft-cap, sinks);
 * on a bfloat16 cache the same four; on a quantized cache (float8 e4m3, int8) for any window
 * (fewer copies of the code to build). */
static void attend_item_any(const item_t *item, const float *query, const void *key,
                            const void *value, const int64_t *table, float *out,
                            const scratch_t *scratch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t sliding_window,
                            float scale, float softcap, const float *sinks, int kind,
                            const float *kv_scales) {
#define ATTEND_K(HEAD_DIM, SLIDING_WINDOW, SOFTCAP, SINKS, KIND, IN_PLACE)                   \
    attend_item(item, query, key, value, table, out, scratch, num_heads, num_kv_heads,      \
                HEAD_DIM, block_size, SLIDING_WINDOW, scale, SOFTCAP, SINKS, KIND, kv_scales, \
                IN_PLACE)
#define ATTEND(HEAD_DIM, SLIDING_WINDOW, SOFTCAP, SINKS, KIND)                               \
    ATTEND_K(HEAD_DIM, SLIDING_WINDOW, SOFTCAP, SINKS, KIND, 0)
#define ATTEND_WITH_WINDOW(HEAD_DIM, KIND)                                                   \
    if (in_place_item(item, num_heads, num_kv_heads, head_dim, kind))                        \
        ATTEND_K(HEAD_DIM, sliding_window, softcap, sinks, KIND, 1);                         \
    else if (softcap > 0.f || sinks)                                                         \
        ATTEND(HEAD_DIM, sliding_window, softcap, sinks, KIND);                              \
    else if (sliding_window == 0)                                                            \
        ATTEND(HEAD_DIM, 0, 0.f, NULL, KIND);                                                \
    else                                                                                     \
        ATTEND(HEAD_DIM, sliding_window, 0.f, NULL, KIND)
#define ATTEND_OF_HEAD_DIM(HEAD_DIM_CASE)                                                    \
    switch (head_dim) {                                                                      \
    case 64: HEAD_DIM_CASE(64); break;                                                       \
    case 128: HEAD_DIM_CASE(128); break;                                                     \
    default: HEAD_DIM_CASE(head_dim);                                                        \
    }
#define FLOAT32_CASE(HEAD_DIM) ATTEND_WITH_WINDOW(HEAD_DIM, KV_FLOAT32)
#define BFLOAT16_CASE(HEAD_DIM) ATTEND_WITH_WINDOW(HEAD_DIM, KV_BFLOAT16)
#define FP8_E4M3_CASE(HEAD_DIM) ATTEND(HEAD_DIM, sliding_window, softcap, sinks, KV_FP8_E4M3)
#define INT8_CASE(HEAD_DIM) ATTEND(HEAD_DIM, sliding_window, softcap, sinks, KV_INT8)
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
#undef ATTEND_WITH_WINDOW
#undef ATTEND
#undef ATTEND_K
}

static int check_seq(const int64_t *table, int64_t query_len, int64_t seq_len, int64_t capacity,
                     int64_t block_size, int64_t num_blocks, int64_t sliding_window) {
    if (query_len < 1 || seq_len < query_len || seq_len > capacity) return 0;
    const int64_t first_block = window_start(seq_len - query_len, sliding_window) / block_size;
    for (int64_t j = first_block; j < (seq_len + block_size - 1) / block_size; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return 0;
    return 1;
}

int64_t paged_prefill_attention(
    const float *query, const void *key, const void *value, const int64_t *block_tables,
    int64_t table_stride, const int64_t *query_start_loc, const int64_t *seq_lens, float *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t num_blocks, int64_t sliding_window, float scale,
    float logit_softcap, const float *sinks, int64_t kv_kind, const float *kv_scales,
    int64_t num_threads) {
    int64_t num_items = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t query_len = query_start_loc[s + 1] - query_start_loc[s];
        if (!check_seq(block_tables + s * table_stride, query_len, seq_lens[s],
                       table_stride * block_size, block_size, num_blocks, sliding_window))
            return -(1 + s);
        num_items += (query_len + Q_TILE - 1) / Q_TILE * num_kv_heads;
    }
    item_t *items = malloc(sizeof(item_t) * (num_items ? num_items : 1));
    if (!items) return -(1 + num_seqs);
    int64_t next = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t begin = query_start_loc[s], stop = query_start_loc[s + 1];
        const int64_t context_start = seq_lens[s] - (stop - begin); /* cached positions */
        for (int64_t first = begin; first < stop; first += Q_TILE)
            for (int64_t h = 0; h < num_kv_heads; h++)
                items[next++] = (item_t){s, h, first, stop - first < Q_TILE ? stop - first : Q_TILE,
                                         context_start + first - begin};
    }
    const int64_t rows = Q_TILE * (num_heads / num_kv_heads);
    int out_of_memory = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        scratch_t scratch;
        if (!scratch_alloc(&scratch, rows, head_dim)) {
#pragma omp atomic write
            out_of_memory = 1;
        }
#pragma omp barrier
        int stop;
#pragma omp atomic read
        stop = out_of_memory;
        if (!stop) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_items; i++)
                attend_item_any(&items[i], query, key, value,
                                block_tables + items[i].seq * table_stride, out, &scratch,
                                num_heads, num_kv_heads, head_dim, block_size, sliding_window,
                                scale, logit_softcap, sinks, (int)kv_kind, kv_scales);
        }
        scratch_free(&scratch);
    }
    free(items);
    return out_of_memory ? -(1 + num_seqs) : 0;
}
