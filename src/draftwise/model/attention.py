"""Paged attention over a flat slot cache, in plain PyTorch.

The K/V cache of one model is one tensor `[layers, 2, num_slots, kv_heads, head_dim]`; a slot is
one token position of one sequence (slot = block_id * block_size + offset). A forward call over a
padded batch of query tokens `[B, T]` is described by `AttentionMetadata`:

- `write_index` / `write_slots`: which of the B*T new tokens write K/V, and where (padding and
  tokens that need no cache write are absent: "a slot index of -1 means write nothing");
- `gather_slots` `[B, L]`: the cache slot of each key position 0..L-1 of each sequence;
- `mask` `[B, 1, T, L]`: True where query t of sequence b may attend key position l (causal on
  absolute positions, limited to the sequence's valid length, optional sliding window).

Stale K/V beyond a sequence's committed length (left by rejected proposals) is never attended:
the causal mask on absolute positions excludes it, and the next step overwrites it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    write_index: torch.Tensor  # [N] long, flat index into B*T query tokens
    write_slots: torch.Tensor  # [N] long, cache slot for each of those tokens
    gather_slots: torch.Tensor  # [B, L] long
    mask: torch.Tensor | None  # [B, 1, T, L] bool, or float 0/-inf; None: every query attends every key
    # B = 1, positions L-T..L-1, keys 0..L-1 on slots gather_start.. (consecutive): K/V read as
    # one slice, and the fused CPU kernels may run the layer (see LlamaModel._fusable)
    gather_start: int | None = None
    # each sequence's number of keys and of new tokens (its last keys, in its first rows; the rest
    # of its rows are padding); set by the runner, read by the fused CPU path (LlamaModel._fusable)
    seq_lens: list[int] | None = None
    seq_new: list[int] | None = None
    # packed rows (the fused CPU path only, see LlamaModel.packs): the B sequences' new tokens are
    # one flat run of rows [1, sum(seq_new)], sequence b's from row row_offsets[b] (B + 1 offsets)
    row_offsets: list[int] | None = None
    # rows that form trees, for the fused CPU path (`tree_attention.kernel_trees`; with seq_lens)
    kernel_trees: list[int] | None = None

    @staticmethod
    def build(
        positions: torch.Tensor,  # [B, T] absolute positions (padding: any value, see valid)
        valid: torch.Tensor,  # [B, T] bool, real query tokens
        slot_mapping: torch.Tensor,  # [B, T] long, -1 = write nothing
        gather_slots: torch.Tensor,  # [B, L] long
        sliding_window: int | None = None,
    ) -> "AttentionMetadata":
        flat_slots = slot_mapping.reshape(-1)
        write_index = torch.nonzero(flat_slots >= 0).squeeze(1)
        write_slots = flat_slots[write_index]
        L = gather_slots.shape[1]
        key_pos = torch.arange(L, device=positions.device)  # [L]
        pos = torch.where(valid, positions, torch.zeros_like(positions))  # padding attends key 0
        mask = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, L]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > (pos[:, :, None] - sliding_window)
        return AttentionMetadata(write_index, write_slots, gather_slots, mask.unsqueeze(1))

    @staticmethod
    def consecutive(start_slot: int, start: int, T: int, positions: torch.Tensor | None,
                    sliding_window: int | None = None) -> "AttentionMetadata":
        """One sequence whose positions 0..start+T-1 lie on slots start_slot.. (consecutive): its T
        new tokens at positions start..start+T-1 (`positions` [1, T], or None: made from start and
        T if read). No slot lists to look up, and the tensors are built only if read (the fused
        CPU path needs the first slot and the number of keys alone)."""
        return ConsecutiveMetadata(start_slot, start, T, positions, sliding_window)

    @property
    def num_keys(self) -> int:  # L
        return self.gather_slots.shape[1]

    @staticmethod
    def build_dense(
        positions: torch.Tensor,  # [B, T], every query token real
        slot_mapping: torch.Tensor,  # [B, T], every token writes
        gather_slots: torch.Tensor,  # [B, L]
        sliding_window: int | None = None,
    ) -> "AttentionMetadata":
        """`build` for a batch without padding (decode steps, equal-length blocks)."""
        B, T = positions.shape
        L = gather_slots.shape[1]
        key_pos = torch.arange(L, device=positions.device)
        write_index = torch.arange(B * T, device=positions.device)
        if B == 1 and T == 1 and (sliding_window is None or L <= sliding_window):
            # one decode token whose keys are exactly positions 0..L-1: nothing to mask (SDPA
            # without a mask is ~3x faster for one query over ~150 keys)
            return AttentionMetadata(write_index, slot_mapping.reshape(-1), gather_slots, None)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, L]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > (positions[:, :, None] - sliding_window)
        return AttentionMetadata(write_index, slot_mapping.reshape(-1), gather_slots, mask.unsqueeze(1))


def paged_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k: torch.Tensor,  # [B, T, Hkv, D] new keys
    v: torch.Tensor,  # [B, T, Hkv, D]
    layer_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [B, H, T, D]; float32 on CPU for half-precision models (see below)
    B, T, Hkv, D = k.shape
    n = meta.write_index.numel()
    if n:
        k_flat = k.reshape(B * T, Hkv, D).to(layer_cache.dtype)
        v_flat = v.reshape(B * T, Hkv, D).to(layer_cache.dtype)
        if n != B * T:  # padding or tokens that write nothing
            k_flat, v_flat = k_flat.index_select(0, meta.write_index), v_flat.index_select(0, meta.write_index)
        layer_cache[0].index_copy_(0, meta.write_slots, k_flat)
        layer_cache[1].index_copy_(0, meta.write_slots, v_flat)
    B, L = meta.gather_slots.shape
    if meta.gather_start is not None:  # one sequence on consecutive slots: a view, no copy
        keys = layer_cache[0].narrow(0, meta.gather_start, L).unsqueeze(0).transpose(1, 2)  # [1, Hkv, L, D]
        values = layer_cache[1].narrow(0, meta.gather_start, L).unsqueeze(0).transpose(1, 2)
    else:
        flat = meta.gather_slots.reshape(-1)  # index_select: ~3x faster than advanced indexing
        keys = layer_cache[0].index_select(0, flat).view(B, L, Hkv, D).transpose(1, 2)  # [B, Hkv, L, D]
        values = layer_cache[1].index_select(0, flat).view(B, L, Hkv, D).transpose(1, 2)
    if q.device.type == "cpu" and q.dtype != torch.float32:
        # CPU SDPA in bfloat16 took ~5x longer than converting to float32 and back (decode step,
        # 6 heads x 150 keys): attend in float32, which is also at least as accurate.
        q, keys, values = q.float(), keys.float(), values.float()
    mask = meta.mask
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:  # a float mask, half-precision q
        mask = mask.to(q.dtype)
    return sdpa(q, keys.to(q.dtype), values.to(q.dtype), mask, scale)


def sdpa(q, k, v, mask, scale, is_causal: bool = False):
    """Scaled dot-product attention with grouped-query heads (no K/V repeat: enable_gqa)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


class ConsecutiveMetadata(AttentionMetadata):
    """`AttentionMetadata.consecutive`: the slot tensors and the mask are built on first read."""

    def __init__(self, start_slot: int, start: int, T: int, positions: torch.Tensor, sliding_window: int | None):
        self.gather_start = start_slot
        self.seq_lens = self.seq_new = self.row_offsets = None
        self._args = (start_slot, start, T, positions, sliding_window)
        self._built: AttentionMetadata | None = None

    @property
    def num_keys(self) -> int:
        return self._args[1] + self._args[2]

    def _tensors(self) -> AttentionMetadata:
        if self._built is None:
            start_slot, start, T, positions, sliding_window = self._args
            if positions is None:
                positions = torch.arange(start, start + T)[None]
            gather = torch.arange(start_slot, start_slot + start + T, device=positions.device)[None]
            meta = AttentionMetadata.build_dense(positions, gather[:, start:], gather, sliding_window)
            if meta.mask is not None:  # additive 0 / -inf: SDPA would convert a boolean mask in every layer
                meta.mask = torch.zeros(meta.mask.shape, device=gather.device).masked_fill_(~meta.mask, float("-inf"))
            meta.gather_start = start_slot
            self._built = meta
        return self._built

    write_index = property(lambda self: self._tensors().write_index)
    write_slots = property(lambda self: self._tensors().write_slots)
    gather_slots = property(lambda self: self._tensors().gather_slots)
    mask = property(lambda self: self._tensors().mask)


class PagedMetadata(AttentionMetadata):
    """A batch on paged slots whose write indices, write slots and mask are built on first read
    (`build()` is called then): the fused CPU path reads the gather slots and the runner's key and
    new-token counts alone, and building the rest cost a few percent of a small model's batch-1
    decode step."""

    def __init__(self, gather_slots: torch.Tensor, seq_lens: list[int], seq_new: list[int], build):
        self._gather = gather_slots
        self.gather_start = self.row_offsets = None
        self.seq_lens, self.seq_new = seq_lens, seq_new
        self._build = build
        self._built: AttentionMetadata | None = None

    @property
    def num_keys(self) -> int:
        return self._gather.shape[1]

    def _tensors(self) -> AttentionMetadata:
        if self._built is None:
            self._built = self._build()
        return self._built

    gather_slots = property(lambda self: self._gather)
    write_index = property(lambda self: self._tensors().write_index)
    write_slots = property(lambda self: self._tensors().write_slots)
    mask = property(lambda self: self._tensors().mask)
