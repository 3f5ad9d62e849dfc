"""The cuts of the teacher store: which entries of each position a teacher-logits output keeps, one selector a file.

`teacher-logits` reads as runner -> selectors -> writer: the runner's forward hands each chunk of positions
(`Entries`, with the softmax itself as `Distribution`) through the selectors in `SELECTORS` order, then the
writer (`store/writer.py`) encodes what is left. Every selector

- declares its part of the stage identity (`identity()`: the `config` keys of run.json and manifest.json) and
  of the shard schema metadata (`metadata()`), from which the reader builds the chain again
  (`chain_from_config`: the manifest records which selectors ran, `SELECTORS` the one order they ran in);
- says whether the values it keeps are still the teacher's most likely entries at their exact log-probabilities
  (`exact`, and `inexact` says what it keeps instead): losses that compare whole rows, and
  `csd-train --teacher-top-k`, need every selector of a store to be exact (`SelectorChain.require_exact`);
- cuts one chunk of positions (`cut(entries, distribution)`: the forward's scope), or, with
  `reads_aligned`, each row of a shard with its aligned chunks (`row_cut(aligned_rows)`: the writer's scope).

Each module here is found when the package is imported (`SELECTORS`: every `Selector` subclass of these
modules, by its `order`), so adding a selector is one module with a `Selector` subclass (its `order`; its
`from_config` reads the config or manifest key it owns and its `check_options` refuses that option out of
range), the option itself (a `TeacherLogitsConfig` field marked `selector=True`, which `csd-pipeline
teacher-logits` offers as a flag), one test file in tests/teacher/store/selectors/ and its docstring's first
sentence, which is its row in docs/ARCHITECTURE.md's generated layout table (docs/ARCHITECTURE.md, "Adding a
selector").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from csd_pipeline.errors import CsdError


@dataclass
class Entries:
    """One chunk of positions on its way through the selectors (numpy, CPU).

    ids int32 [P, w] and logprobs float32 [P, w]: each position's entries, most likely first; lengths int64 [P]:
    how many of them are kept (the rest are left out by the writer); observed float32 [P]: the observed next
    token's log-prob (NaN where none); next_ids int64 [P]: that token (-1 where none)."""

    ids: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    observed: np.ndarray
    next_ids: np.ndarray


@dataclass
class Distribution:
    """The softmax of one chunk of positions, on the teacher's device (torch), for selectors that read beyond
    the entries (`Selector.needs_distribution`).

    weights float32 [P, V]: exp(logit - peak) over the model's whole output (a selector may overwrite it);
    total float32 [P]: their sum before any was overwritten; indices int64 [P, k]: the forward's top-k ids;
    next_ids int64 [P]; vocab_limit: the tokenizer's size; generator: the `torch.Generator` of the draws."""

    weights: object
    total: object
    indices: object
    next_ids: object
    vocab_limit: int
    generator: object


@dataclass
class ServedTop:
    """The K' most likely entries of one row's positions as a served teacher returned them (`teacher-logits
    --teacher-server --server-top-k`), in place of the `Distribution` for the selectors that draw
    (`Selector.served`): its tail is known only among them.

    ids int64 [P, K'] and logprobs float64 [P, K']: most likely first; observed float64 [P]: the observed next
    token's log-prob (NaN where none); next_ids int64 [P] (-1 where none); generator: the row's `torch.Generator`."""

    ids: np.ndarray
    logprobs: np.ndarray
    observed: np.ndarray
    next_ids: np.ndarray
    generator: object


class Selector:
    """One cut of the teacher store (see the module docstring). Subclasses are frozen dataclasses of plain
    values (they cross process boundaries)."""

    name = ""                   # as the docs and errors name it
    order = 0                   # its place in the one order a store applies the selectors (SELECTORS)
    exact = True                # the kept values are the most likely entries at their exact log-probabilities
    inexact = ""                # what the store holds instead, when not exact (completes "... but DIR ...")
    needs_distribution = False  # cut() reads the whole softmax: it can only run inside the forward
    served = False              # with needs_distribution: cut() can read a served teacher's `ServedTop` instead
    reads_aligned = False       # row_cut() reads the aligned chunks of each row: it runs in the writer's scope

    @classmethod
    def from_config(cls, config: dict, aligned=None) -> Selector | None:
        """This selector as the `config` dict (TeacherLogitsConfig fields, or a manifest's `config`) sets it, or
        None when it is not set. `aligned`: the `AlignedOutput` when building a new store (None when reading)."""
        raise NotImplementedError

    @classmethod
    def check_options(cls, config) -> None:
        """Raise `CsdError` naming the option when the `TeacherLogitsConfig` `config` sets this selector out of
        range (before the teacher is loaded)."""

    def identity(self) -> dict:
        """Its keys of the stage identity's `config` (recorded only when set: earlier outputs keep theirs)."""
        return {}

    def metadata(self) -> dict:
        """Its keys of the shard schema metadata (bytes -> bytes)."""
        return {}

    def width(self, width: int) -> int:
        """Entries a position can hold after this selector, given `width` before it."""
        return width

    def cut(self, entries: Entries, distribution: Distribution | None) -> Entries:
        """The chunk's entries after this selector."""
        return entries

    def block_seed(self, first_row_id: str) -> int | None:
        """The seed of the generator of a block of rows, for a selector that draws (None: it does not)."""
        return None

    def row_cut(self, aligned_rows: list):
        """With `reads_aligned`: `select(row_index, TeacherTopkRow) -> TeacherTopkRow` for one shard, whose
        rows' aligned columns are `aligned_rows` (in order)."""
        raise NotImplementedError


@dataclass(frozen=True)
class SelectorChain:
    """The selectors of one store, in `SELECTORS` order; the first is always `TopK` (the forward keeps a top-k)."""

    selectors: tuple

    @property
    def top_k(self) -> int:
        """The entries the forward takes per position before any other cut."""
        return self.selectors[0].k

    @property
    def width(self) -> int:
        """Entries a stored position can hold (the shard's `csd.k`)."""
        width = 0
        for selector in self.selectors:
            width = selector.width(width)
        return width

    @property
    def names(self) -> list[str]:
        return [selector.name for selector in self.selectors]

    def identity(self) -> dict:
        """The selectors' part of the stage identity's `config`; `top_p` is recorded always (null: none),
        as schema version 2 has it."""
        identity = {"top_p": None}
        for selector in self.selectors:
            identity |= selector.identity()
        return identity

    def metadata(self) -> dict:
        """The selectors' keys of the shard schema metadata."""
        metadata = {}
        for selector in self.selectors:
            metadata |= selector.metadata()
        return metadata

    def position_selectors(self) -> tuple:
        """The selectors of the forward's scope (each chunk of positions), in order."""
        return tuple(s for s in self.selectors if not s.reads_aligned)

    @property
    def reads_aligned(self) -> bool:
        return any(s.reads_aligned for s in self.selectors)

    def block_seed(self, first_row_id: str) -> int | None:
        """The generator seed of the block starting at `first_row_id` (None: nothing draws)."""
        return next((seed for s in self.selectors if (seed := s.block_seed(first_row_id)) is not None), None)

    def row_cut(self, aligned_rows: list):
        """`select(row_index, row)` of the writer's scope for one shard, or None when no selector has one."""
        cuts = [s.row_cut(aligned_rows) for s in self.selectors if s.reads_aligned]
        if not cuts:
            return None

        def select(row_index: int, row):
            for cut in cuts:
                row = cut(row_index, row)
            return row

        return select

    def cut_row(self, row, token_ids):
        """One teacher row (`TeacherTopkRow`, values already computed: a stored or replayed top-k) through the
        position selectors, as the forward would have cut it (`token_ids`: the row's teacher ids). Raises
        ValueError for a selector that needs the whole distribution."""
        if not row.ok:
            return row
        next_ids = np.append(np.asarray(token_ids[1:], dtype=np.int64), -1)
        entries = Entries(row.ids, row.logprobs, row.lengths, row.observed_logprob, next_ids)
        for selector in self.position_selectors():
            if selector.needs_distribution:
                raise ValueError(f"the {selector.name} selector needs the teacher's whole distribution")
            entries = selector.cut(entries, None)
        return replace(row, ids=entries.ids, logprobs=entries.logprobs, lengths=entries.lengths)

    def first_inexact(self) -> Selector | None:
        """The first selector whose kept values are not the most likely entries at their exact log-probabilities."""
        return next((s for s in self.selectors if not s.exact), None)

    def require_exact(self, directory, needs: str, fix: str) -> None:
        """Raise `CsdError` unless every selector of the store in `directory` is exact. `needs`: who reads the
        entries as a top-k ("--loss uld"); `fix`: what the user can do instead."""
        selector = self.first_inexact()
        if selector is not None:
            raise CsdError(f"{needs} reads the stored entries as the teacher's most likely ids at their exact "
                           f"log-probabilities, but {directory} {selector.inexact}; {fix}")


def chain_from_config(config: dict, aligned=None) -> SelectorChain:
    """The selectors a `config` dict sets (TeacherLogitsConfig fields, or the `config` a manifest records), in
    `SELECTORS` order. `aligned`: the `AlignedOutput` of a store being written (None when reading one)."""
    selectors = []
    for cls in SELECTORS:
        selector = cls.from_config(config, aligned)
        if selector is not None:
            selectors.append(selector)
    return SelectorChain(tuple(selectors))


def check_share(value: float | None, flag: str, what: str, example: str) -> None:
    """Refuse an option that, when given, must lie in (0, 1] (`--top-p`, `--min-p`), naming `flag`."""
    if value is not None and not 0.0 < value <= 1.0:
        raise CsdError(f"{flag} {value} is out of range; pass {what} in (0, 1], e.g. {example}, or leave it out for a "
                       "fixed --top-k.")


def check_options(config) -> None:
    """Every selector's `check_options` on the `TeacherLogitsConfig` `config` (`TeacherLogitsConfig.validate`)."""
    for cls in SELECTORS:
        cls.check_options(config)


def _discover() -> tuple:
    """Every `Selector` subclass defined in this package's modules (each imported here), by `order`."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found = [cls for cls in Selector.__subclasses__() if cls.__module__.startswith(f"{__name__}.")]
    orders = [cls.order for cls in found]
    if len(set(orders)) != len(orders):
        raise RuntimeError(f"two selectors share an order: {sorted((c.order, c.__name__) for c in found)}")
    return tuple(sorted(found, key=lambda cls: cls.order))


# The selectors, in the one order a store applies them: top-k, top-p, min-p, tail samples, CSD events.
SELECTORS = _discover()
globals().update({cls.__name__: cls for cls in SELECTORS})  # each by its class name too: `selectors.TopK`
