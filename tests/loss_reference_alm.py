"""Float64, dense, brute-force reference of `--loss alm` (Approximate Likelihood Matching), for tests.

Deliberately independent of `csd_pipeline.events.alm_rows` and `loss/alm.py`: chunks come from a plain walk
over the aligned row's chunk lengths and statuses, one chunk at a time in Python; the student's
probabilities from the full softmax of dense logits; the whitespace tokens from a scan of the raw bytes of
each vocabulary (`ReferenceVocab`); the binary cross-entropy is written with the probabilities themselves
(y = p^(1/tau) e^(-eps), log(1 - y) by log1p); gradients come from torch autograd through all of it.
"""

from __future__ import annotations

import math

import numpy as np

from tests.loss_reference import ReferenceVocab

EPSILON = 1e-6  # tokenkit's, subtracted from log p / tau on both sides
SPACE_FLOOR = 1e-6  # the teacher's stored whitespace mass is taken as at least this


def whitespace_ids(vocab: ReferenceVocab) -> np.ndarray:
    """bool [V]: tokens whose first byte is a space, tab or newline, and trusted special tokens."""
    out = np.zeros(len(vocab.token_bytes), dtype=bool)
    for i, b in enumerate(vocab.token_bytes):
        if vocab.special is not None and vocab.special[i]:
            out[i] = True
        elif vocab.usable[i] and b[:1] in (b" ", b"\t", b"\n"):
            out[i] = True
    return out


def bce(p_t, p_s, temperature: float):
    """-(y_T log y_S + (1 - y_T) log(1 - y_S)), y = p^(1/tau) e^(-eps); p_t a float, p_s a 0-dim tensor."""
    import torch

    y_t = (p_t ** (1.0 / temperature)) * math.exp(-EPSILON) if p_t > 0 else 0.0
    y_s = p_s ** (1.0 / temperature) * math.exp(-EPSILON)
    first = y_t * torch.log(y_s) if y_t > 0 else 0.0
    return -(first + (1.0 - y_t) * torch.log1p(-y_s))


def reference_alm_loss(logits: list, rows: list, tops: list, student_vocab: ReferenceVocab,
                       teacher_vocab: ReferenceVocab, *, temperature: float = 100.0, debias: bool = True,
                       chunk_weights=None) -> dict:
    """{"loss", "ce", "kd", "chunks", "p_t", "p_s", "p_t_chunk"}: L = CE + KD (kd scale fixed at 1), both means, float64.

    logits: per row, dense student logits [S, V] (requires_grad for gradients); rows: aligned rows; tops:
    per row the stored teacher top-k dict (ids, logprobs, observed_logprob; optional status). chunk_weights:
    optional fn(log p_T, log p_S detached) -> weight of the chunk's term, from the chunk's own tokens (no
    whitespace terms)."""
    import torch

    ws_s, ws_t = whitespace_ids(student_vocab), whitespace_ids(teacher_vocab)
    ce_sum, kd_sum, ce_count, count, p_ts, p_ss, p_chunk = 0.0, 0.0, 0, 0, [], [], []
    for x, row, top in zip(logits, rows, tops, strict=True):
        probs = torch.softmax(x, dim=-1)
        sid = [int(v) for v in row["student_ids"]]
        tid = [int(v) for v in row["teacher0_ids"]]
        for j in range(1, len(sid)):
            if row["student_loss_mask"][j]:
                ce_sum = ce_sum - torch.log(probs[j - 1, sid[j]])
                ce_count += 1
        if int(top.get("status", 0)):
            continue
        observed = [float(v) for v in top["observed_logprob"]]
        s0 = t0 = 0
        for m, n, status in zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"],
                                row["teacher0_chunk_status"], strict=True):
            m, n = int(m), int(n)
            s, t = s0, t0
            s0, t0 = s0 + m, t0 + n
            if int(status) != 0 or s == 0 or t == 0:
                continue
            p_s = torch.ones((), dtype=torch.float64)
            for r in range(m):
                p_s = p_s * probs[s - 1 + r, sid[s + r]]
            p_t = math.exp(min(sum(observed[t - 1:t + n - 1]), 0.0))
            p_chunk.append(p_t)
            weight = 1.0 if chunk_weights is None else chunk_weights(math.log(p_t), float(torch.log(p_s.detach())))
            if debias:
                p_s = p_s * probs[s + m - 1][torch.as_tensor(ws_s[:probs.shape[1]])].sum()
                last = t + n - 1
                stored = {int(v): math.exp(float(lp)) for v, lp in zip(top["ids"][last], top["logprobs"][last])
                          if math.isfinite(float(lp)) and int(v) >= 0}
                if last + 1 < len(tid) and math.isfinite(observed[last]):
                    stored.setdefault(tid[last + 1], math.exp(observed[last]))
                p_t = p_t * min(max(sum(q for v, q in stored.items() if ws_t[v]), SPACE_FLOOR), 1.0)
            term = bce(p_t, p_s, temperature) * weight
            kd_sum = kd_sum + term
            count += 1
            p_ts.append(p_t)
            p_ss.append(float(p_s.detach()))
    ce = ce_sum / ce_count
    kd = kd_sum / count if count else torch.zeros((), dtype=torch.float64)
    return {"loss": ce + kd, "ce": ce, "kd": kd, "chunks": count, "p_t": p_ts, "p_s": p_ss,
            "p_t_chunk": p_chunk}
