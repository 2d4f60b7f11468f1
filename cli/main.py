"""The `kvtier` command: one entry point, one module per subcommand (imported only when used)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module that defines `add_arguments(parser)` and `run(args) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "check-config": ("kvtier.cli.check_config", "load an LMCache YAML, an `lmcache server` L2-adapter JSON or a "
                     "vLLM --kv-transfer-config as LMCache or vLLM does; fail loudly"),
    "demo": ("kvtier.cli.demo", "replay a multi-turn trace slice through LMCache, with and without kvtier's SSD tier"),
    "demo-vllm": ("kvtier.cli.demo_vllm", "the main job: replay multi-turn conversations through vLLM, with and "
                  "without kvtier"),
    "demo-shared": ("kvtier.cli.demo_shared", "replay conversations round-robin over several vLLM replicas: without "
                    "kvtier, kvtier local-only, kvtier + a shared Redis (writes all / continuing)"),
    "demo-model": ("kvtier.launch.demo_model", "write the tiny demo model (weights + tokenizer) for `vllm serve`"),
    "replay": ("kvtier.replay.runner", "replay a request trace against eviction policies"),
    "replay-stream": ("kvtier.replay.policy_stream", "replay a host tier's recorded policy stream "
                      "(kvtier.record_host_policy) offline through the same policy; engine vs offline hits"),
    "simulate": ("kvtier.sim.simulate", "discrete-event replay of scheduling policies"),
    "workload": ("kvtier.sim.workloads", "generate a synthetic request trace (shared-prefix agent workload)"),
}


#: subcommands whose arguments all belong to another program's CLI
PASS_THROUGH: dict[str, tuple[str, str]] = {
    "serve": ("kvtier.cli.serve", "vLLM's `vllm serve`, arguments passed through (works with vLLM's CPU wheel too)"),
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a subcommand that needs an extra kvtier was installed without (`kvtier[lmcache]`) stops
    with that one line on stderr and exit status 2."""
    from kvtier.compat.extras import MissingExtra

    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except MissingExtra as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    if argv and argv[0] in PASS_THROUGH:
        return int(importlib.import_module(PASS_THROUGH[argv[0]][0]).main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in PASS_THROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:  # import only the module that runs
            importlib.import_module(module).add_arguments(p)
    args, _ = parser.parse_known_args(argv) if wanted not in SUBCOMMANDS else (parser.parse_args(argv), None)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
