"""Issue 28 papercut: `swarm demo --rate-mbit 0` crashed although its help says 0 means unshaped. Every way to
say "unshaped" reaches the peers as an unshaped link, through the argv the demo renders for them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from swarm.daemon.peer_config import build_parser, config_from_args, peer_flags
from swarm.testbed import demo


@pytest.mark.parametrize("rate", ["0", "none", "inf"])
def test_an_unshaped_rate_reaches_the_peers_unshaped(rate, tmp_path: Path):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    cfg = demo.demo_flags().from_args(parser.parse_args(["--rate-mbit", rate]))
    peer = demo.peer_config(cfg, tmp_path)
    assert peer.link_shape.rate_bytes_per_s is None
    rendered = config_from_args(build_parser().parse_args(peer_flags().to_argv(peer)))
    assert rendered.link_shape.rate_bytes_per_s is None and rendered.link_shape.describe() == "unshaped"
