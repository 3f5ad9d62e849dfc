"""`csd-pipeline teacher-logits`: run the teacher once over aligned shards and store its top-k."""

from __future__ import annotations

import click

from cli.outputs import echo_run_report


@click.command()
@click.option("--aligned", required=True, type=click.Path(file_okay=False),
              help="Output directory of `csd-pipeline align`.")
@click.option("--teacher", required=True,
              help="The teacher model: a local Hugging Face folder, a GGUF file, a hub name or a fixture name.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Output directory (resumable).")
@click.option("--teacher-index", default=0, show_default=True, type=int,
              help="Which teacher of the aligned directory this model is (its teacher{i}_ids column).")
@click.option("--top-k", "top_k", default=32, show_default=True, type=int, help="Entries kept per position.")
@click.option("--batch-tokens", default=8192, show_default=True, type=int,
              help="Token budget of one forward batch, padding included (rows are batched by length).")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16", "float64"]),
              help="Teacher weights: auto = float32 on CPU, bfloat16 on GPU. Logits and log-softmax are always float32.")
@click.option("--temperature", default=1.0, show_default=True, type=float,
              help="Capture temperature: the logits are divided by it before the log-softmax.")
@click.option("--block-positions", default=65536, show_default=True, type=int,
              help="Positions per encoded block (one Parquet row group); bigger compresses slightly better.")
@click.option("--skip-tokenizer-check", is_flag=True,
              help="Do not compare the teacher folder's tokenizer.json with the aligned teacher tokenizer.")
@click.option("--workers", default=1, show_default=True, type=int,
              help="Processes on this machine, each with its own copy of the teacher (whole shards each).")
@click.option("--rank", type=int, default=None, help="This process's rank (default: RANK or SLURM_PROCID, else 0).")
@click.option("--world-size", type=int, default=None,
              help="Number of processes (default: WORLD_SIZE or SLURM_NTASKS, else 1).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model repository's own code (off by default).")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def teacher_logits(aligned, teacher, output, teacher_index, top_k, batch_tokens, device, dtype, temperature,
                   block_positions, skip_tokenizer_check, workers, rank, world_size, trust_remote_code, quiet):
    """Store the teacher's top-k log-probabilities for every aligned teacher position (SPEC §6); re-running
    resumes, and `torchrun --nproc-per-node N` splits the shards over N processes."""
    from csd_pipeline.runtime.progress import set_quiet
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits

    config = TeacherLogitsConfig(
        aligned=aligned, teacher=teacher, output=output, teacher_index=teacher_index, top_k=top_k,
        batch_tokens=batch_tokens, device=device, dtype=dtype, temperature=temperature,
        trust_remote_code=trust_remote_code, block_positions=block_positions,
        check_tokenizer=not skip_tokenizer_check,
    )
    log = None if quiet else (lambda message: click.echo(message, err=True))
    set_quiet(quiet)
    report = run_teacher_logits(config, rank=rank, world_size=world_size, workers=workers, log=log)
    if not quiet:
        echo_run_report(output, report)
