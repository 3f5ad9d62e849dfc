"""On-policy rounds vs off-policy training on reference continuations, at equal steps.

    python -m bench.experiments.onpolicy [--setting demo|multilingual] [--out DIR] [--base STUDENT]
                                   [--base-steps 480] [--rounds 2] [--steps 100] [--prompts 500]
                                   [--max-new-tokens 48] [--divergence kl|reverse_kl] [--on-policy-ce]
                                   [--seeds 0,1,2] [--results bench-results/onpolicy.json]
    python -m bench.experiments.onpolicy --table docs/results/onpolicy-multilingual.json

Start: `--base` (an export that already writes text), else a student trained like the demo (demo/run.py:
student config, tables, align, teacher top-128, CSD recipe) for `--base-steps` steps. Prompts: the first
200 characters (cut at whitespace) of the demo's training documents; held-out prompts: those of the
held-out documents. Arms, both from the base, both `--rounds x --steps` csd-train steps:

- off-policy: one aligned set of {prompt, completion = the reference continuation, cut to rounds x the
  mean length of round 1's on-policy completions (about the teacher tokens of all rounds)}, trained for
  rounds x steps steps;
- on-policy: `csd-pipeline rounds` (the student's own samples, fresh each round), trained as GKD trains on them:
  the divergence alone, no CE (`--on-policy-ce`: CE + KD with the off-policy arm's recipe, as before 2026-12-04).
  GKD's comparison needs both directions: run once with `--divergence kl` and once with `reverse_kl`.

Reported per arm (and the base) on held-out prompts, samples at temperature 1: the teacher's bits per
byte of the student's completions (teacher forward on prompt + completion, completion tokens only),
distinct word 2-grams / all 2-grams of the samples, and held-out bits per byte of the student on the
reference text (demo/corpus/devil-heldout.jsonl). Teacher tokens scored by teacher-logits are reported
per arm, and the student's own bits per byte of its samples (`own_bits_per_byte_of_samples`: drawn at temperature 1,
their expected value is the student's entropy per byte on its own text).

Divergence (`--divergence`, both arms): `kl` by default (the demo's); `reverse_kl` is the usual
on-policy choice (its teacher REST is floored, docs/TRAINING.md). Each run's skipped steps (a non-finite
loss) are reported (`skipped_steps`).

Seeds (`--seeds 0,1,2`): each seed trains both arms again from the same base (csd-train --seed, and the
on-policy sampling seed); the held-out samples are drawn with one fixed seed. The summary gives, per arm
and figure, the mean over seeds and half the min-max spread, and the paired on-policy minus off-policy
differences; `goal` checks the issue's bar (on-policy lowers the teacher's bits per byte of the samples
by more than the spread, diversity and reference bits per byte within 2% of off-policy's). Written to
OUT/report.json and `--results` (default bench-results/onpolicy.json), with each phase's seconds and an
estimate of the full run's duration scaled from them (`estimate`). `--table FILE` only prints a results file's
table (`table`: the block of docs/results/onpolicy.md).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from bench.experiments.onpolicy_settings import (
    DEMO,
    ROOT,
    SETTINGS,
    WINDOW,
    multilingual_base,
    multilingual_heldout,
    multilingual_prompts,
    units,
)

TRAIN_ARGS_ROUNDS = ["--batch-size", "2", "--workers", "1", "--progress", "false"]  # both arms
EVAL_SEED = 1234  # the held-out samples of every arm and seed


def _run(command: list[str], phase: str = "other") -> None:
    print("$ " + " ".join(command), flush=True)
    with TIMER.phase(phase):
        subprocess.run(command, cwd=ROOT, check=True)


def base_student(out: Path, steps: int) -> Path:
    """A demo-recipe CSD student (demo/run.py's settings), trained once into OUT/base."""
    from demo.run import CSD_ARGS, TOP_K, TRAIN_ARGS

    export = out / "base" / "train" / "export"
    if (export / "config.json").is_file():
        TIMER.train_run(out / "base" / "train", "base_train")  # its seconds per step, for the estimate
        return export
    py = sys.executable
    _run([py, "-m", "cli.main", "align", "--corpus", "demo/corpus/devil-train.jsonl", "--student-tokenizer",
          "llama-spm", "--teacher-tokenizer", DEMO.teacher_tokenizer, "--output", str(out / "base" / "aligned"),
          "--max-student-tokens", str(WINDOW), "--quiet"], "base_data")
    _run([py, "-m", "cli.main", "teacher-logits", "--aligned", str(out / "base" / "aligned"), "--teacher", DEMO.teacher,
          "--top-k", str(TOP_K), "--output", str(out / "base" / "teacher"), "--quiet"], "base_data")
    _run([py, "-m", "trainer.main", "--aligned", str(out / "base" / "aligned"), "--teacher-logits",
          str(out / "base" / "teacher"), "--student-config", "demo/student-config.json", "--student-tokenizer",
          "llama-spm", "--output", str(out / "base" / "train"), "--steps", str(steps), "--progress", "false",
          *TRAIN_ARGS, *CSD_ARGS], "base_train")
    TIMER.train_run(out / "base" / "train", "base_train")
    return export


def prompts_file(source: str, path: Path, count: int) -> Path:
    lines = (ROOT / source).read_text(encoding="utf-8").splitlines()[:count]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": json.loads(x)["text"]}) + "\n" for x in lines), encoding="utf-8")
    return path


def reference_entries(setting, base: Path, prompts: list[Path]) -> list[dict]:
    """Every training prompt with its reference continuation: {"source" (the prompt file's name), "prompt",
    "reference"}, in the order generate reads them."""
    from csd_pipeline.generate.config import GenerateConfig
    from csd_pipeline.generate.stage import GenerateStage, read_prompts

    if setting.prompt_chars == 0:  # the prompt files hold {"prompt", "reference"}
        return [{"source": path.name, **json.loads(line)} for path in prompts
                for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    config = GenerateConfig(model=str(base), corpus=[str(p) for p in prompts], output="unused",
                            prompt_field=setting.prompt_field, prompt_chars=setting.prompt_chars)
    return [{**e, "source": Path(e["source"]).name} for e in read_prompts(GenerateStage(config).files, config)]


def off_policy(folder: Path, base: Path, entries: list[dict], args, seed: int, chars: dict) -> tuple[Path, int]:
    """Train on {prompt, reference continuation cut to chars[source]} for rounds x steps steps; returns (export,
    teacher tokens)."""
    setting = SETTINGS[args.setting]
    records = folder / "records.jsonl"
    if not records.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        records.write_text("".join(json.dumps({"prompt": e["prompt"], "completion": e["reference"][:chars[e["source"]]]},
                                              ensure_ascii=False) + "\n" for e in entries), encoding="utf-8")
    py = sys.executable
    if not (folder / "train" / "export" / "config.json").is_file():
        _run([py, "-m", "cli.main", "align", "--corpus", str(records), "--student-tokenizer", str(base),
              "--teacher-tokenizer", setting.teacher_tokenizer, "--output", str(folder / "aligned"),
              "--max-student-tokens", str(WINDOW), "--quiet"], "off_data")
        _run([py, "-m", "cli.main", "teacher-logits", "--aligned", str(folder / "aligned"), "--teacher", setting.teacher,
              "--top-k", "32", "--output", str(folder / "teacher"), "--quiet"], "off_data")
        _run([py, "-m", "trainer.main", "--aligned", str(folder / "aligned"), "--teacher-logits", str(folder / "teacher"),
              "--student", str(base), "--output", str(folder / "train"), "--steps", str(args.rounds * args.steps),
              "--loss", "csd", "--divergence", args.divergence, "--seq-len", str(WINDOW), "--seed", str(seed),
              "--save-every", "0", *TRAIN_ARGS_ROUNDS, *setting.recipe], "off_train")
        TIMER.train_run(folder / "train", "off_train")
    return folder / "train" / "export", _teacher_tokens(folder / "aligned")


def _teacher_tokens(aligned: Path) -> int:
    manifest = json.loads((aligned / "manifest.json").read_text())
    return int(manifest["totals"]["stats"]["tokens"]["teacher0"])


def evaluate(model: Path, heldout_prompts: list[Path], out: Path, root: Path, args, teacher) -> dict:
    """Teacher bits/byte of the model's samples, distinct 2-grams, reference bits/byte."""
    from csd_pipeline.generate.config import GenerateConfig
    from csd_pipeline.generate.stage import run_generate
    from csd_pipeline.runtime.manifest import read_manifest

    samples = out / "samples"
    with TIMER.phase("eval"):
        setting = SETTINGS[args.setting]
        run_generate(GenerateConfig(model=str(model), corpus=[str(p) for p in heldout_prompts], output=str(samples),
                                    prompt_field=setting.prompt_field, prompt_chars=setting.prompt_chars,
                                    max_new_tokens=args.max_new_tokens,
                                    temperature=1.0, seed=EVAL_SEED))
        shards = [samples / shard["file"] for shard in read_manifest(samples, stage="generate")["shards"]]
        records = [json.loads(line) for shard in shards for line in shard.open(encoding="utf-8")]
        nats, n_bytes = teacher_nats(teacher, records)
        own = own_bits_per_byte(model, records)
        words = [units(r["completion"]) for r in records]
        pairs = [tuple(w[i:i + 2]) for w in words for i in range(len(w) - 1)]
        return {"teacher_bits_per_byte_of_samples": nats / max(n_bytes, 1) / math.log(2),
                "own_bits_per_byte_of_samples": own,
                "distinct_2grams": len(set(pairs)) / max(len(pairs), 1), "sample_bytes": n_bytes,
                **(multilingual_heldout(model) if args.setting == "multilingual"
                   else {"heldout_bits_per_byte": reference_bits_per_byte(model, root)})}


def own_bits_per_byte(model: Path, records: list[dict]) -> float:
    """The model's bits per byte of its own completions: their expected value, for samples drawn at temperature 1,
    is its entropy per byte on its own text (a flatter student writes samples it finds less likely)."""
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    loaded = load_causal_lm(str(model), dtype="float32", device="cpu")
    nats, n_bytes = teacher_nats((loaded, load_tokenizer(str(loaded.path))), records)
    return nats / max(n_bytes, 1) / math.log(2)


def teacher_nats(teacher, records: list[dict]) -> tuple[float, int]:
    """Sum of -ln p over the completions' tokens under `teacher` (a model and its tokenizer; the prompt as context),
    and their bytes."""
    import torch

    from csd_pipeline.align.corpus import Document
    from csd_pipeline.align.prompt_completion import encode

    loaded, bundle = teacher
    context = bundle.vocab.context_token()
    nats, n_bytes = 0.0, 0
    for r in records:
        if not r["completion"]:
            continue
        prompt_bytes = len(r["prompt"].encode("utf-8"))
        text = r["prompt"] + r["completion"]
        ids, _, _ = encode(bundle, [text], [Document("x", 0, text, prompt_bytes=prompt_bytes)])
        ends = [0]
        for i in ids.tolist():
            ends.append(ends[-1] + len(bundle.vocab.token_bytes[i]))
        first = next(k for k in range(len(ids)) if ends[k] >= prompt_bytes)  # first completion token
        row = torch.as_tensor([[context, *ids.tolist()]])
        with torch.no_grad():
            logprobs = torch.log_softmax(loaded.model(row).logits[0].float(), dim=-1)
        targets = row[0, 1 + first:]
        nats -= float(logprobs[first:-1].gather(1, targets[:, None]).sum())
        n_bytes += len(r["completion"].encode("utf-8"))
    return nats, n_bytes


def reference_bits_per_byte(model: Path, root: Path) -> float:
    """Held-out bits per byte of `model` on the demo's held-out documents (aligned once into ROOT/heldout-aligned;
    every student here has the base's tokenizer)."""
    heldout = root / "heldout-aligned"
    py = sys.executable
    if not (heldout / "manifest.json").is_file():
        _run([py, "-m", "cli.main", "align", "--corpus", "demo/corpus/devil-heldout.jsonl", "--student-tokenizer",
              str(model), "--teacher-tokenizer", DEMO.teacher_tokenizer, "--output", str(heldout), "--max-student-tokens",
              str(WINDOW), "--quiet"])
    result = subprocess.run([py, "-m", "cli.main", "bits-per-byte", "--aligned", str(heldout), "--model", str(model),
                             "--side", "student", "--seq-len", str(WINDOW), "--json"], cwd=ROOT, check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout)["bits_per_byte"]


def run_seed(out: Path, base: Path, train_prompts: list[Path], args, seed: int) -> dict:
    """Both arms for one seed, from the base: {"on_policy"/"off_policy": (export, teacher tokens)}."""
    from csd_pipeline.generate.rounds import RoundsConfig, run_rounds

    setting = SETTINGS[args.setting]
    folder = out / f"seed-{seed}"
    with TIMER.phase("on_policy"):
        on_export = run_rounds(RoundsConfig(
            student=str(base), teacher=setting.teacher, teacher_tokenizer=setting.teacher_tokenizer,
            prompts=[str(p) for p in train_prompts], output=str(folder / "on-policy"), rounds=args.rounds,
            steps=args.steps, prompt_field=setting.prompt_field, prompt_chars=setting.prompt_chars,
            max_new_tokens=args.max_new_tokens, seed=seed, max_student_tokens=WINDOW, divergence=args.divergence,
            ce=args.on_policy_ce, train_args=[" ".join([*TRAIN_ARGS_ROUNDS, *setting.round_recipe(args.on_policy_ce)])],
            device="cpu"))
    for r in range(1, args.rounds + 1):
        TIMER.train_run(folder / "on-policy" / f"round-{r}" / "train", "on_policy")
    on_tokens = sum(_teacher_tokens(folder / "on-policy" / f"round-{r}" / "aligned") for r in range(1, args.rounds + 1))
    generated = folder / "on-policy" / "round-1" / "generated"
    lengths: dict[str, list[int]] = {}  # per prompt file: the round-1 completions' characters
    for shard in sorted(generated.glob("part-*.jsonl")):
        for line in shard.open(encoding="utf-8"):
            record = json.loads(line)
            lengths.setdefault(Path(record["source"]).name, []).append(len(record["completion"]))
    chars = {source: args.rounds * max(1, sum(n) // len(n)) for source, n in lengths.items()}
    off = off_policy(folder / "off-policy", base, reference_entries(setting, base, train_prompts), args, seed, chars)
    return {"on_policy": (on_export, on_tokens, [folder / "on-policy" / f"round-{r}" / "train"
                                                  for r in range(1, args.rounds + 1)]),
            "off_policy": (*off, [folder / "off-policy" / "train"])}


def skipped_steps(trains: list[Path]) -> int:
    """Steps csd-train skipped for a non-finite loss (its `nonfinite_skipped` counter, summed over runs)."""
    total = 0
    for folder in trains:
        steps = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
        total += max((m.get("nonfinite_skipped", 0) for m in steps), default=0)
    return total


FIGURES = ("teacher_bits_per_byte_of_samples", "distinct_2grams", "heldout_bits_per_byte")


class Timer:
    """Wall seconds per phase, and per csd-train phase its runs, steps and summed step times (metrics.jsonl)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.train: dict[str, dict] = {}

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def train_run(self, folder: Path, name: str) -> None:
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [m for m in metrics if "step_time_s" in m]
        entry = self.train.setdefault(name, {"runs": 0, "steps": 0, "step_seconds": 0.0})
        entry["runs"] += 1
        entry["steps"] += len(steps)
        entry["step_seconds"] += sum(m["step_time_s"] for m in steps)

    def record(self) -> dict:
        return {"seconds": self.seconds, "train": self.train}


TIMER = Timer()


def _mean_spread(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "half_spread": (max(values) - min(values)) / 2, "values": values}


def summarize(runs: list[dict]) -> dict:
    """Per arm and figure: mean over seeds and half the min-max spread; on - off per seed; the issue's bar."""
    arms = {arm: {f: _mean_spread([r[f] for r in runs if r["arm"] == arm]) for f in FIGURES}
            for arm in ("on_policy", "off_policy")}
    by_seed = {(r["arm"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs if r["seed"] is not None})
    diffs = {f: _mean_spread([by_seed["on_policy", s][f] - by_seed["off_policy", s][f] for s in seeds])
             for f in FIGURES}
    on, off = arms["on_policy"], arms["off_policy"]
    spread = max(on[FIGURES[0]]["half_spread"], off[FIGURES[0]]["half_spread"])
    goal = {"samples_bits_per_byte_lower_by_more_than_spread": diffs[FIGURES[0]]["mean"] < -spread,
            "diversity_within_2pct": on["distinct_2grams"]["mean"] >= 0.98 * off["distinct_2grams"]["mean"],
            "heldout_bits_per_byte_within_2pct": on["heldout_bits_per_byte"]["mean"]
            <= 1.02 * off["heldout_bits_per_byte"]["mean"]}
    skipped = {arm: sum(r.get("skipped_steps", 0) for r in runs if r["arm"] == arm) for arm in ("on_policy", "off_policy")}
    return {"seeds": seeds, "arms": arms, "on_minus_off": diffs, "goal": goal, "skipped_steps": skipped,
            "note": "one seed: no spread, the bar is not tested" if len(seeds) < 2 else ""}


def table(report: dict) -> str:
    """A report's figures as a Markdown table: the base, each arm with each seed, and on minus off (`summarize` of the
    runs: the mean of the paired differences, +- half their min-max spread for the teacher's and the held-out
    figures (with two seeds or more), the held-out one also relative to off-policy's mean). Extra columns where every
    run has the figure: English held-out bits per byte (--setting multilingual, where `heldout_bits_per_byte` is the
    non-English mean) and the student's own bits per byte of its samples."""
    runs = report["runs"]
    summary = summarize(runs)
    seeds = summary["seeds"]
    extras = [(title, get) for title, key, get in (
        ("English", "heldout_by_language", lambda r: r["heldout_by_language"]["en"]),
        ("the student's own bits/byte of its samples", "own_bits_per_byte_of_samples",
         lambda r: r["own_bits_per_byte_of_samples"])) if all(key in r for r in runs)]
    formats = ["{:.4f}", "{:.3f}", "{:.4f}"] + ["{:.4f}"] * len(extras)

    def figures(run: dict) -> list[float]:
        return [run[f] for f in FIGURES] + [get(run) for _, get in extras]

    english = any(title == "English" for title, _ in extras)
    lines = ["| | teacher bits/byte of the student's samples | distinct 2-grams | held-out bits/byte"
             + (", non-English mean" if english else "") + "".join(f" | {title}" for title, _ in extras) + " |",
             "|---|" + "---|" * len(formats)]
    base = next(r for r in runs if r["arm"] == "base")
    lines.append("| base | " + " | ".join(f.format(v) for f, v in zip(formats, figures(base))) + " |")
    by_seed = {(r["arm"], r["seed"]): figures(r) for r in runs if r["seed"] is not None}
    for arm in ("off_policy", "on_policy"):
        cells = [" / ".join(f.format(by_seed[arm, s][i]) for s in seeds) for i, f in enumerate(formats)]
        lines.append(f"| {arm.replace('_', '-')} (seed {' / '.join(map(str, seeds))}) | " + " | ".join(cells) + " |")
    samples, grams, heldout = (summary["on_minus_off"][f] for f in FIGURES)
    off = summary["arms"]["off_policy"]["heldout_bits_per_byte"]["mean"]
    spread = (lambda figure: f" +- {figure['half_spread']:.3f}") if len(seeds) > 1 else (lambda figure: "")  # one seed: none
    cells = [f"{samples['mean']:+.3f}{spread(samples)}", f"{grams['mean']:+.3f}",
             f"{heldout['mean']:+.3f} ({heldout['mean'] / off:+.1%}){spread(heldout)}"]
    for column in range(len(FIGURES), len(formats)):
        differences = [by_seed["on_policy", s][column] - by_seed["off_policy", s][column] for s in seeds]
        cells.append(f"{sum(differences) / len(differences):+.3f}")
    lines.append("| on minus off | " + " | ".join(cells) + " |")
    return "\n".join(lines)


FULL = {"base_steps": 480, "rounds": 2, "steps": 100, "prompts": 500, "heldout_prompts": 16, "max_new_tokens": 48}


def estimate(timer: Timer, settings: dict) -> dict:
    """Minutes of `--base-steps 480 --rounds 2 --steps 100 --prompts 500` with 1 and 3 seeds, scaled from this
    run's phases: csd-train from its measured seconds per step plus its measured start-up per run; the
    generate/align/teacher-logits work of a round and the evaluation at their measured time per call
    (`low`: loading dominates at small sizes) or linear in prompts x --max-new-tokens (`high`). The
    machine's load scales everything."""
    train, seconds = timer.train, timer.seconds
    rate = {k: v["step_seconds"] / max(v["steps"], 1) for k, v in train.items()}
    step = rate.get("on_policy") or rate.get("off_train") or 0.0
    runs = [(seconds[k] - v["step_seconds"]) / v["runs"] for k, v in train.items()
            if k in ("off_train", "base_train") and k in seconds]
    startup = max(0.0, min(runs)) if runs else 0.0  # a csd-train run's wall beyond its steps
    n_seeds = len(settings["seeds"])
    on_train_wall = train.get("on_policy", {}).get("step_seconds", 0.0) + startup * train.get("on_policy", {}).get("runs", 0)
    round_data = max(0.0, seconds.get("on_policy", 0.0) - on_train_wall) / max(n_seeds * settings["rounds"], 1)
    off_data = seconds.get("off_data", 0.0) / n_seeds
    evaluation = seconds.get("eval", 0.0) / (1 + 2 * n_seeds)
    base = seconds.get("base_data", 0.0) + startup + FULL["base_steps"] * rate.get("base_train", step)
    out = {"seconds_per_step": rate, "csd_train_startup_s": startup, "round_data_s": round_data,
           "off_policy_data_s": off_data, "evaluation_per_model_s": evaluation}
    tokens = FULL["max_new_tokens"] / settings["max_new_tokens"]
    scales = {"low": (1.0, 1.0), "high": (FULL["prompts"] / settings["prompts"] * tokens,
                                          FULL["heldout_prompts"] / settings["heldout_prompts"] * tokens)}
    for label, (data_scale, eval_scale) in scales.items():
        model_eval = evaluation * max(1.0, eval_scale)
        per_seed = (FULL["rounds"] * (round_data * max(1.0, data_scale) + startup + FULL["steps"] * rate.get("on_policy", step))
                    + off_data * max(1.0, data_scale) + startup
                    + FULL["rounds"] * FULL["steps"] * rate.get("off_train", step) + 2 * model_eval)
        for seeds in (1, 3):
            out[f"{label}_minutes_{seeds}_seed{'s' if seeds > 1 else ''}"] = (base + model_eval + seeds * per_seed) / 60
    if "base_data" not in seconds:
        out["note"] = "the base was reused: its align + teacher-logits (a few minutes) are not in the estimate"
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", default="demo", choices=list(SETTINGS),
                        help="demo: the demo's student and teacher; multilingual: issue 33's (onpolicy_settings.py)")
    parser.add_argument("--out", default=None, help="default out/bench-onpolicy (demo), out/bench-onpolicy-multilingual")
    parser.add_argument("--base", default=None, help="a student export that already writes text (default: train one)")
    parser.add_argument("--base-steps", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="csd-train steps per round (off-policy: rounds x steps)")
    parser.add_argument("--prompts", type=int, default=None, help="training prompts per round (default: 500 "
                        "multilingual, 64 demo, whose corpus has 78 documents)")
    parser.add_argument("--on-policy-ce", action="store_true", help="the rounds train with CE + KD (the off-policy "
                        "arm's recipe) instead of KD alone (GKD's way, the default)")
    parser.add_argument("--heldout-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--divergence", default="kl", choices=("kl", "reverse_kl", "jsd"),
                        help="CSD divergence of both arms (reverse_kl: see the module docstring)")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds, e.g. 0,1,2")
    parser.add_argument("--results", default="bench-results/onpolicy.json", help="where the JSON report also goes")
    parser.add_argument("--table", type=Path, help="only print the table of a results file "
                        "(e.g. docs/results/onpolicy-multilingual.json)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers, e.g. --seeds 0,1,2")
    started = time.perf_counter()
    multilingual = args.setting == "multilingual"
    args.prompts = args.prompts or (500 if multilingual else 64)
    documents = len((ROOT / "demo/corpus/devil-train.jsonl").read_text(encoding="utf-8").splitlines())
    if not multilingual and args.prompts > documents:
        parser.error(f"--prompts {args.prompts}: the demo setting has {documents} training documents, one prompt "
                     "each; pass at most that, or --setting multilingual")
    out = Path(args.out or ("out/bench-onpolicy-multilingual" if multilingual else "out/bench-onpolicy")).resolve()
    if multilingual:
        base = Path(args.base) if args.base else multilingual_base(out)
        train_prompts = multilingual_prompts(out, "train", args.prompts)
        heldout_prompts = multilingual_prompts(out, "heldout", 0)
    else:
        base = Path(args.base) if args.base else base_student(out, args.base_steps)
        train_prompts = [prompts_file("demo/corpus/devil-train.jsonl", out / "prompts-train.jsonl", args.prompts)]
        heldout_prompts = [prompts_file("demo/corpus/devil-heldout.jsonl", out / "prompts-heldout.jsonl",
                                        args.heldout_prompts)]
    arms = {seed: run_seed(out, base, train_prompts, args, seed) for seed in seeds}

    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    loaded = load_causal_lm(SETTINGS[args.setting].teacher, dtype="float32", device="cpu")
    teacher = (loaded, load_tokenizer(str(loaded.path)))
    runs = [{"arm": "base", "seed": None, **evaluate(base, heldout_prompts, out / "eval" / "base", out, args, teacher)}]
    print("base", json.dumps(runs[-1]), flush=True)
    for seed, pair in arms.items():
        for arm, (export, tokens, trains) in pair.items():
            figures = evaluate(export, heldout_prompts, out / f"seed-{seed}" / "eval" / arm, out, args, teacher)
            skipped = skipped_steps(trains)
            if skipped:
                print(f"warning: {arm} seed {seed}: csd-train skipped {skipped} steps for a non-finite loss", flush=True)
            runs.append({"arm": arm, "seed": seed, "teacher_tokens": tokens, "skipped_steps": skipped, **figures})
            print(arm, seed, json.dumps(runs[-1]), flush=True)
    report = {"settings": vars(args) | {"seeds": seeds}, "runs": runs, "summary": summarize(runs),
              "seconds": time.perf_counter() - started, "phases": TIMER.record()}
    report["estimate"] = estimate(TIMER, vars(args) | {"seeds": seeds})
    text = json.dumps(report, indent=1) + "\n"
    (out / "report.json").write_text(text)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(text)
    print(json.dumps({"summary": report["summary"], "estimate": report["estimate"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
