"""Canonical chains: one tokenizer's own encoding of every spelling of another vocabulary.

`multi_token_chains(tokenizer, texts)` keeps the spellings it encodes with two or more tokens (what
the original table builder stores; `vocab.tables.count_chains` compares them with the byte-exact
entries). The module imports no numpy, so that it also runs as the helper process of
`tables build-both` (`vocab.table_pair`): `python -m csd_pipeline.vocab.chain_encoder TOKENIZER_JSON`
builds the tokenizer while the texts arrive on stdin (a JSON list of strings), then writes the
chains as JSON on stdout ({"multi": [[index, [ids...]], ...]}) or one `error: ` line on stderr.
Nothing is unpickled on either side.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SLICE = 16384  # texts per encode_batch call: each slice's encodings are freed before the next


def multi_token_chains(tokenizer, texts: list[str], advance=None) -> list[tuple[int, list[int]]]:
    """[(index in `texts`, ids)] of the texts `tokenizer` encodes with 2+ tokens (no special tokens
    added; `encode_batch` runs without the GIL). `advance(n)`, when given, is told of each slice."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # the same ids, no offsets
    multi = []
    for start in range(0, len(texts), SLICE):
        encodings = encode(texts[start:start + SLICE], add_special_tokens=False)
        # len(): the ids, without copying them
        multi += [(start + k, encodings[k].ids) for k in [k for k, n in enumerate(map(len, encodings)) if n > 1]]
        if advance is not None:
            advance(len(encodings))
    return multi


class ChainEncoderProcess:
    """`multi_token_chains` of `texts` with the tokenizer of `tokenizer_file`, in a helper process.

    Started on entry (it builds the tokenizer at once, side by side with this process); `send(texts)`
    hands it the texts from a thread (the pipe never blocks the caller); `result()` waits for the
    chains and raises CsdError with the helper's one-line error when it failed. Leaving the block
    kills a helper still running (an error here, or Ctrl-C)."""

    def __init__(self, tokenizer_file, name: str):
        self.command = [sys.executable, "-m", "csd_pipeline.vocab.chain_encoder", str(tokenizer_file), name]
        self.process = self.sender = None
        self.output: list = []

    def __enter__(self):
        import subprocess

        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        return self

    def send(self, texts: list[str]) -> None:
        import threading

        payload = json.dumps(texts).encode()
        self.sender = threading.Thread(target=lambda: self.output.extend(self.process.communicate(payload)),
                                       name=f"chains {self.command[-1]}", daemon=True)
        self.sender.start()

    def result(self) -> list[tuple[int, list[int]]]:
        from csd_pipeline.errors import CsdError

        self.sender.join()
        out, err = self.output
        if self.process.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise CsdError(lines[-1].removeprefix("error: ") if lines else
                           f"encoding the spellings with {self.command[-1]} failed (exit status "
                           f"{self.process.returncode}); run `csd-pipeline tables build` for that direction")
        return [(k, ids) for k, ids in json.loads(out)["multi"]]

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _main(argv: list[str]) -> int:
    from csd_pipeline.errors import CsdError
    from csd_pipeline.vocab.tokenizer_files import read_json_text, tokenizer_in_thread

    tokenizer_file, name = argv[0], argv[1]
    try:
        thread, outcome = tokenizer_in_thread(read_json_text(Path(tokenizer_file)), name)
        texts = json.loads(sys.stdin.buffer.read())  # arrives while the tokenizer is built
        thread.join()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        multi = multi_token_chains(outcome[0], texts)
    except (CsdError, OSError, ValueError) as err:
        print(f"error: tokenizer {name}: {err}" if not isinstance(err, CsdError) else f"error: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps({"multi": multi}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
