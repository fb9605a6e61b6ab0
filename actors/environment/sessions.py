"""Agent sessions driven from outside (the OpenAI-compatible gateway, `ops/gateway.py`): each
trajectory the trainer assigns becomes a session that an outside agent harness claims and
drives one chat request per turn.

    trainer assigns t ─▶ GatewaySession.reset(task) ── offered on the SessionBoard
    harness:  claim ────────────────────────────────────▶ the session's task
              chat(messages) ─▶ submit() ─▶ reset/step returns the new messages ─▶ a turn
              ◀── reply (text, token ids, logprobs) ◀── step(model output)
              end(reward) ───▶ step returns done with the reward

A session is an environment (`interface.Environment`), so the environment actor keeps the
token ids, logprobs and masks, emits the lifecycle events and hands the finished trajectory
to the trainer, as for any other. Each chat request carries the whole conversation (the
OpenAI API is stateless); the session checks that it continues the one it holds (earlier
messages unchanged, the model's replies as they were given) and passes on only the new
messages.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from actors.environment.interface import ModelOutput, StepResult, Task


class SessionError(ValueError):
    """A request the session cannot take; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Turn:
    messages: list[dict]  # the new messages (the first turn: all of them)
    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class End:
    reward: float


class SessionBoard:
    """The sessions of one gateway: offered until a harness claims one, then found by trajectory id."""

    def __init__(self) -> None:
        self.sessions: dict[str, GatewaySession] = {}
        self._offered: collections.deque[str] = collections.deque()
        self._changed = asyncio.Condition()

    async def offer(self, session: GatewaySession) -> None:
        self.sessions[session.trajectory_id] = session
        self._offered.append(session.trajectory_id)
        async with self._changed:
            self._changed.notify_all()

    def remove(self, session: GatewaySession) -> None:
        self.sessions.pop(session.trajectory_id, None)
        if session.trajectory_id in self._offered:
            self._offered.remove(session.trajectory_id)

    async def claim(self, wait_s: float) -> GatewaySession | None:
        """The oldest session no harness has claimed, waiting up to `wait_s` for one (None: none came)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: bool(self._offered)), wait_s)
            except TimeoutError:
                return None
            return self.sessions[self._offered.popleft()]

    def get(self, trajectory_id: str) -> GatewaySession:
        session = self.sessions.get(trajectory_id)
        if session is None:
            raise SessionError(404, f"no open session {trajectory_id!r} (claim one with GET /v1/prorsa/sessions/next)")
        return session


class GatewaySession:
    """One trajectory, driven by an outside harness through the gateway."""

    def __init__(self, board: SessionBoard, max_output_tokens: int) -> None:
        self.board = board
        self.cap = max_output_tokens  # environments.max_output_tokens: no request asks more per turn
        self.trajectory_id = ""
        self.task: Task | None = None
        self.conversation: list[dict] = []  # every message so far, the model's replies included
        self.max_output_tokens = max_output_tokens  # the current turn's (interface.Environment)
        self._inbox: asyncio.Queue[Turn | End] = asyncio.Queue()
        self._reply: asyncio.Future[ModelOutput] | None = None

    # --- the environment interface (the environment actor calls these) -------------------------
    async def reset(self, task: Task) -> list[dict]:
        self.task = task
        self.trajectory_id = task.trajectory_id
        await self.board.offer(self)
        first = await self._inbox.get()
        if isinstance(first, End):
            raise RuntimeError("the harness ended the session before its first request")
        return self._take(first)

    async def step(self, output: ModelOutput) -> StepResult:
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(output)
        self.conversation.append({"role": "assistant", "content": output.text})
        nxt = await self._inbox.get()
        if isinstance(nxt, End):
            return StepResult(reward=nxt.reward, done=True)
        return StepResult(observation=self._take(nxt))

    async def close(self) -> None:
        self.board.remove(self)
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(SessionError(409, f"session {self.trajectory_id} ended before the model replied"))

    def _take(self, turn: Turn) -> list[dict]:
        self.conversation += turn.messages
        self.max_output_tokens = min(turn.max_tokens or self.cap, self.cap)
        return turn.messages

    # --- the harness's side (the gateway's HTTP handlers call these) ---------------------------
    def submit(self, messages: list[dict], max_tokens: int | None) -> asyncio.Future[ModelOutput]:
        """A chat request: its new messages go to the next turn; the future is the model's reply."""
        if self._reply is not None and not self._reply.done():
            raise SessionError(409, f"session {self.trajectory_id} has a request in flight")
        known = len(self.conversation)
        if [_plain(m) for m in messages[:known]] != [_plain(m) for m in self.conversation]:
            raise SessionError(400, f"the messages do not continue session {self.trajectory_id}: its first {known} must be unchanged")
        new = messages[known:]
        if not new:
            raise SessionError(400, "the request adds no message to the conversation")
        if any(m.get("role") == "assistant" for m in new):
            raise SessionError(400, "only the model writes the assistant's messages in a session")
        self._reply = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(Turn(new, max_tokens))
        return self._reply

    def end(self, reward: float) -> None:
        if self._reply is not None and not self._reply.done():
            raise SessionError(409, f"session {self.trajectory_id} has a request in flight: end it after the reply")
        self._inbox.put_nowait(End(reward))


def _plain(message: dict) -> tuple[str, str]:
    return str(message.get("role")), str(message.get("content") or "")
