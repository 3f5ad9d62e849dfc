"""The student: build or load it, wrap it with the loss, shard it with FSDP2, export it.

Under FSDP2 a parameter is whole only inside the forward of the module group that owns it. The
chunked CSD loss needs the whole LM-head weight and the final hidden states, so the student is
wrapped in `StudentWithLoss`, whose forward runs the decoder body and then the loss:
`fully_shard` goes on each decoder layer, then on the wrapper (the root group), which therefore
owns the embeddings, the final norm and the LM head (tied or not) and has them unsharded while
the loss runs.

This module imports torch at the top: only the training entry point imports it, lazily.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from csd_pipeline.errors import CsdError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class StudentWithLoss(torch.nn.Module):
    """A causal LM whose forward returns the CSD loss pieces instead of logits.

    forward(input_ids [B,S], position_ids [B,S], ce_positions [G], ce_tokens [G], teachers,
    **loss options) -> dict with `ce` and `kd` (0-dim, already divided by the global counts,
    see `csd_pipeline.loss.csd.csd_loss`) and `metrics` (detached). The combination with the dynamic
    scale happens in the loop, which knows the all-rank values.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def decoder_layers(self):
        """The ModuleList of transformer blocks (each gets its own FSDP2 group)."""
        decoder = self.model.get_decoder()
        count = getattr(self.model.config, "num_hidden_layers", None)
        for module in decoder.children():
            if isinstance(module, torch.nn.ModuleList) and (count is None or len(module) == count):
                return module
        raise CsdError(
            f"cannot find the transformer blocks of {type(self.model).__name__}; "
            "use a decoder-only causal LM whose decoder holds a ModuleList of layers"
        )

    def forward(self, input_ids, position_ids, ce_positions, ce_tokens, teachers=(), *,
                global_ce_tokens, global_chunk_counts=None, teacher_weights=None,
                divergence="jsd", beta=5.0, teacher_temperature=1.0, chunk_size=1024, loss_kind="csd",
                baseline=None):
        from csd_pipeline.loss.baselines import BASELINE_LOSSES, baseline_loss
        from csd_pipeline.loss.csd import csd_loss

        hidden = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
        weight = self.model.get_output_embeddings().weight
        if loss_kind in BASELINE_LOSSES:  # uld, gold, strict: `teachers` holds ChunkRows
            out = baseline_loss(
                loss_kind, ce_positions=ce_positions, ce_tokens=ce_tokens, teachers=teachers, hidden=hidden,
                weight=weight, teacher_weights=teacher_weights, global_ce_tokens=global_ce_tokens,
                global_chunk_counts=global_chunk_counts, divergence=divergence, chunk_size=chunk_size,
                kd_scale=0.0, **(baseline or {}),
            )
            return {"ce": out.ce, "kd": out.kd, "metrics": out.metrics}
        out = csd_loss(
            ce_positions=ce_positions, ce_tokens=ce_tokens, teachers=teachers, hidden=hidden, weight=weight,
            teacher_weights=teacher_weights, global_ce_tokens=global_ce_tokens,
            global_chunk_counts=global_chunk_counts, divergence=divergence, beta=beta,
            teacher_temperature=teacher_temperature, chunk_size=chunk_size, kd_scale=0.0,
        )
        return {"ce": out.ce, "kd": out.kd, "metrics": out.metrics}


def _check_head(model) -> None:
    config = model.config
    for key in ("final_logit_softcapping", "logit_scale"):
        value = getattr(config, key, None)
        if value not in (None, 1.0):
            raise CsdError(
                f"the student's config sets {key}={value}, a logit transform the chunked CSD loss does not "
                "apply; use a student whose logits are hidden @ lm_head.weight"
            )
    if model.get_output_embeddings() is None:
        raise CsdError(f"{type(model).__name__} has no LM head; pass a causal LM as the student")


def check_vocab(model_vocab_size: int, tokenizer_size: int, where: str) -> None:
    """Raise `CsdError` when the model cannot embed every id of the tokenizer."""
    if model_vocab_size < tokenizer_size:
        raise CsdError(
            f"{where} has vocab_size {model_vocab_size} but the student tokenizer has {tokenizer_size} ids; "
            f"set vocab_size >= {tokenizer_size} in the config or pass the matching --student-tokenizer"
        )


def build_student(config, tokenizer_size: int):
    """Load (`--student`) or initialise (`--student-config`) the student on the CPU in float32.

    The initialisation is seeded by `--seed`, so every rank builds the same weights. Raises
    `CsdError` for a missing path, a config that is not a causal LM, or a vocabulary smaller than
    the tokenizer's.
    """
    import transformers

    if config.student_config:
        path = Path(config.student_config)
        if not path.is_file():
            raise CsdError(f"--student-config {path} does not exist; pass an HF config.json")
        import json

        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            model_type = raw.pop("model_type")
        except (ValueError, KeyError):
            raise CsdError(f"--student-config {path} is not an HF config (JSON with model_type); fix the file") from None
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **raw)
        except ValueError as err:
            raise CsdError(f"--student-config {path}: {str(err).splitlines()[0]}") from None
        check_vocab(hf_config.vocab_size, tokenizer_size, f"--student-config {path}")
        torch.manual_seed(config.seed)
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=config.attn_implementation,
                trust_remote_code=config.trust_remote_code,
            )
        except ValueError as err:
            raise CsdError(f"--student-config {path} does not describe a causal LM ({str(err).splitlines()[0]})") from None
    else:
        model = load_pretrained(config.student, config.attn_implementation, config.trust_remote_code)
        check_vocab(model.get_input_embeddings().weight.shape[0], tokenizer_size, f"--student {config.student}")
    model = model.to(torch.float32)
    model.config.use_cache = False
    _check_head(model)
    return model


def load_pretrained(name: str, attn_implementation: str, trust_remote_code: bool):
    """Load `--student` (local HF folder, GGUF file, fixture or hub name) in float32 on the CPU.

    Uses `csd_pipeline.runtime.model_loading.load_causal_lm` (the teacher stage's loader), then switches
    the attention kernel when `--attn-implementation` asks for another one.
    """
    from csd_pipeline.runtime.model_loading import load_causal_lm

    model = load_causal_lm(name, dtype="float32", device="cpu", trust_remote_code=trust_remote_code).model
    if getattr(model.config, "_attn_implementation", None) != attn_implementation:
        try:
            model.set_attn_implementation(attn_implementation)
        except (ValueError, ImportError) as err:
            raise CsdError(f"--attn-implementation {attn_implementation} is not available for this student "
                           f"({str(err).splitlines()[0]}); use sdpa or eager") from None
    return model


def student_tokenizer_source(config) -> str:
    """The tokenizer of the student: `--student-tokenizer`, else the `--student` model folder."""
    if config.student_tokenizer:
        return config.student_tokenizer
    from csd_pipeline.runtime.model_loading import resolve_model_source

    folder, gguf_file = resolve_model_source(config.student, trust_remote_code=config.trust_remote_code)
    if gguf_file is not None:
        raise CsdError(f"--student {config.student} is a GGUF file; pass its tokenizer with --student-tokenizer")
    return str(folder)


def shard_student(wrapper, device, param_dtype) -> None:
    """FSDP2: `fully_shard` every decoder layer, then the wrapper as the root group.

    `param_dtype`: torch dtype of parameters in forward/backward (bf16 on GPU by default);
    gradients are reduced in float32 and the returned loss pieces are float32.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32)
    for layer in wrapper.decoder_layers():
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(wrapper, mesh=mesh, mp_policy=policy)  # also moves parameters and buffers to the mesh device


def export_hf(wrapper, tokenizer_source: str, output_dir: str | os.PathLike, is_main: bool) -> None:
    """Write the student as an HF model (safetensors) plus its tokenizer files into `output_dir`.

    Collective: every rank must call it (the full state dict is gathered to rank 0). Written to
    `output_dir.tmp` and renamed.
    """
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(wrapper.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    output_dir = Path(output_dir)
    tmp = output_dir.with_name(output_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = wrapper.model.config
    with torch.device("meta"):
        fresh = transformers.AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.tie_weights()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is on stderr
    fresh.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tokenizer_source, tmp)
    if output_dir.exists():
        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)


def save_tokenizer(source: str, output_dir: Path) -> None:
    """Copy the student tokenizer's files byte for byte (so its fingerprint is unchanged)."""
    from csd_pipeline.fixtures.names import resolve_model_arg, resolve_tokenizer_arg

    path = Path(resolve_model_arg(resolve_tokenizer_arg(source)))
    if path.is_file():
        shutil.copyfile(path, output_dir / "tokenizer.json")
        siblings = [path.parent / name for name in TOKENIZER_FILES[1:]]
    elif path.is_dir():
        siblings = [path / name for name in TOKENIZER_FILES]
    else:  # a hub name
        import transformers

        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(output_dir)
        return
    for sibling in siblings:
        if sibling.is_file():
            shutil.copyfile(sibling, output_dir / sibling.name)
