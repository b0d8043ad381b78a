/* The model's elementwise steps on CPU (float32; bfloat16 below), each one pass over its rows
 * instead of the several tensors eager torch makes: RMSNorm (alone, or after the residual
 * add), rotate-half rotary embedding of q and k in place, and SiLU(gate) * up. Same operations
 * and order per element as transformers' modules, but for the sum of squares, accumulated in
 * another order, and SiLU's exp, a polynomial as accurate as torch's own vectorised exp (within
 * 3 ulp). Rows are shared out over OpenMP's threads (torch's intra-op threads: the same
 * libgomp) when there are enough of them to pay for waking the threads; each row is computed
 * by one thread alone, so results do not depend on the number of threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* below this many floats a call stays on the calling thread: a decode step's rows take tens of
 * microseconds alone, about what waking and joining the other threads costs, and a busy core
 * can keep the calling thread waiting at the join far longer */
#define PARALLEL_MIN_NUMEL 262144

static inline void normalize(const float *restrict x, const float *restrict weight,
                             float *restrict out, int64_t dim, float eps) {
    float sum = 0.f;
    for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
    const float inverse_rms = 1.f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * inverse_rms);
}

/* out[r] = weight * x[r] / rms(x[r]) */
void rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_NUMEL)
    for (int64_t r = 0; r < rows; r++) normalize(x + r * dim, weight, out + r * dim, dim, eps);
}

/* sum[r] = residual[r] + x[r]; out[r] = rms_norm(sum[r]) */
void add_rms_norm_f32(const float *residual, const float *x, const float *weight, float *sum,
                      float *out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_NUMEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = residual + r * dim, *b = x + r * dim;
        float *s = sum + r * dim;
        for (int64_t i = 0; i < dim; i++) s[i] = a[i] + b[i];
        normalize(s, weight, out + r * dim, dim, eps);
    }
}

/* Rotate-half rope on each head of a [tokens, heads, head_dim] view whose tokens are
 * row_stride floats apart (heads contiguous): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static void rotate(float *x, int64_t row_stride, int64_t num_heads, const float *cos,
                   const float *sin, int64_t tokens, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * num_heads * head_dim >= PARALLEL_MIN_NUMEL)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

void rotary_f32(float *query, int64_t query_stride, int64_t num_heads, float *key,
                int64_t key_stride, int64_t num_kv_heads, const float *cos, const float *sin,
                int64_t tokens, int64_t head_dim) {
    rotate(query, query_stride, num_heads, cos, sin, tokens, head_dim);
    rotate(key, key_stride, num_kv_heads, cos, sin, tokens, head_dim);
}

/* e^x for x in [-87, 88] within 2 ulp (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a
 * degree-6 polynomial for e^r, 2^n put in the exponent bits), written without calls or
 * branches so loops over it vectorise: glibc's expf is one call per element, and it made
 * silu_mul three quarters of a prefill step's elementwise time. Clamped outside that range
 * (where silu is x or 0 to float precision anyway); NaN stays NaN. */
static inline float exp_vectorisable(float x) {
    x = x > 88.f ? 88.f : x;
    x = x < -87.f ? -87.f : x;
    float n = rintf(x * 1.44269504088896341f);
    n = n == n ? n : 0.f; /* NaN: any n will do (the polynomial carries the NaN), not UB */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:] */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_NUMEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * dim, *up = gate + dim;
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++)
            o[i] = gate[i] / (1.f + exp_vectorisable(-gate[i])) * up[i];
    }
}

/* bfloat16: each element widened to float, computed as above, and rounded back to nearest
 * even where torch's bfloat16 ops round (each op's result is a bfloat16 tensor in torch): the
 * norm's normalized value before the weight, the weight's product; the residual sum; silu,
 * then its product with up; each of rope's products and sums. */
static inline float widen(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = (bits >> 16) | 0x40u; /* a NaN stays a (quiet) NaN */
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float round_bf16(float f) { return widen(narrow(f)); }

static inline void normalize_bf16(const uint16_t *restrict x, const uint16_t *restrict weight,
                                  uint16_t *restrict out, int64_t dim, float eps) {
    float sum = 0.f;
    for (int64_t i = 0; i < dim; i++) sum += widen(x[i]) * widen(x[i]);
    const float inverse_rms = 1.f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++)
        out[i] = narrow(widen(weight[i]) * round_bf16(widen(x[i]) * inverse_rms));
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                   int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_NUMEL)
    for (int64_t r = 0; r < rows; r++)
        normalize_bf16(x + r * dim, weight, out + r * dim, dim, eps);
}

void add_rms_norm_bf16(const uint16_t *residual, const uint16_t *x, const uint16_t *weight,
                       uint16_t *sum, uint16_t *out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_NUMEL)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *a = residual + r * dim, *b = x + r * dim;
        uint16_t *s = sum + r * dim;
        for (int64_t i = 0; i < dim; i++) s[i] = narrow(widen(a[i]) + widen(b[i]));
        normalize_bf16(s, weight, out + r * dim, dim, eps);
    }
}

static void rotate_bf16(uint16_t *x, int64_t row_stride, int64_t num_heads, const uint16_t *cos,
                        const uint16_t *sin, int64_t tokens, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * num_heads * head_dim >= PARALLEL_MIN_NUMEL)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = widen(x1[i]), b = widen(x2[i]);
                const float ci = widen(c[i]), si = widen(s[i]);
                x1[i] = narrow(round_bf16(a * ci) - round_bf16(b * si));
                x2[i] = narrow(round_bf16(b * ci) + round_bf16(a * si));
            }
        }
    }
}

void rotary_bf16(uint16_t *query, int64_t query_stride, int64_t num_heads, uint16_t *key,
                 int64_t key_stride, int64_t num_kv_heads, const uint16_t *cos,
                 const uint16_t *sin, int64_t tokens, int64_t head_dim) {
    rotate_bf16(query, query_stride, num_heads, cos, sin, tokens, head_dim);
    rotate_bf16(key, key_stride, num_kv_heads, cos, sin, tokens, head_dim);
}

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t dim) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_NUMEL)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * dim, *up = gate + dim;
        uint16_t *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) {
            const float g = widen(gate[i]);
            o[i] = narrow(round_bf16(g / (1.f + exp_vectorisable(-g))) * widen(up[i]));
        }
    }
}
