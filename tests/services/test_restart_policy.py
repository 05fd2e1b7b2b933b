"""When `kvmesh serve` restarts a child that exited: back-off, its reset, and the crash loop."""
from __future__ import annotations

from services.restart_policy import (CRASH_LOOP_EXITS, CRASH_LOOP_WINDOW_S, FIRST_DELAY_S, MAX_DELAY_S,
                                     STABLE_AFTER_S, GiveUp, Restart, RestartPolicy, describe_exit)


def test_back_off_doubles_to_its_cap():
    policy, now, delays = RestartPolicy(), 0.0, []
    for _ in range(8):
        policy.started(now)
        now += 16.0             # each run shorter than a stable one; 4 exits at most in any window
        decision = policy.exited(now)
        assert isinstance(decision, Restart)
        delays.append(decision.delay_s)
    assert delays[0] == FIRST_DELAY_S and delays[1] == 2 * FIRST_DELAY_S
    assert all(b == min(2 * a, MAX_DELAY_S) for a, b in zip(delays, delays[1:]))
    assert delays[-1] == MAX_DELAY_S


def test_back_off_starts_over_after_a_stable_run():
    policy = RestartPolicy()
    policy.started(0.0)
    policy.exited(1.0)
    policy.started(1.5)
    assert policy.exited(2.0).delay_s == 2 * FIRST_DELAY_S       # crashed soon again: longer wait
    policy.started(3.0)
    assert policy.exited(3.0 + STABLE_AFTER_S).delay_s == FIRST_DELAY_S


def test_exits_within_the_window_are_a_crash_loop_and_old_ones_are_forgotten():
    policy, decisions = RestartPolicy(), []
    for i in range(CRASH_LOOP_EXITS):
        policy.started(float(i))
        decisions.append(policy.exited(i + 0.5))
    assert all(isinstance(d, Restart) for d in decisions[:-1])
    assert isinstance(decisions[-1], GiveUp) and f"{CRASH_LOOP_EXITS} times within" in decisions[-1].reason

    policy = RestartPolicy()
    for i in range(CRASH_LOOP_EXITS):          # the same number of exits, spread past the window
        policy.started(i * CRASH_LOOP_WINDOW_S / 2)
        assert isinstance(policy.exited(i * CRASH_LOOP_WINDOW_S / 2 + 1), Restart)


def test_exit_descriptions_name_the_signal():
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(0) == "code 0" and describe_exit(2) == "code 2"
