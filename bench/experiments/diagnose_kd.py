"""Why one divergence helps and another does not: the CE and KD gradients of a student, side by side.

For a student (a from-scratch initialisation or a trained run's HF export) and the first batches
of an aligned corpus with its teacher top-k, this measures per divergence (JSD, forward KL):

- the KD value, the dynamic scale sg(CE/KD) and the norm of the scaled KD gradient next to the
  CE gradient's (the balance between the two terms);
- the cosine between the two gradients (does KD push where CE already pushes?);
- the teacher mass on explicit events and the student's REST mass (event coverage).

    python -m bench.experiments.diagnose_kd --aligned DIR --teacher-logits DIR --student-config demo/student-config.json
        --student-tokenizer llama-spm [--student out/.../export] [--batches 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _flat_grad(wrapper, loss):
    import torch

    params = [p for p in wrapper.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).to(torch.float64)
                      for p, g in zip(params, grads, strict=True)])


def diagnose(args) -> dict:
    from dataclasses import replace

    import torch

    from trainer.config import TrainConfig
    from trainer.data import TrainingData
    from trainer.loop import kd_scale, to_device
    from trainer.model import StudentWithLoss, build_student

    config = TrainConfig.from_options(dict(
        aligned=args.aligned, teacher_logits=[args.teacher_logits], output="/nonexistent",
        student=args.student, student_config=None if args.student else args.student_config,
        student_tokenizer=args.student_tokenizer, seq_len=args.seq_len, batch_size=args.batch_size,
        workers=0, seed=args.seed, device="cpu", dtype="float32", teacher_top_k=args.teacher_top_k,
    )).validate()
    torch.manual_seed(config.seed)
    data = TrainingData.open(config)
    wrapper = StudentWithLoss(build_student(config.student, config.seed, data.student_vocab.size))
    device = torch.device("cpu")
    loader = data.loader(0, 1, None)
    rows: dict = {}
    for _ in range(args.batches):
        batch = next(loader)
        inputs = to_device(batch, device)
        tokens = int(len(batch.ce_positions))
        chunks = [sum(batch.shape_counts[0])]
        for divergence in ("jsd", "kl"):
            wrapper.loss = replace(config.loss, divergence=divergence, beta=args.beta,
                                   teacher_temperature=args.teacher_temperature).build()
            out = wrapper(**inputs, global_ce_tokens=tokens, global_chunk_counts=chunks, teacher_weights=[1.0])
            ce, kd = out["ce"], out["kd"]
            scale = kd_scale(float(ce.detach()), float(kd.detach()), config.loss)  # the trainer's dynamic scale
            g_ce = _flat_grad(wrapper, ce)
            g_kd = _flat_grad(wrapper, scale * kd)
            metrics = out["metrics"]
            entry = {
                "ce": float(ce.detach()), "kd": float(kd.detach()), "scale": scale,
                "grad_ce": float(g_ce.norm()), "grad_kd_scaled": float(g_kd.norm()),
                "cosine": float(g_ce @ g_kd / (g_ce.norm() * g_kd.norm())),
                "teacher_event_mass": float(metrics["teacher0/teacher_event_mass"]),
                "student_rest_mass": float(metrics["teacher0/student_rest_mass"]),
            }
            for key, value in entry.items():
                rows.setdefault(divergence, {}).setdefault(key, []).append(value)
    loader.close()
    return {div: {k: sum(v) / len(v) for k, v in values.items()} for div, values in rows.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aligned", required=True)
    parser.add_argument("--teacher-logits", required=True)
    parser.add_argument("--student", help="a trained HF export (default: a fresh initialisation)")
    parser.add_argument("--student-config", default="demo/student-config.json")
    parser.add_argument("--student-tokenizer", default="llama-spm")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--beta", type=float, default=5.0)
    parser.add_argument("--teacher-top-k", type=int, default=0)
    parser.add_argument("--teacher-temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = diagnose(args)
    print(f"{'divergence':<10} {'CE':>6} {'KD':>7} {'scale':>6} {'|g_CE|':>7} {'|s*g_KD|':>8} {'cos':>6} "
          f"{'T mass':>6} {'S REST':>6}")
    for div, r in result.items():
        print(f"{div:<10} {r['ce']:>6.3f} {r['kd']:>7.4f} {r['scale']:>6.1f} {r['grad_ce']:>7.3f} "
              f"{r['grad_kd_scaled']:>8.3f} {r['cosine']:>6.3f} {r['teacher_event_mass']:>6.3f} "
              f"{r['student_rest_mass']:>6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
