"""N-gram (prompt lookup) drafts: the sequence's last n tokens were seen before, so propose the
tokens that followed them then.

    tokens:  ... a b c d e ........ a b c | ?      last n-gram (n = 3): "a b c"
                 ^match   ^^^ drafts: d e ...       the k tokens after its latest earlier match

n goes from prompt_lookup_max down to prompt_lookup_min; the first n with a match wins. Host
numpy only, over the last SEARCH_WINDOW tokens: one compare of the window against the last token
finds the candidate match ends, then each of up to prompt_lookup_max - 1 passes extends the
candidates still matching by one token, so a step costs O(SEARCH_WINDOW) plus
O(candidates * prompt_lookup_max) whatever the sequence's length.
"""
from __future__ import annotations

import numpy as np

SEARCH_WINDOW = 2048


def propose_ngram(tokens: list[int], k: int, lookup_min: int, lookup_max: int,
                  window: int = SEARCH_WINDOW) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] when no n-gram of length lookup_max..
    lookup_min at its end occurs earlier (within the last `window` tokens)."""
    if k <= 0:
        return []
    t = np.asarray(tokens[-window:], dtype=np.int64)                    # (L,)
    L = len(t)
    # a match ends at i <= L-2 (a token follows it, and it is not the suffix itself)
    ends = np.flatnonzero(t[:L - 1] == t[L - 1])                        # (C,) candidate ends
    if ends.size == 0 or lookup_min > L - 1:
        return []
    length = np.ones(ends.size, dtype=np.int64)                         # (C,) matched length
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(lookup_max, L - 1)):
        prev = ends - j                                                  # (C,)
        alive &= prev >= 0
        alive[alive] &= t[prev[alive]] == t[L - 1 - j]
        if not alive.any():
            break
        length += alive
    n = int(length.max())
    if n < lookup_min:
        return []
    i = int(ends[np.flatnonzero(length >= n)[-1]]) + 1                  # after its latest match
    return t[i:i + k].tolist()


def ngram_may_match(known: list[int], lookup_min: int, window: int = SEARCH_WINDOW) -> bool:
    """Whether propose_ngram(known + [t], ...) can find a match for some next token t not known
    yet. A match of length n >= lookup_min ends at t; its first n - 1 tokens are the last n - 1
    of `known`, so the last lookup_min - 1 of them must occur earlier in `known` with a token
    after them (the one t must equal): that occurrence is a match of propose_ngram(known) of
    exactly that length. Necessary, not sufficient; always True for lookup_min 1."""
    m = lookup_min - 1
    return m == 0 or (len(known) > m and bool(propose_ngram(known, 1, m, m, window)))
