"""Loading a causal LM: sources (folder, GGUF, hub name), remote code stays off, fingerprints."""

from __future__ import annotations

import hashlib
import json

import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.model_loading import (
    file_sha256_cached,
    load_causal_lm,
    model_fingerprint,
    resolve_device,
    resolve_dtype,
    resolve_model_source,
)


@pytest.fixture(autouse=True)
def _hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CSD_HASH_CACHE", str(tmp_path / "hash-cache"))


def test_remote_code_is_never_run_without_the_flag(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil-unknown", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
    }))
    (folder / "model.safetensors").write_bytes(b"not really weights")
    with pytest.raises(CsdError, match="--trust-remote-code"):
        load_causal_lm(str(folder), device="cpu")
    assert not marker.exists()


def test_sources_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source(str(gguf)) == (tmp_path, "m.gguf")
    assert resolve_model_source(str(tmp_path)) == (tmp_path, "m.gguf")  # a folder with one GGUF and no config
    with pytest.raises(CsdError, match="no such file or folder"):
        resolve_model_source(str(tmp_path / "missing"))
    other = tmp_path / "x.txt"
    other.write_text("x")
    with pytest.raises(CsdError, match="a file must be a .gguf"):
        resolve_model_source(str(other))
    with pytest.raises(CsdError, match="could not be fetched from the hub"):
        resolve_model_source("some-org/some-model-that-is-not-cached")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CsdError, match="no weight file"):
        model_fingerprint(tmp_path / "empty")


def test_device_and_dtype_policy():
    import torch

    cpu = resolve_device("cpu")
    assert cpu.type == "cpu" and resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    with pytest.raises(CsdError):
        resolve_dtype("int8", cpu)
    with pytest.raises(CsdError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(CsdError, match="no CUDA"):
            resolve_device("cuda")


def test_fingerprint_covers_config_and_weights(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"one")
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"two")
    (folder / "README.md").write_text("not part of the model")
    first = model_fingerprint(folder)
    assert sorted(first["files"]) == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert first["files"]["config.json"] == hashlib.sha256(b'{"a": 1}').hexdigest()
    (folder / "README.md").write_text("changed")
    assert model_fingerprint(folder) == first
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"TWO")  # new size and mtime: re-hashed
    assert model_fingerprint(folder)["sha256"] != first["sha256"]
    assert file_sha256_cached(folder / "config.json") == first["files"]["config.json"]


