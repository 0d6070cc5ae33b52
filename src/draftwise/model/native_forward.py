"""The fused CPU path of `LlamaModel`: its forward as calls into the C kernels (`kernels/`).

`NativeForward` is a mixin of `LlamaModel` (llama.py): it reads the model's prepared weights
(`plan`, from `fuse_projections`), its config and its RoPE tables, and runs

- `_fused_forward`: `paged_layer`'s computation in 5 kernel calls per layer besides the 4 products
  (`_layer_by_layer`), or every layer in one call (`dw_decoder`) where each product runs in the
  kernels;
- `native_logits`: a target's whole step, token ids to the logits of chosen rows (`dw_forward`);
- both with `feature_layers`: also the listed layers' outputs for every row (the features a drafter
  reads), copied out by the kernel call (`DecoderArgs.feat`);
- `greedy_steps` / `greedy_steps_rows`: a drafter's k greedy steps (`dw_draft_greedy[_rows]`), a
  head over the frequent tokens only (`--draft-vocab`) included.

The whole-model calls take their arguments as two structs (`cpu_kernels.DecoderArgs`, `NativeIO`)
passed by pointer. Each call makes the per-layer path's kernel calls in the same order with the
same arguments: the same bits, without the Python between them. Prepared weights never move (see
`LlamaModel._apply`), so the pointers gathered once stay valid.
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cpu_kernels
from .attention import AttentionMetadata
from .cpu_kernels import DecoderArgs, NativeIO
from .draft_vocab import FLOOR, PrunedHead
from .packed_weights import PackedEmbedding, PackedLinear, QuantizedEmbedding
from .quantize import KERNEL_MAX_ROWS, Int4Linear, Int8Linear


class NativeForward:
    """The fused CPU path of `LlamaModel` (a mixin: see the module docstring)."""

    # longer blocks (prefill chunks) take the PyTorch path, whose SDPA is blocked and
    # multi-threaded: from about 256 tokens it beats the fused attention, below it they are on a
    # par. 128 is also the longest prefill chunk of a step that decodes too (engine: `mixed`),
    # which runs as one packed forward.
    FUSED_MAX_TOKENS = 128

    def _fusable(self, B: int, T: int, kv_cache, meta) -> bool:
        """Can B sequences of T new tokens on the CPU (`forward`, `native_logits` ask) run fused? With
        the kernels built (see cpu_kernels.py), at most FUSED_MAX_TOKENS new tokens per sequence,
        and either one sequence on consecutive cache slots (the runner sets
        `gather_start` only then, with positions L-T..L-1) or a batch whose sequences' key counts
        and new-token counts the runner gave (`seq_lens`, `seq_new`: sequence b's new tokens are
        its last keys, in its first rows; the other rows are padding)."""
        if meta.row_offsets is not None:  # packed rows: the runner asked `packs` first
            return True
        if T > self.FUSED_MAX_TOKENS:
            return False
        if not ((B == 1 and meta.gather_start is not None) or (meta.seq_lens is not None and len(meta.seq_lens) == B)):
            return False
        return self._kernels_fit(kv_cache)

    def _kernels_fit(self, kv_cache) -> bool:
        # the cache's layout, known per cache tensor (asked every step: costly to work out again)
        key = (kv_cache.data_ptr(), kv_cache.dtype, kv_cache.shape, kv_cache.device)
        if self._fit is None or self._fit[0] != key:
            cfg = self.cfg
            self._fit = (key, self.plan is not None and not cfg.qk_norm and cfg.head_dim <= 1024
                         and kv_cache.dtype == self.model.norm.weight.dtype and kv_cache.is_contiguous()
                         and kv_cache.device.type == "cpu")
        return self._fit[1] and cpu_kernels.usable(kv_cache.dtype)

    def packs(self, max_new_tokens: int, kv_cache) -> bool:
        """Can a batch of sequences feeding different numbers of tokens run packed (one row per real
        token, no padding: `AttentionMetadata.row_offsets`)? Only on the fused CPU path, which
        attends each sequence's rows where they are; the PyTorch path takes a padded [B, T] batch."""
        return max_new_tokens <= self.FUSED_MAX_TOKENS and self._kernels_fit(kv_cache)

    def _decoder(self):
        """`_layer_pointers`' answer, worked out on first use."""
        if self._decoder_plan is None:
            self._decoder_plan = self._layer_pointers()
        return self._decoder_plan

    def _layer_pointers(self):
        """For `dw_decoder` (every layer in one call): (14 pointers per layer, 4 product kinds per
        layer, the most rows it takes) when every projection runs in a kernel of `kernels/` whatever
        the rows up to that bound (a small weight's dw_linear up to 16 rows, a dw_gemm packing any
        number, an int8 weight's dw_gemm_q8 and an int4 one's dw_linear_q4 up to KERNEL_MAX_ROWS),
        else () (the per-layer path: some product is oneDNN's, e.g. with DRAFTWISE_NATIVE_GEMM=0).
        The call saves ~10 Python calls a layer. DRAFTWISE_NATIVE_STEP=0 keeps the per-layer path
        (benchmarks/native_gemm.py compares the two)."""
        if os.environ.get("DRAFTWISE_NATIVE_STEP", "1") == "0":
            return ()
        ptrs, kinds, max_rows = [], [], 1 << 30
        dtype = self.model.norm.weight.dtype
        for layer, w in zip(self.model.layers, self.plan):
            a, m = layer.self_attn, layer.mlp
            ptrs.append(w.ln1.data_ptr())
            for n, p in enumerate((a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)):
                bias = 0 if p.bias is None else p.bias.data_ptr()
                if isinstance(p, (Int8Linear, Int4Linear)) and not p.float_out:
                    kind, weight = p.kernel
                    weight, scale = weight.data_ptr(), p.scale.data_ptr()
                    max_rows = max_rows if p.act8 else min(max_rows, KERNEL_MAX_ROWS)  # (act8: any rows)
                elif getattr(p, "native", None) is not None and p.native.dtype == dtype:
                    kind, weight, scale = (1 if dtype == torch.float32 else 2), p.native.data_ptr(), 0
                elif getattr(p, "small", False) and p.weight.dtype == dtype:
                    kind, weight, scale, max_rows = 0, p.weight_t.data_ptr(), 0, min(max_rows, 16)
                else:
                    return ()
                ptrs += [weight, bias, scale]
                kinds.append(kind)
                if n == 1:
                    ptrs.append(w.ln2.data_ptr())
        return (ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int * len(kinds))(*kinds), max_rows

    def _model_args(self, kv_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **rows) -> DecoderArgs:
        """The decoder's arguments that describe the model and its cache (`rows`: the other fields,
        which describe the rows of this call). Without a one-call plan (`_layer_pointers`' ()), the
        layer pointers are NULL: only the per-layer path reads such arguments."""
        cfg = self.cfg
        ptrs, kinds, _ = self._decoder_plan or (None, None, 0)
        return DecoderArgs(
            layers=len(self.plan), hid=cfg.hidden_size, H=cfg.num_attention_heads, Hkv=cfg.num_key_value_heads,
            D=cfg.head_dim, I=cfg.intermediate_size, w=None if ptrs is None else ctypes.addressof(ptrs),
            kinds=None if kinds is None else ctypes.addressof(kinds), final_norm=self.model.norm.weight.data_ptr(),
            eps=cfg.rms_norm_eps, cos=cos.data_ptr(), sin=sin.data_ptr(), cache=kv_cache.data_ptr(),
            layer_stride=kv_cache.stride(0), kv_stride=kv_cache.stride(1), window=cfg.sliding_window or 0,
            scale=cfg.head_dim ** -0.5, bf=int(kv_cache.dtype == torch.bfloat16), threads=torch.get_num_threads(),
            **rows)

    def _decoder_args(self, B: int, T: int, pos_ptr: int, kv_cache, meta: AttentionMetadata, max_position):
        """The decoder's arguments for a step, and the objects they point into, to keep alive until
        the call: B sequences of T rows, or packed rows (`meta.row_offsets`); positions at `pos_ptr`
        (int64, one per row)."""
        keep = []
        offs_p = 0
        if meta.row_offsets is not None:  # packed: [1, R] rows, sequence b's at row_offsets[b]..
            offs = (ctypes.c_int64 * len(meta.row_offsets))(*meta.row_offsets)
            keep.append(offs)
            offs_p, B, T = ctypes.addressof(offs), len(meta.seq_lens), 0
        L = meta.num_keys  # the longest sequence's
        cos, sin = self.rope_table(max(L, int(max_position or 0)), kv_cache.device)
        if meta.gather_start is not None and B == 1:  # consecutive slots
            slot0, Lmax, slots_p, lens_p, news_p = meta.gather_start, 0, 0, 0, 0
        else:  # paged: every key position's slot, per sequence; rows after a sequence's new tokens pad
            slots = meta.gather_slots  # (a view of wider rows, `KVManager.slots`: the row stride is the kernels' Lmax)
            if slots.stride(1) != 1 or (slots.shape[0] > 1 and slots.stride(0) < slots.shape[1]):
                slots = slots.contiguous()
            slot0 = 0
            lens_news = (ctypes.c_int64 * (2 * B))(*meta.seq_lens, *meta.seq_new)
            keep += [slots, lens_news]
            Lmax, slots_p = (slots.stride(0) if slots.shape[0] > 1 else slots.shape[1]), slots.data_ptr()
            lens_p = ctypes.addressof(lens_news)
            news_p = lens_p + 8 * B
        tree_p = 0
        if meta.kernel_trees is not None:  # (the runner gives them with paged slots only)
            trees = (ctypes.c_int64 * len(meta.kernel_trees))(*meta.kernel_trees)
            keep.append(trees)
            tree_p = ctypes.addressof(trees)
        args = self._model_args(kv_cache, cos, sin, B=B, T=T, pos=pos_ptr, slot0=slot0, L=L, slots=slots_p,
                                Lmax=Lmax, lens=lens_p, news=news_p, offs=offs_p, tree=tree_p)
        return args, keep

    def _native_io(self):
        """The `NativeIO` (embedding pointer and kind, head pointer and kind, their scales) when
        the input embedding and the head run inside the kernels (`dw_forward`, `dw_draft_greedy`): an
        `nn.Embedding` of the model's dtype (kind 0), the packed tied one (1) or a GGUF's kept blocks
        (`QuantizedEmbedding`: 2 int8 groups, 3 int4), and a bias-free head packed for dw_gemm_f32
        (head kind 1, float32), dw_gemm_bf16 with float32 logits (2, bfloat16 with `refine_head`:
        compute_logits' float_logits) or an `Int8Linear` of int8 groups with int8 activations and
        float32 logits (3 float32 rows, 4 bfloat16); a draft head over its frequent tokens
        (`PrunedHead`, draft_vocab.py) whose kept rows are such an `Int8Linear`: its rows' token ids
        in `head_ids`, the others at `FLOOR`; else None. The pointers are found once, the kind every
        call (`refine_head` may change)."""
        if self._io is None:
            self._io = self._io_pointers()
        if not self._io:
            return None
        emb, packed, head, kind, emb_scale, head_scale, rows, ids = self._io
        if kind == 0:  # a packed float head: its kind follows the dtype (and refine_head)
            dtype = self.model.norm.weight.dtype
            kind = 1 if dtype == torch.float32 else 2 if dtype == torch.bfloat16 and self.refine_head else 0
        return NativeIO(emb, packed, head, kind, rows, emb_scale, head_scale, ids, FLOOR) if kind else None

    def _io_pointers(self) -> tuple:
        """`_native_io`'s pointers, the head kind 0 for a packed float head (chosen per call), the
        head's rows and their token ids (0: row r is token r); () where the embedding or the head
        does not run in the kernels."""
        dtype, head, emb = self.model.norm.weight.dtype, self.lm_head, self.model.embed_tokens
        rows, ids = self.cfg.vocab_size, 0
        if isinstance(head, PrunedHead):  # its kept rows, run as the head they are
            rows, ids, head = len(head.kept), head.kept.data_ptr(), head.inner
        if isinstance(emb, PackedEmbedding) and emb.packed.dtype == dtype == torch.float32:
            e = (emb.packed.data_ptr(), 1, 0)
        elif type(emb) is nn.Embedding and emb.weight.dtype == dtype and emb.weight.is_contiguous():
            e = (emb.weight.data_ptr(), 0, 0)
        elif (isinstance(emb, QuantizedEmbedding) and emb.dtype == dtype and emb.qweight.is_contiguous()
              and emb.scale.is_contiguous() and emb.embedding_dim % 32 == 0):
            e = (emb.qweight.data_ptr(), 2 if emb.kind == "int8" else 3, emb.scale.data_ptr())
        else:
            return ()
        native = getattr(head, "native", None)
        if isinstance(head, PackedLinear) and native is not None and head.bias is None and native.dtype == dtype:
            return e[0], e[1], native.data_ptr(), 0, e[2], 0, rows, ids
        if (isinstance(head, Int8Linear) and head.act8 and head.float_out and head.bias is None
                and dtype in (torch.float32, torch.bfloat16)):
            return (e[0], e[1], head.qpacked.data_ptr(), 3 if dtype == torch.float32 else 4, e[2], head.scale.data_ptr(),
                    rows, ids)
        return ()

    def _features_into(self, args: DecoderArgs, keep: list, rows: int, dtype: torch.dtype,
                       feature_layers: tuple[int, ...]) -> torch.Tensor | None:
        """With `feature_layers`: a buffer [rows, F * hidden] that the decoder call fills with the
        residual stream after each listed layer, in layer order (what `_layer_by_layer` taps: `i in
        feature_layers`), set in `args`; None without."""
        if not feature_layers:
            return None
        listed = [i for i in range(len(self.plan)) if i in feature_layers]
        feats = torch.empty(rows, len(listed) * self.cfg.hidden_size, dtype=dtype)
        layers = (ctypes.c_int64 * len(listed))(*listed)
        keep.append(layers)
        args.feat, args.feat_layers, args.nfeat = feats.data_ptr(), ctypes.addressof(layers), len(listed)
        return feats

    def native_logits(self, ids: list[int], positions: list[int], B: int, T: int, kv_cache,
                      meta: AttentionMetadata, max_position: int, rows: list[int],
                      feature_layers: tuple[int, ...] = ()):
        """The logits [len(rows), V] (float32) of the listed rows of a step on the fused CPU path, in
        one kernel call (`dw_forward`: embeddings, every layer, the final norm, the head): what
        `forward` then `compute_logits` of those rows give, bit for bit, without their PyTorch calls
        (most of a batch-1 step's overhead is the interpreter and PyTorch's dispatch). `ids` and
        `positions` hold one entry per row (B x T rows, or packed rows: `meta.row_offsets`). None
        where that call does not run this step (the kernels off, another layout, too many rows, a
        token outside the vocabulary: the step-by-step path raises the error): then the caller
        takes `forward`. With `feature_layers`: (logits, features [len(ids), F * hidden]), the listed
        layers' outputs for every row (padding rows included), as `forward` returns them."""
        kern = cpu_kernels.kernels()
        if kern is None or self.plan is None or not rows or not self._fusable(B, T, kv_cache, meta):
            return None
        plan = self._decoder()
        io = self._native_io()
        V = self.cfg.vocab_size
        if not plan or io is None or len(ids) > plan[2]:
            return None
        if min(ids) < 0 or max(ids) >= V:
            return None
        ids_c = (ctypes.c_int64 * len(ids))(*ids)
        pos_c = (ctypes.c_int64 * len(positions))(*positions)
        sel = (ctypes.c_int64 * len(rows))(*rows)
        args, keep = self._decoder_args(B, T, ctypes.addressof(pos_c), kv_cache, meta, max_position)
        feats = self._features_into(args, keep, len(ids), self.model.norm.weight.dtype, feature_layers)
        logits = torch.empty(len(rows), io.V, dtype=torch.float32)  # [len(rows), head rows]
        rc = kern.forward(ctypes.byref(io), ctypes.addressof(ids_c), ctypes.addressof(sel), len(rows),
                          logits.data_ptr(), ctypes.byref(args))
        if rc != 0:
            raise MemoryError("fused forward: no scratch memory")
        if io.head_ids:  # a pruned head's rows into the full row, as `PrunedHead.forward` places them
            full = logits.new_full((len(rows), V), FLOOR)
            full[:, self.lm_head.kept] = logits
            logits = full
        return logits if feats is None else (logits, feats)

    def _fused_forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, max_position,
                       feature_layers: tuple[int, ...] = ()):
        """`paged_layer`'s computation on the kernels: every layer in one call (`dw_decoder`) where
        its products all run in the kernels, else `_layer_by_layer`. Rows are tokens: B sequences
        of T. Returns the final-normalised hidden states; with `feature_layers` (see `forward`) also
        the listed layers' outputs [B, T, F * hidden]: copied out by `dw_decoder` (`_features_into`),
        or read between `_layer_by_layer`'s calls (the same kernel calls, so the same bits)."""
        B, T = input_ids.shape
        pos = positions.contiguous()
        emb = self.model.embed_tokens  # [B, T, hidden], a new tensor: updated in place
        x = F.embedding(input_ids, emb.weight) if type(emb) is nn.Embedding else emb(input_ids)
        h = torch.empty_like(x)  # the normalised input of the next product
        plan = self._decoder()
        args, keep = self._decoder_args(B, T, pos.data_ptr(), kv_cache, meta, max_position)
        if plan and B * T <= plan[2]:
            feats = self._features_into(args, keep, B * T, x.dtype, feature_layers)
            rc = cpu_kernels.kernels().decoder(x.data_ptr(), h.data_ptr(), ctypes.byref(args))  # every layer
            if rc != 0:
                raise MemoryError("fused decoder: no scratch memory")
            return h if feats is None else (h, feats.view(B, T, -1))
        if feature_layers:
            taps: list[torch.Tensor] = []
            h = self._layer_by_layer(x, h, pos, args, kv_cache.element_size(), feature_layers, taps)
            return h, torch.cat(taps, -1)
        return self._layer_by_layer(x, h, pos, args, kv_cache.element_size())

    def _layer_by_layer(self, x: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, a: DecoderArgs, es: int,
                        feature_layers: tuple[int, ...] = (), taps: list | None = None):
        """The decoder layer by layer: RMSNorm, RoPE in place, attention with the K/V write,
        residual add + RMSNorm, SiLU-and-multiply (the kernels) around the 4 products (the prepared
        weights' own calls). The residual stream x [R, hidden] is updated in place; h receives the
        final-normalised hidden states. `a` as for `dw_decoder`, whose calls these are."""
        k = cpu_kernels.kernels()
        R = x.numel() // a.hid
        H, Hkv, D, eps, bf = a.H, a.Hkv, a.D, a.eps, a.bf
        plan = self.plan
        k.rms_norm(x.data_ptr(), plan[0].ln1.data_ptr(), h.data_ptr(), R, a.hid, eps, bf)
        for i, w in enumerate(plan):
            qkv = w.qkv(h)  # [B, T, (H + 2 Hkv) * D]
            k.rope(qkv.data_ptr(), R, (H + 2 * Hkv) * D, H + Hkv, D, pos.data_ptr(), a.cos, a.sin, bf)
            y = torch.empty(*x.shape[:-1], H * D, dtype=x.dtype)
            kc = a.cache + i * a.layer_stride * es
            if not a.slots:  # consecutive slots
                rc = k.attend(qkv.data_ptr(), a.T, H, Hkv, D, kc, kc + a.kv_stride * es, a.slot0, a.L, a.window,
                              a.scale, y.data_ptr(), bf, a.threads)
            else:
                rc = k.attend_batch(qkv.data_ptr(), a.B, a.T, H, Hkv, D, kc, kc + a.kv_stride * es, a.slots, a.Lmax,
                                    a.lens, a.news, a.offs, a.window, a.scale, y.data_ptr(), bf, a.threads, a.tree)
            if rc != 0:
                raise MemoryError("fused attention: no scratch memory")
            o = w.o(y)  # (held in a name: a temporary's memory could be freed before the call)
            k.add_rms_norm(x.data_ptr(), o.data_ptr(), w.ln2.data_ptr(), h.data_ptr(), R, a.hid, eps, bf)
            gu = w.gate_up(h)
            act = torch.empty(*x.shape[:-1], gu.shape[-1] // 2, dtype=x.dtype)
            k.silu_mul(gu.data_ptr(), act.data_ptr(), R, act.shape[-1], bf)
            nxt = plan[i + 1].ln1 if i + 1 < len(plan) else self.model.norm.weight
            d = w.down(act)
            k.add_rms_norm(x.data_ptr(), d.data_ptr(), nxt.data_ptr(), h.data_ptr(), R, a.hid, eps, bf)
            if i in feature_layers:  # x is updated in place: a copy of layer i's output
                taps.append(x.clone())
        return h

    def _fused_steps(self, kv_cache: torch.Tensor, feeds: list[list[int]], ks: list[int]):
        """(kernels, `NativeIO`) when the fused greedy steps can run here for sequences feeding
        `feeds` and drafting `ks` (each >= 1): every product the kernels' own, the embedding and the
        head inside them, each feed 1..FUSED_MAX_TOKENS tokens, the first step's rows within what the
        kernels take, every id inside the vocabulary (else the step-by-step path raises the error);
        None otherwise."""
        kern = cpu_kernels.kernels()
        if kern is None or self.plan is None or not self._kernels_fit(kv_cache) or not feeds or min(ks) < 1:
            return None
        plan = self._decoder()
        lens = [len(f) for f in feeds]
        if not plan or sum(lens) > plan[2] or len(feeds) > plan[2] \
                or max(lens) > self.FUSED_MAX_TOKENS or min(lens) < 1:
            return None
        io = self._native_io()
        V = self.cfg.vocab_size
        if io is None or any(not 0 <= t < V for f in feeds for t in f):
            return None
        return kern, io

    def greedy_steps(self, feed: list[int], start: int, k: int, kv_cache: torch.Tensor, slot0: int | None,
                     slots: torch.Tensor | None, confidence: bool = False, feature_layers: tuple[int, ...] = ()):
        """A drafter's k greedy steps for one sequence in one kernel call (`dw_draft_greedy`): feed
        `feed` at positions start.., take the last row's argmax, feed it, ... k times; the K/V of
        every fed token written (the k-th proposal is not fed). The calls `ModelRunner.run`, the
        head and the argmax make for such a row, with the same arguments: the same proposals,
        without the Python of each step. slot0: the first slot when positions 0.. lie on
        consecutive slots, else `slots` holds each position's slot. Returns (tokens, max softmax
        probability per step or None), or None where this model's forward is not one call
        (another kernel layout, a bias on the head, too many tokens fed). With `feature_layers` a
        third entry: the listed layers' outputs of every fed token, [len(feed) + k - 1, F * hidden]
        (what `forward` returns for them, as the steps' one-call forwards copy them out)."""
        fused = self._fused_steps(kv_cache, [feed], [k])
        if fused is None:
            return None
        kern, io = fused
        n0 = len(feed)
        cos, sin = self.rope_table(start + n0 + k, kv_cache.device)
        args = self._model_args(kv_cache, cos, sin, slot0=-1 if slot0 is None else slot0,
                                slots=0 if slots is None else slots.data_ptr(),
                                Lmax=0 if slots is None else slots.numel())
        keep: list = []
        feats = self._features_into(args, keep, n0 + k - 1, self.model.norm.weight.dtype, feature_layers)
        feed_c = (ctypes.c_int64 * n0)(*feed)
        toks = (ctypes.c_int64 * k)()
        conf = (ctypes.c_float * k)() if confidence else None
        rc = kern.draft_greedy(ctypes.byref(io), ctypes.byref(args), ctypes.addressof(feed_c), n0, start, k,
                               ctypes.addressof(toks), 0 if conf is None else ctypes.addressof(conf), 0, 0)
        if rc != 0:
            raise MemoryError("fused draft steps: no scratch memory")
        out = list(toks), (list(conf) if conf is not None else None)
        return out if feats is None else (*out, feats)

    def greedy_steps_rows(self, feeds: list[list[int]], starts: list[int], ks: list[int], kv_cache: torch.Tensor,
                          slots: torch.Tensor, confidence: bool = False, runners_up: bool = False):
        """`greedy_steps` for B sequences at once (`dw_draft_greedy_rows`): sequence b feeds feeds[b]
        at positions starts[b].., then its proposals, ks[b] of them; each step is one packed forward
        of the sequences still drafting (what the drafter's loop runs for such rows, with the same
        values). slots [B, L]: each sequence's slot per position, reaching starts[b] + len(feeds[b])
        + ks[b] - 1. Returns (tokens per sequence, confidences per sequence or None), or None where
        this model's forward is not one call (as greedy_steps), or the first step's rows exceed
        what the kernels take. `runners_up`: a third entry, per sequence each step's runner-up token
        and its probability ((tokens, probabilities); confidences then computed too)."""
        fused = self._fused_steps(kv_cache, feeds, ks)
        if fused is None:
            return None
        kern, io = fused
        flat = [t for f in feeds for t in f]
        n0, B, kmax = len(flat), len(feeds), max(ks)
        offs = [0]
        for f in feeds:
            offs.append(offs[-1] + len(f))
        cos, sin = self.rope_table(max(s + len(f) + k for s, f, k in zip(starts, feeds, ks)), kv_cache.device)
        slots = slots.contiguous()
        args = self._model_args(kv_cache, cos, sin, slots=slots.data_ptr(), Lmax=slots.shape[1])
        feed_c = (ctypes.c_int64 * n0)(*flat)
        meta_c = (ctypes.c_int64 * (3 * B + 1))(*offs, *starts, *ks)  # offsets, starts, ks
        toks = (ctypes.c_int64 * (B * kmax))()
        conf = (ctypes.c_float * (B * kmax))() if confidence or runners_up else None
        tok2 = (ctypes.c_int64 * (B * kmax))() if runners_up else None
        p2 = (ctypes.c_float * (B * kmax))() if runners_up else None
        base = ctypes.addressof(meta_c)
        rc = kern.draft_greedy_rows(ctypes.byref(io), ctypes.byref(args), ctypes.addressof(feed_c), base,
                                    base + 8 * (B + 1), base + 8 * (2 * B + 1), B, kmax, ctypes.addressof(toks),
                                    0 if conf is None else ctypes.addressof(conf),
                                    0 if tok2 is None else ctypes.addressof(tok2),
                                    0 if p2 is None else ctypes.addressof(p2))
        if rc != 0:
            raise MemoryError("fused draft steps: no scratch memory")
        out = [list(toks[b * kmax : b * kmax + k]) for b, k in enumerate(ks)]
        confs = [list(conf[b * kmax : b * kmax + k]) for b, k in enumerate(ks)] if conf is not None else None
        if not runners_up:
            return out, confs
        return out, confs, [(list(tok2[b * kmax : b * kmax + k]), list(p2[b * kmax : b * kmax + k]))
                            for b, k in enumerate(ks)]
