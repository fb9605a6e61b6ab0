"""Benchmark of the vLLM backend: PD against one colocated engine on a multi-turn workload.

    python -m runners.bench_vllm --out DIR [--trajectories 8 --turns 4 --prompt 256 --obs 64 --out-tokens 32 --rounds 2]

On one tiny Qwen2-style model built from a config (random weights, float32, no download), two
vLLM engines (`VllmEngine`, each an `AsyncLLM` with Prorsa's KV connector) on an embedded
nats-server, and the same multi-turn workload run three ways, side by side in each round:

    pd         engine actor e0 (prefill) + e1 (decode) over JetStream: every turn prefilled on
               e0, its KV moved to e1 over NATS by the connector (only the blocks e1's prefix
               cache lacks), decoded on e1
    colocated  one engine actor (e0, colocated) runs every turn itself, same bus protocol
    direct     plain vLLM: `AsyncLLM.generate` on e0 straight from this process (no bus, no
               actor), the baseline for the actor's overhead

Workload: `--trajectories` agents in parallel, each `--turns` turns in sequence: turn 0's prompt
is `--prompt` tokens, each later turn appends the previous output and an `--obs`-token
observation (a tool result) to the context; `--out-tokens` tokens per turn, greedy. Every
phase starts with empty prefix caches (`reset_prefix_cache`); within it the caches serve
the growing contexts. The phase order rotates each round so that load drifts hit all three.

Per phase: output tokens/s over the phase's wall time, turn latency (work published ..
result received) p50/p99, KV bytes moved and fetch time per turn (the decode engine's
connector counters), prefix-cache hit share (prompt positions the engine running the
prefill did not compute), and for pd the share of prompt positions e1 loaded over NATS.
Exactness: pd, colocated and direct produce the same tokens on every turn.

With `--example-connector N`, two more engines built with vLLM's `ExampleConnector` (KV
through safetensors files in a shared folder) and N single hand-offs of a fresh 2 x
`--prompt`-token prompt (not block-aligned: `handoff_tokens`), one at a time: the second engine's time for the KV and one decode
token, Prorsa's connector (e0 -> e1 over NATS) against the ExampleConnector (x0 -> x1).
Writes DIR/bench_vllm.json and prints a table. Not a timed test: figures depend on the
machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.base.clock import ScaledClock
from actors.base.connection import close, connect, publish_origin
from actors.config import Config, VllmSection
from actors.engine.vllm.actor import VllmEngineActor
from actors.engine.vllm.engine import KvSource, VllmEngine
from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Role
from bus_schemas.work import PrefillWork, TurnResult
from ops.natsserver import EmbeddedNats

PHASES = ("pd", "colocated", "direct")
ENV_ID = "bench"
KV_COUNTERS = ("kv_bytes_fetched", "kv_fetch_us", "kv_fetched", "kv_loads", "kv_loaded_tokens", "kv_load_failures", "kv_loads_repeated")
TURN_TIMEOUT_WALL_S = 300.0
SETTLE_WALL_S = 10.0  # after a phase's last result, its actors' last acks land within this
log = logging.getLogger("bench_vllm")


@dataclass(frozen=True, slots=True)
class Workload:
    trajectories: int
    turns: int
    prompt_tokens: int
    obs_tokens: int
    out_tokens: int

    def max_len_tokens(self) -> int:
        return self.prompt_tokens + (self.turns - 1) * (self.out_tokens + self.obs_tokens) + self.out_tokens


@dataclass(slots=True)
class Turn:
    trajectory: int
    turn: int
    prompt_tokens: int  # context + new tokens
    latency_s: float
    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int  # prompt positions the engine that prefilled did not compute


@dataclass(slots=True)
class Phase:
    name: str
    round: int
    wall_s: float
    turns: list[Turn]
    kv: dict[str, int] = field(default_factory=dict)  # the decode engine's connector counters, this phase's deltas
    actor_counters: dict[str, dict[str, int]] = field(default_factory=dict)  # each engine actor's counters (actor phases)


def tokens(seed: int, n: int) -> list[int]:
    """Deterministic byte-vocabulary ids: the prompt or an observation of one (round, trajectory, turn)."""
    return [(seed * 7919 + i * 104729 + (seed * i) % 251) % 256 for i in range(n)]


def build_model(out_dir: Path, hidden: int, layers: int) -> str:
    """A tiny random Qwen2 (byte vocabulary, head size 32: the smallest vLLM's CPU attention
    takes), weights drawn wide so greedy decoding does not repeat one token, untied."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=259,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=257,
        eos_token_id=256,
        pad_token_id=258,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out_dir))
    return str(out_dir)


def bench_config(model_dir: str, vllm: VllmSection) -> Config:
    raw = {
        "run": {"name": "bench-vllm", "time_scale": 1.0, "policy": "static", "heartbeat_wall_s": 1.0},
        "engines": {"count": 2, "backend": "vllm", "prefill_engines": 1, "kv_writeback": "none", "local_prefill_max_tokens": 0},
        "model": {"temperature": 0.001, "stop_at_eos": False},  # below vLLM's floor of 0.01: greedy
        "vllm": {**msgspec.to_builtins(vllm), "model": model_dir},
    }
    return msgspec.convert(raw, Config)


# --- one phase ---------------------------------------------------------------------------------
async def run_trajectories(w: Workload, r: int, turn_fn, on_turn) -> tuple[float, list[Turn]]:
    """Every trajectory's turns in sequence, all trajectories at once; `turn_fn(traj, turn,
    context, new) -> (ids, logprobs, cached)`. The wall time of the whole, and each turn."""
    done: list[Turn] = []

    async def trajectory(t: int) -> None:
        context, new = [], tokens(1000 * r + t, w.prompt_tokens)
        for k in range(w.turns):
            started = time.perf_counter()
            ids, logprobs, cached = await turn_fn(t, k, context, new)
            done.append(Turn(t, k, len(context) + len(new), time.perf_counter() - started, ids, logprobs, cached))
            on_turn()
            context = context + new + ids
            new = tokens(1000 * r + 100 * (k + 1) + t, w.obs_tokens)

    started = time.perf_counter()
    await asyncio.gather(*(trajectory(t) for t in range(w.trajectories)))
    return time.perf_counter() - started, sorted(done, key=lambda x: (x.trajectory, x.turn))


class Results:
    """TurnResults on the bench's result subject, by work id."""

    def __init__(self) -> None:
        self.waiting: dict[str, asyncio.Future] = {}

    async def on_msg(self, msg) -> None:
        result = decode(TurnResult, msg.data)
        future = self.waiting.pop(result.work_id, None)
        if future is not None and not future.done():
            future.set_result(result)


async def actor_phase(
    url: str, cfg: Config, engines: dict[str, VllmEngine], roles: dict[str, Role], name: str, r: int, w: Workload, on_turn
) -> Phase:
    """The workload through engine actors over JetStream (pd: e0 prefill, e1 decode; colocated: e0).
    The actors get a connection of their own, closed after the phase: a stopped actor's pull
    subscription would otherwise live on and swallow the next phase's work until its ack wait."""
    nc = await connect(url, f"bench-vllm-{name}-{r}", log)
    js = nc.jetstream()
    results = Results()
    await nc.subscribe(subjects.result(ENV_ID), cb=results.on_msg)
    actors = [VllmEngineActor(eid, cfg, nc, ScaledClock(1.0, time.time()), role, engine=engines[eid]) for eid, role in roles.items()]
    running = [asyncio.create_task(a.run()) for a in actors]
    loader = engines["e1" if "e1" in roles else "e0"]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.ready.wait() for a in actors)), timeout=60)
        before = await loader.connector_counters(nc)

        async def turn_fn(t: int, k: int, context: list[int], new: list[int]):
            work = PrefillWork(
                work_id=f"{name}-r{r}-t{t}/bench/t{k}/a0",
                trajectory_id=f"{name}-r{r}-t{t}",
                turn=k,
                env_id=ENV_ID,
                task_family="calc",
                policy_version=0,
                context_tokens=len(context),
                new_tokens=len(new),
                max_output_tokens=w.out_tokens,
                queued_at_s=0.0,
                token_ids=new,
                context_token_ids=context,
            )
            future = asyncio.get_running_loop().create_future()
            results.waiting[work.work_id] = future
            await js.publish(subjects.work_prefill(), encode(work))
            result = await asyncio.wait_for(future, TURN_TIMEOUT_WALL_S)
            return list(result.token_ids), list(result.logprobs), result.cached_prefix_tokens

        wall_s, turns = await run_trajectories(w, r, turn_fn, on_turn)
        deadline = time.monotonic() + SETTLE_WALL_S
        while sum(a.in_flight() for a in actors) and time.monotonic() < deadline:  # the last acks land
            await asyncio.sleep(0.01)  # barrier-ok: polling the actors' own state
        after = await loader.connector_counters(nc)
    finally:
        for a in actors:
            a.request_stop("phase over")
        await asyncio.wait_for(asyncio.gather(*running), timeout=60)
        left = await purge_work(js)  # what the next phase must not see
        await close(nc)
    kv = {k: after.get(k, 0) - before.get(k, 0) for k in KV_COUNTERS}
    counters = {a.actor_id: dict(a.counters) for a in actors}
    counters["bench"] = {"work_left_in_queues": left}
    return Phase(name, r, wall_s, turns, kv, counters)


async def purge_work(js) -> int:
    """Empty both work queues; how many items were left in them."""
    left = 0
    for stream in (streams.WORK_PREFILL, streams.WORK_DECODE):
        left += (await js.stream_info(stream.name)).state.messages
        await js.purge_stream(stream.name)
    return left


async def direct_phase(nc, engine: VllmEngine, r: int, w: Workload, on_turn) -> Phase:
    """The workload straight through `AsyncLLM.generate` on one engine: plain vLLM."""
    before = await engine.connector_counters(nc)

    async def turn_fn(t: int, k: int, context: list[int], new: list[int]):
        gen = await engine.generate(f"direct-r{r}-t{t}-k{k}", context + new, w.out_tokens)
        return gen.token_ids, gen.logprobs, gen.cached_tokens

    wall_s, turns = await run_trajectories(w, r, turn_fn, on_turn)
    after = await engine.connector_counters(nc)
    return Phase("direct", r, wall_s, turns, {k: after.get(k, 0) - before.get(k, 0) for k in KV_COUNTERS})


async def warm_up(nc, engines: dict[str, VllmEngine]) -> None:
    """First calls pay one-off costs (seconds here): one turn on each engine, one hand-off e0 -> e1."""
    ids = tokens(999_999, 300)
    for eid, engine in engines.items():
        await engine.generate(f"warm-{eid}", ids, 4)
    first = await engines["e0"].prefill("warm-p", ids[::-1], hold="warm-h")
    await engines["e1"].decode("warm-d", ids[::-1] + first.token_ids, 3, KvSource("e0", "warm-h", len(ids)))
    if (await engines["e1"].connector_counters(nc)).get("kv_loads", 0) < 1:
        raise RuntimeError("warm-up: e1 loaded no KV from e0; the connector does not work here")


async def files_written(storage: Path, n_files: int, timeout_wall_s: float = 30.0) -> float:
    """Wait until the ExampleConnector's folder holds `n_files` layer files; the wait, ms. Under
    load its files can land after the prefill's output (seen here: the loader then finds the
    prompt's folder without its files and its engine dies on FileNotFoundError)."""
    started = time.perf_counter()
    while len(list(storage.glob("*/*.safetensors"))) < n_files:
        if time.perf_counter() - started > timeout_wall_s:
            raise RuntimeError(f"ExampleConnector: {n_files} KV files not in {storage} after {timeout_wall_s} s")
        await asyncio.sleep(0.005)  # barrier-ok: polling a folder another process writes
    return (time.perf_counter() - started) * 1e3


async def handoff(
    nc, engines: dict[str, VllmEngine], example: dict[str, VllmEngine], n: int, prompt_tokens: int, storage: Path, layers: int
) -> dict:
    """One turn at a time, `n` fresh prompts: prefill on the first engine of a pair, then the
    prompt + first token on the second with 1 output token, its KV moved by Prorsa's connector
    (e0 -> e1 over NATS, from memory) or by vLLM's ExampleConnector (x0 -> x1 through files in a
    shared folder; full blocks only). Medians per turn, and whether both pairs give the same tokens."""
    times = {k: [] for k in ("prorsa_prefill_ms", "prorsa_handoff_ms", "example_prefill_ms", "example_handoff_ms", "example_write_lag_ms")}
    same, loaded_example = True, []
    before = await engines["e1"].connector_counters(nc)
    for i in range(n):
        ids = tokens(50_000 + i, prompt_tokens)
        started = time.perf_counter()
        first = await engines["e0"].prefill(f"ho-p-{i}", ids, hold=f"ho-h-{i}")
        mid = time.perf_counter()
        rest = await engines["e1"].decode(f"ho-d-{i}", ids + first.token_ids, 1, KvSource("e0", f"ho-h-{i}", len(ids)))
        times["prorsa_prefill_ms"].append((mid - started) * 1e3)
        times["prorsa_handoff_ms"].append((time.perf_counter() - mid) * 1e3)
        started = time.perf_counter()
        x_first = await example["x0"].generate(f"ho-xp-{i}", ids, 1)
        times["example_write_lag_ms"].append(await files_written(storage, (i + 1) * layers))
        mid = time.perf_counter()
        x_rest = await example["x1"].generate(f"ho-xd-{i}", ids + x_first.token_ids, 1)
        times["example_prefill_ms"].append((mid - started) * 1e3 - times["example_write_lag_ms"][-1])
        times["example_handoff_ms"].append((time.perf_counter() - mid) * 1e3)
        same &= first.token_ids + rest.token_ids == x_first.token_ids + x_rest.token_ids
        loaded_example.append(x_rest.cached_tokens)
    after = await engines["e1"].connector_counters(nc)
    figures = {k: statistics.median(v) for k, v in times.items()}
    figures.update(
        {
            "turns": n,
            "prompt_tokens": prompt_tokens,
            "same_tokens": same,
            "prorsa_bytes_per_turn": (after.get("kv_bytes_fetched", 0) - before.get("kv_bytes_fetched", 0)) / n,
            "prorsa_loaded_tokens_per_turn": (after.get("kv_loaded_tokens", 0) - before.get("kv_loaded_tokens", 0)) / n,
            "example_loaded_tokens_per_turn": statistics.mean(loaded_example),
            "example_write_lag_ms_max": max(
                times["example_write_lag_ms"]
            ),  # files landing after x0's output (excluded above)  # num_cached_tokens of x1's request: all from the files
            "handoff_ratio_prorsa_over_example": statistics.median(times["prorsa_handoff_ms"])
            / statistics.median(times["example_handoff_ms"]),
        }
    )
    return figures


def handoff_tokens(w: Workload) -> int:
    """The hand-off prompt: about 2 x --prompt, never a whole number of 32-token blocks (at 512
    tokens, 4 blocks of 128, vLLM 0.32's ExampleConnector engine died here: its loader found
    the prompt's folder without the layer files, FileNotFoundError, twice in two runs)."""
    n = 2 * w.prompt_tokens
    return n + 7 if n % 32 == 0 else n


def example_engines(cfg: Config, url: str, storage: Path) -> dict[str, VllmEngine]:
    """Two engines with vLLM's ExampleConnector (KV through safetensors files in `storage`)."""
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return {eid: VllmEngine(eid, cfg.vllm, cfg.vllm.model, url, overrides={"kv_transfer_config": kv}) for eid in ("x0", "x1")}


# --- the run -----------------------------------------------------------------------------------
async def measure(
    url: str, cfg: Config, w: Workload, rounds: int, console: Console, example_turns: int = 0, storage: Path | None = None
) -> tuple[dict[str, float], int, list[Phase], dict | None]:
    nc = await connect(url, "bench-vllm", log)
    js = nc.jetstream()
    await streams.ensure_streams(js)
    await publish_origin(js, cfg.run.name)
    engines = {eid: VllmEngine(eid, cfg.vllm, cfg.vllm.model, url) for eid in ("e0", "e1")}
    example = example_engines(cfg, url, storage) if example_turns else {}
    handoff_figures = None
    start_s: dict[str, float] = {}
    phases: list[Phase] = []
    columns = (TextColumn("{task.description:24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            starting = progress.add_task(f"starting {len(engines) + len(example)} vLLM engines", total=len(engines) + len(example))
            for eid, engine in {**engines, **example}.items():
                started = time.perf_counter()
                await engine.start()
                start_s[eid] = time.perf_counter() - started
                progress.advance(starting)
            await warm_up(nc, engines)
            block_size_tokens = engines["e0"].llm.vllm_config.cache_config.block_size
            per_phase = w.trajectories * w.turns
            turns_task = progress.add_task("turns", total=rounds * len(PHASES) * per_phase)
            for r in range(rounds):
                for name in PHASES[r % len(PHASES) :] + PHASES[: r % len(PHASES)]:  # rotated each round
                    for engine in engines.values():  # every phase starts cold
                        if not await engine.llm.reset_prefix_cache():
                            raise RuntimeError(f"engine {engine.engine_id}: prefix cache not reset (requests still running)")
                    progress.update(turns_task, description=f"round {r + 1}/{rounds}: {name}")
                    advance = lambda: progress.advance(turns_task)
                    if name == "direct":
                        phases.append(await direct_phase(nc, engines["e0"], r, w, advance))
                    else:
                        roles = {"e0": Role.PREFILL, "e1": Role.DECODE} if name == "pd" else {"e0": Role.COLOCATED}
                        phases.append(await actor_phase(url, cfg, engines, roles, name, r, w, advance))
            if example:
                progress.update(turns_task, description="hand-off vs ExampleConnector")
                layers = engines["e0"].llm.model_config.get_num_layers(engines["e0"].llm.vllm_config.parallel_config)
                handoff_figures = await handoff(nc, engines, example, example_turns, handoff_tokens(w), storage, layers)
    finally:
        for engine in {**engines, **example}.values():
            engine.shutdown()
        await close(nc)
    return start_s, block_size_tokens, phases, handoff_figures


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(phases: list[Phase], name: str) -> dict:
    mine = [p for p in phases if p.name == name]
    turns = [t for p in mine for t in p.turns]
    kv = {k: sum(p.kv.get(k, 0) for p in mine) for k in KV_COUNTERS}
    prompt_tokens = sum(t.prompt_tokens for t in turns)
    out_tokens = sum(len(t.token_ids) for t in turns)
    latencies_ms = [t.latency_s * 1e3 for t in turns]
    return {
        "rounds": len(mine),
        "turns": len(turns),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "wall_s": [round(p.wall_s, 3) for p in mine],
        "output_tok_s": statistics.median(sum(len(t.token_ids) for t in p.turns) / p.wall_s for p in mine),
        "output_tok_s_per_round": [round(sum(len(t.token_ids) for t in p.turns) / p.wall_s, 2) for p in mine],
        "turn_latency_ms_p50": percentile(latencies_ms, 0.5),
        "turn_latency_ms_p99": percentile(latencies_ms, 0.99),
        "kv_bytes_moved": kv["kv_bytes_fetched"],
        "kv_bytes_moved_per_turn": kv["kv_bytes_fetched"] / len(turns),
        "kv_transfer_ms_per_turn": kv["kv_fetch_us"] / 1e3 / len(turns),  # over all turns: a turn whose KV did not move counts 0
        "kv_transfer_ms_per_fetch": kv["kv_fetch_us"] / 1e3 / kv["kv_fetched"] if kv["kv_fetched"] else 0.0,
        "kv_fetches": kv["kv_fetched"],
        "kv_loads": kv["kv_loads"],  # loads into the decoder's blocks (a fetch each)
        "kv_loads_repeated": kv["kv_loads_repeated"],  # a request loading again (preempted and resumed)
        "actor_counters": sum_counters([p.actor_counters for p in mine]),
        "kv_load_failures": kv["kv_load_failures"],
        "kv_loaded_share": kv["kv_loaded_tokens"] / prompt_tokens,  # prompt positions the decoder loaded over NATS
        "prefix_cache_hit_share": sum(t.cached_tokens for t in turns) / prompt_tokens,  # on the engine that prefilled
    }


def sum_counters(per_round: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Each actor's counters summed over rounds (zeros kept)."""
    total: dict[str, dict[str, int]] = {}
    for counters in per_round:
        for actor, values in counters.items():
            mine = total.setdefault(actor, {})
            for key, value in values.items():
                mine[key] = mine.get(key, 0) + value
    return total


def exactness(phases: list[Phase]) -> dict:
    """Every turn's tokens, pd and direct against colocated, round by round."""
    by = {(p.name, p.round): {(t.trajectory, t.turn): t for t in p.turns} for p in phases}
    compared, same, diff = 0, {"pd": True, "direct": True}, {"pd": 0.0, "direct": 0.0}
    for (name, r), turns in by.items():
        if name == "colocated":
            continue
        reference = by[("colocated", r)]
        for key, turn in turns.items():
            ref = reference[key]
            compared += name == "pd"
            same[name] &= turn.token_ids == ref.token_ids
            if turn.token_ids == ref.token_ids:
                diff[name] = max(diff[name], max((abs(a - b) for a, b in zip(turn.logprobs, ref.logprobs)), default=0.0))
    return {
        "pd_equals_colocated": same["pd"],
        "direct_equals_colocated": same["direct"],
        "turns_compared": compared,
        "max_logprob_diff_pd": diff["pd"],
        "max_logprob_diff_direct": diff["direct"],
    }


def print_table(console: Console, report: dict) -> None:
    table = Table(title=f"vLLM backend, {report['workload_line']}")
    table.add_column("metric")
    for name in PHASES:
        table.add_column(name, justify="right")
    s = report["phases"]
    rows = [
        ("output tok/s (median of rounds)", "output_tok_s", "{:.1f}"),
        ("turn latency p50 ms", "turn_latency_ms_p50", "{:.0f}"),
        ("turn latency p99 ms", "turn_latency_ms_p99", "{:.0f}"),
        ("KV moved per turn (KB)", "kv_bytes_moved_per_turn", "{:.1f}", 1e-3),
        ("KV transfer ms per turn", "kv_transfer_ms_per_turn", "{:.2f}"),
        ("KV transfer ms per fetch", "kv_transfer_ms_per_fetch", "{:.2f}"),
        ("prompt share loaded over NATS", "kv_loaded_share", "{:.1%}"),
        ("prefix-cache hit share", "prefix_cache_hit_share", "{:.1%}"),
    ]
    for label, key, fmt, *scale in rows:
        table.add_row(label, *(fmt.format(s[n][key] * (scale[0] if scale else 1)) for n in PHASES))
    console.print(table)
    e = report["exact"]
    console.print(
        f"exact: pd == colocated on {e['turns_compared']} turns: {e['pd_equals_colocated']} "
        f"(max logprob diff {e['max_logprob_diff_pd']:.2e}); direct == colocated: {e['direct_equals_colocated']}"
    )
    ratios = report["ratios"]
    h = report["handoff_vs_example_connector"]
    if h:
        console.print(
            f"hand-off, {h['prompt_tokens']} prompt tokens, medians of {h['turns']} (KV in + 1 decode token on the "
            f"second engine): Prorsa's connector {h['prorsa_handoff_ms']:.0f} ms ({h['prorsa_bytes_per_turn'] / 1e3:.0f} KB "
            f"over NATS), ExampleConnector {h['example_handoff_ms']:.0f} ms (files): "
            f"{h['handoff_ratio_prorsa_over_example']:.2f}x; prefill {h['prorsa_prefill_ms']:.0f} vs "
            f"{h['example_prefill_ms']:.0f} ms; same tokens {h['same_tokens']}; ExampleConnector files landed up to "
            f"{h['example_write_lag_ms_max']:.0f} ms after its prefill returned"
        )
    console.print(
        f"pd / colocated output tok/s {ratios['pd_over_colocated_tok_s']:.2f}x; actor overhead (colocated "
        f"against direct) {ratios['actor_overhead_pct']:+.1f}%; engine starts "
        + ", ".join(f"{k} {v:.1f} s" for k, v in report["engine_start_s"].items())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.bench_vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_vllm.json")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256, help="turn 0's prompt tokens")
    parser.add_argument("--obs", type=int, default=64, help="observation tokens appended each later turn")
    parser.add_argument("--out-tokens", type=int, default=32, help="output tokens per turn")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three phases, order rotated")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-chunk-kib", type=int, default=256)
    parser.add_argument(
        "--example-connector",
        type=int,
        default=0,
        metavar="N",
        help="also N single hand-offs of 2 x --prompt tokens against vLLM's ExampleConnector (2 more engines)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.hidden % 32 or args.trajectories < 1 or args.turns < 1 or args.rounds < 1:
        parser.error("--hidden must be a multiple of 32 (vLLM's CPU attention: head size 32); counts >= 1")
    w = Workload(args.trajectories, args.turns, args.prompt, args.obs, args.out_tokens)
    vllm = VllmSection(
        dtype="float32",
        max_model_len_tokens=max(1024, w.max_len_tokens(), handoff_tokens(w) + 8),
        kv_pool_gib=1,
        max_num_seqs=max(8, args.trajectories),
        kv_chunk_bytes=args.kv_chunk_kib * 1024,
    )
    console = Console()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp_dir:
        tmp = Path(tmp_dir)
        cfg = bench_config(build_model(tmp / "model", args.hidden, args.layers), vllm)
        with EmbeddedNats(tmp / "nats") as server:
            start_s, block_size_tokens, phases, handoff_figures = asyncio.run(
                measure(server.url, cfg, w, args.rounds, console, args.example_connector, tmp / "example-kv")
            )
    summary = {name: summarise(phases, name) for name in PHASES}
    report = {
        "command": "python -m runners.bench_vllm " + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": asdict(w),
        "workload_line": (
            f"{w.trajectories} trajectories x {w.turns} turns, prompt {w.prompt_tokens} + {w.obs_tokens} per "
            f"later turn, {w.out_tokens} out, greedy; {args.rounds} rounds"
        ),
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.hidden // 32, "dtype": "float32"},
        "vllm": msgspec.to_builtins(vllm),
        "block_size_tokens": block_size_tokens,
        "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before[0], "load_avg_after": os.getloadavg()[0]},
        "engine_start_s": start_s,
        "phases": summary,
        "exact": exactness(phases),
        "ratios": {
            "pd_over_colocated_tok_s": summary["pd"]["output_tok_s"] / summary["colocated"]["output_tok_s"],
            "actor_overhead_pct": 100 * (summary["direct"]["output_tok_s"] / summary["colocated"]["output_tok_s"] - 1),
        },
        "handoff_vs_example_connector": handoff_figures,
        "turns": {f"{p.name}-r{p.round}": [[t.trajectory, t.turn, t.token_ids] for t in p.turns] for p in phases},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_vllm.json").write_text(json.dumps(report, indent=1) + "\n")
    print_table(console, report)
    console.print(f"wrote {args.out / 'bench_vllm.json'}")
    exact = report["exact"]["pd_equals_colocated"] and (handoff_figures is None or handoff_figures["same_tokens"])
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
