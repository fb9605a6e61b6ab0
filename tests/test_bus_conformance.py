"""The same bus checks against a real nats-server and the in-process bus used for simulation,
so the simulated bus keeps NATS's semantics."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyWrongLastSequenceError

from actors.base.connection import close, connect
from actors.base.inproc import InProcServer
from actors.base.virtual import SimulationDeadlock, VirtualTimeLoop
from bus_schemas import streams, subjects
from tests.conftest import clean_bus

pytestmark = pytest.mark.bus


@pytest.fixture(params=["nats", "inproc"])
async def client(request):
    if request.param == "nats":
        nc = await connect(request.getfixturevalue("nats_server").url, "conformance", logging.getLogger("test"))
    else:
        nc = InProcServer().connect("conformance")
    await clean_bus(nc)
    yield nc
    await close(nc)


async def test_subscribers_see_messages_in_publish_order(client):
    got, done = [], asyncio.Event()

    async def on_msg(msg):
        got.append(msg.data)
        if len(got) == 50:
            done.set()

    await client.subscribe("prorsa.test.order", cb=on_msg)
    await client.flush()
    for i in range(50):
        await client.publish("prorsa.test.order", str(i).encode())
    await asyncio.wait_for(done.wait(), timeout=5)
    assert got == [str(i).encode() for i in range(50)]


async def test_wildcard_subscription(client):
    got, done = [], asyncio.Event()

    async def on_msg(msg):
        got.append(msg.subject)
        done.set()

    await client.subscribe(subjects.status_of_kind("engine"), cb=on_msg)
    await client.flush()
    await client.publish(subjects.status("trainer", "t"), b"x")  # not matched
    await client.publish(subjects.status("engine", "e3"), b"x")
    await asyncio.wait_for(done.wait(), timeout=5)
    assert got == ["prorsa.status.engine.e3"]


async def test_request_reply_timeout_and_no_responders(client):
    async def echo(msg):
        await msg.respond(b"re:" + msg.data)

    await client.subscribe("prorsa.test.echo", cb=echo)
    await client.flush()
    assert (await client.request("prorsa.test.echo", b"hi", timeout=2)).data == b"re:hi"
    with pytest.raises(NoRespondersError):
        await client.request("prorsa.test.nobody", b"hi", timeout=1)

    async def silent(msg):
        pass

    await client.subscribe("prorsa.test.silent", cb=silent)
    await client.flush()
    with pytest.raises(NatsTimeoutError):
        await client.request("prorsa.test.silent", b"hi", timeout=0.2)


async def test_a_wildcard_subscriber_sees_request_replies(client):
    """A reply goes to the requester's inbox like any message: a subscription matching
    `_INBOX.>` sees it too (the in-process bus matches inboxes against fewer patterns)."""
    seen, done = [], asyncio.Event()

    async def echo(msg):
        await msg.respond(b"re:" + msg.data)

    async def watch(msg):
        seen.append((msg.subject.split(".", 1)[0], msg.data))
        if len(seen) == 2:
            done.set()

    await client.subscribe("prorsa.test.echo", cb=echo)
    await client.subscribe("_INBOX.>", cb=watch)
    await client.subscribe("prorsa.>", cb=watch)  # a wildcard no inbox matches
    await client.flush()
    assert (await client.request("prorsa.test.echo", b"hi", timeout=2)).data == b"re:hi"
    await asyncio.wait_for(done.wait(), timeout=5)
    assert sorted(seen) == [("_INBOX", b"re:hi"), ("prorsa", b"hi")]


def test_inproc_replies_leave_no_subject_state_behind():
    """Every request has an inbox of its own: the in-process bus keeps no route or stream
    lookup for it once it is answered (a simulation makes millions)."""

    async def main() -> None:
        server = InProcServer()
        nc = server.connect("c")
        await nc.jetstream().add_stream(name="S", subjects=["prorsa.test.>"])

        async def echo(msg):
            await msg.respond(msg.data)

        await nc.subscribe("prorsa.test.echo", cb=echo)
        for i in range(20):
            assert (await nc.request("prorsa.test.echo", str(i).encode(), timeout=1)).data == str(i).encode()
        assert not [s for s in [*server._stream_of, *server._routes] if s.startswith("_INBOX")]

    asyncio.run(main())


async def test_work_queue_gives_each_item_to_one_puller_and_redelivers_unacked(client):
    js = client.jetstream()
    for i in range(4):
        await js.publish(subjects.work_prefill(), str(i).encode())
    # ack_wait: long enough that `first` is not redelivered while the three fetches run on a
    # loaded machine, short enough to wait for
    a = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=2.0)
    b = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=2.0)
    first = (await a.fetch(1, timeout=2))[0]
    second = (await b.fetch(1, timeout=2))[0]
    assert first.data != second.data  # one consumer, two pullers: never the same item
    for msg in (second, *[(await a.fetch(1, timeout=2))[0] for _ in range(2)]):
        await msg.ack()
    again = (await b.fetch(1, timeout=10))[0]  # `first` was never acked: back after ack_wait
    assert again.data == first.data and again.metadata.num_delivered == 2
    await again.ack()
    with pytest.raises(NatsTimeoutError):
        await a.fetch(1, timeout=0.3)
    assert (await js.stream_info(streams.WORK_PREFILL.name)).state.messages == 0


async def test_the_pull_waiting_longest_is_served_first(client):
    js = client.jetstream()
    a = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=5)
    b = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=5)

    async def waiting(n: int) -> None:
        while (await a.consumer_info()).num_waiting < n:
            await asyncio.sleep(0.01)  # barrier-ok: polls the consumer's open pull requests

    older = asyncio.create_task(a.fetch(1, timeout=10))
    await asyncio.wait_for(waiting(1), timeout=5)
    await js.publish(subjects.work_prefill(), b"one")
    with pytest.raises(NatsTimeoutError):
        await b.fetch(1, timeout=1)  # opened after the message came: it does not overtake the older pull
    assert [m.data for m in await older] == [b"one"]


async def test_nak_redelivers_and_term_removes(client):
    js = client.jetstream()
    await js.publish(subjects.work_decode(), b"x")
    sub = await streams.pull_subscription(js, streams.decode_consumer(), ack_wait_s=30)
    msg = (await sub.fetch(1, timeout=2))[0]
    await msg.nak()
    again = (await sub.fetch(1, timeout=2))[0]
    assert again.data == b"x" and again.metadata.num_delivered == 2
    await again.term()
    with pytest.raises(NatsTimeoutError):
        await sub.fetch(1, timeout=0.3)
    assert (await js.stream_info(streams.WORK_DECODE.name)).state.messages == 0


async def test_in_progress_holds_off_redelivery(client):
    js = client.jetstream()
    await js.publish(subjects.train_tasks(), b"long job")
    sub = await streams.pull_subscription(js, streams.tasks_consumer(), ack_wait_s=2.0)
    msg = (await sub.fetch(1, timeout=2))[0]
    for _ in range(5):  # 2.5 s in all, past ack_wait, but kept alive (each beat well inside it, on a loaded machine too)
        await asyncio.sleep(0.5)  # barrier-ok: the behaviour under test is a passage of time
        await msg.in_progress()
        await client.flush()
    with pytest.raises(NatsTimeoutError):
        await sub.fetch(1, timeout=0.2)
    await msg.ack()


async def test_msg_id_deduplicates(client):
    js = client.jetstream()
    one = await js.publish(subjects.train_finished(), b"a", headers={"Nats-Msg-Id": "t1"})
    two = await js.publish(subjects.train_finished(), b"a", headers={"Nats-Msg-Id": "t1"})
    assert not one.duplicate and two.duplicate and one.seq == two.seq


async def test_key_value_create_is_exclusive(client):
    js = client.jetstream()
    kv = await js.create_key_value(bucket="prorsa_test", history=1)
    await kv.create("k", b"1")
    with pytest.raises(KeyWrongLastSequenceError):
        await kv.create("k", b"2")
    assert (await kv.get("k")).value == b"1"


def test_virtual_time_jumps_to_the_next_timer():
    loop = VirtualTimeLoop()

    async def scenario():
        server = InProcServer()
        nc = server.connect("v")
        js = nc.jetstream()
        await streams.ensure_streams(js)
        await js.publish(subjects.work_prefill(), b"w")
        sub = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=600)
        (await sub.fetch(1, timeout=1))  # never acked
        started = loop.time()
        again = (await sub.fetch(1, timeout=3600))[0]  # redelivered after 10 virtual minutes
        return loop.time() - started, again.metadata.num_delivered

    wall = time.monotonic()
    try:
        waited_s, deliveries = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert waited_s == pytest.approx(600) and deliveries == 2
    assert time.monotonic() - wall < 5


def test_a_simulation_that_can_never_progress_says_so():
    loop = VirtualTimeLoop()
    try:
        with pytest.raises(SimulationDeadlock):
            loop.run_until_complete(asyncio.Event().wait())
    finally:
        loop.close()
