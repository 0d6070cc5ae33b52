/* The bfloat16 products on AVX-512 BF16 (gemm_range's path for bfloat16 rows and weights):
 * bfloat16 weights times bfloat16 rows where the CPU has AVX-512 BF16 (VDPBF16PS: Zen 4 EPYC,
 * Sapphire Rapids Xeon): each instruction adds the products of two inputs (k, k+1) to 16 float32
 * sums, the bfloat16 operands used as they are (no widening: a block's two packed weight rows are
 * one 64-byte load and one lane shuffle into pairs, a row's two inputs one 32-bit broadcast).
 * Every output's chain is fixed: pairs in input order within a GEMM_KB block, the odd last input
 * by one FMA, blocks added in order; a row's sums do not depend on the other rows or the threads.
 * The products of two bfloat16 values are exact in float32; the instruction rounds each addition
 * to nearest even and flushes denormals (a different float32 rounding sequence from the widened
 * FMA chain of gemm_block16: sums equal within float32 rounding). From 2 rows up it is markedly
 * faster than the widened chain (half the instructions per weight pair); -DDW_NO_DPBF16 keeps the
 * widened chain for comparison (`benchmarks/peer_llamacpp.py` in bfloat16). */
#include "gemm.h"

#ifdef GEMM_DPBF16
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
void dw_gemm_dp_range(const uint16_t *x, const uint16_t *wp, float *out, long rows, long O, long N, long b0,
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
