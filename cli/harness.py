"""`csd-pipeline evaluate`: standard tasks with lm-evaluation-harness (the optional extra `[eval]`).

    csd-pipeline evaluate --model out/run/export --tasks csd_next_sentence --output results.json
    csd-pipeline evaluate --list-tasks            # this project's tasks first, one per line
"""

from __future__ import annotations

import click

from csd_pipeline.evaluation.harness import EvaluateConfig
from csd_pipeline.runtime.options import default_of


@click.command("evaluate")
@click.option("--model", "model_arg", help="HF folder (a csd-train export), fixture or hub name.")
@click.option("--tasks", help="Task, group or tag names separated by commas (e.g. csd_next_sentence).")
@click.option("--include-path", "include_paths", multiple=True, type=click.Path(),
              help="A folder of your own task YAML files (repeatable).")
@click.option("--limit", type=int, default=None, help="At most N documents per task (default: all).")
@click.option("--batch-size", default=default_of(EvaluateConfig, "batch_size"), show_default=True, help="Requests per forward pass.")
@click.option("--num-fewshot", type=int, default=None, help="Few-shot examples (default: each task's own).")
@click.option("--device", default=default_of(EvaluateConfig, "device"), show_default=True, help="auto, cpu or cuda (float32 on CPU, bf16 on GPU).")
@click.option("--seed", default=default_of(EvaluateConfig, "seed"), show_default=True, help="The harness's random, numpy, torch and few-shot seeds.")
@click.option("--output", type=click.Path(dir_okay=False), help="Write the harness's results as JSON here.")
@click.option("--list-tasks", is_flag=True, help="Print every task name, this project's first, and exit.")
def evaluate(model_arg, tasks, include_paths, limit, batch_size, num_fewshot, device, seed, output, list_tasks):
    """Score MODEL on lm-evaluation-harness tasks (offline: the project's own csd_next_sentence)."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.evaluation import harness

    if list_tasks:
        for name in harness.list_tasks(list(include_paths)):
            click.echo(name)
        return
    missing = [flag for flag, value in (("--model", model_arg), ("--tasks", tasks), ("--output", output)) if not value]
    if missing:
        raise CsdError(f"evaluate needs {', '.join(missing)}; e.g. csd-pipeline evaluate --model out/run/export "
                       "--tasks csd_next_sentence --output results.json")
    config = EvaluateConfig(model=model_arg, tasks=[t.strip() for t in tasks.split(",")],
                            include_paths=list(include_paths), limit=limit, batch_size=batch_size,
                            device=device, num_fewshot=num_fewshot, seed=seed)
    results = harness.evaluate(config)
    if not results:
        return
    import json

    from csd_pipeline.runtime.files import atomic_write_text

    atomic_write_text(output, json.dumps(results, indent=2, sort_keys=True) + "\n")
    for line in harness.score_lines(results):
        click.echo(line)
    click.echo(f"results: {output}")
