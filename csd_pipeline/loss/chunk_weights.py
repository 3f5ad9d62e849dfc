"""`--kd-chunk-weight advantage`: weigh each chunk's KD term by how much better the teacher predicts its text.

For a chunk c, with log p_T(c) the teacher's log-probability of the chunk's observed teacher tokens (from the
store) and log p_S(c) the student's of its observed student tokens (from this step's logits, detached: a
weight, never a gradient path), the advantage a_c = log p_T(c) - log p_S(c) is how many nats the teacher is
ahead on the chunk's text. Its KD term is multiplied by

    w_c = clamp(a_c / s, 0, w_max)        s = --kd-chunk-weight-scale (nats), w_max = --kd-chunk-weight-max

so chunks the student already predicts as well as the teacher get no KD, and the KD signal goes where the
teacher knows more (issue 40 item 2; docs/RESULTS.md, "Why CSD left SmolLM2 worse than CE alone": M:1
chunks, where the teacher is 2.96 nats ahead, held only 22% of the events' mass). The KD term stays the sum of
w_c D_c divided by the global number of chunks. `none` (the default) leaves every weight 1 and the loss as it was.
"""

from __future__ import annotations

KD_CHUNK_WEIGHTS = ("none", "advantage")
DEFAULT_CHUNK_WEIGHT_SCALE = 1.0  # nats of teacher advantage for weight 1
DEFAULT_CHUNK_WEIGHT_MAX = 4.0


def check_chunk_weighting(mode: str, scale: float, cap: float) -> None:
    """Raise `CsdError` naming the option for a mode not in KD_CHUNK_WEIGHTS or a scale / cap that is not positive."""
    import math

    from csd_pipeline.errors import CsdError

    if mode not in KD_CHUNK_WEIGHTS:
        raise CsdError(f"--kd-chunk-weight {mode!r} is not a chunk weighting; choose one of {', '.join(KD_CHUNK_WEIGHTS)}")
    for flag, value in (("--kd-chunk-weight-scale", scale), ("--kd-chunk-weight-max", cap)):
        if not (value > 0 and math.isfinite(value)):
            raise CsdError(f"{flag} must be a positive number, got {value}")


def advantage_weights(teacher_loglik, student_loglik, *, scale: float = DEFAULT_CHUNK_WEIGHT_SCALE,
                      cap: float = DEFAULT_CHUNK_WEIGHT_MAX):
    """w_c = clamp((log p_T(c) - log p_S(c)) / scale, 0, cap) per chunk, detached (torch [C] each, any float dtype;
    the result has the student's dtype)."""
    import torch

    student = student_loglik.detach()
    advantage = teacher_loglik.to(student.dtype) - student
    return torch.clamp(advantage / scale, min=0.0, max=cap).detach()


def chunk_weighting(options: dict):
    """(scale, cap) of `--kd-chunk-weight advantage` from a loss's options, or None for `none` (or options that
    predate it)."""
    if options.get("kd_chunk_weight", "none") == "none":
        return None
    return (float(options.get("kd_chunk_weight_scale", DEFAULT_CHUNK_WEIGHT_SCALE)),
            float(options.get("kd_chunk_weight_max", DEFAULT_CHUNK_WEIGHT_MAX)))
