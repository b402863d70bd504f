"""Run one JAX program as several processes on this machine: a local stand-in for multi-host.

JAX spans hosts with one process per host, joined by `jax.distributed.initialize` into one
runtime: `jax.devices()` then lists the devices of every process and a mesh can span them all.
On CPU several such processes run on one machine (XLA:CPU's cross-process collectives go
through gloo over TCP), which is how jspec's multi-process paths are tested here::

    python -m jspec.launch -n 2 --devices 4 -- python -m train dflash --distributed --mesh 2x4
    python -m jspec.launch -n 2 --devices 4 -- python -m jspec generate --mesh 2x4 --prompt ..

`launch` (and the command line) starts N copies of a command, each with M fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=M`, `JAX_PLATFORMS=cpu`) and the rendezvous in
its environment (`JSPEC_COORDINATOR` = localhost and a free port, `JSPEC_NUM_PROCESSES`,
`JSPEC_PROCESS_ID`); the program calls `initialize()` first, which hands these to
`jax.distributed.initialize`. Output (stdout and stderr together) is streamed line by line,
prefixed with the rank, and kept per process. The run fails as a whole, with a message that says
which process failed and how, when one process exits with an error (the others are stopped: a
process group blocked in a collective with a dead peer may otherwise wait long) or when the
group runs past its timeout. Every child runs in its own process group (its own session) and is
ended by that group's id, SIGTERM then SIGKILL after a grace period, so nothing it started
outlives the run; on Linux a child is also killed if the launcher itself dies (not what the child
started, then: its group can only be ended by a live launcher).

On real clusters there is no launcher: Cloud TPU (one process per host) and SLURM (one per task)
start the processes and `jax.distributed.initialize()` finds the rendezvous by itself;
`initialize(fallback=True)` does exactly that when the launcher's variables are absent
(docs/SCALING.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

import jax

__all__ = ["ENV_COORDINATOR", "ENV_HEARTBEAT", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "LaunchError",
           "LaunchResult", "ProcessGroup", "ProcessResult", "free_port", "initialize", "launch",
           "main"]

ENV_COORDINATOR = "JSPEC_COORDINATOR"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "JSPEC_NUM_PROCESSES"
ENV_PROCESS_ID = "JSPEC_PROCESS_ID"
ENV_HEARTBEAT = "JSPEC_HEARTBEAT_TIMEOUT"  # seconds without a heartbeat before a peer is dead

TIMEOUT_EXIT = 124  # the run's exit status when the group ran past its timeout (as timeout(1))


class LaunchError(RuntimeError):
    """A launched process group failed (one process exited with an error, or it timed out)."""


# ----------------------------------------------------------------------------- in the child
def initialize(*, fallback: bool = False, initialization_timeout: int = 300,
               heartbeat_timeout: int | None = None) -> bool:
    """Join the distributed runtime, before any other JAX call that touches a device.

    Under `launch`: `jax.distributed.initialize(JSPEC_COORDINATOR, JSPEC_NUM_PROCESSES,
    JSPEC_PROCESS_ID)`. Without those variables: with `fallback`, `jax.distributed.initialize()`
    with no arguments (Cloud TPU, SLURM, Open MPI: JAX detects the rendezvous); else nothing.
    Calling it again after the runtime is up is a no-op.

    Args:
      fallback: outside the launcher, still call `jax.distributed.initialize()` (what
        `--distributed` means on a cluster).
      initialization_timeout: seconds to wait for every process to connect.
      heartbeat_timeout: seconds after which a silent peer is declared dead and every
        process is stopped by the runtime (default `JSPEC_HEARTBEAT_TIMEOUT`, else JAX's 100).
    Returns:
      True when this process is (now) part of a distributed runtime.
    """
    if jax.distributed.is_initialized():
        return True
    kw: dict[str, int] = {"initialization_timeout": initialization_timeout}
    beat = heartbeat_timeout or int(os.environ.get(ENV_HEARTBEAT, "0") or 0)
    if beat:
        kw["heartbeat_timeout_seconds"] = beat
    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator:
        jax.distributed.initialize(coordinator, int(os.environ[ENV_NUM_PROCESSES]),
                                   int(os.environ[ENV_PROCESS_ID]), **kw)
        return True
    if fallback:
        jax.distributed.initialize(**kw)
        return True
    return False


# ----------------------------------------------------------------------------- in the launcher
def free_port() -> int:
    """A TCP port that was free on localhost a moment ago (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def child_env(rank: int, num_processes: int, devices: int, port: int,
              base: Mapping[str, str] | None = None, platform: str | None = "cpu"
              ) -> dict[str, str]:
    """The environment of process `rank`: the rendezvous, M fake CPU devices, unbuffered output.

    Args:
      rank / num_processes: this process's id and the group size.
      devices: CPU devices per process (replaces any `--xla_force_host_platform_device_count`).
      port: the coordinator's port on localhost.
      base: the environment to extend (default `os.environ`).
      platform: `JAX_PLATFORMS` for the child (None: leave it as in `base`).
    Returns:
      the environment mapping.
    """
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    if platform is not None:
        env["JAX_PLATFORMS"] = platform
    env.update({ENV_COORDINATOR: f"localhost:{port}", ENV_NUM_PROCESSES: str(num_processes),
                ENV_PROCESS_ID: str(rank), "PYTHONUNBUFFERED": "1"})
    return env


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """One process of a finished group."""

    rank: int
    pid: int
    returncode: int  # negative: ended by that signal (as subprocess reports it)
    output: str  # stdout and stderr, interleaved as written
    stopped: bool  # ended by the launcher (after another process failed, or the timeout)


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """A finished group: per-process results and, on failure, why."""

    processes: tuple[ProcessResult, ...]
    seconds: float  # wall time from the first start to the last exit
    error: str | None  # None when every process exited with status 0
    returncode: int  # 0, the first failing process's status, or TIMEOUT_EXIT

    @property
    def ok(self) -> bool:
        return self.error is None

    def output(self, rank: int) -> str:
        return self.processes[rank].output

    def check(self) -> LaunchResult:
        """Raise `LaunchError` (with the failure and the tail of each output) unless ok."""
        if self.ok:
            return self
        tails = "\n".join(f"--- process {p.rank} (exit {p.returncode}) ---\n{p.output[-3000:]}"
                          for p in self.processes)
        raise LaunchError(f"{self.error}\n{tails}")


# Linux: the child's first program sets PR_SET_PDEATHSIG (SIGKILL when the launching thread
# dies; it survives exec) and then becomes the command. A fresh interpreter does this rather than
# a `preexec_fn`, which would run Python between fork and exec in a multithreaded parent (JAX's).
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "try:\n"
                    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
                    "except (OSError, AttributeError):\n"
                    "    pass\n"
                    "if os.getppid() != int(sys.argv[1]):\n"
                    "    sys.exit(1)  # the launcher is already gone\n"
                    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def _command(cmd: list[str]) -> list[str]:
    """`cmd`, on Linux behind the parent-death trampoline."""
    if sys.platform != "linux":
        return cmd
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


class ProcessGroup:
    """N copies of a command started together, watched together, ended together.

    Use as a context manager (leaving it stops whatever still runs), or `launch` for one call:

        with ProcessGroup(["python", "worker.py"], 2, devices=4, timeout=300) as g:
            result = g.wait()
    """

    def __init__(self, cmd: Sequence[str], num_processes: int, *, devices: int = 1,
                 timeout: float = 600.0, grace: float = 10.0, cwd: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None, platform: str | None = "cpu",
                 echo: IO[str] | None = None, stop_on_failure: bool = True) -> None:
        """
        Args:
          cmd: the command every process runs (argv).
          num_processes: N >= 1.
          devices: fake CPU devices per process.
          timeout: seconds for the whole group; past it every process is stopped.
          grace: seconds between SIGTERM and SIGKILL when stopping a process group.
          cwd / env: the children's working directory and base environment.
          platform: `JAX_PLATFORMS` of the children (None: inherited).
          echo: where to stream the rank-prefixed output as it comes (None: only collect).
          stop_on_failure: stop the others as soon as one process exits with an error (False:
            let them run to their own end or the timeout: to observe how JAX's runtime itself
            reacts to a dead peer).
        """
        if num_processes < 1 or devices < 1:
            raise ValueError(f"need at least one process and one device, got {num_processes} "
                             f"processes x {devices} devices")
        self.cmd, self.n, self.devices = list(cmd), num_processes, devices
        self.timeout, self.grace, self.cwd, self.env = timeout, grace, cwd, env
        self.platform, self.echo, self.stop_on_failure = platform, echo, stop_on_failure
        self.procs: list[subprocess.Popen[str]] = []
        self._out: list[list[str]] = []
        self._readers: list[threading.Thread] = []
        self._stopped: set[int] = set()
        self._echo_lock = threading.Lock()
        self._t0 = 0.0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> ProcessGroup:
        """Start the N processes, then one output reader thread per process.

        Raises:
          FileNotFoundError: the command is not found (before anything starts).
        """
        if shutil.which(self.cmd[0], path=(self.env or os.environ).get("PATH")) is None and \
                not os.path.isfile(self.cmd[0]):
            raise FileNotFoundError(f"launch: command not found: {self.cmd[0]!r}")
        port = free_port()
        self._t0 = time.monotonic()
        try:
            for rank in range(self.n):
                self.procs.append(subprocess.Popen(
                    _command(self.cmd), cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                    env=child_env(rank, self.n, self.devices, port, self.env, self.platform),
                    start_new_session=True))  # its own process group: ended as a whole, by its id
                self._out.append([])
        except BaseException:
            self.stop()
            raise
        for rank, proc in enumerate(self.procs):
            reader = threading.Thread(target=self._read, args=(rank, proc), daemon=True)
            reader.start()
            self._readers.append(reader)
        return self

    def _read(self, rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._out[rank].append(line)
            if self.echo is not None:
                with self._echo_lock:
                    self.echo.write(f"[{rank}] {line}" if line.endswith("\n")
                                    else f"[{rank}] {line}\n")
                    self.echo.flush()

    def _stop(self, rank: int) -> None:
        """SIGTERM to the process group of `rank`; SIGKILL after the grace period."""
        proc = self.procs[rank]
        if proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers of an exited leader
            return
        self._stopped.add(rank)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(self.grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        """End every process (and whatever it started) that still runs."""
        threads = [threading.Thread(target=self._stop, args=(r,)) for r in range(len(self.procs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def wait(self, poll: float = 0.05) -> LaunchResult:
        """Watch the group until every process has exited, one failed, or the timeout.

        Returns:
          the LaunchResult (`.check()` raises on failure).
        """
        error, code = None, 0
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed and error is None:
                    first = min(failed)  # failed in the same poll: the lowest rank is named
                    code = codes[first]
                    error = f"process {first} of {self.n} {_describe(code)}"
                    if self.stop_on_failure:
                        running = [r for r, c in enumerate(codes) if c is None]
                        if running:
                            error += f"; stopped the others ({', '.join(map(str, running))})"
                        break
                if all(c is not None for c in codes):
                    break
                if time.monotonic() - self._t0 > self.timeout:
                    running = [r for r, c in enumerate(codes) if c is None]
                    prefix = f"{error}; then " if error else ""
                    error = (f"{prefix}the group timed out after {self.timeout:g} s with "
                             f"process{'es' if len(running) > 1 else ''} "
                             f"{', '.join(map(str, running))} still running; stopped them")
                    code = TIMEOUT_EXIT
                    break
                time.sleep(poll)
        finally:
            self.stop()
        for reader in self._readers:
            reader.join(5.0)
        seconds = time.monotonic() - self._t0
        results = tuple(ProcessResult(r, p.pid, int(p.returncode), "".join(self._out[r]),
                                      r in self._stopped) for r, p in enumerate(self.procs))
        return LaunchResult(results, seconds, error, code)

    def __enter__(self) -> ProcessGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(cmd: Sequence[str], num_processes: int, *, devices: int = 1, timeout: float = 600.0,
           grace: float = 10.0, cwd: str | os.PathLike | None = None,
           env: Mapping[str, str] | None = None, platform: str | None = "cpu",
           echo: IO[str] | None = None, stop_on_failure: bool = True,
           on_start: Callable[[ProcessGroup], None] | None = None) -> LaunchResult:
    """Run `cmd` as `num_processes` JAX processes with `devices` CPU devices each; wait.

    Args: as `ProcessGroup`; `on_start` is called with the started group (its `pids`) from a
      thread of its own while the group runs (e.g. to kill one process in a test).
    Returns:
      LaunchResult: per-process exit status and output, `error` None on success.
    """
    with ProcessGroup(cmd, num_processes, devices=devices, timeout=timeout, grace=grace, cwd=cwd,
                      env=env, platform=platform, echo=echo,
                      stop_on_failure=stop_on_failure) as group:
        if on_start is not None:
            threading.Thread(target=on_start, args=(group,), daemon=True).start()
        return group.wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m jspec.launch -n N --devices M [--timeout S] -- COMMAND ...`."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m jspec.launch -n N [--devices M] [--timeout S] -- COMMAND ...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m jspec.launch",
                                description="Run COMMAND as N JAX processes on this machine "
                                            "(M CPU devices each), joined by "
                                            "jspec.launch.initialize().")
    p.add_argument("-n", "--num-processes", type=int, default=2, help="processes (default 2)")
    p.add_argument("--devices", type=int, default=1, help="CPU devices per process (default 1)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds for the whole run (default 3600)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping (default 10)")
    args = p.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        p.error("no command after --")
    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM to the launcher: stop the group on the way out

    signal.signal(signal.SIGTERM, interrupted)
    try:
        result = launch(cmd, args.num_processes, devices=args.devices, timeout=args.timeout,
                        grace=args.grace, echo=sys.stdout)
    except KeyboardInterrupt:  # the group was stopped on the way out
        print("launch: interrupted; stopped every process", file=sys.stderr)
        return 130
    if not result.ok:
        print(f"launch: {result.error}", file=sys.stderr)
        return result.returncode if result.returncode > 0 else 128 - result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
