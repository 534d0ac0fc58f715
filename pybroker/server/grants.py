"""Grant patterns from the auth server: RE2, as nsqd's Go regexps, in bounded time.

nsqd compiles each authorization's topic and channel patterns with Go's ``regexp``
(RE2 syntax and semantics: no backreferences, ``\\z``, linear-time matching) and matches
them unanchored (``MatchString``). ``google-re2`` gives the same syntax and guarantee, so
a pattern nsqd accepts is accepted here, and none backtracks (Python's ``re`` takes
seconds on ``^([a-z0-9]+_?)*$`` against a 27-character topic; RE2 microseconds).

Budget: a pattern's compiled program is at most ``MAX_MEM`` bytes (RE2 refuses larger
ones as it refuses repetitions over 1,000), and one answer's patterns together at most
``MAX_PROGRAM`` instructions; matching costs about half a microsecond per instruction
per topic (64 characters at most), so the worst check is a few milliseconds on the
client's loop, and a check's result is kept (``Authorization.allows`` callers cache per
topic and channel) so each pair is matched once per grant. Compiling runs on the auth
thread, never on an event loop.
"""
from __future__ import annotations

import json
from typing import Protocol

import re2  # type: ignore[import-untyped,unused-ignore]

MAX_MEM = 1 << 20          # bytes of one compiled pattern (RE2's max_mem)
MAX_PROGRAM = 10_000       # instructions of all patterns of one answer together

_OPTIONS = re2.Options()
_OPTIONS.max_mem = MAX_MEM
_OPTIONS.log_errors = False  # RE2 would print its parse errors to stderr


class _Compiled(Protocol):
    """What is used of a compiled RE2 pattern (google-re2 has no type hints)."""

    programsize: int

    def search(self, s: str) -> object: ...


class Pattern:
    """One compiled grant pattern, matched unanchored as Go's MatchString does."""

    __slots__ = ("text", "_re", "size")

    def __init__(self, text: str) -> None:
        self.text = text
        try:
            self._re: _Compiled = re2.compile(text, _OPTIONS)
        except re2.error as e:
            raise ValueError(_reason(e)) from None
        self.size = int(self._re.programsize)

    def search(self, s: str) -> bool:
        return self._re.search(s) is not None

    def __repr__(self) -> str:
        return f"Pattern({self.text!r})"


def _reason(e: Exception) -> str:
    arg = e.args[0] if e.args else e
    return arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)


def compile_grant(kind: str, text: str) -> Pattern:
    """nsqd's "unable to compile topic ..." as a ValueError."""
    try:
        return Pattern(text)
    except ValueError as e:
        raise ValueError(f"unable to compile {kind} {json.dumps(text)} {e}") from None


def check_budget(patterns: list[Pattern]) -> None:
    """Refuse an answer whose patterns together exceed MAX_PROGRAM (ValueError)."""
    total = sum(p.size for p in patterns)
    if total > MAX_PROGRAM:
        raise ValueError(f"authorizations too complex: {total} regexp instructions "
                         f"> {MAX_PROGRAM}")
