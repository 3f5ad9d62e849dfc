"""Packed rows: the loss of a packed batch equals the sum over the same windows run one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from csd_pipeline.errors import CsdError
from csd_pipeline.evaluation.packing import check_window_length, pack, plan_rows
from csd_pipeline.events.batch import ce_targets
from csd_pipeline.fixtures.names import tokenizer_path
from csd_pipeline.vocab.vocabulary import load_tokenizer
from trainer.config import LossConfig
from trainer.model import StudentWithLoss

DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def windows():
    """Real windows: llama-spm tokens of real text, each starting with the BOS context token."""
    bundle = load_tokenizer(str(tokenizer_path("llama-spm")))
    text = (DATA / "botchan-slice.txt").read_text(encoding="utf-8")
    cuts = np.cumsum([0, 300, 90, 500, 40, 220, 150, 400])
    pieces = [text[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    bos = bundle.vocab.roles["bos"]
    out = []
    for encoded in bundle.encode_spans(pieces):
        ids = np.concatenate([[bos], encoded.ids]).astype(np.int64)
        mask = np.ones(len(ids), dtype=bool)
        mask[0] = False
        out.append((ids, mask))
    return out


def tiny_llama(attn: str, vocab_size: int = 32000) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def token_logprobs(model, input_ids, position_ids, positions, tokens):
    logits = model(input_ids=torch.as_tensor(input_ids), position_ids=torch.as_tensor(position_ids),
                   use_cache=False).logits  # a cache disables packed-sequence masking
    flat = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
    return flat[torch.as_tensor(positions), torch.as_tensor(tokens)]


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_packed_loss_equals_sum_of_unpacked(windows, attn):
    model = tiny_llama(attn)
    seq_len, batch_size = 256, 3
    lengths = [len(ids) for ids, _ in windows]
    placements, used = plan_rows(lengths, seq_len, batch_size)
    assert used >= 4 and len({p.row for p in placements}) < used  # rows really hold several windows
    chosen = windows[:used]
    packed = pack([ids for ids, _ in chosen], placements, seq_len, batch_size)
    positions, tokens = ce_targets([i for i, _ in chosen], [m for _, m in chosen], packed.flat_offsets)
    with torch.no_grad():
        packed_lp = token_logprobs(model, packed.input_ids, packed.position_ids, positions, tokens)
        single_lp = []
        for ids, mask in chosen:
            p, t = ce_targets([ids], [mask], [0])
            single_lp.append(token_logprobs(model, ids[None], np.arange(len(ids))[None], p, t))
        single_lp = torch.cat(single_lp)
        # independent reference: each window alone, float64 (eager's softmax runs in float32)
        atol = 1e-10 if attn == "sdpa" else 1e-6
        torch.testing.assert_close(packed_lp, single_lp, rtol=0, atol=atol)
        assert abs(float(-packed_lp.sum() - -single_lp.sum())) < atol * len(tokens)
        if attn == "eager":
            return  # the rest does not depend on the attention kernel
        # the same through the training wrapper (decoder body + chunked LM-head loss)
        out = StudentWithLoss(model, LossConfig(loss="ce", loss_chunk_size=100).build())(
            torch.as_tensor(packed.input_ids), torch.as_tensor(packed.position_ids), torch.as_tensor(positions),
            torch.as_tensor(tokens), global_ce_tokens=1.0)
        assert abs(float(out["ce"]) - float(-single_lp.sum())) < atol * len(tokens)
        # control: without restarting positions, windows see each other and the loss changes
        running = np.tile(np.arange(seq_len), (batch_size, 1))
        leaky = token_logprobs(model, packed.input_ids, running, positions, tokens)
        assert abs(float(leaky.sum() - single_lp.sum())) > 1e-3


def test_plan_is_greedy_and_stops_before_a_window_that_does_not_fit():
    placements, used = plan_rows([5, 4, 3, 6, 2, 9], seq_len=10, batch_size=2)
    assert [(p.row, p.start, p.length) for p in placements] == [(0, 0, 5), (0, 5, 4), (1, 0, 3), (1, 3, 6)]
    assert used == 4  # the window of 2 would start a third row: it opens the next batch
    packed = pack([np.arange(n) + 1 for n in (5, 4, 3, 6)], placements, 10, 2, pad_id=0)
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
    assert packed.position_ids[1].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0]
    assert packed.content_tokens == 18 and packed.flat_offsets.tolist() == [0, 5, 10, 13]


def test_window_longer_than_seq_len_names_both_options():
    with pytest.raises(CsdError, match=r"--seq-len 8.*--max-student-tokens"):
        check_window_length(9, 8, "botchan.txt:0:0")
