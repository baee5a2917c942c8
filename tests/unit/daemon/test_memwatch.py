"""`SWARM_MEMWATCH_S`: the soak's diagnostic that logs what grows in a peer; off unless set, refused if bad."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.daemon.memwatch import start_from_env


def test_off_unless_set_and_a_bad_value_is_named():
    assert start_from_env({}) is None and start_from_env({"SWARM_MEMWATCH_S": ""}) is None
    for bad in ("soon", "0", "-5", "nan"):
        with pytest.raises(ValueError, match="SWARM_MEMWATCH_S"):
            start_from_env({"SWARM_MEMWATCH_S": bad})


def test_it_logs_the_site_and_the_type_that_grew():
    code = """
import logging, sys, threading
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from swarm.daemon.memwatch import start_from_env
class Leak: pass
kept = []
watch = start_from_env({"SWARM_MEMWATCH_S": "0.3"})
done = threading.Event()
for _ in range(400):
    kept.extend(Leak() for _ in range(100))
    if done.wait(0.005):  # allocating over the watch's looks, not a synchronisation
        break
watch.stop.set()
watch.join(5)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "memwatch: baseline taken" in out, out
    assert "Leak +" in out, out  # the object type that grew
    assert "KiB" in out and "<string>" in out, out  # the allocation site


def test_it_logs_a_module_imported_after_its_baseline_and_where():
    code = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from swarm.daemon.memwatch import start_from_env
watch = start_from_env({"SWARM_MEMWATCH_S": "0.2"})
late = next(f for f in sys.meta_path if type(f).__name__ == "_LateImports")
deadline = time.monotonic() + 60
while not late.armed and time.monotonic() < deadline:
    time.sleep(0.05)  # polling the watch's state; the deadline bounds it
import xml.dom.minidom
watch.stop.set()
watch.join(5)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "memwatch: xml imported after the baseline, at <string>:" in out, out
