"""Records the losses of short `csd-train` runs, one per `--loss`, to check that a refactoring of the losses
changes no number: run it on the commit before and the commit after, on the same inputs, and compare the two
JSON files exactly (`--compare`).

    python -m tests.trainer.loss_identity --work DIR --out before.json     # builds DIR/data once, then runs
    python -m tests.trainer.loss_identity --work DIR --out after.json --compare before.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RUNS = {
    "ce": ["--loss", "ce"],
    "csd": ["--loss", "csd"],
    "csd_kl_t15": ["--loss", "csd", "--divergence", "kl", "--beta", "1", "--teacher-temperature", "1.5"],
    "csd_1to1": ["--loss", "csd_1to1"],
    "csd_shuffled": ["--loss", "csd", "--teacher-control", "shuffled"],
    "uld": ["--loss", "uld", "--kd-scale", "fixed", "--kd-weight", "1.5"],
    "gold": ["--loss", "gold", "--gold-matched-weight", "0.5"],
    "strict": ["--loss", "strict", "--strict-top-k", "4", "--kd-scale", "ratio", "--kd-weight", "0.5"],
    "csd_workers1": ["--loss", "csd", "--workers", "1"],
    "csd_eval": ["--loss", "csd", "--eval-every", "2"],  # held-out bits per byte too (eval.jsonl)
}


def build_data(root: Path) -> dict:
    """The trainer tests' inputs (tests/trainer_cases.py) and their real teacher top-k, built once under `root`."""
    from tests.trainer_cases import make_teacher_topk, make_trainer_data

    done = root / "data.json"
    if done.is_file():
        return {key: Path(value) for key, value in json.loads(done.read_text()).items()}
    data = make_trainer_data(root / "data")
    data["teacher"] = make_teacher_topk(data["train_short"], root / "data" / "topk")
    done.write_text(json.dumps({key: str(value) for key, value in data.items()}))
    return data


def run_all(root: Path, names: list[str]) -> dict:
    """{run name: [each metrics.jsonl row's loss values]} for the runs `names`."""
    import shutil

    import torch

    from tests.trainer_cases import kd_run_args, metrics
    from trainer.loop import train
    from trainer.options import parse_args

    torch.set_num_threads(1)
    data = build_data(root)
    results = {}
    for name in names:
        output = root / "runs" / name
        shutil.rmtree(output, ignore_errors=True)
        train(parse_args(kd_run_args(data, data["teacher"], output, "--seed", "0", "--eval-aligned", str(data["eval"]),
                                     "--eval-every", "0", *RUNS[name], steps=3)))
        keys = ("loss", "ce", "kd", "kd_scale", "grad_norm", "chunks_1to1", "chunks_1toN", "chunks_Mto1")
        results[name] = [{key: row.get(key) for key in keys} for row in metrics(output)]
        with open(output / "eval.jsonl", encoding="utf-8") as handle:
            results[name] += [{"eval_nats": json.loads(line)["nats"]} for line in handle]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--compare", type=Path)
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    args = parser.parse_args(argv)
    results = run_all(args.work, args.runs)
    args.out.write_text(json.dumps(results, indent=1))
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    differ = [name for name in results if before.get(name) != results[name]]
    for name in results:
        print(f"{name}: {'DIFFERENT' if name in differ else 'identical'} ({len(results[name])} steps)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
