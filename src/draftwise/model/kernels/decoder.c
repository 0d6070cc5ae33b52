/* The whole decoder in one call: every layer's products, norms, RoPE and attention for a batch of
 * rows (dw_decoder), and a target's step from token ids to the logits of chosen rows (dw_forward).
 * They make the calls of the per-layer path (native_forward.py's `_layer_by_layer`) in the same
 * order with the same arguments, so the bits are the same, without the Python between the calls. */
#include "kernels.h"

/* One projection of dw_decoder, by kind: 0 dw_linear (w transposed [N, O], a small weight), 1
 * dw_gemm_f32 (w packed by dw_pack, float32), 2 dw_gemm_bf16 (packed bfloat16), 3 dw_gemm_q8
 * (w int8 packed by dw_pack, scale [O] float32, bias float32), 4 dw_linear_q4 (int4 groups,
 * scale the float16 (step, minimum) pairs), 5 dw_gemm_q8g (int8 packed, scale the group scales),
 * 6 dw_gemm_q8g_a8 and 7 dw_linear_q4_a8 (the same weights in vnni.c's layouts, int8 activations), 8
 * dw_linear_q4k_a8 (Q4_K super-blocks in vnni.c's layout, scale their sub-scales):
 * what the per-layer path calls for that weight, with the same arguments. */
void dw_product(int kind, const void *x, const void *w, const void *bias, const void *scale, void *out,
                       long rows, long O, long N, int bf, int threads) {
    switch (kind) {
    case 0: /* single-threaded: thread 0 of a team */
        if (dw_team_tid == 0) dw_linear(x, w, bias, out, rows, O, N, bf);
        break;
    case 1: dw_gemm_f32(x, w, bias, out, rows, O, N, threads); break;
    case 2: dw_gemm_bf16(x, w, bias, out, rows, O, N, threads); break;
    case 4: dw_linear_q4(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    case 5: dw_gemm_q8g(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    case 6: dw_gemm_q8g_a8(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    case 7: dw_linear_q4_a8(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    case 8: dw_linear_q4k_a8(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    default: dw_gemm_q8(x, w, scale, bias, out, rows, O, N, threads, bf, bf); break;
    }
}

/* Layer l's output x [R, hid] into its columns of args->feat [R, nfeat * hid], if l is listed. */
static void copy_feature(const char *x, long R, long l, const struct dw_decoder_args *args) {
    long hid = args->hid, F = args->nfeat, es = args->bf ? 2 : 4;
    for (long j = 0; j < F; j++) {
        if (args->feat_layers[j] != l) continue;
        char *dst = (char *)args->feat + es * j * hid;
        for (long r = 0; r < R; r++) memcpy(dst + es * r * F * hid, x + es * r * hid, es * hid);
    }
}

/* The layers of dw_decoder on the calling thread: alone (dw_team_nt 0, each product forking its
 * own OpenMP team), or as one thread of a team (team.c): every thread takes its share of each
 * product and of the attention, thread 0 alone the norms, RoPE and SiLU, a barrier after each op
 * whose output the next one reads. buf: dw_decoder_buf_bytes(args, R) bytes, one for the whole team.
 * Returns 0, or -1 when the attention had no scratch memory. */
int dw_decoder_layers(char *x, char *h, char *buf, long R, const struct dw_decoder_args *args) {
    long B = args->B, T = args->T, layers = args->layers, hid = args->hid, H = args->H, Hkv = args->Hkv;
    long D = args->D, I = args->I, window = args->window;
    void **w = args->w;
    const int *kinds = args->kinds;
    float eps = args->eps, scale = args->scale;
    int bf = args->bf, threads = args->threads, one = dw_team_tid == 0; /* one: this thread runs the serial ops */
    const int64_t *offs = args->offs;
    long es = bf ? 2 : 4, qkvw = (H + 2 * Hkv) * D;
    char *qkv = buf, *y = qkv + es * R * qkvw, *o = y + es * R * H * D, *gu = o + es * R * hid;
    char *a = gu + es * R * 2 * I, *d = a + es * R * I;
    int rc = 0;
    if (one) dw_rms_norm(x, w[0], h, R, hid, eps, bf);
    dw_team_barrier();
    for (long l = 0; l < layers && (rc == 0 || dw_team_nt); l++) { /* (a team's threads meet at every barrier) */
        void **W = w + 14 * l;
        const int *K = kinds + 4 * l;
        char *kc = (char *)args->cache + l * args->layer_stride * es, *vc = kc + args->kv_stride * es;
        dw_product(K[0], h, W[1], W[2], W[3], qkv, R, qkvw, hid, bf, threads);
        dw_team_barrier();
        if (one) dw_rope(qkv, R, qkvw, H + Hkv, D, args->pos, args->cos, args->sin, bf);
        if (args->block)
            rc |= dw_attend_blocks(qkv, B, T, H, Hkv, D, kc, vc, args->slots, args->Lmax, args->lens, scale, y, bf,
                                   threads);
        else if (args->slots)
            rc |= dw_attend_batch(qkv, B, T, H, Hkv, D, kc, vc, args->slots, args->Lmax, args->lens, args->news, offs,
                                  window, scale, y, bf, threads, args->tree);
        else
            rc |= dw_attend(qkv, T, H, Hkv, D, kc, vc, args->slot0, args->L, window, scale, y, bf, threads);
        dw_team_barrier();
        dw_product(K[1], y, W[4], W[5], W[6], o, R, hid, H * D, bf, threads);
        dw_team_barrier();
        if (one) dw_add_rms_norm(x, o, W[7], h, R, hid, eps, bf);
        dw_team_barrier();
        dw_product(K[2], h, W[8], W[9], W[10], gu, R, 2 * I, hid, bf, threads);
        dw_team_barrier();
        if (one) dw_silu_mul(gu, a, R, I, bf);
        dw_team_barrier();
        dw_product(K[3], a, W[11], W[12], W[13], d, R, hid, I, bf, threads);
        dw_team_barrier();
        if (one) dw_add_rms_norm(x, d, l + 1 < layers ? w[14 * (l + 1)] : args->final_norm, h, R, hid, eps, bf);
        if (one && args->feat) copy_feature(x, R, l, args); /* (x is thread 0's alone: the others read h) */
        dw_team_barrier();
    }
    return rc;
}

/* The bytes of dw_decoder_layers' scratch `buf` for R rows: their q/k/v, attention outputs, o, gate/up,
 * SiLU and down products. */
long dw_decoder_buf_bytes(const struct dw_decoder_args *args, long R) {
    long es = args->bf ? 2 : 4, qkvw = (args->H + 2 * args->Hkv) * args->D;
    return es * R * (qkvw + args->H * args->D + args->hid + 3 * args->I + args->hid);
}

/* What dw_decoder's team works on. */
struct dec_call {
    char *x, *h, *buf;
    long R;
    const struct dw_decoder_args *args;
};

static int decoder_rows(void *p) {
    struct dec_call *c = (struct dec_call *)p;
    return dw_decoder_layers(c->x, c->h, c->buf, c->R, c->args);
}

/* Every decoder layer over the rows that `args` describes (struct dw_decoder_args): a draft model's
 * whole forward, or a target's decode / verification step, in one call. x [R, hid] is the residual
 * stream (updated in place; R = B * T, or offs[B] packed), h [R, hid] receives the final-normalised
 * hidden states; args->feat (if not NULL) the listed layers' outputs. With threads > 1 the layers
 * run on one team of that many threads (team.c). Returns 0, or -1 when scratch memory is not available. */
int dw_decoder(void *x, void *h, const struct dw_decoder_args *args) {
    long R = args->offs ? args->offs[args->B] : args->B * args->T; /* rows (packed: offs[B]) */
    char *buf = (char *)malloc(dw_decoder_buf_bytes(args, R));
    if (!buf) return -1;
    struct dec_call c = {(char *)x, (char *)h, buf, R, args};
    int rc = dw_team_run(args->threads, decoder_rows, &c);
    free(buf);
    return rc ? -1 : 0;
}

/* Rows 0..n-1 of x [n, hid] = the embeddings of ids (io's table, or its packed head): copies, or
 * the kept blocks' values, q * d (int8) or q * d + m (int4) in float32 (two roundings, as the
 * lookup's PyTorch ops), then in the dtype. */
void dw_embed_rows(const struct dw_io *io, const int64_t *ids, long n, long hid, long es, char *x) {
    long G = hid / 32;
    for (long t = 0; t < n; t++) {
        int64_t id = ids[t];
        if (io->emb_packed == 1) {
            const float *src = (const float *)io->emb + (id / 16) * hid * 16 + id % 16;
            for (long i = 0; i < hid; i++) ((float *)x)[t * hid + i] = src[i * 16];
        } else if (io->emb_packed == 2) {
            const int8_t *q = (const int8_t *)io->emb + id * hid;
            const uint16_t *d = io->emb_scale + id * G;
            for (long i = 0; i < hid; i++) st(x, t * hid + i, (float)q[i] * h2f(d[i / 32]), es == 2);
        } else if (io->emb_packed == 3) {
            const uint8_t *q = (const uint8_t *)io->emb + id * hid / 2;
            const uint16_t *dm = io->emb_scale + id * G * 2;
            for (long g = 0; g < G; g++) {
                float d = h2f(dm[2 * g]), m = h2f(dm[2 * g + 1]);
                for (long b = 0; b < 16; b++) { /* byte b: input b (low nibble), input b + 16 (high) */
                    uint8_t v = q[g * 16 + b];
                    st(x, t * hid + g * 32 + b, (float)(v & 15) * d + m, es == 2);
                    st(x, t * hid + g * 32 + b + 16, (float)(v >> 4) * d + m, es == 2);
                }
            }
        } else {
            memcpy(x + es * t * hid, (const char *)io->emb + es * id * hid, es * hid);
        }
    }
}

/* The head's float32 logits [n, V] of n rows of h [n, hid] (io's head_kind): what compute_logits
 * calls for such a head. */
void dw_head_rows(const struct dw_io *io, const void *h, long n, long hid, float *logits, int threads) {
    if (io->head_kind == 1)
        dw_gemm_f32((const float *)h, (const float *)io->head_w, NULL, logits, n, io->V, hid, threads);
    else if (io->head_kind >= 3) /* 3: float32 rows, 4: bfloat16 rows */
        dw_gemm_q8g_a8(h, (const int8_t *)io->head_w, io->head_scale, NULL, logits, n, io->V, hid, threads,
                       io->head_kind == 4, 0);
    else
        dw_gemm_bf16_f32out((const uint16_t *)h, (const uint16_t *)io->head_w, NULL, logits, n, io->V, hid, threads);
}

/* A target's whole decode / verification step in one call: the embeddings of ids (one per row, R
 * rows as dw_decoder counts them; padding rows' ids 0), dw_decoder over `args`, then the head on
 * the nsel rows listed in sel into logits [nsel, V] float32: what the embedding, the per-layer
 * path, the row selection and compute_logits give, bit for bit, without ~10 PyTorch calls a step.
 * Returns 0, or -1 when scratch memory is not available. */
int dw_forward(const struct dw_io *io, const int64_t *ids, const int64_t *sel, long nsel, float *logits,
               const struct dw_decoder_args *args) {
    long hid = args->hid, es = args->bf ? 2 : 4, R = args->offs ? args->offs[args->B] : args->B * args->T;
    char *x = (char *)malloc(es * hid * (2 * R + nsel) + 64);
    if (!x) return -1;
    char *h = x + es * R * hid, *hs = h + es * R * hid;
    dw_embed_rows(io, ids, R, hid, es, x);
    int rc = dw_decoder(x, h, args);
    if (rc == 0) {
        for (long r = 0; r < nsel; r++) memcpy(hs + es * r * hid, h + es * sel[r] * hid, es * hid);
        dw_head_rows(io, hs, nsel, hid, logits, args->threads);
    }
    free(x);
    return rc;
}
