"""`csd-train`: the console entry point (thin: parse the options, run the loop, print errors).

Single process: `csd-train --config run.yaml steps=100`. Several ranks:
`torchrun --nproc-per-node N --no-python csd-train ...` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default: sys.argv[1:]), train, exit 0; a `CsdError` prints one line and exits 2
    (`csd_pipeline.errors.exit_on_error`)."""
    from csd_pipeline.errors import exit_on_error
    from trainer.options import help_text

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        try:
            print(help_text())
        except BrokenPipeError:  # `csd-train --help | head`
            sys.stdout = None
        return
    summary = exit_on_error(lambda: _train(argv), rerun="re-run the same command with --resume",
                            interrupted="interrupted; re-run the same command with --resume to continue from the "
                                        "last checkpoint")
    last = summary.get("last") or {}
    if last:
        print(f"done: step {summary['step']}, loss {last.get('loss', float('nan')):.4f}, "
              f"output {summary['output']}", file=sys.stderr)


def _train(argv: list[str]) -> dict:
    """The run of `argv`: its options resolved (`--storage-options` and `--cache-dir` taken out first), then
    trained; returns the loop's summary."""
    from csd_pipeline.runtime import storage
    from trainer.options import parse_args

    config = parse_args(storage.take_storage_flags(argv))  # before torch is imported: a bad option fails fast
    from trainer.loop import train

    return train(config)


if __name__ == "__main__":
    main()
