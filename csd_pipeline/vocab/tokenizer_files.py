"""Finding, reading and building a tokenizer: the part of loading one that needs no numpy.

`open_tokenizer` resolves a tokenizer argument (file, folder, hub name or fixture name) to its
tokenizer.json and configuration, reads the JSON text and, when asked, begins building the
`tokenizers.Tokenizer` in a thread. `tables build` calls it before its other imports, so the
destination tokenizer is being built while they load; `vocab.vocabulary.load_tokenizer` does the rest.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError


@dataclass
class TokenizerSource:
    """A tokenizer argument resolved and read: its tokenizer.json, configuration and JSON text."""

    arg: str
    file: Path
    config: dict
    raw_json: str
    building: tuple | None = None  # (thread, outcome) of `tokenizer_in_thread`, when begun


def open_tokenizer(arg: str, *, trust_remote_code: bool = False, start_tokenizer: bool = False) -> TokenizerSource:
    """Resolve and read tokenizer `arg`; begin building its tokenizer in a thread if `start_tokenizer`.

    Raises CsdError for a missing/unreadable file or a folder with only a slow tokenizer.
    """
    from csd_pipeline.fixtures.names import resolve_tokenizer_arg
    from csd_pipeline.runtime.storage import refuse_url

    refuse_url(arg, "tokenizer")
    resolved = resolve_tokenizer_arg(str(arg))
    path = Path(resolved)
    if path.is_file():
        tokenizer_file, config = path, _read_config(path.parent, only_if_sibling=path)
    elif path.is_dir():
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            if any((path / name).exists() for name in ("tokenizer.model", "vocab.json", "vocab.txt")):
                raise CsdError(
                    f"tokenizer {arg}: the folder has no tokenizer.json, only a slow (non-fast) tokenizer; "
                    "convert it once with transformers (AutoTokenizer.from_pretrained(...).save_pretrained(...)) "
                    "and pass the saved folder"
                )
            raise CsdError(f"tokenizer {arg}: no tokenizer.json in this folder; pass a tokenizer.json file or a model folder")
        config = _read_config(path)
    elif os.sep in arg or arg.endswith(".json") or arg.startswith("."):
        raise CsdError(f"tokenizer {arg}: no such file or folder; check the path (or run `make fixtures` for fixture names)")
    else:
        tokenizer_file, config = _from_hub(arg, trust_remote_code)
    try:
        raw = read_json_text(tokenizer_file)
    except (OSError, UnicodeDecodeError) as err:
        raise CsdError(f"tokenizer {arg}: cannot read {tokenizer_file} ({err.__class__.__name__}); check the file") from None
    building = tokenizer_in_thread(raw, str(arg)) if start_tokenizer else None
    return TokenizerSource(str(arg), tokenizer_file, config, raw, building)


def read_json_text(path: Path) -> str:
    """`path.read_text(encoding="utf-8")`, read and decoded in one piece (a 16 MB tokenizer.json
    three times faster than through `read_text`'s incremental decoder), newlines translated the same
    way (`\r\n` and a lone `\r` become `\n`), so fingerprints do not change."""
    text = path.read_bytes().decode("utf-8")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def parse_tokenizer_json(raw: str) -> dict:
    """`json.loads` of a tokenizer.json, leaving a BPE model's merges out when they can be cut cleanly.

    The vocabulary never reads the merges (the `tokenizers` library parses its own copy), and they
    are most of the parse: a third of the time for Llama 3's tokenizer. They are the file's last
    array (serialised last in `model`, itself the last key); the result keeps `"merges": []` then.
    Anything unexpected falls back to parsing everything. Raises ValueError on invalid JSON.
    """
    key, close = raw.rfind('"merges"'), raw.rfind("]")
    if 0 < key < close and "".join(raw[close + 1:].split()) == "}}":
        try:
            spec = json.loads(raw[:key] + '"merges": []' + raw[close + 1:])
        except ValueError:
            spec = None
        if isinstance(spec, dict) and isinstance(spec.get("model"), dict) and spec["model"].get("merges") == []:
            return spec
    return json.loads(raw)


def tokenizer_in_thread(raw_json: str, name: str):
    """(thread, outcome): a thread building the tokenizer of `raw_json`; `outcome` then holds the
    tokenizer or the error. `Tokenizer.from_str` (a third of a second at 150k ids, 1.2 s at 262k)
    holds the GIL in tokenizers 0.23, so other threads wait for it unless they are in file reads
    or `encode_batch`; building it first, before any other work needs it, keeps it off the end."""
    import threading

    outcome: list = []

    def build():
        try:
            outcome.append(tokenizer_from_json(raw_json, name))
        except Exception as err:  # raised in the thread that asks for the tokenizer
            outcome.append(err)

    thread = threading.Thread(target=build, name=f"tokenizer {name}", daemon=True)
    thread.start()
    return thread, outcome


def tokenizer_from_json(raw_json: str, name: str):
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(raw_json)
    except Exception as err:  # tokenizers raises a plain Exception on a malformed description
        first = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        raise CsdError(f"tokenizer {name}: the tokenizers library cannot load it ({first})") from None
    # Corpus text is never parsed into special tokens.
    tokenizer.encode_special_tokens = True
    return tokenizer


def _read_config(folder: Path, only_if_sibling: Path | None = None) -> dict:
    config: dict = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = folder / name
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError) as err:
                raise CsdError(f"tokenizer config {f}: unreadable JSON ({err.__class__.__name__}); fix or remove it") from None
            if not isinstance(data, dict):
                raise CsdError(f"tokenizer config {f}: not a JSON object; fix or remove it")
            for key, value in data.items():
                config.setdefault(key, value)
    template = folder / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text(encoding="utf-8")
    return config


def _from_hub(name: str, trust_remote_code: bool) -> tuple[Path, dict]:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise CsdError(f"tokenizer {name}: not a local path, and huggingface_hub is not installed to fetch it") from None
    try:
        tokenizer_file = Path(hf_hub_download(name, "tokenizer.json"))
    except Exception as err:
        raise CsdError(
            f"tokenizer {name}: not a local path and not fetchable from the hub ({err.__class__.__name__}); "
            "pass a local tokenizer.json or folder"
        ) from None
    config: dict = {}
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            extra_path = Path(hf_hub_download(name, extra))
            for key, value in json.loads(extra_path.read_text(encoding="utf-8")).items():
                config.setdefault(key, value)
        except Exception:
            continue
    return tokenizer_file, config
