/* A drafter's greedy steps in one call (dw_draft_greedy for one sequence, dw_draft_greedy_rows for
 * several), and each row's argmax with its max softmax probability (dw_argmax_conf). */
#include "kernels.h"

/* The first maximum of v[0..n) (the first NaN where there is one), as torch.max and numpy.argmax
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
 * 1 / sum exp(l - max): exp8 on 8 lanes (a libm call per logit would cost more than the rest of the row). A row with a
 * NaN gets NaN, one whose maximum is +-inf NaN (as torch's exp(max - logsumexp)). */
long dw_argmax_conf_row(const float *logits, long V, float *conf) {
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

/* The runner-up of a row whose first maximum `best` (value top) and confidence conf (1 / sum exp(l -
 * top)) are known: *tok2 the first maximum of the other logits, *p2 its softmax probability. The
 * row is scratch: logits[best] is set aside for the scan and put back. */
static void runner_up_row(float *logits, long V, long best, float top, float conf, int64_t *tok2, float *p2) {
    float keep = logits[best], v2;
    logits[best] = -INFINITY;
    *tok2 = argmax_first(logits, V, &v2);
    logits[best] = keep;
    *p2 = exp1(v2 - top) * conf;
}

/* The token of head row `best` (value top) for a head over some tokens only (io->head_ids; the
 * others at io->head_floor): the full row's first maximum. Where no kept logit exceeds the floor
 * (every kept token masked), that is the first token not kept, or a kept one of lower id at the
 * floor itself. */
static long head_token(const struct dw_io *io, long best, float top) {
    if (!io->head_ids) return best;
    long tok = io->head_ids[best];
    if (top != top || top > io->head_floor) return tok;
    long gap = 0; /* the first id not kept (the ids ascend) */
    while (gap < io->V && io->head_ids[gap] == gap) gap++;
    return top < io->head_floor || gap < tok ? gap : tok;
}

/* head_token for eagle3.c's greedy steps */
long dw_head_token(const struct dw_io *io, long best, float top) { return head_token(io, best, top); }

/* argmax_conf_row, and with tok2 not NULL the runner-up (runner_up_row; conf then computed), as
 * token ids (head_token; a pruned head's confidence is its kept logits' softmax: the others add
 * exp(floor - max) = 0 to the sum, but in another order of the additions). */
static long argmax_conf2_row(const struct dw_io *io, float *logits, float *conf, int64_t *tok2, float *p2) {
    float c;
    long V = io->V, best = dw_argmax_conf_row(logits, V, (conf || tok2) ? &c : NULL);
    if (conf) *conf = c;
    if (tok2) {
        runner_up_row(logits, V, best, logits[best], c, tok2, p2);
        if (io->head_ids) *tok2 = io->head_ids[*tok2];
    }
    return head_token(io, best, logits[best]);
}

/* k greedy proposals of one sequence: the calls the drafter's Python loop makes for such a row
 * (runner.run of the fed tokens, the LM head on the last row, the argmax), in one call. Step 0
 * feeds the n0 tokens of `feed` at positions start..start+n0-1, step s > 0 feeds step s-1's token
 * at position start+n0+s-1; every step writes the fed tokens' K/V (the last proposal is not fed).
 * The model's fields of `args` as dw_decoder takes them (its rows' fields B, T, pos, L, lens, news
 * and offs are set here, step by step); args->slot0 >= 0: positions 0.. on consecutive slots from
 * slot0; else args->slots gives each position's slot (one row of args->Lmax slots). out_tok [k];
 * out_conf [k] (may be NULL): max softmax probability of each step's logits; out_tok2, out_p2 [k] (NULL:
 * not computed): each step's runner-up token and its probability. args->feat (or NULL): the listed
 * layers' outputs of the n0 + k - 1 fed rows in feeding order, [n0 + k - 1, nfeat * hid]. Returns 0,
 * or -1 when scratch memory was not available. */
int dw_draft_greedy(const struct dw_io *io, const struct dw_decoder_args *args, const int64_t *feed, long n0,
                    long start, long k, int64_t *out_tok, float *out_conf, int64_t *out_tok2, float *out_p2) {
    long es = args->bf ? 2 : 4, hid = args->hid, V = io->V;
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
        dw_embed_rows(io, ids, T, hid, es, x);
        long L = p0 + T, lens = L, news = T;
        struct dw_decoder_args step = *args;
        step.B = 1, step.T = T, step.pos = pos, step.L = L, step.offs = NULL;
        if (args->feat) /* this step's rows of the n0 + k - 1 fed: from row 0, or n0 + s - 1 */
            step.feat = (char *)args->feat + es * args->nfeat * hid * (s == 0 ? 0 : n0 + s - 1);
        if (args->slot0 >= 0) { /* consecutive slots */
            step.slots = NULL, step.Lmax = 0, step.lens = NULL, step.news = NULL;
        } else {
            step.slot0 = 0, step.lens = &lens, step.news = &news;
        }
        rc = dw_decoder(x, h, &step);
        if (rc != 0) break;
        const char *last = h + es * (T - 1) * hid;
        dw_head_rows(io, last, 1, hid, logits, args->threads);
        prev = argmax_conf2_row(io, logits, out_conf ? out_conf + s : NULL, out_tok2 ? out_tok2 + s : NULL,
                                out_p2 ? out_p2 + s : NULL);
        out_tok[s] = prev;
    }
    free(x);
    return rc;
}

/* The batched form of dw_draft_greedy: ks[b] greedy proposals of each of B sequences. Step 0 feeds
 * sequence b's tokens feed[offs0[b]..offs0[b+1]) at positions start[b].. (packed rows); step s > 0
 * feeds step s-1's proposal of the sequences with ks[b] > s, at the next position. Each step is one
 * dw_forward of those rows with the head on each sequence's last row, then each row's first maximum
 * (dw_argmax_conf_row: the calls and values of the drafter's Python loop for such rows). args: the
 * model's fields, and slots [B, Lmax]: each sequence's slot per position (reaching start[b] + n0 +
 * ks[b] - 1). out_tok / out_conf / out_tok2 / out_p2 [B, kmax] (all but out_tok may be NULL, as for
 * dw_draft_greedy): row b's first ks[b] entries written. Returns 0, or -1 (no scratch memory). */
int dw_draft_greedy_rows(const struct dw_io *io, const struct dw_decoder_args *args, const int64_t *feed,
                         const int64_t *offs0, const int64_t *start, const int64_t *ks, long B, long kmax,
                         int64_t *out_tok, float *out_conf, int64_t *out_tok2, float *out_p2) {
    long R0 = offs0[B], n = (R0 > B ? R0 : B), Lmax = args->Lmax, V = io->V;
    const int64_t *slots = args->slots;
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
        struct dw_decoder_args step = *args; /* A packed sequences */
        step.B = A, step.T = 0, step.pos = pos, step.slot0 = 0, step.L = L, step.slots = whole ? slots : tab;
        step.lens = lens, step.news = news, step.offs = offs, step.feat = NULL;
        rc = dw_forward(io, ids, sel, A, logits, &step);
        for (long a = 0; a < A && rc == 0; a++) {
            long b = act[a];
            long o = b * kmax + s;
            out_tok[o] = argmax_conf2_row(io, logits + a * V, out_conf ? out_conf + o : NULL,
                                          out_tok2 ? out_tok2 + o : NULL, out_p2 ? out_p2 + o : NULL);
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
    for (long r = 0; r < rows; r++) tok[r] = dw_argmax_conf_row(logits + r * V, V, conf ? conf + r : NULL);
}
