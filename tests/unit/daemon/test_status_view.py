"""The status page's view, without sockets: the snapshot's shape from real records, the trainer's curves read
as they are written (torn lines, a new run's file, the CSV once it ended, bounded points), multiaddr parsing,
the plans seen, the per-client rate and JSON that is safe inside HTML."""

from __future__ import annotations

import csv
import json
import math

import pytest

from swarm.daemon.status_page import ClientRate, PageLimits, status_json
from swarm.daemon.status_view import (
    STATUS_FORMAT,
    PlanHistory,
    StepCurves,
    address_endpoint,
    maddr_endpoint,
    probe_tcp,
    status_snapshot,
)
from tests.status_fixtures import NOW, XSS, A, B, C, R, T, records, snapshot, write_steps


def test_the_snapshot_names_stages_replicas_relays_links_and_liveness(tmp_path):
    snap = snapshot(write_steps(tmp_path / "train"), hostile=False)
    assert snap["format"] == STATUS_FORMAT and snap["run"] == "demo" and snap["time"] == NOW
    assert [(s["stage"], s["layers"], [r["peer_id"] for r in s["replicas"]]) for s in snap["stages"]] == [
        (0, [0, 2], [A]),
        (1, [2, 4], [B, C]),
    ]
    peers = {p["peer_id"]: p for p in snap["peers"]}
    assert peers[A]["planner"] and peers[A]["answered"] and peers[A]["steps"] == 40.0
    assert peers[A]["sent_bytes"] == 3.2e6
    assert peers[B]["answered"] is False, "a serving peer whose Status did not answer is shown as not answering"
    assert peers[R]["answered"] is None, "a peer serving no stage is not asked"
    assert peers[C]["answered"] is None, "a peer behind NAT is not dialled: not known, not 'no'"
    assert peers[C]["reach"] == "relay" and peers[C]["relay"] == R and peers[C]["planned"] == [1, 1]
    (relay,) = snap["relays"]
    assert relay["peer_id"] == R and relay["alive"] and relay["serves"] == [C] and relay["probe"]["alive"]
    links = {(m["src"], m["dst"]): m for m in snap["links"]}
    assert links[A, B]["via"] == [] and links[A, C]["via"] == [R], "a link to a peer behind NAT goes via its relay"
    assert links[A, B]["mbit_s"] == pytest.approx(100.0) and links[A, B]["rtt_ms"] == pytest.approx(4.0)
    assert [b["alive"] for b in snap["bootstrap"]] == [True, False]
    assert snap["plan"]["version"] == 3 and snap["plan"]["standby"] == [R]
    assert snap["trainers"] == [{"peer_id": T, "age_s": 80.0, "banned": []}]
    assert [h["version"] for h in snap["plan_history"]] == [3]
    steps = snap["steps"]
    assert steps["rows"] == 40 and len(steps["loss"]) == 40 and [s for s, _ in steps["held_out"]] == [10, 20, 30, 40]
    assert steps["throughput_unit"] == "samples/s" and steps["throughput"][0] == [1, 16.0]
    assert steps["plan_steps"] == {"2": 1, "3": 21}
    assert steps["last"]["step"] == 40 and steps["last"]["held_out_loss"] == pytest.approx(5.2 / 5)
    json.dumps(snap, allow_nan=False)  # every float finite or None


def test_a_dead_relay_and_a_vanished_replica_are_shown_as_such():
    peers, links, plan, trainers = records()
    without_relay = [p for p in peers if p.peer_id != R]
    snap = status_snapshot("r", NOW, [p for p in without_relay if p.peer_id != B], links, plan, trainers)
    (relay,) = snap["relays"]
    assert relay == {
        "peer_id": R, "address": None, "announced": False, "probe": None, "alive": False, "serves": [C]
    }  # fmt: skip
    replicas = {r["peer_id"]: r for r in snap["stages"][1]["replicas"]}
    assert replicas[B]["announced"] is False and replicas[B]["address"] is None
    assert {(m["src"], m["dst"]): m["reachable"] for m in snap["links"]}[A, B] is False


def test_no_plan_no_peers_is_an_empty_view_not_an_error():
    snap = status_snapshot("empty", NOW, [], [], None)
    assert snap["plan"] is None and snap["stages"] == [] and snap["peers"] == [] and snap["steps"] is None


def test_without_a_plan_the_stages_are_those_the_peers_announce():
    peers, links, _, _ = records()
    stages = status_snapshot("r", NOW, peers, links, None)["stages"]
    assert [(s["stage"], s["layers"], [r["peer_id"] for r in s["replicas"]]) for s in stages] == [
        (0, [0, 2], [A]),
        (1, [2, 4], [B, C]),
    ]
    assert all(s["announced_only"] for s in stages)


def test_status_json_escapes_markup_and_refuses_nan():
    body = status_json({"run": XSS, "n": 1})
    assert b"<" not in body and b">" not in body and b"&" not in body
    assert json.loads(body)["run"] == XSS, "escaped as JSON, read back the same"
    with pytest.raises(ValueError):
        status_json({"x": math.nan})


def test_curves_read_only_new_complete_lines_and_skip_torn_ones(tmp_path):
    curves = StepCurves(tmp_path)
    curves.refresh()
    assert curves.error and "no steps.jsonl" in curves.error and curves.rows == 0
    path = tmp_path / "steps.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1, "train_loss": 4.0, "step_s": 0.5}) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"step": 2, "train_loss": float("nan"), "step_s": 0.5}) + "\n")
        f.write('{"step": 3, "train_lo')  # the trainer is still writing this line
    curves.refresh()
    assert curves.error is None and curves.rows == 2 and curves.loss == [(1, 4.0)], "NaN loss: no point"
    assert curves.to_json()["throughput_unit"] == "steps/s" and curves.throughput == [(1, 2.0), (2, 2.0)]
    with open(path, "a") as f:
        f.write('ss": 3.0, "step_s": 1.0}\n')
    curves.refresh()
    assert curves.rows == 3 and curves.loss[-1] == (3, 3.0)
    json.dumps(curves.to_json(), allow_nan=False)


def test_curves_start_over_on_a_new_run_and_read_the_csv_once_it_ended(tmp_path):
    write_steps(tmp_path, n=30)
    curves = StepCurves(tmp_path / "steps.csv")  # a file names its directory
    curves.refresh()
    assert curves.rows == 30
    write_steps(tmp_path, n=5)  # a new run rewrote the file: shorter than what was read
    curves.refresh()
    assert curves.rows == 5 and curves.loss[0][0] == 1
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    (tmp_path / "steps.jsonl").unlink()  # the trainer ended: steps.csv holds the rows
    with open(tmp_path / "steps.csv", "w", newline="") as f:
        columns = ["step", "train_loss", "step_s", "sample_ids", "plan_version", "time", "held_out_loss"]
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    curves.refresh()
    assert curves.rows == 5 and curves.loss == [(r["step"], r["train_loss"]) for r in rows]
    curves.refresh()
    assert curves.rows == 5, "an unchanged CSV is not read twice"


def test_curves_keep_at_most_max_points_however_long_the_run(tmp_path):
    write_steps(tmp_path, n=1000, held_every=2)
    curves = StepCurves(tmp_path, max_points=64, max_read_bytes=16 << 10)
    for _ in range(200):
        curves.refresh()
    assert curves.rows == 1000, "the file was read across refreshes, max_read_bytes at a time"
    for curve in (curves.loss, curves.held_out, curves.throughput):
        assert 32 <= len(curve) <= 64
        assert curve[0][0] <= 2 and curve[-1][0] >= 1000 - 64, "the curve still spans the run"
    steps = [s for s, _ in curves.loss]
    assert steps == sorted(steps)


def test_plan_history_keeps_newer_versions_only_and_is_bounded():
    _, _, plan, _ = records()
    history = PlanHistory(max_plans=3)
    history.see(None, 1.0)
    history.see(plan, 2.0)
    history.see(plan, 3.0)
    assert [h["seen_at"] for h in history.to_json()] == [2.0], "the same version is seen once"
    from dataclasses import replace

    for v in range(4, 9):
        history.see(replace(plan, version=v), float(v))
    assert [h["version"] for h in history.to_json()] == [6, 7, 8]
    history.see(replace(plan, version=5), 9.0)
    assert history.to_json()[-1]["version"] == 8, "an older plan read late is not history"


@pytest.mark.parametrize(
    "maddr, endpoint",
    [
        ("/ip4/127.0.0.1/tcp/4100/p2p/QmX", ("127.0.0.1", 4100)),
        ("/ip6/::1/tcp/31337", ("::1", 31337)),
        ("/dns4/boot.example.org/tcp/443/p2p/QmX", ("boot.example.org", 443)),
        ("/ip4/127.0.0.1/udp/4100/quic", None),
        ("/ip4/127.0.0.1/tcp/99999", None),
        ("/ip4/127.0.0.1/tcp/x", None),
        ("garbage", None),
        ("", None),
    ],
)
def test_maddr_endpoint(maddr, endpoint):
    assert maddr_endpoint(maddr) == endpoint


def test_address_endpoint_and_a_probe_of_nothing():
    assert address_endpoint("[::1]:4001") == ("::1", 4001) and address_endpoint("h:1") == ("h", 1)
    assert address_endpoint("nohost") is None and address_endpoint(":80") is None
    probe = probe_tcp("quic-only", None, 1.0)
    assert not probe.alive and probe.error == "no TCP address in it" and probe.rtt_ms is None


def test_client_rate_allows_a_burst_then_the_rate_and_forgets_old_clients():
    clock = [0.0]
    rate = ClientRate(PageLimits(requests_per_s=2.0, burst=3, max_clients=2), clock=lambda: clock[0])
    assert [rate.allow("a") for _ in range(4)] == [True, True, True, False]
    assert rate.allow("b"), "another client has its own bucket"
    clock[0] += 0.5  # one token back
    assert rate.allow("a") and not rate.allow("a")
    rate.allow("c")  # a third client: the least recently seen ("b") is forgotten
    assert set(rate._buckets) == {"a", "c"}
    with pytest.raises(ValueError):
        PageLimits(requests_per_s=0)


def test_status_serve_flags_are_checked():
    from swarm.daemon.status import StatusConfig, status_flags

    cfg = StatusConfig(serve=0, steps="runs/x", refresh_s=2.0)
    assert status_flags().to_argv(cfg)[-6:] == ["--serve", "0", "--steps", "runs/x", "--refresh-s", "2.0"]
    for bad in ({"serve": 70000}, {"serve": -1}, {"refresh_s": 0.0}):
        with pytest.raises(ValueError, match="StatusConfig"):
            StatusConfig(**bad)
