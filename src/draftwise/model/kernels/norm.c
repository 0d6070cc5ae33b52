/* The elementwise ops of a decoder layer: RMSNorm (alone and fused with the residual add), RoPE
 * in place, and SiLU-and-multiply of the fused gate/up projection.
 *
 * At batch 1 a decoder layer is 4 matrix products plus ~20 small tensor ops (RMSNorm alone is ~8
 * ATen kernels), each costing several microseconds; these loops do the same arithmetic in a
 * few calls. Each is single-threaded: the work per call is a few thousand multiply-adds. */
#include "kernels.h"

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
            for (long i = 0; i < half; i++) st(qkv, base + i, tmp[i] * c[i] + tmp[i + half] * s[i], bf);
            for (long i = half; i < D; i++) st(qkv, base + i, tmp[i] * c[i] + tmp[i - half] * s[i], bf);
        }
    }
}

/* each lane rounded to bfloat16 and back (round to nearest even; NaN stays NaN), as f2bf */
static inline v8f round8f(v8f f) {
    v8u u = (v8u)f;
    v8u r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
    v8i nan = (v8i)(u & 0x7fffffffu) > 0x7f800000;
    r = (v8u)(((v8i)r & ~nan) | ((v8i)(((u >> 16) | 0x40u) << 16) & nan));
    return (v8f)r;
}

/* out[r, i] = silu(gu[r, i]) * gu[r, I + i] (the gate and up halves of the fused projection);
 * bfloat16 rounds silu's result before the product, as two PyTorch ops would. */
void dw_silu_mul(const void *gu, void *out, long rows, long I, int bf) {
    for (long r = 0; r < rows; r++) {
        long g = r * 2 * I, u = g + I, o = r * I, i = 0;
        for (; i + 8 <= I; i += 8) {
            v8f x = load8(gu, g + i, bf);
            v8f sx = x / (1.0f + exp8(-x));
            if (bf) sx = round8f(sx); /* silu's result rounded */
            v8f y = sx * load8(gu, u + i, bf);
            if (bf) {
                for (int l = 0; l < 8; l++) ((uint16_t *)out)[o + i + l] = f2bf(y[l]);
            } else {
                memcpy((float *)out + o + i, &y, 32);
            }
        }
        for (; i < I; i++) {
            float x = ld(gu, g + i, bf);
            st(out, o + i, rnd(x / (1.0f + exp1(-x)), bf) * ld(gu, u + i, bf), bf);
        }
    }
}
