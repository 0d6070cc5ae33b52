/* The gated delta rule token by token, in C (float32): the recurrence of a hybrid model's
 * linear-attention layers for short blocks (decode steps, verification blocks), where PyTorch
 * spends its time launching ~10 small ops per token and head. Same rule as `delta_update` /
 * `recurrent_rule` in gated_delta.py:
 *     S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
 * Layout (contiguous): S [B, H, dk, dv] (updated in place: the caller passes its own copy),
 * q, k [B, T, H, dk]; v, out [B, T, H, dv]; g, beta [B, T, H]; states [B, T, H, dk, dv] or NULL
 * (the state after each token: the snapshot rollback). Built by cpu_kernels.build_library. */
#include <math.h>
#include <string.h>

void gd_recurrent(float *S, const float *q, const float *k, const float *v, const float *g, const float *beta,
                  float *out, float *states, long B, long T, long H, long dk, long dv) {
    float kv[1024], u[1024];
    if (dv > 1024) return;
    for (long b = 0; b < B; b++) {
        for (long h = 0; h < H; h++) {
            float *s = S + (b * H + h) * dk * dv;
            for (long t = 0; t < T; t++) {
                long row = (b * T + t) * H + h;
                const float *qt = q + row * dk, *kt = k + row * dk, *vt = v + row * dv;
                float decay = expf(g[row]), bt = beta[row];
                for (long j = 0; j < dv; j++) kv[j] = 0.0f;
                for (long i = 0; i < dk; i++) {  /* decay, and S^T k from the decayed state */
                    float *si = s + i * dv, ki = kt[i];
                    for (long j = 0; j < dv; j++) {
                        si[j] *= decay;
                        kv[j] += si[j] * ki;
                    }
                }
                for (long j = 0; j < dv; j++) u[j] = (vt[j] - kv[j]) * bt;
                float *o = out + row * dv;
                for (long j = 0; j < dv; j++) o[j] = 0.0f;
                for (long i = 0; i < dk; i++) {  /* the rank-1 write, and S^T q from the new state */
                    float *si = s + i * dv, ki = kt[i], qi = qt[i];
                    for (long j = 0; j < dv; j++) {
                        si[j] += ki * u[j];
                        o[j] += si[j] * qi;
                    }
                }
                if (states) memcpy(states + row * dk * dv, s, sizeof(float) * dk * dv);
            }
        }
    }
}
