"""Text mode of the align stage: a batch of documents -> aligned rows (schemas/aligned.py, version 1).

`TextAligner.align_documents` tokenizes the batch once per distinct tokenizer (`encode_batch_fast`:
spans come from token bytes, not offsets), aligns the student with every teacher
(`chunks.token_spans`, `chunks.align`, vectorised over the batch), cuts windows
(`chunks.cut_windows`) and builds the Arrow table directly from numpy buffers. Documents whose
token bytes do not spell their text (a normalizer changed it) take their ends from character
offsets (`TokenizerBundle.encode_spans`) and are verified chunk by chunk.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from csd_pipeline.errors import CsdError
from schemas.aligned import SHAPES, ChunkStatus, aligned_schema, teacher_columns


def _count(counter: dict, key: str, amount: int = 1) -> None:
    counter[key] = counter.get(key, 0) + amount


class TextAligner:
    """Tokenizes, aligns and windows a batch of documents into an Arrow table of aligned rows."""

    def __init__(self, student, teachers, max_student: int, max_teachers: list[int], context_token: bool):
        self.student = student
        self.teachers = teachers
        self.max_student = max_student
        self.max_teachers = list(max_teachers)
        # One encoding per distinct tokenizer: a teacher identical to the student (or to an earlier
        # teacher) reuses its token spans.
        fingerprints = [student.vocab.fingerprint]
        self.side_of_teacher = []
        self.bundles = [student]
        for teacher in teachers:
            fp = teacher.vocab.fingerprint
            if fp not in fingerprints:
                fingerprints.append(fp)
                self.bundles.append(teacher)
            self.side_of_teacher.append(fingerprints.index(fp))
        self.context = [b.vocab.context_token() if context_token else None for b in [student, *teachers]]
        for bundle in self.bundles:
            if not getattr(bundle.tokenizer, "encode_special_tokens", False):
                raise CsdError(f"tokenizer {bundle.source} would parse special tokens from corpus text; "
                               "load it with csd_pipeline.vocab.vocabulary.load_tokenizer.")
        self.schema = aligned_schema(len(teachers))

    def new_stats(self) -> dict:
        """Counters of one shard (summed across shards by the executor)."""
        return shard_stats(len(self.teachers))

    def encode(self, bundle, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Content token ids of `texts` (no special tokens added or parsed): (flat ids, offsets per text)."""
        # Offsets are not needed (spans come from token bytes), so skip computing them where possible.
        encode = getattr(bundle.tokenizer, "encode_batch_fast", bundle.tokenizer.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
        counts = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        offsets = np.zeros(len(id_lists) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.int32, count=int(offsets[-1]))
        return ids, offsets

    def align_documents(self, documents: list, stats: dict):
        """Align a batch of non-empty documents; return their windows as an Arrow table (schema v1)."""
        from csd_pipeline.align import prompt_completion
        from csd_pipeline.align.chunks import align, cut_windows

        src, doc_bytes, prompt_ends, spans = self.token_sides(documents)
        student = spans[0]
        tables = [align(src, doc_bytes, student, spans[s]) for s in self.side_of_teacher]
        context = [c is not None for c in self.context]
        windows = cut_windows(src, doc_bytes, tables, self.max_student, self.max_teachers, context)
        loss_tokens = None
        if prompt_ends is not None:
            for table in tables:
                prompt_completion.mark_prompt_chunks(table, prompt_ends)
            windows = prompt_completion.drop_prompt_windows(windows, prompt_ends, stats)
            loss_tokens = prompt_completion.completion_tokens(student, prompt_ends)
        self._count(stats, documents, doc_bytes, windows, tables)
        return self._rows(documents, src, doc_bytes, student, [spans[s] for s in self.side_of_teacher], tables, windows,
                          stats, loss_tokens)

    def token_sides(self, documents: list):
        """(src, doc_bytes, prompt ends or None, `SideSpans` of each distinct tokenizer, student first) of a batch:
        each tokenizer encodes the whole documents once (the one tokenization every alignment starts from)."""
        from csd_pipeline.align import prompt_completion
        from csd_pipeline.align.chunks import token_spans

        texts = [d.text for d in documents]
        encoded = [t.encode("utf-8") for t in texts]
        doc_bytes = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=doc_bytes[1:])
        src = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        prompt_ends = prompt_completion.boundaries(documents, doc_bytes)  # None: no prompt/completion record
        spans = []
        for bundle in self.bundles:
            split = []
            if prompt_ends is None:
                ids, offsets = self.encode(bundle, texts)
            else:
                ids, offsets, split = prompt_completion.encode(bundle, texts, documents)
            side = token_spans(bundle.vocab, ids, offsets, src, doc_bytes)
            inexact = np.flatnonzero(~side.exact).tolist()
            if inexact:
                # A normalizer changed these texts: take their ends from character offsets.
                for d, encoded_text in zip(inexact, bundle.encode_spans([texts[d] for d in inexact])):
                    side.set_ends(d, prompt_completion.offset_ends(bundle, texts[d], documents[d].prompt_bytes)
                                  if d in split else encoded_text.ends, doc_bytes)
            spans.append(side)
        return src, doc_bytes, prompt_ends, spans

    def _count(self, stats, documents, doc_bytes, windows, tables) -> None:
        aligned_docs = np.unique(windows.doc)
        stats["documents"]["aligned"] += int(aligned_docs.size)
        stats["documents"]["with_rejected_regions"] += int(len(windows.rejected_docs))
        unaligned = len(documents) - int(aligned_docs.size)
        if unaligned:
            _count(stats["rejected_documents"], "chunk_longer_than_window", unaligned)
        stats["rejected_regions"]["chunk_longer_than_window"] += windows.rejected_regions
        stats["rejected_region_bytes"] += windows.rejected_bytes
        stats["windows"] += len(windows.doc)
        stats["bytes"]["documents"] += int(doc_bytes[-1])
        stats["bytes"]["windows"] += int((windows.byte_range[:, 1] - windows.byte_range[:, 0]).sum())
        stats["tokens"]["student"] += int((windows.student_range[:, 1] - windows.student_range[:, 0]).sum())
        for i, _table in enumerate(tables):
            ranges = windows.teacher_ranges[i]
            stats["tokens"][f"teacher{i}"] += int((ranges[:, 1] - ranges[:, 0]).sum())

    def _rows(self, documents, src, doc_bytes, student, teacher_spans, tables, windows, stats, loss_tokens=None):
        from csd_pipeline.align.chunks import ragged_arange

        lo, hi = windows.byte_range[:, 0], windows.byte_range[:, 1]
        docs = windows.doc.tolist()
        text = _string_array(src[ragged_arange(lo, hi - lo)], hi - lo)
        offsets, student_ids, content = _with_head(student.ids, windows.student_range, self.context[0])
        if loss_tokens is not None:  # prompt/completion records: no loss on the prompt (prompt_completion.py)
            content &= _with_head(loss_tokens, windows.student_range, 0 if self.context[0] is not None else None)[1] == 1
        columns = {
            "row_id": _strings([f"{documents[d].source}:{documents[d].record_index}:{w}"
                                for d, w in zip(docs, windows.window_index.tolist())]),
            "text": text,
            "student_ids": _list_array(offsets, _array(student_ids, "int32")),
            "student_loss_mask": _list_array(offsets, _bool_array(content)),
        }
        for i, (side, table) in enumerate(zip(teacher_spans, tables)):
            ctx_s, ctx_t = self.context[0], self.context[1 + i]
            ids_col, len_s_col, len_t_col, status_col = teacher_columns(i)
            t_offsets, t_ids, _ = _with_head(side.ids, windows.teacher_ranges[i], ctx_t)
            columns[ids_col] = _list_array(t_offsets, _array(t_ids, "int32"))
            chunks = windows.chunk_ranges[i]
            head = ctx_s is not None or ctx_t is not None
            first_status = None if ctx_s is not None and ctx_t is not None else ChunkStatus.NO_PREDICTOR
            c_offsets, s_len, _ = _with_head(table.student_len, chunks, int(ctx_s is not None) if head else None)
            _, t_len, _ = _with_head(table.teacher_len, chunks, int(ctx_t is not None) if head else None)
            _, status, _ = _with_head(table.status, chunks, int(ChunkStatus.SPECIAL) if head else None,
                                      first_content=first_status)
            columns[len_s_col] = _list_array(c_offsets, _array(s_len, "int32"))
            columns[len_t_col] = _list_array(c_offsets, _array(t_len, "int32"))
            columns[status_col] = _list_array(c_offsets, _array(status, "uint8"))
            _count_chunks(stats[f"teacher{i}"], s_len, t_len, status)
        columns["source"] = _strings([documents[d].source for d in docs])
        columns["record_index"] = _array(np.fromiter((documents[d].record_index for d in docs), np.int64, len(docs)), "int64")
        columns["window_index"] = _array(windows.window_index, "int32")
        columns["byte_start"] = _array(lo - doc_bytes[windows.doc], "int64")
        import pyarrow as pa

        return pa.Table.from_arrays([columns[name] for name in self.schema.names], schema=self.schema)


def _count_chunks(counter: dict, s_len: np.ndarray, t_len: np.ndarray, status: np.ndarray) -> None:
    counts = np.bincount(status, minlength=len(ChunkStatus))
    for s in ChunkStatus:
        counter["chunk_status"][s.name] += int(counts[s])
    accepted = status == ChunkStatus.ACCEPTED
    key = (s_len[accepted] > 1).astype(np.int64) * 2 + (t_len[accepted] > 1)
    shapes = np.bincount(key, minlength=4)
    for k, name in enumerate(SHAPES):
        counter["accepted_shapes"][name] += int(shapes[k])


def _with_head(values: np.ndarray, ranges: np.ndarray, head, *, first_content=None):
    """Rows `values[r0:r1]`, each prefixed by `head` (None: no prefix), as flat values with offsets.

    `first_content`: when given, replaces each row's first content value if it is ACCEPTED (used for
    NO_PREDICTOR). Returns (int32 offsets [W+1], flat values, bool mask of content positions).
    """
    from csd_pipeline.align.chunks import ragged_arange

    r0, r1 = ranges[:, 0], ranges[:, 1]
    extra = 0 if head is None else 1
    offsets = np.zeros(len(r0) + 1, dtype=np.int64)
    np.cumsum(r1 - r0 + extra, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise CsdError("a batch of windows holds 2**31 tokens; lower --batch-mb.")
    heads = offsets[:-1]
    if extra and len(values):
        out = values.take(ragged_arange(r0 - 1, r1 - r0 + 1))  # a head slot takes values[r0 - 1], then is overwritten
        out[heads] = head
    elif extra:
        out = np.full(len(r0), head, dtype=values.dtype)
    else:
        out = values.take(ragged_arange(r0, r1 - r0))
    content = np.ones(len(out), dtype=bool)
    content[heads] = not extra
    if first_content is not None:
        firsts = (heads + extra)[r1 > r0]
        firsts = firsts[out[firsts] == ChunkStatus.ACCEPTED]
        out[firsts] = first_content
    return offsets.astype(np.int32), out, content


# Arrow arrays are built from buffers: no per-value Python objects (and pyarrow's conversion of
# Python lists or numpy arrays would import pandas, a second of start-up in every worker).


def _array(values: np.ndarray, type_name: str):
    import pyarrow as pa

    values = np.ascontiguousarray(values, dtype=np.dtype(type_name))
    return pa.Array.from_buffers(getattr(pa, type_name)(), len(values), [None, pa.py_buffer(values)])


def _bool_array(mask: np.ndarray):
    import pyarrow as pa

    return pa.Array.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(np.packbits(mask, bitorder="little"))])


def _list_array(offsets: np.ndarray, child):
    import pyarrow as pa

    from schemas.aligned import list_of

    return pa.Array.from_buffers(list_of(child.type), len(offsets) - 1, [None, pa.py_buffer(offsets)], children=[child])


def _string_array(data: np.ndarray, lengths: np.ndarray):
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise CsdError("a batch of windows holds 2 GiB of text; lower --batch-mb.")
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data))


def _strings(values: list[str]):
    encoded = [v.encode("utf-8") for v in values]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    return _string_array(np.frombuffer(b"".join(encoded), dtype=np.uint8), lengths)


def shard_stats(n_teachers: int) -> dict:
    """Zeroed counters of one aligned shard (text and chat modes share this layout)."""
    stats = {
        "documents": {"read": 0, "aligned": 0, "with_rejected_regions": 0},
        "rejected_documents": {},
        "rejected_regions": {"chunk_longer_than_window": 0},
        "rejected_region_bytes": 0,
        "windows": 0,
        "bytes": {"documents": 0, "windows": 0},
        "tokens": {"student": 0, **{f"teacher{i}": 0 for i in range(n_teachers)}},
    }
    for i in range(n_teachers):
        stats[f"teacher{i}"] = {
            "chunk_status": {s.name: 0 for s in ChunkStatus},
            "accepted_shapes": dict.fromkeys(SHAPES, 0),
        }
    return stats
