"""Real aligned rows for the events/loss tests: two fixture tokenizers on real text.

A deliberately simple aligner (independent of `alignment.py`): tokenize both sides, walk the
cumulative byte ends to the shortest common boundaries, and accept a chunk when both token
runs spell exactly the same bytes. Each row starts with both sides' context token as a 1:1
SPECIAL chunk, as the align stage writes it.
"""

from __future__ import annotations

import numpy as np

ACCEPTED, SPECIAL, MISMATCH = 0, 1, 4


def chunk_boundaries(s_ends: np.ndarray, t_ends: np.ndarray) -> list[tuple[int, int]]:
    """(M, N) of each minimal chunk: the shortest token runs that end at the same byte position.

    Where the two sides never meet again (ends from offsets of an inexact tokenizer), the rest
    is one chunk.
    """
    chunks = []
    i = j = 0
    n_s, n_t = len(s_ends), len(t_ends)
    while i < n_s or j < n_t:
        i0, j0 = i, j
        i, j = min(i + 1, n_s), min(j + 1, n_t)
        while True:
            es = s_ends[i - 1] if i > 0 else 0
            et = t_ends[j - 1] if j > 0 else 0
            if es == et and i > i0 and j > j0:
                break
            if es <= et and i < n_s:
                i += 1
            elif et <= es and j < n_t:
                j += 1
            else:
                i, j = n_s, n_t
                break
        chunks.append((i - i0, j - j0))
    return chunks


def aligned_row(text: str, student, teacher, row_id: str, teacher_index: int = 0) -> dict:
    """One aligned row (SPEC §8 columns) for `text` with two TokenizerBundles."""
    enc_s = student.encode_spans([text])[0]
    enc_t = teacher.encode_spans([text])[0]
    sb, tb = student.vocab.token_bytes, teacher.vocab.token_bytes
    chunks = chunk_boundaries(enc_s.ends, enc_t.ends)
    s_ids = [student.vocab.context_token()] + enc_s.ids.tolist()
    t_ids = [teacher.vocab.context_token()] + enc_t.ids.tolist()
    ms, ns, status = [1], [1], [SPECIAL]
    si = tj = 1
    for m, n in chunks:
        s_text = b"".join(sb[k] for k in s_ids[si : si + m])
        t_text = b"".join(tb[k] for k in t_ids[tj : tj + n])
        ms.append(m)
        ns.append(n)
        status.append(ACCEPTED if s_text == t_text and m and n else MISMATCH)
        si += m
        tj += n
    p = f"teacher{teacher_index}_"
    return {
        "row_id": row_id,
        "text": text,
        "student_ids": np.asarray(s_ids, dtype=np.int32),
        "student_loss_mask": np.asarray([False] + [True] * (len(s_ids) - 1)),
        p + "ids": np.asarray(t_ids, dtype=np.int32),
        p + "chunk_student_len": np.asarray(ms, dtype=np.int32),
        p + "chunk_teacher_len": np.asarray(ns, dtype=np.int32),
        p + "chunk_status": np.asarray(status, dtype=np.uint8),
    }


def shape_of(m: int, n: int) -> str:
    return "1:1" if m == 1 and n == 1 else "1:N" if m == 1 else "M:1" if n == 1 else "M:N"


def row_shapes(row: dict, teacher_index: int = 0) -> list[str]:
    p = f"teacher{teacher_index}_"
    return [
        shape_of(int(m), int(n))
        for m, n, st in zip(row[p + "chunk_student_len"], row[p + "chunk_teacher_len"], row[p + "chunk_status"])
        if st == ACCEPTED
    ]


# ---------------------------------------------------------------------------------------------
# Cached tokenizer pairs (shared by tests/loss/test_events.py and tests/loss/test_csd.py within one pytest session)

_BUNDLES: dict = {}
_CONTEXTS: dict = {}
_REFERENCE_VOCABS: dict = {}


def bundle(tokenizer_path, name: str):
    """The TokenizerBundle of a fixture tokenizer, loaded once per session."""
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    if name not in _BUNDLES:
        _BUNDLES[name] = load_tokenizer(str(tokenizer_path(name)))
    return _BUNDLES[name]


def cached_table_file(source, destination) -> str:
    """The path of the (source -> destination) table, built once and cached next to the fixtures, keyed by
    both fingerprints and the source of the modules that build tables (any change rebuilds)."""
    import hashlib
    import os
    from pathlib import Path

    import csd_pipeline.vocab.families
    import csd_pipeline.vocab.tables
    import csd_pipeline.vocab.vocabulary
    from csd_pipeline.fixtures.names import fixture_dir
    from csd_pipeline.vocab.tables import build_table

    modules = (csd_pipeline.vocab.families, csd_pipeline.vocab.tables, csd_pipeline.vocab.vocabulary)
    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in modules))
    folder = fixture_dir() / "test-cache" / "tables"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(code.digest() + source.vocab.fingerprint.encode() + destination.vocab.fingerprint.encode())
    path = folder / f"{key.hexdigest()[:24]}.safetensors"
    if not path.is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        build_table(source, destination).save(tmp)
        os.replace(tmp, path)
    return str(path)


def cached_table(source, destination):
    """The (source -> destination) table, loaded from the cache (`cached_table_file`)."""
    from csd_pipeline.vocab.tables import load_table

    return load_table(cached_table_file(source, destination))


def event_context(tokenizer_path, student: str, teacher: str):
    """(student bundle, teacher bundle, EventContext) with both tables loaded once per session."""
    from csd_pipeline.events.context import EventContext

    key = (student, teacher)
    if key not in _CONTEXTS:
        s, t = bundle(tokenizer_path, student), bundle(tokenizer_path, teacher)
        _CONTEXTS[key] = (s, t, EventContext(cached_table(s, t), cached_table(t, s), s.vocab, t.vocab))
    return _CONTEXTS[key]


def load_texts(path) -> list[dict]:
    import json

    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def top_k_ids(dense: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries of each row, largest first, ties by lower id: the first k of a stable argsort of
    -dense, without sorting whole rows of 10^5 ids (a partition finds each row's k-th value; every entry at or
    above it is sorted)."""
    negated = -np.asarray(dense)
    if k >= negated.shape[1]:
        return np.argsort(negated, axis=1, kind="stable")[:, :k]
    kth = np.partition(negated, k - 1, axis=1)[:, k - 1]
    out = np.empty((len(negated), k), dtype=np.int64)
    for t, (values, bound) in enumerate(zip(negated, kth)):
        candidates = np.flatnonzero(values <= bound)  # ascending ids: the stable sort keeps ties by id
        out[t] = candidates[np.argsort(values[candidates], kind="stable")[:k]]
    return out


def topk_from_dense(row: dict, dense: np.ndarray, k: int, teacher_index: int = 0) -> dict:
    """A teacher top-k row (as the teacher-logits stage stores it) from dense log-probs [Tt, V]."""
    ids = top_k_ids(dense, k)
    t_ids = np.asarray(row[f"teacher{teacher_index}_ids"], dtype=np.int64)
    observed = np.full(len(t_ids), np.nan)
    observed[:-1] = dense[np.arange(len(t_ids) - 1), t_ids[1:]]
    return {
        "row_id": row["row_id"],
        "ids": ids.astype(np.int32),
        "logprobs": np.take_along_axis(dense, ids, axis=1),
        "observed_logprob": observed,
    }


def reference_vocab(bundle):
    """The float64 reference's `ReferenceVocab` of a bundle, built once per session (spelling classes too)."""
    from tests.loss_reference import ReferenceVocab

    key = bundle.vocab.fingerprint
    if key not in _REFERENCE_VOCABS:
        _REFERENCE_VOCABS[key] = ReferenceVocab.from_vocabulary(bundle.vocab)
    return _REFERENCE_VOCABS[key]


def as_float(x) -> float:
    """A Python float of a number or a one-element tensor."""
    return float(x.detach()) if hasattr(x, "detach") else float(x)


def close(a, b, tol: float = 1e-10) -> bool:
    """|a - b| <= tol x max(1, |b|): the loss tests' agreement with the float64 reference."""
    return abs(as_float(a) - as_float(b)) <= tol * max(1.0, abs(as_float(b)))


class PairCase:
    """Real aligned rows of one tokenizer pair (texts of tests/data/csd-loss-texts.jsonl by index), a random
    float64 student LM head [V, hidden] and the reference vocabularies; `generator` continues the draws."""

    def __init__(self, tokenizer_path, student: str, teacher: str, text_ids, hidden: int, seed: int = 0):
        from pathlib import Path

        import torch

        self.s, self.t, self.ctx = event_context(tokenizer_path, student, teacher)
        texts = load_texts(Path(__file__).resolve().parent / "data" / "csd-loss-texts.jsonl")
        self.rows = [aligned_row(texts[i]["text"], self.s, self.t, f"csd-loss-texts:{i}") for i in text_ids]
        self.generator = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(self.s.vocab.size, hidden, generator=self.generator, dtype=torch.float64)
        self.s_ref, self.t_ref = reference_vocab(self.s), reference_vocab(self.t)

    def offsets(self, rows):
        return np.cumsum([0] + [len(r["student_ids"]) for r in rows])[:-1]
