"""The command line of a text benchmark run alone (align, chat, train): `python -m bench.bench_<topic>
[--quick] [--corpus DIR]` runs it and prints its result as indented JSON (`run_all.py` runs them together).
"""

from __future__ import annotations

import json
from pathlib import Path


def run_alone(run, doc: str, corpus_file: str, argv: list[str], *, sort_keys: bool = False) -> None:
    """Parse `--quick` and `--corpus DIR` (a folder holding `corpus_file`) from `argv`, then print
    `run(quick=, corpus=)` as JSON; `doc`: the module docstring, whose first line describes the command."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs: a smoke run")
    parser.add_argument("--corpus", type=Path, default=None,
                        help=f"folder holding {corpus_file} (default: the committed slice)")
    args = parser.parse_args(argv)
    print(json.dumps(run(quick=args.quick, corpus=args.corpus), indent=2, sort_keys=sort_keys))
