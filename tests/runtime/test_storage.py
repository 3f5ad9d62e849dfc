"""Object storage (runtime/storage.py) against a real S3 server (moto, a process on 127.0.0.1).

The fast tier keeps one S3 round trip: the shared executor writing a stage to `s3://` commits
without a rename (the whole object, then its record, then the manifest), skips an object that has
no record on a re-run, and writes the bytes a local run writes. The stages end to end, kills and
errors are in tests/runtime/test_storage_stages.py (slow).
"""

from __future__ import annotations

import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import storage
from csd_pipeline.runtime.executor import run_stage
from csd_pipeline.runtime.run_record import stage_status
from tests.runtime.test_executor import ToyStage
from tests.s3_cases import SECRET


def local_tree(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_stage_commits_to_s3_as_a_local_run_does(tmp_path, s3_server, bucket):
    url = f"{bucket}/toy"
    run_stage(ToyStage(tmp_path / "local"))
    report = run_stage(ToyStage(storage.location(url)))
    assert report.complete
    local, remote = local_tree(tmp_path / "local"), s3_server.objects(url)
    assert remote == local  # every object, shards, records, stats and manifest, byte for byte
    assert not any(name.endswith(".tmp") for name in remote)  # nothing is renamed on an object store

    # An object without its completion record does not exist for a re-run: it is written again.
    client, name = s3_server.client(), bucket[len("s3://"):]
    client.delete_object(Bucket=name, Key="toy/done/part-00000-00002.done")
    client.delete_object(Bucket=name, Key="toy/manifest.json")
    client.put_object(Bucket=name, Key="toy/part-00000-00002.txt", Body=b"half an upload")
    status = stage_status(url)
    assert status["missing"] == ["part-00000-00002"] and not status["complete"]
    again = run_stage(ToyStage(storage.location(url)))
    assert again.processed == ["part-00000-00002"] and again.complete
    assert s3_server.objects(url) == local
    assert all(SECRET.encode() not in data for data in s3_server.objects(bucket).values())


def test_a_stage_on_s3_removes_what_a_killed_writer_of_this_host_was_staging(tmp_path, bucket, monkeypatch):
    """A writer killed while staging any file for an object store (here a table copy, in another folder's
    staging directory than the shards') leaves a local `<name>.<host>.<pid>.tmp`; the next stage run on an
    object store removes it, and leaves a live writer's alone. The soak with Ray and S3 found one left."""
    import socket
    import subprocess
    import sys

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    table = storage.location(f"{bucket}/other/tables/teacher_to_student.safetensors")
    killed = storage.staging_path(table).with_name(f"{table.name}.{host}.{int(dead.stdout)}.tmp")
    killed.write_bytes(b"half a table")
    live = storage.staging_path(table)  # this process's own name: a writer still at work
    live.write_bytes(b"being written")
    assert run_stage(ToyStage(storage.location(f"{bucket}/toy"))).complete
    assert not killed.exists() and live.read_bytes() == b"being written"


def test_an_object_is_downloaded_once_per_version_whichever_process_reads_it(tmp_path, s3_server, bucket,
                                                                             monkeypatch):
    """`local_file` keeps one copy per version of an object (URL, size, ETag), shared by processes: a process
    that reads a table again finds it; a rewritten object is a new copy. Copies named by process id filled a
    CI machine's disk (2.1 GB of one table, once per test process)."""
    import subprocess
    import sys

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    client, name = s3_server.client(), bucket[len("s3://"):]
    client.put_object(Bucket=name, Key="tables/t.safetensors", Body=b"first version")
    url = f"{bucket}/tables/t.safetensors"
    first = storage.local_file(url)
    assert first.read_bytes() == b"first version" and storage.local_file(url) == first
    other = subprocess.run([sys.executable, "-c", "import sys; from csd_pipeline.runtime import storage; "
                            "print(storage.local_file(sys.argv[1]))", url], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == str(first)
    client.put_object(Bucket=name, Key="tables/t.safetensors", Body=b"second, longer version")
    storage.location(url).fs.invalidate_cache()
    second = storage.local_file(url)
    assert second != first and second.read_bytes() == b"second, longer version"
    assert sorted(p.name for p in (tmp_path / "cache" / "files").iterdir()) == sorted([first.name, second.name])


def test_a_local_path_stays_a_path_and_bad_options_are_one_line(tmp_path):
    from pathlib import Path

    assert type(storage.location(str(tmp_path))) is type(Path(tmp_path))
    assert storage.location(f"file://{tmp_path}") == tmp_path
    assert storage.redact("s3://KEY:SECRET@bucket/x?sig=1") == "s3://bucket/x"
    with pytest.raises(CsdError, match="--storage-options is not a JSON object"):
        storage.configure("[1, 2]")


def test_a_model_or_tokenizer_url_is_refused_in_one_line():
    from csd_pipeline.runtime.model_loading import resolve_model_source
    from csd_pipeline.vocab.tokenizer_files import open_tokenizer

    for load, what in ((resolve_model_source, "model"), (open_tokenizer, "tokenizer")):
        with pytest.raises(CsdError) as refused:
            load("s3://KEY:SECRET@models/teacher")
        message = str(refused.value)
        assert message.startswith(f"{what} s3://models/teacher:") and "copy it to a local disk first" in message
        assert "SECRET" not in message and "\n" not in message
