"""The chaos soak: seeded server faults in a row, mid-run, on a local 3-server JetStream cluster.

    python -m runners.chaos_soak --out DIR [--seed 0] [--runs 5] [--faults-per-run 4] [--steps 40] [--time-scale 20] [--tls]

Each run is `runners.cluster_check`'s run (its config template with `[bus] replicas = 3`, its
two launchers: engines on server n1, control + environments on n0) with `--faults-per-run`
faults instead of its one kill. The run's RNG (`--seed`, run index) picks each fault's kind,
its server and its moment. The first fault comes 0-2 s after the first finished trajectory,
each next one 1-4 s after the cluster has healed from the last, and only while the run's
trajectories still flow (fewer finished than expected, the control launcher running):

* `kill`: `kill -9` of a random server, a pause of 1-4 s, its restart (same port, same
  store), returned once it knows a metadata leader;
* `freeze`: SIGSTOP for 10-12 s of a server that leads some Raft group (the logs say which),
  then SIGCONT. JetStream's Raft gives each follower an election timeout drawn in [4 s, 9 s]
  (nats-server's server/raft.go: minElectionTimeoutDefault, maxElectionTimeoutDefault;
  heartbeats every 1 s), so a freeze past 9 s makes every group the frozen server led
  (metadata, streams, consumers) elect a new leader while it is stopped. On SIGCONT its own
  election timeouts have run out: it stands for election, and the other groups elect again;
* `kill-in-election`: `kill -9` of the metadata leader A and its restart at once (without
  waiting for a leader: `LocalCluster.revive`); A's groups have no leader until a follower's
  election timeout runs out. At the first election won after the kill (a winner's line in
  any server's log) server B, one of the other two, is `kill -9`ed while the remaining
  groups still elect (B is the fresh winner or the third server, as the RNG says), then
  restarted 1-3 s later. A is back before B goes, so 2 of 3 servers are up throughout.

At most one server is ever down (killed or frozen): after each fault the soak waits (90 s at
most) until every server runs, every stream and consumer of the run has a leader and every
replica is current, before the next one. Each fault's down intervals are recorded.

Elections are counted from the servers' logs (`LocalCluster.leader_changes`: the winner's
"Self is new JetStream cluster metadata leader" / "new stream leader" / "new consumer leader"
lines) between the launchers' start and their exit: `elections` (after the first fault: the
ones the faults forced) and `elections_before_faults` (the run's streams' first leaders).

A run passes when `cluster_check.passed` holds (completed, 0 lost, 0 incomplete, 0 acked
lifecycle events missing, both launchers exit 0), no trajectory finished twice in the log,
none trained twice (trained = expected), every lifecycle event id once, and all its faults
were injected. `finished_redelivered` counts finished trajectories the trainer got again and
discarded by id (at-least-once delivery after a lost ack: never trained twice). DIR/soak.json
holds every run's record and the totals; the command prints a table and exits 1 if a run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import threading
import time
from pathlib import Path

import polars as pl

from actors.base.connection import BUS_ERRORS, close, connect
from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.run import ORIGIN_KEY, RUN_BUCKET, RunOrigin
from ops.cluster import READY_STREAM, LocalCluster
from runners.cluster_check import FIRST_FINISH_TIMEOUT_WALL_S, KILLED, control_summary, passed, start_launcher, tail, wait_all, write_config

LOG = logging.getLogger("prorsa.chaos_soak")
KINDS = ("kill", "freeze", "kill-in-election")
KILL_PAUSE_WALL_S = (1.0, 4.0)
FREEZE_WALL_S = (10.0, 12.0)  # past the 9 s longest Raft election timeout
SECOND_KILL_PAUSE_WALL_S = (1.0, 3.0)
FIRST_FAULT_DELAY_WALL_S = (0.0, 2.0)
GAP_WALL_S = (1.0, 4.0)
ELECTION_WAIT_WALL_S = 30.0  # for the first election after the leader's kill
HEAL_TIMEOUT_WALL_S = 90.0
RUN_TIMEOUT_WALL_S = 600.0
POLL_WALL_S = 0.05
HEAL_POLL_WALL_S = 0.5
TRAJECTORIES_PER_STEP = 4  # the template's tasks_per_step x samples_per_task


class FaultError(RuntimeError):
    """A fault could not be carried out (no metadata leader to kill, no election won)."""


def plan_faults(rng: random.Random, n: int) -> list[str]:
    """n fault kinds: every kind once (n >= 3) in a random order, the rest drawn at random."""
    kinds = list(KINDS[:n])
    kinds += [rng.choice(KINDS) for _ in range(n - len(kinds))]
    rng.shuffle(kinds)
    return kinds


class Injector:
    """Carries out one run's faults on `cluster`: blocking calls, from the thread that started
    the cluster (see `Monitor`)."""

    def __init__(self, cluster: LocalCluster, rng: random.Random, t0_wall_s: float) -> None:
        self.cluster, self.rng, self.t0_wall_s = cluster, rng, t0_wall_s
        self.frozen: set[int] = set()

    def rel(self, wall_s: float) -> float:
        return round(wall_s - self.t0_wall_s, 3)

    def kill(self) -> dict:
        i = self.rng.randrange(len(self.cluster.servers))
        pause = self.rng.uniform(*KILL_PAUSE_WALL_S)
        down = time.time()
        self.cluster.kill(i)
        time.sleep(pause)  # barrier-ok: the fault's length (the server stays dead this long)
        self.cluster.restart(i)
        return {"server": f"n{i}", "pause_wall_s": round(pause, 2), "down": [[f"n{i}", self.rel(down), self.rel(time.time())]]}

    def freeze(self) -> dict:
        leaders = {group: server for group, server in self.cluster.leaders().items() if READY_STREAM not in group}
        leading = sorted(set(leaders.values())) or list(range(len(self.cluster.servers)))
        i = self.rng.choice(leading)  # a server that leads some group: the freeze must outlast its followers' patience
        length = self.rng.uniform(*FREEZE_WALL_S)
        was_meta_leader = leaders.get("_meta_") == i
        led = sorted(group for group, server in leaders.items() if server == i)
        down = time.time()
        self.cluster.freeze(i)
        self.frozen.add(i)
        try:
            time.sleep(length)  # barrier-ok: the fault's length (past the Raft election timeout)
        finally:
            self.cluster.thaw(i)
            self.frozen.discard(i)
        up = time.time()
        return {
            "server": f"n{i}",
            "freeze_wall_s": round(length, 2),
            "was_meta_leader": was_meta_leader,
            "groups_led": len(led),
            "elections_during_freeze": len(self.cluster.leader_changes(down, up)),
            "down": [[f"n{i}", self.rel(down), self.rel(up)]],
        }

    def kill_in_election(self) -> dict:
        n = len(self.cluster.servers)
        a = self.cluster.meta_leader()
        if a is None:
            raise FaultError("no running server has won the metadata election")
        killed_at = time.time()
        self.cluster.kill(a)
        self.cluster.revive(a)  # back at once, a follower: its groups still need new leaders
        revived_at = time.time()
        deadline = revived_at + ELECTION_WAIT_WALL_S
        while not (won := self.cluster.leader_changes(killed_at)):
            if time.time() > deadline:
                raise FaultError(f"no election won within {ELECTION_WAIT_WALL_S} s of n{a}'s kill")
            time.sleep(POLL_WALL_S)  # barrier-ok: polls the servers' logs for the first election won
        first = won[0]
        others = [j for j in range(n) if j != a]
        b = first.server if first.server != a and self.rng.random() < 0.5 else self.rng.choice(others)
        second_at = time.time()
        self.cluster.kill(b)
        pause = self.rng.uniform(*SECOND_KILL_PAUSE_WALL_S)
        time.sleep(pause)  # barrier-ok: the fault's length (the second server stays dead this long)
        self.cluster.restart(b)
        return {
            "server": f"n{a}",
            "second_server": f"n{b}",
            "second_was_fresh_winner": b == first.server,
            "first_election": {
                "kind": first.kind,
                "group": first.group,
                "winner": f"n{first.server}",
                "after_kill_wall_s": round(first.wall_s - killed_at, 2),
            },
            "elections_before_second_kill": len(self.cluster.leader_changes(killed_at, second_at)),
            "second_kill_after_wall_s": round(second_at - killed_at, 2),
            "pause_wall_s": round(pause, 2),
            "down": [[f"n{a}", self.rel(killed_at), self.rel(revived_at)], [f"n{b}", self.rel(second_at), self.rel(time.time())]],
        }

    def inject(self, kind: str) -> dict:
        return {"kill": self.kill, "freeze": self.freeze, "kill-in-election": self.kill_in_election}[kind]()

    def thaw_all(self) -> None:
        for i in list(self.frozen):
            self.cluster.thaw(i)
            self.frozen.discard(i)


async def healed(js) -> str:
    """'' once every stream and consumer has a leader and every replica is current, else what is not."""
    try:
        for info in await js.streams_info():
            name, cluster = info.config.name, info.cluster
            if cluster is None or not cluster.leader:
                return f"stream {name}: no leader"
            replicas = cluster.replicas or []
            if len(replicas) != (info.config.num_replicas or 1) - 1 or not all(r.current and not r.offline for r in replicas):
                return f"stream {name}: replicas {[(r.name, r.current, r.offline) for r in replicas]}"
            for consumer in await js.consumers_info(name):
                c = consumer.cluster
                if c is None or not c.leader or not all(r.current and not r.offline for r in c.replicas or []):
                    return f"consumer {name} > {consumer.name}: not settled"
    except BUS_ERRORS as err:
        return f"{type(err).__name__}: {err}"
    return ""


class Monitor:
    """The soak's own client of the cluster, on an event loop in a thread of its own: it counts
    finished trajectories (a core subscription: a count for pacing, not a check) and asks
    whether the cluster has healed. The faults run in the calling thread: a server gets
    SIGTERM when the thread that started it exits (`ops.procs.die_with_parent`), so every
    (re)start must come from the thread that outlives the cluster."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.finished = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chaos-monitor", daemon=True)
        self.thread.start()
        self.first = threading.Event()
        self.nc = self.call(self._connect(cluster))
        self.js = self.nc.jetstream(timeout=5)

    def call(self, coro, timeout_wall_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_wall_s)

    async def _connect(self, cluster: LocalCluster):
        nc = await connect(cluster.seed_url, "chaos-soak", LOG, tls=cluster.client_tls)

        async def on_finished(_msg) -> None:
            self.finished += 1
            self.first.set()

        await nc.subscribe(subjects.lifecycle("finished"), cb=on_finished)
        await nc.flush()
        return nc

    async def _origin(self) -> RunOrigin | None:
        try:
            return decode(RunOrigin, (await (await self.js.key_value(RUN_BUCKET)).get(ORIGIN_KEY)).value)
        except BUS_ERRORS:
            return None

    def origin(self) -> RunOrigin | None:
        return self.call(self._origin())

    def healed(self) -> str:
        return self.call(healed(self.js))

    def close(self) -> None:
        try:
            self.call(close(self.nc), 30.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


def wait_healed(cluster: LocalCluster, monitor: Monitor) -> str:
    """'' once every server runs and the cluster has healed (HEAL_TIMEOUT_WALL_S at most), else why not."""
    deadline = time.monotonic() + HEAL_TIMEOUT_WALL_S
    while True:
        down = [f"n{i}" for i in range(len(cluster.servers)) if cluster.pid(i) is None]
        why = f"{', '.join(down)} not running" if down else monitor.healed()
        if not why:
            return ""
        if time.monotonic() > deadline:
            return f"not healed within {HEAL_TIMEOUT_WALL_S} s: {why}"
        time.sleep(HEAL_POLL_WALL_S)  # barrier-ok: polls the cluster's state until it has healed


def run_faults(
    cluster: LocalCluster, rng: random.Random, kinds: list[str], control, expected: int, t0_wall_s: float, time_scale: float
) -> dict:
    """Inject `kinds` in a row while the run's trajectories flow: each fault's record, and why
    injection stopped early ('' if it did not)."""
    injector = Injector(cluster, rng, t0_wall_s)
    monitor = Monitor(cluster)
    records: list[dict] = []
    stopped = ""
    try:
        if not monitor.first.wait(FIRST_FINISH_TIMEOUT_WALL_S):
            return {"faults": records, "stopped": f"no trajectory finished within {FIRST_FINISH_TIMEOUT_WALL_S} s"}
        origin = monitor.origin()
        origin_wall_s = origin.origin_wall_s if origin is not None else t0_wall_s  # else model time from the launchers' start
        for k, kind in enumerate(kinds):
            gap = rng.uniform(*(FIRST_FAULT_DELAY_WALL_S if k == 0 else GAP_WALL_S))
            time.sleep(gap)  # barrier-ok: the fault's moment, drawn by the seed
            if control.poll() is not None or monitor.finished >= expected:
                stopped = f"the run's trajectories had all finished before fault {k + 1} of {len(kinds)} (raise --steps)"
                break
            start = time.time()
            record = {"kind": kind, "at_wall_s": injector.rel(start), "at_model_s": round((start - origin_wall_s) * time_scale, 1)}
            record["finished_before"] = monitor.finished
            try:
                record |= injector.inject(kind)
                if why := wait_healed(cluster, monitor):
                    record["error"] = why
            except (RuntimeError, OSError) as err:  # FaultError, or a server that would not restart
                record["error"] = str(err)
            finally:
                injector.thaw_all()
            end = time.time()
            record |= {"healed_wall_s": round(end - start, 2), "elections": election_counts(cluster.leader_changes(start, end))}
            records.append(record)
            if "error" in record:
                stopped = f"fault {k + 1} ({kind}): {record['error']}"
                break
    finally:
        injector.thaw_all()
        monitor.close()
    return {"faults": records, "stopped": stopped}


def election_counts(changes) -> dict:
    counts = {"meta": 0, "stream": 0, "consumer": 0}
    for change in changes:
        counts[change.kind] += 1
    return counts | {"total": len(changes)}


def duplicates(out: Path, summary: dict) -> dict:
    """What the run's export says was done twice."""
    events_path = out / "control" / "events.parquet"
    if not events_path.exists():
        return {"finished_twice": None, "trained_twice": None, "duplicate_event_ids": None, "finished_redelivered": None}
    events = pl.read_parquet(events_path)
    finished = events.filter(pl.col("kind") == "finished")["trajectory_id"]
    trained = summary.get("trajectories_trained", 0)
    steps = [s["step"] for s in summary.get("steps", [])]
    return {
        "finished_twice": finished.len() - finished.n_unique(),
        "trained_twice": max(0, trained - summary.get("trajectories_expected", 0)) + len(steps) - len(set(steps)),
        "duplicate_event_ids": events.height - events["event_id"].n_unique(),
        "finished_redelivered": summary.get("actors", {}).get("trainer", {}).get("duplicate_finished", 0),
    }


def overlapping_downtime(faults: list[dict]) -> list[str]:
    """Pairs of down intervals (of different servers) that overlap: two servers down at once."""
    down = sorted(interval for f in faults for interval in f.get("down", []))
    clashes = []
    for i, (name_a, start_a, end_a) in enumerate(down):
        for name_b, start_b, end_b in down[i + 1 :]:
            if name_a != name_b and start_a < end_b and start_b < end_a:
                clashes.append(f"{name_a} [{start_a}, {end_a}] and {name_b} [{start_b}, {end_b}]")
    return clashes


def run_one(
    out: Path,
    seed: int,
    faults_per_run: int,
    steps: int,
    time_scale: float,
    policy: str = "colocated",
    tls: bool = False,
    run_timeout_wall_s: float = RUN_TIMEOUT_WALL_S,
) -> dict:
    """One run with its faults; its record (also in out/run.json)."""
    rng = random.Random(seed)
    kinds = plan_faults(rng, faults_per_run)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "chaos.toml"
    started = time.monotonic()
    with LocalCluster(out / "cluster", tls=tls) as cluster:
        write_config(config, cluster, time.strftime("%Y%m%d-%H%M%S") + f"-chaos{seed}", time_scale, steps, policy)
        launched = time.time()
        engines = start_launcher(config, out / "engines", cluster.urls[KILLED], ["engines"])
        control = start_launcher(config, out / "control", cluster.urls[0], ["control", "environments"])
        injected = {"faults": [], "stopped": "the soak itself failed"}
        try:
            expected = steps * TRAJECTORIES_PER_STEP
            injected = run_faults(cluster, rng, kinds, control, expected, launched, time_scale)
        finally:
            stalled = injected["stopped"].startswith("no trajectory finished")
            codes = wait_all({"control": control, "engines": engines}, time.monotonic() if stalled else started + run_timeout_wall_s)
            ended = time.time()
        changes = cluster.leader_changes(launched, ended)
    summary = control_summary(out) | {"launcher_exit_codes": codes}
    faults = injected["faults"]
    first_fault = launched + faults[0]["at_wall_s"] if faults else ended
    record = {
        "seed": seed,
        "planned": kinds,
        "faults": faults,
        "stopped_early": injected["stopped"],
        "servers_down_together": overlapping_downtime(faults),
        "elections": election_counts([c for c in changes if c.wall_s >= first_fault]),
        "elections_before_faults": election_counts([c for c in changes if c.wall_s < first_fault]),
        "status": summary.get("status"),
        "trajectories_expected": summary.get("trajectories_expected"),
        "trajectories_finished": summary.get("trajectories_finished"),
        "trajectories_trained": summary.get("trajectories_trained"),
        "lost": summary.get("trajectories_lost"),
        "incomplete": summary.get("incomplete_trajectories"),
        "lifecycle_events_missing": summary["lifecycle_events_missing"],
        "launcher_exit_codes": codes,
        "wall_s": round(time.monotonic() - started, 1),
    } | duplicates(out, summary)
    record["duplicates"] = (record["finished_twice"] or 0) + (record["trained_twice"] or 0)
    record["passed"] = (
        "trajectories_lost" in summary
        and passed(summary)
        and record["finished_twice"] == 0
        and record["trained_twice"] == 0
        and record["duplicate_event_ids"] == 0
        and not record["stopped_early"]
        and len(faults) == faults_per_run
        and not record["servers_down_together"]
    )
    if not record["passed"]:  # what each host printed, so a failure explains itself
        record["launcher_log_tails"] = {name: tail(out / f"{name}.log") for name in ("control", "engines")}
    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def totals(records: list[dict]) -> dict:
    faults = [f for r in records for f in r["faults"]]
    by_kind = {kind: sum(f["kind"] == kind for f in faults) for kind in KINDS}
    elections = {k: sum(r["elections"][k] for r in records) for k in ("meta", "stream", "consumer", "total")}
    return {
        "runs": len(records),
        "runs_passed": sum(r["passed"] for r in records),
        "faults": len(faults),
        "faults_by_kind": by_kind,
        "elections_after_first_fault": elections,
        "trajectories_expected": sum(r["trajectories_expected"] or 0 for r in records),
        "trajectories_finished": sum(r["trajectories_finished"] or 0 for r in records),
        "lost": sum(r["lost"] or 0 for r in records),
        "finished_twice": sum(r["finished_twice"] or 0 for r in records),
        "trained_twice": sum(r["trained_twice"] or 0 for r in records),
        "finished_redelivered": sum(r["finished_redelivered"] or 0 for r in records),
        "lifecycle_events_missing": sum(r["lifecycle_events_missing"] for r in records),
        "wall_s": round(sum(r["wall_s"] for r in records), 1),
    }


def table(records: list[dict]) -> str:
    short = {"kill": "K", "freeze": "F", "kill-in-election": "E"}
    rows = [
        f"{'run':>3} {'seed':>6} {'faults (K kill, F freeze, E kill in election)':<46} {'elections m/s/c':>16} {'finished':>9} {'lost':>4} {'dup':>3} {'redeliv':>7} {'wall s':>7}  result"
    ]
    for i, r in enumerate(records):
        faults = " ".join(
            f"{short[f['kind']]}:{f['server']}{'+' + f['second_server'] if 'second_server' in f else ''}@{f['at_wall_s']:.0f}s"
            for f in r["faults"]
        )
        e = r["elections"]
        rows.append(
            f"{i:>3} {r['seed']:>6} {faults:<46} {e['meta']:>5}/{e['stream']:>3}/{e['consumer']:>3}  "
            f"{r['trajectories_finished']!s:>4}/{r['trajectories_expected']!s:<4} {r['lost']!s:>4} {r['duplicates']:>3} {r['finished_redelivered']!s:>7} {r['wall_s']:>7}  "
            f"{'passed' if r['passed'] else 'FAILED ' + (r['stopped_early'] or r['status'] or '')}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.chaos_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0, help="run r draws its faults from seed * 1000 + r")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--faults-per-run", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="trainer steps of each run (4 trajectories each): long enough for its faults")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--policy", default="colocated")
    parser.add_argument("--tls", action="store_true", help="clients and routes over TLS (a local CA), the runs with [bus] tls = 'on'")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.faults_per_run < 1:
        parser.error("--runs and --faults-per-run must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    # the soak's own client (its disconnects while a server is down) logs to DIR/soak.log
    logging.basicConfig(filename=args.out / "soak.log", level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    records = []
    for r in range(args.runs):
        seed = args.seed * 1000 + r
        record = run_one(args.out / f"run-{r}", seed, args.faults_per_run, args.steps, args.time_scale, args.policy, args.tls)
        records.append(record)
        print(
            f"run {r} (seed {seed}): {'passed' if record['passed'] else 'FAILED'}, {len(record['faults'])} faults, {record['wall_s']} s",
            flush=True,
        )
        (args.out / "soak.json").write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "totals": totals(records), "runs": records}, indent=2) + "\n"
        )
    total = totals(records)
    print(table(records))
    print(json.dumps(total))
    print(f"wrote {args.out / 'soak.json'}", flush=True)
    return 0 if total["runs_passed"] == total["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
