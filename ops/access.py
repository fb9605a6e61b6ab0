"""Who may do what on a run's embedded nats-server: one user per actor, permissions per role.

The launcher makes a random password per user for each run, writes each user's credentials
to DIR/credentials/<user>.json (mode 0600) and gives every actor its own in its environment
(PRORSA_NATS_USER / PRORSA_NATS_PASSWORD, read by `actors.base.connection.connect`). A client
without credentials, or with a wrong password, is refused at connect; one with a role's
credentials may publish and subscribe only where its role needs:

| role | publishes (beyond its own status, report and lifecycle events) | subscribes / reads |
| --- | --- | --- |
| engine `<id>` | work (prefill, decode), results, KV requests, weight requests | its own control and KV subjects, the prefill and decode queues |
| environment | prefill work, finished trajectories | engine heartbeats, dead letters, the task queue, its own results |
| trainer | task assignments, policy versions, step reports, policy loads to engines (`prorsa.ctl.policy.<id>`), update requests to an external trainer | heartbeats, finished trajectories, weight and model requests |
| updater (an external trainer) | nothing | the trainer's update requests (`prorsa.train.update`) |
| allocator | role commands to engines (`prorsa.ctl.engine.<id>`), its decisions (`prorsa.allocation`) | heartbeats, forecasts |
| forecaster | forecasts | the lifecycle log |
| monitor | nothing | everything (read-only) |
| launcher | everything (it creates the streams, moves dead letters, exports the log) | everything |

Replies: every user gets its own inbox prefix (`_INBOX_<user>`), so nobody reads another's
replies (JetStream delivers pulled messages to the puller's inbox); answering a request
(`allow_responses`) needs no publish permission. Policy loads and role commands travel on
subjects of their own, so the trainer cannot send a role command nor the allocator a policy
load; an engine refuses (and counts) a command that arrives on the other family's subject.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from actors.base.connection import inbox_prefix
from bus_schemas import streams, subjects
from bus_schemas.run import RUN_BUCKET

MONITOR, LAUNCHER = "monitor", "launcher"


@dataclass(frozen=True, slots=True)
class User:
    name: str  # e.g. "engine-e0", "monitor"
    password: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.name)

    def server_entry(self) -> dict:
        return {
            "user": self.name,
            "password": self.password,
            "permissions": {
                "publish": {"allow": list(self.publish)},
                "subscribe": {"allow": list(self.subscribe)},
                "allow_responses": True,
            },
        }


def user_name(kind: str, actor_id: str) -> str:
    return kind if kind == actor_id else f"{kind}-{actor_id}"


def _consume(stream: streams.StreamDef) -> list[str]:
    """Publish rights to create, look up and pull a consumer of `stream`, and ack its messages."""
    s = stream.name
    return [
        f"$JS.API.CONSUMER.CREATE.{s}",
        f"$JS.API.CONSUMER.CREATE.{s}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.>",
        f"$JS.API.CONSUMER.INFO.{s}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{s}.>",
        f"$JS.ACK.{s}.>",
    ]


def _common(kind: str, actor_id: str) -> tuple[list[str], list[str]]:
    """What every actor does: its heartbeats, report and lifecycle events; bringing the streams
    to their definition (ensure_streams); the run's origin; its own inbox."""
    publish = [
        subjects.status(kind, actor_id),
        subjects.report(actor_id),
        subjects.lifecycle_all(),
        "$JS.API.INFO",
        "$JS.API.STREAM.INFO.*",
        "$JS.API.STREAM.CREATE.*",
        "$JS.API.STREAM.UPDATE.*",
        f"$JS.API.DIRECT.GET.KV_{RUN_BUCKET}.>",
        f"$JS.API.STREAM.MSG.GET.KV_{RUN_BUCKET}",
        f"$KV.{RUN_BUCKET}.>",
    ]
    subscribe = [f"{inbox_prefix(user_name(kind, actor_id))}.>", subjects.status_all()]
    return publish, subscribe


def role_permissions(kind: str, actor_id: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) allow-lists of one actor."""
    publish, subscribe = _common(kind, actor_id)
    work = [subjects.work_prefill(), subjects.work_prefill() + ".*", subjects.work_decode(), subjects.work_decode() + ".*"]
    match kind:
        case "engine":
            publish += work + [
                subjects.result_all(),
                "prorsa.kv.>",
                subjects.kv_store_put(),
                subjects.train_model(),
                subjects.train_weights(),
            ]
            publish += _consume(streams.WORK_PREFILL) + _consume(streams.WORK_DECODE)
            publish.append(f"$JS.API.STREAM.MSG.GET.{streams.LIFECYCLE.name}")  # the latest policy version at a restart
            subscribe += [
                subjects.ctl_engine(actor_id),
                subjects.ctl_policy(actor_id),
                subjects.kv(actor_id),
                f"prorsa.kv.*.{actor_id}",
                subjects.kv_store_put(),
            ]
        case "environment":
            publish += [subjects.work_prefill(), subjects.work_prefill() + ".*", subjects.train_finished()]
            publish += _consume(streams.TASKS) + _consume(streams.RESULTS)
            subscribe += [subjects.dead_letter_all()]
        case "trainer":
            publish += [
                subjects.train_tasks(),
                subjects.train_policy(),
                subjects.train_step(),
                "prorsa.ctl.policy.*",
                subjects.train_update(),
            ]
            publish += _consume(streams.TRAIN)
            subscribe += [subjects.train_model(), subjects.train_weights()]
        case "updater":  # an external trainer: answers the trainer's update requests
            subscribe += [subjects.train_update()]
        case "allocator":
            publish += ["prorsa.ctl.engine.*", subjects.allocation()]
            subscribe += [subjects.forecast()]
        case "forecaster":
            publish += [subjects.forecast()] + _consume(streams.LIFECYCLE)
        case _:
            raise ValueError(f"no permissions defined for actor kind {kind!r}")
    return publish, subscribe


def monitor_permissions() -> tuple[list[str], list[str]]:
    """Read-only: look at streams and consumers, read messages, watch every subject."""
    publish = [
        "$JS.API.INFO",
        "$JS.API.STREAM.INFO.*",
        "$JS.API.STREAM.NAMES",
        "$JS.API.STREAM.LIST",
        "$JS.API.STREAM.MSG.GET.*",
        "$JS.API.DIRECT.GET.>",
        "$JS.API.CONSUMER.CREATE.>",
        "$JS.API.CONSUMER.INFO.>",
        "$JS.API.CONSUMER.MSG.NEXT.>",
        "$JS.API.CONSUMER.DELETE.>",
        "$JS.API.CONSUMER.LIST.*",
        "$JS.API.CONSUMER.NAMES.*",
        "$JS.FC.>",
    ]
    return publish, [">"]


def make_users(actors: list[tuple[str, str]]) -> dict[str, User]:
    """A user with a fresh random password for every (kind, actor id), the monitor and the launcher."""
    users = {}
    for kind, actor_id in actors:
        publish, subscribe = role_permissions(kind, actor_id)
        name = user_name(kind, actor_id)
        users[name] = User(name, secrets.token_urlsafe(24), tuple(publish), tuple(subscribe))
    users[MONITOR] = User(MONITOR, secrets.token_urlsafe(24), *map(tuple, monitor_permissions()))
    users[LAUNCHER] = User(LAUNCHER, secrets.token_urlsafe(24), (">",), (">",))
    return users


def authorization_block(users: dict[str, User]) -> str:
    """The nats-server config's `authorization` block (its config format reads JSON)."""
    return "authorization: " + json.dumps({"users": [u.server_entry() for u in users.values()]}, indent=1) + "\n"


def write_credentials(folder: Path, users: dict[str, User]) -> None:
    """DIR/credentials/<user>.json, mode 0600 (created so, never readable by others)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for user in users.values():
        path = folder / f"{user.name}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"user": user.name, "password": user.password}, f)
        os.chmod(path, 0o600)


def actor_env(user: User) -> dict[str, str]:
    """The environment that gives an actor process its credentials."""
    return {"PRORSA_NATS_USER": user.name, "PRORSA_NATS_PASSWORD": user.password}
