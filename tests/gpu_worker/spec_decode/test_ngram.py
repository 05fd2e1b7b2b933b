"""The n-gram proposer: the continuation of the latest earlier match of the longest suffix; and its
test of whether any next token could give a match (async scheduling settles a step only then)."""
from __future__ import annotations

import random

from gpu_worker.spec_decode.ngram import ngram_may_match, propose_ngram


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


def _brute_force(tokens: list[int], k: int, lo: int, hi: int, window: int) -> list[int]:
    t = tokens[-window:]
    for n in range(min(hi, len(t) - 1), lo - 1, -1):
        for start in range(len(t) - n - 1, -1, -1):            # latest first
            if t[start:start + n] == t[len(t) - n:]:
                return t[start + n:start + n + k]
    return []


def test_matches_a_brute_force_search_on_random_sequences():
    rng = random.Random(1)
    for _ in range(3000):                                      # bounded
        tokens = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(0, 5), rng.randint(1, 4)
        hi, window = rng.randint(lo, 6), rng.choice([2048, 10])
        assert propose_ngram(tokens, k, lo, hi, window) == (_brute_force(tokens, k, lo, hi, window) if k else [])


def test_may_match_is_true_whenever_some_next_token_matches():
    """Necessary: no next token gives drafts where ngram_may_match says no; and it says no often
    enough to keep steps ahead (random sequences over a larger alphabet)."""
    rng = random.Random(2)
    said_no = 0
    for _ in range(1500):                                      # bounded
        alphabet = rng.randint(1, 12)
        known = [rng.randrange(alphabet) for _ in range(rng.randint(0, 30))]
        lo = rng.randint(1, 4)
        hi, window = rng.randint(lo, 6), rng.choice([2048, 10])
        could = any(propose_ngram(known + [t], 1, lo, hi, window) for t in range(alphabet))
        may = ngram_may_match(known, lo, window)
        assert may or not could, (known, lo, hi, window)
        said_no += not may
    assert said_no > 300
    assert ngram_may_match([], 1) and not ngram_may_match([1, 2, 3], 2) and ngram_may_match([1, 2, 1], 2)
