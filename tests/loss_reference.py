"""A float64, dense, brute-force reference of the CSD loss (SPEC §5), for tests and `make check`.

Deliberately independent of `events.py`, `tables.py` and `loss.py`:

- events are enumerated per chunk by scanning every token id of both vocabularies and comparing
  raw byte strings (no sub-token table, no prefix index);
- the student's distribution is the full softmax of dense logits [T, V]; probabilities (not
  log-probabilities) are multiplied along the chain, REST is 1 - sum, and D is evaluated on the
  explicit (K+1)-vectors;
- gradients come from plain torch autograd through these dense operations.

It is slow (O(V) Python work per chunk) and meant for a handful of chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.csd import REVERSE_KL_TEACHER_REST_FLOOR


@dataclass
class ReferenceVocab:
    """Raw bytes of one vocabulary; `usable[i]` is False for specials / untrusted ids."""

    token_bytes: list[bytes]
    usable: np.ndarray
    special: np.ndarray | None = None  # trusted special tokens (matched by role, never by spelling)
    _groups: dict | None = field(default=None, repr=False)

    @classmethod
    def from_vocabulary(cls, vocab) -> ReferenceVocab:
        special = np.asarray(vocab.is_special) & ~np.asarray(vocab.untrusted)
        return cls(list(vocab.token_bytes), np.asarray(vocab.flags) == 0, special)

    def groups(self) -> dict[bytes, list[int]]:
        """Spelling -> ids, by one scan over every id (its own brute-force spelling classes)."""
        if self._groups is None:
            groups: dict[bytes, list[int]] = {}
            for i, b in enumerate(self.token_bytes):
                if b and self.usable[i]:
                    groups.setdefault(b, []).append(i)
            self._groups = groups
        return self._groups


@dataclass
class ReferenceTeacher:
    """One teacher: its vocabulary, per row either dense log-probs [Tt, Vt] or a top-k dict
    (ids [Tt,k], logprobs [Tt,k], observed_logprob [Tt]), and its KD weight."""

    vocab: ReferenceVocab
    rows: list[Any]
    weight: float = 1.0


_PAIR_CACHE: dict = {}


@dataclass
class _Pairs:
    """Enumerated spelling pairs of a chunk as flat id arrays (pair k: its student and teacher ids)."""

    pairs: list  # [(student spelling, teacher spelling)]
    s_ids: np.ndarray  # flat student ids
    s_pair: np.ndarray  # pair index of each
    t_ids: np.ndarray
    t_pair: np.ndarray
    s_size: np.ndarray  # ids per pair
    t_size: np.ndarray


def _chunk_spelling_pairs(s_voc: ReferenceVocab, t_voc: ReferenceVocab, shape: str, s_prefix: bytes, t_prefix: bytes, obs):
    """All (student spelling, teacher spelling) that complete the chunk identically, by scanning."""
    key = (id(s_voc), id(t_voc), shape, s_prefix if shape == "M:1" else b"", t_prefix if shape == "1:N" else b"", obs if shape == "M:N" else None)
    if key not in _PAIR_CACHE:
        if len(_PAIR_CACHE) > 256:
            _PAIR_CACHE.clear()
        pairs = _scan_spelling_pairs(s_voc, t_voc, shape, s_prefix, t_prefix, obs)
        sg, tg = s_voc.groups(), t_voc.groups()
        s_lists = [sg[x] for x, _ in pairs]
        t_lists = [tg[y] for _, y in pairs]
        s_size = np.asarray([len(a) for a in s_lists], dtype=np.int64)
        t_size = np.asarray([len(b) for b in t_lists], dtype=np.int64)
        flat = _Pairs(
            pairs,
            np.asarray([i for a in s_lists for i in a], dtype=np.int64),
            np.repeat(np.arange(len(pairs)), s_size),
            np.asarray([i for b in t_lists for i in b], dtype=np.int64),
            np.repeat(np.arange(len(pairs)), t_size),
            s_size,
            t_size,
        )
        _PAIR_CACHE[key] = (s_voc, t_voc, flat)
    return _PAIR_CACHE[key][2]


def _special(voc: ReferenceVocab, token: int) -> bool:
    return voc.special is not None and bool(voc.special[token])


def _scan_spelling_pairs(s_voc, t_voc, shape, s_prefix, t_prefix, obs):
    sg, tg = s_voc.groups(), t_voc.groups()
    pairs = []
    if shape == "1:1":
        for x in sg:
            if x in tg:
                pairs.append((x, x))
    elif shape == "1:N":
        n = len(t_prefix)
        for x in sg:
            if len(x) > n and x[:n] == t_prefix and x[n:] in tg:
                pairs.append((x, x[n:]))
    elif shape == "M:1":
        n = len(s_prefix)
        for y in tg:
            if len(y) > n and y[:n] == s_prefix and y[n:] in sg:
                pairs.append((y[n:], y))
    else:
        pairs.append(obs)
    return pairs


def _divergence(pt, ps, divergence: str):
    """D(P_T, P_S) on explicit probability vectors (natural log, 0 log 0 = 0)."""
    import torch

    def xlogy_ratio(a, b):
        # a * log(a / b) with 0 where a == 0 (gradient-safe).
        nz = a > 0
        safe_a = torch.where(nz, a, torch.ones_like(a))
        safe_b = torch.where(nz, b, torch.ones_like(b))
        return torch.where(nz, a * (torch.log(safe_a) - torch.log(safe_b)), torch.zeros_like(a)).sum()

    if divergence == "kl":
        return xlogy_ratio(pt, ps)
    if divergence == "reverse_kl":
        return xlogy_ratio(ps, pt)
    if divergence == "jsd":
        m = 0.5 * (pt + ps)
        return 0.5 * xlogy_ratio(pt, m) + 0.5 * xlogy_ratio(ps, m)
    raise CsdError(f"unknown divergence {divergence!r}")


@dataclass
class ReferenceChunk:
    """One accepted chunk: shape, chain probabilities and per-event final-token probabilities."""

    shape: str
    chain_t: float
    final_t: Any  # [K] teacher final-token class probabilities
    chain_s: Any  # student chain probability (0-dim tensor)
    final_s: Any  # [K] student final-token class probabilities

    def distributions(self, teacher_temperature: float = 1.0, teacher_rest_floor: float = 0.0):
        """(P_T, P_S): q(k) = chain x final(k) for the K events, then REST = 1 - sum.

        teacher_temperature T: P_T becomes P_T^(1/T) / sum(P_T^(1/T)) (REST included).
        teacher_rest_floor: the teacher's REST is at least this (reverse KL's floor).
        """
        import torch

        q_t = self.chain_t * self.final_t
        q_s = self.chain_s * self.final_s
        p_t = torch.cat([q_t, torch.clamp(1 - q_t.sum(), min=teacher_rest_floor).reshape(1)])
        p_s = torch.cat([q_s, torch.clamp(1 - q_s.sum(), min=0).reshape(1)])
        if teacher_temperature != 1.0:
            p_t = p_t ** (1.0 / teacher_temperature)
            p_t = p_t / p_t.sum()
        return p_t, p_s


def reference_chunk_distributions(
    student_probs,
    row: dict,
    teacher_index: int,
    teacher_row,
    s_voc: ReferenceVocab,
    t_voc: ReferenceVocab,
    *,
    spelling: str = "sum",
    only_1to1: bool = False,
):
    """Per accepted chunk, a ReferenceChunk (events enumerated by scanning the raw bytes).

    student_probs: dense softmax [Ts, Vs] (float64 tensor). The teacher's final-token
    candidates are all ids (dense) or the stored top-k plus the observed token.
    """
    import torch

    sid = [int(x) for x in row["student_ids"]]
    tid = [int(x) for x in row[f"teacher{teacher_index}_ids"]]
    ms = [int(x) for x in row[f"teacher{teacher_index}_chunk_student_len"]]
    ns = [int(x) for x in row[f"teacher{teacher_index}_chunk_teacher_len"]]
    st = [int(x) for x in row[f"teacher{teacher_index}_chunk_status"]]
    # One row tensor per position: indexing them keeps each backward op at O(V), not O(T x V).
    rows = torch.unbind(student_probs, 0)
    dense = not isinstance(teacher_row, dict)
    if dense:
        t_probs = np.exp(np.asarray(teacher_row, dtype=np.float64))
    out = []
    s0 = t0 = 0
    for m, n, status in zip(ms, ns, st):
        c_s0, c_t0 = s0, t0
        s0 += m
        t0 += n
        if status != 0 or c_s0 == 0 or c_t0 == 0:
            continue
        shape = "1:1" if m == 1 and n == 1 else "1:N" if m == 1 else "M:1" if n == 1 else "M:N"
        if only_1to1 and shape != "1:1":
            continue
        s_tok, t_tok = sid[c_s0 : c_s0 + m], tid[c_t0 : c_t0 + n]
        u_obs, v_obs = s_tok[-1], t_tok[-1]
        s_prefix = b"".join(s_voc.token_bytes[i] for i in s_tok[:-1])
        t_prefix = b"".join(t_voc.token_bytes[i] for i in t_tok[:-1])
        fs, ft = c_s0 + m - 2, c_t0 + n - 2
        # Chain probabilities.
        chain_s = torch.ones((), dtype=student_probs.dtype)
        for r in range(m - 1):
            chain_s = chain_s * rows[c_s0 - 1 + r][s_tok[r]]
        chain_t = 1.0
        for r in range(n - 1):
            j = c_t0 - 1 + r
            chain_t *= float(t_probs[j, t_tok[r]]) if dense else math.exp(float(teacher_row["observed_logprob"][j]))
        # Teacher final-token candidate probabilities.
        if dense:
            cand = None
        else:
            cand = {}
            for v, lp in zip(np.asarray(teacher_row["ids"][ft]).tolist(), np.asarray(teacher_row["logprobs"][ft]).tolist()):
                if math.isfinite(lp):
                    cand[int(v)] = math.exp(lp)
            if v_obs not in cand:
                cand[v_obs] = math.exp(float(teacher_row["observed_logprob"][ft]))

        if shape == "1:1" and _special(s_voc, u_obs) and _special(t_voc, v_obs):
            # A pair of special tokens (chat end-of-turn): the observed pair is the only event.
            p_t = float(t_probs[ft, v_obs]) if dense else cand[v_obs]
            final = rows[fs][u_obs].reshape(1)
            out.append(ReferenceChunk(shape, chain_t, torch.tensor([p_t], dtype=student_probs.dtype), chain_s, final))
            continue
        obs = (s_voc.token_bytes[u_obs], t_voc.token_bytes[v_obs])
        pp = _chunk_spelling_pairs(s_voc, t_voc, shape, s_prefix, t_prefix, obs)
        if obs not in pp.pairs:
            raise CsdError("reference: the observed pair of a chunk is not among its enumerated events")
        obs_k = pp.pairs.index(obs)
        s_ids, s_pair, t_ids, t_pair = pp.s_ids, pp.s_pair, pp.t_ids, pp.t_pair
        n_pairs = len(pp.pairs)
        keep = np.ones(n_pairs, dtype=bool)
        if spelling == "exclude":
            keep = (pp.s_size == 1) & (pp.t_size == 1)
            keep[obs_k] = True
            if not (pp.s_size[obs_k] == 1 and pp.t_size[obs_k] == 1):
                # The observed event keeps only the observed ids.
                s_sel = (s_pair != obs_k) | (s_ids == u_obs)
                t_sel = (t_pair != obs_k) | (t_ids == v_obs)
                s_ids, s_pair, t_ids, t_pair = s_ids[s_sel], s_pair[s_sel], t_ids[t_sel], t_pair[t_sel]
        # Teacher final-token probability of every listed teacher id (0 when not a stored candidate).
        if dense:
            t_p = t_probs[ft, t_ids]
            present = np.ones(len(t_ids), dtype=bool)
        else:
            c_ids = np.asarray(sorted(cand), dtype=np.int64)
            c_p = np.asarray([cand[int(v)] for v in c_ids])
            at = np.minimum(np.searchsorted(c_ids, t_ids), len(c_ids) - 1)
            present = c_ids[at] == t_ids
            t_p = np.where(present, c_p[at], 0.0)
        has_candidate = np.bincount(t_pair[present], minlength=n_pairs) > 0
        keep &= has_candidate  # spellings without a stored candidate stay in REST
        event_of_pair = np.full(n_pairs, -1, dtype=np.int64)
        event_of_pair[keep] = np.arange(int(keep.sum()))
        q_t = np.zeros(int(keep.sum()))
        t_keep = keep[t_pair]
        np.add.at(q_t, event_of_pair[t_pair[t_keep]], t_p[t_keep])
        s_keep = keep[s_pair]
        final = torch.zeros(len(q_t), dtype=student_probs.dtype).index_add(
            0, torch.as_tensor(event_of_pair[s_pair[s_keep]]), rows[fs][torch.as_tensor(s_ids[s_keep])]
        )
        if not len(q_t):
            raise CsdError("reference: a chunk without events (the observed pair must be one)")
        out.append(ReferenceChunk(shape, chain_t, torch.as_tensor(q_t, dtype=student_probs.dtype), chain_s, final))
    return out


def observed_chunk_logliks(student_probs, row: dict, teacher_index: int, teacher_row: dict, only_1to1: bool = False):
    """Per accepted chunk with a predictor on both sides (the order of `reference_chunk_distributions`):
    (teacher log-probability of its observed teacher tokens from the stored observed log-probs, the student's of
    its observed student tokens from `student_probs`, a float)."""
    sid = [int(x) for x in row["student_ids"]]
    observed = [float(x) for x in teacher_row["observed_logprob"]]
    out, s0, t0 = [], 0, 0
    for m, n, status in zip(row[f"teacher{teacher_index}_chunk_student_len"],
                            row[f"teacher{teacher_index}_chunk_teacher_len"],
                            row[f"teacher{teacher_index}_chunk_status"], strict=True):
        m, n, s, t = int(m), int(n), s0, t0
        s0, t0 = s0 + m, t0 + n
        if int(status) != 0 or s == 0 or t == 0 or (only_1to1 and (m, n) != (1, 1)):
            continue
        student = sum(math.log(float(student_probs[s - 1 + r, sid[s + r]].detach())) for r in range(m))
        out.append((sum(observed[t - 1:t + n - 1]), student))
    return out


def reference_loss(
    student_logits: list,
    rows: list[dict],
    student_vocab: ReferenceVocab,
    teachers: list[ReferenceTeacher],
    *,
    divergence: str = "jsd",
    beta: float = 5.0,
    spelling: str = "sum",
    only_1to1: bool = False,
    global_ce_tokens: float | None = None,
    global_chunk_counts: list[float] | None = None,
    teacher_temperature: float = 1.0,
    chunk_weights=None,
) -> dict:
    """The CSD loss of a batch from dense student logits (one [Ts, Vs] float64 tensor per row).

    Returns {"loss", "ce", "kd", "kd_parts", "chunks"} (torch scalars, differentiable w.r.t. the
    logits). CE is the mean over masked student targets (or / global_ce_tokens); each teacher's
    KD is (sum over 1:1 chunks of D + beta * sum over other chunks) / its chunk count; KD =
    sum_i weight_i KD_i; L = CE + sg(CE / KD) KD, or CE when KD is 0. chunk_weights: optional
    fn(log p_T(chunk), log p_S(chunk) as a float) -> a multiplier of the chunk's term, from the observed tokens of
    each side (`observed_chunk_logliks`; top-k teachers only).
    """
    import torch

    ce_sum = torch.zeros((), dtype=torch.float64)
    n_ce = 0
    probs = []
    for logits, row in zip(student_logits, rows, strict=True):
        logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
        probs.append(torch.exp(logp))
        ids = torch.as_tensor(np.asarray(row["student_ids"], dtype=np.int64))
        mask = torch.as_tensor(np.asarray(row["student_loss_mask"], dtype=bool))
        targets = torch.nonzero(mask[1:]).flatten()
        ce_sum = ce_sum - logp[targets, ids[targets + 1]].sum()
        n_ce += int(targets.numel())
    ce = ce_sum / float(global_ce_tokens if global_ce_tokens is not None else n_ce)
    kd = torch.zeros((), dtype=torch.float64)
    kd_parts, chunk_counts = [], []
    for i, teacher in enumerate(teachers):
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for probs_row, row, t_row in zip(probs, rows, teacher.rows, strict=True):
            chunks = reference_chunk_distributions(
                probs_row, row, i, t_row, student_vocab, teacher.vocab, spelling=spelling, only_1to1=only_1to1
            )
            logliks = observed_chunk_logliks(probs_row, row, i, t_row, only_1to1) if chunk_weights else None
            for k, chunk in enumerate(chunks):
                floor = REVERSE_KL_TEACHER_REST_FLOOR if divergence == "reverse_kl" else 0.0
                d = _divergence(*chunk.distributions(teacher_temperature, floor), divergence)
                if chunk_weights is not None:
                    d = d * chunk_weights(*logliks[k])
                total = total + (d if chunk.shape == "1:1" else beta * d)
                count += 1
        denom = count if global_chunk_counts is None else global_chunk_counts[i]
        part = total / denom if denom else torch.zeros((), dtype=torch.float64)
        kd_parts.append(part)
        chunk_counts.append(count)
        kd = kd + teacher.weight * part
    if float(kd.detach()) == 0.0:
        loss = ce
    else:
        loss = ce + (ce / kd).detach() * kd
    return {"loss": loss, "ce": ce, "kd": kd, "kd_parts": kd_parts, "chunks": chunk_counts}
