"""How local workers start: forked from the caller where that is safe, else from a fork server.

A worker forked from the caller starts with everything the caller has loaded: torch, towers,
``torch._dynamo`` (which building the first optimizer imports) and the user's modules. A fork
server has to import them all again in a fresh interpreter first, after the caller has imported
them itself: about 2.5 s of a first ``towers.train`` call, in which nothing else happens. So
workers are forked from the caller, as PyTorch's DataLoader forks its loading processes, unless:

- the caller has initialised CUDA (a forked child cannot use it) or joined a process group
  (the child would inherit its sockets): then a fork server starts them. CUDA counts as
  initialised once its driver library is loaded, not only once torch has set up its state:
  ``torch.cuda.is_available()`` loads the driver (``cuInit``) without the latter, and a child
  forked after it fails at its first CUDA call;
- the caller has loaded an OpenMP runtime whose thread pool cannot be released: a child forked
  from a process whose pool exists hangs in its first parallel region (GNU libgomp is not
  fork-safe). Before forking, the pool is released with ``omp_pause_resource_all``, which the
  OpenMP 5.0 standard provides for exactly this, and rebuilt at the caller's next parallel
  region;
- ``TOWERS_START_METHOD`` names another method (``forkserver`` or ``spawn``).

A forked child closes the caller's ends of the other workers' result pipes (each worker watches
its own pipe to die with the caller, :mod:`towers.processes.lifeline`) and drops the caller's
Python signal handlers, so that it starts as a fork server's child would.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.connection
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["METHODS", "START_ENV", "Starter", "default_signal_handlers", "starter"]

START_ENV = "TOWERS_START_METHOD"
METHODS = ("auto", "fork", "forkserver", "spawn")
_OPENMP = ("libgomp", "libiomp", "libomp")
_CUDA_DRIVER = "libcuda.so"  # loaded by cuInit; NVML (device counts) is libnvidia-ml
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free every resource, threads included


@dataclass(frozen=True)
class Starter:
    """Where workers come from: a multiprocessing context, and whether it forks the caller."""

    context: Any  # a multiprocessing context: fork, forkserver or spawn
    forks: bool

    def process(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        caller_ends: Sequence[multiprocessing.connection.Connection],
    ) -> Any:
        """Start ``target(*args)`` in a new worker; ``caller_ends`` are the pipe ends this
        process keeps (a forked child closes its copies)."""
        if self.forks:
            fds = tuple(c.fileno() for c in caller_ends)
            target, args = _forked, (fds, target, *args)
        # Not daemonic: a worker may start processes of its own (DataLoader's num_workers),
        # which multiprocessing refuses to a daemon; the caller stops every worker itself.
        p = self.context.Process(target=target, args=args, daemon=False)
        with _fork_warning_silenced():
            p.start()
        return p


def starter(fallback: Callable[[], Any]) -> Starter:
    """How to start workers now; ``fallback()`` is the context to use when forking is not.

    Call it right before starting the workers: it releases the OpenMP pool when it forks.
    """
    method = os.environ.get(START_ENV, "auto")
    if method not in METHODS:
        raise ValueError(
            f"{START_ENV}={method!r} is not a start method; use one of {', '.join(METHODS)} "
            "(auto: fork the caller where that is safe, else a fork server)"
        )
    if method == "auto":
        method = "fork" if _can_fork() else ""
    elif method == "fork":
        if "fork" not in mp.get_all_start_methods():
            raise ValueError(f"{START_ENV}=fork: this platform cannot fork")
        _release_openmp()
    if method == "fork":
        return Starter(mp.get_context("fork"), forks=True)
    if method:
        return Starter(mp.get_context(method), forks=False)
    return Starter(fallback(), forks=False)


def _can_fork() -> bool:
    if sys.platform != "linux" or "fork" not in mp.get_all_start_methods():
        return False
    if torch.cuda.is_initialized() or (dist.is_available() and dist.is_initialized()):
        return False
    loaded = _mapped_files()
    if loaded is None:
        return False
    if any(os.path.basename(p).startswith(_CUDA_DRIVER) for p in loaded):
        return False
    return _release_openmp(loaded)


def _mapped_files() -> set[str] | None:
    """The files this process has mapped (its shared libraries among them); ``None`` if
    ``/proc`` cannot tell."""
    try:
        with open("/proc/self/maps") as f:
            return {fields[-1] for line in f if len(fields := line.split()) >= 6}
    except OSError:
        return None


def _release_openmp(loaded: set[str] | None = None) -> bool:
    """Free this thread's OpenMP pool in every OpenMP runtime loaded; False if one cannot.

    ``loaded``: the paths of the shared libraries this process has mapped (read if not given).
    """
    loaded = _mapped_files() if loaded is None else loaded
    if loaded is None:
        return False
    paths = {p for p in loaded if any(n in p for n in _OPENMP)}
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an OpenMP older than 5.0
            return False
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(_OMP_PAUSE_HARD) != 0:
            return False
    return True


@contextlib.contextmanager
def _fork_warning_silenced() -> Iterator[None]:
    # Python 3.12+ warns on every fork of a multi-threaded process; the caller always is one
    # (numpy's BLAS starts a thread at import), and the hazards it warns of are handled above.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks")
        yield


def _forked(caller_fds: tuple[int, ...], target: Callable[..., Any], *args: Any) -> Any:
    """In a child forked from the caller: shed what it inherited, then run ``target``."""
    for fd in caller_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    default_signal_handlers()
    return target(*args)


def default_signal_handlers() -> None:
    """In a forked child: the parent's Python signal handlers and wake-up fd dropped, as a new
    interpreter starts (``SIGINT``'s is Python's own, ``KeyboardInterrupt``); handlers ignored
    stay ignored, as across an exec."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                interrupt = sig == signal.SIGINT
                signal.signal(sig, signal.default_int_handler if interrupt else signal.SIG_DFL)
