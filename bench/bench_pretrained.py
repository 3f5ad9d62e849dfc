"""`make bench-pretrained`: what CSD buys a pretrained student, per language, at equal steps, data and seed.

Regime `multilingual` (issue 33): the student is SmolLM2-135M-Instruct (mostly English, 49k ByteLevel ids),
the teacher Gemma 3 270M (262k SentencePiece ids, trained on many languages). Data: the *Debian Reference*
in German, French, Spanish, Japanese and Chinese (`bench/corpus/multilingual/`, about 72 KB of each for
training, every tenth document held out, the same split for every arm), aligned as one corpus; Gemma 3's
top-128 stored once. Held out: each of the five languages and English (forgetting), each its own aligned
folder, scored on every run's exported model by `csd-pipeline bits-per-byte` (the command a user runs).
Regimes (REGIMES): `one-pass`, every training document (about 72 KB per language), 80 steps, about a quarter
of an epoch; `repeated`, every tenth training document of each language (about 7 KB each), 120 steps, about
3.5 epochs. Recipe: 2 windows of 256 tokens per step, learning rate 5e-5, 5 warm-up steps (a fine-tuning
rate), the trainer's held-out curve on the five languages together every steps/4 steps.

Arms (ARMS): `ce`; CSD as the from-scratch recipe (`csd kl b1 t1.5`, dynamic scale) and variants; the
peers at their best from-scratch settings (`uld w0.5`, `gold m0.9`, `strict top16 r0.5`); the
shuffled-teacher control. `before` (no training) is measured once.

    python bench/bench_pretrained.py [--regime one-pass|repeated] [--arms A,B] [--seeds 0,1,2] [--jobs 2] [--quick]

Writes bench-results/pretrained.json (one record per run, replacing the same (regime, arm, seed)) and prints
a table: per language the mean held-out bits per byte over the seeds, the non-English mean, vs CE.
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

CORPUS = ROOT / "bench/corpus/multilingual"
LANGUAGES = ("de", "fr", "es", "ja", "zh-cn")
HELDOUT = (*LANGUAGES, "en")
STUDENT, STUDENT_TOKENIZER = "smollm2-135m-instruct", "smollm2"
TEACHER, TEACHER_TOKENIZER = "gemma3-270m", "gemma3"
LR, WARMUP = "5e-5", 5
# one-pass: every training document, 80 steps (about a quarter of an epoch): a domain learned in one pass.
# repeated: every tenth training document of each language, 120 steps (about 3.5 epochs): limited data seen again.
REGIMES = {"one-pass": {"train": None, "steps": 80}, "repeated": {"train": slice(0, None, 10), "steps": 120}}
TRAIN = ["--seq-len", str(WINDOW), "--batch-size", "2", "--lr", LR, "--save-every", "0", "--workers", "1",
         "progress=false"]
CSD = ["--loss", "csd", "--divergence", "kl", "--beta", "1"]
ARMS = {
    "ce": ["--loss", "ce"],
    "csd kl b1 t1.5": [*CSD, "--teacher-temperature", "1.5"],  # the from-scratch best (README)
    "csd kl b1": CSD,
    "csd kl b1 prefix": [*CSD, "--spelling", "prefix"],
    "csd kl b1 w0.25": [*CSD, "--kd-weight", "0.25"],
    # the from-scratch recipe with ULD's weighting (L = CE + 0.5 KD) instead of the dynamic scale
    "csd kl b1 t1.5 fixed0.5": [*CSD, "--teacher-temperature", "1.5", "--kd-scale", "fixed", "--kd-weight", "0.5"],
    "csd kl b1 shuffled": [*CSD, "--teacher-control", "shuffled"],
    "uld w0.5": ["--loss", "uld", "--kd-scale", "fixed", "--kd-weight", "0.5"],
    "gold m0.9": ["--loss", "gold", "--divergence", "jsd", "--gold-matched-weight", "0.9", "--kd-scale", "fixed",
                  "--kd-weight", "1"],
    "strict top16 r0.5": ["--loss", "strict", "--strict-top-k", "16", "--kd-scale", "ratio", "--kd-weight", "0.5"],
    # each peer's second trial, as CSD had two weightings here (dynamic, fixed 0.5)
    "uld dynamic": ["--loss", "uld"],
    "gold m0.9 fixed0.5": ["--loss", "gold", "--divergence", "jsd", "--gold-matched-weight", "0.9", "--kd-scale",
                           "fixed", "--kd-weight", "0.5"],
    "strict top16 fixed0.5": ["--loss", "strict", "--strict-top-k", "16", "--kd-scale", "fixed", "--kd-weight", "0.5"],
}


def _corpus(part: str, lang: str, take, folder: Path) -> str:
    """The corpus file, or (`take`: a slice of its documents) that slice written into `folder`."""
    path = CORPUS / f"{part}-{lang}.jsonl"
    if take is None:
        return str(path)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / path.name
    text = "".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[take])
    if not target.is_file() or target.read_text(encoding="utf-8") != text:
        target.write_text(text, encoding="utf-8")
    return str(target)


def prepare(out: Path, log: Path, regime: str, quick: bool) -> dict:
    """Align the regime's training documents as one corpus and each held-out language alone; store Gemma 3's
    top-128 of the training documents."""
    pipeline, dirs = BIN / "csd-pipeline", {}
    align = ["--student-tokenizer", STUDENT_TOKENIZER, "--teacher-tokenizer", TEACHER_TOKENIZER,
             "--max-student-tokens", WINDOW, "--max-teacher-tokens", WINDOW, "--quiet"]
    quick_dir = out / "quick-corpus"
    train = slice(0, 2) if quick else REGIMES[regime]["train"]
    corpus = [arg for lang in LANGUAGES
              for arg in ("--corpus", _corpus("train", lang, train, out / f"corpus-{regime}"))]
    quick = slice(0, 2) if quick else None  # held out: all of it, or two documents for a smoke run
    dirs["aligned"] = out / f"aligned-{regime}"
    if not (dirs["aligned"] / "manifest.json").is_file():
        run([pipeline, "align", *corpus, "--output", dirs["aligned"], *align], log)
    heldout = [arg for lang in LANGUAGES for arg in ("--corpus", _corpus("heldout", lang, quick, quick_dir))]
    dirs["heldout"] = out / "heldout"  # the five languages together: the trainer's curve
    if not (dirs["heldout"] / "manifest.json").is_file():
        run([pipeline, "align", *heldout, "--output", dirs["heldout"], *align], log)
    for lang in HELDOUT:
        dirs[lang] = out / f"heldout-{lang}"
        if not (dirs[lang] / "manifest.json").is_file():
            run([pipeline, "align", "--corpus", _corpus("heldout", lang, quick, quick_dir), "--output", dirs[lang],
                 *align], log)
    dirs["teacher"] = out / f"gemma3-top128-{regime}"
    if not (dirs["teacher"] / "manifest.json").is_file():
        run([pipeline, "teacher-logits", "--aligned", dirs["aligned"], "--teacher", TEACHER, "--top-k", "128",
             "--output", dirs["teacher"], "--quiet"], log)
    return dirs


def per_language(dirs: dict, model, side: str, threads: int | None = None) -> dict:
    return {lang: bits_per_byte(dirs[lang], model, side, threads) for lang in HELDOUT}


def train_arm(regime: str, arm: str, seed: int, dirs: dict, out: Path, steps: int, log: Path,
              threads: int | None = None) -> dict:
    target = out / "runs" / regime / f"{arm.replace(' ', '_')}-seed{seed}"
    log = fresh_run(target, log, threads)
    started = time.perf_counter()
    run([BIN / "csd-train", "--aligned", dirs["aligned"], "--teacher-logits", dirs["teacher"], "--student", STUDENT,
         *TRAIN, "--output", target, "--steps", steps, "--seed", seed, "--eval-aligned", dirs["heldout"],
         "--eval-every", max(steps // 4, 1), "--warmup-steps", min(WARMUP, steps // 4), *ARMS[arm]], log, threads)
    seconds = time.perf_counter() - started
    tail = _read_jsonl(target / "metrics.jsonl")[-10:]
    return {"regime": regime, "arm": arm, "seed": seed, "steps": steps, "args": ARMS[arm], "seconds": seconds, "threads": threads,
            "curve": [[e["step"], e["bits_per_byte"]] for e in _read_jsonl(target / "eval.jsonl")],
            "step_time_s": sum(float(m["step_time_s"]) for m in tail) / max(len(tail), 1),
            "bits_per_byte": per_language(dirs, target / "export", "student", threads)}


def _save(path: Path, results: list[dict], scores: dict) -> None:
    """pretrained.json: a run replaces the (regime, arm, seed) run it repeats and keeps the others."""
    def key(r):
        return r["regime"], r["arm"], r["seed"]

    if path.is_file():
        previous = json.loads(path.read_text())
        repeated = {key(r) for r in results}
        results = [r for r in previous.get("results", []) if key(r) not in repeated] + results
        scores = previous.get("reference_bits_per_byte", {}) | scores
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"regime": "multilingual", "reference_bits_per_byte": scores, "results": results},
                              indent=1) + "\n")
    tmp.replace(path)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def print_table(results: list[dict], scores: dict, regime: str) -> None:
    """Per arm of `regime`: mean bits per byte per language over seeds, the non-English mean, vs CE."""
    rows = {"teacher": [scores.get("teacher", {})], "before": [scores.get("before", {})]}
    for r in results:
        if r["regime"] == regime:
            rows.setdefault(r["arm"], []).append(r["bits_per_byte"])
    print(f"\n{regime}: held-out bits per byte (mean over seeds; spread = half of max - min of the non-English mean)")
    print(f"{'arm':<22} {'seeds':>5} " + " ".join(f"{lang:>7}" for lang in HELDOUT) + "  non-en   spread   vs CE")
    ce = None
    for arm, runs in rows.items():
        if not runs[0]:
            continue
        means = {lang: _mean(r[lang] for r in runs) for lang in HELDOUT}
        per_run = [_mean(r[lang] for lang in LANGUAGES) for r in runs]
        non_en = _mean(per_run)
        ce = non_en if arm == "ce" else ce
        vs = f"{100 * (non_en / ce - 1):+6.2f}%" if ce and arm not in ("ce", "teacher", "before") else ""
        spread = (max(per_run) - min(per_run)) / 2
        print(f"{arm:<22} {len(runs):>5} " + " ".join(f"{means[lang]:7.4f}" for lang in HELDOUT)
              + f"  {non_en:.4f}  {spread:.4f}  {vs}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-pretrained")
    parser.add_argument("--arms", default="ce,csd kl b1 t1.5 fixed0.5", help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--regime", action="append", choices=list(REGIMES), help="default: both")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, each with cores/jobs torch threads")
    parser.add_argument("--quick", action="store_true", help="two documents per language, 4 steps: a smoke run")
    parser.add_argument("--table", type=Path, help="only print the tables of a results file (e.g. docs/results/pretrained.json)")
    args = parser.parse_args(argv)
    if args.table:
        merged = json.loads(args.table.read_text())
        for regime in args.regime or sorted({r["regime"] for r in merged["results"]}):
            print_table(merged["results"], merged["reference_bits_per_byte"], regime)
        return 0
    arms = [a.strip() for a in args.arms.split(",")]
    if set(arms) - set(ARMS):
        parser.error(f"--arms: unknown arm(s) {sorted(set(arms) - set(ARMS))}; choose from {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = ROOT / (args.out + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    path = ROOT / "bench-results" / ("pretrained-quick.json" if args.quick else "pretrained.json")
    path.parent.mkdir(exist_ok=True)
    started, results = time.perf_counter(), []
    for regime in args.regime or list(REGIMES):
        dirs = prepare(out, log, regime, args.quick)
        previous = json.loads(path.read_text()).get("reference_bits_per_byte", {}) if path.is_file() else {}
        scores = previous if {"teacher", "before"} <= set(previous) else {
            "teacher": per_language(dirs, TEACHER, "teacher0"), "before": per_language(dirs, STUDENT, "student")}
        print(f"[pretrained] {regime}: prepared after {time.perf_counter() - started:.0f} s; teacher "
              + ", ".join(f"{k} {v:.4f}" for k, v in scores["teacher"].items()), flush=True)
        steps = 4 if args.quick else REGIMES[regime]["steps"]
        train = partial(train_arm, regime, dirs=dirs, out=out, steps=steps, log=log)
        for record in side_by_side([(arm, seed) for seed in seeds for arm in arms], args.jobs, train):
            results.append(record)
            _save(path, results, scores)
            non_en = _mean(record["bits_per_byte"][lang] for lang in LANGUAGES)
            print(f"[pretrained] {regime} {record['arm']:<22} seed {record['seed']}: non-English {non_en:.4f}, "
                  f"en {record['bits_per_byte']['en']:.4f} ({record['seconds']:.0f} s)", flush=True)
    merged = json.loads(path.read_text())
    for regime in args.regime or list(REGIMES):
        print_table(merged["results"], merged["reference_bits_per_byte"], regime)
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
