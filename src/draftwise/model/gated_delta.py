"""The gated delta rule and its short causal convolution, in plain PyTorch (pure functions).

Qwen3-Next's linear-attention layers (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks")
keep per head a state S `[dk, dv]`. Per token t, with q_t and k_t L2-normalised (q_t also scaled
by dk^-1/2), a log decay g_t <= 0 and a write strength beta_t in (0, 1):

    S <- exp(g_t) S                          (forget)
    S <- S + k_t beta_t (v_t - S^T k_t)^T    (delta rule: write the part of v_t S does not predict)
    o_t = S^T q_t

`recurrent_rule` runs this token by token (verification blocks, decode; it can keep the state
after every token: the `snapshot` rollback). `chunked_rule` gives the same result for long
blocks (prefill) in chunks of C tokens: within a chunk the C updates are one triangular solve
(the "UT transform" of DeltaNet), between chunks the state is carried (Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule"). A token with beta = 0 and g = 0 leaves
the state unchanged, which is how padding rows of a ragged batch are kept out of it.

`delta_update` is the state update alone (no output): the `replay` rollback re-applies the
accepted tokens' updates with it. `causal_conv` is the depthwise convolution of width K over
[window of the K - 1 previous inputs, new inputs], followed by SiLU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


# oneDNN's depthwise convolution cost ~250 us per call for one token (C = 768, K = 4); K
# multiply-adds cost a few us
CONV_UNFOLD_MAX_TOKENS = 32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """window [B, K-1, C] (the previous inputs), x [B, T, C] (new inputs), weight [C, K] ->
    (silu(conv) [B, T, C], the concatenated inputs [B, K-1+T, C]; the window after t tokens is
    `cat[:, t : t + K - 1]`)."""
    cat = torch.cat((window.to(x.dtype), x), dim=1)  # [B, K-1+T, C]
    if x.shape[1] <= CONV_UNFOLD_MAX_TOKENS:  # a few tokens: K products, no convolution call
        K = weight.shape[1]
        out = sum(cat[:, j : j + x.shape[1]].to(weight.dtype) * weight[:, j] for j in range(K))  # [B, T, C]
        return F.silu(out).to(x.dtype), cat
    out = F.conv1d(cat.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])  # [B, C, T]
    return F.silu(out).transpose(1, 2).to(x.dtype), cat


def delta_update(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token's update. S [..., H, dk, dv], k [..., H, dk], v [..., H, dv], g / beta [..., H]."""
    S = S * g.exp()[..., None, None]
    kv_mem = (k.unsqueeze(-2) @ S).squeeze(-2)  # S^T k: [..., H, dv]
    u = (v - kv_mem) * beta[..., None]
    return S + k.unsqueeze(-1) * u.unsqueeze(-2)


def recurrent_rule(q, k, v, g, beta, S, states_out: torch.Tensor | None = None):
    """Token by token. q, k [B, T, H, dk]; v [B, T, H, dv]; g, beta [B, T, H]; S [B, H, dk, dv]
    (float32 throughout). Returns (o [B, T, H, dv], final S); with `states_out` [B, T, H, dk, dv]
    the state after each token is written there (the caller's scratch: no copy to gather them)."""
    T = q.shape[1]
    outs = []
    for t in range(T):
        S = delta_update(S, k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))  # S^T q: [B, H, dv]
        if states_out is not None:
            states_out[:, t] = S
    return torch.stack(outs, 1), S


def chunked_rule(q, k, v, g, beta, S, chunk: int = 64):
    """The same result as `recurrent_rule` (up to rounding) in chunks of `chunk` tokens.

    Within a chunk, with G_t = g_1 + .. + g_t and S0 the state entering it, the written values
    u_t = beta_t (v_t - e^{G_t} S0^T k_t - sum_{s<t} e^{G_t - G_s} (k_t . k_s) u_s) solve the
    unit lower-triangular system (I + A) U = beta V - beta e^G K S0, A[t, s] = beta_t e^{G_t-G_s} k_t.k_s;
    then o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t-G_s} (q_t . k_s) u_s and
    S_C = e^{G_C} S0 + sum_s e^{G_C - G_s} k_s u_s^T."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # padding tokens: beta = 0, g = 0 (no change to the state), outputs dropped
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // chunk

    def heads_first(x):  # [B, T', H, ...] -> [B, H, n, C, ...]
        x = x.transpose(1, 2)
        return x.reshape(B, H, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (heads_first(x) for x in (q, k, v, g, beta))
    G = g.cumsum(-1)  # [B, H, n, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, n, C, C]
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay  # only the strict lower triangle is read (unitriangular)
    U0 = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)  # [.., C, dv]
    W = torch.linalg.solve_triangular(A, kb * G.exp()[..., None], upper=False, unitriangular=True)  # [.., C, dk]
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C], diagonal included
    q_in = q * G.exp()[..., None]  # reads the entering state
    k_out = k * (G[..., -1:] - G).exp()[..., None]  # writes the leaving state
    out = torch.empty(B, H, n, chunk, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        u = U0[:, :, i] - W[:, :, i] @ S  # [B, H, C, dv]
        out[:, :, i] = q_in[:, :, i] @ S + attn[:, :, i] @ u
        S = S * G[:, :, i, -1].exp()[..., None, None] + k_out[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(B, H, n * chunk, dv)[:, :, :T].transpose(1, 2)  # [B, T, H, dv]
    return out, S
