"""Two teachers combined (`--kd-combine sum|select`) against a float64 brute-force reference.

Student llama-spm, teachers smollm2 (49k ids) and gemma3 (262k ids), real text. The reference finds
the groups by itself: each teacher's chunk boundaries as byte offsets of the text (from the
teacher's own token spans), the offsets common to both teachers, the student tokens and teacher
tokens inside each group by their bytes, the teachers' log-likelihoods of each group from their
dense log-probs, and chooses as docs/LOSSES.md says. It then marks the chunks it drops as not
accepted and evaluates `tests.loss_reference.reference_loss` on those rows; the implementation goes
through the loader's path (`build_row_events`, `teacher_select.select_windows`, `collate_events`,
`csd_loss` with the combined chunk count).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import ce_targets, collate_events
from csd_pipeline.events.row_events import build_row_events
from csd_pipeline.events.teacher_select import choose_teachers, chunk_boundaries, select_row, select_windows
from csd_pipeline.loss.csd import csd_loss
from tests.csd_cases import ACCEPTED, MISMATCH, aligned_row, event_context, topk_from_dense
from tests.loss_reference import ReferenceTeacher, ReferenceVocab, reference_loss

DATA = Path(__file__).resolve().parents[1] / "data"
TOL = 1e-10
HIDDEN = 16
TOP_K = 8
TEACHERS = ("smollm2", "gemma3")


def _texts() -> list[str]:
    """Three short real texts: scripture, Python documentation, a translated message."""
    import json

    kjv = (DATA / "kjv-genesis-slice.txt").read_text(encoding="utf-8")[:160]
    docs = (DATA / "python-docs-slice.txt").read_text(encoding="utf-8")[400:560]
    lines = [json.loads(line) for line in open(DATA / "csd-loss-texts.jsonl", encoding="utf-8") if line.strip()]
    return [kjv, docs, lines[2]["text"]]


class Case:
    """Rows aligned with both teachers, random student (h, W) and teacher log-probs (top-k kept)."""

    def __init__(self, tokenizer_path):
        self.s, t0, self.ctx0 = event_context(tokenizer_path, "llama-spm", TEACHERS[0])
        _, t1, self.ctx1 = event_context(tokenizer_path, "llama-spm", TEACHERS[1])
        self.t = (t0, t1)
        self.texts = _texts()
        self.rows = []
        for i, text in enumerate(self.texts):
            row = aligned_row(text, self.s, t0, f"r{i}", teacher_index=0)
            row.update({k: v for k, v in aligned_row(text, self.s, t1, f"r{i}", teacher_index=1).items()
                        if k.startswith("teacher1_")})
            for t, every in ((0, 7), (1, 5)):  # as if the align stage had rejected some chunks: groups
                status = row[f"teacher{t}_chunk_status"]  # that no teacher covers whole
                status[np.flatnonzero(status == ACCEPTED)[every - 1::every]] = MISMATCH
            self.rows.append(row)
        g = torch.Generator().manual_seed(3)
        self.weight = torch.randn(self.s.vocab.size, HIDDEN, generator=g, dtype=torch.float64)
        self.hidden = [0.3 * torch.randn(len(r["student_ids"]), HIDDEN, generator=g, dtype=torch.float64)
                       for r in self.rows]
        # per teacher, per row: top-k rows and the dense log-probs of the observed tokens (the reference's)
        self.topk, self.observed = [[], []], [[], []]
        for i, t in enumerate(self.t):
            for r in self.rows:
                ids = torch.as_tensor(r[f"teacher{i}_ids"].astype(np.int64))
                logits = 2.0 * torch.randn(len(ids), t.vocab.size, generator=g, dtype=torch.float64)
                boost = (torch.rand(len(ids) - 1, generator=g) < 0.6).double() * 12.0
                logits[torch.arange(len(ids) - 1), ids[1:]] += boost
                dense = torch.log_softmax(logits, -1).numpy()
                self.topk[i].append(topk_from_dense(r, dense, TOP_K, teacher_index=i))
                self.observed[i].append(dense[np.arange(len(ids) - 1), ids[1:].numpy()])
        self.offsets = np.cumsum([0] + [len(r["student_ids"]) for r in self.rows])[:-1]

    def row_events(self):
        return [[build_row_events(r, i, t, ctx) for r, t in zip(self.rows, self.topk[i], strict=True)]
                for i, ctx in enumerate((self.ctx0, self.ctx1))]

    def ce(self):
        return ce_targets([r["student_ids"] for r in self.rows], [r["student_loss_mask"] for r in self.rows],
                          self.offsets)


@pytest.fixture(scope="module")
def case(tokenizer_path):
    return Case(tokenizer_path)


# ---------------------------------------------------------------------------------------------
# The reference selection: groups from byte offsets, by brute force


def _token_spans(bundle, text: str) -> list[tuple[int, int]]:
    """(byte start, byte end) of every token of a row: the context token spans (-1, 0), then the text's."""
    ends = [int(e) for e in bundle.encode_spans([text])[0].ends]
    return [(-1, 0)] + [(ends[j - 1] if j else 0, e) for j, e in enumerate(ends)]


def reference_selection(case: Case, r: int) -> list[list[bool]]:
    """Per teacher, per chunk of row r: kept by the select rule (found independently of the implementation)."""
    row, text = case.rows[r], case.texts[r]
    s_spans = _token_spans(case.s, text)
    chunks = []  # per teacher: [(byte start, byte end, is a KD chunk, teacher token indices)]
    for i, t in enumerate(case.t):
        t_spans = _token_spans(t, text)
        mine, tj = [], 0
        for c, (n, status) in enumerate(zip(row[f"teacher{i}_chunk_teacher_len"], row[f"teacher{i}_chunk_status"])):
            tokens = list(range(tj, tj + int(n)))
            tj += int(n)
            start, end = t_spans[tokens[0]][0], t_spans[tokens[-1]][1]
            mine.append((start, end, int(status) == ACCEPTED and c > 0, tokens))
        chunks.append(mine)
    cuts = sorted(set.intersection(*({c[0] for c in mine} | {c[1] for c in mine} for mine in chunks)))
    keep = [[False] * len(mine) for mine in chunks]
    for lo, hi in zip(cuts, cuts[1:]):
        n_student = sum(1 for a, b in s_spans if lo <= a < b <= hi)
        options = []
        for i, mine in enumerate(chunks):
            inside = [c for c, (a, b, _, _) in enumerate(mine) if lo <= a and b <= hi]
            kd = [c for c in inside if mine[c][2]]
            covered = sum(1 for c in kd for a, b in s_spans if mine[c][0] <= a < b <= mine[c][1])
            score = sum(float(case.observed[i][r][j - 1]) for c in kd for j in mine[c][3])
            options.append((covered == n_student and n_student > 0, covered, score, -i, kd))
        if not any(o[1] for o in options):
            continue
        whole = [o for o in options if o[0]]
        best = max(whole, key=lambda o: (o[2], o[3])) if whole else max(options, key=lambda o: (o[1], o[2], o[3]))
        for c in best[4]:
            keep[-best[3]][c] = True
    return keep


def _rows_keeping(case: Case, keep_by_row) -> list[dict]:
    """The rows with every chunk the selection drops marked as not accepted."""
    out = []
    for row, keep in zip(case.rows, keep_by_row, strict=True):
        row = dict(row)
        for i, kept in enumerate(keep):
            status = np.array(row[f"teacher{i}_chunk_status"])
            status[[c for c, k in enumerate(kept) if not k and status[c] == ACCEPTED]] = MISMATCH
            row[f"teacher{i}_chunk_status"] = status
        out.append(row)
    return out


def _reference(case: Case, rows, weights, counts):
    logits = [(h @ case.weight.T).requires_grad_(True) for h in case.hidden]
    teachers = [ReferenceTeacher(ReferenceVocab.from_vocabulary(t.vocab), case.topk[i], weights[i])
                for i, t in enumerate(case.t)]
    ref = reference_loss(logits, rows, ReferenceVocab.from_vocabulary(case.s.vocab), teachers, divergence="kl",
                         global_chunk_counts=counts, teacher_temperature=1.5, beta=2.0)
    ref["loss"].backward()
    return ref, torch.cat([x.grad for x in logits]) @ case.weight


def _implementation(case: Case, events, weights, counts):
    cp, ct = case.ce()
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    out = csd_loss(hidden=h, weight=case.weight, ce_positions=cp, ce_tokens=ct, teachers=events,
                   teacher_weights=weights, global_chunk_counts=counts, divergence="kl", teacher_temperature=1.5,
                   beta=2.0, chunk_size=29)
    out.loss.backward()
    return out, h.grad


def _close(a, b) -> bool:
    a, b = float(a.detach() if hasattr(a, "detach") else a), float(b.detach() if hasattr(b, "detach") else b)
    return abs(a - b) <= TOL * max(1.0, abs(b))


def _assert_matches(out, grad, ref, ref_grad):
    assert _close(out.ce, ref["ce"]) and _close(out.kd, ref["kd"]) and _close(out.loss, ref["loss"])
    assert float((grad - ref_grad).abs().max()) <= TOL * max(1.0, float(ref_grad.abs().max()))


@pytest.mark.slow
def test_weighted_sum_matches_reference(case):
    weights = [0.7, 0.3]
    events = [collate_events(rows, case.offsets) for rows in case.row_events()]
    out, grad = _implementation(case, events, weights, None)
    ref, ref_grad = _reference(case, case.rows, weights, None)
    assert [e.num_chunks for e in events] == ref["chunks"]
    _assert_matches(out, grad, ref, ref_grad)


@pytest.mark.slow
def test_selection_matches_reference_and_differs_from_the_sum(case):
    rows_by_teacher = case.row_events()
    boundaries = [[chunk_boundaries(r, i) for r in case.rows] for i in range(2)]
    selected = select_windows(rows_by_teacher, boundaries)
    keep = [reference_selection(case, r) for r in range(len(case.rows))]
    # the same chunks kept, teacher by teacher and row by row (KD chunks in row order on both sides)
    for i in range(2):
        for r, row in enumerate(case.rows):
            starts = np.concatenate([[0], np.cumsum(row[f"teacher{i}_chunk_student_len"])[:-1]])
            expected = [int(starts[c]) for c, k in enumerate(keep[r][i]) if k]
            assert selected[i][r].chunk_student_start.tolist() == expected
    events = [collate_events(rows, case.offsets) for rows in selected]
    kept = [e.num_chunks for e in events]
    total = sum(kept)
    out, grad = _implementation(case, events, [1.0, 1.0], [total, total])
    ref, ref_grad = _reference(case, _rows_keeping(case, keep), [1.0, 1.0], [total, total])
    assert ref["chunks"] == kept
    _assert_matches(out, grad, ref, ref_grad)
    # both teachers are chosen somewhere, chunks are dropped, and the loss is not the sum's
    full = [sum(e.num_chunks for e in rows) for rows in rows_by_teacher]
    assert all(k > 0 for k in kept) and all(k < f for k, f in zip(kept, full, strict=True))
    assert sum(rows[0].stats["groups_uncovered"] for rows in zip(*selected)) > 0
    summed, _ = _implementation(case, [collate_events(rows, case.offsets) for rows in rows_by_teacher],
                                [0.5, 0.5], None)
    assert abs(float(summed.kd.detach()) - float(out.kd.detach())) > 1e-3 * float(out.kd.detach())


def test_choice_rules_and_ties():
    """Whole coverage first, then the higher score, then the lower index; without a whole cover the most
    covered tokens, then the score, then the index; groups without KD chunks choose nobody."""
    group_len = np.array([3, 3, 3, 3, 2, 2])
    coverage = np.array([[3, 3, 2, 1, 0, 1],
                         [3, 1, 2, 2, 0, 1],
                         [3, 3, 3, 2, 0, 1]])
    score = np.array([[-5.0, -9.0, -1.0, -1.0, 0.0, -3.0],
                      [-4.0, -0.5, -2.0, -3.0, 0.0, -2.0],
                      [-4.0, -9.0, -9.0, -3.0, 0.0, -2.0]])
    assert choose_teachers(coverage, score, group_len).tolist() == [1, 0, 2, 1, -1, 1]


def test_select_row_refuses_rows_of_different_lengths(case):
    events = [rows[0] for rows in case.row_events()]
    short = np.array([0, 1, 2])
    with pytest.raises(CsdError, match="same row"):
        select_row(events, [chunk_boundaries(case.rows[0], 0), short])
