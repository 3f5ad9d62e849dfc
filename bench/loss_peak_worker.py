"""One loss forward+backward in its own process: its allocations and its time (bench_loss).

    python -m bench.loss_peak_worker --variant chunked|naive|ce --events EVENTS.npz \
        --positions P --vocab V --hidden H [--chunk-size C] [--keep-mb M] \
        [--keep-dtype float32|float16|bfloat16] [--repeats R] [--threads N] [--grad-out FILE.npz]

The inputs (last hidden states [P, H] and LM head [V, H], float32, requiring grad) are created
first. Then one forward+backward runs under `torch.profiler` with `profile_memory=True`: every
allocation and free of the step is recorded, and the peak of the bytes they hold at once (above the
inputs, gradients included) is the memory figure. It is timed as well, and `--repeats` - 1 more run
without the profiler, each timed. Prints one JSON
object: variant, peak bytes above the inputs, bytes still held after the step (the gradients), the
chunk size and kept-logits budget used, the wall and CPU time of each timed run. `--grad-out` writes
the loss and the gradients of the LM head and the hidden states (float32, .npz) for an error check
against another variant (`bench_loss.py --grad-error`).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def allocation_peak(step) -> tuple[int, int]:
    """(peak bytes held at once, bytes held at the end) of the CPU allocations `step()` makes, from
    the memory events of `torch.profiler` (each allocation and free, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak, held


def load_events(path: str):
    """(ce_positions, ce_tokens, BatchEvents) from an .npz written by bench_loss (no pickle)."""
    import numpy as np

    from csd_pipeline.events.batch import BatchEvents

    data = np.load(path, allow_pickle=False)
    fields = [
        "chain_pos", "chain_tok", "chain_chunk", "final_pos", "final_tok", "final_event",
        "event_chunk", "event_teacher_logq", "chunk_shape",
    ]
    spans = {f: data[f] if f in data else np.zeros(len(data["chunk_shape"]), dtype)  # not read by the loss
             for f, dtype in (("chunk_student_start", np.int64), ("chunk_student_len", np.int64),
                              ("chunk_teacher_loglik", np.float64))}
    events = BatchEvents(**{f: data[f] for f in fields}, **spans, stats={})
    return data["ce_positions"], data["ce_tokens"], events


def naive_loss(hidden, weight, ce_pos, ce_tok, events):
    """The textbook dense version: log_softmax over the whole [P, V] logits, then gather."""
    import torch

    from csd_pipeline.loss.csd import combine_losses, csd_divergence

    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    ce_sum = -logp[torch.as_tensor(ce_pos), torch.as_tensor(ce_tok)].sum()
    term = csd_divergence(logp[events.chain_pos, events.chain_tok], logp[events.final_pos, events.final_tok], events)
    return combine_losses(ce_sum, len(ce_pos), [term])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["chunked", "naive", "ce"], required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--positions", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--keep-mb", type=float, default=0.0, help="logits the chunked forward keeps for backward")
    parser.add_argument("--keep-dtype", default="float32", help="how the kept logits are stored")
    parser.add_argument("--grad-out", default=None, help="write the gradients to this .npz")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from csd_pipeline.loss.csd import csd_loss
    from csd_pipeline.loss.token_logprobs import auto_chunk_size

    if args.threads:
        torch.set_num_threads(args.threads)
    ce_pos, ce_tok, events = load_events(args.events)
    teachers = [] if args.variant == "ce" else [events.to("cpu", float_dtype=torch.float32)]
    g = torch.Generator().manual_seed(0)
    # In place, so that creating the inputs leaves no temporary in the baseline peak.
    hidden = torch.randn(args.positions, args.hidden, generator=g).mul_(0.05).requires_grad_(True)
    weight = torch.randn(args.vocab, args.hidden, generator=g).mul_(0.05).requires_grad_(True)
    reuse_bytes = int(args.keep_mb * (1 << 20))
    losses = []

    def step():
        hidden.grad = weight.grad = None
        if args.variant == "naive":
            out = naive_loss(hidden, weight, ce_pos, ce_tok, teachers[0])
        else:
            out = csd_loss(
                hidden=hidden, weight=weight, ce_positions=ce_pos, ce_tokens=ce_tok, teachers=teachers,
                chunk_size=args.chunk_size, reuse_bytes=reuse_bytes, reuse_dtype=args.reuse_dtype,
            )
        out.loss.backward()
        losses.append(float(out.loss.detach()))

    baseline = _peak_rss_bytes()
    start, start_cpu = time.perf_counter(), time.process_time()
    peak, held = allocation_peak(step)  # timed too: the profiler only records a few dozen large ops here
    times, cpu_times = [time.perf_counter() - start], [time.process_time() - start_cpu]
    peak_rss_step = _peak_rss_bytes() - baseline
    for _ in range(args.repeats - 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
    if args.grad_out:
        import numpy as np

        tmp = args.grad_out + ".tmp.npz"
        np.savez(tmp, loss=np.float64(losses[-1]), grad_weight=weight.grad.numpy(), grad_hidden=hidden.grad.numpy())
        Path(tmp).replace(args.grad_out)
    print(json.dumps({
        "variant": args.variant,
        "peak_above_inputs_bytes": peak,
        "held_after_step_bytes": held,
        "peak_rss_growth_bytes": peak_rss_step,  # for reference only: freed pages are reused, so it can read 0
        "inputs_bytes": (hidden.numel() + weight.numel()) * 4,
        "chunk_size": args.chunk_size or auto_chunk_size(args.vocab),
        "reuse_bytes": reuse_bytes,
        "reuse_dtype": args.reuse_dtype,
        "threads": torch.get_num_threads(),
        "seconds": times,
        "cpu_seconds": cpu_times,  # every thread's CPU time: on a shared machine it moves less than wall time
        "loss": losses[-1],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
