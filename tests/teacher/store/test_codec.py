"""The teacher top-k codec: exact ids, log-probs within 1/102 nat, observed log-probs, on random
(hypothesis) and real SmolLM2 output; fixed and variable entry counts per position (`--top-p`);
blocks of the version 1 encoding still decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.store.codec import (
    LOGPROB_FLOOR,
    MAX_ABS_ERROR,
    PAD_ID,
    block_header,
    canonical_order,
    decode_block,
    encode_block,
    quantize,
)

DATA = Path(__file__).resolve().parents[2] / "data"


def _tolerance(value) -> np.ndarray:
    """The grid's half step plus float32 rounding of the input and decoded values (<= 0.00981 above -20)."""
    return MAX_ABS_ERROR + 4 * np.spacing(np.abs(np.asarray(value, np.float32)))


def _roundtrip_checks(ids, logprobs, observed_ids, observed_lp, lengths=None):
    """Encode, decode and compare with the input (brute force per position): lengths[p] of the
    entries of position p (all k without lengths), none less likely on the grid than one left out,
    then padding."""
    payload = encode_block(ids, logprobs, observed_ids, observed_lp, lengths)
    mask = observed_ids >= 0
    out_ids, out_lp, out_obs, out_lengths = decode_block(payload, mask)
    positions, k = ids.shape
    lengths = np.full(positions, k) if lengths is None else np.asarray(lengths)
    assert out_ids.shape == (positions, k) and out_ids.dtype == np.int32
    assert out_lp.shape == (positions, k) and out_lp.dtype == np.float32
    assert out_lengths.tolist() == lengths.tolist()
    reference = np.maximum(np.asarray(logprobs, np.float64), LOGPROB_FLOOR)
    for p in range(positions):
        n = int(lengths[p])
        # n of the given (id, log-prob) pairs, in descending log-prob order, then padding.
        expected = dict(zip(ids[p].tolist(), reference[p].tolist()))
        kept = out_ids[p, :n].tolist()
        assert len(set(kept)) == n and set(kept) <= set(expected)
        for token, value in zip(kept, out_lp[p, :n].tolist()):
            assert abs(value - expected[token]) <= _tolerance(expected[token])
        left_out = [expected[i] for i in expected if i not in kept]
        if left_out:  # the kept ones are the most likely, up to ties on the grid
            assert quantize([min(expected[i] for i in kept)])[0] <= quantize([max(left_out)])[0]
        assert np.all(np.diff(out_lp[p, :n]) <= 0)
        assert np.all(out_ids[p, n:] == PAD_ID) and np.all(np.isneginf(out_lp[p, n:]))
    assert np.all(np.isnan(out_obs[~mask]))
    expected_obs = np.maximum(np.asarray(observed_lp, np.float64)[mask], LOGPROB_FLOOR)
    assert np.all(np.abs(out_obs[mask] - expected_obs) <= _tolerance(expected_obs))
    return payload


@st.composite
def blocks(draw):
    positions = draw(st.integers(0, 12))
    k = draw(st.integers(1, 40))
    wide = draw(st.booleans())
    vocab = draw(st.sampled_from([k + 3, 50_000, 200_000, (1 << 24) - 1] if wide else [k, k + 1, 1000, 65_536]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(positions)]) if positions else np.zeros((0, k), np.int64)
    style = draw(st.sampled_from(["spread", "ties", "huge_gaps", "floor", "tiny"]))
    if style == "spread":
        lp = -np.sort(rng.exponential(3.0, size=(positions, k)), axis=1)
    elif style == "ties":
        lp = -np.round(rng.exponential(1.0, size=(positions, k)), 1)  # many exactly equal values
    elif style == "huge_gaps":
        lp = -np.cumsum(rng.choice([0.0, 0.01, 7.0, 40.0], size=(positions, k)), axis=1)  # escaped gaps
    elif style == "floor":
        lp = -rng.uniform(0, 3000, size=(positions, k))  # below the -1285 floor too
    else:
        lp = -rng.uniform(0, 1e-3, size=(positions, k))
    lp = lp.astype(np.float32)
    lp = np.take_along_axis(lp, rng.permuted(np.tile(np.arange(k), (positions, 1)), axis=1), axis=1)  # any order
    observed_ids = np.full(positions, -1, np.int64)
    observed_lp = np.full(positions, np.nan, np.float32)
    for p in range(positions):
        kind = draw(st.sampled_from(["none", "in", "out"]))
        if kind == "in":
            j = int(rng.integers(k))
            observed_ids[p], observed_lp[p] = ids[p, j], lp[p, j]
        elif kind == "out" and vocab > k:
            outside = np.setdiff1d(np.arange(min(vocab, k + 50)), ids[p])
            observed_ids[p] = outside[0]
            observed_lp[p] = lp[p].min() - np.float32(rng.exponential(2.0))
    counts = draw(st.sampled_from(["all", "one", "random", "max_and_one"]))
    if counts == "all":
        lengths = None
    elif counts == "one":
        lengths = np.ones(positions, np.int64)
    elif counts == "random":
        lengths = rng.integers(1, k + 1, size=positions)
    else:
        lengths = np.where(np.arange(positions) % 2 == 0, k, 1)
    return ids, lp, observed_ids, observed_lp, lengths


@settings(max_examples=200, deadline=None)
@given(blocks())
def test_roundtrip_property(block):
    _roundtrip_checks(*block)


def test_variable_counts_keep_the_most_likely_and_the_observed_one_outside_them():
    """Position 0 keeps 1 entry, position 1 all k: an observed token among the dropped entries is
    stored as a gap below the position's last kept value, not as an index into the dropped ones."""
    ids = np.array([[9, 5, 2, 7], [4, 3, 8, 1]])
    lp = np.array([[-2.5, -0.1, -3.0, -4.0], [-1.0, -1.5, -2.0, -2.2]], np.float32)
    payload = _roundtrip_checks(ids, lp, np.array([2, -1]), np.array([-3.0, np.nan], np.float32), np.array([1, 4]))
    decoded = decode_block(payload, np.array([True, False]))
    assert decoded.ids[0].tolist() == [5, PAD_ID, PAD_ID, PAD_ID] and decoded.lengths.tolist() == [1, 4]
    assert abs(decoded.observed[0] - (-3.0)) <= MAX_ABS_ERROR
    assert block_header(payload)["entries"] == 5


def test_fixed_k_stores_no_entry_counts():
    rng = np.random.default_rng(1)
    ids = rng.choice(50_000, size=(64, 16), replace=False)
    lp = -np.sort(rng.exponential(2.0, size=(64, 16)), axis=1).astype(np.float32)
    observed_ids = np.append(ids[1:, 0], -1)
    fixed = encode_block(ids, lp, observed_ids, lp[:, 0])
    assert block_header(fixed)["stream_bytes"]["lens"] == 0
    assert fixed == encode_block(ids, lp, observed_ids, lp[:, 0], np.full(64, 16))
    assert block_header(encode_block(ids, lp, observed_ids, lp[:, 0], np.full(64, 15)))["stream_bytes"]["lens"] > 0


def test_bad_entry_counts_raise_value_error():
    ids, lp = np.array([[1, 2]]), np.array([[-0.1, -1.0]], np.float32)
    for lengths in ([0], [3], [1, 1]):
        with pytest.raises(ValueError):
            encode_block(ids, lp, np.array([-1]), np.array([np.nan], np.float32), np.array(lengths))


def test_version_1_blocks_still_decode():
    """A shard written by the version 1 code path (tests/data/teacher-topk-v1, see its README entry):
    every block decodes to k = 8 entries per position, within the grid of an independent float32
    forward of each row, with the same ids."""
    import pyarrow.parquet as pq

    folder = DATA / "teacher-topk-v1"
    reference = np.load(folder / "reference.npz", allow_pickle=False)
    table = pq.read_table(folder / "part-00000-00000.parquet")
    positions = table.column("positions").to_numpy()
    payloads = [p for p in table.column("payload").to_pylist() if p is not None]
    blocks = table.column("block").to_numpy()
    ids, lp, observed, offset = [], [], [], 0
    for block, payload in enumerate(payloads):
        lengths = positions[blocks == block]
        mask = np.ones(int(lengths.sum()), bool)
        mask[np.cumsum(lengths) - 1] = False
        assert block_header(payload)["version"] == 1
        decoded = decode_block(payload, mask)
        assert decoded.lengths.tolist() == [8] * int(lengths.sum())
        ids.append(decoded.ids)
        lp.append(decoded.logprobs)
        observed.append(decoded.observed)
        offset += int(lengths.sum())
    ids, lp, observed = np.concatenate(ids), np.concatenate(lp), np.concatenate(observed)
    assert offset == int(reference["positions"].sum()) == len(ids)
    order = np.argsort(reference["topk_ids"], axis=1)
    assert np.array_equal(np.sort(ids, axis=1), np.take_along_axis(reference["topk_ids"], order, axis=1))
    forward_noise = 1e-4  # the stage ran rows batched with padding; the reference ran each row alone
    assert np.all(np.abs(np.sort(lp, axis=1) - np.sort(reference["topk_logprobs"], axis=1)) <= MAX_ABS_ERROR + forward_noise)
    has_next = ~np.isnan(reference["observed_logprob"])
    assert np.array_equal(has_next, ~np.isnan(observed))
    assert np.all(np.abs(observed[has_next] - reference["observed_logprob"][has_next]) <= MAX_ABS_ERROR + forward_noise)


def test_rounding_does_not_accumulate():
    # 31 steps of 0.0099 nat each: quantizing the gaps would round every one to 0 and drift 0.3 nat.
    k = 32
    lp = -(0.5 + 0.0099 * np.arange(k, dtype=np.float64))[None, :].astype(np.float32)
    ids = np.arange(k)[None, :]
    _roundtrip_checks(ids, lp, np.array([-1]), np.array([np.nan], np.float32))


def test_canonical_order_sorts_ties_by_id():
    ids = np.array([[9, 3, 7, 1]])
    q = np.array([[2, 2, 0, 2]])
    ordered_ids, ordered_q = canonical_order(ids, q)
    assert ordered_ids.tolist() == [[7, 1, 3, 9]] and ordered_q.tolist() == [[0, 2, 2, 2]]


def test_quantize_grid_and_floor():
    assert quantize([0.0, -1 / 51, -1.0, -1e9]).tolist() == [0, 1, 51, 65535]
    assert quantize([1e-7]).tolist() == [0]  # a float32 log-prob can be a hair above 0


def test_corrupt_payloads_raise_csd_error():
    rng = np.random.default_rng(0)
    ids = rng.choice(1000, size=(5, 8), replace=False)
    lp = -np.sort(rng.exponential(2.0, size=(5, 8)), axis=1).astype(np.float32)
    payload = encode_block(ids, lp, np.array([1, 2, 3, 4, -1]) + 2000 * 0, lp[:, 0])
    mask = np.array([True, True, True, True, False])
    with pytest.raises(CsdError):
        decode_block(payload[:-3], mask)
    with pytest.raises(CsdError):
        decode_block(b"XXXX" + payload[4:], mask)
    with pytest.raises(CsdError):
        decode_block(payload, np.ones(5, bool))  # the rows disagree with the block
    assert block_header(payload)["positions"] == 5
    variable = encode_block(ids, lp, np.array([1, 2, 3, 4, -1]), lp[:, 0], np.array([1, 8, 3, 2, 5]))
    with pytest.raises(CsdError):
        decode_block(variable[:-1], mask)


@pytest.fixture
def one_thread():
    """One torch thread: on a busy shared machine two OpenMP threads mostly wait on each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_real_smollm2_output(model_path, one_thread):
    """Real teacher output: every stored log-prob > -20 within 0.01 nat, ids exact, observed exact."""
    import torch
    from transformers import AutoModelForCausalLM

    from csd_pipeline.vocab.vocabulary import load_tokenizer

    folder = model_path("smollm2-135m-instruct")
    bundle = load_tokenizer(str(folder))
    text = (DATA / "python-docs-generators-slice.txt").read_text(encoding="utf-8")
    tokens = [bundle.vocab.context_token(), *bundle.encode_spans([text])[0].ids.tolist()]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    values, ids = torch.topk(logprobs, 32, dim=-1)
    observed_ids = np.append(np.array(tokens[1:]), -1)
    observed = logprobs.gather(1, torch.tensor(np.maximum(observed_ids, 0))[:, None])[:, 0].numpy()
    observed[-1] = np.nan
    payload = _roundtrip_checks(ids.numpy(), values.numpy(), observed_ids, observed)
    assert values.numpy().min() > -20  # so the 0.01 bound is the one that applies everywhere here
    assert _tolerance(-20.0) < 0.01
    # Size on this small slice (~350 positions; LZMA starts cold): the 64 B bound is measured on
    # 20k+ positions by bench/bench_teacher.py; here only guard against a gross regression.
    assert len(payload) / len(tokens) < 80
