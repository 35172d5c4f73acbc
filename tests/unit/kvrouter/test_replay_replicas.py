"""Router replicas in replay: virtual time (R placers, their placements delivered to each other
after a delay, or never) — synced replicas send follow-ups where a peer put their prefix, a sync
slower than the run is no sync, the CLI's rows and errors — and live mode's
``--router-processes`` (the fleet's router as ``kvrouter serve --processes N``, real processes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvrouter.replay.cli import main
from kvrouter.replay.fleet import Fleet, FleetSpec
from kvrouter.replay.live import add_live_arguments, targets_from_args
from kvrouter.replay.replicas import RouterReplicas
from kvrouter.replay.trace import TraceRequest
from kvrouter.replay.virtual import VirtualFleet, run_virtual
from router.settings import load_settings

TB = 64
#: the index hears of a cache 10 s late: only the replicas' own predictions steer follow-ups
LATE_EVENTS = VirtualFleet(workers=2, block_size=16, gpu_blocks=1024, event_delay_s=10.0)
FLEET3 = VirtualFleet(workers=3, block_size=16, gpu_blocks=1024)
#: lanes off: synced replicas then take the one router's choice, not a near-best one by lane
NO_LANES = load_settings(
    environ={}, overrides={"workers": [], "block_size": 16, "scoring": {"replica_spread": 0}}
)


def _conversations(n: int = 12) -> list[TraceRequest]:
    """``n`` conversations of a long new prefix; each one's follow-up comes 0.2 s later."""
    reqs = []
    for c in range(n):
        prefix = tuple(range(100 * c, 100 * c + 8))
        reqs.append(TraceRequest(0.5 * c, prefix, 8 * TB, 2))
        reqs.append(TraceRequest(0.5 * c + 0.2, (*prefix, 99), 9 * TB, 2))
    return reqs


def _follow_ups_hit(run) -> int:
    return sum(o.cached_tokens >= 8 * TB - 16 for o in run.outcomes[1::2])


def test_synced_replicas_follow_a_peers_prefix_and_unsynced_ones_miss() -> None:
    reqs = _conversations()
    one = run_virtual(reqs, "kvrouter", LATE_EVENTS, trace_block=TB)
    sync = RouterReplicas(4, True, 0.001)
    synced = run_virtual(reqs, "kvrouter", LATE_EVENTS, trace_block=TB, replicas=sync)
    alone = RouterReplicas(4, False)
    unsynced = run_virtual(reqs, "kvrouter", LATE_EVENTS, trace_block=TB, replicas=alone)
    assert (one.policy, synced.policy) == ("kvrouter", "kvrouter (4 replicas, sync)")
    assert unsynced.policy == "kvrouter (4 replicas, no sync)"
    assert _follow_ups_hit(one) == _follow_ups_hit(synced) == 12
    # a follow-up at another replica sees no prediction: it lands by load and tie alone
    assert _follow_ups_hit(unsynced) < 12


def test_synced_replicas_without_delay_place_exactly_as_one_router() -> None:
    """Each replica's index is fed the same events and every peer placement is applied before
    the next decision: with lanes off, four replicas are one router, whichever of them a request
    reaches; with lanes (the default), replicas past lane 0 take near-best workers instead."""
    reqs = [
        TraceRequest(0.05 * (i // 3), (i % 5, 50 + i % 7, 90 + i), 3 * TB, 4) for i in range(60)
    ]
    four = RouterReplicas(4, True, 0)
    one = run_virtual(reqs, "kvrouter", FLEET3, trace_block=TB, settings=NO_LANES)
    same = run_virtual(reqs, "kvrouter", FLEET3, trace_block=TB, settings=NO_LANES, replicas=four)
    assert [o.worker for o in same.outcomes] == [o.worker for o in one.outcomes]
    assert [o.cached_tokens for o in same.outcomes] == [o.cached_tokens for o in one.outcomes]
    assert len({o.worker for o in one.outcomes}) == 3 and sum(o.cached_tokens for o in one.outcomes)
    laned = run_virtual(reqs, "kvrouter", FLEET3, trace_block=TB, replicas=four)
    assert [o.worker for o in laned.outcomes] != [o.worker for o in one.outcomes]


def test_a_sync_slower_than_the_run_is_no_sync() -> None:
    reqs = _conversations(6)
    late = RouterReplicas(3, True, 60.0)
    never = RouterReplicas(3, False)
    # (lanes off: unsynced replicas do not know each other, so they have none)
    kw = {"trace_block": TB, "settings": NO_LANES}
    a = run_virtual(reqs, "kvrouter", LATE_EVENTS, replicas=late, **kw)
    b = run_virtual(reqs, "kvrouter", LATE_EVENTS, replicas=never, **kw)
    assert [o.worker for o in a.outcomes] == [o.worker for o in b.outcomes]
    assert [o.cached_tokens for o in a.outcomes] == [o.cached_tokens for o in b.outcomes]


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for r in _conversations(4):
            row = {"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                   "output_length": r.output_length, "hash_ids": list(r.hash_ids)}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


def test_cli_rows_beside_one_router_and_bad_counts(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.json"
    args = ["--trace", str(_trace(tmp_path)), "--trace-block", str(TB), "--workers", "2"]
    args += ["--no-progress", "--policies", "kvrouter,round_robin"]
    assert (
        main([*args, "--router-replicas", "3", "--replica-sync", "both", "--json", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["table"]
    assert [r["policy"] for r in rows] == [
        "kvrouter",
        "kvrouter (3 replicas, sync)",
        "kvrouter (3 replicas, no sync)",
        "round_robin",
    ]
    assert all(r["ok"] == 8 for r in rows)
    capsys.readouterr()
    assert main([*args, "--router-replicas", "0"]) == 2
    assert "--router-replicas" in capsys.readouterr().err


def _live_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_live_arguments(p)
    args = p.parse_args(list(argv))
    args.policies = "kvrouter"
    return args


def test_router_processes_reach_the_fleet_and_refuse_a_router_url() -> None:
    t = targets_from_args(
        _live_args("--router-processes", "2"), workers=2, block_size=16, gpu_blocks=64, speedup=1
    )
    assert t.router_processes == 2 and t.fleet is not None
    with pytest.raises(ValueError, match="--router-processes"):
        targets_from_args(
            _live_args("--router-processes", "2", "--router-url", "http://127.0.0.1:1"),
            workers=2,
            block_size=16,
            gpu_blocks=64,
            speedup=1,
        )


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def test_the_fleets_router_runs_as_two_processes(tmp_path: Path) -> None:
    spec = FleetSpec(workers=1, gpu_blocks=256, block_size=16, speedup=10.0, ready_timeout=90)
    with open(tmp_path / "children.log", "w") as log, Fleet(spec, log=log) as fleet:
        url = fleet.start_kvrouter(processes=2)
        assert fleet.router_pid is not None and url.startswith("http://127.0.0.1:")
        # the supervisor's two serving processes were both up before start_kvrouter returned
        assert len(_children(fleet.router_pid)) == 2
        assert (fleet.router_cpu() or 0.0) > 0.0
