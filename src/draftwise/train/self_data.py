"""Self-generated training data for a draft (`draftwise train draft --data self`): the target's
own replies to chat prompts made from the corpus's training files.

A draft is worth what it agrees with the target on the target's own outputs, so the draft of a
chat model learns from the chat model's replies (sequence-level distillation) rather than from
the raw corpus. The prompts are `chat_prompts`' chat-grounded and chat-open requests over the
training split (the lab's chat workloads come from the held-out files: nothing is shared),
rendered with the target's chat template and answered by draftwise's own engine, greedy for
even prompts and at temperature 0.8 for odd ones (both kinds of decoding the draft will serve).

Storage (resumable after an interruption): `DIR/shard_NNNNN.pt`, one per batch of prompts, each a
list of int32 token tensors (prompt + reply, one per request), written atomically, and
`DIR/manifest.json` (the target's fingerprint, the settings, prompts and tokens done; prompts
too long for the target's context with the reply are skipped and counted). A rerun
continues after the last shard; a different target or settings refuses to mix. Streams for
training: every sample followed by the end-of-sequence token, in prompt order; one sample in
VAL_EVERY goes to the validation stream.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .. import corpus
from ..chat_prompts import chat_candidates, chat_messages

VAL_EVERY = 20
SAMPLED_TEMPERATURE = 0.8
FORMAT = 1


def chat_prompts(files: list[tuple[str, str]]) -> list[tuple[tuple[str, str], ...]]:
    """Every chat request of the training files, grounded and open interleaved, in a fixed
    order: messages tuples."""
    cands = chat_candidates(files)
    grounded = [chat_messages(i, kind, fields) for i, (_, kind, fields) in enumerate(cands["chat-grounded"])]
    open_ = [chat_messages(i, kind, fields) for i, (_, kind, fields) in enumerate(cands["chat-open"])]
    out = []
    for i in range(max(len(grounded), len(open_))):
        out += ([grounded[i]] if i < len(grounded) else []) + ([open_[i]] if i < len(open_) else [])
    return out


def _manifest(path: Path) -> dict | None:
    f = path / "manifest.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def generate(target_dir: str | Path, out: str | Path, tokens: int, max_tokens: int = 192, batch: int = 32,
             device: str = "cpu", dtype: str = "float32", minutes: float | None = None, log=print) -> dict:
    """Generate until the shards hold `tokens` tokens (prompts + replies), or `minutes` pass, or
    the prompts run out; resumes after the shards already written. Returns the manifest."""
    from ..llm import LLM  # the offline API, as a user would (train may import llm: test_layering)
    from ..model.chat_template import ChatTemplate
    from ..policies.profile import model_fingerprint
    from ..sampling import SamplingParams

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"format": FORMAT, "target": model_fingerprint(target_dir), "max_tokens": max_tokens,
                "temperature": [0.0, SAMPLED_TEMPERATURE], "batch": batch}
    man = _manifest(out) or {**settings, "prompts_done": 0, "tokens": 0, "shards": 0, "seconds": 0.0}
    if any(man.get(k) != v for k, v in settings.items()):
        raise ValueError(f"{out} holds data generated with other settings or another target "
                         f"({ {k: man.get(k) for k in settings} }); give another --data-dir")
    prompts = chat_prompts(corpus.split().texts("train"))
    if man["tokens"] >= tokens or man["prompts_done"] >= len(prompts):
        return man
    llm = LLM(model=target_dir, device=device, dtype=dtype, max_num_seqs=batch)
    chat = ChatTemplate(llm.engine.target.tokenizer_config)
    tok = llm.engine.target.tokenizer
    t0 = time.time()
    while man["tokens"] < tokens and man["prompts_done"] < len(prompts):
        if minutes is not None and time.time() - t0 > minutes * 60:
            break
        start = man["prompts_done"]
        chunk = prompts[start:start + batch]
        ids, params = [], []
        for i, m in enumerate(chunk):  # a prompt that leaves no room for the reply is skipped
            p = tok.encode(chat.render([{"role": r, "content": c} for r, c in m]), add_special_tokens=False).ids
            if len(p) + max_tokens <= llm.engine.max_model_len:
                ids.append(p)
                params.append(SamplingParams(temperature=0.0 if (start + i) % 2 == 0 else SAMPLED_TEMPERATURE,
                                             max_tokens=max_tokens, seed=start + i))
        s = time.time()
        outs = llm.generate(ids, params) if ids else []
        samples = [torch.tensor(o.prompt_token_ids + o.token_ids, dtype=torch.int32) for o in outs]
        shard = out / f"shard_{man['shards']:05d}.pt"
        _write_atomic(shard, lambda p: torch.save(samples, p))
        generated = sum(len(o.token_ids) for o in outs)
        man.update(prompts_done=start + len(chunk), tokens=man["tokens"] + sum(len(x) for x in samples),
                   shards=man["shards"] + 1, seconds=round(man["seconds"] + time.time() - s, 1),
                   prompts_total=len(prompts), prompts_skipped=man.get("prompts_skipped", 0) + len(chunk) - len(ids),
                   replies_tokens=man.get("replies_tokens", 0) + generated)
        _write_atomic(out / "manifest.json", lambda p: p.write_text(json.dumps(man, indent=1)))
        log(f"self data: {man['prompts_done']}/{len(prompts)} prompts, {man['tokens']} tokens "
            f"({generated / max(time.time() - s, 1e-9):.0f} generated tokens/s)")
    return man


def load_streams(path: str | Path, eos_id: int) -> dict[str, torch.Tensor]:
    """{"train", "val"} int32 streams of the shards: sample, EOS, sample, EOS, ..."""
    path = Path(path)
    man = _manifest(path)
    if man is None or man["shards"] == 0:
        raise ValueError(f"{path}: no self-generated data yet (run with --gen-tokens > 0 first)")
    parts: dict[str, list[torch.Tensor]] = {"train": [], "val": []}
    sep = torch.tensor([eos_id], dtype=torch.int32)
    n = 0
    for i in range(man["shards"]):
        for sample in torch.load(path / f"shard_{i:05d}.pt"):
            parts["val" if n % VAL_EVERY == VAL_EVERY - 1 else "train"] += [sample, sep]
            n += 1
    if not parts["train"]:
        raise ValueError(f"{path}: no samples (every prompt was too long for the target's context with the reply)")
    return {k: torch.cat(v) if v else torch.zeros(0, dtype=torch.int32) for k, v in parts.items()}
