/* Products that read their weight unpacked: small float weights (dw_linear, the weight given
 * transposed) and int4 groups (dw_linear_q4, quantize.py's Int4Linear). */
#include "kernels.h"

/* 16-lane vectors (GCC/Clang vector extensions): the compiler maps them onto the machine's SIMD
 * registers (AVX-512 here, narrower ones elsewhere). */
typedef float v16f __attribute__((vector_size(64)));
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

/* out[t, o] = x[t] . w[o] (+ bias[o]) for a small weight, given transposed: wt [N, O] (below
 * KERNEL_LINEAR_MAX_NUMEL in packed_weights.py: there a BLAS or oneDNN call costs more than its
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

/* ---- int4 weights (--quantization int4) ----
 * w [O, N] in groups of 32 inputs (Q4_1's layout): byte i of a group's 16 holds q[i] in its low
 * nibble and q[i + 16] in its high one, q in 0..15; sm [O, N/32, 2] float16: the group's step d and
 * minimum m, w = d * q + m. y[r, o] = sum_g (d_g * (x_g . q_g) + m_g * sum(x_g)) + b[o]: each
 * group's dot product on 8 lanes (x_g . q_g, 4 products in order), scaled into an 8-lane
 * accumulator; the m terms in a scalar one. The order is the same for every row whatever the
 * others (a row's result does not depend on the batch). Half a byte a weight plus 4 bytes a group:
 * 0.625 bytes a weight, as Q4_1. */

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
    long nt = dw_threads_for(threads, O * N, Q8_MIN_PARALLEL), blocks = (O + 3) / 4;
    if (nt > blocks) nt = blocks;
    DW_SHARES(nt, t, {
        long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        q4_range(xf, xs, q, sm, bias, out, rows, O, N, 4 * b0, 4 * b1 < O ? 4 * b1 : O, obf);
    });
    free(xf);
}
