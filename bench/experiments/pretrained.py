"""`make bench-pretrained`: what CSD buys a pretrained student, per language, at equal steps, data and seed.

Regime `multilingual` (issue 33): the student is SmolLM2-135M-Instruct (mostly English, 49k ByteLevel ids),
the teacher Gemma 3 270M (262k SentencePiece ids, trained on many languages). Data: the *Debian Reference*
in German, French, Spanish, Japanese and Chinese (`bench/corpus/multilingual/`, about 72 KB of each for
training, every tenth document held out, the same split for every arm), aligned as one corpus; Gemma 3's
top-128 stored once. Held out: each of the five languages and English (forgetting), each its own aligned
folder, scored on every run's exported model by `csd-pipeline bits-per-byte` (the command a user runs).
Regimes (REGIMES): `one-pass`, every training document (about 72 KB per language) once: as many steps as the
aligned windows fill batches of the recipe's 2 (`steps: epoch`); `repeated`, every tenth training document of each language (about 7 KB each), 120 steps, about
3.5 epochs. Recipe: 2 windows of 256 tokens per step, learning rate 5e-5, 5 warm-up steps (a fine-tuning
rate), the trainer's held-out curve on the five languages together every steps/4 steps.

Arms (csd_pipeline/recipes/experiments.yaml, `pretrained`): `ce`; CSD as the from-scratch recipe (`csd kl b1 t1.5`, dynamic scale) and variants; the
peers at their best from-scratch settings (`uld w0.5`, `gold m0.9`, `strict top16 r0.5`); the
shuffled-teacher control. `before` (no training) is measured once.

    python -m bench.experiments.pretrained [--regime one-pass|repeated] [--arms A,B] [--seeds 0,1,2] [--jobs 2] [--quick]

Writes bench-results/pretrained.json (one record per run, replacing the same (regime, arm, seed)) and prints
a table: per language the mean held-out bits per byte over the seeds, the non-English mean, vs CE.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.experiments.plan import arm_flags, experiment, is_ce_arm, store_args, train_config_args
from bench.experiments.plan import best_ce_arm as plan_best_ce_arm
from bench.experiments.runner import BIN, ROOT, WINDOW, Bench, bits_per_byte, fresh_run, main, read_jsonl, run

CORPUS = ROOT / "bench/corpus/multilingual"
LANGUAGES = ("de", "fr", "es", "ja", "zh-cn")
HELDOUT = (*LANGUAGES, "en")
STUDENT, STUDENT_TOKENIZER = "smollm2-135m-instruct", "smollm2"
TEACHER, TEACHER_TOKENIZER = "gemma3-270m", "gemma3"
WARMUP = 5
# one-pass: every training document once: a domain learned in one pass.
# repeated: every tenth training document of each language (about 3.5 epochs): limited data seen again.
REGIMES = {name: {"train": slice(0, None, spec["every"]) if spec.get("every") else None, "steps": spec["steps"]}
           for name, spec in experiment("pretrained").regimes.items()}
_EPOCH_STEPS: dict[str, int] = {}  # regime -> steps of one pass over its aligned windows (set by `prepare`)


def epoch_steps(aligned: Path) -> int:
    """Steps that show every window of an aligned folder once, at the training recipe's windows a step."""
    import json

    from csd_pipeline.recipes import load_recipe

    rows = json.loads((aligned / "manifest.json").read_text(encoding="utf-8"))["totals"]["rows"]
    return max(1, -(-int(rows) // int(load_recipe(experiment("pretrained").train)["batch_size"])))


def regime_steps(regime: str, quick: bool) -> int:
    """The steps of a regime: 4 for a smoke run, one pass over the aligned windows for `steps: epoch`."""
    steps = REGIMES[regime]["steps"]
    if quick:
        return 4
    return _EPOCH_STEPS[regime] if steps == "epoch" else int(steps)


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


def prepare(regime: str, out: Path, log: Path, quick: bool) -> dict:
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
    _EPOCH_STEPS[regime] = epoch_steps(dirs["aligned"])
    heldout = [arg for lang in LANGUAGES for arg in ("--corpus", _corpus("heldout", lang, quick, quick_dir))]
    dirs["heldout"] = out / "heldout"  # the five languages together: the trainer's curve
    if not (dirs["heldout"] / "manifest.json").is_file():
        run([pipeline, "align", *heldout, "--output", dirs["heldout"], *align], log)
    for lang in HELDOUT:
        dirs[lang] = out / f"heldout-{lang}"
        if not (dirs[lang] / "manifest.json").is_file():
            run([pipeline, "align", "--corpus", _corpus("heldout", lang, quick, quick_dir), "--output", dirs[lang],
                 *align], log)
    exp = experiment("pretrained")
    dirs["teacher"] = out / f"gemma3-{exp.store}-{regime}"
    if not (dirs["teacher"] / "manifest.json").is_file():
        run([pipeline, "teacher-logits", "--aligned", dirs["aligned"], "--teacher", TEACHER,
             *store_args(exp.store), "--output", dirs["teacher"], "--quiet"], log)
    return dirs


def per_language(dirs: dict, model, side: str, threads: int | None = None) -> dict:
    return {lang: bits_per_byte(dirs[lang], model, side, threads) for lang in HELDOUT}


def train_arm(regime: str, arm: str, seed: int, dirs: dict, out: Path, steps: int, log: Path,
              threads: int | None = None) -> dict:
    target = out / "runs" / regime / f"{arm.replace(' ', '_')}-seed{seed}"
    log = fresh_run(target, log, threads)
    exp = experiment("pretrained")
    recipe = exp.arms_of(regime)[arm]
    steps = int(recipe.options.get("steps", steps))  # an arm may tune the steps too (CE's, issue 40)
    started = time.perf_counter()
    run([BIN / "csd-train", *train_config_args(exp, recipe), "--aligned", dirs["aligned"], "--teacher-logits",
         dirs["teacher"], "--student", STUDENT, "--output", target, "--no-save-final", "--steps", steps, "--seed", seed, "--eval-aligned", dirs["heldout"],
         "--eval-every", max(steps // 4, 1), "--warmup-steps", min(WARMUP, steps // 4)], log, threads)
    seconds = time.perf_counter() - started
    tail = read_jsonl(target / "metrics.jsonl")[-10:]
    return {"regime": regime, "arm": arm, "seed": seed, "steps": steps, "args": arm_flags(exp, recipe), "seconds": seconds, "threads": threads,
            "curve": [[e["step"], e["bits_per_byte"]] for e in read_jsonl(target / "eval.jsonl")],
            "step_time_s": sum(float(m["step_time_s"]) for m in tail) / max(len(tail), 1),
            "bits_per_byte": per_language(dirs, target / "export", "student", threads)}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def reference_scores(regime: str, dirs: dict, previous: dict) -> dict:
    """The teacher's and the untrained student's bits per byte per language (measured once, then reused)."""
    if {"teacher", "before"} <= set(previous):
        return previous
    return {"teacher": per_language(dirs, TEACHER, "teacher0"), "before": per_language(dirs, STUDENT, "student")}


def _non_english(record: dict) -> float:
    return _mean(record["bits_per_byte"][lang] for lang in LANGUAGES)


def best_ce_arm(results: list[dict], regime: str) -> tuple[str, float | None]:
    """CE tuned: of the CE arms of `regime` (`ce`, `ce lr...`), the best by non-English figure (`plan.best_ce_arm`:
    compared on shared seeds), and its mean (("ce", None) when no CE arm ran)."""
    runs: dict[str, dict[int, float]] = {}
    for r in results:
        if r["regime"] == regime and is_ce_arm(r["arm"]):
            runs.setdefault(r["arm"], {})[r["seed"]] = _non_english(r)
    arm, mean = plan_best_ce_arm(runs)
    return arm or "ce", mean


def paired_vs_ce(results: list[dict], regime: str, arm: str, ce_arm: str = "ce") -> str:
    """The arm's non-English mean minus CE's (`ce_arm`), paired by seed: the mean over the seeds both ran, in percent
    of CE's mean over those seeds, +- half the min-max spread of the paired differences ("" with fewer than two)."""
    ce = {r["seed"]: _non_english(r) for r in results if r["regime"] == regime and r["arm"] == ce_arm}
    runs = {r["seed"]: _non_english(r) for r in results if r["regime"] == regime and r["arm"] == arm}
    seeds = sorted(set(ce) & set(runs))
    if len(seeds) < 2:
        return ""
    diffs = [100 * (runs[s] - ce[s]) / _mean(ce[s] for s in seeds) for s in seeds]
    return f"{_mean(diffs):+6.2f}% +- {(max(diffs) - min(diffs)) / 2:.2f} ({len(seeds)})"


def best_of_curve(results: list[dict], regime: str, arm: str) -> float | None:
    """The mean over seeds of the lowest point of the trainer's held-out curve (the five languages together, every
    steps/4 steps): each arm stopped at its best evaluation, as a tuned number of steps would."""
    curves = [min(v for _, v in r["curve"]) for r in results if r["regime"] == regime and r["arm"] == arm
              and r.get("curve")]
    return _mean(curves) if curves else None


def regime_table(results: list[dict], scores: dict, regime: str) -> str:
    """Per arm of `regime`: mean bits per byte per language over seeds, the non-English mean, vs CE (of the means,
    and paired by seed where both ran two or more seeds), and the best point of the held-out curve vs CE's.
    CE is its best-tuned arm (`best_ce_arm`): every arm is compared with CE at CE's best learning rate."""
    rows = {"teacher": [scores.get("teacher", {})], "before": [scores.get("before", {})]}
    for r in results:
        if r["regime"] == regime:
            rows.setdefault(r["arm"], []).append(r["bits_per_byte"])
    ce_arm, ce = best_ce_arm(results, regime)
    width = max(len(arm) for arm in rows)
    lines = [f"{regime}: held-out bits per byte (mean over seeds; spread = half of max - min of the non-English mean;"
             f" vs CE = vs `{ce_arm}`, the CE arm with the lowest mean;"
             " paired = per seed vs CE, mean +- half its spread (seeds); best = the lowest point of the trainer's"
             " held-out curve, five languages together, vs the lowest of any CE arm)",
             f"{'arm':<{width}} {'seeds':>5} " + " ".join(f"{lang:>7}" for lang in HELDOUT)
             + "  non-en   spread   vs CE    best  vs CE   paired"]
    ce_curves = [best_of_curve(results, regime, a) for a in {r["arm"] for r in results if r["regime"] == regime}
                 if is_ce_arm(a)]
    ce_best = min((b for b in ce_curves if b is not None), default=None)  # CE's steps tuned too: its lowest point
    for arm, runs in rows.items():
        if not runs[0]:
            continue
        means = {lang: _mean(r[lang] for r in runs) for lang in HELDOUT}
        per_run = [_mean(r[lang] for lang in LANGUAGES) for r in runs]
        non_en = _mean(per_run)
        vs = f"{100 * (non_en / ce - 1):+6.2f}%" if ce and arm not in (ce_arm, "teacher", "before") else ""
        spread = (max(per_run) - min(per_run)) / 2
        paired = paired_vs_ce(results, regime, arm, ce_arm) if arm not in (ce_arm, "teacher", "before") else ""
        best = best_of_curve(results, regime, arm)
        best_cell = f"{best:.4f}" if best is not None else ""
        best_vs = f"{100 * (best / ce_best - 1):+6.2f}%" if best is not None and ce_best and best != ce_best else ""
        lines.append((f"{arm:<{width}} {len(runs):>5} " + " ".join(f"{means[lang]:7.4f}" for lang in HELDOUT)
                      + f"  {non_en:.4f}  {spread:.4f}  {vs:>7}  {best_cell:>6} {best_vs:>7}  {paired}").rstrip())
    return "\n".join(lines)


def table(merged: dict) -> str:
    """Every regime of a results file (pretrained.json), one table each."""
    regimes = [r for r in REGIMES if any(x["regime"] == r for x in merged["results"])]
    return "\n\n".join(regime_table(merged["results"], merged["reference_bits_per_byte"], r) for r in regimes)


def _line(record: dict) -> str:
    non_en = _mean(record["bits_per_byte"][lang] for lang in LANGUAGES)
    return f"{record['arm']:<22} seed {record['seed']}: non-English {non_en:.4f}, en {record['bits_per_byte']['en']:.4f}"


BENCH = Bench(name="pretrained", doc=__doc__, prepare=prepare, scores=reference_scores, train=train_arm,
              steps=regime_steps, table=table, line=_line,
              head={"regime": "multilingual"}, dump={"indent": 1},
              default_arms=experiment("pretrained").extra["default_arms"])

if __name__ == "__main__":
    sys.exit(main(BENCH, sys.argv[1:]))
