"""The worker-process resume under repetition (bench/soak.py --resume-repeats N).

Repeats, in one process, what
`tests/trainer/test_csd.py::test_csd_resume_with_worker_processes_matches_the_in_process_run` does: a CSD
run of the trainer test data stopped at step 2 with two data-loader worker processes, then resumed with two
workers, its losses compared with an in-process run (no workers). Every repetition leaves the previous
ones' objects to the garbage collector, as a test session does, so a forked worker inherits them. A
repetition that prints nothing for `timeout` seconds is a hang: the driver records every process of the
run with its state and kernel wait channel, ends them, and goes on with a fresh process.

    python -m bench.soak_resume --repeats 50 --folder out/soak/resume    # the repeating process itself
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("step", "loss", "ce", "kd", "lr", "grad_norm", "chunks_1to1", "chunks_1toN", "chunks_Mto1", "chunks_MtoN")


def _process_report(pid: int) -> str:
    proc = Path("/proc") / str(pid)
    try:
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        wchan = (proc / "wchan").read_text()
    except OSError:
        return f"{pid}: gone"
    return f"{pid} (parent {status['PPid'].strip()}) {status['State'].strip()} wchan={wchan} {command}"


def repeat_resume(repeats: int, folder: Path, timeout: float) -> dict:
    """Run `repeats` repetitions (restarting the repeating process after a hang); return the counts."""
    from bench.soak import session_processes

    folder.mkdir(parents=True, exist_ok=True)
    done, hangs, mismatches, seconds = 0, [], 0, []
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CSD_PROGRESS="0")
    while done < repeats:
        process = subprocess.Popen([sys.executable, "-m", "bench.soak_resume", "--repeats", str(repeats - done), "--folder",
                                    str(folder)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                                   start_new_session=True)
        last = time.monotonic()
        while True:
            ready, _, _ = select.select([process.stdout], [], [], 1.0)
            if ready:
                line = process.stdout.readline()
                if not line:
                    break
                last = time.monotonic()
                if line.startswith("repeat "):
                    done += 1
                    record = json.loads(line.split(" ", 2)[2])
                    mismatches += not record["same"]
                    seconds.append(record["seconds"])
                    print(f"resume repeat {done}/{repeats}: {'same losses' if record['same'] else 'OTHER LOSSES'} "
                          f"({record['seconds']:.1f} s)", flush=True)
            elif time.monotonic() - last > timeout:
                stuck = [_process_report(pid) for pid in session_processes(process.pid)]
                hangs.append({"repeat": done + 1, "processes": stuck})
                print(f"resume repeat {done + 1}: HANG, no progress for {timeout:.0f} s:\n  " + "\n  ".join(stuck),
                      flush=True)
                os.killpg(process.pid, signal.SIGKILL)
                done += 1
                break
        process.wait()
        if process.returncode not in (0, -signal.SIGKILL):
            raise SystemExit(f"soak: the resume repetitions failed (exit {process.returncode})")
    return {"ok": not hangs and not mismatches, "tried": done, "hangs": hangs, "other_losses": mismatches,
            "median_s": sorted(seconds)[len(seconds) // 2] if seconds else None}


def _repeat(repeats: int, folder: Path) -> None:
    import torch

    from tests.trainer_cases import kd_run_args, make_teacher_topk, make_trainer_data, metrics
    from trainer.loop import train
    from trainer.options import parse_args

    torch.set_num_threads(1)
    data_file = folder / "data.json"
    if not data_file.is_file():
        for part in ("data", "teacher"):
            shutil.rmtree(folder / part, ignore_errors=True)
        data = make_trainer_data(folder / "data")
        make_teacher_topk(data["train_short"], folder / "teacher")
        data_file.write_text(json.dumps({k: str(v) for k, v in data.items()}))
    data = {k: Path(v) for k, v in json.loads(data_file.read_text()).items()}
    teacher = folder / "teacher"
    shutil.rmtree(folder / "in-process", ignore_errors=True)
    train(parse_args(kd_run_args(data, teacher, folder / "in-process")))
    want = [{k: r[k] for k in KEYS} for r in metrics(folder / "in-process")]
    for _ in range(repeats):
        started = time.monotonic()
        run = folder / "run"
        shutil.rmtree(run, ignore_errors=True)
        train(parse_args(kd_run_args(data, teacher, run, "--workers", "2", "stop_at_step=2")))
        train(parse_args(kd_run_args(data, teacher, run, "--workers", "2", "--resume")))
        same = [{k: r[k] for k in KEYS} for r in metrics(run)] == want
        print("repeat " + str(_ + 1) + " " + json.dumps({"same": same, "seconds": time.monotonic() - started}),
              flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--folder", required=True)
    arguments = parser.parse_args()
    _repeat(arguments.repeats, Path(arguments.folder))
