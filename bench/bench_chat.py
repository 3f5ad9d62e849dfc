"""Chat mode of `csd-pipeline align`: speed against the tokenizers floor, and exactness.

Corpus: `--corpus DIR`, a folder holding python-faq-chat.jsonl (174 CPython FAQ question/answer
pairs; tests/data/README.md says where it comes from), or by default the committed slice
tests/data/python-faq-chat-slice.jsonl (its first 30 records). Student Qwen2 (its own ChatML
template), teacher SmolLM2 (its own template).

Floor: `tokenizers` `encode_batch_fast` of the two renderings of every record (what chat mode must
tokenize anyway), in this process. Measured: `ChatAligner.align_documents` over the same records
(rendering each conversation twice per side with jinja2, locating the final turn, tokenizing,
aligning the answer, building the Arrow rows), tokenizers and templates loaded beforehand. Floor and
stage alternate and the best of each is kept (the machine is shared). Checks: the ratio, no record
refused on this clean data, and every row's loss mask spelling exactly the final answer bytes
followed by the end-of-turn token.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORPUS_FILE = "python-faq-chat.jsonl"
SLICE = ROOT / "tests" / "data" / "python-faq-chat-slice.jsonl"
STUDENT, TEACHER = "qwen2", "smollm2"
LIMIT_RATIO = 6.0
REPEATS = 3


def _records(quick: bool, corpus_dir: Path | None) -> tuple[list[dict], str]:
    if corpus_dir is None:
        records = [json.loads(line) for line in SLICE.read_text(encoding="utf-8").splitlines()]
        return records, "tests/data/python-faq-chat-slice.jsonl (the committed slice; --corpus DIR for the full file)"
    full = Path(corpus_dir) / CORPUS_FILE
    if not full.is_file():
        raise FileNotFoundError(f"{full} not found: --corpus must be a folder holding {CORPUS_FILE}")
    records = [json.loads(line) for line in full.read_text(encoding="utf-8").splitlines()]
    return (records[:60], "python-faq-chat.jsonl (first 60, quick)") if quick else (records, "python-faq-chat.jsonl")


def _mask_exact(rows: list[dict], records: list[dict], vocab, eot: int) -> float:
    exact = 0
    for row, record in zip(rows, records, strict=True):
        ids = [i for i, m in zip(row["student_ids"], row["student_loss_mask"], strict=True) if m]
        answer = record["messages"][-1]["content"].encode("utf-8")
        exact += ids[-1] == eot and b"".join(vocab.token_bytes[i] for i in ids[:-1]) == answer
    return exact / len(rows) if rows else 0.0


def run(quick: bool = False, corpus: Path | None = None) -> dict:
    from csd_pipeline.align.chat_mode import ChatAligner
    from csd_pipeline.align.chat_records import ChatOptions
    from csd_pipeline.align.corpus import Document
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    records, note = _records(quick, corpus)
    start = time.perf_counter()
    student = load_tokenizer(str(tokenizer_path(STUDENT)))
    teacher = load_tokenizer(str(tokenizer_path(TEACHER)))
    aligner = ChatAligner(student, [teacher], 1 << 20, [1 << 20], ChatOptions(), [None, None])
    aligner.check()
    load_seconds = time.perf_counter() - start
    documents = [Document("bench.jsonl", i, json.dumps(r)) for i, r in enumerate(records)]
    renderings = [[side.render(r, ChatOptions()).text for r in records] for side in aligner.sides]

    floors, stages = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for side, texts in zip(aligner.sides, renderings, strict=True):
            side.bundle.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        floors.append(time.perf_counter() - start)
        stats = aligner.new_stats()
        start = time.perf_counter()
        table = aligner.align_documents(documents, stats)
        stages.append(time.perf_counter() - start)
    floor, stage = min(floors), min(stages)
    rows = table.to_pylist()
    eot = student.vocab.roles["eot"]
    exact = _mask_exact(rows, [records[r["record_index"]] for r in rows], student.vocab, eot)
    refused = sum(stats["rejected_documents"].values())
    chunks = stats["teacher0"]["chunk_status"]
    total_chunks = sum(chunks.values())
    ratio = stage / floor
    return {
        "name": "chat",
        "metrics": {
            "corpus": note,
            "records": len(records),
            "rows": len(rows),
            "student_tokens": stats["tokens"]["student"],
            "teacher_tokens": stats["tokens"]["teacher0"],
            "supervised_student_tokens_per_row": round(stats["chat"]["supervised_student_tokens"] / max(1, len(rows)), 2),
            "accepted_chunk_fraction": round(chunks["ACCEPTED"] / max(1, total_chunks), 4),
            "accepted_shapes": stats["teacher0"]["accepted_shapes"],
            "load_seconds": round(load_seconds, 3),
            "floor_seconds": round(floor, 4),
            "chat_align_seconds": round(stage, 4),
            "records_per_second": round(len(records) / stage, 1),
        },
        "checks": {
            "chat_align_over_tokenize_floor": {"value": ratio, "limit": LIMIT_RATIO, "ok": ratio <= LIMIT_RATIO},
            "records_refused": {"value": float(refused), "limit": 0.0, "ok": refused == 0},
            "mask_is_answer_plus_eot_fraction": {"value": exact, "limit": 1.0, "ok": exact >= 1.0},
        },
    }


if __name__ == "__main__":
    from bench.command_line import run_alone

    run_alone(run, __doc__, CORPUS_FILE, sys.argv[1:], sort_keys=True)
