"""The gateway's HTTP surface and its sessions without engines: the environment actor's side
(reset, step) is played by the test, the harness's side over HTTP (ASGI, in process)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from actors.environment.interface import ModelOutput, StepResult, Task
from actors.environment.sessions import GatewaySession, SessionBoard
from ops.gateway import make_app

TASK = Task("s0-k0", "agent", 0, 7, 1, 0, "s0-k0-g1")


async def harness(board: SessionBoard):
    app = make_app(board, "tiny", claim_wait_s=0.2, reply_timeout_s=5.0)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/v1")


def test_a_session_runs_turn_by_turn_and_ends_with_the_harness_reward():
    async def go():
        board = SessionBoard()
        http = await harness(board)
        assert (await http.get("/prorsa/sessions/next")).status_code == 404  # nothing assigned yet
        session = GatewaySession(board, max_output_tokens=16)
        first_turn = asyncio.create_task(session.reset(TASK))  # the environment actor, on assignment
        claimed = (await http.get("/prorsa/sessions/next")).json()
        assert claimed == {"trajectory_id": "s0-k0-g1", "task_id": "s0-k0", "family": "agent", "seed": 7, "sample_index": 1, "step": 0}
        user = [{"role": "user", "content": "hi"}]
        request = asyncio.create_task(
            http.post("/chat/completions", json={"messages": user, "user": "s0-k0-g1", "max_tokens": 4, "logprobs": True})
        )
        assert await first_turn == user and session.max_output_tokens == 4
        second_turn = asyncio.create_task(session.step(ModelOutput("abcd", [97, 98, 99, 100], 0, [-0.5, -1.0, -1.5, -2.0])))
        done = (await request).json()
        assert done["choices"][0]["message"] == {"role": "assistant", "content": "abcd"}
        assert done["choices"][0]["finish_reason"] == "length"  # 4 tokens of a 4-token cap
        assert [c["logprob"] for c in done["choices"][0]["logprobs"]["content"]] == [-0.5, -1.0, -1.5, -2.0]
        assert done["prorsa"] == {"trajectory_id": "s0-k0-g1", "turn": 0, "token_ids": [97, 98, 99, 100]}

        tool = [*user, {"role": "assistant", "content": "abcd"}, {"role": "tool", "content": "42"}]
        streamed = asyncio.create_task(
            http.post("/chat/completions", json={"messages": tool, "stream": True}, headers={"X-Prorsa-Trajectory": "s0-k0-g1"})
        )
        assert await second_turn == StepResult(observation=[{"role": "tool", "content": "42"}])
        assert session.max_output_tokens == 16  # no max_tokens: the cap
        ending = asyncio.create_task(session.step(ModelOutput("ok", [111, 107], 1, [-0.1, -0.2])))
        events = [line.removeprefix("data: ") for line in (await streamed).text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "ok"} and chunks[0]["prorsa"]["token_ids"] == [111, 107]
        assert chunks[1]["choices"][0]["finish_reason"] == "stop"
        assert (await http.post("/prorsa/sessions/s0-k0-g1/end", json={"reward": 0.75})).status_code == 200
        assert await ending == StepResult(reward=0.75, done=True)
        await session.close()
        assert (await http.post("/chat/completions", json={"messages": tool, "user": "s0-k0-g1"})).status_code == 404

    asyncio.run(go())


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "name the session"),
        ({"messages": [{"role": "user", "content": "x"}], "user": "nobody"}, 404, "no open session 'nobody'"),
        ({"messages": "x", "user": "s0-k0-g1"}, 400, "messages must be a list"),
        ({"messages": [{"role": "user", "content": "x"}], "user": "s0-k0-g1", "max_tokens": 0}, 400, "max_tokens must be a positive"),
        ({"messages": [], "user": "s0-k0-g1"}, 400, "adds no message"),
        ({"messages": [{"role": "assistant", "content": "x"}], "user": "s0-k0-g1"}, 400, "only the model writes"),
    ],
)
def test_a_request_the_session_cannot_take_gets_an_openai_style_error_and_changes_nothing(body, status, message):
    async def go():
        board = SessionBoard()
        http = await harness(board)
        session = GatewaySession(board, max_output_tokens=16)
        first_turn = asyncio.create_task(session.reset(TASK))
        await http.get("/prorsa/sessions/next")
        r = await http.post("/chat/completions", json=body)
        assert r.status_code == status and message in r.json()["error"]["message"]
        assert session.conversation == [] and not first_turn.done()
        bad_end = await http.post("/prorsa/sessions/s0-k0-g1/end", json={"reward": "high"})
        assert bad_end.status_code == 400 and "reward must be a number" in bad_end.json()["error"]["message"]
        first_turn.cancel()

    asyncio.run(go())


def test_a_session_ended_before_its_model_replied_fails_the_waiting_request():
    async def go():
        board = SessionBoard()
        http = await harness(board)
        session = GatewaySession(board, max_output_tokens=16)
        first_turn = asyncio.create_task(session.reset(TASK))
        request = asyncio.create_task(
            http.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "user": "s0-k0-g1"})
        )
        await first_turn
        await session.close()  # the trajectory ended (an engine fault, the run stopping)
        r = await request
        assert r.status_code == 409 and "ended before the model replied" in r.json()["error"]["message"]

    asyncio.run(go())
