"""The n-gram proposer: the continuation of the latest earlier match of the longest suffix."""
from __future__ import annotations

from gpu_worker.spec_decode.ngram import propose_ngram


def test_longest_suffix_first_then_latest_match():
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" (n=3) occurs at 0: continuation 9 9 5; "2 3" alone would match later (at 6: 7 8)
    assert propose_ngram(tokens, 3, 2, 3) == [9, 9, 5]
    assert propose_ngram(tokens, 3, 2, 2) == [7, 8, 1]        # latest match of "2 3"


def test_no_match_gives_nothing_and_k_bounds_the_drafts():
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []
    assert propose_ngram([5, 6, 5, 6, 5, 6], 2, 2, 2) == [5, 6]
    assert propose_ngram([5, 6, 5, 6, 5, 6], 0, 1, 2) == []
    assert propose_ngram([7], 3, 1, 3) == []


def test_continuation_may_run_into_the_suffix():
    assert propose_ngram([4, 4, 4], 5, 1, 1) == [4]           # match at 1, one token follows


def test_search_is_bounded_by_the_window():
    tokens = [1, 2, 42] + [0] * 50 + [1, 2]
    assert propose_ngram(tokens, 1, 2, 2) == [42]
    assert propose_ngram(tokens, 1, 2, 2, window=20) == []
