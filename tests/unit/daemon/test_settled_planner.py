"""A planner that leads a quiet swarm (the plan it sees, the peers alive and the trainers unchanged for
`SETTLED_AFTER_S`, nothing left to calibrate) takes its whole look at the DHT every `SETTLED_TICK_S` like any
settled peer; between looks its heartbeats go on every second (`Planner.beat`), and a peer they find silent makes
the next look due at once. A fake DHT and a fake clock; no network, no sleeps."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.daemon.liveness import Liveness, LivenessConfig
from swarm.daemon.peer import SETTLED_AFTER_S
from swarm.daemon.peer_config import PlanningConfig
from swarm.daemon.planning import Planner
from tests.unit.daemon.test_planner_versions import SPEC, swarm
from tests.unit.daemon.test_repair import A, B, C, Clock, D, E, grid, ids, peer, record


def _quiet_swarm(silent: set[str], pinged: list[str], calibrator=None):
    current = record(3, grid([A, B], [C, D], unused=[E]).replace(trainer_ids=()))
    announced = [peer(A, 3, 0), peer(B, 3, 0), peer(C, 3, 1), peer(D, 3, 1), peer(E, 3)]
    dht, published = swarm(A, {"peers": announced, "plan": [(A, current)]})
    clock = Clock()

    def ping(pid: str) -> bool:
        pinged.append(pid)
        return pid not in silent

    live = Liveness(ping, LivenessConfig(every_s=1.0, gone_after_s=3.0), clock=clock)
    planner = Planner(
        PlanningConfig(min_peers=2, replicas=2), dht, SPEC, 2, settle_s=5.0, clock=clock, liveness=live,
        calibrator=calibrator,
    )  # fmt: skip
    return planner, clock, published, live


def test_a_planner_is_quiet_once_its_plan_peers_and_trainers_held_still_long_enough():
    silent, pinged = set(), []
    planner, clock, published, live = _quiet_swarm(silent, pinged)
    assert planner.round() is None and planner.leading
    assert not planner.quiet_for(SETTLED_AFTER_S), "it just saw the plan and the peers"
    clock.t += SETTLED_AFTER_S
    assert planner.quiet_for(SETTLED_AFTER_S) and published == []
    planner.leading = False
    assert not planner.quiet_for(SETTLED_AFTER_S), "a peer that does not lead has no swarm to be quiet about"
    live.close()
    pending = SimpleNamespace(done=False, observe=lambda plan: None)
    calibrating, clock, _, live = _quiet_swarm(set(), [], calibrator=pending)
    calibrating.round()
    clock.t += SETTLED_AFTER_S
    assert not calibrating.quiet_for(SETTLED_AFTER_S), "its calibration window is still open"
    pending.done = True
    assert calibrating.quiet_for(SETTLED_AFTER_S)
    live.close()


def test_between_looks_the_heartbeats_go_on_and_a_new_silence_makes_the_look_due():
    silent, pinged = set(), []
    planner, clock, published, live = _quiet_swarm(silent, pinged)
    planner.round()
    assert sorted(pinged) == [A, B, C, D, E], "the look's round: the plan's peers and the announced ones"
    del pinged[:]
    assert planner.beat() is False and pinged == [], "a beat within the second pings nobody"
    clock.t += 1
    assert planner.beat() is False and sorted(pinged) == [A, B, C, D, E], "one heartbeat round a second, no DHT read"
    silent.add(C)
    beats = []
    for _ in range(4):  # C silent for more than 3 s of rounds
        clock.t += 1
        beats.append(planner.beat())
    assert beats == [False, False, False, True], "only a silence past gone_after_s wakes the look"
    assert planner.beat() is True, "until a look took it in"
    planner.round()  # the look it woke repairs around C at once
    assert [ids(p) for _, p in published] == [[[A, B], [E, D]]]
    assert planner.beat() is False, "the look saw that silence: no news"
    clock.t += SETTLED_AFTER_S / 2
    planner.round()
    assert not planner.quiet_for(SETTLED_AFTER_S), "a plan just published: not quiet"
    planner.leading, before = False, len(pinged)
    clock.t += 1
    assert planner.beat() is False and len(pinged) == before, "a peer that does not lead sends no heartbeats"
    live.close()
