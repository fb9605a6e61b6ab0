"""What the OpenAI-compatible gateway adds to a turn, over an environment that calls the bus
directly (`python -m runners.bench gateway`).

    openai client ─HTTP─▶ uvicorn + FastAPI ─▶ GatewaySession ─▶ (the environment actor's
    turn: answered here at once) ─▶ reply ─HTTP─▶ openai client

The turn itself (the bus, the engines) is the same with or without the gateway, so it is
left out: the environment actor's side of each session answers every turn as soon as it
arrives, and what is timed is the harness's request to its reply through a real uvicorn
server on loopback, with the official client, conversations growing turn by turn as an
agent's do.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import openai

from actors.environment.interface import ModelOutput, Task
from actors.environment.sessions import GatewaySession, SessionBoard
from ops.gateway import HttpServer, make_app

REPLY_TOKENS = 32


async def _engine_side(session: GatewaySession, task: Task, turns: int) -> None:
    """The environment actor's side of one session: every turn answered at once."""
    await session.reset(task)
    for turn in range(turns):
        await session.step(ModelOutput("x" * REPLY_TOKENS, list(range(REPLY_TOKENS)), turn, [-1.0] * REPLY_TOKENS))


async def _harness(client: openai.AsyncOpenAI, trajectory_id: str, turns: int, observation_chars: int) -> list[float]:
    messages = [{"role": "user", "content": "task: " + "y" * observation_chars}]
    took_ms = []
    for _ in range(turns):
        started = time.perf_counter()
        done = await client.chat.completions.create(
            model="m", messages=messages, user=trajectory_id, max_tokens=REPLY_TOKENS, logprobs=True
        )
        took_ms.append((time.perf_counter() - started) * 1e3)
        messages += [
            {"role": "assistant", "content": done.choices[0].message.content},
            {"role": "tool", "content": "z" * observation_chars},
        ]
    return took_ms


async def bench(sessions: int, turns: int, concurrent: int, observation_chars: int = 2000) -> dict:
    board = SessionBoard()
    http = HttpServer(make_app(board, "m", 1.0, 30.0), "127.0.0.1", 0)
    port = await http.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    took_ms: list[float] = []
    started = time.perf_counter()
    try:
        for first in range(0, sessions, concurrent):
            batch = range(first, min(sessions, first + concurrent))
            tasks = [Task(f"k{i}", "bench", 0, i, 0, 0, f"t{i}") for i in batch]
            engine = [asyncio.create_task(_engine_side(GatewaySession(board, REPLY_TOKENS), t, turns)) for t in tasks]
            for _ in tasks:  # each session is on the board, claimed, before its harness asks
                assert await board.claim(5.0) is not None
            for result in await asyncio.gather(*(_harness(client, t.trajectory_id, turns, observation_chars) for t in tasks)):
                took_ms += result
            for e in engine:
                e.cancel()
    finally:
        wall_s = time.perf_counter() - started
        await http.stop()
    took_ms.sort()
    return {
        "turns": len(took_ms),
        "concurrent_sessions": concurrent,
        "p50_ms": round(statistics.median(took_ms), 3),
        "p90_ms": round(took_ms[int(0.9 * (len(took_ms) - 1))], 3),
        "p99_ms": round(took_ms[int(0.99 * (len(took_ms) - 1))], 3),
        "mean_ms": round(statistics.fmean(took_ms), 3),
        "turns_per_s": round(len(took_ms) / wall_s, 1),  # the harness and the gateway share one process and core
    }
