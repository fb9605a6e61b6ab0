"""Benchmark of the torch backend against plain transformers, side by side in one run.

    python -m runners.bench_torch [--hidden 256 --layers 4 --seqs 16 --prompt 256 --out-tokens 64]

On one freshly built model (random weights, float32, CPU unless a GPU is present), first the
plain baselines in this process, then the engines, each its own OS process
(`python -m actors.engine`, as `ops.launch` starts them) on an embedded nats-server:
1. prefill tokens/s: the prefill engine (work pulled from JetStream, first token sampled, KV
   held for hand-off, decode work queued durably) vs one plain forward per prompt + sampling;
   timed from the first publish to the last decode work item seen on the bus;
2. decode tokens/s: the decode engine (KV fetched from the prefill engine, checked, batched
   decode with sampling) vs `generate` on the same batch (its prefill subtracted). Two
   engine figures, from the lifecycle log: "window" = first decode_started .. last
   decode_done; "incl. hand-off" = start of the first KV fetch .. last decode_done;
3. KV hand-off per turn, as the decode engine timed it (fetch request .. KV rebuilt and
   verified, ready to join the batch) vs raw serialisation of the same tensors in one
   process (torch.save + torch.load round trip in memory, no network); and the whole
   batch's hand-off (first request .. last KV ready) vs that many raw round trips.
The two phases do not overlap: the decode engine is drained (stops pulling) while the batch
is prefilled, then set back to decode. Both sides run `--threads` torch threads and the
allocator settings of `load_model`. Targets: engine overhead <= 15 %, hand-off <= 2x raw.
Not a timed test: figures depend on the machine and its load (rounds interleave plain and
engine runs so that both see the same load; medians are reported).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from nats.errors import NoRespondersError

from actors.base.connection import close, connect, publish_origin
from actors.config import Config, ModelSection
from actors.engine.torch.actor import KV_FETCHES_IN_FLIGHT
from actors.engine.torch.model import build_tiny, load_model, load_tokenizer
from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Command, CommandAck, Drain, LoadPolicy, Role, SetRole, command_subject
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.work import PrefillWork
from ops.export import read_stream
from ops.natsserver import EmbeddedNats
from ops.procs import die_with_parent

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_WALL_S = 120.0
DRAIN_SETTLE_WALL_S = 0.5  # lets the Drain land; a pull still open hands back what it gets (nak)


def bench_config(checkpoint: Path, args) -> Config:
    raw = {
        "run": {"name": "bench-torch", "time_scale": 1.0, "policy": "static", "heartbeat_wall_s": 1.0},
        "engines": {"count": 2, "backend": "torch", "max_decode_seqs": 256, "max_batch_tokens": 8192},
        "model": {
            "checkpoint": str(checkpoint),
            "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.heads // 2,
            "stop_at_eos": False,
            "verify_trainer": False,
            "threads": args.threads,
            "decode_chunk_tokens": args.decode_chunk,
        },
    }
    return msgspec.convert(raw, Config)


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, length), generator=g).tolist()


# --- plain transformers, in this process ------------------------------------------------------
def plain_prefill_s(lm, batch: list[list[int]]) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        for ids in batch:
            logits = lm(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1).logits
            torch.multinomial(torch.softmax(logits[0, -1], -1), 1)
    return time.perf_counter() - started


def plain_decode_s(lm, batch: list[list[int]], out_tokens: int, pad_id: int) -> float:
    """generate(out_tokens) - generate(1) on the whole batch: the decode part of generation."""
    ids = torch.tensor(batch)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            lm.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad_id,
            )
        return time.perf_counter() - started

    gen(2)  # warm-up
    return gen(out_tokens) - gen(1)


def raw_serialisation_s(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    started = time.perf_counter()
    buffer = io.BytesIO()
    torch.save(kv, buffer)
    buffer.seek(0)
    torch.load(buffer)
    return time.perf_counter() - started


# --- the engines, each its own process --------------------------------------------------------
def spawn_engine(engine_id: str, role: Role, config_path: Path, url: str, logs: Path):
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with open(logs / f"engine-{engine_id}.log", "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "actors.engine",
                "--config",
                str(config_path),
                "--id",
                engine_id,
                "--role",
                role.value,
                "--nats-url",
                url,
                "--log-level",
                "WARNING",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
        )


async def command(nc, engine_id: str, cmd: Command, deadline: float) -> CommandAck:
    """Send a command; retry while the engine is not up yet (no responders)."""
    while True:
        try:
            ack = decode(CommandAck, (await nc.request(command_subject(engine_id, cmd), encode(cmd), timeout=5.0)).data)
            if not ack.ok:
                raise RuntimeError(f"engine {engine_id} refused {cmd!r}: {ack.error}")
            return ack
        except (NoRespondersError, TimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {engine_id} not up after {READY_WALL_S} s") from None
            await asyncio.sleep(0.2)


class Counter:
    """Messages seen on a core subscription; `reach(n)` waits for the n-th."""

    def __init__(self) -> None:
        self.n = 0
        self.changed = asyncio.Event()

    async def on_msg(self, _msg) -> None:
        self.n += 1
        self.changed.set()

    async def reach(self, n: int) -> None:
        while self.n < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), timeout=300)


class Engines:
    """The prefill engine e0 and the decode engine e1, each its own process, driven over the bus."""

    def __init__(self, cfg: Config, url: str, tmp: Path) -> None:
        self.cfg, self.url, self.tmp = cfg, url, tmp
        self.decode_items, self.results = Counter(), Counter()
        self.procs: dict = {}
        self.epoch = 0

    async def start(self, warm_ids: list[int]) -> None:
        self.nc = await connect(self.url, "bench", logging.getLogger("bench"))
        self.js = self.nc.jetstream()
        await streams.ensure_streams(self.js)
        self.origin = await publish_origin(self.js, self.cfg.run.name)
        config_path = self.tmp / "config.json"
        config_path.write_bytes(msgspec.json.encode(self.cfg))
        await self.nc.subscribe(subjects.work_decode(), cb=self.decode_items.on_msg)
        await self.nc.subscribe(subjects.result("env0"), cb=self.results.on_msg)
        for engine_id, role in (("e0", Role.PREFILL), ("e1", Role.DECODE)):
            self.procs[engine_id] = spawn_engine(engine_id, role, config_path, self.url, self.tmp)
        deadline = time.monotonic() + READY_WALL_S
        for engine_id in self.procs:
            await command(self.nc, engine_id, LoadPolicy(version=0), deadline)  # answered once the engine serves
        # warm-up turn through both engines, so that no measurement pays first-call costs
        await self.js.publish(subjects.work_prefill(), encode(_work("warm", warm_ids, 4)))
        await self.results.reach(1)

    async def round(self, r: int, batch: list[list[int]], out_tokens: int) -> dict:
        """Prefill the batch (decode engine not pulling), then decode it; the round's figures."""
        deadline = time.monotonic() + READY_WALL_S
        base_items, base_results = self.decode_items.n, self.results.n
        await command(self.nc, "e1", Drain(reason="bench: prefill phase"), deadline)
        await asyncio.sleep(DRAIN_SETTLE_WALL_S)
        started = time.perf_counter()
        for i, ids in enumerate(batch):
            await self.js.publish(subjects.work_prefill(), encode(_work(f"r{r}-t{i}", ids, out_tokens)))
        await self.decode_items.reach(base_items + len(batch))
        prefill_s = time.perf_counter() - started
        prefill_end_s = time.time() - self.origin.origin_wall_s  # model time (time_scale 1)
        self.epoch += 1
        await command(self.nc, "e1", SetRole(role=Role.DECODE, epoch=self.epoch), deadline)  # ends the drain
        await self.results.reach(base_results + len(batch))
        return {"prefill_s": prefill_s, "prefill_end_s": prefill_end_s}

    async def stop(self) -> list[LifecycleEvent]:
        for p in self.procs.values():
            p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            await asyncio.to_thread(p.wait, 20)
        events = await read_stream(self.js, streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)
        await close(self.nc)
        return events


def decode_figures(events: list[LifecycleEvent], r: int, prefill_end_s: float) -> dict:
    """The decode engine's side of round r, from the lifecycle log."""
    mine = [e for e in events if e.trajectory_id.startswith(f"r{r}-") and e.engine_id == "e1"]
    transfers = [e for e in mine if e.kind is EventKind.KV_TRANSFER_DONE]
    first_fetch_s = min(e.at_s - e.duration_s for e in transfers)
    decode_started = min(e.at_s for e in mine if e.kind is EventKind.DECODE_STARTED)
    decode_done = max(e.at_s for e in mine if e.kind is EventKind.DECODE_DONE)
    return {
        "decode_window_s": decode_done - decode_started,
        "decode_handoff_s": decode_done - first_fetch_s,
        "handoff_span_s": max(e.at_s for e in transfers) - first_fetch_s,  # every turn's KV, one after another
        "transfer_s": [e.duration_s for e in transfers],
        "transfer_bytes": [e.kv_bytes for e in transfers],
        "phases_overlap": first_fetch_s < prefill_end_s,  # a KV fetch began inside the prefill phase
    }


async def measure(cfg: Config, url: str, tmp: Path, lm, pad_id: int, batch: list[list[int]], kv, args) -> tuple[list[dict], list[dict]]:
    """`rounds` rounds, each: plain prefill, decode and raw serialisation in this process, then the
    same turns through the engines; interleaved, so that both sides see the same machine load."""
    engines = Engines(cfg, url, tmp)
    plain, rounds = [], []
    try:
        await engines.start(batch[0][:16])
        plain_prefill_s(lm, batch[:2])  # warm-up
        for r in range(args.rounds):
            plain.append(
                {
                    "prefill_s": plain_prefill_s(lm, batch),
                    "decode_s": plain_decode_s(lm, batch, args.out_tokens, pad_id),
                    "raw_s": [raw_serialisation_s(kv) for _ in range(len(batch))],
                }
            )
            rounds.append(await engines.round(r, batch, args.out_tokens))
    finally:
        events = await engines.stop()
    for r, figures in enumerate(rounds):
        figures.update(decode_figures(events, r, figures["prefill_end_s"]))
    return plain, rounds


def _work(traj: str, ids: list[int], out_tokens: int) -> PrefillWork:
    return PrefillWork(
        work_id=f"{traj}/bench/t0/a0",
        trajectory_id=traj,
        turn=0,
        env_id="env0",
        task_family="calc",
        policy_version=0,
        context_tokens=0,
        new_tokens=len(ids),
        max_output_tokens=out_tokens,
        queued_at_s=0.0,
        token_ids=ids,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.bench_torch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--out-tokens", type=int, default=64)
    parser.add_argument("--decode-chunk", type=int, default=16, help="decode iterations per engine step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in each engine process")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved plain/engine rounds; medians are reported")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = ModelSection(
            hidden_size=args.hidden, intermediate_size=2 * args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.heads // 2
        )
        checkpoint = build_tiny(model, tmp / "model")
        cfg = bench_config(checkpoint, args)
        lm, tok = load_model(checkpoint, args.threads), load_tokenizer(checkpoint)
        batch = prompts(args.seqs, args.prompt)
        with torch.inference_mode():
            out = lm(torch.tensor([batch[0]]), use_cache=True).past_key_values
            kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in out.layers]
        raw_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        with EmbeddedNats(tmp / "nats") as server:
            plain, rounds = asyncio.run(measure(cfg, server.url, tmp, lm, tok.pad_id, batch, kv, args))
    raw = statistics.median(t for p in plain for t in p["raw_s"])
    med = statistics.median
    n_prefill = args.seqs * args.prompt
    n_decode = args.seqs * (args.out_tokens - 1)  # the first token of each turn comes with prefill
    plain_p, plain_d = med(p["prefill_s"] for p in plain), med(p["decode_s"] for p in plain)
    rows = [
        ("prefill tok/s", n_prefill / med(r["prefill_s"] for r in rounds), n_prefill / plain_p, "first publish .. last decode work queued"),
        (
            "decode tok/s (window)",
            n_decode / med(r["decode_window_s"] for r in rounds),
            n_decode / plain_d,
            "first decode_started .. last decode_done",
        ),
        (
            "decode tok/s (incl. hand-off)",
            n_decode / med(r["decode_handoff_s"] for r in rounds),
            n_decode / plain_d,
            "first KV fetch .. last decode_done",
        ),
    ]
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads; {args.seqs} seqs x {args.prompt} prompt "
        f"tokens, {args.out_tokens} output tokens; threads {args.threads} per process; device {next(lm.parameters()).device}; "
        f"{os.cpu_count()} CPUs; medians of {args.rounds} interleaved rounds"
    )
    print(f"{'metric':32} {'engine':>12} {'plain':>12} {'overhead':>9}")
    for name, engine, plain_rate, note in rows:
        print(f"{name:32} {engine:12.1f} {plain_rate:12.1f} {100 * (plain_rate / engine - 1):8.1f}%  ({note})")
    transfers = [t for r in rounds for t in r["transfer_s"]]
    handoff, per_seq_bytes = med(transfers), med(b for r in rounds for b in r["transfer_bytes"])
    print(
        f"{'KV hand-off per turn (median)':32} {handoff * 1e3:10.2f}ms {raw * 1e3:10.2f}ms {handoff / raw:8.2f}x  "
        f"({per_seq_bytes / 1e6:.2f} MB engine to engine over NATS, first request .. KV ready, vs torch.save+load "
        f"of {raw_bytes / 1e6:.2f} MB in memory, medians; {len(transfers)} transfers, {min(transfers) * 1e3:.2f}..{max(transfers) * 1e3:.2f} ms)"
    )
    span = med(r["handoff_span_s"] for r in rounds)
    print(
        f"{'KV hand-off, whole batch':32} {span * 1e3:10.2f}ms {raw * args.seqs * 1e3:10.2f}ms {span / (raw * args.seqs):8.2f}x  "
        f"(first request .. last KV ready, {args.seqs} turns, at most {KV_FETCHES_IN_FLIGHT} in flight, vs "
        f"{args.seqs} x the raw round trip; median of rounds)"
    )
    print(
        "per round, engine/plain s: "
        + "; ".join(
            f"prefill {r['prefill_s']:.3f}/{p['prefill_s']:.3f} decode {r['decode_window_s']:.3f}/{p['decode_s']:.3f}"
            for r, p in zip(rounds, plain)
        )
    )
    if any(r["phases_overlap"] for r in rounds):
        print("warning: a KV fetch began before the prefill phase ended; the phases overlapped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
