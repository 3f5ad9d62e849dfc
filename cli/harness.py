"""`csd-pipeline evaluate`: standard tasks with lm-evaluation-harness (the optional extra `[eval]`).

    csd-pipeline evaluate --model out/run/export --tasks csd_next_sentence --output results.json
    csd-pipeline evaluate --list-tasks            # this project's tasks first, one per line
    csd-pipeline evaluate ... --cache-dir DIR     # reuse an earlier run's scores of the same model and tasks
"""

from __future__ import annotations

import click

from csd_pipeline.evaluation.harness import EvaluateConfig
from csd_pipeline.runtime.options import config_field, config_option


@click.command("evaluate")
@config_option(EvaluateConfig, "model", required=False)
@click.option("--tasks", help=config_field(EvaluateConfig, "tasks").metadata["help"])
@config_option(EvaluateConfig, "include_paths", "--include-path", type=click.Path(), required=False)
@config_option(EvaluateConfig, "limit", type=int)
@config_option(EvaluateConfig, "batch_size")
@config_option(EvaluateConfig, "num_fewshot", type=int)
@config_option(EvaluateConfig, "device")
@config_option(EvaluateConfig, "seed")
@click.option("--output", type=click.Path(dir_okay=False), help="Write the harness's results as JSON here.")
@click.option("--cache-dir", type=click.Path(file_okay=False),
              help="Reuse the results of an earlier run with the same model weights, task files, lm-eval version and "
                   "options from this folder (and store new ones there).")
@click.option("--list-tasks", is_flag=True, help="Print every task name, this project's first, and exit.")
def evaluate(model, tasks, include_paths, limit, batch_size, num_fewshot, device, seed, output, cache_dir,
             list_tasks):
    """Score MODEL on lm-evaluation-harness tasks (offline: the project's own csd_next_sentence)."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.evaluation import harness

    if list_tasks:
        for name in harness.list_tasks(list(include_paths)):
            click.echo(name)
        return
    missing = [flag for flag, value in (("--model", model), ("--tasks", tasks), ("--output", output)) if not value]
    if missing:
        raise CsdError(f"evaluate needs {', '.join(missing)}; e.g. csd-pipeline evaluate --model out/run/export "
                       "--tasks csd_next_sentence --output results.json")
    config = EvaluateConfig(model=model, tasks=[t.strip() for t in tasks.split(",")],
                            include_paths=list(include_paths), limit=limit, batch_size=batch_size,
                            device=device, num_fewshot=num_fewshot, seed=seed)
    if cache_dir:
        results, reused = harness.evaluate_cached(config, cache_dir)
        if reused is not None:
            click.echo(f"task scores reused from {reused} (same model sha256 "
                       f"{results['csd_pipeline']['cache_key']['model_sha256'][:12]}, task files, lm-eval "
                       f"{results['csd_pipeline']['cache_key']['lm_eval']} and options)")
    else:
        results = harness.evaluate(config)
    if not results:
        return
    import json

    from csd_pipeline.runtime.files import atomic_write_text

    atomic_write_text(output, json.dumps(results, indent=2, sort_keys=True) + "\n")
    for line in harness.score_lines(results):
        click.echo(line)
    click.echo(f"results: {output}")
