"""The `kvmesh` command: one dispatcher, each subcommand lives in the package that owns it.

Subcommands are imported lazily so that `kvmesh gateway` never imports torch and
`kvmesh --help` answers instantly.
"""
from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("services.launcher:main", "start the whole stack on this machine"),
    "gateway": ("services.gateway.main:main", "run the OpenAI-compatible HTTP gateway"),
    "tokenizer": ("tokenizer_svc.main:main", "run the tokenizer / detokenizer service"),
    "scheduler": ("scheduler_svc.main:main", "run the global scheduler"),
    "prefix-cache": ("prefix_cache_svc.main:main", "run the cluster prefix-cache index"),
    "worker": ("gpu_worker.service.main:main", "run one GPU worker (engine) service"),
    "generate": ("gpu_worker.cli_generate:main", "generate text offline with the engine"),
    "make-model": ("gpu_worker.make_model:main", "write a random-weight model directory"),
    "planner": ("services.planner.main:main", "scale the prefill and decode pools from SLO signals"),
    "bench": ("services.bench.cli:main", "benchmark an OpenAI-compatible server"),
    "keys": ("services.security.keys_cli:main", "make the internal planes' keys (a directory or Kubernetes Secrets)"),
}


def _usage() -> str:
    lines = ["usage: kvmesh <command> [options]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `kvmesh <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"kvmesh: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name = SUBCOMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
