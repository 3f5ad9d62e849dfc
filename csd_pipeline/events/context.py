"""The look-ups of one (student, teacher) pair that CSD events are built from, made once per worker.

Spelling classes (token ids with equal bytes), the common spellings and the prefix-support entries
of the subtoken tables (`vocab.tables`), as plain dictionaries and tuples so that the work per chunk
(`events.chunk_events`) is dictionary look-ups.
"""

from __future__ import annotations

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import SHAPE_1_1, SHAPE_1_N, SHAPE_M_N


class EventContext:
    """Look-up structures for one (student, teacher) pair, built once per data-loader worker.

    s2t: student->teacher SubtokenTable; t2s: teacher->student table. student_vocab /
    teacher_vocab: the vocabularies of the data's tokenizers (default: the tables' own copies).
    Spelling classes, common spellings and prefix-support entries come from the tables.
    Raises CsdError when the two tables or the vocabularies have different fingerprints
    (tables of another tokenizer).
    """

    def __init__(self, s2t, t2s, student_vocab=None, teacher_vocab=None, *, tables_name: str = "tables"):
        student_vocab = s2t.source if student_vocab is None else student_vocab
        teacher_vocab = s2t.destination if teacher_vocab is None else teacher_vocab
        checks = (
            ("student->teacher", "student (source)", s2t.source_fingerprint, student_vocab),
            ("student->teacher", "teacher (destination)", s2t.destination_fingerprint, teacher_vocab),
            ("teacher->student", "teacher (source)", t2s.source_fingerprint, teacher_vocab),
            ("teacher->student", "student (destination)", t2s.destination_fingerprint, student_vocab),
        )
        for direction, side, fingerprint, vocab in checks:
            if fingerprint != vocab.fingerprint:
                raise CsdError(
                    f"the {direction} table in {tables_name} was built for another {side} tokenizer than "
                    f"{vocab.name} (fingerprint {str(fingerprint)[:12]} != {vocab.fingerprint[:12]}); "
                    "re-run `csd-pipeline tables build` and the align stage with these tokenizers."
                )
        self.s2t, self.t2s = s2t, t2s
        self.student_vocab, self.teacher_vocab = student_vocab, teacher_vocab
        self.student_bytes = s2t.source.token_bytes
        self.teacher_bytes = s2t.destination.token_bytes
        # Spelling -> ids (tuples of ints: per-chunk work is plain dictionary look-ups).
        self.student_classes: dict[bytes, tuple[int, ...]] = {
            k: tuple(int(i) for i in v) for k, v in s2t.source.spellings().items()
        }
        self.teacher_classes: dict[bytes, tuple[int, ...]] = {
            k: tuple(int(i) for i in v) for k, v in s2t.destination.spellings().items()
        }
        # Per teacher id: its spelling (None for specials / untrusted tokens: never a spelling).
        self.teacher_spelling: list[bytes | None] = [None] * len(self.teacher_bytes)
        for spelling, ids in self.teacher_classes.items():
            for i in ids:
                self.teacher_spelling[i] = spelling
        self._common_dense = None
        self._prefix_dense = None
        self._prefix_members = None
        self._common_prefix: dict[bytes, bytes | None] = {}
        self._teacher_common = None
        self._prefix_cache: dict[tuple[str, bytes], list] = {}
        self._student_special = s2t.source.is_special & ~s2t.source.untrusted
        self._teacher_special = s2t.destination.is_special & ~s2t.destination.untrusted

    def is_special_pair(self, u: int, v: int) -> bool:
        """Whether (student u, teacher v) are both special tokens (no bytes): chat mode's end-of-turn pair."""
        return bool(self._student_special[u] and self._teacher_special[v])

    def event_class(self, shape: int, teacher_spelling: bytes | None, observed_spelling: bytes, s_prefix: bytes,
                    t_prefix: bytes, u_obs: int) -> bytes | None:
        """The student spelling class that a teacher candidate spelled `teacher_spelling` turns into at a chunk's
        final teacher position, or None when it is no event (its mass goes to REST).

        1:1: the same spelling; 1:N: the observed teacher prefix + it; M:1: it minus the observed student
        prefix; M:N: only the observed spelling (the observed student token's class). The class must exist
        in the student vocabulary. The one rule for the loss (`events.chunk_events`) and for the store that
        keeps only these entries (`teacher.store.selectors.csd_events`).
        """
        if teacher_spelling is None:
            return None
        if shape == SHAPE_M_N:
            x = self.student_bytes[u_obs] if teacher_spelling == observed_spelling else None
        elif shape == SHAPE_1_1:
            x = teacher_spelling
        elif shape == SHAPE_1_N:
            x = t_prefix + teacher_spelling
        elif len(teacher_spelling) > len(s_prefix) and teacher_spelling.startswith(s_prefix):  # M:1
            x = teacher_spelling[len(s_prefix):]
        else:
            x = None
        return x if x is not None and x in self.student_classes else None

    def teacher_common(self) -> np.ndarray:
        """bool [Vt]: whether each teacher id's spelling is also a student spelling (a 1:1 chunk's events)."""
        if self._teacher_common is None:
            self._teacher_common = np.asarray(
                [y is not None and y in self.student_classes for y in self.teacher_spelling], dtype=bool)
        return self._teacher_common

    def common_dense(self):
        """Common spellings of the student->teacher table as flat arrays (dense teachers only)."""
        if self._common_dense is None:
            spellings, s_ids, s_cls, t_ids, t_cls = [], [], [], [], []
            for k, spelling in enumerate(self.s2t.common_spellings()):
                a, b = self.student_classes[spelling], self.teacher_classes[spelling]
                spellings.append(spelling)
                s_ids.append(np.asarray(a, dtype=np.int64))
                s_cls.append(np.full(len(a), k, dtype=np.int64))
                t_ids.append(np.asarray(b, dtype=np.int64))
                t_cls.append(np.full(len(b), k, dtype=np.int64))
            cat = np.concatenate
            self._common_dense = (spellings, cat(s_ids), cat(s_cls), cat(t_ids), cat(t_cls))
        return self._common_dense

    def common_prefix(self, spelling: bytes) -> bytes | None:
        """The longest common spelling (a student and a teacher spelling) that `spelling` begins with, itself
        included; None when no common spelling begins it.

        The "prefix" spelling mode's rule for 1:1 chunks. A teacher token that the student has no token for,
        say `" Benutzerkonto"`, is spelled by the student starting with a shorter token, `" Ben"`: the text
        event "the next teacher token is ` Ben`" excludes that word, "the next student token is ` Ben`"
        includes it. Counting every token on both sides toward the longest common spelling that begins it
        makes the two events the same text ("the text continues with ` Ben`, and with no longer common
        spelling"), however much longer the tokens of one vocabulary are than the other's.
        """
        found = self._common_prefix.get(spelling, False)
        if found is False:
            found = None
            for end in range(len(spelling), 0, -1):
                head = spelling[:end]
                if head in self.student_classes and head in self.teacher_classes:
                    found = head
                    break
            self._common_prefix[spelling] = found
        return found

    def prefix_members(self) -> dict[bytes, tuple[int, ...]]:
        """Common spelling -> the student ids whose longest common prefix it is (`common_prefix`), its class first."""
        if self._prefix_members is None:
            members: dict[bytes, list[int]] = {}
            for spelling, ids in self.student_classes.items():
                head = self.common_prefix(spelling)
                if head is not None:
                    members.setdefault(head, []).extend(ids)
            self._prefix_members = {head: tuple(ids) for head, ids in members.items()}
        return self._prefix_members

    def prefix_dense(self):
        """`common_dense`'s arrays under the "prefix" rule: each common spelling with every student and teacher id
        whose longest common prefix it is (dense teachers only)."""
        if self._prefix_dense is None:
            spellings = self.s2t.common_spellings()
            index = {spelling: k for k, spelling in enumerate(spellings)}
            members = self.prefix_members()
            s_ids, s_cls, t_ids, t_cls = [], [], [], []
            for k, spelling in enumerate(spellings):
                s_ids += members[spelling]
                s_cls += [k] * len(members[spelling])
            for spelling, ids in self.teacher_classes.items():
                head = self.common_prefix(spelling)
                if head is not None:
                    t_ids += ids
                    t_cls += [index[head]] * len(ids)
            self._prefix_dense = (spellings, *(np.asarray(a, dtype=np.int64) for a in (s_ids, s_cls, t_ids, t_cls)))
        return self._prefix_dense

    def prefix_support(self, direction: str, prefix: bytes) -> list:
        """The `direction` ("s2t" or "t2s") table's prefix-support entries (a, b) with a == prefix + b (cached)."""
        key = (direction, prefix)
        entries = self._prefix_cache.get(key)
        if entries is None:  # read once into a local: encoder threads (teacher-logits) share this cache
            table = self.s2t if direction == "s2t" else self.t2s
            if len(self._prefix_cache) > 4096:
                self._prefix_cache.clear()
            entries = self._prefix_cache[key] = list(table.prefix_support(prefix))
        return entries
