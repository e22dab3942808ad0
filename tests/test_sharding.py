"""shard_optimizer=True: each tower keeps the optimizer state of its part, and the run is exact.

One spawn of 3 workers runs every case (3 towers cut the test model's parameters inside them);
each case is compared with a plain single-process loop over the same global batches, within
the float64-derived bound (tests/exact.py). A checkpoint written by the 3 towers is resumed by
2, which must end where the uninterrupted run ends.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from exact import Reference, as_float64, bound, states
from helpers import Net, mse, regression_data
from torch import nn

import towers
from towers.engines.shard import ELEMENTWISE, layout
from towers.engines.shard_gather import IN_FLIGHT, PIECE
from towers.engines.transforms.scatter import _pieces

STEPS, CLIP = 7, 0.05


def wide(seed: int = 0) -> Net:
    """321 parameters: over 3 towers fc1.weight (192) is cut at 128 (cuts fall on multiples of
    64 elements)."""
    torch.manual_seed(seed)
    return Net(hidden=64)


def batches(size: int = 11, dtype: torch.dtype = torch.float32) -> list:
    """``STEPS`` global batches of ``size`` samples, the last one short (an uneven end)."""
    x, y = regression_data(STEPS * size)
    x, y = (x, y) if dtype == torch.float32 else as_float64((x, y))
    out = [(x[i : i + size], y[i : i + size]) for i in range(0, STEPS * size, size)]
    out[-1] = (out[-1][0][: size // 2], out[-1][1][: size // 2])
    return out


def make(name: str, params, dtype=torch.float32):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _state_elements(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim() > 0)


# -- the towers' loops ----------------------------------------------------------------------------


def _sgd_plain_backward(ctx) -> tuple:
    """SGD with Nesterov momentum and weight decay, a StepLR schedule, a plain loss.backward()."""
    model = ctx.replicate(wide(seed=ctx.rank), shard_optimizer=True)  # rank 0's weights
    opt = make("sgd", model.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for shard in ctx.shards(batches()):
        mse(model, shard).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    return _state(model), _state_elements(opt)


def _sgd_closure(ctx) -> dict[str, torch.Tensor]:
    """The SGD case with the backward in a closure, as LBFGS-style loops and Lightning call
    step: the closure sees the whole parameters, the step the slices."""
    model = ctx.replicate(wide(), shard_optimizer=True)
    opt = make("sgd", model.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for shard in ctx.shards(batches()):

        def closure(shard=shard):
            opt.zero_grad()
            loss = mse(model, shard)
            loss.backward()
            return loss

        opt.step(closure)
        schedule.step()
    return _state(model)


def _adam_clipped(ctx, balance: bool) -> tuple:
    """Adam, ctx.backward, clip_grad_norm_ over the whole model (the norm over all parts)."""
    torch.manual_seed(0)
    model = ctx.replicate(wide(), shard_optimizer=True, balance=balance)
    opt = make("adam", model.parameters())
    norms = []
    for shard in ctx.shards(batches()):
        ctx.backward(mse(model, shard))
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return _state(model), norms, _state_elements(opt)


def _norms(model: nn.Module) -> list[float]:
    """What a script reads of the gradients as a whole: the 2-norm and the largest magnitude
    over the model (clip_grad_norm_'s two usual kinds), and each parameter's 2-norm."""
    params = list(model.parameters())
    total = float(nn.utils.clip_grad_norm_(params, 1e9))
    largest = float(nn.utils.clip_grad_norm_(params, 1e9, norm_type=float("inf")))
    return [total, largest, *(float(p.grad.norm()) for p in params)]


def _sgd_norms(ctx) -> list[float]:
    torch.manual_seed(0)
    model = ctx.replicate(wide(), shard_optimizer=True)
    opt = make("sgd", model.parameters())
    seen = []
    for shard in ctx.shards(batches()):
        ctx.backward(mse(model, shard))
        seen += _norms(model)
        opt.step()
        opt.zero_grad()
    return seen


def _plain_norms(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(0)
    model = wide().to(dtype)
    opt = make("sgd", model.parameters())
    seen = []
    for x, y in batches(11, dtype):
        mse(model, (x, y)).backward()
        seen += _norms(model)
        opt.step()
        opt.zero_grad()
    return model, seen


def _adamw_scaled_accumulated(ctx, directory: Path, stop: int | None) -> dict:
    """AdamW with weight decay, a GradScaler, two micro-batches a step, a checkpoint at each
    step; ``stop``: leave after that many steps (a run that is resumed later)."""
    torch.manual_seed(0)
    model = ctx.replicate(wide(), shard_optimizer=True)
    opt = make("adamw", model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    start, _ = ctx.load_checkpoint(directory, model, opt)
    for step, shard in enumerate(ctx.shards(batches(12)[start:]), start=start):
        if step == stop:
            break
        x, y = shard
        half = len(x) // 2
        ctx.accumulate(mse(model, (x[:half], y[:half])), half, scaler=scaler)
        ctx.backward(mse(model, (x[half:], y[half:])), len(x) - half, scaler=scaler)
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ctx.save_checkpoint(directory, step + 1, model, opt)
    return _state(model)


def _mistakes(ctx, directory: Path) -> dict[str, str]:
    errors = {}
    model = ctx.replicate(wide(), shard_optimizer=True)
    shard = next(iter(ctx.shards(batches())))
    for name, build in {
        "lbfgs": lambda: torch.optim.LBFGS(model.parameters()),
        "stranger": lambda: torch.optim.SGD(
            [*model.parameters(), torch.zeros(2, requires_grad=True)], lr=0.1
        ),
    }.items():
        opt = build()
        ctx.backward(mse(model, shard))
        try:
            opt.step(lambda: mse(model, shard)) if name == "lbfgs" else opt.step()
        except ValueError as exc:
            errors[name] = str(exc)
        opt.zero_grad()
    opt = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    hook = opt.register_step_post_hook(lambda *args: None)
    ctx.backward(mse(model, shard))
    try:
        opt.step()
    except ValueError as exc:
        errors["hooks"] = str(exc)
    hook.remove()
    model.zero_grad()
    ctx.step(mse(model, shard), opt)
    try:
        opt.state_dict()
    except RuntimeError as exc:
        errors["state_dict"] = str(exc)
    opt.add_param_group({"params": model.fc2.parameters()})
    ctx.backward(mse(model, shard))
    try:
        opt.step()
    except ValueError as exc:
        errors["group"] = str(exc)
    # frozen parameters in the optimizer's groups stay whole and unchanged, as in one process
    frozen = Net()
    frozen.fc1.requires_grad_(False)
    frozen = ctx.replicate(frozen, shard_optimizer=True)
    before = _state(frozen)
    opt = torch.optim.AdamW(frozen.parameters(), lr=0.1)
    assert not opt.state[frozen.fc2.weight]  # a read before the first step adds an empty entry
    ctx.step(mse(frozen, shard), opt)
    after = _state(frozen)
    errors["frozen"] = [k for k in before if not torch.equal(before[k], after[k])]
    frozen.fc1.requires_grad_(True)  # unfrozen after replicate: neither averaged nor sharded
    ctx.backward(mse(frozen, shard))
    try:
        opt.step()
    except ValueError as exc:
        errors["unfrozen"] = str(exc)
    # ranks that find different newest checkpoints (a path local to each host) all stop
    plain = ctx.replicate(Net())
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    ctx.step(mse(plain, shard), opt)
    ctx.save_checkpoint(directory / "own" / str(ctx.rank), 1, plain, opt)  # rank 0 writes
    try:
        ctx.load_checkpoint(directory / "own" / str(ctx.rank), plain, opt)
    except RuntimeError as exc:
        errors["apart"] = str(exc)
    for kwargs in (
        {"shard_optimizer": "yes"},
        {"shard_optimizer": True, "mode": "diloco:2:overlap"},
        {"shard_optimizer": True, "mode": "diloco:2", "compress": "bf16"},
    ):
        try:
            ctx.replicate(Net(), **kwargs)
        except (TypeError, ValueError) as exc:
            errors[str(kwargs)] = f"{type(exc).__name__}: {exc}"
    return errors


def sharded_cases(directory: Path, transport: str) -> dict:
    ctx = towers.init(timeout=60, transport=transport)
    try:
        return {
            "sgd": _sgd_plain_backward(ctx),
            "closure": _sgd_closure(ctx),
            "norms": _sgd_norms(ctx),
            "adam": _adam_clipped(ctx, balance=False),
            "adam balanced": _adam_clipped(ctx, balance=True),
            "adamw": _adamw_scaled_accumulated(ctx, directory / "whole", None),
            "first 3": _adamw_scaled_accumulated(ctx, directory / "resumed", 3),
            "mistakes": _mistakes(ctx, directory),
        }
    finally:
        ctx.close()


def resumed_case(directory: Path, transport: str) -> dict:
    ctx = towers.init(timeout=60, transport=transport)
    try:
        return _adamw_scaled_accumulated(ctx, directory / "resumed", None)
    finally:
        ctx.close()


# -- the plain loops ------------------------------------------------------------------------------


def _plain(
    name: str, dtype: torch.dtype, *, size: int = 11, clip: float | None = None, micro: bool = False
):
    torch.manual_seed(0)
    model = wide().to(dtype)
    opt = make(name, model.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if name == "sgd" else None
    norms = []
    for x, y in batches(size, dtype):
        if micro:  # each micro-batch's mean loss weighted by its samples: the batch's mean
            half = len(x) // 2
            (mse(model, (x[:half], y[:half])) * half / len(x)).backward()
            (mse(model, (x[half:], y[half:])) * (len(x) - half) / len(x)).backward()
        else:
            mse(model, (x, y)).backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
    return model, norms


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_sharded_optimizer_state_trains_as_one_process_and_resumes_on_fewer_towers(
    tmp_path, transport
):
    """Over shared memory the gradients are summed whole; over Gloo each tower's part is
    summed for it alone, and each gradient holds a stand-in for the rest of its norm."""
    out = towers.spawn(sharded_cases, 3, tmp_path, transport)
    resumed = towers.spawn(resumed_case, 2, tmp_path, transport)

    sgd = Reference.run(functools.partial(_plain, "sgd"))
    adam = Reference.run(functools.partial(_plain, "adam", clip=CLIP))
    (m32, n32), (m64, n64) = (_plain("adam", d, clip=CLIP) for d in (torch.float32, torch.float64))
    norms = Reference(states(m32), states(m64), n32, n64)
    adamw = Reference.run(functools.partial(_plain, "adamw", size=12, clip=1.0, micro=True))
    parts = [sum(p.size for p in ps) for ps in layout([192, 64, 64, 1], 3)]
    assert parts == [128, 128, 65]  # fc1.weight is cut between towers 0 and 1
    if transport == "gloo":  # a third of the one bucket each
        parts = [107, 107, 107]
    (_, s32), (_, s64) = (_plain_norms(d) for d in (torch.float32, torch.float64))
    seen = Reference({}, {}, s32, s64)
    for rank, got in enumerate(out):
        sgd.check(got["sgd"][0], f"rank {rank}, SGD")
        # the gradients' norms a script reads: the global batch's, whatever each tower holds
        seen.check_losses(got["norms"], f"rank {rank}, the gradients' 2-norms and largest values")
        sgd.check(got["closure"], f"rank {rank}, SGD, the backward in a closure")
        # each tower holds the momentum of its part only: a third of the state
        assert got["sgd"][1] == parts[rank], got["sgd"][1]
        for case in ("adam", "adam balanced"):
            params, got_norms, elements = got[case]
            assert max(got_norms) > CLIP  # the clipping did bite
            adam.check(params, f"rank {rank}, {case}")
            norms.check_losses(got_norms, f"rank {rank}, {case}: gradient norms over all parts")
            assert elements == 2 * parts[rank]  # exp_avg and exp_avg_sq of its part
        adamw.check(got["adamw"], f"rank {rank}, AdamW, GradScaler, accumulation")
        errors = got["mistakes"]
        assert "cannot shard LBFGS" in errors["lbfgs"] and "whole parameters" in errors["lbfgs"]
        assert "not the replicated model's trainable parameters" in errors["stranger"]
        assert "ctx.save_checkpoint" in errors["state_dict"]
        assert "a parameter group added?" in errors["group"]
        assert "step hooks of its own" in errors["hooks"]
        assert errors["frozen"] == ["fc2.weight", "fc2.bias"]
        assert "Unfreeze every parameter you will train before" in errors["unfrozen"]
        assert "different newest checkpoints" in errors["apart"]
        assert "rank 0: 1, rank 1: none, rank 2: none" in errors["apart"]
        assert errors["{'shard_optimizer': 'yes'}"].startswith("TypeError: shard_optimizer must")
        overlap = errors["{'shard_optimizer': True, 'mode': 'diloco:2:overlap'}"]
        assert "use mode='diloco:2' (blocking exchanges)" in overlap
        bf16 = errors["{'shard_optimizer': True, 'mode': 'diloco:2', 'compress': 'bf16'}"]
        assert "compressing parameters would change the result" in bf16
    # 3 towers wrote a checkpoint after 3 steps; 2 towers resumed it and ended where the
    # uninterrupted 3-tower run ended
    for rank, got in enumerate(resumed):
        adamw.check(got, f"resumed on 2 towers, rank {rank}")
    # each rank writes its part beside the checkpoint; the two newest are kept, parts and all
    files = sorted(p.name for p in (tmp_path / "resumed").iterdir())
    assert files == [
        f"step-{s:08d}{end}" for s in (6, 7) for end in (".part-00000.pt", ".part-00001.pt", ".pt")
    ], files


ADAMW = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
DECAY = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.7)
DATA = regression_data(23)  # batches of 5: 5 per epoch, the last of 3 samples


def train(steps: int, workers: int, **kwargs):
    return towers.train(
        wide(), mse, DATA, batch_size=5, steps=steps, workers=workers, optimizer=ADAMW,
        lr_schedule=DECAY, seed=11, progress=False, shard_optimizer=True, **kwargs,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_train_with_sharded_state_resumes_on_more_towers_as_one_process(tmp_path):
    first = train(7, 2, checkpoint=tmp_path, checkpoint_every=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-{s:08d}{end}" for s in (6, 7) for end in (".part-00000.pt", ".part-00001.pt", ".pt")
    ]
    # a checkpoint with a damaged part is passed over for the one before, with a warning that
    # names the part; a part whose checkpoint was never written is removed
    part = tmp_path / "step-00000007.part-00001.pt"
    part.write_bytes(part.read_bytes()[:-9] + bytes(9))
    (tmp_path / "step-00000005.part-00000.pt").write_bytes(part.read_bytes())
    with pytest.warns(RuntimeWarning, match=r"part-00001\.pt does not match the sha256"):
        resumed = train(
            12, 3, checkpoint=tmp_path, checkpoint_every=3, balance=True, transport="gloo"
        )
    parts = (".part-00000.pt", ".part-00001.pt", ".part-00002.pt", ".pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-{s:08d}{end}" for s in (9, 12) for end in parts
    ]
    for result, steps in ((first, 7), (resumed, 12)):
        reference = Reference.of(
            wide(), DATA, batch_size=5, steps=steps, optimizer=ADAMW, lr_schedule=DECAY,
            seed=11, towers=len(result.shards[-1]), shards=result.shards,
        )  # fmt: skip
        reference.check_losses(result.losses, f"{steps} steps")
        reference.check(result.model, f"{steps} steps")
    # (over Gloo the parts are gathered by all_gather, over shared memory by an in-place sum)
    # an unsharded run cannot resume a sharded checkpoint: it says how
    with pytest.raises(ValueError, match="resume it with shard_optimizer=True"):
        towers.train(
            wide(), mse, DATA, batch_size=5, steps=14, workers=2, optimizer=ADAMW,
            lr_schedule=DECAY, seed=11, progress=False, checkpoint=tmp_path,
        )  # fmt: skip


def deep(seed: int = 0) -> nn.Module:
    """About 530 k parameters in one bucket: over 2 towers and Gloo each tower's part is more
    than ``IN_FLIGHT`` calls of ``PIECE`` elements, in the sum and in the gather."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 1)
    )


@pytest.mark.timeout(120)
def test_a_part_sent_in_many_calls_over_gloo_trains_as_one_process():
    total = sum(p.numel() for p in deep().parameters())
    assert total // 2 > IN_FLIGHT * PIECE  # more calls than are started at once
    result = towers.train(
        deep(), mse, DATA, batch_size=5, steps=6, workers=2, optimizer=ADAMW,
        lr_schedule=DECAY, seed=11, progress=False, shard_optimizer=True, transport="gloo",
    )  # fmt: skip
    reference = Reference.of(
        deep(), DATA, batch_size=5, steps=6, optimizer=ADAMW, lr_schedule=DECAY, seed=11,
        towers=2, shards=result.shards,
    )  # fmt: skip
    reference.check_losses(result.losses, "6 steps")
    reference.check(result.model, "6 steps")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_tower_reports_its_piece_of_the_sum_and_whether_it_overflowed(dtype):
    """What each tower tells the others of its piece of a summed bucket, to decide the step
    and fill the stand-ins: each parameter's squared 2-norm and largest magnitude over the
    piece alone, and whether a value there is not finite, as where finite gradients summed
    past the dtype's range (a tower's own non-finite gradient rides in the step's metadata)."""
    flat = torch.arange(1, 11, dtype=dtype)  # parameter 0: elements 0-5, parameter 1: 6-9
    slots = [(0, 0, 6), (1, 6, 10)]
    second = SimpleNamespace(rank=1, world_size=2)  # its piece: elements 5-9

    def reported() -> torch.Tensor:
        return _pieces(2, [(flat, slots)], second).view(2, 3)

    expected = torch.tensor([[36.0, 7**2 + 8**2 + 9**2 + 10**2, 0.0], [6.0, 10.0, 0.0]])
    torch.testing.assert_close(reported(), expected.double(), rtol=1e-12, atol=0.0)  # float64
    flat[1] = float("nan")  # outside the piece: another tower's to report
    assert reported()[0, 2] == 0.0
    flat[8] = torch.tensor(torch.finfo(dtype).max, dtype=dtype) * 2  # a sum that overflowed
    assert reported()[0, 2] == 1.0
    if dtype == torch.float64:  # finite, but its square is past float64's range: not raised
        flat[8] = 1e160
        assert reported()[0, 2] == 1.0


def test_train_refuses_what_it_cannot_shard_before_any_worker_starts():
    lbfgs = functools.partial(torch.optim.LBFGS, lr=0.1)
    cases = [
        ({"optimizer": lbfgs}, ValueError, "cannot shard LBFGS"),
        ({"mode": "async"}, ValueError, "needs mode='sync' or 'diloco:H'"),
        ({"shard_optimizer": 1}, TypeError, "shard_optimizer must be True or False"),
        ({"elastic": True}, ValueError, "in an elastic job needs its checkpoints"),
    ]
    for kwargs, kind, message in cases:
        args = {"shard_optimizer": True, **kwargs}
        with pytest.raises(kind, match=message):
            towers.train(wide(), mse, DATA, batch_size=5, steps=2, workers=2, **args)


@pytest.mark.timeout(120)
def test_a_compressed_sum_steps_the_same_with_its_state_sharded():
    """int8 sums are not split by owner: the gradient is summed whole, as without sharding,
    and only the optimizer's step is cut. Its result is the unsharded run's, up to the
    float32 rounding the plain loop's float64 comparison allows (both sides of the bound)."""

    def run(**kwargs):
        return towers.train(
            wide(), mse, DATA, batch_size=5, steps=9, workers=2, optimizer=ADAMW,
            seed=11, progress=False, compress="int8", balance=False, **kwargs,
        )  # fmt: skip

    whole, sharded = run(), run(shard_optimizer=True)
    reference = Reference.of(wide(), DATA, batch_size=5, steps=9, optimizer=ADAMW, seed=11)
    floats = list(reference.exact)
    _, allowed = bound([reference.single[n] for n in floats], [reference.exact[n] for n in floats])
    for name, value in states(sharded.model).items():
        off = float((value - states(whole.model)[name]).abs().max())
        assert off <= 2 * allowed, (
            f"{name}: {off:.3g} from the unsharded run, bound {2 * allowed:.3g}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_slice_steps_as_its_whole_parameter_bit_for_bit(dtype):
    """The cuts fall on multiples of 64 elements, so each slice runs the whole parameter's
    vectorised loop: every element-wise optimizer steps the slices exactly as the whole
    (a cut at 333 gives bfloat16 and float16 SGD momentum and RMSprop a rounding apart)."""
    torch.set_num_threads(1)
    parts = [p for ps in layout([1000], 3) for p in ps]
    assert [(p.start, p.stop) for p in parts] == [(0, 384), (384, 704), (704, 1000)]
    for kind in ELEMENTWISE:
        options = {"momentum": 0.9} if kind in (torch.optim.SGD, torch.optim.RMSprop) else {}
        if kind is not torch.optim.Rprop:
            options["weight_decay"] = 0.1
        g = torch.Generator().manual_seed(0)
        whole = torch.randn(1000, generator=g).to(dtype)
        cut = whole.clone()
        slices = [cut[p.start : p.stop] for p in parts]
        one, each = kind([whole], lr=0.01, **options), kind(slices, lr=0.01, **options)
        for _ in range(5):
            grad = torch.randn(1000, generator=g).to(dtype)
            whole.grad = grad.clone()
            for view, p in zip(slices, parts, strict=True):
                view.grad = grad[p.start : p.stop].clone()
            one.step()
            each.step()
        # float16 Adam with weight decay overflows to nan in both alike
        assert torch.equal(whole.nan_to_num(), cut.nan_to_num()), kind.__name__


def _big() -> nn.Module:
    """1 M parameters: each of 2 towers' part of AdamW's state is about 4 MB."""
    torch.manual_seed(0)
    return nn.Linear(1024, 1024)


def _save_at_3_and_6(directory: Path) -> None:
    ctx = towers.init()
    model = ctx.replicate(_big(), shard_optimizer=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = [(torch.randn(8, 1024, generator=torch.Generator().manual_seed(k)),) for k in range(6)]
    for k, (x,) in enumerate(ctx.shards(data)):
        ctx.step(model(x).square().mean(), opt)
        if k + 1 in (3, 6):
            ctx.save_checkpoint(directory, k + 1, model, opt)
    ctx.close()


def _bytes_read() -> int:
    """Bytes this process has read with read() calls (mapped pages are not counted)."""
    line = next(x for x in Path("/proc/self/io").read_text().splitlines() if x.startswith("rchar"))
    return int(line.split()[1])


def _resume(directory: Path) -> tuple[int, int, list[str]]:
    ctx = towers.init()
    model = ctx.replicate(_big(), shard_optimizer=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = _bytes_read()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step, _ = ctx.load_checkpoint(directory, model, opt)
    read = _bytes_read() - before
    ctx.close()
    return step, read, [str(w.message) for w in seen]


@pytest.mark.timeout(120)
def test_an_own_loop_resume_reads_only_the_parts_each_rank_needs(tmp_path):
    """Each rank checks and opens only the parts of the sharded state that overlap its own
    (here, with as many towers as saved, its own), and a damaged part found by one rank sends
    every rank to the checkpoint before, with a warning that names it."""
    towers.spawn(_save_at_3_and_6, 2, tmp_path, timeout=100)
    main = (tmp_path / "step-00000006.pt").stat().st_size
    parts = [(tmp_path / f"step-00000006.part-0000{r}.pt").stat().st_size for r in range(2)]
    for rank, (step, read, said) in enumerate(towers.spawn(_resume, 2, tmp_path, timeout=100)):
        assert step == 6 and not said, said
        # the checkpoint, and its own part (read whole for its sha256, then mapped); not the
        # other's, which a rank used to read whole as well
        assert main + parts[rank] <= read < main + parts[rank] + parts[1 - rank] // 2, (
            rank, read, main, parts,
        )  # fmt: skip
    damaged = tmp_path / "step-00000006.part-00001.pt"
    damaged.write_bytes(damaged.read_bytes()[:-9] + bytes(9))
    for step, _, said in towers.spawn(_resume, 2, tmp_path, timeout=100):
        assert step == 3
        assert any(
            "step-00000006.part-00001.pt does not match the sha256" in m
            and "resuming from the previous one" in m
            for m in said
        ), said


def _rollback_batches() -> list:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 3, generator=g), torch.randn(48, 1, generator=g)
    return [(x[i : i + 12], y[i : i + 12]) for i in range(0, 48, 12)]


def _rollback_run(directory: Path, transport: str, save: bool) -> dict:
    """``save``: 2 steps and a checkpoint; else 1 step, then back to that checkpoint (written
    by another number of towers) and on to the end."""
    ctx = towers.init(timeout=60, transport=transport)
    try:
        model = ctx.replicate(wide(), shard_optimizer=True)
        opt = make("adamw", model.parameters())
        for shard in ctx.shards(_rollback_batches()[: 2 if save else 1]):
            ctx.step(mse(model, shard), opt)
        if save:
            ctx.save_checkpoint(directory, 2, model, opt)
            return {}
        start, _ = ctx.load_checkpoint(directory, model, opt)
        for shard in ctx.shards(_rollback_batches()[start:]):
            ctx.step(mse(model, shard), opt)
        return _state(model)
    finally:
        ctx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_running_loop_rolls_back_to_another_number_of_towers_checkpoint(tmp_path, transport):
    towers.spawn(_rollback_run, 3, tmp_path, transport, True)
    got = towers.spawn(_rollback_run, 2, tmp_path, transport, False)

    def plain(dtype: torch.dtype) -> tuple[nn.Module, list[float]]:
        torch.manual_seed(0)
        model = wide().to(dtype)
        opt = make("adamw", model.parameters())
        for x, y in _rollback_batches():
            mse(model, (x.to(dtype), y.to(dtype))).backward()
            opt.step()
            opt.zero_grad()
        return model, []

    want = Reference.run(plain)
    for rank, state in enumerate(got):
        want.check(state, f"{transport}, rank {rank}")
