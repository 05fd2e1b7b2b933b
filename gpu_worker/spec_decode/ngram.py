"""N-gram (prompt lookup) drafts: the sequence's last n tokens were seen before, so propose the
tokens that followed them then.

    tokens:  ... a b c d e ........ a b c | ?      last n-gram (n = 3): "a b c"
                 ^match   ^^^ drafts: d e ...       the k tokens after its latest earlier match

n goes from prompt_lookup_max down to prompt_lookup_min; the first n with a match wins. Host
numpy only; the search covers the last SEARCH_WINDOW tokens, so one sequence costs at most
O(SEARCH_WINDOW * prompt_lookup_max) element compares a step, whatever its length.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SEARCH_WINDOW = 2048


def propose_ngram(tokens: list[int], k: int, lookup_min: int, lookup_max: int,
                  window: int = SEARCH_WINDOW) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] when no n-gram of length lookup_max..
    lookup_min at its end occurs earlier (within the last `window` tokens)."""
    if k <= 0:
        return []
    t = np.asarray(tokens[-window:], dtype=np.int64)                    # (L,)
    L = len(t)
    for n in range(min(lookup_max, L - 1), lookup_min - 1, -1):
        # windows start at 0..L-1-n: each match has at least one token after it, and the
        # suffix itself (start L-n) is excluded
        starts = sliding_window_view(t[:L - 1], n)                       # (L-n, n)
        hits = np.flatnonzero((starts == t[L - n:]).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n                                        # first token after the match
            return t[i:i + k].tolist()
    return []
