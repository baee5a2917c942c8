"""`swarm bootstrap` and `swarm status` are configs (`BootstrapConfig`, `StatusConfig`): their flags, a --config
TOML file under them, and the argv that rebuilds a config, as the testbed starts and queries them."""

from __future__ import annotations

import argparse

import pytest

from swarm.daemon import bootstrap, status
from swarm.daemon.bootstrap import BootstrapConfig, bootstrap_flags
from swarm.daemon.status import StatusConfig, status_argv, status_flags
from swarm.peers.dht_config import DHTConfig

MADDR = "/ip4/127.0.0.1/tcp/4001/p2p/QmBootstrapNode"


def _parse(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_a_bootstrap_config_renders_the_argv_that_rebuilds_it():
    dht = DHTConfig(
        initial_peers=(MADDR,), host="10.0.0.2", port=31337, run_name="r", identity_path="/ids/boot.id",
        trusted_planners=("aa", "bb"),
    )  # fmt: skip
    cfg = BootstrapConfig(address_file="/run/boot.addr", dht=dht, report_s=5.0)
    argv = bootstrap_flags().to_argv(cfg)
    assert argv[argv.index("--identity-path") + 1] == "/ids/boot.id"
    assert bootstrap_flags().from_args(_parse(bootstrap.add_arguments, argv)) == cfg
    assert bootstrap_flags().to_argv(BootstrapConfig()) == []


def test_bootstrap_flags_keep_their_defaults_and_verbose_stays_a_process_flag():
    args = _parse(bootstrap.add_arguments, ["-v"])
    assert args.verbose and bootstrap_flags().from_args(args) == BootstrapConfig()
    assert BootstrapConfig().report_s == 60.0 and BootstrapConfig().dht == DHTConfig()


def test_status_reads_a_toml_file_under_its_flags(tmp_path):
    toml = tmp_path / "status.toml"
    toml.write_text('address-file = "/run/a.addr"\ntimeout_s = 3.5\njson = true\nrun-name = "from-file"\n')
    args = _parse(status.add_arguments, ["--config", str(toml), "--run-name", "from-flag"])
    cfg = status_flags().from_args(args)
    assert cfg.address_file == "/run/a.addr" and cfg.timeout_s == 3.5 and cfg.json
    assert cfg.dht.run_name == "from-flag", "a flag on the command line overrides the file"


def test_status_joins_through_the_address_file_in_client_mode_bounded_by_its_timeout(tmp_path):
    other = "/ip4/127.0.0.2/tcp/4002/p2p/QmOtherNode"
    addr = tmp_path / "boot.addr"
    bootstrap.write_address_file(str(addr), [MADDR, other])
    cfg = StatusConfig(str(addr), DHTConfig(initial_peers=(MADDR,)), timeout_s=7.0)
    dht = cfg.dht_config()
    assert dht.initial_peers == (MADDR, other), "each peer once, --initial-peers first"
    assert dht.client_mode and dht.start_timeout_s == 7.0 and dht.request_timeout_s == 7.0
    with pytest.raises(ValueError, match="nothing to join"):
        StatusConfig().dht_config()
    with pytest.raises(OSError):
        StatusConfig(address_file=str(tmp_path / "missing")).dht_config()


def test_the_testbeds_status_query_parses_back_to_its_config():
    argv = status_argv("/run/boot.addr", "10.77.0.3", timeout_s=15.0)
    cfg = status_flags().from_args(_parse(status.add_arguments, argv))
    assert cfg == StatusConfig("/run/boot.addr", DHTConfig(host="10.77.0.3"), json=True, timeout_s=15.0)
