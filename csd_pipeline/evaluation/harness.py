"""Standard-task evaluation with lm-evaluation-harness (`csd-pipeline evaluate`).

The harness runs unchanged: `lm_eval.simple_evaluate` with its Hugging Face backend on the model's
local folder, a `TaskManager` that sees the harness's own registry, this project's tasks
(`tasks/`, package data) and any `--include-path` folders of the user's. lm-eval is the optional
extra `csd-pipeline[eval]`; it is imported only here, inside functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.options import option

PROJECT_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
INSTALL_HINT = "pip install 'csd-pipeline[eval]'"


@dataclass
class EvaluateConfig:
    """What `csd-pipeline evaluate` runs (each field's help is its flag's; `cli/harness.py`)."""

    model: str = option(help="HF folder (a csd-train export), fixture or hub name (GGUF files are refused).")
    tasks: list[str] = option(help="Task, group or tag names separated by commas (e.g. csd_next_sentence).")
    include_paths: list[str] = option([], "A folder of your own task YAML files (repeatable).")
    limit: int | None = option(None, "At most N documents per task (default: all).")
    batch_size: int = option(8, "Requests per forward pass.")
    device: str = option("auto", "auto, cpu or cuda (float32 on CPU, bf16 on GPU).")
    num_fewshot: int | None = option(None, "Few-shot examples (default: each task's own).")
    seed: int = option(0, "The harness's random, numpy, torch and few-shot seeds.")

    def __post_init__(self):
        if not self.tasks or any(not t.strip() for t in self.tasks):
            raise CsdError("--tasks is empty; pass task names separated by commas (`csd-pipeline evaluate "
                           "--list-tasks` lists them)")
        if self.limit is not None and self.limit < 1:
            raise CsdError(f"--limit {self.limit}: pass a number of documents >= 1, or leave it out for all")
        if self.batch_size < 1:
            raise CsdError(f"--batch-size {self.batch_size}: pass a number >= 1")
        for folder in self.include_paths:
            if not Path(folder).is_dir():
                raise CsdError(f"--include-path {folder}: no such folder; pass a folder of task YAML files")


def require_lm_eval():
    """The `lm_eval` module. Raises CsdError (one line, how to install) when it is not installed."""
    try:
        import lm_eval  # noqa: I001  (first: a missing harness is named before its dependencies)
        import accelerate  # noqa: F401  (the harness's HF backend imports it)
    except ImportError as err:
        raise CsdError(f"csd-pipeline evaluate needs lm-evaluation-harness, and `{err.name}` is not installed; "
                       f"run: {INSTALL_HINT}") from None
    return lm_eval


def task_manager(include_paths: list[str], with_registry: bool = True):
    """An lm-eval TaskManager over the project's tasks, `include_paths` and (with_registry) the harness's own.
    Indexing the harness's registry takes seconds, so a process keeps one manager per set of task folders and
    their files' contents (`task_files_sha256`): csd-train scoring tasks at several steps indexes once."""
    require_lm_eval()
    key = (tuple(map(str, include_paths)), with_registry, task_files_sha256(list(include_paths)))
    if key not in _MANAGERS:
        from lm_eval.tasks import TaskManager

        _MANAGERS[key] = TaskManager(include_path=[str(PROJECT_TASKS_DIR), *map(str, include_paths)],
                                     include_defaults=with_registry)
    return _MANAGERS[key]


_MANAGERS: dict[tuple, object] = {}


def list_tasks(include_paths: list[str]) -> list[str]:
    """Every task, group and tag name: the project's first, then the user's folders', then the harness's."""
    manager = task_manager(include_paths)
    roots = [PROJECT_TASKS_DIR.resolve(), *(Path(p).resolve() for p in include_paths)]

    def origin(name: str) -> int:
        yaml_path = manager.task_index[name].yaml_path
        if yaml_path is not None:
            resolved = Path(yaml_path).resolve()
            for rank, root in enumerate(roots):
                if resolved.is_relative_to(root):
                    return rank
        return len(roots)

    return sorted(manager.all_tasks, key=lambda name: (origin(name), name))


def manager_for(config: EvaluateConfig):
    """A TaskManager that knows every name in config.tasks; the harness's registry (seconds to index) is
    left out when only the project's tasks are asked for. Raises CsdError naming an unknown task."""
    if not config.include_paths:
        own = task_manager([], with_registry=False)
        if all(name in own.all_tasks for name in config.tasks):
            return own
    manager = task_manager(config.include_paths)
    unknown = [name for name in config.tasks if name not in manager.all_tasks and not Path(name).is_file()]
    if unknown:
        raise CsdError(f"unknown task {', '.join(unknown)}: `csd-pipeline evaluate --list-tasks` lists the tasks "
                       "(this project's first); a task of your own: --include-path DIR with its YAML")
    return manager


def model_arguments(model: str, device: str) -> tuple[dict, str]:
    """(model_args for lm-eval's `hf` backend, torch device name) for a model argument.

    The model is resolved to a local folder (fixture names included) with the project's resolver.
    Raises CsdError when there is no such model.
    """
    from csd_pipeline.runtime.model_loading import resolve_device, resolve_model_source

    torch_device = resolve_device(device)
    path, gguf_file = resolve_model_source(model)
    if gguf_file is not None:   # the harness can read GGUF, but that path is not tested here
        raise CsdError(f"model {model}: evaluate reads Hugging Face folders, not GGUF ({gguf_file}); pass a csd-train "
                       "export, or load the GGUF once with transformers and save_pretrained it to a folder")
    args = {"pretrained": str(path), "dtype": "float32" if torch_device.type == "cpu" else "bfloat16",
            "trust_remote_code": False}
    return args, str(torch_device)


def evaluate(config: EvaluateConfig) -> dict:
    """Run the harness; returns its results as a JSON-ready dict, with this run's settings under
    "csd_pipeline". Raises CsdError for a missing lm-eval, model or task."""
    require_lm_eval()
    from csd_pipeline.runtime.model_loading import model_fingerprint

    model_args, device = model_arguments(config.model, config.device)
    manager = manager_for(config)
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    results = simple_evaluate(
        model="hf", model_args=model_args, tasks=list(config.tasks), num_fewshot=config.num_fewshot,
        batch_size=config.batch_size, device=device, limit=config.limit, task_manager=manager,
        log_samples=False, random_seed=config.seed, numpy_random_seed=config.seed,
        torch_random_seed=config.seed, fewshot_random_seed=config.seed,
    )
    if results is None:  # simple_evaluate returns None on the ranks other than 0
        return {}
    results.pop("samples", None)
    results = json.loads(json.dumps(results, default=handle_non_serializable))
    fingerprint = model_fingerprint(Path(model_args["pretrained"]))
    results["csd_pipeline"] = {
        "model": config.model, "model_path": model_args["pretrained"], "model_sha256": fingerprint["sha256"],
        "tasks": list(config.tasks), "include_paths": list(config.include_paths), "limit": config.limit,
        "batch_size": config.batch_size, "device": device, "dtype": model_args["dtype"], "seed": config.seed,
    }
    return results


def task_files_sha256(include_paths: list[str]) -> str:
    """One sha256 over every file of the project's task folder and of `include_paths` (names and bytes): a task's
    YAML (with its `metadata: version`), data and code; any change gives another value."""
    from csd_pipeline.runtime.files import bytes_sha256

    parts = []
    for root in (PROJECT_TASKS_DIR, *map(Path, include_paths)):
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            parts.append(f"{root.name}/{path.relative_to(root).as_posix()}\0{bytes_sha256(path.read_bytes())}\n")
    return bytes_sha256("".join(parts).encode("utf-8"))


def cache_key(config: EvaluateConfig) -> dict:
    """What a cached result stands for: the model's weights, the tasks' files, the harness's version and every
    option that changes a score."""
    from importlib.metadata import version

    from csd_pipeline.runtime.model_loading import model_fingerprint

    model_args, device = model_arguments(config.model, config.device)
    return {"model_sha256": model_fingerprint(Path(model_args["pretrained"]))["sha256"],
            "tasks": sorted(config.tasks), "task_files_sha256": task_files_sha256(list(config.include_paths)),
            "lm_eval": version("lm_eval"), "limit": config.limit, "batch_size": config.batch_size,
            "num_fewshot": config.num_fewshot, "seed": config.seed, "device": device, "dtype": model_args["dtype"]}


def cache_file(cache_dir: str | Path, key: dict) -> Path:
    """The file in `cache_dir` that holds the results of `key` (`cache_key`)."""
    from csd_pipeline.runtime.files import bytes_sha256

    return Path(cache_dir) / f"{bytes_sha256(json.dumps(key, sort_keys=True).encode('utf-8'))[:32]}.json"


def evaluate_cached(config: EvaluateConfig, cache_dir: str | Path) -> tuple[dict, Path | None]:
    """`evaluate(config)`, or its earlier results from `cache_dir` when the model, the tasks' files, the harness's
    version and the options are the same (`cache_key`). Returns (results, the cache file reused or None)."""
    from csd_pipeline.runtime.files import atomic_write_text

    key = cache_key(config)
    path = cache_file(cache_dir, key)
    if path.is_file():
        try:
            cached = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cached = None   # unreadable: computed again and replaced
        if isinstance(cached, dict) and cached.get("csd_pipeline", {}).get("cache_key") == key:
            return cached, path
    results = evaluate(config)
    if results:
        results["csd_pipeline"]["cache_key"] = key
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(results, indent=2, sort_keys=True) + "\n")
    return results, None


def score_lines(results: dict) -> list[str]:
    """One line per task (and group) and metric: `task metric value ± stderr`."""
    lines = []
    for section in ("results", "groups"):
        for task, metrics in sorted(results.get(section, {}).items()):
            for key, value in sorted(metrics.items()):
                name, _, filt = key.partition(",")
                if name.endswith("_stderr") or not isinstance(value, (int, float)) or name in ("alias", "sample_len"):
                    continue
                stderr = metrics.get(f"{name}_stderr,{filt}")
                spread = f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else ""
                line = f"{task} {name} {value:.4f}{spread}"
                if line not in lines:
                    lines.append(line)
    return lines
