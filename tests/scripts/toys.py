"""A toy transport, a toy mode and a toy compression: each is one class and one registration.

Importing this module registers them; ``towers.train(transport="ordered", mode="clipped:C",
compress="raw")`` and ``towers.init(transport="ordered")`` then use them by name
(``tests/test_registries.py``, docs/architecture.md):

- transport ``ordered``: every sum gathers every rank's tensor and adds them up in rank order,
  so its result does not depend on the order in which the values arrive;
- mode ``clipped:C``: ``sync`` whose averaged gradient is clipped to the global norm C before
  every step;
- compression ``raw``: float32 values as they are, 4 bytes each, through towers' coded sum.

With ``TOY_LOG`` set, each rank writes the number of sums and gathers its transport carried to
``$TOY_LOG/rank-R.json`` when it closes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from towers.comm.base import DistComm, Work
from towers.comm.transports import register as register_transport
from towers.core.modes import register as register_mode
from towers.core.specs import Real
from towers.core.transport import Transport
from towers.engines.sync.mode import SyncMode
from towers.engines.sync.plan import EveryStep, StepPlan
from towers.engines.transforms.coded import CodedSum
from towers.engines.transforms.compressions import Compression
from towers.engines.transforms.compressions import register as register_compression

# -- a transport: its class, and one registration ------------------------------------------


class _Added:
    """A gather on its way; waited, it adds the ranks' tensors up in rank order."""

    def __init__(self, work: Work, gathered: torch.Tensor, into: torch.Tensor):
        self.work, self.gathered, self.into = work, gathered, into

    def wait(self) -> Any:
        self.work.wait()
        total = self.gathered[0].clone()
        for part in self.gathered[1:]:
            total += part
        self.into.copy_(total.view_as(self.into))
        return True


class OrderedComm:
    """The job's process group, with every sum taken in rank order."""

    def __init__(self, base: DistComm):
        self.base = base
        self.counts = {"sums": 0, "gathers": 0}

    def __getattr__(self, name: str) -> Any:  # everything else as the process group does
        return getattr(self.base, name)

    def all_reduce_sum(self, tensor: torch.Tensor) -> Work:
        self.counts["sums"] += 1
        flat = tensor.detach().reshape(-1)
        gathered = torch.empty(self.base.world_size * flat.numel(), dtype=flat.dtype)
        work = self.base.all_gather(gathered, flat.contiguous())
        return _Added(work, gathered.view(self.base.world_size, -1), tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        self.counts["gathers"] += 1
        return self.base.all_gather(output, input)

    def close(self) -> None:
        log = os.environ.get("TOY_LOG")
        if log:
            path = Path(log, f"rank-{self.base.rank}.json")
            path.write_text(json.dumps(self.counts))
        self.base.close()


ORDERED = register_transport(
    Transport("ordered", "sums in rank order", ("cpu",), module=__name__),
    lambda base, timeout, interrupt: OrderedComm(base),
)

# -- a mode: its class (and its step plan), registered -----------------------------------------


class ClipEveryStep(EveryStep):
    """``sync``'s step, with the averaged gradient clipped to the norm ``most`` first."""

    def __init__(self, most: float):
        super().__init__()
        self.most = most

    def step(self, driver, optimizer, index, *, stamp=None, at=None):
        result = driver.reduce(stamp)
        if optimizer is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.most)
            driver.apply(result, optimizer)
        self._landed.append((index, result, None))
        return result


@register_mode
class Clipped(SyncMode):
    """``clipped:C``: ``sync``, the averaged gradient clipped to the global norm C."""

    name = "clipped"
    help = "sync, with the averaged gradient clipped to the norm C before each step"
    example = "clipped:1.0"
    fields = (Real("C, the largest norm of the averaged gradient (> 0)", above=0.0),)
    exact_under_any_split = True
    reduces_every_step = True

    def plan(self, outer_optimizer: Any = None) -> StepPlan:
        return ClipEveryStep(cast(float, self.arg))


# -- a codec: its class, and the compression that names it, registered ------------------------


@dataclass(frozen=True)
class RawCodec:
    """float32 values as they are."""

    name = "raw"

    def nbytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return data.contiguous().view(torch.float32)


@register_compression
class Raw(Compression):
    """``raw``: every value sent as the float32 it is."""

    name = "raw"
    help = "float32 values as they are, 4 bytes each"

    def transform(self) -> CodedSum:
        return CodedSum(RawCodec())
