"""What a vLLM engine measures of its own steps, for the allocator (actors/engine/timing.py).

vLLM's engine core times every iteration it runs and says what the iteration computed:
prompt tokens and the requests they belong to, generated tokens and their requests, and the
share of its KV pool in use (`enable_logging_iteration_details`: a `SchedulerStats` with
`iteration_details`, handed to every stat logger of the engine's front end, which runs in
the engine actor's process). `StepMeter` counts each such iteration under Prorsa's kinds:

* `prefill` (prompt tokens, nothing generated), `decode` (nothing prefilled), `mixed`;
* `prefill_short` / `mixed_short` where the prompt tokens fill less than FULL_CHUNK_SHARE
  of vLLM's token budget (`max_num_batched_tokens`), `decode_short` where the pool is less
  than FULL_KV_SHARE full;

with its measured seconds (vLLM's own clock, as model seconds: wall × `run.time_scale`) and
the seconds the engine's prior cost model (`engines.preset` for its role) gives the same
iteration. vLLM does not say how much context each request reads, so the prior prices the
prompt tokens as one chunk on no cached prefix, and the decodes at the context of the
requests the engine runs at that moment (their prompts and tokens so far): the prior's time
is a reference the allocator scales, not a forecast of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.engine.emulated.costmodel import CostPreset, iteration_s
from actors.engine.timing import FULL_CHUNK_SHARE, FULL_KV_SHARE, IterationMeter


@dataclass(frozen=True, slots=True)
class VllmStep:
    """One iteration of a vLLM engine, as its engine core reports it."""

    prefill_tokens: int  # prompt tokens computed (vLLM: num_ctx_tokens)
    decode_seqs: int  # requests that generated a token (num_generation_requests)
    decode_tokens: int
    elapsed_s: float  # wall seconds the iteration took
    kv_usage: float  # share of the KV pool in use


def step_kind(step: VllmStep, chunk_tokens: int) -> str:
    if step.prefill_tokens == 0:
        return "decode" if step.kv_usage >= FULL_KV_SHARE else "decode_short"
    kind = "mixed" if step.decode_seqs else "prefill"
    return kind if step.prefill_tokens >= FULL_CHUNK_SHARE * chunk_tokens else f"{kind}_short"


class StepMeter:
    """Counts a vLLM engine's iterations into `meter`. `prior`: the engine's prior cost model
    now (it follows the role); `decode_context_tokens`: the context its running requests
    read now."""

    def __init__(
        self,
        meter: IterationMeter,
        prior: Callable[[], CostPreset],
        chunk_tokens: int,
        time_scale: float,
        decode_context_tokens: Callable[[], int],
    ) -> None:
        self.meter = meter
        self.prior = prior
        self.chunk_tokens = chunk_tokens
        self.time_scale = time_scale
        self.decode_context_tokens = decode_context_tokens
        self.kv_usage = 0.0  # the pool's share in use at the latest iteration

    def record(self, step: VllmStep) -> None:
        self.kv_usage = step.kv_usage
        if step.prefill_tokens == 0 and step.decode_seqs == 0:
            return  # nothing computed (an idle data-parallel peer's dummy pass)
        chunks = [(step.prefill_tokens, 0)] if step.prefill_tokens else []
        prior_s = iteration_s(self.prior(), chunks, step.decode_seqs, self.decode_context_tokens() if step.decode_seqs else 0)
        measured_s = step.elapsed_s * self.time_scale
        self.meter.add(step_kind(step, self.chunk_tokens), 1, measured_s, prior_s, step.prefill_tokens, step.decode_tokens)


def stat_logger_factory(on_step: Callable[[VllmStep], None]):
    """A vLLM stat logger factory (`AsyncLLM(stat_loggers=[...])`) whose loggers hand each
    iteration's details to `on_step`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class IterationLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            details = getattr(scheduler_stats, "iteration_details", None)
            if details is None or details.is_dummy:
                return
            on_step(
                VllmStep(
                    prefill_tokens=details.num_ctx_tokens,
                    decode_seqs=details.num_generation_requests,
                    decode_tokens=details.num_generation_tokens,
                    elapsed_s=details.elapsed_ms / 1e3,
                    kv_usage=scheduler_stats.kv_cache_usage,
                )
            )

        def log_engine_initialized(self) -> None:
            pass

    return IterationLogger
