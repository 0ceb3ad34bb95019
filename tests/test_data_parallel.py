"""``DataParallel`` itself: without a process group, its options, and how a step decides to synchronise."""

from __future__ import annotations

import os
import re
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.plan import StepPlan
from tests.helpers.models import NormNet
from tests.helpers.distributed import run_ranks


def test_world_size_one_runs_the_module_unchanged():
    module = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="world size is 1"):
        wrapped = __import__("lit_dp").DataParallel(module)
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapped(x), module(x))
    assert wrapped.reducer is None
    with wrapped.no_sync():
        wrapped(x).sum().backward()
    assert module.weight.grad is not None


TORCHRUN_RANK_1_OF_2 = {
    "TORCHELASTIC_RUN_ID": "x",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    ("environ", "described"),
    [
        (TORCHRUN_RANK_1_OF_2, "torchrun: RANK=1, WORLD_SIZE=2"),
        ({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2"}, "Paddle's launcher: PADDLE_TRAINER_ID=1, PADDLE_TRAINERS_NUM=2"),
        ({"PADDLE_TRAINERS_NUM": "2"}, "no launcher: PADDLE_TRAINERS_NUM=2"),
    ],
)
def test_a_launched_job_without_a_process_group_is_refused(environ, described):
    # Each rank would train its own model; torch DDP raises here too ("Default process group has not been initialized").
    with mock.patch.dict(os.environ, environ, clear=True), pytest.raises(ValueError) as caught:
        __import__("lit_dp").DataParallel(nn.Linear(3, 2))
    message = str(caught.value)
    assert f"describes world size 2 ({described})" in message
    assert "lit_dp.init_parallel_env()" in message and "torch.distributed.init_process_group()" in message


def test_unreadable_launcher_variables_without_a_process_group_are_refused():
    environ = {name: value for name, value in TORCHRUN_RANK_1_OF_2.items() if name != "LOCAL_RANK"}
    with mock.patch.dict(os.environ, environ, clear=True), pytest.raises(ValueError, match="LOCAL_RANK is not set"):
        __import__("lit_dp").DataParallel(nn.Linear(3, 2))


@pytest.mark.parametrize("environ", [{}, {**TORCHRUN_RANK_1_OF_2, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}])
def test_one_process_without_a_process_group_runs_with_a_warning(environ):
    with mock.patch.dict(os.environ, environ, clear=True), pytest.warns(UserWarning, match="world size is 1"):
        wrapped = __import__("lit_dp").DataParallel(nn.Linear(3, 2))
    assert wrapped.reducer is None


@pytest.mark.parametrize(("option", "value"), [("comm_buffer_size", 0), ("last_comm_buffer_size", -1)])
def test_bucket_size_options_are_validated(option, value):
    with warnings.catch_warnings(), pytest.raises(ValueError, match=f"{option}={value} is invalid"):
        warnings.simplefilter("ignore")
        __import__("lit_dp").DataParallel(nn.Linear(2, 2), **{option: value})


class CountCollectives(ReducerObserver):
    """The reducer's synchronised steps and the buckets it launched."""

    def __init__(self) -> None:
        self.steps = self.launches = 0

    def step_started(self, step: int, plan: StepPlan) -> None:
        self.steps += 1

    def bucket_launched(self, launch: BucketLaunch) -> None:
        self.launches += 1


def gloo_collectives(run) -> int:
    """How many collectives the default group ran during ``run()``: its own sequence number,
    whichever Python or C++ path issued them. (Gloo's profiler events missed some on torch 2.8: the
    event is recorded in a callback that may run after the waiting thread has woken.)"""
    import torch.distributed as dist

    group = dist.group.WORLD
    before = group._get_sequence_number_for_group()
    run()
    return group._get_sequence_number_for_group() - before


def accumulate_the_way_scripts_written_for_ddp_do(rank, steps, accumulate):
    """nanoGPT's accumulation: ``require_backward_grad_sync`` set before each micro-step's forward.
    Returns what the reducer saw, and Gloo's own count of collectives per micro-step, for lit_dp
    and for torch DDP."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp
    from tests.helpers.equivalence import assert_same_gradients
    from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    base = MODELS["tied"]()
    reference, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    ours, ddp = lit_dp.DataParallel(base), DistributedDataParallel(ddp_model)
    counter = CountCollectives()
    ours.reducer.add_observer(counter)
    collectives = {"lit_dp": [], "ddp": []}
    for step in range(steps):
        for micro in range(accumulate):
            seed = step * accumulate + micro
            inputs, targets = batch(seed, world_size)
            for name, model in (("lit_dp", ours), ("ddp", ddp)):
                model.require_backward_grad_sync = micro == accumulate - 1
                micro_step = lambda: loss(model, shard(inputs, rank), shard(targets, rank), rank, seed).backward()
                collectives[name].append(gloo_collectives(micro_step))
            reference_loss(reference, seed, world_size).backward()
        assert_same_gradients(ours, ddp, f"step {step} rank {rank} vs DDP")
        assert_same_gradients(ours, reference, f"step {step} rank {rank} vs one process")
        for model in (ours, ddp, reference):
            model.zero_grad(set_to_none=True)
    return counter.steps, counter.launches, len(ours.reducer.bucket_indices), collectives


def test_require_backward_grad_sync_accumulates_locally_with_one_collective_round_per_step():
    steps, accumulate = 3, 4
    for rank, (synchronised, launches, buckets, collectives) in run_ranks(
        accumulate_the_way_scripts_written_for_ddp_do, 2, steps, accumulate
    ).items():
        assert synchronised == steps, f"rank {rank}: {synchronised} synchronised backwards for {steps} steps"
        assert launches == steps * buckets, f"rank {rank}: {launches} bucket launches, expected {steps} x {buckets}"
        # Counted by Gloo. lit_dp agrees on the buckets' ready order at the end of the first
        # synchronised backward, DDP at the forward after it (its bucket rebuild): from then on,
        # no collective in a local micro-step, and as many per step as DDP.
        ours, ddp = collectives["lit_dp"], collectives["ddp"]
        settled = slice(2 * accumulate, None)
        local_ours = [count for micro, count in enumerate(ours) if micro % accumulate != accumulate - 1]
        local_ddp = [count for micro, count in enumerate(ddp[settled]) if micro % accumulate != accumulate - 1]
        assert not any(local_ours) and not any(local_ddp), f"rank {rank}: collectives in local micro-steps {collectives}"
        assert ours[settled] == ddp[settled] and sum(ours[settled]) == steps - 2, f"rank {rank}: {collectives}"


# --- torch DDP's constructor, attributes and refusals, on a group of one rank in this process ---


def test_ddp_arguments_by_position_and_its_attributes():
    import torch.distributed as dist

    from lit_dp import DataParallel
    from tests.helpers.groups import one_rank_group

    group = one_rank_group()
    net = NormNet()
    # DDP's positional order: module, device_ids, output_device, dim, broadcast_buffers, init_sync,
    # process_group, bucket_cap_mb, find_unused_parameters, check_reduction, gradient_as_bucket_view.
    model = DataParallel(net, None, None, 1, False, True, group, 2, True, False, True, static_graph=True)
    assert model.module is net and model._layers is net
    assert model.device_ids is None and model.output_device is None and model.dim == 1
    assert model.broadcast_buffers is False and model.forward_sync_buffers is False
    assert model.process_group is group is dist.group.WORLD
    assert model.find_unused_parameters and model.gradient_as_bucket_view and model.static_graph
    assert model.require_backward_grad_sync and model.require_forward_param_sync
    assert model.bucket_bytes_cap == 2 * 2**20 and model.reducer is not None
    assert model.device == torch.device("cpu") and model.device_type == "cpu" and not model.is_multi_device_module
    # bucket_cap_mb is comm_buffer_size, bounding the last bucket too, as DDP's does.
    assert model.options.comm_buffer_size == 2 and model.options.last_comm_buffer_size == 2
    model.broadcast_buffers = True
    assert model.forward_sync_buffers and model.will_sync_module_buffers() is False  # one rank of torch's: no-op
    logging_data = model._get_ddp_logging_data()
    assert logging_data["module_name"] == "NormNet" and logging_data["world_size"] == 1
    assert logging_data["find_unused_parameters"] == 1 and logging_data["has_error"] == 0


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        pytest.param(("group",), {}, ValueError, r"by name: DataParallel\(module, process_group=g\)", id="group-as-device_ids"),
        pytest.param(([0],), {}, ValueError, "device_ids=None for a CPU", id="cpu-device_ids"),
        pytest.param((), {"output_device": 0}, ValueError, "output_device 0", id="cpu-output_device"),
        pytest.param((), {"mixed_precision": object()}, ValueError, "torch.autocast", id="mixed_precision"),
        pytest.param((), {"bucket_cap_mb_list": [1, 2]}, ValueError, "last_comm_buffer_size", id="bucket_cap_mb_list"),
        pytest.param((), {"delay_all_reduce_named_params": []}, ValueError, "at the same time", id="delay-alone"),
        pytest.param((), {"process_group": "group", "group": "subgroup"}, ValueError, "pass one of them", id="two-groups"),
        pytest.param((), {"process_group": "group", "device_mesh": object()}, RuntimeError, "and device_mesh", id="mesh"),
        pytest.param((), {"bucket_cap_mb": 2, "comm_buffer_size": 3}, ValueError, "same option", id="bucket_cap_mb-twice"),
        pytest.param((), {"find_unused_parameters": True, "options": "options"}, TypeError, "not both", id="options-twice"),
    ],
)
def test_what_cannot_work_is_refused_naming_what_to_use(args, kwargs, error, message):
    import torch.distributed as dist

    from lit_dp import DataParallel, Options
    from tests.helpers.groups import one_rank_group

    group = one_rank_group()
    stand_ins = {"group": group, "subgroup": dist.new_group([0]), "options": Options.build({}, "module")}
    args = [stand_ins.get(value, value) if isinstance(value, str) else value for value in args]
    kwargs = {key: stand_ins.get(value, value) if isinstance(value, str) else value for key, value in kwargs.items()}
    with pytest.raises(error, match=message):
        DataParallel(NormNet(), *args, **kwargs)


def test_modules_ddp_refuses_are_refused_with_the_parameters_named():
    from lit_dp import DataParallel
    from tests.helpers.groups import one_rank_group

    one_rank_group()
    with pytest.raises(RuntimeError, match="nothing to train in Module: it has no parameters"):
        DataParallel(nn.Module())
    frozen = NormNet().requires_grad_(False)
    frozen_message = r"nothing to train in NormNet: its parameters stem.weight, stem.bias, norm.weight \(and 3 more\)"
    with pytest.raises(RuntimeError, match=frozen_message):
        DataParallel(frozen)
    two_devices = NormNet()
    two_devices.head.to("meta")
    per_type = r"on cpu: stem.weight, stem.bias, norm.weight \(and 1 more\); on meta: head.weight, head.bias"
    with pytest.raises(ValueError, match=per_type):
        DataParallel(two_devices)
    with pytest.raises(RuntimeError, match="uninitialized parameters"):
        DataParallel(nn.LazyLinear(3))
    with pytest.warns(FutureWarning, match="check_reduction"):
        DataParallel(NormNet(), check_reduction=True)


def test_state_dict_has_ddps_prefix_and_either_form_loads():
    from lit_dp import DataParallel
    from tests.helpers.groups import one_rank_group

    one_rank_group()
    model = DataParallel(NormNet())
    plain = NormNet()
    assert list(model.state_dict()) == [f"module.{key}" for key in plain.state_dict()]
    assert [name for name, _ in model.named_parameters()] == [f"module.{n}" for n, _ in plain.named_parameters()]
    model.load_state_dict(plain.state_dict())  # a plain module's checkpoint
    torch.testing.assert_close(model.module.stem.weight, plain.stem.weight)
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        model.module.stem.weight.zero_()
    model.load_state_dict(saved)  # its own form, as DDP's
    torch.testing.assert_close(model.module.stem.weight, plain.stem.weight)
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({"module.stem.weight": plain.stem.weight})


def test_deepcopy_and_pickling_give_a_model_that_trains_like_the_original():
    import copy
    import io

    import torch.distributed as dist

    from lit_dp import DataParallel
    from tests.helpers.groups import one_rank_group

    one_rank_group()
    model = DataParallel(NormNet(), comm_stats=True)
    inputs = torch.randn(6, 6)
    model(inputs).sum().backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert twin.reducer is not None and twin.reducer is not model.reducer
        assert twin.comm_stats() is None, "a copy has no observers"
        for net in (model, twin):
            net.zero_grad(set_to_none=True)
            net(inputs).sum().backward()
        for ours, theirs in zip(model.parameters(), twin.parameters()):
            assert ours is not theirs
            torch.testing.assert_close(theirs.grad, ours.grad)
    explicit = DataParallel(NormNet(), process_group=dist.group.WORLD)  # the default group, named: allowed
    assert copy.deepcopy(explicit).process_group is dist.group.WORLD
    sub = dist.new_group([0])
    with pytest.raises(RuntimeError, match="need the default process group"):
        copy.deepcopy(DataParallel(NormNet(), process_group=sub))


def test_backward_with_create_graph_runs_as_on_ddp():
    from lit_dp import DataParallel
    from tests.helpers.groups import one_rank_group

    one_rank_group()

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.tensor(1.0))

        def forward(self) -> torch.Tensor:
            return self.p.pow(2)

    model = DataParallel(Square())
    with pytest.warns(UserWarning, match="create_graph=True"):
        for _ in range(6):
            model().backward(create_graph=True)
    assert model.module.p.grad.requires_grad
    torch.testing.assert_close(model.module.p.grad.detach(), torch.tensor(12.0))


def test_bad_hooks_raise_ddps_errors():
    import torch.distributed as dist

    from lit_dp import DataParallel
    from tests.helpers.groups import one_rank_group

    one_rank_group()

    def wrong_bucket(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    def wrong_result(state: object, bucket: dist.GradBucket) -> int:
        return 1

    def no_future(state, bucket):
        return 1

    def as_a_list(state, bucket):
        future = torch.futures.Future()
        future.set_result([bucket.buffer() * 2])
        return future

    for hook, error, message in (
        (1, TypeError, "Communication hook must be callable."),
        (wrong_bucket, ValueError, "bucket annotation should be dist.GradBucket."),
        (wrong_result, ValueError, r"return annotation should be torch.futures.Future\[torch.Tensor\]."),
    ):
        model = DataParallel(nn.Linear(2, 2))
        with pytest.raises(error, match=message):
            model.register_comm_hook(None, hook)
        logged = model._get_ddp_logging_data()
        assert logged["has_error"] == 1 and re.search(message, logged["error"]), "logged as DDP logs its errors"
    model = DataParallel(nn.Linear(2, 2))
    model.register_comm_hook(None, no_future)
    with pytest.raises(RuntimeError, match="callback must return a torch.futures.Future object, but got int"):
        model(torch.randn(3, 2)).sum().backward()
    model = DataParallel(nn.Linear(2, 2))
    model.register_comm_hook(None, as_a_list)  # a future of [tensor], as a collective's own future holds
    with pytest.raises(RuntimeError, match="register_comm_hook or register_builtin_comm_hook can only be called once."):
        model.register_comm_hook(None, as_a_list)
    inputs = torch.randn(3, 2)
    model(inputs).sum().backward()
    torch.testing.assert_close(model.module.bias.grad, torch.full((2,), 6.0))


def test_static_graph_is_set_before_training_only():
    from lit_dp import DataParallel
    from tests.helpers.groups import one_rank_group

    one_rank_group()
    model = DataParallel(nn.Linear(2, 2))
    model._set_static_graph()
    assert model.static_graph
    model(torch.randn(3, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="should be called before training loop starts"):
        model._set_static_graph()
    assert "before training loop starts" in model._get_ddp_logging_data()["error"]


def test_a_process_group_written_in_python_is_used_through_its_own_methods():
    """As torch's test_c10d_pypg: DDP on a Python group; torchft's groups are such subclasses."""
    from lit_dp import DataParallel
    from tests.helpers.python_group import OneRankPythonGroup

    for as_view in (False, True):
        group = OneRankPythonGroup()
        torch.manual_seed(123)
        net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
        reference = __import__("copy").deepcopy(net)
        model = DataParallel(net, process_group=group, bucket_cap_mb=0.00001, gradient_as_bucket_view=as_view)
        assert group.calls["broadcast"] == 1, "construction broadcasts from the group's first rank"
        for step in range(2):
            inputs = torch.randn(4, 2, generator=torch.Generator().manual_seed(step))
            model(inputs).sum().backward()
            reference(inputs).sum().backward()
            for ours, expected in zip(net.parameters(), reference.parameters()):
                torch.testing.assert_close(ours.grad, expected.grad)
                with torch.no_grad():
                    ours -= ours.grad
                    expected -= expected.grad
                ours.grad = expected.grad = None
        # Collectives even on one rank (a Python group may do more than reduce), awaited as torch does.
        assert group.calls["allreduce"] >= 2 and group.waits > 0 and group.futures > 0
    quiet = OneRankPythonGroup()
    DataParallel(nn.Linear(2, 2), process_group=quiet, init_sync=False)
    assert not quiet.calls and quiet.waits == quiet.futures == 0, "init_sync=False communicates nothing"


def test_buffers_are_broadcast_before_a_forward_that_follows_a_synchronised_one():
    """DDP's rule (require_forward_param_sync): counted on a Python group of one rank, which gets
    every collective (a group of torch's own with one rank skips them)."""
    from lit_dp import DataParallel
    from tests.helpers.python_group import OneRankPythonGroup

    group = OneRankPythonGroup()
    model = DataParallel(NormNet(), process_group=group)
    inputs = torch.randn(4, 6)

    def broadcasts_of(step) -> int:
        before = group.calls["broadcast"]
        step()
        return group.calls["broadcast"] - before

    # Two dtypes of buffers (BatchNorm's float statistics and its integer count): two broadcasts.
    # The first step also broadcasts the bucket order the reducer agrees on after its first backward.
    assert broadcasts_of(lambda: model(inputs).sum().backward()) == 2 + 1
    assert broadcasts_of(lambda: model(inputs).sum().backward()) == 2  # after a synchronised one
    with model.no_sync():
        assert broadcasts_of(lambda: model(inputs).sum().backward()) == 2
        assert broadcasts_of(lambda: model(inputs).sum().backward()) == 0  # after a local one
    assert not model.require_forward_param_sync
    assert broadcasts_of(lambda: model(inputs).sum().backward()) == 0  # the window's last micro-step
    with torch.no_grad():
        assert broadcasts_of(lambda: model(inputs)) == 2  # evaluation after training
        assert broadcasts_of(lambda: model(inputs)) == 0
    model.broadcast_buffers = False
    assert broadcasts_of(lambda: model(inputs).sum().backward()) == 0
    off = OneRankPythonGroup()
    DataParallel(NormNet(), process_group=off, broadcast_buffers=False)(inputs).sum().backward()
    assert off.calls["broadcast"] == 1, "broadcast_buffers=False: parameters only, at construction"



def test_join_on_a_process_group_written_in_python_is_refused_by_name():
    """torch's Join reads the rank through torch's group bookkeeping, which a Python group (torchft's)
    is not in: DDP's join() fails with "not registered"; lit_dp's raised a KeyError in its own store
    bookkeeping. Next to a default group, as under torchft."""
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from lit_dp import DataParallel
    from tests.helpers.python_group import OneRankPythonGroup

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the conftest destroys it
    with pytest.raises(ValueError, match="not registered"):
        DistributedDataParallel(nn.Linear(2, 2), process_group=OneRankPythonGroup()).join()
    model = DataParallel(nn.Linear(2, 2), process_group=OneRankPythonGroup())
    for enter in (model.join, lambda: Join([model])):
        with pytest.raises(ValueError, match="join\\(\\) on a process group written in Python \\(OneRankPythonGroup\\)"):
            enter()


# --- a hand-written loop in bf16 with a fused optimizer and clipping ---


def bf16_fused_adamw_clipped(rank, steps):
    """lit_dp and torch DDP side by side under ``torch.autocast(bfloat16)``, fused AdamW, clip_grad_norm_."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp
    from tests.helpers.equivalence import assert_same_gradients, assert_same_parameters
    from tests.helpers.models import Tied, batch, loss, reference_loss, shard

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    base = Tied()
    reference = copy.deepcopy(base)
    ours, ddp = lit_dp.DataParallel(base), DistributedDataParallel(copy.deepcopy(base))
    optimizers = [torch.optim.AdamW(model.parameters(), lr=0.01, fused=True) for model in (ours, ddp)]
    for step in range(steps):
        inputs, targets = batch(step, world_size)
        reference.load_state_dict(ours.module.state_dict())  # the one-process oracle at this step's weights
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for model in (ours, ddp):
                loss(model, shard(inputs, rank), shard(targets, rank), rank, step).backward()
            reference_loss(reference, step, world_size).backward()
        norms = [torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2) for model in (ours, ddp, reference)]
        assert norms[0] > 1e-2, f"clipping did not act: norm {norms[0]}"
        label = f"step {step} rank {rank}"
        assert_same_gradients(ours, ddp, f"{label} vs DDP")  # the same local bf16 gradients, averaged alike
        torch.testing.assert_close(norms[0], norms[1])
        # One process rounds the sum of both halves' bf16 weight gradients once, the ranks each half's:
        # bfloat16's tolerances (8 significant bits).
        for (name, param), ref in zip(ours.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(
                param.grad, ref.grad, rtol=1.6e-2, atol=1e-5, msg=lambda m: f"{label} {name}: {m}"
            )
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert_same_parameters(ours, ddp, f"after {steps} steps")
    return True


def test_a_hand_written_bf16_loop_with_fused_adamw_and_clipping_matches_ddp_and_one_process():
    assert run_ranks(bf16_fused_adamw_clipped, 2, 3) == {0: True, 1: True}
