"""The selector chain: one order, built from the options or a manifest, and the one check on exact values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.store.selectors import SELECTORS, chain_from_config

OPTIONS = {"top_p": 0.9, "min_p": 0.02, "tail_samples": 4, "keep": "csd-events"}
ORDER = ["top-k", "top-p", "min-p", "tail-samples", "csd-events"]
NOT_EXACT = {"tail_samples": "--tail-samples", "keep": "--keep csd-events"}


def test_selectors_apply_in_one_order_whatever_the_options():
    assert [cls.name for cls in SELECTORS] == ORDER
    for count in range(len(OPTIONS) + 1):
        for chosen in itertools.permutations(OPTIONS, count):
            config = {"top_k": 16, "teacher_index": 0, **{key: OPTIONS[key] for key in chosen}}
            names = chain_from_config(config).names
            assert names == [name for name in ORDER if name in names] and len(names) == count + 1


@pytest.mark.parametrize("option", [None, *OPTIONS])
def test_one_check_refuses_stores_whose_values_are_not_exact(option, tmp_path):
    """`require_exact` (the baselines and --teacher-top-k call it) passes a top-k, top-p and min-p store and refuses
    a store with tail draws or only CSD's event entries, naming the option that made it so; the same from a
    manifest through `TeacherTopkOutput.require_exact`."""
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    config = {"top_k": 16, "top_p": None, "teacher_index": 0, **({option: OPTIONS[option]} if option else {})}
    output = TeacherTopkOutput(tmp_path, {"config": config, "shards": []})
    if option not in NOT_EXACT:
        output.require_exact("--loss uld", "fix it")
        return
    with pytest.raises(CsdError, match=rf"--loss uld reads .* but {tmp_path} .*{NOT_EXACT[option]}.*; fix it"):
        output.require_exact("--loss uld", "fix it")


def hand_made_rows(count: int, width: int, rng):
    """Hand-made teacher rows (no teacher: the writer takes rows from any source) and their token ids."""
    from csd_pipeline.teacher.row import TeacherTopkRow

    rows, tokens = [], []
    for _ in range(count):
        positions = int(rng.integers(2, 9))
        ids = np.stack([rng.permutation(500)[:width] for _ in range(positions)]).astype(np.int32)
        logprobs = np.sort(-np.abs(rng.normal(5, 2, size=(positions, width))), axis=1)[:, ::-1].astype(np.float32)
        lengths = rng.integers(1, width + 1, size=positions).astype(np.int64)
        observed = -np.abs(rng.normal(4, 1, size=positions)).astype(np.float32)
        observed[-1] = np.nan
        rows.append(TeacherTopkRow(None, ids, logprobs, observed, 0, lengths))
        tokens.append(rng.integers(0, 500, size=positions).astype(np.int64))
    return rows, tokens


def test_the_reader_checks_each_shards_selectors_against_the_manifest(tmp_path):
    """A shard written by the store's writer (rows from any source) records its selectors' metadata; the reader
    reads it back under a manifest that records the same selectors, and refuses it under another one."""
    from csd_pipeline.teacher.store.codec import MAX_ABS_ERROR
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from csd_pipeline.teacher.store.writer import write_store

    config = {"top_k": 6, "top_p": None, "min_p": 0.02, "teacher_index": 0}
    chain = chain_from_config(config)
    rows, tokens = hand_made_rows(7, 6, np.random.default_rng(1))
    row_ids = [f"doc:{i}:0" for i in range(len(rows))]
    stats = write_store(tmp_path / "part.parquet", chain, row_ids, tokens, lambda start, end: rows[start:end], 16)
    assert stats["positions"] == sum(len(t) for t in tokens) and stats["entries"] == sum(int(r.lengths.sum()) for r in rows)
    shards = [{"name": "part", "file": "part.parquet"}]
    shard = TeacherTopkOutput(tmp_path, {"config": config, "shards": shards}).shard(0)
    assert shard.selector_metadata == {b"csd.top_p": b"", b"csd.min_p": b"0.02"}
    for row, back in zip(rows, shard):
        for t in range(len(row.lengths)):
            n = int(row.lengths[t])
            assert back.lengths[t] == n and set(back.ids[t, :n].tolist()) == set(row.ids[t, :n].tolist())
            assert np.abs(np.sort(back.logprobs[t, :n]) - np.sort(row.logprobs[t, :n])).max() <= MAX_ABS_ERROR + 1e-6
    for other in ({**config, "min_p": 0.05}, {**config, "min_p": None}, {**config, "tail_samples": 4}):
        with pytest.raises(CsdError, match=r"records the selectors csd.min_p='0.02'.* but .*manifest.json records"):
            TeacherTopkOutput(tmp_path, {"config": other, "shards": shards}).shard(0)


@pytest.mark.parametrize(("options", "refusal"), [
    ({"top_k": 0}, "--top-k 0 is out of range"),
    ({"top_p": 1.5}, "--top-p 1.5 is out of range"),
    ({"min_p": 0.0}, "--min-p 0.0 is out of range"),
    ({"top_k": 200, "tail_samples": 60}, "--tail-samples 60 is out of range with --top-k 200; pass 0 (none) up to 54"),
    ({"keep": "all"}, "--keep 'all' is not one of top-k, csd-events"),
])
def test_each_selector_checks_its_own_options(options, refusal):
    """The selectors are found in their own modules and each refuses its option out of range, naming the flag;
    `teacher-logits` offers every option a selector owns (the `selector=True` fields) as a flag."""
    from click.testing import CliRunner

    from cli.teacher_logits import teacher_logits
    from csd_pipeline.teacher.config import TeacherLogitsConfig

    assert [cls.__module__.rsplit(".", 1)[1] for cls in SELECTORS] == ["top_k", "top_p", "min_p", "tail_samples",
                                                                         "csd_events"]
    config = TeacherLogitsConfig(aligned="A", teacher="T", output="O", **options)
    with pytest.raises(CsdError, match=refusal.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        config.validate()
    help_text = CliRunner().invoke(teacher_logits, ["--help"]).output
    for name in ("--top-k", "--top-p", "--min-p", "--tail-samples", "--sample-seed", "--keep"):
        assert name in help_text
