"""DSpark's block drafting in one kernel call (`dw_dspark_block`, kernels/dspark.c) and its cache
writes in another (`dw_dspark_commit`).

`DSparkDrafter.block_hidden` and `draw` make about 11 products a round and some 60 PyTorch
operations around them (masks, concatenations, RoPE, the Markov head's and the confidence head's
steps), each a call from Python that forks the OpenMP team: on the embedded 20M target a round's
drafting cost more than the target's own verification step. `DSparkKernel.block` makes the same
computation in one call on one team: the block's input rows, the drafter's layers (the kernels'
decoder layer with a block's attention: every row sees its context and its whole block, or the
rows up to its own with `causal_block`), the drafter's final norm and the target's head, and the
vanilla Markov head's steps left to right with their confidences for greedy rows whose q is their
raw logits (`raw_greedy`: the argmax) and for rows that sample with nothing but a temperature
(`temperature_only`: q_k = softmax((U_k + B_k) / t), a draw with a uniform of the row's generator;
q_k goes back as DraftBlock.probs). The other rows (penalties, top-k/top-p, grammars) get the
base logits U_k and hidden states back, and `draw` makes their sequential stage from them
(`StepChooser`), so DraftBlock.probs is always the q drawn from. The block's own K/V go to scratch slots past
the paged ones, so the committed cache stays as it is.

`DSparkKernel.commit` writes feature rows into the drafter's cache: fc and the hidden norm (the
fused feature), each layer's k/v product and RoPE, the writes at the positions' slots; a step's
rows of every sequence in one call (each weight read once a step, not once a sequence).

With `--draft-vocab N` (`DSparkDrafter.set_head`: a head over the target's N most frequent tokens)
the call's head is those rows (the kernels' `dw_io` with their token ids) and the Markov head's bias
is over the same tokens (`MarkovHead.keep`): N logits a position, the argmax or the draw mapped to
token ids; the logits and q handed back are whole-vocabulary rows (FLOOR, 0 elsewhere), as
`PrunedHead` gives them.

Both equal the PyTorch path up to float rounding (tests compare them). `DSparkKernel.of(drafter)`
is None where the calls cannot run: the kernels unavailable, a projection outside them, the
drafter's dtype or norm epsilon not the target's, the target's embedding or the drafter's head
outside them.
"""
from __future__ import annotations

import ctypes

import torch

from . import cpu_kernels
from .cpu_kernels import DecoderArgs, DSparkIO, DSparkTree
from .eagle3_native import full_rows, head_io
from .packed_weights import kernel_product

LAYER_PRODUCTS = ("qkv", "o", "gate_up", "down")


class TreeRequest:
    """Greedy rows' trees for `DSparkKernel.block` (`struct dw_dspark_tree`): nodes[b] the node
    budget of row b (0: none), `width` children per expanded node, `ratio` [2, bins] the node
    calibration's scale of q (NodeCalibration.ratios), `floor` the log of the step's price, and
    whether a node's confidence is the confidence head's."""

    def __init__(self, nodes: list[int], width: int, ratio: list[float], floor: float, confidence: bool):
        self.nodes = torch.tensor(nodes, dtype=torch.int64)
        self.width, self.bins, self.floor, self.confidence = width, len(ratio) // 2, floor, confidence
        self.ratio = torch.tensor(ratio, dtype=torch.float32)
        self.M = max(1, max(nodes))

    def prepare(self, B: int) -> DSparkTree:
        M = self.M
        self.n = torch.zeros(B, dtype=torch.int64)
        self.tok, self.parent = torch.zeros(B, M, dtype=torch.int64), torch.zeros(B, M, dtype=torch.int64)
        self.conf, self.q = torch.zeros(B, M), torch.zeros(B, M)
        self.first = torch.zeros(B, M, dtype=torch.uint8)
        return DSparkTree(self.nodes.data_ptr(), self.width, self.bins, M, self.ratio.data_ptr(),
                          max(self.floor, -3.0e38), int(self.confidence), self.n.data_ptr(), self.tok.data_ptr(),
                          self.parent.data_ptr(), self.conf.data_ptr(), self.q.data_ptr(), self.first.data_ptr())

    def results(self) -> list[tuple[list[int], list[int], list[float], list[float], list[bool]] | None]:
        out = []
        for b, n in enumerate(self.n.tolist()):
            if self.nodes[b] <= 0:
                out.append(None)
                continue
            out.append((self.tok[b, :n].tolist(), self.parent[b, :n].tolist(), self.conf[b, :n].tolist(),
                        self.q[b, :n].tolist(), [bool(f) for f in self.first[b, :n].tolist()]))
        return out


class DSparkKernel:
    """The pointers of a prepared DSpark drafter and its target that the kernels read (prepared
    weights never move), found once (`of`)."""

    def __init__(self, drafter, layer_ptrs, kinds, ds: DSparkIO, keep: list, sequential: bool):
        self.drafter, self.cfg = drafter, drafter.cfg
        self.target = drafter._target[0]
        self.layer_ptrs, self.kinds, self.ds = layer_ptrs, kinds, ds
        self._keep = keep  # the arrays and tensors `ds` points into
        self.sequential = sequential  # the vanilla Markov head (or none): greedy rows drafted whole here
        self.dtype = next(drafter.parameters()).dtype
        self.head = drafter.kept_head  # a `PrunedHead` (--draft-vocab) or None (the target's)

    @staticmethod
    def of(drafter) -> "DSparkKernel | None":
        lib, target = cpu_kernels.kernels(), (drafter._target or [None])[0]
        if lib is None or target is None or not drafter.packed:
            return None
        cfg, dtype = drafter.cfg, next(drafter.parameters()).dtype
        if (dtype not in (torch.float32, torch.bfloat16) or target.model.norm.weight.dtype != dtype
                or next(drafter.parameters()).device.type != "cpu" or head_io(target, drafter.kept_head, dtype) is None):
            return None
        norms = [drafter.hidden_norm, drafter.norm] + [n for layer in drafter.layers
                                                       for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(n.weight.dtype != dtype or n.eps != cfg.rms_norm_eps for n in norms):
            return None
        ptrs, kinds, kv = [], [], []
        for i, layer in enumerate(drafter.layers):
            prods = [kernel_product(layer.packed.get(n), dtype) for n in LAYER_PRODUCTS + ("kv",)]
            if any(p is None or p[0] == 0 for p in prods):  # (the small-weight loop: 16 rows at most)
                return None
            ptrs.append(layer.input_layernorm.weight.data_ptr())
            for n, (_, w, b, s) in enumerate(prods[:4]):
                ptrs += [w, b, s]
                if n == 1:
                    ptrs.append(layer.post_attention_layernorm.weight.data_ptr())
            kinds += [p[0] for p in prods[:4]]
            kv.append(prods[4])
        none = (0, 0, 0, 0)  # a piece the drafter has not: NULL pointers
        markov = drafter.markov
        fc = kernel_product(drafter.packed.get("fc"), dtype)
        fc_in = kernel_product(drafter.packed.get("fc_in"), dtype) if drafter.fc_in is not None else none
        w2 = (kernel_product(markov.packed.get("w2_kept" if drafter.kept_head is not None else "w2"), dtype)
              if markov is not None else none)  # the bias over the head's tokens
        if any(p is None or (p[1] and p[0] == 0) for p in (fc, fc_in, w2)):
            return None
        rank, w1 = (cfg.markov_rank, markov.w1.weight.detach()) if markov is not None else (0, None)
        conf = drafter.confidence
        conf_w = conf.weight.detach().reshape(-1).to(dtype).contiguous()  # [H + r]
        temps = (torch.tensor(cfg.confidence_temperatures, dtype=torch.float32)
                 if cfg.confidence_temperatures else None)
        if temps is not None and temps.numel() != cfg.block_size:
            return None
        kv_ptrs = (ctypes.c_void_p * (3 * len(kv)))(*(x for _, w, b, s in kv for x in (w, b, s)))
        kv_kinds = (ctypes.c_int * len(kv))(*(p[0] for p in kv))
        ds = DSparkIO(fc[1], fc[2], fc[3], fc[0], drafter.hidden_norm.weight.data_ptr(), fc_in[1], fc_in[2],
                      fc_in[3], fc_in[0], drafter.mask_embedding.data_ptr(), ctypes.addressof(kv_ptrs),
                      ctypes.addressof(kv_kinds), 0 if w1 is None else w1.data_ptr(), rank, w2[1], w2[2], w2[3],
                      w2[0], conf_w.data_ptr(), float(conf.bias.detach().float()) if conf.bias is not None else 0.0,
                      0 if temps is None else temps.data_ptr(), len(cfg.target_feature_layers))
        sequential = markov is None or markov.kind == "vanilla"
        return DSparkKernel(drafter, (ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int * len(kinds))(*kinds), ds,
                            [kv_ptrs, kv_kinds, w1, conf_w, temps], sequential)

    def _args(self, B: int, T: int, cache: torch.Tensor | None, slots: torch.Tensor | None) -> DecoderArgs:
        """The drafter's layers as dw_decoder takes them, over `cache` [layers, 2, slots, Hkv, D] (None:
        no cache read) through `slots` [B, Lmax] (contiguous; kept alive by the caller for the call)."""
        cfg = self.cfg
        cos, sin = self.drafter._rope.tables("cpu")
        return DecoderArgs(
            B=B, T=T, layers=cfg.num_hidden_layers, hid=cfg.hidden_size, H=cfg.num_attention_heads,
            Hkv=cfg.num_key_value_heads, D=cfg.head_dim, I=cfg.intermediate_size,
            w=ctypes.addressof(self.layer_ptrs), kinds=ctypes.addressof(self.kinds),
            final_norm=self.drafter.norm.weight.data_ptr(), eps=cfg.rms_norm_eps, cos=cos.data_ptr(),
            sin=sin.data_ptr(), cache=0 if cache is None else cache.data_ptr(),
            layer_stride=0 if cache is None else cache.stride(0), kv_stride=0 if cache is None else cache.stride(1),
            slots=0 if slots is None else slots.data_ptr(), Lmax=0 if slots is None else slots.shape[1],
            scale=cfg.head_dim ** -0.5, bf=int(self.dtype == torch.bfloat16), threads=torch.get_num_threads(),
            block=int(not cfg.causal_block))

    def block(self, anchors: list[int], last: torch.Tensor | None, starts: list[int], ks: list[int],
              cache: torch.Tensor, slots: torch.Tensor, outputs: bool, temps: list[float] | None = None,
              uniforms: torch.Tensor | None = None, tree: "TreeRequest | None" = None):
        """One block per row: anchors [B] the tokens at positions starts[b], last [B, H] the fused
        feature of position starts[b] - 1 (with `anchor_feature`), ks[b] the positions of row b
        drafted here (the vanilla Markov head; 0: none), temps[b] how (0 or no temps: the argmax;
        t > 0: a draw from softmax(logits / t) with uniforms [B, gamma] float64), cache [layers, 2,
        slots, Hkv, D] the drafter's, slots [B, Lmax] each row's slot per position up to starts[b] +
        gamma - 1 (the block's own K/V written from starts[b] on, into slots the caller keeps for
        them). Returns (tokens per row, confidences per row, q [B, gamma, V] float32 of the sampled
        rows' drafted positions or None, and the logits [B, gamma, V] float32 and hidden states [B,
        gamma, H] where `outputs`, else None, None): a row drafted here has its first ks[b] tokens,
        c_k, and logits U_k + B_k; the others' logits are U_k, for `draw`. With `tree`, the rows whose
        tree.nodes[b] > 0 (ks[b] = 0) grow greedy trees (kernels/dspark_tree.c), returned as a sixth
        entry: per row (tokens, parents, confidences, q(token), firsts) or None."""
        g, B, top = self.cfg.block_size, len(starts), self.cfg.max_position_embeddings
        io = head_io(self.target, self.head, self.dtype)  # V: the head's rows (a pruned head's N)
        slots = slots.contiguous()
        # positions past the RoPE table read its last row, as `rope`
        meta = torch.tensor([*anchors, *ks, *(s + g for s in starts), *([g] * B),
                             *(min(s + j, top) for s in starts for j in range(g))], dtype=torch.int64)
        args = self._args(B, g, cache, slots)
        base = meta.data_ptr()
        args.lens, args.news, args.pos = base + 16 * B, base + 24 * B, base + 32 * B
        toks = torch.zeros(B, g, dtype=torch.int64)
        conf = torch.zeros(B, g, dtype=torch.float32)
        sampled = temps is not None and any(t > 0 for t in temps)
        temp = torch.tensor(temps, dtype=torch.float32) if sampled else None
        u = uniforms.to(torch.float64).contiguous() if sampled else None
        probs = torch.empty(B, g, io.V, dtype=torch.float32) if sampled else None
        logits = torch.empty(B, g, io.V, dtype=torch.float32) if outputs else None
        hidden = torch.empty(B, g, self.cfg.hidden_size, dtype=self.dtype) if outputs else None
        lastp = 0
        if self.drafter.fc_in is not None:
            last = last.to(self.dtype).contiguous()
            lastp = last.data_ptr()
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        grown = tree.prepare(B) if tree is not None else None
        rc = cpu_kernels.kernels().dspark_block(
            ctypes.byref(io), ctypes.byref(args), ctypes.byref(self.ds), base, lastp, base + 8 * B, ptr(temp), ptr(u),
            B, toks.data_ptr(), conf.data_ptr(), ptr(probs), ptr(logits), ptr(hidden),
            None if grown is None else ctypes.byref(grown))
        if rc != 0:
            raise MemoryError("dspark block: no scratch memory")
        tok_rows, conf_rows = toks.tolist(), conf.tolist()
        V = self.cfg.vocab_size
        return ([tok_rows[b][:k] for b, k in enumerate(ks)], [conf_rows[b][:k] for b, k in enumerate(ks)],
                None if probs is None else full_rows(probs, self.head, V, 0.0),
                None if logits is None else full_rows(logits, self.head, V), hidden,
                None if tree is None else tree.results())

    def commit(self, features: torch.Tensor, positions: list[int], slots: torch.Tensor, cache: torch.Tensor,
               fused_rows: torch.Tensor | None) -> None:
        """Feature rows [n, F*H] (the target's) of `positions` [n] into the drafter's cache at slots [n]
        (int64): `fuse` of them to fused_rows [slots, H] (if not None), each layer's `context_kv` to
        cache [layers, 2, slots, Hkv, D], equal to those up to float rounding. A row's values are a
        function of that row alone: a step's rows of every sequence take one call."""
        n = features.shape[0]
        feat = features.to(self.dtype).contiguous()
        slots = slots.to(torch.int64).contiguous()
        top = self.cfg.max_position_embeddings  # (positions past the RoPE table read its last row, as `rope`)
        pos = torch.tensor([min(p, top) for p in positions], dtype=torch.int64)
        args = self._args(1, n, cache, None)
        rc = cpu_kernels.kernels().dspark_commit(ctypes.byref(args), ctypes.byref(self.ds), feat.data_ptr(),
                                                 pos.data_ptr(), slots.data_ptr(), n,
                                                 0 if fused_rows is None else fused_rows.data_ptr())
        if rc != 0:
            raise MemoryError("dspark cache rows: no scratch memory")
