"""PaddleEnvironment: Lightning's view of a job that Paddle's launcher started."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from lit_dp import PaddleEnvironment

TWO_NODES = {
    "PADDLE_TRAINER_ID": "3",
    "PADDLE_TRAINERS_NUM": "4",
    "PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171",
    "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6171",
}


def test_ranks_layout_and_rendezvous_come_from_the_launcher():
    environment = PaddleEnvironment(TWO_NODES)
    assert environment.creates_processes_externally
    assert (environment.global_rank(), environment.world_size()) == (3, 4)
    assert (environment.local_rank(), environment.node_rank()) == (1, 1)
    assert (environment.main_address, environment.main_port) == ("10.0.0.1", 6170)  # the first endpoint


def test_lightning_cannot_change_what_the_launcher_fixed():
    environment = PaddleEnvironment(TWO_NODES)
    environment.set_global_rank(0)
    environment.set_world_size(8)
    assert (environment.global_rank(), environment.world_size()) == (3, 4)


def test_detected_only_under_the_launcher():
    with mock.patch.dict(os.environ, {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2"}, clear=True):
        assert PaddleEnvironment.detect()
    with mock.patch.dict(os.environ, {"PADDLE_TRAINER_ID": "0"}, clear=True):
        assert not PaddleEnvironment.detect()


def test_a_device_count_that_contradicts_the_launcher_is_named():
    with pytest.raises(ValueError, match=r"`devices=3` and `num_nodes=2`.*\(6\) does not match PADDLE_TRAINERS_NUM=4"):
        PaddleEnvironment(TWO_NODES).validate_settings(num_devices=3, num_nodes=2)


def test_no_rendezvous_address_is_named():
    with pytest.raises(ValueError, match="no rendezvous address: expected MASTER_ADDR and MASTER_PORT"):
        PaddleEnvironment({"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2"}).main_address


def test_a_malformed_variable_is_named_when_first_read():
    environment = PaddleEnvironment({**TWO_NODES, "PADDLE_TRAINER_ID": "four"})  # parsed lazily, like Lightning's
    with pytest.raises(ValueError, match="PADDLE_TRAINER_ID='four' is invalid"):
        environment.global_rank()
