"""The `swarm` command: one CLI whose subcommands live in their own modules, imported only when run."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from swarm.startup import imports_done

# command path -> (module, one-line help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("demo",): ("swarm.testbed.demo", "start a local swarm on 127.0.0.1 and train the default model (the main job)"),
    ("train",): ("swarm.train.trainer", "drive training across the stages found in the DHT"),
    ("export",): (
        "swarm.train.export_cli",
        "write a run's model as a Hugging Face directory, from checkpoints or the swarm",
    ),
    ("eval",): ("swarm.train.evaluate", "the held-out loss of an exported model (transformers, no swarm)"),
    ("generate",): ("swarm.train.generate", "continue a prompt with an exported model (transformers, no swarm)"),
    ("status",): ("swarm.daemon.status", "list the peers in the DHT, their stages and link figures"),
    ("stop",): ("swarm.daemon.stop_cli", "stop a swarm: every peer checkpoints its own layers and exits"),
    ("bootstrap",): ("swarm.daemon.bootstrap", "run a DHT bootstrap node that peers and trainers join"),
    ("run",): ("swarm.daemon.run_cli", "an owned run: init (owner key, signed manifest), show, delegate, revoke"),
    ("plan",): ("swarm.daemon.live_plan", "plan stages, layer ranges and peers for a scenario, a JSON file or the DHT"),
    ("testbed",): ("swarm.testbed.testbed_cli", "network-namespace testbed: up, status, down"),
    ("bench", "kernels"): ("swarm.bench.kernels", "quantize/dequantize GB/s against a memory copy"),
    ("bench", "codecs"): ("swarm.bench.codecs", "every codec's wire size, error and speed, beside hivemind's"),
    ("bench", "scheduler"): ("swarm.bench.scheduler", "our plans against random and greedy on DT-FM's scenarios"),
    ("bench", "transport"): ("swarm.bench.transport", "gRPC stream throughput, goodput on shaped links"),
    ("bench", "soak"): ("swarm.bench.soak", "a loopback swarm for N steps: RSS, threads and fds of every process"),
    ("bench", "footprint"): ("swarm.bench.footprint", "memory of a default toy swarm-peer, its DHT process and p2pd"),
    ("bench", "idle"): ("swarm.bench.idle", "CPU seconds of an idle loopback swarm, process by process"),
    ("bench", "hostile"): ("swarm.bench.hostile", "hostile clients against a local pipeline, case by case"),
    ("bench", "model"): ("swarm.bench.model", "a model's tokens/s per stage, boundary bytes per token, link speeds"),
    ("bench", "selective"): (
        "swarm.bench.selective",
        "which links selective compression compresses per link rate, and the predicted step with and without",
    ),
    ("bench", "auth"): ("swarm.bench.auth", "the demo's mean step time with authentication on and off, alternating"),
    ("bench", "relay"): ("swarm.bench.relay", "latency and bytes/s of a call through a relay vs direct"),
    ("bench", "verify"): ("swarm.bench.verify", "samples/s of a replicated pipeline with stage-work audits off and on"),
    ("experiment", "convergence"): (
        "swarm.experiments.convergence",
        "train with every codec setting in one process and compare losses and bytes",
    ),
    ("experiment", "throttled"): (
        "swarm.experiments.throttled",
        "the link-speed x codec matrix on shaped links, with plots and a report",
    ),
    ("experiment", "finetune"): (
        "swarm.experiments.finetune",
        "write a Hugging Face checkpoint and tokenizer locally, fine-tune it over a local 3-peer swarm",
    ),
    ("experiment", "hetero"): (
        "swarm.experiments.hetero",
        "one peer 2x slower: all-equal, uniform fp32 and planned per-peer precision (QSync), same seed",
    ),
    ("experiment", "nat"): (
        "swarm.experiments.nat",
        "the same run with every peer reachable, half behind NAT, and two adjacent stages through a relay",
    ),
    ("experiment", "freezing"): (
        "swarm.experiments.freezing",
        "train from one seed without freezing, with PipeTransformer's freezing, and with freezing + repack",
    ),
    ("experiment", "churn"): (
        "swarm.experiments.churn",
        "train twice from one seed, without and with peers killed and joining; recovery, samples, targets",
    ),
    ("experiment", "attacks"): (
        "swarm.experiments.attacks",
        "a local open run attacked once per setting (strangers, in-plan liars): refused, evicted, stopped, loss",
    ),
}

GROUP_HELP = {"bench": "benchmarks that print figures (and JSON with --json)", "experiment": "experiments"}


def _build_parser() -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="swarm", description=__doc__)
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    leaves: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for path, (_module, help_text) in COMMANDS.items():
        if len(path) == 1:
            leaves[path] = top.add_parser(path[0], help=help_text, description=help_text)
            continue
        group, name = path
        if group not in groups:
            group_parser = top.add_parser(group, help=GROUP_HELP[group], description=GROUP_HELP[group])
            groups[group] = group_parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
        leaves[path] = groups[group].add_parser(name, help=help_text, description=help_text)
    return parser, leaves


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, leaves = _build_parser()
    # Find the leaf command without importing every module (torch and gRPC are slow to import).
    words = [w for w in argv if not w.startswith("-")]
    path = next((p for p in leaves if tuple(words[: len(p)]) == p), None)
    if path is None:
        parser.parse_args(argv)  # prints usage or the group's help and exits
        parser.print_help()
        return 2
    from swarm.peers.allocator import tune_allocator

    tune_allocator()
    module = importlib.import_module(COMMANDS[path][0])
    module.add_arguments(leaves[path])
    args = parser.parse_args(argv)
    imports_done()  # the command's modules are in: the collector on again, what they made frozen (swarm.startup)
    unwind_on_sigterm()
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        print(f"swarm {' '.join(path)}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


class Terminated(KeyboardInterrupt):
    """A SIGTERM, unwinding the main thread as Ctrl-C's KeyboardInterrupt does (`unwind_on_sigterm`)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _unwind(signum: int, _frame) -> None:
    raise Terminated(signum)


def unwind_on_sigterm() -> None:
    """SIGTERM (a `kill`, a supervisor, CI's timeout) unwinds the main thread as Ctrl-C does, so every `with` that
    started processes, namespaces or a DHT reaps them; Python's default ends the process on the spot and left an
    experiment's whole swarm (bootstrap, peers, their p2pd) running. A command that sets its own handler later
    (the testbed, the soak) keeps it."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _unwind)


if __name__ == "__main__":
    sys.exit(main())
