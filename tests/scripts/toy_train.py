"""``towers.train`` on two workers with the toy transport, mode and compression of ``toys.py``,
each asked for by name.

    python toy_train.py OUT

Writes the trained parameters and the losses to ``OUT/result.pt``; each rank's transport logs
what it carried to ``OUT/rank-R.json``.
"""

import functools
import os
import sys
from pathlib import Path

import torch

CLIP, STEPS, BATCH = 0.05, 6, 16  # read by the test, which must not register the toys


def main() -> None:
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    import toys  # noqa: F401  (registers the toys)
    from helpers import make_net, mse, regression_data

    import towers

    out = Path(sys.argv[1])
    os.environ["TOY_LOG"] = str(out)
    torch.set_num_threads(1)
    result = towers.train(
        make_net(),
        mse,
        regression_data(),
        workers=2,
        steps=STEPS,
        batch_size=BATCH,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        mode=f"clipped:{CLIP}",
        compress="raw",
        transport="ordered",
    )
    torch.save({"model": result.model.state_dict(), "losses": result.losses}, out / "result.pt")


if __name__ == "__main__":
    main()
