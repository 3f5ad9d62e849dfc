"""Bytes each training rank reads against the number of ranks W (issue 31 item 4).

Two measurements, neither timed:
- plan: 4,096 shards (quick: 1,024) of 600 to 1,400 rows at 900 to 1,100 bytes per row, split by
  `trainer.shuffle.EpochPlan` over W = 1, 2, 8, 64 ranks, 2 lanes per rank (`--data-lanes 2`), 2
  data-loader workers (one lane each), `--shuffle-block 4`: the bytes of the shards each rank's lanes
  open in one epoch (aligned and teacher shards are co-partitioned, so a shard stands for both).
  Check: the most any rank reads <= 1.2 x total / W + the largest shard (the value is that ratio).
- real: the first 24,000 characters of tests/data/python-docs-slice.txt aligned into ~22 shards with
  a tiny random teacher's top-8 (quick and full alike; `tests.trainer_cases.make_read_store`), one
  epoch through the real loader for W = 1, 2, 4 simulated ranks in this process, the bytes the readers
  take from the files counted (`tests.trainer_cases.counted_file_reads`). The total is what W = 1 reads.
Before this change every rank read every shard: 1.00 x total at any W.

`python -m bench.bench_reads [--quick]` prints the table; `python -m bench.run_all reads` runs it in the suite.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORLDS = (1, 2, 8, 64)
REAL_WORLDS = (1, 2, 4)
LANES, WORKERS, BLOCK = 2, 2, 4
LIMIT = 1.0  # the most a rank reads over (1.2 x total / W + one shard)


def plan_table(shards: int) -> list[dict]:
    """One row per W: the most bytes a rank and a worker read in epoch 0, against total / W."""
    import numpy as np

    from trainer.shuffle import EpochPlan

    rng = np.random.default_rng(7)
    rows = rng.integers(600, 1400, size=shards)
    shard_bytes = rows * rng.integers(900, 1100, size=shards)
    total, largest = int(shard_bytes.sum()), int(shard_bytes.max())
    plan = EpochPlan(3, 0, tuple(rows.tolist()), BLOCK)
    table = []
    for world in WORLDS:
        read = np.zeros((world, WORKERS), dtype=np.int64)
        for rank in range(world):
            for lane in range(LANES):
                opened = plan.lane_shards(rank * LANES + lane, world * LANES)
                read[rank, lane % WORKERS] += int(shard_bytes[opened].sum())
        table.append({"W": world, "total": total, "max_rank": int(read.sum(axis=1).max()),
                      "max_worker": int(read.max()), "bound": 1.2 * total / world + largest})
    return table


def real_table(tmp: Path) -> list[dict]:
    """One row per W of `REAL_WORLDS`: bytes the real loader reads per rank and per worker in epoch 0."""
    import json
    from collections import Counter

    from tests.trainer_cases import STUDENT_CONFIG, counted_file_reads, lane_epoch_reads, make_read_store
    from trainer.data import TrainingData
    from trainer.options import parse_args

    store = make_read_store(tmp)
    (tmp / "student.json").write_text(json.dumps(STUDENT_CONFIG))
    data = TrainingData.open(parse_args([
        "--aligned", str(store["aligned"]), "--teacher-logits", str(store["topk"]), "--student-config",
        str(tmp / "student.json"), "--student-tokenizer", "llama-spm", "--output", str(tmp / "run"), "--seq-len", "128",
        "--batch-size", "2", "--workers", "0", "--shuffle-block", str(BLOCK), "--data-lanes", str(LANES),
        "--no-progress"]))
    table, total = [], None
    with counted_file_reads() as counts:
        for world in REAL_WORLDS:
            ranks = [lane_epoch_reads(data, rank, world, counts) for rank in range(world)]
            per_worker = [sum(read.values()) for lanes in ranks for read, _ in lanes]
            per_rank = [sum(sum(read.values()) for read, _ in lanes) for lanes in ranks]
            if total is None:
                total = per_rank[0]
                whole = Counter()
                for read, _ in ranks[0]:
                    whole.update(read)
                largest = max(whole.values())
            table.append({"W": world, "total": total, "max_rank": max(per_rank), "max_worker": max(per_worker),
                          "bound": 1.2 * total / world + largest, "shards": len(data.aligned.shards)})
    return table


def markdown(title: str, table: list[dict]) -> str:
    lines = [f"{title}", "", "| W | total bytes | most read by a rank | x total/W | most read by a worker | "
             "x total/(W x workers) | bound 1.2 x total/W + 1 shard |", "|---|---|---|---|---|---|---|"]
    for row in table:
        share = row["total"] / row["W"]
        lines.append(f"| {row['W']} | {row['total']:,} | {row['max_rank']:,} | {row['max_rank'] / share:.3f} | "
                     f"{row['max_worker']:,} | {row['max_worker'] / (share / WORKERS):.3f} | {row['bound']:,.0f} |")
    return "\n".join(lines)


def run(quick: bool = False) -> dict:
    plan = plan_table(1024 if quick else 4096)
    with tempfile.TemporaryDirectory() as tmp:
        real = real_table(Path(tmp))
    metrics, checks = {}, {}
    for kind, table in (("plan", plan), ("real", real)):
        for row in table:
            share = row["total"] / row["W"]
            metrics[f"{kind}_W{row['W']}_rank_over_share"] = row["max_rank"] / share
            metrics[f"{kind}_W{row['W']}_worker_over_share"] = row["max_worker"] / (share / WORKERS)
            value = row["max_rank"] / row["bound"]
            checks[f"{kind}_W{row['W']}_rank_within_bound"] = {"value": value, "limit": LIMIT, "ok": value <= LIMIT}
    return {"name": "reads", "metrics": metrics, "checks": checks,
            "tables": {"plan": plan, "real": real}}


def main(argv: list[str]) -> int:
    result = run(quick="--quick" in argv)
    print(markdown("Plan: bytes of the shards each rank opens in one epoch (2 lanes and 2 workers per rank)",
                   result["tables"]["plan"]))
    print()
    print(markdown("Real: bytes the loader reads from aligned + teacher files in one epoch (W simulated ranks)",
                   result["tables"]["real"]))
    return 0 if all(c["ok"] for c in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
