"""Gradient error of the chunked loss per kept-logits dtype, against the same path in float64 (bench_loss).

    python -m bench.bench_loss --grad-error P H

CE + CSD of real llama-bpe / qwen2 events (teacher top-32, as in the memory benchmark) from hidden
states [P, H] and an LM head [V, H] drawn as in `loss_peak_worker.py` (N(0, 0.05^2) each), once
as drawn (logits with a standard deviation of about 0.05^2 sqrt(H): a near-uniform softmax, the
worst case for 16-bit log-probabilities, whose error grows with the entropy) and once with the
hidden states scaled 100x (a peaked softmax). Every variant keeps all of its chunks (except
"none", which recomputes them), so the error is the representation's. Prints one JSON object:
per case, the mean softmax entropy in nats and, per variant, the relative errors of the LM head's
and the hidden states' gradients: Frobenius norm of the error over that of the float64 gradient
(`*_fro`) and the largest element error over the largest float64 gradient element (`*_max`).
"""

from __future__ import annotations

from pathlib import Path

VARIANTS = {"none_kept": (0, "float32"), "float32_kept": (1 << 40, "float32"),
            "float16_kept": (1 << 40, "float16"), "bfloat16_kept": (1 << 40, "bfloat16")}
HIDDEN_SCALES = {"near_uniform": 1.0, "peaked": 100.0}


def _gradients(hidden, weight, arrays, events, reuse_bytes: int, reuse_dtype: str):
    from csd_pipeline.loss.csd import csd_loss

    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = csd_loss(hidden=h, weight=w, ce_positions=arrays["ce_positions"], ce_tokens=arrays["ce_tokens"],
                   teachers=[events.to("cpu", float_dtype=hidden.dtype)], reuse_bytes=reuse_bytes, reuse_dtype=reuse_dtype)
    out.loss.backward()
    return w.grad.double(), h.grad.double()


def _relative_errors(got, ref) -> dict:
    diff = got - ref
    return {"fro": float(diff.norm() / ref.norm()), "max": float(diff.abs().max() / ref.abs().max())}


def gradient_errors(positions: int, hidden_size: int, vocab: int) -> dict:
    """{case: {"mean_entropy_nats", variant: {lm_head_fro, lm_head_max, hidden_fro, hidden_max}}}."""
    import tempfile

    import numpy as np
    import torch

    from bench.bench_loss import build_events
    from bench.loss_peak_worker import load_events

    arrays, info = build_events(positions, quick=False)
    tokens = info["tokens"]
    with tempfile.TemporaryDirectory(prefix="loss-grad-error-") as tmp:
        path = str(Path(tmp) / "events.npz")
        np.savez(path, **arrays)
        _, _, events = load_events(path)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).mul_(0.05)
    weight = torch.randn(vocab, hidden_size, generator=g).mul_(0.05)
    result = {"positions": tokens, "hidden": hidden_size, "vocab": vocab}
    for case, scale in HIDDEN_SCALES.items():
        h = hidden * scale
        logp = torch.log_softmax(h @ weight.T, dim=-1)
        entry = {"mean_entropy_nats": float(-(logp.exp() * logp).sum(-1).mean())}
        del logp
        ref_w, ref_h = _gradients(h.double(), weight.double(), arrays, events, 0, "float32")
        for name, (reuse_bytes, reuse_dtype) in VARIANTS.items():
            got_w, got_h = _gradients(h, weight, arrays, events, reuse_bytes, reuse_dtype)
            err_w, err_h = _relative_errors(got_w, ref_w), _relative_errors(got_h, ref_h)
            entry[name] = {"lm_head_fro": err_w["fro"], "lm_head_max": err_w["max"],
                           "hidden_fro": err_h["fro"], "hidden_max": err_h["max"]}
        result[case] = entry
    return result
