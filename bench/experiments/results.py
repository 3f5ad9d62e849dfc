"""The generated tables of docs/RESULTS.md and docs/results/*.md, written from the experiments' JSON results.

Each generated block stands between two marker comments, `<!-- results NAME: ... -->` and `<!-- end of results
NAME -->`, in the page `PAGES` names for it; everything else in those pages is hand-written. The blocks
(`blocks`): `current`, RESULTS.md's summary (per experiment and regime: CE, the best arm, its margin); `quality`
and `comparison`, the tables of `make bench-quality` and `make bench-compare` (docs/results/quality.json,
comparison.json); `teachers-data-limited`, `teachers-data-rich` and `teachers-pretrained`, the regimes of `make
bench-teachers` (teachers.json); `pretrained` and `prune`, the tables of `make bench-pretrained` and `make
bench-prune`; `onpolicy`, the on-policy rounds of onpolicy-multilingual.json (CE on the samples), and
`onpolicy-gkd-kl`, `onpolicy-gkd-reverse-kl`, GKD's way (KD alone, 500 prompts a round; ONPOLICY names each
block's file); `diagnosis`, the held-out curves of pretrained-diagnosis.json; `gpu`, the runs of `make gpu-check` (gpu_check.json). Each benchmark's block is the text of its module's own table function
(`--table docs/results/<name>.json` prints the same; for the comparison `python -m bench.experiments.quality
--comparison --table ...`). To publish a new measurement, copy its bench-results/<name>.json to docs/results/
and run this.

quality.json, comparison.json and teachers.json were transcribed from the hand-written tables of the results
log (measured 2026-11-30 and 2026-12-01), because those runs' own files were not kept: every record says so in
its `source` field and holds only what the tables stated (bits per byte to four decimals, the teachers' scores,
seconds per step where given). Means, spreads and margins are computed from those four-decimal values, so a few
differ in the last digit from the runs' own (the pages say which). The next run of a benchmark replaces them.

    python -m bench.experiments.results           # rewrite the blocks (make results)
    python -m bench.experiments.results --check   # exit 1 and name the stale blocks (tests/docs/test_results.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ROOT / "docs"
RESULTS_MD = DOCS / "RESULTS.md"
RESULTS_DIR = DOCS / "results"
ONPOLICY = {"onpolicy": "onpolicy-multilingual", "onpolicy-gkd-kl": "onpolicy-gkd-kl",  # block -> its JSON
            "onpolicy-gkd-reverse-kl": "onpolicy-gkd-reverse-kl"}
# the page (relative to docs/) that holds each generated block
PAGES = {"current": "RESULTS.md", "quality": "results/quality.md", "comparison": "results/comparison.md",
         "teachers-data-limited": "results/teachers.md", "teachers-data-rich": "results/teachers.md",
         "teachers-pretrained": "results/teachers.md", "pretrained": "results/pretrained.md",
         "diagnosis": "results/pretrained.md", "prune": "results/prune.md", "gpu": "results/gpu.md",
         **dict.fromkeys(ONPOLICY, "results/onpolicy.md")}
COMMAND = "python -m bench.experiments.results"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


MAKE_TARGETS = {"comparison": "bench-compare"}  # else `make bench-<name>`
SUMMARIZED = ("quality", "comparison", "teachers", "pretrained", "prune")  # the experiments in `current`


def _score(name: str, record: dict) -> float:
    """A run's one figure: the mean over the non-English languages (pretrained); else held-out bits per byte (quality,
    comparison, teachers: for its pretrained regime the trainer's final evaluation, equal to the export's; prune)."""
    if name == "pretrained":
        from bench.experiments.pretrained import LANGUAGES

        return _mean(record["bits_per_byte"][lang] for lang in LANGUAGES)
    return record["bits_per_byte"]


def current(results: dict[str, dict]) -> str:
    """The opening summary: per experiment and regime, CE at its best-tuned arm (`ce`, `ce lr...`: plan.best_ce_arm)
    and the best other arm (lowest mean over its seeds)."""
    from bench.experiments.plan import best_ce_arm, is_ce_arm

    lines = ["| experiment | regime | CE | best arm | its bits/byte | vs CE | seeds | runs | results |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, merged in results.items():
        regimes = dict.fromkeys(r.get("regime", merged.get("regime")) for r in merged["results"])
        for regime in regimes:
            runs: dict[str, dict[int, float]] = {}  # arm -> seed -> figure
            for r in merged["results"]:
                if r.get("regime", merged.get("regime")) == regime:
                    runs.setdefault(r["arm"], {})[r["seed"]] = _score(name, r)
            means = {arm: _mean(seeds.values()) for arm, seeds in runs.items()}
            ce_arm, ce = best_ce_arm(runs)  # CE's tuned arms: its best, compared on shared seeds
            best = min((arm for arm in means if not is_ce_arm(arm)), key=means.get)
            versus = f"{100 * (means[best] / ce - 1):+.2f}%" if ce else ""
            figure = "non-English mean" if name == "pretrained" else "held-out bits/byte"
            ce_cell = f"{ce:.4f}" + (f" (`{ce_arm}`)" if ce_arm != "ce" else "")
            lines.append(f"| `make {MAKE_TARGETS.get(name, f'bench-{name}')}` | {regime} ({figure}) | {ce_cell} | "
                         f"`{best}` | {means[best]:.4f} | {versus} | {len(runs[best])} | {sum(map(len, runs.values()))} | "
                         f"`docs/results/{name}.json` |")
    return "\n".join(lines)


def diagnosis(merged: dict) -> str:
    """The diagnosis runs' held-out curves: one row per run, one column per evaluated step."""
    steps = sorted({step for run in merged["runs"] for step, _ in run["curve"]})
    lines = ["| arm | flags | data order | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|---|---|" + "---|" * len(steps)]
    for run in merged["runs"]:
        at = dict((step, value) for step, value in run["curve"])
        cells = [f"{at[s]:.4f}" if s in at else "" for s in steps]
        lines.append(f"| {run['arm']} | `{run['flags']}` | {run['data_order']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def blocks(results_dir: Path = RESULTS_DIR) -> dict[str, str]:
    """Every generated block's text, from the JSON files in `results_dir`."""
    from bench import gpu_check
    from bench.experiments import onpolicy, pretrained, prune, quality, teachers

    def load(name: str) -> dict:
        return json.loads((results_dir / f"{name}.json").read_text(encoding="utf-8"))

    loaded = {name: load(name) for name in SUMMARIZED}
    return {"current": current(loaded),
            "quality": quality.table(loaded["quality"]),
            **{f"teachers-{regime}": teachers.table(loaded["teachers"], [regime]) for regime in teachers.ALL_REGIMES},
            "pretrained": f"```\n{pretrained.table(loaded['pretrained'])}\n```",
            "diagnosis": diagnosis(load("pretrained-diagnosis")),
            "prune": f"```\n{prune.table(loaded['prune'])}\n```",
            **{block: onpolicy.table(load(name)) for block, name in ONPOLICY.items()},
            "comparison": quality.comparison_table(loaded["comparison"]),
            "gpu": gpu_check.table(load("gpu_check"))}


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- results {name}: generated by `{COMMAND}` from docs/results/; edit the JSON, not this block -->",
            f"<!-- end of results {name} -->")


def with_blocks(text: str, generated: dict[str, str], page: str = "RESULTS.md") -> str:
    """One page's text with each block of `generated` between its markers replaced by the generated one."""
    for name, block in generated.items():
        begin, end = markers(name)
        if text.count(begin) != 1 or text.count(end) != 1:
            raise ValueError(f"docs/{page}: the markers of block {name!r} are missing or repeated; put {begin!r} "
                             f"and {end!r} once around it")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{block}\n{end}{tail}"
    return text


def read_pages(docs: Path = DOCS) -> dict[str, str]:
    """The text of every page that holds a generated block, by its path relative to docs/."""
    return {page: (docs / page).read_text(encoding="utf-8") for page in dict.fromkeys(PAGES.values())}


def updated(pages: dict[str, str], generated: dict[str, str]) -> dict[str, str]:
    """The pages with every generated block put in its place (`PAGES`)."""
    out = dict(pages)
    for name, block in generated.items():
        page = PAGES[name]
        out[page] = with_blocks(out[page], {name: block}, page)
    return out


def stale(pages: dict[str, str], generated: dict[str, str]) -> list[str]:
    """The blocks whose text in their page differs from what their JSON gives."""
    return [name for name in generated
            if with_blocks(pages[PAGES[name]], {name: generated[name]}, PAGES[name]) != pages[PAGES[name]]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only say which blocks are stale (exit 1 if any)")
    args = parser.parse_args(argv)
    try:
        pages, generated = read_pages(), blocks()
        old = stale(pages, generated)
        new = updated(pages, generated)
    except (ValueError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        if old:
            where = ", ".join(f"{name} (docs/{PAGES[name]})" for name in old)
            print(f"error: the block(s) {where} disagree with their JSON in docs/results/; run `{COMMAND}`",
                  file=sys.stderr)
            return 1
        return 0
    for page, text in new.items():
        if text != pages[page]:
            (DOCS / page).write_text(text, encoding="utf-8")
    print(f"docs: {', '.join(old) or 'no block'} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
