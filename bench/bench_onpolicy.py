"""On-policy rounds vs off-policy training on reference continuations, at equal steps.

    python bench/bench_onpolicy.py [--out out/bench-onpolicy] [--base STUDENT] [--base-steps 480]
                                   [--rounds 2] [--steps 100] [--prompts 64] [--max-new-tokens 48] [--seeds 0]

Start: `--base` (an export that already writes text), else a student trained like the demo (demo/run.py:
student config, tables, align, teacher top-128, CSD recipe) for `--base-steps` steps. Prompts: the first
200 characters (cut at whitespace) of the demo's training documents; held-out prompts: those of the
held-out documents. Arms, both from the base, both `--rounds x --steps` csd-train steps (reverse KL):

- off-policy: one aligned set of {prompt, completion = the reference continuation, cut to about the
  on-policy completions' length}, trained for rounds x steps steps;
- on-policy: `csd-pipeline rounds` (the student's own samples, fresh each round).

Reported per arm (and the base) on held-out prompts, samples at temperature 1: the teacher's bits per
byte of the student's completions (teacher forward on prompt + completion, completion tokens only),
distinct word 2-grams / all 2-grams of the samples, and held-out bits per byte of the student on the
reference text (demo/corpus/devil-heldout.jsonl). Teacher tokens scored by teacher-logits are reported
per arm. Written to OUT/report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEACHER, TEACHER_TOKENIZER, WINDOW = "smollm2-135m-instruct", "smollm2", 256
PROMPT_CHARS = 200


def _run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def base_student(out: Path, steps: int) -> Path:
    """A demo-recipe CSD student (demo/run.py's settings), trained once into OUT/base."""
    from demo.run import CSD_ARGS, TOP_K, TRAIN_ARGS

    export = out / "base" / "train" / "export"
    if (export / "config.json").is_file():
        return export
    py = sys.executable
    _run([py, "-m", "cli.main", "align", "--corpus", "demo/corpus/devil-train.jsonl", "--student-tokenizer",
          "llama-spm", "--teacher-tokenizer", TEACHER_TOKENIZER, "--output", str(out / "base" / "aligned"),
          "--max-student-tokens", str(WINDOW), "--quiet"])
    _run([py, "-m", "cli.main", "teacher-logits", "--aligned", str(out / "base" / "aligned"), "--teacher", TEACHER,
          "--top-k", str(TOP_K), "--output", str(out / "base" / "teacher"), "--quiet"])
    _run([py, "-m", "trainer.main", "--aligned", str(out / "base" / "aligned"), "--teacher-logits",
          str(out / "base" / "teacher"), "--student-config", "demo/student-config.json", "--student-tokenizer",
          "llama-spm", "--output", str(out / "base" / "train"), "--steps", str(steps), "--progress", "false",
          *TRAIN_ARGS, *CSD_ARGS])
    return export


def prompts_file(source: str, path: Path, count: int) -> Path:
    lines = (ROOT / source).read_text(encoding="utf-8").splitlines()[:count]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": json.loads(x)["text"]}) + "\n" for x in lines), encoding="utf-8")
    return path


def off_policy(out: Path, base: Path, prompts: Path, args, completion_chars: int) -> tuple[Path, int]:
    """Train on {prompt, reference continuation}; returns (export, teacher tokens)."""
    from csd_pipeline.generate.config import GenerateConfig
    from csd_pipeline.generate.stage import GenerateStage, read_prompts

    folder = out / "off-policy"
    records = folder / "records.jsonl"
    if not records.is_file():
        config = GenerateConfig(model=str(base), corpus=[str(prompts)], output=str(folder / "unused"),
                                prompt_field="text", prompt_chars=PROMPT_CHARS)
        entries = read_prompts(GenerateStage(config).files, config)
        folder.mkdir(parents=True, exist_ok=True)
        records.write_text("".join(json.dumps({"prompt": e["prompt"], "completion": e["reference"][:completion_chars]})
                                   + "\n" for e in entries), encoding="utf-8")
    py = sys.executable
    if not (folder / "train" / "export" / "config.json").is_file():
        _run([py, "-m", "cli.main", "align", "--corpus", str(records), "--student-tokenizer", str(base),
              "--teacher-tokenizer", TEACHER_TOKENIZER, "--output", str(folder / "aligned"), "--max-student-tokens",
              str(WINDOW), "--quiet"])
        _run([py, "-m", "cli.main", "teacher-logits", "--aligned", str(folder / "aligned"), "--teacher", TEACHER,
              "--top-k", "32", "--output", str(folder / "teacher"), "--quiet"])
        _run([py, "-m", "trainer.main", "--aligned", str(folder / "aligned"), "--teacher-logits", str(folder / "teacher"),
              "--student", str(base), "--output", str(folder / "train"), "--steps", str(args.rounds * args.steps),
              "--loss", "csd", "--divergence", "reverse_kl", "--seq-len", str(WINDOW), "--seed", "0",
              "--save-every", "0", "--progress", "false", "--batch-size", "2", "--workers", "1"])
    return folder / "train" / "export", _teacher_tokens(folder / "aligned")


def _teacher_tokens(aligned: Path) -> int:
    stats = json.loads((aligned / "manifest.json").read_text())["stats"]
    return int(stats["tokens"]["teacher0"])


def evaluate(model: Path, heldout_prompts: Path, out: Path, args, teacher) -> dict:
    """Teacher bits/byte of the model's samples, distinct 2-grams, reference bits/byte."""
    from csd_pipeline.generate.config import GenerateConfig
    from csd_pipeline.generate.stage import run_generate

    samples = out / "samples"
    run_generate(GenerateConfig(model=str(model), corpus=[str(heldout_prompts)], output=str(samples),
                                prompt_field="text", prompt_chars=PROMPT_CHARS, max_new_tokens=args.max_new_tokens,
                                temperature=1.0, seed=1234))
    records = [json.loads(line) for shard in sorted(samples.glob("part-*.jsonl")) for line in shard.open()]
    nats, n_bytes = teacher_nats(teacher, records)
    words = [r["completion"].split() for r in records]
    pairs = [tuple(w[i:i + 2]) for w in words for i in range(len(w) - 1)]
    return {"teacher_bits_per_byte_of_samples": nats / max(n_bytes, 1) / math.log(2),
            "distinct_2grams": len(set(pairs)) / max(len(pairs), 1), "sample_bytes": n_bytes,
            "heldout_bits_per_byte": reference_bits_per_byte(model, out)}


def teacher_nats(teacher, records: list[dict]) -> tuple[float, int]:
    """Sum of -ln p_teacher over the completions' teacher tokens (prompt as context), and their bytes."""
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


def reference_bits_per_byte(model: Path, out: Path) -> float:
    heldout = out.parent / "heldout-aligned"
    py = sys.executable
    if not (heldout / "manifest.json").is_file():
        _run([py, "-m", "cli.main", "align", "--corpus", "demo/corpus/devil-heldout.jsonl", "--student-tokenizer",
              str(model), "--teacher-tokenizer", TEACHER_TOKENIZER, "--output", str(heldout), "--max-student-tokens",
              str(WINDOW), "--quiet"])
    result = subprocess.run([py, "-m", "cli.main", "bits-per-byte", "--aligned", str(heldout), "--model", str(model),
                             "--side", "student", "--seq-len", str(WINDOW), "--json"], cwd=ROOT, check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout)["bits_per_byte"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-onpolicy")
    parser.add_argument("--base", default=None)
    parser.add_argument("--base-steps", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--heldout-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out).resolve()
    base = Path(args.base) if args.base else base_student(out, args.base_steps)
    train_prompts = prompts_file("demo/corpus/devil-train.jsonl", out / "prompts-train.jsonl", args.prompts)
    heldout_prompts = prompts_file("demo/corpus/devil-heldout.jsonl", out / "prompts-heldout.jsonl", args.heldout_prompts)

    from csd_pipeline.generate.rounds import RoundsConfig, run_rounds

    on_export = run_rounds(RoundsConfig(
        student=str(base), teacher=TEACHER, teacher_tokenizer=TEACHER_TOKENIZER, prompts=[str(train_prompts)],
        output=str(out / "on-policy"), rounds=args.rounds, steps=args.steps, prompt_field="text",
        prompt_chars=PROMPT_CHARS, max_new_tokens=args.max_new_tokens, max_student_tokens=WINDOW,
        train_args=["--batch-size 2 --workers 1 --progress false"]))
    on_tokens = sum(_teacher_tokens(out / "on-policy" / f"round-{r}" / "aligned") for r in range(1, args.rounds + 1))
    generated = out / "on-policy" / "round-1" / "generated"
    chars = [len(json.loads(line)["completion"]) for shard in generated.glob("part-*.jsonl") for line in shard.open()]
    off_export, off_tokens = off_policy(out, base, train_prompts, args, max(1, sum(chars) // max(len(chars), 1)))

    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    loaded = load_causal_lm(TEACHER, dtype="float32", device="cpu")
    teacher = (loaded, load_tokenizer(str(loaded.path)))
    report = {"settings": vars(args), "teacher_tokens": {"off_policy": off_tokens, "on_policy": on_tokens},
              "arms": {}}
    for arm, model in (("base", base), ("off_policy", off_export), ("on_policy", on_export)):
        report["arms"][arm] = evaluate(model, heldout_prompts, out / "eval" / arm, args, teacher)
        print(arm, json.dumps(report["arms"][arm]), flush=True)
    report["seconds"] = time.perf_counter() - started
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
