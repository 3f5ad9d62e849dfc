"""`csd-pipeline bits-per-byte`: held-out bits per byte of any causal LM on an aligned folder.

Bits per byte compares models with different tokenizers: the model's cross-entropy in nats over
the UTF-8 bytes of the same text, divided by ln 2. The student side reads `student_ids`, teacher i
reads `teacher{i}_ids`, so teacher and students are scored on exactly the same bytes.
"""

from __future__ import annotations

import json

import click


@click.command("bits-per-byte")
@click.option("--aligned", required=True, type=click.Path(file_okay=False), help="Output folder of `csd-pipeline align`.")
@click.option("--model", "model_arg", required=True, help="HF folder, GGUF file, hub name or fixture name.")
@click.option("--side", default="student", show_default=True,
              help="Which ids the model reads: `student`, or `teacherN` for teacher N.")
@click.option("--seq-len", default=2048, show_default=True, help="Tokens per packed row (>= the longest window).")
@click.option("--batch-size", default=4, show_default=True, help="Packed rows per forward pass.")
@click.option("--max-rows", default=0, show_default=True, help="Score at most N windows (0: all).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model repository's own code (off by default).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (with `sources`: the same figures per corpus file).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bits_per_byte(aligned, model_arg, side, seq_len, batch_size, max_rows, device, trust_remote_code, as_json, quiet):
    """Held-out bits per byte of MODEL on the aligned folder's text."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.evaluation.bits_per_byte import bits_per_byte as score
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.runtime.progress import set_quiet

    set_quiet(quiet)
    if side == "student":
        which = "student"
    elif side.startswith("teacher") and side[len("teacher"):].isdigit():
        which = int(side[len("teacher"):])
    else:
        raise CsdError(f"--side {side}: use `student` or `teacherN` (N = the teacher's index in the aligned folder)")
    if which != "student":
        from csd_pipeline.align.output import AlignedOutput

        teachers = AlignedOutput.open(aligned).num_teachers
        if which >= teachers:
            raise CsdError(f"--side {side} is out of range: {aligned} aligns {teachers} teacher(s); pass "
                           f"{' or '.join(f'teacher{i}' for i in range(teachers)) or 'student'}, or `student`")
    loaded = load_causal_lm(model_arg, dtype="float32" if device in ("auto", "cpu") else "auto", device=device,
                            trust_remote_code=trust_remote_code)
    loaded.model.eval()
    result = score(loaded.model, aligned, which, seq_len=seq_len, batch_size=batch_size, max_rows=max_rows)
    result = {"model": model_arg, "side": side, **result}
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    else:
        click.echo(f"{model_arg} on {aligned} ({side}): {result['bits_per_byte']:.4f} bits/byte "
                   f"over {result['bytes']} bytes, {result['tokens']} tokens")
        if len(result["sources"]) > 1:
            for source, figures in result["sources"].items():
                click.echo(f"  {source}: {figures['bits_per_byte']:.4f} bits/byte over {figures['bytes']} bytes")
