"""Sub-token tables against an independent brute force (SPEC §3), on real tokenizer pairs.

The reference derives every token's bytes from tokenizer.json with its own code
(`reference_token_bytes`), then enumerates the sets the table must hold: common spellings,
prefix-support triples (p, a, b) and multi-id spellings, for both directions of each pair.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import numpy as np
import pytest

from csd_pipeline.vocab.tables import build_table, load_table, validate_tables
from tests.vocab.test_vocabulary import bundle, reference_token_bytes

PAIRS = [("llama-bpe", "qwen2"), ("gpt-2", "llama-spm"), ("smollm2", "llama-spm")]


@cache
def reference_sets(name: str):
    """(spelling -> ids) from the independent byte derivation (specials excluded)."""
    classes = defaultdict(list)
    for i, b in enumerate(reference_token_bytes(name)):
        if b:
            classes[b].append(i)
    return dict(classes)


def reference_prefix_triples(src: dict, dst: dict) -> set[tuple[bytes, bytes, bytes]]:
    by_length = defaultdict(set)
    for b in dst:
        by_length[len(b)].add(b)
    triples = set()
    for a in src:
        for length, candidates in by_length.items():
            if length < len(a) and a[-length:] in candidates:
                triples.add((a[: len(a) - length], a, a[-length:]))
    return triples


@cache
def built(source: str, destination: str):
    return build_table(bundle(source), bundle(destination))


def table_triples(table) -> set[tuple[bytes, bytes, bytes]]:
    src, dst = table.source.token_bytes, table.destination.token_bytes
    return {
        (src[a][:n], src[a], dst[b])
        for a, b, n in zip(table.prefix_source.tolist(), table.prefix_destination.tolist(), table.prefix_length.tolist())
    }


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}<->{p[1]}")
def test_sets_equal_brute_force_both_directions(pair, tmp_path):
    for source, destination in (pair, pair[::-1]):
        table = built(source, destination)
        path = tmp_path / f"{source}-{destination}.safetensors"
        table.save(path)
        loaded = load_table(path)
        src_ref, dst_ref = reference_sets(source), reference_sets(destination)

        assert set(loaded.common_spellings()) == src_ref.keys() & dst_ref.keys()
        triples = table_triples(loaded)
        assert len(triples) == loaded.prefix_length.size  # stored entries are distinct
        assert triples == reference_prefix_triples(src_ref, dst_ref)
        assert {b for b, ids in loaded.source.spellings().items() if len(ids) > 1} == {
            b for b, ids in src_ref.items() if len(ids) > 1
        }
        assert {b: list(ids) for b, ids in loaded.destination.spellings().items()} == dst_ref

        counts = loaded.counts()
        assert counts["source_vocab_size"] == bundle(source).vocab.size
        assert counts["destination_vocab_size"] == bundle(destination).vocab.size
        assert counts["common_spellings"] == len(src_ref.keys() & dst_ref.keys())
        assert counts["prefix_entries"] == len(triples)
        assert counts["multi_id_spellings_source"] == sum(len(v) > 1 for v in src_ref.values())
        assert counts["multi_id_spellings_destination"] == sum(len(v) > 1 for v in dst_ref.values())
        assert counts["canonical_chains_in_prefix_entries"] <= counts["canonical_multi_token_chains"]


def test_prefix_support_lookup_answers_the_question():
    """Given emitted teacher bytes p, each entry's b completes exactly one student token a."""
    table = built("gpt-2", "llama-spm")
    mapping = table.prefix_map()
    rng = np.random.default_rng(1)
    keys = list(mapping)
    for k in rng.choice(len(keys), size=200, replace=False).tolist():
        p = keys[k]
        for a, b in table.prefix_support(p):
            assert a == p + b
            assert a in table.source.spellings() and b in table.destination.spellings()
    assert table.prefix_support(b"\xff\xfe no such prefix") == []


def test_validate_accepts_matching_tables_and_rejects_swapped(tmp_path):
    s2t, t2s = built("gpt-2", "llama-spm"), built("llama-spm", "gpt-2")
    report = validate_tables(bundle("gpt-2"), bundle("llama-spm"), s2t, t2s)
    assert set(report) == {"student-to-teacher", "teacher-to-student"}
    from csd_pipeline.errors import CsdError

    with pytest.raises(CsdError, match="other direction"):
        validate_tables(bundle("gpt-2"), bundle("llama-spm"), t2s, s2t)
    with pytest.raises(CsdError, match="fingerprint"):
        validate_tables(bundle("smollm2"), bundle("llama-spm"), s2t, t2s)


def test_chain_encoder_process_matches_in_process_chains_and_reports_errors(tmp_path):
    """The helper process of `tables build-both` gives the chains `encode_spellings` gives, and a
    tokenizer it cannot build comes back as the one-line CsdError, not a hang or a traceback."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.vocab.chain_encoder import ChainEncoderProcess
    from csd_pipeline.vocab.tables import encode_spellings, spelling_texts

    source, destination = bundle("smollm2"), bundle("llama-spm")
    expected = encode_spellings(source, destination)[1]
    with ChainEncoderProcess(tokenizer_path("llama-spm") / "tokenizer.json", "llama-spm") as encoder:
        encoder.send(spelling_texts(source.vocab)[1])
        assert encoder.result() == [(k, list(ids)) for k, ids in expected]
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": {"type": "BPE", "vocab": 3}}', encoding="utf-8")
    with ChainEncoderProcess(broken, "broken") as encoder:
        encoder.send(["a", "b"])
        with pytest.raises(CsdError, match="tokenizer broken: the tokenizers library cannot load it"):
            encoder.result()



def test_a_killed_writers_temporary_table_is_removed_by_the_next_save(tmp_path):
    """The soak found it: `kill -9` during a table's write left `<table>.<host>.<pid>.tmp`, which no run removed.
    The next save of that table removes it; another file's, or a live writer's, stays."""
    import os
    import socket
    import subprocess
    import sys

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    path = tmp_path / "student_to_teacher.safetensors"
    host = socket.gethostname()
    left, other = tmp_path / f"{path.name}.{host}.{dead}.tmp", tmp_path / f"other.safetensors.{host}.{dead}.tmp"
    live = tmp_path / f"{path.name}.{host}.{os.getppid()}.tmp"  # a live process (this one writes its own)
    for stale in (left, other, live):
        stale.write_bytes(b"partial")
    built("gpt-2", "gpt-2").save(path)
    assert path.is_file() and not left.exists() and other.exists() and live.exists()
