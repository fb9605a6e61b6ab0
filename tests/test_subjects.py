from __future__ import annotations

import pytest

from bus_schemas import streams, subjects


def _stream_of(subject: str) -> str:
    """Which stream captures a concrete subject."""
    hits = [s.name for s in streams.ALL_STREAMS if any(subjects.matches(p, subject) for p in s.subjects)]
    assert len(hits) <= 1, f"{subject} is captured by several streams: {hits}"
    return hits[0] if hits else ""


@pytest.mark.parametrize(
    "pattern, subject, hit",
    [
        ("prorsa.lc.*", "prorsa.lc.finished", True),
        ("prorsa.lc.*", "prorsa.lc.a.b", False),
        ("prorsa.status.>", "prorsa.status.engine.e0", True),
        ("prorsa.status.>", "prorsa.status", False),
        ("prorsa.work.prefill", "prorsa.work.prefill.e1", False),
        ("prorsa.*.prefill", "prorsa.work.prefill", True),
    ],
)
def test_wildcard_matching(pattern, subject, hit):
    assert subjects.matches(pattern, subject) is hit


def test_subjects_follow_the_hierarchy():
    assert subjects.work_prefill() == "prorsa.work.prefill"
    assert subjects.work_prefill("e3") == "prorsa.work.prefill.e3"
    assert subjects.work_decode("e1") == "prorsa.work.decode.e1"
    assert subjects.kv("e2") == "prorsa.kv.e2"
    assert subjects.result("env0") == "prorsa.result.env0"
    assert subjects.lifecycle("prefill_done") == "prorsa.lc.prefill_done"
    assert subjects.ctl_engine("e0") == "prorsa.ctl.engine.e0"
    assert subjects.status("engine", "e0") == "prorsa.status.engine.e0"
    assert subjects.train_tasks() == "prorsa.train.tasks"


@pytest.mark.parametrize("bad", ["e.1", "e*", "e>", "", "e 1"])
def test_ids_that_would_break_the_hierarchy_are_refused(bad):
    with pytest.raises(ValueError, match="not a valid subject token"):
        subjects.kv(bad)


@pytest.mark.parametrize(
    "subject, stream",
    [
        (subjects.work_prefill(), "WORK_PREFILL"),
        (subjects.work_prefill("e4"), "WORK_PREFILL"),
        (subjects.work_decode(), "WORK_DECODE"),
        (subjects.work_decode("e4"), "WORK_DECODE"),
        (subjects.result("env3"), "RESULTS"),
        (subjects.lifecycle("finished"), "LIFECYCLE"),
        (subjects.train_tasks(), "TASKS"),
        (subjects.train_finished(), "TRAIN"),
        (subjects.train_policy(), "TRAIN"),
        (subjects.train_step(), "TRAIN"),
        (subjects.report("e0"), "REPORTS"),
        (subjects.kv("e0"), ""),  # request/reply, never stored
        (subjects.ctl_engine("e0"), ""),
        (subjects.status("engine", "e0"), ""),
    ],
)
def test_each_subject_lands_in_exactly_its_stream(subject, stream):
    assert _stream_of(subject) == stream


def test_has_wildcard_tells_patterns_from_subjects():
    assert subjects.has_wildcard(subjects.status_of_kind("engine"))
    assert subjects.has_wildcard(subjects.lifecycle_all())
    assert not subjects.has_wildcard(subjects.status("engine", "e0"))
    assert not subjects.has_wildcard("_INBOX.12")
