"""csd-pipeline: offline Common-Support Distillation across tokenizers.

Stages: sub-token tables, alignment, teacher top-k, training. Heavy libraries are
imported inside the functions that use them so that importing this package is cheap.
"""

__version__ = "0.1.0"

__all__ = ["CsdError", "read_teacher_topk", "__version__"]


def __getattr__(name):
    # Lazy exports: keep `import csd_pipeline` (and every `--help`) instant.
    if name == "CsdError":
        from csd_pipeline.errors import CsdError

        return CsdError
    if name == "read_teacher_topk":
        from csd_pipeline.teacher.store.reader import read_teacher_topk

        return read_teacher_topk
    raise AttributeError(f"module 'csd_pipeline' has no attribute {name!r}")
