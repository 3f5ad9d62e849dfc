"""Packing aligned windows into rows of `--seq-len` tokens without attention across windows.

Windows are placed in data order, greedily: a window goes into the current row if it fits,
otherwise the row is closed (padded) and the window starts the next row. A batch closes once it
has `batch_size` rows and the next window does not fit; that window is *not* consumed, so the
loader state after a batch is simply "the next window to read". Positions restart at 0 in every
window (and in the padding), which is how the model separates them: transformers turns
restarting `position_ids` into a block-diagonal causal mask (sdpa / eager / flex) or varlen
attention (flash). CE targets (`csd_pipeline.events.batch.ce_targets`) are built per window, so they
never cross a window boundary. The trainer's data loader and the bits-per-byte evaluation pack
alike with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from csd_pipeline.errors import CsdError


@dataclass
class Placement:
    """Where one window sits in a packed batch."""

    row: int     # packed row
    start: int   # first column in that row
    length: int  # tokens


@dataclass
class PackedBatch:
    """Packed student inputs of one micro-batch (numpy; the loop makes tensors).

    Flat positions (row * seq_len + column, see `flat_offsets`) address the flattened hidden
    states; CE targets and CSD events are shifted by each window's flat offset.
    """

    input_ids: np.ndarray      # int64 [batch_size, seq_len]
    position_ids: np.ndarray   # int64 [batch_size, seq_len]
    placements: list[Placement] = field(default_factory=list)
    content_tokens: int = 0    # non-padding tokens

    @property
    def flat_offsets(self) -> np.ndarray:
        """Flat position of each window's first token (row * seq_len + start)."""
        seq_len = self.input_ids.shape[1]
        return np.array([p.row * seq_len + p.start for p in self.placements], dtype=np.int64)


def check_window_length(length: int, seq_len: int, row_id: str) -> None:
    """Raise `CsdError` for a window longer than a packed row."""
    if length > seq_len:
        raise CsdError(
            f"aligned row {row_id} has {length} student tokens, more than --seq-len {seq_len}; "
            f"raise --seq-len or re-run `csd-pipeline align` with --max-student-tokens <= {seq_len}"
        )


def plan_rows(lengths: list[int], seq_len: int, batch_size: int) -> tuple[list[Placement], int]:
    """Place windows (in order) into up to `batch_size` rows; return (placements, windows consumed).

    Stops at the first window that does not fit once all rows are open, or when lengths run out.
    A window longer than `seq_len` must have been refused before (see `check_window_length`).
    """
    placements: list[Placement] = []
    row, column = 0, 0
    for length in lengths:
        if length > seq_len:
            raise CsdError(f"window of {length} tokens exceeds --seq-len {seq_len}")
        if column + length > seq_len:
            if row + 1 >= batch_size:
                break
            row, column = row + 1, 0
        placements.append(Placement(row, column, length))
        column += length
    return placements, len(placements)


def pack(windows: list[np.ndarray], placements: list[Placement], seq_len: int, batch_size: int,
         pad_id: int = 0) -> PackedBatch:
    """Build the packed arrays from the windows' student ids and their placements."""
    input_ids = np.full((batch_size, seq_len), pad_id, dtype=np.int64)
    position_ids = np.zeros((batch_size, seq_len), dtype=np.int64)
    used = np.zeros(batch_size, dtype=np.int64)
    for ids, place in zip(windows, placements, strict=True):
        ids = np.asarray(ids, dtype=np.int64)
        n = place.length
        input_ids[place.row, place.start:place.start + n] = ids
        position_ids[place.row, place.start:place.start + n] = np.arange(n)
        used[place.row] = place.start + n
    for row in range(batch_size):
        # padding is its own "window": positions restart, so nothing real attends to it
        position_ids[row, used[row]:] = np.arange(seq_len - used[row])
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        placements=list(placements),
        content_tokens=int(used.sum()),
    )
