"""Every config composes and instantiates; bad values fail with the key, the value and what is allowed."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lit_dp import Options, PaddleDPStrategy
from lit_dp.options import TRAINER, declared_options
from lit_dp.options.core import ddp_takes_bf16_hooks
from lit_dp_recipes.config import (
    build_strategy,
    check_cpu_devices,
    ddp_options,
    ddp_schema,
    paddle_dp_schema,
    register_configs,
    validate_trainer,
)
from lit_dp_recipes.ddp_peer import DDPPeer, ddp_strategy
from lit_dp_recipes.train import train
from tests.helpers.recipes import CONF, compose_config

PRIMARY = ["digits", "gpt", "charlm"]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

register_configs()


@pytest.mark.parametrize("name", PRIMARY)
@pytest.mark.parametrize("strategy", ["paddle_dp", "ddp"])
def test_primary_configs_compose_and_instantiate(name, strategy, tmp_path):
    cfg = compose_config(name, [f"strategy={strategy}"], tmp_path)
    validate_trainer(cfg)
    assert isinstance(instantiate(cfg.model, _convert_="all"), pl.LightningModule)
    assert isinstance(instantiate(cfg.data, _convert_="all"), pl.LightningDataModule)
    built = build_strategy(cfg.strategy)
    assert isinstance(built, PaddleDPStrategy) == (strategy == "paddle_dp")
    callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
    trainer = instantiate(cfg.trainer, strategy=built, callbacks=callbacks, logger=False)
    assert trainer.strategy is built


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_configs_compose(experiment, tmp_path):
    primary = next((name for name in ("charlm", "gpt") if experiment.startswith(name)), "digits")
    cfg = compose_config(primary, [f"experiment={experiment}"], tmp_path)
    validate_trainer(cfg)
    build_strategy(cfg.strategy)


def test_overrides_reach_the_strategy(tmp_path):
    cfg = compose_config(
        "digits",
        ["strategy.comm_buffer_size=5", "strategy.backend=gloo", "strategy.nrings=2", "trainer.devices=3"],
        tmp_path,
    )
    strategy = build_strategy(cfg.strategy)
    assert (strategy.options.comm_buffer_size, strategy.process_group_backend, strategy.options.nrings) == (5, "gloo", 2)
    assert cfg.trainer.devices == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("strategy.comm_buffer_size=-1", r"strategy.comm_buffer_size=-1 is invalid: expected a positive number"),
        ("strategy.comm_buffer_size=abc", r"strategy.comm_buffer_size='abc' is invalid: .* megabytes or 'auto'"),
        ("strategy.last_comm_buffer_size=0", r"strategy.last_comm_buffer_size=0.0 is invalid"),
        ("strategy.backend=foo", r"strategy.backend='foo' is invalid: expected 'auto', a backend torch.distributed reports available"),
        ("strategy.nrings=9", r"strategy.nrings=9 is invalid: expected an integer in \[1, 8\]"),
        ("strategy.timeout=-5", r"strategy.timeout=-5.0 is invalid: expected a positive duration"),
        ("strategy.start_method=thread", r"strategy.start_method='thread' is invalid"),
        ("trainer.devices=zero", r"trainer.devices='zero' is invalid: expected a positive integer, 'auto'"),
        ("trainer.devices=0", r"trainer.devices=0 is invalid"),
        ("trainer.accelerator=tpuu", r"trainer.accelerator='tpuu' is invalid: expected one of"),
        ("trainer.num_nodes=0", r"trainer.num_nodes=0 is invalid: expected an integer >= 1"),
        ("strategy.comm_hook=int8", r"strategy.comm_hook='int8' is invalid: expected one of fp16, bf16, powersgd"),
        ("strategy.comm_dtype=fp8", r"strategy.comm_dtype='fp8' is invalid: expected one of fp16, bf16"),
        ("strategy.powersgd.rank=2", r"strategy.powersgd.rank=2 is invalid with strategy.comm_hook=None: it applies to"),
        ("strategy.comm_hook=powersgd strategy.powersgd.start_iter=1", r"powersgd.start_iter=1 is invalid: .* >= 2"),
        ("strategy.comm_hook=powersgd strategy.powersgd.rank=0", r"strategy.powersgd.rank=0 is invalid: .* >= 1"),
        ("strategy.comm_hook=fp16 strategy.comm_dtype=bf16", r"comm_dtype='bf16' is invalid with strategy.comm_hook='fp16'"),
        ("strategy.local_sgd.steps=0", r"strategy.local_sgd.steps=0 is invalid: expected an integer >= 1"),
        ("strategy.local_sgd.steps=2 strategy.local_sgd.warmup_steps=-5", "strategy.local_sgd.warmup_steps=-5 is invalid"),
        ("strategy.local_sgd.adaptive=true", "strategy.local_sgd.adaptive=True needs strategy.local_sgd.steps"),
        # Issue 39, 3: refused in each rank's setup, after the ranks started; now where the job starts.
        ("strategy.comm_hook=powersgd strategy.powersgd.start_iter=2 strategy.comm_buffer_size=auto",
         r"strategy.comm_buffer_size='auto' with strategy.comm_hook='powersgd' and strategy.powersgd.start_iter=2 is "
         r"invalid: 'auto' rebuilds the buckets until synchronised step 121, .* expected strategy.powersgd.start_iter "
         r">= 121, or a fixed strategy.comm_buffer_size"),
        ("strategy.trace.steps=[0,2]", r"strategy.trace.steps=\(0, 2\) needs strategy.trace.dir"),
        # Refused in each rank's setup by the strategy; the recipe refuses it before the ranks start.
        ("strategy.sharding.stage=2 trainer.precision=16-mixed",
         r"trainer.precision='16-mixed' with strategy.sharding.stage=2 is invalid: a gradient scaler"),
        ("strategy.trace.steps=[3,1]", r"strategy.trace.steps=\[3, 1\] is invalid: expected two integers"),
        ("strategy.bucket_size=5", "strategy.bucket_size=5 is not an option of lit_dp.PaddleDPStrategy"),
        ("trainer.devices=100000", r"trainer.devices=100000 is too many CPU processes: this machine gives \d+ cores"),
        ("data.batch_size=0", r"data.batch_size=0 is invalid: expected an integer >= 1"),
        ("data.val_fraction=abc", r"data.val_fraction='abc' is invalid: expected a number in \(0, 1\)"),
    ],
)
def test_bad_values_fail_in_train_before_anything_is_built(override, message, tmp_path, monkeypatch):
    cfg = compose_config("digits", override.split(), tmp_path)
    monkeypatch.setattr(pl, "Trainer", _must_not_be_called)
    with pytest.raises(ValueError, match=message):
        train(cfg)


def test_a_trace_dir_under_a_file_fails_in_train_before_anything_is_built(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    cfg = compose_config("digits", [f"strategy.trace.dir={tmp_path / 'afile' / 'trace'}"], tmp_path)
    monkeypatch.setattr(pl, "Trainer", _must_not_be_called)
    with pytest.raises(ValueError, match=rf"strategy.trace.dir='.*afile/trace' is invalid: {tmp_path / 'afile'} is not a folder"):
        train(cfg)


def test_fault_tolerance_with_replica_groups_of_any_size_passes_the_checks(tmp_path, monkeypatch):
    # A replica group is its launcher's job, of one rank or many (docs/fault_tolerance.md).
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    for overrides in (["trainer.devices=1"], ["trainer.devices=auto"], ["trainer.devices=[0]"], [], ["trainer.num_nodes=2"]):
        cfg = compose_config("gpt", ["strategy.fault_tolerance=torchft", *overrides], tmp_path)
        validate_trainer(cfg)


def test_cpu_devices_above_the_cores_warn_and_far_above_fail():
    check_cpu_devices("cpu", 2, cores=2)
    with pytest.warns(UserWarning, match=r"trainer.devices=3 starts more CPU processes than the 2 cores .*at most 8"):
        check_cpu_devices("cpu", 3, cores=2)
    with pytest.raises(ValueError, match=r"trainer.devices=100 is too many CPU processes: this machine gives 2 cores, "
                                         r"and at most 8 processes \(4 per core\) are accepted. Use trainer.devices=2"):
        check_cpu_devices("cpu", 100, cores=2)
    check_cpu_devices("gpu", 100, cores=2)  # GPUs are counted by Lightning against the devices it finds


def _must_not_be_called(*args, **kwargs):
    raise AssertionError("a Trainer was built from an invalid config")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("strategy.find_unused_parameters=maybe", "find_unused_parameters"),
        ("strategy.sharding.stage=two", "stage"),
        ("strategy.trace.dri=x", "Key 'dri' not in 'TraceConfig'"),
    ],
)
def test_wrong_types_and_unknown_keys_inside_a_node_fail_at_composition(override, message, tmp_path):
    with pytest.raises(ConfigCompositionException) as error:
        compose_config("digits", override.split(), tmp_path)
    assert message in str(error.value) + str(error.value.__cause__)


# Every option of a group (or of a named hook) as a command line spelt it before options were
# grouped: strategy.trace_dir, strategy.local_sgd_steps, strategy.powersgd_rank, ...
FLAT_SPELLINGS = [(d.keyword, d.path) for d in declared_options(TRAINER) if "." in d.path]


@pytest.mark.parametrize(("flat", "path"), FLAT_SPELLINGS)
def test_a_flat_spelling_fails_in_train_naming_the_key_to_use(flat, path, tmp_path, monkeypatch):
    # The schema is open at its top: the flat key composes, and Options.build names the nested one.
    default = next(d.field.default for d in declared_options(TRAINER) if d.path == path)
    override = f"strategy.{flat}={'null' if default is None else list(default) if isinstance(default, tuple) else default}"
    cfg = compose_config("digits", [override.replace(" ", "")], tmp_path)
    monkeypatch.setattr(pl, "Trainer", _must_not_be_called)
    with pytest.raises(ValueError, match=re.escape(f"Did you mean 'strategy.{path}'?")):
        train(cfg)


def test_structured_config_is_generated_from_the_one_declaration_of_options():
    schema = OmegaConf.to_container(OmegaConf.structured(paddle_dp_schema()))
    assert schema.pop("_target_") == "lit_dp.PaddleDPStrategy"
    defaults = PaddleDPStrategy().options
    # Every option a command line can express, at its path, with the library's default; Python objects stay out.
    for declared in declared_options(TRAINER):
        owner, _, member = declared.path.rpartition(".")
        node = schema[owner] if owner else schema
        if declared.field.metadata["config"] is None:
            assert member not in node, declared.path
            continue
        value = node.pop(member)
        assert (tuple(value) if isinstance(value, list) else value) == declared.field.default, declared.path
    assert all(node == {} for node in schema.values()), f"schema keys without a declaration: {schema}"
    values = OmegaConf.to_container(OmegaConf.structured(paddle_dp_schema()))
    values.pop("_target_")
    assert Options.build(values, TRAINER, nested=True) == defaults


def test_the_ddp_config_holds_the_options_whose_declaration_says_what_ddp_has_for_them():
    schema = OmegaConf.to_container(OmegaConf.structured(ddp_schema()))
    for declared in ddp_options():
        owner, _, member = declared.path.rpartition(".")
        assert member in (schema[owner] if owner else schema), declared.path
    # A named hook's options go with comm_hook; everything else a config can express is DDP's or refused.
    assert {"comm_buffer_size", "comm_hook", "powersgd"} <= set(schema)
    assert not {"last_comm_buffer_size", "comm_stats", "local_sgd", "sharding", "trace"} & set(schema)
    strategy = ddp_strategy(comm_buffer_size=5, backend="gloo", timeout=60, find_unused_parameters=True)
    assert isinstance(strategy, DDPPeer)
    assert strategy._ddp_kwargs == {
        "bucket_cap_mb": 5.0, "find_unused_parameters": True, "gradient_as_bucket_view": False
    }
    assert (strategy._process_group_backend, strategy._timeout.total_seconds()) == ("gloo", 60)
    with pytest.raises(ValueError, match=r"nrings=2 has no counterpart in torch DDP"):
        ddp_strategy(nrings=2)
    with pytest.raises(ValueError, match=r"comm_buffer_size=0 is invalid"):
        ddp_strategy(comm_buffer_size=0)
    with pytest.raises(ValueError, match=r"comm_bufer_size=5 is not an option under torch DDP. Did you mean 'comm_buffer"):
        ddp_strategy(comm_bufer_size=5)


def test_a_named_hook_under_ddp_is_torchs_hook_registered_on_every_device():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert ddp_strategy(comm_hook="fp16")._ddp_comm_hook is default_hooks.fp16_compress_hook
    if ddp_takes_bf16_hooks():
        assert ddp_strategy(comm_hook="bf16")._ddp_comm_hook is default_hooks.bf16_compress_hook
    else:  # DDP would refuse it in each rank, after they started
        with pytest.raises(ValueError, match=r"comm_dtype='bf16' is invalid under torch DDP with this torch build"):
            ddp_strategy(comm_dtype="bf16")
    powersgd = ddp_strategy(comm_hook="powersgd", powersgd={"rank": 2, "start_iter": 10})
    assert powersgd._ddp_comm_hook is powerSGD_hook.powerSGD_hook
    assert (powersgd._ddp_comm_state.matrix_approximation_rank, powersgd._ddp_comm_state.start_powerSGD_iter) == (2, 10)
    wrapped = ddp_strategy(comm_hook="powersgd", comm_dtype="fp16")._ddp_comm_hook
    assert wrapped.__qualname__.startswith("fp16_compress_wrapper")
    assert ddp_strategy()._ddp_comm_hook is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # Issue 39, 1: crashed inside torch DDP after the ranks started ("invalid literal for int()").
        (["strategy.comm_buffer_size=auto"],
         r"strategy.comm_buffer_size='auto' is invalid under torch DDP: DDP has no automatic bucket size .* expected "
         r"a number, e.g. strategy.comm_buffer_size=25"),
        # Issue 39, 2: trained, the option ignored.
        (["+strategy.last_comm_buffer_size=5"],
         r"strategy.last_comm_buffer_size=5 has no counterpart in torch DDP \(Lightning's DDPStrategy\), which would "
         r"run without it \(last_comm_buffer_size: size limit"),
        (["experiment=small_buckets"], r"strategy.last_comm_buffer_size=0.05 has no counterpart in torch DDP"),
        (["+strategy.comm_stats=true", "+strategy.sharding.stage=1"],
         r"strategy.comm_stats=True and strategy.sharding.stage=1 have no counterpart in torch DDP"),
        (["+strategy.nrings=2"], r"strategy.nrings=2 has no counterpart in torch DDP"),
    ],
)
def test_what_ddp_cannot_take_fails_in_train_before_anything_is_built(overrides, message, tmp_path, monkeypatch):
    cfg = compose_config("gpt", ["strategy=ddp", *overrides], tmp_path)
    monkeypatch.setattr(pl, "Trainer", _must_not_be_called)
    with pytest.raises(ValueError, match=message):
        train(cfg)


def test_slurm_launcher_config_composes(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the lit_dp[slurm] extra")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("digits", overrides=["hydra/launcher=slurm_gpu", "trainer=multinode"], return_hydra_config=True)
    assert cfg.hydra.launcher.nodes == 2


def test_tensorboard_logger_is_skipped_where_tensorboard_is_missing(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import CSVLogger

    from lit_dp_recipes import train as train_module

    cfg = compose_config("digits", [], tmp_path)
    real_find_spec = train_module.importlib.util.find_spec
    monkeypatch.setattr(
        train_module.importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real_find_spec(name)
    )
    loggers = train_module._loggers(cfg.logger)
    assert [type(logger) for logger in loggers] == [CSVLogger]


@pytest.mark.parametrize(("primary", "experiment", "vocab_size"), [("gpt", "gpt2_small", 50304), ("charlm", "charlm_gpt2", 256)])
def test_gpt2_small_experiments_are_compiled_in_bf16(primary, experiment, vocab_size, tmp_path):
    cfg = compose_config(primary, [f"experiment={experiment}"], tmp_path)
    validate_trainer(cfg)
    assert (cfg.compile, cfg.compile_backend) == (True, "inductor")
    assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("gpu", "bf16-mixed")
    with torch.device("meta"):  # 86 M / 124 M parameters: no memory needed to check the shape
        model = instantiate(cfg.model, _convert_="all")
    assert (model.hparams.n_layer, model.hparams.n_head, model.hparams.n_embd, model.hparams.block_size) == (12, 12, 768, 1024)
    assert model.hparams.vocab_size == cfg.data.vocab_size == vocab_size
    assert instantiate(cfg.callbacks.throughput).peak_flops is None


def test_bad_shards_fail_in_train_before_anything_is_built(tmp_path, monkeypatch):
    cfg = compose_config("gpt", [f"data.train_shards={tmp_path}/*train*.bin", f"data.val_shards={tmp_path}/*val*.bin"], tmp_path)
    monkeypatch.setattr(pl, "Trainer", _must_not_be_called)
    with pytest.raises(ValueError, match=r"data.train_shards='.*\*train\*.bin' matches no file"):
        train(cfg)


def test_bad_compile_options_fail_in_train_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(pl, "Trainer", _must_not_be_called)
    with pytest.raises(ValueError, match=r"compile='maybe' is invalid: expected true or false"):
        train(compose_config("gpt", ["compile=maybe"], tmp_path))
    with pytest.raises(ValueError, match=r"compile_backend='inductr' is invalid: expected a torch.compile backend"):
        train(compose_config("gpt", ["compile=true", "compile_backend=inductr"], tmp_path))
