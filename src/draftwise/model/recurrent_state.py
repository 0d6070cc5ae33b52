"""Per-sequence recurrent state of a hybrid model's linear-attention layers, beside the paged K/V.

Layout (one pool per model runner, slot-major so that one sequence's state is one block):

    matrix [num_slots, L_rec, H_v, dk, dv]   float32   the delta-rule state S of each layer
    conv   [num_slots, L_rec, K-1, C]        model dtype  the short convolution's window

A slot holds the **committed checkpoint**: the state after exactly `num_computed` tokens of its
sequence (the positions whose K/V are valid in the attention layers). A sequence gets a slot on
its first forward (start 0: zeroed), keeps it while it runs, and gives it back when its K/V
blocks are freed (finish, abort, preemption: the runner hooks `KVManager.free`); a preempted
sequence is rebuilt by recompute from token 0 like its K/V. The pool grows by doubling.

A verification block `[last committed, d_1..d_k]` advances the state through proposals that may
be rejected, so its rows are *provisional*: the checkpoint is not written during the forward, and
postprocess calls `commit(seq_id, num_computed)` once it knows how many of the block's positions
were committed (n = num_computed - start, 1..k+1). Two strategies (`--recurrent-rollback`):

- `snapshot`: the forward keeps the state (matrix and window) after each of the block's positions
  (scratch: (k+1) states per sequence); commit copies the one after position n into the slot.
- `replay`: the forward keeps only the per-position inputs of the recurrence (k, v, g, beta after
  the convolution, and the convolution's inputs; scratch: k+1 small rows per layer); commit
  re-applies the first n updates to the checkpoint (`delta_update`, all layers at once).

Rows that are not provisional (prefill chunks, plain decode steps) write their final state into
the checkpoint during the forward: every fed token of theirs is committed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .gated_delta import delta_update

ROLLBACK_STRATEGIES = ("snapshot", "replay")


@dataclass
class Pending:
    """A provisional block of one sequence, waiting for commit. Tensors lead with the layer:
    snapshot: `states` [L, T, H, dk, dv], `windows` [L, T, K-1, C];
    replay: `conv_in` [L, T, C], `k` [L, T, H, dk], `v` [L, T, H, dv], `g` / `beta` [L, T, H]."""

    start: int  # num_computed when the block was fed
    length: int  # positions fed
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t[:, : self.length].numel() * t.element_size() for t in self.tensors.values())


class RecurrentStatePool:
    def __init__(self, num_layers: int, num_v_heads: int, k_dim: int, v_dim: int, conv_kernel: int, conv_dim: int,
                 dtype: torch.dtype, device, rollback: str = "snapshot", initial_slots: int = 8):
        if rollback not in ROLLBACK_STRATEGIES:
            raise ValueError(f"recurrent rollback must be one of {', '.join(ROLLBACK_STRATEGIES)}, got {rollback!r}")
        self.rollback = rollback
        self.num_layers, self.conv_kernel = num_layers, conv_kernel
        self._shapes = ((num_layers, num_v_heads, k_dim, v_dim), (num_layers, conv_kernel - 1, conv_dim))
        self.dtype, self.device = dtype, device
        self.matrix = torch.zeros(initial_slots, *self._shapes[0], dtype=torch.float32, device=device)
        self.conv = torch.zeros(initial_slots, *self._shapes[1], dtype=dtype, device=device)
        self.slots: dict[int, int] = {}  # seq_id -> slot
        self.positions: dict[int, int] = {}  # seq_id -> tokens its checkpoint covers
        self.free_slots = list(range(initial_slots - 1, -1, -1))  # popped from the end: lowest first
        self.pending: dict[int, Pending] = {}
        self.peak_scratch_bytes = 0  # the largest provisional scratch of one forward

    @property
    def num_slots(self) -> int:
        return self.matrix.shape[0]

    def state_bytes(self) -> int:
        """Bytes of one sequence's checkpoint (all recurrent layers)."""
        return self.matrix[0].numel() * 4 + self.conv[0].numel() * self.conv.element_size()

    def _grow(self) -> None:
        n = self.num_slots
        self.matrix = torch.cat((self.matrix, torch.zeros_like(self.matrix)))
        self.conv = torch.cat((self.conv, torch.zeros_like(self.conv)))
        self.free_slots = list(range(2 * n - 1, n - 1, -1)) + self.free_slots

    def slot_for(self, seq_id: int, start: int, provisional: bool) -> tuple[int, bool]:
        """The sequence's slot, and whether this forward continues its pending block. A forward
        from position 0 (new, or recomputed) starts from zeros; otherwise it must start at the
        checkpoint or, provisional again, where its pending block ends (a drafter's next step)."""
        slot = self.slots.get(seq_id)
        p = self.pending.get(seq_id)
        if start == 0:
            if slot is None:
                if not self.free_slots:
                    self._grow()
                slot = self.slots[seq_id] = self.free_slots.pop()
            self.matrix[slot].zero_()
            self.conv[slot].zero_()
            self.positions[seq_id] = 0
        elif slot is None:
            raise RuntimeError(f"sequence {seq_id} continues at position {start} without a recurrent state")
        elif p is not None and provisional and start == p.start + p.length:
            return slot, True
        if self.positions[seq_id] != start:
            raise RuntimeError(f"sequence {seq_id}: a forward from position {start}, its recurrent state covers "
                               f"{self.positions[seq_id]} tokens")
        self.pending.pop(seq_id, None)
        return slot, False

    def place(self, seq_id: int, position: int) -> None:
        """A slot holding a zero state said to cover `position` tokens: for timing forwards at a
        context that was never prefilled (the hardware profile; timings do not depend on values)."""
        self.slot_for(seq_id, 0, False)
        self.positions[seq_id] = position

    def free(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.pending.pop(seq_id, None)
        self.positions.pop(seq_id, None)

    def batch(self, seq_ids: list[int], starts: list[int], lens: list[int],
              provisional: list[bool] | None) -> "StateBatch":
        prov = list(provisional) if provisional is not None else [False] * len(seq_ids)
        slots, cont = zip(*(self.slot_for(s, st, pv) for s, st, pv in zip(seq_ids, starts, prov)))
        if any(cont) and self.rollback != "snapshot":
            raise NotImplementedError("a provisional block continued by another forward (a hybrid drafter's "
                                      "steps) needs the snapshot strategy")
        return StateBatch(self, list(seq_ids), starts, lens, prov, torch.tensor(slots, dtype=torch.long,
                                                                               device=self.device), list(cont))

    def commit(self, seq_id: int, num_computed: int) -> None:
        """Advance the checkpoint of a provisional block to `num_computed` (postprocess)."""
        p = self.pending.pop(seq_id, None)
        if p is None:
            return
        n = num_computed - p.start
        if not 0 <= n <= p.length:
            raise RuntimeError(f"sequence {seq_id}: {n} committed positions of a {p.length}-position block")
        if n == 0:
            return
        slot = self.slots[seq_id]
        self.positions[seq_id] = num_computed
        t = p.tensors
        if self.rollback == "snapshot":
            self.matrix[slot].copy_(t["states"][:, n - 1])
            self.conv[slot].copy_(t["windows"][:, n - 1])
            return
        S = self.matrix[slot]  # [L, H, dk, dv]
        for j in range(n):  # all layers at once: each layer's inputs are its own
            S = delta_update(S, t["k"][:, j], t["v"][:, j], t["g"][:, j], t["beta"][:, j])
        self.matrix[slot].copy_(S)
        K1 = self.conv_kernel - 1
        self.conv[slot].copy_(torch.cat((self.conv[slot], t["conv_in"][:, :n].to(self.dtype)), dim=1)[:, -K1:])


@dataclass
class StateBatch:
    """The recurrent state of one forward call's B sequences: layers read their checkpoints and
    hand back what the call produced (`record`); `finish` files provisional rows as `Pending`."""

    pool: RecurrentStatePool
    seq_ids: list[int]
    starts: list[int]
    lens: list[int]  # new tokens of each row (the rest of the row is padding)
    provisional: list[bool]
    slots: torch.Tensor  # [B] long
    continues: list[bool]  # provisional rows that start where their pending block ends (not at the checkpoint)
    _scratch: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [L_rec, B, T, ...]

    def __post_init__(self):
        self._slot0 = int(self.slots[0]) if len(self.seq_ids) == 1 else None

    @property
    def keeps_states(self) -> bool:
        """Does a layer need the state after every position (snapshot with provisional rows)?"""
        return self.pool.rollback == "snapshot" and any(self.provisional)

    def valid(self, T: int, device) -> torch.Tensor:  # [B, T] bool: real tokens, not padding
        return torch.arange(T, device=device)[None] < torch.tensor(self.lens, device=device)[:, None]

    def read(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent layer r's starting states: window [B, K-1, C], matrix [B, H, dk, dv] (the
        checkpoint, or for a continuing row the state after its pending block: snapshot only)."""
        if len(self.seq_ids) == 1 and not self.continues[0]:  # one sequence: views, no gather
            slot = self._slot0
            return self.pool.conv[slot : slot + 1, r], self.pool.matrix[slot : slot + 1, r]
        conv, matrix = self.pool.conv[self.slots, r], self.pool.matrix[self.slots, r]
        for b, c in enumerate(self.continues):
            if c:
                t = self.pool.pending[self.seq_ids[b]].tensors
                conv[b], matrix[b] = t["windows"][r, -1], t["states"][r, -1]
        return conv, matrix

    def record(self, r: int, cat: torch.Tensor, k, v, g, beta, final: torch.Tensor) -> None:
        """Layer r's results: cat [B, K-1+T, C] (window + new inputs), k / v / g / beta per position,
        final state [B, H, dk, dv] (padding left it unchanged). Under snapshot the layer has
        already written the state after each position into `scratch("states", r, ...)`."""
        pool, K1 = self.pool, self.pool.conv_kernel - 1
        rows = [b for b, p in enumerate(self.provisional) if not p]
        if rows and r == 0:
            for b in rows:
                pool.positions[self.seq_ids[b]] = self.starts[b] + self.lens[b]
        if rows == [0] and len(self.seq_ids) == 1:  # one sequence (the usual decode step): slices
            slot, n = self._slot0, self.lens[0]
            pool.matrix[slot, r] = final[0]
            pool.conv[slot, r] = cat[0, n : n + K1]
        elif rows:  # committed rows: the checkpoint moves now
            idx = torch.tensor(rows, dtype=torch.long, device=cat.device)
            ends = torch.tensor([self.lens[b] for b in rows], device=cat.device)
            win = cat[idx[:, None], ends[:, None] + torch.arange(K1, device=cat.device)]  # [R, K-1, C]
            pool.matrix[self.slots[idx], r] = final[idx]
            pool.conv[self.slots[idx], r] = win.to(pool.dtype)
        if not any(self.provisional):
            return
        if pool.rollback == "snapshot":  # the states are already in scratch (the layer wrote them)
            T = cat.shape[1] - K1
            windows = cat.unfold(1, K1, 1)[:, 1 : T + 1].transpose(-1, -2)  # [B, T, K-1, C]: after each token
            self.scratch("windows", r, windows.shape, pool.dtype).copy_(windows)
        else:
            for name, x in (("conv_in", cat[:, K1:]), ("k", k), ("v", v), ("g", g), ("beta", beta)):
                self.scratch(name, r, x.shape, x.dtype).copy_(x)

    def scratch(self, name: str, r: int, shape, dtype) -> torch.Tensor:
        """Recurrent layer r's part of a per-forward scratch buffer `[L_rec, *shape]` (allocated once)."""
        buf = self._scratch.get(name)
        if buf is None:
            buf = self._scratch[name] = torch.empty(self.pool.num_layers, *shape, dtype=dtype, device=self.pool.device)
        return buf[r]

    def finish(self) -> None:
        """After the forward: each provisional row's part of the scratch becomes its Pending."""
        if not any(self.provisional):
            return
        stacked = self._scratch  # [L, B, T, ...]
        total = 0
        for b, (sid, prov) in enumerate(zip(self.seq_ids, self.provisional)):
            if prov:
                new = {n: x[:, b, : self.lens[b]] for n, x in stacked.items()}
                if self.continues[b]:  # a drafter's next step: the block grows
                    old = self.pool.pending[sid]
                    new = {n: torch.cat((old.tensors[n], x), dim=1) for n, x in new.items()}
                    p = Pending(old.start, old.length + self.lens[b], new)
                else:
                    p = Pending(self.starts[b], self.lens[b], new)
                self.pool.pending[sid] = p
                total += p.nbytes()
        self.pool.peak_scratch_bytes = max(self.pool.peak_scratch_bytes, total)
