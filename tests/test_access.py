"""Access control on the launcher's embedded nats-server (ops/access.py): a real server with
one user per actor; clients without credentials, or with another role's, cannot send role
commands, publish policy versions or another engine's status, nor read trajectories."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import nats
import pytest
from nats.js.errors import APIError

from actors.base.connection import inbox_prefix
from bus_schemas import streams, subjects
from ops import access
from ops.natsserver import EmbeddedNats

pytestmark = pytest.mark.bus
ACTORS = [
    ("engine", "e0"),
    ("engine", "e1"),
    ("environment", "env0"),
    ("trainer", "trainer"),
    ("allocator", "allocator"),
    ("forecaster", "forecaster"),
]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A server that requires the run's credentials, and those credentials."""
    users = access.make_users(ACTORS)
    server = EmbeddedNats(tmp_path_factory.mktemp("secured"), authorization=access.authorization_block(users))
    server.start()
    yield server, users
    server.stop()


class Client:
    """A raw nats-py client that records the server's permission errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def connect(self, url: str, user: access.User | None = None, password: str | None = None) -> Client:
        async def on_error(err: Exception) -> None:
            self.errors.append(str(err))

        kwargs = {} if user is None else dict(user=user.name, password=password or user.password, inbox_prefix=inbox_prefix(user.name))
        self.nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, error_cb=on_error, **kwargs)
        return self

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]


async def client(server, users, name: str | None) -> Client:
    return await Client().connect(server.url, users[name] if name else None)


async def test_no_credentials_or_a_wrong_password_cannot_connect(secured):
    server, users = secured
    with pytest.raises(Exception, match="(?i)authorization"):
        await Client().connect(server.url)
    with pytest.raises(Exception, match="(?i)authorization"):
        await Client().connect(server.url, users["allocator"], password="guess")


async def received_until_marker(watcher: Client, subject: str, intruder: Client, legit: Client, publish) -> list[bytes]:
    """What `watcher` receives on `subject` from the intruder's attempt, up to a marker the
    legitimate role publishes after it (flushes order the two at the server)."""
    got: list[bytes] = []
    marker = asyncio.Event()

    async def on_msg(msg) -> None:
        got.append(msg.data)
        if msg.data == b"marker":
            marker.set()

    sub = await watcher.nc.subscribe(subject, cb=on_msg)
    await watcher.nc.flush()
    await publish(intruder, b"intrusion")
    await intruder.nc.flush()
    await publish(legit, b"marker")
    await legit.nc.flush()
    await asyncio.wait_for(marker.wait(), timeout=5)
    await sub.unsubscribe()
    return got


COMMANDS = [  # (subject, the one role that sends there, roles that must not)
    (subjects.ctl_engine("e1"), "allocator", ["engine-e0", "environment-env0", "trainer", "monitor"]),  # role commands
    (subjects.ctl_policy("e1"), "trainer", ["allocator", "engine-e0", "environment-env0"]),  # policy loads
]


@pytest.mark.parametrize("subject, sender, intruder_role", [(s, sender, i) for s, sender, intruders in COMMANDS for i in intruders])
async def test_only_one_role_sends_each_family_of_engine_commands(secured, subject: str, sender: str, intruder_role: str):
    server, users = secured
    watcher, intruder, legit = (
        await client(server, users, "launcher"),
        await client(server, users, intruder_role),
        await client(server, users, sender),
    )
    try:

        async def command(c: Client, data: bytes) -> None:
            await c.nc.publish(subject, data)

        got = await received_until_marker(watcher, subject, intruder, legit, command)
        assert got == [b"marker"]  # the intruder's command never reached the engine's subject
        assert intruder.violations() and not legit.violations()
    finally:
        for c in (watcher, intruder, legit):
            await c.nc.close()


async def test_only_the_trainer_publishes_policy_versions_and_an_engine_only_its_own_status(secured):
    server, users = secured
    watcher, engine, trainer, e1 = [await client(server, users, n) for n in ("launcher", "engine-e0", "trainer", "engine-e1")]
    try:

        async def policy(c: Client, data: bytes) -> None:
            await c.nc.publish(subjects.train_policy(), data)

        assert await received_until_marker(watcher, subjects.train_policy(), engine, trainer, policy) == [b"marker"]

        async def e1_status(c: Client, data: bytes) -> None:
            await c.nc.publish(subjects.status("engine", "e1"), data)

        assert await received_until_marker(watcher, subjects.status("engine", "e1"), engine, e1, e1_status) == [b"marker"]
        assert len(engine.violations()) == 2
    finally:
        for c in (watcher, engine, trainer, e1):
            await c.nc.close()


@pytest.mark.parametrize("reader", ["engine-e0", "allocator", "environment-env0", None])
async def test_other_roles_cannot_read_trajectories(secured, reader: str | None):
    server, users = secured
    launcher = await client(server, users, "launcher")
    js = launcher.nc.jetstream()
    await streams.ensure_streams(js)
    ack = await js.publish(subjects.train_finished(), b"a finished trajectory")
    try:
        if reader is None:
            with pytest.raises(Exception, match="(?i)authorization"):
                await Client().connect(server.url)
            return
        intruder = await client(server, users, reader)
        try:
            seen: list[bytes] = []

            async def on_msg(msg) -> None:
                seen.append(msg.data)

            for pattern in (subjects.train_finished(), "_INBOX.>", f"{inbox_prefix('trainer')}.>", ">"):
                await intruder.nc.subscribe(pattern, cb=on_msg)  # each refused by the server
            await intruder.nc.flush()
            await js.publish(subjects.train_finished(), b"another")
            await intruder.nc.flush()
            assert seen == [] and len(intruder.violations()) == 4
            ijs = intruder.nc.jetstream(timeout=1.0)
            with pytest.raises((APIError, TimeoutError, nats.errors.Error)):
                await ijs.get_msg(streams.TRAIN.name, ack.seq)
            with pytest.raises((APIError, TimeoutError, nats.errors.Error)):
                await ijs.pull_subscribe(subjects.train_finished(), durable="snoop", stream=streams.TRAIN.name)
        finally:
            await intruder.nc.close()
        trainer = await client(server, users, "trainer")  # the trainer, by contrast, reads them
        try:
            sub = await trainer.nc.jetstream().pull_subscribe(
                subjects.train_finished(), durable="trainer-finished", stream=streams.TRAIN.name
            )
            assert (await sub.fetch(1, timeout=5))[0].data == b"a finished trajectory"
        finally:
            await trainer.nc.close()
    finally:
        await js.purge_stream(streams.TRAIN.name)
        for info in await js.consumers_info(streams.TRAIN.name):
            await js.delete_consumer(streams.TRAIN.name, info.name)
        await launcher.nc.close()


async def test_the_monitor_reads_but_cannot_write(secured):
    server, users = secured
    launcher, monitor = await client(server, users, "launcher"), await client(server, users, "monitor")
    try:
        js = launcher.nc.jetstream()
        await streams.ensure_streams(js)
        before = (await js.stream_info(streams.LIFECYCLE.name)).state.messages  # the module's server: other tests publish too
        ack = await js.publish(subjects.lifecycle("started"), b"event")
        assert (await monitor.nc.jetstream().get_msg(streams.LIFECYCLE.name, ack.seq)).data == b"event"
        with pytest.raises((APIError, TimeoutError, nats.errors.Error)):
            await monitor.nc.jetstream(timeout=1.0).publish(subjects.lifecycle("started"), b"forged")
        with pytest.raises((APIError, TimeoutError, nats.errors.Error)):
            await monitor.nc.jetstream(timeout=1.0).purge_stream(streams.LIFECYCLE.name)
        assert (await js.stream_info(streams.LIFECYCLE.name)).state.messages == before + 1  # the forgery did not land
    finally:
        await launcher.nc.close()
        await monitor.nc.close()


def test_credentials_are_written_for_the_owner_only(tmp_path: Path):
    users = access.make_users(ACTORS)
    access.write_credentials(tmp_path / "credentials", users)
    files = sorted((tmp_path / "credentials").iterdir())
    assert [f.stem for f in files] == sorted(users)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE((tmp_path / "credentials").stat().st_mode) == 0o700
    assert len({u.password for u in users.values()}) == len(users)  # one secret per user
