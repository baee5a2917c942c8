"""`swarm train --log-level`: swarm's INFO lines (a deferred held-out evaluation, a re-plan) reach stderr when asked
for, above the progress bar; by default only warnings do."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from swarm.train import trainer

SCRIPT = """
import logging, sys
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from swarm.train.trainer import configure_logging
configure_logging(sys.argv[1])
with logging_redirect_tqdm(), tqdm(total=2, desc="training", file=sys.stderr) as bar:
    logging.getLogger("swarm.train.heldout").info("held-out evaluation put off")
    logging.getLogger("swarm.runtime.driver").warning("peer evicted")
    logging.getLogger("hivemind.dht").info("hivemind chatter")
    bar.update(2)
"""


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    trainer.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_log_level_flag_takes_any_case_and_refuses_other_words():
    assert _parse().log_level == "WARNING" and _parse("--log-level", "info").log_level == "INFO"
    with pytest.raises(SystemExit):
        _parse("--log-level", "loud")


@pytest.mark.parametrize("level, shown", [("INFO", True), ("WARNING", False)])
def test_swarm_info_lines_reach_stderr_only_when_asked_for_and_hivemind_stays_at_warnings(level, shown):
    done = subprocess.run([sys.executable, "-c", SCRIPT, level], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("INFO swarm.train.heldout: held-out evaluation put off" in done.stderr) is shown, done.stderr
    assert "WARNING swarm.runtime.driver: peer evicted" in done.stderr
    assert "hivemind chatter" not in done.stderr
