"""`make bench-prune`: healing a depth-pruned SmolLM2 by CE, by CSD from Gemma 3, by CSD and by same-vocabulary KD
from the unpruned SmolLM2, at equal steps, data and seed (issue 33, prune and heal).

Student: SmolLM2-135M-Instruct with 20 of its 30 decoder layers removed (`python -m bench.experiments.prune_student --keep
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

Arms (csd_pipeline/recipes/experiments.yaml, `prune`: each its options and the teacher whose top-128 it
reads): `ce`; `csd gemma3` and `csd gemma3 t1.5` (CSD from Gemma 3); `csd smollm2` (CSD from the unpruned
SmolLM2); `kd smollm2` (`--loss kd`: forward KL on the stored entries plus the rest); each KD arm also with the
from-scratch weighting, the dynamic scale (`... dynamic`). Reference scores:
the pruned model before healing, the unpruned SmolLM2, Gemma 3. "Gap closed" is
(before - arm) / (before - unpruned).

    python -m bench.experiments.prune [--arms A,B] [--seeds 0,1,2] [--jobs 2] [--quick] [--table FILE]

Writes bench-results/prune.json (one record per run, replacing the same (arm, seed)) and prints the table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.experiments.plan import arm_flags, best_ce_arm, experiment, store_args, train_config_args
from bench.experiments.runner import BIN, ROOT, WINDOW, Bench, bits_per_byte, fresh_run, main, read_jsonl, run

STUDENT = "smollm2-135m-instruct"
KEEP = "0-7,28-29"
TEACHERS = {"gemma3": ("gemma3", "gemma3-270m"), "smollm2": ("smollm2", STUDENT)}  # name: (tokenizer, model)
_REGIME = experiment("prune").regimes["prune-and-heal"]
TRAIN_TAKE, STEPS, WARMUP = slice(0, None, _REGIME["every"]), _REGIME["steps"], 5


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


def prepare(regime: str, out: Path, log: Path, quick: bool) -> dict:
    """The pruned student; per teacher the training text aligned (SmolLM2 student side) and its top-128; the
    held-out text aligned (SmolLM2 on both sides, for the students' and the unpruned model's scores)."""
    pipeline, dirs = BIN / "csd-pipeline", {"student": out / "smollm2-pruned"}
    if not (dirs["student"] / "config.json").is_file():
        run([sys.executable, "-m", "bench.experiments.prune_student", "--model", STUDENT, "--keep", KEEP,
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
            run([pipeline, "teacher-logits", "--aligned", dirs[f"aligned-{name}"], "--teacher", model,
                 *store_args(experiment("prune").store), "--output", dirs[f"teacher-{name}"], "--quiet"],
                log)
    return dirs


def reference_scores(regime: str, dirs: dict, previous: dict) -> dict:
    """The pruned model before healing, the unpruned SmolLM2 and Gemma 3 (measured once, then reused)."""
    if {"before", "unpruned", "gemma3"} <= set(previous):
        return previous
    heldout = dirs["heldout-smollm2"]
    return {"before": bits_per_byte(heldout, dirs["student"], "student"),
            "unpruned": bits_per_byte(heldout, STUDENT, "student"),
            "gemma3": bits_per_byte(dirs["heldout-gemma3"], "gemma3-270m", "teacher0")}


def train_arm(regime: str, arm: str, seed: int, dirs: dict, out: Path, steps: int, log: Path,
              threads: int | None = None) -> dict:
    exp = experiment("prune")
    recipe = exp.arms_of(regime)[arm]
    teacher, flags = recipe.teacher, arm_flags(exp, recipe)
    target = out / "runs" / f"{arm.replace(' ', '_')}-seed{seed}"
    log = fresh_run(target, log, threads)
    source = teacher or "smollm2"
    teacher_args = ["--teacher-logits", dirs[f"teacher-{teacher}"]] if teacher else []
    started = time.perf_counter()
    run([BIN / "csd-train", *train_config_args(exp, recipe), "--aligned", dirs[f"aligned-{source}"], *teacher_args,
         "--student", dirs["student"], "--output", target, "--no-save-final", "--steps", steps, "--seed", seed, "--eval-aligned", dirs["heldout-smollm2"],
         "--eval-every", max(steps // 4, 1), "--warmup-steps", min(WARMUP, steps // 4)], log, threads)
    seconds = time.perf_counter() - started
    tail = read_jsonl(target / "metrics.jsonl")[-10:]
    return {"arm": arm, "seed": seed, "steps": steps, "args": flags, "teacher": teacher, "seconds": seconds,
            "threads": threads, "curve": [[e["step"], e["bits_per_byte"]] for e in read_jsonl(target / "eval.jsonl")],
            "step_time_s": sum(float(m["step_time_s"]) for m in tail) / max(len(tail), 1),
            "bits_per_byte": bits_per_byte(dirs["heldout-smollm2"], target / "export", "student", threads)}


def table(merged: dict) -> str:
    """Per arm: mean held-out bits per byte over seeds, spread (half of max - min), vs CE, gap closed."""
    results, scores = merged["results"], merged["reference_bits_per_byte"]
    before, unpruned = scores["before"], scores["unpruned"]
    order = list(experiment("prune").arms)
    width = max([18, *(len(r["arm"]) for r in results)])
    lines = ["prune and heal: held-out bits per byte (English; spread = half of max - min over seeds)",
             f"{'arm':<{width}} {'seeds':>5} {'bits/byte':>9} {'spread':>7} {'vs CE':>7} {'gap closed':>10}"]
    lines += [f"{name:<{width}} {'':>5} {scores[name]:9.4f}" for name in ("before", "unpruned", "gemma3")]
    by_seed: dict[str, dict[int, float]] = {}
    for r in sorted(results, key=lambda r: order.index(r["arm"]) if r["arm"] in order else 99):
        by_seed.setdefault(r["arm"], {})[r["seed"]] = r["bits_per_byte"]
    runs = {arm: list(seeds.values()) for arm, seeds in by_seed.items()}
    ce_arm, ce = best_ce_arm(by_seed)
    ce_arm = ce_arm or "ce"
    lines[0] += f"; vs CE = vs `{ce_arm}`, CE's best arm (compared with the others on shared seeds)"
    for arm, values in runs.items():
        mean = sum(values) / len(values)
        vs = f"{100 * (mean / ce - 1):+6.2f}%" if ce and arm != ce_arm else ""
        closed = 100 * (before - mean) / (before - unpruned)
        lines.append(f"{arm:<{width}} {len(values):>5} {mean:9.4f} {(max(values) - min(values)) / 2:7.4f} {vs:>7} "
                     f"{closed:9.1f}%")
    return "\n".join(lines)


BENCH = Bench(name="prune", doc=__doc__, prepare=prepare, scores=reference_scores, train=train_arm,
              steps=lambda regime, quick: 4 if quick else STEPS, table=table, key=("arm", "seed"),
              line=lambda r: f"{r['arm']:<18} seed {r['seed']}: {r['bits_per_byte']:.4f}",
              head={"regime": "prune-and-heal", "keep": KEEP}, dump={"indent": 1})

if __name__ == "__main__":
    sys.exit(main(BENCH, sys.argv[1:]))
