"""`csd-pipeline tables build | validate | build-both | inspect`."""

from __future__ import annotations

import json

import click

from csd_pipeline.runtime.options import config_option
from csd_pipeline.vocab.config import TableBuildConfig, TableCheckConfig, TablePairConfig


@click.group()
def tables():
    """Byte-exact sub-token tables between two vocabularies (both directions)."""


@tables.command()
@config_option(TableBuildConfig, "source_tokenizer")
@config_option(TableBuildConfig, "destination_tokenizer")
@config_option(TableBuildConfig, "output", type=click.Path(dir_okay=False))
@config_option(TableBuildConfig, "trust_remote_code")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def build(source_tokenizer, destination_tokenizer, output, trust_remote_code, quiet):
    """Build the (source -> destination) table."""
    from csd_pipeline.runtime import storage
    from csd_pipeline.vocab.tokenizer_files import open_tokenizer

    if storage.is_url(output):  # a missing bucket or refused credentials fail before the build
        storage.check_writable(storage.location(output).parent)

    # build_table encodes with the destination tokenizer: built in a thread from the moment its file is
    # read, before numpy and the table code are imported (Tokenizer.from_str holds the GIL, so those
    # imports wait for it; the encoding, which is what waits for the tokenizer, starts sooner)
    opened = open_tokenizer(destination_tokenizer, trust_remote_code=trust_remote_code, start_tokenizer=True)
    from csd_pipeline.runtime.progress import set_quiet
    from csd_pipeline.vocab.tables import build_table
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    set_quiet(quiet)
    destination = load_tokenizer(destination_tokenizer, trust_remote_code=trust_remote_code, opened=opened)
    source = load_tokenizer(source_tokenizer, trust_remote_code=trust_remote_code)
    table = build_table(source, destination)
    table.save(output)
    if not quiet:
        c = table.counts()
        click.echo(
            f"wrote {output}: {c['source_vocab_size']} -> {c['destination_vocab_size']} ids, "
            f"{c['common_spellings']} common spellings, {c['prefix_entries']} prefix entries "
            f"({c['canonical_multi_token_chains']} canonical multi-token chains)"
        )


@tables.command()
@config_option(TableCheckConfig, "student_tokenizer")
@config_option(TableCheckConfig, "teacher_tokenizer")
@config_option(TableCheckConfig, "student_to_teacher", type=click.Path(dir_okay=False))
@config_option(TableCheckConfig, "teacher_to_student", type=click.Path(dir_okay=False))
@config_option(TableCheckConfig, "sample")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def validate(student_tokenizer, teacher_tokenizer, student_to_teacher, teacher_to_student, sample, as_json):
    """Check both tables against the tokenizers (fingerprints, direction, sampled entries)."""
    from csd_pipeline.vocab.tables import load_table, validate_tables
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    student = load_tokenizer(student_tokenizer)
    teacher = load_tokenizer(teacher_tokenizer)
    s2t = load_table(student_to_teacher)
    t2s = load_table(teacher_to_student)
    report = validate_tables(student, teacher, s2t, t2s, sample=sample)
    if as_json:
        click.echo(json.dumps({"ok": True, "tables": report}, sort_keys=True))
    else:
        click.echo(f"ok: {student_to_teacher} and {teacher_to_student} match {student_tokenizer} and {teacher_tokenizer}")


@tables.command("build-both")
@config_option(TablePairConfig, "student_tokenizer")
@config_option(TablePairConfig, "teacher_tokenizer")
@config_option(TablePairConfig, "output_dir", type=click.Path(file_okay=False))
@config_option(TablePairConfig, "sample")
@config_option(TablePairConfig, "trust_remote_code")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def build_both(student_tokenizer, teacher_tokenizer, output_dir, sample, trust_remote_code, quiet):
    """Build both tables of a pair and validate them (what `make tables` runs): the files of two
    `tables build` calls, then `tables validate`, in one process."""
    from csd_pipeline.runtime.progress import set_quiet
    from csd_pipeline.vocab.table_pair import build_and_validate_pair

    set_quiet(quiet)
    result = build_and_validate_pair(student_tokenizer, teacher_tokenizer, output_dir, sample=sample,
                                     trust_remote_code=trust_remote_code)
    if not quiet:
        for key in ("student_to_teacher", "teacher_to_student"):
            c = result["report"][key.replace("_", "-")]
            click.echo(f"wrote {result[key]}: {c['source_vocab_size']} -> {c['destination_vocab_size']} ids, "
                       f"{c['common_spellings']} common spellings, {c['prefix_entries']} prefix entries")
        click.echo(f"ok: both tables match {student_tokenizer} and {teacher_tokenizer}")


@tables.command()
@click.argument("table_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(table_file, as_json):
    """Counts: vocab sizes, common spellings, prefix entries, spelling classes, specials."""
    from csd_pipeline.vocab.tables import inspect_table

    counts = inspect_table(table_file)
    if as_json:
        click.echo(json.dumps(counts, sort_keys=True))
        return
    width = max(len(k) for k in counts)
    for key, value in counts.items():
        click.echo(f"{key:<{width}}  {value}")
