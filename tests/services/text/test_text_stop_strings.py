"""Stop strings: never leak stop text, match across chunks, keep text that only looked like a stop."""
from __future__ import annotations

import random

import pytest

from services.text.stop_strings import StopResult, StopStringMatcher


def run(stop, chunks):
    m = StopStringMatcher(stop)
    out = []
    for c in chunks:
        emit, stopped = m.push(c)
        out.append(emit)
        if stopped:
            return "".join(out), True, m.matched
    return "".join(out) + m.flush(), False, None


def reference(stop, text):
    hits = [(text.find(s), s) for s in stop if s and s in text]
    if not hits:
        return text, False
    i, _ = min(hits)
    return text[:i], True


def test_basic_and_across_chunks():
    assert run(["<|end|>"], ["Hello wor", "ld<|e", "nd|> tail"]) == ("Hello world", True, "<|end|>")
    assert run(["STOP"], ["S", "T", "O", "P"]) == ("", True, "STOP")
    assert run(["STOP"], ["aST", "OX", "b"]) == ("aSTOXb", False, None)


def test_nothing_leaks_while_held():
    m = StopStringMatcher(["</answer>"])
    assert m.push("result</ans") == StopResult("result", False)
    assert m.push("wer") == StopResult("", False)
    assert m.push(">more") == StopResult("", True)
    assert m.push("after") == StopResult("", True)  # finished: nothing more comes out
    assert m.flush() == ""


def test_stop_at_very_start():
    assert run(["###"], ["###", "x"]) == ("", True, "###")
    assert run(["\n"], ["\nabc"]) == ("", True, "\n")


def test_multiple_and_overlapping_stops():
    assert run(["abcd", "bc"], ["a", "bcd"]) == ("", True, "abcd")  # earliest position wins
    assert run(["bcd", "ab"], ["xa", "bcd"]) == ("x", True, "ab")
    assert run(["aab", "ab"], ["a", "a", "a", "b"]) == ("a", True, "aab")
    assert run(["aaab"], ["aa", "aa", "b"]) == ("a", True, "aaab")  # prefix re-aligns after a near miss
    assert run(["xyz", "yq"], ["xy", "q"]) == ("x", True, "yq")


def test_flush_returns_false_alarm():
    assert run(["<|im_end|>"], ["text <|im", "_"]) == ("text <|im_", False, None)


def test_no_stop_strings_passes_through():
    m = StopStringMatcher([])
    assert m.push("abc") == StopResult("abc", False)
    assert StopStringMatcher(["", "x"]).stop == ("x",)


@pytest.mark.parametrize("seed", range(5))
def test_random_against_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab<|>é😀"
    for _ in range(400):
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        emitted, stopped, _ = run(stop, chunks)
        assert (emitted, stopped) == reference(stop, text), (stop, chunks)


def test_held_text_is_never_a_match_but_a_stop_ending_after_it_is():
    """hold(): text made before min_tokens (vLLM's: stop strings count from there on). It is sent
    except a tail that may begin a stop string; later text completes a stop across the boundary."""
    m = StopStringMatcher(["is", "abc"])
    assert m.hold("this ab") == "this "          # "is" in there does not count; "ab" may begin "abc"
    assert m.push("") == StopResult("", False)    # nothing new: nothing to match
    assert m.push("cd") == StopResult("", True) and m.matched == "abc"
    m = StopStringMatcher(["is"])
    assert m.hold("xi") == "x" and m.push("s!") == StopResult("", True)
    m = StopStringMatcher(["b", "abc"])
    assert m.hold("ab") == "" and m.push("x") == StopResult("abx", False)   # the held "b" was early


def run_kept(stop, chunks):
    """include_stop: each piece's text as pushed; the pieces before the one that stopped."""
    m = StopStringMatcher(stop, include_stop=True)
    out = []
    for k, c in enumerate(chunks):
        emit, stopped = m.push(c)
        out.append(emit)
        if stopped:
            return out, m.matched, k
    return out + [m.flush()], None, len(chunks)


def test_include_stop_keeps_the_stop_string_and_holds_nothing_back():
    """vLLM's include_stop_str_in_output: nothing is held (a piece goes out whole), the stop string
    stays in the text, the text after it in the same piece does not."""
    assert run_kept(["<|end|>"], ["Hello wor", "ld<|e", "nd|> tail"]) == (["Hello wor", "ld<|e", "nd|>"], "<|end|>", 2)
    assert run_kept(["STOP"], ["S", "T", "O", "P", "x"]) == (["S", "T", "O", "P"], "STOP", 3)
    assert run_kept(["xyz"], ["abx", "y", "q"]) == (["abx", "y", "q", ""], None, 3)
    assert run_kept(["\n"], ["a\nb"]) == (["a\n"], "\n", 0)


def test_include_stop_held_text_is_sent_and_still_begins_a_stop():
    m = StopStringMatcher(["is", "abc"], include_stop=True)
    assert m.hold("this ab") == "this ab"         # before min_tokens: sent whole, "is" does not count
    assert m.push("cd") == StopResult("c", True) and m.matched == "abc"


@pytest.mark.parametrize("seed", range(3))
def test_include_stop_random(seed):
    rng = random.Random(seed)
    alphabet = "ab<|>é😀"
    for _ in range(300):
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, matched, k = run_kept(stop, chunks)
        emitted = "".join(out)
        assert out[:k] == chunks[:k] and text.startswith(emitted), (stop, chunks)
        assert (matched is not None) == any(s in text for s in stop), (stop, chunks)
        if matched is not None:      # the first piece in which some stop string ends stops it
            before = "".join(chunks[:k])
            assert emitted.endswith(matched) and not any(s in before for s in stop), (stop, chunks)
        else:
            assert emitted == text
