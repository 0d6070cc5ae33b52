/* Shared by the fused CPU kernels (the C files of this folder, compiled together into one library by
 * draftwise/model/cpu_kernels.py): the bfloat16 conversions, the 8-lane vector helpers, and the
 * entry points one part calls in another.
 *
 * Every kernel works on float32 (bf = 0) or bfloat16 (bf = 1) tensors and follows the PyTorch
 * path's rounding points (Hugging Face semantics for bfloat16). Built with -ffp-contract=off so
 * that a * b + c is not fused into one rounding (as in PyTorch's separate mul and add kernels);
 * where a kernel wants one rounding it says so (fma8). */
#ifndef DW_KERNELS_H
#define DW_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__FMA__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as PyTorch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : r); /* branch-free */
}

static inline float ld(const void *p, long i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, long i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = f2bf(v);
    else ((float *)p)[i] = v;
}

static inline float rnd(float v, int bf) { return bf ? bf2f(f2bf(v)) : v; } /* round to the dtype */

/* 8-lane vectors (GCC/Clang vector extensions): one AVX register on AVX2 machines, half of one
 * with AVX-512; the attention keeps its 16-lane sums as pairs of them (tree16), so a 16-lane
 * accumulator is two registers and nothing spills on AVX2. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

/* a * b + c: one rounding (FMA) where the CPU has it (every x86-64 CPU with AVX2), else two. The
 * attention's and the products' chains use it: one build gives one answer whatever the batch. */
#ifdef __FMA__
static inline v8f fma8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8f fma8(v8f a, v8f b, v8f c) { return a * b + c; }
#endif

typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8f vsel8(v8i m, v8f a, v8f b) { return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }

static inline v8f bcast8(float s) { return (v8f){s, s, s, s, s, s, s, s}; } /* vbroadcastss; 0 + s is an add */

/* exp(x) for x in [-87, 88] (clamped: softmax arguments are <= 0, and exp(-87) ~ 1.6e-38 is
 * negligible next to the maximum's 1): Cephes' expf (range reduction by ln 2, degree-6
 * polynomial), within ~2 ulp of the exact value. Written on 8-lane vectors (GCC/Clang vector
 * extensions: one AVX2 register; GCC scalarised a 16-lane version's conversions on AVX2) because
 * the C library's expf is one call per element. */
static inline v8f exp8(v8f x) {
    const v8f lo = bcast8(-87.0f), hi = bcast8(88.0f); /* (not x * 0 - 87: NaN for x = -inf) */
    x = vsel8(x < lo, lo, x);
    x = vsel8(x > hi, hi, x);
    v8f t = x * 1.44269504088896341f + 0.5f;
    v8i ni = __builtin_convertvector(t, v8i);
    v8f n = __builtin_convertvector(ni, v8f);
    v8i below = n > t;
    ni += below;
    n = __builtin_convertvector(ni, v8f);
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    v8f z = x * x;
    v8f y = ((((x * 1.9875691500e-4f + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x
             + 1.6666665459e-1f) * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    return y * (v8f)((ni + 127) << 23);
}

static inline float exp1(float x) { /* one element through the same formula */
    v8f v = {0};
    v[0] = x;
    return exp8(v)[0];
}

static inline v8f load8(const void *p, long i, int bf) {
    v8f r;
    if (bf) {
        v8h h;
        memcpy(&h, (const uint16_t *)p + i, 16);
        v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&r, &u, 32);
    } else {
        memcpy(&r, (const float *)p + i, 32);
    }
    return r;
}

/* Q8_MIN_PARALLEL: weights of fewer elements run on the calling thread alone (a fork of the OpenMP
 * team costs a few microseconds: more than a draft-sized product); dw_gemm_* and dw_linear_q4. */
#ifndef Q8_MIN_PARALLEL
#define Q8_MIN_PARALLEL (1L << 17)
#endif

static inline float h2f(uint16_t h) { /* float16 -> float32, exact */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        float f = (float)m * (1.0f / 16777216.0f); /* zero or subnormal: m * 2^-24 */
        return sign ? -f : f;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112u) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 8 float16 -> 8 floats (exact; dw_gemm_q8g's group scales) */
static inline v8f h8x8f(const uint16_t *p) {
#ifdef __F16C__
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8f v;
    for (int l = 0; l < 8; l++) v[l] = h2f(p[l]);
    return v;
#endif
}

/* team.c: dw_decoder's thread team. dw_team_nt: the team's threads while the calling thread runs
 * in one (dw_team_tid its number), else 0. */
struct dw_team_bar {
    int count, sense;
};
extern __thread int dw_team_tid, dw_team_nt;
__attribute__((visibility("hidden"))) void dw_team_enter(struct dw_team_bar *bar, int tid, int nt);
__attribute__((visibility("hidden"))) void dw_team_leave(void);
__attribute__((visibility("hidden"))) void dw_team_barrier(void);
__attribute__((visibility("hidden"))) int dw_team_run(int threads, int (*fn)(void *), void *arg);

/* The threads for `work` multiply-adds: inside a team all of it; else `threads` when the work
 * reaches `min_work` (a fork of the OpenMP team costs more than a smaller product), else 1. */
static inline long dw_threads_for(int threads, long work, long min_work) {
    if (dw_team_nt) return dw_team_nt;
    return (threads > 1 && work >= min_work) ? threads : 1;
}

/* Shares t = 0..NT-1 of a product's work: inside a team the calling thread's shares (t = its
 * number, then every dw_team_nt-th), else a forked OpenMP loop, one share a thread. Each share is
 * the same work either way. */
#define DW_SHARES(NT, T, ...)                                                           \
    do {                                                                                \
        long nt_ = (NT);                                                                \
        if (dw_team_nt) {                                                               \
            for (long T = dw_team_tid; T < nt_; T += dw_team_nt) { __VA_ARGS__ }        \
        } else {                                                                        \
            _Pragma("omp parallel for num_threads(nt_) schedule(static, 1) if (nt_ > 1)") \
            for (long T = 0; T < nt_; T++) { __VA_ARGS__ }                              \
        }                                                                               \
    } while (0)

#ifdef __AVX512F__
/* 16 outputs of row r (o0.. o0 + 15, those below O) from an accumulator, the bias added: the
 * int8-activation products' last step (vnni.c, amx.c) */
static inline void dw_store16(__m512 acc, const float *bias, void *out, long r, long O, long o0, int obf) {
    float v[16];
    _mm512_storeu_ps(v, acc);
    for (int l = 0; l < 16 && o0 + l < O; l++) {
        float y = v[l];
        if (bias) y += bias[o0 + l];
        st(out, r * O + o0 + l, y, obf);
    }
}
#endif

/* ---- entry points (cpu_kernels.py declares the same signatures for ctypes) ---- */

/* amx.c: vnni.c's products on AMX tiles, blocks of up to 16 rows (dw_amx_rows: from how many rows) */
extern int dw_amx_rows;
int dw_amx_enable(int min_rows);
void dw_amx_release(void);
void dw_amx_q8g_block(const int8_t *xq, const float *xs, const int8_t *wv, const uint16_t *gs, const float *bias,
                      void *out, long r0, int M, long ob, long O, long N, int obf);
void dw_amx_q4_block(const int8_t *xq, const float *xs, const float *xsum, const uint8_t *qv, const uint16_t *sm,
                     const float *bias, void *out, long r0, int M, long ob, long O, long N, int obf);
void dw_amx_q4k_block(const int8_t *xq, const float *xs, const int16_t *bs, const uint8_t *kx, const uint8_t *qv,
                      const uint8_t *ks, const float *bias, void *out, long r0, int M, long ob, long O, long N,
                      int obf);

/* norm.c: the elementwise ops of a layer */
void dw_rms_norm(const void *x, const void *w, void *out, long rows, long n, float eps, int bf);
void dw_add_rms_norm(void *x, const void *d, const void *w, void *out, long rows, long n, float eps, int bf);
void dw_rope(void *qkv, long T, long row, long heads, long D, const int64_t *pos, const float *cos,
             const float *sin, int bf);
void dw_silu_mul(const void *gu, void *out, long rows, long I, int bf);

/* attention.c */
int dw_attend(const void *qkv, long T, long H, long Hkv, long D, void *kc, void *vc, long slot0, long L,
              long window, float scale, void *out, int bf, int threads);
int dw_attend_batch(const void *qkv, long B, long T, long H, long Hkv, long D, void *kc, void *vc,
                    const int64_t *slots, long Lmax, const int64_t *lens, const int64_t *news,
                    const int64_t *offs, long window, float scale, void *out, int bf, int threads,
                    const int64_t *tree);
int dw_attend_blocks(const void *qkv, long B, long T, long H, long Hkv, long D, void *kc, void *vc,
                     const int64_t *slots, long Lmax, const int64_t *lens, float scale, void *out, int bf,
                     int threads);

/* linear.c: small float weights and int4 groups */
void dw_linear(const void *x, const void *wt, const void *bias, void *out, long rows, long O, long N, int bf);
void dw_linear_q4(const void *x, const uint8_t *q, const uint16_t *sm, const float *bias, void *out, long rows,
                  long O, long N, int threads, int bf, int obf);

/* vnni.c: int8 / int4 groups times int8 activations (AVX-512 VNNI builds; dw_vnni() says which) */
int dw_vnni(void);
void dw_gemm_q8g_a8(const void *x, const int8_t *wv, const uint16_t *gs, const float *bias, void *out, long rows,
                    long O, long N, int threads, int bf, int obf);
void dw_linear_q4_a8(const void *x, const uint8_t *qv, const uint16_t *sm, const float *bias, void *out, long rows,
                     long O, long N, int threads, int bf, int obf);
void dw_linear_q4k_a8(const void *x, const uint8_t *qv, const uint8_t *ks, const float *bias, void *out, long rows,
                      long O, long N, int threads, int bf, int obf);

/* gemm.c: weights packed by dw_pack (float32, bfloat16, int8) */
void dw_gemm_f32(const float *x, const float *wp, const float *bias, float *out, long rows, long O, long N,
                 int threads);
void dw_gemm_q8(const void *x, const int8_t *wp, const float *scale, const float *bias, void *out, long rows, long O,
                long N, int threads, int bf, int obf);
void dw_gemm_q8g(const void *x, const int8_t *wp, const uint16_t *gs, const float *bias, void *out, long rows, long O,
                 long N, int threads, int bf, int obf);
void dw_gemm_bf16_f32out(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, float *out, long rows, long O,
                         long N, int threads);
void dw_gemm_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *out, long rows, long O,
                  long N, int threads);
void dw_pack(const void *w, void *wp, long O, long N, long es);

/* The decoder's arguments (decoder.c's dw_decoder; `DecoderArgs` in cpu_kernels.py mirrors it field
 * for field). B sequences of T rows: one sequence on consecutive slots (slots NULL: key position j
 * in slot slot0 + j, L keys), else paged (slots [B, Lmax]: sequence b's key position j in slot
 * slots[b * Lmax + j]; lens[b] keys, news[b] new tokens), with padding rows or packed by offs
 * (sequence b's rows from offs[b], offs[B] rows in all; T unused), as dw_attend_batch takes them.
 * w holds 14 pointers per layer: ln1, then (weight, bias, scale) of the qkv, o, gate/up and down
 * projections, ln2 after o's (biases and scales may be NULL); kinds holds the 4 projections' kinds
 * per layer (dw_product). Caches: layer l's K at cache + l * layer_stride elements, its V
 * kv_stride further. pos: each row's position; cos, sin: float32 RoPE tables [positions, D].
 * threads: the products' and attention's OpenMP threads. feat (or NULL): receives the residual
 * stream after each of the nfeat layers listed in feat_layers (ascending), [rows, nfeat * hid] in
 * the dtype, layer j's at columns j * hid.. of every row: the features a drafter reads. */
struct dw_decoder_args {
    long B, T, layers, hid, H, Hkv, D, I;
    void **w;
    const int *kinds;
    const void *final_norm;
    float eps;
    const int64_t *pos;
    const float *cos, *sin;
    void *cache;
    long layer_stride, kv_stride, slot0, L;
    const int64_t *slots;
    long Lmax;
    const int64_t *lens, *news, *offs;
    long window;
    float scale;
    int bf, threads;
    const int64_t *tree; /* sequences whose rows form a tree, as dw_attend_batch takes them; NULL: none */
    void *feat;
    const int64_t *feat_layers;
    long nfeat;
    long block; /* each sequence's T rows a block whose rows see each other (dw_attend_blocks); 0: causal rows */
};

/* The input embedding and the LM head run inside dw_forward and the drafter's greedy steps (`NativeIO`
 * in cpu_kernels.py): emb [V, hid] in the model's dtype (emb_packed 0), a tied model's float32 head
 * packed by dw_pack, [ceil(V/16)][hid][16] (emb_packed 1), or a GGUF's blocks kept
 * (packed_weights.QuantizedEmbedding), dequantised row by row as its lookup does: int8 in groups of
 * 32, q [V, hid] with emb_scale [V, hid/32] float16 (emb_packed 2), or int4, q [V, hid/2] with
 * emb_scale [V, hid/32][2] float16 step and minimum (emb_packed 3). head_w packed, without bias:
 * head_kind 1 dw_gemm_f32 (float32), 2 dw_gemm_bf16_f32out (bfloat16 weights, float32 logits), 3 and
 * 4 dw_gemm_q8g_a8 (int8 groups in vnni.c's layout, head_scale its group scales; float32 logits) of
 * float32 (3) or bfloat16 (4) rows. V: the head's rows. head_ids (NULL: row r is token r): a head over
 * some tokens only (a pruned draft head, model/draft_vocab.py), the token id of each row, ascending;
 * the other tokens' logit is head_floor (the greedy steps' argmax picks as over the whole row). */
struct dw_io {
    const void *emb;
    int emb_packed;
    const void *head_w;
    int head_kind;
    long V;
    const uint16_t *emb_scale, *head_scale;
    const int64_t *head_ids;
    float head_floor;
};

/* decoder.c */
int dw_decoder(void *x, void *h, const struct dw_decoder_args *a);
int dw_forward(const struct dw_io *io, const int64_t *ids, const int64_t *sel, long nsel, float *logits,
               const struct dw_decoder_args *a);
/* decoder.c's helpers for greedy.c (not exported from the library) */
__attribute__((visibility("hidden"))) void dw_embed_rows(const struct dw_io *io, const int64_t *ids, long n,
                                                         long hid, long es, char *x);
__attribute__((visibility("hidden"))) void dw_head_rows(const struct dw_io *io, const void *h, long n, long hid,
                                                        float *logits, int threads);
/* decoder.c's helpers for eagle3.c: one projection by kind, the layers of dw_decoder on the calling
 * thread (alone or in a team, with the scratch the caller gives) and that scratch's size */
__attribute__((visibility("hidden"))) void dw_product(int kind, const void *x, const void *w, const void *bias,
                                                      const void *scale, void *out, long rows, long O, long N,
                                                      int bf, int threads);
__attribute__((visibility("hidden"))) int dw_decoder_layers(char *x, char *h, char *buf, long R,
                                                            const struct dw_decoder_args *a);
__attribute__((visibility("hidden"))) long dw_decoder_buf_bytes(const struct dw_decoder_args *a, long R);

/* greedy.c: a drafter's greedy steps and the argmax with confidence */
int dw_draft_greedy(const struct dw_io *io, const struct dw_decoder_args *a, const int64_t *feed, long n0,
                    long start, long k, int64_t *out_tok, float *out_conf, int64_t *out_tok2, float *out_p2);
int dw_draft_greedy_rows(const struct dw_io *io, const struct dw_decoder_args *a, const int64_t *feed,
                         const int64_t *offs0, const int64_t *start, const int64_t *ks, long B, long kmax,
                         int64_t *out_tok, float *out_conf, int64_t *out_tok2, float *out_p2);
void dw_argmax_conf(const float *logits, long rows, long V, int64_t *tok, float *conf, int threads);
/* a row's first maximum and (conf not NULL) its max softmax probability, for eagle3.c */
__attribute__((visibility("hidden"))) long dw_argmax_conf_row(const float *logits, long V, float *conf);
/* the token of row `best` (value top) of a head's logits: best itself, or for a head over some tokens
 * only (io->head_ids) the full row's first maximum, for eagle3.c */
__attribute__((visibility("hidden"))) long dw_head_token(const struct dw_io *io, long best, float top);

/* eagle3.c: EAGLE-3's greedy drafting steps. dw_eagle3 holds the drafter's norms on its own output
 * (hidden_norm) and on the drafted token's embedding (embed_norm), [hid] in the dtype, and fc_in
 * [2 hid -> hid] as dw_product takes it (kind, weight, bias and scale or NULL); for
 * dw_eagle3_commit also fc [nfeat hid -> hid] (the features' fusion) the same way. */
struct dw_eagle3 {
    const void *hidden_norm, *embed_norm;
    const void *fc_in, *fc_in_bias, *fc_in_scale;
    int fc_in_kind;
    const void *fc, *fc_bias, *fc_scale;
    int fc_kind;
    long nfeat;
};
int dw_eagle3_greedy(const struct dw_io *io, const struct dw_decoder_args *a, const struct dw_eagle3 *e,
                     const void *first, const int64_t *start, const int64_t *ks, long B, long kmax,
                     int64_t *out_tok, float *out_conf, float *out_logits);
int dw_eagle3_step(const struct dw_io *io, const struct dw_decoder_args *a, const struct dw_eagle3 *e, const void *x,
                   const int64_t *tok, const int64_t *start, long B, long s, float *out_logits, void *out_a);
int dw_eagle3_commit(const struct dw_io *io, const struct dw_decoder_args *a, const struct dw_eagle3 *e,
                     const void *feat, const int64_t *ids, const int64_t *pos, const int64_t *slots, long n,
                     void *rows);


/* dspark.c: DSpark's block drafting and cache writes. dw_dspark holds the drafter's pieces besides
 * its layers: fc [nfeat hid -> hid] and hidden_norm (the features' fusion), fc_in [2 hid -> hid]
 * (NULL: rows without the anchor feature), mask_emb [hid], each layer's k/v product (kv: weight,
 * bias, scale per layer; kv_kinds), the vanilla Markov head (w1 [V, rank] in the dtype, w2 [rank ->
 * V] as dw_product takes it; rank 0: none), the confidence head (conf_w [hid + rank] in the dtype,
 * conf_b) and its temperatures per position (temps [g] or NULL). */
struct dw_dspark {
    const void *fc, *fc_bias, *fc_scale;
    int fc_kind;
    const void *hidden_norm;
    const void *fc_in, *fc_in_bias, *fc_in_scale;
    int fc_in_kind;
    const void *mask_emb;
    void *const *kv;
    const int *kv_kinds;
    const void *w1;
    long rank;
    const void *w2, *w2_bias, *w2_scale;
    int w2_kind;
    const void *conf_w;
    float conf_b;
    const float *temps;
    long nfeat;
};
/* Greedy rows' trees grown in dw_dspark_block (model/dspark_native.py, proposers/dspark_tree.py):
 * nodes[b] row b's node budget (0: no tree), width children per expanded node, ratio [2, bins]
 * NodeCalibration's scale of q per (most probable token?, bin of q), floor the log of the step's
 * price (-inf: none), confidence whether a node's confidence is the confidence head's (else max q).
 * Out, [B, nodes max] each: out_n[b] nodes kept, then per node its token, parent (-1: the root),
 * confidence, q(token) and whether it was its slot's most probable token. */
struct dw_dspark_tree {
    const int64_t *nodes;
    long width, bins, max_nodes;
    const float *ratio;
    float floor;
    int confidence;
    int64_t *out_n, *out_tok, *out_parent;
    float *out_conf, *out_q;
    uint8_t *out_first;
};
int dw_dspark_block(const struct dw_io *io, const struct dw_decoder_args *a, const struct dw_dspark *ds,
                    const int64_t *anchors, const void *last, const int64_t *ks, const float *temp,
                    const double *u, long B, int64_t *out_tok, float *out_conf, float *out_probs,
                    float *out_logits, void *out_hidden, const struct dw_dspark_tree *tree);
/* dspark_tree.c: the tree stage of dw_dspark_block (thread 0 but for the product of each depth) */
struct dw_tree_state;
__attribute__((visibility("hidden"))) struct dw_tree_state *dw_tree_new(const struct dw_dspark_tree *t, long B,
                                                                        long g, long rank, long V, long es);
__attribute__((visibility("hidden"))) void dw_tree_free(struct dw_tree_state *s);
__attribute__((visibility("hidden"))) char *dw_tree_z(struct dw_tree_state *s);
__attribute__((visibility("hidden"))) char *dw_tree_bias(struct dw_tree_state *s);
__attribute__((visibility("hidden"))) long dw_tree_inputs(struct dw_tree_state *s, long d, const struct dw_dspark *ds,
                                                          const int64_t *anchors, int bf);
__attribute__((visibility("hidden"))) long dw_tree_rows(const struct dw_tree_state *s);
__attribute__((visibility("hidden"))) void dw_tree_expand(struct dw_tree_state *s, long d, const struct dw_io *io,
                                                          const struct dw_dspark *ds, const float *logits,
                                                          const void *h, long hid, int bf);
__attribute__((visibility("hidden"))) void dw_tree_output(struct dw_tree_state *s);
int dw_dspark_commit(const struct dw_decoder_args *a, const struct dw_dspark *ds, const void *feat,
                     const int64_t *pos, const int64_t *slots, long n, void *fused_rows);

#endif
