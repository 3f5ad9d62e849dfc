"""One teacher capture, many students, on the demo corpus (issue 42 item 2): what sharing a capture costs and saves.

The demo's teacher (SmolLM2-135M-Instruct, `smollm2` tokenizer) is captured once (`align --capture-only`, then
`teacher-logits` with the demo store's selectors but `--keep top-k`: a capture serves any student), and two
students are aligned against it (`align --against-capture`): the demo's Llama 2 SentencePiece tokenizer and
the ByteLevel `gpt-2` fixture. Each student also gets a capture made for it alone, as the demo makes one:
`align` with the student, then `teacher-logits` with the demo store (`--keep csd-events`, which keeps only
what the CSD loss reads, so the CSD loss is the one the same entries of a whole top-k give). Each student
trains `--steps` steps (default 50) with the demo's CSD recipe from both, and the losses are compared.

Two window settings:
- `same`: windows of 1024 tokens on every side, so every demo document is one window for every tokenizer and
  both ways cut the same windows: the losses must agree within float tolerance;
- `demo`: the demo's 256-token windows. A capture cuts by the teacher alone and the normal align by both
  sides, so the windows differ: the losses and the ACCEPTED chunks of each are reported.

Reported per setting: the teacher-logits wall seconds of the capture and of each student's own run (what a
shared capture saves is the second student's run, and every later one), bytes per teacher position of the
capture's store and of each `--keep csd-events` store, the edge chunks of each student against the capture,
and the 50 losses of each pair with their largest difference. Every command runs with OMP_NUM_THREADS=1 and is
printed; outputs are kept in --out, so a re-run resumes (a finished stage is not run again, its seconds are
read back from --out/seconds.json).

    python -m bench.bench_capture [--out out/bench-capture] [--steps 50] [--settings same,demo] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from csd_pipeline.recipes import as_flags, load_store, recipe_path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = "demo/corpus/devil-train.jsonl"
TEACHER, TEACHER_TOKENIZER = "smollm2-135m-instruct", "smollm2"
STUDENTS = ("llama-spm", "gpt-2")
STORE = load_store("stores/events-min0.02-s48")  # the demo's store
CAPTURE_STORE = {key: value for key, value in STORE.items() if key != "keep"}
# window (teacher tokens of a capture window, and both limits of the normal align), the student limit against the
# capture (a capture window of 256 teacher tokens can hold more student tokens), --seq-len of training
SETTINGS = {"same": {"window": 1024, "against_student": 1024, "seq_len": 1024},
            "demo": {"window": 256, "against_student": 512, "seq_len": 512}}


class Runner:
    """Runs commands (printed, timed, one thread each); a command whose output folder is complete is skipped and
    its seconds read back from OUT/seconds.json."""

    def __init__(self, out: Path):
        self.out = out
        self.seconds_file = out / "seconds.json"
        self.seconds = json.loads(self.seconds_file.read_text()) if self.seconds_file.is_file() else {}

    def __call__(self, key: str, args: list, done: Path) -> float:
        if key in self.seconds and done.exists():
            return self.seconds[key]
        shown = " ".join(shlex.quote(str(a)) for a in args)
        print(f"\n$ OMP_NUM_THREADS=1 {shown}", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        started = time.perf_counter()
        result = subprocess.run([str(a) for a in args], cwd=ROOT, env=env)
        if result.returncode:
            sys.exit(f"bench_capture: the command above failed (exit {result.returncode})")
        self.seconds[key] = round(time.perf_counter() - started, 1)
        self.seconds_file.write_text(json.dumps(self.seconds, indent=1, sort_keys=True))
        print(f"  ({self.seconds[key]} s)", flush=True)
        return self.seconds[key]


def pipeline(*args) -> list:
    return [sys.executable, "-m", "cli.main", *args]


def manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def store_numbers(directory: Path, seconds: float) -> dict:
    """Seconds, positions and shard bytes per teacher position of a teacher-logits output."""
    totals = manifest(directory)["totals"]
    positions = totals["stats"]["positions"]
    return {"seconds": seconds, "positions": positions, "bytes": totals["bytes"],
            "bytes_per_position": round(totals["bytes"] / positions, 1),
            "entries_per_position": round(totals["stats"]["entries"] / positions, 2)}


def student_config(out: Path, student: str) -> Path:
    """The demo's student config, with the vocabulary of `student`'s tokenizer."""
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    config = json.loads((ROOT / "demo" / "student-config.json").read_text())
    vocab = load_tokenizer(str(tokenizer_path(student))).vocab
    config["vocab_size"] = vocab.size
    for role in ("bos", "eos"):
        if role in vocab.roles:
            config[f"{role}_token_id"] = int(vocab.roles[role])
    config["max_position_embeddings"] = 1024
    path = out / f"student-{student}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def train(run: Runner, key: str, aligned: Path, store: Path, student: str, config: Path, output: Path, seq_len: int,
          steps: int) -> dict:
    """Train the student `steps` steps with the demo's CSD recipe; its losses and the chunks it trained on."""
    run(key, [sys.executable, "-m", "trainer.main", "--config", recipe_path("demo/train"), "--config",
              recipe_path("demo/csd"), "--aligned", aligned, "--teacher-logits", store, "--student-config", config,
              "--student-tokenizer", student, "--output", output, "--steps", str(steps), "--seq-len", str(seq_len),
              "--no-progress"], output / "metrics.jsonl")
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    chunk_keys = [k for k in rows[0] if k.startswith("chunks_")]
    return {"loss": [row["loss"] for row in rows], "ce": [row["ce"] for row in rows],
            "chunks_trained": sum(row[k] for row in rows for k in chunk_keys)}


def run_setting(run: Runner, out: Path, name: str, steps: int) -> dict:
    setting = SETTINGS[name]
    window = str(setting["window"])
    base = out / name
    capture, capture_store = base / "capture", base / "capture-teacher"
    report: dict = {"window": setting["window"]}
    run(f"{name}/capture-align", pipeline("align", "--capture-only", "--corpus", CORPUS, "--teacher-tokenizer",
                                          TEACHER_TOKENIZER, "--max-teacher-tokens", window, "--output", capture,
                                          "--quiet"), capture / "manifest.json")
    seconds = run(f"{name}/capture-teacher", pipeline("teacher-logits", "--aligned", capture, "--teacher", TEACHER,
                                                      *as_flags(CAPTURE_STORE), "--device", "cpu", "--output",
                                                      capture_store, "--quiet"), capture_store / "manifest.json")
    report["capture"] = {"rows": manifest(capture)["totals"]["rows"], **store_numbers(capture_store, seconds)}
    for student in STUDENTS:
        config = student_config(out, student)
        against, own, own_store = base / f"against-{student}", base / f"own-{student}", base / f"own-{student}-teacher"
        run(f"{name}/{student}/against", pipeline(
            "align", "--against-capture", capture, "--student-tokenizer", student, "--max-student-tokens",
            str(setting["against_student"]), "--output", against, "--quiet"), against / "manifest.json")
        run(f"{name}/{student}/own-align", pipeline(
            "align", "--corpus", CORPUS, "--student-tokenizer", student, "--teacher-tokenizer", TEACHER_TOKENIZER,
            "--max-student-tokens", window, "--max-teacher-tokens", window, "--output", own, "--quiet"),
            own / "manifest.json")
        seconds = run(f"{name}/{student}/own-teacher", pipeline(
            "teacher-logits", "--aligned", own, "--teacher", TEACHER, *as_flags(STORE), "--device", "cpu", "--output",
            own_store, "--quiet"), own_store / "manifest.json")
        shared = train(run, f"{name}/{student}/train-shared", against, capture_store, student, config,
                       base / f"train-{student}-shared", setting["seq_len"], steps)
        alone = train(run, f"{name}/{student}/train-own", own, own_store, student, config,
                      base / f"train-{student}-own", setting["seq_len"], steps)
        stats = {key: manifest(folder)["totals"]["stats"] for key, folder in (("against", against), ("own", own))}
        diffs = [abs(a - b) for a, b in zip(shared["loss"], alone["loss"])]
        report[student] = {
            "own_store": store_numbers(own_store, seconds),
            "rows": {"against": manifest(against)["totals"]["rows"], "own": manifest(own)["totals"]["rows"]},
            "same_rows": _same_rows(against, own),
            "accepted_chunks": {key: s["teacher0"]["chunk_status"]["ACCEPTED"] for key, s in stats.items()},
            "capture_edges": stats["against"]["capture_edges"],
            "capture_edge_chunks": stats["against"]["teacher0"]["chunk_status"]["CAPTURE_EDGE"],
            "chunks_trained": {"shared": shared["chunks_trained"], "own": alone["chunks_trained"]},
            "loss_shared": shared["loss"], "loss_own": alone["loss"],
            "max_abs_loss_difference": max(diffs), "mean_loss": {"shared": _mean(shared["loss"]), "own": _mean(alone["loss"])},
        }
    own_seconds = sum(report[s]["own_store"]["seconds"] for s in STUDENTS)
    report["teacher_seconds"] = {"capture_once": report["capture"]["seconds"], "own_per_student_total": own_seconds,
                                 "saved": round(own_seconds - report["capture"]["seconds"], 1)}
    return report


def _same_rows(a: Path, b: Path) -> bool:
    import pyarrow.parquet as pq

    def rows(folder):
        return [r for s in manifest(folder)["shards"] for r in pq.read_table(folder / s["file"]).to_pylist()]

    return rows(a) == rows(b)


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-capture", help="output folder (kept; a re-run resumes)")
    parser.add_argument("--steps", type=int, default=50, help="training steps of each student run")
    parser.add_argument("--settings", default="same,demo", help="window settings, comma-separated: same, demo")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Runner(out)
    report = {"steps": args.steps, "corpus": CORPUS, "teacher": TEACHER, "students": list(STUDENTS),
              "capture_store": CAPTURE_STORE, "own_store": STORE}
    for name in args.settings.split(","):
        report[name] = run_setting(run, out, name, args.steps)
    text = json.dumps(report, indent=1)
    (out / "report.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    for name in args.settings.split(","):
        r = report[name]
        print(f"\n== {name} windows ({r['window']} tokens): capture teacher {r['capture']['seconds']} s, "
              f"{r['capture']['bytes_per_position']} B/position; saved {r['teacher_seconds']['saved']} s of teacher")
        for student in STUDENTS:
            s = r[student]
            print(f"  {student}: own csd-events store {s['own_store']['seconds']} s, {s['own_store']['bytes_per_position']} "
                  f"B/position; same rows {s['same_rows']}; ACCEPTED {s['accepted_chunks']}; edges {s['capture_edges']}; "
                  f"mean loss {s['mean_loss']}; max |loss difference| {s['max_abs_loss_difference']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
