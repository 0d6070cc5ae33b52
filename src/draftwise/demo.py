"""`make demo`: complete a held-out function with and without speculation on the embedded pair.

Prints both completions (identical at temperature 0), the acceptance figures and the measured
speedup. If the embedded models are not there (a checkout without `models/`), it says so and uses
small random models the project builds itself, so the mechanics can still be seen.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from .engine import SpecConfig
from .llm import LLM
from .paths import default_draft, default_target
from .sampling import SamplingParams

K = 4
MAX_TOKENS = 128


def held_out_prompt(tokenizer, index: int = 0) -> tuple[str, str]:
    """A held-out stdlib function's signature and docstring (the model card's evaluation set)."""
    try:
        from .corpus import split
        from .train.evaluate import function_prompts

        fn = function_prompts(split(), tokenizer, n=64)[index]
        # end at the closing quotes: with this BPE a bare trailing newline means "not indented"
        return fn["prompt"].rstrip("\n"), f"{fn['path']}:{fn['line']} {fn['name']}"
    except Exception:  # no stdlib sources on disk: a fixed prompt
        return 'def is_palindrome(s):\n    """Return True if s reads the same forwards and backwards."""', "built-in"


def model_dirs() -> tuple[Path, Path, bool]:
    t, d = default_target(), default_draft()
    if (t / "model.safetensors").is_file() and (d / "model.safetensors").is_file():
        return t, d, True
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny_models import make_model_dir, make_tokenizer  # the tests' own tiny-model builder

    root = Path(tempfile.gettempdir()) / "draftwise-demo-models"
    tok = make_tokenizer()
    t = make_model_dir(root / "target", seed=0, tokenizer=tok, layers=4, hidden=128, max_pos=1024)
    return t, t, False


def timed(llm: LLM, prompt: str, params: SamplingParams):
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))  # warm-up
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    return out, time.perf_counter() - t0


def main() -> int:
    target, draft, embedded = model_dirs()
    if embedded:
        print(f"embedded pair: target {target}, draft {draft}")
    else:
        print("The embedded models (models/target, models/draft) are not in this checkout yet;\n"
              "using a small random model the project builds itself, drafting for itself (all accepted).")
    plain_llm = LLM(str(target))
    prompt, where = held_out_prompt(plain_llm.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    plain, t_plain = timed(plain_llm, prompt, params)
    spec_llm = LLM(str(target), draft=str(draft), spec=SpecConfig(method="draft", k=K))
    spec, t_spec = timed(spec_llm, prompt, params)
    bar = "-" * 72
    print(f"{bar}\nprompt (held-out function {where}):\n{prompt}\n{bar}")
    print(f"plain decoding ({len(plain.token_ids)} tokens, {t_plain:.2f} s):\n{plain.text}\n{bar}")
    print(f"speculative, draft model, k={K} ({len(spec.token_ids)} tokens, {t_spec:.2f} s):\n{spec.text}\n{bar}")
    same = plain.token_ids == spec.token_ids
    s = spec.stats
    print(f"identical output: {'yes' if same else 'NO'}")
    print(f"rounds: {s.rounds}, proposed: {s.proposed_tokens}, accepted: {s.accepted_tokens} "
          f"(acceptance rate {s.acceptance_rate:.2f}), mean accepted length {s.mean_accepted_length:.2f} tokens/round")
    print(f"accepted by position: {s.accepted_per_position}")
    print(f"plain {len(plain.token_ids) / t_plain:.1f} tok/s, speculative {len(spec.token_ids) / t_spec:.1f} tok/s: "
          f"speedup {t_plain / t_spec:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
