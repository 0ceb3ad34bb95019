"""Which launcher started a process and the job it describes: one rule for init_parallel_env and the strategies."""

from __future__ import annotations

import importlib.util
import os
from unittest import mock

import lightning.pytorch as pl
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment

from lit_dp import PaddleDPStrategy
from lit_dp.job.launcher import PADDLE, SLURM, TORCH_ENV, TORCHRUN, detect_launch, detect_launcher

PADDLE_JOB = {"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6170"}
# Worker 3 of 8: the second process on the second of four nodes.
TORCHRUN_JOB = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job",
}
# Task 3 of 4, two per node; no MASTER_ADDR/MASTER_PORT: Lightning derives them.
SLURM_JOB = {
    "SLURM_JOB_ID": "1234567",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NODELIST": "node[3-4]",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}
TORCH_ENV_JOB = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def environment(*jobs: dict[str, str], **variables: str):
    return mock.patch.dict(os.environ, {key: value for job in jobs for key, value in job.items()} | variables, clear=True)


def test_torchruns_variables_describe_the_job_and_the_node_layout():
    with environment(TORCHRUN_JOB):
        launch = detect_launch()
    env = launch.parallel_env
    assert launch.launcher == TORCHRUN
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (3, 8, 1, 2, 1)
    assert (env.master_addr, env.master_port, env.device_id) == ("10.0.0.1", 29500, 1)
    assert (launch.rank_source, launch.world_size_source, launch.device_source) == ("RANK=3", "WORLD_SIZE=8", "LOCAL_RANK=1")


def test_slurms_address_and_port_are_derived_as_lightnings_slurm_environment_derives_them():
    with environment(SLURM_JOB):
        launch = detect_launch()
        lightning = SLURMEnvironment()
        expected = (lightning.main_address, lightning.main_port)
    env = launch.parallel_env
    assert launch.launcher == SLURM
    assert (env.master_addr, env.master_port) == expected == ("node3", 15000 + 4567)  # first node, job id's last 4 digits
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (3, 4, 1, 1)
    assert (launch.rank_source, launch.world_size_source) == ("SLURM_PROCID=3", "SLURM_NTASKS=4")


@pytest.mark.parametrize(
    ("jobs", "variables", "expected"),
    [
        pytest.param([TORCHRUN_JOB, SLURM_JOB], {}, TORCHRUN, id="torchrun inside SLURM"),
        pytest.param([PADDLE_JOB, SLURM_JOB], {}, PADDLE, id="Paddle's launcher inside SLURM"),
        pytest.param([PADDLE_JOB], {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job"}, PADDLE, id="Paddle and torchrun agreeing"),
        pytest.param([SLURM_JOB], {"SLURM_JOB_NAME": "interactive"}, None, id="an interactive SLURM shell"),
        pytest.param([SLURM_JOB, TORCH_ENV_JOB], {"SLURM_JOB_NAME": "bash"}, TORCH_ENV, id="env:// in a SLURM shell"),
        pytest.param([TORCH_ENV_JOB], {}, TORCH_ENV, id="torch's env:// variables"),
        pytest.param([], {"PADDLE_TRAINERS_NUM": "2"}, None, id="Paddle's variables in part"),
        pytest.param([], {"OMPI_COMM_WORLD_SIZE": "1"}, None, id="an MPI world of one"),
        pytest.param([], {}, None, id="nothing"),
    ],
)
def test_the_first_launcher_of_the_rule_wins(jobs, variables, expected):
    with environment(*jobs, **variables):
        assert detect_launcher() == expected


def test_paddles_variables_in_part_keep_their_meaning():
    with environment(PADDLE_TRAINERS_NUM="2"):
        launch = detect_launch()
    assert (launch.parallel_env.rank, launch.parallel_env.world_size) == (0, 2)
    assert (launch.rank_source, launch.world_size_source) == (None, "PADDLE_TRAINERS_NUM=2")


def test_paddle_and_torch_variables_that_describe_different_jobs_are_refused():
    with environment(PADDLE_JOB, TORCHRUN_JOB), pytest.raises(ValueError) as error:
        detect_launcher()
    message = str(error.value)
    assert "PADDLE_TRAINER_ID=1 but RANK=3; PADDLE_TRAINERS_NUM=2 but WORLD_SIZE=8" in message
    assert "Unset the variables of the launcher that did not start this process" in message


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is not None, reason="checks the refusal without mpi4py")
@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"])
def test_an_mpi_launch_without_mpi4py_is_refused_not_read_as_one_rank(variable):
    with environment(**{variable: "4"}), pytest.raises(ValueError) as error:
        detect_launcher()
    assert f"an MPI launcher started this process ({variable}=4), but mpi4py is not installed" in str(error.value)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"RANK": "three"}, "RANK='three' is invalid: expected an integer >= 0."),
        ({"RANK": "8"}, "RANK='8' is invalid: expected a value in [0, 8) because WORLD_SIZE=8."),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is invalid: expected an integer >= 1."),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK='2' is invalid: expected a value in [0, 2) because LOCAL_WORLD_SIZE=2."),
        ({"LOCAL_RANK": ""}, "torchrun (TORCHELASTIC_RUN_ID=job) describes the job, but LOCAL_RANK is not set"),
        ({"MASTER_PORT": ""}, "torchrun (TORCHELASTIC_RUN_ID=job) describes world size 8, but MASTER_PORT is not set"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT='0' is invalid: expected a port number in [1, 65535]."),
    ],
)
def test_a_malformed_torchrun_variable_is_named(variables, expected):
    with environment(TORCHRUN_JOB, **variables), pytest.raises(ValueError) as error:
        detect_launch()
    assert expected in str(error.value)


def test_torch_env_variables_need_a_rank_and_a_rendezvous_address_like_init_process_group():
    with environment(WORLD_SIZE="2"), pytest.raises(ValueError, match=r"torch's env:// rendezvous \(WORLD_SIZE=2\) describes the job, but RANK is not set"):
        detect_launch()
    with environment(RANK="1", WORLD_SIZE="2"), pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT is not set"):
        detect_launch()
    with environment(TORCH_ENV_JOB):
        env = detect_launch().parallel_env
    assert (env.rank, env.world_size, env.local_rank, env.device_id) == (1, 2, 0, 0)  # one process per node by default


def test_a_malformed_slurm_variable_is_named():
    with environment(SLURM_JOB, SLURM_PROCID="third"), pytest.raises(ValueError) as error:
        detect_launch()
    assert "SLURM started this process, but Lightning's SLURMEnvironment could not read the job" in str(error.value)
    assert "SLURM_PROCID" in str(error.value)
    with environment(SLURM_JOB, SLURM_PROCID="4"), pytest.raises(ValueError, match=r"SLURM_PROCID='4' is invalid: expected a value in \[0, 4\) because SLURM_NTASKS=4"):
        detect_launch()


def test_paddles_own_settings_apply_under_any_launcher():
    settings = {"FLAGS_nccl_nrings": "2", "PADDLE_PG_TIMEOUT": "9000", "PADDLE_DISTRI_BACKEND": "gloo"}
    with environment(TORCHRUN_JOB, **settings):
        env = detect_launch().parallel_env
    assert (env.nrings, env.pg_timeout, env.backend) == (2, 9000, "gloo")


# Lightning's environment for each launcher of the rule; without one, its own launcher's.
LIGHTNING_ENVIRONMENT = {
    PADDLE: "PaddleEnvironment",
    TORCHRUN: "TorchElasticEnvironment",
    SLURM: "SLURMEnvironment",
    TORCH_ENV: "LightningEnvironment",
    None: "LightningEnvironment",
}


@pytest.mark.parametrize(
    ("jobs", "devices", "num_nodes"),
    [
        pytest.param([TORCHRUN_JOB, SLURM_JOB], 2, 4, id="torchrun inside SLURM"),
        pytest.param([PADDLE_JOB, SLURM_JOB], 2, 1, id="Paddle's launcher inside SLURM"),
        pytest.param([SLURM_JOB], 2, 2, id="SLURM"),
        pytest.param([], 1, 1, id="no launcher"),
    ],
)
def test_the_trainer_follows_the_same_launcher_with_the_same_ranks(jobs, devices, num_nodes):
    with environment(*jobs):
        launcher = detect_launcher()
        trainer = pl.Trainer(strategy=PaddleDPStrategy(), accelerator="cpu", devices=devices, num_nodes=num_nodes, logger=False)
        cluster_environment = trainer.strategy.cluster_environment
        assert type(cluster_environment).__name__ == LIGHTNING_ENVIRONMENT[launcher]
        if launcher is not None:
            env = detect_launch().parallel_env
            assert (cluster_environment.global_rank(), cluster_environment.world_size()) == (env.rank, env.world_size)
