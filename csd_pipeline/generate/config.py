"""`GenerateConfig`: the options of `csd-pipeline generate`, each with its one default and help.

The click command (`cli/generate.py`) builds its flags from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.model_loading import DTYPES
from csd_pipeline.runtime.options import option

BACKENDS = ("transformers",)
MODES = ("text", "chat")


@dataclass
class GenerateConfig:
    """Options of `csd-pipeline generate`."""

    model: str = option(help="The student: a Hugging Face folder (e.g. a csd-train export/), a GGUF file or a fixture name.")
    corpus: list[str] = option(help="Prompts: a .jsonl/.json/.parquet/.txt file or a folder of them (read like "
                                    "`csd-pipeline align --corpus`); repeatable.")
    output: str = option(help="Output directory (resumable); `csd-pipeline align --corpus DIR` reads it.")
    mode: str = option("text", "text: a prompt is a text field, the sample continues it; chat: a prompt is a chat "
                               "record whose final assistant turn the student writes (docs/ONPOLICY.md).", choices=MODES)
    chat_template: str | None = option(None, "Chat mode: the student's template (.jinja, tokenizer_config.json or GGUF; "
                                             "default: the tokenizer's own), as `align --student-chat-template`.")
    prompt_field: str = option("prompt", "The record field that holds the prompt (`text` for plain documents).")
    prompt_chars: int = option(0, "When > 0: the prompt is the document's first N characters, cut back to the last "
                                  "whitespace; the rest is kept as the record's `reference`.")
    max_new_tokens: int = option(128, "Tokens the student writes per sample (at most).")
    temperature: float = option(1.0, "Sampling temperature; 0 is greedy.")
    top_p: float = option(1.0, "Nucleus sampling: keep the smallest set of tokens with this much probability.")
    samples_per_prompt: int = option(1, "Completions written for each prompt.")
    seed: int = option(0, "Seed; each sample's seed is derived from (seed, prompt source, record index, sample index).")
    batch_size: int = option(8, "Samples generated together (fixed groups within a shard, so results do not "
                                "depend on ranks or workers).")
    prompts_per_shard: int = option(64, "Prompts per output shard.")
    backend: str = option("transformers", "Generation backend.", choices=BACKENDS)
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N.")
    dtype: str = option("auto", "Model weights: auto = float32 on CPU, bfloat16 on GPU.", choices=DTYPES)
    trust_remote_code: bool = option(False, "Allow the model repository's own code (off by default).")

    def validate(self) -> None:
        """Raise CsdError naming the option that is out of range."""
        for name in ("max_new_tokens", "samples_per_prompt", "batch_size", "prompts_per_shard"):
            if getattr(self, name) < 1:
                raise CsdError(f"--{name.replace('_', '-')} {getattr(self, name)} is not positive; pass 1 or more.")
        if self.temperature < 0:
            raise CsdError(f"--temperature {self.temperature} is negative; pass 0 (greedy) or more.")
        if not 0 < self.top_p <= 1:
            raise CsdError(f"--top-p {self.top_p} is out of range; pass a value in (0, 1].")
        if self.prompt_chars < 0:
            raise CsdError(f"--prompt-chars {self.prompt_chars} is negative; pass 0 (the whole field) or more.")
        if self.mode not in MODES:
            raise CsdError(f"--mode {self.mode!r} is unknown; use one of {', '.join(MODES)}.")
        if self.mode == "chat" and self.prompt_chars:
            raise CsdError("--prompt-chars cuts text prompts; chat prompts are whole records: drop it or use --mode text.")
        if self.mode == "text" and self.chat_template is not None:
            raise CsdError("--chat-template is for chat prompts; add --mode chat or drop it.")
        if self.backend not in BACKENDS:
            raise CsdError(f"--backend {self.backend!r} is unknown; use one of {', '.join(BACKENDS)}.")
