"""A served teacher: the teacher top-k of each row from an OpenAI-compatible server, never from text.

`ServedTeacher` takes the place of `TeacherRunner` when `teacher-logits --teacher-server URL --teacher-model
NAME` is given: `run(rows)` returns the same `TeacherTopkRow`s, cut by the same position selectors, so the
store's writer cannot tell the two apart and the store has the same format.

The request is vLLM's completions request with prompt log-probabilities (vLLM's OpenAI-compatible server,
`--max-logprobs` at least --top-k): `POST URL/v1/completions` with

    {"model": NAME, "prompt": [ids of the row..., one more id], "max_tokens": 1, "temperature": 0,
     "prompt_logprobs": K}

- `prompt` is a list of token ids, the row's exact teacher ids: the server never tokenises text of its own.
  One id is appended so that the last position of the row (which predicts a token beyond it) is a prompt
  position too; its value never matters (the store keeps no observed token there).
- The answer's `choices[0].prompt_logprobs` holds one entry per prompt token: None for the first, then for
  token i a dict keyed by token id (as a string) of the K most likely ids at that position plus token i itself
  (K + 1 entries when it is not among them), each `{"logprob": float, ...}`. Entry i + 1 is the store's
  position i (the distribution that predicts token i + 1, SPEC §6).
- A request whose connection fails (a kept-alive connection reset, a server restarting) or that a proxy answers
  502-504 is sent again, three times at most, 0.5, 1 and 2 s apart: the answers are pure functions of the ids.
- Anything else is refused, naming the server and the fix: fewer than K entries, an id outside the teacher
  tokenizer, a non-finite value, an HTTP error (vLLM answers 400 when K exceeds its --max-logprobs), no
  answer within --server-timeout, no server at the address. Nothing of a shard is kept then (the executor
  discards the shard being written), and a re-run resumes at that shard.

The server's log-probabilities are at temperature 1 (prompt log-probabilities take none), which is what the
store keeps; --temperature other than 1 is refused. --tail-samples N draws from the part of the tail that the
server returns: it is asked for --server-top-k K' entries (K' > --top-k), the draws fall on those beyond the
kept ones in proportion to their probabilities, and a draw that falls on the mass beyond all K' (1 minus what
the server returned) is dropped (`selectors.ServedTop`, `tail_samples.draw_served_tail`). Each id among the K'
keeps an unbiased estimate, as in-process; the mass beyond them stays in REST. The draws of a row are seeded by
its block's seed and its place in the block, so they do not depend on which answer came first.

Rows go out as `--server-concurrency` requests at once (a thread pool); the server batches them as it can.
The answers are put back in row order, so the shard's bytes do not depend on which answer came first.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.row import TeacherTopkRow
from csd_pipeline.teacher.store.schema import RowStatus
from csd_pipeline.teacher.store.selectors import Entries

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
RETRIES, RETRY_PAUSE = 3, 0.5  # a request whose connection fails, or answered TRANSIENT, is sent again (seconds)
TRANSIENT = (502, 503, 504)


@dataclass(frozen=True)
class ServerDevice:
    """Stands where a runner's torch device stands (`write_teacher_shard` reads `.type`): the work is elsewhere,
    so this process is free to encode blocks in threads."""

    type: str = "server"

    def __str__(self) -> str:
        return self.type


class ServedTeacherError(CsdError):
    """One line naming the server, what went wrong and the fix."""


def check_served_options(config) -> None:
    """Refuse the options a served teacher cannot honour, naming each (before any request is sent)."""
    if config.teacher:
        raise CsdError(f"--teacher {config.teacher} and --teacher-server {config.teacher_server} both name a teacher; "
                       "pass one of them.")
    if not config.teacher_model:
        raise CsdError(f"--teacher-server {config.teacher_server} needs --teacher-model, the name the server serves "
                       "the teacher under (its /v1/models lists them).")
    if not config.teacher_server.startswith(("http://", "https://")):
        raise CsdError(f"--teacher-server {config.teacher_server} is not an http:// or https:// URL; pass e.g. "
                       "http://127.0.0.1:8000.")
    asked = config.server_top_k
    if config.tail_samples and (asked is None or asked <= config.top_k):
        raise CsdError(f"--tail-samples {config.tail_samples} from a served teacher are drawn among the entries it "
                       f"returns beyond --top-k {config.top_k}; pass --server-top-k above it (e.g. "
                       f"{4 * config.top_k}, at most the server's logprobs limit: vLLM's --max-logprobs).")
    if asked is not None and not config.tail_samples:
        raise CsdError(f"--server-top-k {asked} asks the server for entries that only --tail-samples reads; drop "
                       "--server-top-k or pass --tail-samples.")
    if config.temperature != 1.0:
        raise CsdError(f"--temperature {config.temperature}: a server's prompt log-probabilities are at temperature "
                       "1; drop --temperature (the trainer applies its own) or run the teacher in-process.")
    if config.server_concurrency < 1:
        raise CsdError(f"--server-concurrency {config.server_concurrency} is not positive; pass e.g. 8.")
    if not config.server_timeout > 0:
        raise CsdError(f"--server-timeout {config.server_timeout} is not positive; pass seconds, e.g. 600.")


def prompt_entries(answer: dict, row: np.ndarray, top_k: int, vocab_limit: int, where: str):
    """The top-k of every position of one row from a completions answer with prompt log-probabilities.

    answer: the decoded JSON of the server's answer to the row's request (prompt = row + one extra id);
    row: the row's teacher ids (int, length T); top_k: K; vocab_limit: the teacher tokenizer's size; where: the
    server, for errors. Returns (ids int32 [T, K], logprobs float32 [T, K], observed float32 [T] with NaN at the
    last position), most likely first. Raises `ServedTeacherError` for an answer of another shape, fewer than K
    entries at a position, an id outside the tokenizer or a non-finite value.
    """
    try:
        positions = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ServedTeacherError(
            f"teacher server {where} answered without choices[0].prompt_logprobs; it must be an OpenAI-compatible "
            "server that returns prompt log-probabilities of a token-id prompt (vLLM: prompt_logprobs).") from None
    length = len(row)
    if not isinstance(positions, list) or len(positions) != length + 1:
        got = len(positions) if isinstance(positions, list) else type(positions).__name__
        raise ServedTeacherError(
            f"teacher server {where} returned prompt log-probabilities for {got} prompt tokens, but the prompt had "
            f"{length + 1}; it must take the token ids as they are (no BOS added, no text).")
    ids = np.empty((length, top_k), dtype=np.int32)
    logprobs = np.empty((length, top_k), dtype=np.float32)
    observed = np.full(length, np.nan, dtype=np.float32)
    for t in range(length):
        token = int(row[t + 1]) if t + 1 < length else int(row[-1])  # the prompt's token t + 1 (the extra id last)
        top, value = _position_top_k(positions[t + 1], token, top_k, vocab_limit, where, t)
        ids[t], logprobs[t] = [i for i, _ in top], [v for _, v in top]
        if t + 1 < length:
            observed[t] = value
    return ids, logprobs, observed


def _position_top_k(entry, token: int, top_k: int, vocab_limit: int, where: str, t: int):
    """([(id, logprob)] * K most likely first, the logprob of the prompt's token there) of one prompt position."""
    if not isinstance(entry, dict):
        raise ServedTeacherError(f"teacher server {where} returned no log-probabilities at prompt position {t + 1}; "
                                 "it must return them for every prompt token but the first.")
    values = {}
    for key, item in entry.items():
        try:
            token_id = int(key)
            value = float(item["logprob"] if isinstance(item, dict) else item)
        except (TypeError, ValueError, KeyError):
            raise ServedTeacherError(
                f"teacher server {where} keyed a log-probability by {key!r}, not by a token id; it must return "
                "prompt log-probabilities keyed by token id (vLLM's prompt_logprobs).") from None
        if not 0 <= token_id < vocab_limit:
            raise ServedTeacherError(
                f"teacher server {where} returned id {token_id} at prompt position {t + 1}, outside the teacher "
                f"tokenizer (size {vocab_limit}); serve the teacher that goes with the aligned teacher tokenizer.")
        if not math.isfinite(value):
            raise ServedTeacherError(f"teacher server {where} returned a non-finite log-probability ({value}) for id "
                                     f"{token_id} at prompt position {t + 1}; check the served model.")
        values[token_id] = value
    if token not in values:
        raise ServedTeacherError(f"teacher server {where} left out the prompt's own token {token} at prompt position "
                                 f"{t + 1}; it must return each prompt token's log-probability with the top-k.")
    # K entries hold the prompt's token among them; K + 1 hold it besides them.
    top = sorted(values.items(), key=lambda pair: (-pair[1], pair[0]))
    if len(values) == top_k + 1:
        top = [pair for pair in top if pair[0] != token]
    elif len(values) != top_k:
        raise ServedTeacherError(
            f"teacher server {where} returned {len(values)} entries at prompt position {t + 1} for a top-{top_k}; "
            f"start it with a logprobs limit of at least {top_k} (vLLM: --max-logprobs {top_k}) or pass a smaller "
            "--top-k.")
    return top, values[token]


class ServedTeacher:
    """The teacher top-k of rows of teacher ids from a server (see the module docstring): the runner of a
    `teacher-logits` run with --teacher-server.

    url, model: --teacher-server and --teacher-model; top_k: the store's --top-k; asked: the entries asked for per
    position (--server-top-k, at least top_k); vocab_limit: the teacher tokenizer's size; selectors: the store's
    position selectors (`SelectorChain.position_selectors()`); concurrency: requests in flight; timeout: seconds
    per request.
    """

    device = ServerDevice()

    def __init__(self, url: str, model: str, *, top_k: int, vocab_limit: int, selectors: tuple, concurrency: int,
                 timeout: float, asked: int | None = None):
        from csd_pipeline.teacher.store.selectors import SelectorChain

        self.url = url.rstrip("/")
        self.model = model
        self.top_k = top_k
        self.asked = max(top_k, asked or top_k)
        self.vocab_limit = vocab_limit
        self.selectors = tuple(selectors)
        self.chain = SelectorChain(self.selectors)
        self.concurrency = concurrency
        self.timeout = timeout
        self._client = None
        self._block_seed = None
        if any(selector.needs_distribution and not selector.served for selector in self.selectors):
            raise CsdError("a selector of this run needs the teacher's whole distribution, which a served teacher "
                           "does not return; run the teacher in-process with --teacher.")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None}  # a copy for another process opens its own connections

    @property
    def width(self) -> int:
        return self.chain.width

    def _http(self):
        if self._client is None:
            try:
                import httpx
            except ImportError:
                raise ImportError("--teacher-server needs the httpx package: pip install 'csd-pipeline[serve]'") from None

            limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
            self._client = httpx.Client(timeout=self.timeout, limits=limits)
        return self._client

    def _send(self, method: str, path: str, body: dict | None):
        """The server's response to one request, sent again (RETRIES times at most, after RETRY_PAUSE x 2^i s) while
        the connection fails or the server says it is busy (TRANSIENT): a kept-alive connection that the server
        closed as a request went out is reset, and a proxy may answer 502-504 a moment. The requests are pure (the
        same ids give the same answer), so sending one twice changes nothing. A timeout is not retried."""
        import httpx

        for attempt in range(RETRIES + 1):
            try:
                response = self._http().request(method, self.url + path, json=body)
            except httpx.TimeoutException:
                raise
            except httpx.TransportError:
                if attempt == RETRIES:
                    raise
            else:
                if response.status_code not in TRANSIENT or attempt == RETRIES:
                    return response
            time.sleep(RETRY_PAUSE * 2 ** attempt)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """The decoded JSON answer of one request; `ServedTeacherError` (one line) for anything else."""
        import httpx

        where = self.url
        try:
            response = self._send(method, path, body)
        except httpx.TimeoutException:
            raise ServedTeacherError(
                f"teacher server {where} did not answer within --server-timeout {self.timeout:g} s; check that it "
                "is up and not overloaded, pass a larger --server-timeout or a smaller --server-concurrency, then "
                "re-run to resume.") from None
        except httpx.HTTPError as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ServedTeacherError(
                f"teacher server {where} cannot be reached ({reason}); start it (or pass the right --teacher-server), "
                "then re-run to resume.") from None
        if response.status_code != 200:
            detail = " ".join(response.text.split())[:300]
            raise ServedTeacherError(
                f"teacher server {where} answered {method} {path} with HTTP {response.status_code} ({detail}); it "
                "must take a token-id prompt with prompt_logprobs (vLLM: start it with --max-logprobs at least "
                "--top-k and --max-model-len above the longest aligned row), then re-run to resume.")
        try:
            return response.json()
        except ValueError:
            raise ServedTeacherError(f"teacher server {where} answered {path} with something other than JSON; check "
                                     "that --teacher-server is an OpenAI-compatible server.") from None

    def check_model(self) -> None:
        """Refuse a server that does not list --teacher-model (GET /v1/models)."""
        answer = self._call("GET", MODELS_PATH)
        names = [item.get("id") for item in answer.get("data", []) if isinstance(item, dict)]
        if self.model not in names:
            raise ServedTeacherError(f"teacher server {self.url} serves {', '.join(map(str, names)) or 'no model'}, "
                                     f"not --teacher-model {self.model}; pass one of those names.")

    def request(self, row: np.ndarray) -> dict:
        """The completions request of one row: its exact ids plus one (module docstring), K prompt log-probs."""
        prompt = [int(i) for i in row] + [int(row[-1])]
        return {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": self.asked}

    def _row(self, row: np.ndarray, index: int) -> TeacherTopkRow:
        """The store's entries of one row, the `index`-th of its block."""
        answer = self._call("POST", COMPLETIONS_PATH, self.request(row))
        ids, logprobs, observed = prompt_entries(answer, row, self.asked, self.vocab_limit, self.url)
        next_ids = np.append(np.asarray(row[1:], dtype=np.int64), -1)
        entries = Entries(ids, logprobs, np.full(len(row), self.asked, np.int64), observed, next_ids)
        top = self._served_top(entries, index) if self.asked > self.top_k else None
        for selector in self.selectors:
            entries = selector.cut(entries, top)
        return TeacherTopkRow(None, entries.ids, entries.logprobs, entries.observed, int(RowStatus.OK),
                              entries.lengths)

    def _served_top(self, entries: Entries, index: int):
        """The server's K' entries of a row as the draws read them, with the row's own generator."""
        import torch

        from csd_pipeline.teacher.store.selectors import ServedTop
        from csd_pipeline.teacher.store.selectors.tail_samples import block_seed

        seed = block_seed(self._block_seed or 0, str(index))
        return ServedTop(entries.ids.astype(np.int64), entries.logprobs.astype(np.float64),
                         entries.observed.astype(np.float64), entries.next_ids,
                         torch.Generator().manual_seed(seed))

    def seed(self, seed: int) -> None:
        """The seed of the next block's draws (each row's generator: this seed and the row's place in the block)."""
        self._block_seed = int(seed)

    def run(self, rows: list[np.ndarray]) -> list[TeacherTopkRow]:
        """The `TeacherTopkRow` of every row (int teacher ids, each non-empty), in the given order."""
        from concurrent.futures import ThreadPoolExecutor

        from csd_pipeline.runtime import progress

        results: list[TeacherTopkRow | None] = [None] * len(rows)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(self._row, row, index) for index, row in enumerate(rows)]
            try:
                for index, future in enumerate(futures):
                    results[index] = future.result()
                    progress.advance(1)
            except BaseException:
                for future in futures:
                    future.cancel()  # one row failed: send no other request
                raise
        return results


def served_teacher(config, chain, vocab_size: int) -> ServedTeacher:
    """The `ServedTeacher` of a `TeacherLogitsConfig` with --teacher-server, its model checked on the server."""
    teacher = ServedTeacher(config.teacher_server, config.teacher_model, top_k=chain.top_k, vocab_limit=vocab_size,
                            selectors=chain.position_selectors(), concurrency=config.server_concurrency,
                            timeout=float(config.server_timeout), asked=config.server_top_k)
    teacher.check_model()
    return teacher
