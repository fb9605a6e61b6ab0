"""Benchmark of the torch backend against plain transformers, side by side in one run.

    python -m runners.bench_torch [--hidden 256 --layers 4 --seqs 16 --prompt 256 --out-tokens 64]

On one freshly built model (random weights, float32, CPU unless a GPU is present):
1. prefill tokens/s: a prefill engine actor on an embedded nats-server (work pulled from
   JetStream, KV held for hand-off, decode work queued) vs one plain forward per prompt;
2. decode tokens/s: a decode engine actor (KV fetched from the prefill engine in chunks,
   checksum, batched decode) vs `generate` on the same batch (its prefill subtracted);
3. KV hand-off: each transfer as the decode engine measured it (fetch, checksum, rebuild)
   vs raw serialisation of the same tensors (torch.save + torch.load round trip).
Prints a table; targets: engine overhead <= 15 %, hand-off <= 2x raw. Not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from actors.base.clock import ScaledClock
from actors.base.connection import close, connect, publish_origin
from actors.config import Config, ModelSection
from actors.engine.torch_actor import TorchEngineActor
from actors.engine.torch_model import build_tiny, load_model, load_tokenizer
from bus_schemas import streams, subjects
from bus_schemas.codec import encode
from bus_schemas.control import Role
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.work import PrefillWork
from ops.export import read_stream
from ops.natsserver import EmbeddedNats


def bench_config(checkpoint: Path, args) -> Config:
    raw = {
        "run": {"name": "bench-torch", "time_scale": 1.0, "policy": "static", "heartbeat_wall_s": 1.0},
        "engines": {"count": 2, "backend": "torch", "max_decode_seqs": 256, "max_batch_tokens": 8192},
        "model": {"checkpoint": str(checkpoint), "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
                  "layers": args.layers, "heads": args.heads, "kv_heads": args.heads // 2, "stop_at_eos": False,
                  "verify_trainer": False, "threads": args.threads, "decode_chunk_tokens": args.decode_chunk},
    }  # fmt: skip
    return msgspec.convert(raw, Config)


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, length), generator=g).tolist()


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
            lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                        temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)  # fmt: skip
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


async def engine_run(cfg: Config, url: str, batch: list[list[int]], out_tokens: int) -> dict:
    log = logging.getLogger("bench")
    nc = await connect(url, "bench", log)
    js = nc.jetstream()
    await streams.ensure_streams(js)
    await publish_origin(js, "bench")
    clock = ScaledClock(1.0, time.time())
    queued, results = asyncio.Event(), asyncio.Event()
    counts = {"decode": 0, "result": 0}

    async def on_decode(_msg) -> None:
        counts["decode"] += 1
        if counts["decode"] == len(batch):
            queued.set()

    async def on_result(_msg) -> None:
        counts["result"] += 1
        if counts["result"] == len(batch):
            results.set()

    await nc.subscribe(subjects.work_decode(), cb=on_decode)
    await nc.subscribe(subjects.result("env0"), cb=on_result)
    a = TorchEngineActor("e0", cfg, nc, clock, Role.PREFILL)
    b = TorchEngineActor("e1", cfg, nc, clock, Role.DECODE)
    running = [asyncio.create_task(a.run())]
    await a.ready.wait()
    # warm-up turn through both engines, so that neither measurement pays first-call costs
    warm = _work("warm", batch[0][:16], 4)
    await js.publish(subjects.work_prefill(), encode(warm))
    # 1. prefill through the prefill engine
    started = time.perf_counter()
    for i, ids in enumerate(batch):
        await js.publish(subjects.work_prefill(), encode(_work(f"t{i}", ids, out_tokens)))
    counts["decode"] -= 1  # the warm-up item is not part of the measured batch
    await queued.wait()
    prefill_s = time.perf_counter() - started
    # 2. decode (with the KV hand-offs) through the decode engine
    running.append(asyncio.create_task(b.run()))
    await b.ready.wait()
    started = time.perf_counter()
    counts["result"] -= 1
    await results.wait()
    decode_wall_s = time.perf_counter() - started
    for actor in (a, b):
        actor.request_stop("bench over")
    await asyncio.gather(*running)
    events = await read_stream(js, streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)
    await close(nc)
    mine = [e for e in events if e.trajectory_id != "warm"]
    transfers = [e for e in mine if e.kind is EventKind.KV_TRANSFER_DONE]
    started_at = min(e.at_s for e in mine if e.kind is EventKind.DECODE_STARTED)
    done_at = max(e.at_s for e in mine if e.kind is EventKind.DECODE_DONE)
    return {
        "prefill_s": prefill_s,
        "decode_wall_s": decode_wall_s,
        "decode_window_s": done_at - started_at,
        "transfer_s": [e.duration_s for e in transfers],
        "transfer_bytes": [e.kv_bytes for e in transfers],
        "bytes_per_token": a.torch.kv_bytes_per_token,
    }


def _work(traj: str, ids: list[int], out_tokens: int) -> PrefillWork:
    return PrefillWork(
        work_id=f"{traj}/bench/t0/a0", trajectory_id=traj, turn=0, env_id="env0", task_family="calc", policy_version=0,
        context_tokens=0, new_tokens=len(ids), max_output_tokens=out_tokens, queued_at_s=0.0, token_ids=ids,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.bench_torch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--out-tokens", type=int, default=64)
    parser.add_argument("--decode-chunk", type=int, default=16, help="decode iterations per engine step")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model"
        model = ModelSection(hidden_size=args.hidden, intermediate_size=2 * args.hidden, layers=args.layers,
                             heads=args.heads, kv_heads=args.heads // 2)  # fmt: skip
        build_tiny(model, checkpoint)
        cfg = bench_config(checkpoint, args)
        lm, tok = load_model(checkpoint, args.threads), load_tokenizer(checkpoint)
        batch = prompts(args.seqs, args.prompt)
        plain_prefill_s(lm, batch[:2])  # warm-up
        plain_p = plain_prefill_s(lm, batch)
        plain_d = plain_decode_s(lm, batch, args.out_tokens, tok.pad_id)
        with torch.inference_mode():
            kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in lm(torch.tensor([batch[0]]), use_cache=True).past_key_values.layers]
        raw = statistics.median(raw_serialisation_s(kv) for _ in range(20))
        raw_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        with EmbeddedNats(Path(tmp) / "nats") as server:
            run = asyncio.run(engine_run(cfg, server.url, batch, args.out_tokens))
    n_prefill = args.seqs * args.prompt
    n_decode = args.seqs * (args.out_tokens - 1)  # the first token of each turn comes with prefill
    rows = [
        ("prefill tok/s", n_prefill / run["prefill_s"], n_prefill / plain_p, "engine actor vs plain forward per prompt"),
        ("decode tok/s (window)", n_decode / run["decode_window_s"], n_decode / plain_d, "first decode_started .. last decode_done"),
        ("decode tok/s (incl. hand-off)", n_decode / run["decode_wall_s"], n_decode / plain_d, "decode engine ready .. last result"),
    ]
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads; {args.seqs} seqs x {args.prompt} prompt "
          f"tokens, {args.out_tokens} output tokens; threads {args.threads}; device {next(lm.parameters()).device}")  # fmt: skip
    print(f"{'metric':32} {'engine':>12} {'plain':>12} {'overhead':>9}")
    for name, engine, plain, note in rows:
        print(f"{name:32} {engine:12.1f} {plain:12.1f} {100 * (plain / engine - 1):8.1f}%  ({note})")
    handoff = statistics.median(run["transfer_s"])
    per_seq_bytes = statistics.median(run["transfer_bytes"])
    print(f"{'KV hand-off per turn (median)':32} {handoff * 1e3:10.2f}ms {raw * 1e3:10.2f}ms {handoff / raw:8.2f}x  "
          f"({per_seq_bytes / 1e6:.2f} MB over NATS vs torch.save+load of {raw_bytes / 1e6:.2f} MB)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
