"""A small character-level GPT trained with towers' own loop, the way nanoGPT-style scripts train.

Everything such a script has is here: AdamW with weight decay on matrices only, a linear warmup
then cosine learning-rate schedule, gradient clipping, gradient accumulation, and an evaluation
of the train and validation loss every few steps. The text is the Python standard library's own
source (the ``.py`` files at the top of ``sysconfig.get_paths()["stdlib"]``, in name order), so
the example needs no download.

What makes it a towers script (docs/porting.md has the same for DDP, Hogwild, Horovod and
Accelerate, side by side):

- ``ctx = towers.init()`` and ``model = ctx.replicate(model)`` instead of
  ``init_process_group`` and ``DDP(model)``;
- every rank draws the SAME global batches (one generator, one seed) and takes its shard with
  ``ctx.shards``; nanoGPT seeds each rank differently so that each draws its own batch;
- micro-batches: ``ctx.accumulate(loss, samples)`` for all but the last, ``ctx.backward`` for the
  last, each loss the plain mean over its micro-batch: NOT divided by the number of
  micro-batches, since towers weights every micro-batch by its samples;
- the evaluation runs on every rank (each its part of the evaluation batches) and combines with
  ``ctx.mean``, a collective: calling it on rank 0 alone, as nanoGPT calls ``estimate_loss``,
  would wait for the others forever.

The script checks itself: with more than one rank, rank 0 then trains the same model in one
process on the same global batches, without towers, and exits non-zero unless the parameters,
the losses and the evaluations agree to float tolerance.

Run it::

    towers run examples/char_gpt.py -n 2
    torchrun --nproc-per-node 2 examples/char_gpt.py
    python examples/char_gpt.py                    # one rank
"""

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import towers

# -- data ----------------------------------------------------------------------------------------


def load_text(chars):
    """The first ``chars`` characters of the standard library's top-level modules, by name."""
    text = ""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= chars:
            break
    return text[:chars]


def encode(text):
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(vocab)


def random_batches(data, steps, batch_size, block_size, seed):
    """``steps`` global batches of ``batch_size`` random windows: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
        x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        yield x, y


# -- model ---------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        # No biases in the attention: a key's bias has no effect on the softmax, so its gradient
        # is float noise, which Adam scales up to full steps in a direction no run agrees on.
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def attend(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attend(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        for m in self.modules():  # small initial weights: a first loss near ln(vocab_size)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # mean over the tokens


def make_optimizer(model, args):
    """AdamW, decaying the matrices (embeddings, linear weights) but not biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def learning_rate(step, args):
    """Linear warmup to ``args.lr``, then a cosine down to a tenth of it at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.lr / 10)


def build(args, vocab_size):
    torch.manual_seed(args.seed)  # the same initial weights wherever it is built
    return GPT(vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)


# -- training with towers ------------------------------------------------------------------------


def evaluate(ctx, model, splits, args):
    """Mean loss on each split's evaluation batches, over all ranks; call it on every rank.

    Each rank evaluates its shard of every batch and ``ctx.mean`` weights the ranks by their
    samples: the result equals one process evaluating every batch whole.
    """
    model.eval()
    losses, samples = {}, 0
    with torch.no_grad():
        for name, data in splits.items():
            total, samples = 0.0, 0
            for batch in random_batches(data, args.eval_iters, args.batch_size, args.block_size, 1):
                x, y = towers.split(batch, ctx.world_size)[ctx.rank]
                if len(x):
                    total += model(x, y).item() * len(x)
                    samples += len(x)
            losses[name] = total / max(samples, 1)
    model.train()
    return ctx.mean(losses, samples)  # every split has the same samples on a rank


def train(args):
    ctx = towers.init()
    data, vocab_size = encode(load_text(args.chars))
    cut = int(0.9 * len(data))
    splits = {"train": data[:cut], "val": data[cut:]}
    model = ctx.replicate(build(args, vocab_size))
    optimizer = make_optimizer(model, args)
    batches = random_batches(splits["train"], args.steps, args.batch_size, args.block_size, 0)
    losses, evals = [], []
    for step, shard in enumerate(ctx.shards(batches)):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        micro = towers.split(shard, args.accumulate)  # the last ones may be empty
        for x, y in micro[:-1]:
            if len(x):
                ctx.accumulate(model(x, y), samples=len(x))  # no division by args.accumulate
        x, y = micro[-1]
        r = ctx.backward(model(x, y) if len(x) else None, samples=len(x))
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(r.loss)  # the mean over the whole global batch, every rank
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append(evaluate(ctx, model, splits, args))  # every rank, not rank 0 alone
            if ctx.is_main:
                e = evals[-1]
                print(f"step {step + 1}: loss {r.loss:.4f}, train {e['train']:.4f}, "
                      f"val {e['val']:.4f}, lr {learning_rate(step, args):.2e}")  # fmt: skip
    if ctx.is_main and ctx.world_size > 1:
        check_against_one_process(model, losses, evals, splits, vocab_size, args, ctx.world_size)
    ctx.close()


# -- the check: the same training in one process, without towers (added) -------------------------


def check_against_one_process(trained, losses, evals, splits, vocab_size, args, ranks):
    model = build(args, vocab_size)
    optimizer = make_optimizer(model, args)
    batches = random_batches(splits["train"], args.steps, args.batch_size, args.block_size, 0)
    plain_losses, plain_evals = [], []
    for step, (x, y) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        loss = model(x, y)  # the whole global batch at once
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        plain_losses.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            with torch.no_grad():
                plain_evals.append({
                    name: sum(model(x, y).item() for x, y in random_batches(
                        data, args.eval_iters, args.batch_size, args.block_size, 1
                    )) / args.eval_iters
                    for name, data in splits.items()
                })  # fmt: skip
            model.train()
    worst = 0.0
    for (name, p), q in zip(trained.named_parameters(), model.parameters()):
        gap = ((p.detach() - q.detach()).abs().max() / q.detach().abs().max()).item()
        worst = max(worst, gap)
        if gap > args.rtol:
            raise SystemExit(f"FAIL: {name} differs from one process's by {gap:.1e} (relative)")
    pairs = list(zip(losses, plain_losses))
    pairs += [(e[k], f[k]) for e, f in zip(evals, plain_evals) for k in e]
    loss_gap = max(abs(got - want) / abs(want) for got, want in pairs)
    if loss_gap > args.rtol:
        raise SystemExit(f"FAIL: losses differ from one process's by {loss_gap:.1e} (relative)")
    print(
        f"OK: {args.steps} steps on {ranks} ranks x {args.accumulate} micro-batches equal one "
        f"process: parameters within {worst:.1e}, losses and evaluations within {loss_gap:.1e}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=200_000, help="characters of text")
    parser.add_argument("--steps", type=int, default=40, help="global batches")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per global batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per rank")
    parser.add_argument("--block-size", type=int, default=32, help="characters per sequence")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=5, help="warmup steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--eval-iters", type=int, default=4, help="batches per evaluation")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--rtol", type=float, default=1e-4, help="tolerance of the check")
    train(parser.parse_args())
