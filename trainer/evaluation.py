"""Held-out bits per byte of the FSDP2-sharded student during training.

The scoring itself (`bits_per_byte`, `eval_batches`, content targets, packing) is the library's
(`csd_pipeline.evaluation.bits_per_byte`), shared with `csd-pipeline bits-per-byte`; here only the
collective version that every rank of a training run calls.
"""

from __future__ import annotations

import numpy as np

from csd_pipeline.evaluation.bits_per_byte import eval_batches, summary


def bits_per_byte_fsdp(wrapper, aligned_dir, ctx, *, seq_len: int, batch_size: int, max_rows: int = 0,
                       chunk_size: int = 1024, student_fingerprint: str | None = None) -> dict:
    """Bits per byte of the FSDP2-sharded student (collective: every rank calls it).

    Rows are split over ranks; ranks with fewer batches run empty ones so the collectives match.
    """
    import torch

    from csd_pipeline.loss.training import cross_entropy_only
    from csd_pipeline.runtime import progress
    from trainer import distributed

    ce_only = cross_entropy_only(chunk_size)

    batches = list(eval_batches(aligned_dir, "student", seq_len=seq_len, batch_size=batch_size,
                                max_rows=max_rows, rank=ctx.rank, world=ctx.world,
                                fingerprint=student_fingerprint))
    rounds = int(max(distributed.all_reduce_sum([0.0] * ctx.rank + [len(batches)] + [0.0] * (ctx.world - ctx.rank - 1),
                                                ctx.device)))
    nats, n_bytes, n_tokens, n_rows = 0.0, 0, 0, 0
    empty = np.zeros(0, dtype=np.int64)
    was_training = wrapper.training
    wrapper.eval()
    shown = progress.bar(rounds, "held-out", "batch", leave=False) if ctx.rank == 0 else progress.NullBar()
    with torch.no_grad(), shown:
        for i in range(rounds):
            if i < len(batches):
                packed, positions, tokens, text_bytes = batches[i]
                input_ids, position_ids = packed.input_ids, packed.position_ids
            else:
                input_ids = position_ids = np.zeros((1, 2), dtype=np.int64)
                positions, tokens, text_bytes = empty, empty, 0
            out = wrapper(torch.as_tensor(input_ids, device=ctx.device),
                          torch.as_tensor(position_ids, device=ctx.device),
                          torch.as_tensor(positions, device=ctx.device), torch.as_tensor(tokens, device=ctx.device),
                          global_ce_tokens=1.0, loss=ce_only)
            nats += float(out["ce"])  # divided by 1: the sum of -log p
            n_bytes += text_bytes
            n_tokens += len(tokens)
            n_rows += len(packed.placements) if i < len(batches) else 0
            shown.update(1)
    wrapper.train(was_training)
    nats, n_bytes, n_tokens, n_rows = distributed.all_reduce_sum([nats, n_bytes, n_tokens, n_rows], ctx.device)
    return summary(nats, int(n_bytes), int(n_tokens), int(n_rows))
