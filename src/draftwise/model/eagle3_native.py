"""EAGLE-3's greedy drafting steps in one kernel call (`dw_eagle3_greedy`, kernels/eagle3.c), and
its other rows' steps one kernel call each (`dw_eagle3_step`), their logits back to the caller.

`Eagle3Drafter.draft` for greedy rows (each step's token its logits' argmax) runs per step a
decoder layer, the target's final norm and LM head and the next row's fc_in: about 20 products a
round, each a call from Python that forks the OpenMP team, so a k=4 round cost several times its
products. `Eagle3Kernel.greedy` makes the same steps in one call on one team: the same products
(dw_gemm_f32 / dw_gemm_bf16 / dw_linear for the drafter's packed weights, the target's packed
head, as `PackedLinear` and `compute_logits` call them), the kernels' norms, RoPE and attention for
torch's (equal up to float rounding). Rows whose tokens are chosen from processed logits (sampled,
penalised or constrained: `StepChooser`) take `Eagle3Kernel.draft`: the same steps without the
argmax, one call each, the step's logits handed to the chooser and its tokens fed to the next call;
the rows draw from q computed from those logits, so DraftBlock.probs stays the q drawn from.
After verification `Eagle3Kernel.commit` writes the committed positions' rows and context K/V
into the drafter's cache in one call (`dw_eagle3_commit`): `row_input(fuse(.))` and `kv`'s
products (K and V from the layer's q/k/v product, whose weights the steps keep warm), norms and
RoPE, on one team.

A drafter with a head over some tokens (`--draft-vocab N`, eagle3_vocab.py) runs that head in the
kernels' `dw_io` (its rows' token ids in `head_ids`): the steps compute its N logits, the greedy
argmax maps back to token ids, and the logits handed back are expanded to the whole vocabulary,
FLOOR elsewhere, as `PrunedHead` gives them.

`Eagle3Kernel.of(drafter)` is None where the call cannot run: the kernels unavailable, a
projection or the target's embedding or head outside them, the drafter's dtype or norm epsilon
not the target's; the caller then keeps `draft`.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from . import cpu_kernels
from .cpu_kernels import DecoderArgs, Eagle3IO, NativeIO
from .draft_vocab import FLOOR
from .packed_weights import PackedLinear, kernel_product
from .quantize import Int8Linear

SMALL_MAX_ROWS = 16  # dw_linear (a small weight's loop) takes up to this many rows


def head_io(target, head, dtype: torch.dtype):
    """The `dw_io` of a feature drafter's kernel call: the target's embedding and head, or its
    embedding and the drafter's `head` over some tokens (a `PrunedHead`; None: the target's), or None
    where that head does not run in the kernels."""
    io = target._native_io()
    if io is None or head is None:
        return io
    inner, kind, scale = head.inner, 0, 0
    native = getattr(inner, "native", None)
    if isinstance(inner, PackedLinear) and native is not None and native.dtype == dtype:
        kind = 1 if dtype == torch.float32 else 2 if io.head_kind == 2 else 0
        w = native.data_ptr()
    elif isinstance(inner, Int8Linear) and inner.act8 and inner.float_out and inner.bias is None:
        kind = 3 if dtype == torch.float32 else 4
        w, scale = inner.qpacked.data_ptr(), inner.scale.data_ptr()
    if not kind:
        return None
    return NativeIO(io.emb, io.emb_packed, w, kind, len(head.kept), io.emb_scale, scale, head.kept.data_ptr(), FLOOR)


def full_rows(rows: torch.Tensor, head, vocab: int, fill: float = FLOOR) -> torch.Tensor:
    """A head's rows [..., N] as whole-vocabulary rows [..., V]: `fill` (FLOOR: logits; 0:
    probabilities) outside a pruned head's tokens (`head` None: the rows as they are)."""
    if head is None:
        return rows
    out = rows.new_full((*rows.shape[:-1], vocab), fill)
    out[..., head.kept] = rows
    return out


class Eagle3Kernel:
    """The pointers of a prepared drafter and its target that `dw_eagle3_greedy` reads (prepared
    weights never move), found once."""

    def __init__(self, drafter, layer_ptrs, kinds, e3: Eagle3IO, max_rows: int, commits: bool):
        self.drafter, self.cfg = drafter, drafter.cfg
        self.target = drafter._target[0]
        self.layer_ptrs, self.kinds, self.e3, self.max_rows = layer_ptrs, kinds, e3, max_rows
        self.commits = commits  # fc in the kernels too: `commit` runs
        self.dtype = next(drafter.parameters()).dtype
        self.head = drafter.head  # a `PrunedHead` or None (the target's)

    def _io(self):
        """The `dw_io` of a call (`head_io`)."""
        return head_io(self.target, self.head, self.dtype)

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        return full_rows(logits, self.head, self.cfg.vocab_size)

    @staticmethod
    def of(drafter) -> "Eagle3Kernel | None":
        lib, target = cpu_kernels.kernels(), (drafter._target or [None])[0]
        if lib is None or target is None or not drafter.packed or not drafter.layer.packed:
            return None
        dtype = next(drafter.parameters()).dtype
        tnorm = target.model.norm
        if (dtype not in (torch.float32, torch.bfloat16) or tnorm.weight.dtype != dtype
                or tnorm.eps != drafter.cfg.rms_norm_eps or next(drafter.parameters()).device.type != "cpu"
                or target._native_io() is None):
            return None
        if drafter.head is not None and not (drafter.head.kept.dtype == torch.int64 and drafter.head.kept.is_contiguous()):
            return None
        layer, packed = drafter.layer, drafter.layer.packed
        prods = [kernel_product(packed[n], dtype) for n in ("qkv", "o", "gate_up", "down")] + [kernel_product(drafter.packed["fc_in"], dtype)]
        norms = (layer.input_layernorm, layer.post_attention_layernorm, drafter.hidden_norm, drafter.embed_norm)
        if any(p is None for p in prods) or any(n.weight.dtype != dtype or n.eps != drafter.cfg.rms_norm_eps for n in norms):
            return None
        ptrs = [layer.input_layernorm.weight.data_ptr()]
        for n, (_, w, b, s) in enumerate(prods[:4]):
            ptrs += [w, b, s]
            if n == 1:
                ptrs.append(layer.post_attention_layernorm.weight.data_ptr())
        kind, w, b, s = prods[4]
        fc = kernel_product(drafter.packed["fc"], dtype)  # for `commit` (with the layer's qkv)
        commits = fc is not None
        fc = fc or (0, 0, 0, 0)
        e3 = Eagle3IO(drafter.hidden_norm.weight.data_ptr(), drafter.embed_norm.weight.data_ptr(), w, b, s, kind,
                      fc[1], fc[2], fc[3], fc[0], len(drafter.cfg.target_feature_layers))
        max_rows = SMALL_MAX_ROWS if any(p[0] == 0 for p in prods + [fc]) else 1 << 30
        kern = Eagle3Kernel(drafter, (ctypes.c_void_p * 14)(*ptrs), (ctypes.c_int * 4)(*(p[0] for p in prods[:4])),
                            e3, max_rows, commits)
        return kern if kern._io() is not None else None

    def fits(self, starts: list[int], ks: list[int]) -> bool:
        """Whether one call takes these rows: few enough for every product, each step's position
        inside the drafter's RoPE table."""
        return len(starts) <= self.max_rows and max(s + k for s, k in zip(starts, ks)) - 1 <= self.cfg.max_position_embeddings

    def _args(self, B: int, cache: torch.Tensor, slots: torch.Tensor) -> DecoderArgs:
        """The drafter's layer as dw_decoder takes it, over `cache` [1, 2, slots, Hkv, D] through
        `slots` [B, Lmax] (contiguous; kept alive by the caller for the call)."""
        cfg = self.cfg
        cos, sin = self.drafter._rope.tables(cache.device)
        return DecoderArgs(
            B=B, T=1, layers=1, hid=cfg.hidden_size, H=cfg.num_attention_heads, Hkv=cfg.num_key_value_heads,
            D=cfg.head_dim, I=cfg.intermediate_size, w=ctypes.addressof(self.layer_ptrs),
            kinds=ctypes.addressof(self.kinds), final_norm=self.target.model.norm.weight.data_ptr(),
            eps=cfg.rms_norm_eps, cos=cos.data_ptr(), sin=sin.data_ptr(), cache=cache.data_ptr(),
            layer_stride=cache.stride(0), kv_stride=cache.stride(1), slots=slots.data_ptr(), Lmax=slots.shape[1],
            scale=cfg.head_dim ** -0.5, bf=int(self.dtype == torch.bfloat16), threads=torch.get_num_threads())

    def greedy(self, first: torch.Tensor, starts: list[int], ks: list[int], cache: torch.Tensor, slots: torch.Tensor,
               confidence: bool = True, logits: bool = False):
        """ks[b] greedy steps of each row: first [B, H] step 1's rows (position starts[b]'s), cache
        [1, 2, slots, Hkv, D] the drafter's K/V, slots [B, Lmax] each row's slot per position up to
        starts[b] + ks[b] - 1 (the steps' own K/V are written at positions starts[b].., into slots
        the caller keeps for them). Returns (tokens per row, max softmax probability per row or
        None, the logits [B, max(ks), V] float32 or None): what `Eagle3Drafter.draft` with the
        argmax gives, up to float rounding."""
        lib = cpu_kernels.kernels()
        io = self._io()
        B, kmax, V = len(ks), max(ks), io.V
        slots = slots.contiguous()
        args = self._args(B, cache, slots)
        first = first.to(self.dtype).contiguous()
        meta = (ctypes.c_int64 * (2 * B))(*starts, *ks)
        toks = (ctypes.c_int64 * (B * kmax))()
        conf = (ctypes.c_float * (B * kmax))() if confidence else None
        out = torch.empty(B, kmax, V, dtype=torch.float32) if logits else None
        base = ctypes.addressof(meta)
        rc = lib.eagle3_greedy(ctypes.byref(io), ctypes.byref(args), ctypes.byref(self.e3),
                               first.data_ptr(), base, base + 8 * B, B, kmax, ctypes.addressof(toks),
                               0 if conf is None else ctypes.addressof(conf), 0 if out is None else out.data_ptr())
        if rc != 0:
            raise MemoryError("eagle3 draft steps: no scratch memory")
        tokens = [list(toks[b * kmax: b * kmax + k]) for b, k in enumerate(ks)]
        confs = None if conf is None else [list(conf[b * kmax: b * kmax + k]) for b, k in enumerate(ks)]
        return tokens, confs, None if out is None else self._full(out)

    def draft(self, first: torch.Tensor, starts: list[int], steps: int, cache: torch.Tensor, slots: torch.Tensor,
              choose: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """`steps` steps of every row, each step's tokens chosen by the caller: `Eagle3Drafter.draft`
        with `choose(j, logits [B, V] float32) -> [B]`, one kernel call a step (`dw_eagle3_step`).
        first, cache and slots as `greedy` takes them (slots reaching starts[b] + steps - 1 for every
        row); the logits are the kernel's, equal to `draft`'s up to float rounding."""
        lib = cpu_kernels.kernels()
        io = self._io()
        B, V, H = first.shape[0], io.V, self.cfg.hidden_size
        slots = slots.contiguous()
        args = self._args(B, cache, slots)
        x = first.to(self.dtype).contiguous()  # [B, H] step 1's rows, then each step's layer outputs a
        start = torch.tensor(starts, dtype=torch.int64)  # [B]
        io = ctypes.byref(io)
        tok = None
        for j in range(steps):
            logits = torch.empty(B, V, dtype=torch.float32)  # [B, V] the head's rows
            a = torch.empty(B, H, dtype=self.dtype)  # [B, H]
            rc = lib.eagle3_step(io, ctypes.byref(args), ctypes.byref(self.e3), x.data_ptr(),
                                 0 if tok is None else tok.data_ptr(), start.data_ptr(), B, j, logits.data_ptr(),
                                 a.data_ptr())
            if rc != 0:
                raise MemoryError("eagle3 draft step: no scratch memory")
            tok = choose(j, self._full(logits)).to(torch.int64).contiguous()  # [B] (the chooser may keep its rows)
            x = a

    def commit(self, features: torch.Tensor, ids: list[int], start: int, slots: torch.Tensor, cache: torch.Tensor,
               rows: torch.Tensor) -> None:
        """Committed positions start .. start + n - 1 into the drafter's cache (`dw_eagle3_commit`):
        features [n, F*H] the target's, ids [n] the token after each, slots [n] (int64) theirs; row t
        = `row_input(fuse(features), ids)` to rows [slots, H], its K (rotated) and V (`kv`) to cache
        [1, 2, slots, Hkv, D] (both in the drafter's dtype), equal to those up to float rounding.
        For n up to `max_rows` where `commits`."""
        n = features.shape[0]
        feat = features.to(self.dtype).contiguous()
        slots = slots.contiguous()
        top = self.cfg.max_position_embeddings  # (positions past the RoPE table read its last row, as `rope`)
        meta = (ctypes.c_int64 * (2 * n))(*ids, *(min(p, top) for p in range(start, start + n)))
        args = self._args(1, cache, slots[None])
        base = ctypes.addressof(meta)
        rc = cpu_kernels.kernels().eagle3_commit(ctypes.byref(self.target._native_io()), ctypes.byref(args),
                                                 ctypes.byref(self.e3), feat.data_ptr(), base, base + 8 * n,
                                                 slots.data_ptr(), n, rows.data_ptr())
        if rc != 0:
            raise MemoryError("eagle3 cache rows: no scratch memory")
