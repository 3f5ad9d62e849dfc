"""The "prefix" spelling rule (`--spelling prefix`) against a brute force, on a real pair and real German text.

A teacher with a larger vocabulary has whole words the student spells with several tokens. In a 1:1 chunk the
"prefix" rule counts every teacher candidate and every student id toward the longest common spelling that
begins it. The brute force here finds that spelling by scanning every id of both vocabularies (no tables, no
`EventContext.common_prefix`) and sums the teacher's probabilities itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from csd_pipeline.events.batch import SHAPE_1_1
from csd_pipeline.events.row_events import build_row_events
from tests.csd_cases import ACCEPTED, aligned_row, event_context, topk_from_dense

DATA = Path(__file__).resolve().parents[1] / "data"
K = 16


def _spellings(vocab) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab.token_bytes):
        if b and vocab.flags[i] == 0:
            out.setdefault(b, []).append(i)
    return out


@pytest.fixture(scope="module")
def german(tokenizer_path):
    """llama-spm student (32k ids) and qwen2 teacher (151k ids) on German prose, with a dense random teacher
    whose mass is planted on teacher-only words that extend a common spelling."""
    s, t, ctx = event_context(tokenizer_path, "llama-spm", "qwen2")
    lines = (DATA / "debian-reference-de-slice.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [aligned_row(json.loads(line)["text"][:600], s, t, f"de:{i}") for i, line in enumerate(lines[:2])]
    s_sp, t_sp = _spellings(s.vocab), _spellings(t.vocab)
    common = set(s_sp) & set(t_sp)
    extending = np.asarray([i for y, ids in t_sp.items() if y not in common and len(y) > 3 for i in ids])
    rng = np.random.default_rng(0)
    dense = []
    for r in rows:
        logits = rng.normal(size=(len(r["teacher0_ids"]), t.vocab.size)) * 2.0
        logits[:, rng.choice(extending, size=(len(r["teacher0_ids"]), 6))] += 9.0
        logits[np.arange(len(r["teacher0_ids"]) - 1), r["teacher0_ids"][1:]] += 10.0
        logits -= logits.max(axis=1, keepdims=True)  # log-softmax in place: 150k-wide rows, one temporary
        logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
        dense.append(logits)
    return s, t, ctx, rows, dense, s_sp, t_sp, common


def _longest_common(spelling: bytes, common: set) -> bytes | None:
    heads = [spelling[:end] for end in range(1, len(spelling) + 1) if spelling[:end] in common]
    return max(heads, key=len) if heads else None


def _one_to_one(row):
    """(KD chunk index, first student token, first teacher token) of each accepted 1:1 chunk with a predictor."""
    out, s0, t0, k = [], 0, 0, 0
    for m, n, st in zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"], row["teacher0_chunk_status"]):
        if st == ACCEPTED and s0 > 0 and t0 > 0:
            if m == 1 and n == 1:
                out.append((k, s0, t0))
            k += 1
        s0, t0 = s0 + int(m), t0 + int(n)
    return out


def _events(ev, chunk) -> dict[frozenset, float]:
    """Student ids of each event of `chunk` -> its teacher log q (one grouping pass over the chunk's gathers)."""
    events = np.flatnonzero(ev.event_chunk == chunk)
    gathers = np.flatnonzero(np.isin(ev.final_event, events))
    order = gathers[np.argsort(ev.final_event[gathers], kind="stable")]
    bounds = np.searchsorted(ev.final_event[order], np.append(events, events[-1] + 1) if events.size else [0])
    return {frozenset(ev.final_tok[order[bounds[i]:bounds[i + 1]]].tolist()): float(ev.event_teacher_logq[e])
            for i, e in enumerate(events)}


@pytest.mark.slow  # over 5 s: the fast tier keeps make test-fast under 2 minutes
def test_prefix_events_equal_the_brute_force(german):
    s, t, ctx, rows, dense, s_sp, t_sp, common = german
    members: dict[bytes, set] = {}
    for y, ids in s_sp.items():
        head = _longest_common(y, common)
        if head is not None:
            members.setdefault(head, set()).update(ids)
    moved = checked = 0
    for row, d in zip(rows, dense):
        top = topk_from_dense(row, d, K)
        ev = build_row_events(row, 0, top, ctx, spelling="prefix")
        plain = build_row_events(row, 0, top, ctx, spelling="sum")
        for chunk, _s0, t0 in _one_to_one(row):
            ft = t0 - 1
            groups: dict[bytes, list[float]] = {}
            candidates = set(top["ids"][ft].tolist()) | {int(row["teacher0_ids"][t0])}
            for v in candidates:
                head = _longest_common(t.vocab.token_bytes[v], common) if t.vocab.flags[v] == 0 else None
                if head is not None:
                    groups.setdefault(head, []).append(float(d[ft, v]))
            want = {frozenset(members[h]): float(np.logaddexp.reduce(lps)) for h, lps in groups.items()}
            got = _events(ev, chunk)
            assert got.keys() == want.keys()
            for key, logq in want.items():
                assert abs(got[key] - logq) < 1e-9
            checked += 1
            moved += sum(np.exp(list(want.values()))) > sum(np.exp(list(_events(plain, chunk).values()))) + 1e-6
    assert checked > 20
    assert moved > 5, "the planted teacher-only words should move mass into the events"


@pytest.mark.slow  # over 5 s: the fast tier keeps make test-fast under 2 minutes
def test_prefix_events_from_a_dense_teacher_cover_every_id_with_a_common_prefix(german):
    """Dense teacher, 1:1 chunk: the events hold every teacher id with a common prefix, so REST is exactly the
    mass of the ids with none; the top-k events are a subset of the dense ones (same student ids)."""
    s, t, ctx, rows, dense, s_sp, t_sp, common = german
    with_head = {i for y, ids in t_sp.items() if _longest_common(y, common) is not None for i in ids}
    without = np.asarray([i for i in range(t.vocab.size) if i not in with_head])
    for row, d in zip(rows[:1], dense[:1]):
        ev = build_row_events(row, 0, d, ctx, spelling="prefix")
        top = build_row_events(row, 0, topk_from_dense(row, d, K), ctx, spelling="prefix")
        for chunk, _s0, t0 in _one_to_one(row)[:8]:
            events = _events(ev, chunk)
            mass = float(np.exp(list(events.values())).sum())
            rest = float(np.exp(np.logaddexp.reduce(d[t0 - 1, without])))
            assert abs(mass + rest - 1.0) < 1e-9
            assert set(_events(top, chunk)) <= set(events)
    assert int((ev.chunk_shape == SHAPE_1_1).sum()) > 0


def test_prefix_leaves_other_shapes_as_sum(german):
    s, t, ctx, rows, dense, *_ = german
    for row, d in zip(rows, dense):
        top = topk_from_dense(row, d, K)
        ev = build_row_events(row, 0, top, ctx, spelling="prefix")
        plain = build_row_events(row, 0, top, ctx, spelling="sum")
        others = np.flatnonzero(ev.chunk_shape != SHAPE_1_1)
        assert others.size
        for c in others:
            assert _events(ev, c) == _events(plain, c)
