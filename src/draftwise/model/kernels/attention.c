/* Attention over the paged K/V cache: the new tokens' K/V written into their slots, then each
 * query's float32 scores, softmax and weighted sum of values; one sequence on consecutive slots
 * (dw_attend) or a batch on paged slots, padded or packed (dw_attend_batch). */
#include "kernels.h"

/* The 16 lanes lo[0..7], hi[0..7] summed as a tree: (l + l+8), then (l + l+4), then pairs */
static inline float tree16(v8f lo, v8f hi) {
    v8f u = lo + hi;
    float a0 = u[0] + u[4], a1 = u[1] + u[5], a2 = u[2] + u[6], a3 = u[3] + u[7];
    return (a0 + a2) + (a1 + a3);
}

/* Sum of n floats in a fixed order (16 lanes as two 8-lane halves, tree16, then the tail): the
 * same result wherever the array starts, so a query's softmax does not depend on the block it
 * came in. */
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
 * position first + r / group): S[r * L + j] = scale * (q_r . k_j), 16 lanes as two 8-lane
 * FMA chains summed by tree16. Each key is read (and converted) once for all queries. DD a compile-time constant where it can be (64, 128). */
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

/* Scores S [nq, L] of the group's queries Q [nq, D] against their keys from lo_all (query r sees
 * keys up to its position first + r / group), scaled. */
static void group_scores(const float *Q, long nq, long group, long first, const void *kc, long slot0,
                         const int64_t *slots, long kv, long g, long D, long lo_all, long L, float scale, float *S,
                         float *x, int bf) {
    if (D == 64) {
        qk_scores(Q, nq, group, first, kc, slot0, slots, kv, g * D, lo_all, L, 64, scale, S, bf);
    } else if (D == 128) {
        qk_scores(Q, nq, group, first, kc, slot0, slots, kv, g * D, lo_all, L, 128, scale, S, bf);
    } else if ((D & 15) == 0 && D <= 1024) {
        qk_scores(Q, nq, group, first, kc, slot0, slots, kv, g * D, lo_all, L, D, scale, S, bf);
    } else { /* a sequential order; x holds one key */
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
}

/* Softmax in place over each query's own keys lo .. p of its row of S (p: its position, first +
 * r / group, or pend[r / group] for a tree's rows, whose rows of S are compacted: tree_compact). */
static void group_softmax(float *S, long nq, long group, long first, const long *pend, long window, long L) {
    for (long r = 0; r < nq; r++) {
        long p = pend ? pend[r / group] : first + r / group;
        long lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0, n = p + 1 - lo;
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
}

/* A [nq, D] = each query's probabilities S times the values, 64 outputs at a time in registers.
 * Index j of a row of S is key j, except in a tree's rows (zp not NULL) from index zb on: there
 * index zb + i is the row's i-th zone key on its path, key zb + zp[(r / group) * Z + i]. The keys
 * are summed in index order either way (two runs of the same loop), so a tree row's output is the
 * bits its path alone would give. */
static void group_values(const float *S, long nq, long group, long first, const long *pend, const long *zp,
                         long zb, long Z, long window, long L, const void *vc, long slot0, const int64_t *slots,
                         long kv, long g, long D, float *A, int bf) {
    for (long r = 0; r < nq; r++) {
        long p = pend ? pend[r / group] : first + r / group, lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
        const long *zr = zp ? zp + (r / group) * Z : NULL; /* key of index j >= zb: zb + zr[j - zb] */
        long e1 = p < zb - 1 ? p : zb - 1, z0 = lo > zb ? lo : zb; /* indices lo..e1 direct, z0..p through zr */
        const float *sr = S + r * L;
        float *a = A + r * D;
        long i0 = 0;
        for (; i0 + 64 <= D; i0 += 64) {
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
#define PV_STEP(BF, J0, J1, KEY)                                                         \
    for (long j = J0; j <= J1; j++) {                                                    \
        long off = SLOT(KEY) * kv + g * D + i0;                                          \
        v8f w = bcast8(sr[j]);                                                           \
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
                PV_STEP(1, lo, e1, j)
                PV_STEP(1, z0, p, zb + zr[j - zb])
            } else {
                PV_STEP(0, lo, e1, j)
                PV_STEP(0, z0, p, zb + zr[j - zb])
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
            for (long j = lo; j <= e1; j++) a0 = fma8(bcast8(sr[j]), load8(vc, SLOT(j) * kv + g * D + i0, bf), a0);
            for (long j = z0; j <= p; j++)
                a0 = fma8(bcast8(sr[j]), load8(vc, SLOT(zb + zr[j - zb]) * kv + g * D + i0, bf), a0);
            memcpy(a + i0, &a0, 32);
        }
        for (long i = i0; i < D; i++) {
            float acc = 0.0f;
            for (long j = lo; j <= e1; j++) acc += sr[j] * ld(vc, SLOT(j) * kv + g * D + i, bf);
            for (long j = z0; j <= p; j++) acc += sr[j] * ld(vc, SLOT(zb + zr[j - zb]) * kv + g * D + i, bf);
            a[i] = acc;
        }
    }
}

/* A tree's rows (tz: [base, parents of keys base .. L-1 relative to base, -1: under the context]):
 * each of the T new rows (row t at key first + t) gets its position pend[t] and, from key base on,
 * its path: zp[t * Z + i] (Z = L - base), the zone keys (relative to base) of its ancestors and
 * itself, ascending. A row before the zone is causal: pend[t] = its key. */
static void tree_paths(const int64_t *tz, long first, long T, long L, long *pend, long *zp) {
    long base = tz[0], Z = L - base;
    const int64_t *par = tz + 1;
    for (long t = 0; t < T; t++) {
        long k = first + t;
        if (k < base) {
            pend[t] = k;
            continue;
        }
        long d = 0;
        for (long j = k - base; j >= 0; j = par[j]) d++;
        pend[t] = base + d - 1;
        long *row = zp + t * Z;
        for (long j = k - base; j >= 0; j = par[j]) row[--d] = j;
    }
}

/* The scores of a tree's rows compacted in place: row r's index base + i takes the score of its
 * i-th zone key on its path (never a later index: path keys ascend), so indices 0 .. pend form the
 * row's keys in order, as its path alone would lay them out. */
static void tree_compact(float *S, long nq, long group, long first, long base, long Z, const long *pend,
                         const long *zp, long window, long L) {
    for (long r = 0; r < nq; r++) {
        long t = r / group, p = pend[t];
        if (first + t < base) continue;
        long lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
        float *s = S + r * L + base;
        for (long i = (lo > base ? lo - base : 0); i <= p - base; i++) s[i] = s[zp[t * Z + i]];
    }
}

/* The queries of K/V head g (its H / Hkv query heads, all T tokens): a unit of work of its own,
 * independent of the other heads (threads may take heads in any order: the same bits). tz: the
 * sequence's tree (tree_paths), or NULL: causal rows. Returns 0, or -1 when scratch memory is not
 * available. */
static int attend_group(const void *qkv, long T, long H, long Hkv, long D, void *kc, void *vc, long slot0,
                        const int64_t *slots, long L, long window, float scale, void *out, int bf, long g,
                        const int64_t *tz) {
    long row = (H + 2 * Hkv) * D, kv = Hkv * D;
    long group = H / Hkv, nq = T * group;
    long base = tz ? tz[0] : L, Z = L - base, tree_longs = tz ? T + T * Z : 0;
    float *S = (float *)aligned_alloc(32, sizeof(float) * ((nq * L + 2 * nq * D + D + 8) / 8 * 8 + 8)
                                              + sizeof(long) * tree_longs);
    if (!S) return -1;
    float *Q = S + nq * L, *A = Q + nq * D, *x = A + nq * D; /* scores [nq, L], queries, outputs, a key */
    long *pend = tz ? (long *)(S + (nq * L + 2 * nq * D + D + 8) / 8 * 8 + 8) : NULL, *zp = pend ? pend + T : NULL;
    long first = L - T; /* key index of the first query (its position unless in a tree) */
    long low = first; /* the lowest position of a query */
    if (tz) {
        tree_paths(tz, first, T, L, pend, zp);
        for (long t = 0; t < T; t++) low = pend[t] < low ? pend[t] : low;
    }
    long lo_all = (window > 0 && low - window + 1 > 0) ? low - window + 1 : 0;
    for (long r = 0; r < nq; r++) { /* query r: token r / group, head g * group + r % group */
        long t = r / group, h = g * group + r % group;
        for (long i = 0; i < D; i++) Q[r * D + i] = ld(qkv, t * row + h * D + i, bf);
    }
    group_scores(Q, nq, group, first, kc, slot0, slots, kv, g, D, lo_all, L, scale, S, x, bf);
    if (tz) tree_compact(S, nq, group, first, base, Z, pend, zp, window, L);
    group_softmax(S, nq, group, first, pend, window, L);
    group_values(S, nq, group, first, pend, zp, base, Z, window, L, vc, slot0, slots, kv, g, D, A, bf);
    for (long r = 0; r < nq; r++) {
        long t = r / group, h = g * group + r % group;
        for (long i = 0; i < D; i++) st(out, t * H * D + h * D + i, A[r * D + i], bf);
    }
    free(S);
    return 0;
}
#undef SLOT

/* ATT_MIN_PARALLEL: below this many query-key-dimension products in a call, its heads run on the
 * calling thread alone (a fork of the OpenMP team costs a few microseconds: a draft model's
 * attention over a short context is less than that). A target's batch-1 decode step over a few
 * hundred keys is above it: splitting its heads across threads sped decoding up; lower bounds
 * changed nothing. */
#ifndef ATT_MIN_PARALLEL
#define ATT_MIN_PARALLEL (1L << 14)
#endif

/* One sequence, its K/V heads split across `threads` (torch's OpenMP team) when the work is
 * large enough. Returns 0, or -1 when scratch memory was not available. */
int dw_attend(const void *qkv, long T, long H, long Hkv, long D, void *kc, void *vc, long slot0, long L,
              long window, float scale, void *out, int bf, int threads) {
    if (dw_team_nt) { /* inside dw_decoder's team: thread 0 writes the keys, then the heads are shared */
        int rc = 0;
        if (dw_team_tid == 0) attend_write(qkv, T, H, Hkv, D, kc, vc, slot0, NULL, L, bf);
        dw_team_barrier();
        for (long g = dw_team_tid; g < Hkv; g += dw_team_nt)
            rc |= attend_group(qkv, T, H, Hkv, D, kc, vc, slot0, NULL, L, window, scale, out, bf, g, NULL);
        return rc;
    }
    attend_write(qkv, T, H, Hkv, D, kc, vc, slot0, NULL, L, bf);
    long nt = (threads > 1 && T * H * L * D >= ATT_MIN_PARALLEL) ? (threads < Hkv ? threads : Hkv) : 1;
    int rc = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1) reduction(| : rc)
    for (long g = 0; g < Hkv; g++) rc |= attend_group(qkv, T, H, Hkv, D, kc, vc, slot0, NULL, L, window, scale, out, bf, g, NULL);
    return rc;
}

/* dw_attend_batch's work item `it`: sequence it / Hkv, K/V head it % Hkv */
static int attend_item(const void *qkv, long it, long H, long Hkv, long D, long T, void *kc, void *vc,
                       const int64_t *slots, long Lmax, const int64_t *lens, const int64_t *news, const int64_t *offs,
                       long window, float scale, void *out, int bf, const int64_t *tree) {
    long b = it / Hkv, g = it % Hkv, es = bf ? 2 : 4;
    long n = news ? news[b] : T, r0 = offs ? offs[b] : b * T;
    const int64_t *tz = (tree && tree[b] >= 0) ? tree + tree[b] : NULL;
    return attend_group((const char *)qkv + r0 * (H + 2 * Hkv) * D * es, n, H, Hkv, D, kc, vc, 0, slots + b * Lmax,
                        lens[b], window, scale, (char *)out + r0 * H * D * es, bf, g, tz);
}

/* B sequences on paged slots, T rows each: sequence b's key position j is at slots[b * Lmax + j],
 * it has lens[b] keys and news[b] <= T new tokens (its last keys; news NULL: all T), in its first
 * news[b] rows; the rows after them are padding (their outputs are set to zero, nothing written).
 * qkv [B * T, (H + 2 Hkv) * D], out [B * T, H * D].
 * tree NULL: every row causal; else tree[b] < 0: sequence b's rows are causal, or its keys from
 * base = tree[tree[b]] on form a tree (model/tree_attention.py's TreeSpec): key base + j hangs
 * under key base + tree[tree[b] + 1 + j] (-1: the keys before base), j < lens[b] - base; a row from
 * base on attends the keys before base, its ancestors and itself, at position base + its depth. */
int dw_attend_batch(const void *qkv, long B, long T, long H, long Hkv, long D, void *kc, void *vc,
                    const int64_t *slots, long Lmax, const int64_t *lens, const int64_t *news,
                    const int64_t *offs, long window, float scale, void *out, int bf, int threads,
                    const int64_t *tree) {
    /* offs NULL: sequence b's rows are b*T.. (padded to T, the padding rows zeroed); else packed:
     * its news[b] rows start at row offs[b] (offs[B] rows in all, no padding) */
    long es = bf ? 2 : 4, work = 0;
    for (long b = 0; b < B && dw_team_tid == 0; b++) { /* (inside dw_decoder's team: thread 0) */
        long n = news ? news[b] : T, r0 = offs ? offs[b] : b * T;
        char *ob = (char *)out + r0 * H * D * es;
        attend_write((const char *)qkv + r0 * (H + 2 * Hkv) * D * es, n, H, Hkv, D, kc, vc, 0, slots + b * Lmax,
                     lens[b], bf);
        if (!offs) memset(ob + n * H * D * es, 0, (T - n) * H * D * es);
        work += n * H * lens[b] * D;
    }
    long items = B * Hkv;
    int rc = 0;
    if (dw_team_nt) { /* the work items shared by the team's threads, after thread 0's writes */
        dw_team_barrier();
        for (long it = dw_team_tid; it < items; it += dw_team_nt) rc |= attend_item(qkv, it, H, Hkv, D, T, kc, vc,
                                                                                    slots, Lmax, lens, news, offs,
                                                                                    window, scale, out, bf, tree);
        return rc;
    }
    /* work items: (sequence, K/V head), longest contexts spread by the dynamic schedule */
    long nt = (threads > 1 && work >= ATT_MIN_PARALLEL) ? (threads < items ? threads : items) : 1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1) reduction(| : rc)
    for (long it = 0; it < items; it++)
        rc |= attend_item(qkv, it, H, Hkv, D, T, kc, vc, slots, Lmax, lens, news, offs, window, scale, out, bf, tree);
    return rc;
}

/* dw_attend_blocks' work item `it`: row it / Hkv (of sequence it / Hkv / T), K/V head it % Hkv,
 * as a lone query at the sequence's last key: it sees all of them. */
static int block_item(const void *qkv, long it, long T, long H, long Hkv, long D, void *kc, void *vc,
                      const int64_t *slots, long Lmax, const int64_t *lens, float scale, void *out, int bf) {
    long r = it / Hkv, b = r / T, es = bf ? 2 : 4;
    return attend_group((const char *)qkv + r * (H + 2 * Hkv) * D * es, 1, H, Hkv, D, kc, vc, 0, slots + b * Lmax,
                        lens[b], 0, scale, (char *)out + r * H * D * es, bf, it % Hkv, NULL);
}

/* Blocks of rows that see each other (DSpark's parallel stage): sequence b's T rows (rows b*T..) are
 * its keys lens[b] - T .. lens[b] - 1, written into their slots first as dw_attend_batch writes new
 * tokens', and each row attends all lens[b] keys: its context and every row of its block. qkv, out,
 * slots as dw_attend_batch takes them (padded rows, no padding). Returns 0, or -1 when scratch
 * memory was not available. */
int dw_attend_blocks(const void *qkv, long B, long T, long H, long Hkv, long D, void *kc, void *vc,
                     const int64_t *slots, long Lmax, const int64_t *lens, float scale, void *out, int bf,
                     int threads) {
    long es = bf ? 2 : 4, work = 0, items = B * T * Hkv;
    for (long b = 0; b < B && dw_team_tid == 0; b++) { /* (inside dw_decoder's team: thread 0) */
        attend_write((const char *)qkv + b * T * (H + 2 * Hkv) * D * es, T, H, Hkv, D, kc, vc, 0, slots + b * Lmax,
                     lens[b], bf);
        work += T * H * lens[b] * D;
    }
    int rc = 0;
    if (dw_team_nt) {
        dw_team_barrier();
        for (long it = dw_team_tid; it < items; it += dw_team_nt)
            rc |= block_item(qkv, it, T, H, Hkv, D, kc, vc, slots, Lmax, lens, scale, out, bf);
        return rc;
    }
    long nt = (threads > 1 && work >= ATT_MIN_PARALLEL) ? (threads < items ? threads : items) : 1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1) reduction(| : rc)
    for (long it = 0; it < items; it++)
        rc |= block_item(qkv, it, T, H, Hkv, D, kc, vc, slots, Lmax, lens, scale, out, bf);
    return rc;
}
