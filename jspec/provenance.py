"""Where and how a result was produced: recorded in every `--json` output and bench JSON."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; `platform` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    if not (ROOT / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(dtype: str | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """The machine, the software and the command behind a result.

    Args:
      dtype: the target's dtype ("float32" / "bfloat16"), if the result has one.
      argv: the command line (default `sys.argv`, with the interpreter in front).
    Returns:
      a JSON-ready dict: cpu, backend, device_kind, device_count, process_count, jax, jaxlib,
      python, platform, dtype, command (shell-quoted), git_commit, xla_flags, time_utc.
    """
    devs = jax.devices()
    args = list(sys.argv if argv is None else argv)
    if args and args[0].endswith("__main__.py"):  # `python -m pkg` shows as pkg/__main__.py
        args[:1] = ["-m", Path(args[0]).parent.name]
    cmd = [sys.executable, *args]
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "backend": jax.default_backend(),
            "device_kind": devs[0].device_kind, "device_count": len(devs),
            "process_count": jax.process_count(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "dtype": dtype, "command": shlex.join(cmd),
            "git_commit": _git_commit(), "xla_flags": os.environ.get("XLA_FLAGS"),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
