"""Shared pieces of the on-policy tests: a tiny random-init student with a real tokenizer, and prompts
cut from real text (the demo corpus)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_TRAIN = REPO / "demo" / "corpus" / "devil-train.jsonl"


def tiny_student(folder: Path, tokenizer: str = "llama-spm", seed: int = 0) -> Path:
    """An HF folder with a 2-layer Llama (random weights from `seed`) and the fixture tokenizer's files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from csd_pipeline.fixtures.names import tokenizer_path
    from trainer.export import save_tokenizer

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(str(tokenizer_path(tokenizer)), folder)
    return folder


def prompt_corpus(path: Path, documents: int = 6) -> Path:
    """The first `documents` demo documents as {"text"} records (use --prompt-field text --prompt-chars N)."""
    lines = DEMO_TRAIN.read_text(encoding="utf-8").splitlines()[:documents]
    path.write_text("".join(json.dumps({"text": json.loads(line)["text"]}) + "\n" for line in lines), encoding="utf-8")
    return path
