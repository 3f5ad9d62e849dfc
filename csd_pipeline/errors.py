"""User-facing errors: one sentence saying what is wrong, where, and what to do.

The CLIs catch `CsdError`, print its message on stderr and exit non-zero, so a user
mistake never shows a Python traceback.
"""


class CsdError(Exception):
    """A user-facing error (bad path, unsupported tokenizer, mismatched manifest, ...)."""

    exit_code = 2


class UnsupportedTokenizerError(CsdError):
    """The tokenizer's family cannot be made byte-exact."""


class ManifestError(CsdError):
    """A stage output is missing its manifest, has an unknown schema, or mismatches its inputs."""
