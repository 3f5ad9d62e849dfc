"""`csd-train`: the console entry point (thin: parse the options, run the loop, print errors).

Single process: `csd-train --config run.yaml steps=100`. Several ranks:
`torchrun --nproc-per-node N --no-python csd-train ...` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default: sys.argv[1:]), train, exit 0; a `CsdError` prints one line and exits 2."""
    from csd_pipeline.errors import CsdError
    from trainer.options import help_text, parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        try:
            print(help_text())
        except BrokenPipeError:  # `csd-train --help | head`
            sys.stdout = None
        return
    try:
        from csd_pipeline.runtime import storage

        config = parse_args(storage.take_storage_flags(argv))
        from trainer.loop import train

        summary = train(config)
    except CsdError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("interrupted; re-run the same command with --resume to continue from the last checkpoint",
              file=sys.stderr)
        sys.exit(130)
    except OSError as err:  # disk full, read-only output, ... outside the checkpoint writer's own handling
        from csd_pipeline.runtime.io_errors import io_error_message
        from csd_pipeline.runtime.storage import describe_error

        message = describe_error(err) or io_error_message(err, "re-run the same command with --resume")
        print(f"error: {message}", file=sys.stderr)
        sys.exit(CsdError.exit_code)
    except Exception as err:  # an object store's client error (botocore, aiohttp): one line naming the URL
        from csd_pipeline.runtime.storage import describe_error

        if describe_error(err) is None:
            raise
        print(f"error: {describe_error(err)}", file=sys.stderr)
        sys.exit(CsdError.exit_code)
    last = summary.get("last") or {}
    if last:
        print(f"done: step {summary['step']}, loss {last.get('loss', float('nan')):.4f}, "
              f"output {summary['output']}", file=sys.stderr)


if __name__ == "__main__":
    main()
