"""The loss of a server, end to end: `runners.cluster_check` runs one emulated run
over two launcher processes, each on a different server of a local 3-server cluster, and
`kill -9`s one server mid-run. The run must complete with nothing lost."""

from __future__ import annotations

import json

import pytest

from runners import cluster_check

pytestmark = pytest.mark.e2e


def test_a_server_killed_mid_run_loses_nothing(tmp_path) -> None:
    assert cluster_check.main(["--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["servers_killed"]
    assert summary["trajectories_finished"] == summary["trajectories_expected"] > 0
    assert summary["trajectories_lost"] == 0 and summary["lifecycle_events_missing"] == 0
    assert all(code == 0 for code in summary["launcher_exit_codes"].values())


def test_an_event_is_missing_when_acked_and_absent_but_not_a_rerun_finish_the_stream_kept_once(tmp_path) -> None:
    """A rerun of a trajectory already reported logs its `finished` again under the first
    one's id: the stream keeps one, and that is not an event lost. Anything else acked and
    absent from the log is."""
    control = tmp_path / "control"
    control.mkdir()
    actors = {"env0": {"lifecycle_events": 78, "finished_again": 1}, "e0": {"lifecycle_events": 54}, "trainer": {"lifecycle_events": 6}}
    for stored, missing in ((137, 0), (136, 1)):
        (control / "summary.json").write_text(json.dumps({"actors": actors, "events": stored}))
        summary = cluster_check.control_summary(tmp_path)
        assert summary["lifecycle_events_emitted"] == 138 and summary["lifecycle_events_missing"] == missing
