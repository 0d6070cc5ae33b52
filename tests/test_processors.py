"""process_logits: hand-computed cases for each control, and purity in (logits, params, history)."""
import math

import pytest
import torch

from draftwise.sampling import SamplingParams, probs_from_logits, process_logits

INF = math.inf


def run(logits, sp, prompt=(), output=(), eos=None):
    x = torch.tensor([logits], dtype=torch.float32)
    return process_logits(x, [sp], [list(prompt)], [list(output)], eos_ids=None if eos is None else [eos])[0].tolist()


def log_probs(ps):
    return [math.log(p) for p in ps]


def test_defaults_are_identity():
    assert run([1.0, -2.0, 0.5], SamplingParams()) == [1.0, -2.0, 0.5]


def test_temperature_scales_sampled_rows_only():
    assert run([1.0, 2.0, 3.0], SamplingParams(temperature=0.5)) == [2.0, 4.0, 6.0]
    assert run([1.0, 2.0, 3.0], SamplingParams(temperature=2.0)) == [0.5, 1.0, 1.5]
    # Greedy rows: no temperature, no truncation (neither changes the argmax).
    assert run([1.0, 2.0, 3.0], SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9)) == [1.0, 2.0, 3.0]


def test_top_k():
    assert run([1.0, 3.0, 2.0, 0.0], SamplingParams(top_k=2)) == [-INF, 3.0, 2.0, -INF]
    assert run([1.0, 3.0, 2.0, 0.0], SamplingParams(top_k=1)) == [-INF, 3.0, -INF, -INF]
    assert run([3.0, 2.0, 2.0, 0.0], SamplingParams(top_k=2)) == [3.0, 2.0, 2.0, -INF]  # ties kept
    for disabled in (0, -1, 4, 100):
        assert run([1.0, 3.0, 2.0, 0.0], SamplingParams(top_k=disabled)) == [1.0, 3.0, 2.0, 0.0]


def test_top_k_applies_after_temperature_and_per_row():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [4.0, 3.0, 2.0, 1.0]])
    out = process_logits(x, [SamplingParams(top_k=3, temperature=2.0), SamplingParams(top_k=1)], [[], []], [[], []])
    assert out.tolist() == [[0.5, 1.5, 1.0, -INF], [4.0, -INF, -INF, -INF]]


@pytest.mark.parametrize(
    "top_p, kept",
    [(1e-9, [0]), (0.4, [0]), (0.75, [0, 1]), (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p(top_p, kept):
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    out = run(logits, SamplingParams(top_p=top_p))
    assert [i for i, v in enumerate(out) if v != -INF] == kept
    for i in kept:
        assert out[i] == pytest.approx(logits[i])


def test_top_p_order_independent_of_vocab_position():
    logits = log_probs([0.05, 0.15, 0.3, 0.5])
    out = run(logits, SamplingParams(top_p=0.75))
    assert [i for i, v in enumerate(out) if v != -INF] == [2, 3]


def test_top_p_after_top_k_renormalises_over_the_kept_set():
    # After top_k=2: probs (0.5, 0.3) / 0.8 = (0.625, 0.375); top_p=0.6 keeps only the first.
    out = run(log_probs([0.5, 0.3, 0.15, 0.05]), SamplingParams(top_k=2, top_p=0.6))
    assert [i for i, v in enumerate(out) if v != -INF] == [0]
    out = run(log_probs([0.5, 0.3, 0.15, 0.05]), SamplingParams(top_k=2, top_p=0.7))
    assert [i for i, v in enumerate(out) if v != -INF] == [0, 1]


@pytest.mark.parametrize("min_p, kept", [(0.0, [0, 1, 2, 3]), (0.25, [0, 1, 2]), (0.5, [0, 1]), (1.0, [0])])
def test_min_p(min_p, kept):
    out = run(log_probs([0.5, 0.3, 0.15, 0.05]), SamplingParams(min_p=min_p))
    assert [i for i, v in enumerate(out) if v != -INF] == kept


def test_repetition_penalty_over_prompt_and_output():
    out = run([2.0, -2.0, 1.0, 0.5], SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1])
    assert out == [1.0, -4.0, 1.0, 0.5]
    out = run([2.0, -2.0, 1.0, 0.5], SamplingParams(repetition_penalty=0.5), prompt=[0, 2], output=[])
    assert out == [4.0, -2.0, 2.0, 0.5]


def test_presence_and_frequency_over_output_only():
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = run([1.0, 1.0, 1.0, 1.0], sp, prompt=[0, 0, 1], output=[2, 2, 3])
    assert out == [1.0, 1.0, 1.0 - 0.5 - 2 * 0.25, 1.0 - 0.5 - 0.25]
    out = run([1.0, 1.0], SamplingParams(presence_penalty=-1.0), output=[1])
    assert out == [1.0, 2.0]


def test_logit_bias_then_penalty_then_temperature():
    assert run([1.0, 0.0, 0.0], SamplingParams(logit_bias={1: 5.0, 2: -100.0})) == [1.0, 5.0, -100.0]
    # bias 1 -> -1, then repetition 2 -> -2, then temperature 0.5 -> -4.
    sp = SamplingParams(logit_bias={0: -2.0}, repetition_penalty=2.0, temperature=0.5)
    assert run([1.0, 3.0], sp, output=[0]) == [-4.0, 6.0]


def test_min_tokens_masks_stop_ids_and_eos_until_reached():
    sp = SamplingParams(min_tokens=2, stop_token_ids=[2])
    assert run([1.0, 1.0, 1.0, 1.0], sp, output=[0], eos=[3]) == [1.0, 1.0, -INF, -INF]
    assert run([1.0, 1.0, 1.0, 1.0], sp, output=[0, 0], eos=[3]) == [1.0, 1.0, 1.0, 1.0]
    ignore = SamplingParams(min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert run([1.0, 1.0, 1.0, 1.0], ignore, output=[], eos=[3]) == [1.0, 1.0, -INF, 1.0]
    assert run([1.0, 1.0, 1.0, 1.0], sp, output=[]) == [1.0, 1.0, -INF, 1.0]  # no eos_ids given


def test_probs_from_logits():
    out = run(log_probs([0.5, 0.3, 0.15, 0.05]), SamplingParams(top_k=2))
    probs = probs_from_logits(torch.tensor([out]))[0]
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    assert probs[2] == 0 and probs[3] == 0


def test_penalties_at_proposed_positions_count_proposed_tokens():
    """The engine's rows for proposed positions j = 0..K of one request: history = committed +
    proposed[:j]. Each row equals processing that history alone, and sees the tokens before j."""
    torch.manual_seed(0)
    vocab = 6
    sp = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2, temperature=0.8,
                        top_k=4)
    prompt, committed, proposed = [5, 1], [1, 2], [3, 3, 4]
    logits = torch.randn(len(proposed) + 1, vocab)  # [K+1, V]
    logits[:, 3] += 5.0  # token 3 stays in the top-k, so its penalised logit is visible
    before = logits.clone()
    histories = [committed + proposed[:j] for j in range(len(proposed) + 1)]
    batch = process_logits(logits, [sp] * len(histories), [prompt] * len(histories), histories)
    assert torch.equal(logits, before)  # input untouched
    for j, hist in enumerate(histories):
        alone = process_logits(logits[j : j + 1], [sp], [prompt], [hist])[0]
        assert torch.equal(batch[j], alone)
    # Token 3 is proposed at j = 0 and j = 1: unpenalised at j = 0, penalised at j = 1, more at j = 2.
    plain = process_logits(logits, [SamplingParams(temperature=0.8, top_k=4)] * 4, [prompt] * 4, [[]] * 4)
    l3 = logits[:, 3]
    expect_rep = torch.where(l3 > 0, l3 / 1.5, l3 * 1.5)
    assert batch[0, 3] == plain[0, 3]
    for j, count in ((1, 1), (2, 2), (3, 2)):
        want = (expect_rep[j] - 0.3 - 0.2 * count) / 0.8
        assert batch[j, 3].item() == pytest.approx(want.item(), rel=1e-6)


def test_rows_are_independent_of_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(5, 50)
    params = [SamplingParams(top_p=0.7), SamplingParams(temperature=0), SamplingParams(top_k=5, min_p=0.1),
              SamplingParams(repetition_penalty=1.3, temperature=1.3), SamplingParams(frequency_penalty=1.0)]
    hist = [[1, 2], [3], [], [4, 4, 5], [6, 6]]
    batch = process_logits(logits, params, [[0]] * 5, hist)
    for i in range(5):
        assert torch.equal(batch[i], process_logits(logits[i : i + 1], [params[i]], [[0]], [hist[i]])[0])


def test_changes_logits_is_false_only_where_process_logits_is_the_identity():
    """The engine's and the drafter's argmax shortcut rests on this: where `changes_logits` says
    no, `process_logits` returns the logits unchanged; each setting it names does change them."""
    from draftwise.sampling.processors import changes_logits

    torch.manual_seed(0)
    logits = torch.randn(1, 12)
    prompt, out = [1, 2, 3], [3, 4, 5, 6]
    cases = [
        SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(temperature=0, min_tokens=9, stop_token_ids=[7]),
        SamplingParams(temperature=0, logit_bias={5: 3.0}), SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0, frequency_penalty=0.5),
        SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3),
    ]
    for sp in cases:
        got = process_logits(logits, [sp], [prompt], [out], eos_ids=[[7]])
        if not changes_logits(sp, len(out)):
            assert torch.equal(got, logits), sp
        else:
            assert not torch.equal(got, logits), sp
