"""The one error-to-exit wrapper: both console entry points end a user's mistake with one `error:` line."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from csd_pipeline.errors import CsdError, exit_on_error

HINTS = {"rerun": "run it again", "interrupted": "interrupted; run it again"}


def outcome(capsys, action) -> tuple[int, str]:
    """(exit code, stderr) of `action` run under the wrapper."""

    def main():
        action()

    with pytest.raises(SystemExit) as done:
        exit_on_error(main, **HINTS)
    return done.value.code, capsys.readouterr().err


def raise_(err):
    def action():
        raise err

    return action


def test_what_a_user_can_fix_is_one_line(capsys, tmp_path):
    assert outcome(capsys, raise_(CsdError("--top-k 0 is out of range"))) == (
        2, "error: --top-k 0 is out of range\n")
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "part.parquet"))
    code, err = outcome(capsys, raise_(full))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert str(tmp_path / "part.parquet") in err and "run it again" in err
    assert outcome(capsys, raise_(KeyboardInterrupt())) == (130, "interrupted; run it again\n")


def test_a_bug_keeps_its_traceback_and_a_result_is_returned():
    with pytest.raises(ZeroDivisionError):
        exit_on_error(lambda: 1 / 0, **HINTS)
    assert exit_on_error(lambda: {"step": 3}, **HINTS) == {"step": 3}


@pytest.mark.slow
@pytest.mark.parametrize(("command", "fragment"), [
    ([sys.executable, "-m", "cli.main", "teacher-logits", "--aligned", "A", "--teacher", "T", "--output", "O",
      "--top-k", "0"], "error: --top-k 0 is out of range"),
    ([sys.executable, "-m", "trainer.main", "--aligned", "A", "--output", "O", "--student", "S", "--top-k", "3"],
     "error: unknown option 'top-k' in the command line"),
])
def test_both_entry_points_exit_2_with_one_line(command, fragment):
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(fragment) and done.stderr.count("\n") == 1, done.stderr
