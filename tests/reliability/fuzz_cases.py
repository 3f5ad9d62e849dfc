"""The harness of the reader fuzz tests (tests/reliability/test_fuzz_*.py, issue 35 item 2).

Each test builds one valid input from real small data, then hypothesis mutates its bytes (truncation,
bit flips, invalid UTF-8) or, for JSON, its values (wrong types, huge or negative numbers, deep nesting,
duplicate keys, paths in every field). Every example must end in one of two ways:

- refused: a `CsdError` whose one-line message names the file (`Outcomes.refused`, counted by reason);
- read: the values the reader gives equal those of the unmutated input.

Anything else fails the example: another exception type, a read slower than `EXAMPLE_SECONDS` (a
`signal.setitimer` alarm interrupts it), a resident-memory high-water mark growing by more than
`MEMORY_LIMIT`, or a silently different value. `CSD_FUZZ_REPORT=FILE` appends each test's counts as one JSON
line (what docs/RELIABILITY.md's fuzzing table is made from). The slow tier (`-m slow`) runs `SLOW_EXAMPLES`
examples per reader (`COSTLY_SLOW_EXAMPLES` for the tokenizer files), the fast tier `FAST_EXAMPLES`; both are derandomized (the same examples on every run)
unless `CSD_FUZZ_RANDOM=1`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import time
from collections import Counter
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csd_pipeline.errors import CsdError

FAST_EXAMPLES = 15
SLOW_EXAMPLES = int(os.environ.get("CSD_FUZZ_EXAMPLES", 300))  # a longer hunt: CSD_FUZZ_EXAMPLES=5000 CSD_FUZZ_RANDOM=1
EXAMPLE_SECONDS = 30
MEMORY_LIMIT = 1 << 30

_COMMON = dict(deadline=None, derandomize=not os.environ.get("CSD_FUZZ_RANDOM"), database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
FAST = settings(max_examples=FAST_EXAMPLES, **_COMMON)
SLOW = settings(max_examples=SLOW_EXAMPLES, **_COMMON)
# each reader's test runs at both: `@pytest.mark.parametrize("settings", SPEEDS)` (slow: the slow tier)
SPEEDS = [pytest.param(FAST, id="fast"), pytest.param(SLOW, id="slow", marks=pytest.mark.slow)]
# readers whose every read example costs a whole tokenizer load (~0.1 s): fewer slow-tier examples, unless
# CSD_FUZZ_EXAMPLES asks for a number (the test suite's time budget, issue 41)
COSTLY_SLOW_EXAMPLES = int(os.environ.get("CSD_FUZZ_EXAMPLES", 100))
COSTLY_SPEEDS = [pytest.param(FAST, id="fast"),
                 pytest.param(settings(max_examples=COSTLY_SLOW_EXAMPLES, **_COMMON), id="slow", marks=pytest.mark.slow)]

PATHS = ["../../etc/passwd", "/etc/passwd", "part-00000-00000.parquet/../../x", "", ".", "..", "a\x00b",
         "~/x", "done/../../../x", "tables/../../escape.safetensors"]
WRONG_VALUES = [None, True, False, 0, -1, -(2**63), 2**64, 10**30, 1e308, -1e308, 0.5, "", "x", "9" * 40, [], {},
                [1, 2], {"a": 1}, "\u00e9\u4e2d\U0001f600", "\ud800" * 0]


class ExampleTimeout(BaseException):
    """Raised by the alarm when one example runs past `EXAMPLE_SECONDS` (a hang)."""


@contextmanager
def deadline(seconds: float = EXAMPLE_SECONDS):
    """Interrupt the block (ExampleTimeout) when it runs longer than `seconds`."""
    def on_alarm(signum, frame):
        raise ExampleTimeout(f"one example ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Outcomes:
    """What the examples of one reader ended in: read with equal values, or refused (by reason)."""

    def __init__(self, reader: str, reasons: dict[str, str]):
        self.reader, self.reasons = reader, reasons
        self.counts: Counter = Counter()
        self.started = time.monotonic()

    def reason(self, message: str) -> str:
        for name, pattern in self.reasons.items():
            if re.search(pattern, message):
                return name
        return "other: " + message[:90]

    def check(self, read, names: tuple[str, ...], expected, values=lambda result: result, mutation: str = "",
              *, other_ok=None):
        """Run `read()`; refused with a CsdError naming one of `names`, or `values(result) == expected`.

        `other_ok(result)` may accept a result that is neither (e.g. a marker ignored: the shard is redone),
        returning the outcome's name."""
        before = max_rss()
        try:
            with deadline():
                result = read()
                got = values(result)
        except CsdError as err:
            message = str(err)
            assert "\n" not in message, message
            assert any(name in message for name in names), (names, message)
            self.counts[f"refused: {self.reason(message)}"] += 1
            self.counts[f"mutation {mutation}"] += 1
            return "refused"
        finally:
            grown = max_rss() - before
            assert grown < MEMORY_LIMIT, f"{self.reader}: one example grew memory by {grown >> 20} MiB"
        self.counts[f"mutation {mutation}"] += 1
        if got == expected:
            self.counts["read: same values"] += 1
            return "same"
        kind = other_ok(result) if other_ok else None
        assert kind, f"{self.reader}: a mutated input ({mutation}) read as different values"
        self.counts[kind] += 1
        return kind

    def report(self) -> None:
        total = sum(n for key, n in self.counts.items() if key.startswith("mutation "))
        assert total, f"{self.reader}: no example ran"
        target = os.environ.get("CSD_FUZZ_REPORT")
        if target:
            with open(target, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"reader": self.reader, "examples": total,
                                         "seconds": round(time.monotonic() - self.started, 1),
                                         "counts": dict(sorted(self.counts.items()))}) + "\n")


# ---------------------------------------------------------------------------------------------
# Mutations of bytes


def truncated(data: bytes, cut: int) -> bytes:
    return data[:cut % max(1, len(data))]


def flipped(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, bit in flips:
        out[position % len(out)] ^= 1 << bit
    return bytes(out)


def byte_mutations(data: bytes):
    """(name, mutated bytes): a truncation, 1-3 bit flips, or invalid UTF-8 bytes put in or over."""
    flips = st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 7)), min_size=1, max_size=3)
    invalid = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xfe\xff"])
    return st.one_of(
        st.integers(0, len(data) - 1).map(lambda cut: ("truncation", truncated(data, cut))),
        flips.map(lambda f: ("bit flips", flipped(data, f))),
        st.tuples(st.integers(0, len(data)), invalid).map(
            lambda pi: ("invalid utf-8", data[:pi[0]] + pi[1] + data[pi[0] + len(pi[1]):])),
    )


# ---------------------------------------------------------------------------------------------
# Mutations of JSON values


def json_paths(value, prefix=()) -> list[tuple]:
    """Every path (tuple of keys / indices) into a JSON value, the root included, at most 400."""
    paths = [prefix]
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        paths += json_paths(child, (*prefix, key))
        if len(paths) > 400:
            break
    return paths[:400]


def replaced(value, path: tuple, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


def at(value, path: tuple):
    for key in path:
        value = value[key]
    return value


DEEP = "__csd_fuzz_deep__"
DUPLICATE = "__csd_fuzz_duplicate__"


def json_text(value, depth: int = 0, duplicate_of: str | None = None) -> str:
    text = json.dumps(value, sort_keys=False, indent=2, ensure_ascii=False)
    if depth:
        text = text.replace(json.dumps(DEEP), "[" * depth + "]" * depth)
    if duplicate_of is not None:
        text = text.replace(json.dumps(DUPLICATE), json.dumps(duplicate_of), 1)
    return text


def json_mutations(original):
    """(name, mutated JSON bytes) for a parsed JSON value: a wrong type or a huge / negative number or a path
    at any place, a deeply nested array there, or a duplicate key with another value in any object."""
    paths = json_paths(original)
    objects = [p for p in paths if isinstance(at(original, p), dict) and at(original, p)]

    def wrong(args):
        path, new = args
        return ("wrong type or value" if not isinstance(new, str) or new not in PATHS else "path in a field",
                json_text(replaced(original, path, new)).encode("utf-8"))

    def huge_digits(args):
        path, digits = args
        return "huge number", json_text(replaced(original, path, DEEP)).replace(
            json.dumps(DEEP), "-" * (digits % 2) + "9" * digits).encode("utf-8")

    def deep(args):
        path, depth = args
        return "deep nesting", json_text(replaced(original, path, DEEP), depth=depth).encode("utf-8")

    def duplicate(args):
        path, index, new = args
        obj = at(original, path)
        key = sorted(obj)[index % len(obj)]
        mutated = replaced(original, path, {**obj, DUPLICATE: new if new != obj[key] else [obj[key]]})
        return "duplicate key", json_text(mutated, duplicate_of=key).encode("utf-8")

    where = st.sampled_from(paths)
    strategies = [
        st.tuples(where, st.sampled_from(WRONG_VALUES + PATHS)).map(wrong),
        st.tuples(where, st.integers(400, 6000)).map(huge_digits),
        st.tuples(where, st.sampled_from([600, 5000, 200_000])).map(deep),
    ]
    if objects:
        strategies.append(st.tuples(st.sampled_from(objects), st.integers(0, 1000),
                                    st.sampled_from(WRONG_VALUES + PATHS)).map(duplicate))
    return st.one_of(*strategies)


def json_file_mutations(data: bytes):
    """Byte mutations and value mutations of a JSON file's bytes."""
    return st.one_of(byte_mutations(data), json_mutations(json.loads(data)))


def run(examples, outcomes: Outcomes, data: bytes, strategy, example, **more) -> None:
    """Call `example(kind, mutated, **drawn)` on each of `examples` (FAST or SLOW) mutations of `data` that
    `strategy` draws (`more`: further strategies, drawn alongside), then report the outcomes."""

    @examples
    @given(mutation=strategy(data), **more)
    def wrapped(mutation, **drawn):
        example(*mutation, **drawn)

    wrapped()
    outcomes.report()
