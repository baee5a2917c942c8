"""A peer's footprint: `swarm bench footprint`'s reading of a process tree, and the peer's lean torch (no
torch._dynamo, sympy or triton for an optimizer that never compiles), with the same arithmetic as torch's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from swarm.bench.footprint import TARGET_MB, FootprintConfig, measure_tree, summed_row
from swarm.flags import Flags

TRAIN = """
import json, sys, torch
if sys.argv[1] == "lean":
    from swarm.daemon.lean import skip_dynamo
    assert skip_dynamo()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
for _ in range(5):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
opt.load_state_dict(opt.state_dict())
assert torch.is_grad_enabled(), "step must restore grad mode"
with torch.no_grad():
    weights = [round(float(p.sum()), 7) for p in model.parameters()]
print(json.dumps({"weights": weights, "dynamo": "torch._dynamo" in sys.modules, "sympy": "sympy" in sys.modules}))
"""


def _fresh_lines(code: str, env=None) -> list[str]:
    """The output lines of `code` run in a fresh interpreter (this one's), which must exit 0."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def _train(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", TRAIN, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_lean_peer_trains_exactly_like_torch_without_importing_its_compiler():
    plain, lean = _train("plain"), _train("lean")
    assert lean["weights"] == plain["weights"], "skip_dynamo changed the optimizer's arithmetic"
    assert plain["dynamo"], "torch no longer imports dynamo for an optimizer: skip_dynamo may be dropped"
    assert not lean["dynamo"] and not lean["sympy"], "an optimizer step still imports torch's compiler"


def test_skip_dynamo_leaves_a_process_that_already_has_dynamo_alone():
    code = "import torch._dynamo\nfrom swarm.daemon.lean import skip_dynamo\nprint(skip_dynamo())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_measure_tree_reads_rss_pss_and_uss_of_a_tree_and_sums_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rows = measure_tree(os.getpid())
        assert rows[0]["role"] == "peer" and rows[0]["process"].endswith(str(os.getpid()))
        assert any(r["process"].endswith(str(child.pid)) and r["role"] == "dht" for r in rows)
        for r in rows:
            assert 0 < r["uss_mb"] <= r["pss_mb"] <= r["rss_mb"] + 0.1 and r["threads"] >= 1
        total = summed_row("peer0", rows)
        assert total["rss_mb"] == pytest.approx(sum(r["rss_mb"] for r in rows), abs=0.2)
        assert total["processes"] == len(rows)
        assert total["verdict"] == ("PASS" if total["pss_mb"] <= TARGET_MB else "FAIL")
    finally:
        child.kill()
        child.wait()
    assert measure_tree(child.pid) == [], "a reaped process has no tree"


def test_an_empty_tree_fails_rather_than_passing_with_zero_megabytes():
    assert summed_row("peer0", [])["verdict"] == "FAIL"


def test_footprint_flags_round_trip():
    flags = Flags(FootprintConfig)
    cfg = FootprintConfig(steps=5, peers=3, settle_s=0.5, out="x", json=True)
    assert flags.parse(flags.to_argv(cfg)) == cfg


def test_cap_arenas_leaves_a_users_malloc_arena_max_alone(monkeypatch):
    from swarm.daemon.lean import cap_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert cap_arenas() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    code = "from swarm.daemon.lean import cap_arenas; print(cap_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip() == "True", done.stderr[-2000:]  # glibc here


def test_a_daemon_process_shares_hivemind_tensors_without_a_torch_shm_manager():
    code = (
        "import swarm.daemon.peer, torch.multiprocessing as m, os; "
        "print(m.get_sharing_strategy(), os.environ['HIVEMIND_MEMORY_SHARING_STRATEGY'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.stdout.split()[-2:] == ["file_descriptor", "file_descriptor"], done.stderr[-2000:]
    env["HIVEMIND_MEMORY_SHARING_STRATEGY"] = "file_system"  # a user's choice stands
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.stdout.split()[-2:] == ["file_system", "file_system"], done.stderr[-2000:]


def test_a_daemon_imports_hivemind_without_its_averager_optimizer_or_moe_until_asked():
    code = (
        "import sys, swarm.daemon.peer, swarm.peers.dht, swarm.net.dhtmode\n"
        "print(sorted(m for m in ('hivemind.moe', 'hivemind.optim', 'scipy', 'pydantic') if m in sys.modules))\n"
        "import hivemind\n"
        "print(hivemind.__version__, hivemind.DHT.__name__, 'hivemind.moe' in sys.modules)\n"
        "from swarm.daemon.lean import defer_hivemind_init\n"
        "print(defer_hivemind_init())\n"
    )
    lines = _fresh_lines(code)
    assert lines[0] == "[]", "hivemind's package __init__ ran (scipy, pydantic, MoE: ~50 MB)"
    version, cls, moe = lines[1].split()
    assert cls == "DHT" and moe == "True", "a lookup on the package must run its __init__, as a plain import would"
    assert lines[2] == "False", "hivemind is imported already: nothing to defer"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stage_backward_gives_torchs_gradients_exactly(dtype):
    from swarm.runtime.worker import backward

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(dtype)
    x = torch.randn(3, 8, dtype=dtype)
    g = torch.randn(3, 8, dtype=dtype)
    g[0, 0], g[1, 1] = float("inf"), float("nan")
    results = []
    for how in ("torch", "swarm"):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(g) if how == "torch" else backward(out, g)
        results.append([xi.grad, layer.weight.grad, layer.bias.grad])
    for ref, got in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    scalar = torch.tensor(2.0, requires_grad=True)
    backward(scalar * 3, torch.tensor(0.25))  # the last stage: a loss and its micro-batch's weight
    assert scalar.grad.item() == 0.75


def test_a_peers_backward_and_planning_import_neither_sympy_nor_scipy():
    code = (
        "import sys, torch, swarm.daemon.peer\n"
        "from swarm.runtime.worker import backward\n"
        "from swarm.scheduler.graph import bottleneck_assignment\n"
        "x = torch.randn(4, 4, requires_grad=True)\n"
        "backward(x * 2, torch.ones(4, 4))\n"
        "bottleneck_assignment(torch.ones(1, 1).numpy())\n"
        "print(sorted(m for m in ('sympy', 'scipy') if m in sys.modules))\n"
        "import numpy as np\n"
        "print(bottleneck_assignment(np.array([[1.0, 5.0], [2.0, 1.0]]))[0], 'scipy' in sys.modules)\n"
    )
    lines = _fresh_lines(code)
    assert lines[0] == "[]", "a stage's backward or a one-replica plan imported sympy or scipy (~38 MB each)"
    assert lines[1] == "1.0 True"  # pairing replicas loads scipy when it is needed


def test_a_peer_pricing_a_plan_does_not_import_torchs_compiler():
    """A peer's planning loop prices the replicas' sum from one layer built on the meta device; the seeded draw
    of its init once ran there through torch's Python reference, whose first call imported torch._dynamo (1.2
    CPU-s and ~140 MB of RSS in every peer). Its shapes are still those of a layer built for real."""
    code = (
        "import sys, torch, swarm.daemon.peer\n"
        "from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig\n"
        "from swarm.model.gpt import ModelConfig\n"
        "from swarm.model.spec import build_stage\n"
        "from swarm.scheduler.sizes import layer_shapes, model_spec\n"
        "codecs = [CodecConfig.parse(c) for c in (DEFAULT_FORWARD_CODEC, DEFAULT_BACKWARD_CODEC)]\n"
        "model_spec(ModelConfig(), *codecs, 2, 4)\n"
        "meta = layer_shapes(ModelConfig())\n"
        "print('torch._dynamo' in sys.modules)\n"
        "real = build_stage(ModelConfig(), 1, 2, False, False)\n"
        "print(meta == tuple(tuple(p.shape) for _, p in sorted(real.named_parameters())))\n"
    )
    assert _fresh_lines(code) == ["False", "True"]


def test_the_soaks_sample_reads_rss_threads_and_fds_and_pss_only_when_asked():
    from swarm.bench.soak import sample_tree, slope_per_1k, summed

    quick, full = sample_tree(os.getpid()), sample_tree(os.getpid(), full=True)
    assert next(iter(quick)).endswith(str(os.getpid())) and list(quick) == list(full)
    first = next(iter(quick.values()))
    assert first.pss_mib is None and first.uss_mib is None and first.fds > 0 and first.threads >= 1
    assert all(0 < s.uss_mib <= s.pss_mib <= s.rss_mib + 0.1 for s in full.values())
    assert summed(quick).processes == len(quick) and summed({}) is None
    assert slope_per_1k([0, 1000, 2000], [10.0, 10.5, 11.0]) == pytest.approx(0.5)
    assert slope_per_1k([5, 5], [1.0, 2.0]) is None


def test_a_process_pss_splits_into_anonymous_and_file_pages_and_its_threads_are_counted_by_name():
    import threading

    from swarm.bench.footprint import read_pss_split, thread_names

    split = read_pss_split(os.getpid())
    if split is None:
        pytest.skip("this kernel's smaps_rollup has no Pss_Anon")
    anon, file = split
    assert anon > 0 and file > 0
    before = sum(thread_names(os.getpid()).values())
    assert before == len(os.listdir(f"/proc/{os.getpid()}/task")), "every thread is counted under some name"
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait, name=f"fpworker_{i}") for i in range(3)]
    for w in workers:
        w.start()
    try:
        assert sum(thread_names(os.getpid()).values()) == before + 3
        assert not any(any(c.isdigit() for c in name) for name in thread_names(os.getpid())), "numbers dropped"
    finally:
        stop.set()
        for w in workers:
            w.join(10)
    assert read_pss_split(2**22 + 7) is None and thread_names(2**22 + 7) == {}, "no such process"


def test_a_daemon_process_starts_torch_with_mkl_buffer_pools_off_unless_the_user_says_otherwise():
    code = "import swarm.daemon.peer, os; print(os.environ.get('MKL_DISABLE_FAST_MM'))"
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.stdout.split()[-1:] == ["1"], done.stderr[-2000:]
    env["MKL_DISABLE_FAST_MM"] = "0"  # a user's choice stands
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.stdout.split()[-1:] == ["0"], done.stderr[-2000:]


def test_mkl_buffer_pools_are_left_alone_once_torch_is_loaded():
    import torch  # noqa: F401 - loaded: MKL has read its environment, a late setting would change nothing

    from swarm.daemon.lean import no_mkl_buffer_pools

    environ: dict[str, str] = {}
    assert no_mkl_buffer_pools(environ) is False and environ == {}


def test_swarm_train_turns_mkls_buffer_pools_off_before_torch_loads():
    # the trainer computes on threads it starts per step; MKL reads MKL_DISABLE_FAST_MM once, when torch loads it
    code = (
        "import os, sys\n"
        "seen = []\n"
        "class AtTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' and not seen:\n"
        "            seen.append(os.environ.get('MKL_DISABLE_FAST_MM'))\n"
        "sys.meta_path.insert(0, AtTorch())\n"
        "from swarm import cli\n"
        "try:\n"
        "    cli.main(['train', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules, seen)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    assert _fresh_lines(code, env)[-1] == "True ['1']"
