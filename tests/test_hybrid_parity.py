"""The hybrid (Qwen3-Next style) model matches transformers' `Qwen3NextForCausalLM` on a tiny
random checkpoint: logits over a prompt (full forward, and through the paged runner in prefill
chunks + single-token steps), and 64 greedy tokens; float32. Also the chunked form of the gated
delta rule against the token-by-token one."""
import pytest
import torch

from draftwise.model import load_model
from draftwise.model.gated_delta import chunked_rule, l2norm, recurrent_rule
from draftwise.model.runner import ModelRunner
from tiny_hybrid import make_hybrid_dir

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_next")


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory, tokenizer):
    path = make_hybrid_dir(tmp_path_factory.mktemp("hybrid"), seed=3, tokenizer=tokenizer)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, ref


def test_chunked_rule_matches_recurrent():
    torch.manual_seed(0)
    B, T, H, dk, dv = 2, 45, 3, 8, 5
    q = l2norm(torch.randn(B, T, H, dk)) * dk ** -0.5
    k = l2norm(torch.randn(B, T, H, dk))
    v, g, beta = torch.randn(B, T, H, dv), -torch.rand(B, T, H), torch.rand(B, T, H)
    S0 = torch.randn(B, H, dk, dv)
    o1, s1 = recurrent_rule(q, k, v, g, beta, S0)
    o2, s2 = chunked_rule(q, k, v, g, beta, S0, chunk=16)
    assert torch.allclose(o1, o2, atol=1e-5) and torch.allclose(s1, s2, atol=1e-5)
    o3, s3 = chunked_rule(q, k, v, g, beta * 0.5, S0, chunk=16)  # a different input must differ
    assert not torch.allclose(s1, s3, atol=1e-3)


def test_logits_match_transformers(hybrid_pair):
    path, ref = hybrid_pair
    torch.manual_seed(0)
    ids = torch.randint(1, ref.config.vocab_size, (2, 90))
    with torch.no_grad():
        want = ref(ids).logits  # [2, 90, V]
    for fuse in (False, True):
        got = load_model(path, load_tokenizer=False, fuse=fuse).model.logits(ids)
        assert (got - want).abs().max() < 1e-4, fuse
    # the paged runner: a 33-token chunk (chunked rule), a 20-token chunk, then single tokens
    loaded = load_model(path, load_tokenizer=False)
    runner = ModelRunner(loaded, num_blocks=16, block_size=16)
    x = ids[0].tolist()
    runner.kv.reserve(5, 90)
    parts = [runner.run([5], [x[:33]], [0], [33]), runner.run([5], [x[33:53]], [33], [20])]
    parts += [runner.run([5], [[x[i]]], [i], [1]) for i in range(53, 90)]
    assert (torch.cat(parts) - want[0]).abs().max() < 1e-4


def test_greedy_64_tokens_match_transformers(hybrid_pair):
    path, ref = hybrid_pair
    prompt = [5, 17, 42, 99, 7, 15, 3, 8]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64,
                           eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    from draftwise.llm import LLM
    from draftwise.sampling import SamplingParams

    llm = LLM(str(path), dtype="float32")
    got = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == want


def test_c_loop_matches_recurrent_rule(monkeypatch):
    from draftwise.model.gated_delta_kernel import fused_recurrent_rule

    torch.manual_seed(1)
    B, T, H, dk, dv = 2, 5, 3, 8, 6
    q = l2norm(torch.randn(B, T, H, dk)) * dk ** -0.5
    k = l2norm(torch.randn(B, T, H, dk))
    v, g, beta = torch.randn(B, T, H, dv), -torch.rand(B, T, H), torch.rand(B, T, H)
    S0 = torch.randn(B, H, dk, dv)
    states = torch.empty(B, T, H, dk, dv)
    got = fused_recurrent_rule(q, k, v, g, beta, S0, states_out=states)
    if got is None:
        pytest.skip("no C compiler")
    want_states = torch.empty_like(states)
    o, s = recurrent_rule(q, k, v, g, beta, S0, states_out=want_states)
    assert torch.allclose(got[0], o, atol=1e-5) and torch.allclose(got[1], s, atol=1e-5)
    assert torch.allclose(states, want_states, atol=1e-5)
    assert not torch.equal(S0, got[1])  # the caller's state is not updated in place
    monkeypatch.setenv("DRAFTWISE_KERNELS", "0")
    assert fused_recurrent_rule(q, k, v, g, beta, S0) is None
