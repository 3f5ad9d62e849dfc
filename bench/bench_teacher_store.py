"""Bytes per position of the teacher store, by kind of text and by what each position keeps (issue 21).

The real SmolLM2-135M-Instruct teacher runs once over `bench/corpus/kinds.jsonl` (six kinds of
text, one aligned shard each, gpt-2 student, 1024-token windows) with its top-128; each setting (a store
setting, `bench.experiments.plan.store_settings(name)`) then goes through that setting's selectors
(`csd_pipeline/teacher/store/selectors/`, built from the setting's options as `teacher-logits` builds them) and the store's writer (`write_store`, same blocks,
same Parquet file), from those same values:

- `top-128`, `top-64`, `top-32`: a fixed top-k (`--top-k 128`, ...);
- `p0.99`, `p0.95`, `p0.90`: the mass-adaptive top-k (`--top-p P --top-k 128`): per position the most
  likely entries until their probabilities reach P, at most 128; `p0.99k64`: `--top-p 0.99 --top-k 64`;
- `events128`, `events72`, `events68`: `--top-k 128` / `72` / `68 --keep csd-events`, only the entries the CSD loss turns
  into events (these depend on the student: `--student NAME`, default gpt-2; the quality benchmark's
  student is llama-spm);
- `min0.0035`: `--top-k 128 --min-p 0.0035`, the entries at least 0.0035 times as likely as the first;
  `events-min0.004`, `events-min0.0035`: those with `--keep csd-events`;
- `events-min0.01-s32`, `events-min0.02-s48`: `--top-k 128 --min-p 0.01 --tail-samples 32 --keep csd-events`
  (and 0.02 / 48): the kept entries plus draws from the rest of each position's distribution. The draws
  need the whole distribution, so these run the real `TeacherRunner` again per kind (TAIL_SETTINGS; bytes
  and entries per position only).

Reported per kind and over all kinds: shard-file bytes per position, entries per position (mean,
share of positions with 1 entry and with 128), the teacher mass the stored entries hold, and how
often the observed next token is among them. `pooled_block` encodes every kind's positions as one
block (what a large shard's 64k-position blocks see: LZMA warmed up) for the scale sheet. A real
`TeacherRunner` with the `p0.99` selectors run on the first kind must write the same bytes as its `p0.99`
file, and a real top-128 run with the stage's event selection the same bytes as its `events128` file.

`--teacher gemma3-270m` runs the Gemma 3 270M teacher (262,144 ids; aligned for its own tokenizer)
instead; `--chars N` keeps the first N characters of each kind (default 16,000; 2,000 in quick mode).

    python -m bench.bench_teacher_store [--quick] [--teacher NAME] [--student NAME] [--chars N] [--json FILE]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from bench.experiments.plan import store_settings

ROOT = Path(__file__).resolve().parent.parent

TEACHER = "smollm2-135m-instruct"
TEACHER_TOKENIZERS = {"smollm2-135m-instruct": "smollm2", "gemma3-270m": "gemma3"}  # model fixture -> its tokenizer
STORED_K = 128
# The settings measured: stores by name (a shipped store recipe or experiments.yaml's `stores:`, the `teacher-logits` options they stand for).
SETTINGS = {name: store_settings(name) for name in (
    "top-128", "top-64", "top-32", "p0.99", "p0.95", "p0.90", "p0.99k64", "events128", "events72", "events68",
    "min0.0035", "events-min0.004", "events-min0.0035")}
# with tail draws: a real runner of its own per kind
TAIL_SETTINGS = {name: store_settings(name) for name in ("events-min0.01-s32", "events-min0.02-s48")}


def _chains(aligned) -> dict:
    """Each setting's `SelectorChain`, built from its options as `teacher-logits` builds it; the settings with
    `--keep csd-events` share one selector (one set of tables loaded)."""
    from csd_pipeline.teacher.store.selectors import SelectorChain, chain_from_config

    chains, shared = {}, None
    for name, store in SETTINGS.items():
        chain = chain_from_config(store, aligned)
        if store.get("keep") == "csd-events":
            shared = shared or chain.selectors[-1]
            chain = SelectorChain((*chain.selectors[:-1], shared))
        chains[name] = chain
    for name, store in TAIL_SETTINGS.items():
        chains[name] = chain_from_config(store, aligned)
    return chains


def _coverage(stored, top_k: int, rows) -> dict:
    """Entries per position, the stored teacher mass and the observed token among the stored entries
    (`stored`: the rows one setting stores)."""
    import numpy as np

    counts, mass, hits, observed = [], [], 0, 0
    for result, row in zip(stored, rows):
        logprobs, ids, n = result.logprobs, result.ids, result.lengths
        kept = np.arange(top_k)[None, :] < n[:, None]
        counts.append(n)
        mass.append(np.where(kept, np.exp(logprobs.astype(np.float64)), 0.0).sum(axis=1))
        hits += int(((ids[:-1] == np.asarray(row[1:])[:, None]) & kept[:-1]).any(axis=1).sum())
        observed += len(row) - 1
    counts, mass = np.concatenate(counts), np.concatenate(mass)
    return {"entries_mean": float(counts.mean()), "entries_median": float(np.median(counts)),
            "one_entry_share": float((counts == 1).mean()), "at_cap_share": float((counts == top_k).mean()),
            "stored_mass_mean": float(mass.mean()), "observed_stored_share": hits / observed}


def _pooled_block(stored, all_rows, top_k: int) -> float:
    """Payload bytes per position when every kind's positions (`stored`, one setting's) form one block."""
    from csd_pipeline.teacher.store.writer import encode_rows

    payload, stats = encode_rows(stored, all_rows, top_k)
    return len(payload) / stats["positions"]


def _align(tmp: Path, quick: bool, teacher_tokenizer: str, chars: int | None, student: str = "gpt-2"
           ) -> tuple[Path, list[str]]:
    """The kinds of text aligned as `bench_teacher` aligns them (gpt-2 student unless `student`, 1024-token
    windows, one shard per kind), for `teacher_tokenizer`, each kind cut to `chars` characters when given."""
    from bench.bench_teacher import WINDOW, corpus_sources
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align

    corpus = tmp / "corpus"
    corpus.mkdir()
    files = []
    for index, (name, body) in enumerate(corpus_sources(quick, None).items()):
        path = corpus / f"{index}-{name}.txt"
        path.write_text(body if chars is None else body[:chars], encoding="utf-8")
        files.append(str(path))
    out = tmp / "aligned"
    run_align(AlignConfig(corpus=files, student_tokenizer=student, teacher_tokenizers=[teacher_tokenizer], output=str(out),
                          max_student_tokens=WINDOW, max_teacher_tokens=[WINDOW], shard_bytes=1), rank=0, world_size=1)
    return out, files


def run(quick: bool = False, teacher: str = TEACHER, chars: int | None = None, student: str = "gpt-2") -> dict:
    """Bytes per position per kind and setting; returns {"name", "metrics", "checks"}."""
    import torch

    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.errors import CsdError
    from csd_pipeline.fixtures.names import model_path, tokenizer_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.config import TeacherLogitsConfig
    from csd_pipeline.teacher.runner import TeacherRunner
    from csd_pipeline.teacher.shard_writer import write_teacher_shard
    from csd_pipeline.teacher.store.selectors import chain_from_config
    from csd_pipeline.teacher.store.writer import write_store
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    if teacher not in TEACHER_TOKENIZERS:
        raise CsdError(f"--teacher {teacher}: not a fixture teacher; pass one of {', '.join(TEACHER_TOKENIZERS)}")
    vocab_limit = load_tokenizer(str(tokenizer_path(TEACHER_TOKENIZERS[teacher]))).vocab.size
    block = TeacherLogitsConfig.block_positions
    metrics: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-teacher-store-") as tmp_name:
        tmp = Path(tmp_name)
        aligned_dir, files = _align(tmp, quick, TEACHER_TOKENIZERS[teacher], chars, student)
        kinds = [Path(name).stem.split("-", 1)[1] for name in files]
        aligned = AlignedOutput.open(aligned_dir)
        chains = _chains(aligned)
        loaded = load_causal_lm(str(model_path(teacher)), device="cpu")
        runner = TeacherRunner(loaded, top_k=STORED_K, vocab_limit=vocab_limit, batch_tokens=8192)
        tail_runners = {name: TeacherRunner(loaded, top_k=STORED_K, vocab_limit=vocab_limit, batch_tokens=8192,
                                            selectors=chains[name].position_selectors()) for name in TAIL_SETTINGS}
        totals = {name: [0, 0] for name in [*SETTINGS, *TAIL_SETTINGS]}
        tail_entries = {name: 0 for name in TAIL_SETTINGS}
        all_rows, coverage_rows = [], {name: [] for name in SETTINGS}
        all_stored: dict = {name: [] for name in SETTINGS}
        began = time.perf_counter()
        for index, (kind, shard) in enumerate(zip(kinds, aligned.shards)):
            row_ids, rows = aligned.teacher_rows(shard, 0)
            aligned_rows = aligned.read(shard, aligned.training_columns([0])).to_pylist()
            results = runner.run(rows)
            all_rows += rows
            for name, store in SETTINGS.items():
                top_k = store["top_k"]
                target, chain = tmp / f"{name}-{index}.parquet", chains[name]
                chosen = chain.row_cut(aligned_rows)
                cut = [chain.cut_row(result, row) for result, row in zip(results, rows)]  # the forward's selectors
                stats = write_store(target, chain, row_ids, rows, lambda start, end, cut=cut: cut[start:end], block, chosen)
                size = target.stat().st_size
                totals[name][0] += size
                totals[name][1] += stats["positions"]
                metrics[f"{kind}/{name}/bytes_per_position"] = round(size / stats["positions"], 2)
                stored = cut if chosen is None else [chosen(i, r) if r.ok else r for i, r in enumerate(cut)]
                all_stored[name] += stored
                coverage = _coverage(stored, top_k, rows)
                coverage_rows[name].append((stats["positions"], coverage))
                metrics[f"{kind}/{name}/entries_mean"] = round(coverage["entries_mean"], 2)
            for name, tail_runner in tail_runners.items():
                target = tmp / f"{name}-{index}.parquet"
                chain = chains[name]
                stats = write_teacher_shard(tail_runner, chain, row_ids, rows, target, block,
                                            chain.row_cut(aligned_rows)).stats
                totals[name][0] += target.stat().st_size
                totals[name][1] += stats["positions"]
                tail_entries[name] += stats["entries"]
                metrics[f"{kind}/{name}/bytes_per_position"] = round(target.stat().st_size / stats["positions"], 2)
                metrics[f"{kind}/{name}/entries_mean"] = round(stats["entries"] / stats["positions"], 2)
            metrics[f"{kind}/positions"] = sum(len(r) for r in rows)
            if index == 0:  # the real runner (with --top-p; with the event selection) writes what the replay wrote
                top_p = chain_from_config({"top_k": STORED_K, "top_p": 0.99})
                real = TeacherRunner(loaded, top_k=STORED_K, vocab_limit=vocab_limit, batch_tokens=8192,
                                     selectors=top_p.position_selectors())
                write_teacher_shard(real, top_p, row_ids, rows, tmp / "real-p0.99.parquet", block)
                same = (tmp / "real-p0.99.parquet").read_bytes() == (tmp / "p0.99-0.parquet").read_bytes()
                events = chains["events128"]
                write_teacher_shard(runner, events, row_ids, rows, tmp / "real-events128.parquet", block,
                                    events.row_cut(aligned_rows))
                same_events = (tmp / "real-events128.parquet").read_bytes() == (tmp / "events128-0.parquet").read_bytes()
        seconds = time.perf_counter() - began
        for name, store in SETTINGS.items():
            top_k, (size, positions) = store["top_k"], totals[name]
            metrics[f"all/{name}/bytes_per_position"] = round(size / positions, 2)
            metrics[f"all/{name}/pooled_block_payload_bytes_per_position"] = round(
                _pooled_block(all_stored[name], all_rows, top_k), 2)
            for key in ("entries_mean", "one_entry_share", "at_cap_share", "stored_mass_mean", "observed_stored_share"):
                weighted = sum(n * c[key] for n, c in coverage_rows[name]) / positions
                metrics[f"all/{name}/{key}"] = round(weighted, 4)
        for name in TAIL_SETTINGS:
            metrics[f"all/{name}/bytes_per_position"] = round(totals[name][0] / totals[name][1], 2)
            metrics[f"all/{name}/entries_mean"] = round(tail_entries[name] / totals[name][1], 2)
        metrics["teacher"] = teacher
        metrics["student"] = student
        metrics["positions"] = totals["top-128"][1]
        metrics["teacher_and_encode_seconds"] = round(seconds, 1)
        metrics["torch_threads"] = torch.get_num_threads()
    checks = {"real_top_p_run_writes_the_replayed_bytes": {"value": same, "ok": same},
              "real_event_selection_writes_the_replayed_bytes": {"value": same_events, "ok": same_events}}
    return {"name": "teacher_store", "metrics": metrics, "checks": checks}


if __name__ == "__main__":
    def _option(flag: str, default):
        return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default

    chars = _option("--chars", None)
    result = run(quick="--quick" in sys.argv, teacher=_option("--teacher", TEACHER),
                 chars=None if chars is None else int(chars), student=_option("--student", "gpt-2"))
    text = json.dumps(result, indent=2, sort_keys=True)
    if "--json" in sys.argv:
        target = Path(sys.argv[sys.argv.index("--json") + 1])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
    print(text)
