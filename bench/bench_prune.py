"""`make bench-prune`: healing a depth-pruned SmolLM2 by CE, by CSD from Gemma 3, by CSD and by same-vocabulary KD
from the unpruned SmolLM2, at equal steps, data and seed (issue 33, prune and heal).

Student: SmolLM2-135M-Instruct with 20 of its 30 decoder layers removed (`bench/prune_student.py --keep
0-7,28-29`: the first 8 and the last 2 kept, the deeper middle block removed, as depth pruning finds the
middle-to-deep layers the least needed). Data: English prose, `bench/corpus/rich-train.jsonl` (*The Devil's
Dictionary* and *Botchan*, public domain), every second document (about 300 KB); held out:
`rich-heldout.jsonl` (every tenth document of the same text, 40 KB), the same split for every arm.
Teachers (top-128 each, stored once): Gemma 3 270M (another tokenizer: the alignment has M:1, 1:N and M:N
chunks) and the unpruned SmolLM2 (the same tokenizer: every chunk is 1:1, so CSD must reduce to top-k KD
with a REST term).
Recipe: 100 steps of 2 windows of 256 tokens (51k tokens, about 0.7 epoch), learning rate 1e-4, 5 warm-up
steps, KD weight fixed at 0.5 (L = CE + 0.5 KD, the pretrained-student recipe of `make bench-pretrained`),
teacher temperature 1 (same-vocabulary KD is defined at T = 1, and every arm uses the same).

Arms (ARMS): `ce`; `csd gemma3` and `csd gemma3 t1.5` (CSD from Gemma 3); `csd smollm2` (CSD from the unpruned
SmolLM2); `kd smollm2` (`--loss kd`: forward KL on the stored entries plus the rest); each KD arm also with the
from-scratch weighting, the dynamic scale (`... dynamic`). Reference scores:
the pruned model before healing, the unpruned SmolLM2, Gemma 3. "Gap closed" is
(before - arm) / (before - unpruned).

    python bench/bench_prune.py [--arms A,B] [--seeds 0,1,2] [--jobs 2] [--quick] [--table FILE]

Writes bench-results/prune.json (one record per run, replacing the same (arm, seed)) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

from bench_quality import BIN, ROOT, WINDOW, _read_jsonl, fresh_run, run, side_by_side
from bench_teachers import bits_per_byte

STUDENT = "smollm2-135m-instruct"
KEEP = "0-7,28-29"
TEACHERS = {"gemma3": ("gemma3", "gemma3-270m"), "smollm2": ("smollm2", STUDENT)}  # name: (tokenizer, model)
TRAIN_TAKE, STEPS, LR, WARMUP = slice(0, None, 2), 100, "1e-4", 5
TRAIN = ["--seq-len", str(WINDOW), "--batch-size", "2", "--lr", LR, "--save-every", "0", "--workers", "1",
         "progress=false"]
FIXED = ["--kd-scale", "fixed", "--kd-weight", "0.5"]
KL = ["--loss", "csd", "--divergence", "kl", "--beta", "1"]
CSD = [*KL, *FIXED]
ARMS = {  # arm: (teacher or None, flags)
    "ce": (None, ["--loss", "ce"]),
    "csd gemma3": ("gemma3", CSD),
    "csd gemma3 t1.5": ("gemma3", [*CSD, "--teacher-temperature", "1.5"]),
    "csd smollm2": ("smollm2", CSD),
    "kd smollm2": ("smollm2", ["--loss", "kd", *FIXED]),
    # the from-scratch weighting (the dynamic scale sg(CE/KD)): the pruned model starts far from its teacher
    "csd gemma3 dynamic": ("gemma3", KL),
    "csd smollm2 dynamic": ("smollm2", KL),
    "kd smollm2 dynamic": ("smollm2", ["--loss", "kd"]),
}


def _documents(name: str, take: slice | None, folder: Path) -> str:
    path = ROOT / "bench/corpus" / name
    if take is None:
        return str(path)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    text = "".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[take])
    if not target.is_file() or target.read_text(encoding="utf-8") != text:
        target.write_text(text, encoding="utf-8")
    return str(target)


def prepare(out: Path, log: Path, quick: bool) -> dict:
    """The pruned student; per teacher the training text aligned (SmolLM2 student side) and its top-128; the
    held-out text aligned (SmolLM2 on both sides, for the students' and the unpruned model's scores)."""
    pipeline, dirs = BIN / "csd-pipeline", {"student": out / "smollm2-pruned"}
    if not (dirs["student"] / "config.json").is_file():
        run([sys.executable, ROOT / "bench/prune_student.py", "--model", STUDENT, "--keep", KEEP,
             "--output", dirs["student"]], log)
    train = _documents("rich-train.jsonl", slice(0, 4) if quick else TRAIN_TAKE, out / "corpus")
    heldout = _documents("rich-heldout.jsonl", slice(0, 2) if quick else None, out / "corpus-heldout")
    for name, (tokenizer, model) in TEACHERS.items():
        align = ["--student-tokenizer", "smollm2", "--teacher-tokenizer", tokenizer, "--max-student-tokens", WINDOW,
                 "--max-teacher-tokens", WINDOW, "--quiet"]
        for part, corpus in (("aligned", train), ("heldout", heldout)):
            dirs[f"{part}-{name}"] = out / f"{part}-{name}"
            if not (dirs[f"{part}-{name}"] / "manifest.json").is_file():
                run([pipeline, "align", "--corpus", corpus, "--output", dirs[f"{part}-{name}"], *align], log)
        dirs[f"teacher-{name}"] = out / f"{name}-top128"
        if not (dirs[f"teacher-{name}"] / "manifest.json").is_file():
            run([pipeline, "teacher-logits", "--aligned", dirs[f"aligned-{name}"], "--teacher", model, "--top-k",
                 "128", "--output", dirs[f"teacher-{name}"], "--quiet"], log)
    return dirs


def reference_scores(dirs: dict) -> dict:
    heldout = dirs["heldout-smollm2"]
    return {"before": bits_per_byte(heldout, dirs["student"], "student"),
            "unpruned": bits_per_byte(heldout, STUDENT, "student"),
            "gemma3": bits_per_byte(dirs["heldout-gemma3"], "gemma3-270m", "teacher0")}


def train_arm(arm: str, seed: int, dirs: dict, out: Path, steps: int, log: Path, threads: int | None = None) -> dict:
    teacher, flags = ARMS[arm]
    target = out / "runs" / f"{arm.replace(' ', '_')}-seed{seed}"
    log = fresh_run(target, log, threads)
    source = teacher or "smollm2"
    teacher_args = ["--teacher-logits", dirs[f"teacher-{teacher}"]] if teacher else []
    started = time.perf_counter()
    run([BIN / "csd-train", "--aligned", dirs[f"aligned-{source}"], *teacher_args, "--student", dirs["student"],
         *TRAIN, "--output", target, "--steps", steps, "--seed", seed, "--eval-aligned", dirs["heldout-smollm2"],
         "--eval-every", max(steps // 4, 1), "--warmup-steps", min(WARMUP, steps // 4), *flags], log, threads)
    seconds = time.perf_counter() - started
    tail = _read_jsonl(target / "metrics.jsonl")[-10:]
    return {"arm": arm, "seed": seed, "steps": steps, "args": flags, "teacher": teacher, "seconds": seconds,
            "threads": threads, "curve": [[e["step"], e["bits_per_byte"]] for e in _read_jsonl(target / "eval.jsonl")],
            "step_time_s": sum(float(m["step_time_s"]) for m in tail) / max(len(tail), 1),
            "bits_per_byte": bits_per_byte(dirs["heldout-smollm2"], target / "export", "student", threads)}


def _save(path: Path, results: list[dict], scores: dict) -> None:
    """prune.json: a run replaces the (arm, seed) run it repeats and keeps the others."""
    if path.is_file():
        previous = json.loads(path.read_text())
        repeated = {(r["arm"], r["seed"]) for r in results}
        results = [r for r in previous.get("results", []) if (r["arm"], r["seed"]) not in repeated] + results
        scores = previous.get("reference_bits_per_byte", {}) | scores
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"regime": "prune-and-heal", "keep": KEEP, "reference_bits_per_byte": scores,
                               "results": results}, indent=1) + "\n")
    tmp.replace(path)


def print_table(results: list[dict], scores: dict) -> None:
    """Per arm: mean held-out bits per byte over seeds, spread (half of max - min), vs CE, gap closed."""
    before, unpruned = scores["before"], scores["unpruned"]
    print("\nprune and heal: held-out bits per byte (English; spread = half of max - min over seeds)")
    print(f"{'arm':<18} {'seeds':>5} {'bits/byte':>9} {'spread':>7} {'vs CE':>7} {'gap closed':>10}")
    for name in ("before", "unpruned", "gemma3"):
        print(f"{name:<18} {'':>5} {scores[name]:9.4f}")
    runs: dict[str, list[float]] = {}
    for r in sorted(results, key=lambda r: list(ARMS).index(r["arm"]) if r["arm"] in ARMS else 99):
        runs.setdefault(r["arm"], []).append(r["bits_per_byte"])
    ce = sum(runs["ce"]) / len(runs["ce"]) if runs.get("ce") else None
    for arm, values in runs.items():
        mean = sum(values) / len(values)
        vs = f"{100 * (mean / ce - 1):+6.2f}%" if ce and arm != "ce" else ""
        closed = 100 * (before - mean) / (before - unpruned)
        print(f"{arm:<18} {len(values):>5} {mean:9.4f} {(max(values) - min(values)) / 2:7.4f} {vs:>7} {closed:9.1f}%")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-prune")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, each with cores/jobs torch threads")
    parser.add_argument("--quick", action="store_true", help="four training documents, 4 steps: a smoke run")
    parser.add_argument("--table", type=Path, help="only print the table of a results file (e.g. docs/results/prune.json)")
    args = parser.parse_args(argv)
    if args.table:
        merged = json.loads(args.table.read_text())
        print_table(merged["results"], merged["reference_bits_per_byte"])
        return 0
    arms = [a.strip() for a in args.arms.split(",")]
    if set(arms) - set(ARMS):
        parser.error(f"--arms: unknown arm(s) {sorted(set(arms) - set(ARMS))}; choose from {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = ROOT / (args.out + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    path = ROOT / "bench-results" / ("prune-quick.json" if args.quick else "prune.json")
    path.parent.mkdir(exist_ok=True)
    started = time.perf_counter()
    dirs = prepare(out, log, args.quick)
    previous = json.loads(path.read_text()).get("reference_bits_per_byte", {}) if path.is_file() else {}
    scores = previous if {"before", "unpruned", "gemma3"} <= set(previous) else reference_scores(dirs)
    print(f"[prune] prepared after {time.perf_counter() - started:.0f} s; "
          + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
    train = partial(train_arm, dirs=dirs, out=out, steps=4 if args.quick else STEPS, log=log)
    results = []
    for record in side_by_side([(arm, seed) for seed in seeds for arm in arms], args.jobs, train):
        results.append(record)
        _save(path, results, scores)
        print(f"[prune] {record['arm']:<18} seed {record['seed']}: {record['bits_per_byte']:.4f} "
              f"({record['seconds']:.0f} s)", flush=True)
    _save(path, results, scores)
    merged = json.loads(path.read_text())
    print_table(merged["results"], merged["reference_bits_per_byte"])
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
