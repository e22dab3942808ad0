"""A DDP script on towers by its imports: the names it takes from ``torch.distributed``,
``torch.nn.parallel`` and ``torch.utils.data.distributed``.

```diff
-from torch.nn.parallel import DistributedDataParallel as DDP
-from torch.distributed import init_process_group, destroy_process_group
+from towers.ddp import DistributedDataParallel as DDP
+from towers.ddp import init_process_group, destroy_process_group
```

Each rank brings its own batch, as under DDP; towers weights each rank by its samples, so an
uneven last batch, ranks with batches of different sizes and ranks that run out at different
steps (``model.join()``) stay exact against one process on the batches put together, and
towers' options (``compress=``, shared-memory sums on one host, two-level sums across hosts,
the job's secret) apply. A loader given ``DistributedBatchSampler`` as its ``batch_sampler``
cuts each global batch in shares that follow the ranks' speeds, and ``ZeroRedundancyOptimizer``
(torch's name, from ``torch.distributed.optim``) shards the optimizer's state over the ranks.
See docs/porting.md.
"""

import torch.distributed as _dist

from .api.ddp import (
    DistributedDataParallel,
    barrier,
    destroy_process_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
)
from .api.sampler import DistributedBatchSampler, DistributedSampler
from .api.zero import ZeroRedundancyOptimizer

__all__ = [
    "DistributedBatchSampler",
    "DistributedDataParallel",
    "DistributedSampler",
    "ReduceOp",
    "ZeroRedundancyOptimizer",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_available",
    "is_initialized",
]

# The job's process group is torch's default one (a job of one has none): torch's own calls
# work on it, as a DDP script makes them.
ReduceOp = _dist.ReduceOp
all_reduce = _dist.all_reduce
broadcast = _dist.broadcast
is_available = _dist.is_available
