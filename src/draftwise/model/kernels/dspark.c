/* DSpark's drafting in one call (dw_dspark_block) and a step's cache writes in another
 * (dw_dspark_commit): the calls of model/dspark.py's `block_hidden`, `draw` (greedy and
 * temperature-only rows, the vanilla Markov head) and of the proposer's projections and cache
 * writes, the products on one OpenMP team (team.c) for the whole call, without a fork of the team
 * and the Python around every product (about 11 products and 60 PyTorch operations a round).
 *
 * dw_dspark_block, for B rows each drafting a block of g positions after its committed context:
 * - the block's rows: the anchor's embedding (the target's), then g - 1 mask embeddings; with an
 *   anchor feature each row is fc_in([fused feature of the position before the anchor ; row]);
 * - the drafter's layers (dw_decoder_layers with args->block: a row attends its context's cached
 *   K/V and every row of its block), the drafter's final norm, the target's LM head: the base
 *   logits U_1..U_g of every row;
 * - for rows with ks[b] > 0, the sequential stage left to right: z_k = W1[x_{k-1}] (x_0 the
 *   anchor), the bias W2 z_k added to U_k, the confidence sigmoid((w . [h_k ; z_k] + b) / T_k), and
 *   x_k: the argmax (greedy rows) or a draw from q_k = softmax((U_k + W2 z_k) / t) (rows sampled at
 *   temperature t, nothing else processing their logits); the other rows' logits and hidden
 *   states go back to the caller, which draws from them itself (processed or constrained rows).
 * dw_dspark_commit: feature rows' fused features fc(features) -> hidden_norm and each layer's k
 * (rotated) and v of them into the drafter's cache, the fused rows into theirs: a step's rows of
 * every sequence in one call. */
#include "kernels.h"

/* One call of dw_dspark_block and its scratch. */
struct ds_call {
    const struct dw_io *io;
    const struct dw_decoder_args *args;
    const struct dw_dspark *ds;
    const int64_t *anchors, *ks;
    const void *last;
    const float *temp; /* [B]: 0 greedy, else the row samples at this temperature (NULL: all greedy) */
    const double *u;   /* [B, g] the sampled rows' uniforms */
    long B, g;
    int64_t *out_tok;
    float *out_conf, *out_probs, *logits;
    char *x, *h, *in, *buf, *z, *bias; /* rows [R, hid], [R, hid], [R, 2 hid], layers' scratch, [B, r], [B, V] */
    int64_t *prev, *act;               /* [B] each: x_{k-1} of each row, the rows drafting position k */
    long A;                            /* how many rows draft position k */
    struct dw_tree_state *tree;        /* greedy rows' trees (dspark_tree.c), or NULL */
};

/* Thread 0: the block's input rows (the anchor's embedding, mask embeddings; with fc_in the fused
 * feature before the anchor ahead of each, into c->in), into c->x or c->in. */
static void block_inputs(struct ds_call *c) {
    const struct dw_dspark *ds = c->ds;
    long hid = c->args->hid, es = c->args->bf ? 2 : 4, g = c->g;
    long width = ds->fc_in ? 2 * hid : hid, off = ds->fc_in ? hid : 0;
    char *rows = ds->fc_in ? c->in : c->x;
    for (long b = 0; b < c->B; b++)
        for (long j = 0; j < g; j++) {
            char *row = rows + es * (b * g + j) * width;
            if (ds->fc_in) memcpy(row, (const char *)c->last + es * b * hid, es * hid);
            if (j == 0) dw_embed_rows(c->io, c->anchors + b, 1, hid, es, row + es * off);
            else memcpy(row + es * off, ds->mask_emb, es * hid);
        }
}

/* Thread 0: position k's z = W1[x_{k-1}] of the rows that draft it (c->act, c->A). */
static void markov_inputs(struct ds_call *c, long k) {
    const struct dw_dspark *ds = c->ds;
    long r = ds->rank, es = c->args->bf ? 2 : 4, A = 0;
    for (long b = 0; b < c->B; b++) {
        if (c->ks[b] <= k) continue;
        if (r) memcpy(c->z + es * A * r, (const char *)ds->w1 + es * c->prev[b] * r, es * r);
        c->act[A++] = b;
    }
    c->A = A;
}

/* Row o's token from its logits (U_k + W2 z_k): greedy their first maximum; sampled at temperature t
 * an inverse-CDF draw with uniform u from q = softmax(logits / t), written to q (as
 * sampling/rejection.py's categorical_from_uniform draws: the first token whose float64 cumulative
 * sum exceeds u times the total; u * total rounding up to it takes the last token with weight). */
static long choose_token(const float *row, long V, float t, double u, float *q) {
    if (t <= 0.0f) return dw_argmax_conf_row(row, V, NULL);
    float m = -INFINITY, z = 0.0f;
    for (long v = 0; v < V; v++) {
        q[v] = row[v] / t;
        m = q[v] > m ? q[v] : m;
    }
    for (long v = 0; v < V; v++) z += (q[v] = expf(q[v] - m));
    double total = 0.0;
    for (long v = 0; v < V; v++) total += (q[v] /= z);
    double target = u * total, cdf = 0.0;
    long last = -1;
    for (long v = 0; v < V; v++) {
        if (q[v] > 0.0f) last = v;
        cdf += q[v];
        if (cdf > target) return v;
    }
    return last >= 0 ? last : dw_argmax_conf_row(row, V, NULL); /* (no weight at all: NaN logits) */
}

/* Thread 0: position k of the rows that draft it: U_k + W2 z_k (in place in the logits), the
 * confidence and the token (`choose_token`). */
static void markov_choose(struct ds_call *c, long k) {
    const struct dw_dspark *ds = c->ds;
    const struct dw_decoder_args *args = c->args;
    long hid = args->hid, r = ds->rank, V = c->io->V, g = c->g;
    int bf = args->bf;
    for (long a = 0; a < c->A; a++) {
        long b = c->act[a], o = b * g + k;
        float *row = c->logits + o * V;
        if (r)
            for (long v = 0; v < V; v++) row[v] += ld(c->bias, a * V + v, bf);
        float dot = 0.0f;
        for (long i = 0; i < hid; i++) dot += ld(ds->conf_w, i, bf) * ld(c->h, o * hid + i, bf);
        for (long i = 0; i < r; i++) dot += ld(ds->conf_w, hid + i, bf) * ld(c->z, a * r + i, bf);
        float tk = ds->temps ? ds->temps[k] : 1.0f;
        c->out_conf[o] = 1.0f / (1.0f + expf(-rnd(dot + ds->conf_b, bf) / tk));
        float t = c->temp ? c->temp[b] : 0.0f;
        float *q = t > 0.0f ? c->out_probs + o * V : NULL;
        long x = choose_token(row, V, t, t > 0.0f ? c->u[o] : 0.0, q); /* a row of the head */
        int64_t tok = t > 0.0f ? (c->io->head_ids ? c->io->head_ids[x] : x) : dw_head_token(c->io, x, row[x]);
        c->out_tok[o] = c->prev[b] = tok;
    }
}

/* The team's part of dw_dspark_block: the products and attention shared, thread 0 the rest. */
static int dspark_block_rows(void *p) {
    struct ds_call *c = (struct ds_call *)p;
    const struct dw_decoder_args *args = c->args;
    const struct dw_dspark *ds = c->ds;
    long hid = args->hid, R = c->B * c->g, V = c->io->V;
    int one = dw_team_tid == 0, bf = args->bf, nt = args->threads;
    if (one) block_inputs(c);
    dw_team_barrier();
    if (ds->fc_in) dw_product(ds->fc_in_kind, c->in, ds->fc_in, ds->fc_in_bias, ds->fc_in_scale, c->x, R, hid,
                              2 * hid, bf, nt);
    dw_team_barrier();
    int rc = dw_decoder_layers(c->x, c->h, c->buf, R, args); /* h: the drafter's final norm of its output */
    dw_head_rows(c->io, c->h, R, hid, c->logits, nt);
    dw_team_barrier();
    for (long k = 0; k < c->g; k++) {
        if (one) markov_inputs(c, k);
        dw_team_barrier();
        if (c->A == 0) break;
        if (ds->rank) dw_product(ds->w2_kind, c->z, ds->w2, ds->w2_bias, ds->w2_scale, c->bias, c->A, V, ds->rank,
                                 bf, nt);
        dw_team_barrier();
        if (one) markov_choose(c, k);
        dw_team_barrier();
    }
    for (long d = 0; c->tree && d < c->g; d++) { /* the trees: one product a depth for all expansions */
        if (one) dw_tree_inputs(c->tree, d, ds, c->anchors, bf);
        dw_team_barrier();
        long E = dw_tree_rows(c->tree);
        if (E == 0) break;
        if (ds->rank) dw_product(ds->w2_kind, dw_tree_z(c->tree), ds->w2, ds->w2_bias, ds->w2_scale,
                                 dw_tree_bias(c->tree), E, V, ds->rank, bf, nt);
        dw_team_barrier();
        if (one) dw_tree_expand(c->tree, d, c->io, ds, c->logits, c->h, hid, bf);
        dw_team_barrier();
    }
    if (one && c->tree) dw_tree_output(c->tree);
    return rc;
}

/* B rows' blocks of g = args->T positions. args: the drafter's layers as dw_decoder takes them
 * (final_norm the drafter's; block 1, or 0 for a causal block; pos [B * g] each row's positions
 * L_b .. L_b + g - 1; slots [B, Lmax] row b's slot per position up to L_b + g - 1, those from L_b on
 * scratch the call writes the block's K/V to; lens[b] = L_b + g; news[b] = g; cos, sin the
 * drafter's RoPE tables). io: the target's embedding and head (V its rows), or a head over some
 * tokens (io->head_ids; ds->w2 then over the same tokens), tokens mapped to their ids. anchors [B] the token
 * at L_b; last [B, hid] the fused feature of position L_b - 1 (read with ds->fc_in only). ks [B]:
 * the positions of row b the call chooses itself (0 .. g; 0: none), temp [B] how (NULL or 0: the
 * argmax; t > 0: a draw from softmax(logits / t) with the uniform u[b * g + k], its q written to
 * out_probs [B, g, V] float32). out_tok, out_conf [B, g]: row b's first ks[b] entries written;
 * out_logits [B, g, V] float32 (may be NULL): U_k, and for the positions chosen here U_k + W2 z_k;
 * out_hidden [B, g, hid] (may be NULL) the final-normed hidden states h_k in the dtype. tree (may
 * be NULL): the rows with tree->nodes[b] > 0 (and ks[b] = 0) grow a greedy tree from their base
 * logits instead (dspark_tree.c, struct dw_dspark_tree). Returns 0, or -1 when scratch memory was
 * not available. */
int dw_dspark_block(const struct dw_io *io, const struct dw_decoder_args *args, const struct dw_dspark *ds,
                    const int64_t *anchors, const void *last, const int64_t *ks, const float *temp,
                    const double *u, long B, int64_t *out_tok, float *out_conf, float *out_probs,
                    float *out_logits, void *out_hidden, const struct dw_dspark_tree *tree) {
    long hid = args->hid, es = args->bf ? 2 : 4, g = args->T, R = B * g, V = io->V, r = ds->rank;
    long rows = es * (R * 4 * hid + B * r + B * V) + 64;
    long floats = out_logits ? 0 : R * V;
    char *mem = (char *)malloc(rows + sizeof(float) * floats + sizeof(int64_t) * 2 * B);
    char *buf = (char *)malloc(dw_decoder_buf_bytes(args, R > 0 ? R : 1));
    struct dw_tree_state *ts = tree ? dw_tree_new(tree, B, g, r, V, es) : NULL;
    if (!mem || !buf || (tree && !ts)) {
        free(mem);
        free(buf);
        dw_tree_free(ts);
        return -1;
    }
    struct ds_call c = {io, args, ds, anchors, ks, last, temp, u, B, g, out_tok, out_conf, out_probs};
    c.x = mem, c.h = c.x + es * R * hid, c.in = c.h + es * R * hid, c.z = c.in + es * R * 2 * hid;
    c.bias = c.z + es * B * r, c.buf = buf, c.tree = ts;
    c.logits = out_logits ? out_logits : (float *)(mem + rows);
    c.prev = (int64_t *)(mem + rows + sizeof(float) * floats), c.act = c.prev + B;
    for (long b = 0; b < B; b++) c.prev[b] = anchors[b];
    int rc = dw_team_run(args->threads, dspark_block_rows, &c);
    if (rc == 0 && out_hidden) memcpy(out_hidden, c.h, es * R * hid);
    free(mem);
    free(buf);
    dw_tree_free(ts);
    return rc ? -1 : 0;
}

/* What dspark_project works on. */
struct ds_project {
    const struct dw_decoder_args *args;
    const struct dw_dspark *ds;
    const void *feat;
    long n;
    char *gbuf, *fused, *kv; /* [n, hid] fc's output; out: [n, hid] fused, [layers, n, 2 Hkv D] k, v */
};

/* The team's part of dspark_project: the products shared, thread 0 the norm. */
static int dspark_project_rows(void *p) {
    struct ds_project *c = (struct ds_project *)p;
    const struct dw_decoder_args *args = c->args;
    const struct dw_dspark *ds = c->ds;
    long hid = args->hid, n = c->n, es = args->bf ? 2 : 4, row = args->Hkv * args->D;
    int bf = args->bf, nt = args->threads;
    dw_product(ds->fc_kind, c->feat, ds->fc, ds->fc_bias, ds->fc_scale, c->gbuf, n, hid, ds->nfeat * hid, bf, nt);
    dw_team_barrier();
    if (dw_team_tid == 0) dw_rms_norm(c->gbuf, ds->hidden_norm, c->fused, n, hid, args->eps, bf);
    dw_team_barrier();
    for (long l = 0; l < args->layers; l++) {
        void *const *w = ds->kv + 3 * l;
        dw_product(ds->kv_kinds[l], c->fused, w[0], w[1], w[2], c->kv + es * l * n * 2 * row, n, 2 * row, hid, bf, nt);
    }
    dw_team_barrier();
    return 0;
}

/* n feature rows (feat [n, nfeat * hid], the target's) fused and projected: fused [n, hid] =
 * hidden_norm(fc(feat)), kv [layers, n, 2 Hkv D] each layer's k (unrotated) and v of them (ds->kv's
 * product, no norm before it). Returns 0, or -1 when scratch memory was not available. */
static int dspark_project(const struct dw_decoder_args *args, const struct dw_dspark *ds, const void *feat, long n,
                          void *fused, void *kv) {
    long es = args->bf ? 2 : 4;
    if (n <= 0) return 0;
    char *mem = (char *)malloc(es * n * args->hid + 64);
    if (!mem) return -1;
    struct ds_project c = {args, ds, feat, n, mem, (char *)fused, (char *)kv};
    int rc = dw_team_run(args->threads, dspark_project_rows, &c);
    free(mem);
    return rc ? -1 : 0;
}

/* n projected rows (`dspark_project`'s: fused [n, hid]; kv, layer l's rows kv_layer elements
 * after layer l - 1's, each row 2 Hkv D) of committed positions pos [n] (rows of args->cos,
 * args->sin) into the drafter's cache at slots [n]: each layer's k rotated and v to args->cache
 * [layers, 2, slots, Hkv, D] (layer_stride, kv_stride elements apart), the fused rows to fused_rows
 * [slots, hid] (may be NULL). On the calling thread. Returns 0, or -1 when scratch memory was not
 * available. */
static int dspark_place(const struct dw_decoder_args *args, const void *fused, const void *kv, long kv_layer,
                        const int64_t *pos, const int64_t *slots, long n, void *fused_rows) {
    long hid = args->hid, es = args->bf ? 2 : 4, row = args->Hkv * args->D;
    if (n <= 0) return 0;
    char *tmp = (char *)malloc(es * n * 2 * row + 64);
    if (!tmp) return -1;
    if (fused_rows)
        for (long t = 0; t < n; t++)
            memcpy((char *)fused_rows + es * slots[t] * hid, (const char *)fused + es * t * hid, es * hid);
    for (long l = 0; l < args->layers; l++) {
        memcpy(tmp, (const char *)kv + es * l * kv_layer, es * n * 2 * row);
        dw_rope(tmp, n, 2 * row, args->Hkv, args->D, pos, args->cos, args->sin, args->bf); /* k's heads */
        char *kc = (char *)args->cache + es * l * args->layer_stride, *vc = kc + es * args->kv_stride;
        for (long t = 0; t < n; t++) {
            memcpy(kc + es * slots[t] * row, tmp + es * t * 2 * row, es * row);
            memcpy(vc + es * slots[t] * row, tmp + es * (t * 2 + 1) * row, es * row);
        }
    }
    free(tmp);
    return 0;
}

/* n feature rows (feat [n, nfeat * hid], the target's) of positions pos [n] (rows of args->cos,
 * args->sin) into the drafter's cache at slots [n]: fused = hidden_norm(fc(feat)) to fused_rows
 * [slots, hid] (may be NULL), each layer l's k (rotated) and v of it (ds->kv's product, no norm
 * before it) to args->cache [layers, 2, slots, Hkv, D] (layer_stride, kv_stride elements apart). A
 * row's values are a function of that row alone: a step's rows of every sequence go in one call,
 * each weight read once. args: only layers, hid, Hkv, D, eps, cos, sin, cache, layer_stride,
 * kv_stride, bf, threads read. Returns 0, or -1 when scratch memory was not available. */
int dw_dspark_commit(const struct dw_decoder_args *args, const struct dw_dspark *ds, const void *feat,
                     const int64_t *pos, const int64_t *slots, long n, void *fused_rows) {
    long es = args->bf ? 2 : 4, kv_layer = n * 2 * args->Hkv * args->D;
    if (n <= 0) return 0;
    char *mem = (char *)malloc(es * (n * args->hid + args->layers * kv_layer) + 64);
    if (!mem) return -1;
    char *kv = mem + es * n * args->hid;
    int rc = dspark_project(args, ds, feat, n, mem, kv);
    if (rc == 0) rc = dspark_place(args, mem, kv, kv_layer, pos, slots, n, fused_rows);
    free(mem);
    return rc;
}
