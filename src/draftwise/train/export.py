"""Export a trained model as a Hugging Face directory: config.json (LlamaForCausalLM),
model.safetensors in bfloat16, tokenizer.json + tokenizer_config.json, generation_config.json,
and the training summary (`training.json`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..model.loader import save_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(src: str | Path, out: str | Path) -> None:
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)


def export_model(model, out: str | Path, tokenizer_dir: str | Path, summary: dict | None = None) -> None:
    out = Path(out)
    save_model(model, out, dtype=torch.bfloat16)
    copy_tokenizer(tokenizer_dir, out)
    cfg = model.cfg
    eos = cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else cfg.eos_token_id
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": eos,
           "do_sample": False, "max_new_tokens": 128}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if summary is not None:
        (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
