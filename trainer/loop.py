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
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import storage
from csd_pipeline.runtime.executor import check_output_dir
from schemas.aligned import SHAPES
from trainer import checkpoint, distributed
from trainer.config import LossConfig, OptimizerConfig, TrainConfig, check_resume_compatible, write_resolved
from trainer.metrics import MetricsLogger

# metrics.jsonl spells the shapes without a colon: chunks_1to1, chunks_1toN, chunks_Mto1, chunks_MtoN
SHAPE_KEYS = tuple(shape.replace(":", "to") for shape in SHAPES)
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


def build_optimizer(wrapper, config: OptimizerConfig):
    """AdamW (no weight decay on vectors: norms, biases) and the warm-up + cosine schedule."""
    decay = [p for p in wrapper.parameters() if p.ndim >= 2]
    no_decay = [p for p in wrapper.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
    )
    schedule = partial(lr_factor, warmup=config.warmup_steps, total=config.steps, min_ratio=config.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _prepare_output(config: TrainConfig, ctx) -> None:
    # every rank checks (same files, same verdict: no rank waits on one that gave up), then rank 0 writes
    out = storage.location(config.checkpoints.output)
    saved = out / RESOLVED_CONFIG
    resume = config.checkpoints.resume
    if out.exists() and not out.is_dir():
        raise CsdError(f"--output {out} is a file; pass a directory")
    if checkpoint.complete_checkpoints(out) and not resume:
        raise CsdError(f"{out} already holds checkpoints; pass --resume to continue that run "
                       "or choose a new --output")
    if resume and saved.is_file():
        from trainer.options import load_yaml

        check_resume_compatible(config, load_yaml(str(storage.local_file(saved))), str(out))
    check_output_dir(out)  # every rank: the same verdict (writable?), before any rank waits on another
    distributed.barrier()
    if ctx.is_main:
        if not storage.is_remote(out):
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
    from csd_pipeline.runtime.model_loading import resolve_dtype
    from trainer.data import TrainingData
    from trainer.model import build_sharded_student

    data = TrainingData.open(config)
    wrapper = build_sharded_student(config.student, config.seed, data.student_vocab.size, ctx,
                                    resolve_dtype(config.student.dtype, ctx.device), data.loss)
    optimizer, scheduler = build_optimizer(wrapper, config.optimizer)
    return data, wrapper, optimizer, scheduler


def _train(config: TrainConfig, ctx) -> dict:
    torch.manual_seed(config.seed)
    _prepare_output(config, ctx)
    data, wrapper, optimizer, scheduler = build_components(config, ctx)
    torch.manual_seed(config.seed + 1000003 * ctx.rank)  # per-rank stream after the shared initialisation
    step, counters, loader_state, resumed_from = _resume(config, ctx, wrapper, optimizer, scheduler)
    if config.evaluation.eval_tasks:
        from trainer.task_eval import check_tasks

        check_tasks(config.evaluation, ctx)

    steps, output = config.optimizer.steps, config.checkpoints.output
    loader = data.loader(ctx.rank, ctx.world, loader_state)
    metrics = MetricsLogger(output, ctx.is_main, steps, step, config.progress and ctx.is_main,
                            report_to=config.report_to, config=config.to_dict())
    if step:
        metrics.message(f"resumed from {resumed_from} at step {step}")
    last: dict = {}
    evaluated_at = None
    start_time = time.perf_counter()
    last_step = min(steps, config.checkpoints.stop_at_step or steps)
    try:
        while step < last_step:
            step += 1
            t0 = time.perf_counter()
            micro = [next(loader) for _ in range(config.optimizer.grad_accum)]
            data_wait = time.perf_counter() - t0
            record = train_step(wrapper, optimizer, scheduler, micro, data.teacher_weights, config, ctx)
            counters["tokens_seen"] += record["tokens"]
            counters["nonfinite_skipped"] += int(record["skipped"])
            elapsed = time.perf_counter() - t0
            record.update(step=step, tokens_per_s=record["tokens"] / elapsed, step_time_s=elapsed,
                          data_wait_s=data_wait, elapsed_s=time.perf_counter() - start_time,
                          nonfinite_skipped=counters["nonfinite_skipped"], epoch=micro[-1].state["epoch"])
            metrics.log_step(record)
            last = record
            evaluation = config.evaluation
            if evaluation.eval_aligned and evaluation.eval_every and step % evaluation.eval_every == 0:
                _evaluate(wrapper, config, ctx, data, step, metrics)
                evaluated_at = step
            saved = _save(config, ctx, step, step == last_step, wrapper, optimizer, scheduler, counters, micro[-1],
                          data)
            _evaluate_tasks(wrapper, config, ctx, data, step, metrics, micro[-1])
            if saved:
                metrics.sync()  # an object-store output gets the metrics files with each checkpoint
        if step == steps:
            if config.evaluation.eval_aligned and evaluated_at != step:
                _evaluate(wrapper, config, ctx, data, step, metrics)
            sample = micro[-1] if last else next(loader)  # a real batch for the export's check
            export(wrapper, config, ctx, data, storage.location(output) / EXPORT_DIR, sample)
            _evaluate_tasks(wrapper, config, ctx, data, step, metrics, sample, final=True)
    finally:
        metrics.close()
        loader.close()
    return {"step": step, "last": last, "output": output, "counters": counters}


def _resume(config: TrainConfig, ctx, wrapper, optimizer, scheduler) -> tuple[int, dict, dict | None, Path | None]:
    """(step, run counters, this rank's loader state, checkpoint folder) restored from the latest checkpoint
    with `--resume`; the start of the run otherwise."""
    counters = {"nonfinite_skipped": 0, "tokens_seen": 0}
    if not config.checkpoints.resume:
        return 0, counters, None, None
    checkpoint.clean_partial(config.checkpoints.output, ctx)
    resumed = checkpoint.load_checkpoint(config.checkpoints.output, wrapper, optimizer, ctx)
    if resumed is None:
        return 0, counters, None, None
    scheduler.load_state_dict(resumed.trainer["scheduler"])
    counters.update(resumed.trainer.get("counters", {}))
    return resumed.step, counters, resumed.loader_state, resumed.path


def _save(config: TrainConfig, ctx, step: int, final: bool, wrapper, optimizer, scheduler, counters: dict,
          batch, data) -> bool:
    """The checkpoint (every `--save-every` steps and at the last step of this process) and `--export-every` export
    (`batch`: the step's last micro-batch, its loader state and the export check's real batch). True when a
    checkpoint was written."""
    options = config.checkpoints
    skip_final = final and step == config.optimizer.steps and not options.save_final
    saved = bool((options.save_every and step % options.save_every == 0) or final) and not skip_final
    if saved:
        checkpoint.save_checkpoint(
            options.output, step, wrapper, optimizer, {"scheduler": scheduler.state_dict(), "counters": counters},
            batch.state, ctx, options.save_total_limit,
        )
    if options.export_every and step % options.export_every == 0 and step != config.optimizer.steps:
        export(wrapper, config, ctx, data, storage.location(options.output) / f"{EXPORT_DIR}-step-{step}", batch)
    return saved


def export(wrapper, config: TrainConfig, ctx, data, folder: Path, sample) -> None:
    """The checked HF export of the student into `folder` (`trainer.export.export_hf`; collective)."""
    from trainer.export import export_hf, student_model_folder

    export_hf(wrapper, data.student_tokenizer, folder, ctx, sample=sample,
              student_folder=student_model_folder(config.student), fingerprint=data.student_vocab.fingerprint)


def _evaluate_tasks(wrapper, config: TrainConfig, ctx, data, step: int, metrics, batch, final: bool = False) -> None:
    """`--eval-tasks` on the export of `step` (`trainer.task_eval`): the final export at the end, else the
    `--export-every` one of this step or a scratch export written for it (`batch`: its check's real batch)."""
    from trainer import task_eval

    options, output = config.evaluation, Path(config.checkpoints.output)
    if not (options.eval_tasks and (final or task_eval.due(options, step, config.optimizer.steps))):
        return
    every = config.checkpoints.export_every
    if final:
        folder = output / EXPORT_DIR
    elif every and step % every == 0:
        folder = output / f"{EXPORT_DIR}-step-{step}"   # `_save` has just written it
    else:
        folder = output / task_eval.SCRATCH_EXPORT
        export(wrapper, config, ctx, data, folder, batch)
    record = task_eval.evaluate_export(folder, options, output, step, config.device, ctx)
    if record is not None:
        metrics.log_tasks(record)


def _evaluate(wrapper, config: TrainConfig, ctx, data, step: int, metrics) -> None:
    from trainer.evaluation import bits_per_byte_fsdp

    result = bits_per_byte_fsdp(wrapper, config.evaluation.eval_aligned, ctx, seq_len=config.data.seq_len,
                                batch_size=config.data.batch_size, max_rows=config.evaluation.eval_max_rows,
                                student_fingerprint=data.student_vocab.fingerprint,
                                chunk_size=config.loss.loss_chunk_size or None)
    teacher = config.evaluation.eval_teacher_bits_per_byte
    if teacher is not None:
        result["teacher_bits_per_byte"] = teacher
    metrics.log_eval({"step": step, **result})
    if teacher is not None and result["bits_per_byte"] < teacher:
        metrics.message(
            f"warning: at step {step} the student's held-out bits per byte ({result['bits_per_byte']:.4f}) is below the "
            f"teacher's ({teacher:.4f}): the KD term now pulls it toward a worse model; lower --kd-weight or stop here "
            "(docs/TRAINING.md)")


def to_device(micro, device):
    """One micro-batch's arrays as tensors on `device` (non-blocking copies)."""
    def tensor(array):
        return torch.as_tensor(array).to(device, non_blocking=True)

    return {
        "input_ids": tensor(micro.input_ids),
        "position_ids": tensor(micro.position_ids),
        "ce_positions": tensor(micro.ce_positions),
        "ce_tokens": tensor(micro.ce_tokens),
        "teachers": [events.to(device) for events in micro.teachers],
    }


@dataclass
class StepCounts:
    """What one optimizer step holds over all ranks and micro-steps, all-reduced before the first forward."""

    ce_tokens: float      # CE targets: the CE term is divided by this
    tokens: float         # content tokens
    padding: float        # padding tokens of the packed rows
    rows: float           # aligned rows (windows)
    shapes: list          # per teacher: accepted KD chunks per shape (SHAPES order)

    @property
    def chunks(self) -> list[float]:
        """Per teacher: accepted KD chunks (each teacher's KD term is divided by its count)."""
        return [sum(c) for c in self.shapes]

    @classmethod
    def all_reduce(cls, micro: list, n_teachers: int, device) -> StepCounts:
        local = [sum(len(m.ce_positions) for m in micro), sum(m.content_tokens for m in micro),
                 sum(m.padding_tokens for m in micro), sum(m.windows for m in micro)]
        for t in range(n_teachers):
            local += [sum(m.shape_counts[t][s] for m in micro) for s in range(len(SHAPES))]
        totals = distributed.all_reduce_sum(local, device)
        width = len(SHAPES)
        shapes = [totals[4 + width * t: 4 + width * (t + 1)] for t in range(n_teachers)]
        return cls(totals[0], totals[1], totals[2], totals[3], shapes)


def train_step(wrapper, optimizer, scheduler, micro: list, teacher_weights: list[float], config: TrainConfig,
               ctx) -> dict:
    """One optimizer step over the prefetched micro-batches; returns the step's global metrics."""
    counts = StepCounts.all_reduce(micro, len(teacher_weights), ctx.device)
    if counts.ce_tokens <= 0:
        raise CsdError("a global batch has no student tokens to train on; check student_loss_mask in the "
                       "aligned shards (chat mode trains only the final assistant turn)")
    sums = _forward_backward(wrapper, micro, counts, teacher_weights, config.loss, ctx)
    grad_norm = _clip_grad_norm(wrapper, config.optimizer.grad_clip)
    nonfinite = distributed.agree_any(not (math.isfinite(sums["loss"]) and math.isfinite(grad_norm)), ctx.device)
    lr = scheduler.get_last_lr()[0]
    if not nonfinite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return _step_record(counts, sums, lr=lr, grad_norm=grad_norm, skipped=nonfinite,
                        select=config.loss.kd_combine == "select")


def _forward_backward(wrapper, micro: list, counts: StepCounts, teacher_weights: list[float], loss: LossConfig,
                      ctx) -> dict:
    """Forward and backward of every micro-batch; returns the all-rank sums of the step's loss pieces."""
    n_teachers = len(teacher_weights)
    sums = {"ce": 0.0, "kd": 0.0, "loss": 0.0, "scales": [], "teacher_kd": [0.0] * n_teachers,
            # per teacher: the LOSS_DIAGNOSTICS sums, then how many micro-steps contributed
            "diagnostics": [0.0] * (n_teachers * (len(LOSS_DIAGNOSTICS) + 1))}
    for batch in micro:
        out = wrapper(**to_device(batch, ctx.device), global_ce_tokens=counts.ce_tokens,
                      global_chunk_counts=wrapper.loss.kd_denominators(counts.chunks), teacher_weights=teacher_weights)
        pieces = [out["ce"].detach().item(), out["kd"].detach().item()]
        pieces += [float(out["metrics"].get(f"teacher{t}/kd", 0.0)) for t in range(n_teachers)]
        pieces += _diagnostics(out["metrics"], n_teachers)
        ce_m, kd_m, *rest = distributed.all_reduce_sum(pieces, ctx.device)
        scale = kd_scale(ce_m, kd_m, loss)
        ce_weight = 1 - loss.kd_weight if loss.kd_scale == "ratio" else 1.0
        step_loss = ce_weight * out["ce"] + scale * out["kd"] if scale else ce_weight * out["ce"]
        (step_loss * ctx.world).backward()
        sums["ce"] += ce_m
        sums["kd"] += kd_m
        sums["loss"] += ce_weight * ce_m + scale * kd_m
        sums["scales"].append(scale)
        sums["teacher_kd"] = [a + b for a, b in zip(sums["teacher_kd"], rest[:n_teachers], strict=True)]
        sums["diagnostics"] = [a + b for a, b in zip(sums["diagnostics"], rest[n_teachers:], strict=True)]
    return sums


def _step_record(counts: StepCounts, sums: dict, *, lr: float, grad_norm: float, skipped: bool,
                 select: bool = False) -> dict:
    """The metrics.jsonl record of one step (without the timing fields the loop adds); with `select`
    (`--kd-combine select`) each teacher's share of the kept chunks too."""
    rows = counts.rows
    record = {"loss": sums["loss"], "ce": sums["ce"], "kd": sums["kd"], "lr": lr, "grad_norm": grad_norm,
              "tokens": int(counts.tokens), "ce_tokens": int(counts.ce_tokens), "padding_tokens": int(counts.padding),
              "aligned_rows": int(rows), "supervised_tokens_per_row": counts.ce_tokens / rows if rows else 0.0,
              "skipped": bool(skipped)}
    for s, key in enumerate(SHAPE_KEYS):
        record[f"chunks_{key}"] = int(sum(c[s] for c in counts.shapes))
    record["kd_scale"] = sum(sums["scales"]) / len(sums["scales"])
    n_teachers = len(counts.shapes)
    width = len(LOSS_DIAGNOSTICS) + 1
    for t in range(n_teachers):
        prefix = f"teacher{t}_" if n_teachers > 1 else ""
        if n_teachers > 1:
            record[f"teacher{t}_kd"] = sums["teacher_kd"][t]
            record[f"teacher{t}_chunks"] = int(counts.chunks[t])
            if select:
                record[f"teacher{t}_share"] = counts.chunks[t] / sum(counts.chunks) if sum(counts.chunks) else 0.0
        diagnostics = sums["diagnostics"][t * width:(t + 1) * width]
        if diagnostics[-1]:
            record.update({prefix + key: value / diagnostics[-1]
                           for key, value in zip(LOSS_DIAGNOSTICS, diagnostics[:-1], strict=True)})
    return record


def kd_scale(ce: float, kd: float, config: LossConfig) -> float:
    """The KD multiplier of one micro-step from its all-rank CE and KD values.

    dynamic: w * sg(CE/KD), so that the KD term weighs w times the CE (L = CE when KD is 0);
    fixed: w; ratio: w (and CE weighs 1 - w). `--kd-weight 1` with the dynamic scale is the paper's loss.
    """
    if config.kd_scale in ("fixed", "ratio"):
        return config.kd_weight
    return config.kd_weight * ce / kd if kd != 0 and math.isfinite(kd) else 0.0


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
