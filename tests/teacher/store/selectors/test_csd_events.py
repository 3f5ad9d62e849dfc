"""`teacher-logits --keep csd-events`: the entries kept are exactly those the CSD loss reads.

Real tokenizer pairs and real text (`tests/data/csd-loss-texts.jsonl`); a random dense teacher whose
top-16 at each non-1:1 chunk's final position also holds prefix completions (so every shape has
events beyond the observed token). The kept entries are checked against a brute-force definition
(an entry is needed when leaving it out of the top-k changes the row's events), and the events and
the loss read from the kept entries, through the codec, against those of the whole top-k.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from csd_pipeline.events.batch import SHAPE_1_1, SHAPE_1_N, SHAPE_M_1, chunk_shape
from csd_pipeline.events.row_events import ACCEPTED, build_row_events, read_aligned_chunks
from csd_pipeline.teacher.row import TeacherTopkRow
from csd_pipeline.teacher.store.codec import decode_block, encode_block
from csd_pipeline.teacher.store.selectors.csd_events import event_entry_mask, marked_first
from tests.csd_cases import PairCase, topk_from_dense

TOP_K = 16
PAIRS = {"llama-spm/gpt-2": ("llama-spm", "gpt-2", [3, 5, 6, 7]),
         "llama-bpe/qwen2": ("llama-bpe", "qwen2", [0, 1, 2, 3, 4, 7])}
EVENT_FIELDS = ("chain_pos", "chain_tok", "chain_chunk", "final_pos", "final_tok", "final_event", "event_chunk",
                "event_teacher_logq", "chunk_shape", "chunk_student_start", "chunk_student_len",
                "chunk_teacher_loglik")


def _completion_ids(ctx, shape: int, s_prefix: bytes, t_prefix: bytes) -> list[int]:
    """Teacher ids that are events of a 1:N or M:1 chunk besides its observed token (prefix support)."""
    if shape == SHAPE_1_N:
        spellings = [y for _, y in ctx.prefix_support("s2t", t_prefix)]
    elif shape == SHAPE_M_1:
        spellings = [a for a, _ in ctx.prefix_support("t2s", s_prefix)]
    else:
        return []
    return [i for y in spellings for i in ctx.teacher_classes.get(y, ())]


class Case(PairCase):
    """Aligned rows of one pair and, per row, a dense random teacher [T, Vt] and its top-16."""

    def __init__(self, tokenizer_path, pair: str):
        student, teacher, text_ids = PAIRS[pair]
        super().__init__(tokenizer_path, student, teacher, text_ids, hidden=32)
        g = np.random.default_rng(5)
        self.dense, self.topk = [], []
        sb, tb = self.ctx.student_bytes, self.ctx.teacher_bytes
        for row in self.rows:
            t_ids = row["teacher0_ids"].astype(np.int64)
            logits = g.normal(size=(len(t_ids), self.t.vocab.size)) * 2.0
            logits[np.arange(len(t_ids) - 1), t_ids[1:]] += np.where(g.random(len(t_ids) - 1) < 0.7, 14.0, 0.0)
            chunks = read_aligned_chunks(row, 0, self.ctx)
            for c in np.flatnonzero(chunks.status == ACCEPTED):
                m, n = int(chunks.student_len[c]), int(chunks.teacher_len[c])
                s0, t0 = int(chunks.student_start[c]), int(chunks.teacher_start[c])
                shape = chunk_shape(m, n)
                if shape == SHAPE_1_1 or s0 == 0 or t0 == 0:
                    continue
                s_prefix = b"".join(sb[i] for i in chunks.student_ids[s0:s0 + m - 1].tolist())
                t_prefix = b"".join(tb[i] for i in chunks.teacher_ids[t0:t0 + n - 1].tolist())
                extra = _completion_ids(self.ctx, shape, s_prefix, t_prefix)[:5]
                logits[t0 + n - 2, extra] += 12.0  # a few completions among the top-16
            dense = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
                - logits.max(1, keepdims=True)
            self.dense.append(dense)
            self.topk.append(topk_from_dense(row, dense, TOP_K))


@pytest.fixture(scope="module")
def case_of(tokenizer_path):
    return functools.cache(lambda pair: Case(tokenizer_path, pair))


def _without(topk: dict, t: int, j: int) -> dict:
    """The top-k row with entry j of position t left out (the rest of that position moved up)."""
    ids, lp = topk["ids"].copy(), topk["logprobs"].copy()
    ids[t, j:-1], lp[t, j:-1] = ids[t, j + 1:].copy(), lp[t, j + 1:].copy()
    lengths = np.full(len(ids), ids.shape[1], np.int64)
    lengths[t] -= 1
    return dict(topk, ids=ids, logprobs=lp, lengths=lengths)


def _same_events(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in EVENT_FIELDS)


def _round_trip(row: dict, topk: dict, lengths) -> dict:
    """A top-k row through the store's codec, with `lengths` entries per position."""
    observed_ids = np.append(row["teacher0_ids"][1:], -1).astype(np.int64)
    payload = encode_block(topk["ids"], topk["logprobs"], observed_ids, topk["observed_logprob"], lengths)
    ids, logprobs, observed, decoded = decode_block(payload, observed_ids >= 0)
    return {"row_id": topk["row_id"], "ids": ids, "logprobs": logprobs, "observed_logprob": observed,
            "lengths": decoded}


@pytest.mark.parametrize("pair", ["llama-spm/gpt-2", pytest.param("llama-bpe/qwen2", marks=pytest.mark.slow)])
def test_kept_entries_are_those_whose_absence_changes_the_events(case_of, pair):
    """Brute force: at every position and every stored entry but the observed token, the entry is kept
    exactly when the events without it differ (spelling classes summed; the observed token is always
    kept, the loss would read its value from the observed column otherwise)."""
    case = case_of(pair)
    shapes, kept_counts = set(), []
    for row, topk in zip(case.rows, case.topk):
        lengths = np.full(len(topk["ids"]), TOP_K, np.int64)
        mask = event_entry_mask(row, 0, topk["ids"], lengths, case.ctx)
        full = build_row_events(row, 0, topk, case.ctx)
        shapes.update(np.asarray(full.chunk_shape).tolist())
        observed = np.append(row["teacher0_ids"][1:], -1)
        for t in range(len(topk["ids"])):
            for j in range(TOP_K):
                if topk["ids"][t, j] == observed[t]:
                    continue
                changed = not _same_events(full, build_row_events(row, 0, _without(topk, t, j), case.ctx))
                assert bool(mask[t, j]) == changed, (row["row_id"], t, j, int(topk["ids"][t, j]))
        kept_counts.extend(mask.sum(axis=1).tolist())
    assert {SHAPE_1_1, SHAPE_1_N, SHAPE_M_1} <= shapes, shapes  # every shape with candidate events occurs
    assert 0 in kept_counts and max(kept_counts) > 1 and np.mean(kept_counts) < TOP_K


@pytest.mark.parametrize(("pair", "spelling"), [("llama-spm/gpt-2", "exclude"), ("llama-spm/gpt-2", "sum"),
                                                pytest.param("llama-bpe/qwen2", "sum", marks=pytest.mark.slow)])
def test_stored_event_entries_give_the_events_and_loss_of_the_whole_top_k(case_of, pair, spelling):
    """Through the codec: the kept entries (1 to 16 per position) give the same events as the whole
    stored top-16 under both spelling modes, so the same CSD loss and gradient; fewer entries."""
    from csd_pipeline.events.batch import ce_targets, collate_events
    from csd_pipeline.loss.csd import csd_loss

    case = case_of(pair)
    stored, kept_rows, entries, counts = [], [], 0, []
    for row, topk in zip(case.rows, case.topk):
        full = TeacherTopkRow(row["row_id"], topk["ids"].astype(np.int64), topk["logprobs"].astype(np.float32),
                              topk["observed_logprob"].astype(np.float32))
        kept = marked_first(full, event_entry_mask(row, 0, full.ids, full.lengths, case.ctx))
        assert kept.lengths.min() >= 1 and set(np.unique(kept.lengths).tolist()) > {1}
        for t, n in enumerate(kept.lengths.tolist()):  # the kept entries are a subsequence, most likely first
            assert set(kept.ids[t, :n].tolist()) <= set(full.ids[t].tolist())
            assert np.all(np.diff(kept.logprobs[t, :n]) <= 0)
        stored.append(_round_trip(row, topk, None))
        kept_rows.append(_round_trip(row, {**topk, "ids": kept.ids, "logprobs": kept.logprobs}, kept.lengths))
        assert kept_rows[-1]["lengths"].tolist() == kept.lengths.tolist()
        entries += int(kept.lengths.sum())
        counts.extend(kept.lengths.tolist())
    assert 1 in counts and entries < TOP_K * len(counts)
    offsets = case.offsets(case.rows)
    results = []
    for teachers in (stored, kept_rows):
        rows_events = [build_row_events(r, 0, t, case.ctx, spelling=spelling) for r, t in zip(case.rows, teachers)]
        batch = collate_events(rows_events, offsets)
        cp, ct = ce_targets([r["student_ids"] for r in case.rows], [r["student_loss_mask"] for r in case.rows], offsets)
        h = torch.randn(int(offsets[-1] + len(case.rows[-1]["student_ids"])), 32,
                        generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_(True)
        out = csd_loss(hidden=h, weight=case.weight, ce_positions=cp, ce_tokens=ct, teachers=[batch], divergence="kl")
        out.loss.backward()
        results.append((batch, float(out.loss.detach()), h.grad))
    (a, loss_a, grad_a), (b, loss_b, grad_b) = results
    assert a.num_chunks > 0 and _same_events(a, b)
    assert loss_a == loss_b and torch.equal(grad_a, grad_b)


def test_the_selector_declares_its_part_and_reads_it_back(trainer_data):
    """`--keep csd-events` as a selector: the tables' sha256 in the identity (read back from a manifest's config
    as the same selector), csd.keep in the metadata, not exact, the writer's scope; a copy for a worker process
    carries no tables loaded, and its row cut is `event_selector` with the aligned tables."""
    import pickle

    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.runtime.files import file_sha256
    from csd_pipeline.teacher.store.selectors import CsdEvents, chain_from_config

    aligned = AlignedOutput.open(trainer_data["train_short"])
    chain = chain_from_config({"top_k": 8, "keep": "csd-events", "teacher_index": 0}, aligned)
    events = chain.selectors[-1]
    sha = [file_sha256(path) for path in aligned.tables(0)]
    assert chain.names == ["top-k", "csd-events"] and chain.reads_aligned and events.reads_aligned
    assert events.identity() == {"keep": "csd-events", "tables_sha256": sha} and not events.exact
    assert events.metadata() == {b"csd.keep": b"csd-events"} and "--keep csd-events" in events.inexact
    recorded = chain_from_config({"top_k": 8, "top_p": None, **chain.identity(), "teacher_index": 0})
    assert recorded == chain and isinstance(recorded.selectors[-1], CsdEvents)
    assert chain_from_config({"top_k": 8, "keep": "top-k"}, aligned).names == ["top-k"]
    shard = aligned.shards[0]
    aligned_rows = aligned.read(shard, aligned.training_columns([0])).to_pylist()
    select = chain.row_cut(aligned_rows)
    assert "_context" in events.__dict__ and "_context" not in pickle.loads(pickle.dumps(events)).__dict__
    _, rows = aligned.teacher_rows(shard, 0)
    vocab = events.event_context().teacher_bytes
    rng = np.random.default_rng(0)
    for index, ids in enumerate(rows[:4]):
        top = rng.integers(0, len(vocab), size=(len(ids), TOP_K)).astype(np.int32)
        logprobs = np.sort(-np.abs(rng.normal(6, 2, size=(len(ids), TOP_K))), axis=1)[:, ::-1].astype(np.float32)
        row = TeacherTopkRow(None, top, logprobs, np.full(len(ids), -3.0, np.float32))
        mask = event_entry_mask(aligned_rows[index], 0, top, row.lengths, events.event_context())
        expected = marked_first(row, mask)
        got = select(index, row)
        np.testing.assert_array_equal(got.ids, expected.ids)
        np.testing.assert_array_equal(got.lengths, expected.lengths)
