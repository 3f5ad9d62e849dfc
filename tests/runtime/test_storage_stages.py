"""The stages with every input and output in `s3://`, against a real S3 server (moto, a process).

The demo's four stages (align, teacher-logits, csd-train, bits-per-byte) on the smallest inputs the
stage tests use: each shard has the sha256 of the local run's, and the held-out bits per byte is the
local run's. `tables build-both`, `report` and `rounds` write into the bucket what they write locally. A `kill -9` mid-align and mid-teacher-logits with the output in S3, then a re-run, gives
the same bytes; csd-train killed mid-checkpoint in S3 resumes to the same losses. The failures a user
meets (wrong endpoint, missing bucket, denied credentials, an object deleted between two stages) are
one `error:` line naming the URL, never the secret.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3_cases import SECRET
from tests.trainer_cases import DATA, STUDENT_CONFIG

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PAIR_TABLES = ("pair-tables/student_to_teacher.safetensors", "pair-tables/teacher_to_student.safetensors")
STAGE_ARGS = ["--split-on-blank-lines", "--student-tokenizer", "llama-spm", "--teacher-tokenizer", "smollm2",
              "--max-student-tokens", "128", "--shard-mb", str(2000 / (1 << 20)), "--quiet",
              "--tables", *PAIR_TABLES]  # the cached tables (copied into `work`): no align builds them again
TRAIN_ARGS = ["--student-tokenizer", "llama-spm", "--steps", "2", "--seq-len", "128", "--batch-size", "2",
              "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "1", "--workers", "0", "--no-progress"]


def cli(args, cwd, env=None, tool=("-m", "cli.main")):
    """Run `csd-pipeline ARGS` (or `csd-train`: tool=("-m", "trainer.main")) as a process in `cwd`."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, *tool, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env)


def in_process(main, args, cwd) -> str:
    """Run a console entry point (`cli.main.main`, `trainer.main.main`) in this process in `cwd`; its stdout."""
    import contextlib
    import io

    before, out = os.getcwd(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            main([str(a) for a in args])
    except SystemExit as exit_:
        if exit_.code:
            raise AssertionError(f"{args[0]} exited {exit_.code}") from None
    finally:
        os.chdir(before)
    return out.getvalue()


def shards(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name.endswith(".parquet")}


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory, s3_server, tables_for):
    """A folder with the corpus (botchan slice, first 2500 characters) under `corpus/`, the same corpus
    in a bucket, a tiny random teacher (smollm2 tokenizer), the tiny student config and the pair's tables."""
    import shutil

    from csd_pipeline.fixtures.names import tokenizer_path
    from tests.teacher.test_stage import make_tiny_teacher

    root = tmp_path_factory.mktemp("s3-stages")
    (root / "pair-tables").mkdir()
    for cached, name in zip(tables_for("llama-spm", "smollm2"), PAIR_TABLES, strict=True):
        shutil.copyfile(cached, root / name)
    (root / "corpus").mkdir()
    (root / "corpus" / "botchan.txt").write_text((DATA / "botchan-slice.txt").read_text(encoding="utf-8")[:2500],
                                                 encoding="utf-8")
    (root / "heldout").mkdir()
    (root / "heldout" / "devil.txt").write_text((DATA / "devil-slice.txt").read_text(encoding="utf-8")[:1500],
                                                encoding="utf-8")
    make_tiny_teacher(root / "teacher", tokenizer_path("smollm2"))
    (root / "student.json").write_text(json.dumps(STUDENT_CONFIG))
    s3_server.client().create_bucket(Bucket="stages")
    s3_server.put_tree(root / "corpus", "s3://stages/corpus")
    s3_server.put_tree(root / "heldout", "s3://stages/heldout")
    return root


def run_four_stages(root: Path, base: str, out: str) -> float:
    """align (train and held-out), teacher-logits, csd-train, bits-per-byte of the export, in this process;
    `base`: where the corpus folders are ("" local, "s3://stages/" in the bucket), `out`: the outputs' prefix."""
    from cli.main import main as pipeline
    from trainer.main import main as train

    pipeline_run = functools.partial(in_process, pipeline, cwd=root)
    pipeline_run(["align", "--corpus", f"{base}corpus", *STAGE_ARGS, "--output", f"{out}aligned"])
    pipeline_run(["align", "--corpus", f"{base}heldout", *STAGE_ARGS, "--output", f"{out}heldout"])
    pipeline_run(["teacher-logits", "--aligned", f"{out}aligned", "--teacher", root / "teacher", "--top-k", "8",
                  "--device", "cpu", "--output", f"{out}topk", "--quiet"])
    in_process(train, ["--aligned", f"{out}aligned", "--teacher-logits", f"{out}topk", "--student-config",
                       root / "student.json", *TRAIN_ARGS, "--eval-aligned", f"{out}heldout", "--eval-every", "2",
                       "--output", f"{out}student"], root)
    export = root / out / "student" / "export"
    if out.startswith("s3://"):  # the export went to the bucket: bits per byte reads a local copy of it
        from csd_pipeline.runtime.storage import location

        remote, export = location(f"{out}student/export"), root / "export-copy"
        remote.fs.get(remote.path + "/", str(export) + "/", recursive=True)
    result = pipeline_run(["bits-per-byte", "--aligned", f"{out}heldout", "--model", export, "--seq-len", "128",
                           "--json"])
    return json.loads(result)["bits_per_byte"]


@pytest.fixture(scope="module")
def runs(work, one_thread):
    """The four stages run locally (in `work/local/`) and in the bucket (`s3://stages/run/`): their bits per byte.
    One torch thread, as the killed runs' processes have (OMP_NUM_THREADS=1): a resume matches the reference run
    to the last bit only when both reduce in the same order."""
    return run_four_stages(work, "", "local/"), run_four_stages(work, "s3://stages/", "s3://stages/run/")


def test_the_four_stages_in_s3_write_the_local_bytes(work, runs, s3_server):
    local_bpb, remote_bpb = runs
    for name in ("aligned", "heldout", "topk"):
        local, remote = shards(local_files(work / "local" / name)), shards(s3_server.objects(f"s3://stages/run/{name}"))
        assert local and remote == local, name  # every shard, byte for byte
    assert remote_bpb == local_bpb
    local_eval = (work / "local/student/eval.jsonl").read_bytes()  # csd-train's held-out evaluation, from S3 too
    remote_eval = s3_server.objects("s3://stages/run/student")["eval.jsonl"]
    assert [json.loads(line)["bits_per_byte"] for line in remote_eval.splitlines()] == [
        json.loads(line)["bits_per_byte"] for line in local_eval.splitlines()]
    everything = s3_server.objects("s3://stages")
    assert all(SECRET.encode() not in data for data in everything.values())


def capture_and_train(root: Path, base: str, out: str) -> list[float]:
    """One teacher capture of the corpus, its store, a student aligned against it and two training steps, in this
    process; `base`/`out` as in `run_four_stages`. Returns the training losses."""
    from cli.main import main as pipeline
    from trainer.main import main as train

    pipeline_run = functools.partial(in_process, pipeline, cwd=root)
    pipeline_run(["align", "--corpus", f"{base}corpus", "--capture-only", "--teacher-tokenizer", "smollm2",
                  "--max-teacher-tokens", "96", "--split-on-blank-lines", "--shard-mb", str(2000 / (1 << 20)),
                  "--quiet", "--output", f"{out}capture"])
    pipeline_run(["teacher-logits", "--aligned", f"{out}capture", "--teacher", root / "teacher", "--top-k", "8",
                  "--device", "cpu", "--output", f"{out}capture-topk", "--quiet"])
    pipeline_run(["align", "--against-capture", f"{out}capture", "--student-tokenizer", "llama-spm", "--max-student-tokens", "128", "--tables",
                  *PAIR_TABLES, "--quiet", "--output", f"{out}against"])
    in_process(train, ["--aligned", f"{out}against", "--teacher-logits", f"{out}capture-topk", "--student-config",
                       root / "student.json", *TRAIN_ARGS, "--output", f"{out}against-student"], root)
    if out.startswith("s3://"):
        from csd_pipeline.runtime.storage import location

        remote = location(f"{out}against-student/metrics.jsonl")
        text = remote.fs.cat_file(remote.path).decode("utf-8")
    else:
        text = (root / out / "against-student" / "metrics.jsonl").read_text(encoding="utf-8")
    return [json.loads(line)["loss"] for line in text.splitlines() if line.strip()]


def test_one_capture_in_s3_serves_a_student_in_s3_as_locally(work, runs, s3_server):
    # issue 42 item 3: the capture, its store and the student aligned against it all in the bucket
    local = capture_and_train(work, "", "local/")
    remote = capture_and_train(work, "s3://stages/", "s3://stages/run/")
    for name in ("capture", "capture-topk", "against"):
        mine, theirs = shards(local_files(work / "local" / name)), shards(s3_server.objects(f"s3://stages/run/{name}/"))
        assert mine and theirs == mine, name
    assert len(local) == 2 and remote == local


def test_report_reads_and_writes_s3_as_a_local_report(work, runs, s3_server):
    """The same report drawn into a local folder and into the bucket: the same files, report.md uploaded last."""
    from cli.main import main as pipeline

    inputs = ["report", "s3://stages/run/aligned", "s3://stages/run/topk", "s3://stages/run/student"]
    local = in_process(pipeline, [*inputs, "--output", "report", "--quiet"], work)
    assert (work / "report" / "report.md").is_file(), local
    s3_server.client().put_object(Bucket="stages", Key="reports/r1/notes.txt", Body=b"kept")  # not the report's
    in_process(pipeline, [*inputs, "--output", "s3://stages/reports/r1", "--quiet"], work)
    remote = s3_server.objects("s3://stages/reports/r1")
    assert remote.pop("notes.txt") == b"kept"  # a report adds its files to a folder, as on a local disk
    assert remote == local_files(work / "report") and any(name.endswith(".png") for name in remote)


def test_tables_build_both_into_s3_writes_the_local_bytes(work, runs, s3_server):
    """`make tables`'s command with --output-dir in the bucket writes the bytes it writes into a local folder
    (each table uploaded whole); `tables validate` and `tables inspect` read them from the bucket."""
    import json as json_

    from cli.main import main as pipeline

    pair = ["--student-tokenizer", "llama-spm", "--teacher-tokenizer", "smollm2"]
    for output in ("tables", "s3://stages/tables"):
        in_process(pipeline, ["tables", "build-both", *pair, "--output-dir", output, "--quiet"], work)
    built = s3_server.objects("s3://stages/tables")
    assert built == local_files(work / "tables") and len(built) == 2
    names = [f"s3://stages/tables/{name}" for name in ("student_to_teacher.safetensors", "teacher_to_student.safetensors")]
    checked = json_.loads(in_process(pipeline, ["tables", "validate", *pair, "--student-to-teacher", names[0],
                                                "--teacher-to-student", names[1], "--sample", "50", "--json"], work))
    assert checked["ok"]
    counts = json_.loads(in_process(pipeline, ["tables", "inspect", names[0], "--json"], work))
    assert counts["source_vocab_size"] == 32000


def test_rounds_with_the_output_in_s3_chain_the_exports_and_resume(work, runs, s3_server, tmp_path, monkeypatch):
    """Two on-policy rounds with every output in the bucket (the rounds driver's end-to-end test): each round's
    stages, seed and KD-alone training step; round 2 samples with a checked local copy of round 1's export (the same
    bytes as its objects); a re-run trains nothing and rewrites nothing."""
    from csd_pipeline.generate.rounds import RoundsConfig, run_rounds
    from csd_pipeline.runtime import storage
    from csd_pipeline.runtime.manifest import read_manifest
    from tests.onpolicy_cases import prompt_corpus, tiny_student

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))  # where the export's local copy goes
    config = RoundsConfig(student=str(tiny_student(tmp_path / "student")), teacher=str(work / "teacher"),
                          teacher_tokenizer="smollm2", prompts=[str(prompt_corpus(tmp_path / "prompts.jsonl", 2))],
                          output="s3://stages/rounds", rounds=2, steps=1, prompt_field="text", prompt_chars=60,
                          max_new_tokens=6, max_student_tokens=64, top_k=8, device="cpu",
                          train_args=["--batch-size 1 --workers 0 --progress false --warmup-steps 0"])
    lines: list[str] = []
    last = run_rounds(config, log=lines.append)
    assert str(last) == "s3://stages/rounds/round-2/train/export"
    written = s3_server.objects("s3://stages/rounds")
    for r in (1, 2):
        for stage, folder in (("generate", "generated"), ("align", "aligned"), ("teacher-logits", "teacher")):
            manifest = read_manifest(storage.location(f"s3://stages/rounds/round-{r}/{folder}"), stage=stage)
            if stage == "generate":
                assert manifest["config"]["seed"] == r - 1
        assert f"round-{r}/train/export/config.json" in written and f"round-{r}/train/export/model.safetensors" in written
        assert not any(name.startswith(f"round-{r}/train/checkpoints/") for name in written)  # export only: --no-save-final
        steps = [json.loads(x) for x in written[f"round-{r}/train/metrics.jsonl"].decode().splitlines() if '"step"' in x]
        assert [m["step"] for m in steps] == [1] and not steps[0]["skipped"]
        # GKD: the samples train the divergence alone (CE measured, weighted 0)
        assert steps[0]["loss"] == pytest.approx(steps[0]["kd"], rel=1e-6) and steps[0]["ce"] > 0
    model = read_manifest(storage.location("s3://stages/rounds/round-2/generated"), stage="generate")["sources"]["model"]
    export = {name[len("round-1/train/export/"):]: data for name, data in written.items()
              if name.startswith("round-1/train/export/")}
    assert model.startswith(str(tmp_path / "cache")) and local_files(Path(model)) == export
    again: list[str] = []
    assert str(run_rounds(config, log=again.append)) == str(last)
    assert sum(line.startswith("$ csd-train") for line in lines) == 2
    assert not any(line.startswith("$ csd-train") for line in again)
    assert s3_server.objects("s3://stages/rounds") == written


def test_csd_train_from_s3_with_loader_worker_processes_matches_the_in_process_loader(work, runs, one_thread):
    """csd-train reading its shards from S3 in forked loader workers (`--workers 1`), run in this process, whose
    s3fs file system the fork inherits (the `runs` fixture used it): each worker opens its own (an inherited one
    raised "This class is not fork-safe" in the worker; the soak found it), and the losses are the local
    in-process loader's."""
    from trainer.main import main as train

    args = ["--aligned", "s3://stages/run/aligned", "--teacher-logits", "s3://stages/run/topk", "--student-config",
            work / "student.json", *TRAIN_ARGS, "--output", work / "workers-from-s3"]
    args[args.index("--workers") + 1] = "1"
    in_process(train, args, work)

    def losses(folder):
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["ce"], r["kd"]) for r in rows]

    assert losses(work / "workers-from-s3") == losses(work / "local" / "student")


def test_kill_9_mid_stage_with_the_output_in_s3_resumes_to_the_same_bytes(work, runs, s3_server):
    from cli.main import main as pipeline

    out = "s3://stages/killed/"
    crash = {"CSD_TEST_CRASH": "before_marker:1"}  # the shard object is uploaded, its record is not
    killed = cli(["align", "--corpus", "s3://stages/corpus", *STAGE_ARGS, "--output", f"{out}aligned"], work, crash)
    assert killed.returncode == -9, killed.stderr[-2000:]
    written = s3_server.objects(f"{out}aligned")
    assert "part-00000-00000.parquet" in written and "manifest.json" not in written
    assert "done/part-00000-00000.done" not in written  # an object without its record: absent for the re-run
    in_process(pipeline, ["align", "--corpus", "s3://stages/corpus", *STAGE_ARGS, "--output", f"{out}aligned"], work)
    assert shards(s3_server.objects(f"{out}aligned")) == shards(local_files(work / "local" / "aligned"))

    teacher = ["teacher-logits", "--aligned", f"{out}aligned", "--teacher", work / "teacher", "--top-k", "8",
               "--device", "cpu", "--output", f"{out}topk", "--quiet"]
    killed = cli(teacher, work, crash)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "manifest.json" not in s3_server.objects(f"{out}topk")
    in_process(pipeline, teacher, work)
    assert shards(s3_server.objects(f"{out}topk")) == shards(local_files(work / "local" / "topk"))


def test_csd_train_killed_mid_checkpoint_in_s3_resumes_to_the_same_losses(work, runs, s3_server, monkeypatch,
                                                                          one_thread):
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.runtime import storage
    from trainer.main import main as train

    monkeypatch.setenv(storage.CACHE_ENV, "")  # restored after the test: --cache-dir below sets it

    args = ["--aligned", "s3://stages/run/aligned", "--teacher-logits", "s3://stages/run/topk", "--student-config",
            work / "student.json", *TRAIN_ARGS, "--output", "s3://stages/resumed"]
    killed = cli(args, work, {"CSD_TEST_CRASH": "checkpoint_written:2"}, tool=("-m", "trainer.main"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    written = s3_server.objects("s3://stages/resumed")
    assert "checkpoints/step-1/complete.json" in written and "checkpoints/step-2/.metadata" in written
    assert "checkpoints/step-2/complete.json" not in written  # DCP's files, no completion record: not a checkpoint
    in_process(train, [*args, "--resume", "--cache-dir", work / "cache"], work)
    written = s3_server.objects("s3://stages/resumed")
    aligned = AlignedOutput.open("s3://stages/run/aligned")
    cached = {p.stem for p in (work / "cache").rglob("*.parquet")}  # copies named by their manifest sha256
    assert {s.sha256 for s in aligned.shards} <= cached
    damaged = next((work / "cache").rglob(f"{aligned.shards[0].sha256}.parquet"))
    damaged.write_bytes(b"not the shard")  # a changed copy is never used: it is fetched again
    copy = storage.cached_copy(aligned.shard_path(aligned.shards[0]), aligned.shards[0].sha256, work / "cache")
    assert copy.read_bytes() == s3_server.objects("s3://stages/run/aligned")[aligned.shards[0].file]
    assert "checkpoints/step-2/complete.json" in written
    losses = [json.loads(line)["loss"] for line in (work / "local/student/metrics.jsonl").read_text().splitlines()]
    assert [json.loads(line)["loss"] for line in written["metrics.jsonl"].decode().splitlines()] == losses


def in_process_failure(args, cwd) -> subprocess.CompletedProcess:
    """`csd-pipeline ARGS` run in this process (no second torch import) that is expected to fail: its exit
    code and output, as `subprocess.run` would give them."""
    import contextlib
    import io

    from cli.main import main

    before, out, err = os.getcwd(), io.StringIO(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_error_line(done, url: str) -> str:
    """The stderr of a failed command: one `error:` line that names `url` and never the secret."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert url in lines[0] and SECRET not in done.stderr + done.stdout
    return lines[0]


def test_object_store_failures_are_one_error_line_naming_the_url(work, runs, s3_server):
    from tests.s3_cases import _free_port, start_moto

    aligned, quick = "s3://stages/run/aligned", {"AWS_MAX_ATTEMPTS": "1"}  # no retries against a closed port
    wrong = one_error_line(cli(["status", aligned], work, {**quick, "AWS_ENDPOINT_URL":
                                                           f"http://127.0.0.1:{_free_port()}"}), aligned)
    assert "cannot be reached" in wrong and "AWS_ENDPOINT_URL" in wrong
    missing = one_error_line(cli(["inspect", "s3://no-such-bucket/aligned"], work), "s3://no-such-bucket/aligned")
    assert "bucket 'no-such-bucket' does not exist" in missing

    checking, endpoint = start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # a server that checks credentials
    try:
        denied = one_error_line(cli(["status", aligned], work, {**quick, "AWS_ENDPOINT_URL": endpoint}), aligned)
    finally:
        checking.kill()
        checking.wait()
    assert "access was denied" in denied and "AWS_SECRET_ACCESS_KEY" in denied

    # An aligned shard deleted after align wrote its manifest: teacher-logits names it and says what to do.
    from csd_pipeline.runtime.storage import location

    copy = location("s3://stages/deleted/aligned")
    copy.fs.copy(location(aligned).path, copy.path, recursive=True)
    copy.fs.rm_file((copy / "part-00000-00000.parquet").path)
    deleted = one_error_line(in_process_failure(["teacher-logits", "--aligned", str(copy), "--teacher", work / "teacher",
                                                 "--device", "cpu", "--output", "s3://stages/deleted/topk", "--quiet"],
                                                work), str(copy))
    assert "part-00000-00000.parquet is missing" in deleted
