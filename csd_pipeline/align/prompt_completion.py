"""Prompt/completion records in text mode: the prompt is context, the completion is the loss region.

A record `{"prompt": P, "completion": C}` (what `csd-pipeline generate` writes) is one document
with text P + C. Both sides are aligned over the whole text, but only the completion is trained on:

- Token boundary at the prompt's end: as chat mode does at the start of the assistant turn, each
  side tokenizes P + C in one piece when that piece has a token ending exactly at the end of P;
  otherwise P and C are tokenized on their own (C without a SentencePiece dummy prefix), so every
  side's tokens spell P, then C, exactly. The end of P is then a common boundary: no chunk straddles it.
- Chunks of P get status `OUTSIDE_LOSS_REGION` (no KD) and P's student tokens are outside
  `student_loss_mask` (no CE); the chunks and tokens of C are those of text mode.
- A window holding only prompt bytes carries no loss and is not written (counted in
  `prompt_completion.prompt_only_windows`). Keep `--max-student-tokens` above prompt + completion
  so that the whole prompt stays in the completion's window.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from schemas.aligned import ChunkStatus


def boundaries(documents, doc_bytes: np.ndarray) -> np.ndarray | None:
    """Batch byte position of each document's prompt end (its start for a plain document), or None
    when no document of the batch is a prompt/completion record."""
    if all(d.prompt_bytes is None for d in documents):
        return None
    prompt = np.fromiter((d.prompt_bytes or 0 for d in documents), dtype=np.int64, count=len(documents))
    return doc_bytes[:-1] + prompt


def encode(bundle, texts: list[str], documents) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Content token ids of `texts` with a token boundary at every prompt end: (flat ids, offsets per
    text, indices of the documents tokenized as two parts)."""
    tokenizer = bundle.tokenizer
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    id_lists = [e.ids for e in encode_batch(texts, add_special_tokens=False)]
    split = [d for d, doc in enumerate(documents)
             if doc.prompt_bytes and not _natural_boundary(bundle.vocab, id_lists[d], texts[d], doc.prompt_bytes)]
    if split:
        prompts, completions = zip(*(_parts(texts[d], documents[d].prompt_bytes) for d in split))
        free = _prefix_free(bundle)
        free_batch = getattr(free, "encode_batch_fast", free.encode_batch)
        heads = encode_batch(list(prompts), add_special_tokens=False)
        tails = free_batch(list(completions), add_special_tokens=False)
        for d, head, tail in zip(split, heads, tails, strict=True):
            id_lists[d] = list(head.ids) + list(tail.ids)
    counts = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    offsets = np.zeros(len(id_lists) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets, split


def offset_ends(bundle, text: str, prompt_bytes: int) -> np.ndarray:
    """Byte ends (document coordinates) of a split document's tokens from character offsets, for a side
    whose token bytes do not spell the text (a normalizer changed it)."""
    from csd_pipeline.vocab.vocabulary import byte_ends_from_offsets

    prompt, completion = _parts(text, prompt_bytes)
    head = bundle.tokenizer.encode(prompt, add_special_tokens=False)
    tail = _prefix_free(bundle).encode(completion, add_special_tokens=False)
    head_ends = byte_ends_from_offsets(prompt, head.offsets) if head.ids else np.zeros(0, dtype=np.int64)
    tail_ends = byte_ends_from_offsets(completion, tail.offsets) if tail.ids else np.zeros(0, dtype=np.int64)
    return np.concatenate([np.asarray(head_ends, dtype=np.int64), prompt_bytes + np.asarray(tail_ends, dtype=np.int64)])


def mark_prompt_chunks(table, ends_at: np.ndarray) -> None:
    """Chunks that end at or before their document's prompt end become `OUTSIDE_LOSS_REGION`."""
    doc_of_chunk = np.repeat(np.arange(len(table.doc_chunks) - 1), np.diff(table.doc_chunks))
    in_prompt = table.bounds[1:] <= ends_at[doc_of_chunk]
    table.status[in_prompt] = ChunkStatus.OUTSIDE_LOSS_REGION


def completion_tokens(student, ends_at: np.ndarray) -> np.ndarray:
    """uint8 per student token of the batch: 1 where the token lies in a completion (or a plain document)."""
    doc_of_token = np.repeat(np.arange(len(student.doc_tokens) - 1), np.diff(student.doc_tokens))
    return (student.ends > ends_at[doc_of_token]).astype(np.uint8)


def drop_prompt_windows(windows, ends_at: np.ndarray, stats: dict):
    """`windows` without those that hold prompt bytes only (counted in the shard's stats)."""
    keep = windows.byte_range[:, 1] > ends_at[windows.doc]
    dropped = int((~keep).sum())
    counter = stats.setdefault("prompt_completion", {"prompt_only_windows": 0})
    counter["prompt_only_windows"] = counter.get("prompt_only_windows", 0) + dropped
    if not dropped:
        return windows
    windows.doc, windows.window_index, windows.byte_range = windows.doc[keep], windows.window_index[keep], windows.byte_range[keep]
    windows.student_range = windows.student_range[keep]
    windows.teacher_ranges = [r[keep] for r in windows.teacher_ranges]
    windows.chunk_ranges = [r[keep] for r in windows.chunk_ranges]
    return windows


def _parts(text: str, prompt_bytes: int) -> tuple[str, str]:
    data = text.encode("utf-8")
    return data[:prompt_bytes].decode("utf-8"), data[prompt_bytes:].decode("utf-8")


def _natural_boundary(vocab, ids: list[int], text: str, prompt_bytes: int) -> bool:
    """Whether the whole-text tokens spell the text and one of them ends exactly at the prompt's end."""
    spelled = [vocab.token_bytes[i] for i in ids]
    data = text.encode("utf-8")
    joined = b"".join(spelled)
    shift = 0
    if joined != data:
        if not (vocab.dummy_prefix and joined == b" " + data):
            return False
        shift = 1
    ends = np.cumsum([len(b) for b in spelled]) - shift
    return bool(np.isin(prompt_bytes, ends))


def _prefix_free(bundle):
    from csd_pipeline.align.chat_render import prefix_free_tokenizer

    return prefix_free_tokenizer(bundle)
