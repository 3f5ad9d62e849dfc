"""One line for a failed read or write: what failed, where, and what to do.

The command-line entry points (`csd_pipeline.errors.exit_on_error`) turn an `OSError` that no stage
turned into a `CsdError` (disk full, read-only file system, a path under a regular file, ...) into
`io_error_message(err, rerun)`. Stages write through temporary names and rename, and remove what
they were writing when a write fails, so the re-run that the message asks for finishes with the
same bytes.
"""

from __future__ import annotations

import errno

_ADVICE = {
    errno.ENOSPC: "free space on that file system (or pass an --output elsewhere)",
    errno.EDQUOT: "free space within your quota (or pass an --output elsewhere)",
    errno.EROFS: "that file system is read-only: pass an --output on a writable one",
    errno.EACCES: "you may not write there: pass an --output you can write to, or fix its permissions",
    errno.EPERM: "you may not write there: pass an --output you can write to, or fix its permissions",
    errno.ENOTDIR: "a part of that path is a regular file, not a folder: pass another --output",
    errno.EISDIR: "that path is a folder where a file was expected: pass a file path",
    errno.ENOENT: "check the path",
    errno.EIO: "the storage reported an I/O error: check the disk",
}
_ERRNO_IN_TEXT = {"No space left on device": errno.ENOSPC, "Read-only file system": errno.EROFS,
                  "Permission denied": errno.EACCES, "Not a directory": errno.ENOTDIR,
                  "Disk quota exceeded": errno.EDQUOT}


def error_number(err: BaseException) -> int | None:
    """The errno of an OSError, also when a library only put it in the message (pyarrow, safetensors)."""
    number = getattr(err, "errno", None)
    if isinstance(number, int):
        return number
    text = str(err)
    for phrase, value in _ERRNO_IN_TEXT.items():
        if phrase in text:
            return value
    return None


def discard(path) -> None:
    """Remove a partly written file, quietly (on a read-only or failing disk even unlink can fail)."""
    import os

    try:
        os.unlink(path)
    except OSError:
        pass


def reason_and_advice(err: BaseException) -> tuple[str, str]:
    """(the failure in a few words, what to do about it) for an I/O error."""
    reason = getattr(err, "strerror", None) or (str(err).splitlines()[0] if str(err) else type(err).__name__)
    return reason, _ADVICE.get(error_number(err), "check the path and the disk")


def io_error_message(err: BaseException, rerun: str) -> str:
    """'a file operation failed at <path> (<reason>); <advice>, then <rerun>' on one line.

    `rerun`: what re-running means for the command ("re-run the same command: it resumes").
    """
    reason, advice = reason_and_advice(err)
    where = getattr(err, "filename", None)
    path = f" at {where}" if where else ""
    return f"a file operation failed{path} ({reason}); {advice}, then {rerun}"
