"""CSD events from tables and teacher top-k, on real tokenizer pairs and real text (SPEC §5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import SHAPE_1_1, SHAPE_1_N, SHAPE_M_1, SHAPE_M_N, ce_targets, collate_events
from csd_pipeline.events.context import EventContext
from csd_pipeline.events.row_events import build_row_events
from tests.csd_cases import ACCEPTED, aligned_row, bundle, event_context, load_texts, topk_from_dense

DATA = Path(__file__).resolve().parents[1] / "data"
K = 8


@pytest.fixture(scope="module")
def spm(tokenizer_path):
    """llama-spm student (byte-fallback duplicate spellings) and gpt-2 teacher on real text."""
    s, t, ctx = event_context(tokenizer_path, "llama-spm", "gpt-2")
    texts = load_texts(DATA / "csd-loss-texts.jsonl")
    rows = [aligned_row(texts[i]["text"], s, t, f"csd-loss-texts:{i}") for i in (3, 5, 6, 7)]
    rng = np.random.default_rng(0)
    dense = []
    for r in rows:
        logits = rng.normal(size=(len(r["teacher0_ids"]), t.vocab.size)) * 2.0
        logits[np.arange(len(r["teacher0_ids"]) - 1), r["teacher0_ids"][1:]] += 12.0
        dense.append(logits - np.logaddexp.reduce(logits, axis=1, keepdims=True))
    return s, t, ctx, rows, dense


def _chunks(row):
    """(chunk index among KD chunks, s0, t0, M, N) of every accepted chunk with a predictor."""
    out = []
    s0 = t0 = 0
    for m, n, st in zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"], row["teacher0_chunk_status"]):
        if st == ACCEPTED and s0 > 0 and t0 > 0:
            out.append((len(out), s0, t0, int(m), int(n)))
        s0 += int(m)
        t0 += int(n)
    return out


def _events_of(ev, chunk):
    return np.flatnonzero(ev.event_chunk == chunk)


def _final_ids(ev) -> list[list[int]]:
    """Student final-token ids of every event (grouped once, not one scan per event)."""
    order = np.argsort(ev.final_event, kind="stable")
    bounds = np.searchsorted(ev.final_event[order], np.arange(ev.num_events + 1))
    toks = ev.final_tok[order]
    return [toks[bounds[e] : bounds[e + 1]].tolist() for e in range(ev.num_events)]


def test_dense_events_follow_the_tables(spm):
    """Dense teacher: 1:1 = all common spellings, 1:N / M:1 = prefix support, M:N = observed only."""
    s, t, ctx, rows, dense = spm
    sb, tb = s.vocab.token_bytes, t.vocab.token_bytes
    seen = set()
    for row, d in zip(rows, dense):
        ev = build_row_events(row, 0, d, ctx)
        sid, tid = row["student_ids"], row["teacher0_ids"]
        for c, s0, t0, m, n in _chunks(row):
            events = _events_of(ev, c)
            shape = int(ev.chunk_shape[c])
            seen.add(shape)
            s_prefix = b"".join(sb[i] for i in sid[s0 : s0 + m - 1])
            t_prefix = b"".join(tb[i] for i in tid[t0 : t0 + n - 1])
            if shape == SHAPE_1_1:
                assert len(events) == len(ctx.s2t.common_spellings())
            elif shape == SHAPE_1_N:
                assert m == 1 and len(events) == len(ctx.s2t.prefix_support(t_prefix)) >= 1
            elif shape == SHAPE_M_1:
                assert n == 1 and len(events) == len(ctx.t2s.prefix_support(s_prefix)) >= 1
            else:
                assert shape == SHAPE_M_N and len(events) == 1
            # Chain gathers: the student's fixed prefix, predicted from the positions before it.
            chain = ev.chain_chunk == c
            assert ev.chain_pos[chain].tolist() == list(range(s0 - 1, s0 + m - 2))
            assert ev.chain_tok[chain].tolist() == sid[s0 : s0 + m - 1].tolist()
            # Every final gather sits at the last predictor position; the observed token is one of them.
            finals = np.isin(ev.final_event, events)
            assert set(ev.final_pos[finals].tolist()) == {s0 + m - 2}
            obs_event = ev.final_event[finals & (ev.final_tok == sid[s0 + m - 1])]
            assert len(obs_event) == 1
            # Its teacher log q is the chain plus the observed final token's class.
            chain_t = sum(d[t0 - 1 + r, tid[t0 + r]] for r in range(n - 1))
            t_class = list(ctx.teacher_classes[tb[tid[t0 + n - 1]]])
            expected = chain_t + np.logaddexp.reduce(d[t0 + n - 2, t_class])
            assert abs(ev.event_teacher_logq[obs_event[0]] - expected) < 1e-9
    assert seen == {SHAPE_1_1, SHAPE_1_N, SHAPE_M_1, SHAPE_M_N}


@pytest.mark.slow
def test_topk_events_are_stored_candidates_plus_observed(spm):
    s, t, ctx, rows, dense = spm
    sb, tb = s.vocab.token_bytes, t.vocab.token_bytes
    for row, d in zip(rows, dense):
        top = topk_from_dense(row, d, K)
        ev = build_row_events(row, 0, top, ctx)
        full = build_row_events(row, 0, d, ctx)
        ev_ids, full_ids = _final_ids(ev), _final_ids(full)
        sid, tid = row["student_ids"], row["teacher0_ids"]
        for c, s0, t0, m, n in _chunks(row):
            events = _events_of(ev, c)
            assert 1 <= len(events) <= K + 1
            ft = t0 + n - 2
            allowed = {tb[v] for v in top["ids"][ft]} | {tb[tid[t0 + n - 1]]}
            # Each explicit event's teacher probability is the sum over its stored candidates only.
            for e in events:
                x = sb[ev_ids[e][0]]
                s_prefix = b"".join(sb[i] for i in sid[s0 : s0 + m - 1])
                t_prefix = b"".join(tb[i] for i in tid[t0 : t0 + n - 1])
                y = (s_prefix + x)[len(t_prefix) :]
                assert y in allowed
                stored = [v for v in set(top["ids"][ft].tolist()) | {int(tid[t0 + n - 1])} if tb[v] == y]
                chain = sum(top["observed_logprob"][t0 - 1 + r] for r in range(n - 1))
                assert abs(ev.event_teacher_logq[e] - (chain + np.logaddexp.reduce(d[ft, stored]))) < 1e-9
            # The top-k events are a subset of the dense events of the same chunk (same student ids).
            dense_events = {tuple(sorted(full_ids[e])) for e in _events_of(full, c)}
            for e in events:
                assert tuple(sorted(ev_ids[e])) in dense_events


@pytest.mark.slow
def test_spelling_classes_sum_or_exclude(spm):
    """llama-spm spells single bytes twice (`.` and `<0x2E>`): summed into one event, or sent to REST."""
    s, t, ctx, rows, dense = spm
    multi = {b for b, ids in ctx.student_classes.items() if len(ids) > 1}
    assert multi, "llama-spm should have byte-fallback duplicates"
    found_observed_multi = False
    for row, d in zip(rows, dense):
        summed = build_row_events(row, 0, d, ctx, spelling="sum")
        excluded = build_row_events(row, 0, d, ctx, spelling="exclude")
        assert summed.num_chunks == excluded.num_chunks
        sum_ids, exc_ids = _final_ids(summed), _final_ids(excluded)
        sid = row["student_ids"]
        for c, s0, _t0, m, _n in _chunks(row):
            u_obs = int(sid[s0 + m - 1])
            x = s.vocab.token_bytes[u_obs]
            ids_sum = [sum_ids[e] for e in _events_of(summed, c)]
            ids_exc = [exc_ids[e] for e in _events_of(excluded, c)]
            # Sum: each event holds the whole spelling class; exclude: only single-id events (+ observed).
            classes = ctx.student_classes
            assert all(sorted(ids) == list(classes[s.vocab.token_bytes[ids[0]]]) for ids in ids_sum)
            assert all(len(ids) == 1 for ids in ids_exc)
            assert [u_obs] in ids_exc
            if x in multi:
                found_observed_multi = True
                assert sorted(ctx.student_classes[x]) in [sorted(i) for i in ids_sum]
            if int(summed.chunk_shape[c]) == SHAPE_1_1:
                assert len(ids_exc) < len(ids_sum)
    assert found_observed_multi


def test_only_1to1_and_no_predictor(spm):
    s, t, ctx, rows, dense = spm
    row, d = rows[0], dense[0]
    full = build_row_events(row, 0, d, ctx)
    only = build_row_events(row, 0, d, ctx, only_1to1=True)
    assert set(only.chunk_shape.tolist()) == {SHAPE_1_1}
    assert only.num_chunks + only.stats["chunks_not_1to1"] == full.num_chunks
    # A chunk at the very start of a row has no predictor: skipped and counted, never an error.
    first = next(c for c, st in enumerate(row["teacher0_chunk_status"]) if st == ACCEPTED)
    cut_s = int(row["teacher0_chunk_student_len"][:first].sum())
    cut_t = int(row["teacher0_chunk_teacher_len"][:first].sum())
    bare = dict(row, student_ids=row["student_ids"][cut_s:], teacher0_ids=row["teacher0_ids"][cut_t:])
    bare["student_loss_mask"] = row["student_loss_mask"][cut_s:]
    for key in ("teacher0_chunk_student_len", "teacher0_chunk_teacher_len", "teacher0_chunk_status"):
        bare[key] = row[key][first:]
    ev = build_row_events(bare, 0, d[cut_t:], ctx)
    assert ev.stats["chunks_no_predictor"] == 1 and ev.num_chunks == full.num_chunks - 1


def test_collate_and_ce_targets(spm):
    s, t, ctx, rows, dense = spm
    evs = [build_row_events(r, 0, topk_from_dense(r, d, K), ctx) for r, d in zip(rows, dense)]
    offsets = [0, 1000, 2000, 3000]
    batch = collate_events(evs, offsets)
    assert batch.num_chunks == sum(e.num_chunks for e in evs)
    assert batch.num_events == sum(e.num_events for e in evs)
    c0 = e0 = 0
    for i, e in enumerate(evs):
        sl = slice(c0, c0 + e.num_chunks)
        assert batch.chunk_shape[sl].tolist() == e.chunk_shape.tolist()
        rows_of = np.isin(batch.event_chunk, np.arange(c0, c0 + e.num_chunks))
        assert np.array_equal(batch.event_teacher_logq[rows_of], e.event_teacher_logq)
        mine = (batch.final_event >= e0) & (batch.final_event < e0 + e.num_events)
        assert np.array_equal(batch.final_pos[mine], e.final_pos + offsets[i])
        c0 += e.num_chunks
        e0 += e.num_events
    assert batch.shape_counts() == np.bincount(batch.chunk_shape, minlength=4).tolist()
    mask = [np.asarray([False, True, False, True, True]), np.asarray([True, True, True])]
    ids = [np.asarray([5, 6, 7, 8, 9]), np.asarray([1, 2, 3])]
    pos, tok = ce_targets(ids, mask, [0, 10])
    # Position p predicts token p+1 where the mask of p+1 is true.
    assert pos.tolist() == [0, 2, 3, 10, 11] and tok.tolist() == [6, 8, 9, 2, 3]


# ------------------------------------------------------------------------------------------------
# Bad input: a clear CsdError naming the row / file and the stage to re-run


def _first_chunk_of_shape(row, shape_pred):
    for _c, s0, t0, m, n in _chunks(row):
        if shape_pred(m, n):
            return s0, t0, m, n
    raise AssertionError("no such chunk")


def test_tables_of_other_tokenizers_are_refused(tokenizer_path, spm):
    s, t, ctx, rows, dense = spm
    qwen = bundle(tokenizer_path, "qwen2")
    with pytest.raises(CsdError, match="tables build"):
        EventContext(ctx.s2t, ctx.t2s, s.vocab, qwen.vocab)
    with pytest.raises(CsdError, match="another"):
        EventContext(ctx.s2t, ctx.s2t)


def test_teacher_shards_of_another_alignment_are_refused(spm):
    s, t, ctx, rows, dense = spm
    top = topk_from_dense(rows[1], dense[1], K)
    with pytest.raises(CsdError, match="teacher-logits"):
        build_row_events(rows[0], 0, top, ctx, source="part-00000-00000.parquet")
    short = {**topk_from_dense(rows[0], dense[0], K), "row_id": rows[0]["row_id"]}
    short = {k: (v[:-1] if k != "row_id" else v) for k, v in short.items()}
    with pytest.raises(CsdError, match="teacher-logits"):
        build_row_events(rows[0], 0, short, ctx)
    # A row the teacher-logits stage rejected (status NON_FINITE, empty arrays): no KD events.
    rejected = {"row_id": rows[0]["row_id"], "ids": np.zeros((0, K)), "logprobs": np.zeros((0, K)),
                "observed_logprob": np.zeros(0), "status": 1}
    ev = build_row_events(rows[0], 0, rejected, ctx)
    assert ev.num_chunks == 0 and ev.stats["rows_teacher_rejected"] == 1
    nan = topk_from_dense(rows[0], dense[0], K)
    s0, t0, m, n = _first_chunk_of_shape(rows[0], lambda m, n: n > 1)
    nan["observed_logprob"][t0 - 1] = np.nan
    with pytest.raises(CsdError, match=r"row csd-loss-texts:3.*teacher-logits"):
        build_row_events(rows[0], 0, nan, ctx)


def test_chunks_that_contradict_the_tables_are_refused(spm):
    s, t, ctx, rows, dense = spm
    row = rows[1]
    top = topk_from_dense(row, dense[1], K)
    # The observed student token of a 1:1 chunk replaced: the chunk's bytes differ between sides.
    s0, t0, m, n = _first_chunk_of_shape(row, lambda m, n: m == 1 and n == 1)
    bad = dict(row, student_ids=row["student_ids"].copy())
    bad["student_ids"][s0] = s.vocab.spellings()[b"zz"][0] if b"zz" in s.vocab.spellings() else 100
    with pytest.raises(CsdError, match=r"row csd-loss-texts:5 of part-00003-00001.parquet.*align"):
        build_row_events(bad, 0, top, ctx, source="part-00003-00001.parquet")
    # The observed teacher token of a 1:N chunk does not extend the recorded teacher prefix.
    s0, t0, m, n = _first_chunk_of_shape(row, lambda m, n: m == 1 and n > 1)
    bad = dict(row, teacher0_ids=row["teacher0_ids"].copy())
    bad["teacher0_ids"][t0 + n - 1] = t.vocab.spellings()[b"Q"][0]
    with pytest.raises(CsdError, match="spells"):
        build_row_events(bad, 0, topk_from_dense(bad, dense[1], K), ctx)
    # Chunk lengths that do not cover the row.
    bad = dict(row, teacher0_chunk_student_len=row["teacher0_chunk_student_len"].copy())
    bad["teacher0_chunk_student_len"][-1] += 1
    with pytest.raises(CsdError, match="align"):
        build_row_events(bad, 0, top, ctx)
    # An accepted chunk with no token on one side.
    bad = dict(row)
    for key in ("teacher0_chunk_student_len", "teacher0_chunk_teacher_len", "teacher0_chunk_status"):
        bad[key] = np.append(row[key], 0)
    bad["teacher0_chunk_teacher_len"] = bad["teacher0_chunk_teacher_len"].copy()
    bad["teacher0_chunk_teacher_len"][-1] = 0
    bad["teacher0_chunk_student_len"][-1] = 0
    with pytest.raises(CsdError, match="both sides"):
        build_row_events(bad, 0, top, ctx)
    with pytest.raises(CsdError, match="spelling"):
        build_row_events(row, 0, top, ctx, spelling="mean")
