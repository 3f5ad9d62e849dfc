"""`csd-pipeline recipes`: list the shipped recipes, or print one (what `csd-train --config NAME` reads)."""

from __future__ import annotations

import click


@click.command("recipes")
@click.argument("name", required=False)
def recipes(name: str | None) -> None:
    """List the shipped recipes by name, or print the recipe NAME.

    A training recipe is what `csd-train --config NAME` reads (`csd-train --config pretrained/train --config
    pretrained/csd_kl_b1_t1.5_fixed0.5 ...`); a store recipe (stores/...) holds `teacher-logits` options.
    Copy one to a file of your own to change it: `csd-pipeline recipes demo/train > my.yaml`.
    """
    from csd_pipeline.recipes import load_recipe, recipe_path, shipped_recipes

    if name is None:
        names = shipped_recipes()
        width = max(map(len, names))
        for each in names:
            options = ", ".join(f"{key}: {str(value).lower() if isinstance(value, bool) else value}" for key, value in load_recipe(each).items())
            click.echo(f"{each:<{width}}  {options}")
        return
    load_recipe(name)  # refuses a missing or malformed recipe with one line naming it
    click.echo(recipe_path(name).read_text(encoding="utf-8"), nl=False)
