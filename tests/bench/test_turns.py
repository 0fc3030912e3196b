"""The order of timed calls: turns of runs, each turn after an untimed call, every competitor timed ``repeats``
times."""
import pytest

from bench.turns import take_turns


def test_turns_run_each_competitor_in_a_row_after_an_untimed_call():
    calls = []
    take_turns(2, 7, 3, lambda i, timed: calls.append((i, timed)))
    first_turns = [(0, False), (0, True), (0, True), (0, True), (1, False), (1, True), (1, True), (1, True)]
    assert calls[:8] == first_turns and calls[8:16] == first_turns
    assert calls[16:] == [(0, False), (0, True), (1, False), (1, True)]  # the last turn times what is left
    for i in (0, 1):
        assert sum(1 for c in calls if c == (i, True)) == 7


def test_turns_of_one_call_alternate_with_an_untimed_call_each():
    calls = []
    take_turns(3, 2, 1, lambda i, timed: calls.append((i, timed)))
    assert calls == [(i, t) for _ in range(2) for i in range(3) for t in (False, True)]


def test_run_length_below_one_is_refused():
    with pytest.raises(ValueError, match="run_length"):
        take_turns(2, 3, 0, lambda i, timed: None)
