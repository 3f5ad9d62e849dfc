"""`--engine ray`: align, teacher-logits and generate on a real local Ray cluster (2 CPUs, started once for
the module in this process) write the bytes of `--engine local`; a worker killed mid-shard by its pid is
retried; a driver killed mid-run resumes; a cluster that cannot be reached is one `error:` line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from csd_pipeline.runtime.ray_engine import EngineConfig
from tests.align.test_stage import config as align_config
from tests.align.test_stage import small_corpus  # noqa: F401 (the align tests' corpus fixture, used below)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory, s3_server):
    """A local Ray cluster of 2 CPUs hosted by this process; its workers import this checkout, one thread each,
    and find the test S3 server (started first: they take this process's AWS_* variables). Yields the address
    another driver connects to."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        path = os.environ.get("PYTHONPATH")
        patch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{path}" if path else str(REPO))
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("CSD_HASH_CACHE", str(tmp_path_factory.mktemp("hash-cache")))
        from bench.bench_engines import start_local_ray

        start_local_ray(num_cpus=2)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


RAY = EngineConfig(engine="ray")


@pytest.fixture(scope="module")
def align_inputs(tmp_path_factory, small_corpus, tables_for):  # noqa: F811 (the fixture imported above)
    """A smaller shard size than the align tests' (more shards to spread) and its `--engine local` output."""
    from csd_pipeline.align.stage import run_align

    tables = [tables_for("llama-bpe", "qwen2")]
    local = tmp_path_factory.mktemp("align-local") / "out"
    run_align(align_config(small_corpus, local, tables, shard_bytes=6_000))
    return small_corpus, tables, local


def output_files(directory: Path) -> dict[str, bytes]:
    """Every file but temporary ones (shards, markers, stats, manifest)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and not p.name.endswith(".tmp")}


@pytest.mark.slow
def test_align_on_ray_writes_the_local_bytes_to_s3(ray_cluster, align_inputs, s3_server, bucket, monkeypatch):
    """3 actors on 2 CPUs write into moto's S3 server (a process): two take every shard, the third never starts and
    holds none back; the endpoint and credentials reach them only through --storage-options (the actors of a
    cluster started before the server do not have its AWS_* variables)."""
    import json

    from csd_pipeline.align.stage import run_align
    from csd_pipeline.runtime import storage
    from tests.s3_cases import SECRET

    # what --storage-options sets (storage.configure), through monkeypatch so that it ends with the test
    monkeypatch.setenv(storage.OPTIONS_ENV, json.dumps({"endpoint_url": s3_server.endpoint, "key": "testing",
                                                        "secret": SECRET}))
    corpus, tables, local = align_inputs
    url = f"{bucket}/aligned"
    report = run_align(align_config(corpus, url, tables, shard_bytes=6_000), workers=3, engine=RAY)
    assert report.complete and len(report.processed) >= 6
    written = s3_server.objects(url)
    def shards(files):
        return {name: data for name, data in files.items() if name.endswith(".parquet") or name.startswith("done/")}

    assert shards(written) == shards(output_files(local))  # every shard and record, as the local run wrote them
    assert len(shards(written)) == 2 * len(report.processed) and "manifest.json" in written
    assert all(SECRET.encode() not in data for data in written.values())


def _kill_first_writer(out: Path, stop: threading.Event) -> list[int]:
    """Poll `out` for a shard's temporary file written by another process (`<name>.<host>.<pid>.tmp`)
    and SIGKILL that process, once; returns the pid killed (empty when none was seen)."""
    host, me = socket.gethostname(), os.getpid()
    while not stop.is_set():
        for path in out.glob(f"part-*.{host}.*.tmp") if out.is_dir() else []:
            pid = int(path.name.removesuffix(".tmp").rpartition(".")[2])
            if pid != me:
                os.kill(pid, signal.SIGKILL)
                return [pid]
        time.sleep(0.002)
    return []


@pytest.mark.slow
def test_a_worker_killed_mid_shard_is_retried_to_the_same_bytes(ray_cluster, one_thread, tiny_teacher, tmp_path,
                                                                 tmp_path_factory, tokenizer_path, tables_for):
    """teacher-logits with 2 actors: the first actor process seen writing a shard is SIGKILLed by its pid."""
    from tests.teacher.test_stage import run_stage as run_teacher

    aligned = _aligned_for_teacher(tmp_path_factory, tokenizer_path, tables_for)
    teacher = tiny_teacher
    run_teacher(aligned, teacher, tmp_path / "local", device="cpu")
    out, stop, killed = tmp_path / "ray", threading.Event(), []
    killer = threading.Thread(target=lambda: killed.extend(_kill_first_writer(out, stop)))
    killer.start()
    try:
        from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits

        config = TeacherLogitsConfig(aligned=str(aligned), teacher=str(teacher), output=str(out), top_k=8,
                                     batch_tokens=512, device="cpu")
        report = run_teacher_logits(config, workers=2, engine=RAY)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was seen writing a shard"
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)
    assert report.complete
    assert output_files(out) == output_files(tmp_path / "local")
    assert not list(out.rglob("*.tmp"))  # the killed worker's partial shard was removed


def _aligned_for_teacher(tmp_path_factory, tokenizer_path, tables_for) -> Path:
    """The teacher tests' aligned input, cut into 6 shards (more shards than actors, so one is killed mid-run)."""
    from csd_pipeline.align.stage import AlignConfig, run_align
    from tests.teacher.test_stage import DATA

    out = tmp_path_factory.mktemp("aligned")
    run_align(AlignConfig(
        corpus=[str(DATA / "kjv-genesis-slice.txt"), str(DATA / "python-docs-generators-slice.txt")],
        student_tokenizer=str(tokenizer_path("gpt-2")), teacher_tokenizers=[str(tokenizer_path("smollm2"))],
        output=str(out), max_student_tokens=128, split_on_blank_lines=True, shard_bytes=500,
        tables=[tables_for("gpt-2", "smollm2")]))
    return out


@pytest.mark.slow
def test_generate_on_ray_writes_the_local_bytes(ray_cluster, one_thread, tiny_student, tmp_path):
    from csd_pipeline.generate.stage import run_generate
    from tests.generate.test_stage import _config
    from tests.onpolicy_cases import prompt_corpus

    inputs = tiny_student, prompt_corpus(tmp_path / "prompts.jsonl", documents=5)
    run_generate(_config(inputs, tmp_path / "local"))
    report = run_generate(_config(inputs, tmp_path / "ray"), workers=1, engine=RAY)
    assert report.complete and len(report.processed) == 3
    assert output_files(tmp_path / "ray") == output_files(tmp_path / "local")


@pytest.mark.slow
def test_a_killed_driver_resumes_from_the_completion_records(ray_cluster, align_inputs, tmp_path):
    """`csd-pipeline align --engine ray --ray-address ...` in its own process, SIGKILLed once a shard is
    complete; the same run again (here, in this process) completes it with the local bytes."""
    corpus, (tables,), local = align_inputs
    out = tmp_path / "out"
    command = [sys.executable, "-m", "cli.main", "align", "--corpus", str(corpus), "--split-on-blank-lines",
               "--student-tokenizer", "llama-bpe", "--teacher-tokenizer", "qwen2", "--output", str(out),
               "--tables", *tables, "--shard-mb", str(6_000 / (1 << 20)), "--quiet",
               "--engine", "ray", "--ray-address", ray_cluster]
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        while driver.poll() is None and not list((out / "done").glob("*.done") if (out / "done").is_dir() else []):
            time.sleep(0.01)
    finally:
        driver.kill()
    stderr = driver.communicate()[1].decode()
    assert driver.returncode == -signal.SIGKILL, stderr
    done = len(list((out / "done").glob("*.done")))
    assert 1 <= done < 6 and not (out / "manifest.json").exists()

    from csd_pipeline.align.stage import run_align

    messages = []
    report = run_align(align_config(corpus, out, [tables], shard_bytes=6_000), workers=2, engine=RAY,
                       log=messages.append)
    assert report.complete and len(report.skipped) >= done
    assert any("already complete, resuming" in m for m in messages)
    assert output_files(out) == output_files(local)


def test_engine_options_are_refused_in_one_line(tmp_path, run_cli):
    """Before anything is loaded: a cluster where nothing listens, ranks with Ray, Ray flags without it."""
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "docs.txt").write_text("Some text.\n")
    base = ["align", "--corpus", str(tmp_path / "docs.txt"), "--student-tokenizer", "llama-bpe",
            "--teacher-tokenizer", "qwen2", "--output", str(tmp_path / "out")]
    cases = [
        (["--engine", "ray", "--ray-address", f"127.0.0.1:{port}"], f"Ray cluster at 127.0.0.1:{port} cannot be reached"),
        (["--engine", "ray", "--ray-address", "head-node"], "is not host:port"),
        (["--engine", "ray", "--world-size", "2", "--rank", "0"], "drop --rank/--world-size"),
        (["--ray-address", "127.0.0.1:6379"], "--ray-address applies to --engine ray only"),
        (["--num-gpus-per-worker", "1"], "--num-gpus-per-worker applies to --engine ray only"),
    ]
    for extra, fragment in cases:
        code, out, err = run_cli(base + extra)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_served_teacher_on_ray_writes_the_local_bytes_to_s3(ray_cluster, one_thread, tiny_teacher, tmp_path,
                                                             tmp_path_factory, tokenizer_path, tables_for, s3_server,
                                                             bucket, monkeypatch):
    """teacher-logits --teacher-server with 2 Ray actors that hold no model, only an HTTP client: into S3 it writes
    the bytes of the local engine's folder against the same server, and every row is asked of the server once per
    run (an HTTP stand-in answering from the tiny teacher: tests/teacher/served_http.py)."""
    import json

    from csd_pipeline.runtime import storage
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from tests.s3_cases import SECRET
    from tests.teacher.served_http import serving

    monkeypatch.setenv(storage.OPTIONS_ENV, json.dumps({"endpoint_url": s3_server.endpoint, "key": "testing",
                                                        "secret": SECRET}))
    aligned = _aligned_for_teacher(tmp_path_factory, tokenizer_path, tables_for)
    rows = json.loads((aligned / "manifest.json").read_text())["totals"]["rows"]
    with serving(tiny_teacher) as (url, counter):
        def run(output, **engine):
            config = TeacherLogitsConfig(aligned=str(aligned), output=str(output), teacher_server=url,
                                         teacher_model="tiny", top_k=8, server_concurrency=2)
            before = counter["completions"]
            report = run_teacher_logits(config, **engine)
            assert report.complete and counter["completions"] - before == rows
            return report

        run(tmp_path / "local")
        report = run(f"{bucket}/served", workers=2, engine=RAY)
    local = output_files(tmp_path / "local")
    written = s3_server.objects(f"{bucket}/served")
    committed = {name: data for name, data in written.items() if name.endswith(".parquet") or name.startswith("done/")}
    assert committed == {name: data for name, data in local.items() if name in committed}
    assert len(committed) == 2 * len(report.processed) >= 6 and "manifest.json" in written
