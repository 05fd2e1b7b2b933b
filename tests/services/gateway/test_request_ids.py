"""Internal request ids are random: a forged Abort or TextBatch cannot name another user's request."""
import re

from services.gateway.backend import new_request_id


def test_request_ids_are_128_random_bits_not_a_counter():
    ids = [new_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"r-[0-9a-f]{32}", rid) for rid in ids)
    assert len({rid[:10] for rid in ids}) > 9_000   # no shared prefix (tag) to learn and count from
