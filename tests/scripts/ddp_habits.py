"""A DDP script's loop with only its setup changed: ``loss.backward()``, ``clip_grad_norm_``,
``optimizer.step()``, ``zero_grad()``, micro-batches under ``no_sync``; saves rank 0's
parameters (its state dict). With ``--rank0-eval`` the script then trains the same steps once
more, where rank 0 also draws from the global RNG (nanoGPT's ``estimate_loss`` under
``if master_process``), which the next step must refuse: the job fails, after the save.

    towers run tests/scripts/ddp_habits.py -n 2 -- OUT [--rank0-eval]
    torchrun --nproc-per-node 2 tests/scripts/ddp_habits.py OUT [--rank0-eval]
"""

import sys

import torch

import towers

STEPS, MICRO, BATCH = 6, 2, 12


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def get_batch():
    """As nanoGPT draws its batches: from the global RNG, the same on every rank."""
    x = torch.randn(BATCH, 4)
    return x, x.sum(1, keepdim=True).sin()


def train(ctx, model, opt, rank0_eval: bool) -> None:
    torch.manual_seed(1337)  # the same seed on every rank: the same global batches
    for step in range(STEPS):
        if rank0_eval and step == 2 and ctx.is_main:
            torch.randn(BATCH, 4)  # an evaluation on rank 0 only, from the global RNG
        opt.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            (shard,) = ctx.shards([get_batch()])
            loss = (model(shard[0]) - shard[1]).square().mean() / MICRO
            if micro < MICRO - 1:
                with ctx.no_sync():
                    loss.backward()
            else:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def main(out: str, rank0_eval: bool) -> None:
    torch.set_num_threads(1)
    ctx = towers.init(timeout=30)
    model = ctx.replicate(build(), balance=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(ctx, model, opt, rank0_eval=False)
    if ctx.is_main:
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, out)
    if rank0_eval:
        train(ctx, model, opt, rank0_eval=True)  # raises at step 3, on every rank
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1], "--rank0-eval" in sys.argv)
