"""A task family's phase chain PRE → DEC → TOOL → PRE …, walked as spectra (the lifecycle
model's core: forecasting.models.lifecycle), the turn-continuation weights along it, and the
rows a group of live trajectories puts into the walk."""

from __future__ import annotations

import numpy as np

from forecasting.live import DEC, PRE, TOOL


def walk(phase: int, cycles: int) -> tuple[np.ndarray, np.ndarray]:
    """The stages of the phase chain from `phase`: each one's phase and m, the decode
    completions passed before it (the chain stops after cycles + 1 of them)."""
    phases, passed = [], []
    m, stage = 0, phase
    while m <= cycles:
        phases.append(stage)
        passed.append(m)
        if stage == DEC:
            m += 1  # past a decode completion only the continuing share goes on
        stage = (stage + 1) % 3
    return np.array(phases), np.array(passed)


class PhaseChain:
    """One family's phase chain PRE → DEC → TOOL → PRE …, as spectra.

    The kernel from a phase to the end of the r-th stage after it in cycle k is C^k times
    the r stages' durations (C: one whole cycle, PRE ∗ DEC ∗ TOOL; C^k kept to `slots`,
    which leaves the first `slots` slots exact). A mass times C^k times two stages is four
    factors of `slots` each, so an FFT of n_fft ≥ 4·slots gives the exact (linear)
    convolutions, and a chain costs a few vector products instead of a convolution per
    stage."""

    def __init__(self, pmfs: np.ndarray, cycles: int) -> None:
        self.slots, self.cycles = pmfs.shape[1], cycles
        self.n_fft = 1 << (4 * self.slots - 4).bit_length()
        cycle = truncated(truncated(pmfs[PRE], pmfs[DEC]), pmfs[TOOL])
        powers = [np.eye(1, self.slots)[0]]
        for _ in range(cycles):
            powers.append(truncated(powers[-1], cycle))
        self._powers_hat = self.forward(np.array(powers))
        self._pmf_hats = self.forward(pmfs)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return np.fft.rfft(x, self.n_fft)

    def inverse(self, x_hat: np.ndarray) -> np.ndarray:
        return np.fft.irfft(x_hat, self.n_fft)[..., : self.slots]

    def spectrum(self, phase: int, ends_by_cycle: np.ndarray) -> np.ndarray:
        """(3, F): spectra of the PRE, DEC and TOOL ends that follow, from ends_by_cycle[m]:
        the current phase's end mass weighted by the probability of going on through m
        more decode completions."""
        ends_hat = self.forward(ends_by_cycle)
        phases, passed = walk(phase, self.cycles)
        out = np.zeros((3, self._pmf_hats.shape[1]), complex)
        between = np.ones(self._pmf_hats.shape[1])
        for r in range(3):  # stages r, r + 3, r + 6, …: phase + r, in cycles k = 0, 1, 2, …
            m = passed[r::3]
            out[phases[r]] += between * (ends_hat[m] * self._powers_hat[: len(m)]).sum(axis=0)
            between = between * self._pmf_hats[phases[(r + 1) % 3]]
        return out


def truncated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.convolve(a, b)[: len(a)]


def continuation_weights(cont: np.ndarray, cycles: int) -> np.ndarray:
    """(cycles + 1, turns): W[m, t] = P(a trajectory at turn t goes on past its next m
    decode completions); turns past the last are at the last."""
    turns = np.arange(len(cont))
    weights = np.ones((cycles + 1, len(cont)))
    for m in range(1, cycles + 1):
        weights[m] = weights[m - 1] * cont[np.minimum(turns + m - 1, len(cont) - 1)]
    return weights


def ahead(cont: np.ndarray, cycles: int) -> tuple[np.ndarray, np.ndarray]:
    """The continuation weights W[m] (P(going on past the next m decode completions), m =
    0..cycles: `continuation_weights`) and the probability of finishing at the m-th decode
    completion ahead, W[m] - W[m+1]."""
    weights = continuation_weights(cont, cycles + 1)
    return weights[:-1], weights[:-1] - weights[1:]


def shared(
    bucket: np.ndarray, first_turn: np.ndarray, weights: np.ndarray, finishing: np.ndarray, context: np.ndarray, growth: float
) -> tuple[np.ndarray, np.ndarray]:
    """Trajectories with the same (elapsed bucket, first turn) have the same future: the
    distinct pairs' buckets, and per pair four blocks of rows (one per decode completion
    ahead, m = 0..M): their continuation weights times how many share it; the same times the
    contexts their decodes read, summed (the m-th decode ahead reads its trajectory's
    `context` plus m turns' `growth`); and both again with the probability of finishing
    there (`finishing`, `ahead`) in place of going on."""
    turn = np.minimum(first_turn, weights.shape[1] - 1)
    low, width = int(turn.min()), int(bucket.max()) + 1
    key = (turn - low) * width + bucket
    counts = np.bincount(key)
    pairs = np.flatnonzero(counts)
    contexts = np.bincount(key, context)[pairs] + growth * np.arange(len(weights))[:, None] * counts[pairs]
    blocks = [weights[:, pairs // width + low], finishing[:, pairs // width + low]]
    return pairs % width, np.vstack([x for w in blocks for x in (w * counts[pairs], w * contexts)])
