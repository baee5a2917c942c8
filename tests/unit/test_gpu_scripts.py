"""The GPU machine's scripts, on the CPU: the checkout finder (swarm importable without an install), the summary of
a gpu-check output folder, and the shell scripts' syntax. scripts/gpu-device-run.sh --dry-run runs them whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_summary  # noqa: E402

_PROBE = (
    "import swarm.proto.wire_pb2 as w, swarm.kernels.reference as k, swarm.peers as p; "
    "print(w.__file__); print(k.__file__); print(p.__file__)"
)


def _probe(tmp_path: Path, finder: bool) -> subprocess.CompletedProcess:
    """A python without site (so no editable install of this checkout) and with the checkout's root on its path."""
    purelib = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(ROOT), purelib])}
    env.pop("SWARM_CHECKOUT", None)
    if finder:
        env["SWARM_CHECKOUT"] = str(ROOT)
    code = ("import swarm_checkout; " if finder else "") + _PROBE
    return subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_checkout_finder_maps_the_package_dirs(tmp_path):
    done = _probe(tmp_path, finder=True)
    assert done.returncode == 0, done.stderr
    files = done.stdout.split()
    assert files == [str(ROOT / "proto" / "wire_pb2.py"), str(ROOT / "kernels" / "reference.py"),
                     str(ROOT / "peers" / "__init__.py")]  # fmt: skip


def test_without_the_finder_the_mapped_packages_are_not_found(tmp_path):
    done = _probe(tmp_path, finder=False)
    assert done.returncode != 0 and "No module named 'swarm.proto'" in done.stderr


def _kernel_row(quantizer: str, bits: int, gbps: float, kernel_gbps: float) -> dict:
    return {"quantizer": quantizer, "bits": bits, "rounding": "nearest", "size": "512 MiB", "quantize_gbps": gbps,
            "quantize_share": 0.9, "quantize_hbm": gbps / 4800, "quantize_kernel_gbps": kernel_gbps,
            "quantize_kernel_hbm": kernel_gbps / 4800, "dequantize_gbps": 1.0, "dequantize_share": 0.1,
            "update_gbps": 2.0, "update_share": 0.2, "copy_gbps": 4300.0, "device": "NVIDIA H200",
            "hbm_peak_gbps": 4800.0}  # fmt: skip


def test_the_summary_reads_every_part_and_records_failures(tmp_path):
    (tmp_path / "device.json").write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.11.0"}))
    parts = ["bench-kernels\tok\t20", "bench-gpt2-small\tok\t30", "bench-llama-100m\tfailed:1\t9", "demo\tok\t60",
             "pytest-cuda\tok\t40", "pytest-triton\ttimeout\t180"]  # fmt: skip
    (tmp_path / "parts.tsv").write_text("\n".join(parts) + "\n")
    rows = [_kernel_row("aqsgd", 2, 3900.0, 3950.0), _kernel_row("acsgd", 2, 2000.0, 4200.0)]
    (tmp_path / "bench-kernels.out").write_text("a warning line\n" + json.dumps(rows))
    model = {"model": "gpt2", "parameters": 124, "micro_batch": 8, "seq_len": 512, "device": "cuda:0",
             "stages": [{"tokens_per_s": 1e5, "layers": [0, 6], "fwd_bwd_s": 0.04}],
             "boundary_bytes_per_token": {"fp32_forward": 3072.0, "codec_forward_steady": 60.0}}  # fmt: skip
    (tmp_path / "bench-gpt2-small.out").write_text(json.dumps(model))
    (tmp_path / "bench-llama-100m.out").write_text("Traceback ...\n")
    (tmp_path / "demo-shape.json").write_text(json.dumps({"batch_size": 16, "seq_len": 128}))
    (tmp_path / "demo" / "logs").mkdir(parents=True)
    demo = {"steps": 8, "first_loss": 5.5, "final_loss": 4.0, "mean_step_s": 0.1, "wire_bytes": 8 * 2048 * 60,
            "fp32_wire_bytes": 8 * 2048 * 1024, "peer_exit_codes": {"peer0": 0}}  # fmt: skip
    (tmp_path / "demo" / "demo.json").write_text(json.dumps(demo))
    (tmp_path / "demo" / "logs" / "peer0.log").write_text("x: joined the DHT as ab; compute 812.5 layers/s on cuda:0\n")
    (tmp_path / "pytest-cuda.out").write_text("....s\n5 passed, 1 skipped in 3.2s\n")
    (tmp_path / "pytest-triton.out").write_text("....")
    assert gpu_summary.main([str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["kernels"]["best_quantize_hbm"]["quantizer"] == "aqsgd"  # the call's best
    assert s["kernels"]["best_quantize_kernel_hbm"]["quantizer"] == "acsgd"
    assert s["kernels"]["quantize_target_met"] is True, "the kernel alone: 4200/4800 = 87.5% >= 85%"
    assert s["gpt2-small"]["tokens_per_s"] == [1e5]
    assert "error" in s["llama-100m"] and s["parts"]["bench-llama-100m"]["result"] == "failed:1"
    assert s["demo"]["boundary_bytes_per_token"] == pytest.approx(60.0)
    assert s["demo"]["peers"]["peer0"] == {"compute_layers_per_s": 812.5, "device": "cuda:0"}
    assert s["pytest-cuda"] == {"passed": 5, "skipped": 1}
    assert "no pytest result line" in s["pytest-triton"]["error"]


def test_the_target_is_missed_below_85_percent_of_the_peak(tmp_path):
    rows = [_kernel_row("acsgd", 8, 2100.0, 3270.0)]  # 68% of 4800, as the H200 measured it
    (tmp_path / "bench-kernels.out").write_text(json.dumps(rows))
    assert gpu_summary._kernels(tmp_path)["quantize_target_met"] is False


def test_a_missing_output_folder_part_is_an_error_not_a_guess(tmp_path):
    (tmp_path / "parts.tsv").write_text("bench-kernels\ttimeout\t120\n")
    summary = gpu_summary.summarize(tmp_path)
    assert "error" in summary["device"] and "error" in summary["kernels"]
    assert "kernels: " in gpu_summary.report(summary)


@pytest.mark.parametrize("script", ["gpu-check.sh", "gpu-device-run.sh", "gpu-wheels.sh"])
def test_the_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True).returncode == 0


def test_gpu_check_refuses_an_unknown_argument():
    done = subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh"), "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown argument --bogus" in done.stderr
