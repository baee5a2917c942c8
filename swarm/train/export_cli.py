"""`swarm export`: a run's model as a Hugging Face directory, from its stage checkpoints or from the live swarm.

From checkpoints (`--checkpoint-dir`), every weight is found by layer across the `layers-*.safetensors` files
there, the newest step winning per layer (`swarm.runtime.checkpoint.gather_layers`), whatever splits wrote them;
a layer no file holds is named and nothing is written. From a live swarm (`--address-file`/`--initial-peers`,
`--run`), each stage of the current plan sends its weights over `GetState` (one replica per stage, the next one
if it fails; only the weights are read, the stream is cancelled at the optimizer's state); a stage none of whose
replicas answers is named and nothing is written. GetState is served to the plan's peers and trainers only:
export with the run's trainer key (`--identity`). `swarm demo` and `swarm train` call `save_model` at the end
with `--save-model DIR`. The directory's format is `swarm.model.export`'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swarm.flags import Flags, flag
from swarm.model.export import model_from_json, tied_pair, weight_shapes, write_hf_dir
from swarm.model.heldout import DEFAULT_EVAL_SAMPLES
from swarm.model.spec import AnyModelConfig
from swarm.options import DHT_FLAGS, MODEL_GROUP, ModelFlags

if TYPE_CHECKING:
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.plan import PlanDocument
    from swarm.train.trainer import TrainConfig

__all__ = [
    "ExportConfig",
    "ExportError",
    "weights_from_checkpoints",
    "weights_from_stages",
    "save_model",
    "held_out_of",
    "weights_from_swarm",
    "add_arguments",
    "run",
]

log = logging.getLogger("swarm.train.export")
_HELD_OUT = "held-out windows (recorded for `swarm eval`)"


class ExportError(Exception):
    """The model cannot be exported whole: what is missing or who failed, named."""


@dataclass(frozen=True)
class ExportConfig:
    """`swarm export`: where the weights come from, where the directory goes."""

    out: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """the Hugging Face directory to write (config.json, model.safetensors, tokenizer); required"""
    checkpoint_dir: str | None = field(default=None, metadata=flag(metavar="DIR"))
    """export from the stage checkpoints in DIR (a run's --checkpoint-dir) instead of the live swarm"""
    model: ModelFlags = field(default_factory=ModelFlags, metadata=flag(group=MODEL_GROUP))
    """The model, for checkpoints that do not record theirs and for a swarm without --run (an owned run's
    manifest and the checkpoints' record win)."""
    address_file: str | None = field(default=None, metadata=flag(metavar="PATH", group="DHT"))
    """join the live swarm through the multiaddrs in PATH (as `swarm bootstrap` writes them)"""
    dht: DHTConfig | None = field(default=None, metadata={"flag": DHT_FLAGS})
    """How to join the live swarm (with --run, its manifest names the model; --identity the trainer key)."""
    timeout_s: float = 120.0
    """bound on joining the DHT, finding the plan and each stage's transfer, seconds"""
    data: str | None = field(default=None, metadata=flag(group=_HELD_OUT))
    """the run's training text (none: the default corpus)"""
    train_samples: int | None = field(default=None, metadata=flag(group=_HELD_OUT))
    """the run's training windows (none: every window not held out)"""
    eval_samples: int = field(default=DEFAULT_EVAL_SAMPLES, metadata=flag(group=_HELD_OUT))
    """the run's held-out windows"""


@cache
def export_flags() -> Flags[ExportConfig]:
    from swarm.peers.dht_config import DHTConfig

    return Flags(ExportConfig, base=ExportConfig(dht=DHTConfig(client_mode=True)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    export_flags().add_to(parser)
    parser.add_argument("--json", action="store_true", help="print what was written as one JSON object")


def weights_from_checkpoints(
    directory: str | Path, model: AnyModelConfig | None = None
) -> tuple[AnyModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The unsplit model's weights (and the last stage's head copy of a tied model) from the stage checkpoints in
    `directory`, found by layer, newest step first; the model is the one the newest checkpoint records, else
    `model`. Returns (model, weights, provenance).

    Raises:
        ExportError: no checkpoint, no model to build, or layers that no checkpoint holds (named).
    """
    from swarm.runtime.checkpoint import gather_layers, scan_checkpoints

    files = scan_checkpoints(directory)
    if not files:
        raise ExportError(f"no stage checkpoint (layers-*.safetensors) in {directory}")
    recorded = [f for f in sorted(files, key=lambda f: f.rank, reverse=True) if f.model]
    if recorded:
        model = model_from_json(recorded[0].model)
    if model is None:
        raise ExportError(f"the checkpoints in {directory} do not record their model: give its flags (--model ...)")
    shapes = weight_shapes(model)
    found = gather_layers(files, shapes, weights_only=True)
    if found.missing:
        raise ExportError(
            f"{directory}: no checkpoint holds {found.missing_text()} of the model; present: "
            + ", ".join(f.path.name for f in files)
        )
    weights = {k[len("model.") :]: v for k, v in found.tensors.items() if k.startswith("model.")}
    pair = tied_pair(model)
    if pair is not None:  # the last stage's own copy, where a split had one: kept if it differs from the embedding
        head = gather_layers(files, {pair[0]: shapes[pair[1]]}, aliases=dict([pair]), weights_only=True)
        weights[pair[0]] = head.tensors[f"model.{pair[0]}"]
    info = {"source": f"checkpoints {directory}", "steps_done": found.steps_done, "from": found.sources_text()}
    return model, weights, info


def weights_from_stages(
    document: PlanDocument,
    addresses: dict[str, str],
    model: AnyModelConfig,
    connector,
    plan_version: int,
    timeout_s: float = 120.0,
) -> dict[str, torch.Tensor]:
    """Each stage's weights over GetState from one of its replicas (in plan order, the next on failure), read
    within the stage's own names and shapes (`swarm.runtime.referee.weights_from_items`).

    Args:
        document: the plan the swarm follows.
        addresses: peer id -> announced address.
        model: the run's model.
        connector: reaches a peer (`GrpcConnector` with the trainer's signer; tests: an in-process one).
        plan_version: the plan's version (a peer on another plan refuses).
        timeout_s: bound on one stage's transfer.

    Raises:
        ExportError: naming every stage none of whose replicas sent its weights, and why.
    """
    from swarm.model.spec import build_stage
    from swarm.proto import stage_pb2
    from swarm.runtime.referee import weights_from_items

    weights: dict[str, torch.Tensor] = {}
    failed = []
    n = len(document.stages)
    for index, stage in enumerate(document.stages):
        with torch.device("meta"):
            module = build_stage(model, stage.layer_start, stage.layer_end, index == 0, index == n - 1)
        expected = {k: v.shape for k, v in module.state_dict().items()}
        why = []
        for peer_id in stage.peer_ids:
            address = addresses.get(peer_id)
            if address is None:
                why.append(f"{peer_id}: not announced")
                continue
            try:
                # communication: the stage streams its state, weights first; only those are read
                items = connector.stage(address, peer_id).GetState(
                    stage_pb2.StateRequest(stage=index, plan_version=plan_version), timeout=timeout_s
                )
                got = weights_from_items(items, expected, f"stage {index} at {peer_id} ({address})")
                weights.update({k: t.reshape(expected[k]) for k, t in got.items()})
                break
            except Exception as e:  # noqa: BLE001 - any failure: try the next replica, name it if none
                why.append(f"{peer_id}: {_reason(e)}")
        else:
            failed.append(f"stage {index} (layers [{stage.layer_start}, {stage.layer_end})): {'; '.join(why)}")
    if failed:
        refused = any("PERMISSION_DENIED" in line for line in failed)
        hint = "; GetState serves the plan's peers and trainers: export with the run's trainer key (--identity)"
        raise ExportError("could not fetch " + " | ".join(failed) + (hint if refused else ""))
    return weights


def _reason(error: Exception) -> str:
    """One line for a failed fetch: a gRPC status as CODE: details, anything else as itself."""
    code, details = getattr(error, "code", None), getattr(error, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}"
        except Exception:  # noqa: BLE001 - a call object without a status yet
            pass
    return str(error).splitlines()[0] if str(error) else type(error).__name__


PLAN_ATTEMPTS, PLAN_RETRY_S = 5, 2.0
"""How often a live export reads the plan again when the stages answer that they serve a newer one, and how long
it waits between reads (a plan reaches every DHT reader within a poll or two)."""


def weights_from_swarm(
    dht, model: AnyModelConfig, signer, timeout_s: float = 120.0, say=lambda line: None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every stage's weights from the swarm `dht` is joined to, under its current plan, fetched with `signer`'s
    key (a trainer the plan names, or a plan peer). Returns (weights, provenance). Raises ExportError."""
    from swarm.daemon.nat import announced_dial
    from swarm.net.connect import GrpcConnector
    from swarm.net.stream import PLAN_MISMATCH

    connector = GrpcConnector(signer=signer, dial=announced_dial(dht.peers, signer))  # NAT: through relays
    try:
        for attempt in range(PLAN_ATTEMPTS):
            # the trainer of a finished run no longer announces itself: a plan naming it is still the stages' plan
            record = dht.get_plan(model.n_layers, check_trainers=False)
            if record is None:
                raise ExportError("no plan in the DHT for this model: is the swarm running, and is --run right?")
            addresses = {p.peer_id: p.address for p in dht.peers()}
            say(f"plan {record.version}: {len(record.document.stages)} stages; fetching each stage's weights")
            try:
                weights = weights_from_stages(record.document, addresses, model, connector, record.version, timeout_s)
                break
            except ExportError as e:  # the stages moved to a newer plan than this reader saw: read it again
                if PLAN_MISMATCH not in str(e) or attempt == PLAN_ATTEMPTS - 1:  # the stages' shared marker
                    raise
                say(f"the stages are on a newer plan than {record.version}: reading the plan again")
                time.sleep(PLAN_RETRY_S)
    finally:
        connector.close()
    return weights, {"source": f"live swarm, plan {record.version}", "plan_version": record.version}


def _from_swarm(cfg: ExportConfig, model: AnyModelConfig, say) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from swarm.daemon.roster import PeerAuth
    from swarm.peers.dht import SwarmDHT

    auth = PeerAuth.load(cfg.dht)
    with SwarmDHT(cfg.dht, private_key=auth.identity.key) as dht:
        say(f"joined as {dht.peer_id}")
        return weights_from_swarm(dht, model, auth.signer, cfg.timeout_s, say)


def save_model(
    model: AnyModelConfig,
    out: str | Path,
    *,
    dht=None,
    signer=None,
    checkpoint_dir: str | Path | None = None,
    data: str | None = None,
    train_samples: int | None = None,
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
    timeout_s: float = 120.0,
    say=lambda line: None,
) -> Path | None:
    """`--save-model` of `swarm demo` and `swarm train`: the run's model exported to `out` at the end, from the
    live swarm (`dht`, fetched with the trainer's `signer`: the weights the last step left) or else from the
    stage checkpoints in `checkpoint_dir`, recording the run's held-out windows for `swarm eval`. Returns `out`,
    or None when it could not be exported (the reason printed to stderr: the run itself is not failed)."""
    try:
        if dht is not None:
            weights, info = weights_from_swarm(dht, model, signer, timeout_s)
        elif checkpoint_dir is not None:
            _, weights, info = weights_from_checkpoints(checkpoint_dir, model)
        else:
            raise ExportError("nothing to export from: neither a swarm nor a checkpoint directory")
        info["held_out"] = _held_out(model, data, train_samples, eval_samples)
        written = write_hf_dir(model, weights, out, info)
    except (ExportError, ValueError, OSError) as e:
        print(f"error: --save-model {out}: {e}", file=sys.stderr)
        return None
    say(f"model written to {written} ({info['source']})")
    return written


def held_out_of(train: TrainConfig) -> dict[str, Any]:
    """`save_model`'s held-out arguments of a `TrainConfig`: its data, training windows and held-out windows
    (its `eval_samples`; the data set's default where the run held none out, so that the exported model still
    names windows that share no text with its training ones)."""
    eval_samples = train.eval_samples or DEFAULT_EVAL_SAMPLES
    return {"data": train.data, "train_samples": train.train_samples, "eval_samples": eval_samples}


def _held_out(model: AnyModelConfig, data: str | None, train_samples: int | None, eval_samples: int) -> dict:
    return {
        "data": data, "seq_len_tokens": model.seq_len_tokens, "train_samples": train_samples,
        "eval_samples": eval_samples, "tokenizer": getattr(model, "tokenizer_path", None),
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    say = (lambda *_: None) if args.json else (lambda s: print(f"[export] {s}", file=sys.stderr))
    try:
        cfg = export_flags().from_args(args)
        if cfg.out is None:
            raise ValueError("--out DIR is required")
        if cfg.checkpoint_dir is not None:
            model, weights, info = weights_from_checkpoints(cfg.checkpoint_dir, cfg.model.build())
        else:
            from swarm.daemon.bootstrap import joined_peers

            dht = replace(cfg.dht, initial_peers=joined_peers(cfg.dht.initial_peers, cfg.address_file))
            if not dht.initial_peers:
                raise ValueError("give --checkpoint-dir DIR, or a live swarm to join (--address-file, --initial-peers)")
            cfg = replace(cfg, dht=replace(dht, start_timeout_s=cfg.timeout_s, request_timeout_s=cfg.timeout_s))
            if dht.run is not None:
                from swarm.daemon.run_cli import manifest_of, with_manifest

                cfg = replace(with_manifest(export_flags(), args, manifest_of(dht)), dht=cfg.dht)
            model = cfg.model.build()
            weights, info = _from_swarm(cfg, model, say)
        info["held_out"] = _held_out(model, cfg.data, cfg.train_samples, cfg.eval_samples)
        out = write_hf_dir(model, weights, cfg.out, info)
    except (ExportError, ValueError, OSError) as e:
        print(f"swarm export: {e}", file=sys.stderr)
        return 2
    result = {"out": str(out), "family": json.loads((out / "config.json").read_text())["model_type"], **info}
    print(json.dumps(result) if args.json else f"wrote {out} ({result['family']}) from {info['source']}")
    return 0
