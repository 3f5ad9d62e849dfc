"""Make a depth-pruned student: a pretrained causal LM with some of its decoder layers removed, as an HF folder.

Depth pruning (Minitron, "The Unreasonable Ineffectiveness of the Deeper Layers") removes whole decoder
layers and heals the model by training; the layers whose removal hurts least are usually a block of the
deeper ones, short of the last. The default keeps SmolLM2-135M's first 8 and last 2 of its 30 layers
(`--keep 0-7,28-29`): two thirds of the layers gone. The output loads with
`transformers.AutoModelForCausalLM.from_pretrained` and nothing else (config with the new layer count,
safetensors weights, the source's tokenizer files and generation config byte for byte).

    python -m bench.experiments.prune_student --model smollm2-135m-instruct --keep 0-7,28-29 --output out/smollm2-pruned
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_layers(spec: str, total: int) -> list[int]:
    """`0-7,28-29` -> [0, ..., 7, 28, 29]; raises ValueError for an empty, repeated or out-of-range spec."""
    layers: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        layers += range(int(first), int(last or first) + 1)
    if not layers or len(set(layers)) != len(layers) or sorted(layers) != layers or not 0 <= layers[0] <= layers[-1] < total:
        raise ValueError(f"--keep {spec!r}: give increasing layer indices in [0, {total}) without repeats, e.g. 0-7,28-29")
    return layers


def prune(model_arg: str, keep: str, output: Path) -> list[int]:
    """Write the pruned model to `output`; returns the kept layer indices."""
    import torch

    from csd_pipeline.runtime.model_loading import load_causal_lm
    from trainer.export import save_tokenizer

    model = load_causal_lm(model_arg, dtype="float32", device="cpu").model
    layers = model.model.layers
    kept = parse_layers(keep, len(layers))
    model.model.layers = torch.nn.ModuleList(layers[i] for i in kept)
    for index, layer in enumerate(model.model.layers):  # the attention cache is indexed by position in the stack
        layer.self_attn.layer_idx = index
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in kept]
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    save_tokenizer(model_arg, output)
    return kept


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a fixture name or an HF folder")
    parser.add_argument("--keep", default="0-7,28-29", help="decoder layers to keep (default 0-7,28-29)")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        kept = prune(args.model, args.keep, args.output)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"kept {len(kept)} layers ({args.keep}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
