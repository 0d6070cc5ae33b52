/* EAGLE-3's greedy drafting steps in one call (dw_eagle3_greedy): for B sequences, k times the
 * drafter's decoder layer, the target's final norm and LM head, the argmax, and the next step's row
 * fc_in([norm(a) ; norm(emb(token))]), all on one OpenMP team (team.c) for the whole call: the
 * calls of model/eagle3.py's `Eagle3Drafter.draft` for greedy rows, without a fork of the team and
 * the Python around every product (about 20 a round). dw_eagle3_step: one of those steps without
 * the argmax, for rows whose tokens the caller chooses from the step's logits (sampled rows).
 * dw_eagle3_commit: committed positions' context rows and K/V into the drafter's cache (after each
 * verification), the pieces of `row_input(fuse(.))` and `kv` in one call. */
#include "kernels.h"

/* What one call works on, and the step's rows that thread 0 sets between barriers for the team. */
struct e3_call {
    const struct dw_io *io;
    const struct dw_decoder_args *args;
    const struct dw_eagle3 *e;
    const int64_t *start, *ks;
    long B, kmax;
    int64_t *out_tok;
    float *out_conf, *out_logits;
    char *x, *h, *in, *emb, *buf; /* rows [B, hid], [B, hid], [B, 2 hid], one row, dw_decoder_layers' scratch */
    float *logits;                /* [B, V] */
    char *out_a;                  /* dw_eagle3_step's layer outputs [B, hid] */
    int64_t *pos, *lens, *news, *act, *tab; /* [B] each, tab [B, Lmax] */
    long A, A2;                   /* rows of this step, of the next one */
    struct dw_decoder_args step;
};

/* Thread 0: the rows of step s (the sequences with ks[b] > s, in order; their rows in c->x) as one
 * decoder call of single new tokens: sequence b's at position start[b] + s, attending its keys up
 * to it through its slot row. */
static void step_rows(struct e3_call *c, long s) {
    const struct dw_decoder_args *args = c->args;
    long A = 0, L = 0, Lmax = args->Lmax;
    int whole = 1; /* every sequence runs: their slot rows as given */
    for (long b = 0; b < c->B; b++) {
        if (c->ks[b] <= s) {
            whole = 0;
            continue;
        }
        c->pos[A] = c->start[b] + s;
        c->lens[A] = c->pos[A] + 1;
        c->news[A] = 1;
        if (c->lens[A] > L) L = c->lens[A];
        c->act[A++] = b;
    }
    if (!whole)
        for (long a = 0; a < A; a++) memcpy(c->tab + a * Lmax, args->slots + c->act[a] * Lmax, sizeof(int64_t) * Lmax);
    c->step = *args;
    c->step.B = A, c->step.T = 1, c->step.pos = c->pos, c->step.slot0 = 0, c->step.L = L;
    c->step.slots = whole ? args->slots : c->tab, c->step.lens = c->lens, c->step.news = c->news;
    c->step.offs = NULL, c->step.feat = NULL, c->step.tree = NULL;
    c->A = A;
}

/* Thread 0: the next step's input row [norm(a) ; norm(emb(tok))] of one sequence into `in` [2 hid]. */
static void feed_row(struct e3_call *c, const char *a, int64_t tok, char *in) {
    const struct dw_decoder_args *args = c->args;
    long hid = args->hid, es = args->bf ? 2 : 4;
    dw_rms_norm(a, c->e->hidden_norm, in, 1, hid, args->eps, args->bf);
    dw_embed_rows(c->io, &tok, 1, hid, es, c->emb);
    dw_rms_norm(c->emb, c->e->embed_norm, in + es * hid, 1, hid, args->eps, args->bf);
}

/* Thread 0, after step s's head: each row's token (and confidence, logits), and the input rows
 * [norm(a) ; norm(emb(token))] of the sequences that draft a further step, in order. */
static void choose_and_feed(struct e3_call *c, long s) {
    const struct dw_decoder_args *args = c->args;
    long hid = args->hid, es = args->bf ? 2 : 4, V = c->io->V, A2 = 0;
    for (long a = 0; a < c->A; a++) {
        long b = c->act[a], o = b * c->kmax + s;
        const float *row = c->logits + a * V;
        if (c->out_logits) memcpy(c->out_logits + o * V, row, sizeof(float) * V);
        long best = dw_argmax_conf_row(row, V, c->out_conf ? c->out_conf + o : NULL);
        int64_t tok = dw_head_token(c->io, best, row[best]); /* a pruned head's row: its token id */
        c->out_tok[o] = tok;
        if (c->ks[b] <= s + 1) continue;
        feed_row(c, c->x + es * a * hid, tok, c->in + es * A2++ * 2 * hid);
    }
    c->A2 = A2;
}

/* The steps on the calling thread: alone, or as one thread of the team (every thread makes the same
 * calls and meets at the same barriers; thread 0 alone the bookkeeping, norms and argmax). */
static int eagle3_steps(void *p) {
    struct e3_call *c = (struct e3_call *)p;
    const struct dw_decoder_args *args = c->args;
    const struct dw_eagle3 *e = c->e;
    long hid = args->hid;
    int one = dw_team_tid == 0, rc = 0;
    for (long s = 0; s < c->kmax; s++) {
        if (one) step_rows(c, s);
        dw_team_barrier();
        if (c->A == 0) break;
        rc |= dw_decoder_layers(c->x, c->h, c->buf, c->A, &c->step); /* x: the layer's output a; h: norm(a) */
        dw_head_rows(c->io, c->h, c->A, hid, c->logits, args->threads);
        dw_team_barrier();
        if (one) choose_and_feed(c, s);
        dw_team_barrier();
        if (c->A2 > 0) /* the next step's rows, over this step's (read above) */
            dw_product(e->fc_in_kind, c->in, e->fc_in, e->fc_in_bias, e->fc_in_scale, c->x, c->A2, hid, 2 * hid,
                       args->bf, args->threads);
        dw_team_barrier();
    }
    return rc;
}

/* The call's rows, logits and tables in one block, dw_decoder_layers' scratch in another: 0, or -1
 * (nothing allocated) when memory was not available. */
static int e3_alloc(struct e3_call *c) {
    const struct dw_decoder_args *args = c->args;
    long hid = args->hid, es = args->bf ? 2 : 4, V = c->io->V, B = c->B;
    long rows = es * hid * (4 * B + 1) + 64, bytes = rows + sizeof(float) * B * V + sizeof(int64_t) * B * (4 + args->Lmax);
    char *mem = (char *)malloc(bytes), *buf = (char *)malloc(dw_decoder_buf_bytes(args, B > 0 ? B : 1));
    if (!mem || !buf) {
        free(mem);
        free(buf);
        return -1;
    }
    c->x = mem, c->h = c->x + es * B * hid, c->in = c->h + es * B * hid, c->emb = c->in + es * B * 2 * hid, c->buf = buf;
    c->logits = (float *)(mem + rows);
    c->pos = (int64_t *)(c->logits + B * V), c->lens = c->pos + B, c->news = c->lens + B, c->act = c->news + B;
    c->tab = c->act + B;
    return 0;
}

/* fn(c) on one team, then c's memory freed: 0, or -1 when fn failed. */
static int e3_run(struct e3_call *c, int (*fn)(void *)) {
    int rc = dw_team_run(c->args->threads, fn, c);
    free(c->x);
    free(c->buf);
    return rc ? -1 : 0;
}

/* ks[b] >= 0 greedy steps of each of B sequences. first [B, hid]: step 1's row of each (its last
 * committed position's row, at position start[b]). args: the drafter's layer as dw_decoder takes it
 * (layers 1; final_norm the target's; cos, sin the drafter's RoPE tables, reaching start[b] + ks[b]
 * - 1), its cache and slots [B, Lmax]: sequence b's slot per position up to start[b] + ks[b] - 1
 * (the steps write their K/V at positions start[b].., so those slots are the caller's scratch); io:
 * the target's embedding and head, or a head over some tokens only (io->head_ids: the drafter's
 * reduced vocabulary, model/eagle3_vocab.py; V its rows, the argmax mapped to token ids). out_tok
 * [B, kmax]; out_conf [B, kmax] (may be NULL) each step's max softmax probability; out_logits [B,
 * kmax, V] (may be NULL) its logits, one per head row. Row b's first ks[b] entries are written.
 * Returns 0, or -1 when scratch memory was not available. */
int dw_eagle3_greedy(const struct dw_io *io, const struct dw_decoder_args *args, const struct dw_eagle3 *e,
                     const void *first, const int64_t *start, const int64_t *ks, long B, long kmax,
                     int64_t *out_tok, float *out_conf, float *out_logits) {
    long hid = args->hid, es = args->bf ? 2 : 4;
    struct e3_call c = {io, args, e, start, ks, B, kmax, out_tok, out_conf, out_logits};
    if (e3_alloc(&c)) return -1;
    long A = 0;
    for (long b = 0; b < B; b++) /* step 1's rows: the sequences that draft */
        if (ks[b] > 0) memcpy(c.x + es * A++ * hid, (const char *)first + es * b * hid, es * hid);
    return e3_run(&c, eagle3_steps);
}

/* One step of every sequence (the team's part of dw_eagle3_step): the input rows (c->in fed, or
 * c->x as given), the layer, the head into c->logits, the layer's outputs a left in c->x. */
static int eagle3_one_step(void *p) {
    struct e3_call *c = (struct e3_call *)p;
    const struct dw_decoder_args *args = c->args;
    const struct dw_eagle3 *e = c->e;
    long hid = args->hid;
    if (dw_team_tid == 0) step_rows(c, c->kmax - 1);
    dw_team_barrier();
    if (c->A2 > 0)
        dw_product(e->fc_in_kind, c->in, e->fc_in, e->fc_in_bias, e->fc_in_scale, c->x, c->A2, hid, 2 * hid,
                   args->bf, args->threads);
    dw_team_barrier();
    int rc = dw_decoder_layers(c->x, c->h, c->buf, c->A, &c->step);
    dw_head_rows(c->io, c->h, c->A, hid, c->logits, args->threads);
    if (dw_team_tid == 0) memcpy(c->out_a, c->x, (args->bf ? 2 : 4) * c->A * hid);
    dw_team_barrier();
    return rc;
}

/* Step s (0-based) of B sequences, for a caller that chooses each step's tokens itself (sampled
 * rows): dw_eagle3_greedy's step s of every sequence, without its argmax. x [B, hid]: step 1's rows
 * (tok NULL), or step s - 1's layer outputs a, each fed with tok[b], the token chosen there, through
 * fc_in([norm(a) ; norm(emb(tok))]). The step runs at positions start[b] + s and writes its K/V
 * into the slots of that position (args as dw_eagle3_greedy's, reaching start[b] + s). out_logits
 * [B, V] the step's logits (V = io->V, the head's rows: a head over some tokens gives theirs);
 * out_a [B, hid] its layer outputs (the next step's x). Returns 0, or -1 when scratch memory was not
 * available. */
int dw_eagle3_step(const struct dw_io *io, const struct dw_decoder_args *args, const struct dw_eagle3 *e,
                   const void *x, const int64_t *tok, const int64_t *start, long B, long s, float *out_logits,
                   void *out_a) {
    long hid = args->hid, es = args->bf ? 2 : 4, V = io->V;
    int64_t *ks = (int64_t *)malloc(sizeof(int64_t) * (B > 0 ? B : 1));
    if (!ks) return -1;
    for (long b = 0; b < B; b++) ks[b] = s + 1;
    struct e3_call c = {io, args, e, start, ks, B, s + 1, NULL, NULL, NULL};
    if (e3_alloc(&c)) {
        free(ks);
        return -1;
    }
    if (tok)
        for (long b = 0; b < B; b++) feed_row(&c, (const char *)x + es * b * hid, tok[b], c.in + es * b * 2 * hid);
    else
        memcpy(c.x, x, es * B * hid);
    c.A2 = tok ? B : 0;
    c.logits = out_logits, c.out_a = (char *)out_a; /* the head and the layer write the caller's rows */
    int rc = e3_run(&c, eagle3_one_step);
    free(ks);
    return rc;
}

/* What dw_eagle3_commit works on: its arguments and the rows between its products. */
struct e3_commit {
    const struct dw_io *io;
    const struct dw_decoder_args *args;
    const struct dw_eagle3 *e;
    const void *feat;
    const int64_t *ids, *pos, *slots;
    long n;
    void *rows;
    char *g, *in, *x, *h, *qkv; /* [n, hid], [n, 2 hid], [n, hid], [n, hid], [n, (H + 2 Hkv) D] */
};

/* The team's part of dw_eagle3_commit: the products split across it, thread 0 the norms, the
 * embedding lookup, RoPE and the cache writes. */
static int eagle3_commit_rows(void *p) {
    struct e3_commit *c = (struct e3_commit *)p;
    const struct dw_decoder_args *args = c->args;
    const struct dw_eagle3 *e = c->e;
    long hid = args->hid, n = c->n, es = args->bf ? 2 : 4, row = args->Hkv * args->D, bf = args->bf;
    long q = args->H * args->D, qkvw = q + 2 * row;
    int one = dw_team_tid == 0, nt = args->threads;
    dw_product(e->fc_kind, c->feat, e->fc, e->fc_bias, e->fc_scale, c->g, n, hid, e->nfeat * hid, bf, nt);
    dw_team_barrier();
    if (one) { /* [norm(g) ; norm(emb(x_{t+1}))], the embeddings in h for now */
        dw_embed_rows(c->io, c->ids, n, hid, es, c->h);
        for (long t = 0; t < n; t++) {
            dw_rms_norm(c->g + es * t * hid, e->hidden_norm, c->in + es * 2 * t * hid, 1, hid, args->eps, bf);
            dw_rms_norm(c->h + es * t * hid, e->embed_norm, c->in + es * (2 * t + 1) * hid, 1, hid, args->eps, bf);
        }
    }
    dw_team_barrier();
    dw_product(e->fc_in_kind, c->in, e->fc_in, e->fc_in_bias, e->fc_in_scale, c->x, n, hid, 2 * hid, bf, nt);
    dw_team_barrier();
    if (one) dw_rms_norm(c->x, args->w[0], c->h, n, hid, args->eps, bf); /* the layer's input norm */
    dw_team_barrier();
    /* the layer's q/k/v product (its weights stay warm from the drafting steps: a k/v-only product of
     * its own, the small-weight loop on one thread, cost more than q's share), q unused */
    dw_product(args->kinds[0], c->h, args->w[1], args->w[2], args->w[3], c->qkv, n, qkvw, hid, bf, nt);
    dw_team_barrier();
    if (one) {
        dw_rope(c->qkv + es * q, n, qkvw, args->Hkv, args->D, c->pos, args->cos, args->sin, bf); /* k's heads */
        char *kc = (char *)args->cache, *vc = kc + es * args->kv_stride;
        for (long t = 0; t < n; t++) {
            int64_t s = c->slots[t];
            memcpy(kc + es * s * row, c->qkv + es * (t * qkvw + q), es * row);
            memcpy(vc + es * s * row, c->qkv + es * (t * qkvw + q + row), es * row);
            memcpy((char *)c->rows + es * s * hid, c->x + es * t * hid, es * hid);
        }
    }
    dw_team_barrier();
    return 0;
}

/* The context rows of n committed positions into the drafter's cache. feat [n, nfeat * hid]: the
 * target's features of the positions; ids [n] the token after each (x_{t+1}); pos [n] their
 * positions (rows of args->cos, args->sin); slots [n] their slots. Row t = fc_in([norm(fc(feat_t)) ;
 * norm(emb(ids_t))]) goes to rows [slots, hid] at slots[t], its K (rotated) and V (the layer's input
 * norm and q/k/v product, args->w[0..3]) to args->cache [2, slots, Hkv, D] (V kv_stride elements
 * after K). args: the drafter's layer as dw_eagle3_greedy takes it (only hid, H, Hkv, D, w, kinds,
 * eps, cos, sin, cache, kv_stride, bf, threads read). Returns 0, or -1 when scratch memory was not
 * available. */
int dw_eagle3_commit(const struct dw_io *io, const struct dw_decoder_args *args, const struct dw_eagle3 *e,
                     const void *feat, const int64_t *ids, const int64_t *pos, const int64_t *slots, long n,
                     void *rows) {
    long hid = args->hid, es = args->bf ? 2 : 4, qkvw = (args->H + 2 * args->Hkv) * args->D;
    if (n <= 0) return 0;
    char *mem = (char *)malloc(es * n * (5 * hid + qkvw) + 64);
    if (!mem) return -1;
    struct e3_commit c = {io, args, e, feat, ids, pos, slots, n, rows};
    c.g = mem, c.in = c.g + es * n * hid, c.x = c.in + es * n * 2 * hid, c.h = c.x + es * n * hid;
    c.qkv = c.h + es * n * hid;
    int rc = dw_team_run(args->threads, eagle3_commit_rows, &c);
    free(mem);
    return rc ? -1 : 0;
}
