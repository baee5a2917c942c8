"""scripts/gpu-check.sh's summary: every part's figures from its output folder into summary.json, printed last.

    python scripts/gpu_summary.py OUT     # reads OUT/{device.json,parts.tsv,<part>.out,demo/...}

Standard library only: it must run where a part failed to import swarm. A part whose output is missing or
unparsable is recorded with the reason, never guessed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

QUANTIZE_TARGET = 0.85  # of the HBM's nominal peak (issue 31; torchao's blockwise fp8 reaches 0.79-0.87)
_PYTEST = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_COMPUTE = re.compile(r"compute ([0-9.]+) layers/s on (\S+)")


def _json_out(path: Path):
    """The JSON document a part printed on stdout (after any line of text before it)."""
    text = path.read_text()
    start = min((i for i in (text.find("["), text.find("{")) if i >= 0), default=-1)
    if start < 0:
        raise ValueError(f"no JSON in {path.name}")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def _kernels(out: Path) -> dict:
    rows = _json_out(out / "bench-kernels.out")
    keep = ("quantizer", "bits", "rounding", "size", "quantize_gbps", "quantize_hbm", "quantize_share",
            "quantize_kernel_gbps", "quantize_kernel_hbm", "dequantize_gbps", "dequantize_share", "update_gbps",
            "update_share")  # fmt: skip

    def best(key: str) -> dict | None:
        row = max((r for r in rows if r.get(key) is not None), key=lambda r: r[key], default=None)
        return row and {k: row[k] for k in keep if k in row}

    kernel = best("quantize_kernel_hbm")
    return {
        "device": rows[0].get("device") if rows else None,
        "hbm_peak_gbps": rows[0].get("hbm_peak_gbps") if rows else None,
        "copy_gbps": rows[0].get("copy_gbps") if rows else None,
        "rows": [{k: r.get(k) for k in keep} for r in rows],
        "best_quantize_hbm": best("quantize_hbm"),
        "best_quantize_kernel_hbm": kernel,
        "quantize_target_hbm": QUANTIZE_TARGET,
        # the kernel alone, as torchao's figure is a kernel's
        "quantize_target_met": None if kernel is None else kernel["quantize_kernel_hbm"] >= QUANTIZE_TARGET,
    }


def _model(out: Path, name: str) -> dict:
    r = _json_out(out / f"bench-{name}.out")
    return {
        "model": r.get("model"),
        "parameters": r.get("parameters"),
        "micro_batch": r.get("micro_batch"),
        "seq_len": r.get("seq_len"),
        "device": r.get("device"),
        "tokens_per_s": [s["tokens_per_s"] for s in r["stages"]],
        "stage_layers": [s["layers"] for s in r["stages"]],
        "fwd_bwd_s": [s["fwd_bwd_s"] for s in r["stages"]],
        "boundary_bytes_per_token": r.get("boundary_bytes_per_token"),
        "codecs_network_bound_below_mbit": r.get("codecs_network_bound_below_mbit"),
        "fp32_network_bound_below_mbit": r.get("fp32_network_bound_below_mbit"),
    }


def _demo(out: Path) -> dict:
    d = json.loads((out / "demo" / "demo.json").read_text())
    shape = json.loads((out / "demo-shape.json").read_text())
    tokens = d["steps"] * shape["batch_size"] * shape["seq_len"]
    peers = {}
    for log in sorted((out / "demo" / "logs").glob("peer*.log")):
        found = _COMPUTE.search(log.read_text(errors="replace"))
        peers[log.stem] = {"compute_layers_per_s": float(found[1]), "device": found[2]} if found else None
    return {
        "steps": d["steps"],
        "first_loss": d["first_loss"],
        "final_loss": d["final_loss"],
        "mean_step_s": d["mean_step_s"],
        "total_s": d.get("total_s"),
        "tokens": tokens,
        "boundary_bytes_per_token": d["wire_bytes"] / tokens if tokens else None,
        "fp32_boundary_bytes_per_token": d["fp32_wire_bytes"] / tokens if tokens else None,
        "wire_ratio_vs_fp32": d.get("wire_ratio_vs_fp32"),
        "peer_exit_codes": d.get("peer_exit_codes"),
        "peers": peers,
    }


def _pytest(out: Path, name: str) -> dict:
    lines = [line for line in (out / f"{name}.out").read_text().splitlines() if _PYTEST.search(line)]
    if not lines:
        raise ValueError(f"no pytest result line in {name}.out")
    return {word.rstrip("s"): int(n) for n, word in _PYTEST.findall(lines[-1])}


def summarize(out: Path) -> dict:
    summary: dict = {"parts": {}}
    try:
        summary["device"] = json.loads((out / "device.json").read_text())
    except (OSError, ValueError) as error:
        summary["device"] = {"error": str(error)}
    if (out / "parts.tsv").exists():
        for line in (out / "parts.tsv").read_text().splitlines():
            name, result, seconds = line.split("\t")
            summary["parts"][name] = {"result": result, "seconds": int(seconds)}
    readers = {"bench-kernels": ("kernels", _kernels), "demo": ("demo", _demo)}
    readers |= {f"bench-{m}": (m, lambda out, m=m: _model(out, m)) for m in ("gpt2-small", "llama-100m")}
    readers |= {p: (p, lambda out, p=p: _pytest(out, p)) for p in ("pytest-cuda", "pytest-triton")}
    for part, (key, read) in readers.items():
        if part not in summary["parts"]:
            continue
        try:
            summary[key] = read(out)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            summary[key] = {"error": f"{type(error).__name__}: {error}"}
    return summary


def _fmt(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def report(s: dict) -> str:
    d = s.get("device", {})
    lines = ["", "==== gpu-check summary ====",
             f"device: {d.get('device', 'cpu')} (capability {d.get('capability', '-')}, {d.get('memory_gib', '-')} "
             f"GiB); torch {d.get('torch')} cuda {d.get('cuda')}, triton {d.get('triton')}, "
             f"transformers {d.get('transformers')}, python {d.get('python')}"]  # fmt: skip
    lines.append("parts: " + ", ".join(f"{n} {p['result']} ({p['seconds']}s)" for n, p in s["parts"].items()))
    k = s.get("kernels")
    if k and "error" not in k:
        lines.append(f"kernels: copy {_fmt(k['copy_gbps'], '.0f')} GB/s, nominal HBM peak "
                     f"{_fmt(k['hbm_peak_gbps'], '.0f')} GB/s")  # fmt: skip
        for r in k["rows"]:
            lines.append(
                f"  {r['quantizer']} {r['bits']}-bit {r.get('rounding') or ''} {r['size']}: quantize "
                f"{_fmt(r['quantize_gbps'], '.0f')} GB/s = {_fmt(r['quantize_hbm'], '.1%')} of peak, "
                f"{_fmt(r['quantize_share'], '.1%')} of copy (kernel alone {_fmt(r.get('quantize_kernel_gbps'), '.0f')}"
                f" = {_fmt(r.get('quantize_kernel_hbm'), '.1%')}); dequantize {_fmt(r['dequantize_gbps'], '.0f')}; "
                f"update {_fmt(r['update_gbps'], '.0f')} GB/s"
            )
        for key, what in (("quantize_hbm", "call"), ("quantize_kernel_hbm", "kernel alone")):
            best = k.get(f"best_{key}")
            if best:
                lines.append(f"  best quantize ({what}): {best['quantizer']} {best['bits']}-bit "
                             f"{best.get('rounding') or ''} at {best[key]:.1%} of peak")  # fmt: skip
        if k["quantize_target_met"] is not None:
            met = "met" if k["quantize_target_met"] else "NOT met"
            lines.append(f"  target {k['quantize_target_hbm']:.0%} of peak, kernel alone: {met}")
    elif k:
        lines.append(f"kernels: {k['error']}")
    for m in ("gpt2-small", "llama-100m"):
        r = s.get(m)
        if r and "error" not in r:
            stages = ", ".join(f"{t:,.0f}" for t in r["tokens_per_s"])
            b = r["boundary_bytes_per_token"] or {}
            lines.append(
                f"{m}: {r['parameters']:,} params, micro-batch {r['micro_batch']} x {r['seq_len']} on {r['device']}: "
                f"tokens/s per stage [{stages}]; boundary B/token fp32 fw {_fmt(b.get('fp32_forward'), '.0f')}, "
                f"codec fw {_fmt(b.get('codec_forward_steady'), '.1f')} (first sight "
                f"{_fmt(b.get('codec_forward_first_sight'), '.1f')}), bw {_fmt(b.get('codec_backward'), '.1f')}"
            )
        elif r:
            lines.append(f"{m}: {r['error']}")
    r = s.get("demo")
    if r and "error" not in r:
        peers = ", ".join(f"{n} {p['compute_layers_per_s']:.0f} layers/s on {p['device']}" if p else f"{n} ?"
                          for n, p in r["peers"].items())  # fmt: skip
        lines.append(
            f"demo (2 peers): {r['steps']} steps, loss {r['first_loss']:.3f} -> {r['final_loss']:.3f}, "
            f"{r['mean_step_s']:.3f} s/step; boundary {_fmt(r['boundary_bytes_per_token'], '.1f')} B/token "
            f"(fp32 {_fmt(r['fp32_boundary_bytes_per_token'], '.0f')}); {peers}; exits {r['peer_exit_codes']}"
        )
    elif r:
        lines.append(f"demo: {r['error']}")
    for p in ("pytest-cuda", "pytest-triton"):
        if p in s:
            lines.append(f"{p}: {s[p]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
