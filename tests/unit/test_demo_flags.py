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


def test_the_demo_takes_the_evaluations_share_of_the_run():
    """`swarm demo --rate-mbit 1` is where an evaluation's fp32 activations cost most: its trainer keeps the
    evaluations to --eval-max-share of the run like `swarm train`'s, and a share outside (0, 1] is refused."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.demo_flags().from_args(parser.parse_args([])).train.eval_max_share == 0.25
    cfg = demo.demo_flags().from_args(parser.parse_args(["--eval-max-share", "0.5"]))
    assert cfg.train.eval_max_share == 0.5
    with pytest.raises(ValueError, match="eval_max_share"):
        demo.demo_flags().from_args(parser.parse_args(["--eval-max-share", "0"]))
