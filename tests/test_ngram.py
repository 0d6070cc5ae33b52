"""Direct tests of prompt lookup (`ngram_lookup`) and of the n-gram proposer built on it."""
import pytest

from draftwise.proposers.ngram import NgramProposer, ngram_lookup


def test_the_most_recent_match_wins():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]  # the suffix [1, 2] occurred at 0 (then 3) and at 3 (then 4)
    assert ngram_lookup(tokens, 1, max_n=2) == [4]
    assert ngram_lookup(tokens, 3, max_n=2) == [4, 1, 2]


def test_the_longest_n_is_tried_first():
    tokens = [5, 6, 7, 8, 9, 7, 1, 6, 7]
    # [6, 7] occurred at 1 (then 8, 9); [7] alone occurred more recently, at 5 (then 1, 6)
    assert ngram_lookup(tokens, 2, max_n=2) == [8, 9]
    assert ngram_lookup(tokens, 2, max_n=1) == [1, 6]


def test_min_n_refuses_shorter_matches():
    tokens = [1, 2, 3, 4, 3]  # [3] matches (then 4, 3); [4, 3] never occurred before
    assert ngram_lookup(tokens, 2, max_n=3, min_n=1) == [4, 3]
    assert ngram_lookup(tokens, 2, max_n=3, min_n=2) == []


def test_k_truncates_and_the_continuation_may_run_into_the_suffix():
    tokens = [1, 2, 1]
    assert ngram_lookup(tokens, 0) == []
    assert ngram_lookup(tokens, 1) == [2]
    assert ngram_lookup(tokens, 5) == [2, 1]  # only what follows the match exists
    assert ngram_lookup([1, 1, 1], 4, max_n=2) == [1]  # overlapping occurrence of [1, 1] at 0


def test_the_suffix_never_matches_itself():
    assert ngram_lookup([1, 2, 3], 4) == []
    assert ngram_lookup([9, 8, 7, 6], 4, max_n=4) == []


def test_short_inputs():
    assert ngram_lookup([], 3) == []
    assert ngram_lookup([7], 3) == []
    assert ngram_lookup([7, 7], 3, max_n=4) == [7]  # n is capped at len - 1


class History:
    def __init__(self, ids):
        self.all_ids = ids


def test_proposer_blocks_carry_no_q_and_respect_num_draft():
    prop = NgramProposer(ngram_max=2, ngram_min=1)
    blocks = prop.propose([History([1, 2, 3, 1, 2]), History([4, 5]), History([1, 2, 3, 1, 2])], [2, 3, 0])
    assert [b.token_ids for b in blocks] == [[3, 1], [], []]
    assert all(b.probs is None for b in blocks)


@pytest.mark.parametrize("max_n, min_n", [(2, 3), (2, 0)])
def test_proposer_rejects_bad_sizes(max_n, min_n):
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(ngram_max=max_n, ngram_min=min_n)


def test_match_length_counts_past_max_n():
    from draftwise.proposers.ngram import ngram_match
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4, 5]  # the suffix [9 .. 5] (6 tokens) occurred at 0
    assert ngram_match(tokens, 2, max_n=2) == ([6, 7], 6)
    assert ngram_match([1, 2, 1], 1) == ([2], 1)
    assert ngram_match([1, 2, 3], 1) == ([], 0)


def test_proposer_confidence_grows_with_the_match_and_along_the_block():
    short = [5, 1, 8, 7, 2, 1]  # [1] matched once (then 8, 7)
    long = [3, 4, 5, 1, 8, 7, 6, 3, 4, 5, 1]  # [3, 4, 5, 1] matched (then 8, 7)
    prop = NgramProposer(ngram_max=4, ngram_min=1)
    a, b = prop.propose([History(short), History(long)], [2, 2])
    assert a.token_ids == b.token_ids == [8, 7]
    assert a.confidence == [1 - 1 / 2, 1 - 1 / 3] and b.confidence == [1 - 1 / 5, 1 - 1 / 6]
    prop.confidence = False  # what the engine sets when the policy never reads it
    assert prop.propose([History(long)], [2])[0].confidence is None
