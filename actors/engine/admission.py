"""Admission that reserves KV for the growth of running decodes (`engines.admission`).

An engine that admits whatever KV fits now fills its pool, then preempts (recomputes)
sequences as they grow: fed as fast as it drains, it thrashes. SGLang reserves room instead
(`engines.admission = "sglang"`, the default); vLLM v1 admits greedily and preempts the
newest request when a block cannot be allocated (`"vllm"`, the engine core's behaviour
before this module).

SGLang, three rules (python/sglang/srt/environ.py for the constants; docs/calibration.md
"Admission" for the sources):

* **Engines that prefill** (colocated; a decode engine's local appends): the scheduler's
  PrefillAdder starts from the free KV minus, for every running request, its remaining
  output (max_new_tokens − output so far, clipped at `CLIP_MAX_NEW_TOKENS`) times the
  `new_token_ratio`; a new request needs its uncached input plus its clipped max_new_tokens
  times the ratio, and the first that does not fit stops admission (first come, first
  served). The ratio starts at `INIT` (× 0.3 under DP attention, `init_ratio`), falls by (INIT − MIN) / `DECAY_STEPS` per decode step
  to MIN = INIT × `MIN_FACTOR`, goes back to INIT when the engine is idle, and after a
  retraction (KV ran out) is reset to (tokens generated + `RETRACT_DECODE_STEPS` per request)
  / max_new_tokens, summed over the batch that stays (`NewTokenRatio.after_preemption`).
* **PD decode engines** (disaggregation/decode.py, `_allocatable_tokens`): a transferred
  request is pre-allocated only into the free KV minus `RESERVED_DECODE_TOKENS` for every
  request running, transferring or waiting there.
* **PD prefill engines** compute a request only once a decode engine has pre-allocated its
  KV; the engine actor approximates that from the decode queue (`_decode_side_full` in
  actors/engine/actor.py, `EngineCore.hold_new_handoffs`).
"""

from __future__ import annotations

from dataclasses import dataclass

INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR: the floor is INIT × this
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS: decode steps from INIT to the floor
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS: tokens per request the ratio assumes after a retraction
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: a request's growth is counted up to this
RESERVED_DECODE_TOKENS = 512  # SGLANG_NUM_RESERVED_DECODE_TOKENS: a PD decode engine's reservation per request
# schedule_conservativeness (default 1.0) scales INIT; SGLang multiplies it by 0.3 under DP
# attention (server_args.py `_handle_data_parallelism`), so a DP-attention engine starts at 0.21
DP_ATTENTION_CONSERVATIVENESS = 0.3


def rank_chunk_tokens(max_batch_tokens: int, dp_ranks: int, divided: bool) -> int:
    """Each DP rank's chunked-prefill budget: SGLang divides chunked_prefill_size by the DP
    size under DP attention (`engines.dp_chunk = "divided"`, server_args.py
    `_handle_data_parallelism`: 8192 -> 1024 per rank at DP8)."""
    return max(1, max_batch_tokens // dp_ranks) if divided else max_batch_tokens


def init_ratio(dp_ranks: int) -> float:
    """The new-token ratio an engine of `dp_ranks` DP-attention ranks starts from."""
    return min(1.0, INIT_NEW_TOKEN_RATIO * (DP_ATTENTION_CONSERVATIVENESS if dp_ranks > 1 else 1.0))


@dataclass(slots=True)
class NewTokenRatio:
    """The share of its remaining max_new_tokens a running request is expected to still
    generate (SGLang's NewTokenRatioTracker)."""

    init: float = INIT_NEW_TOKEN_RATIO  # `init_ratio`
    current: float = INIT_NEW_TOKEN_RATIO

    @property
    def floor(self) -> float:
        return self.init * MIN_NEW_TOKEN_RATIO_FACTOR

    def decay(self, decode_steps: int = 1) -> None:
        step = (self.init - self.floor) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.current = max(self.floor, self.current - step * decode_steps)

    def reset(self) -> None:
        self.current = self.init

    def start_from(self, init: float) -> None:
        """A new starting ratio (the engine's layout changed), taking effect now."""
        self.init = self.current = init

    def after_preemption(self, generated: list[int], max_new: list[int]) -> None:
        """The batch that stays after a retraction: its tokens so far and caps."""
        if generated:
            estimate = (sum(generated) + RETRACT_DECODE_STEPS * len(generated)) / (sum(max_new) + 1)
            self.current = min(1.0, estimate)  # as SGLang: not clamped here; the next decay lifts it to the floor if below


def growth_tokens(max_new_tokens: int, generated: int, ratio: float) -> float:
    """KV a request is expected to still need for its output."""
    return min(max(max_new_tokens - generated, 0), CLIP_MAX_NEW_TOKENS) * ratio
