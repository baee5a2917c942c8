"""The testbed without root or Docker: services and their argv (parsed by the real entry points' parsers),
the ip/tc commands, config validation, and docker/ checked statically against the namespace testbed."""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from swarm import cli
from swarm.model.gpt import ModelConfig
from swarm.testbed import lifecycle, netns, services
from swarm.testbed import testbed_cli as testbed
from swarm.testbed.compose import SHARED_DIR, compose_config, compose_service, entrypoint_argv, render_compose
from swarm.testbed.netns import lay_out_testbed, setup_commands, shaping_commands, tbf_burst_bytes, tbf_limit_bytes
from swarm.testbed.services import METRICS_PORT, PEER_PORT, LinkRate, process_argv
from swarm.testbed.testbed_status import metrics_url, render_status
from swarm.train.trainer import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
RICH = services.TestbedConfig(
    peers=3,
    egress=services.Egress(50.0),
    peer_rate_mbit=(100, 0),
    links=(LinkRate("peer0", "peer1", 10, 40), LinkRate("peer1", "peer2", None, 25), LinkRate("trainer", "peer0", 5)),
    delay_ms=20,
    fw_codec="directq4",
    bw_codec="gradq8+ef",
    layers=2,
    hidden=32,
    heads=2,
    seq_len=16,
    steps=7,
    peer_flags=("--lr", "0.01"),
    trainer_flags=("--schedule", "gpipe"),
)


def parse_entry_point(argv: list[str] | tuple[str, ...]) -> argparse.Namespace:
    """Parses argv with the real parser of its installed entry point (`swarm SUBCOMMAND` or `swarm-peer`)."""
    argv = list(argv)
    try:
        if argv[0] == "swarm-peer":
            from swarm.daemon.peer import build_parser

            return build_parser().parse_args(argv[1:])
        assert argv[0] == "swarm", f"{argv[0]!r} is not an entry point"
        parser, leaves = cli._build_parser()
        path = next((p for p in leaves if tuple(argv[1 : 1 + len(p)]) == p), None)
        assert path is not None, f"`swarm {argv[1]}` is not a swarm subcommand"
        importlib.import_module(cli.COMMANDS[path][0]).add_arguments(leaves[path])
        return parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"the entry point rejects: {shlex.join(argv)}")


# ---- services ---------------------------------------------------------------------------------------------


def test_services_are_bootstrap_peers_trainer_on_fixed_subnet_addresses():
    started = services.testbed_services(services.TestbedConfig(peers=3), "/run")
    assert [s.name for s in started] == ["bootstrap", "peer0", "peer1", "peer2", "trainer"]
    assert [s.address for s in started] == ["10.77.0.2", "10.77.0.10", "10.77.0.11", "10.77.0.12", "10.77.0.3"]
    assert [s.argv[:2] for s in started] == [("swarm", "bootstrap")] + [("swarm-peer", "--address-file")] * 3 + [
        ("swarm", "train")
    ]
    assert all(s.rate_mbit == 100 and not s.link_rate_mbit for s in started)


@pytest.mark.parametrize("cfg", [services.TestbedConfig(), RICH], ids=["default", "rich"])
def test_every_service_argv_is_accepted_by_its_entry_point(cfg):
    for service in services.testbed_services(cfg, "/run"):
        args = parse_entry_point(service.argv)
        assert args.host == service.address
        assert args.address_file == "/run/bootstrap.addr"
        if service.name != "bootstrap":
            assert args.metrics_port == METRICS_PORT, "every peer and the trainer serve /metrics at their address"
        if service.name.startswith("peer"):
            assert (args.num_stages, args.grpc_port, args.fw_codec, args.bw_codec) == (
                cfg.peers,
                PEER_PORT,
                cfg.fw_codec,
                cfg.bw_codec,
            )
            assert args.rate_mbit is None, "bandwidth is the kernel's job, not the app shaper's"
            assert args.delay_ms == cfg.delay_ms
        if service.name == "trainer":
            assert args.num_stages == cfg.peers


def test_rich_config_rates_delays_and_flags_reach_the_right_services():
    by_name = {s.name: s for s in services.testbed_services(RICH, "/run")}
    assert [by_name[f"peer{i}"].rate_mbit for i in range(3)] == [100, None, 50]
    assert by_name["bootstrap"].rate_mbit == by_name["trainer"].rate_mbit == 50
    assert by_name["peer0"].link_rate_mbit == (("10.77.0.11", 10),)
    assert by_name["peer1"].link_rate_mbit == ()  # its link to peer2 changes only the delay
    assert by_name["trainer"].link_rate_mbit == (("10.77.0.10", 5),)
    peer0, peer1 = (parse_entry_point(by_name[n].argv) for n in ("peer0", "peer1"))
    assert peer0.link == [f"10.77.0.11:{PEER_PORT}=none:40"] and peer1.link == [f"10.77.0.12:{PEER_PORT}=none:25"]
    assert peer0.lr == 0.01 and (peer0.layers, peer0.hidden, peer0.heads, peer0.seq_len) == (2, 32, 2, 16)
    assert (peer0.total_steps, peer0.warmup_steps) == (7, 1)
    trainer = parse_entry_point(by_name["trainer"].argv)
    assert (trainer.steps, trainer.schedule, trainer.layers, trainer.out) == (7, "gpipe", 2, "/run/train")


def test_process_argv_runs_entry_points_with_this_interpreter():
    assert process_argv(("swarm-peer", "--x")) == [sys.executable, "-m", "swarm.daemon.peer", "--x"]
    assert process_argv(("swarm", "train")) == [sys.executable, "-m", "swarm.cli", "train"]
    with pytest.raises(ValueError):
        process_argv(("bash", "-c", "true"))


# ---- namespaces, links, shaping ---------------------------------------------------------------------------


def test_setup_commands_name_everything_with_the_prefix():
    plan = lay_out_testbed(RICH, "/run")
    commands = setup_commands(plan)
    assert commands[0] == ["ip", "link", "add", "swt-br0", "type", "bridge"]
    for node in plan.nodes:
        for name in (node.namespace, node.veth_root, node.veth_ns):
            assert name.startswith("swt-")
        assert len(node.veth_root) <= 15 and len(node.veth_ns) <= 15, "Linux interface names are at most 15 bytes"
        ns = node.namespace
        assert ["ip", "netns", "add", ns] in commands
        assert ["ip", "-n", ns, "link", "set", "lo", "up"] in commands
        assert ["ip", "-n", ns, "addr", "add", f"{node.service.address}/24", "dev", node.veth_ns] in commands
        assert ["ip", "link", "set", node.veth_root, "master", "swt-br0", "up"] in commands
    for command in commands:
        if command[0] == "tc" or "gso_max_size" in command:
            assert command[1:3] == ["-n", command[2]] and command[2].startswith("swt-")
    addresses = [ipaddress.ip_address(n.service.address) for n in plan.nodes]
    assert len(set(addresses)) == len(addresses)
    assert all(a in ipaddress.ip_network(RICH.subnet) for a in addresses)


def test_single_rate_is_tbf_with_a_queue_for_two_gso_packets():
    gso, command = shaping_commands("swt-1b", 10.0, netns="swt-peer0")
    assert gso == ["ip", "-n", "swt-peer0", "link", "set", "dev", "swt-1b", "gso_max_size", "16384"]
    assert command[:9] == ["tc", "-n", "swt-peer0", "qdisc", "replace", "dev", "swt-1b", "root", "tbf"]
    opts = dict(zip(command[9::2], command[10::2], strict=True))
    assert opts["rate"] == "10mbit"
    assert int(opts["burst"]) >= 10 * 1514
    assert int(opts["limit"]) >= 2 * 65536 + int(opts["burst"])
    assert tbf_burst_bytes(1000) >= 1000e6 / 8 / 250, "a 1 Gbit/s bucket must cover a 250 Hz tick"
    assert tbf_limit_bytes(1000) >= 1000e6 / 8 * 0.05
    assert shaping_commands("eth0", None) == []


def test_per_link_rates_are_htb_classes_with_a_filter_per_destination():
    commands = shaping_commands("eth0", 50.0, (("10.77.0.11", 10.0), ("10.77.0.3", 5.0)))
    text = [" ".join(c) for c in commands[1:]]
    assert commands[0] == ["ip", "link", "set", "dev", "eth0", "gso_max_size", "16384"]
    assert text[0] == "tc qdisc replace dev eth0 root handle 1: htb default 1"
    assert text[1].startswith("tc class add dev eth0 parent 1: classid 1:1 htb rate 50mbit ")
    assert text[2].startswith("tc class add dev eth0 parent 1: classid 1:10 htb rate 10mbit ")
    assert text[3] == "tc filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.77.0.11/32 flowid 1:10"
    assert text[4].startswith("tc class add dev eth0 parent 1: classid 1:11 htb rate 5mbit ")
    assert text[5].endswith("match ip dst 10.77.0.3/32 flowid 1:11")
    unshaped_default = shaping_commands("eth0", None, (("10.77.0.11", 10.0),))
    assert unshaped_default[1][-2:] == ["default", "0"], "unclassified traffic passes unshaped"
    assert not any("classid 1:1 " in " ".join(c) + " " for c in unshaped_default)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefix": "swt"},
        {"prefix": "Swarm-"},
        {"prefix": "toolong-"},
        {"subnet": "8.8.8.0/24"},
        {"subnet": "fd00::/64"},
        {"subnet": "10.77.0.0/29"},
        {"peer_rate_mbit": (1, 2, 3)},
        {"links": (LinkRate("peer0", "peer7", 10),)},
        {"peers": 0},
        {"train_samples": 4},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        services.TestbedConfig(**kwargs)


def test_egress_rejects_a_negative_rate():
    with pytest.raises(ValueError):
        services.Egress(-1)


def test_link_parse_and_validation():
    assert LinkRate.parse("peer0:peer1=10:40") == LinkRate("peer0", "peer1", 10.0, 40.0)
    assert LinkRate.parse("trainer:peer0=5") == LinkRate("trainer", "peer0", 5.0, 0.0)
    assert LinkRate.parse("peer1:peer0=none:25") == LinkRate("peer1", "peer0", None, 25.0)
    for bad in ("peer0=10", "peer0:peer1", "peer0:peer0=1", "peer0:nobody=1", "trainer:peer0=5:10", "peer0:peer1=0"):
        with pytest.raises(ValueError):
            LinkRate.parse(bad)


def test_sweep_helpers_parse_ip_output(monkeypatch):
    outputs = {
        ("ip", "netns", "list"): "swt-peer0 (id: 1)\nother (id: 0)\nswt-bootstrap\n",
        ("ip", "-o", "link", "show"): "1: lo: <LOOPBACK> mtu 65536\n5: swt-0a@if4: <UP> mtu 1500\n"
        "7: swt-br0: <UP> mtu 1500\n9: vethX@if8: <UP>\n",
        ("ip", "netns", "pids", "swt-peer0"): "123\n456\n",
    }
    fake = lambda argv, **_: subprocess.CompletedProcess(argv, 0, outputs[tuple(argv)], "")  # noqa: E731
    monkeypatch.setattr(netns, "run_command", fake)
    assert netns.list_namespaces("swt-") == ["swt-bootstrap", "swt-peer0"]
    assert netns.list_links("swt-") == ["swt-0a", "swt-br0"]
    assert netns.namespace_pids("swt-peer0") == [123, 456]


# ---- the CLI ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["up", "status", "down", "measure"])
def test_without_root_it_says_so_and_points_to_the_app_shaper(monkeypatch, capsys, action):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["testbed", action]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "swarm demo --rate-mbit" in err


def test_cli_flags_build_the_config(capsys):
    argv = ["testbed", "compose", "--peers", "3", "--peer-rate-mbit", "100,10", "--link", "peer0:peer1=5:20"]
    argv += ["--delay-ms", "7", "--fw-codec", "fp32", "--layers", "2"]
    assert cli.main(argv) == 0
    parser, leaves = cli._build_parser()
    testbed.add_arguments(leaves[("testbed",)])
    cfg = testbed.config_from_args(parser.parse_args(argv))
    assert cfg.peer_rate_mbit == (100.0, 10.0) and cfg.links == (LinkRate("peer0", "peer1", 5.0, 20.0),)
    assert (cfg.delay_ms, cfg.fw_codec, cfg.layers, cfg.peers) == (7.0, "fp32", 2, 3)
    assert capsys.readouterr().out == render_compose(cfg)


def test_scenario_gives_every_ordered_peer_pair_a_link():
    cfg = services.TestbedConfig(peers=3, links=testbed._scenario_links("worldwide", 3, 0.5))
    assert {(link.src, link.dst) for link in cfg.links} == {
        (f"peer{i}", f"peer{j}") for i in range(3) for j in range(3) if i != j
    }
    assert all(link.rate_mbit > 0 and link.delay_ms >= 0 for link in cfg.links)
    for service in services.testbed_services(cfg, "/run"):
        parse_entry_point(service.argv)


def test_status_prints_the_metrics_urls_of_the_services_serving_them():
    nodes = {
        s.name: {"name": s.name, "address": s.address, "argv": list(s.argv)}
        for s in services.testbed_services(RICH, "/run")
    }
    urls = {name: metrics_url(node) for name, node in nodes.items()}
    assert urls["bootstrap"] is None
    assert urls["peer2"] == f"http://10.77.0.12:{METRICS_PORT}/metrics"
    assert urls["trainer"] == f"http://10.77.0.3:{METRICS_PORT}/metrics"
    rows = [
        {"service": name, "namespace": f"swt-{name}", "address": node["address"], "shaping": "unshaped",
         "sent_bytes": None, "drops": None, "processes": [], "metrics_url": urls[name]}
        for name, node in nodes.items()
    ]  # fmt: skip
    text = render_status({"namespaces": rows, "links": [], "trained": None, "train_command": None, "prefix": "swt-"})
    assert [line.split()[0] for line in text.splitlines() if "/metrics" in line and "curl" not in line] == [
        "peer0", "peer1", "peer2", "trainer"
    ]  # fmt: skip
    assert all(url in text for url in urls.values() if url)


def test_shape_dry_run_prints_the_shaping_commands(capsys):
    assert cli.main(["testbed", "shape", "--rate-mbit", "20", "--to", "10.77.0.11=5", "--dry-run"]) == 0
    expected = [" ".join(c) for c in shaping_commands("eth0", 20.0, (("10.77.0.11", 5.0),))]
    assert capsys.readouterr().out.splitlines() == expected


def test_run_in_testbed_maps_the_throttled_experiments_cell(monkeypatch, tmp_path):
    seen = {}

    def fake_bring_up(cfg, run_dir, say, ready_timeout_s=120.0):
        seen["cfg"] = cfg
        (run_dir / "train").mkdir(parents=True)
        (run_dir / "train" / "steps.csv").write_text("step,train_loss\n1,5.5\n")
        return lifecycle.Testbed(lay_out_testbed(cfg, str(run_dir)), run_dir, None)

    monkeypatch.setattr(testbed, "bring_up", fake_bring_up)
    monkeypatch.setattr(testbed, "train_in", lambda *a, **k: 0)
    monkeypatch.setattr(testbed, "take_down", lambda *a, **k: (0, 0, 0))
    from swarm.daemon.peer_config import PeerConfig
    from swarm.options import CodecFlags
    from swarm.peers.shaper import LinkShape
    from swarm.runtime.worker import OptimConfig

    peer = PeerConfig(
        link_shape=LinkShape.from_mbit(10.0, 5.0), optim=OptimConfig(total_steps=8, warmup_steps=1),
        **CodecFlags("aqsgd2", "gradq4").build(),
    )  # fmt: skip
    train_cfg = TrainConfig(
        model=ModelConfig(init_seed=3), train_samples=16, batch_size=8, micro_batches=4, steps=8,
        setting="aqsgd2/gradq4", deadline_s=300.0, out=str(tmp_path / "cell"),
    )  # fmt: skip
    rows = testbed.run_in_testbed(10.0, peer, train_cfg, peers=2)
    assert rows == [{"step": "1", "train_loss": "5.5"}]
    cfg = seen["cfg"]
    assert (cfg.egress.rate_mbit, cfg.delay_ms, f"{cfg.fw_codec}/{cfg.bw_codec}", cfg.steps) == (
        10.0,
        5.0,
        "aqsgd2/gradq4",
        8,
    )
    assert cfg.peers == 2 and (cfg.layers, cfg.hidden, cfg.seq_len) == (4, 128, 128)
    for service in services.testbed_services(cfg, "/run"):
        args = parse_entry_point(service.argv)
        if service.name != "bootstrap":
            assert args.model_seed == 3, "peers and trainer start from the same weights"
        if service.name == "trainer":
            assert (args.steps, args.setting, args.deadline_s, args.schedule) == (8, "aqsgd2/gradq4", 300.0, "1f1b")
        if service.name.startswith("peer"):
            assert (args.rate_mbit, args.total_steps, args.delay_ms) == (None, 8, 5.0)


# ---- docker/ ----------------------------------------------------------------------------------------------


def test_committed_compose_file_is_the_generated_one():
    assert (DOCKER / "compose.yaml").read_text() == render_compose(services.TestbedConfig()), (
        "regenerate it: swarm testbed compose > docker/compose.yaml"
    )


@pytest.mark.parametrize("cfg", [services.TestbedConfig(), RICH], ids=["committed", "rich"])
def test_compose_runs_the_namespace_testbeds_services(cfg):
    yaml = pytest.importorskip("yaml")
    text = (DOCKER / "compose.yaml").read_text() if cfg == services.TestbedConfig() else render_compose(cfg)
    doc = yaml.safe_load(text)
    cfg = compose_config(cfg)  # the same services in compose's own subnets (test_compose_subnets_are_its_own)
    expected = {s.name: s for s in services.testbed_services(cfg, SHARED_DIR)}
    assert list(doc["services"]) == list(expected)
    assert doc["networks"]["swarm"]["ipam"]["config"] == [{"subnet": cfg.subnet}]
    for name, svc in doc["services"].items():
        service = expected[name]
        command, env = svc["command"], {k: str(v) for k, v in svc["environment"].items()}
        parse_entry_point(command)  # a real entry point with real flags
        assert entrypoint_argv(command, env) == list(service.argv), f"{name} differs from the namespace testbed"
        assert float(env["RATE"]) == (service.rate_mbit or 0)
        assert env["LINKS"].split() == [f"{a}={r:g}" for a, r in service.link_rate_mbit]
        assert svc["networks"]["swarm"]["ipv4_address"] == service.address
        assert "NET_ADMIN" in svc["cap_add"] and f"shared:{SHARED_DIR}" in svc["volumes"]
        assert svc["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
        if name != "bootstrap":  # /metrics reachable from the host's loopback, on a port docker picks
            assert svc["ports"] == [f"127.0.0.1::{METRICS_PORT}"] and svc["expose"] == [str(METRICS_PORT)]
        if name == "bootstrap":
            assert svc["healthcheck"]["test"] == ["CMD", "test", "-s", f"{SHARED_DIR}/bootstrap.addr"]
        else:
            assert svc["depends_on"]["bootstrap"] == {"condition": "service_healthy"}


def test_entrypoint_shapes_like_the_namespace_testbed_and_hands_delay_to_the_peer():
    for service in services.testbed_services(RICH, SHARED_DIR):
        command, env = compose_service(service)
        result = subprocess.run(
            ["sh", str(DOCKER / "entrypoint.sh"), *command],
            env={"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SWARM_DRY_RUN": "1", **env},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        tc_lines, argv = result.stdout.split("--\n")
        expected_tc = shaping_commands("eth0", service.rate_mbit, service.link_rate_mbit)
        assert tc_lines.splitlines() == [" ".join(c) for c in expected_tc], service.name
        assert argv.splitlines() == list(service.argv), service.name


def test_dockerfile_installs_the_project_with_cpu_torch_and_the_entrypoint():
    """The base image is a build argument (python:3.11-slim where a registry is reachable), torch is pinned to
    the CPU build so an ignored wheel source fails the build instead of pulling CUDA torch."""
    text = (DOCKER / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[:2] == ["ARG BASE_IMAGE=python:3.11-slim", "FROM ${BASE_IMAGE} AS system"]
    assert any("iproute2" in line for line in lines), "the entrypoint needs tc"
    assert "ARG TORCH=torch==2.13.0+cpu" in lines and "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in lines
    assert any('pip install --find-links /tmp/wheels $index "$TORCH"' in line for line in lines)
    assert lines.index("FROM system") > next(i for i, line in enumerate(lines) if "$TORCH" in line), (
        "the wheel stays in the build stage"
    )
    assert lines.index("COPY --from=build /opt/venv /opt/venv") == lines.index("FROM system") + 1
    assert any(line.startswith("RUN pip install --no-deps .") for line in lines), "the project on the venv"
    assert 'ENTRYPOINT ["/opt/swarm/docker/entrypoint.sh"]' in lines
    assert os.access(DOCKER / "entrypoint.sh", os.X_OK)


def test_compose_subnets_are_its_own():
    """A compose run and a namespace testbed share one host: the default subnets move, explicit ones stay."""
    ns_default = services.TestbedConfig(nat=(1,))
    moved = compose_config(ns_default)
    for a, b in ((moved.subnet, ns_default.subnet), (moved.nat_subnet, ns_default.nat_subnet)):
        assert not ipaddress.ip_network(a).overlaps(ipaddress.ip_network(b))
    assert not ipaddress.ip_network(moved.subnet).overlaps(ipaddress.ip_network(ns_default.nat_subnet))
    assert moved.subnet == "10.177.0.0/24" and {s.address for s in services.testbed_services(moved, "/x")} == {
        "10.177.0.2", "10.177.0.3", "10.177.0.10", "10.178.0.26"
    }  # fmt: skip
    explicit = services.TestbedConfig(subnet="10.99.0.0/24", nat_subnet="10.98.0.0/20")
    assert compose_config(explicit) == explicit
    assert "10.77." not in (DOCKER / "compose.yaml").read_text()


def test_testbed_peers_default_to_the_swarms_codecs():
    from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
    from swarm.testbed.services import TestbedConfig

    cfg = TestbedConfig()
    assert (cfg.fw_codec, cfg.bw_codec) == (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC)
    assert CodecConfig.parse(DEFAULT_BACKWARD_CODEC).group_size == 256  # parses, with its own group size


def test_every_tc_command_shares_one_egress_flag():
    from swarm.flags import Flags

    up = Flags(testbed.Up).parse(["--rate-mbit", "20"])
    shape = Flags(testbed.Shape).parse(["--rate-mbit", "20"])
    assert up.layout.testbed.egress == shape.egress == services.Egress(20.0)
    assert Flags(testbed.Up).parse([]).layout.testbed.egress.rate_mbit == 100.0  # each command keeps its default
    assert Flags(testbed.Shape).parse([]).egress.rate_mbit == 0.0


def test_testbed_actions_round_trip_and_read_toml(tmp_path):
    from swarm.flags import Flags

    flags = Flags(testbed.Up)
    up = testbed.Up(
        testbed.Layout(services.TestbedConfig(peers=3, egress=services.Egress(10.0), nat=(1,)), scenario_scale=0.5),
        testbed.Location("runs/x", "abc-"), train=True, ready_timeout_s=30.0,
    )  # fmt: skip
    assert flags.parse(flags.to_argv(up)) == up
    shape = testbed.Shape(dev="veth0", egress=services.Egress(5.0), to=("10.0.0.2=1", "10.0.0.3=2"), dry_run=True)
    assert Flags(testbed.Shape).parse(Flags(testbed.Shape).to_argv(shape)) == shape
    path = tmp_path / "up.toml"
    path.write_text('peers = 4\nrate-mbit = 30.0\nprefix = "tb-"\ntrain = true\n')
    parser = argparse.ArgumentParser()
    testbed.add_arguments(parser)
    cfg = testbed.config_from_args(parser.parse_args(["up", "--config", str(path), "--rate-mbit", "40"]))
    assert (cfg.peers, cfg.egress.rate_mbit, cfg.prefix) == (4, 40.0, "tb-")
    with pytest.raises(ValueError, match="expected ADDR=RATE"):
        testbed.Shape(to=("10.0.0.2",)).links()


def test_the_bootstrap_service_argv_is_its_config_rendered():
    from swarm.daemon.bootstrap import bootstrap_flags

    boot = next(s for s in services.testbed_services(services.TestbedConfig(), "/run") if s.name == "bootstrap")
    cfg = bootstrap_flags().parse(list(boot.argv[2:]))
    assert (cfg.dht.host, cfg.dht.port) == (boot.address, services.BOOTSTRAP_PORT)
    assert cfg.dht.identity_path == "/run/bootstrap.id" and cfg.address_file == f"/run/{services.ADDRESS_FILE}"
