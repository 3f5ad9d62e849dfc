"""A GGUF causal language model turned into a plain Hugging Face folder, and a loss check for it.

transformers can load a GGUF file directly (`from_pretrained(dir, gguf_file=...)`, which
dequantizes every tensor, ~12 s for SmolLM2-135M) but refuses to save the result. Converting once
into `config.json` + `model.safetensors` makes later loads fast and independent of `gguf`.
"""

from __future__ import annotations

from pathlib import Path

from csd_pipeline.errors import CsdError


def convert_gguf_model(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize `gguf_file` into a float32 Hugging Face model folder `out_dir`.

    Writes config.json, generation_config.json and model.safetensors (no tokenizer files).
    Raises CsdError when transformers cannot read the file, or ImportError naming a missing
    package (`gguf`, `accelerate`).
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
    except (OSError, ValueError) as err:
        raise CsdError(f"transformers could not load the GGUF model {gguf_file} ({err}).") from err
    # The loaded model carries a GGUF "quantization" config that transformers will not save;
    # rebuild the same architecture without it and move the dequantized weights over.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config = type(loaded.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.eval()
    model.save_pretrained(str(out_dir))
    for path in out_dir.iterdir():
        path.chmod(0o644)   # safetensors are written owner-only; the cache is shared read-only


def text_nll(model, ids: list[int], context_id: int) -> float:
    """Total next-token negative log-likelihood (nats, float64) of `ids` after one context token.

    Every token of `ids` is predicted (the context token plays the document separator), so two
    segmentations of the same text can be compared by their totals.
    """
    import torch

    if not ids:
        raise CsdError("cannot score an empty token sequence; give the loss check some text.")
    with torch.inference_mode():
        inputs = torch.tensor([[context_id, *ids]], dtype=torch.long)
        logits = model(inputs).logits[0, :-1].to(torch.float64)
        logprobs = torch.log_softmax(logits, dim=-1)
        picked = logprobs.gather(1, inputs[0, 1:, None])
    return float(-picked.sum())
