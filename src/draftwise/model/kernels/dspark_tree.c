/* Greedy rows' trees in dw_dspark_block (dspark.c): proposers/dspark_tree.py's `markov_trees`
 * without the Python around each depth. A block's base logits U_1..U_g are known; the distribution
 * at depth d after a node of token x is softmax(U_d + W2 W1[x]) (the vanilla Markov head), so a
 * depth's expansions are one product over the vocabulary for all of them (the team's, in
 * dspark.c) and this file's bookkeeping on thread 0:
 * - tree_inputs: the nodes to expand at depth d (the root at d = 0; else the nodes added at d - 1
 *   that rank among the row's best `nodes[b]`), their z = W1[token];
 * - tree_expand: each one's `width` most probable children (first maximum first), scored by the
 *   log of the product along the path of min(0.999, max(1e-6, q * ratio[first][bin of q]))
 *   (NodeCalibration.rate), their confidence the confidence head's (or max q);
 * - tree_output: the best nodes (score at least `floor`; order: score, then depth, then creation),
 *   in creation order (parents first), parents renumbered. */
#include "kernels.h"

struct tree_node {
    int64_t token;
    long parent; /* index in the row's nodes; -1: the root */
    long depth;
    double score;
    float conf, q;
    uint8_t first;
};

struct dw_tree_state {
    const struct dw_dspark_tree *t;
    long B, g, cap, E;
    struct tree_node *nodes; /* [B, cap] */
    long *count;             /* [B] nodes so far */
    long *front, *nfront;    /* [B, cap] nodes added at the last depth that rank; how many */
    long *best;              /* [cap] scratch: a row's ranking */
    long *eb, *ej;           /* [B * nodes max]: the expansions of this depth (row, node or -1) */
    char *z, *bias;          /* [E max, rank], [E max, V] in the dtype */
};

struct dw_tree_state *dw_tree_new(const struct dw_dspark_tree *t, long B, long g, long rank, long V, long es) {
    long nmax = 1, emax;
    for (long b = 0; b < B; b++) nmax = t->nodes[b] > nmax ? t->nodes[b] : nmax;
    emax = B * nmax;
    struct dw_tree_state *s = (struct dw_tree_state *)calloc(1, sizeof(*s));
    if (!s) return NULL;
    s->t = t, s->B = B, s->g = g, s->cap = g * nmax * (t->width > 0 ? t->width : 1) + 1;
    s->nodes = (struct tree_node *)malloc(sizeof(struct tree_node) * B * s->cap);
    s->count = (long *)calloc(B, sizeof(long));
    s->front = (long *)malloc(sizeof(long) * B * s->cap);
    s->nfront = (long *)calloc(B, sizeof(long));
    s->best = (long *)malloc(sizeof(long) * s->cap);
    s->eb = (long *)malloc(sizeof(long) * emax);
    s->ej = (long *)malloc(sizeof(long) * emax);
    s->z = (char *)malloc(es * emax * (rank > 0 ? rank : 1));
    s->bias = (char *)malloc(es * emax * V);
    if (!s->nodes || !s->count || !s->front || !s->nfront || !s->best || !s->eb || !s->ej || !s->z || !s->bias) {
        dw_tree_free(s);
        return NULL;
    }
    return s;
}

void dw_tree_free(struct dw_tree_state *s) {
    if (!s) return;
    free(s->nodes), free(s->count), free(s->front), free(s->nfront), free(s->best), free(s->eb), free(s->ej);
    free(s->z), free(s->bias), free(s);
}

char *dw_tree_z(struct dw_tree_state *s) { return s->z; }
long dw_tree_rows(const struct dw_tree_state *s) { return s->E; }
char *dw_tree_bias(struct dw_tree_state *s) { return s->bias; }

/* Whether node a ranks before node b: higher score, then shallower, then older. */
static int ranks_before(const struct tree_node *n, long a, long b) {
    if (n[a].score != n[b].score) return n[a].score > n[b].score;
    if (n[a].depth != n[b].depth) return n[a].depth < n[b].depth;
    return a < b;
}

/* Row b's best nodes (at most its budget, score at least floor) into s->best, best first; returns how many. */
static long rank_row(struct dw_tree_state *s, long b) {
    const struct tree_node *n = s->nodes + b * s->cap;
    long m = 0, keep = s->t->nodes[b];
    for (long i = 0; i < s->count[b]; i++) {
        if (n[i].score < s->t->floor) continue;
        long j = m++;
        while (j > 0 && ranks_before(n, i, s->best[j - 1])) {
            s->best[j] = s->best[j - 1];
            j--;
        }
        s->best[j] = i;
        if (m > keep) m = keep;
    }
    return m;
}

long dw_tree_inputs(struct dw_tree_state *s, long d, const struct dw_dspark *ds, const int64_t *anchors, int bf) {
    long es = bf ? 2 : 4, r = ds->rank, E = 0;
    for (long b = 0; b < s->B; b++) {
        if (s->t->nodes[b] <= 0) continue;
        long n = d == 0 ? 1 : s->nfront[b];
        for (long i = 0; i < n; i++) {
            long j = d == 0 ? -1 : s->front[b * s->cap + i];
            int64_t x = j < 0 ? anchors[b] : s->nodes[b * s->cap + j].token;
            if (r) memcpy(s->z + es * E * r, (const char *)ds->w1 + es * x * r, es * r);
            s->eb[E] = b, s->ej[E] = j, E++;
        }
    }
    return s->E = E;
}

/* A node's calibrated acceptance (NodeCalibration.rate). */
static double node_rate(const struct dw_dspark_tree *t, float q, int first) {
    long bin = (long)(q * t->bins);
    bin = bin < 0 ? 0 : (bin >= t->bins ? t->bins - 1 : bin);
    double v = q * t->ratio[first * t->bins + bin];
    return v > 0.999 ? 0.999 : (v < 1e-6 ? 1e-6 : v);
}

void dw_tree_expand(struct dw_tree_state *s, long d, const struct dw_io *io, const struct dw_dspark *ds,
                    const float *logits, const void *h, long hid, int bf) {
    const struct dw_dspark_tree *t = s->t;
    long V = io->V, r = ds->rank, w = t->width < 16 ? t->width : 16;
    float top[16];
    long idx[16];
    for (long e = 0; e < s->E; e++) {
        long b = s->eb[e], j = s->ej[e], o = b * s->g + d;
        const float *u = logits + o * V;
        long k = 0;
        float m = -INFINITY;
        for (long v = 0; v < V; v++) { /* the top w of U_d + bias (first maxima first), and the max */
            float x = u[v] + (r ? ld(s->bias, e * V + v, bf) : 0.0f);
            if (x > m) m = x;
            if (k < w || x > top[k - 1]) {
                long i = k < w ? k++ : k - 1;
                while (i > 0 && x > top[i - 1]) {
                    top[i] = top[i - 1], idx[i] = idx[i - 1];
                    i--;
                }
                top[i] = x, idx[i] = v;
            }
        }
        double z = 0.0;
        for (long v = 0; v < V; v++) z += expf(u[v] + (r ? ld(s->bias, e * V + v, bf) : 0.0f) - m);
        float lz = m + (float)log(z);
        float conf = expf(top[0] - lz);
        if (t->confidence) {
            float dot = 0.0f;
            for (long i = 0; i < hid; i++) dot += ld(ds->conf_w, i, bf) * ld(h, o * hid + i, bf);
            for (long i = 0; i < r; i++) dot += ld(ds->conf_w, hid + i, bf) * ld(s->z, e * r + i, bf);
            float tk = ds->temps ? ds->temps[d] : 1.0f;
            conf = 1.0f / (1.0f + expf(-rnd(dot + ds->conf_b, bf) / tk));
        }
        struct tree_node *n = s->nodes + b * s->cap;
        double base = j < 0 ? 0.0 : n[j].score;
        for (long i = 0; i < k; i++) {
            if (!(top[i] > -INFINITY) || s->count[b] >= s->cap) continue; /* never a token q cannot produce */
            float q = expf(top[i] - lz);
            struct tree_node *c = n + s->count[b]++;
            c->token = io->head_ids ? io->head_ids[idx[i]] : idx[i];
            c->parent = j, c->depth = d, c->conf = conf, c->q = q, c->first = i == 0;
            c->score = base + log(node_rate(t, q, i == 0));
        }
    }
    for (long b = 0; b < s->B; b++) { /* the next depth expands this depth's nodes that rank */
        if (t->nodes[b] <= 0) continue;
        long m = rank_row(s, b), f = 0;
        for (long i = 0; i < m; i++)
            if (s->nodes[b * s->cap + s->best[i]].depth == d) s->front[b * s->cap + f++] = s->best[i];
        for (long i = 1; i < f; i++) { /* creation order, as they were added */
            long x = s->front[b * s->cap + i], a = i;
            while (a > 0 && s->front[b * s->cap + a - 1] > x) {
                s->front[b * s->cap + a] = s->front[b * s->cap + a - 1];
                a--;
            }
            s->front[b * s->cap + a] = x;
        }
        s->nfront[b] = f;
    }
}

void dw_tree_output(struct dw_tree_state *s) {
    const struct dw_dspark_tree *t = s->t;
    long M = t->max_nodes;
    for (long b = 0; b < s->B; b++) {
        t->out_n[b] = 0;
        if (t->nodes[b] <= 0) continue;
        long m = rank_row(s, b);
        for (long i = 1; i < m; i++) { /* creation order: parents first */
            long x = s->best[i], a = i;
            while (a > 0 && s->best[a - 1] > x) {
                s->best[a] = s->best[a - 1];
                a--;
            }
            s->best[a] = x;
        }
        const struct tree_node *n = s->nodes + b * s->cap;
        for (long i = 0; i < m && i < M; i++) {
            const struct tree_node *c = n + s->best[i];
            long parent = -1;
            for (long a = 0; a < i; a++)
                if (s->best[a] == c->parent) parent = a;
            t->out_tok[b * M + i] = c->token, t->out_parent[b * M + i] = parent;
            t->out_conf[b * M + i] = c->conf, t->out_q[b * M + i] = c->q, t->out_first[b * M + i] = c->first;
        }
        t->out_n[b] = m < M ? m : M;
    }
}
