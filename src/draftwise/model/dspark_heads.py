"""DSpark's sequential stage: the head that makes position k's distribution depend on the token
drafted before it (model/dspark.py). Four kinds (`DSparkConfig.markov_head_type`), all a rank-r
bias on the vocabulary, B = W2 z_k, added to the backbone's base logits U_k (mlp also moves h_k):

- **vanilla**: z_k = W1[x_{k-1}], a bigram bias (the paper's Markov head).
- **gated**: z_k = sigmoid(Wg [h_k ; W1[x_{k-1}]]) * W1[x_{k-1}]: the backbone's hidden state h_k
  decides how much of the bigram applies at this position.
- **rnn**: a recurrent state s over the block, s_0 = 0; from [s_{k-1} ; W1[x_{k-1}] ; h_k] one
  linear map gives a gate g, a candidate c and an output o; s_k = g s_{k-1} + (1 - g) tanh(c),
  z_k = tanh(o). Position k then reads every token drafted before it in its block, not only the
  last one, and reads it together with h_k.
- **mlp**: the vanilla bias, and before the LM head the hidden state itself moves: h'_k = h_k +
  MLP([h_k ; E[x_{k-1}]]) (E the target's embedding, a SwiGLU of the target's width, its output
  projection starting at zero), so the token drafted before reaches the logits through the
  target's full-rank head, not only a rank-r bias. The price: drawing calls the head once per
  position (the others once per block).

Each is a left-to-right conditional q_k(. | x_1..x_{k-1}), so a drafted block is a sequential
distribution and verification against it stays exact. W2 starts at zero: a fresh head leaves the
backbone's logits unchanged. Shapes: r the rank, H the width, V the vocabulary; `...` any leading
dimensions (rows, blocks).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .packed_weights import PackedLinear

HEAD_TYPES = ("vanilla", "gated", "rnn", "mlp")


class MarkovHead(nn.Module):
    """The vanilla head; `GatedMarkovHead` and `RNNHead` change how z_k is made (`_latent`),
    `MLPHead` also moves h_k (`adjust`)."""

    kind = "vanilla"
    adjusts_hidden = False  # `adjust` moves h_k before the LM head (mlp)

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.w1.weight, std=rank ** -0.5)
        nn.init.zeros_(self.w2.weight)
        self.packed: dict[str, PackedLinear] = {}  # `prepare`: for the CPU kernels (not in the state dict)
        self.rows: torch.Tensor | None = None  # `restrict`: training's bias over these tokens only

    def prepare(self) -> None:
        self.packed = {"w2": PackedLinear.of(self.w2, native=True)}

    def keep(self, kept: torch.Tensor) -> None:
        """The bias over the `kept` tokens only, packed for the kernels (`packed["w2_kept"]`: W2's rows of
        those tokens), for a drafter whose head is over those tokens (`DSparkDrafter.set_head`)."""
        self.packed["w2_kept"] = PackedLinear([self.w2.weight.detach()[kept].contiguous()], native=True)

    def restrict(self, rows: torch.Tensor | None) -> None:
        """Training over some tokens only (`train dspark --draft-vocab`): the bias [..., len(rows)] over
        the tokens `rows`, in their order, where the drafter's training head gives their logits; None:
        the whole vocabulary again."""
        self.rows = rows

    def prev(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., r]: W1[x], the confidence head's input
        return self.w1(ids)

    def project(self, z: torch.Tensor) -> torch.Tensor:  # [..., r] -> [..., V] (len(rows) with `restrict`)
        if self.rows is not None:
            return F.linear(z, self.w2.weight[self.rows])
        return self.packed.get("w2", self.w2)(z)

    def adjust(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """h_k [..., H], E[x_{k-1}] [..., H] -> the hidden state the LM head reads."""
        return hidden

    def init_state(self, ids: torch.Tensor):
        """The state before a block's first position (rows `ids` [...]): none for a memoryless head."""
        return None

    def _latent(self, state, prev: torch.Tensor, hidden: torch.Tensor):
        """(state, W1[x_{k-1}] [..., r], h_k [..., H]) -> (next state, z_k [..., r])."""
        return state, prev

    def step(self, state, prev_ids: torch.Tensor, hidden: torch.Tensor):
        """One position: (state, x_{k-1} [...], h_k [..., H]) -> (next state, B [..., V] float32)."""
        prev = self.w1(prev_ids)
        state, z = self._latent(state, prev, hidden.to(prev.dtype))
        return state, self.project(z).float()

    def block(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced over a block: prev_ids [..., gamma] (the anchor, then the true tokens),
        hidden [..., gamma, H] -> B [..., gamma, V] float32. A memoryless head in one product; the
        rnn head unrolled left to right."""
        state, out = self.init_state(prev_ids[..., 0]), []
        if state is None:
            prev = self.w1(prev_ids)
            return self.project(self._latent(None, prev, hidden.to(prev.dtype))[1]).float()
        for k in range(prev_ids.shape[-1]):
            state, bias = self.step(state, prev_ids[..., k], hidden[..., k, :])
            out.append(bias)
        return torch.stack(out, -2)


class GatedMarkovHead(MarkovHead):
    kind = "gated"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.gate = nn.Linear(hidden_size + rank, rank)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, 2.0)  # starts near the vanilla head (gate ~0.88)

    def _latent(self, state, prev, hidden):
        return state, torch.sigmoid(self.gate(torch.cat((hidden, prev), -1))) * prev


class RNNHead(MarkovHead):
    kind = "rnn"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.joint = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [s ; W1[x] ; h] -> [gate ; candidate ; output]

    def init_state(self, ids):
        return self.w1.weight.new_zeros(*ids.shape, self.rank)

    def _latent(self, state, prev, hidden):
        gate, cand, out = self.joint(torch.cat((state.to(prev.dtype), prev, hidden), -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return gate * state + (1 - gate) * torch.tanh(cand), torch.tanh(out)


class MLPHead(MarkovHead):
    kind = "mlp"
    adjusts_hidden = True

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.gate_up = nn.Linear(2 * hidden_size, 2 * hidden_size, bias=False)
        self.down = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def adjust(self, hidden, prev_embedding):
        gate, up = self.gate_up(torch.cat((hidden, prev_embedding.to(hidden.dtype)), -1)).chunk(2, -1)
        return hidden + self.down(F.silu(gate) * up)


def make_head(kind: str, vocab_size: int, rank: int, hidden_size: int) -> MarkovHead:
    cls = {h.kind: h for h in (MarkovHead, GatedMarkovHead, RNNHead, MLPHead)}.get(kind)
    if cls is None:
        raise ValueError(f"markov head type {kind!r}: one of {', '.join(HEAD_TYPES)}")
    return cls(vocab_size, rank, hidden_size)
