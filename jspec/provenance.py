"""Where and how a result was produced: recorded in every `--json` output and bench JSON."""

from __future__ import annotations

import functools
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

from jspec.errors import JspecError

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


# A TPU generation is a class of its own ("tpu": one whose generation is not known).
TPU_CLASSES = ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")
MACHINE_CLASSES = ("cpu", "cpu-bf16", "gpu", "tpu", *TPU_CLASSES)
# device_kind -> class; more specific kinds first ("TPU v5 lite" before "TPU v5").
_TPU_KINDS = (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v6 lite", "tpu-v6e"),
              ("v6e", "tpu-v6e"), ("v5p", "tpu-v5p"), ("v5", "tpu-v5p"), ("v4", "tpu-v4"))
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16 / AMX; Arm's BF16 extension


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo "flags" on x86, "Features" on Arm; empty
    elsewhere); read once per process."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("flags", "features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def machine_class(device: Any = None) -> str:
    """The class of machine a measured default belongs to: "tpu-v5e" / "tpu-v6e" / "tpu-v5p" /
    "tpu-v4" (a TPU generation; "tpu" if unknown), "gpu", "cpu-bf16" (a CPU with bfloat16 matmul
    instructions, where a bfloat16 target decodes faster) or "cpu" (where bfloat16 is emulated
    and float32 is faster). `device`: the class of that device (e.g. one of a TPU topology that
    a program is compiled for); default this host's. `$JSPEC_MACHINE_CLASS` overrides it."""
    env = os.environ.get("JSPEC_MACHINE_CLASS")
    if env:
        if env not in MACHINE_CLASSES:
            raise JspecError(f"$JSPEC_MACHINE_CLASS must be one of {MACHINE_CLASSES}, got "
                             f"{env!r}")
        return env
    backend = (device.platform if device is not None else jax.default_backend()).lower()
    if backend == "tpu":
        kind = (device.device_kind if device is not None else jax.devices()[0].device_kind)
        kind = kind.lower()
        return next((cls for key, cls in _TPU_KINDS if key in kind), "tpu")
    if backend != "cpu":
        return "gpu"  # cuda / rocm
    return "cpu-bf16" if cpu_flags() & set(_BF16_FLAGS) else "cpu"


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
      a JSON-ready dict: cpu, cpu_count, machine_class, backend, device_kind, device_count,
      process_count, jax, jaxlib, python, platform, dtype, command (shell-quoted), git_commit,
      xla_flags, time_utc.
    """
    devs = jax.devices()
    args = list(sys.argv if argv is None else argv)
    if args and args[0].endswith("__main__.py"):  # `python -m pkg` shows as pkg/__main__.py
        args[:1] = ["-m", Path(args[0]).parent.name]
    cmd = [sys.executable, *args]
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "machine_class": machine_class(),
            "backend": jax.default_backend(),
            "device_kind": devs[0].device_kind, "device_count": len(devs),
            "process_count": jax.process_count(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "dtype": dtype, "command": shlex.join(cmd),
            "git_commit": _git_commit(), "xla_flags": os.environ.get("XLA_FLAGS"),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
