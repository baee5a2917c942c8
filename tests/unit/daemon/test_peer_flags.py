"""swarm-peer's flags are PeerConfig's fields: a config renders as the argv that rebuilds it, a TOML file goes
under the command line, and --help carries every field's docstring."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.compression import CodecConfig
from swarm.daemon.peer_config import PeerConfig, PlanningConfig, build_parser, config_from_args, peer_flags
from swarm.flags import field_docs
from swarm.model.gpt import ModelConfig
from swarm.peers.dht_config import DHTConfig
from swarm.peers.shaper import LinkShape
from swarm.peers.transport import TransportConfig
from swarm.runtime.budget import StageBudget
from swarm.runtime.worker import OptimConfig


def _parse(argv: list[str]) -> PeerConfig:
    return config_from_args(build_parser().parse_args(argv))


def _changed() -> PeerConfig:
    """A config that differs from the defaults in every group of flags."""
    return PeerConfig(
        dht=DHTConfig(initial_peers=("/ip4/1.2.3.4/tcp/5/p2p/Qm",), host="0.0.0.0", port=7, run_name="r"),
        transport=TransportConfig(host="0.0.0.0", max_workers=40),
        grpc_port=5001, assign="even", num_stages=3, stage=1, precision="bf16", threads=2,
        compute_layers_per_s=12.5, announce_host="10.0.0.1", announce_ttl_s=45.0, auth=False, reach="relay",
        relay=False, relay_data_port=None,
        budget=StageBudget(max_batch=64, max_micro_batches=8, max_wait_s=30.0, caller_data_calls=12,
                           min_link_rate_bytes_per_s=1e6),
        planning=PlanningConfig(min_peers=3, seed=4, replicas=2, probe_links=False, even_layers=True,
                                codec_policy="per-link", calibrate_after_steps=5, precision_budget=1e-3),
        model=ModelConfig(n_layers=2, hidden_dim=32, n_heads=2, seq_len_tokens=16, init_seed=9),
        optim=OptimConfig(lr_peak=1e-3, warmup_steps=3, total_steps=30, grad_clip_norm=None),
        fw_codec=CodecConfig.parse("aqsgd4", zstd_level=3, seed=2, group_size=64),
        bw_codec=CodecConfig.parse("gradq4+ef", zstd_level=3, seed=2, group_size=128),
        link_shape=LinkShape.from_mbit(25.0, 12.0),
        link_shapes=(("127.0.0.1:5001", LinkShape.from_mbit(10.0, 25.0)), ("10.0.0.2:5002", LinkShape.parse("none:3"))),
        checkpoint_dir="/tmp/ck", checkpoint_every=7, resume=True, replicate_every=3, leave_timeout_s=5.0,
        metrics_port=0,
    )  # fmt: skip


def test_to_argv_round_trips_a_peer_config_with_non_default_values():
    cfg = _changed()
    argv = peer_flags().to_argv(cfg)
    assert _parse(argv) == cfg
    assert _parse(peer_flags().to_argv(cfg, all=True)) == cfg
    assert "--no-auth" in argv and "--relay-data-port" in argv and argv[argv.index("--relay-data-port") + 1] == "-1"
    assert peer_flags().to_argv(PeerConfig()) == [] and _parse([]) == PeerConfig()


def test_shared_host_flag_sets_the_dht_and_the_stage_service_alike():
    cfg = _parse(["--host", "0.0.0.0", "--max-workers", "40"])
    assert cfg.dht.host == cfg.transport.host == "0.0.0.0"
    assert cfg.budget.data_calls == 32, "8 of the server's threads stay free for control calls"
    with pytest.raises(ValueError, match="--host is shared"):
        peer_flags().to_argv(PeerConfig(transport=TransportConfig(host="0.0.0.0")))


def test_a_secret_never_renders_and_a_field_without_flag_is_refused():
    with pytest.raises(ValueError, match="never goes on a command line"):
        peer_flags().to_argv(PeerConfig(dht=DHTConfig(run_secret="s3cret")))
    with pytest.raises(ValueError, match="budget"):
        peer_flags().to_argv(PeerConfig(budget=StageBudget(stale_step_s=1.0)))


def test_toml_file_goes_under_the_command_line(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text(
        'num_stages = 3\nfw-codec = "aqsgd4"\nrate_mbit = 10.0\nlink = ["127.0.0.1:5001=5:2"]\n'
        + "auth = false\nplan_seed = 5\nlink_probe = false\ngrad_clip = 0\n"
    )
    cfg = _parse(["--config", str(path), "--num-stages", "4"])
    assert cfg.num_stages == 4, "the command line wins"
    assert cfg.fw_codec == CodecConfig.parse("aqsgd4") and cfg.link_shape == LinkShape.from_mbit(10.0)
    assert cfg.link_shapes == (("127.0.0.1:5001", LinkShape.parse("5:2")),)
    assert not cfg.auth and cfg.planning.seed == 5 and not cfg.planning.probe_links and cfg.optim.grad_clip_norm is None
    # a flag given on the command line wins even when it says the default
    assert _parse(["--config", str(path), "--auth"]).auth is True


def test_toml_unknown_key_is_an_error_naming_key_and_file(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text("num_stages = 3\nnum_stagez = 4\n")
    with pytest.raises(SystemExit, match=r"peer\.toml: unknown key 'num_stagez'"):
        _parse(["--config", str(path)])


def test_help_carries_every_flag_fields_docstring(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping: a docstring's words stay as written
    text = " ".join(build_parser().format_help().split())
    flagged = {"dht", "transport", "budget", "planning", "optim", "model", "fw_codec", "bw_codec", "link_shape",
               "link_shapes"}  # fmt: skip
    for name, doc in field_docs(PeerConfig).items():
        if name not in flagged:
            assert doc in text, f"--help lacks {name}'s docstring"
    for name, doc in field_docs(PlanningConfig).items():
        assert doc in text, f"--help lacks planning.{name}'s docstring"
    assert "(default: 120.0)" in text and "--config FILE" in text


def test_every_field_of_peer_config_has_a_docstring():
    docs = field_docs(PeerConfig)
    assert [f.name for f in dataclasses.fields(PeerConfig) if f.name not in docs] == []
