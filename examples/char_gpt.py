"""A character-level GPT in the shape of nanoGPT's ``train.py``, ported to towers by its setup.

The training is nanoGPT's: batches drawn with ``torch.randint`` from the global RNG by
``get_batch``, the next batch drawn ahead while the current one trains, gradient accumulation
with ``loss / gradient_accumulation_steps`` and ``require_backward_grad_sync``, a GradScaler,
clipping, AdamW with decay and no-decay groups, warmup then cosine, and an evaluation by rank 0
alone (``estimate_loss`` under ``master_process``). The text is the Python standard library's
own source (the ``.py`` files at the top of ``sysconfig.get_paths()["stdlib"]``, in name
order), so nothing is downloaded.

The lines a DDP script changes for towers are marked ``# towers:`` below, with what they were
(docs/porting.md shows them as a diff). ``loss.backward()``, the micro-step flag,
``clip_grad_norm_``, ``optimizer.step()`` and ``zero_grad`` stay as DDP has them. Three changes
are not setup: every rank seeds alike and keeps the whole accumulation (each micro-batch is a
global one, which ``tw.shard`` cuts), and ``estimate_loss`` leaves the global RNG as it found it,
because rank 0 alone draws its evaluation batches from it. Without that line the next step
stops with "the ranks are not on the same global batch", naming an evaluation on rank 0.

The script checks itself: with more than one rank, rank 0 then runs the same script as one
plain PyTorch process (``ddp`` false: no towers, no DDP) and exits non-zero unless the final
parameters and every evaluation agree to float tolerance. Dropout is off: its masks are drawn
per rank, so with dropout no run on several ranks equals one process exactly.

Run it::

    towers run examples/char_gpt.py -n 2
    torchrun --nproc-per-node 2 examples/char_gpt.py
    python examples/char_gpt.py                    # one process
"""

import argparse
import math
import os
import sysconfig
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import towers  # towers: was the imports of DistributedDataParallel and init_process_group

# -- the model -----------------------------------------------------------------------------------


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

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.ln_f(self.blocks(x)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """AdamW, decaying the matrices (embeddings, linear weights) but not biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def load_text(chars):
    """The first ``chars`` characters of the standard library's top-level modules, by name."""
    text = ""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= chars:
            break
    return text[:chars]


# -- train.py ------------------------------------------------------------------------------------


def train(cfg, distributed=True):
    """nanoGPT's training script; returns rank 0's model and evaluations (others: None)."""
    ddp = distributed and int(os.environ.get("RANK", -1)) != -1  # a launcher started us
    gradient_accumulation_steps = cfg.gradient_accumulation_steps
    batch_size, block_size = cfg.batch_size, cfg.block_size
    if ddp:
        tw = towers.init()  # towers: was init_process_group(backend=backend)
        ddp_rank = int(os.environ["RANK"])
        ddp_world_size = int(os.environ["WORLD_SIZE"])
        device = str(tw.device)  # towers: was f"cuda:{ddp_local_rank}" and cuda.set_device
        master_process = ddp_rank == 0
        seed_offset = 0  # towers: was ddp_rank: every rank draws the same global batches
        # towers: `gradient_accumulation_steps //= ddp_world_size` deleted, with its assert
    else:
        master_process, seed_offset, ddp_world_size = True, 0, 1
        device = cfg.device
    tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # towers: no * world
    if master_process:
        print(f"tokens per iteration will be: {tokens_per_iter:,} on {ddp_world_size} rank(s)")
    torch.manual_seed(1337 + seed_offset)
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    autocast = (
        nullcontext()
        if device_type == "cpu"
        else torch.amp.autocast(device_type=device_type, dtype=ptdtype[cfg.dtype])
    )

    text = load_text(cfg.chars)
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    train_data, val_data = data[:n], data[n:]

    def get_batch(split):
        d = train_data if split == "train" else val_data
        ix = torch.randint(len(d) - block_size, (batch_size,))
        x = torch.stack([d[i : i + block_size] for i in ix.tolist()])
        y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix.tolist()])
        return x.to(device), y.to(device)

    model = GPT(len(stoi), block_size, cfg.n_layer, cfg.n_head, cfg.n_embd).to(device)
    scaler = torch.amp.GradScaler(device_type, enabled=cfg.dtype == "float16")
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (0.9, 0.95))
    if ddp:
        model = tw.replicate(model)  # towers: was DDP(model, device_ids=[ddp_local_rank])

    @torch.no_grad()
    @torch.random.fork_rng()  # towers: added: rank 0's draws here must not move the batches
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(cfg.eval_iters)
            for k in range(cfg.eval_iters):
                X, Y = get_batch(split)
                with autocast:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it):
        if it < cfg.warmup_iters:
            return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
        if it > cfg.lr_decay_iters:
            return cfg.min_lr
        ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)

    X, Y = get_batch("train")  # the first batch, drawn ahead
    raw_model = model  # towers: was model.module if ddp else model
    evals, iter_num = [], 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % cfg.eval_interval == 0 and master_process:
            losses = estimate_loss()
            evals.append(losses)
            train_loss, val_loss = losses["train"], losses["val"]
            print(f"step {iter_num}: train loss {train_loss:.4f}, val loss {val_loss:.4f}")
        for micro_step in range(gradient_accumulation_steps):
            if ddp:  # only the last micro-step's backward combines the ranks' gradients
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            with autocast:
                _, loss = model(*tw.shard((X, Y))) if ddp else model(X, Y)  # towers: shard
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")  # the next batch, drawn while this one trains
            scaler.scale(loss).backward()
        if cfg.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num > cfg.max_iters:
            break
    if ddp:
        tw.close()  # towers: was destroy_process_group()
    return (raw_model, evals, ddp_world_size) if master_process else (None, None, ddp_world_size)


# -- the check: the same script as one plain process (added) -------------------------------------


def check_against_one_process(trained, evals, ranks, cfg):
    plain, plain_evals, _ = train(cfg, distributed=False)
    worst = 0.0
    for (name, p), q in zip(trained.named_parameters(), plain.parameters()):
        p, q = p.detach().cpu(), q.detach().cpu()
        gap = ((p - q).abs().max() / q.abs().max()).item()
        worst = max(worst, gap)
        if gap > cfg.rtol:
            raise SystemExit(f"FAIL: {name} differs from one process's by {gap:.1e} (relative)")
    pairs = [(e[k], f[k]) for e, f in zip(evals, plain_evals) for k in e]
    loss_gap = max(abs(got - want) / abs(want) for got, want in pairs)
    if loss_gap > cfg.rtol:
        raise SystemExit(f"FAIL: evaluations differ from one process's by {loss_gap:.1e}")
    print(
        f"OK: {cfg.max_iters + 1} steps on {ranks} ranks x {cfg.gradient_accumulation_steps} "
        f"micro-steps equal one process: parameters within {worst:.1e}, evaluations within "
        f"{loss_gap:.1e}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=200_000, help="characters of text")
    parser.add_argument("--max-iters", type=int, default=40, help="the last iteration")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-step")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32, help="characters per sequence")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup-iters", type=int, default=5)
    parser.add_argument("--lr-decay-iters", type=int, default=40)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--eval-interval", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--eval-iters", type=int, default=4, help="batches per evaluation")
    parser.add_argument("--device", default="cpu", help="the device of a plain run")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rtol", type=float, default=1e-4, help="tolerance of the check")
    config = parser.parse_args()
    model, evaluations, world = train(config)
    if model is not None and world > 1:
        check_against_one_process(model, evaluations, world, config)
