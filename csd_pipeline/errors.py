"""User-facing errors: one sentence saying what is wrong, where, and what to do.

The console entry points run under `exit_on_error`, which prints a `CsdError`'s message on stderr
and exits 2, so a user mistake never shows a Python traceback.
"""


class CsdError(Exception):
    """A user-facing error (bad path, unsupported tokenizer, mismatched manifest, ...)."""

    exit_code = 2


class UnsupportedTokenizerError(CsdError):
    """The tokenizer's family cannot be made byte-exact."""


class ManifestError(CsdError):
    """A stage output is missing its manifest, has an unknown schema, or mismatches its inputs."""


def exit_on_error(main, *, rerun: str, interrupted: str):
    """Call `main()` and return what it returns; what the user can act on ends the process instead, as one
    `error:` line on stderr and exit code 2, never a traceback. The one error-to-exit wrapper of every
    console entry point (`cli.main.run_cli` for `csd-pipeline`, `trainer.main` for `csd-train`).

    A `CsdError` prints its message; a click usage error (a stage command's options) click's own lines;
    an `OSError` (disk full, read-only output) or an object store's client error one line naming the
    path or URL, with `rerun` (what to run again) as the advice; Ctrl-C prints `interrupted` and exits 130.
    Any other exception is a bug and keeps its traceback.
    """
    import sys

    import click

    def fail(message: str, code: int = CsdError.exit_code):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(code)

    try:
        return main()
    except CsdError as err:
        fail(str(err), err.exit_code)
    except click.exceptions.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        sys.exit(130)
    except OSError as err:  # disk full, read-only output, ... that no stage turned into a CsdError
        from csd_pipeline.runtime.io_errors import io_error_message
        from csd_pipeline.runtime.storage_errors import describe_error

        fail(describe_error(err) or io_error_message(err, rerun))
    except Exception as err:  # an object store's client error (botocore, aiohttp): one line naming the URL
        from csd_pipeline.runtime.storage_errors import describe_error

        if describe_error(err) is None:
            raise
        fail(describe_error(err))
