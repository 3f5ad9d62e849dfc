"""Held-out bits per byte of the FSDP2-sharded student during training.

The scoring itself (`bits_per_byte`, `HeldOutRows`, content targets, packing, the per-source sums) is the
library's (`csd_pipeline.evaluation`), shared with `csd-pipeline bits-per-byte`; here only the collective
version that every rank of a training run calls.
"""

from __future__ import annotations

import numpy as np

from csd_pipeline.evaluation.bits_per_byte import HeldOutRows, summary


def bits_per_byte_fsdp(wrapper, aligned_dir, ctx, *, seq_len: int, batch_size: int, max_rows: int = 0,
                       chunk_size: int = 1024, student_fingerprint: str | None = None) -> dict:
    """Bits per byte of the FSDP2-sharded student (collective: every rank calls it), overall and per source
    (`summary`'s "sources").

    Rows are split over ranks; ranks with fewer batches run empty ones so the collectives match.
    """
    import torch

    from csd_pipeline.evaluation.per_source import TOKEN_LOGPROBS, SourceTally, token_scores
    from csd_pipeline.runtime import progress
    from trainer import distributed

    scores = token_scores(chunk_size)
    held_out = HeldOutRows(aligned_dir, "student", max_rows=max_rows, fingerprint=student_fingerprint)
    batches = list(held_out.batches(seq_len=seq_len, batch_size=batch_size, rank=ctx.rank, world=ctx.world))
    tally = SourceTally(held_out.sources)
    rounds = int(max(distributed.all_reduce_sum([0.0] * ctx.rank + [len(batches)] + [0.0] * (ctx.world - ctx.rank - 1),
                                                ctx.device)))
    nats, n_bytes, n_tokens, n_rows = 0.0, 0, 0, 0
    empty = np.zeros(0, dtype=np.int64)
    was_training = wrapper.training
    wrapper.eval()
    shown = progress.bar(rounds, "held-out", "batch", leave=False) if ctx.rank == 0 else progress.NullBar()
    with torch.no_grad(), shown:
        for i in range(rounds):
            batch = batches[i] if i < len(batches) else None
            if batch is not None:
                input_ids, position_ids = batch.packed.input_ids, batch.packed.position_ids
                positions, tokens = batch.positions, batch.tokens
            else:
                input_ids = position_ids = np.zeros((1, 2), dtype=np.int64)
                positions, tokens = empty, empty
            out = wrapper(torch.as_tensor(input_ids, device=ctx.device),
                          torch.as_tensor(position_ids, device=ctx.device),
                          torch.as_tensor(positions, device=ctx.device), torch.as_tensor(tokens, device=ctx.device),
                          global_ce_tokens=1.0, loss=scores)
            nats += float(out["ce"])  # divided by 1: the sum of -log p
            if batch is not None:
                tally.add(batch, out["metrics"][TOKEN_LOGPROBS].double().cpu().numpy())
                n_bytes += batch.text_bytes
                n_tokens += len(tokens)
                n_rows += len(batch.packed.placements)
            shown.update(1)
    wrapper.train(was_training)
    nats, n_bytes, n_tokens, n_rows, *per_source = distributed.all_reduce_sum(
        [nats, n_bytes, n_tokens, n_rows, *tally.flat()], ctx.device)
    tally.load(per_source)
    return summary(nats, int(n_bytes), int(n_tokens), int(n_rows), tally.by_source())
