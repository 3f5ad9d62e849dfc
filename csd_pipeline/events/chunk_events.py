"""The event rules of one accepted chunk (SPEC §5), for a teacher top-k or dense teacher log-probs.

1:1 chunks take the common spellings; 1:N the prefix-support entries of the student->teacher
table keyed by the observed teacher prefix bytes; M:1 the mirror image with the teacher->student
table; M:N only the observed sequence. The observed pair is always an event. With a teacher top-k
only candidates in the stored top-k (plus the observed token) are explicit. Ids sharing a spelling
are summed into one event (`spelling="sum"`) or sent to REST (`spelling="exclude"`, the observed
event then keeps only the observed ids). `spelling="prefix"` sums them and, in 1:1 chunks, counts every
token on both sides toward the longest common spelling that begins it (`EventContext.common_prefix`).
`EventBuilder` accumulates the events of one row's chunks.
"""

from __future__ import annotations

from math import isfinite

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import SHAPE_1_1, SHAPE_1_N, SHAPE_M_1, SHAPE_M_N, BatchEvents
from csd_pipeline.events.context import EventContext


class EventBuilder:
    """Accumulates the events of one row's chunks as Python lists, then converts them to arrays once.

    `where` names the row in error messages.
    """

    def __init__(self, context: EventContext, spelling: str, where: str):
        self.ctx = context
        self.exclude = spelling == "exclude"
        self.prefix = spelling == "prefix"
        self.where = where
        self.chain_pos: list[int] = []
        self.chain_tok: list[int] = []
        self.chain_chunk: list[int] = []
        self.final_pos: list[int] = []
        self.final_tok: list[int] = []
        self.final_event: list[int] = []
        self.event_chunk: list[int] = []
        self.event_logq: list[float] = []
        self.chunk_shape: list[int] = []
        self.chunk_student_start: list[int] = []
        self.chunk_student_len: list[int] = []
        self.chunk_teacher_loglik: list[float] = []

    def start_chunk(self, shape: int, chain: list[tuple[int, int]], student_span: tuple[int, int] = (0, 0),
                    teacher_loglik: float = 0.0) -> int:
        """Open a chunk of `shape` with its student chain gathers [(position, token)]; returns its index.

        student_span: (first student token, student tokens) of the chunk; teacher_loglik: the teacher's
        log-probability of the chunk's observed teacher tokens (both read by `events.teacher_select`).
        """
        c = len(self.chunk_shape)
        self.chunk_shape.append(shape)
        self.chunk_student_start.append(int(student_span[0]))
        self.chunk_student_len.append(int(student_span[1]))
        self.chunk_teacher_loglik.append(float(teacher_loglik))
        for pos, tok in chain:
            self.chain_pos.append(pos)
            self.chain_tok.append(tok)
            self.chain_chunk.append(c)
        return c

    def add_event(self, chunk: int, pos: int, student_ids, teacher_logq: float) -> None:
        """One event of `chunk`: the student ids gathered at `pos` and the teacher's log q_T."""
        e = len(self.event_chunk)
        self.event_chunk.append(chunk)
        self.event_logq.append(teacher_logq)
        if len(student_ids) == 1:
            self.final_pos.append(pos)
            self.final_tok.append(int(student_ids[0]))
            self.final_event.append(e)
        else:
            n = len(student_ids)
            self.final_pos.extend([pos] * n)
            self.final_tok.extend(int(i) for i in student_ids)
            self.final_event.extend([e] * n)

    def _observed_error(self, chunk_index: int) -> CsdError:
        return CsdError(
            f"{self.where}: the observed pair of a chunk (KD chunk {chunk_index}) is not an event of the tables; "
            "the tables do not match the tokenizers of the data, re-run `csd-pipeline tables build` and align."
        )

    def add_topk_events(self, chunk, shape, pos, cand_ids, cand_lp, obs_lp, chain, s_prefix, t_prefix, u_obs, v_obs):
        """Events of `chunk` from the teacher top-k (`cand_ids`, `cand_lp`) at its final teacher position."""
        ctx = self.ctx
        tsp = ctx.teacher_spelling
        obs_spelling = tsp[v_obs]
        if self.prefix and shape == SHAPE_1_1:
            self._prefix_topk_events(chunk, pos, cand_ids, cand_lp, obs_lp, chain, u_obs, v_obs)
            return
        groups: dict[bytes, list[float]] = {}
        seen_obs = False
        n_teacher = len(tsp)
        for v, lp in zip(cand_ids.tolist(), cand_lp.tolist()):
            if v == v_obs:
                seen_obs = True
                lp = obs_lp = lp if isfinite(lp) else obs_lp
            elif not isfinite(lp):
                continue  # padding of a short top-k row
            y = tsp[v] if 0 <= v < n_teacher else None
            if y is None or (shape == SHAPE_M_N and y != obs_spelling):
                continue
            groups.setdefault(y, []).append(lp)
        if not seen_obs:
            groups.setdefault(obs_spelling, []).append(obs_lp)
        found_obs = False
        for y, lps in groups.items():
            is_obs = y == obs_spelling
            x = ctx.event_class(shape, y, obs_spelling, s_prefix, t_prefix, u_obs)
            if x is None:
                continue
            s_ids = ctx.student_classes[x]
            if self.exclude and (len(s_ids) > 1 or len(ctx.teacher_classes[y]) > 1):
                if not is_obs:
                    continue
                s_ids = (u_obs,)
                lps = [obs_lp]
            if is_obs:
                if u_obs not in s_ids:
                    raise self._observed_error(chunk)
                found_obs = True
            self.add_event(chunk, pos, s_ids, chain + _logsumexp(lps))
        if not found_obs:
            raise self._observed_error(chunk)

    def _prefix_topk_events(self, chunk, pos, cand_ids, cand_lp, obs_lp, chain, u_obs, v_obs):
        """1:1 chunk, "prefix" rule: each candidate counts toward the longest common spelling that begins it; the
        student side gathers every id whose longest common prefix that spelling is."""
        ctx = self.ctx
        tsp = ctx.teacher_spelling
        obs_spelling = tsp[v_obs]
        groups: dict[bytes, list[float]] = {obs_spelling: []}
        seen_obs = False
        for v, lp in zip(cand_ids.tolist(), cand_lp.tolist()):
            if v == v_obs:
                seen_obs = True
                lp = lp if isfinite(lp) else obs_lp
            elif not isfinite(lp):
                continue
            y = tsp[v] if 0 <= v < len(tsp) else None
            head = None if y is None else ctx.common_prefix(y)
            if head is not None:
                groups.setdefault(head, []).append(lp)
        if not seen_obs:
            groups[obs_spelling].append(obs_lp)
        members = ctx.prefix_members()
        if ctx.common_prefix(obs_spelling) != obs_spelling or u_obs not in members.get(obs_spelling, ()):
            raise self._observed_error(chunk)
        for head, lps in groups.items():
            self.add_event(chunk, pos, members[head], chain + _logsumexp(lps))

    def add_dense_events(self, chunk, shape, pos, teacher_row, chain, s_prefix, t_prefix, u_obs, v_obs):
        """Events of `chunk` from dense teacher log-probs (`teacher_row` [V]) at its final teacher position."""
        ctx = self.ctx
        sb, tb = ctx.student_bytes, ctx.teacher_bytes
        obs_pair = (sb[u_obs], tb[v_obs])
        if shape == SHAPE_1_1:
            self._dense_common_events(chunk, pos, teacher_row, chain, u_obs, v_obs)
            return
        if shape == SHAPE_1_N:
            pairs = ctx.prefix_support("s2t", t_prefix)
        elif shape == SHAPE_M_1:
            pairs = [(b, a) for a, b in ctx.prefix_support("t2s", s_prefix)]
        else:
            pairs = [obs_pair]
        found_obs = False
        for x, y in pairs:
            s_ids, t_ids = ctx.student_classes.get(x), ctx.teacher_classes.get(y)
            if s_ids is None or t_ids is None:
                continue
            is_obs = (x, y) == obs_pair
            if self.exclude and (len(s_ids) > 1 or len(t_ids) > 1):
                if not is_obs:
                    continue
                s_ids = (u_obs,)
                t_ids = (v_obs,)
            if is_obs:
                if u_obs not in s_ids or v_obs not in t_ids:
                    raise self._observed_error(chunk)
                found_obs = True
            self.add_event(chunk, pos, s_ids, chain + _logsumexp(teacher_row[np.asarray(t_ids)]))
        if not found_obs:
            raise self._observed_error(chunk)

    def _dense_common_events(self, chunk, pos, teacher_row, chain, u_obs, v_obs):
        """1:1 chunk with a dense teacher: every common spelling is an event (vectorised)."""
        spellings, s_ids, s_cls, t_ids, t_cls = self.ctx.prefix_dense() if self.prefix else self.ctx.common_dense()
        n_cls = len(spellings)
        obs = self.ctx.teacher_spelling[v_obs]
        hit = np.flatnonzero(t_ids == v_obs)
        obs_k = int(t_cls[hit[0]]) if hit.size else None
        if obs_k is None or spellings[obs_k] != obs or u_obs not in s_ids[s_cls == obs_k]:
            raise self._observed_error(chunk)
        s_size = np.bincount(s_cls, minlength=n_cls)
        t_size = np.bincount(t_cls, minlength=n_cls)
        keep = np.ones(n_cls, dtype=bool) if not self.exclude else (s_size == 1) & (t_size == 1)
        keep[obs_k] = True
        values = teacher_row[t_ids]
        peak = np.full(n_cls, -np.inf)
        np.maximum.at(peak, t_cls, values)
        total = np.zeros(n_cls)
        np.add.at(total, t_cls, np.exp(values - peak[t_cls]))
        logq = chain + peak + np.log(total)
        s_keep_ids, s_keep_cls = s_ids, s_cls
        if self.exclude and (s_size[obs_k] > 1 or t_size[obs_k] > 1):
            logq[obs_k] = chain + float(teacher_row[v_obs])
            in_obs = s_cls == obs_k
            s_keep_ids = np.concatenate([s_ids[~in_obs], [u_obs]])
            s_keep_cls = np.concatenate([s_cls[~in_obs], [obs_k]])
        kept = np.flatnonzero(keep)
        event_of_class = np.full(n_cls, -1, dtype=np.int64)
        base = len(self.event_chunk)
        event_of_class[kept] = base + np.arange(kept.size)
        sel = keep[s_keep_cls]
        self.event_chunk.extend([chunk] * kept.size)
        self.event_logq.extend(logq[kept].tolist())
        self.final_tok.extend(s_keep_ids[sel].tolist())
        self.final_event.extend(event_of_class[s_keep_cls[sel]].tolist())
        self.final_pos.extend([pos] * int(sel.sum()))

    def finish(self, stats: dict) -> BatchEvents:
        """The row's events as arrays, with `stats`."""
        def ints(values):
            return np.asarray(values, dtype=np.int64)

        return BatchEvents(
            chain_pos=ints(self.chain_pos),
            chain_tok=ints(self.chain_tok),
            chain_chunk=ints(self.chain_chunk),
            final_pos=ints(self.final_pos),
            final_tok=ints(self.final_tok),
            final_event=ints(self.final_event),
            event_chunk=ints(self.event_chunk),
            event_teacher_logq=np.asarray(self.event_logq, dtype=np.float64),
            chunk_shape=ints(self.chunk_shape),
            chunk_student_start=ints(self.chunk_student_start),
            chunk_student_len=ints(self.chunk_student_len),
            chunk_teacher_loglik=np.asarray(self.chunk_teacher_loglik, dtype=np.float64),
            stats=stats,
        )


def _logsumexp(values) -> float:
    if len(values) == 1:
        return float(values[0])
    arr = np.asarray(values, dtype=np.float64)
    peak = arr.max()
    return float(peak + np.log(np.exp(arr - peak).sum()))
