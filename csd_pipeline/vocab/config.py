"""The options of `csd-pipeline tables build`, `tables validate` and `tables build-both`, each with its one default and help.

The click commands (`cli/tables.py`) build their flags from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from csd_pipeline.runtime.options import option

TOKENIZER_HELP = "tokenizer.json, tokenizer folder, hub name or fixture name."


@dataclass
class TableBuildConfig:
    """Options of `csd-pipeline tables build`: the (source -> destination) table."""

    source_tokenizer: str = option(help=TOKENIZER_HELP)
    destination_tokenizer: str = option(help=TOKENIZER_HELP)
    output: str = option(help="Table file to write (.safetensors).")
    trust_remote_code: bool = option(False, "Allow a hub tokenizer's remote code (off by default).")


@dataclass
class TableCheckConfig:
    """Options of `csd-pipeline tables validate`: both tables of a pair against their tokenizers."""

    student_tokenizer: str = option(help=TOKENIZER_HELP)
    teacher_tokenizer: str = option(help=TOKENIZER_HELP)
    student_to_teacher: str = option(help="The student->teacher table file.")
    teacher_to_student: str = option(help="The teacher->student table file.")
    sample: int = option(2000, "Entries re-derived from the tokenizers per check.")


@dataclass
class TablePairConfig:
    """Options of `csd-pipeline tables build-both`: both tables of a pair, then their validation."""

    student_tokenizer: str = option(help=TOKENIZER_HELP)
    teacher_tokenizer: str = option(help=TOKENIZER_HELP)
    output_dir: str = option(help="Folder to write student_to_teacher.safetensors and teacher_to_student.safetensors into.")
    sample: int = option(TableCheckConfig.sample, "Entries re-derived from the tokenizers per check.")
    trust_remote_code: bool = option(False, "Allow a hub tokenizer's remote code (off by default).")
