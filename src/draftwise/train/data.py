"""Token stream and batches.

The stream is `<|endoftext|> file_0 <|endoftext|> file_1 ...` over a split's files in path
order, stored as int16 when the vocabulary fits (the embedded tokenizer's 8192), else int32 (e.g.
SmolLM2's 49152). Each epoch cuts the stream into
non-overlapping windows of `seq_len + 1` tokens (offset by a per-epoch shift) and visits them
in an order shuffled by `seed + epoch`. A batch is a pure function of (seed, step), so the
data position saved in a checkpoint is a single integer and resume loses nothing.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..corpus import Split
from .tokenizer import EOS


def stream_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest signed integer type that holds every token id."""
    return torch.int16 if vocab_size <= torch.iinfo(torch.int16).max + 1 else torch.int32


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS} token to separate files in the token stream")
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=stream_dtype(tok.get_vocab_size()))


def load_streams(tok, split: Split, cache_dir: str | Path | None = None) -> dict[str, torch.Tensor]:
    """`{"train": ..., "val": ...}` token streams, cached under `cache_dir` (keyed by tokenizer and files)."""
    import hashlib

    key = hashlib.sha256((tok.to_str() + "\0" + "\0".join(map(str, split.train + split.held_out))).encode()).hexdigest()
    f = Path(cache_dir) / "streams.pt" if cache_dir is not None else None
    if f is not None and f.is_file():
        cached = torch.load(f)
        if cached.get("key") == key:
            return {"train": cached["train"], "val": cached["val"]}
    streams = {
        "train": encode_stream(tok, [t for _, t in split.texts("train")]),
        "val": encode_stream(tok, [t for _, t in split.texts("held_out")]),
    }
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        torch.save(dict(streams, key=key), f)
    return streams


class Batches:
    """Deterministic batches `[B, T+1]` (int64) from a stream; `get(step)` is pure."""

    def __init__(self, stream: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0):
        self.stream, self.B, self.T, self.seed = stream, batch_size, seq_len, seed
        self.windows = (len(stream) - 1) // (seq_len + 1)
        if self.windows < batch_size:
            raise ValueError(f"stream of {len(stream)} tokens too short for batch {batch_size}x{seq_len}")
        self.per_epoch = self.windows // batch_size
        self._epoch, self._perm, self._shift = None, None, 0

    def _order(self, epoch: int):
        if self._epoch != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.windows, generator=g)
            slack = len(self.stream) - self.windows * (self.T + 1)
            self._shift = int(torch.randint(0, slack, (1,), generator=g)) if slack > 0 else 0
            self._epoch = epoch
        return self._perm, self._shift

    def get(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.per_epoch)
        perm, shift = self._order(epoch)
        idx = perm[i * self.B:(i + 1) * self.B]
        starts = shift + idx * (self.T + 1)
        offs = torch.arange(self.T + 1)
        return self.stream[starts[:, None] + offs[None, :]].long()


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping `[N, T+1]` windows of a validation stream, in order."""
    n = (len(stream) - 1) // (seq_len + 1)
    if max_windows is not None:
        n = min(n, max_windows)
    return stream[: n * (seq_len + 1)].view(n, seq_len + 1).long()
