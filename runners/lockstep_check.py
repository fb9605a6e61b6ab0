"""Mechanism check of the DP-attention lockstep model (pure: the scheduler core, model time).

SGLang issue #35241 (DeepSeek-V4-Pro, TP8/DP8 with DP attention, chunked prefill, a
prefill-heavy load) measured 94.6–94.8k input tokens/s while the ranks prefilled in
lockstep and 62–79k tokens/s when they fell out of step: a 17–35% loss [M]; other reports
span 13–35% (docs/calibration.md, "DP-attention lockstep constants"). This check runs one
DP-attention engine under the same kind of load twice and reports the loss the cost model
gives:

* every rank serves a closed loop of `CONCURRENCY` requests (a new request replaces one that
  finishes, on the same rank): prompts of `PROMPT_TOKENS`, short outputs (prefill-heavy);
* "lockstep": every rank gets the same prompt lengths in the same order, so the ranks
  prefill and decode in phase (what SGLang's PrefillDelayer aims for);
* "desynchronised": the same prompts, shuffled per rank, so one rank's prefill steps meet
  its peers' decode steps.

The loss is 1 − desynchronised / lockstep input tokens per second.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from actors.engine.core import EngineCore
from actors.engine.emulated.costmodel import PRESETS, CostPreset, with_lockstep
from bus_schemas.control import Role
from bus_schemas.work import PrefillWork

PUBLISHED_LOSS = (0.13, 0.35)  # SGLang #35241 17-35%, TPU PR #2577 from 13% [M]
CONCURRENCY = 8  # requests in flight per rank (a serving benchmark's client concurrency)
REQUESTS_PER_RANK = 24
OUTPUT_TOKENS = 64
PROMPT_TOKENS = (2048, 12288)  # uniform range of prompt lengths
CHUNK_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class LockstepResult:
    preset: str
    dp_sync: str
    lockstep_tokens_per_s: float
    desync_tokens_per_s: float

    @property
    def loss(self) -> float:
        return 1.0 - self.desync_tokens_per_s / self.lockstep_tokens_per_s


def _work(rank: int, i: int, prompt: int, output_tokens: int) -> PrefillWork:
    return PrefillWork(
        work_id=f"r{rank}-{i}",
        trajectory_id=f"r{rank}-{i}",
        turn=0,
        env_id="env",
        task_family="check",
        policy_version=0,
        context_tokens=0,
        new_tokens=prompt,
        max_output_tokens=output_tokens,
        target_output_tokens=output_tokens,
        queued_at_s=0.0,
    )


def _run(preset: CostPreset, prompts_by_rank: list[list[int]], concurrency: int, output_tokens: int) -> float:
    """Input tokens per model second of a closed loop over every rank's prompt list."""
    core = EngineCore("check", Role.COLOCATED, preset, CHUNK_TOKENS, max_decode_seqs=256, max_waiting=256)
    queues = [list(p) for p in prompts_by_rank]
    issued = [0] * preset.dp_ranks

    def admit(rank: int) -> None:
        if issued[rank] < len(queues[rank]):
            seq = core.admit_prefill(_work(rank, issued[rank], queues[rank][issued[rank]], output_tokens))
            seq.rank = rank
            issued[rank] += 1

    for rank in range(preset.dp_ranks):
        for _ in range(concurrency):
            admit(rank)
    elapsed_s = 0.0
    while (batch := core.plan(max_advance_s=0.0)) is not None:  # one iteration per step
        elapsed_s += batch.duration_s
        for kind, seq in core.complete(batch):
            if kind == "decode_done":
                admit(seq.rank)
    return sum(sum(p) for p in prompts_by_rank) / elapsed_s


def grid(preset_name: str = "h200-deepseek-v3-fp8") -> list[dict]:
    """The loss across client concurrency and output length (the check's setting is one cell)."""
    rows = []
    for concurrency in (2, 4, 8):
        for output in (16, 64, 256):
            row = {"concurrency": concurrency, "output_tokens": output}
            for mode in ("sglang", "ideal"):
                row[mode] = round(check(preset_name, mode, concurrency=concurrency, output_tokens=output).loss, 3)
            rows.append(row)
    return rows


def check(
    preset_name: str = "h200-deepseek-v3-fp8",
    dp_sync: str = "sglang",
    seed: int = 0,
    end: str = "value",
    concurrency: int = CONCURRENCY,
    output_tokens: int = OUTPUT_TOKENS,
) -> LockstepResult:
    preset = with_lockstep(PRESETS[preset_name], dp_sync, end=end)
    rng = random.Random(seed)
    prompts = [rng.randint(*PROMPT_TOKENS) for _ in range(REQUESTS_PER_RANK)]
    lockstep = [list(prompts) for _ in range(preset.dp_ranks)]
    desync = [rng.sample(prompts, len(prompts)) for _ in range(preset.dp_ranks)]
    return LockstepResult(
        preset.name, dp_sync, _run(preset, lockstep, concurrency, output_tokens), _run(preset, desync, concurrency, output_tokens)
    )
