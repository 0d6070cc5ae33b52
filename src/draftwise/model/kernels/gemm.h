/* Shared by the packed-weight products (gemm.c, gemm_dp.c): their blocking constants, the
 * output stores, and the bfloat16 dot-product path's entry. */
#ifndef DW_GEMM_H
#define DW_GEMM_H

#include "kernels.h"

#define GEMM_KB 1024
#define GROUP_Q8 32 /* dw_gemm_q8g: inputs per scale (llama.cpp's Q8_0 block) */
#define GEMM_RC 48
/* 2 to GEMM_NB2_ROWS rows (a verification block of up to 5 tokens) take two output blocks per
 * register block, all their rows in one (GEMM_NB2_RS: 20 accumulators at 5 rows, a few spilled):
 * two weight streams per thread instead of one, which keeps the memory busier on AVX2. From 6 rows
 * on, splitting the rows (5 + 1) costs more than the second stream gains: one block, 6 rows each.
 * The sums are the same: each output's accumulation runs over k in the same order whatever the
 * blocking. */
#ifndef GEMM_NB2_ROWS
#define GEMM_NB2_ROWS 5
#endif
#ifndef GEMM_NB2_RS
#define GEMM_NB2_RS 5
#endif
#ifndef GEMM_PREFETCH
#define GEMM_PREFETCH 512 /* floats ahead in a block's stream (32 lines) */
#endif
/* the prefetches' locality hint: 0 (prefetchnta, the faster on AMD EPYCs) unless the build says
 * otherwise. cpu_kernels.py builds with 1 (prefetcht2) on Intel CPUs, where prefetchnta starved
 * the weight streams of several rows (about twice as slow as prefetcht2, slower than no prefetch
 * at all); the bits are the same either way. */
#ifndef GEMM_PREFETCH_LOCALITY
#define GEMM_PREFETCH_LOCALITY 0
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
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(DW_GEMM8) && !defined(DW_NO_DPBF16)
#define GEMM_DPBF16 1
/* gemm_range's loops for bfloat16 rows and weights on VDPBF16PS (gemm_dp.c) */
void dw_gemm_dp_range(const uint16_t *x, const uint16_t *wp, float *out, long rows, long O, long N, long b0,
                      long b1);
#endif

#endif
