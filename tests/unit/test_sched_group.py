"""kvpush.integrations.sched_group.decide: when a vLLM worker takes a scheduling group of its own."""

from __future__ import annotations

import dataclasses

from kvpush.integrations.sched_group import Process, decide, this_process

WORKER = Process(linux=True, autogroup=True, started_by_multiprocessing=True, cores=frozenset({1}), host_cores=2,
                 group_leader=False, parent_cores=frozenset({0, 1}))


def test_a_pinned_vllm_worker_in_a_shared_session_takes_its_own() -> None:
    assert decide(WORKER) is None
    assert decide(dataclasses.replace(WORKER, cores=frozenset({0, 1}), host_cores=4,
                                         parent_cores=frozenset(range(4)))) is None  # a TP rank's cores
    assert decide(dataclasses.replace(WORKER, parent_cores=frozenset())) is None  # the parent's cores unknown
    assert decide(dataclasses.replace(WORKER, parent_cores=frozenset({0}))) is None  # its engine core elsewhere


def test_every_other_process_stays_where_it_is() -> None:
    for change, reason in (({"linux": False}, "not Linux"),
                           ({"autogroup": False}, "sched_autogroup_enabled is 0"),
                           ({"started_by_multiprocessing": False}, "its own program's session is left alone"),
                           ({"cores": frozenset({0, 1})}, "not bound to some of the cores"),
                           ({"cores": frozenset()}, "not bound to some of the cores"),
                           ({"group_leader": True}, "leads a process group"),
                           ({"parent_cores": frozenset({1})}, "its engine core runs on its cores only"),
                           ({"cores": frozenset({0, 1}), "host_cores": 4, "parent_cores": frozenset({1})},
                            "its engine core runs on its cores only")):
        why = decide(dataclasses.replace(WORKER, **change))
        assert why is not None and reason in why, (change, why)


def test_this_process_is_read_without_changing_anything() -> None:
    process = this_process()
    assert not process.started_by_multiprocessing  # pytest's own process: never moved
    assert decide(process) is not None
