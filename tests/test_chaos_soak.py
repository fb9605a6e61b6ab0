"""The chaos soak (`runners/chaos_soak.py`): seeded server faults in a row (kill -9 and
restart, SIGSTOP past the Raft election timeout, a kill while leaders are being elected),
mid-run, on a local 3-server JetStream cluster; each run must lose nothing and do nothing twice.

    pytest -m soak tests/test_chaos_soak.py            # PRORSA_CHAOS_RUNS (default 5) runs of PRORSA_CHAOS_FAULTS (default 4) faults
    PRORSA_CHAOS_OUT=runs/chaos pytest -m soak ...     # keeps each run's folder there, and the totals in soak.json

The soak itself is not in CI (tests/conftest.py deselects it unless `-m soak` is given);
the tests of what it reads and checks (the servers' election lines, the fault plan, two
servers down at once) run everywhere.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from ops.cluster import LocalCluster
from runners import chaos_soak

RUNS = int(os.environ.get("PRORSA_CHAOS_RUNS", "5"))
FAULTS = int(os.environ.get("PRORSA_CHAOS_FAULTS", "4"))
SEED = int(os.environ.get("PRORSA_CHAOS_SEED", "0"))
STEPS, TIME_SCALE = 40, 20.0
MAX_ELECTION_TIMEOUT_WALL_S = 9.0  # nats-server server/raft.go: maxElectionTimeoutDefault
RECORDS: list[dict] = []

N0_LOG = """\
[101] 2026/01/02 10:00:00.100000 [INF] Starting nats-server
[101] 2026/01/02 10:00:00.500000 [INF] Self is new JetStream cluster metadata leader
[101] 2026/01/02 10:00:01.000000 [INF] JetStream cluster new stream leader for '$G > LIFECYCLE'
[101] 2026/01/02 10:00:03.250000 [INF] JetStream cluster new consumer leader for '$G > TASKS > environments'
[202] 2026/01/02 10:00:20.000000 [INF] Starting nats-server
[202] 2026/01/02 10:00:20.400000 [INF] JetStream cluster new metadata leader: n1/prorsa
"""
N1_LOG = """\
[103] 2026/01/02 10:00:00.600000 [INF] JetStream cluster new metadata leader: n0/prorsa
[103] 2026/01/02 10:00:09.000000 [INF] JetStream cluster no metadata leader
[103] 2026/01/02 10:00:15.000000 [INF] Self is new JetStream cluster metadata leader
[103] 2026/01/02 10:00:15.100000 [INF] JetStream cluster new stream leader for '$G > LIFECYCLE'
[103] 2026/01/02 10:00:15.200000 [WRN] JetStream cluster new stream leader for '$G > NOT_INFO'
"""


def test_elections_are_read_from_the_winners_log_lines(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)  # configured, not started: the logs are written by hand
    for i, text in enumerate((N0_LOG, N1_LOG)):
        cluster.servers[i].log_path.parent.mkdir(parents=True)
        cluster.servers[i].log_path.write_text(text)
    won = [(c.server, c.kind, c.group) for c in cluster.leader_changes()]
    # a follower's "new metadata leader: nX" and "no metadata leader" are no elections; a restart's lines append
    assert won == [
        (0, "meta", "_meta_"),
        (0, "stream", "$G > LIFECYCLE"),
        (0, "consumer", "$G > TASKS > environments"),
        (1, "meta", "_meta_"),
        (1, "stream", "$G > LIFECYCLE"),
    ]
    changes = cluster.leader_changes()
    assert changes[4].wall_s - changes[0].wall_s == pytest.approx(14.6)
    assert [c.server for c in cluster.leader_changes(changes[1].wall_s, changes[3].wall_s)] == [0, 0]
    assert cluster.leaders() == {"_meta_": 1, "$G > LIFECYCLE": 1, "$G > TASKS > environments": 0}
    assert cluster.meta_leader() is None  # the logs name n1, but no server is running


def test_the_plan_has_every_kind_and_two_servers_down_at_once_are_caught() -> None:
    for seed in range(20):
        plan = chaos_soak.plan_faults(random.Random(seed), 4)
        assert len(plan) == 4 and set(plan) == set(chaos_soak.KINDS)
    assert chaos_soak.plan_faults(random.Random(0), 2) in (["kill", "freeze"], ["freeze", "kill"])
    apart = [{"down": [["n0", 1.0, 2.0], ["n1", 2.5, 4.0]]}, {"down": [["n0", 5.0, 6.0]]}]
    assert chaos_soak.overlapping_downtime(apart) == []
    together = [{"down": [["n0", 1.0, 3.0]]}, {"down": [["n2", 2.9, 4.0]]}]
    assert chaos_soak.overlapping_downtime(together) == ["n0 [1.0, 3.0] and n2 [2.9, 4.0]"]


@pytest.fixture(scope="module")
def soak_totals():
    yield RECORDS
    if RECORDS:
        print("\n" + chaos_soak.table(RECORDS) + "\n" + json.dumps(chaos_soak.totals(RECORDS)))
    if (out := os.environ.get("PRORSA_CHAOS_OUT")) and RECORDS:
        (Path(out) / "soak.json").write_text(json.dumps({"totals": chaos_soak.totals(RECORDS), "runs": RECORDS}, indent=2) + "\n")


@pytest.mark.soak
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", range(RUNS))
def test_server_faults_in_a_row_lose_and_duplicate_nothing(tmp_path: Path, run: int, soak_totals) -> None:
    out = Path(os.environ["PRORSA_CHAOS_OUT"]) / f"run-{run}" if os.environ.get("PRORSA_CHAOS_OUT") else tmp_path
    record = chaos_soak.run_one(out, SEED * 1000 + run, FAULTS, STEPS, TIME_SCALE)
    soak_totals.append(record)
    where = f"seed {record['seed']}, {out}"
    assert not record["stopped_early"], where
    assert len(record["faults"]) == FAULTS and not [f for f in record["faults"] if "error" in f], where
    assert record["servers_down_together"] == [], where  # quorum (2 of 3) throughout
    for fault in record["faults"]:
        if fault["kind"] == "freeze":  # a server leading some group, frozen past every follower's election timeout
            assert fault["freeze_wall_s"] > MAX_ELECTION_TIMEOUT_WALL_S and fault["groups_led"] >= 1
            assert fault["elections"]["total"] >= 1, where
        if fault["kind"] == "kill-in-election":  # the second kill came after an election was won, with A back up
            assert fault["elections_before_second_kill"] >= 1 and fault["second_server"] != fault["server"], where
    assert record["status"] == "completed", where
    assert record["trajectories_finished"] == record["trajectories_expected"] == STEPS * chaos_soak.TRAJECTORIES_PER_STEP, where
    assert record["lost"] == 0 and record["incomplete"] == 0 and record["lifecycle_events_missing"] == 0, where
    assert record["finished_twice"] == 0 and record["trained_twice"] == 0 and record["duplicate_event_ids"] == 0, where
    assert all(code == 0 for code in record["launcher_exit_codes"].values()), where
    assert record["passed"], where
