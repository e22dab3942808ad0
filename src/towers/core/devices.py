"""Where a worker computes: the device choice, a pure function of what was asked and what is there.

``device="auto" | "cpu" | "cuda"`` (``towers.train``, ``towers.init``) becomes a
:class:`Placement` by :func:`place`, from the request, the number of worker processes that share
this host's GPUs, the number of GPUs visible here and the worker's local rank. GPU workers get one
GPU each (``cuda:LOCAL_RANK``) and talk over NCCL; CPU workers talk over Gloo (or shared memory).
NCCL refuses two ranks on one GPU, so ``auto`` trains on GPUs only when every worker on the host
has its own, and ``cuda`` with fewer GPUs than workers is refused before any process starts.

The visible count comes from :func:`visible_gpus`, which asks NVML through
``torch.cuda.device_count()``: unlike ``torch.cuda.is_available()`` it does not initialise CUDA
in the caller, so the caller can still fork CPU workers (a child forked after CUDA was
initialised cannot use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .transport import Transport

__all__ = [
    "DEVICES",
    "KINDS",
    "DeviceKind",
    "Placement",
    "check_device",
    "moved",
    "narrow",
    "place",
    "visible_gpus",
]

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceKind:
    """What a kind of device declares: ``untimed``, why a tower's seconds on the host cannot
    steer a balanced split there, or ``None`` where they measure its compute."""

    name: str
    untimed: str | None = None


def _no_events() -> str | None:
    """Why GPU towers cannot be timed on their device by this torch, if they cannot (a tower's
    time on the host measures how fast it queues kernels, not how fast its GPU runs them)."""
    event = getattr(getattr(torch, "cuda", None), "Event", None)
    if event is not None and hasattr(event, "elapsed_time") and hasattr(event, "query"):
        return None
    return (
        "this torch has no CUDA events to time each tower's work on its GPU "
        "(torch.cuda.Event.elapsed_time), and a tower's time on the host measures how fast it "
        "queues kernels, not how fast its GPU runs them"
    )


# GPU towers are timed by CUDA events around their forward and backward
# (towers.engines.sync.runner: DeviceClock)
KINDS = {"cpu": DeviceKind("cpu"), "cuda": DeviceKind("cuda", untimed=_no_events())}


@dataclass(frozen=True)
class Placement:
    """One worker's device and the process-group backend that goes with it.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``.
        device: this worker's device (``cuda:LOCAL_RANK`` or ``cpu``).
        backend: ``"nccl"`` for GPU workers, ``"gloo"`` for CPU workers.
        reason: one line for the log: what was chosen and why.
    """

    kind: str
    device: torch.device
    backend: str
    reason: str

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"


def visible_gpus() -> int:
    """CUDA devices this process can see (``CUDA_VISIBLE_DEVICES`` applied), without
    initialising CUDA; 0 on a build of torch without CUDA."""
    return torch.cuda.device_count()


def check_device(device: object) -> str:
    """``device`` as one of :data:`DEVICES`, or a ``ValueError``/``TypeError`` saying what is."""
    if isinstance(device, torch.device):
        device = device.type if device.index is None else str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda:"):
        raise ValueError(
            f"device={device!r}: towers gives each worker its own GPU (cuda:LOCAL_RANK); pass "
            "device='cuda', and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))}; got {device!r}")
    return device


def narrow(
    request: str, transport: Transport | str | None = None, backend: str | None = None
) -> str:
    """The device that ``request`` leaves once the transport or backend asked for is applied.

    NCCL moves GPU tensors; Gloo and shared memory move CPU tensors. ``auto`` follows them;
    an explicit device that contradicts them is refused. ``backend`` is a process group's
    (``"gloo"``, ``"nccl"``), read as the transport of the same name.

    Raises:
        ValueError: ``device='cpu'`` with NCCL, or ``device='cuda'`` with Gloo or shared memory.
    """
    request = check_device(request)
    given = {"transport": transport, "backend": backend}
    asked = [f"{k}={str(v)!r}" for k, v in given.items() if v is not None and str(v) != "auto"]
    wants = {Transport.parse(v) for v in given.values() if v is not None} - {Transport.AUTO}
    if Transport.NCCL in wants:
        if request == "cpu" or any(t.cpu for t in wants):
            raise ValueError(
                f"{', '.join(asked)} with device={request!r}: NCCL moves GPU tensors and Gloo or "
                "shared memory CPU tensors; pass device='cuda' for NCCL or device='cpu' for Gloo"
            )
        return "cuda"
    if any(t.cpu for t in wants):
        if request == "cuda":
            raise ValueError(
                f"{', '.join(asked)} with device='cuda': Gloo and shared memory move CPU tensors "
                "here; GPU workers sum over NCCL: drop the transport/backend (or pass 'nccl'), "
                "or pass device='cpu'"
            )
        return "cpu"
    return request


def place(request: str, workers: int, visible: int, local_rank: int = 0) -> Placement:
    """The placement of the worker with ``local_rank`` among ``workers`` processes on its host.

    Args:
        request: ``"auto"``, ``"cpu"`` or ``"cuda"`` (see :func:`check_device`).
        workers: the processes on this host that compute (each needs its own GPU).
        visible: the GPUs this host's processes can see.
        local_rank: this worker's index among them.

    Raises:
        ValueError: ``"cuda"`` on a host with no GPU, or with fewer GPUs than ``workers``.

    Example:
        >>> place("auto", workers=2, visible=1).kind  # one GPU cannot hold two NCCL ranks
        'cpu'
    """
    request = check_device(request)
    if workers < 1 or local_rank < 0:
        raise ValueError(f"no placement for local rank {local_rank} among {workers} workers")
    if request == "cuda":
        if visible == 0:
            raise ValueError(
                f"device='cuda' but no CUDA device is visible here (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda}); install a CUDA build of torch, check "
                "CUDA_VISIBLE_DEVICES, or pass device='cpu'"
            )
        if visible < workers:
            raise ValueError(
                f"device='cuda' gives every worker its own GPU: {workers} workers on this host, "
                f"{visible} GPU{'s' if visible != 1 else ''} visible. Use at most {visible} "
                "workers per host, or device='cpu' (device='auto' chooses)"
            )
        if local_rank >= visible:
            raise ValueError(
                f"device='cuda': local rank {local_rank} has no GPU of its own ({visible} "
                "visible); give each host at most as many workers as GPUs"
            )
        why = f"device='cuda': {workers} worker(s), one GPU each, NCCL"
        return _gpu(local_rank, why)
    if request == "auto" and visible >= workers and local_rank < visible:
        why = f"device='auto': {visible} GPU(s) for {workers} worker(s): one GPU each, NCCL"
        return _gpu(local_rank, why)
    if request == "auto" and visible > 0:
        why = (
            f"device='auto': {workers} workers but {visible} GPU(s) visible, and a GPU holds one "
            "worker: CPU workers, Gloo (pass device='cuda' with at most that many workers)"
        )
    elif request == "auto":
        why = "device='auto': no GPU visible: CPU workers, Gloo"
    else:
        why = "device='cpu': CPU workers, Gloo"
    return Placement("cpu", torch.device("cpu"), "gloo", why)


def _gpu(local_rank: int, reason: str) -> Placement:
    return Placement("cuda", torch.device("cuda", local_rank), "nccl", reason)


def moved(value: Any, device: torch.device | str) -> Any:
    """``value`` with every tensor in it on ``device``: dicts, lists and tuples are walked (and
    rebuilt), other values kept. For state that travels or is saved: a checkpoint written on a
    GPU holds CPU tensors, and a state read from one goes back to the worker's device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(moved(v, device) for v in value)
    return value
