"""Grant patterns (pybroker.server.grants, pybroker.server.auth.parse_state): RE2 as
nsqd's Go regexps, in bounded time, with the budget on an answer's patterns."""
from __future__ import annotations

import json
import time

import pytest

from pybroker.server.auth import parse_state
from pybroker.server.grants import MAX_PROGRAM, Pattern


def _state(*auths: dict[str, object]) -> bytes:
    return json.dumps({"ttl": 60, "authorizations": list(auths)}).encode()


def test_go_syntax_is_accepted_and_matches_unanchored() -> None:
    assert Pattern(r"^t3\z").search("t3")          # \z: valid in Go and RE2, not in re
    assert not Pattern(r"^t3\z").search("t33")
    assert Pattern("ok").search("not_ok_either")   # Go's MatchString is unanchored
    assert Pattern("(?i)^ABC").search("abc")


@pytest.mark.parametrize("bad", ["(a", r"(\w)\1", "a{1001}", "(?=x)"])
def test_invalid_patterns_are_nsqds_error(bad: str) -> None:
    with pytest.raises(ValueError, match=r'^unable to compile topic "'):
        parse_state(_state({"topic": bad, "channels": [".*"], "permissions": ["publish"]}))


def test_a_backtracking_pattern_matches_in_linear_time() -> None:
    state = parse_state(_state({"topic": "^([a-z0-9]+_?)*$", "channels": [".*"],
                                "permissions": ["publish"]}))
    t0 = time.perf_counter()
    assert not state.is_allowed("a" * 26 + "-", "")   # Python's re: seconds
    assert state.is_allowed("a" * 27, "")
    assert time.perf_counter() - t0 < 0.05


def test_an_answer_over_the_program_budget_is_refused() -> None:
    big = {"topic": "((a|b)?){999}c", "channels": ["((a|b)?){999}c"],
           "permissions": ["publish"]}
    with pytest.raises(ValueError, match="authorizations too complex"):
        parse_state(_state(big, big))
    assert MAX_PROGRAM >= 6000   # one such pattern alone still fits


def test_checks_are_cached_per_grant() -> None:
    # as nsqd: a publish checks the channel patterns against "" too
    state = parse_state(_state({"topic": "^pub_", "channels": ["^ok", "^$"],
                                "permissions": ["publish", "subscribe"]}))
    assert state.is_allowed("pub_x", "") and not state.is_allowed("sub_x", "")
    assert state.is_allowed("pub_x", "ok1") and not state.is_allowed("pub_x", "no")
    assert state.checked[("pub_x", "")] is True and state.checked[("sub_x", "")] is False
