"""`teacher-logits --tail-samples`: the draws from the rest of a distribution, against float64 brute force.

The stage's end-to-end test (the tiny teacher, its float64 reference forward) is in test_stage.py; here
the two steps on logits whose probabilities are known exactly: the estimates are unbiased for every
id of the tail, nothing kept, observed or padded is ever drawn, and a block encodes and decodes with
every observed value exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from csd_pipeline.teacher.store.codec import MAX_ABS_ERROR, decode_block, encode_block
from csd_pipeline.teacher.store.selectors.tail_samples import block_seed, draw_tail, merge_tail

VOCAB, OUTPUTS, K, DRAWS = 40, 44, 6, 8  # 4 padded output rows beyond the tokenizer's 40 ids


def softmax_chunk(logits64: np.ndarray, next_ids: np.ndarray):
    """What the runner holds of a chunk of positions (torch, float32 logits [P, OUTPUTS]): the top-K values and ids,
    exp(logit - peak), its sum, the normaliser, the next ids and the observed log-probs (NaN where none)."""
    import torch

    logits = torch.from_numpy(logits64.astype(np.float32))
    values, indices = torch.topk(logits[:, :VOCAB], K, dim=-1)
    peak = logits.amax(dim=-1)
    weights = (logits - peak[:, None]).exp()
    total = weights.sum(dim=-1)
    lse = peak + torch.log(total)
    nxt = torch.from_numpy(next_ids)
    observed = (logits.gather(1, nxt.clamp(min=0)[:, None])[:, 0] - lse).numpy()
    observed[next_ids < 0] = np.nan
    return values, indices, weights, total, lse, nxt, observed


def sample(logits64: np.ndarray, kept: np.ndarray, next_ids: np.ndarray, seed: int):
    """draw_tail + merge_tail as the runner calls them, on float32 logits [P, OUTPUTS]."""
    import torch

    values, indices, weights, total, lse, nxt, observed = softmax_chunk(logits64, next_ids)
    draws, log_tail = draw_tail(weights, indices, torch.from_numpy(kept), nxt, total, DRAWS,
                                torch.Generator().manual_seed(seed), VOCAB)
    ids, logprobs, lengths = merge_tail(indices.numpy(), (values - lse[:, None]).numpy(), kept, draws.numpy(),
                                        log_tail.numpy(), next_ids, observed)
    return ids, logprobs, lengths, observed


def reference(logits64: np.ndarray) -> np.ndarray:
    shifted = logits64 - logits64.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@pytest.fixture(scope="module")
def positions():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(5, OUTPUTS)) * 2.0
    logits[:, VOCAB:] += 1.0  # padded rows hold real mass: in the normaliser, never drawn
    logits[4, 3] = 30.0  # a peaked position: its tail holds ~1e-12
    kept = np.array([1, 3, K, 2, 1])
    top = np.argsort(-logits[:, :VOCAB], axis=1)
    next_ids = np.array([top[0, 1], top[1, 0], -1, top[3, 20], top[4, 9]])  # 2nd (kept: 1st), kept, none, deep, peaked
    return logits, kept, next_ids


@pytest.mark.slow  # ~2 s: the fast tier keeps its budget; the other tests here run the same two steps
def test_estimates_are_unbiased_for_every_tail_id(positions):
    """Over 3,000 independent repetitions of each position (one call on the positions tiled 3,000 times: each
    position draws from its own row), the mean stored probability of every tail id is its float64 probability
    (within 5 standard errors); kept entries hold their own values, and the kept, observed and padded ids are
    never drawn; the stored ids of a position are distinct."""
    logits, kept, next_ids = positions
    exact = np.exp(reference(logits))
    order = np.argsort(-logits[:, :VOCAB], axis=1)
    runs, n_pos = 3000, len(logits)
    ids, logprobs, lengths, _ = sample(np.tile(logits, (runs, 1)), np.tile(kept, runs), np.tile(next_ids, runs), 0)
    width = ids.shape[1]
    ids, logprobs = ids.reshape(runs, n_pos, width), logprobs.reshape(runs, n_pos, width)
    stored = np.arange(width)[None, None, :] < lengths.reshape(runs, n_pos, 1)
    assert np.all(ids[stored] < VOCAB)
    ordered = np.sort(np.where(stored, ids, -1 - np.arange(width)[None, None, :]), axis=2)
    assert np.all(ordered[:, :, 1:] != ordered[:, :, :-1])  # the stored ids of a position are distinct
    total = np.zeros((n_pos, OUTPUTS))
    for t in range(n_pos):
        top = order[t, :kept[t]]
        is_top = np.isin(ids[:, t], top) & stored[:, t]
        assert np.all(is_top.sum(axis=1) == kept[t])
        assert np.all(np.abs(logprobs[:, t][is_top] - np.log(exact[t, ids[:, t][is_top]])) < 1e-5)
        drawn = stored[:, t] & ~np.isin(ids[:, t], top) & (ids[:, t] != next_ids[t])
        np.add.at(total[t], ids[:, t][drawn], np.exp(logprobs[:, t][drawn].astype(np.float64)))
    for t in range(n_pos):
        tail = np.ones(OUTPUTS, dtype=bool)
        tail[order[t, :kept[t]]] = False
        tail[VOCAB:] = False
        if next_ids[t] >= 0:
            tail[next_ids[t]] = False
        mass = exact[t, tail].sum()
        mean = total[t] / runs
        assert np.all(mean[~tail] == 0)  # kept, observed and padded ids: never drawn
        p = exact[t, tail]
        standard_error = np.sqrt(mass * p * (1 - p / mass) / DRAWS / runs)
        assert np.all(np.abs(mean[tail] - p) <= 5 * standard_error + 1e-9 * mass), (t, np.abs(mean[tail] - p).max())


def test_a_block_with_draws_decodes_every_observed_value_exactly(positions):
    """The observed token is stored as an entry where its value lies above the least likely stored one, so the
    decoded observed values are within the grid's error everywhere (without that rule a drawn estimate below it
    would clamp the observed gap); entries decode to their stored values, most likely first."""
    logits, kept, next_ids = positions
    top = np.argsort(-logits[:, :VOCAB], axis=1)
    forced = 0
    for seed in range(50):
        ids, logprobs, lengths, observed = sample(logits, kept, next_ids, seed)
        decoded = decode_block(encode_block(ids, logprobs, next_ids, np.nan_to_num(observed), lengths), next_ids >= 0)
        for t in range(len(logits)):
            n = int(lengths[t])
            np.testing.assert_array_equal(np.sort(decoded.ids[t, :n]), np.sort(ids[t, :n]))
            assert np.all(np.abs(np.sort(decoded.logprobs[t, :n]) - np.sort(logprobs[t, :n])) <= MAX_ABS_ERROR + 1e-6)
            if next_ids[t] >= 0:
                assert abs(decoded.observed[t] - observed[t]) <= MAX_ABS_ERROR + 1e-6, (seed, t)
            forced += bool(next_ids[t] >= 0 and next_ids[t] in ids[t, :n] and next_ids[t] not in top[t, :kept[t]])
    assert forced > 0  # the rule was needed on some seed


def test_block_seeds_differ_by_seed_and_row():
    assert block_seed(0, "a") == block_seed(0, "a")
    assert len({block_seed(0, "a"), block_seed(1, "a"), block_seed(0, "b")}) == 3
    assert 0 <= block_seed(123, "row") < 1 << 63


def test_the_selector_draws_as_the_two_steps_do(positions):
    """`TailSamples.cut` on a chunk (its entries and `Distribution`) stores what draw_tail + merge_tail store with
    the same generator; it declares estimated values (not exact) and k + N + 1 entries, and needs the forward."""
    import torch

    from csd_pipeline.teacher.store.selectors import Distribution, Entries, TailSamples, chain_from_config

    logits64, kept, next_ids = positions
    chain = chain_from_config({"top_k": K, "tail_samples": DRAWS, "sample_seed": 3})
    selector = chain.selectors[-1]
    assert chain.names == ["top-k", "tail-samples"] and selector == TailSamples(DRAWS, 3) and not selector.exact
    assert chain.width == K + DRAWS + 1 and chain.first_inexact() is selector and "--tail-samples" in selector.inexact
    assert selector.identity() == {"tail_samples": DRAWS, "sample_seed": 3}
    assert selector.metadata() == {b"csd.tail_samples": str(DRAWS).encode()}
    assert chain.block_seed("row") == block_seed(3, "row") != chain.block_seed("other")
    values, indices, weights, total, lse, nxt, observed = softmax_chunk(logits64, next_ids)
    entries = Entries(indices.numpy().astype(np.int32), (values - lse[:, None]).numpy(), kept.astype(np.int64),
                      observed, next_ids)
    with pytest.raises(ValueError, match="whole distribution"):
        selector.cut(entries, None)
    distribution = Distribution(weights, total, indices, nxt, VOCAB, torch.Generator().manual_seed(5))
    cut = selector.cut(entries, distribution)
    ids, logprobs, lengths, _ = sample(logits64, kept, next_ids, 5)
    np.testing.assert_array_equal(cut.ids, ids)
    np.testing.assert_array_equal(cut.logprobs, logprobs)
    np.testing.assert_array_equal(cut.lengths, lengths)


SERVED = 16  # a served teacher's --server-top-k: the entries it returns per position (K < SERVED < VOCAB)


def test_served_draws_are_unbiased_among_the_servers_entries_and_drop_the_rest(positions):
    """A served teacher returns its SERVED most likely entries (float64 values here) and the tail is drawn among
    them (`ServedTop`, `draw_served_tail`): over 3,000 repetitions the mean stored probability of every id among
    them that is neither kept nor observed is its float64 probability (within 5 standard errors), no id beyond them
    is ever stored, and the share of dropped draws is the mass beyond them over the tail's (5 standard errors)."""
    import torch

    from csd_pipeline.teacher.store.selectors import Entries, ServedTop, TailSamples

    logits, kept, next_ids = positions
    exact = reference(logits)  # the whole-output normaliser, as a server's log-probabilities have it
    order = np.argsort(-logits[:, :VOCAB], axis=1, kind="stable")
    runs, n_pos = 3000, len(logits)
    served_ids = np.tile(order[:, :SERVED], (runs, 1))
    served_lp = np.take_along_axis(np.tile(exact, (runs, 1)), served_ids, axis=1)
    observed = np.array([exact[t, next_ids[t]] if next_ids[t] >= 0 else np.nan for t in range(n_pos)])
    nxt, obs = np.tile(next_ids, runs), np.tile(observed, runs)
    entries = Entries(served_ids[:, :K].astype(np.int32), served_lp[:, :K].astype(np.float32), np.tile(kept, runs),
                      obs.astype(np.float32), nxt)
    top = ServedTop(served_ids, served_lp, obs, nxt, torch.Generator().manual_seed(0))
    cut = TailSamples(DRAWS).cut(entries, top)
    ids, logprobs = cut.ids.reshape(runs, n_pos, -1), cut.logprobs.reshape(runs, n_pos, -1)
    stored = np.arange(ids.shape[2])[None, None, :] < cut.lengths.reshape(runs, n_pos, 1)
    p = np.exp(exact)
    for t in range(n_pos):
        kept_ids, among = order[t, :kept[t]], order[t, :SERVED]
        drawn = stored[:, t] & ~np.isin(ids[:, t], kept_ids) & (ids[:, t] != next_ids[t])
        assert np.all(np.isin(ids[:, t][drawn], among))  # nothing beyond the server's entries
        total = np.zeros(OUTPUTS)
        np.add.at(total, ids[:, t][drawn], np.exp(logprobs[:, t][drawn].astype(np.float64)))
        tail = np.isin(np.arange(OUTPUTS), among) & ~np.isin(np.arange(OUTPUTS), kept_ids)
        observed_p = 0.0
        if next_ids[t] >= 0:
            tail[next_ids[t]] = False
            observed_p = 0.0 if next_ids[t] in kept_ids else p[t, next_ids[t]]
        mass = 1.0 - p[t, kept_ids].sum() - observed_p  # the padded rows' mass too: beyond the server's entries
        standard_error = np.sqrt(mass * p[t, tail] * (1 - p[t, tail] / mass) / DRAWS / runs)
        assert np.all(np.abs(total[tail] / runs - p[t, tail]) <= 5 * standard_error + 1e-9 * mass), t
        # the draws that fell beyond: DRAWS * runs trials of probability (mass beyond) / mass
        counts = np.rint(np.exp(logprobs[:, t][drawn].astype(np.float64)) * DRAWS / mass).sum()
        beyond = 1.0 - p[t, tail].sum() / mass
        dropped = 1.0 - counts / (DRAWS * runs)
        assert abs(dropped - beyond) <= 5 * np.sqrt(beyond * (1 - beyond) / DRAWS / runs) + 1e-9, t
