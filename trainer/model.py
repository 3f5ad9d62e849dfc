"""The student: build it on the meta device, wrap it with the loss, shard it with FSDP2, fill it.

Its HF export: `trainer/export.py`.

Under FSDP2 a parameter is whole only inside the forward of the module group that owns it. The
chunked CSD loss needs the whole LM-head weight and the final hidden states, so the student is
wrapped in `StudentWithLoss`, whose forward runs the decoder body and then the loss:
`fully_shard` goes on each decoder layer, then on the wrapper (the root group), which therefore
owns the embeddings, the final norm and the LM head (tied or not) and has them unsharded while
the loss runs. The student is built on the meta device and materialised after sharding
(`build_sharded_student`), with the weights rank 0 builds once on the CPU (`build_student`).

This module imports torch at the top: only the training entry point imports it, lazily.
"""

from __future__ import annotations

from pathlib import Path

import torch

from csd_pipeline.errors import CsdError


class StudentWithLoss(torch.nn.Module):
    """A causal LM whose forward returns the loss pieces of its `loss` instead of logits.

    forward(input_ids [B,S], position_ids [B,S], ce_positions [G], ce_tokens [G], teachers (one collated batch
    per teacher), *, global_ce_tokens, global_chunk_counts, teacher_weights) -> dict with `ce` and `kd` (0-dim,
    already divided by the global counts) and `metrics` (detached). `loss`: the run's `TrainingLoss`
    (`csd_pipeline.loss.training`). The combination with the dynamic scale happens in the loop, which knows
    the all-rank values.
    """

    def __init__(self, model, loss=None):
        super().__init__()
        self.model = model
        self.loss = loss

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

    def forward(self, input_ids, position_ids, ce_positions, ce_tokens, teachers=(), *, global_ce_tokens,
                global_chunk_counts=None, teacher_weights=None, loss=None):
        """CE and KD of one micro-batch, from the decoder's last hidden states and the LM head (`loss`: another
        `TrainingLoss` than the run's, e.g. the CE alone of the held-out evaluation)."""
        hidden = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        weight = self.model.get_output_embeddings().weight
        # FSDP2's layers hand float32 to the final norm, whose output is then float32 beside a bf16 head
        hidden = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
        out = (loss or self.loss)(ce_positions=ce_positions, ce_tokens=ce_tokens, teachers=teachers, hidden=hidden,
                        weight=weight, global_ce_tokens=global_ce_tokens, global_chunk_counts=global_chunk_counts,
                        teacher_weights=teacher_weights, kd_scale=0.0)
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


def student_architecture(options):
    """The HF config of the student, read on every rank without loading weights.

    `options`: the `StudentConfig`. From `--student-config` (a model started from scratch) or the
    config of `--student` (local folder, GGUF file, fixture or hub name). Raises `CsdError` for a
    missing path or a config that is not an HF config.
    """
    import json

    import transformers

    if not options.student_config:
        from csd_pipeline.runtime.model_loading import resolve_model_source

        folder, gguf_file = resolve_model_source(options.student, trust_remote_code=options.trust_remote_code)
        try:
            return transformers.AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file,
                                                           trust_remote_code=options.trust_remote_code)
        except (OSError, ValueError) as err:
            raise CsdError(f"--student {options.student}: cannot read its config ({str(err).splitlines()[0]})") from None
    path = Path(options.student_config)
    if not path.is_file():
        raise CsdError(f"--student-config {path} does not exist; pass an HF config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        model_type = raw.pop("model_type")
    except (ValueError, KeyError):
        raise CsdError(f"--student-config {path} is not an HF config (JSON with model_type); fix the file") from None
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **raw)
    except ValueError as err:
        raise CsdError(f"--student-config {path}: {str(err).splitlines()[0]}") from None
    return hf_config


def _where(options) -> str:
    return f"--student {options.student}" if options.student else f"--student-config {options.student_config}"


def _causal_lm_from_config(options, hf_config):
    """`AutoModelForCausalLM.from_config` for the student (float32 like a loaded `--student`); raises `CsdError`."""
    import transformers

    kwargs = {"dtype": torch.float32} if options.student else {}  # as `load_pretrained` loads it
    try:
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, trust_remote_code=options.trust_remote_code, **kwargs)
    except ValueError as err:
        raise CsdError(f"{_where(options)} does not describe a causal LM ({str(err).splitlines()[0]})") from None
    set_attention(model, options.attn_implementation)
    return model


def _finish(model, options, tokenizer_size: int):
    model = model.to(torch.float32)
    model.config.use_cache = False
    check_vocab(model.get_input_embeddings().weight.shape[0], tokenizer_size, _where(options))
    _check_head(model)
    return model


def build_student(options, seed: int, tokenizer_size: int):
    """The whole student on the CPU in float32: loaded (`--student`) or initialised (`--student-config`).

    `options`: the `StudentConfig`. The initialisation is seeded by `seed` (`--seed`), so it is the
    same on every call. Raises `CsdError` for a missing path, a config that is not a causal LM, or a
    vocabulary smaller than the tokenizer's.
    """
    if options.student_config:
        hf_config = student_architecture(options)
        torch.manual_seed(seed)
        model = _causal_lm_from_config(options, hf_config)
    else:
        model = load_pretrained(options.student, options.attn_implementation, options.trust_remote_code)
    return _finish(model, options, tokenizer_size)


def build_sharded_student(options, seed: int, tokenizer_size: int, ctx, param_dtype, loss=None) -> StudentWithLoss:
    """The student for training: built on the meta device, sharded with FSDP2, then materialised.

    As torchtitan does: every rank builds the model on the meta device (no memory), `fully_shard`s
    it (`shard_student`), allocates only its own shards on `ctx.device` (`to_empty`), then fills
    them. The weights come from rank 0, which alone builds the whole student on the CPU
    (`build_student`: the seeded initialisation or the `--student` weights) and scatters them,
    so a run starts from exactly the weights `build_student` gives. `loss`: the run's `TrainingLoss`, which the
    wrapper's forward computes. Collective; raises `CsdError`
    on every rank when rank 0 could not build the student.
    """
    hf_config = student_architecture(options)
    with torch.device("meta"):
        model = _finish(_causal_lm_from_config(options, hf_config), options, tokenizer_size)
    wrapper = StudentWithLoss(model, loss)
    shard_student(wrapper, ctx.device, param_dtype)
    wrapper.to_empty(device=ctx.device)
    source, failure = None, None
    if ctx.is_main:
        try:
            source = build_student(options, seed, tokenizer_size)
        except Exception as err:  # every rank must hear of it before the collective load below
            failure = err
    from trainer import distributed

    if distributed.agree_any(failure is not None, ctx.device):
        raise failure if failure is not None else CsdError("rank 0 could not build the student; see its error")
    _load_weights(model, source)
    return wrapper


def _load_weights(model, source) -> None:
    """Scatter rank 0's `source` weights into the shards of `model`, and its buffers to every rank (collective)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = source.state_dict() if source is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers (e.g. rotary frequency tables) are not in a state dict.
    buffers = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if source is not None:
                buffer.copy_(buffers[name])
            if dist.get_world_size() > 1:
                dist.broadcast(buffer, src=0)


def load_pretrained(name: str, attn_implementation: str, trust_remote_code: bool):
    """Load `--student` (local HF folder, GGUF file, fixture or hub name) in float32 on the CPU.

    Uses `csd_pipeline.runtime.model_loading.load_causal_lm` (the teacher stage's loader), then switches
    the attention kernel when `--attn-implementation` asks for another one.
    """
    from csd_pipeline.runtime.model_loading import load_causal_lm

    model = load_causal_lm(name, dtype="float32", device="cpu", trust_remote_code=trust_remote_code).model
    set_attention(model, attn_implementation)
    return model


def set_attention(model, attn_implementation: str) -> None:
    """Switch the model to `--attn-implementation` when it uses another kernel; raises `CsdError` if unavailable."""
    if getattr(model.config, "_attn_implementation", None) != attn_implementation:
        try:
            model.set_attn_implementation(attn_implementation)
        except (ValueError, ImportError) as err:
            raise CsdError(f"--attn-implementation {attn_implementation} is not available for this student "
                           f"({str(err).splitlines()[0]}); use sdpa or eager") from None


def student_tokenizer_source(options) -> str:
    """The tokenizer of the student (`StudentConfig`): `--student-tokenizer`, else the `--student` model folder."""
    if options.student_tokenizer:
        return options.student_tokenizer
    from csd_pipeline.runtime.model_loading import resolve_model_source

    folder, gguf_file = resolve_model_source(options.student, trust_remote_code=options.trust_remote_code)
    if gguf_file is not None:
        raise CsdError(f"--student {options.student} is a GGUF file; pass its tokenizer with --student-tokenizer")
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
