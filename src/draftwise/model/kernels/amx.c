/* vnni.c's int8-activation products on AMX tiles (Intel Xeon since Sapphire Rapids), for blocks of
 * up to 16 rows: verification blocks, batched decoding, prefill.
 *
 * Why: past a few rows a product of int8 / int4 weights is compute-bound on VPDPBUSD (a 1.5B
 * target: 8 rows ~1.8x a 1-row step, 17 rows ~2.8x on 2 Xeon cores). One TDPBSSD / TDPBSUD multiplies
 * a [rows x 32] tile of activation bytes by a [32 x 16] tile of weight bytes into [rows x 16] int32
 * sums: a group's products for every row in one instruction.
 *
 * The layouts are vnni.c's, and they are already AMX's: the 64-byte vector j of a group holds, per
 * output, the bytes of inputs 4j..4j+3, which is row j of a B tile (K/4 rows of 16 outputs x 4
 * bytes). int8 groups load their B tile straight from the packed weights; int4 and Q4_K groups
 * split their nibbles into one (rows 0-3 the low nibbles, inputs 0..15; rows 4-7 the high ones).
 *
 * Exactness: a tile's int32 sum of a group is the integer vnni.c's VPDPBUSD chains sum (integer
 * sums are exact in any order), and every float operation after it is vnni.c's, in the same order
 * (groups in order, the same multiplies and FMAs): a row's result is bitwise the one vnni.c gives
 * it, so a block run here agrees with the 1-row steps run there. Q4_K's sub-block sums, at most
 * 32 x 15 x 127 in magnitude, are scaled by e_j sc_j with a 32-bit multiply (vnni.c multiplies its
 * two halves of 16 with VPDPWSSD): the same integer.
 *
 * Linux hands a process the tiles' state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM):
 * dw_amx_enable asks once; until it has said 1, nothing here runs. Each thread loads the tile
 * configuration for its block's row count before its products and releases the tiles after. */
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DW_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

int dw_amx_rows = 0; /* products of at least this many rows run here; 0: none */

/* 1 where this build has the AMX products and the kernel (Linux) lets this process use the tiles;
 * products of `min_rows` rows or more then run on them (0: none, as before the call) */
int dw_amx_enable(int min_rows) {
#ifdef DW_AMX
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    dw_amx_rows = granted ? min_rows : 0;
    return granted;
#else
    (void)min_rows;
    dw_amx_rows = 0;
    return 0;
#endif
}

#ifdef DW_AMX
struct tile_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0, 1, 6, 7: sums [M x 16] int32; 2, 3: activations [M x 32] bytes; 4, 5: weights [8 x 64] bytes */
static __thread int tiles_rows;

static void tiles_for(int M) {
    if (tiles_rows == M) return;
    struct tile_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t == 4 || t == 5 ? 8 : M;
        c.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    }
    _tile_loadconfig(&c);
    tiles_rows = M;
}

void dw_amx_release(void) {
    if (tiles_rows) _tile_release();
    tiles_rows = 0;
}

/* the nibbles of one int4 group (vnni.c's layout, 256 bytes) as a B tile (512 bytes) */
static inline void split_nibbles(const uint8_t *w, uint8_t *b) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_loadu_si512((const void *)(w + c * 64));
        _mm512_store_si512((void *)(b + c * 64), _mm512_and_si512(v, m4));
        _mm512_store_si512((void *)(b + 256 + c * 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
}

/* the int32 sums of groups g .. g + n - 1 (n <= 4) for M rows into C[t][r][16]. Tiles are not
 * renamed: groups g + 2, g + 3 take sum tiles 6, 7 while 0, 1 are still being stored (the
 * activation and weight tiles are read by then), so one pair's stores overlap the next pair's
 * products. XQ(t) is group t's first activation byte, B(t) its weight tile. */
#define TILE_ONE(DP, CT, AT, BT, XQ, STRIDE, B)                                 \
    do {                                                                        \
        _tile_zero(CT);                                                         \
        _tile_loadd(AT, (XQ), (STRIDE));                                        \
        _tile_loadd(BT, (B), 64);                                               \
        DP(CT, AT, BT);                                                         \
    } while (0)
#define TILE_GROUPS(DP, n, XQ, STRIDE, B, C)                                    \
    do {                                                                        \
        TILE_ONE(DP, 0, 2, 4, XQ(0), STRIDE, B(0));                             \
        if ((n) > 1) TILE_ONE(DP, 1, 3, 5, XQ(1), STRIDE, B(1));                \
        _tile_stored(0, (C)[0], 64);                                            \
        if ((n) > 1) _tile_stored(1, (C)[1], 64);                               \
        if ((n) > 2) TILE_ONE(DP, 6, 2, 4, XQ(2), STRIDE, B(2));                \
        if ((n) > 3) TILE_ONE(DP, 7, 3, 5, XQ(3), STRIDE, B(3));                \
        if ((n) > 2) _tile_stored(6, (C)[2], 64);                               \
        if ((n) > 3) _tile_stored(7, (C)[3], 64);                               \
    } while (0)

/* int8 groups (vnni.c's q8g_block): M <= 16 rows from r0 of output block ob */
void dw_amx_q8g_block(const int8_t *xq, const float *xs, const int8_t *wv, const uint16_t *gs, const float *bias,
                      void *out, long r0, int M, long ob, long O, long N, int obf) {
    const long G = N / 32;
    int32_t c[4][16][16] __attribute__((aligned(64)));
    __m512 acc[16];
    tiles_for(M);
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *w = wv + ob * N * 16;
    for (long g = 0; g < G; g += 4) {
        int n = G - g < 4 ? (int)(G - g) : 4;
#define XQ8(t) (xq + r0 * N + (g + (t)) * 32)
#define B8(t) (w + (g + (t)) * 512)
        TILE_GROUPS(_tile_dpbssd, n, XQ8, N, B8, c);
#undef XQ8
#undef B8
        for (int t = 0; t < n; t++) {
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gs + (ob * G + g + t) * 16)));
            for (int r = 0; r < M; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[t][r])),
                                         _mm512_mul_ps(d, _mm512_set1_ps(xs[(r0 + r) * G + g + t])), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) dw_store16(acc[r], bias, out, r0 + r, O, ob * 16, obf);
}

/* int4 groups (vnni.c's q4_block_a8) */
void dw_amx_q4_block(const int8_t *xq, const float *xs, const float *xsum, const uint8_t *qv, const uint16_t *sm,
                     const float *bias, void *out, long r0, int M, long ob, long O, long N, int obf) {
    const long G = N / 32;
    int32_t c[4][16][16] __attribute__((aligned(64)));
    uint8_t b[4][512] __attribute__((aligned(64)));
    __m512 acc[16];
    tiles_for(M);
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *w = qv + ob * G * 256;
    for (long g = 0; g < G; g += 4) {
        int n = G - g < 4 ? (int)(G - g) : 4;
        for (int t = 0; t < n; t++) split_nibbles(w + (g + t) * 256, b[t]);
#define XQ4(t) (xq + r0 * N + (g + (t)) * 32)
#define B4(t) (b[t])
        TILE_GROUPS(_tile_dpbsud, n, XQ4, N, B4, c);
#undef XQ4
#undef B4
        for (int t = 0; t < n; t++) {
            const uint16_t *sc = sm + (ob * G + g + t) * 32;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16)));
            for (int r = 0; r < M; r++) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[t][r])),
                                         _mm512_mul_ps(d, _mm512_set1_ps(xs[(r0 + r) * G + g + t])), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(r0 + r) * G + g + t]), acc[r]);
            }
        }
    }
    for (int r = 0; r < M; r++) dw_store16(acc[r], bias, out, r0 + r, O, ob * 16, obf);
}

/* Q4_K super-blocks (vnni.c's q4k_block_a8) */
void dw_amx_q4k_block(const int8_t *xq, const float *xs, const int16_t *bs, const uint8_t *kx, const uint8_t *qv,
                      const uint8_t *ks, const float *bias, void *out, long r0, int M, long ob, long O, long N,
                      int obf) {
    const long G = N / 32, S = N / 256;
    int32_t c[4][16][16] __attribute__((aligned(64)));
    uint8_t b[4][512] __attribute__((aligned(64)));
    __m512 acc[16];
    tiles_for(M);
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *w = qv + ob * G * 256, *k = ks + ob * S * 320;
    for (long sb = 0; sb < S; sb++, k += 320) {
        __m512i isc[16];
        for (int r = 0; r < M; r++) isc[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 4, w += 1024) {
            for (int t = 0; t < 4; t++) split_nibbles(w + t * 256, b[t]);
#define XQK(t) (xq + r0 * N + (sb * 8 + j + (t)) * 32)
#define BK(t) (b[t])
            TILE_GROUPS(_tile_dpbsud, 4, XQK, N, BK, c);
#undef XQK
#undef BK
            for (int t = 0; t < 4; t++) {
                /* e_j sc_j for each sub-step k a row may have (read by index, as vnni.c) */
                __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k + 16 * (j + t))));
                __m512i sck[4] = {_mm512_slli_epi32(sc, 3), _mm512_slli_epi32(sc, 2), _mm512_slli_epi32(sc, 1), sc};
                for (int r = 0; r < M; r++)
                    isc[r] = _mm512_add_epi32(isc[r], _mm512_mullo_epi32(_mm512_load_si512((const void *)c[t][r]),
                                                                         sck[kx[(r0 + r) * G + sb * 8 + j + t]]));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(k + 256)));
        __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(k + 288)));
        for (int r = 0; r < M; r++) {
            __m512i imn = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(k + 128 + 32 * p)));
                imn = _mm512_dpwssd_epi32(imn, mn, _mm512_set1_epi32(*(const int32_t *)(bs + (r0 + r) * G + sb * 8 + 2 * p)));
            }
            __m512 tt = _mm512_mul_ps(_mm512_cvtepi32_ps(isc[r]), d);
            tt = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imn), dm, tt);
            acc[r] = _mm512_fmadd_ps(tt, _mm512_set1_ps(xs[(r0 + r) * S + sb]), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) dw_store16(acc[r], bias, out, r0 + r, O, ob * 16, obf);
}
#else /* never called: dw_amx_rows stays 0 */
void dw_amx_release(void) {}
void dw_amx_q8g_block(const int8_t *xq, const float *xs, const int8_t *wv, const uint16_t *gs, const float *bias,
                      void *out, long r0, int M, long ob, long O, long N, int obf) {}
void dw_amx_q4_block(const int8_t *xq, const float *xs, const float *xsum, const uint8_t *qv, const uint16_t *sm,
                     const float *bias, void *out, long r0, int M, long ob, long O, long N, int obf) {}
void dw_amx_q4k_block(const int8_t *xq, const float *xs, const int16_t *bs, const uint8_t *kx, const uint8_t *qv,
                      const uint8_t *ks, const float *bias, void *out, long r0, int M, long ob, long O, long N,
                      int obf) {}
#endif
