"""Chaos soak: the demo's four stages and two on-policy rounds, killed with `kill -9` again and again.

    python -m bench.soak [--kills 30] [--seed 0] [--out out/soak] [--recipe small|demo]
    python -m bench.soak --kills 0 --resume-repeats 50      # only the worker-process resume, repeated
    python -m bench.soak --kills 8 --engine ray --storage s3  # stages on a local Ray, outputs in S3 (moto)

First the recipe (bench/soak_recipe.py) runs once uninterrupted; its outputs become OUT/reference.
Then the same commands run again in the same folder (OUT/run) while the soak kills the running command
with SIGKILL at `--kills` moments drawn from a generator seeded with `--seed`, and after each kill
starts the same command again. A kill is one of:

- `time`: a moment drawn over the command's uninterrupted duration;
- `recovery`: in the re-run after a kill, before it shows progress (while it imports, reads its markers
  or checkpoint, removes what the killed run left);
- `shard`: as soon as a temporary file appears in the output (a shard, a completion record, a table);
- `checkpoint`: as soon as a `checkpoints/step-N.tmp/` folder appears (DCP writing);
- `hook`: the command's own fault-injection point (`CSD_TEST_CRASH`, docs/RELIABILITY.md): a shard
  before its rename, before or after its completion record, a checkpoint once its DCP files or its
  `complete.json` are written, or the manifest once its temporary file is written.

Only the command's own process is killed: whatever it started (loader workers, align workers, the
rounds driver's csd-train) must end by itself within `--orphan-bound` seconds (a process that does not is
reported and ended by the soak). A kill whose command finishes first is carried to the next command;
kills still left when the last command has finished are dealt over the commands again, from the first, in
the same folder (a lap): every command is then complete, and each such kill (`rerun`) falls at a moment
over the command's last finished attempt, so a re-run of complete work is killed and must leave the same
bytes. At most `--max-laps` laps (default 4); a kill still not delivered fails the soak.

At the end the soak compares OUT/run with OUT/reference: every file of every stage output (sha256,
per-rank stats aside), every step's logged values of every training run (losses, counts, learning
rate, gradient norm, held-out bits per byte; not the timings), every byte of every export, and that no
`*.tmp` file or folder nor failed export is left, and that every planned kill was delivered. It prints
each kill (lap, command, trigger, seconds into the attempt, where it was) and the verdict, and writes
OUT/soak.json. Exit 0 when everything holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.soak_recipe import ROOT, Command, recipe
from bench.soak_state import compare, describe, leftovers, progress_seen

TRIGGERS = {"tables": ("time", "shard"), "stage": ("time", "shard", "hook"),
            "train": ("time", "checkpoint", "hook"), "rounds": ("time", "shard", "checkpoint", "hook")}
SHARD_HOOKS = ("before_rename", "before_marker", "after_marker", "manifest_written")
CHECKPOINT_HOOKS = ("checkpoint_written", "checkpoint_complete")
POLL_S = 0.005
STORE_POLL_S = 0.05  # an object-store output is listed over HTTP: poll it less often
RERUN_SHARE = 0.8  # a rerun kill falls in the first 80% of the command's last finished attempt


@dataclass
class Kill:
    """A planned kill: the command it targets, its trigger and the draws that place it."""

    command: int
    trigger: str
    fraction: float           # where in the duration (time, recovery), which shard or step (hook)
    hook: str = ""


@dataclass
class Outcome:
    """What happened to one attempt of a command."""

    command: str
    trigger: str
    killed: bool
    seconds: float
    where: str = ""
    hook: str = ""
    orphans: list = field(default_factory=list)  # processes it started that outlived it by the bound
    orphans_ended_s: float = 0.0                  # how long the last of its processes took to end after it
    lap: int = 1                                  # the soak's pass over the commands it came in


def session_processes(sid: int) -> list[int]:
    """Live processes of session `sid` (each command runs in its own session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def hooks_for(kind: str, engine: str) -> tuple[str, ...]:
    """The `CSD_TEST_CRASH` points a command of `kind` reaches (on Ray a stage's shards are written by
    actors, which do not see the driver's variables: only its manifest hook is left)."""
    if kind == "train":
        return CHECKPOINT_HOOKS
    if kind == "rounds":
        return SHARD_HOOKS + CHECKPOINT_HOOKS
    return ("manifest_written",) if engine == "ray" else SHARD_HOOKS


def plan(commands: list[Command], durations: list[float], kills: int, rng: random.Random,
         engine: str = "local") -> list[Kill]:
    """`kills` kills over the commands, more where more time is spent; a command's second and later
    kills are in a recovery one time in three; each command gets one when there are kills to spare (with
    the recipe's four stages, five kills are enough)."""
    planned, per_command = [], [0] * len(commands)
    for _ in range(kills):
        index = rng.choices(range(len(commands)), weights=durations)[0]
        kind = commands[index].kind
        trigger = rng.choice(TRIGGERS[kind])
        if per_command[index] and rng.random() < 1 / 3:
            trigger = "recovery"
        hook = rng.choice(hooks_for(kind, engine)) if trigger == "hook" else ""
        planned.append(Kill(index, trigger, rng.random(), hook))
        per_command[index] += 1
    if kills >= 3:
        _ensure_each_phase(planned, commands)
    # each command's kills in the order drawn, a manifest kill last (after it the command has little left),
    # but never a recovery first (it needs a killed run to recover from: the manifest kill then goes first)
    ordered = sorted(planned, key=lambda k: (k.command, k.hook == "manifest_written"))
    return [kill for index in range(len(commands)) for kill in _recovery_not_first(
        [k for k in ordered if k.command == index])]


def _recovery_not_first(kills: list[Kill]) -> list[Kill]:
    """`kills` in their order, but the first kill that is not a recovery goes first when a recovery would: a recovery
    needs a killed run to recover from (at the head of a command's queue it would become a `time` kill)."""
    lead = next((i for i, k in enumerate(kills) if k.trigger != "recovery"), None)
    if not kills or kills[0].trigger != "recovery" or lead is None:
        return kills
    return [kills[lead], *kills[:lead], *kills[lead + 1:]]


def _ensure_each_phase(planned: list[Kill], commands: list[Command]) -> None:
    """At least one kill during a recovery, one during a checkpoint and one during a manifest write: where
    the draws gave none, the last kill of the commands that can take it becomes one."""
    train = [i for i, c in enumerate(commands) if c.kind == "train"]
    stage = [i for i, c in enumerate(commands) if c.kind == "stage"]
    wanted = [(lambda k: k.trigger == "recovery", train, "recovery", ""),
              (lambda k: k.trigger == "checkpoint" or k.hook in CHECKPOINT_HOOKS, train, "checkpoint", ""),
              (lambda k: k.hook == "manifest_written", stage[-1:], "hook", "manifest_written")]
    for present, targets, trigger, hook in wanted:
        if targets and not any(present(k) for k in planned):
            mine = [k for k in planned if k.command in targets] or planned
            free = [k for k in [*reversed(mine), *reversed(planned)] if _redundant(k, planned, wanted)]
            victim = free[0] if free else mine[-1]  # the targets' own kills first
            victim.command, victim.trigger, victim.hook = targets[-1], trigger, hook
    _ensure_each_command(planned, commands, wanted)
    recovery = next(k for k in planned if k.trigger == "recovery")
    if sum(k.command == recovery.command for k in planned) == 1:  # a recovery needs a kill before it
        spare = next((k for k in planned if k is not recovery and not any(p(k) for p, *_ in wanted)
                      and sum(other.command == k.command for other in planned) > 1), None)
        if spare is not None:
            spare.command, spare.trigger, spare.hook = recovery.command, "time", ""
    for index in range(len(commands)):
        mine = [k for k in planned if k.command == index]
        if mine and mine[0].trigger == "recovery":
            other = next((k for k in mine if k.trigger != "recovery"), None)
            if other is None:
                mine[0].trigger = "time"
            else:
                swapped = (other.trigger, other.hook, other.fraction)
                other.trigger, other.hook, other.fraction = mine[0].trigger, mine[0].hook, mine[0].fraction
                mine[0].trigger, mine[0].hook, mine[0].fraction = swapped


def _redundant(kill: Kill, planned: list[Kill], wanted) -> bool:
    """Whether every phase `kill` is in has another kill: it can be moved without losing a phase."""
    return all(any(present(k) for k in planned if k is not kill) for present, *_ in wanted if present(kill))


def _ensure_each_command(planned: list[Kill], commands: list[Command], wanted) -> None:
    """With kills to spare, every command is killed at least once: a command the draws
    left out takes a spare kill (from a command with another, and not the only one of a phase above) as a
    `time` kill in the first half of its run (before it could finish: a kill it outlives goes to the next
    command)."""
    if len(planned) < len(commands):
        return
    for index in range(len(commands)):
        if any(k.command == index for k in planned):
            continue
        kill = next((k for k in reversed(planned) if _redundant(k, planned, wanted)
                     and sum(other.command == k.command for other in planned) > 1), None)
        if kill is not None:
            kill.command, kill.trigger, kill.hook, kill.fraction = index, "time", "", kill.fraction / 2


def hook_env(kill: Kill, command: Command, options) -> str:
    """The `CSD_TEST_CRASH` value of a hook kill, from what is on disk now."""
    if kill.hook == "manifest_written":
        return kill.hook
    if kill.hook in CHECKPOINT_HOOKS:
        steps = options.steps if command.kind == "train" else options.round_steps
        saves = [s for s in range(options.save_every, steps + 1, options.save_every)] or [steps]
        return f"{kill.hook}:{saves[int(kill.fraction * len(saves))]}"
    remaining = shards_left(command.output) if command.kind == "stage" else 0
    return f"{kill.hook}:{1 + int(kill.fraction * (remaining or 3))}"  # the n-th shard this process writes


def shards_left(folder: Path) -> int:
    """Shards of a stage output not complete yet (0 when it has no run record yet)."""
    try:
        tasks = len(json.loads((folder / "run.json").read_text(encoding="utf-8"))["tasks"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return max(0, tasks - len(list((folder / "done").glob("*.done"))))


def fit(kill: Kill, index: int, kind: str, engine: str = "local") -> Kill:
    """A kill carried from another command (or drawn before the engine was known), made one that `kind`
    of command can receive."""
    trigger, hook = kill.trigger, kill.hook
    if trigger not in TRIGGERS[kind] + ("recovery",):
        trigger, hook = "time", ""
    hooks = hooks_for(kind, engine)
    if trigger == "hook" and hook not in hooks:
        hook = hooks[int(kill.fraction * len(hooks))]
    return Kill(index, trigger, kill.fraction, hook)


def temporary(command: Command, trigger: str) -> set[str]:
    """The temporary files or folders of the trigger's kind in the command's output now."""
    found = set()
    if trigger == "shard" and not isinstance(command.output, Path):  # an object is staged in TMPDIR, then uploaded
        found = {str(p) for p in (Path(os.environ.get("TMPDIR", "/tmp")) / "csd-pipeline-staging").rglob("*.tmp")}
    if not command.output.exists():
        return found
    pattern = "checkpoints/step-*.tmp" if trigger == "checkpoint" else "*.tmp"
    found |= {str(p) for p in command.output.rglob(pattern)}
    if trigger == "checkpoint" and not isinstance(command.output, Path):  # DCP writes step-N/ in place there
        found |= {str(p) for p in command.output.glob("checkpoints/step-*") if not (p / "complete.json").exists()}
    return found


def trigger_due(kill: Kill, command: Command, started: float, duration: float, first_progress: float,
                stale: set) -> bool:
    """Whether to kill now. `stale`: what a killed run left (updated: the re-run removes it, then a
    new one of the same name is this run's own)."""
    elapsed = time.monotonic() - started
    if kill.trigger in ("time", "rerun"):
        return elapsed >= kill.fraction * duration
    if kill.trigger == "recovery":
        return elapsed >= kill.fraction * first_progress
    if kill.trigger in ("checkpoint", "shard"):
        now = temporary(command, kill.trigger)
        stale &= now
        return bool(now - stale)
    return False  # hook: the process kills itself


def wait_for_orphans(sid: int, bound: float) -> tuple[list[int], float]:
    """Wait until every process of session `sid` has ended (at most `bound` s); end and return the rest."""
    started = time.monotonic()
    while time.monotonic() - started < bound:
        alive = session_processes(sid)
        if not alive:
            return [], time.monotonic() - started
        time.sleep(0.05)
    alive = session_processes(sid)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive, bound


def attempt(command: Command, kill: Kill | None, duration: float, first_progress: float, options,
            log_file) -> Outcome:
    """Run `command` once; kill it as `kill` says (None: let it finish). Raises when it fails by itself."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CSD_PROGRESS="0")
    env.pop("CSD_TEST_CRASH", None)
    hook = hook_env(kill, command, options) if kill and kill.trigger == "hook" else ""
    if hook:
        env["CSD_TEST_CRASH"] = hook
    stale = temporary(command, kill.trigger) if kill else set()
    log_file.write(f"\n$ {' '.join(command.argv)}  # {kill.trigger if kill else 'to the end'} {hook}\n")
    log_file.flush()
    started = time.monotonic()
    process = subprocess.Popen(command.argv, cwd=ROOT, env=env, stdout=log_file, stderr=log_file,
                               start_new_session=True)
    killed = False
    while process.poll() is None:
        if time.monotonic() - started > options.attempt_timeout:
            raise SystemExit(f"soak: {command.name} ran past --attempt-timeout {options.attempt_timeout} s (a hang?); "
                             f"its processes: {session_processes(process.pid)}; see {log_file.name}")
        if kill and kill.trigger != "hook" and trigger_due(kill, command, started, duration, first_progress,
                                                           stale):
            os.kill(process.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(POLL_S if isinstance(command.output, Path) else STORE_POLL_S)
    process.wait()
    seconds = time.monotonic() - started
    if hook and process.returncode != 0:
        killed = True  # the process (or, for rounds, its csd-train) killed itself at the hook
    elif process.returncode != 0 and not killed:
        raise SystemExit(f"soak: {command.name} failed by itself (exit {process.returncode}); see {log_file.name}")
    outcome = Outcome(command.name, kill.trigger if kill else "", killed, round(seconds, 2),
                      describe(command.kind, command.output) if killed else "finished", hook)
    if killed:
        orphans, ended = wait_for_orphans(process.pid, options.orphan_bound)
        outcome.orphans, outcome.orphans_ended_s = orphans, round(ended, 2)
    return outcome


def reference_run(commands: list[Command], options, log_file) -> tuple[list[float], list[float]]:
    """Each command once, uninterrupted: (seconds, seconds to its first visible progress) per command."""
    durations, firsts = [], []
    for command in commands:
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CSD_PROGRESS="0")
        env.pop("CSD_TEST_CRASH", None)
        log_file.write(f"\n$ {' '.join(command.argv)}  # reference\n")
        log_file.flush()
        started, first = time.monotonic(), None
        process = subprocess.Popen(command.argv, cwd=ROOT, env=env, stdout=log_file, stderr=log_file)
        while process.poll() is None:
            if first is None and progress_seen(command.kind, command.output):
                first = time.monotonic() - started
            time.sleep(0.02)
        if process.returncode != 0:
            raise SystemExit(f"soak: the reference run of {command.name} failed (exit {process.returncode}); "
                             f"see {log_file.name}")
        durations.append(time.monotonic() - started)
        firsts.append(first if first is not None else durations[-1])
        print(f"reference: {command.name} {durations[-1]:.1f} s (first progress after {firsts[-1]:.1f} s)", flush=True)
    return durations, firsts


def soak(commands: list[Command], planned: list[Kill], durations, firsts, options,
         log_file) -> tuple[list[Outcome], int]:
    """Deliver the planned kills: lap 1 runs the commands in order, each killed as planned and run again
    until it finishes; kills left when the last command finished are dealt over the commands again (lap 2
    and on, every command already complete), at most `--max-laps` laps. Returns the outcomes and the
    number of kills still not delivered."""
    outcomes, last_finished = [], list(durations)
    queues = [[k for k in planned if k.command == index] for index in range(len(commands))]
    for lap in range(1, options.max_laps + 1):
        carried = []
        for index, command in enumerate(commands):
            # a command that finished before its kill passes the rest on; a recovery among them still follows a kill
            carried = _deliver(command, index, lap, _recovery_not_first(carried + queues[index]), durations, firsts,
                               last_finished, options, log_file, outcomes)
        if not carried:
            return outcomes, 0
        queues = [carried[index::len(commands)] for index in range(len(commands))]
    return outcomes, len(carried)


def _deliver(command: Command, index: int, lap: int, queue: list[Kill], durations, firsts, last_finished,
             options, log_file, outcomes: list[Outcome]) -> list[Kill]:
    """Run `command` killed by each kill of `queue` in turn, then to its end; return the kills it finished
    before. Lap 2 and on, every kill is a `rerun`: a moment over its last finished attempt (it is complete)."""
    for position, kill in enumerate(queue):
        if lap > 1:
            kill, duration = Kill(index, "rerun", kill.fraction), RERUN_SHARE * last_finished[index]
        else:
            kill, duration = fit(kill, index, command.kind, options.engine), durations[index]
            if kill.trigger == "recovery" and not position:  # carried here: no killed run to recover from
                kill.trigger = "time"
        outcome = attempt(command, kill, duration, firsts[index], options, log_file)
        if not outcome.killed:  # the command finished first: the rest of its kills go to the next command
            last_finished[index] = outcome.seconds
            return queue[position + 1:] + [queue[position]]
        outcome.lap = lap
        outcomes.append(outcome)
        print(f"kill {len(outcomes):3d}: lap {lap} {outcome.command:16s} {outcome.trigger:10s} {outcome.hook:24s} "
              f"{outcome.seconds:7.2f} s  {outcome.where}"
              + (f"  ORPHANS {outcome.orphans}" if outcome.orphans else ""), flush=True)
    last_finished[index] = attempt(command, None, durations[index], firsts[index], options, log_file).seconds
    return []


def verdict(commands: list[Command], reference: Path, work: Path, outcomes: list[Outcome], undelivered: int,
            laps: int, staged: list[str]) -> dict:
    """Compare `work` with `reference` (object-store outputs fetched into `work` first); `staged`: the
    staging files left in the commands' TMPDIR."""
    problems = [f"{undelivered} planned kill(s) not delivered in {laps} laps"] if undelivered else []
    for command in commands:
        for kind, folder in command.outputs:
            relative = Path(str(folder).rsplit(f"/{work.name}/", 1)[1])  # under work or its bucket prefix
            problems += compare(kind, reference / relative, work / relative)
    partial = leftovers(work) + [f"TMPDIR/{name}" for name in staged]
    problems += [f"left behind: {name}" for name in partial]
    problems += [f"kill {i + 1} ({o.command}): processes {o.orphans} outlived it by the bound"
                 for i, o in enumerate(outcomes) if o.orphans]
    return {"ok": not problems, "problems": problems, "kills": len(outcomes),
            "laps": max((o.lap for o in outcomes), default=1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30, help="kill -9 this many times (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--out", default="out/soak", help="reference/ and run/ go here (default out/soak)")
    parser.add_argument("--recipe", choices=("small", "demo"), default="small",
                        help="small (default): every stage and both rounds on fewer documents and steps; demo: "
                             "the demo's corpus and options, both students")
    parser.add_argument("--docs", type=int, default=6, help="small recipe: training documents (default 6)")
    parser.add_argument("--heldout-docs", type=int, default=2, help="small recipe: held-out documents")
    parser.add_argument("--steps", type=int, default=16, help="small recipe: csd-train steps (default 16)")
    parser.add_argument("--round-steps", type=int, default=4, help="small recipe: steps per on-policy round")
    parser.add_argument("--new-tokens", type=int, default=16, help="small recipe: tokens sampled per prompt")
    parser.add_argument("--save-every", type=int, default=4, help="checkpoint every N steps (default 4)")
    parser.add_argument("--shard-kb", type=float, default=8, help="aligned shard size in KiB (default 8)")
    parser.add_argument("--teacher", default="smollm2-135m-instruct", help="teacher model (smollm2 tokenizer)")
    parser.add_argument("--student-config", default=str(ROOT / "demo" / "student-config.json"))
    parser.add_argument("--no-rounds", action="store_true", help="the four stages only (the test's short soak)")
    parser.add_argument("--no-heldout", action="store_true", help="no held-out align and no evaluation")
    parser.add_argument("--orphan-bound", type=float, default=30.0,
                        help="seconds a killed command's processes have to end (default 30)")
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="ray: align and teacher-logits run as drivers on a local Ray cluster the soak starts")
    parser.add_argument("--storage", choices=("local", "s3"), default="local",
                        help="s3: the outputs of align, teacher-logits and csd-train in s3:// on a moto server "
                             "the soak starts on 127.0.0.1 (the tables stay local; no rounds)")
    parser.add_argument("--max-laps", type=int, default=4,
                        help="kills left when the last command finishes go round the commands again, at most "
                             "this many passes in all (default 4)")
    parser.add_argument("--attempt-timeout", type=float, default=1800.0, help="a longer attempt is a hang")
    parser.add_argument("--resume-repeats", type=int, default=0,
                        help="also run the worker-process resume (stop, then --resume, 2 loader workers) this "
                             "many times in one process (bench/soak_resume.py)")
    options = parser.parse_args(argv)
    out = Path(options.out).resolve()
    result: dict = {"options": vars(options)}
    if options.kills > 0:
        result.update(run_soak(options, out))
    if options.resume_repeats > 0:
        from bench.soak_resume import repeat_resume

        result["resume_repeats"] = repeat_resume(options.resume_repeats, out / "resume", options.attempt_timeout)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    ok = result.get("verdict", {"ok": True})["ok"] and result.get("resume_repeats", {"ok": True})["ok"]
    print(f"soak: {'PASS' if ok else 'FAIL'} (details: {out / 'soak.json'})", flush=True)
    return 0 if ok else 1


def run_soak(options, out: Path) -> dict:
    work, reference = out / "run", out / "reference"
    for folder in (work, reference):
        shutil.rmtree(folder, ignore_errors=True)
    work.mkdir(parents=True)
    from bench.soak_backends import backends

    with open(out / "soak.log", "w", encoding="utf-8") as log_file, \
            backends(options.engine, options.storage, out) as started_backends:
        commands = recipe(options, work, started_backends.store(work), started_backends.engine_args())
        started = time.monotonic()
        durations, firsts = reference_run(commands, options, log_file)
        reference_s = time.monotonic() - started
        started_backends.fetch(work)
        work.rename(reference)
        work.mkdir()
        commands = recipe(options, work, started_backends.store(work), started_backends.engine_args())
        planned = plan(commands, durations, options.kills, random.Random(options.seed), options.engine)
        started = time.monotonic()
        outcomes, undelivered = soak(commands, planned, durations, firsts, options, log_file)
        soak_s = time.monotonic() - started
        started_backends.fetch(work)
        staged = started_backends.leftovers()
    result = verdict(commands, reference, work, outcomes, undelivered, options.max_laps, staged)
    print(f"\nsoak: {result['kills']} kills delivered; reference {reference_s:.0f} s, soak {soak_s:.0f} s", flush=True)
    for problem in result["problems"]:
        print(f"  FAIL {problem}", flush=True)
    if result["ok"]:
        print("  every stage output, every logged step and every export equal the uninterrupted run's; "
              "nothing partial left; every process ended", flush=True)
    return {"verdict": result, "kills": [asdict(o) for o in outcomes], "reference_s": round(reference_s, 1),
            "soak_s": round(soak_s, 1), "commands": [" ".join(c.argv[1:]) for c in commands]}


if __name__ == "__main__":
    sys.exit(main())
