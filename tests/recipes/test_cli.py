"""The recipes' command line: every mistake is one line naming what was typed and what is expected,
with the near names, no traceback, before any rank starts (docs/conventions.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace
from typing import get_args

import lightning.pytorch as pl
import pytest
import torch
from hydra.errors import InstantiationException
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lit_dp_recipes.cli import CommandLineMistake, command_line_mistakes
from lit_dp_recipes.config import PRECISIONS, register_configs
from lit_dp_recipes.digits import DigitsDataModule, MLPClassifier
from lit_dp_recipes.gpt import GPT
from lit_dp_recipes.token_data import TokenDataModule
from lit_dp_recipes.train import train
from tests.helpers.recipes import ROOT, compose_config


@pytest.fixture(autouse=True, scope="module")
def schemas():
    register_configs()  # as recipe_main does first; alone, this file would compose without them


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["strategy.comm_bufer_size=5"],
         "strategy.comm_bufer_size is not an option of strategy=paddle_dp: did you mean strategy.comm_buffer_size"),
        (["strategy=ddp", "strategy.find_unused=true"],
         "strategy.find_unused is not an option of strategy=ddp: did you mean strategy.find_unused_parameters?"),
        # In a sweep each strategy is checked.
        (["-m", "strategy=paddle_dp,ddp", "strategy.comm_hok=bf16"],
         "strategy.comm_hok is not an option of strategy=paddle_dp: did you mean strategy.comm_hook? "
         "(docs/options.md lists them all)\n"
         "strategy.comm_hok is not an option of strategy=ddp: did you mean strategy.comm_hook?"),
        (["-m", "strategy=paddle_dp,ddp", "strategy.nothing_alike=1"],
         "strategy.nothing_alike is not an option of strategy=ddp: its options: backend, broadcast_buffers,"),
        # lit_dp's options that torch DDP has nothing like (issue 39: they were ignored silently).
        (["strategy=ddp", "strategy.last_comm_buffer_size=5"],
         "strategy.last_comm_buffer_size is not an option of strategy=ddp: torch DDP has no counterpart "
         "(last_comm_buffer_size: size limit in MB"),
        (["-m", "strategy=paddle_dp,ddp", "strategy.sharding.stage=1"],
         "strategy.sharding.stage is not an option of strategy=ddp: torch DDP has no counterpart"),
        # Issue 47: every group, not only strategy's; Hydra would advise `+trainer.max_epoch=5`.
        (["trainer.max_epoch=5"], "trainer.max_epoch is not a key of trainer=cpu: did you mean trainer.max_epochs"),
        (["model.lrr=1"], "model.lrr is not a key of model=mlp: did you mean model.lr?"),
        (["data.batchsize=8"], "data.batchsize is not a key of data=digits: did you mean data.batch_size?"),
        (["callbacks.model_checkpoint.monitr=x"],
         "callbacks.model_checkpoint.monitr is not a key of callbacks.model_checkpoint: did you mean "
         "callbacks.model_checkpoint.monitor?"),
        # A key unlike any the config has may be an argument of the node's target that it leaves out.
        (["callbacks.model_checkpoint.every_n_epochs=3"],
         "callbacks.model_checkpoint.every_n_epochs is not a key of callbacks.model_checkpoint: its keys: dirpath, "
         "enable_version_counter, mode, monitor, save_last. To pass lightning.pytorch.callbacks.ModelCheckpoint an "
         "argument the config leaves out: +callbacks.model_checkpoint.every_n_epochs=..."),
        (["trainer.fast_dev_run=true"], "To pass lightning.pytorch.Trainer an argument the config leaves out: "
                                        "+trainer.fast_dev_run=..."),
        (["callbacks.run_summary.foo=1"], "callbacks.run_summary.foo is not a key of callbacks.run_summary: it has none. "
                                          "To pass lit_dp_recipes.callbacks.RunSummary an argument"),
        (["monitor_mode=maxx"], "monitor_mode='maxx' is invalid: expected min (the least monitor is best, a loss) or max"),
        (["sed=1"], "sed is not a key of the config: did you mean seed?"),
        (["hydra.run.dirr=x"], "hydra.run.dirr is not a key of hydra.run: did you mean hydra.run.dir?"),
        (["strategy=dpp"], "strategy=dpp is not a choice of strategy: did you mean strategy=ddp? expected one of ddp, paddle_dp."),
        (["experiment=smal_buckets"], "experiment=smal_buckets is not a choice of experiment: did you mean experiment=small_buckets?"),
        (["experiment=null"], "experiment=null is not a choice of experiment: expected ~experiment to leave the group out"),
        # An experiment of another recipe: the MLP and the digits would refuse its keys only once built.
        (["experiment=gpt_tiny"],
         "experiment=gpt_tiny is not an experiment of the digits recipe: it sets model.n_layer, model.n_embd, "
         "model.n_head and 4 more, which its config lacks; expected one written for it"),
        (["-m", "trainer=cpu,gpuu"], "trainer=gpuu is not a choice of trainer: did you mean trainer=gpu?"),
        # Wrong types, and values the checks made before anything starts refuse.
        (["trainer.max_steps=abc"], "trainer.max_steps=abc is invalid: Value 'abc' of type 'str' could not be converted to Integer."),
        (["strategy.comm_buffer_size=-1"], "strategy.comm_buffer_size=-1 is invalid: expected a positive number of megabytes"),
        (["strategy.trace.steps=4"], "strategy.trace.steps=4 is invalid: expected a list in brackets, such as [1,4]."),
        (["trainer.devices=0"], "trainer.devices=0 is invalid: expected a positive integer"),
        (["-m", "trainer.devices=2,0"], "trainer.devices=0 is invalid: expected a positive integer"),
        # Values Lightning refuses only once the Trainer is built, or never and then fails in each rank.
        (["trainer.max_steps=-5"], "trainer.max_steps=-5 is invalid: expected a number of steps >= 0, or -1 (no limit)."),
        (["trainer.precision=bf32"], "trainer.precision='bf32' is invalid: expected one of 16-mixed, bf16-mixed, 32-true,"),
        (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0 is invalid: expected an integer >= 1."),
        (["trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch=0 is invalid: expected an integer >= 1"),
        (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1.0 is invalid: expected a norm >= 0"),
        (["trainer.val_check_interval=1.5"],
         "trainer.val_check_interval=1.5 is invalid: expected the training batches between validations: an integer >= 1, "
         "a share of an epoch in (0, 1], or null."),
        (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 is invalid: expected the training batches"),
        (["trainer.limit_train_batches=-1"],
         "trainer.limit_train_batches=-1 is invalid: expected the batches of an epoch to use: an integer >= 0, "
         "a share of an epoch in [0, 1], or null."),
        (["trainer.limit_val_batches=abc"], "trainer.limit_val_batches='abc' is invalid: expected the batches of an epoch"),
        (["checkpoint_every_n_steps=0"], "checkpoint_every_n_steps=0 is invalid: expected a positive number"),
        (["compile=maybe"], "compile='maybe' is invalid: expected true or false."),
        (["seed=abc"], "seed='abc' is invalid: expected an integer."),
        (["ckpt_path=no/such.ckpt"], "ckpt_path='no/such.ckpt' is invalid: no such file from "),
        # What Hydra cannot parse at all.
        (["trainer.devices=[0,1"], "trainer.devices=[0,1 is not an override Hydra can read (no viable alternative at "
                                   "input '[0,1'): expected key=value"),
        (["trainer.devices"], "trainer.devices is not an override Hydra can read"),
        # An addition is the user's business, but the strategy still refuses an option it lacks, by name.
        (["+strategy.anything=1"], "strategy.anything=1 is not an option of lit_dp.PaddleDPStrategy. Expected one of:"),
    ],
)
def test_each_mistake_is_one_message_naming_it_and_what_is_expected(arguments, message):
    assert message in "\n".join(command_line_mistakes("digits", arguments))


@pytest.mark.parametrize(
    ("recipe", "arguments", "spelling"),
    [
        ("digits", ["--devices=2"], "--devices=2: the recipes take Hydra overrides, key=value without dashes: trainer.devices=2"),
        ("digits", ["--max-epochs", "3"], "--max-epochs 3: the recipes take Hydra overrides, key=value without dashes: "
                                          "trainer.max_epochs=3"),
        ("digits", ["--trainer.devices=2", "seed=1"], "--trainer.devices=2: the recipes take Hydra overrides, key=value "
                                                      "without dashes: trainer.devices=2"),
        ("digits", ["--lr=0.1"], "model.lr=0.1"),
        ("digits", ["--comm_buffer_size=5"], "strategy.comm_buffer_size=5"),
        ("digits", ["--enable_progress_bar"], "trainer.enable_progress_bar=true"),  # a boolean switch
        ("digits", ["--seed"], "seed=..."),
        ("gpt", ["--warmup=3"], "callbacks.throughput.warmup=3 or callbacks.recompiles.warmup=3"),
        ("digits", ["--max_epoch=3"], "did you mean trainer.max_epochs=3 or trainer.max_steps=3? (--cfg job prints the config)"),
        ("digits", ["--nothing_alike=1"], "the config has no key nothing_alike (--cfg job prints the config)"),
    ],
)
def test_an_argparse_flag_is_answered_with_the_override_that_sets_it(recipe, arguments, spelling):
    [mistake] = command_line_mistakes(recipe, arguments)
    assert mistake.endswith(spelling), mistake


def test_hydras_own_flags_and_their_abbreviations_are_left_to_hydra():
    from hydra._internal.utils import get_args_parser  # Hydra's parser, private: read here only to check the list

    from lit_dp_recipes.cli import HYDRA_FLAGS

    assert set(HYDRA_FLAGS) == {flag for action in get_args_parser()._actions for flag in action.option_strings}
    for arguments in (["--cfg", "job"], ["-cn", "gpt"], ["--info"], ["--config-n=digits"], ["-m", "seed=1,2"]):
        assert command_line_mistakes("digits", arguments) == [], arguments
    assert len(command_line_mistakes("digits", ["--devices=2", "--lr", "0.1"])) == 2  # one line per flag


@pytest.mark.parametrize(
    ("model", "batch"),
    [
        (MLPClassifier(hidden_sizes=[8]), (torch.randn(4, 64), torch.randint(0, 10, (4,)))),
        (GPT(block_size=8, n_layer=1, n_head=1, n_embd=8), (torch.randint(0, 256, (4, 8)), torch.randint(0, 256, (4, 8)))),
    ],
    ids=["mlp", "gpt"],
)
def test_a_models_declared_metrics_are_what_it_logs(model, batch, tmp_path):
    loader = DataLoader(TensorDataset(*batch), batch_size=4)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, loader, loader)
    assert set(trainer.callback_metrics) == set(model.METRICS)


def test_the_precisions_accepted_are_lightnings():
    from lightning.fabric.connector import _PRECISION_INPUT

    lightnings = {str(value) for literal in get_args(_PRECISION_INPUT) for value in get_args(literal)}
    assert set(PRECISIONS) == lightnings


def test_a_required_key_left_out_is_named():
    assert command_line_mistakes("prepare_shards", ["output_dir=out"]) == [
        "input_dir has no value: expected input_dir=... on the command line."
    ]


@pytest.mark.parametrize(
    "arguments",
    [
        [],
        ["strategy.comm_buffer_size=5", "trainer.devices=3"],
        ["strategy=ddp", "strategy.comm_buffer_size=5"],
        ["strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd.start_iter=2"],
        ["strategy.comm_buffer_size=1,5", "-m"],
        ["experiment=small_buckets", "trainer=gpu", "callbacks.model_checkpoint=null"],
        ["experiment=local_sgd"],
        ["~experiment"],
        # What Lightning's launcher adds to each rank's command line (lit_dp_recipes.launch.rank_command).
        ["hydra.mode=RUN", 'hydra.run.dir="/tmp/a b"', "hydra.job.name=train_ddp_process_1", "hydra.output_subdir=null"],
        ["--cfg", "job", "anything_goes=1"],  # Hydra's own flags: Hydra checks
        ["trainer.val_check_interval=0.25", "trainer.limit_train_batches=10", "trainer.limit_val_batches=0"],
        ["trainer.val_check_interval=100.0", "trainer.precision=16-mixed", "trainer.check_val_every_n_epoch=null"],
    ],
)
def test_a_correct_command_line_passes(arguments):
    assert command_line_mistakes("digits", arguments) == []


@pytest.mark.parametrize(
    ("recipe", "override", "message"),
    [
        ("digits", "data.batch_size=0", "data.batch_size=0 is invalid: expected an integer >= 1"),
        ("digits", "model.lr=-1", "model.lr=-1 is invalid: expected a positive learning rate"),
        ("digits", "model.hidden_sizes=abc", "model.hidden_sizes='abc' is invalid: expected a list of positive integers"),
        ("gpt", "model.lr=abc", "model.lr='abc' is invalid: expected a positive learning rate"),
        ("digits", "data.split_seed=abc", "data.split_seed='abc' is invalid: expected an integer."),
        # A model that does not fit the data, which every rank would find at its first batch.
        ("digits", "model.num_classes=5",
         "model.num_classes=5 is invalid with data=digits: expected 10 (the digits are 64 pixels in 10 classes)."),
        ("digits", "model.in_features=32", "model.in_features=32 is invalid with data=digits: expected 64"),
        ("gpt", "model.block_size=32",
         "model.block_size=32 is invalid with data.block_size=64: expected at least data.block_size "
         "(model.block_size follows data.block_size unless set)."),
        ("gpt", "model.vocab_size=100", "model.vocab_size=100 is invalid with data.vocab_size=256: expected at least"),
        # Lightning's own words, after the key they are about.
        ("gpt", "callbacks.lr_monitor.logging_interval=stepp",
         "callbacks.lr_monitor.logging_interval='stepp' is invalid: logging_interval should be `step` or `epoch` or `None`."),
        ("digits", "logger.csv.save_dir=null",
         "logger.csv: lightning.pytorch.loggers.CSVLogger refused its arguments: expected str, bytes or os.PathLike object"),
        ("digits", "logger.csv._target_=lightning.pytorch.loggers.CSVLogga",
         "logger.csv._target_='lightning.pytorch.loggers.CSVLogga' is invalid: expected an importable class or function."),
        # ModelCheckpoint would find a misspelt metric at the first validation, in every rank.
        ("digits", "monitor=val_accc",
         "monitor='val_accc' is invalid: the model logs train_loss, val_loss, val_acc; did you mean monitor=val_acc?"),
        ("gpt", "monitor=val_los", "monitor='val_los' is invalid: the model logs train_loss, val_loss; did you mean "
                                   "monitor=val_loss"),
    ],
)
def test_what_only_building_the_data_or_model_checks_is_a_mistake_too(recipe, override, message, tmp_path, monkeypatch):
    monkeypatch.setattr(pl, "Trainer", lambda *a, **k: pytest.fail("the Trainer was built"))
    with pytest.raises(CommandLineMistake, match="^" + re.escape(message)):
        train(compose_config(recipe, [override], tmp_path))


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        # 1797 digits, a fifth for validation: 1438 for training, 719 for each of 2 ranks, 23 batches of 32.
        ("digits", ["trainer.val_check_interval=24"],
         "trainer.val_check_interval=24 is invalid: an epoch is 23 training batches per rank here (data.batch_size=32, "
         "2 ranks); expected at most 23, a fraction of an epoch (0.5: twice an epoch), or "
         "trainer.check_val_every_n_epoch=null to count batches across epochs."),
        # 480 for each of 3 ranks, 15 batches, half of them: 7.
        ("digits", ["trainer.devices=3", "trainer.limit_train_batches=0.5", "trainer.val_check_interval=8"],
         "trainer.val_check_interval=8 is invalid: an epoch is 7 training batches per rank here (data.batch_size=32, "
         "3 ranks, trainer.limit_train_batches=0.5); expected at most 7"),
        # The GPT recipe counts steps across epochs; counted within one, 1e6 stdlib bytes give 14062 windows of 65 tokens.
        ("gpt", ["trainer.check_val_every_n_epoch=1", "trainer.val_check_interval=220"],
         "trainer.val_check_interval=220 is invalid: an epoch is 219 training batches per rank here "
         "(data.batch_size=32, 2 ranks); expected at most 219"),
        # Lightning's own check of these is in each rank, after the ranks start.
        # 3600 bytes for training: 56 windows of 64 tokens and the next.
        ("gpt", ["data.max_bytes=4000"],
         "the stdlib text's train split gives 56 windows of data.block_size + 1 = 65 tokens: fewer than one batch "
         "(data.batch_size=32) for each of the 2 ranks."),
    ],
)
def test_what_the_data_and_the_trainer_check_together_is_refused_before_any_rank_starts(
    recipe, overrides, message, tmp_path, monkeypatch
):
    monkeypatch.setattr(pl, "Trainer", lambda *a, **k: pytest.fail("the Trainer was built"))
    with pytest.raises(CommandLineMistake, match="^" + re.escape(message)):
        train(compose_config(recipe, overrides, tmp_path))


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_trainer_on_a_machine_without_one_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(pl, "Trainer", lambda *a, **k: pytest.fail("the Trainer was built"))
    with pytest.raises(CommandLineMistake, match=r"^trainer.accelerator='gpu' is invalid here: torch .* sees no such device"):
        train(compose_config("digits", ["trainer=gpu"], tmp_path))


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        ("digits", ["trainer.val_check_interval=23"]),  # a whole epoch
        ("digits", ["trainer.val_check_interval=1000", "trainer.check_val_every_n_epoch=null"]),
        ("digits", ["trainer.val_check_interval=1000", "trainer.limit_val_batches=0"]),
        ("gpt", ["trainer.val_check_interval=100000"]),  # across epochs (the recipe's default); validates at the last step
    ],
)
def test_an_interval_lightning_accepts_is_not_refused(recipe, overrides, tmp_path, monkeypatch):
    class TrainerBuilt(Exception):
        """Every check before the Trainer passed."""

    def trainer(*args, **kwargs):
        raise TrainerBuilt

    monkeypatch.setattr(pl, "Trainer", trainer)
    with pytest.raises(InstantiationException) as raised:
        train(compose_config(recipe, overrides, tmp_path))
    assert isinstance(raised.value.__cause__, TrainerBuilt), raised.value


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_batches_a_rank_draws_are_counted_as_its_loader_gives_them(ranks):
    # What Lightning counts in each rank: the length of the rank's loader, with the sampler Lightning
    # gives the digits' (a DistributedSampler) and the one the token data brings.
    digits = DigitsDataModule(batch_size=32)
    digits.setup()
    sampler = DistributedSampler(digits.train_set, num_replicas=ranks, rank=ranks - 1, shuffle=True)
    assert digits.train_batches(ranks) == len(DataLoader(digits.train_set, batch_size=32, sampler=sampler))
    tokens = TokenDataModule(batch_size=8, max_bytes=100_000)
    tokens.trainer = SimpleNamespace(world_size=ranks, global_rank=ranks - 1,
                                     strategy=SimpleNamespace(root_device=torch.device("cpu")))
    tokens.setup()
    assert tokens.train_batches(ranks) == len(tokens.train_dataloader())


def test_a_key_a_target_does_not_take_names_the_ones_it_does(tmp_path):
    with pytest.raises(CommandLineMistake, match=r"^trainer.max_epoch is not an argument of lightning.pytorch.Trainer: "
                                                  r"did you mean trainer.max_epochs"):
        train(compose_config("digits", ["+trainer.max_epoch=5"], tmp_path))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["strategy.comm_buffer_size=-1", "trainer.max_epoch=5"],
         "error: trainer.max_epoch is not a key of trainer=cpu: did you mean trainer.max_epochs or trainer.max_steps?"),
        (["strategy.comm_buffer_size=-1"],
         "error: strategy.comm_buffer_size=-1 is invalid: expected a positive number of megabytes or 'auto'."),
        # Issue 52: argparse's habit, which Hydra answered with its usage screen and "unrecognized arguments".
        (["--devices=2"], "error: --devices=2: the recipes take Hydra overrides, key=value without dashes: trainer.devices=2"),
    ],
)
def test_a_refusal_is_one_line_without_lightning_torchs_compiler_or_a_traceback(arguments, message, tmp_path):
    # The recipe's own main, as `python recipes/digits.py ...` runs it: the exit message is the
    # whole output, and the check has loaded neither Lightning nor lit_dp's DataParallel with
    # torch's compiler (a refusal costs the imports of torch and of lit_dp's options only).
    code = (
        "import sys; from lit_dp_recipes.run.digits import main\n"
        f"sys.argv = ['digits.py', *{arguments!r}]\n"
        "try:\n    main()\n"
        "except SystemExit as stop:\n"
        "    print(stop.code, file=sys.stderr)\n"
        "    heavy = ('lightning', 'torch._dynamo', 'lit_dp.data_parallel')\n"
        "    print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.stderr.strip() == message, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    assert not (tmp_path / "outputs").exists()


def test_a_refusal_of_what_only_the_task_checks_is_one_line_too(tmp_path):
    # Refused in `train`, after Lightning loads and before any rank starts: no seed line, no traceback.
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "digits.py"), "model.num_classes=5",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1
    assert (done.stdout + done.stderr).strip() == (
        "error: model.num_classes=5 is invalid with data=digits: expected 10 (the digits are 64 pixels in 10 classes)."
    ), done.stdout + done.stderr


def test_a_searchpath_of_the_users_leaves_its_groups_to_hydra(tmp_path):
    # docs/configs.md's `hydra.searchpath=[file://my_conf] experiment=mine`: the choice is in the user's folder.
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nseed: 3\n")
    assert command_line_mistakes("gpt", [f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"]) == []
    assert command_line_mistakes("gpt", ["experiment=mine"])  # without it, an unknown choice
