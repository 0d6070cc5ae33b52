"""The OpenAI-compatible server through the official `openai` client, on loopback.

Two live servers over tiny float32 models: plain decoding, and speculation with the target as
its own drafter (k=4, so nearly every greedy proposal is accepted and tokens arrive in blocks).
Greedy text must equal `LLM.generate`'s; logprobs must agree across the two servers and with a
plain scoring pass (`model.logits` over prompt + output).
"""
import httpx
import openai
import pytest
import torch

from draftwise import LLM, SamplingParams, SpecConfig
from draftwise.model.chat_template import ChatTemplate
from server_harness import ServerThread

PROMPTS = ["def add(a, b):", "class Point:\n", "for i in"]
MAX = 20


@pytest.fixture(scope="module")
def ref(target_dir):
    return LLM(str(target_dir))


@pytest.fixture(scope="module")
def servers(target_dir):
    plain = LLM(str(target_dir)).engine
    spec = LLM(str(target_dir), draft=str(target_dir), spec=SpecConfig(method="draft", k=4),
               draft_dtype="float32").engine
    with ServerThread(plain) as a, ServerThread(spec) as b:
        yield {"plain": a, "spec": b}


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(ref, prompt, n=MAX):
    return ref.generate(prompt, SamplingParams(temperature=0, max_tokens=n))[0]


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_completions_greedy_equals_generate(servers, ref, which):
    c = client(servers[which])
    for prompt in PROMPTS:
        want = greedy(ref, prompt)
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        ext = r.model_extra["draftwise"]
        if which == "spec":
            assert ext["method"] == "draft" and ext["proposed_tokens"] > 0
            assert ext["accepted_tokens"] > 0 and ext["mean_accepted_length"] > 1
        else:
            assert ext["method"] == "none" and ext["proposed_tokens"] == 0

        chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_chat_greedy_equals_generate(servers, ref, which, target_dir):
    c = client(servers[which])
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add"}]
    text = ChatTemplate({}).render(msgs)
    assert text == "system: You write Python.\nuser: def add\nassistant:"
    ids = ref.tokenizer.encode(text, add_special_tokens=False).ids
    want = greedy(ref, [ids])
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)

    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_template_from_tokenizer_config():
    tpl = ChatTemplate({"chat_template": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
                        "bos_token": {"content": "<s>"}})
    assert tpl.render([{"role": "user", "content": "hi"}]) == "<s><user>hi<assistant>"


def _score(model, prompt_ids, out_ids):
    """Log-probabilities of a plain forward over prompt + output: [len(out), V]."""
    with torch.no_grad():
        logits = model.logits(torch.tensor([prompt_ids + out_ids]))[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1].float(), dim=-1)


def test_logprobs_agree_with_and_without_speculation_and_scoring(servers, ref):
    prompt = PROMPTS[0]
    want = greedy(ref, prompt)
    got = {}
    for which in ("plain", "spec"):
        r = client(servers[which]).completions.create(model="tiny", prompt=prompt, max_tokens=MAX,
                                                      temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert all(len(t) == 3 for t in lp.top_logprobs)
        got[which] = lp
    a, b = torch.tensor(got["plain"].token_logprobs), torch.tensor(got["spec"].token_logprobs)
    assert got["plain"].tokens == got["spec"].tokens
    assert (a - b).abs().max() <= 1e-4
    scored = _score(ref.engine.target.model, want.prompt_token_ids, want.token_ids)
    plain = scored.gather(1, torch.tensor(want.token_ids)[:, None])[:, 0]
    assert (a - plain).abs().max() <= 1e-4
    for j, top in enumerate(got["spec"].top_logprobs):  # greedy: the chosen token is the best one
        assert max(top.values()) == pytest.approx(got["spec"].token_logprobs[j], abs=1e-6)
        assert sorted(top.values(), reverse=True) == pytest.approx(scored[j].topk(3).values.tolist(), abs=1e-4)

    # chat: logprobs=true + top_logprobs
    r = client(servers["spec"]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


def test_n_choices_and_seed(servers, ref):
    c = client(servers["spec"])
    kw = dict(model="tiny", prompt="def", max_tokens=12, temperature=1.0, n=3, seed=7, logprobs=0)
    r1, r2 = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in r1.choices] == [0, 1, 2]
    assert [ch.text for ch in r1.choices] == [ch.text for ch in r2.choices]  # reproducible
    assert len({tuple(ch.logprobs.tokens) for ch in r1.choices}) > 1  # independent
    assert r1.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in r1.choices)
    assert r1.usage.prompt_tokens == len(ref.tokenizer.encode("def").ids)  # once per prompt, not per choice


def test_extra_body_fields(servers, ref):
    c = client(servers["plain"])
    want = greedy(ref, PROMPTS[1])
    r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX, temperature=1.0,
                             extra_body={"top_k": 1})
    assert r.choices[0].text == want.text  # top_k=1 is greedy
    first = want.token_ids[3]
    r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX, temperature=0, logprobs=0,
                             extra_body={"stop_token_ids": [first]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == want.token_ids.index(first) + 1
    r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=7, temperature=0,
                             extra_body={"ignore_eos": True, "min_tokens": 7, "repetition_penalty": 1.0,
                                         "min_p": 0.0})
    assert r.usage.completion_tokens == 7


def test_stop_string_streamed_equals_unstreamed(servers, ref):
    want = greedy(ref, PROMPTS[2], 30).text
    stop = want[8:11]
    expect = want[: want.index(stop)]
    c = client(servers["spec"])
    r = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                       stop=[stop], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expect


def test_models_health_metrics(servers):
    srv = servers["spec"]
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = srv.wait_idle()
    assert h["status"] == "ok" and h["speculation"] == {"method": "draft", "k": 4, "policy": "fixed", "lookup": None}
    assert h["kv_blocks"]["target"]["used"] == 0 and h["kv_blocks"]["draft"]["used"] == 0
    text = httpx.get(srv.url + "/metrics").text
    for name in ("draftwise:requests_total", "draftwise:num_requests_waiting", "draftwise:num_requests_running",
                 'draftwise:kv_blocks_used{model="draft"', 'draftwise:kv_blocks_free{model="target"',
                 "draftwise:num_preemptions_total", "draftwise:prompt_tokens_total",
                 "draftwise:generation_tokens_total", "draftwise:spec_decode_num_rounds_total",
                 "draftwise:spec_decode_num_draft_tokens_total", "draftwise:spec_decode_num_accepted_tokens_total",
                 'draftwise:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="3"}',
                 'draftwise:spec_decode_committed_per_round_bucket{le="5"', 'draftwise:step_seconds_total{',
                 'phase="verify"', "draftwise:time_to_first_token_seconds_bucket",
                 "draftwise:e2e_request_latency_seconds_count", "draftwise:prefix_cache_hits_total",
                 "draftwise:draft_prefix_cache_queries_total", "draftwise:draft_prefix_cache_hits_total",
                 "draftwise:spec_decode_num_lookup_rounds_total"):
        assert name in text, name
    accepted = [ln for ln in text.splitlines() if ln.startswith("draftwise:spec_decode_num_accepted_tokens_total")]
    assert float(accepted[0].split()[-1]) > 0
