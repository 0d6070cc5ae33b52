/* Products of int8 / int4 weights in groups of 32 inputs with int8 activations, on AVX-512 VNNI
 * (VPDPBUSD: 64 unsigned x signed byte products summed into 16 int32 lanes per instruction).
 *
 * Why: a verification block of 5 rows through widened float weights (dw_gemm_q8g, dw_linear_q4)
 * costs 5 float FMAs per weight, compute-bound at ~2x a 1-row step on 2 cores. Quantising each
 * row's activations per group of 32 to int8 (llama.cpp's Q8 activations: xs = max|x| / 127,
 * xq = round(x / xs)) turns each weight's products into byte products, 4x denser per instruction;
 * a weight vector loaded once feeds every row, so a few rows cost about one row's weight reading.
 *
 * int8 groups (dw_gemm_q8g_a8): w = d * q, q int8, packed [ceil(O/16)][N/4][16][4]: for 4
 * consecutive inputs, 16 outputs' 4 bytes side by side (one 64-byte vector per VPDPBUSD). The
 * weights enter as unsigned (q + 128, a sign-bit flip); the sum starts at -128 * sum(xq) of the
 * group, which removes the offset exactly. y += float(sum) * (d * xs), groups in order.
 * int4 groups (dw_linear_q4_a8): w = d * q + m, q in 0..15, packed [ceil(O/16)][N/32][4][16][4]:
 * vector j of a group holds, per output, the group's bytes 4j..4j+3 (Q4_1's nibble order: byte i's
 * low nibble is input i, its high one input i + 16), scales [ceil(O/16)][N/32][2][16] float16 (d,
 * then m). y += float(sum q * xq) * (d * xs) + m * sum(x), sum(x) the group's float sum.
 *
 * Q4_K super-blocks (dw_linear_q4k_a8): w = d * sc_j * q - dmin * mn_j for sub-block j (32 inputs) of
 * a super-block of 256, sc_j and mn_j 6-bit integers, d and dmin float16 per super-block. The
 * activations are quantised with one step a row and super-block, refined per 32 by a power of two
 * (a8_quantize_k: e_j = 2^(3 - k_j)), with the int8 sums of each 32 (bsums), and the sub-scales are
 * applied in integer arithmetic, llama.cpp's Q4_K x Q8_K form:
 *   y += xs * (d * float(sum_j e_j sc_j (q_j . xq_j)) - dmin * float(sum_j mn_j e_j bsum_j)),
 * one float conversion a super-block instead of a multiply and two FMAs a group. q_j . xq_j is summed
 * as two halves of 16 inputs (|sum| <= 16 * 15 * 127 < 2^15: each an int16 value in its int32 lane),
 * so VPDPWSSD against e_j sc_j (the lane's high half 0) multiplies and accumulates it in one instruction;
 * the minima's sum is VPDPWSSD of (mn_2p, mn_2p+1) pairs against (e bsum_2p, e bsum_2p+1) pairs. Nibbles
 * as the int4 groups' layout; sub-scales [ceil(O/16)][N/256][320] bytes: sc [8][16], mn [4][16][2]
 * (pair p's two minima side by side per output), d [16] and dmin [16] float16.
 *
 * Each (row, output) is one fixed sequence of operations: a row's result does not depend on the
 * other rows or the threads (verification and decoding agree bitwise). */
#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define DW_A8 1
#endif

int dw_vnni(void) {
#ifdef DW_A8
    return 1;
#else
    return 0;
#endif
}

#ifdef DW_A8
#define A8_RB 6 /* rows per register block */

/* 4 bytes broadcast to every lane, read as one int32 from memory (a register broadcast from a
 * general register cost a shuffle port) */
typedef int32_t i32u __attribute__((may_alias, aligned(1)));
static inline __m512i bcast4(const int8_t *p) { return _mm512_set1_epi32(*(const i32u *)p); }

/* acc + w (unsigned bytes) . the 4 activation bytes at p, broadcast to every lane as VPDPBUSD's
 * memory operand ({1to16}): GCC kept a separate VPBROADCASTD per product for the intrinsics, and
 * folding it made a 5-row block of Q4_K super-blocks ~25% faster on AMD EPYC (Zen 4) */
static inline __m512i dpbusd_x(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32u *)p));
    return acc;
}

/* rows of x [rows, N] -> xq (int8, [rows, N]), xs [rows, N/32] (the groups' steps) and xsum
 * [rows, N/32] (the groups' float sums), qsum [rows, N/32] (sum of xq). Two 16-lane vectors a
 * group: the quantisation is a verification step's few percent, not its tens with scalar divisions.
 * x / step is IEEE division, rounded to nearest even: the values torch.round(x / step) gives. */
static void a8_quantize(const void *x, long rows, long N, int bf, int8_t *xq, float *xs, float *xsum, int32_t *qsum) {
    long G = N / 32;
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < G; g++) {
            long i0 = r * N + g * 32;
            __m512 v0, v1;
            if (bf) {
                const uint16_t *p = (const uint16_t *)x + i0;
                v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
                v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16))), 16));
            } else {
                v0 = _mm512_loadu_ps((const float *)x + i0);
                v1 = _mm512_loadu_ps((const float *)x + i0 + 16);
            }
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float step = amax / 127.0f;
            __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
            if (step > 0.0f) {
                __m512 sv = _mm512_set1_ps(step);
                q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v0, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v1, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            _mm_storeu_si128((__m128i *)(xq + i0), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(xq + i0 + 16), _mm512_cvtepi32_epi8(q1));
            xs[r * G + g] = step;
            xsum[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            qsum[r * G + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
}

/* int8 groups: NR rows from r0 of output block ob */
static inline __attribute__((always_inline)) void q8g_block(const int8_t *xq, const float *xs, const int32_t *qsum,
                                                            const int8_t *wv, const uint16_t *gs, const float *bias,
                                                            void *out, long r0, int NR, long ob, long O, long N,
                                                            int obf) {
    const long G = N / 32;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[A8_RB];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *w = wv + ob * N * 16;
    for (long g = 0; g < G; g++, w += 512) {
        /* two sum chains per row (even and odd chunks): VPDPBUSD's latency is several cycles, and
         * one chain of 8 left a lone row waiting on it */
        __m512i s[A8_RB], s2[A8_RB];
        for (int r = 0; r < NR; r++) {
            s[r] = _mm512_set1_epi32(-128 * qsum[(r0 + r) * G + g]);
            s2[r] = _mm512_setzero_si512();
        }
        __builtin_prefetch(w + 2048, 0, 0);
        for (int c = 0; c < 8; c += 2) {
            __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + c * 64)), flip);
            __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + c * 64 + 64)), flip);
            for (int r = 0; r < NR; r++) {
                const int8_t *x4 = xq + (r0 + r) * N + g * 32 + c * 4;
                s[r] = dpbusd_x(s[r], w0, x4);
                s2[r] = dpbusd_x(s2[r], w1, x4 + 4);
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gs + (ob * G + g) * 16)));
        for (int r = 0; r < NR; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[r], s2[r])),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xs[(r0 + r) * G + g])), acc[r]);
    }
    for (int r = 0; r < NR; r++) dw_store16(acc[r], bias, out, r0 + r, O, ob * 16, obf);
}

/* int4 groups: NR rows from r0 of output block ob */
static inline __attribute__((always_inline)) void q4_block_a8(const int8_t *xq, const float *xs, const float *xsum,
                                                              const uint8_t *qv, const uint16_t *sm, const float *bias,
                                                              void *out, long r0, int NR, long ob, long O, long N,
                                                              int obf) {
    const long G = N / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[A8_RB];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *w = qv + ob * G * 256;
    for (long g = 0; g < G; g++, w += 256) {
        __m512i lo[4], hi[4];
        __builtin_prefetch(w + 1024, 0, 0);
        __builtin_prefetch(w + 1088, 0, 0);
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(w + j * 64));
            lo[j] = _mm512_and_si512(v, m4);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        const uint16_t *sc = sm + (ob * G + g) * 32;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16)));
        for (int r = 0; r < NR; r++) {
            const int8_t *x = xq + (r0 + r) * N + g * 32;
            /* one row: two chains (VPDPBUSD's latency); more rows: one each, the rows' chains
             * interleave (an add a row and group less; integer sums: the same either way) */
            __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                s = dpbusd_x(s, lo[j], x + 4 * j);
                if (NR == 1)
                    s2 = dpbusd_x(s2, hi[j], x + 16 + 4 * j);
                else
                    s = dpbusd_x(s, hi[j], x + 16 + 4 * j);
            }
            if (NR == 1) s = _mm512_add_epi32(s, s2);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xs[(r0 + r) * G + g])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(r0 + r) * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) dw_store16(acc[r], bias, out, r0 + r, O, ob * 16, obf);
}

/* rows of x [rows, N] -> xq (int8, [rows, N]), xs [rows, N/256], bs [rows, N/32] (int16) and ks
 * [rows, N/32] for Q4_K super-blocks. A super-block's step is a = max|x| / 127; sub-block j's is a / 2^k_j,
 * k_j in 0..3 the largest with max|x_j| * 2^k_j <= max|x| (a finer grid where no outlier is: per-256
 * steps alone cost the 1.5B ~1% held-out perplexity). xs = a / 8, bs_j = 2^(3 - k_j) * sum(xq_j)
 * (|bs| <= 8 * 32 * 127 < 2^15), ks_j = k_j. Rounded as a8_quantize rounds. */
static void a8_quantize_k(const void *x, long rows, long N, int bf, int8_t *xq, float *xs, int16_t *bs, uint8_t *ks) {
    long S = N / 256, G = N / 32;
    for (long r = 0; r < rows; r++)
        for (long b = 0; b < S; b++) {
            long i0 = r * N + b * 256;
            __m512 v[16];
            float gmax[8];
            for (int c = 0; c < 16; c++) {
                if (bf) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i0 + 16 * c));
                    v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                } else
                    v[c] = _mm512_loadu_ps((const float *)x + i0 + 16 * c);
            }
            float amax = 0.0f;
            for (int j = 0; j < 8; j++) {
                gmax[j] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[2 * j]), _mm512_abs_ps(v[2 * j + 1])));
                amax = gmax[j] > amax ? gmax[j] : amax;
            }
            float step = amax / 127.0f;
            for (int j = 0; j < 8; j++) {
                int k = 0;
                while (k < 3 && gmax[j] * (float)(2 << k) <= amax) k++;
                float sj = step * (1.0f / (float)(1 << k)); /* exact: a power of two */
                __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
                if (step > 0.0f) {
                    __m512 sv = _mm512_set1_ps(sj);
                    const int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                    q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v[2 * j], sv), rne));
                    q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v[2 * j + 1], sv), rne));
                }
                _mm_storeu_si128((__m128i *)(xq + i0 + 32 * j), _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128((__m128i *)(xq + i0 + 32 * j + 16), _mm512_cvtepi32_epi8(q1));
                bs[r * G + b * 8 + j] = (int16_t)(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)) * (8 >> k));
                ks[r * G + b * 8 + j] = (uint8_t)k;
            }
            xs[r * S + b] = step * 0.125f;
        }
}

/* Q4_K super-blocks: NR rows from r0 of output block ob */
static inline __attribute__((always_inline)) void q4k_block_a8(const int8_t *xq, const float *xs, const int16_t *bs,
                                                               const uint8_t *kx, const uint8_t *qv, const uint8_t *ks,
                                                               const float *bias,
                                                               void *out, long r0, int NR, long ob, long O, long N,
                                                               int obf) {
    const long G = N / 32, S = N / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[A8_RB];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *w = qv + ob * G * 256, *k = ks + ob * S * 320;
    for (long b = 0; b < S; b++, k += 320) {
        /* integer sums of the super-block: sc_j * dot_j (two chains of the halves for few rows:
         * VPDPWSSD's latency), then the minima */
        __m512i isc[A8_RB], isc2[A8_RB];
        for (int r = 0; r < NR; r++) isc[r] = isc2[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++, w += 256) {
            __m512i lo[4], hi[4];
            __builtin_prefetch(w + 1024, 0, 0);
            __builtin_prefetch(w + 1088, 0, 0);
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void *)(w + c * 64));
                lo[c] = _mm512_and_si512(v, m4);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            /* the scales times 2^(3 - k) for each sub-step k a row may have (read by index) */
            __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k + 16 * j)));
            __m512i sck[4] = {_mm512_slli_epi32(sc, 3), _mm512_slli_epi32(sc, 2), _mm512_slli_epi32(sc, 1), sc};
            for (int r = 0; r < NR; r++) {
                const int8_t *x = xq + (r0 + r) * N + (b * 8 + j) * 32;
                const __m512i scr = sck[kx[(r0 + r) * G + b * 8 + j]];
                __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    s = dpbusd_x(s, lo[c], x + 4 * c);
                    s2 = dpbusd_x(s2, hi[c], x + 16 + 4 * c);
                }
                isc[r] = _mm512_dpwssd_epi32(isc[r], s, scr);
                if (NR <= 2)
                    isc2[r] = _mm512_dpwssd_epi32(isc2[r], s2, scr);
                else
                    isc[r] = _mm512_dpwssd_epi32(isc[r], s2, scr);
            }
        }
        __m512i imn[A8_RB];
        for (int r = 0; r < NR; r++) imn[r] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(k + 128 + 32 * p)));
            for (int r = 0; r < NR; r++)
                imn[r] = _mm512_dpwssd_epi32(imn[r], mn, bcast4((const int8_t *)(bs + (r0 + r) * G + b * 8 + 2 * p)));
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(k + 256)));
        __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(k + 288)));
        for (int r = 0; r < NR; r++) {
            if (NR <= 2) isc[r] = _mm512_add_epi32(isc[r], isc2[r]);
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isc[r]), d);
            t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imn[r]), dm, t); /* t - mins * dmin, one rounding */
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(xs[(r0 + r) * S + b]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) dw_store16(acc[r], bias, out, r0 + r, O, ob * 16, obf);
}

#define A8_ROWS(CALL)                                                        \
    for (long r0 = 0; r0 < rows; r0 += A8_RB) {                              \
        switch (rows - r0 < A8_RB ? rows - r0 : A8_RB) {                     \
        case 6: CALL(6); break;                                              \
        case 5: CALL(5); break;                                              \
        case 4: CALL(4); break;                                              \
        case 3: CALL(3); break;                                              \
        case 2: CALL(2); break;                                              \
        default: CALL(1); break;                                             \
        }                                                                    \
    }

static void a8_product(int kind, const void *x, const void *w, const void *scale, const float *bias, void *out,
                       long rows, long O, long N, int threads, int bf, int obf) {
    long G = N / 32;
    int8_t *xq = (int8_t *)malloc(rows * N + 64);
    float *xs = (float *)malloc(sizeof(float) * (2 * rows * G + 16));
    float *xsum = xs + rows * G;
    int32_t *qsum = (int32_t *)malloc(sizeof(int32_t) * (rows * G + 16));
    int16_t *bs = (int16_t *)qsum;
    uint8_t *kx = (uint8_t *)(bs + rows * G); /* (the second half of qsum's buffer) */
    if (kind == 44)
        a8_quantize_k(x, rows, N, bf, xq, xs, bs, kx);
    else
        a8_quantize(x, rows, N, bf, xq, xs, xsum, qsum);
    long blocks = (O + 15) / 16;
    long nt = dw_threads_for(threads, O * N, Q8_MIN_PARALLEL);
    if (nt > blocks) nt = blocks;
#define Q8G_CALL(NR) q8g_block(xq, xs, qsum, (const int8_t *)w, scale, bias, out, r0, NR, ob, O, N, obf)
#define Q4_CALL(NR) q4_block_a8(xq, xs, xsum, (const uint8_t *)w, scale, bias, out, r0, NR, ob, O, N, obf)
#define Q4K_CALL(NR) q4k_block_a8(xq, xs, bs, kx, (const uint8_t *)w, scale, bias, out, r0, NR, ob, O, N, obf)
    const int amx = dw_amx_rows > 0 && rows >= dw_amx_rows; /* blocks of up to 16 rows on tiles: amx.c */
    /* blocks of at most 16 rows, balanced (17 rows: 9 and 8, not 16 and a lone row that would
     * take a whole pass over the weights for itself) */
    const long nrb = (rows + 15) / 16;
#define AMX_ROWS(CALL)                                                       \
    for (long i = 0; i < nrb; i++) {                                         \
        long r0 = rows * i / nrb;                                            \
        int M = (int)(rows * (i + 1) / nrb - r0);                            \
        CALL;                                                                \
    }
    DW_SHARES(nt, t, {
        long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        if (amx) {
            for (long ob = b0; ob < b1; ob++) {
                if (kind == 8)
                    AMX_ROWS(dw_amx_q8g_block(xq, xs, (const int8_t *)w, scale, bias, out, r0, M, ob, O, N, obf))
                else if (kind == 44)
                    AMX_ROWS(dw_amx_q4k_block(xq, xs, bs, kx, (const uint8_t *)w, scale, bias, out, r0, M, ob, O, N,
                                              obf))
                else
                    AMX_ROWS(dw_amx_q4_block(xq, xs, xsum, (const uint8_t *)w, scale, bias, out, r0, M, ob, O, N, obf))
            }
            dw_amx_release();
        } else {
            for (long ob = b0; ob < b1; ob++) {
                if (kind == 8) {
                    A8_ROWS(Q8G_CALL)
                } else if (kind == 44) {
                    A8_ROWS(Q4K_CALL)
                } else {
                    A8_ROWS(Q4_CALL)
                }
            }
        }
    });
#undef Q8G_CALL
#undef Q4_CALL
#undef Q4K_CALL
#undef AMX_ROWS
    free(xq);
    free(xs);
    free(qsum);
}
#endif

/* x [rows, N] (float32, or bfloat16 when bf) times int8 groups packed as above; out [rows, O]
 * (bfloat16 when obf). N a multiple of 32. Where the build has no VNNI, nothing is written (the
 * loader packs these layouts only where dw_vnni() says 1). */
void dw_gemm_q8g_a8(const void *x, const int8_t *wv, const uint16_t *gs, const float *bias, void *out, long rows,
                    long O, long N, int threads, int bf, int obf) {
#ifdef DW_A8
    a8_product(8, x, wv, gs, bias, out, rows, O, N, threads, bf, obf);
#endif
}

/* the same for int4 groups packed as above, sm the (step, minimum) pairs in their layout */
void dw_linear_q4_a8(const void *x, const uint8_t *qv, const uint16_t *sm, const float *bias, void *out, long rows,
                     long O, long N, int threads, int bf, int obf) {
#ifdef DW_A8
    a8_product(4, x, qv, sm, bias, out, rows, O, N, threads, bf, obf);
#endif
}

/* the same for Q4_K super-blocks packed as above (N a multiple of 256), ks their sub-scales */
void dw_linear_q4k_a8(const void *x, const uint8_t *qv, const uint8_t *ks, const float *bias, void *out, long rows,
                      long O, long N, int threads, int bf, int obf) {
#ifdef DW_A8
    a8_product(44, x, qv, ks, bias, out, rows, O, N, threads, bf, obf);
#endif
}
