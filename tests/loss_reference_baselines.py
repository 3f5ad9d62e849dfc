"""Float64, dense, brute-force references of the baseline losses (ULD, GOLD, strict), for tests.

Deliberately independent of `csd_pipeline.events.baseline_rows`, `baselines.py` and the tables:

- chunks come from a plain walk over the aligned row's chunk lengths and statuses;
- shared spellings are found by scanning the raw bytes of both vocabularies (`ReferenceVocab.groups`);
- the student's row is the full softmax of dense logits; "its largest entries" come from a full sort
  of the whole row, its tail from what the sort leaves; the divergences are written out term by term;
- gradients come from plain torch autograd through these dense operations.

The formulas are the offline versions that docs/LOSSES.md states (stored top-k plus the observed
token as the teacher's explicit entries, one tail bucket for the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tests.loss_reference import ReferenceVocab

TAIL_FLOOR = 1e-6  # strict: the teacher's tail mass is taken as at least this


@dataclass
class SharedSpellings:
    """Shared spellings of two vocabularies found by scanning: class k has student ids s_ids[s_cls == k]."""

    s_ids: np.ndarray
    s_cls: np.ndarray
    t_ids: np.ndarray
    t_cls: np.ndarray
    count: int
    teacher_of_id: dict  # teacher id -> class


def shared_spellings(s_voc: ReferenceVocab, t_voc: ReferenceVocab) -> SharedSpellings:
    sg, tg = s_voc.groups(), t_voc.groups()
    common = [x for x in sg if x in tg]
    s_ids, s_cls, t_ids, t_cls = [], [], [], []
    for k, x in enumerate(common):
        s_ids += sg[x]
        s_cls += [k] * len(sg[x])
        t_ids += tg[x]
        t_cls += [k] * len(tg[x])
    return SharedSpellings(np.asarray(s_ids), np.asarray(s_cls), np.asarray(t_ids), np.asarray(t_cls), len(common),
                           dict(zip(t_ids, t_cls)))


@dataclass
class Chunk:
    shape: str
    final: int            # student final predictor position
    chain_s: object       # 0-dim tensor: product of the student's chain probabilities
    chain_t: float
    explicit: dict        # teacher id -> probability at the final position (top-k + observed)


def chunks_of(student_probs, row: dict, teacher_row: dict, *, only_1to1: bool = False) -> list[Chunk]:
    """Accepted chunks with a predictor on both sides, walking the chunk lengths."""
    import torch

    sid = [int(x) for x in row["student_ids"]]
    tid = [int(x) for x in row["teacher0_ids"]]
    out, s0, t0 = [], 0, 0
    for m, n, status in zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"],
                            row["teacher0_chunk_status"], strict=True):
        m, n = int(m), int(n)
        start_s, start_t = s0, t0
        s0, t0 = s0 + m, t0 + n
        if int(status) != 0 or start_s == 0 or start_t == 0:
            continue
        shape = "1:1" if m == 1 and n == 1 else "1:N" if m == 1 else "M:1" if n == 1 else "M:N"
        if only_1to1 and shape != "1:1":
            continue
        chain_s = torch.ones((), dtype=torch.float64)
        for r in range(m - 1):
            chain_s = chain_s * student_probs[start_s - 1 + r, sid[start_s + r]]
        observed = np.asarray(teacher_row["observed_logprob"], dtype=np.float64)
        chain_t = math.exp(float(observed[start_t - 1:start_t + n - 2].sum()))
        ft = start_t + n - 2
        explicit = {int(v): math.exp(float(lp)) for v, lp in zip(teacher_row["ids"][ft], teacher_row["logprobs"][ft])
                    if math.isfinite(float(lp))}
        explicit.setdefault(tid[ft + 1], math.exp(float(observed[ft])))
        out.append(Chunk(shape, start_s + m - 2, chain_s, chain_t, explicit))
    return out


def _l1_top_and_tail(student_vec, teacher_values: list[float], teacher_tail: float, chain_t: float):
    """Both sides' |teacher_values| largest entries sorted, plus one tail bucket each; L1."""
    import torch

    k = len(teacher_values)
    s_sorted = torch.sort(student_vec, descending=True).values
    t_sorted = torch.as_tensor(sorted(teacher_values, reverse=True), dtype=torch.float64) * chain_t
    head = (s_sorted[:k] - t_sorted).abs().sum()
    return head + (s_sorted[k:].sum() - chain_t * teacher_tail).abs()


def _terms(a, b, divergence: str):
    """Elementwise divergence terms of teacher values a against student values b (all > 0)."""
    import torch

    if divergence == "kl":
        return a * torch.log(a / b)
    if divergence == "reverse_kl":
        return b * torch.log(b / a)
    m = (a + b) / 2
    return 0.5 * a * torch.log(a / m) + 0.5 * b * torch.log(b / m)


def uld_chunk(probs_row, chunk: Chunk):
    tail = max(0.0, 1.0 - sum(chunk.explicit.values()))
    return _l1_top_and_tail(chunk.chain_s * probs_row, list(chunk.explicit.values()), tail, chunk.chain_t)


def gold_chunk(probs_row, chunk: Chunk, shared: SharedSpellings, divergence: str, weight: float):
    import torch

    classes = {v: shared.teacher_of_id[v] for v in chunk.explicit if v in shared.teacher_of_id}
    matched = sorted(set(classes.values()))
    t_class = torch.zeros(shared.count, dtype=torch.float64)
    for v, k in classes.items():
        t_class[k] += chunk.explicit[v]
    s_class = torch.zeros(shared.count, dtype=torch.float64).index_add(
        0, torch.as_tensor(shared.s_cls), probs_row[torch.as_tensor(shared.s_ids)])
    idx = torch.as_tensor(matched, dtype=torch.int64)
    direct = _terms(chunk.chain_t * t_class[idx], chunk.chain_s * s_class[idx], divergence).sum()
    in_matched = np.isin(shared.s_cls, matched)
    student_keep = torch.ones(len(probs_row), dtype=torch.bool)
    student_keep[torch.as_tensor(shared.s_ids[in_matched], dtype=torch.int64)] = False
    rest = [p for v, p in chunk.explicit.items() if v not in classes]
    tail = max(0.0, 1.0 - sum(chunk.explicit.values()))
    sorted_part = _l1_top_and_tail(chunk.chain_s * probs_row[student_keep], rest, tail, chunk.chain_t)
    return weight * direct + (1 - weight) * sorted_part


def strict_teacher_classes(chunk: Chunk, shared: SharedSpellings, teacher_vocab_size: int) -> np.ndarray:
    """The teacher's value of every shared class: explicit ids as stored, every other id its even share of
    the tail mass (at least TAIL_FLOOR) over the teacher ids outside the explicit entries."""
    tail = max(TAIL_FLOOR, 1.0 - sum(chunk.explicit.values()))
    each = tail / (teacher_vocab_size - len(chunk.explicit))
    values = np.zeros(shared.count)
    for v, k in zip(shared.t_ids.tolist(), shared.t_cls.tolist(), strict=True):
        values[k] += chunk.explicit.get(v, each)
    return values


def strict_chunk(probs_row, chunk: Chunk, shared: SharedSpellings, teacher_vocab_size: int, top_n: int, divergence: str):
    import torch

    s_class = torch.zeros(shared.count, dtype=torch.float64).index_add(
        0, torch.as_tensor(shared.s_cls), probs_row[torch.as_tensor(shared.s_ids)])
    t_class = torch.as_tensor(strict_teacher_classes(chunk, shared, teacher_vocab_size))
    if 0 < top_n < shared.count:
        keep = torch.as_tensor(np.argsort(-s_class.detach().numpy(), kind="stable")[:top_n])
        s_class, t_class = s_class[keep], t_class[keep]
    return _terms(t_class / t_class.sum(), s_class / s_class.sum(), divergence).sum()


def reference_baseline_loss(kind: str, student_logits: list, rows: list[dict], teacher_rows: list[dict],
                            s_voc: ReferenceVocab, t_voc: ReferenceVocab, *, divergence: str = "jsd",
                            gold_matched_weight: float | None = None, strict_top_k: int = 0,
                            strict_divergence: str = "reverse_kl") -> dict:
    """{"loss", "ce", "kd", "chunks"} of a batch (one [Ts, Vs] float64 logits tensor per row), differentiable.

    CE: mean over masked student targets; KD: mean over chunks of the per-chunk loss; L = CE + sg(CE/KD) KD.
    """
    import torch

    shared = shared_spellings(s_voc, t_voc)
    weight = gold_matched_weight
    if weight is None:
        weight = len(shared.t_ids) / len(t_voc.token_bytes)
    ce_sum, n_ce, total, count = torch.zeros((), dtype=torch.float64), 0, torch.zeros((), dtype=torch.float64), 0
    for logits, row, t_row in zip(student_logits, rows, teacher_rows, strict=True):
        probs = torch.softmax(logits.to(torch.float64), dim=-1)
        ids = torch.as_tensor(np.asarray(row["student_ids"], dtype=np.int64))
        targets = torch.nonzero(torch.as_tensor(np.asarray(row["student_loss_mask"], dtype=bool))[1:]).flatten()
        ce_sum = ce_sum - torch.log(probs[targets, ids[targets + 1]]).sum()
        n_ce += int(targets.numel())
        for chunk in chunks_of(probs, row, t_row, only_1to1=kind == "strict"):
            p = probs[chunk.final]
            if kind == "uld":
                total = total + uld_chunk(p, chunk)
            elif kind == "gold":
                total = total + gold_chunk(p, chunk, shared, divergence, weight)
            else:
                total = total + strict_chunk(p, chunk, shared, len(t_voc.token_bytes), strict_top_k, strict_divergence)
            count += 1
    ce = ce_sum / n_ce
    kd = total / count if count else total
    loss = ce if float(kd.detach()) == 0 else ce + (ce / kd).detach() * kd
    return {"loss": loss, "ce": ce, "kd": kd, "chunks": count}
