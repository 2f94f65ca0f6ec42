"""What a fresh interpreter imports: for the "discovery is cheap" checks."""

from __future__ import annotations

import ast
import subprocess
import sys


def modules_loaded_by(setup: str, watched: tuple[str, ...], timeout_s: float = 60) -> list[str]:
    """Run ``setup`` (Python source) in a fresh interpreter; return the ``watched`` modules (or
    submodules of them) that it left in ``sys.modules``, sorted."""
    code = (
        f"{setup}\n"
        "import sys\n"
        f"watched = {watched!r}\n"
        "print(sorted(m for m in sys.modules\n"
        "             if any(m == w or m.startswith(w + '.') for w in watched)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])
