"""The training loop of `csd-train`: set up, then one optimizer step after another.

One optimizer step takes `grad_accum` micro-batches from the loader (prefetched, so the global
CE-token and chunk counts, all-reduced over ranks *and* micro-steps, are known before the first
forward). Each micro-step's loss pieces are divided by those global counts; the dynamic scale
sg(CE/KD) uses the all-rank CE and KD of that micro-step (exact when grad_accum is 1, see
docs/TRAINING.md). FSDP2 averages gradients over ranks, so each rank backpropagates
`world * (ce + scale * kd)` to obtain the gradient of the global loss.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import torch

from csd_pipeline.errors import CsdError
from trainer import checkpoint, distributed
from trainer.config import TrainConfig, check_resume_compatible, write_resolved
from trainer.metrics import MetricsLogger

SHAPE_KEYS = ("1to1", "1toN", "Mto1", "MtoN")
# per-teacher diagnostics of csd_pipeline.loss.csd (means over the ranks and micro-steps that had chunks)
LOSS_DIAGNOSTICS = ("events_per_chunk", "teacher_event_mass", "student_rest_mass", "divergence_per_chunk")
RESOLVED_CONFIG = "config.yaml"
EXPORT_DIR = "export"


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total` (step counts from 0)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(wrapper, config: TrainConfig):
    """AdamW (no weight decay on vectors: norms, biases) and the warm-up + cosine schedule."""
    decay = [p for p in wrapper.parameters() if p.ndim >= 2]
    no_decay = [p for p in wrapper.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
    )
    schedule = partial(lr_factor, warmup=config.warmup_steps, total=config.steps, min_ratio=config.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _param_dtype(config: TrainConfig, device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]


def _prepare_output(config: TrainConfig, ctx) -> None:
    # every rank checks (same files, same verdict: no rank waits on one that gave up), then rank 0 writes
    out = Path(config.output)
    saved = out / RESOLVED_CONFIG
    if out.exists() and not out.is_dir():
        raise CsdError(f"--output {out} is a file; pass a directory")
    if checkpoint.complete_checkpoints(out) and not config.resume:
        raise CsdError(f"{out} already holds checkpoints; pass --resume to continue that run "
                       "or choose a new --output")
    if config.resume and saved.is_file():
        from trainer.config import load_yaml

        check_resume_compatible(config, load_yaml(str(saved)), str(out))
    distributed.barrier()
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_resolved(config, str(saved))
    distributed.barrier()


def train(config: TrainConfig) -> dict:
    """Run (or resume) a training run; returns a summary dict (last metrics, paths).

    Initialises the process group (torchrun ranks, or one local rank) and tears it down.
    Raises `CsdError` for user mistakes (agreed by every rank where it matters).
    """
    ctx = distributed.setup(config.device)
    try:
        return _train(config, ctx)
    finally:
        distributed.teardown()


def build_components(config: TrainConfig, ctx):
    """The checked data, the sharded student wrapper, the optimizer and the schedule of a run."""
    from trainer.data import TrainingData
    from trainer.model import StudentWithLoss, build_student, shard_student

    data = TrainingData.open(config)
    model = build_student(config, data.student_vocab.size)
    wrapper = StudentWithLoss(model)
    shard_student(wrapper, ctx.device, _param_dtype(config, ctx.device))
    optimizer, scheduler = build_optimizer(wrapper, config)
    return data, wrapper, optimizer, scheduler


def _train(config: TrainConfig, ctx) -> dict:
    from trainer.model import export_hf

    torch.manual_seed(config.seed)
    _prepare_output(config, ctx)
    data, wrapper, optimizer, scheduler = build_components(config, ctx)

    torch.manual_seed(config.seed + 1000003 * ctx.rank)  # per-rank stream after the shared initialisation
    step, counters, loader_state = 0, {"nonfinite_skipped": 0, "tokens_seen": 0}, None
    if config.resume:
        checkpoint.clean_partial(config.output, ctx)
        resumed = checkpoint.load_checkpoint(config.output, wrapper, optimizer, ctx)
        if resumed is not None:
            step, loader_state = resumed.step, resumed.loader_state
            scheduler.load_state_dict(resumed.trainer["scheduler"])
            counters.update(resumed.trainer.get("counters", {}))

    loader = data.loader(ctx.rank, ctx.world, loader_state)
    metrics = MetricsLogger(config.output, ctx.is_main, config.steps, step, config.progress and ctx.is_main)
    if step:
        metrics.message(f"resumed from {resumed.path} at step {step}")
    weights = data.teacher_weights
    state_after = loader_state
    last: dict = {}
    evaluated_at = None
    start_time = time.perf_counter()
    last_step = min(config.steps, config.stop_at_step or config.steps)
    try:
        while step < last_step:
            step += 1
            t0 = time.perf_counter()
            micro = [next(loader) for _ in range(config.grad_accum)]
            data_wait = time.perf_counter() - t0
            state_after = micro[-1].state
            record = train_step(wrapper, optimizer, scheduler, micro, weights, config, ctx)
            counters["tokens_seen"] += record["tokens"]
            counters["nonfinite_skipped"] += int(record["skipped"])
            elapsed = time.perf_counter() - t0
            record.update(step=step, tokens_per_s=record["tokens"] / elapsed, step_time_s=elapsed,
                          data_wait_s=data_wait, elapsed_s=time.perf_counter() - start_time,
                          nonfinite_skipped=counters["nonfinite_skipped"], epoch=micro[-1].state["epoch"])
            metrics.log_step(record)
            last = record
            if config.eval_aligned and config.eval_every and step % config.eval_every == 0:
                _evaluate(wrapper, config, ctx, data, step, metrics)
                evaluated_at = step
            if (config.save_every and step % config.save_every == 0) or step == last_step:
                checkpoint.save_checkpoint(
                    config.output, step, wrapper, optimizer,
                    {"scheduler": scheduler.state_dict(), "counters": counters}, state_after, ctx,
                    config.keep_last,
                )
            if config.export_every and step % config.export_every == 0 and step != config.steps:
                export_hf(wrapper, data.student_tokenizer, Path(config.output) / f"{EXPORT_DIR}-step-{step}",
                          ctx.is_main)
        if step == config.steps:
            if config.eval_aligned and evaluated_at != step:
                _evaluate(wrapper, config, ctx, data, step, metrics)
            export_hf(wrapper, data.student_tokenizer, Path(config.output) / EXPORT_DIR, ctx.is_main)
    finally:
        metrics.close()
        loader.close()
    return {"step": step, "last": last, "output": config.output, "counters": counters}


def _evaluate(wrapper, config, ctx, data, step, metrics) -> None:
    from trainer.evaluation import bits_per_byte_fsdp

    result = bits_per_byte_fsdp(wrapper, config.eval_aligned, ctx, seq_len=config.seq_len,
                                batch_size=config.batch_size, max_rows=config.eval_max_rows,
                                student_fingerprint=data.student_vocab.fingerprint,
                                chunk_size=config.loss_chunk_size or None)
    metrics.log_eval({"step": step, **result})


def _to_device(micro, device):
    def tensor(array):
        return torch.as_tensor(array).to(device, non_blocking=True)

    return {
        "input_ids": tensor(micro.input_ids),
        "position_ids": tensor(micro.position_ids),
        "ce_positions": tensor(micro.ce_positions),
        "ce_tokens": tensor(micro.ce_tokens),
        "teachers": [events.to(device) for events in micro.teachers],
    }


def train_step(wrapper, optimizer, scheduler, micro: list, teacher_weights: list[float], config: TrainConfig,
               ctx) -> dict:
    """One optimizer step over the prefetched micro-batches; returns the step's global metrics."""
    n_teachers = len(teacher_weights)
    # Global counts over ranks and micro-steps, known before the first forward.
    local = [sum(len(m.ce_positions) for m in micro), sum(m.content_tokens for m in micro),
             sum(m.padding_tokens for m in micro)]
    for t in range(n_teachers):
        local += [sum(m.shape_counts[t][s] for m in micro) for s in range(4)]
    local.append(sum(m.windows for m in micro))
    totals = distributed.all_reduce_sum(local, ctx.device)
    rows = totals[-1]
    ce_tokens, tokens, padding = totals[0], totals[1], totals[2]
    shape_counts = [totals[3 + 4 * t: 7 + 4 * t] for t in range(n_teachers)]
    chunk_counts = [sum(c) for c in shape_counts]
    if ce_tokens <= 0:
        raise CsdError("a global batch has no student tokens to train on; check student_loss_mask in the "
                       "aligned shards (chat mode trains only the final assistant turn)")

    ce_total = kd_total = loss_total = 0.0
    teacher_kd = [0.0] * n_teachers
    diagnostics = [0.0] * (n_teachers * (len(LOSS_DIAGNOSTICS) + 1))  # sums, then how many contributed
    scales = []
    for batch in micro:
        inputs = _to_device(batch, ctx.device)
        out = wrapper(**inputs, global_ce_tokens=ce_tokens, global_chunk_counts=chunk_counts,
                      teacher_weights=teacher_weights, divergence=config.divergence, beta=config.beta,
                      teacher_temperature=config.teacher_temperature,
                      chunk_size=config.loss_chunk_size or None, loss_kind=config.loss,
                      baseline=baseline_options(config))
        pieces = [out["ce"].detach().item(), out["kd"].detach().item()]
        pieces += [float(out["metrics"].get(f"teacher{t}/kd", 0.0)) for t in range(n_teachers)]
        pieces += _diagnostics(out["metrics"], n_teachers)
        ce_m, kd_m, *rest = distributed.all_reduce_sum(pieces, ctx.device)
        kd_teachers, diag_m = rest[:n_teachers], rest[n_teachers:]
        scale = kd_scale(ce_m, kd_m, config)
        ce_weight = 1 - config.kd_weight if config.kd_scale == "ratio" else 1.0
        loss = ce_weight * out["ce"] + scale * out["kd"] if scale else ce_weight * out["ce"]
        (loss * ctx.world).backward()
        ce_total += ce_m
        kd_total += kd_m
        loss_total += ce_weight * ce_m + scale * kd_m
        scales.append(scale)
        teacher_kd = [a + b for a, b in zip(teacher_kd, kd_teachers, strict=True)]
        diagnostics = [a + b for a, b in zip(diagnostics, diag_m, strict=True)]

    grad_norm = _clip_grad_norm(wrapper, config.grad_clip)
    nonfinite = distributed.agree_any(not (math.isfinite(loss_total) and math.isfinite(grad_norm)), ctx.device)
    lr = scheduler.get_last_lr()[0]
    if not nonfinite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()

    record = {"loss": loss_total, "ce": ce_total, "kd": kd_total, "lr": lr, "grad_norm": grad_norm,
              "tokens": int(tokens), "ce_tokens": int(ce_tokens), "padding_tokens": int(padding),
              "aligned_rows": int(rows), "supervised_tokens_per_row": ce_tokens / rows if rows else 0.0,
              "skipped": bool(nonfinite)}
    for s, key in enumerate(SHAPE_KEYS):
        record[f"chunks_{key}"] = int(sum(c[s] for c in shape_counts))
    record["kd_scale"] = sum(scales) / len(scales)
    width = len(LOSS_DIAGNOSTICS) + 1
    for t in range(n_teachers):
        prefix = f"teacher{t}_" if n_teachers > 1 else ""
        if n_teachers > 1:
            record[f"teacher{t}_kd"] = teacher_kd[t]
            record[f"teacher{t}_chunks"] = int(chunk_counts[t])
        sums, count = diagnostics[t * width:t * width + width - 1], diagnostics[t * width + width - 1]
        if count:
            record.update({prefix + key: value / count for key, value in zip(LOSS_DIAGNOSTICS, sums, strict=True)})
    return record


def kd_scale(ce: float, kd: float, config: TrainConfig) -> float:
    """The KD multiplier of one micro-step from its all-rank CE and KD values.

    dynamic: w * sg(CE/KD), so that the KD term weighs w times the CE (L = CE when KD is 0);
    fixed: w; ratio: w (and CE weighs 1 - w). `--kd-weight 1` with the dynamic scale is the paper's loss.
    """
    if config.kd_scale in ("fixed", "ratio"):
        return config.kd_weight
    return config.kd_weight * ce / kd if kd != 0 and math.isfinite(kd) else 0.0


def baseline_options(config: TrainConfig) -> dict:
    """The options of the baseline losses (`csd_pipeline.loss.baselines.baseline_loss`)."""
    return {"gold_matched_weight": config.gold_matched_weight, "strict_top_k": config.strict_top_k,
            "strict_divergence": config.strict_divergence}


def _diagnostics(metrics: dict, n_teachers: int) -> list[float]:
    """Per teacher: the loss diagnostics of this rank's micro-batch and 1 (or zeros when it had no chunks)."""
    values = []
    for t in range(n_teachers):
        present = all(f"teacher{t}/{key}" in metrics for key in LOSS_DIAGNOSTICS)
        values += [float(metrics[f"teacher{t}/{key}"]) if present else 0.0 for key in LOSS_DIAGNOSTICS]
        values.append(1.0 if present else 0.0)
    return values


def _clip_grad_norm(wrapper, max_norm: float) -> float:
    """Global gradient norm (clipped to `max_norm` when > 0); works on FSDP2 DTensor gradients."""
    params = [p for p in wrapper.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
