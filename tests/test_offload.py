"""OffloadedAdamW trains exactly as plain AdamW does, whatever part of the update runs on the CPU and when.

References are independent: plain ``torch.optim.AdamW`` (its default, unfused implementation) in one process, with
``torch.nn.utils.clip_grad_norm_`` where clipping is on; for bf16 compute copies, fp32 masters kept by hand.
"""

from __future__ import annotations

import contextlib
import io
import threading
import traceback

import pytest
import torch

from nbtrain.errors import InvalidArgumentError
from nbtrain.models import GPT, GPTConfig
from nbtrain.notebook.plots import timeline_plot
from nbtrain.profiler.model import lm_loss
from nbtrain.run.offload.optimizer import OffloadedAdamW
from nbtrain.planner.offload_split import balanced_offload, step_period
from nbtrain.run.offload.split import cut_layer
from tests.distributed_fixtures import BATCH, GPT_TINY, batches, gloo_worker, spawn_group

STEPS = 6
LR = 1e-2
SPLIT = [0.0, 0.0, 1.0, 1.0]  # embeddings and block 0 on the device, block 1 and the head on the CPU
LAYERS = 4  # embeddings, 2 blocks, head


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """As in a launched worker: on a busy 2-core machine two OpenMP threads per op run tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(model, opt, steps=STEPS, scheduler=None, clip_norm=None) -> list[float]:
    """Losses of the usual loop: forward, backward, ``clip_grad_norm_`` (when ``clip_norm``), step, zero_grad, and
    the scheduler's step."""
    losses = []
    for ids, targets in batches(steps):
        loss = lm_loss(model(ids), targets)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
        opt.zero_grad()
        if scheduler:
            scheduler.step()
        losses.append(loss.item())
    return losses


def reference(clip_norm=None, steps=STEPS, schedule=None):
    """Losses and final weights of plain AdamW (clip_grad_norm_ first when ``clip_norm``)."""
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    return train(model, opt, steps, scheduler, clip_norm), model


def offloaded(offload, steps=STEPS, lr_schedule=None, model=None, **kwargs):
    """Losses, model and (closed) optimizer of the same training under OffloadedAdamW."""
    if model is None:
        torch.manual_seed(0)
        model = GPT(GPT_TINY)
    with OffloadedAdamW.from_model(model, offload, lr=LR, **kwargs) as opt:  # it clips itself, when asked
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule) if lr_schedule else None
        losses = train(model, opt, steps, scheduler)
    return losses, model, opt


def assert_same_training(got, want):
    """Losses within 1e-4 relative at every step; each final weight tensor within 1e-5 relative norm."""
    (losses, model), (ref_losses, ref_model) = got[:2], want[:2]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: loss {a} vs {b}; all: {losses} vs {ref_losses}"
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if name.endswith("attn.k.bias"):
            # Its gradient is zero in exact arithmetic (softmax ignores the q·b added to every key's score), so
            # Adam normalises rounding noise into steps: any two fp32 implementations disagree here, fused AdamW
            # and plain AdamW included. Both stay near zero.
            assert p.float().norm() < 1e-3 and q.norm() < 1e-3, name
            continue
        assert (p.float() - q).norm() <= 1e-5 * q.norm(), f"{name} differs"


def offload_threads():
    return [t for t in threading.enumerate() if t.name.startswith("nbtrain-offload")]


@pytest.mark.parametrize("offload, schedule", [
    (1.0, "overlap"), (SPLIT, "overlap"), (0.5, "overlap"), ([0.0, 0.5, 1.0, 1.0], "overlap"),
    (1.0, "after_backward"), (SPLIT, "after_backward"),
], ids=["overlap-all", "overlap-split", "overlap-half", "overlap-mixed", "zero_offload-all", "zero_offload-split"])
def test_offloaded_training_matches_plain_adamw(offload, schedule):
    got = offloaded(offload, schedule=schedule)
    assert_same_training(got, reference())
    opt = got[2]
    if schedule == "overlap":
        assert opt.last_overlapped == sum(f > 0 for f in opt.cpu_fractions)  # every CPU update started in backward
    else:
        assert opt.last_overlapped == 0


def test_half_offload_cuts_each_layer_in_two_halves_by_parameter_count():
    torch.manual_seed(0)
    opt = OffloadedAdamW.from_model(GPT(GPT_TINY), 0.5)
    assert opt.cpu_fractions == pytest.approx([0.5] * LAYERS, abs=1e-3)
    opt.close()
    w, b = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))
    cuts = [(c.param is w, c.start, c.stop, c.on_cpu) for c in cut_layer([w, b], 0.5)]
    assert cuts == [(True, 0, 7, False), (True, 7, 12, True), (False, 0, 3, True)]  # the CPU takes the last 8


def test_no_offload_is_exactly_fused_adamw():
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    want = train(model, torch.optim.AdamW(model.parameters(), lr=LR, fused=True))
    for offload in (0.0, 1.0, SPLIT):  # the CPU runs the same kernel on fp32 masters: bit for bit
        losses, got, _ = offloaded(offload)
        assert losses == want
        assert all(torch.equal(p, q) for p, q in zip(got.parameters(), model.parameters()))


def test_bf16_compute_copies_train_as_fp32_masters_kept_by_hand():
    torch.manual_seed(0)
    model = GPT(GPT_TINY).to(torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, fused=True)
    want = []
    for ids, targets in batches(STEPS):
        loss = lm_loss(model(ids), targets)
        loss.backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
                p.grad = None
        want.append(loss.item())
    for offload in (1.0, SPLIT, 0.5):
        torch.manual_seed(0)
        losses, got, opt2 = offloaded(offload, model=GPT(GPT_TINY).to(torch.bfloat16))
        assert losses == pytest.approx(want, rel=1e-4)
        assert all(p.dtype == torch.bfloat16 for p in got.parameters())
        masters_got = opt2.state_dict()["state"]
        for i, m in enumerate(masters):
            assert (masters_got[i]["master"] - m).norm() <= 1e-5 * m.norm()


def test_gradients_crossing_in_bf16_update_fp32_masters_as_adamw_fed_the_rounded_gradients():
    # an fp32 model trained in bf16 sends its offloaded gradients to the CPU in bf16 (half the PCIe bytes, as
    # Reflow does): the CPU's fp32 update is then AdamW's on those gradients rounded to bf16, and nothing else
    for clip_norm in (None, 0.05):  # 0.05 clips every step: the norm is of the gradients as computed (fp32)
        torch.manual_seed(0)
        model = GPT(GPT_TINY)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        want = []
        for ids, targets in batches(STEPS):
            loss = lm_loss(model(ids), targets)
            loss.backward()
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            offloaded_params = {id(p) for layer in range(2, LAYERS) for p in _layer_params(model, layer)}
            for p in model.parameters():  # the offloaded layers' gradients as they reach the CPU
                if id(p) in offloaded_params:
                    p.grad = p.grad.bfloat16().float() if clip_norm is None else p.grad
            opt.step()
            opt.zero_grad()
            want.append(loss.item())
        losses, got, _ = offloaded(SPLIT, grad_dtype=torch.bfloat16, clip_norm=clip_norm)
        if clip_norm is None:
            assert_same_training((losses, got), (want, model))
        else:  # rounded before the clip's scale here, after it there: bf16's rounding apart, no more
            assert losses == pytest.approx(want, rel=1e-3)
        plain, _, _ = offloaded(SPLIT, clip_norm=clip_norm)
        assert max(abs(a - b) for a, b in zip(losses, plain)) > 1e-7  # the rounding did happen


def _layer_params(model, layer: int) -> list:
    from nbtrain.models.description import layer_slots, slot_module

    return [p for parent, attr in layer_slots(model)[layer] for p in slot_module(parent, attr).parameters()]


def test_clip_limit_never_reached_is_unclipped_training():
    for schedule in ("overlap", "after_backward"):
        losses, model, opt = offloaded(1.0, clip_norm=1e3, schedule=schedule)
        assert_same_training((losses, model), reference())
        assert (opt.clipped_steps, opt.rollbacks) == (0, 0)
        assert opt.last_grad_norm > 0


@pytest.mark.parametrize("offload", [1.0, SPLIT, 0.5])
def test_clip_limit_always_exceeded_rolls_back_each_step_and_matches_clip_grad_norm(offload):
    # 0.9: above the head's gradient norm (the first to arrive, ~0.7), below the total (1.0 to 1.8), so each step
    # updates the head speculatively, then finds it must clip, rolls back and redoes it.
    losses, model, opt = offloaded(offload, clip_norm=0.9)
    clipped = reference(clip_norm=0.9)
    assert max(abs(a - b) / b for a, b in zip(clipped[0], reference()[0])) > 1e-3  # clipping changes training
    assert_same_training((losses, model), clipped)
    assert opt.clipped_steps == STEPS
    assert opt.rollbacks == STEPS


def test_clip_known_from_the_first_gradients_is_not_speculated():
    # 0.01: the first layer's gradients alone exceed it; no update is speculated, none undone
    for schedule in ("overlap", "after_backward"):
        losses, model, opt = offloaded(1.0, clip_norm=0.01, schedule=schedule)
        assert_same_training((losses, model), reference(clip_norm=0.01))
        assert (opt.clipped_steps, opt.rollbacks) == (STEPS, 0)


def test_micro_batches_accumulate_under_no_sync_and_update_once():
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    losses = []
    with OffloadedAdamW.from_model(model, SPLIT, lr=LR) as opt:
        for ids, targets in batches(STEPS):
            total = 0.0
            for i, (x, y) in enumerate(zip(ids.chunk(2), targets.chunk(2))):
                with opt.no_sync() if i == 0 else contextlib.nullcontext():
                    loss = lm_loss(model(x), y) / 2
                    loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            assert opt.last_overlapped == 2  # the last micro-batch's gradients were handed over in its backward
            losses.append(total)
    assert_same_training((losses, model), reference())


def test_a_second_backward_before_step_without_no_sync_is_an_error():
    # after_backward: nothing is updated before step(), so the forward goes on and the second backward's hand-over
    # of a gradient already handed over is what says so (overlapped, the forward is refused first: below)
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    ids, targets = next(batches(1))
    with OffloadedAdamW.from_model(model, 1.0, schedule="after_backward"):
        lm_loss(model(ids), targets).backward()
        with pytest.raises(InvalidArgumentError, match=r"^a second backward before step\(\).*no_sync"):
            lm_loss(model(ids), targets).backward()


@pytest.mark.parametrize("land_at", ["forward", "step"])
def test_a_forward_between_backward_and_step_is_refused_while_the_cpu_writes_the_weights(land_at):
    # the overlapped updates write host-memory weights in place until step(): a forward then (a metric under
    # no_grad, a second micro-batch) would read some layers old and some new, at the worker's pace
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    ids, targets = next(batches(1))
    with OffloadedAdamW.from_model(model, 1.0, land_at=land_at) as opt:
        lm_loss(model(ids), targets).backward()
        with pytest.raises(InvalidArgumentError, match=r"before step\(\).*opt.step\(\)"), torch.no_grad():
            model(ids)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(ids)  # after step() the weights are the step's, whichever layer the forward reaches first


def test_lr_schedule_drives_every_layer():
    def halve(step):
        return 0.5 ** step

    got = offloaded(SPLIT, lr_schedule=halve)
    assert_same_training(got, reference(schedule=halve))


def test_state_dict_resumes_under_another_split():
    whole = reference()
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    with OffloadedAdamW.from_model(model, 1.0, lr=LR) as opt:
        for ids, targets in batches(3):
            lm_loss(model(ids), targets).backward()
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()
    torch.manual_seed(1)
    resumed = GPT(GPT_TINY)  # other weights: the masters in the state dict replace them
    with OffloadedAdamW.from_model(resumed, 0.5, lr=LR) as opt:
        opt.load_state_dict(state)
        losses = []
        for ids, targets in list(batches(STEPS))[3:]:
            loss = lm_loss(resumed(ids), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert_same_training((losses, resumed), (whole[0][3:], whole[1]))


@pytest.mark.parametrize("schedule, land_at", [("after_backward", "step"), ("overlap", "step"),
                                               ("overlap", "forward")])
def test_the_trace_holds_every_layers_backward_and_cpu_update_whenever_updates_land(schedule, land_at):
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    with OffloadedAdamW.from_model(model, 1.0, schedule=schedule, land_at=land_at) as opt:
        train(model, opt, steps=2)
    labels = {(row, label.split()[0]) for row, label, *_ in opt.last_trace}
    assert {("device", "backward"), ("cpu", "update")} <= labels, opt.last_trace
    assert sum(label.startswith("backward") for _, label, *_ in opt.last_trace) == LAYERS


def test_cpu_update_of_the_last_layer_starts_before_backward_of_the_first_ends():
    # Blocks wide enough that each one's backward takes tens of milliseconds: far longer than a thread's wake-up,
    # even on a busy 2-core machine. Only the order of events is asserted, never a duration.
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_embd=256, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(config)
    ids = torch.randint(0, 256, (8, 128))
    with OffloadedAdamW.from_model(model, 1.0) as opt:
        for _ in range(2):
            opt.zero_grad()
            lm_loss(model(ids), torch.roll(ids, -1, 1)).backward()
            opt.step()
        trace = {(row, label): (start, end) for row, label, start, end in opt.last_trace}
        assert type(timeline_plot(opt.last_trace)).__name__ == "Figure"
    last = config.n_layer + 1  # the head: the first layer backward reaches
    assert trace[("cpu", f"update {last}")][0] < trace[("device", "backward 0")][1], opt.last_trace
    assert trace[("device", f"backward {last}")][1] <= trace[("cpu", f"update {last}")][0]
    assert all(start <= end for start, end in trace.values())


def test_step_returns_before_the_cpu_updates_and_the_next_forward_waits_for_each_layer():
    """CoTrain's data-reuse distance: the CPU's update of a layer may run on until the next forward needs it."""
    ids, targets = next(batches(1))
    torch.manual_seed(0)
    expected = GPT(GPT_TINY)
    with OffloadedAdamW.from_model(expected, SPLIT, land_at="step") as opt:
        lm_loss(expected(ids), targets).backward()
        opt.step()
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    old_head = model.head.lm_head.weight.detach().clone()
    release = threading.Event()
    with OffloadedAdamW.from_model(model, SPLIT) as opt:
        original = opt._cpu_update

        def held(*args):  # the worker holds each update until the test lets it go
            release.wait(timeout=60)
            return original(*args)

        opt._cpu_update = held
        lm_loss(model(ids), targets).backward()
        opt.step()
        # step() returned with the CPU's updates still held, so the head still has its old weights
        assert torch.equal(model.head.lm_head.weight, old_head)
        assert torch.equal(model.blocks[0].attn.q.weight, expected.blocks[0].attn.q.weight)  # the device's share
        release.set()
        logits = model(ids)  # each offloaded layer waits for its update before its forward
        assert torch.equal(model.head.lm_head.weight, expected.head.lm_head.weight)
        assert torch.equal(logits, expected(ids))


def test_worker_thread_runs_one_intra_op_thread_even_when_the_caller_runs_more():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = GPT(GPT_TINY)
        seen = []
        with OffloadedAdamW.from_model(model, 1.0) as opt:
            original = opt._cpu_update

            def spy(*args):
                seen.append(torch.get_num_threads())
                return original(*args)

            opt._cpu_update = spy
            ids, targets = next(batches(1))
            lm_loss(model(ids), targets).backward()
            opt.step()
            assert torch.get_num_threads() == 2
        assert seen and set(seen) == {1}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("land_at", ["step", "forward"])
def test_worker_exception_surfaces_where_the_update_lands_and_close_leaves_no_thread(land_at):
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    opt = OffloadedAdamW.from_model(model, SPLIT, land_at=land_at)

    def exploding_update(layer, kind, scale):
        raise RuntimeError(f"no memory left for layer {layer.index}")

    opt._cpu_update = exploding_update
    ids, targets = next(batches(1))
    lm_loss(model(ids), targets).backward()
    with pytest.raises(RuntimeError, match="no memory left for layer") as info:
        opt.step()
        model(ids)  # "forward": the first offloaded layer waits for its update here
    assert "exploding_update" in "".join(traceback.format_exception(info.value))  # the worker's frame
    assert offload_threads()
    opt.close()  # the step's other updates were waited for with the first failure: nothing more to raise
    assert offload_threads() == []
    with pytest.raises(InvalidArgumentError, match="closed"):
        opt.step()
    lm_loss(model(ids), targets).backward()  # the hooks are gone: nothing queued to a stopped thread


def test_split_rule_keeps_the_layers_whose_gradients_come_last_on_the_device():
    backward, cpu = [1.0] * 6, [1.0] * 6
    assert balanced_offload(backward, cpu, device_update_s=[0.0] * 6) == [0.0] + [1.0] * 5
    assert balanced_offload(backward, cpu, device_update_s=[1.0] * 6) == [0.5] + [1.0] * 5
    assert balanced_offload(backward, [3.0] * 6, device_update_s=[0.1] * 6)[:3] == [0.0, 0.0, 0.0]


def test_step_period_when_updates_land_at_the_next_forward():
    forward, backward = [1.0] * 3, [1.0] * 3
    # no offload: forward, backward and the device's updates, one after the other
    assert step_period(forward, backward, [10.0] * 3, [2.0] * 3, [0.0] * 3) == pytest.approx(3 + 3 + 6)
    # all offloaded, the CPU far slower: its 30 s queue plus what it cannot overlap, the next forward up to layer 0's
    # update (all of it: layer 0 lands last) and the backward of the last layer, which its first update waits for
    assert step_period(forward, backward, [10.0] * 3, [2.0] * 3, [1.0] * 3) == pytest.approx(30 + 3 + 1)
    # the CPU fast: only layer 0's update is waited for, as its gradient comes last and the next forward needs it first
    assert step_period(forward, backward, [0.1] * 3, [2.0] * 3, [1.0] * 3) == pytest.approx(3 + 3 + 0.1)
    # layer 0 kept on the device: the next forward runs it while the CPU finishes layer 1
    split = balanced_offload(backward, [1.5] * 3, [1.5] * 3, forward_s=forward)
    assert split[0] < 1.0 and split[2] == 1.0
    assert step_period(forward, backward, [1.5] * 3, [1.5] * 3, split) < step_period(
        forward, backward, [1.5] * 3, [1.5] * 3, [1.0] * 3)


# -- two processes: DistributedDataParallel, each rank half the batch ------------------------------------------------

CASES = {"overlap-all": dict(offload=1.0), "overlap-split-clipped": dict(offload=SPLIT, clip_norm=0.9),
         "zero_offload-half": dict(offload=0.5, schedule="after_backward")}


def _sharded_gpt():
    """GPT_TINY under FSDP2 as nbtrain's executor shards it: each layer its own group, one root over them."""
    from torch.distributed.fsdp import fully_shard

    from nbtrain.models.description import layer_slots, slot_module

    model = GPT(GPT_TINY)
    for slots in layer_slots(model):
        fully_shard([slot_module(parent, attr) for parent, attr in slots])
    return fully_shard(model)


def _data_parallel_worker(rank, world, port, queue):
    with gloo_worker(rank, world, port, queue) as report:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        # small buckets: several all-reduces per backward, each handing its layers over as it completes
        wrappers = {"ddp": lambda: DistributedDataParallel(GPT(GPT_TINY), bucket_cap_mb=0.02), "fsdp": _sharded_gpt}
        results = {}
        for (wrapper, build), (name, kwargs) in ((w, c) for w in wrappers.items() for c in CASES.items()):
            torch.manual_seed(0)
            model = build()
            opt = OffloadedAdamW.from_model(model, lr=LR, **kwargs)
            losses = []
            for ids, targets in batches(STEPS):
                rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
                loss = lm_loss(model(ids[rows]), targets[rows])
                loss.backward()
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / world)
            state = getattr(model, "module", model).state_dict()
            state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
            weights = io.BytesIO()  # bytes: shared tensors would need this process alive when they are read
            torch.save(state, weights)
            results[wrapper, name] = (losses, weights.getvalue(), opt.last_overlapped, opt.rollbacks)
            opt.close()
        report(results if rank == 0 else None)


@pytest.mark.slow
def test_two_data_parallel_processes_train_as_one_process_on_the_whole_batch():
    """Under DDP (gradients from its all-reduce) and FSDP2 dp_shard (each rank offloads its shard, handed over by the
    reduce-scatter): the losses and weights of one process with plain AdamW on the whole batch."""
    results = spawn_group(_data_parallel_worker, 2)
    for (wrapper, name), (losses, weights, overlapped, rollbacks) in results.items():
        clip = CASES[name].get("clip_norm")
        ref_losses, ref_model = reference(clip_norm=clip)
        got = GPT(GPT_TINY)
        got.load_state_dict(torch.load(io.BytesIO(weights)))
        assert_same_training((losses, got), (ref_losses, ref_model))
        if CASES[name].get("schedule") != "after_backward":
            # every offloaded layer was handed over by its all-reduce or reduce-scatter, during backward
            assert overlapped == (LAYERS if name == "overlap-all" else 2), (wrapper, name)
        if clip:
            assert rollbacks == STEPS, (wrapper, name)


def test_one_process_under_fsdp2_trains_as_plain_adamw():
    """A world of one: FSDP2's "reduce-scatter" is a copy, and the hooks still hand each layer over in backward."""
    import torch.distributed as dist

    from tests.distributed_fixtures import single_process_group

    with single_process_group():
        torch.manual_seed(0)
        model = _sharded_gpt()
        losses, model, opt = offloaded(SPLIT, model=model, clip_norm=0.9)
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert dist.get_world_size() == 1
    got = GPT(GPT_TINY)
    got.load_state_dict(state)
    assert_same_training((losses, got), reference(clip_norm=0.9))
    assert opt.last_overlapped == 2 and opt.rollbacks == STEPS


def test_invalid_arguments_say_what_is_wrong():
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    with pytest.raises(InvalidArgumentError, match="3 offload fractions for 4 layers"):
        OffloadedAdamW.from_model(model, [1.0, 1.0, 1.0])
    with pytest.raises(InvalidArgumentError, match="schedule"):
        OffloadedAdamW.from_model(model, 1.0, schedule="eventually")
    with pytest.raises(InvalidArgumentError, match="between 0 and 1"):
        OffloadedAdamW.from_model(model, 1.5)
