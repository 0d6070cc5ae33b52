"""Direct tests of `stop_holdback`: how much streamed text waits in case a stop string is starting."""
from draftwise.server.async_engine import stop_holdback


def test_the_longest_suffix_that_starts_a_stop_string():
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("aaa", ["aaaa"]) == 3  # the longest of "a", "aa", "aaa"
    assert stop_holdback("a", ["abc"]) == 1
    assert stop_holdback("c", ["abc"]) == 0  # a suffix of the stop string, not a prefix


def test_only_proper_prefixes_are_held_back():
    """A whole stop string is the stop check's business (it ends the request), not the holdback's."""
    assert stop_holdback("hello world", ["world"]) == 0
    assert stop_holdback("x", ["x"]) == 0  # a one-character stop never waits


def test_the_longest_over_several_stops_in_any_order():
    assert stop_holdback("abc", ["cx", "bcz"]) == 2
    assert stop_holdback("abc", ["bcz", "cx"]) == 2
    assert stop_holdback("ab", ["b", "abc"]) == 2
    assert stop_holdback("the end\n", ["\n\n", "END"]) == 1


def test_empty_text_or_stops():
    assert stop_holdback("", ["abc"]) == 0
    assert stop_holdback("abc", []) == 0
    assert stop_holdback("abc", [""]) == 0
