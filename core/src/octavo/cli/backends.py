"""``octavo backends``: a doctor's view of the installed backends.

For each backend registered by an installed plugin, highest priority first: its package,
priority, device type and process-group backend, whether it can run here and why (or why not),
and everything it declares in ``BackendCapabilities``. ``--json`` prints the same as one JSON
object. Exit status 1 when no backend is installed or none is available here (text view).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from octavo.backends.backend import Backend, BackendCapabilities

# How the text view shows a capability that is None (anything else: "no limit").
_NONE_TEXT = {"head_dims": "any", "block_sizes": "any"}
# Text-view labels (a field without one shows its name with spaces).
_LABELS = {
    "cuda_graphs": "CUDA graphs",
    "cuda_graphs_multi_token": "multi-token graphs",
    "async_scheduling": "async scheduling",
    "default_max_num_batched_tokens": "token budget",
    "max_logprobs": "max top logprobs",
    "quantization_methods": "quantization",
    "kv_cache_dtypes": "kv cache dtypes",
}


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "backends",
        help="list installed backends, their availability and capabilities",
        description="List every installed Octavo backend (found through the `octavo` entry-point "
        "group): its package and priority, whether it is available on this machine and why "
        "not, what it supports (dtypes, head sizes, block sizes, CUDA graphs, limits), and "
        "which one would be selected by default.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def capabilities_dict(caps: BackendCapabilities) -> dict[str, Any]:
    """Every capability field by name, tuples as lists (JSON-ready)."""
    out = {}
    for f in fields(caps):
        value = getattr(caps, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def capability_lines(caps: BackendCapabilities) -> list[str]:
    """One ``label  value`` line per capability field, for the text view."""
    lines = []
    for name, value in capabilities_dict(caps).items():
        if value is None:
            text = _NONE_TEXT.get(name, "no limit")
        elif isinstance(value, bool):
            text = "yes" if value else "no"
        elif isinstance(value, list):
            text = ", ".join(map(str, value)) or "none"
        else:
            text = str(value)
        lines.append(f"{_LABELS.get(name, name.replace('_', ' ')):<18} {text}")
    return lines


def backend_row(backend: Backend) -> dict[str, Any]:
    """What ``--json`` says about one backend (``default`` is filled in by the caller)."""
    from octavo.backends.selection import probe

    answer = probe(backend)
    return {
        "name": backend.name,
        "package": backend.package,
        "priority": backend.priority,
        "device_type": backend.device_type,
        "dist_backend": backend.dist_backend,
        "description": backend.description,
        "available": answer.available,
        "reason": answer.reason,
        "default": False,
        "ranks_here": ranks_here(backend) if answer.available else 0,
        "capabilities": capabilities_dict(backend.capabilities),
    }


def ranks_here(backend: Backend) -> int | None:
    """How many ranks of a split model this host can run for ``backend`` (tensor x pipeline
    parallel size with the mp executor): its GPUs on "cuda", ``None`` (processes, no fixed
    limit) on the host."""
    if backend.device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    return None if backend.device_type == "cpu" else 1


def run(args: argparse.Namespace) -> int:
    from octavo.backends.selection import KNOWN_BACKEND_PACKAGES, list_backends
    from octavo.plugins import get_plugin_manager

    backends = list_backends(get_plugin_manager())
    rows = [backend_row(backend) for backend in backends]
    selected = next((row["name"] for row in rows if row["available"]), None)
    for row in rows:
        row["default"] = row["name"] == selected
    if args.json:
        print(json.dumps({"backends": rows, "default": selected}))
        return 0
    if not rows:
        print("No Octavo backend is installed. Install one of:")
        for hint in KNOWN_BACKEND_PACKAGES.values():
            print(f"  {hint}")
        return 1
    for backend, row in zip(backends, rows):
        _print_backend(backend, row)
    if selected is None:
        installed = {row["name"] for row in rows}
        hints = [hint for name, hint in KNOWN_BACKEND_PACKAGES.items() if name not in installed]
        print("No installed backend can run on this machine."
              + (f" Install one that does, e.g. {'; '.join(hints)}." if hints else ""))
        return 1
    print(f"Default: {selected} (the available backend of highest priority); choose another "
          "with --device NAME.")
    return 0


def _print_backend(backend: Backend, row: dict[str, Any]) -> None:
    indent = " " * 9
    mark = "available" if row["available"] else "unavailable"
    default = "  <- default" if row["default"] else ""
    print(f"{row['name']:<8} {mark:<12} {row['reason']}{default}")
    if row["description"]:
        print(f"{indent}{row['description']}")
    print(f"{indent}package {row['package']}, priority {row['priority']}, device type "
          f"{row['device_type']}, process group {row['dist_backend']}")
    if row["available"]:
        ranks = row["ranks_here"]
        limit = "one process per rank" if ranks is None else f"up to {ranks} ranks"
        print(f"{indent}split models here (mp executor): {limit}; more hosts with --distributed-"
              "executor-backend ray")
    for line in capability_lines(backend.capabilities):
        print(f"{indent}{line}")
    print()
