"""What both strategies share: the registered families, the default backend, the job as init_parallel_env reads it."""

from __future__ import annotations

import os
from unittest import mock

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry

from lit_dp import PaddleDPStrategy
from lit_dp.strategies.base import default_backend, lightning_parallel_env, register_families
from tests.helpers.lightning import REGISTERED


def test_the_families_register_with_their_start_methods_and_unused_flags():
    registry = _StrategyRegistry()
    register_families(registry, PaddleDPStrategy)
    assert set(registry.available_strategies()) == set(REGISTERED)
    for name, (start_method, find_unused) in REGISTERED.items():
        init = registry[name]["init_params"]
        assert init["start_method"] == start_method
        assert init.get("find_unused_parameters", False) is find_unused


def test_auto_is_nccl_for_cuda_devices_and_gloo_otherwise():
    assert default_backend(torch.device("cuda", 1)) == "nccl"
    assert default_backend(torch.device("cpu")) == "gloo"


def test_the_job_comes_from_lightnings_environment_and_paddle_flags_still_apply():
    environ = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29512", "FLAGS_nccl_nrings": "2", "PADDLE_PG_TIMEOUT": "9000"}
    with mock.patch.dict(os.environ, environ, clear=True):
        env = lightning_parallel_env(LightningEnvironment(), 3, 4, torch.device("cuda", 1), nrings=None)
        assert (env.rank, env.world_size, env.device_id) == (3, 4, 1)
        assert (env.master_addr, env.master_port, env.nrings, env.pg_timeout) == ("10.1.2.3", 29512, 2, 9000)
        assert lightning_parallel_env(LightningEnvironment(), 0, 4, torch.device("cpu"), nrings=3).nrings == 3
