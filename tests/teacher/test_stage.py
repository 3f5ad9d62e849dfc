"""The teacher-logits stage, end to end through the real align stage and real tokenizers.

A tiny random-initialised Llama (vocabulary = SmolLM2's 49,152 ids + 64 padded output rows) is
checked against a direct float64 full-softmax computation of each row alone; the real
SmolLM2-135M-Instruct teacher is checked against its own loss on the same text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from csd_pipeline.teacher.store.codec import MAX_ABS_ERROR

DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 49152  # SmolLM2's tokenizer
PADDED = 64  # extra output rows of the tiny teacher, as in models whose embedding is padded
K = 8
# Stored values are within 1/102 nat of the float32 teacher; float32 vs the float64 reference adds < 1e-4.
TOLERANCE = MAX_ABS_ERROR + 1e-4
assert TOLERANCE < 0.01


# ---------------------------------------------------------------------------------------------
# Inputs: one aligned directory (real align stage), a tiny teacher


@pytest.fixture(scope="module", autouse=True)
def _quiet_machine(tmp_path_factory):
    """Model-file hashes cached in a temporary folder; one torch thread (the tiny teacher's matmuls are
    too small to share, and on a busy shared machine two OpenMP threads mostly wait on each other:
    SmolLM2 ran 3x faster on one thread there)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CSD_HASH_CACHE", str(tmp_path_factory.mktemp("hash-cache")))
        yield threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def aligned(tmp_path_factory, tokenizer_path, tables_for) -> Path:
    """Real text aligned (gpt-2 student, SmolLM2 teacher, cached tables): 3 shards, 12 rows of 4 to 126
    teacher tokens."""
    from csd_pipeline.align.stage import AlignConfig, run_align

    out = tmp_path_factory.mktemp("aligned")
    config = AlignConfig(
        corpus=[str(DATA / "kjv-genesis-slice.txt"), str(DATA / "python-docs-generators-slice.txt")],
        student_tokenizer=str(tokenizer_path("gpt-2")), teacher_tokenizers=[str(tokenizer_path("smollm2"))],
        output=str(out), max_student_tokens=128, split_on_blank_lines=True, shard_bytes=1000,
        tables=[tables_for("gpt-2", "smollm2")],
    )
    run_align(config, rank=0, world_size=1, log=None)
    return out


def aligned_rows(directory: Path) -> list[tuple[str, str, np.ndarray]]:
    """(shard file, row_id, teacher ids) of every aligned row, in order."""
    import pyarrow.parquet as pq

    manifest = json.loads((directory / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        table = pq.read_table(directory / shard["file"], columns=["row_id", "teacher0_ids"])
        for row_id, ids in zip(table.column("row_id").to_pylist(), table.column("teacher0_ids").to_pylist()):
            rows.append((shard["file"], row_id, np.asarray(ids, np.int64)))
    return rows


def make_tiny_teacher(folder: Path, tokenizer_dir: Path, *, poison: int | None = None, output_size: int = VOCAB + PADDED,
                      tokenizer: bool = True) -> Path:
    """A random 2-layer Llama with `output_size` outputs, saved as a HF folder with the given tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=output_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # logits spread over several nats
        if output_size > VOCAB:
            model.lm_head.weight[VOCAB:] *= 1.6  # padded rows: big logits, they must still stay out of the top-k
        if poison is not None:
            model.model.embed_tokens.weight[poison] = float("nan")
    model.save_pretrained(str(folder))
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def run_stage(aligned_dir, teacher, output, **options):
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits

    rank = options.pop("rank", 0)
    world_size = options.pop("world_size", 1)
    config = TeacherLogitsConfig(aligned=str(aligned_dir), teacher=str(teacher), output=str(output),
                                 **{"top_k": K, "batch_tokens": 512, **options})
    return run_teacher_logits(config, rank=rank, world_size=world_size, log=None)


@pytest.fixture(scope="module")
def tiny_output(tmp_path_factory, aligned, tiny_teacher) -> Path:
    out = tmp_path_factory.mktemp("teacher-out")
    report = run_stage(aligned, tiny_teacher, out)
    assert report.complete
    return out


def output_bytes(directory: Path) -> dict[str, bytes]:
    """Every shard, marker, stats file and the manifest (what must be identical across runs)."""
    names = [p for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.endswith(".tmp")]
    return {str(p.relative_to(directory)): p.read_bytes() for p in names}


# ---------------------------------------------------------------------------------------------
# Values


def float64_reference(model_dir: Path, ids: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """log-softmax over the model's whole output, float64, this row alone (no batch, no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = _float64_models.get(str(model_dir))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
        _float64_models[str(model_dir)] = model
    with torch.inference_mode():
        logits = model(torch.tensor(ids[None, :])).logits[0].double() / temperature
        return torch.log_softmax(logits, dim=-1).numpy()


_float64_models: dict = {}


def check_row_against_reference(row, ids: np.ndarray, reference: np.ndarray, k: int) -> None:
    """Stored top-k, log-probs and observed log-probs of one row vs the dense float64 reference."""
    positions = len(ids)
    assert row.ids.shape == (positions, k) and row.logprobs.shape == (positions, k)
    assert row.observed_logprob.shape == (positions,)
    assert row.ids.max() < VOCAB  # padded output rows never enter the top-k
    real = reference[:, :VOCAB]
    kth = -np.sort(-real, axis=1)[:, k - 1]
    for t in range(positions):
        stored = row.ids[t].astype(np.int64)
        assert len(set(stored.tolist())) == k
        # Every stored id is a top-k id of the reference (up to float noise at the k-th value) ...
        assert np.all(real[t, stored] >= kth[t] - 1e-4)
        # ... and every clear top-k id of the reference is stored.
        clear = np.flatnonzero(real[t] > kth[t] + 1e-4)
        assert set(clear.tolist()) <= set(stored.tolist())
        assert np.all(np.abs(row.logprobs[t] - real[t, stored]) <= TOLERANCE)
        assert np.all(np.diff(row.logprobs[t]) <= 0)
    observed = reference[np.arange(positions - 1), ids[1:]]
    assert np.all(np.abs(row.observed_logprob[:-1] - observed) <= TOLERANCE)
    assert np.isnan(row.observed_logprob[-1])


def test_tiny_teacher_matches_float64_reference(aligned, tiny_teacher, tiny_output):
    from csd_pipeline import read_teacher_topk

    rows = list(read_teacher_topk(tiny_output))
    expected = aligned_rows(aligned)
    assert [r.row_id for r in rows] == [row_id for _, row_id, _ in expected]  # aligned order
    padded_top, normaliser_gap = 0, 0.0
    for row, (_, _, ids) in zip(rows, expected):
        assert row.ok
        reference = float64_reference(tiny_teacher, ids)
        check_row_against_reference(row, ids, reference, K)
        padded_top += int((reference.argmax(axis=1) >= VOCAB).sum())
        lse_real = np.log(np.exp(reference[:, :VOCAB]).sum(axis=1))  # < 0 when padded rows hold mass
        normaliser_gap = max(normaliser_gap, float(-lse_real.min()))
    # The padded rows matter here: unmasked they would top some positions, and normalising over the
    # tokenizer's ids only would be off by far more than the tolerance.
    assert padded_top > 0 and normaliser_gap > 0.1


def test_rows_are_batched_with_padding_and_match_unbatched(aligned, tiny_teacher):
    """The runner's batched values equal a forward of each row alone (float32, before encoding)."""
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner, plan_batches

    rows = [ids for _, _, ids in aligned_rows(aligned)]
    batches = plan_batches([len(r) for r in rows], 512)
    assert any(len({len(rows[i]) for i in batch}) > 1 for batch in batches)  # padding happens
    loaded = load_causal_lm(str(tiny_teacher), device="cpu")
    batched = TeacherRunner(loaded, top_k=K, vocab_limit=VOCAB, batch_tokens=512).run(rows)
    alone = TeacherRunner(loaded, top_k=K, vocab_limit=VOCAB, batch_tokens=1).run(rows)
    for a, b in zip(batched, alone):
        assert a.ok and b.ok
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(a.observed_logprob, b.observed_logprob, atol=1e-4, rtol=0)
        same = a.ids == b.ids
        # An id may differ only where two entries are tied to float noise.
        assert np.all(same | (np.abs(a.logprobs - b.logprobs) < 1e-4))


def make_tiny_gemma2(folder: Path, tokenizer_dir: Path) -> Path:
    """A random Gemma 2 (final-logit soft-capping, scaled embeddings) with the padded SmolLM2 vocabulary."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(1)
    config = Gemma2Config(vocab_size=VOCAB + PADDED, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=5.0,
                          max_position_embeddings=512, tie_word_embeddings=False)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # logits well beyond the cap, so the cap changes them
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("kind", ["model-forward-fallback", pytest.param("gemma2-softcap-head", marks=pytest.mark.slow)])
def test_runner_logit_paths_match_float64(kind, aligned, tiny_teacher, tokenizer_path, tmp_path, monkeypatch):
    """Both ways to get logits (hidden states + float32 head, or the model's own forward) are exact."""

    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner

    rows = [ids for _, _, ids in aligned_rows(aligned)][:5]
    if kind == "model-forward-fallback":
        folder, expected_path = tiny_teacher, "forward"
        monkeypatch.setattr(TeacherRunner, "_probe_matches", lambda self: False)
    else:
        folder, expected_path = make_tiny_gemma2(tmp_path / "gemma2", tokenizer_path("smollm2")), "hidden+head"
    runner = TeacherRunner(load_causal_lm(str(folder), device="cpu"), top_k=K, vocab_limit=VOCAB, batch_tokens=512)
    assert runner.path == expected_path  # the soft-capped head reproduces Gemma 2's own logits on the probe
    for result, ids in zip(runner.run(rows), rows):
        check_row_against_reference(result, ids, float64_reference(folder, ids), K)


def test_temperature_divides_the_logits(aligned, tiny_teacher, tmp_path):
    from csd_pipeline import read_teacher_topk

    run_stage(aligned, tiny_teacher, tmp_path / "out", temperature=2.0)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["temperature"] == 2.0
    for row, (_, _, ids) in list(zip(read_teacher_topk(tmp_path / "out"), aligned_rows(aligned)))[:4]:
        check_row_against_reference(row, ids, float64_reference(tiny_teacher, ids, temperature=2.0), K)


def test_manifest_and_co_partitioning(aligned, tiny_teacher, tiny_output):
    import hashlib

    import pyarrow.parquet as pq

    from csd_pipeline.runtime.model_loading import model_fingerprint

    manifest = json.loads((tiny_output / "manifest.json").read_text())
    aligned_manifest = json.loads((aligned / "manifest.json").read_text())
    assert manifest["stage"] == "teacher-logits" and manifest["schema_version"] == 2
    assert manifest["config"]["top_k"] == K and manifest["config"]["encoding"] == "csd-topk-lzma-v2"
    assert manifest["config"]["top_p"] is None
    assert manifest["totals"]["stats"]["entries"] == K * manifest["totals"]["stats"]["positions"]
    assert manifest["config"]["temperature"] == 1.0 and manifest["config"]["max_abs_error"] < 0.01
    assert manifest["teacher"]["fingerprint"] == model_fingerprint(tiny_teacher)["sha256"]
    assert set(manifest["teacher"]["files"]) == {"config.json", "model.safetensors"}
    assert manifest["teacher"]["output_size"] == VOCAB + PADDED and manifest["teacher"]["tokenizer_size"] == VOCAB
    assert manifest["aligned"]["manifest_sha256"] == hashlib.sha256((aligned / "manifest.json").read_bytes()).hexdigest()
    assert [s["file"] for s in manifest["shards"]] == [s["file"] for s in aligned_manifest["shards"]]
    for ours, theirs in zip(manifest["shards"], aligned_manifest["shards"]):
        assert ours["rows"] == theirs["rows"]
        left = pq.read_table(tiny_output / ours["file"], columns=["row_id"]).column("row_id").to_pylist()
        right = pq.read_table(aligned / theirs["file"], columns=["row_id"]).column("row_id").to_pylist()
        assert left == right
    stats = manifest["totals"]["stats"]
    assert stats["positions"] == sum(len(ids) for _, _, ids in aligned_rows(aligned))
    assert stats["rejected"]["non_finite"] == 0


TOP_P = 0.6


def test_top_p_keeps_the_most_likely_entries_until_their_mass(aligned, tiny_teacher, tmp_path):
    """--top-p: position t keeps the n most likely ids, n the smallest count whose float64 reference
    probabilities reach P, at most K; then padding. Positions keep 1 entry and K entries."""
    import pyarrow.parquet as pq

    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    out = tmp_path / "top-p"
    assert run_stage(aligned, tiny_teacher, out, top_p=TOP_P).complete
    output = TeacherTopkOutput.open(out)
    assert output.top_p == TOP_P and output.top_k == K and output.manifest["schema_version"] == 2
    metadata = pq.read_schema(out / output.shard_files[0]).metadata
    assert metadata[b"csd.top_p"] == repr(TOP_P).encode() and metadata[b"csd.schema_version"] == b"2"
    counts, stored = [], 0
    for row, (_, _, ids) in zip(output.rows(), aligned_rows(aligned)):
        real = float64_reference(tiny_teacher, ids)[:, :VOCAB]
        top = -np.sort(-real, axis=1)[:, :K]
        mass = np.cumsum(np.exp(top), axis=1)
        for t in range(len(ids)):
            n = int(row.lengths[t])
            expected = min(K, 1 + int(np.count_nonzero(mass[t] < TOP_P)))
            boundary = np.abs(mass[t] - TOP_P).min() < 1e-4  # float32 vs float64 may decide either way
            assert n == expected or (boundary and abs(n - expected) == 1), (t, n, expected, mass[t])
            kept, values = row.entries(t)
            nth = top[t, n - 1]
            assert np.all(real[t, kept] >= nth - 1e-4)  # among the n most likely (up to float noise) ...
            assert set(np.flatnonzero(real[t] > nth + 1e-4).tolist()) <= set(kept.tolist())  # ... all clear ones
            assert np.all(np.abs(values - real[t, kept]) <= TOLERANCE)
            assert np.all(row.ids[t, n:] == -1) and np.all(np.isneginf(row.logprobs[t, n:]))
            counts.append(n)
        observed = real[np.arange(len(ids) - 1), ids[1:]]
        assert np.all(np.abs(row.observed_logprob[:-1] - observed) <= TOLERANCE)
        stored += int(row.lengths.sum())
    assert 1 in counts and K in counts and 1 < np.mean(counts) < K
    assert output.manifest["totals"]["stats"]["entries"] == stored


def test_top_p_out_of_range_is_refused(aligned, tiny_teacher, tmp_path):
    from csd_pipeline.errors import CsdError

    for value in (0.0, 1.5, -0.1):
        with pytest.raises(CsdError, match="--top-p"):
            run_stage(aligned, tiny_teacher, tmp_path / "bad", top_p=value)


MIN_P = 0.05


@pytest.mark.parametrize("top_p", [None, TOP_P])
def test_min_p_keeps_the_entries_within_a_ratio_of_the_most_likely(aligned, tiny_teacher, tmp_path, top_p):
    """--min-p R: position t keeps the n most likely ids whose float64 reference probabilities are at
    least R times the most likely one's, at most K (with --top-p as well: the smaller of the two counts);
    then padding. Recorded in the manifest and the schema; positions keep 1 entry and K entries."""
    import pyarrow.parquet as pq

    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    out = tmp_path / "min-p"
    assert run_stage(aligned, tiny_teacher, out, min_p=MIN_P, top_p=top_p).complete
    output = TeacherTopkOutput.open(out)
    assert output.min_p == MIN_P and output.top_p == top_p and output.manifest["config"]["min_p"] == MIN_P
    metadata = pq.read_schema(out / output.shard_files[0]).metadata
    assert metadata[b"csd.min_p"] == repr(MIN_P).encode()
    counts, capped = [], 0
    for row, (_, _, ids) in zip(output.rows(), aligned_rows(aligned)):
        real = float64_reference(tiny_teacher, ids)[:, :VOCAB]
        top = -np.sort(-real, axis=1)[:, :K]
        for t in range(len(ids)):
            n = int(row.lengths[t])
            gaps = top[t] - (top[t, 0] + np.log(MIN_P))
            expected, boundary = int(np.count_nonzero(gaps >= 0)), np.abs(gaps).min() < 1e-4
            if top_p is not None:
                mass = np.cumsum(np.exp(top[t]))
                by_mass = min(K, 1 + int(np.count_nonzero(mass < top_p)))
                capped += by_mass < expected
                boundary = boundary or np.abs(mass - top_p).min() < 1e-4
                expected = min(expected, by_mass)
            assert n == expected or (boundary and abs(n - expected) == 1), (t, n, expected, top[t])
            kept, values = row.entries(t)
            assert np.all(real[t, kept] >= top[t, n - 1] - 1e-4)
            assert np.all(np.abs(values - real[t, kept]) <= TOLERANCE)
            assert np.all(row.ids[t, n:] == -1) and np.all(np.isneginf(row.logprobs[t, n:]))
            counts.append(n)
    assert 1 in counts and K in counts and 1 < np.mean(counts) < K
    assert top_p is None or capped > 0  # the mass bound decides some positions


def test_min_p_out_of_range_is_refused(aligned, tiny_teacher, tmp_path):
    from csd_pipeline.errors import CsdError

    for value in (0.0, 1.5, -0.1):
        with pytest.raises(CsdError, match="--min-p"):
            run_stage(aligned, tiny_teacher, tmp_path / "bad", min_p=value)


TAIL_SAMPLES = 16


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_tail_samples_store_the_kept_entries_and_draws_from_the_rest(aligned, tiny_teacher, tmp_path):
    """--tail-samples N (with --min-p): each position holds its kept entries at their float64 values, and
    distinct ids from outside them (never the observed token, unless at its exact value) at log(c * m / N),
    m the float64 mass of the rest and the counts c summing to N; the observed values stay exact; k is the
    top-k + N + 1; a re-run writes the same bytes, another --sample-seed other draws; baselines refuse it."""
    import pyarrow.parquet as pq

    from csd_pipeline.errors import CsdError
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from trainer.config import LossConfig
    from trainer.data import _check_top_k

    out = tmp_path / "tail"
    assert run_stage(aligned, tiny_teacher, out, min_p=MIN_P, tail_samples=TAIL_SAMPLES).complete
    output = TeacherTopkOutput.open(out)
    assert output.tail_samples == TAIL_SAMPLES and output.manifest["config"]["sample_seed"] == 0
    metadata = pq.read_schema(out / output.shard_files[0]).metadata
    assert metadata[b"csd.tail_samples"] == b"16" and metadata[b"csd.k"] == str(K + TAIL_SAMPLES + 1).encode()
    forced = drawn_total = 0
    for row, (_, _, ids) in zip(output.rows(), aligned_rows(aligned)):
        real = float64_reference(tiny_teacher, ids)[:, :VOCAB]
        top = np.argsort(-real, axis=1)[:, :K]
        for t in range(len(ids)):
            entries, values = row.entries(t)
            n_top = int(np.count_nonzero(real[t, top[t]] >= real[t, top[t, 0]] + np.log(MIN_P)))
            kept = top[t, :n_top]
            if np.abs(real[t, top[t]] - real[t, top[t, 0]] - np.log(MIN_P)).min() < 1e-4:
                continue  # float32 vs float64 may decide the cut either way
            is_kept = np.isin(entries, kept)
            assert is_kept.sum() == n_top and np.all(np.abs(values[is_kept] - real[t, entries[is_kept]]) <= TOLERANCE)
            assert len(set(entries.tolist())) == len(entries)
            observed = ids[t + 1] if t + 1 < len(ids) else -1
            is_observed = (entries == observed) & ~is_kept
            if is_observed.any():  # stored only at its exact value, above the least likely entry
                forced += 1
                assert abs(values[is_observed][0] - real[t, observed]) <= TOLERANCE
            drawn = ~is_kept & ~is_observed
            rest = np.ones(VOCAB, dtype=bool)
            rest[kept] = False
            if observed >= 0:
                rest[observed] = False
            mass = np.exp(real[t, rest]).sum()
            counts = np.exp(values[drawn] - np.log(mass / TAIL_SAMPLES))
            assert np.all(np.abs(counts - np.rint(counts)) <= TOLERANCE * counts + 1e-3), counts
            assert int(np.rint(counts).sum()) == TAIL_SAMPLES
            drawn_total += int(drawn.sum())
        assert np.all(np.abs(row.observed_logprob[:-1] - real[np.arange(len(ids) - 1), ids[1:]]) <= TOLERANCE)
    assert forced > 0 and drawn_total > 0
    again, other = tmp_path / "again", tmp_path / "other-seed"
    assert run_stage(aligned, tiny_teacher, again, min_p=MIN_P, tail_samples=TAIL_SAMPLES).complete
    assert output_bytes(again) == output_bytes(out)
    assert run_stage(aligned, tiny_teacher, other, min_p=MIN_P, tail_samples=TAIL_SAMPLES, sample_seed=1).complete
    assert output_bytes(other) != output_bytes(out)
    with pytest.raises(CsdError, match="--tail-samples"):
        LossConfig(loss="gold").build().check_teacher(None, output)
    LossConfig(loss="csd").build().check_teacher(None, output)
    with pytest.raises(CsdError, match="--tail-samples"):
        _check_top_k(4, output)
    _check_top_k(0, output)
    with pytest.raises(CsdError, match="--tail-samples"):
        run_stage(aligned, tiny_teacher, tmp_path / "bad", top_k=250, tail_samples=8)


def test_keep_csd_events_stores_what_the_loss_reads(aligned, tiny_teacher, tiny_output, tables_for, tmp_path):
    """--keep csd-events: fewer entries than the whole top-8, recorded in the manifest and the schema; the
    CSD events of every row (both spelling modes) equal those of the whole top-8; the baselines refuse it."""
    import pyarrow.parquet as pq

    from csd_pipeline.errors import CsdError
    from csd_pipeline.events.context import EventContext
    from csd_pipeline.events.row_events import build_row_events
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from csd_pipeline.vocab.tables import load_table
    from trainer.config import LossConfig

    out = tmp_path / "events"
    assert run_stage(aligned, tiny_teacher, out, keep="csd-events").complete
    events, whole = TeacherTopkOutput.open(out), TeacherTopkOutput.open(tiny_output)
    assert events.keep == "csd-events" and whole.keep == "top-k" and "keep" not in whole.manifest["config"]
    assert len(events.manifest["config"]["tables_sha256"]) == 2
    assert pq.read_schema(out / events.shard_files[0]).metadata[b"csd.keep"] == b"csd-events"
    stored = events.manifest["totals"]["stats"]["entries"]
    assert stored < whole.manifest["totals"]["stats"]["entries"]
    s2t, t2s = tables_for("gpt-2", "smollm2")
    context = EventContext(load_table(s2t), load_table(t2s))
    from csd_pipeline.align.output import AlignedOutput

    source = AlignedOutput.open(aligned)
    rows = [r for shard in source.shards for r in source.read(shard, source.training_columns([0])).to_pylist()]
    counts, chunks = [], 0
    for row, kept, full in zip(rows, events.rows(), whole.rows(), strict=True):
        counts.extend(kept.lengths.tolist())
        np.testing.assert_array_equal(kept.observed_logprob, full.observed_logprob)
        for spelling in ("sum", "exclude"):
            a = build_row_events(row, 0, full, context, spelling=spelling)
            b = build_row_events(row, 0, kept, context, spelling=spelling)
            for name in ("final_pos", "final_tok", "final_event", "event_chunk", "event_teacher_logq", "chain_pos"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            chunks += a.num_chunks
    assert chunks > 0 and 1 in counts and max(counts) > 1 and sum(counts) == stored
    with pytest.raises(CsdError, match="--keep csd-events"):
        LossConfig(loss="uld").build().check_teacher(None, events)
    LossConfig(loss="csd").build().check_teacher(None, events)
    LossConfig(loss="uld").build().check_teacher(None, whole)
    with pytest.raises(CsdError, match="--spelling prefix"):  # it reads entries the store left out
        LossConfig(loss="csd", spelling="prefix").build().check_teacher(None, events)
    LossConfig(loss="csd", spelling="prefix").build().check_teacher(None, whole)


def test_version_1_output_is_still_read():
    """An output of schema version 1 (tests/data/teacher-topk-v1: written by the code before --top-p,
    fixed top-8 of SmolLM2 on Genesis 1) opens and reads: every position holds its 8 entries, the ids
    of an independent float32 forward of each row alone, values within the grid."""
    from csd_pipeline import read_teacher_topk
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    folder = DATA / "teacher-topk-v1"
    reference = np.load(folder / "reference.npz", allow_pickle=False)
    output = TeacherTopkOutput.open(folder)
    assert output.manifest["schema_version"] == 1 and output.top_k == 8 and output.top_p is None
    rows = list(read_teacher_topk(folder))
    assert [r.row_id for r in rows] == reference["row_ids"].tolist()
    offsets = np.concatenate([[0], np.cumsum(reference["positions"])])
    for index, row in enumerate(rows):
        part = slice(offsets[index], offsets[index + 1])
        assert row.ok and row.lengths.tolist() == [8] * int(reference["positions"][index])
        assert np.array_equal(np.sort(row.ids, axis=1), np.sort(reference["topk_ids"][part], axis=1))
        for t in range(len(row.ids)):
            expected = dict(zip(reference["topk_ids"][part][t].tolist(), reference["topk_logprobs"][part][t].tolist()))
            for token, value in zip(*row.entries(t)):
                assert abs(value - expected[int(token)]) <= TOLERANCE
        observed = reference["observed_logprob"][part]
        assert np.all(np.abs(row.observed_logprob[:-1] - observed[:-1]) <= TOLERANCE) and np.isnan(row.observed_logprob[-1])


def test_teacher_vocabulary_size_comes_from_the_aligned_manifest(aligned, tmp_path, monkeypatch):
    """The align stage records each tokenizer's vocabulary size, so no table is loaded to learn it; an
    aligned output written before that still gives the size, from its teacher->student table."""
    import csd_pipeline.vocab.tables as tables
    from csd_pipeline.align.output import AlignedOutput

    manifest = json.loads((aligned / "manifest.json").read_text())
    assert manifest["tokenizers"]["teachers"][0]["size"] == VOCAB
    real, loaded = tables.load_table, []
    monkeypatch.setattr(tables, "load_table", lambda path: loaded.append(path) or real(path))
    assert AlignedOutput.open(aligned).teacher_tokenizer(0).size == VOCAB and loaded == []
    older = tmp_path / "older"
    shutil.copytree(aligned, older)
    for record in [manifest["tokenizers"]["student"], *manifest["tokenizers"]["teachers"]]:
        del record["size"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    assert AlignedOutput.open(older).teacher_tokenizer(0).size == VOCAB and len(loaded) == 1


def test_random_access_equals_iteration(tiny_output):
    from csd_pipeline.teacher.store.reader import read_teacher_shard

    manifest = json.loads((tiny_output / "manifest.json").read_text())
    shard = read_teacher_shard(tiny_output, manifest["shards"][0]["file"])
    in_order = list(shard)
    for index in (2, 0, len(shard) - 1, 1):
        np.testing.assert_array_equal(shard[index].ids, in_order[index].ids)
        np.testing.assert_array_equal(shard[index].logprobs, in_order[index].logprobs)


def test_reads_out_of_order_decode_each_block_once_when_it_fits(aligned, tiny_teacher, tmp_path, monkeypatch):
    import csd_pipeline.teacher.store.codec as codec
    from csd_pipeline.teacher.store.reader import read_teacher_shard

    out = tmp_path / "small-blocks"
    assert run_stage(aligned, tiny_teacher, out, block_positions=64).complete
    manifest = json.loads((out / "manifest.json").read_text())
    rows = len(read_teacher_shard(out, manifest["shards"][0]["file"]))
    order = np.concatenate([np.arange(rows)[::-1], np.arange(rows)])  # back and forth over every block
    decoded = []
    real = codec.decode_block
    monkeypatch.setattr(codec, "decode_block", lambda *a, **k: decoded.append(1) or real(*a, **k))
    for cache_bytes in (1 << 30, 0):
        shard = read_teacher_shard(out, manifest["shards"][0]["file"], cache_bytes=cache_bytes)
        blocks = len(shard._block_rows)
        in_order = list(read_teacher_shard(out, manifest["shards"][0]["file"]))
        decoded.clear()
        for index in order.tolist():
            np.testing.assert_array_equal(shard[index].ids, in_order[index].ids)
            np.testing.assert_array_equal(shard[index].logprobs, in_order[index].logprobs)
        assert blocks >= 2
        if cache_bytes:
            assert len(decoded) == blocks  # every block once
        else:
            assert len(decoded) == 2 * blocks - 1  # one block kept: going back decodes again


# ---------------------------------------------------------------------------------------------
# Faults, resume, ranks


def test_non_finite_row_is_rejected_in_place(aligned, tiny_output, tokenizer_path, tmp_path):
    from csd_pipeline import read_teacher_topk

    rows = aligned_rows(aligned)
    counts = {}
    for _, _, ids in rows:
        for token in set(ids.tolist()):
            counts[token] = counts.get(token, 0) + 1
    # A token of exactly one row (past the probe ids 0..15) gets a NaN embedding.
    victim_row = next(i for i, (_, _, ids) in enumerate(rows) if any(counts[t] == 1 and t >= 16 for t in ids.tolist()))
    poison = next(t for t in rows[victim_row][2].tolist() if counts[t] == 1 and t >= 16)
    teacher = make_tiny_teacher(tmp_path / "poisoned", tokenizer_path("smollm2"), poison=poison)
    run_stage(aligned, teacher, tmp_path / "out")
    got = list(read_teacher_topk(tmp_path / "out"))
    clean = list(read_teacher_topk(tiny_output))
    assert [r.row_id for r in got] == [r.row_id for r in clean]  # co-partitioning kept
    for index, (row, reference) in enumerate(zip(got, clean)):
        if index == victim_row:
            assert row.status == 1 and not row.ok and row.ids.shape == (0, K)
        else:
            assert row.ok
            np.testing.assert_array_equal(row.ids, reference.ids)
            np.testing.assert_allclose(row.logprobs, reference.logprobs, atol=2 * MAX_ABS_ERROR + 1e-5)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["totals"]["stats"]["rejected"]["non_finite"] == 1


def cli(args, env_extra=None, check=True):
    # One thread: the tiny teacher's matmuls are too small to share, and the machine may be busy.
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    result = subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def cli_args(aligned_dir, teacher, output):
    return ["teacher-logits", "--aligned", str(aligned_dir), "--teacher", str(teacher), "--output", str(output),
            "--top-k", str(K), "--batch-tokens", "512", "--device", "cpu"]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_bytes(aligned, tiny_teacher, tiny_output, tmp_path, capsys):
    out = tmp_path / "out"
    # SIGKILLed after the first shard is complete, with the second written but not yet renamed.
    crashed = cli(cli_args(aligned, tiny_teacher, out), {"CSD_TEST_CRASH": "before_rename:2"}, check=False)
    assert crashed.returncode != 0 and not (out / "manifest.json").exists()
    assert (out / "done" / "part-00000-00000.done").is_file()
    assert any(p.name.endswith(".tmp") for p in out.iterdir())
    # The resume through the same CLI, in this process (a second interpreter would only import torch again).
    from cli.main import cli as group
    from cli.main import run_cli

    capsys.readouterr()
    run_cli(group, cli_args(aligned, tiny_teacher, out))  # a failure raises SystemExit
    assert "1 of 3 shards already complete" in capsys.readouterr().err
    assert output_bytes(out) == output_bytes(tiny_output)
    # A complete output is skipped on a re-run.
    again = run_stage(aligned, tiny_teacher, out)
    assert again.complete and again.processed == []
    assert output_bytes(out) == output_bytes(tiny_output)


def test_ranks_split_shards_and_last_writes_manifest(aligned, tiny_teacher, tiny_output, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    first = run_stage(aligned, tiny_teacher, out, rank=None, world_size=None)
    assert not first.complete and not (out / "manifest.json").exists()
    assert first.processed == ["part-00000-00001"]
    monkeypatch.setenv("RANK", "0")
    second = run_stage(aligned, tiny_teacher, out, rank=None, world_size=None)
    assert second.complete and second.processed == ["part-00000-00000", "part-00000-00002"]
    produced = {k: v for k, v in output_bytes(out).items() if not k.startswith("stats/")}
    expected = {k: v for k, v in output_bytes(tiny_output).items() if not k.startswith("stats/")}
    assert produced == expected


@pytest.mark.slow
def test_torchrun_cpu_processes_give_the_same_output(aligned, tiny_teacher, tiny_output, tmp_path):
    """`torchrun --nproc-per-node 2` on CPU: disjoint shards per rank, one manifest, the same bytes."""
    out = tmp_path / "out"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "cli.main",
                             *cli_args(aligned, tiny_teacher, out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = sorted(p.name for p in (out / "stats").iterdir())
    assert stats == ["rank-00000.json", "rank-00001.json"]
    shards = [json.loads((out / "stats" / name).read_text())["shards"] for name in stats]
    assert shards == [["part-00000-00000", "part-00000-00002"], ["part-00000-00001"]]
    produced = {k: v for k, v in output_bytes(out).items() if not k.startswith("stats/")}
    expected = {k: v for k, v in output_bytes(tiny_output).items() if not k.startswith("stats/")}
    assert produced == expected


# ---------------------------------------------------------------------------------------------
# Bad input: one sentence on stderr, exit 2, no traceback (through the CLI's own error handling)


def run_cli_captured(args, capsys) -> tuple[int, str]:
    from cli.main import cli as group
    from cli.main import run_cli

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(group, args)
    return exit_info.value.code, capsys.readouterr().err


def _assert_one_line_error(outcome, *fragments):
    code, stderr = outcome
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_cli_refuses_bad_inputs(aligned, tiny_teacher, tokenizer_path, tmp_path, capsys):
    def attempt(aligned_dir, teacher, output, *more):
        return run_cli_captured([*cli_args(aligned_dir, teacher, output), "--quiet", *more], capsys)

    no_manifest = tmp_path / "no-manifest"
    shutil.copytree(aligned, no_manifest)
    (no_manifest / "manifest.json").unlink()
    _assert_one_line_error(attempt(no_manifest, tiny_teacher, tmp_path / "o1"), "has no manifest.json")

    future = tmp_path / "future"
    shutil.copytree(aligned, future)
    manifest = json.loads((future / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (future / "manifest.json").write_text(json.dumps(manifest))
    _assert_one_line_error(attempt(future, tiny_teacher, tmp_path / "o2"), "schema version 99")

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    _assert_one_line_error(attempt(aligned, tiny_teacher, blocker / "out"), "not writable")

    small = make_tiny_teacher(tmp_path / "small", tokenizer_path("smollm2"), output_size=1000, tokenizer=False)
    _assert_one_line_error(attempt(aligned, small, tmp_path / "o3"), "1000 outputs", "49152 ids")

    other = make_tiny_teacher(tmp_path / "other", tokenizer_path("gpt-2"), output_size=50257)
    _assert_one_line_error(attempt(aligned, other, tmp_path / "o4"), "another tokenizer")

    _assert_one_line_error(attempt(aligned, tiny_teacher, tmp_path / "o5", "--teacher-index", "3"), "--teacher-index 3")
    _assert_one_line_error(attempt(aligned, tmp_path / "missing-model", tmp_path / "o6"), "no such file or folder")

    tampered = tmp_path / "tampered"
    shutil.copytree(aligned, tampered)
    with (tampered / "part-00000-00001.parquet").open("ab") as handle:
        handle.write(b"x")
    _assert_one_line_error(attempt(tampered, tiny_teacher, tmp_path / "o8"), "differs from what its manifest records")

    # Without --quiet, progress lines come first; the error is still one line, last, without a traceback.
    code, stderr = run_cli_captured(cli_args(aligned, small, tmp_path / "o7"), capsys)
    assert code == 2 and stderr.splitlines()[-1].startswith("error: ") and "Traceback" not in stderr


# ---------------------------------------------------------------------------------------------
# The real teacher


@pytest.mark.slow
def test_real_smollm2_reproduces_its_own_loss(aligned, model_path, tmp_path):
    """Mean stored observed log-prob == the model's own cross-entropy on the same rows (~670 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from csd_pipeline import read_teacher_topk

    teacher = model_path("smollm2-135m-instruct")
    run_stage(aligned, teacher, tmp_path / "out", top_k=32, batch_tokens=1024)
    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    stored_total, model_total, count = 0.0, 0.0, 0
    for row, (_, _, ids) in zip(read_teacher_topk(tmp_path / "out"), aligned_rows(aligned)):
        assert row.ok and row.ids.shape == (len(ids), 32)
        if len(ids) < 2:
            continue
        with torch.inference_mode():
            inputs = torch.tensor(ids[None, :])
            loss = float(model(inputs, labels=inputs).loss)  # the model's own mean next-token CE
        stored = -float(np.mean(row.observed_logprob[:-1].astype(np.float64)))
        assert abs(stored - loss) <= MAX_ABS_ERROR + 1e-4
        stored_total += stored * (len(ids) - 1)
        model_total += loss * (len(ids) - 1)
        count += len(ids) - 1
    assert count > 300
    assert abs(stored_total / count - model_total / count) <= MAX_ABS_ERROR + 1e-4
