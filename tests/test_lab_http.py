"""`bench --url`: the streaming HTTP backend against `draftwise serve` (in-process), and /metrics parsing."""
import json

from draftwise import LLM, SpecConfig
from draftwise.cli.main import main
from draftwise.lab.backends import parse_prometheus, spec_stats_from_metrics
from server_harness import ServerThread

VLLM_BEFORE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""
VLLM_AFTER = VLLM_BEFORE.replace("} 10.0", "} 30.0").replace("} 30.0\nvllm:spec_decode_num_acc", "} 90.0\nvllm:spec_decode_num_acc") \
    .replace("} 12.0", "} 52.0").replace('"0"} 7.0', '"0"} 27.0').replace('"1"} 4.0', '"1"} 16.0').replace('"2"} 1.0', '"2"} 9.0')


def test_vllm_metrics():
    before, after = parse_prometheus(VLLM_BEFORE), parse_prometheus(VLLM_AFTER)
    assert not any(n == "vllm:num_requests_running" for n, _ in after)
    st = spec_stats_from_metrics(before, after)
    assert st == {"rounds": 20, "draft_tokens": 60, "accepted_tokens": 40, "committed_tokens": 60,
                  "accepted_per_position": [20, 12, 8]}
    assert spec_stats_from_metrics({}, {}) == {}


def test_bench_url_against_draftwise_serve(target_dir, tmp_path, capsys):
    wl = tmp_path / "short.jsonl"
    wl.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 12}) + "\n"
                          for i, p in enumerate(["def add(a, b):", "class Point:\n", "for i in", "import os\n"])))
    llm = LLM(str(target_dir), draft=str(target_dir), spec=SpecConfig(method="draft", k=3),
              draft_dtype="float32")  # its own draft at its precision: all accepted
    with ServerThread(llm.engine, "tiny", loaded=llm.models) as srv:
        rc = main(["bench", "--url", srv.url, "--workload", str(wl), "--max-tokens", "12",
                   "--concurrency", "1,2", "--out", str(tmp_path / "out"), "--progress"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "8/8" in cap.err and "ETA" in cap.err and cap.out == ""  # 2 levels x 4 requests, on stderr only
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    # the settings say what the server said about itself, not this command's local defaults
    st = res["settings"]
    assert st["model"] == "tiny" and st["method"] == "draft" and st["k"] == 3
    # what it loaded, from its /health (the local defaults would say "embedded")
    assert st["draft"] == target_dir.name and st["dtype"] == st["draft_dtype"] == "float32"
    assert st["quantization"] is None and st["device"] == "cpu"
    assert st["server"]["owned_by"] == "draftwise" and st["server"]["speculation"]["policy"] == "fixed"
    assert st["server"]["metrics"]["exporter"] == "draftwise" and st["reference_server"] is None
    runs = res["workloads"][0]["runs"]
    assert [r["level_label"] for r in runs] == ["c=1", "c=2"]
    for r in runs:
        assert r["config"] == "server:tiny" and r["completed"] == 4 and r["output_tokens"] == 4 * 12
        sp = r["speculation"]
        # the target drafting for itself: every proposal accepted, several tokens per delivery
        assert sp["proposed_tokens"] > 0 and sp["acceptance_rate"] == 1.0
        assert sp["mean_accepted_length"] > 1 and r["tokens_per_delivery"] > 1
        assert sum(sp["committed_per_round"].values()) == sp["rounds"]


def test_check_certifies_a_server_against_a_reference(target_dir, draft_dir, tmp_path, capsys, monkeypatch):
    """A speculative server against a plain one: PASS; a lossy one (accepts every proposal): FAIL."""
    import draftwise.engine.engine as engine_mod

    plain = LLM(str(target_dir)).engine
    spec = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3)).engine
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nclass Point:\nfor i in range(10):\nimport os\n")
    args = ["check", "--max-tokens", "12", "--samples", "150", "--horizon", "2", "--prompts", str(prompts)]
    with ServerThread(plain, "tiny") as ref, ServerThread(spec, "tiny") as srv:
        assert main(args + ["--url", srv.url, "--reference-url", ref.url]) == 0
        out = capsys.readouterr().out
        assert "PASS greedy equality (servers)" in out and "PASS distribution (servers" in out
        flat = " ".join(out.split())  # the TV beside the TV of the two servers' samples dealt at random
        assert "sampling noise alone: " in flat and "pooled and dealt at random into two sets" in flat
        real = engine_mod.verify_proposals

        def accept_everything(p_logits, meta, q, generators=None, draws=None):
            res = real(p_logits, meta, q, generators, draws)
            lossy = res.committed.clone()
            for b, n in enumerate(meta.num_draft.tolist()):
                lossy[b, :n] = meta.draft_token_ids[b, :n]
                lossy[b, n] = res.committed[b, 0]
            return type(res)(lossy, meta.num_draft.clone(), res.valid)

        real_argmax = engine_mod.verify_argmax

        def accept_everything_greedy(logits, ids):  # greedy rows (logprobs too) take the argmax rule
            toks, _, valid = real_argmax(logits, ids)
            return [list(d) + t[:1] for d, t in zip(ids, toks)], [len(d) for d in ids], valid

        monkeypatch.setattr(engine_mod, "verify_proposals", accept_everything)
        monkeypatch.setattr(engine_mod, "verify_argmax", accept_everything_greedy)
        assert main(args + ["--url", srv.url, "--reference-url", ref.url]) == 1
        assert "FAIL greedy equality (servers)" in capsys.readouterr().out
    assert main(args + ["--url", "http://127.0.0.1:9"]) == 2  # --reference-url missing


def test_bench_url_with_a_reference_server(target_dir, draft_dir, tmp_path):
    wl = tmp_path / "short.jsonl"
    wl.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 10}) + "\n"
                          for i, p in enumerate(["def add(a, b):", "class Point:\n", "for i in"])))
    plain = LLM(str(target_dir)).engine
    spec = LLM(str(target_dir), draft=str(draft_dir), spec=SpecConfig(method="draft", k=3)).engine
    with ServerThread(plain, "tiny") as ref, ServerThread(spec, "tiny") as srv:
        rc = main(["bench", "--url", srv.url, "--reference-url", ref.url, "--workload", str(wl),
                   "--concurrency", "2", "--out", str(tmp_path / "out")])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = res["workloads"][0]["runs"]
    assert [r["config"] for r in runs] == ["server:tiny", "reference:tiny"]
    assert runs[0]["correctness"]["compared"] == 3 and runs[0]["correctness"]["mismatching_requests"] == 0
    # the speedup of --url is against the reference's run at the same level, and the report shows it
    speedup = runs[0]["vs_none"]["speedup"]
    assert speedup == runs[0]["output_tokens_per_s"] / runs[1]["output_tokens_per_s"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| speedup vs reference:tiny | c=2 |" in report
    row = next(line for line in report.splitlines() if line.startswith("| server:tiny |") and line.count("|") == 3)
    assert f"{speedup:.2f}x" in row  # the matrix's cell (bold at >= 1.05x), not "-"
    assert res["settings"]["method"] == "draft" and res["settings"]["reference_server"]["speculation"]["method"] == "none"
    assert main(["bench", "--reference-url", ref.url, "--workload", str(wl)]) == 2  # needs --url


def test_a_foreign_server_describes_itself_through_v1_models():
    """A vLLM-like server: the model id, owned_by, root and max_model_len from /v1/models, its
    spec-decode counters from /metrics; what it does not say is "unknown"."""
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from draftwise.lab.server_info import describe_server, server_settings
    from server_harness import free_port

    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"data": [{"id": "HuggingFaceTB/SmolLM2-360M-Instruct", "owned_by": "vllm", "root": "/m/smol",
                          "max_model_len": 8192}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics():
        return VLLM_BEFORE

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        info = describe_server(f"http://127.0.0.1:{port}/v1")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert info["model"] == "HuggingFaceTB/SmolLM2-360M-Instruct" and info["owned_by"] == "vllm"
    assert info["root"] == "/m/smol" and info["max_model_len"] == 8192
    assert info["speculation"] == "unknown"  # /health's speculation is a draftwise field
    assert info["metrics"] == {"exporter": "vllm", "proposed_tokens": 30}
    st = server_settings(info, None)
    assert st["model"] == info["model"] and st["method"] == st["dtype"] == st["draft"] == "unknown"
