/* Products against weights packed by dw_pack ([ceil(O/16)][N][16]): float32 (dw_gemm_f32),
 * bfloat16 (dw_gemm_bf16, and dw_gemm_bf16_f32out for a head's float32 logits) and int8 with one
 * scale per output or per group of inputs (dw_gemm_q8, dw_gemm_q8g: quantize.py's Int8Linear).
 * Batch-1 decoding and verification are bound by reading the weights: these products stream each
 * weight once per chunk of rows, widened in registers, into float32 FMA chains of a fixed order
 * per (row, output), so a row's result does not depend on the rows around it or the threads. */
#include "gemm.h"

/* Float32 products against a weight packed as [ceil(O/16)][N][16] (`dw_pack`: for each input
 * k the weights of 16 consecutive outputs side by side; the last block's missing outputs are zero).
 * Each output is an FMA chain over k in order, restarted from zero every GEMM_KB inputs, the
 * chains' sums added in order, then the bias: the order of oneDNN's float32 product on AVX2 (the
 * loader checks the two bitwise per weight before using this one, see packed_weights.py), and the same for
 * every row whatever the others: a row's result does not depend on the batch.
 *
 * Register blocking: NR rows x NB 16-output blocks, two 8-lane accumulators each (<= 12 of the 16
 * AVX2 registers): 1 row x 4 blocks, 2 x 2, or up to 6 x 1; the weights of a block stream from
 * memory once per 48 rows (RC) and stay in cache for the row blocks of that chunk. */

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

#if defined(__AVX512F__) && !defined(DW_GEMM8)
/* gemm_block on AVX-512 for weights of kind 0-2 (float32, bfloat16, int8 with one scale per
 * output): each 16-output block's accumulator is one 16-lane register instead of two 8-lane ones,
 * a block's 16 weights widened in one go. Every output's FMA chain is the same (lane l of block j
 * accumulates x[k] * w[k][l] over k in order, fused), so are the bits; half the instructions
 * (bfloat16 weights are widened in registers: bound by instructions rather than by memory), which
 * pays most from 16 rows up. -DDW_GEMM8 keeps the 8-lane block. */
static inline __attribute__((always_inline)) void gemm_block16(const float *x, long N, const void *wp, long ob,
                                                               long k0, long k1, float *out, long O, int NR, int NB,
                                                               int first, int WB) {
    __m512 acc[6][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    long es = WB >= 2 ? 1 : WB ? 2 : 4;
    const char *w = (const char *)wp + (ob * N + k0) * 16 * es;
    for (long k = k0; k < k1; k++, w += 16 * es) {
        /* as gemm_block's, but not for one row of bfloat16 weights either: at one row the
         * hardware's prefetchers keep up with these streams too, and the software prefetch cost
         * time (from a few rows on it pays) */
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
         * prefetch cost time (bfloat16 weights still gain from it) */
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

static void gemm_range(const void *xv, const void *wp, float *out, long rows, long O, long N, long b0, long b1,
                       int wb, const uint16_t *gs) {
#ifdef GEMM_DPBF16
    if (wb == 4) { /* bfloat16 rows and weights: VDPBF16PS */
        dw_gemm_dp_range((const uint16_t *)xv, (const uint16_t *)wp, out, rows, O, N, b0, b1);
        return;
    }
#endif
    const float *x = (const float *)xv;
    long kb = wb == 3 ? GROUP_Q8 : GEMM_KB; /* group scales: one k-block a group */
    int nb = rows == 1 ? 4 : rows <= GEMM_NB2_ROWS ? 2 : 1; /* output blocks per register block */
#if defined(__AVX512F__) && !defined(DW_GEMM8)
    /* gemm_block16's 32 registers hold 6 rows x 4 blocks (24 sums): past a verification block's
     * rows, each weight vector loaded feeds 6 rows x 4 blocks of FMAs instead of 6 x 1 (the same
     * bits, faster from 8 rows on; at 2-5 rows four blocks were slower than two) */
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
 * 3 int8 weights with a scale per group of GROUP_Q8 inputs (gs [ceil(O/16)][N/GROUP_Q8][16] float16).
 * The outputs [*lo, *hi) are the ones the calling thread must finish (bias, scale, rounding): its
 * own share inside a team (dw_decoder's: the other threads finish theirs), else all. */
static void gemm_threads(const void *x, const void *wp, float *out, long rows, long O, long N, int threads, int wb,
                         const uint16_t *gs, long *lo, long *hi) {
    long blocks = (O + 15) / 16;
    long nt = dw_threads_for(threads, O * N, Q8_MIN_PARALLEL);
    if (nt > blocks / 4) nt = blocks / 4 > 1 ? blocks / 4 : 1;
    *lo = dw_team_nt ? O : 0, *hi = O;
    DW_SHARES(nt, t, {
        long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        b0 = (b0 + 3) & ~3L; /* whole groups of 4 blocks per thread (the last may be short) */
        b1 = t == nt - 1 ? blocks : ((b1 + 3) & ~3L);
        if (b0 < b1) gemm_range(x, wp, out, rows, O, N, b0, b1, wb, gs);
        if (dw_team_nt && b0 < b1) {
            *lo = 16 * b0 < *lo ? 16 * b0 : *lo;
            *hi = 16 * b1 < O ? 16 * b1 : O;
        }
    });
    if (*lo > *hi) *lo = *hi;
}

static void add_bias(float *out, const float *bias, long rows, long O, long lo, long hi) {
    if (bias)
        for (long r = 0; r < rows; r++)
            for (long o = lo; o < hi; o++) out[r * O + o] = out[r * O + o] + bias[o];
}

/* out [rows, O] = x [rows, N] times the packed weight (+ bias [O], may be NULL). */
void dw_gemm_f32(const float *x, const float *wp, const float *bias, float *out, long rows, long O, long N,
                 int threads) {
    long lo, hi;
    gemm_threads(x, wp, out, rows, O, N, threads, 0, NULL, &lo, &hi);
    add_bias(out, bias, rows, O, lo, hi);
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
    long lo, hi;
    for (long i = 0; i < rows * N; i++) xf[i] = ld(x, i, bf);
    gemm_threads(xf, wp, y, rows, Op, N, threads, group ? 3 : 2, group ? (const uint16_t *)scale : NULL, &lo, &hi);
    if (hi > O) hi = O;
    for (long r = 0; r < rows; r++)
        for (long o = lo; o < hi; o++) {
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

/* dw_gemm_bf16_f32out's product, its outputs [*lo, *hi) finished by the calling thread (gemm_threads) */
static void bf16_f32out(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, float *out, long rows, long O,
                        long N, int threads, long *lo, long *hi) {
#ifdef GEMM_DPBF16
    gemm_threads(x, wp, out, rows, O, N, threads, 4, NULL, lo, hi);
#else
    float *xf = (float *)malloc(sizeof(float) * (rows * N + 16));
    for (long i = 0; i < rows * N; i++) xf[i] = bf2f(x[i]);
    gemm_threads(xf, wp, out, rows, O, N, threads, 1, NULL, lo, hi);
    free(xf);
#endif
    if (bias)
        for (long r = 0; r < rows; r++)
            for (long o = *lo; o < *hi; o++) out[r * O + o] = out[r * O + o] + bf2f(bias[o]);
}

/* dw_gemm_bf16's product before its rounding: float32 results (bias added in float32): a bfloat16
 * LM head's logits as float32 sums of the bfloat16 weights times the bfloat16 hidden states, the
 * values head_precision.py's refinement recomputes for a row's top logits, for every logit. */
void dw_gemm_bf16_f32out(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, float *out, long rows, long O,
                         long N, int threads) {
    long lo, hi;
    bf16_f32out(x, wp, bias, out, rows, O, N, threads, &lo, &hi);
}

/* bfloat16: x [rows, N], the packed weight, bias [O] (may be NULL) and out [rows, O] in bfloat16:
 * float32 sums (VDPBF16PS pairs with AVX-512 BF16, see gemm_block_dp; elsewhere the weights widened
 * to float32 in registers, float32 FMA chains as dw_gemm_f32's: half the bytes of float32 to
 * stream), the bias added in float32, one rounding to bfloat16 at the end (as F.linear rounds its
 * float32 accumulation). */
void dw_gemm_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, long rows, long O,
                  long N, int threads) {
    float *yf = (float *)malloc(sizeof(float) * (rows * O + 16));
    long lo, hi;
    bf16_f32out(x, wp, bias, yf, rows, O, N, threads, &lo, &hi);
    for (long r = 0; r < rows; r++) /* one rounding, as F.linear's */
        for (long o = lo; o < hi; o++) out[r * O + o] = f2bf(yf[r * O + o]);
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
