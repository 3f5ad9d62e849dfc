"""The HF export of the student: `OUTPUT/export/`, complete and checked before it is put in place.

The folder holds the model (safetensors, `config.json`, `generation_config.json`) and every
tokenizer file of the student, copied byte for byte: the chat template in whichever form the
student has it (inside `tokenizer_config.json` or as `chat_template.jinja`), added and special
tokens, SentencePiece and processor files. It is written to `export.tmp/`, loaded back with
`AutoModelForCausalLM` and `AutoTokenizer` alone, and its logits compared with the in-memory
student's on a real batch; only then does it replace `export/`. A failed check leaves
it in `export.failed/` for inspection and raises `CsdError` (the checkpoint written before it is kept).

This module imports torch at the top: only the training entry point imports it, lazily.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import storage
from csd_pipeline.runtime.files import replace_directory, tmp_path

# The files of a tokenizer (and of a processor) that transformers reads, whichever the student has.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "preprocessor_config.json", "processor_config.json")
TOKENIZER_FOLDERS = ("additional_chat_templates",)  # transformers 5: named chat templates, one .jinja each
MODEL_FILES = ("generation_config.json",)  # taken from the --student folder where it has them
# The largest |logit difference| allowed between the loaded export and the student, relative to max(1, max |logit|).
LOGITS_TOLERANCE = 1e-5
SAMPLE_POSITIONS = 256  # positions of the real batch's first row that the check runs


def save_tokenizer(source: str, output_dir: Path) -> None:
    """Copy every tokenizer file of `source` (a fixture name, a folder, a tokenizer.json or a hub name)
    into `output_dir` byte for byte (so its fingerprint is unchanged)."""
    from csd_pipeline.fixtures.names import resolve_model_arg, resolve_tokenizer_arg

    path = Path(resolve_model_arg(resolve_tokenizer_arg(source)))
    if path.is_file():
        shutil.copyfile(path, Path(output_dir) / "tokenizer.json")
        folder, names = path.parent, TOKENIZER_FILES[1:]
    elif path.is_dir():
        folder, names = path, TOKENIZER_FILES
    else:  # a hub name: transformers writes the files it fetched, the tokenizer.json stays byte for byte
        import transformers

        from csd_pipeline.vocab.tokenizer_files import open_tokenizer

        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(output_dir)
        shutil.copyfile(open_tokenizer(source).file, Path(output_dir) / "tokenizer.json")
        return
    _copy_files(folder, names + TOKENIZER_FOLDERS, Path(output_dir))


def _copy_files(folder: Path, names, output_dir: Path) -> None:
    for name in names:
        source = folder / name
        if source.is_file():
            shutil.copyfile(source, output_dir / name)
        elif source.is_dir():
            shutil.copytree(source, output_dir / name, dirs_exist_ok=True)
    for source in sorted(folder.glob("*processor_config.json")):  # image, video, feature processors
        shutil.copyfile(source, output_dir / source.name)


def student_model_folder(options) -> Path | None:
    """The folder of `--student` (`StudentConfig`) when it is an HF folder; None for `--student-config` or GGUF."""
    if not options.student:
        return None
    from csd_pipeline.runtime.model_loading import resolve_model_source

    folder, gguf_file = resolve_model_source(options.student, trust_remote_code=options.trust_remote_code)
    return None if gguf_file is not None else Path(folder)


def export_hf(wrapper, tokenizer_source: str, output_dir: str | os.PathLike, ctx, *, sample=None,
              student_folder: Path | None = None, fingerprint: str | None = None) -> None:
    """Write the student as an HF model (safetensors) plus its tokenizer files into `output_dir`, checked.

    Collective: every rank must call it (the full state dict is gathered to rank 0, which writes and
    checks). `sample`: a `MicroBatch` whose first row the check runs (None: no logits check);
    `student_folder`: the `--student` folder, whose `generation_config.json` is carried;
    `fingerprint`: the student tokenizer's, which the export's must equal. Written to a `*.tmp` folder
    next to `output_dir`, checked (`verify_export`), then put in its place. Raises `CsdError` on every
    rank when the check fails.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trainer import distributed

    state = get_model_state_dict(wrapper.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failure = None
    if ctx.is_main:
        # buffers (rotary tables, ...) are replicated on every rank, and non-persistent ones are in no state dict
        buffers = {name: b.detach().to("cpu", copy=True) for name, b in wrapper.model.named_buffers()}
        target = storage.location(output_dir)
        local = storage.staging_path(target) if storage.is_remote(target) else target  # built and checked here
        try:
            _write_and_check(wrapper.model.config, state, buffers, tokenizer_source, local, sample=sample,
                             student_folder=student_folder, fingerprint=fingerprint)
            if local is not target:
                storage.upload_folder(local, target, last="config.json")
        except CsdError as err:  # every rank must hear of it before the next collective
            failure = err
    if distributed.agree_any(failure is not None, ctx.device):
        raise failure if failure is not None else CsdError("rank 0 could not write or check the export; see its error")


def _write_and_check(config, state: dict, buffers: dict, tokenizer_source: str, output_dir: Path, *, sample, student_folder,
                     fingerprint) -> None:
    import transformers
    from transformers.utils import logging as hf_logging

    tmp = tmp_path(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    config = copy.deepcopy(config)
    config.use_cache = True  # the trainer turns the KV cache off; a served model wants it
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    for name, buffer in buffers.items():  # the student's own, so the check runs exactly the student
        owner, _, attribute = name.rpartition(".")
        model.get_submodule(owner)._buffers[attribute] = buffer
    hf_logging.disable_progress_bar()  # our own progress bar is on stderr
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tokenizer_source, tmp)
    if student_folder is not None:
        _copy_files(Path(student_folder), MODEL_FILES, tmp)
    if sample is not None:
        input_ids = torch.as_tensor(sample.input_ids[:1, :SAMPLE_POSITIONS]).long()
        position_ids = torch.as_tensor(sample.position_ids[:1, :SAMPLE_POSITIONS]).long()
        failed = output_dir.with_name(f"{output_dir.name}.failed")
        try:
            verify_export(tmp, model, input_ids, position_ids, fingerprint=fingerprint, final=output_dir)
        except CsdError:
            replace_directory(tmp, failed)  # kept for inspection under a name no reader takes for the export
            raise
        shutil.rmtree(failed, ignore_errors=True)
    replace_directory(tmp, output_dir)


def verify_export(folder: Path, reference, input_ids, position_ids=None, *, fingerprint: str | None = None,
                  final: Path | None = None) -> float:
    """Check that `folder` loads with `AutoModelForCausalLM` / `AutoTokenizer` alone and reproduces `reference`.

    `reference`: the student (its float32 weights in its own config); `input_ids` / `position_ids`:
    [1, S] of a real batch. `fingerprint`: the student tokenizer's, which the loaded tokenizer's must equal.
    Returns the largest |logit difference|; raises `CsdError` naming `final` (default: `folder`)
    when it does not load, its tokenizer differs or a logit differs by more than `LOGITS_TOLERANCE`.
    """
    import transformers

    where = f"the export {final or folder}"
    kept = f"{final}.failed" if final else folder
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    except Exception as err:  # whatever the loaders raise, the export is unusable
        raise CsdError(f"{where} does not load with AutoModelForCausalLM/AutoTokenizer ({_first_line(err)}); "
                       f"it is left in {kept}, and the checkpoint is kept") from None
    if len(tokenizer) > loaded.get_input_embeddings().weight.shape[0]:
        raise CsdError(f"{where}: its tokenizer has {len(tokenizer)} ids, more than the model's "
                       f"{loaded.get_input_embeddings().weight.shape[0]}; it is left in {kept}, and the checkpoint is kept")
    if fingerprint is not None:
        from csd_pipeline.vocab.vocabulary import load_tokenizer

        if load_tokenizer(str(folder)).vocab.fingerprint != fingerprint:
            raise CsdError(f"{where}: its tokenizer is not the student tokenizer the run trained with (fingerprint "
                           f"mismatch); it is left in {kept}, and the checkpoint is kept")
    with torch.no_grad():
        expected = reference.eval()(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits.float()
        got = loaded(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits.float()
    error = float((got - expected).abs().max()) if got.shape == expected.shape else float("inf")
    bound = LOGITS_TOLERANCE * max(1.0, float(expected.abs().max()))
    if not error <= bound:
        raise CsdError(f"{where} does not reproduce the student: its logits differ by up to {error:.3g} (allowed "
                       f"{bound:.3g}) on a real batch of {input_ids.shape[1]} tokens; it is left in {kept}, and the "
                       "checkpoint is kept (the same command with --resume continues from it, or writes the final "
                       "export again)")
    return error


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
