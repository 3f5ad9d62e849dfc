"""Speed of `csd-pipeline inspect` on a large aligned output: its polars lazy scans against reading
the same columns with pyarrow alone and counting them with numpy (issue 20 §2).

Output: the data-rich benchmark corpus (`bench/corpus/rich-train.jsonl`, 0.6 MB) aligned once
(llama-spm student, smollm2 teacher, windows of 256 tokens, shards of 0.25 MiB, 0.8 MB of Parquet),
then grown to the wanted size by a copied manifest that lists those shards again and again under new
names (hard links: a symbolic link leading outside the output is refused by the readers' path checks,
docs/RELIABILITY.md): the readers see GB of distinct shards while the disk holds one copy, so the
files are read from the page cache on both sides (the time is decoding and counting, not the disk).
Both readers compute the same tables (rows, documents, text bytes, tokens, chunk statuses and shapes,
window lengths, per source) and must agree exactly. Each is timed twice, alternating; the best counts.

    python -m bench.run_all inspect [--inspect-gb 1.0]     (default 0.1 GB; --quick 0.02 GB)
    python -m bench.bench_inspect [--gb 1.0] [--quick]
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORPUS = ROOT / "bench" / "corpus" / "rich-train.jsonl"
DEFAULT_GB, QUICK_GB = 0.1, 0.02
LIMIT_RATIO = 1.0  # polars must not be slower than pyarrow alone
REPEATS = 2


def _align(out: Path) -> Path:
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align

    run_align(AlignConfig(corpus=[str(CORPUS)], student_tokenizer="llama-spm", teacher_tokenizers=["smollm2"],
                          output=str(out), max_student_tokens=256, shard_bytes=1 << 18))
    return out


def replicate(aligned: Path, out: Path, gb: float) -> dict:
    """A copy of `aligned`'s manifest in `out` listing its shards until they sum to `gb` GiB (hard links, new
    names; `out` must be on the file system of `aligned`)."""
    manifest = json.loads((aligned / "manifest.json").read_text())
    shards, total, index = [], 0, 0
    out.mkdir(parents=True, exist_ok=True)
    while total < gb * (1 << 30):
        for shard in manifest["shards"]:
            name = f"part-00000-{index:05d}"
            os.link(aligned / shard["file"], out / f"{name}.parquet")
            shards.append(dict(shard, name=name, file=f"{name}.parquet"))
            total += shard["bytes"]
            index += 1
    copies = len(shards) // len(manifest["shards"])
    manifest["shards"] = shards
    manifest["totals"] = dict(manifest["totals"], shards=len(shards), rows=sum(s["rows"] for s in shards), bytes=total)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return {"shards": len(shards), "bytes": total, "copies": copies}


# ---------------------------------------------------------------------------------------------
# The same tables with pyarrow and numpy, shard by shard


def pyarrow_tables(aligned):
    """`csd_pipeline.report.stats.aligned_tables` of an `AlignedOutput`, computed by reading each shard with pyarrow."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from csd_pipeline.align.output import STUDENT_COLUMNS
    from csd_pipeline.report.stats import AlignedTables
    from schemas.aligned import SHAPES, ChunkStatus

    teachers = aligned.num_teachers
    chat = aligned.mode == "chat"
    sides = ["student", *(f"teacher{i}" for i in range(teachers))]
    chunk_columns = [aligned.chunk_columns(i) for i in range(teachers)]
    columns = ["source", "record_index", "text",
               *(name for c in chunk_columns for name in (c.student_len, c.teacher_len, c.status))]
    sources: dict[str, int] = {}
    rows, text_bytes, documents = {}, {}, {}
    lengths = {side: {} for side in sides}
    chunks = [np.zeros((0, 3), dtype=np.int64) for _ in range(teachers)]  # per (source*64 + key): chunks, s, t
    supervised = 0
    for shard in aligned.shards:
        table = pq.read_table(aligned.shard_path(shard), columns=columns + ([STUDENT_COLUMNS[1]] if chat else []))
        encoded = table["source"].combine_chunks().dictionary_encode()
        ids = np.asarray([sources.setdefault(s, len(sources)) for s in encoded.dictionary.to_pylist()],
                         dtype=np.int64)[encoded.indices.to_numpy()]
        _add(rows, ids, np.ones(len(ids), dtype=np.int64))
        _add(text_bytes, ids, pc.binary_length(table["text"]).to_numpy().astype(np.int64))
        pairs = np.unique(ids << 40 | table["record_index"].to_numpy())
        for key in pairs.tolist():
            documents[key] = 1
        if chat:
            mask = table[STUDENT_COLUMNS[1]].combine_chunks()
            supervised += int(mask.values.to_numpy(zero_copy_only=False).sum())
        for i in range(teachers):
            chunks[i] = _count_chunks(table, chunk_columns[i], ids, chunks[i], lengths, i)
    names = {v: k for k, v in sources.items()}
    tables = AlignedTables(rows=sum(rows.values()), text_bytes=sum(text_bytes.values()),
                           supervised_student_tokens=supervised, documents=len(documents),
                           tokens={side: 0 for side in sides},
                           window_tokens={side: dict(sorted(c.items())) for side, c in lengths.items()})
    per_source = {}
    for sid, name in names.items():
        docs = sum(1 for key in documents if key >> 40 == sid)
        per_source[sid] = {"source": name, "rows": rows[sid], "documents": docs, "text_bytes": text_bytes[sid],
                           "tokens": {side: 0 for side in sides},
                           "chunks": {f"teacher{i}": {"content": 0, "accepted": 0} for i in range(teachers)}}
    for i, counts in enumerate(chunks):
        teacher = f"teacher{i}"
        status_counts, shapes = {s.name: 0 for s in ChunkStatus}, {shape: 0 for shape in SHAPES}
        for code in np.flatnonzero(counts[:, 0]).tolist():
            sid, key = divmod(code, 64)
            status, shape = ChunkStatus(key // 4), SHAPES[key % 4]
            n, s_tokens, t_tokens = counts[code].tolist()
            status_counts[status.name] += n
            entry = per_source[sid]
            if chat or status != ChunkStatus.SPECIAL:
                entry["tokens"]["student"] += s_tokens if i == 0 else 0
                entry["tokens"][teacher] += t_tokens
            if status != ChunkStatus.SPECIAL:
                entry["chunks"][teacher]["content"] += n
            if status == ChunkStatus.ACCEPTED:
                entry["chunks"][teacher]["accepted"] += n
                shapes[shape] += n
        tables.chunk_status[teacher], tables.chunk_shapes[teacher] = status_counts, shapes
    for side in sides:
        tables.tokens[side] = sum(e["tokens"][side] for e in per_source.values())
    tables.sources = sorted(per_source.values(), key=lambda r: (-r["rows"], r["source"]))
    return tables


def _count_chunks(table, columns, ids, counts, lengths: dict, i: int):
    """Add one shard's chunks against teacher i to `counts` (rows: source*64 + status*4 + shape; columns:
    chunks, student tokens, teacher tokens) and its window lengths to `lengths`; returns the grown counts."""
    import numpy as np

    s_len = table[columns.student_len].combine_chunks()
    t_len = table[columns.teacher_len].combine_chunks()
    status = table[columns.status].combine_chunks()
    offsets = s_len.offsets.to_numpy()
    s_val, t_val = s_len.values.to_numpy().astype(np.int64), t_len.values.to_numpy().astype(np.int64)
    if i == 0:
        _count(lengths["student"], _row_sums(s_val, offsets))
    _count(lengths[f"teacher{i}"], _row_sums(t_val, offsets))
    key = status.values.to_numpy().astype(np.int64) * 4 + (s_val > 1) * 2 + (t_val > 1)
    per_chunk = np.repeat(ids, np.diff(offsets)) * 64 + key
    size = max(int(per_chunk.max(initial=0)) + 1, len(counts))
    grown = np.zeros((size, 3), dtype=np.int64)
    grown[:len(counts)] = counts
    for column, weights in enumerate((None, s_val, t_val)):
        grown[:, column] += np.bincount(per_chunk, weights, minlength=size).astype(np.int64)
    return grown


def _add(total: dict, ids, values) -> None:
    import numpy as np

    sums = np.bincount(ids, values)
    for sid in np.flatnonzero(np.bincount(ids)).tolist():
        total[sid] = total.get(sid, 0) + int(sums[sid])


def _row_sums(values, offsets):
    import numpy as np

    cumulative = np.concatenate([[0], np.cumsum(values)])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def _count(histogram: dict, values) -> None:
    import numpy as np

    unique, counts = np.unique(values, return_counts=True)
    for value, n in zip(unique.tolist(), counts.tolist()):
        histogram[value] = histogram.get(value, 0) + n


# ---------------------------------------------------------------------------------------------


def _timed(function) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def run(quick: bool = False, gb: float | None = None) -> dict:
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.report.stats import aligned_tables

    gb = gb if gb is not None else (QUICK_GB if quick else DEFAULT_GB)
    with tempfile.TemporaryDirectory() as tmp:
        aligned = _align(Path(tmp) / "aligned")
        big = Path(tmp) / "big"
        size = replicate(aligned, big, gb)
        output = AlignedOutput.open(big)
        polars_s, pyarrow_s = float("inf"), float("inf")
        for _ in range(REPEATS):  # alternate, so that a busy moment of the shared machine hits both
            seconds, from_polars = _timed(lambda: aligned_tables(output))
            polars_s = min(polars_s, seconds)
            seconds, from_pyarrow = _timed(lambda: pyarrow_tables(output))
            pyarrow_s = min(pyarrow_s, seconds)
    agree = dataclasses.asdict(from_polars) == dataclasses.asdict(from_pyarrow)
    ratio = polars_s / pyarrow_s
    return {
        "name": "inspect",
        "metrics": {"output_gb": size["bytes"] / (1 << 30), "shards": size["shards"], "rows": from_polars.rows,
                    "polars_seconds": polars_s, "pyarrow_seconds": pyarrow_s,
                    "polars_gb_per_s": size["bytes"] / (1 << 30) / polars_s},
        "checks": {"inspect_polars_vs_pyarrow": {"value": ratio, "limit": LIMIT_RATIO, "ok": ratio <= LIMIT_RATIO},
                   "inspect_tables_agree": {"value": float(agree), "limit": 1.0, "ok": agree}},
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, help=f"size of the replicated output in GiB (default {DEFAULT_GB})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_GB} GiB")
    args = parser.parse_args()
    print(json.dumps(run(quick=args.quick, gb=args.gb), indent=2))
