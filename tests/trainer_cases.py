"""Shared inputs of the trainer tests (tests/trainer/): small aligned directories of real
text (llama-spm student, smollm2 teacher) and a tiny student config. The `trainer_data` fixture in
conftest.py calls `make_trainer_data` once per session."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"

STUDENT_CONFIG = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": True,
}


def align(corpus: list[Path], output: Path, max_student_tokens: int = 128, teachers: int = 1) -> Path:
    """Run the align stage (llama-spm student, `teachers` x smollm2 teacher) into `output`."""
    from csd_pipeline.align.stage import AlignConfig, run_align

    run_align(AlignConfig(corpus=[str(c) for c in corpus], student_tokenizer="llama-spm",
                          teacher_tokenizers=["smollm2"] * teachers, output=str(output),
                          max_student_tokens=max_student_tokens,
                          split_on_blank_lines=True, shard_bytes=2000))
    return output


def make_trainer_data(root: Path) -> dict:
    """{"train", "eval"}: aligned dirs of the botchan / devil slices (windows <= 128 student tokens);
    "train_short": the first 2500 characters of the botchan slice, aligned for two teachers with the
    same (smollm2) tokenizer; "student_config": a 2-layer, 64-wide Llama config JSON with the llama-spm vocabulary."""
    from csd_pipeline.fixtures.names import tokenizer_path

    tokenizer_path("llama-spm")  # fails with `make fixtures` advice when the cache is missing
    out = {"train": align([DATA / "botchan-slice.txt"], root / "train"),
           "eval": align([DATA / "devil-slice.txt"], root / "eval")}
    # a shorter text for the runs that need the real teacher's top-k (the teacher is the slow part)
    short = root / "botchan-short.txt"
    short.write_text((DATA / "botchan-slice.txt").read_text(encoding="utf-8")[:2500], encoding="utf-8")
    out["train_short"] = align([short], root / "train-short", teachers=2)
    out["student_config"] = root / "student.json"
    out["student_config"].write_text(json.dumps(STUDENT_CONFIG))
    return out


def make_teacher_topk(aligned: Path, output: Path, top_k: int = 8) -> Path:
    """Run the teacher-logits stage with the real SmolLM2-135M-Instruct teacher on `aligned`."""
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits

    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher="smollm2-135m-instruct", output=str(output),
                                           top_k=top_k, device="cpu"))
    return output
