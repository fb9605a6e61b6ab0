"""The OpenAI-compatible gateway: an outside agent harness drives the run's trajectories over
HTTP, one chat request per turn, on the run's own engines.

    python -m ops.gateway --config CONFIG.toml --id env0 [--nats-url URL]   # one gateway
    [gateway] enabled = true                      # ops.launch runs every environment as one

    GET  /v1/models                               the run's model
    GET  /v1/prorsa/sessions/next?wait_s=S        claim a session: its trajectory and task
    POST /v1/chat/completions                     a turn (`user` or X-Prorsa-Trajectory: the session)
    POST /v1/prorsa/sessions/{trajectory_id}/end  {"reward": R}: the trajectory is finished

The gateway is an environment actor (`actors/environment/real.py`) whose environment class
is a `sessions.GatewaySession`, with a FastAPI app served by uvicorn in the same event loop.
The engines, the trainer, the lifecycle events and the finished trajectories are those of
any run. docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from actors.base import actor_main
from actors.environment.interface import ModelOutput
from actors.environment.real import RealEnvironmentActor
from actors.environment.sessions import GatewaySession, SessionBoard, SessionError

TRAJECTORY_HEADER = "X-Prorsa-Trajectory"


def gateway_port(config, env_id: str) -> int:
    """The i-th environment's port (`env<i>`): gateway.port + i (0: any free port)."""
    return config.gateway.port + int(env_id.removeprefix("env") or 0) if config.gateway.port else 0


def make_app(board: SessionBoard, model_name: str, claim_wait_s: float, reply_timeout_s: float) -> FastAPI:
    app = FastAPI(title="Prorsa gateway")

    @app.exception_handler(SessionError)
    async def session_error(_: Request, e: SessionError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=e.status)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "prorsa"}]}

    @app.get("/v1/prorsa/sessions/next")
    async def next_session(wait_s: float = claim_wait_s) -> JSONResponse:
        session = await board.claim(min(wait_s, claim_wait_s))
        if session is None:
            return JSONResponse({"error": {"message": "no session to claim yet", "type": "not_found"}}, status_code=404)
        task = session.task
        return JSONResponse(
            {
                "trajectory_id": session.trajectory_id,
                "task_id": task.task_id,
                "family": task.family,
                "seed": task.seed,
                "sample_index": task.sample_index,
                "step": task.step,
            }
        )

    @app.post("/v1/prorsa/sessions/{trajectory_id}/end")
    async def end_session(trajectory_id: str, request: Request) -> dict:
        body = await _json(request)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise SessionError(400, f"reward must be a number, not {reward!r}")
        board.get(trajectory_id).end(float(reward))
        return {"trajectory_id": trajectory_id, "ended": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request, x_prorsa_trajectory: str | None = Header(default=None)) -> Any:
        body = await _json(request)
        trajectory_id = x_prorsa_trajectory or body.get("user")
        if not trajectory_id:
            raise SessionError(400, f"name the session: the `user` field or the {TRAJECTORY_HEADER} header (GET /v1/prorsa/sessions/next)")
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise SessionError(400, "messages must be a list of {role, content} objects with text content")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise SessionError(400, f"max_tokens must be a positive integer, not {max_tokens!r}")
        reply = board.get(trajectory_id).submit(messages, max_tokens)
        try:
            output = await asyncio.wait_for(reply, reply_timeout_s)
        except TimeoutError:
            raise SessionError(504, f"the model did not reply within {reply_timeout_s:g} s") from None
        completion = _completion(output, model_name, trajectory_id, max_tokens, bool(body.get("logprobs")))
        if body.get("stream"):
            return StreamingResponse(_chunks(completion), media_type="text/event-stream")
        return completion

    return app


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise SessionError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise SessionError(400, "the body must be a JSON object")
    return body


def _completion(output: ModelOutput, model_name: str, trajectory_id: str, max_tokens: int | None, logprobs: bool) -> dict:
    finish = "length" if max_tokens is not None and len(output.token_ids) >= max_tokens else "stop"
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": output.text}, "finish_reason": finish}
    if logprobs:  # per token: the engines' log-probabilities; the token's text is its id (the ids are exact)
        choice["logprobs"] = {
            "content": [
                {"token": str(i), "logprob": lp, "bytes": None, "top_logprobs": []}
                for i, lp in zip(output.token_ids, output.logprobs, strict=True)
            ]
        }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": {"prompt_tokens": 0, "completion_tokens": len(output.token_ids), "total_tokens": len(output.token_ids)},
        # the exact ids the engines generated (text does not round-trip through every tokenizer)
        "prorsa": {"trajectory_id": trajectory_id, "turn": output.turn, "token_ids": output.token_ids},
    }


async def _chunks(completion: dict):
    """The reply as server-sent events: the engines return a turn whole, so one content chunk."""
    base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = completion["choices"][0]
    first = {"index": 0, "delta": {"role": "assistant", "content": choice["message"]["content"]}, "finish_reason": None}
    if "logprobs" in choice:
        first["logprobs"] = choice["logprobs"]
    last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    for chunk in ({**base, "choices": [first], "prorsa": completion["prorsa"]}, {**base, "choices": [last], "usage": completion["usage"]}):
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


class HttpServer:
    """A uvicorn server in the running event loop (the caller owns the signals): `start`
    returns once it listens, with its port (port 0: any free one); `stop` waits it out."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.server.install_signal_handlers = lambda: None
        self._serving: asyncio.Task | None = None

    async def start(self) -> int:
        self._serving = asyncio.create_task(self.server.serve(), name="gateway-http")
        while not self.server.started and not self._serving.done():  # uvicorn sets a flag, no event
            await asyncio.sleep(0.01)
        if self._serving.done():
            self._serving.result()  # the server could not start (port taken): the error says why
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._serving is not None:
            await self._serving


class GatewayActor(RealEnvironmentActor):
    """An environment actor whose trajectories are sessions an outside harness drives over HTTP."""

    def __init__(self, actor_id, config, nc, clock, tokenizer=None) -> None:
        super().__init__(actor_id, config, nc, clock, tokenizer)
        self.board = SessionBoard()
        self.port = gateway_port(config, actor_id)
        self._timeout_s = config.gateway.session_idle_wall_s  # reset and step wait on the harness
        self._http: HttpServer | None = None

    def _class_of(self, family: str) -> type:
        return GatewaySession  # every family: the harness decides what a trajectory does

    def _build(self, cls: type) -> GatewaySession:
        return GatewaySession(self.board, self.config.environments.max_output_tokens)

    async def setup(self) -> None:
        await super().setup()
        gc = self.config.gateway
        model_name = gc.model_name or self.config.run.name
        self._http = HttpServer(make_app(self.board, model_name, gc.claim_wait_wall_s, gc.reply_timeout_wall_s), gc.host, self.port)
        self.port = await self._http.start()
        self.log.info("gateway on http://%s:%d/v1 (model %s)", gc.host, self.port, model_name)

    async def teardown(self) -> None:
        if self._http is not None:
            await self._http.stop()
        await super().teardown()


def _build(args, config, nc, clock) -> GatewayActor:
    return GatewayActor(args.id, config, nc, clock)


if __name__ == "__main__":
    sys.exit(actor_main("environment", _build))
