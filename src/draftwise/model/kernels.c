/* Fused CPU kernels for the decoder layers (draftwise/model/cpu_kernels.py loads them; llama.py's
 * _fused_forward calls them for one sequence or a batch).
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

static inline uint16_t f2bf(float f) { /* round to nearest even, as PyTorch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : r); /* branch-free */
}

/* 16-lane vectors (GCC/Clang vector extensions): the compiler maps them onto the machine's SIMD
 * registers (AVX-512 here, narrower ones elsewhere). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f load16(const void *p, long i, int bf) {
    v16f r;
    if (bf) {
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, 32);
        r = (v16f)(__builtin_convertvector(h, v16u) << 16);
    } else {
        memcpy(&r, (const float *)p + i, 64);
    }
    return r;
}

static inline v16h round16(v16f f) { /* float32 -> bfloat16 bits, round to nearest even */
    v16u u = (v16u)f;
    v16u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16i nan = (v16i)(u & 0x7fffffffu) > 0x7f800000;
    r = (v16u)(((v16i)r & ~nan) | ((v16i)((u >> 16) | 0x40u) & nan));
    return __builtin_convertvector(r, v16h);
}

static inline void store16(void *p, long i, v16f v, int bf) {
    if (bf) {
        v16h h = round16(v);
        memcpy((uint16_t *)p + i, &h, 32);
    } else {
        memcpy((float *)p + i, &v, 64);
    }
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
            for (long i = 0; i < half; i++) st(qkv, base + i, tmp[i] * c[i] + tmp[i + half] * s[i], bf);
            for (long i = half; i < D; i++) st(qkv, base + i, tmp[i] * c[i] + tmp[i - half] * s[i], bf);
        }
    }
}

/* The 16 lanes of a vector summed as a tree: (0..7 + 8..15), then (0..3 + 4..7), then pairs. The
 * attention's scores repeat this order on two 8-lane halves (tree16, see qk_scores). */
static inline float hsum16(v16f acc) {
    float t[16];
    memcpy(t, &acc, 64);
    for (int l = 0; l < 8; l++) t[l] += t[l + 8];
    for (int l = 0; l < 4; l++) t[l] += t[l + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* Dot product: 16 float32 lanes (GCC/Clang vector extension), then hsum16; a different (not
 * worse) order than a sequential loop, and a fixed one. */
static inline float dot_f32(const float *q, const float *k, long D) {
    if ((D & 15) == 0) {
        v16f acc = {0};
        for (long i = 0; i < D; i += 16) {
            v16f a, b;
            memcpy(&a, q + i, 64);
            memcpy(&b, k + i, 64);
            acc += a * b;
        }
        return hsum16(acc);
    }
    float s = 0.0f;
    for (long i = 0; i < D; i++) s += q[i] * k[i];
    return s;
}

/* Sum of n floats in a fixed order (16 lanes, hsum16, then the tail): the same result wherever
 * the array starts, so a query's softmax does not depend on the block it came in. */
static inline float sum_f32(const float *s, long n) {
    v16f acc = {0};
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        v16f v;
        memcpy(&v, s + j, 64);
        acc += v;
    }
    float z = hsum16(acc);
    for (; j < n; j++) z += s[j];
    return z;
}

/* 8-lane vectors: one AVX register on AVX2 machines, half of one with AVX-512; the attention
 * below keeps its 16-lane arithmetic (hsum16's order) as pairs of them, so a 16-lane
 * accumulator is two registers and nothing spills on AVX2. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

/* a * b + c: one rounding (FMA) where the CPU has it (every x86-64 CPU with AVX2), else two. The
 * attention's products use it: its scores and outputs are draftwise's own (the PyTorch path's
 * SDPA rounds differently anyway), and one build gives one answer whatever the batch. */
#ifdef __FMA__
#include <immintrin.h>
static inline v8f fma8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8f fma8(v8f a, v8f b, v8f c) { return a * b + c; }
#endif

typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8f vsel8(v8i m, v8f a, v8f b) { return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }

static inline v8f bcast8(float s) { return (v8f){s, s, s, s, s, s, s, s}; } /* vbroadcastss; 0 + s is an add */

/* exp(x) for x in [-87, 88] (clamped: softmax arguments are <= 0, and exp(-87) ~ 1.6e-38 is
 * negligible next to the maximum's 1): Cephes' expf (range reduction by ln 2, degree-6
 * polynomial), within ~2 ulp of the exact value. Written on 8-lane vectors (GCC/Clang vector
 * extensions: one AVX2 register; GCC scalarised a 16-lane version's conversions on AVX2) because
 * the C library's expf is one call per element. */
static inline v8f exp8(v8f x) {
    const v8f lo = bcast8(-87.0f), hi = bcast8(88.0f); /* (not x * 0 - 87: NaN for x = -inf) */
    x = vsel8(x < lo, lo, x);
    x = vsel8(x > hi, hi, x);
    v8f t = x * 1.44269504088896341f + 0.5f;
    v8i ni = __builtin_convertvector(t, v8i);
    v8f n = __builtin_convertvector(ni, v8f);
    v8i below = n > t;
    ni += below;
    n = __builtin_convertvector(ni, v8f);
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    v8f z = x * x;
    v8f y = ((((x * 1.9875691500e-4f + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x
             + 1.6666665459e-1f) * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    return y * (v8f)((ni + 127) << 23);
}

static inline float exp1(float x) { /* one element through the same formula */
    v8f v = {0};
    v[0] = x;
    return exp8(v)[0];
}



static inline v8f load8(const void *p, long i, int bf) {
    v8f r;
    if (bf) {
        v8h h;
        memcpy(&h, (const uint16_t *)p + i, 16);
        v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&r, &u, 32);
    } else {
        memcpy(&r, (const float *)p + i, 32);
    }
    return r;
}

/* hsum16 of the 16 lanes lo[0..7], hi[0..7]: (l + l+8), then (l + l+4), then pairs */
static inline float tree16(v8f lo, v8f hi) {
    v8f u = lo + hi;
    float a0 = u[0] + u[4], a1 = u[1] + u[5], a2 = u[2] + u[6], a3 = u[3] + u[7];
    return (a0 + a2) + (a1 + a3);
}

/* each lane rounded to bfloat16 and back (round to nearest even; NaN stays NaN), as f2bf */
static inline v8f round8f(v8f f) {
    v8u u = (v8u)f;
    v8u r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
    v8i nan = (v8i)(u & 0x7fffffffu) > 0x7f800000;
    r = (v8u)(((v8i)r & ~nan) | ((v8i)(((u >> 16) | 0x40u) << 16) & nan));
    return (v8f)r;
}

/* sum_f32 on two 8-lane halves (bitwise the same) */
static inline float sum8_f32(const float *s, long n) {
    v8f lo = {0}, hi = {0};
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        v8f a, b;
        memcpy(&a, s + j, 32);
        memcpy(&b, s + j + 8, 32);
        lo += a;
        hi += b;
    }
    float z = tree16(lo, hi);
    for (; j < n; j++) z += s[j];
    return z;
}

/* Scores of the nq queries Q [nq, DD] against keys j = lo .. L-1 (query r only up to its
 * position first + r / group): S[r * L + j] = scale * dot_f32(q_r, k_j). Each key is read (and
 * converted) once for all queries. DD a compile-time constant where it can be (64, 128). */
static inline __attribute__((always_inline)) void qk_scores(const float *Q, long nq, long group, long first,
                                                              const void *kc, long slot0, const int64_t *slots,
                                                              long kv, long goff, long lo, long L, long DD,
                                                              float scale, float *S, int bf) {
    float kbuf[1024] __attribute__((aligned(32)));
    for (long j = lo; j < L; j++) {
        long off = (slots ? slots[j] : slot0 + j) * kv + goff;
        for (long c = 0; c < DD; c += 8) {
            v8f v = load8(kc, off + c, bf);
            memcpy(kbuf + c, &v, 32);
        }
        long r0 = j > first ? (j - first) * group : 0; /* queries before position j do not see key j */
        for (long r = r0; r < nq; r++) {
            const float *q = Q + r * DD;
            v8f plo = {0}, phi = {0};
            for (long c = 0; c < DD; c += 16) {
                v8f a, b, a2, b2;
                memcpy(&a, q + c, 32);
                memcpy(&b, kbuf + c, 32);
                memcpy(&a2, q + c + 8, 32);
                memcpy(&b2, kbuf + c + 8, 32);
                plo = fma8(a, b, plo);
                phi = fma8(a2, b2, phi);
            }
            S[r * L + j] = tree16(plo, phi) * scale;
        }
    }
}

/* max(s[0..n)), as the loop m = s[j] > m ? s[j] : m from m = s[0] gives it (NaNs after s[0] are
 * passed over), 8 lanes at a time: a chain of scalar maxima waited ~4 cycles an element. */
static inline float max_f32(const float *s, long n) {
    float m = s[0];
    long j = 1;
    if (n >= 9) {
        v8f m8 = bcast8(m);
        for (; j + 8 <= n; j += 8) {
            v8f v;
            memcpy(&v, s + j, 32);
            m8 = vsel8(v > m8, v, m8);
        }
        for (int l = 0; l < 8; l++) m = m8[l] > m ? m8[l] : m;
    }
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* Attention of one sequence: key position j in cache slot slots[j], or slot0 + j when slots is
 * NULL (consecutive slots). qkv: [T, (H + 2 Hkv) * D] (q heads, k heads, v heads; RoPE applied),
 * its T tokens at positions L - T .. L - 1. Writes their K/V into the caches ([slots, Hkv, D]),
 * then for each query t and head h attends keys max(0, p - window + 1) .. p (p = its position;
 * window 0 = none) with float32 scores and softmax; out: [T, H * D] in the dtype (grouped-query:
 * head h reads K/V head h / (H / Hkv)). The T * H / Hkv queries that share a K/V head are done
 * together: each key and value is read (and converted from bfloat16) once for all of them, and a
 * query's scores and output do not depend on how many queries came with it (bitwise). dw_attend /
 * dw_attend_batch: attend_write, then attend_group for every (sequence, K/V head), threaded. */
#define SLOT(j) (slots ? slots[j] : slot0 + (j)) /* the cache slot of key position j */
/* The K/V write of a sequence's T new tokens (every K/V head), before any head attends. */
static void attend_write(const void *qkv, long T, long H, long Hkv, long D, void *kc, void *vc, long slot0,
                         const int64_t *slots, long L, int bf) {
    long row = (H + 2 * Hkv) * D, kv = Hkv * D, es = bf ? 2 : 4;
    for (long t = 0; t < T; t++) {
        long slot = SLOT(L - T + t);
        memcpy((char *)kc + slot * kv * es, (const char *)qkv + (t * row + H * D) * es, kv * es);
        memcpy((char *)vc + slot * kv * es, (const char *)qkv + (t * row + (H + Hkv) * D) * es, kv * es);
    }
}

/* The queries of K/V head g (its H / Hkv query heads, all T tokens): a unit of work of its own,
 * independent of the other heads (threads may take heads in any order: the same bits). Returns 0,
 * or -1 when scratch memory is not available. */
static int attend_group(const void *qkv, long T, long H, long Hkv, long D, void *kc, void *vc, long slot0,
                        const int64_t *slots, long L, long window, float scale, void *out, int bf, long g) {
    long row = (H + 2 * Hkv) * D, kv = Hkv * D;
    long group = H / Hkv, nq = T * group;
    float *S = (float *)aligned_alloc(32, sizeof(float) * ((nq * L + 2 * nq * D + D + 8) / 8 * 8 + 8));
    if (!S) return -1;
    float *Q = S + nq * L, *A = Q + nq * D, *x = A + nq * D; /* scores [nq, L], queries, outputs, a key */
    long first = L - T; /* position of the first query */
    long lo_all = (window > 0 && first - window + 1 > 0) ? first - window + 1 : 0;
    {
        for (long r = 0; r < nq; r++) { /* query r: token r / group, head g * group + r % group */
            long t = r / group, h = g * group + r % group;
            for (long i = 0; i < D; i++) Q[r * D + i] = ld(qkv, t * row + h * D + i, bf);
        }
        if (D == 64) {
            qk_scores(Q, nq, group, first, kc, slot0, slots, kv, g * D, lo_all, L, 64, scale, S, bf);
        } else if (D == 128) {
            qk_scores(Q, nq, group, first, kc, slot0, slots, kv, g * D, lo_all, L, 128, scale, S, bf);
        } else if ((D & 15) == 0 && D <= 1024) {
            qk_scores(Q, nq, group, first, kc, slot0, slots, kv, g * D, lo_all, L, D, scale, S, bf);
        } else { /* dot_f32's sequential order */
            for (long j = lo_all; j < L; j++) {
                for (long i = 0; i < D; i++) x[i] = ld(kc, SLOT(j) * kv + g * D + i, bf);
                long r0 = j > first ? (j - first) * group : 0;
                for (long r = r0; r < nq; r++) {
                    float s = 0.0f;
                    for (long i = 0; i < D; i++) s += Q[r * D + i] * x[i];
                    S[r * L + j] = s * scale;
                }
            }
        }
        for (long r = 0; r < nq; r++) { /* softmax over each query's own keys lo .. p */
            long p = first + r / group, lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0, n = p + 1 - lo;
            float *s = S + r * L + lo;
            float m = max_f32(s, n);
            long j = 0;
            for (; j + 8 <= n; j += 8) {
                v8f v;
                memcpy(&v, s + j, 32);
                v = exp8(v - m);
                memcpy(s + j, &v, 32);
            }
            for (; j < n; j++) s[j] = exp1(s[j] - m);
            float z = sum8_f32(s, n);
            for (long jj = 0; jj < n; jj++) s[jj] /= z;
        }
        for (long r = 0; r < nq; r++) { /* out = sum_j s_j v_j, 64 outputs at a time in registers */
            long p = first + r / group, lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
            const float *sr = S + r * L;
            float *a = A + r * D;
            long i0 = 0;
            for (; i0 + 64 <= D; i0 += 64) {
                v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
#define PV_STEP(BF)                                                                      \
    for (long j = lo; j <= p; j++) {                                                     \
        long off = SLOT(j) * kv + g * D + i0;                                            \
        v8f w = bcast8(sr[j]);                                                        \
        a0 = fma8(w, load8(vc, off, BF), a0);                                            \
        a1 = fma8(w, load8(vc, off + 8, BF), a1);                                        \
        a2 = fma8(w, load8(vc, off + 16, BF), a2);                                       \
        a3 = fma8(w, load8(vc, off + 24, BF), a3);                                       \
        a4 = fma8(w, load8(vc, off + 32, BF), a4);                                       \
        a5 = fma8(w, load8(vc, off + 40, BF), a5);                                       \
        a6 = fma8(w, load8(vc, off + 48, BF), a6);                                       \
        a7 = fma8(w, load8(vc, off + 56, BF), a7);                                       \
    }
                if (bf) { /* the dtype's branch outside the loop */
                    PV_STEP(1)
                } else {
                    PV_STEP(0)
                }
#undef PV_STEP
                memcpy(a + i0, &a0, 32);
                memcpy(a + i0 + 8, &a1, 32);
                memcpy(a + i0 + 16, &a2, 32);
                memcpy(a + i0 + 24, &a3, 32);
                memcpy(a + i0 + 32, &a4, 32);
                memcpy(a + i0 + 40, &a5, 32);
                memcpy(a + i0 + 48, &a6, 32);
                memcpy(a + i0 + 56, &a7, 32);
            }
            for (; i0 + 8 <= D; i0 += 8) {
                v8f a0 = {0};
                for (long j = lo; j <= p; j++) a0 = fma8(bcast8(sr[j]), load8(vc, SLOT(j) * kv + g * D + i0, bf), a0);
                memcpy(a + i0, &a0, 32);
            }
            for (long i = i0; i < D; i++) {
                float acc = 0.0f;
                for (long j = lo; j <= p; j++) acc += sr[j] * ld(vc, SLOT(j) * kv + g * D + i, bf);
                a[i] = acc;
            }
        }
        for (long r = 0; r < nq; r++) {
            long t = r / group, h = g * group + r % group;
            for (long i = 0; i < D; i++) st(out, t * H * D + h * D + i, A[r * D + i], bf);
        }
    }
    free(S);
    return 0;
}
#undef SLOT

/* ATT_MIN_PARALLEL: below this many query-key-dimension products in a call, its heads run on the
 * calling thread alone (a fork of the OpenMP team costs a few microseconds: a draft model's
 * attention over a short context is less than that). 2^17 left the embedded target's batch-1
 * decode step (6 heads x 64 dims, ~250-380 keys: 100-150K) on one thread; at 2^14, one process
 * alternating library builds on code-easy prompts (AVX-512 EPYC, 2 threads): bfloat16 plain
 * 1.04-1.07x, float32 plain 1.06-1.08x, bfloat16 with the draft 0.99-1.00x; 2^11 the same as 2^14. */
#ifndef ATT_MIN_PARALLEL
#define ATT_MIN_PARALLEL (1L << 14)
#endif

/* One sequence, its K/V heads split across `threads` (torch's OpenMP team) when the work is
 * large enough. Returns 0, or -1 when scratch memory was not available. */
int dw_attend(const void *qkv, long T, long H, long Hkv, long D, void *kc, void *vc, long slot0, long L,
              long window, float scale, void *out, int bf, int threads) {
    attend_write(qkv, T, H, Hkv, D, kc, vc, slot0, NULL, L, bf);
    long nt = (threads > 1 && T * H * L * D >= ATT_MIN_PARALLEL) ? (threads < Hkv ? threads : Hkv) : 1;
    int rc = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1) reduction(| : rc)
    for (long g = 0; g < Hkv; g++) rc |= attend_group(qkv, T, H, Hkv, D, kc, vc, slot0, NULL, L, window, scale, out, bf, g);
    return rc;
}

/* B sequences on paged slots, T rows each: sequence b's key position j is at slots[b * Lmax + j],
 * it has lens[b] keys and news[b] <= T new tokens (its last keys; news NULL: all T), in its first
 * news[b] rows; the rows after them are padding (their outputs are set to zero, nothing written).
 * qkv [B * T, (H + 2 Hkv) * D], out [B * T, H * D]. */
int dw_attend_batch(const void *qkv, long B, long T, long H, long Hkv, long D, void *kc, void *vc,
                    const int64_t *slots, long Lmax, const int64_t *lens, const int64_t *news,
                    const int64_t *offs, long window, float scale, void *out, int bf, int threads) {
    /* offs NULL: sequence b's rows are b*T.. (padded to T, the padding rows zeroed); else packed:
     * its news[b] rows start at row offs[b] (offs[B] rows in all, no padding) */
    long es = bf ? 2 : 4, work = 0;
    for (long b = 0; b < B; b++) {
        long n = news ? news[b] : T, r0 = offs ? offs[b] : b * T;
        char *ob = (char *)out + r0 * H * D * es;
        attend_write((const char *)qkv + r0 * (H + 2 * Hkv) * D * es, n, H, Hkv, D, kc, vc, 0, slots + b * Lmax,
                     lens[b], bf);
        if (!offs) memset(ob + n * H * D * es, 0, (T - n) * H * D * es);
        work += n * H * lens[b] * D;
    }
    /* work items: (sequence, K/V head), longest contexts spread by the dynamic schedule */
    long items = B * Hkv, nt = (threads > 1 && work >= ATT_MIN_PARALLEL) ? (threads < items ? threads : items) : 1;
    int rc = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1) reduction(| : rc)
    for (long it = 0; it < items; it++) {
        long b = it / Hkv, g = it % Hkv;
        long n = news ? news[b] : T, r0 = offs ? offs[b] : b * T;
        rc |= attend_group((const char *)qkv + r0 * (H + 2 * Hkv) * D * es, n, H, Hkv, D, kc, vc, 0, slots + b * Lmax,
                           lens[b], window, scale, (char *)out + r0 * H * D * es, bf, g);
    }
    return rc;
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

/* out[t, o] = x[t] . w[o] (+ bias[o]) for a small weight, given transposed: wt [N, O] (below
 * KERNEL_LINEAR_MAX_NUMEL in llama.py: there a BLAS or oneDNN call costs more than its
 * arithmetic). wt is read row after row (sequential, prefetch-friendly even when it comes from
 * memory), each row multiplied into all outputs' accumulators at once: vertical vector
 * multiply-adds, no per-output lane sums. Each row's result is independent of the other rows
 * (its accumulation order is fixed). bias may be NULL (accumulators start at the bias). */
void dw_linear(const void *x, const void *wt, const void *bias, void *out, long rows, long O, long N, int bf) {
    long Ov = O & ~15L; /* outputs in whole vectors; the rest one by one */
    float *xf = (float *)malloc(sizeof(float) * (rows * N + O + 16));
    float *acc = xf + rows * N;
    for (long i = 0; i < rows * N; i++) xf[i] = ld(x, i, bf);
    for (long t = 0; t < rows; t++) {
        const float *xr = xf + t * N;
        for (long o = 0; o < O; o++) acc[o] = bias ? ld(bias, o, bf) : 0.0f;
#define LIN_ROW(BF)                                                                      \
    for (long i = 0; i < N; i++) { /* wt's rows in memory order: a sequential read */   \
        float xi = xr[i];                                                                \
        long off = i * O;                                                                \
        for (long o = 0; o < Ov; o += 16) {                                              \
            v16f a;                                                                      \
            memcpy(&a, acc + o, 64);                                                     \
            a += xi * load16(wt, off + o, BF);                                           \
            memcpy(acc + o, &a, 64);                                                     \
        }                                                                                \
        for (long o = Ov; o < O; o++) acc[o] += xi * ld(wt, off + o, BF);                \
    }
        if (bf) {
            LIN_ROW(1)
        } else {
            LIN_ROW(0)
        }
#undef LIN_ROW
        for (long o = 0; o < O; o++) st(out, t * O + o, acc[o], bf);
    }
    free(xf);
}

/* ---- int8 weight-only products (quantize.py's Int8Linear) ----
 * out[t, o] = scale[o] * (x[t] . q[o]) (+ bias[o]): q [O, N] int8 (one symmetric scale per output
 * channel), x [rows, N] float32 or bfloat16 (bf), out float32 or bfloat16 (obf). Batch-1 decoding
 * and verification are bound by reading the weights: one byte each here (float32 reads 4). Each
 * 16-byte run of q is widened to 16 floats in registers and multiplied into float32 accumulators;
 * 4 outputs x up to 6 rows share each load (24 accumulators). A (row, output)'s sum runs in one
 * fixed order (16 lanes over the inputs, fused multiply-adds, hsum16, the tail, then the scale and
 * the bias) whatever the rows around it: a row's result is bitwise the same alone or in a block. */
/* Q8_MIN_PARALLEL: weights of fewer elements run on the calling thread alone (a fork of the OpenMP
 * team costs a few microseconds: more than a draft-sized product); dw_gemm_* and dw_linear_q4. */
#ifndef Q8_MIN_PARALLEL
#define Q8_MIN_PARALLEL (1L << 17)
#endif

#ifdef __AVX2__
#include <immintrin.h>
#endif

/* ---- int4 weights (--quantization int4) ----
 * w [O, N] in groups of 32 inputs (Q4_1's layout): byte i of a group's 16 holds q[i] in its low
 * nibble and q[i + 16] in its high one, q in 0..15; sm [O, N/32, 2] float16: the group's step d and
 * minimum m, w = d * q + m. y[r, o] = sum_g (d_g * (x_g . q_g) + m_g * sum(x_g)) + b[o]: each
 * group's dot product on 8 lanes (x_g . q_g, 4 products in order), scaled into an 8-lane
 * accumulator; the m terms in a scalar one. The order is the same for every row whatever the
 * others (a row's result does not depend on the batch). Half a byte a weight plus 4 bytes a group:
 * 0.625 bytes a weight, as Q4_1. */
static inline float h2f(uint16_t h) { /* float16 -> float32, exact */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        float f = (float)m * (1.0f / 16777216.0f); /* zero or subnormal: m * 2^-24 */
        return sign ? -f : f;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112u) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 8 float16 -> 8 floats (exact; dw_gemm_q8g's group scales) */
static inline v8f h8x8f(const uint16_t *p) {
#ifdef __F16C__
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8f v;
    for (int l = 0; l < 8; l++) v[l] = h2f(p[l]);
    return v;
#endif
}

/* One group's 32 weights of an output as 4 x 8 floats (the nibbles' values 0..15) */
#ifdef __AVX2__
static inline void q4_unpack(const uint8_t *p, v8f w[4]) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    w[0] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#else
typedef uint8_t v8b __attribute__((vector_size(8)));
static inline v8f u8x8f(uint64_t b) {
    v8b c;
    memcpy(&c, &b, 8);
    return __builtin_convertvector(__builtin_convertvector(c, v8i), v8f);
}
static inline void q4_unpack(const uint8_t *p, v8f w[4]) {
    const uint64_t lo4 = 0x0f0f0f0f0f0f0f0full;
    uint64_t b0, b1;
    memcpy(&b0, p, 8);
    memcpy(&b1, p + 8, 8);
    w[0] = u8x8f(b0 & lo4), w[1] = u8x8f(b1 & lo4), w[2] = u8x8f((b0 >> 4) & lo4), w[3] = u8x8f((b1 >> 4) & lo4);
}
#endif

/* a group's (step, minimum) from float16 */
static inline void q4_dm(const uint16_t *dm, float *d, float *m) {
#ifdef __F16C__
    __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(dm[0] | ((uint32_t)dm[1] << 16))));
    *d = _mm_cvtss_f32(v);
    *m = _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1));
#else
    *d = h2f(dm[0]);
    *m = h2f(dm[1]);
#endif
}

static inline float hsum8(v8f v) { /* (l + l+4), then pairs */
    float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
    return (a0 + a2) + (a1 + a3);
}

/* NR rows (1..4) x NO outputs (1, 2 or 4) from row r0, output o0; xs [rows, N/32]: each row's group sums */
static inline __attribute__((always_inline)) void q4_block(const float *xf, const float *xs, const uint8_t *q,
                                                           const uint16_t *sm, const float *bias, void *out, long r0,
                                                           long o0, long O, long N, int NR, int NO, int obf) {
    const long G = N / 32, rowb = N / 2;
    v8f acc[4][4];
    float macc[4][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NO; j++) {
            acc[r][j] = (v8f){0};
            macc[r][j] = 0.0f;
        }
    for (long g = 0; g < G; g++) {
        if ((g & 3) == 0) /* the output rows 3 blocks ahead, a cache line each per 4 groups (the hardware
                             prefetcher alone left int8 weights in this layout at a third of the rate) */
            for (int j = 0; j < NO; j++) __builtin_prefetch(q + (o0 + 3 * NO + j) * rowb + g * 16, 0, 3);
        for (int j = 0; j < NO; j++) {
            v8f w[4];
            q4_unpack(q + (o0 + j) * rowb + g * 16, w);
            float d, m;
            q4_dm(sm + ((o0 + j) * G + g) * 2, &d, &m);
            v8f dv = bcast8(d);
            for (int r = 0; r < NR; r++) {
                const float *x = xf + (r0 + r) * N + g * 32;
                v8f x0, x1, x2, x3;
                memcpy(&x0, x, 32);
                memcpy(&x1, x + 8, 32);
                memcpy(&x2, x + 16, 32);
                memcpy(&x3, x + 24, 32);
                v8f t = x0 * w[0];
                t = fma8(x1, w[1], t);
                t = fma8(x2, w[2], t);
                t = fma8(x3, w[3], t);
                acc[r][j] = fma8(dv, t, acc[r][j]);
                macc[r][j] += m * xs[(r0 + r) * G + g];
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NO; j++) {
            float y = hsum8(acc[r][j]) + macc[r][j];
            if (bias) y += bias[o0 + j];
            st(out, (r0 + r) * O + o0 + j, y, obf);
        }
}

#define Q4_ROWS(NO, MAXR)                                                                        \
    for (long r0 = 0; r0 < rows; r0 += MAXR) {                                                   \
        switch (rows - r0 < MAXR ? rows - r0 : MAXR) {                                           \
        case 4: q4_block(xf, xs, q, sm, bias, out, r0, o0, O, N, 4, NO, obf); break;             \
        case 3: q4_block(xf, xs, q, sm, bias, out, r0, o0, O, N, 3, NO, obf); break;             \
        case 2: q4_block(xf, xs, q, sm, bias, out, r0, o0, O, N, 2, NO, obf); break;             \
        default: q4_block(xf, xs, q, sm, bias, out, r0, o0, O, N, 1, NO, obf); break;            \
        }                                                                                        \
    }

static void q4_range(const float *xf, const float *xs, const uint8_t *q, const uint16_t *sm, const float *bias,
                     void *out, long rows, long O, long N, long o_begin, long o_end, int obf) {
    long o0 = o_begin;
    if (rows == 1)
        for (; o0 + 4 <= o_end; o0 += 4) Q4_ROWS(4, 1)
    else if (rows == 2)
        for (; o0 + 2 <= o_end; o0 += 2) Q4_ROWS(2, 2)
    for (; o0 < o_end; o0++) Q4_ROWS(1, 4)
}
#undef Q4_ROWS

/* x [rows, N] (float32, or bfloat16 when bf) times the int4 weight above, N a multiple of 32; out
 * [rows, O] (bfloat16 when obf). Weights of >= Q8_MIN_PARALLEL elements: the outputs split across
 * `threads` OpenMP threads in whole 4-output blocks (a (row, output)'s arithmetic does not depend on it). */
void dw_linear_q4(const void *x, const uint8_t *q, const uint16_t *sm, const float *bias, void *out, long rows,
                  long O, long N, int threads, int bf, int obf) {
    long G = N / 32;
    float *xf = (float *)malloc(sizeof(float) * (rows * N + rows * G + 16));
    float *xs = xf + rows * N;
    for (long i = 0; i < rows * N; i++) xf[i] = ld(x, i, bf);
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < G; g++) {
            float t = 0.0f;
            for (int i = 0; i < 32; i++) t += xf[r * N + g * 32 + i];
            xs[r * G + g] = t;
        }
    long nt = (threads > 1 && O * N >= Q8_MIN_PARALLEL) ? threads : 1, blocks = (O + 3) / 4;
    if (nt > blocks) nt = blocks;
#pragma omp parallel for num_threads(nt) schedule(static, 1) if (nt > 1)
    for (long t = 0; t < nt; t++) {
        long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        q4_range(xf, xs, q, sm, bias, out, rows, O, N, 4 * b0, 4 * b1 < O ? 4 * b1 : O, obf);
    }
    free(xf);
}

/* Float32 products against a weight packed as [ceil(O/16)][N][16] (`dw_pack`: for each input
 * k the weights of 16 consecutive outputs side by side; the last block's missing outputs are zero).
 * Each output is an FMA chain over k in order, restarted from zero every GEMM_KB inputs, the
 * chains' sums added in order, then the bias: the order of oneDNN's float32 product on AVX2 (the
 * loader checks the two bitwise per weight before using this one, see llama.py), and the same for
 * every row whatever the others: a row's result does not depend on the batch.
 *
 * Register blocking: NR rows x NB 16-output blocks, two 8-lane accumulators each (<= 12 of the 16
 * AVX2 registers): 1 row x 4 blocks, 2 x 2, or up to 6 x 1; the weights of a block stream from
 * memory once per 48 rows (RC) and stay in cache for the row blocks of that chunk. */
#define GEMM_KB 1024
#define GROUP_Q8 32 /* dw_gemm_q8g: inputs per scale (llama.cpp's Q8_0 block) */
#define GEMM_RC 48
/* 2 to GEMM_NB2_ROWS rows (a verification block of up to 5 tokens) take two output blocks per
 * register block, all their rows in one (GEMM_NB2_RS: 20 accumulators at 5 rows, a few spilled):
 * two weight streams per thread instead of one. SmolLM2-135M's 30 layers of products on the
 * AVX2-only EPYC, 2 threads, alternating: 3 / 4 / 5 rows 32.3 / 33.1 / 35.6 ms with one block
 * per register block, 30.4 / 31.1 / 30.5 with two (6 rows as 5 + 1 lost: 31.1 -> 33.7 ms, so 6
 * and more keep one block, 6 rows each). The sums are the same: each output's accumulation runs
 * over k in the same order whatever the blocking. */
#ifndef GEMM_NB2_ROWS
#define GEMM_NB2_ROWS 5
#endif
#ifndef GEMM_NB2_RS
#define GEMM_NB2_RS 5
#endif
#ifndef GEMM_PREFETCH
#define GEMM_PREFETCH 512 /* floats ahead in a block's stream (32 lines) */
#endif
/* the prefetches' locality hint: 0 (prefetchnta, measured on the EPYCs) unless the build says
 * otherwise. cpu_kernels.py builds with 1 (prefetcht2) on Intel CPUs: on the Sapphire Rapids Xeon
 * (2 threads, the 20M target's 33 float32 products, builds alternating, ms at 2 / 5 / 16 rows)
 * prefetchnta took 6.56 / 6.15 / 9.31 against 2.89 / 2.98 / 5.00 with prefetcht2 (3.10 / 3.66 / 6.17
 * with no prefetch; one row 1.27 ms in all three, bits the same). */
#ifndef GEMM_PREFETCH_LOCALITY
#define GEMM_PREFETCH_LOCALITY 0
#endif

/* 8 int8 weights -> 8 floats (dw_gemm_q8's packed int8 weights) */
#ifdef __AVX2__
static inline v8f i8x8f(const void *p) {
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
typedef int8_t v8sc __attribute__((vector_size(8)));
static inline v8f i8x8f(const void *p) {
    v8sc c;
    memcpy(&c, p, 8);
    return __builtin_convertvector(__builtin_convertvector(c, v8i), v8f);
}
#endif

/* A register block's sums for outputs o0..o0+15 of one row (y: the row): stored (the first
 * k-block) or added to what the earlier k-blocks left; outputs past O dropped. */
static inline void gemm_out16(const float *v, float *y, long O, long o0, int first) {
    long n = O - o0 < 16 ? O - o0 : 16;
    y += o0;
    if (first)
        for (long l = 0; l < n; l++) y[l] = v[l];
    else
        for (long l = 0; l < n; l++) y[l] = y[l] + v[l];
}

#if defined(__AVX512F__) && !defined(DW_GEMM8)
/* gemm_out16 for a 16-lane register: a whole block of outputs one vector store (or load, add,
 * store: the same sums as gemm_out16's), the last partial block through gemm_out16 */
static inline void gemm_store16(__m512 acc, float *y, long O, long o0, int first) {
    if (o0 + 16 <= O) {
        _mm512_storeu_ps(y + o0, first ? acc : _mm512_add_ps(_mm512_loadu_ps(y + o0), acc));
        return;
    }
    float v[16];
    _mm512_storeu_ps(v, acc);
    gemm_out16(v, y, O, o0, first);
}

/* gemm_block on AVX-512 for weights of kind 0-2 (float32, bfloat16, int8 with one scale per
 * output): each 16-output block's accumulator is one 16-lane register instead of two 8-lane ones,
 * a block's 16 weights widened in one go. Every output's FMA chain is the same (lane l of block j
 * accumulates x[k] * w[k][l] over k in order, fused), so are the bits; half the instructions
 * (bfloat16 weights are widened in registers: bound by instructions rather than by memory). The
 * 20M target's 33 products, AVX-512 EPYC, 2 threads, library builds with and without this block
 * alternating (-DDW_GEMM8 keeps the 8-lane one), ms at 1 / 5 / 16 / 64 rows: bfloat16 1.68 /
 * 1.94 / 4.36 / 13.3 against 1.75 / 2.23 / 6.21 / 21.8; float32 2.56 / 3.52 / 4.80 / 14.1
 * against 2.51 / 3.53 / 5.88 / 16.4; bitwise the same results. */
static inline __attribute__((always_inline)) void gemm_block16(const float *x, long N, const void *wp, long ob,
                                                               long k0, long k1, float *out, long O, int NR, int NB,
                                                               int first, int WB) {
    __m512 acc[6][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    long es = WB >= 2 ? 1 : WB ? 2 : 4;
    const char *w = (const char *)wp + (ob * N + k0) * 16 * es;
    for (long k = k0; k < k1; k++, w += 16 * es) {
        /* as gemm_block's, but not for one row of bfloat16 weights either: the 20M target's 33
         * products at 1 row, AVX-512 EPYC, 2 threads, library builds alternating: 1.27 / 1.51 ms
         * without against 1.39 / 1.76 with (at 5 rows the prefetch still pays: 1.58 / 1.75 with,
         * 1.64 / 1.91 without; the engine's bfloat16 batch-1 decoding, library builds alternating in
         * one process: 1.01-1.03x plain, 1.00-1.02x with the draft) */
        if ((WB && !(WB == 1 && NB == 4)) || NB < 4)
            for (int j = 0; j < NB; j++) __builtin_prefetch(w + (j * N * 16 + GEMM_PREFETCH) * es, 0, GEMM_PREFETCH_LOCALITY);
        __m512 wv[4];
        for (int j = 0; j < NB; j++) {
            const char *p = w + j * N * 16 * es;
            if (WB >= 2)
                wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            else if (WB)
                wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
            else
                wv[j] = _mm512_loadu_ps((const float *)p);
        }
        for (int r = 0; r < NR; r++) {
            __m512 xb = _mm512_set1_ps(x[r * N + k]);
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_fmadd_ps(xb, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) gemm_store16(acc[r][j], out + r * O, O, (ob + j) * 16, first);
}
#endif

static inline __attribute__((always_inline)) void gemm_block(const float *x, long N, const void *wp, long ob,
                                                             long k0, long k1, float *out, long O, int NR, int NB,
                                                             int first, int WB, const uint16_t *gs) {
#if defined(__AVX512F__) && !defined(DW_GEMM8)
    if (WB <= 2) {
        gemm_block16(x, N, wp, ob, k0, k1, out, O, NR, NB, first, WB);
        return;
    }
#endif
    v8f acc[6][4][2];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) acc[r][j][0] = acc[r][j][1] = (v8f){0};
    long es = WB >= 2 ? 1 : WB ? 2 : 4; /* int8 (3: with group scales), bfloat16 or float32 weights */
    const char *w = (const char *)wp + (ob * N + k0) * 16 * es;
    for (long k = k0; k < k1; k++, w += 16 * es) {
        /* a line a k (float32; half a line for bfloat16). Not for one row of float32 weights (4
         * blocks, 4 streams a line a k): the hardware's prefetchers keep up there, and the software
         * prefetch cost time (the 20M target's float32 decode step, AVX2 EPYC, 2 threads, calls
         * alternated: 4.02 ms without against 4.71 with; its bfloat16 step 2.66 with, 2.96 without) */
        if (WB || NB < 4)
            for (int j = 0; j < NB; j++) __builtin_prefetch(w + (j * N * 16 + GEMM_PREFETCH) * es, 0, GEMM_PREFETCH_LOCALITY);
        v8f w0[4], w1[4];
        for (int j = 0; j < NB; j++) {
            if (WB >= 2) {
                w0[j] = i8x8f(w + j * N * 16);
                w1[j] = i8x8f(w + j * N * 16 + 8);
            } else {
                w0[j] = load8(w + j * N * 16 * es, 0, WB);
                w1[j] = load8(w + j * N * 16 * es, 8, WB);
            }
        }
        for (int r = 0; r < NR; r++) {
            v8f xb = bcast8(x[r * N + k]);
            for (int j = 0; j < NB; j++) {
                acc[r][j][0] = fma8(xb, w0[j], acc[r][j][0]);
                acc[r][j][1] = fma8(xb, w1[j], acc[r][j][1]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) {
            if (WB == 3) { /* this k-block is one group of GROUP_Q8 inputs: y += acc * its 16 scales (the
                              caller's rows are whole blocks of 16: O a multiple of 16) */
                const uint16_t *sc = gs + ((ob + j) * (N / GROUP_Q8) + k0 / GROUP_Q8) * 16;
                float *y = out + r * O + (ob + j) * 16;
                v8f s0 = h8x8f(sc), s1 = h8x8f(sc + 8), y0, y1;
                if (first) {
                    y0 = acc[r][j][0] * s0;
                    y1 = acc[r][j][1] * s1;
                } else {
                    memcpy(&y0, y, 32);
                    memcpy(&y1, y + 8, 32);
                    y0 = fma8(acc[r][j][0], s0, y0);
                    y1 = fma8(acc[r][j][1], s1, y1);
                }
                memcpy(y, &y0, 32);
                memcpy(y + 8, &y1, 32);
                continue;
            }
            float v[16];
            memcpy(v, &acc[r][j][0], 32);
            memcpy(v + 8, &acc[r][j][1], 32);
            gemm_out16(v, out + r * O, O, (ob + j) * 16, first);
        }
}

#define GEMM_ROWS(NB, WB)                                                                                \
    for (long r0 = rc; r0 < rc_end; r0 += rs) {                                                          \
        const float *xr = x + r0 * N;                                                                    \
        float *yr = out + r0 * O;                                                                        \
        switch (rc_end - r0 < rs ? rc_end - r0 : rs) {                                                   \
        case 6: gemm_block(xr, N, wp, ob, k0, k1, yr, O, 6, NB, first, WB, gs); break;                       \
        case 5: gemm_block(xr, N, wp, ob, k0, k1, yr, O, 5, NB, first, WB, gs); break;                       \
        case 4: gemm_block(xr, N, wp, ob, k0, k1, yr, O, 4, NB, first, WB, gs); break;                       \
        case 3: gemm_block(xr, N, wp, ob, k0, k1, yr, O, 3, NB, first, WB, gs); break;                       \
        case 2: gemm_block(xr, N, wp, ob, k0, k1, yr, O, 2, NB, first, WB, gs); break;                       \
        default: gemm_block(xr, N, wp, ob, k0, k1, yr, O, 1, NB, first, WB, gs); break;                      \
        }                                                                                                \
    }

/* the register block for this step's output blocks (step 4, 2 or 1), weights of kind WB */
#define GEMM_STEP(WB)              \
    {                              \
        if (step == 4) {           \
            GEMM_ROWS(4, WB)       \
        } else if (step == 2) {    \
            GEMM_ROWS(2, WB)       \
        } else {                   \
            GEMM_ROWS(1, WB)       \
        }                          \
    }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(DW_GEMM8) && !defined(DW_NO_DPBF16)
#define GEMM_DPBF16 1
/* bfloat16 weights times bfloat16 rows where the CPU has AVX-512 BF16 (VDPBF16PS: Zen 4 EPYC,
 * Sapphire Rapids Xeon): each instruction adds the products of two inputs (k, k+1) to 16 float32
 * sums, the bfloat16 operands used as they are (no widening: a block's two packed weight rows are
 * one 64-byte load and one lane shuffle into pairs, a row's two inputs one 32-bit broadcast).
 * Every output's chain is fixed: pairs in input order within a GEMM_KB block, the odd last input
 * by one FMA, blocks added in order; a row's sums do not depend on the other rows or the threads.
 * The products of two bfloat16 values are exact in float32; the instruction rounds each addition
 * to nearest even and flushes denormals (a different float32 rounding sequence from the widened
 * FMA chain of gemm_block16: sums equal within float32 rounding). The 20M target's 33 products,
 * Sapphire Rapids Xeon (AMX, AVX-512 BF16), 2 threads, best of 15, ms at 1 / 2 / 5 / 16 / 64 rows:
 * this block (no prefetch) 0.68 / 1.62 / 1.84 / 3.87 / 13.5 against the widened chain's (with its
 * prefetchnta) 0.70 / 2.19 / 2.27 / 5.42 / 17.9, builds alternating (-DDW_NO_DPBF16); SmolLM2-135M's
 * 120: 7.7 / 10.3 / 11.6 / 23.6 / 79.8 against 7.8 / 16.0 / 15.2 / 37.3 / 129.8. A later run, this
 * block with prefetcht2 (GEMM_PREFETCH_LOCALITY 1) against none: 0.73 / 0.78 / 1.16 / 3.50 / 13.7
 * against 0.76 / 0.78 / 1.18 / 3.50 / 14.2 (prefetchnta: 2.6 ms at 1 row). `benchmarks/peer_llamacpp.py`
 * in bfloat16 (the embedded pair, k=4), builds in turn: speculative 1387 against 813 tok/s, plain
 * 1136 / 1127. */
static const uint16_t DP_PAIRS[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

static inline __attribute__((always_inline)) void gemm_block_dp(const uint16_t *x, long N, const uint16_t *wp,
                                                                long ob, long k0, long k1, float *out, long O,
                                                                int NR, int NB, int first) {
    __m512 acc[6][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    const __m512i pairs = _mm512_loadu_si512((const void *)DP_PAIRS);
    const uint16_t *w = wp + (ob * N + k0) * 16;
    long k = k0;
    for (; k + 1 < k1; k += 2, w += 32) {
        __m512bh wv[4];
        for (int j = 0; j < NB; j++) {
            __builtin_prefetch(w + j * N * 16 + GEMM_PREFETCH, 0, GEMM_PREFETCH_LOCALITY);
            wv[j] = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_loadu_si512((const void *)(w + j * N * 16)));
        }
        for (int r = 0; r < NR; r++) {
            uint32_t two;
            memcpy(&two, x + r * N + k, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)two);
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
        }
    }
    if (k < k1) /* an odd last input: widened, one FMA (the product is exact either way) */
        for (int j = 0; j < NB; j++) {
            __m512 wf = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + j * N * 16))), 16));
            for (int r = 0; r < NR; r++) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(bf2f(x[r * N + k])), wf, acc[r][j]);
        }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) gemm_store16(acc[r][j], out + r * O, O, (ob + j) * 16, first);
}

#define GEMM_DP_ROWS(NB)                                                                                \
    switch (nr) {                                                                                       \
    case 6: gemm_block_dp(xr, N, wp, ob, k0, k1, yr, O, 6, NB, first); break;                           \
    case 5: gemm_block_dp(xr, N, wp, ob, k0, k1, yr, O, 5, NB, first); break;                           \
    case 4: gemm_block_dp(xr, N, wp, ob, k0, k1, yr, O, 4, NB, first); break;                           \
    case 3: gemm_block_dp(xr, N, wp, ob, k0, k1, yr, O, 3, NB, first); break;                           \
    case 2: gemm_block_dp(xr, N, wp, ob, k0, k1, yr, O, 2, NB, first); break;                           \
    default: gemm_block_dp(xr, N, wp, ob, k0, k1, yr, O, 1, NB, first); break;                          \
    }

/* gemm_range's loops for gemm_block_dp: 4 output blocks (2 or 1 at a range's end) by up to 6 rows
 * a register block (24 sums, 4 weight pairs, one broadcast: 29 of the 32 registers). */
static void gemm_dp_range(const uint16_t *x, const uint16_t *wp, float *out, long rows, long O, long N, long b0,
                          long b1) {
    for (long rc = 0; rc < rows; rc += GEMM_RC) {
        long rc_end = rc + GEMM_RC < rows ? rc + GEMM_RC : rows;
        for (long ob = b0; ob < b1;) {
            int step = ob + 4 <= b1 ? 4 : ob + 2 <= b1 ? 2 : 1;
            for (long k0 = 0; k0 < N; k0 += GEMM_KB) {
                long k1 = k0 + GEMM_KB < N ? k0 + GEMM_KB : N;
                int first = k0 == 0;
                for (long r0 = rc; r0 < rc_end; r0 += 6) {
                    const uint16_t *xr = x + r0 * N;
                    float *yr = out + r0 * O;
                    long nr = rc_end - r0 < 6 ? rc_end - r0 : 6;
                    if (step == 4)
                        GEMM_DP_ROWS(4)
                    else if (step == 2)
                        GEMM_DP_ROWS(2)
                    else
                        GEMM_DP_ROWS(1)
                }
            }
            ob += step;
        }
    }
}
#undef GEMM_DP_ROWS
#endif

static void gemm_range(const void *xv, const void *wp, float *out, long rows, long O, long N, long b0, long b1,
                       int wb, const uint16_t *gs) {
#ifdef GEMM_DPBF16
    if (wb == 4) { /* bfloat16 rows and weights: VDPBF16PS */
        gemm_dp_range((const uint16_t *)xv, (const uint16_t *)wp, out, rows, O, N, b0, b1);
        return;
    }
#endif
    const float *x = (const float *)xv;
    long kb = wb == 3 ? GROUP_Q8 : GEMM_KB; /* group scales: one k-block a group */
    int nb = rows == 1 ? 4 : rows <= GEMM_NB2_ROWS ? 2 : 1; /* output blocks per register block */
#if defined(__AVX512F__) && !defined(DW_GEMM8)
    /* gemm_block16's 32 registers hold 6 rows x 4 blocks (24 sums): past a verification block's
     * rows, each weight vector loaded feeds 6 rows x 4 blocks of FMAs instead of 6 x 1 (the 20M
     * target's 33 float32 products, Sapphire Rapids Xeon, 2 threads, builds alternating, with
     * gemm_store16's vector stores: 1.83 / 2.94 / 5.25 / 11.5 / 32.7 against 2.27 / 3.50 / 6.75 /
     * 14.7 / 41.1 ms at 8 / 16 / 32 / 80 / 256 rows, 1.33 against 1.42 at 5; the same bits. Four
     * blocks at 2-5 rows lost: 1.49 against 1.40 ms at 5) */
    if (wb <= 2 && rows > GEMM_NB2_ROWS) nb = 4;
#endif
    for (long rc = 0; rc < rows; rc += GEMM_RC) {
        long rc_end = rc + GEMM_RC < rows ? rc + GEMM_RC : rows;
        for (long ob = b0; ob < b1;) {
            int step = (nb == 4 && ob + 4 <= b1) ? 4 : (nb >= 2 && ob + 2 <= b1) ? 2 : 1;
            long rs = step == 1 || rows > GEMM_NB2_ROWS ? 6 : step == 2 ? GEMM_NB2_RS : 1; /* rows per register block */
            for (long k0 = 0; k0 < N; k0 += kb) {
                long k1 = k0 + kb < N ? k0 + kb : N;
                int first = k0 == 0;
                if (wb == 3)
                    GEMM_STEP(3)
                else if (wb == 2)
                    GEMM_STEP(2)
                else if (wb)
                    GEMM_STEP(1)
                else
                    GEMM_STEP(0)
            }
            ob += step;
        }
    }
}
#undef GEMM_STEP
#undef GEMM_ROWS

/* gemm_range over all output blocks, split into `threads` ranges (OpenMP, torch's own team) of
 * whole groups of 4 blocks when the weight is large enough; wb: 0 float32, 1 bfloat16, 2 int8 weights,
 * 3 int8 weights with a scale per group of GROUP_Q8 inputs (gs [ceil(O/16)][N/GROUP_Q8][16] float16). */
static void gemm_threads(const void *x, const void *wp, float *out, long rows, long O, long N, int threads, int wb,
                         const uint16_t *gs) {
    long blocks = (O + 15) / 16;
    long nt = (threads > 1 && O * N >= Q8_MIN_PARALLEL) ? threads : 1;
    if (nt > blocks / 4) nt = blocks / 4 > 1 ? blocks / 4 : 1;
#pragma omp parallel for num_threads(nt) schedule(static, 1) if (nt > 1)
    for (long t = 0; t < nt; t++) {
        long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        b0 = (b0 + 3) & ~3L; /* whole groups of 4 blocks per thread (the last may be short) */
        b1 = t == nt - 1 ? blocks : ((b1 + 3) & ~3L);
        if (b0 < b1) gemm_range(x, wp, out, rows, O, N, b0, b1, wb, gs);
    }
}

/* out [rows, O] = x [rows, N] times the packed weight (+ bias [O], may be NULL). */
void dw_gemm_f32(const float *x, const float *wp, const float *bias, float *out, long rows, long O, long N,
                 int threads) {
    gemm_threads(x, wp, out, rows, O, N, threads, 0, NULL);
    if (bias)
        for (long r = 0; r < rows; r++)
            for (long o = 0; o < O; o++) out[r * O + o] = out[r * O + o] + bias[o];
}

/* The int8 products (x float32, or bfloat16 when bf; out bfloat16 when obf): the weights packed by
 * dw_pack (es 1), widened in registers, dw_gemm_f32's register blocks and FMA chains. group 0: one
 * scale per output (scale [O]), out = (x . q) * scale + bias, each output's chain restarted every
 * GEMM_KB inputs; group GROUP_Q8: scale [ceil(O/16)][N/GROUP_Q8][16] float16, one k-block a group, its chain
 * added to the output by one FMA with the group's scale, groups in order (the rows computed as whole
 * blocks of 16 outputs). One fixed order per (row, output): rows independent of the batch and threads. */
static void q8_product(const void *x, const int8_t *wp, const void *scale, int group, const float *bias, void *out,
                       long rows, long O, long N, int threads, int bf, int obf) {
    long Op = group ? (O + 15) & ~15L : O; /* group scales: the packed outputs (zero past O), whole blocks */
    float *xf = (float *)malloc(sizeof(float) * (rows * N + rows * Op + 16));
    float *y = xf + rows * N;
    for (long i = 0; i < rows * N; i++) xf[i] = ld(x, i, bf);
    gemm_threads(xf, wp, y, rows, Op, N, threads, group ? 3 : 2, group ? (const uint16_t *)scale : NULL);
    for (long r = 0; r < rows; r++)
        for (long o = 0; o < O; o++) {
            float v = group ? y[r * Op + o] : y[r * O + o] * ((const float *)scale)[o];
            if (bias) v += bias[o];
            st(out, r * O + o, v, obf);
        }
    free(xf);
}

/* int8 weights, scale [O] per output: one weight stream per 16 outputs, a quarter of float32's bytes. */
void dw_gemm_q8(const void *x, const int8_t *wp, const float *scale, const float *bias, void *out, long rows, long O,
                long N, int threads, int bf, int obf) {
    q8_product(x, wp, scale, 0, bias, out, rows, O, N, threads, bf, obf);
}

/* int8 weights with one scale per group of GROUP_Q8 inputs of each output (llama.cpp's Q8_0 blocks kept
 * as they are), gs [ceil(O/16)][N/GROUP_Q8][16] float16; N a multiple of GROUP_Q8. */
void dw_gemm_q8g(const void *x, const int8_t *wp, const uint16_t *gs, const float *bias, void *out, long rows, long O,
                 long N, int threads, int bf, int obf) {
    q8_product(x, wp, gs, GROUP_Q8, bias, out, rows, O, N, threads, bf, obf);
}

/* dw_gemm_bf16's product before its rounding: float32 results (bias added in float32): a bfloat16
 * LM head's logits as float32 sums of the bfloat16 weights times the bfloat16 hidden states, the
 * values head_precision.py's refinement recomputes for a row's top logits, for every logit. */
void dw_gemm_bf16_f32out(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, float *out, long rows, long O,
                         long N, int threads) {
#ifdef GEMM_DPBF16
    gemm_threads(x, wp, out, rows, O, N, threads, 4, NULL);
#else
    float *xf = (float *)malloc(sizeof(float) * (rows * N + 16));
    for (long i = 0; i < rows * N; i++) xf[i] = bf2f(x[i]);
    gemm_threads(xf, wp, out, rows, O, N, threads, 1, NULL);
    free(xf);
#endif
    if (bias)
        for (long r = 0; r < rows; r++)
            for (long o = 0; o < O; o++) out[r * O + o] = out[r * O + o] + bf2f(bias[o]);
}

/* bfloat16: x [rows, N], the packed weight, bias [O] (may be NULL) and out [rows, O] in bfloat16:
 * float32 sums (VDPBF16PS pairs with AVX-512 BF16, see gemm_block_dp; elsewhere the weights widened
 * to float32 in registers, float32 FMA chains as dw_gemm_f32's: half the bytes of float32 to
 * stream), the bias added in float32, one rounding to bfloat16 at the end (as F.linear rounds its
 * float32 accumulation). */
void dw_gemm_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, long rows, long O,
                  long N, int threads) {
    float *yf = (float *)malloc(sizeof(float) * (rows * O + 16));
    dw_gemm_bf16_f32out(x, wp, bias, yf, rows, O, N, threads);
    for (long i = 0; i < rows * O; i++) out[i] = f2bf(yf[i]); /* one rounding, as F.linear's */
    free(yf);
}

/* wp [ceil(O/16)][N][16] from w [O, N] (row-major, as nn.Linear keeps it), elements of `es` bytes
 * (4: float32, 2: bfloat16); the last block's missing outputs zero */
void dw_pack(const void *w, void *wp, long O, long N, long es) {
    long blocks = (O + 15) / 16;
    for (long b = 0; b < blocks; b++)
        for (long k = 0; k < N; k++)
            for (long l = 0; l < 16; l++) {
                long o = b * 16 + l;
                char *dst = (char *)wp + ((b * N + k) * 16 + l) * es;
                if (o < O)
                    memcpy(dst, (const char *)w + (o * N + k) * es, es);
                else
                    memset(dst, 0, es);
            }
}

/* ---- the whole decoder in one call ----
 * One projection of dw_decoder, by kind: 0 dw_linear (w transposed [N, O], a small weight), 1
 * dw_gemm_f32 (w packed by dw_pack, float32), 2 dw_gemm_bf16 (packed bfloat16), 3 dw_gemm_q8
 * (w int8 packed by dw_pack, scale [O] float32, bias float32), 4 dw_linear_q4 (int4 groups,
 * scale the float16 (step, minimum) pairs), 5 dw_gemm_q8g (int8 packed, scale the group scales):
 * what the layer-by-layer path (LlamaModel._fused_forward) calls for that weight, with the same
 * arguments: the same bits. */
static void dw_product(int kind, const void *x, const void *w, const void *bias, const void *scale, void *out,
                       long rows, long O, long N, int bf, int threads) {
    switch (kind) {
    case 0: dw_linear(x, w, bias, out, rows, O, N, bf); break;
    case 1: dw_gemm_f32(x, w, bias, out, rows, O, N, threads); break;
    case 2: dw_gemm_bf16(x, w, bias, out, rows, O, N, threads); break;
    case 4: dw_linear_q4(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    case 5: dw_gemm_q8g(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    default: dw_gemm_q8(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    }
}

/* Every decoder layer, for B sequences of T rows (one sequence on consecutive slots: slots NULL,
 * slot0 and L; else paged, with padding rows or packed by offs, as dw_attend_batch): the calls
 * LlamaModel._fused_forward makes per layer, in one call (a draft model's whole forward, or a
 * target's decode / verification step: Python only schedules). x [R, hid] is the residual stream
 * (updated in place; R = B * T, or offs[B] packed), h [R, hid] receives the final-normalised
 * hidden states. w holds 14 pointers per layer: ln1, then (weight, bias, scale) of the qkv, o,
 * gate/up and down projections, ln2 after o's (biases and scales may be NULL); kinds holds the 4
 * projections' kinds per layer (dw_product). Caches: layer l's K at cache + l * layer_stride
 * elements, its V kv_stride further. threads: the products' and attention's OpenMP threads.
 * Returns 0, or -1 when scratch memory is not available. */
int dw_decoder(void *x, void *h, long B, long T, long layers, long hid, long H, long Hkv, long D, long I,
               void **w, const int *kinds, const void *final_norm, float eps, const int64_t *pos, const float *cos,
               const float *sin, void *cache, long layer_stride, long kv_stride, long slot0, long L,
               const int64_t *slots, long Lmax, const int64_t *lens, const int64_t *news, const int64_t *offs,
               long window, float scale, int bf, int threads) {
    long es = bf ? 2 : 4, qkvw = (H + 2 * Hkv) * D;
    long R = offs ? offs[B] : B * T; /* rows (packed: offs[B]) */
    char *buf = (char *)malloc(es * R * (qkvw + H * D + hid + 3 * I + hid));
    if (!buf) return -1;
    char *qkv = buf, *y = qkv + es * R * qkvw, *o = y + es * R * H * D, *gu = o + es * R * hid;
    char *a = gu + es * R * 2 * I, *d = a + es * R * I;
    int rc = 0;
    dw_rms_norm(x, w[0], h, R, hid, eps, bf);
    for (long l = 0; l < layers && rc == 0; l++) {
        void **W = w + 14 * l;
        const int *K = kinds + 4 * l;
        char *kc = (char *)cache + l * layer_stride * es;
        dw_product(K[0], h, W[1], W[2], W[3], qkv, R, qkvw, hid, bf, threads);
        dw_rope(qkv, R, qkvw, H + Hkv, D, pos, cos, sin, bf);
        if (slots)
            rc = dw_attend_batch(qkv, B, T, H, Hkv, D, kc, kc + kv_stride * es, slots, Lmax, lens, news, offs,
                                 window, scale, y, bf, threads);
        else
            rc = dw_attend(qkv, T, H, Hkv, D, kc, kc + kv_stride * es, slot0, L, window, scale, y, bf, threads);
        dw_product(K[1], y, W[4], W[5], W[6], o, R, hid, H * D, bf, threads);
        dw_add_rms_norm(x, o, W[7], h, R, hid, eps, bf);
        dw_product(K[2], h, W[8], W[9], W[10], gu, R, 2 * I, hid, bf, threads);
        dw_silu_mul(gu, a, R, I, bf);
        dw_product(K[3], a, W[11], W[12], W[13], d, R, hid, I, bf, threads);
        dw_add_rms_norm(x, d, l + 1 < layers ? w[14 * (l + 1)] : final_norm, h, R, hid, eps, bf);
    }
    free(buf);
    return rc;
}

/* Rows 0..n-1 of x [n, hid] = the embeddings of ids (a table [V, hid] of the model's dtype, or a
 * tied model's float32 head packed by dw_pack, [ceil(V/16)][hid][16]: emb_packed): copies. */
static void embed_rows(const void *emb, int emb_packed, const int64_t *ids, long n, long hid, long es, char *x) {
    for (long t = 0; t < n; t++) {
        int64_t id = ids[t];
        if (emb_packed) {
            const float *src = (const float *)emb + (id / 16) * hid * 16 + id % 16;
            for (long i = 0; i < hid; i++) ((float *)x)[t * hid + i] = src[i * 16];
        } else {
            memcpy(x + es * t * hid, (const char *)emb + es * id * hid, es * hid);
        }
    }
}

/* The head's float32 logits [n, V] of n rows of h [n, hid]: head_kind 1 dw_gemm_f32 (float32, packed),
 * 2 dw_gemm_bf16_f32out (bfloat16, packed; float32 sums not rounded): what compute_logits calls. */
static void head_rows(const void *h, long n, long hid, const void *head_w, int head_kind, long V, float *logits,
                      int threads) {
    if (head_kind == 1)
        dw_gemm_f32((const float *)h, (const float *)head_w, NULL, logits, n, V, hid, threads);
    else
        dw_gemm_bf16_f32out((const uint16_t *)h, (const uint16_t *)head_w, NULL, logits, n, V, hid, threads);
}

/* A target's whole decode / verification step in one call: the embeddings of ids (one per row, R
 * rows as dw_decoder counts them; padding rows' ids 0), dw_decoder with the same arguments after
 * its x and h, then the head (head_rows' kinds) on the nsel rows listed in sel into logits [nsel, V]
 * float32: what the embedding, LlamaModel._fused_forward, the row selection and compute_logits give,
 * bit for bit, without ~10 PyTorch calls a step. Returns 0, or -1 when scratch memory is not available. */
int dw_forward(const void *emb, int emb_packed, const int64_t *ids, const void *head_w, int head_kind, long V,
               const int64_t *sel, long nsel, float *logits, long B, long T, long layers, long hid, long H, long Hkv,
               long D, long I, void **w, const int *kinds, const void *final_norm, float eps, const int64_t *pos,
               const float *cos, const float *sin, void *cache, long layer_stride, long kv_stride, long slot0, long L,
               const int64_t *slots, long Lmax, const int64_t *lens, const int64_t *news, const int64_t *offs,
               long window, float scale, int bf, int threads) {
    long es = bf ? 2 : 4, R = offs ? offs[B] : B * T;
    char *x = (char *)malloc(es * hid * (2 * R + nsel) + 64);
    if (!x) return -1;
    char *h = x + es * R * hid, *hs = h + es * R * hid;
    embed_rows(emb, emb_packed, ids, R, hid, es, x);
    int rc = dw_decoder(x, h, B, T, layers, hid, H, Hkv, D, I, w, kinds, final_norm, eps, pos, cos, sin, cache,
                        layer_stride, kv_stride, slot0, L, slots, Lmax, lens, news, offs, window, scale, bf, threads);
    if (rc == 0) {
        for (long r = 0; r < nsel; r++) memcpy(hs + es * r * hid, h + es * sel[r] * hid, es * hid);
        head_rows(hs, nsel, hid, head_w, head_kind, V, logits, threads);
    }
    free(x);
    return rc;
}

/* ---- a drafter's greedy steps in one call ----
 * The first maximum of v[0..n) (the first NaN where there is one), as torch.max and numpy.argmax
 * pick; *top gets its value. */
static long argmax_first(const float *v, long n, float *top) {
    /* the maximum on 8 lanes (and whether any lane saw a NaN), then the first index holding it */
    long i = 0;
    if (n >= 8) {
        v8f m, l;
        v8i nan = {0};
        memcpy(&m, v, 32);
        for (i = 0; i + 8 <= n; i += 8) {
            memcpy(&l, v + i, 32);
            nan |= l != l;
            m = vsel8(l > m, l, m);
        }
        int any = 0;
        for (int j = 0; j < 8; j++) any |= nan[j];
        if (!any) {
            float t = m[0];
            for (int j = 1; j < 8; j++) t = m[j] > t ? m[j] : t;
            for (; i < n; i++) { /* the tail */
                if (v[i] != v[i]) break;
                t = v[i] > t ? v[i] : t;
            }
            if (i == n) {
                for (i = 0; v[i] != t; i++) {}
                *top = t;
                return i;
            }
        }
    }
    long best = 0; /* a NaN somewhere (or fewer than 8 values): the scalar scan */
    for (i = 0; i < n; i++) {
        if (v[i] != v[i]) { /* NaN: the maximum for both torch and numpy */
            best = i;
            break;
        }
        if (v[i] > v[best]) best = i;
    }
    *top = v[best];
    return best;
}

/* The first maximum of one row of logits; *conf (when not NULL) its max softmax probability,
 * 1 / sum exp(l - max): exp8 on 8 lanes (a libm exp per logit cost ~0.1 ms a step). A row with a
 * NaN gets NaN, one whose maximum is +-inf NaN (as torch's exp(max - logsumexp)). */
static long argmax_conf_row(const float *logits, long V, float *conf) {
    float top;
    long best = argmax_first(logits, V, &top);
    if (conf) {
        v8f acc = {0}, t8 = bcast8(top);
        long i = 0;
        for (; i + 8 <= V; i += 8) {
            v8f l;
            memcpy(&l, logits + i, 32);
            acc += exp8(l - t8);
        }
        double z = 0.0;
        for (int j = 0; j < 8; j++) z += acc[j];
        for (; i < V; i++) z += exp1(logits[i] - top);
        *conf = top != top || top == INFINITY || top == -INFINITY ? NAN : (float)(1.0 / z);
    }
    return best;
}

/* k greedy proposals of one sequence: the calls the drafter's Python loop makes for such a row
 * (runner.run of the fed tokens, the LM head on the last row, the argmax), in one call. Step 0
 * feeds the n0 tokens of `feed` at positions start..start+n0-1, step s > 0 feeds step s-1's token
 * at position start+n0+s-1; every step writes the fed tokens' K/V (the last proposal is not fed).
 * The embedding: emb [V, hid] in the model's dtype (emb_packed 0) or the float32 head packing
 * [ceil(V/16), hid, 16] (1: PackedEmbedding). The decoder's arguments as dw_decoder's; slot0 >= 0:
 * positions 0.. on consecutive slots from slot0; else slots gives each position's slot (B = 1,
 * Lmax slots). The head: kind 1 dw_gemm_f32, 2 dw_gemm_bf16_f32out (packed, float32 logits, no
 * bias). out_tok [k]; out_conf [k] (may be NULL): max softmax probability of each step's logits.
 * Returns 0, or -1 when scratch memory was not available. */
int dw_draft_greedy(const void *emb, int emb_packed, const int64_t *feed, long n0, long start, long k, long layers,
                    long hid, long H, long Hkv, long D, long I, void **w, const int *kinds, const void *final_norm,
                    float eps, const float *cos, const float *sin, void *cache, long layer_stride, long kv_stride,
                    long slot0, const int64_t *slots, long Lmax, long window, float scale, int bf, int threads,
                    const void *head_w, int head_kind, long V, int64_t *out_tok, float *out_conf) {
    long es = bf ? 2 : 4;
    char *x = (char *)malloc(es * n0 * hid * 2 + sizeof(float) * V + sizeof(int64_t) * n0 + 64);
    if (!x) return -1;
    char *h = x + es * n0 * hid;
    float *logits = (float *)(h + es * n0 * hid);
    int64_t *pos = (int64_t *)(logits + V);
    int64_t prev = 0;
    int rc = 0;
    for (long s = 0; s < k && rc == 0; s++) {
        long T = s == 0 ? n0 : 1, p0 = s == 0 ? start : start + n0 + s - 1;
        const int64_t *ids = s == 0 ? feed : &prev;
        for (long t = 0; t < T; t++) pos[t] = p0 + t;
        embed_rows(emb, emb_packed, ids, T, hid, es, x);
        long L = p0 + T, lens = L, news = T;
        if (slot0 >= 0)
            rc = dw_decoder(x, h, 1, T, layers, hid, H, Hkv, D, I, w, kinds, final_norm, eps, pos, cos, sin, cache,
                            layer_stride, kv_stride, slot0, L, NULL, 0, NULL, NULL, NULL, window, scale, bf, threads);
        else
            rc = dw_decoder(x, h, 1, T, layers, hid, H, Hkv, D, I, w, kinds, final_norm, eps, pos, cos, sin, cache,
                            layer_stride, kv_stride, 0, L, slots, Lmax, &lens, &news, NULL, window, scale, bf, threads);
        if (rc != 0) break;
        const char *last = h + es * (T - 1) * hid;
        head_rows(last, 1, hid, head_w, head_kind, V, logits, threads);
        prev = argmax_conf_row(logits, V, out_conf ? out_conf + s : NULL);
        out_tok[s] = prev;
    }
    free(x);
    return rc;
}

/* The batched form of dw_draft_greedy: ks[b] greedy proposals of each of B sequences. Step 0 feeds
 * sequence b's tokens feed[offs0[b]..offs0[b+1]) at positions start[b].. (packed rows); step s > 0
 * feeds step s-1's proposal of the sequences with ks[b] > s, at the next position. Each step is one
 * dw_forward of those rows with the head on each sequence's last row, then each row's first maximum
 * (argmax_conf_row: the calls and values of the drafter's Python loop for such rows). slots [B, Lmax]:
 * each sequence's slot per position (reaching start[b] + n0 + ks[b] - 1). out_tok / out_conf [B, kmax]
 * (out_conf may be NULL): row b's first ks[b] entries written. Returns 0, or -1 (no scratch memory). */
int dw_draft_greedy_rows(const void *emb, int emb_packed, const int64_t *feed, const int64_t *offs0,
                         const int64_t *start, const int64_t *ks, long B, long layers, long hid, long H, long Hkv,
                         long D, long I, void **w, const int *kinds, const void *final_norm, float eps,
                         const float *cos, const float *sin, void *cache, long layer_stride, long kv_stride,
                         const int64_t *slots, long Lmax, long window, float scale, int bf, int threads,
                         const void *head_w, int head_kind, long V, long kmax, int64_t *out_tok, float *out_conf) {
    long R0 = offs0[B], n = (R0 > B ? R0 : B);
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (2 * n + 5 * B + 2 + B * Lmax) + sizeof(float) * B * V);
    if (!ids) return -1;
    int64_t *pos = ids + n, *offs = pos + n, *lens = offs + B + 1, *news = lens + B, *sel = news + B;
    int64_t *act = sel + B, *tab = act + B;
    float *logits = (float *)(tab + B * Lmax);
    int rc = 0;
    for (long s = 0; s < kmax && rc == 0; s++) {
        long A = 0, R = 0, L = 0;
        int whole = 1; /* every sequence runs: their slot rows as given */
        offs[0] = 0;
        for (long b = 0; b < B; b++) {
            if (ks[b] <= s) {
                whole = 0;
                continue;
            }
            long n0 = offs0[b + 1] - offs0[b], T = s == 0 ? n0 : 1, p0 = s == 0 ? start[b] : start[b] + n0 + s - 1;
            for (long t = 0; t < T; t++) {
                ids[R + t] = s == 0 ? feed[offs0[b] + t] : out_tok[b * kmax + s - 1];
                pos[R + t] = p0 + t;
            }
            R += T;
            lens[A] = p0 + T;
            news[A] = T;
            offs[A + 1] = R;
            sel[A] = R - 1;
            if (lens[A] > L) L = lens[A];
            act[A++] = b;
        }
        if (A == 0) break;
        if (!whole)
            for (long a = 0; a < A; a++) memcpy(tab + a * Lmax, slots + act[a] * Lmax, sizeof(int64_t) * Lmax);
        rc = dw_forward(emb, emb_packed, ids, head_w, head_kind, V, sel, A, logits, A, 0, layers, hid, H, Hkv, D, I,
                        w, kinds, final_norm, eps, pos, cos, sin, cache, layer_stride, kv_stride, 0, L,
                        whole ? slots : tab, Lmax, lens, news, offs, window, scale, bf, threads);
        for (long a = 0; a < A && rc == 0; a++) {
            long b = act[a];
            out_tok[b * kmax + s] = argmax_conf_row(logits + a * V, V, out_conf ? out_conf + b * kmax + s : NULL);
        }
    }
    free(ids);
    return rc;
}

/* Each row's first maximum and, when conf is not NULL, its confidence max softmax = 1 / sum exp(l - max)
 * (what the Python loop computes as exp(max - logsumexp)), for `rows` rows of V float32 logits. */
void dw_argmax_conf(const float *logits, long rows, long V, int64_t *tok, float *conf, int threads) {
    int nt = rows > 1 ? threads : 1; /* rows apart on the threads */
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (long r = 0; r < rows; r++) tok[r] = argmax_conf_row(logits + r * V, V, conf ? conf + r : NULL);
}
