"""The cache of derived vocabularies (`vocab.vocab_cache`): a cached vocabulary is the derived one, field
for field; a changed tokenizer file or config is never answered from a stale entry; a corrupted,
truncated or foreign entry is never trusted; concurrent writers leave one whole entry."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

from csd_pipeline.fixtures.names import FIXTURE_TOKENIZERS, tokenizer_path
from csd_pipeline.vocab import vocab_cache
from csd_pipeline.vocab.families import FLAG_UNTRUSTED
from csd_pipeline.vocab.vocabulary import load_tokenizer

FIELDS = ("name", "family", "roles", "dummy_prefix", "fingerprint", "adds_bos", "needs_round_trip")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "vocab-cache"
    monkeypatch.setenv(vocab_cache.CACHE_ENV, str(folder))
    return folder


def derived(arg, monkeypatch):
    """The vocabulary of `arg` derived from the tokenizer.json (cache off)."""
    with monkeypatch.context() as m:
        m.setenv(vocab_cache.CACHE_ENV, "off")
        return load_tokenizer(str(arg)).vocab


def assert_same(cached, reference) -> None:
    assert cached.token_bytes == reference.token_bytes
    assert cached.flags.dtype == reference.flags.dtype == np.uint8
    assert np.array_equal(cached.flags, reference.flags)
    for name in FIELDS:
        assert getattr(cached, name) == getattr(reference, name), name
    assert cached.spellings() == reference.spellings()


def entries(folder) -> list:
    return sorted(folder.glob("*.safetensors"))


@pytest.mark.parametrize("name", FIXTURE_TOKENIZERS)
def test_cached_vocabulary_is_the_derived_one(name, cache, monkeypatch):
    reference = derived(name, monkeypatch)
    first = load_tokenizer(name).vocab  # derived, then stored
    assert len(entries(cache)) == 1
    again = load_tokenizer(name)  # read back
    assert_same(first, reference)
    assert_same(again.vocab, reference)
    assert again.tokenizer.get_vocab_size() >= again.vocab.size - len(again.vocab.roles)  # the tokenizer still loads


def test_untrusted_added_tokens_are_cached_with_their_flags(tmp_path, cache, monkeypatch):
    """An added token whose text does not round-trip (found by running the tokenizer: `▁` decodes
    to a space) keeps its untrusted flag; one that round-trips stays trusted."""
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_path("llama-spm"), folder)
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    taken = max(spec["model"]["vocab"].values()) + 1
    token = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False}
    spec["added_tokens"] = list(spec.get("added_tokens") or []) + [
        {**token, "id": taken, "content": "\u2581zq"}, {**token, "id": taken + 1, "content": "zqz"}]
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    reference = derived(folder, monkeypatch)
    assert (reference.flags[taken], reference.flags[taken + 1]) == (FLAG_UNTRUSTED, 0)
    load_tokenizer(str(folder))
    cached = load_tokenizer(str(folder)).vocab
    assert_same(cached, reference)
    assert cached.needs_round_trip


def test_a_changed_tokenizer_file_is_never_answered_from_the_old_entry(tmp_path, cache, monkeypatch):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_path("smollm2"), folder)
    before = load_tokenizer(str(folder)).vocab
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    piece, i = next((p, i) for p, i in vocab.items() if len(p) > 3 and p.isalpha())
    del vocab[piece]
    vocab[piece[::-1] + "Q"] = i  # one token spelled differently, same size
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    after = load_tokenizer(str(folder)).vocab
    assert after.token_bytes[i] != before.token_bytes[i]
    assert_same(after, derived(folder, monkeypatch))
    assert len(entries(cache)) == 2


def test_a_changed_config_is_a_new_entry(tmp_path, cache, monkeypatch):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_path("smollm2"), folder)
    before = load_tokenizer(str(folder)).vocab
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["add_bos_token"] = not before.adds_bos
    config_file.write_text(json.dumps(config), encoding="utf-8")
    after = load_tokenizer(str(folder)).vocab
    assert after.adds_bos != before.adds_bos
    assert_same(after, derived(folder, monkeypatch))


def test_corrupted_truncated_or_foreign_entries_are_never_trusted(cache, monkeypatch):
    reference = derived("gpt-2", monkeypatch)
    load_tokenizer("gpt-2")
    (entry,) = entries(cache)
    good = entry.read_bytes()
    header = int.from_bytes(good[:8], "little") + 8
    flipped = bytearray(good)
    flipped[header + (len(good) - header) // 2] ^= 0x20  # one byte of the token bytes
    forged = load_tokenizer("llama-spm")  # a whole, valid entry of another tokenizer, under gpt-2's key
    other = next(p for p in entries(cache) if p != entry).read_bytes()
    for damaged in (bytes(flipped), good[: len(good) // 2], good[:5], b"", other):
        entry.write_bytes(damaged)
        assert_same(load_tokenizer("gpt-2").vocab, reference)
        assert entry.read_bytes() == good  # derived again and rewritten
    assert forged.vocab.size != reference.size


def test_a_forged_checksum_does_not_pass(cache, monkeypatch):
    """An entry whose bytes were changed and whose checksum was recomputed over the wrong header: refused."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    reference = derived("gpt-2", monkeypatch)
    load_tokenizer("gpt-2")
    (entry,) = entries(cache)
    with safe_open(str(entry), framework="numpy") as handle:
        meta = json.loads(handle.metadata()["csd_vocabulary"])
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    tensors["flags"] = tensors["flags"].copy()
    tensors["flags"][100] = 1  # token 100 made special
    save_file(tensors, str(entry), metadata={"csd_vocabulary": json.dumps(meta)})  # the old checksum
    assert_same(load_tokenizer("gpt-2").vocab, reference)


def test_cache_off_writes_nothing(tmp_path, monkeypatch):
    folder = tokenizer_path("gpt-2")
    monkeypatch.setenv(vocab_cache.CACHE_ENV, "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    load_tokenizer(str(folder))
    assert vocab_cache.cache_dir() is None
    assert not any(tmp_path.rglob("*.safetensors"))


def test_an_unwritable_cache_is_simply_not_used(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(vocab_cache.CACHE_ENV, str(blocker / "cache"))
    assert_same(load_tokenizer("gpt-2").vocab, derived("gpt-2", monkeypatch))


def test_concurrent_loads_leave_one_whole_entry(cache, monkeypatch):
    reference = derived("smollm2", monkeypatch)
    results, errors = [], []

    def load():
        try:
            results.append(load_tokenizer("smollm2").vocab)
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for vocab in results + [load_tokenizer("smollm2").vocab]:
        assert_same(vocab, reference)
    assert len(entries(cache)) == 1
    assert not list(cache.glob("*.tmp"))
