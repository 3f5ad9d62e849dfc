"""The fixture cache: real tokenizers that reproduce llama.cpp's vectors, the SmolLM2 teacher, the manifest.

The vectors were produced by the original Hugging Face tokenizers (llama.cpp's
convert_hf_to_gguf_update.py, `add_special_tokens=False`), so they are an independent reference
for the converted `tokenizer.json` files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from csd_pipeline.fixtures import build as fixtures
from csd_pipeline.fixtures import names
from csd_pipeline.errors import CsdError

VECTOR_NAMES = ("llama-bpe", "qwen2", "gpt-2", "llama-spm")
EXPECTED_SIZES = {"llama-bpe": 128_256, "qwen2": 151_936, "gpt-2": 50_257, "llama-spm": 32_000, "smollm2": 49_152}
ADDS_BOS = {"llama-bpe": True, "llama-spm": True, "qwen2": False, "gpt-2": False, "smollm2": False}
REPO = Path(__file__).resolve().parents[1]


def _vectors(fixtures_dir: Path, name: str) -> list[tuple[str, list[int]]]:
    # Parsed here, independently of csd_pipeline.fixtures.gguf_tokenizer.read_vectors.
    texts = (fixtures_dir / "vectors" / f"{name}.inp").read_bytes().decode("utf-8").split("\n__ggml_vocab_test__\n")
    lines = (fixtures_dir / "vectors" / f"{name}.out").read_bytes().decode("utf-8").splitlines()
    assert texts[-1] == ""
    assert len(texts) - 1 == len(lines)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts[:-1], lines, strict=True)]


def _tokenizer(tokenizer_path, name):
    return _load_tokenizer(str(tokenizer_path(name) / "tokenizer.json"))


@cache
def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_tokenizer_reproduces_every_vector(fixtures_dir, tokenizer_path, name):
    vectors = _vectors(fixtures_dir, name)
    assert len(vectors) == 46
    tokenizer = _tokenizer(tokenizer_path, name)
    normalize_nfc = name == "qwen2"   # Qwen 2's tokenizer normalizes to NFC, so decoding gives NFC text
    for text, expected in vectors:
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, text
        decoded = tokenizer.decode(expected, skip_special_tokens=False)
        assert decoded == (unicodedata.normalize("NFC", text) if normalize_nfc else text), text


@pytest.mark.parametrize("name", VECTOR_NAMES)
def test_transformers_loads_the_folder_and_agrees(fixtures_dir, tokenizer_path, name):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path(name)))
    for text, expected in _vectors(fixtures_dir, name):
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text
    with_specials = tokenizer.encode("Hello world", add_special_tokens=True)
    assert (with_specials[0] == tokenizer.bos_token_id) is ADDS_BOS[name]


@pytest.mark.parametrize("name", names.FIXTURE_TOKENIZERS)
def test_vocab_size_and_every_id_present(tokenizer_path, name):
    tokenizer = _tokenizer(tokenizer_path, name)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == EXPECTED_SIZES[name]
    content = json.loads((tokenizer_path(name) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = content["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(EXPECTED_SIZES[name]))
    for added in content["added_tokens"]:
        assert vocab[added["content"]] == added["id"]   # tokenizers would renumber it otherwise


@pytest.mark.parametrize("name", names.FIXTURE_TOKENIZERS)
def test_special_tokens_and_config(tokenizer_path, name):
    folder = tokenizer_path(name)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    content = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    specials = {t["content"] for t in content["added_tokens"] if t["special"]}
    assert config["add_bos_token"] is ADDS_BOS[name]
    assert config["eos_token"] in specials
    assert config["model_max_length"] > 0
    assert ("chat_template" in config) is (name in ("qwen2", "smollm2"))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))   # not the cached one: it is changed below
    eos_id = tokenizer.token_to_id(config["eos_token"])
    # Special tokens are never taken from text when special-token parsing is off.
    tokenizer.encode_special_tokens = True
    assert eos_id not in tokenizer.encode(f"a {config['eos_token']} b", add_special_tokens=False).ids
    # No BOS unless asked for.
    assert tokenizer.encode("Hello", add_special_tokens=False).ids[0] != tokenizer.token_to_id(config.get("bos_token", ""))


def test_qwen_placeholder_ids_are_special(tokenizer_path):
    content = json.loads((tokenizer_path("qwen2") / "tokenizer.json").read_text(encoding="utf-8"))
    placeholders = [t for t in content["added_tokens"] if t["content"].startswith("[PAD")]
    assert len(placeholders) == 151_936 - 151_646
    assert all(t["special"] for t in placeholders)


def test_smollm2_splits_digits_one_by_one(tokenizer_path):
    tokenizer = _tokenizer(tokenizer_path, "smollm2")
    assert tokenizer.encode("12345", add_special_tokens=False).tokens == list("12345")
    tokens = tokenizer.encode("Tokyo, September, 1918.", add_special_tokens=False).tokens
    assert tokens[-5:] == ["1", "9", "1", "8", "."]


def test_wrong_tokenizer_is_refused(fixtures_dir, tmp_path):
    """A vocabulary whose vectors are not reproduced is refused with one sentence naming it."""
    (tmp_path / "vectors").mkdir()
    inp, out = names.vectors_path("llama-spm")
    shutil.copyfile(inp, tmp_path / "vectors" / "llama-spm.inp")
    lines = out.read_text(encoding="utf-8").splitlines()
    lines[11] = lines[11] + " 0"   # "Hello world": expect one id more than the tokenizer gives
    (tmp_path / "vectors" / "llama-spm.out").write_text("\n".join(lines) + "\n", encoding="utf-8")
    gguf_file = fixtures_dir / "gguf" / "ggml-vocab-llama-spm.gguf"
    with pytest.raises(CsdError) as err:
        fixtures.convert_vocabulary("llama-spm", gguf_file, tmp_path, log=lambda line: None)
    message = str(err.value)
    assert "llama-spm" in message and "45/46" in message and "'Hello world'" in message
    assert "\n" not in message


def test_missing_ignore_merges_is_caught(fixtures_dir, tokenizer_path, tmp_path):
    """The vectors are strict enough to catch transformers' known Llama 3 conversion slip."""
    from csd_pipeline.fixtures.gguf_tokenizer import check_vectors, read_vectors

    content = json.loads((tokenizer_path("llama-bpe") / "tokenizer.json").read_text(encoding="utf-8"))
    content["model"]["ignore_merges"] = False
    flawed = tmp_path / "tokenizer.json"
    flawed.write_text(json.dumps(content), encoding="utf-8")
    report = check_vectors(flawed, read_vectors(*names.vectors_path("llama-bpe")))
    assert not report.ok and report.encode_passed == 45 and report.first_failure is not None


def test_sha256_mismatch_is_refused(tmp_path):
    path = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    path.write_bytes(b"not the pinned sdist")
    with pytest.raises(CsdError) as err:
        fixtures.verify_sha256(path, fixtures.PACKAGES[0].sha256)
    message = str(err.value)
    assert str(path) in message and fixtures.PACKAGES[0].sha256 in message and "\n" not in message
    fixtures.verify_sha256(path, fixtures.sha256_file(path))   # the right hash passes


def test_manifest_is_complete(fixtures_dir, fixtures_manifest):
    manifest = fixtures_manifest
    assert [(p["name"], p["version"], p["sha256"]) for p in manifest["packages"]] == [
        (p.name, p.version, p.sha256) for p in fixtures.PACKAGES
    ]
    for name in names.FIXTURE_TOKENIZERS:
        record = manifest["tokenizers"][name]
        assert record["vocab_size"] == EXPECTED_SIZES[name]
        if name in VECTOR_NAMES:
            assert record["vectors"] == "46/46" and record["vectors_decode"] == "46/46"
    model = manifest["models"]["smollm2-135m-instruct"]
    assert all(check["ok"] for check in model["checks"].values())
    assert model["checks"]["english_mean_loss_nats"]["value"] < 4.0
    assert manifest["templates"] >= 60
    # `test-cache/` holds tables the test suite builds once and reuses; it is not a fixture.
    on_disk = {p.relative_to(fixtures_dir).as_posix() for p in fixtures_dir.rglob("*")
               if p.is_file() and not p.relative_to(fixtures_dir).as_posix().startswith("test-cache/")}
    assert on_disk == set(manifest["files"]) | {fixtures.MANIFEST_NAME}
    for relative, entry in manifest["files"].items():
        if relative.startswith(("tokenizers/", "vectors/")):
            assert fixtures.sha256_file(fixtures_dir / relative) == entry["sha256"], relative


def test_rerun_does_nothing(fixtures_dir):
    before = (fixtures_dir / fixtures.MANIFEST_NAME).stat().st_mtime_ns
    manifest = fixtures.ensure_fixtures(verbose=False)
    assert manifest["format_version"] == fixtures.FORMAT_VERSION
    assert (fixtures_dir / fixtures.MANIFEST_NAME).stat().st_mtime_ns == before


def test_paths_and_resolvers(fixtures_dir, tmp_path, monkeypatch):
    assert names.resolve_tokenizer_arg("qwen2") == str(fixtures_dir / "tokenizers" / "qwen2")
    assert names.resolve_model_arg("smollm2-135m-instruct") == str(fixtures_dir / "models" / "smollm2-135m-instruct")
    assert names.resolve_tokenizer_arg("some/other/tokenizer.json") == "some/other/tokenizer.json"
    assert names.template_path("Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2").mkdir()
    assert names.resolve_tokenizer_arg("qwen2") == "qwen2"   # a local path wins over the fixture name
    with pytest.raises(CsdError, match="unknown fixture tokenizer"):
        names.tokenizer_path("llama-7")


def test_missing_fixtures_say_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CSD_FIXTURES_DIR", str(tmp_path / "empty"))
    for call, arg in ((names.tokenizer_path, "gpt-2"), (names.model_path, "smollm2-135m-instruct"),
                      (names.template_path, "x.jinja"), (names.resolve_tokenizer_arg, "gpt-2")):
        with pytest.raises(CsdError, match="run `make fixtures`"):
            call(arg)


def test_cli_reports_a_changed_file_in_one_line(fixtures_manifest, tmp_path):
    """`--verify` on a cache whose file no longer matches its hash: one line on stderr, exit 2."""
    root = tmp_path / "fixtures"
    (root / "vectors").mkdir(parents=True)
    changed = root / "vectors" / "gpt-2.inp"
    changed.write_bytes(b"edited")
    manifest = dict(fixtures_manifest, files={"vectors/gpt-2.inp": {"sha256": "0" * 64, "size": 6}})
    (root / fixtures.MANIFEST_NAME).write_text(json.dumps(manifest), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "fixtures", "--verify", "--quiet"],
        capture_output=True, text=True, cwd=REPO, env={**_env(), "CSD_FIXTURES_DIR": str(root)},
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "vectors/gpt-2.inp" in result.stderr
    assert "Traceback" not in result.stderr


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "CSD_FIXTURES_DIR"}


@pytest.mark.slow
def test_teacher_weights_match_the_gguf(fixtures_dir, model_path):
    """Dequantize a few GGUF tensors independently (gguf.quants) and compare with model.safetensors."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(fixtures_dir / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    config = json.loads((model_path("smollm2-135m-instruct") / "config.json").read_text(encoding="utf-8"))

    def unpermute(weight, heads):
        # llama.cpp stores Q/K rotary halves interleaved; this is its permute() applied to HF weights.
        rows = weight.shape[0]
        return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)

    pairs = {
        "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", None),
        "blk.7.attn_v.weight": ("model.layers.7.self_attn.v_proj.weight", None),
        "blk.5.attn_q.weight": ("model.layers.5.self_attn.q_proj.weight", config["num_attention_heads"]),
        "blk.5.attn_k.weight": ("model.layers.5.self_attn.k_proj.weight", config["num_key_value_heads"]),
        "output_norm.weight": ("model.norm.weight", None),
    }
    with safe_open(str(model_path("smollm2-135m-instruct") / "model.safetensors"), "np") as weights:
        for gguf_name, (hf_name, heads) in pairs.items():
            expected = dequantize(tensors[gguf_name].data, tensors[gguf_name].tensor_type)
            actual = weights.get_tensor(hf_name)
            if heads is not None:
                actual = unpermute(actual, heads)
            np.testing.assert_array_equal(actual, expected.reshape(actual.shape), err_msg=gguf_name)


@pytest.mark.slow
def test_teacher_loss_on_real_text(model_path, fixtures_manifest):
    """transformers' own loss (labels) on the English check paragraph, after one context token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    text = (REPO / "csd_pipeline" / "fixtures" / "data" / "fixture-check-english.txt").read_text(encoding="utf-8")
    ids = [tokenizer.convert_tokens_to_ids("<|endoftext|>"), *tokenizer.encode(text, add_special_tokens=False)]
    inputs = torch.tensor([ids])
    labels = inputs.clone()
    labels[0, 0] = -100
    with torch.inference_mode():
        loss = float(model(inputs, labels=labels).loss)
    assert loss < 4.0
    recorded = fixtures_manifest["models"]["smollm2-135m-instruct"]["checks"]["english_mean_loss_nats"]["value"]
    assert abs(loss - recorded) < 1e-3
