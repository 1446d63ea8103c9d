"""The fleet starts what it says, in the mode it says, and leaves nothing running."""

from __future__ import annotations

import shutil
import socket

import pytest

from infra.fleet import LEDGER_ENV, Fleet, LedgerMode
from infra.processes import alive
from infra.stub_provider import StubProvider

pytestmark = pytest.mark.slow


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def ports_and_pids(fleet: Fleet) -> tuple[list[int], list[int]]:
    ports = [fleet.redis.port, fleet.provider.port, *(s.port for s in fleet.services)]
    pids = [p.pid for p in (fleet.redis.process, *(s.process for s in fleet.services)) if p]
    return ports, pids


@pytest.mark.parametrize("mode", list(LedgerMode))
def test_each_mode_gives_every_instance_its_ledger_and_a_working_key(mode: LedgerMode) -> None:
    with Fleet(mode=mode, instances=2, provider=StubProvider(latency_ms_min=0,
                                                             latency_ms_max=0)) as fleet:
        health = fleet.health()
        keys = fleet.provision("org:fleet-test", 50_000)
        assert len(keys) == 2
        if mode is LedgerMode.SHARED:
            assert len(set(keys)) == 1
            assert [h["status"] for h in health] == ["ok", "ok"]
            assert {h["ledger"]["backend"] for h in health} == {"redis"}
        else:
            assert len(set(keys)) == 2  # each instance's own key in its own memory
            assert [h["status"] for h in health] == ["degraded", "degraded"]
            assert all("ledger_not_shared" in h["reasons"] for h in health)
        assert fleet.committed_micros("org:fleet-test") == [0, 0]


def interrupt_running(fleet: Fleet, seen: list[tuple[list[int], list[int]]]) -> None:
    with fleet:
        seen.append(ports_and_pids(fleet))
        assert all(listening(p) for p in seen[0][0])
        raise KeyboardInterrupt


def test_everything_is_stopped_when_the_caller_is_interrupted() -> None:
    fleet, seen = Fleet(instances=2), list[tuple[list[int], list[int]]]()
    with pytest.raises(KeyboardInterrupt):
        interrupt_running(fleet, seen)
    [(ports, pids)] = seen
    assert len(pids) == 3
    assert not any(listening(p) for p in ports)
    assert not any(alive(pid) for pid in pids)
    assert not fleet.workdir.exists()


class UnconfiguredFleet(Fleet):
    """Instances with no ledger at all: `ceiling serve` refuses to start."""

    def service_env(self) -> dict[str, str]:
        return dict.fromkeys(LEDGER_ENV, "")


def test_a_failed_start_stops_what_did_start() -> None:
    fleet = UnconfiguredFleet(instances=2)
    with pytest.raises(RuntimeError, match=r"service on port \d+ exited"):
        fleet.start()
    ports, pids = ports_and_pids(fleet)
    assert pids == []  # every process was stopped and reaped
    assert not any(listening(p) for p in ports)
    # Kept, and saying why: a forked instance's output reaches its own log.
    assert "refusing to start" in (fleet.workdir / "instance-00.log").read_text()
    shutil.rmtree(fleet.workdir)
