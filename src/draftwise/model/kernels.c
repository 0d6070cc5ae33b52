/* Fused CPU kernels for one sequence's decoder layer (draftwise/model/cpu_kernels.py loads them).
 *
 * Why: at batch 1 a decoder layer on this project's 2-core CPU is 4 matrix products plus ~20
 * small tensor ops (RMSNorm alone is ~8 ATen kernels), each costing several microseconds; for
 * the 2-layer draft those small ops were over half of a step. These loops do the same arithmetic
 * in 5 calls per layer. Each works on float32 (bf = 0) or bfloat16 (bf = 1) tensors, follows the
 * PyTorch path's rounding points (Hugging Face semantics for bfloat16), and is single-threaded:
 * the work per call is a few thousand multiply-adds.
 *
 * Built with -ffp-contract=off so that a * b + c is not fused into one rounding (as in PyTorch's
 * separate mul and add kernels). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as PyTorch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ld(const void *p, long i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, long i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = f2bf(v);
    else ((float *)p)[i] = v;
}

static inline float rnd(float v, int bf) { return bf ? bf2f(f2bf(v)) : v; } /* round to the dtype */

/* out[r] = rms_norm(x[r]) * w over rows of n. bfloat16: normalise in float32, round, then scale
 * in bfloat16 (HF: weight * hidden.to(input_dtype)); float32: x * rsqrt(mean(x^2) + eps) * w. */
static void norm_row(const void *x, long off, const void *w, void *out, long n, float eps, int bf) {
    double ss = 0.0;
    for (long i = 0; i < n; i++) {
        float v = ld(x, off + i, bf);
        ss += (double)v * v;
    }
    float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (long i = 0; i < n; i++) {
        float y = ld(x, off + i, bf) * r;
        st(out, off + i, bf ? rnd(y, 1) * ld(w, i, 1) : y * ld(w, i, 0), bf);
    }
}

void dw_rms_norm(const void *x, const void *w, void *out, long rows, long n, float eps, int bf) {
    for (long r = 0; r < rows; r++) norm_row(x, r * n, w, out, n, eps, bf);
}

/* The residual step fused with the next norm: x += d (rounded to the dtype); out = rms_norm(x) * w. */
void dw_add_rms_norm(void *x, const void *d, const void *w, void *out, long rows, long n, float eps, int bf) {
    for (long r = 0; r < rows; r++) {
        for (long i = 0; i < n; i++) st(x, r * n + i, ld(x, r * n + i, bf) + ld(d, r * n + i, bf), bf);
        norm_row(x, r * n, w, out, n, eps, bf);
    }
}

/* RoPE in place on the first `heads` heads of each row of qkv ([T, row] with heads of D):
 * x * cos + rotate_half(x) * sin, with rotate_half's sign folded into the table's sin (as
 * `apply_rope`); cos/sin are float32 tables [positions, D], pos gives each row's position. */
void dw_rope(void *qkv, long T, long row, long heads, long D, const int64_t *pos, const float *cos,
             const float *sin, int bf) {
    float tmp[1024];
    long half = D / 2;
    for (long t = 0; t < T; t++) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (long h = 0; h < heads; h++) {
            long base = t * row + h * D;
            for (long i = 0; i < D; i++) tmp[i] = ld(qkv, base + i, bf);
            for (long i = 0; i < D; i++) {
                float a = tmp[i] * c[i];
                float b = tmp[i < half ? i + half : i - half] * s[i];
                st(qkv, base + i, a + b, bf);
            }
        }
    }
}

static inline float dot(const void *a, long ao, const void *b, long bo, long D, int bf) {
    float acc[16] = {0};
    long i = 0;
    if (!bf) {
        const float *x = (const float *)a + ao, *y = (const float *)b + bo;
        for (; i + 16 <= D; i += 16)
            for (int l = 0; l < 16; l++) acc[l] += x[i + l] * y[i + l];
    } else {
        const uint16_t *x = (const uint16_t *)a + ao, *y = (const uint16_t *)b + bo;
        for (; i + 16 <= D; i += 16)
            for (int l = 0; l < 16; l++) acc[l] += bf2f(x[i + l]) * bf2f(y[i + l]);
    }
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < D; i++) s += ld(a, ao + i, bf) * ld(b, bo + i, bf);
    return s;
}

/* Attention of one sequence whose K/V occupy consecutive cache slots: slot0 + position.
 * qkv: [T, (H + 2 Hkv) * D] (q heads, k heads, v heads; RoPE applied), its T tokens at positions
 * L - T .. L - 1. Writes their K/V into the caches ([slots, Hkv, D]), then for each query t and
 * head h attends keys max(0, p - window + 1) .. p (p = its position; window 0 = none) with float32
 * scores and softmax; out: [T, H * D] in the dtype (grouped-query: head h reads K/V head h / (H / Hkv)). */
void dw_attend(const void *qkv, long T, long H, long Hkv, long D, void *kc, void *vc, long slot0, long L,
               long window, float scale, void *out, int bf) {
    long row = (H + 2 * Hkv) * D, kv = Hkv * D, es = bf ? 2 : 4;
    for (long t = 0; t < T; t++) {
        long slot = slot0 + L - T + t;
        memcpy((char *)kc + slot * kv * es, (const char *)qkv + (t * row + H * D) * es, kv * es);
        memcpy((char *)vc + slot * kv * es, (const char *)qkv + (t * row + (H + Hkv) * D) * es, kv * es);
    }
    float *sc = (float *)malloc(sizeof(float) * (L + D));
    float *acc = sc + L;
    long group = H / Hkv;
    for (long t = 0; t < T; t++) {
        long p = L - T + t, lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
        for (long h = 0; h < H; h++) {
            long g = h / group;
            float m = -INFINITY;
            for (long j = lo; j <= p; j++) {
                float s = dot(qkv, t * row + h * D, kc, (slot0 + j) * kv + g * D, D, bf) * scale;
                sc[j] = s;
                if (s > m) m = s;
            }
            float z = 0.0f;
            for (long j = lo; j <= p; j++) {
                sc[j] = expf(sc[j] - m);
                z += sc[j];
            }
            for (long i = 0; i < D; i++) acc[i] = 0.0f;
            for (long j = lo; j <= p; j++) {
                long vo = (slot0 + j) * kv + g * D;
                float pj = sc[j];
                if (bf) {
                    const uint16_t *v = (const uint16_t *)vc + vo;
                    for (long i = 0; i < D; i++) acc[i] += pj * bf2f(v[i]);
                } else {
                    const float *v = (const float *)vc + vo;
                    for (long i = 0; i < D; i++) acc[i] += pj * v[i];
                }
            }
            float inv = 1.0f / z;
            for (long i = 0; i < D; i++) st(out, t * H * D + h * D + i, acc[i] * inv, bf);
        }
    }
    free(sc);
}

/* out[r, i] = silu(gu[r, i]) * gu[r, I + i] (the gate and up halves of the fused projection);
 * bfloat16 rounds silu's result before the product, as two PyTorch ops would. */
void dw_silu_mul(const void *gu, void *out, long rows, long I, int bf) {
    for (long r = 0; r < rows; r++)
        for (long i = 0; i < I; i++) {
            float g = ld(gu, r * 2 * I + i, bf), u = ld(gu, r * 2 * I + I + i, bf);
            float s = rnd(g / (1.0f + expf(-g)), bf);
            st(out, r * I + i, s * u, bf);
        }
}
