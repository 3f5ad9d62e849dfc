"""Every reader of what a user hands the tools fuzzed (issue 35, item 2): sub-token tables (safetensors), a
checkpoint's complete.json, tokenizer files, chat templates and corpus records. The harness and its rules:
tests/reliability/fuzz_cases.py.

A tokenizer, chat template or corpus that reads as other values is another input, not a damaged one: its
sha256 differs, and the stages record it (tokenizer fingerprint, template sha256, corpus size and mtime), so
outputs made from it are never mistaken for those of the original. For those readers the examples check
that every read ends in a refusal or a result, in bounded time and memory, and they count the results."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from csd_pipeline.align.templates import TemplateRenderError
from tests.reliability import fuzz_cases as fc

REASONS = {  # the first that matches names the refusal in the counts
    "not readable JSON or metadata": r"not readable JSON|unreadable JSON|unreadable or truncated|not a readable|"
                                     r"no chat_template|is unreadable \(|not valid JSON",
    "checksum or sha256 differs": r"checksum|sha256",
    "malformed (wrong type, missing field)": r"malformed|not a csd-pipeline|format version|neither a string|"
                                             r"no template named|not a JSON object|not a tokenizer.json",
    "does not compile / load": r"does not compile|cannot load|cannot read",
    "truncated or damaged compressed file": r"truncated|damaged",
}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "Seven."}]


# ---------------------------------------------------------------------------------------------
# Sub-token tables (safetensors)


def table_values(table):
    return (table.counts(), table.source.token_bytes, table.destination.token_bytes, table.source.roles,
            table.destination.roles, table.source.fingerprint, table.destination.fingerprint,
            table.source.flags.tolist(), table.destination.flags.tolist(), table.source.dummy_prefix,
            table.destination.adds_bos, table.source.family, table.destination.name,
            [np.asarray(a).tolist() for a in (table.prefix_source, table.prefix_destination, table.prefix_length)])


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_table(tables_for, tmp_path, settings):
    from csd_pipeline.vocab.tables import load_table

    path = tmp_path / "student_to_teacher.safetensors"
    load_table(tables_for("llama-spm", "smollm2")[0]).save(path)  # written by this version
    data = path.read_bytes()
    expected = table_values(load_table(path))
    outcomes = fc.Outcomes("sub-token table (safetensors, load_table)", REASONS)

    def example(kind, mutated):
        path.write_bytes(mutated)
        outcomes.check(lambda: load_table(path), (str(path),), expected, table_values, kind)

    fc.run(settings, outcomes, data, fc.byte_mutations, example)


# ---------------------------------------------------------------------------------------------
# Checkpoint complete.json


@pytest.fixture(scope="module")
def checkpoint_folder(tmp_path_factory):
    """A real DCP checkpoint folder of a small state, with the complete.json csd-train writes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer import checkpoint, checkpoint_guard

    folder = tmp_path_factory.mktemp("checkpoint") / "step-1"
    dcp.save({"model": {"weight": torch.arange(6.0).reshape(2, 3)}, "optim": {"step": torch.tensor(1.0)}},
             checkpoint_id=str(folder))
    (folder / checkpoint.COMPLETE_FILE).write_text(json.dumps({
        "version": checkpoint.CHECKPOINT_VERSION, "step": 1, "world": 1,
        checkpoint_guard.HASH_KEY: checkpoint_guard.metadata_sha256(folder)}, indent=2))
    return folder


def checkpoint_values(metadata):
    return sorted((key, repr(value)) for key, value in metadata.state_dict_metadata.items())


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_complete_json(checkpoint_folder, tmp_path, settings):
    from trainer import checkpoint, checkpoint_guard

    folder = tmp_path / "step-1"
    shutil.copytree(checkpoint_folder, folder)
    path = folder / checkpoint.COMPLETE_FILE
    data = path.read_bytes()

    def read():
        return checkpoint_guard.read_checked_metadata(folder, checkpoint.read_complete(folder))

    expected = checkpoint_values(read())
    outcomes = fc.Outcomes("checkpoint complete.json (read_complete, read_checked_metadata)", REASONS)

    def example(kind, mutated):
        path.write_bytes(mutated)
        outcomes.check(read, (str(folder),), expected, checkpoint_values, kind)

    fc.run(settings, outcomes, data, fc.json_file_mutations, example)


# ---------------------------------------------------------------------------------------------
# Tokenizer files (tokenizer.json, tokenizer_config.json)


def tokenizer_values(bundle):
    return (bundle.vocab.fingerprint, bundle.vocab.token_bytes, bundle.vocab.roles, bundle.vocab.family,
            [e.ids.tolist() for e in bundle.encode_spans(["The Devil's Dictionary, 1911: caf\u00e9 \u4e2d"])])


@pytest.mark.parametrize("settings", fc.COSTLY_SPEEDS)
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_fuzz_tokenizer(tokenizer_path, tmp_path, monkeypatch, settings, name):
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    monkeypatch.setenv("CSD_VOCAB_CACHE", "off")
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_path("llama-spm"), folder)
    path = folder / name
    data = path.read_bytes()
    expected = tokenizer_values(load_tokenizer(str(folder)))
    outcomes = fc.Outcomes(f"tokenizer file ({name}, load_tokenizer)", REASONS)

    def example(kind, mutated):
        path.write_bytes(mutated)
        outcomes.check(lambda: load_tokenizer(str(folder)), (str(folder), name), expected, tokenizer_values, kind,
                       other_ok=lambda bundle: "read: another tokenizer (another fingerprint)")

    strategy = fc.byte_mutations if name == "tokenizer.json" else fc.json_file_mutations
    fc.run(settings, outcomes, data, strategy, example)


# ---------------------------------------------------------------------------------------------
# Chat templates (.jinja, tokenizer_config.json)


@pytest.mark.parametrize("settings", fc.SPEEDS)
@pytest.mark.parametrize("kind_of_file", ["jinja", "json"])
def test_fuzz_template(tokenizer_path, template_path, tmp_path, settings, kind_of_file):
    from csd_pipeline.align.templates import load_chat_template

    if kind_of_file == "jinja":
        source = template_path("Qwen-Qwen2.5-7B-Instruct.jinja")
        path = tmp_path / "template.jinja"
    else:
        source = Path(tokenizer_path("smollm2")) / "tokenizer_config.json"
        path = tmp_path / "tokenizer_config.json"
    shutil.copy(source, path)
    data = path.read_bytes()

    def read():
        template = load_chat_template(None, str(path), "student")
        try:
            return template.render(CONVERSATION, None, {})
        except TemplateRenderError:
            return "refused when rendering"  # align counts the record as refused by the template

    expected = read()
    outcomes = fc.Outcomes(f"chat template (.{kind_of_file}, load_chat_template + render)", REASONS)

    def example(kind, mutated):
        path.write_bytes(mutated)
        outcomes.check(read, (str(path),), expected, mutation=kind,
                       other_ok=lambda text: ("refused: the template raises when rendering"
                                              if text == "refused when rendering" else
                                              "read: another template (another sha256)"))

    strategy = fc.byte_mutations if kind_of_file == "jinja" else fc.json_file_mutations
    fc.run(settings, outcomes, data, strategy, example)


# ---------------------------------------------------------------------------------------------
# Corpus records (.jsonl, .json, .jsonl.gz)


def corpus_bytes(suffix: str) -> bytes:
    text = (Path(__file__).parents[1] / "data" / "devil-slice.txt").read_text(encoding="utf-8")[:3000]
    records = [{"text": part, "id": i} for i, part in enumerate(text.split("\n\n"))]
    if suffix == ".json":
        return json.dumps(records, indent=1).encode("utf-8")
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    return gzip.compress(lines, mtime=0) if suffix == ".jsonl.gz" else lines


def read_corpus(path: Path):
    from csd_pipeline.align.corpus import CorpusFile, ReadOptions, discover, plan_shards, read_segment

    options = ReadOptions(text_field="text")
    files = discover([str(path)])
    documents = []
    for shard in plan_shards(files, options, 500):
        for segment in shard:
            file = CorpusFile.from_spec({**files[segment["file"]].spec(), **segment})
            documents += [(d.source, d.record_index, d.text, d.reason) for d in read_segment(file, segment, options)]
    return documents


@pytest.mark.parametrize("settings", fc.SPEEDS)
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz"])
def test_fuzz_corpus(tmp_path, settings, suffix):
    path = tmp_path / f"corpus{suffix}"
    data = corpus_bytes(suffix)
    path.write_bytes(data)
    expected = read_corpus(path)
    outcomes = fc.Outcomes(f"corpus records ({suffix}: discover, plan_shards, read_segment)", REASONS)
    compressed = suffix.endswith(".gz")

    def other(documents):
        if compressed:  # a compressed file has a checksum: damage is refused, never read as other text; a file
            # cut to nothing holds no records (tests/align/test_corpus_formats.py: an empty file is an empty corpus)
            return "read: no records (the file cut to 0 bytes)" if not path.stat().st_size else None
        rejected = sum(1 for d in documents if d[3])
        return f"read: other records ({'some rejected by reason' if rejected else 'all read'})"

    def example(kind, mutated):
        path.write_bytes(mutated)
        outcomes.check(lambda: read_corpus(path), (str(path),), expected, mutation=kind, other_ok=other)

    fc.run(settings, outcomes, data, fc.byte_mutations if suffix != ".json" else fc.json_file_mutations, example)
