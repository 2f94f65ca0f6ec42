"""``octavo backends``: installed backends, whether each can run here, and why not."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "backends",
        help="list installed backends and their availability",
        description="List every installed Octavo backend (found through the `octavo` entry-point "
        "group), whether it is available on this machine and why not, and which one "
        "would be selected by default.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octavo.backends.selection import KNOWN_BACKEND_PACKAGES, list_backends, probe
    from octavo.plugins import get_plugin_manager

    backends = list_backends(get_plugin_manager())
    rows = []
    selected = None
    for backend in backends:
        answer = probe(backend)
        if answer.available and selected is None:
            selected = backend.name
        caps = backend.capabilities
        rows.append({
            "name": backend.name,
            "package": backend.package,
            "priority": backend.priority,
            "available": answer.available,
            "reason": answer.reason,
            "dtypes": list(caps.dtypes),
            "block_sizes": list(caps.block_sizes) if caps.block_sizes else "any",
            "cuda_graphs": caps.cuda_graphs,
        })
    if args.json:
        print(json.dumps({"backends": rows, "default": selected}))
        return 0
    if not rows:
        print("No Octavo backend is installed. Install one of:")
        for hint in KNOWN_BACKEND_PACKAGES.values():
            print(f"  {hint}")
        return 1
    for row in rows:
        mark = "available" if row["available"] else "unavailable"
        default = "  <- default" if row["name"] == selected else ""
        print(f"{row['name']:<8} {mark:<12} {row['reason']}{default}")
        print(f"         package {row['package']}, priority {row['priority']}, dtypes "
              f"{', '.join(row['dtypes'])}, block sizes {row['block_sizes']}, "
              f"CUDA graphs {'yes' if row['cuda_graphs'] else 'no'}")
    if selected is None:
        installed = {row["name"] for row in rows}
        hints = [hint for name, hint in KNOWN_BACKEND_PACKAGES.items() if name not in installed]
        print("No installed backend can run on this machine."
              + (f" Install one that does, e.g. {'; '.join(hints)}." if hints else ""))
        return 1
    return 0
