import pytest
import torch.distributed as dist

from lit_dp import ParallelEnv

TWO = {"PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.1:6171"}


def test_defaults_describe_a_single_process():
    env = ParallelEnv({})
    assert (env.rank, env.world_size, env.nranks) == (0, 1, 1)
    assert (env.device_type, env.device_id, env.dev_id) == ("", 0, 0)
    assert env.current_endpoint == "" and env.trainer_endpoints == []
    assert (env.nrings, env.pg_timeout, env.backend) == (1, 1_800_000, "auto")
    assert (env.master_addr, env.master_port) == (None, None)
    assert (env.local_rank, env.local_world_size, env.node_rank) == (0, 1, 0)


def test_full_paddle_launcher_environment():
    env = ParallelEnv(
        {
            "PADDLE_TRAINER_ID": "3",
            "PADDLE_TRAINERS_NUM": "4",
            "PADDLE_TRAINER_ENDPOINTS": " 10.0.0.1:6170 , 10.0.0.1:6171,10.0.0.2:6170, 10.0.0.2:6171 ",
            "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6171",
            "FLAGS_selected_gpus": "1",
            "FLAGS_nccl_nrings": "2",
            "PADDLE_PG_TIMEOUT": "60000",
            "PADDLE_DISTRI_BACKEND": "NCCL" if dist.is_nccl_available() else "GLOO",
        }
    )
    assert (env.rank, env.world_size, env.device_id, env.nrings, env.pg_timeout) == (3, 4, 1, 2, 60000)
    assert env.trainer_endpoints == ["10.0.0.1:6170", "10.0.0.1:6171", "10.0.0.2:6170", "10.0.0.2:6171"]
    assert env.current_endpoint == "10.0.0.2:6171"
    assert env.backend == ("nccl" if dist.is_nccl_available() else "gloo")
    # Paddle's rendezvous falls back to the first trainer endpoint.
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 6170)
    # Second endpoint of the second host: node 1, local rank 1 of 2.
    assert (env.local_rank, env.local_world_size, env.node_rank) == (1, 2, 1)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29500", "PADDLE_MASTER": "10.8.8.8:1"}, ("10.9.9.9", 29500)),
        ({"PADDLE_MASTER": "10.8.8.8:1234"}, ("10.8.8.8", 1234)),
        ({"PADDLE_MASTER": "[fe80::1]:1234"}, ("fe80::1", 1234)),
        ({}, ("10.0.0.1", 6170)),
    ],
)
def test_master_address_follows_paddles_order(extra, expected):
    env = ParallelEnv({**TWO, **extra})
    assert (env.master_addr, env.master_port) == expected


def test_ipv6_endpoints_in_brackets():
    env = ParallelEnv(
        {"PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "1", "PADDLE_TRAINER_ENDPOINTS": "[::1]:6170,[::1]:6171"}
    )
    assert env.current_endpoint == "[::1]:6171"
    assert (env.master_addr, env.master_port, env.local_rank) == ("::1", 6170, 1)


def test_custom_device_reads_its_own_selection_flag():
    env = ParallelEnv({"PADDLE_XCCL_BACKEND": "npu", "FLAGS_selected_npus": "3,4", "FLAGS_selected_gpus": "1"})
    assert (env.device_type, env.device_id) == ("npu", 3)


def test_launcher_node_local_rank_wins_over_derivation():
    env = ParallelEnv({**TWO, "PADDLE_TRAINER_ID": "1", "PADDLE_RANK_IN_NODE": "0", "PADDLE_LOCAL_SIZE": "1"})
    assert (env.local_rank, env.local_world_size) == (0, 1)


def test_is_immutable_and_endpoints_are_a_copy():
    env = ParallelEnv(TWO)
    with pytest.raises(AttributeError, match="immutable"):
        env.rank = 1
    env.trainer_endpoints.append("x:1")
    assert len(env.trainer_endpoints) == 2


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "5")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "4")
    assert ParallelEnv().rank == 4


BAD = [
    ({"PADDLE_TRAINER_ID": "one"}, "PADDLE_TRAINER_ID='one'.*integer"),
    ({"PADDLE_TRAINER_ID": "-1", "PADDLE_TRAINERS_NUM": "2"}, "PADDLE_TRAINER_ID='-1'.*>= 0"),
    ({"PADDLE_TRAINER_ID": "2", "PADDLE_TRAINERS_NUM": "2"}, r"PADDLE_TRAINER_ID=2.*\[0, 2\).*PADDLE_TRAINERS_NUM=2"),
    ({"PADDLE_TRAINERS_NUM": "0"}, "PADDLE_TRAINERS_NUM='0'.*>= 1"),
    ({"PADDLE_TRAINERS_NUM": "2.5"}, "PADDLE_TRAINERS_NUM='2.5'.*integer"),
    ({"FLAGS_nccl_nrings": "9"}, r"FLAGS_nccl_nrings='9'.*\[1, 8\]"),
    ({"FLAGS_nccl_nrings": "0"}, r"FLAGS_nccl_nrings='0'.*\[1, 8\]"),
    ({"PADDLE_PG_TIMEOUT": "-5"}, "PADDLE_PG_TIMEOUT='-5'.*>= 1"),
    ({"PADDLE_PG_TIMEOUT": "30s"}, "PADDLE_PG_TIMEOUT='30s'.*integer"),
    ({"FLAGS_selected_gpus": "a"}, "FLAGS_selected_gpus='a'.*device ids"),
    ({"FLAGS_selected_gpus": "0,-1"}, "FLAGS_selected_gpus='0,-1'.*device ids"),
    ({"PADDLE_XCCL_BACKEND": "n p u"}, "PADDLE_XCCL_BACKEND='n p u'.*device type"),
    ({"PADDLE_DISTRI_BACKEND": "nope"}, "PADDLE_DISTRI_BACKEND='nope' is invalid: expected 'auto', a backend"),
    ({"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1"}, "PADDLE_TRAINER_ENDPOINTS='10.0.0.1'.*host:port"),
    ({"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:0"}, r"PADDLE_TRAINER_ENDPOINTS='10.0.0.1:0'.*\[1, 65535\]"),
    ({"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:65536"}, r"PADDLE_TRAINER_ENDPOINTS='10.0.0.1:65536'.*\[1, 65535\]"),
    ({"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:x"}, "PADDLE_TRAINER_ENDPOINTS='10.0.0.1:x'.*port"),
    ({"PADDLE_TRAINER_ENDPOINTS": "::1:6170"}, "PADDLE_TRAINER_ENDPOINTS='::1:6170'.*brackets"),
    ({"PADDLE_TRAINER_ENDPOINTS": ":6170"}, "PADDLE_TRAINER_ENDPOINTS=':6170'.*host:port"),
    ({"PADDLE_TRAINER_ENDPOINTS": "a:1,,b:2", "PADDLE_TRAINERS_NUM": "2"}, "empty items"),
    ({"PADDLE_TRAINER_ENDPOINTS": "a:1,b:2", "PADDLE_TRAINERS_NUM": "3"}, "lists 2 endpoint.*PADDLE_TRAINERS_NUM=3"),
    ({"PADDLE_TRAINER_ENDPOINTS": "a:1, a:1", "PADDLE_TRAINERS_NUM": "2"}, "distinct endpoints.*a:1 repeats"),
    ({**TWO, "PADDLE_CURRENT_ENDPOINT": "10.0.0.3:6170"}, "PADDLE_CURRENT_ENDPOINT='10.0.0.3:6170' is not in"),
    ({**TWO, "PADDLE_CURRENT_ENDPOINT": "10.0.0.1:6171"}, "entry 1 of PADDLE_TRAINER_ENDPOINTS.*PADDLE_TRAINER_ID=0"),
    ({"PADDLE_CURRENT_ENDPOINT": "nohost"}, "PADDLE_CURRENT_ENDPOINT='nohost'"),
    ({"MASTER_ADDR": "10.0.0.1"}, "MASTER_ADDR='10.0.0.1' is set but MASTER_PORT is not"),
    ({"MASTER_PORT": "29500"}, "MASTER_PORT='29500' is set but MASTER_ADDR is not"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "99999"}, r"MASTER_PORT='99999'.*\[1, 65535\]"),
    ({"PADDLE_MASTER": "10.0.0.1"}, "PADDLE_MASTER='10.0.0.1'.*host:port"),
    ({**TWO, "PADDLE_RANK_IN_NODE": "2"}, r"PADDLE_RANK_IN_NODE=2.*\[0, 2\)"),
]


@pytest.mark.parametrize(("environ", "message"), BAD, ids=[next(iter(e)) + "=" + next(iter(e.values())) for e, _ in BAD])
def test_malformed_values_name_the_variable_value_and_expectation(environ, message):
    with pytest.raises(ValueError, match=message):
        ParallelEnv(environ)
