"""The KV an engine core's sequences hold, kept current as they move and grow
(actors/engine/core.py), so that the core never adds it up over every sequence it holds.

Each sequence records where it is (`Seq.place`): waiting (queued or part-way through its
prefill), running (decoding), held for a decode engine, or out (retracted to host memory,
finished, handed over). The ledger keeps, per place and per DP rank, the sequences' count,
their resident KV (`Seq.kv_tokens`) and the prefill tokens they still have to compute
(`Seq.prefill_left`), and the trajectories with a sequence in it. Every figure is a whole
number of tokens, so the sums are exactly the ones a pass over the sequences would give.
A sequence's counts may change only while it is out of the ledger (`leave`, change,
`enter`; `changing` does both); the one exception is a running decode's growth, which
`EngineCore.complete` adds to its rank's running KV directly (a token per iteration).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from actors.engine.sequence import OUT, Seq

PLACES = 4  # OUT, WAITING, RUNNING, HELD (actors/engine/sequence.py)


class KvLedger:
    def __init__(self, ranks: int = 1) -> None:
        # [place][rank]; OUT's lists stay zero (out of the ledger)
        self.count = [[0] * ranks for _ in range(PLACES)]
        self.kv = [[0] * ranks for _ in range(PLACES)]
        self.left = [[0] * ranks for _ in range(PLACES)]
        self.trajectories: dict[str, int] = {}  # trajectory -> its sequences in the ledger

    def fit_ranks(self, ranks: int) -> None:
        """Room for `ranks` DP ranks (a role switch may change the layout; sequences keep their rank)."""
        for table in (self.count, self.kv, self.left):
            for row in table:
                row.extend([0] * (ranks - len(row)))

    def enter(self, seq: Seq, place: int) -> None:
        seq.place = place
        if place != OUT:
            self._add(seq, place, 1)

    def leave(self, seq: Seq) -> int:
        """Take the sequence out; returns where it was."""
        place = seq.place
        if place != OUT:
            self._add(seq, place, -1)
            seq.place = OUT
        return place

    @contextmanager
    def changing(self, seq: Seq) -> Iterator[None]:
        """Change a sequence's token counts where it is."""
        place = self.leave(seq)
        yield
        self.enter(seq, place)

    def _add(self, seq: Seq, place: int, sign: int) -> None:
        rank = seq.rank
        if rank >= len(self.kv[place]):
            self.fit_ranks(rank + 1)
        self.count[place][rank] += sign
        self.kv[place][rank] += sign * seq.kv_tokens
        self.left[place][rank] += sign * seq.prefill_left
        trajectory_id = seq.work.trajectory_id
        left = self.trajectories.get(trajectory_id, 0) + sign
        if left:
            self.trajectories[trajectory_id] = left
        else:
            del self.trajectories[trajectory_id]
