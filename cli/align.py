"""`csd-pipeline align`: tokenize a corpus with the student and every teacher, align, write shards."""

from __future__ import annotations

import click

from cli.outputs import echo_run_report


@click.command()
@click.option("--corpus", "corpus", multiple=True, required=True, type=click.Path(),
              help="A .txt/.jsonl/.json/.parquet file or a directory of them; repeatable.")
@click.option("--student-tokenizer", required=True, help="tokenizer.json, tokenizer folder, hub name or fixture name.")
@click.option("--teacher-tokenizer", "teacher_tokenizers", multiple=True, required=True,
              help="A teacher's tokenizer; repeat for several teachers (columns teacher0_*, teacher1_*, ...).")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Output directory (resumable).")
@click.option("--mode", type=click.Choice(["text", "chat"]), default="text", show_default=True,
              help="text: align the whole text; chat: render each model's chat template and align the final "
                   "assistant turn (docs/CHAT.md).")
@click.option("--max-student-tokens", default=2048, show_default=True, type=int,
              help="Window limit of the student, context token included.")
@click.option("--max-teacher-tokens", "max_teacher_tokens", multiple=True, type=int,
              help="Window limit of the teachers, context token included: once for all, or once per teacher "
                   "(default: --max-student-tokens).")
@click.option("--no-context-token", is_flag=True,
              help="Do not start each window with the BOS / document-separator token.")
@click.option("--tables", "tables", nargs=2, multiple=True, type=click.Path(dir_okay=False),
              help="S2T T2S: existing student->teacher and teacher->student tables, once per teacher in order "
                   "(default: build them).")
@click.option("--text-field", default="text", show_default=True, help="The text field of .jsonl/.json/.parquet records.")
@click.option("--split-on-blank-lines", is_flag=True, help=".txt files: one document per blank-line-separated block.")
@click.option("--shard-mb", default=4.0, show_default=True, type=float, help="Source text per output shard, in MiB.")
@click.option("--batch-mb", default=1.0, show_default=True, type=float,
              help="Text tokenized per encode_batch call, in MiB (memory vs speed; output is the same).")
@click.option("--workers", default=1, show_default=True, type=int, help="Processes on this machine (whole shards each).")
@click.option("--rank", type=int, default=None, help="This machine's rank (default: RANK or SLURM_PROCID, else 0).")
@click.option("--world-size", type=int, default=None,
              help="Number of machines (default: WORLD_SIZE or SLURM_NTASKS, else 1).")
@click.option("--student-chat-template", type=click.Path(dir_okay=False),
              help="Chat mode: the student's template (.jinja, tokenizer_config.json or GGUF; default: the tokenizer's).")
@click.option("--teacher-chat-template", "teacher_chat_templates", multiple=True,
              help="Chat mode: a teacher's template file, once for all or once per teacher in order "
                   "(`default`: that teacher tokenizer's own).")
@click.option("--include-thinking", is_flag=True,
              help="Chat mode: train on the final turn's reasoning and its closing marker too (not the opening scaffold).")
@click.option("--alignment-regions", "alignment_regions", multiple=True,
              help="Chat mode with --include-thinking: KD only on these regions, comma-separated from "
                   "reasoning,close,answer,eot (default: all).")
@click.option("--drop-first-assistant-chunk", "drop_first_assistant_chunk", multiple=True, type=int,
              help="Chat mode: for this teacher index (repeatable), exclude the first accepted chunk of the final "
                   "assistant message from KD.")
@click.option("--trust-remote-code", is_flag=True, help="Allow a hub tokenizer's remote code (off by default).")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def align(corpus, student_tokenizer, teacher_tokenizers, output, mode, max_student_tokens, max_teacher_tokens,
          no_context_token, tables, text_field, split_on_blank_lines, shard_mb, batch_mb, workers, rank, world_size,
          student_chat_template, teacher_chat_templates, include_thinking, alignment_regions,
          drop_first_assistant_chunk, trust_remote_code, quiet):
    """Align a corpus into shards of windows (SPEC §4, §7, §8); re-running resumes."""
    from csd_pipeline.align.stage import AlignConfig, run_align
    from csd_pipeline.runtime.progress import set_quiet

    config = AlignConfig(
        corpus=list(corpus),
        student_tokenizer=student_tokenizer,
        teacher_tokenizers=list(teacher_tokenizers),
        output=output,
        mode=mode,
        max_student_tokens=max_student_tokens,
        max_teacher_tokens=list(max_teacher_tokens),
        context_token=not no_context_token,
        text_field=text_field,
        split_on_blank_lines=split_on_blank_lines,
        shard_bytes=int(shard_mb * (1 << 20)),
        tables=[tuple(pair) for pair in tables],
        batch_bytes=max(1, int(batch_mb * (1 << 20))),
        trust_remote_code=trust_remote_code,
        student_chat_template=student_chat_template,
        teacher_chat_templates=list(teacher_chat_templates),
        include_thinking=include_thinking,
        alignment_regions=list(alignment_regions),
        drop_first_assistant_chunk=list(drop_first_assistant_chunk),
    )
    log = None if quiet else (lambda message: click.echo(message, err=True))
    set_quiet(quiet)
    report = run_align(config, rank=rank, world_size=world_size, workers=workers, log=log)
    if not quiet:
        echo_run_report(output, report)
