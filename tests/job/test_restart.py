import pytest

from lit_dp.job.restart import JobAttempt, Restart


def test_outside_a_launcher_there_is_no_job_id_and_no_restart():
    attempt = JobAttempt.from_environ({})
    assert attempt == JobAttempt(None, (), None)
    assert not attempt.is_restart and not attempt.is_last
    assert attempt.key == "attempt_0" and attempt.describe() == "first attempt"


def test_torchrun_restart_with_its_agent_store():
    attempt = JobAttempt.from_environ(
        {
            "TORCHELASTIC_RUN_ID": "a1b2",
            "TORCHELASTIC_RESTART_COUNT": "1",
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert attempt.job_id == "torchrun-a1b2"
    assert attempt.restarts == (Restart("torchrun", 1, 3),)
    assert attempt.is_restart and not attempt.is_last
    assert attempt.key == "torchrun_1" and attempt.describe() == "restart 1 of 3"
    assert attempt.agent_store == ("127.0.0.1", 29500)


def test_last_torchrun_attempt():
    environ = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "2"}
    assert JobAttempt.from_environ(environ).is_last
    assert JobAttempt.from_environ({**environ, "TORCHELASTIC_USE_AGENT_STORE": "False"}).agent_store is None


def test_torchrun_inside_slurm_keeps_the_slurm_job_id_and_counts_both():
    attempt = JobAttempt.from_environ(
        {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}
    )
    assert attempt.job_id == "slurm-4242"
    assert attempt.key == "slurm_2/torchrun_0"
    assert attempt.describe() == "SLURM requeue 2, restart 0"
    assert attempt.is_restart


def test_slurm_before_any_requeue_and_paddle_job_id():
    assert JobAttempt.from_environ({"SLURM_JOB_ID": "7"}).restarts == (Restart("slurm", 0, None),)
    assert JobAttempt.from_environ({"PADDLE_JOB_ID": "resnet"}).job_id == "paddle-resnet"
    # "default" is the id Paddle's launcher gives every job that names none: not this job's own.
    assert JobAttempt.from_environ({"PADDLE_JOB_ID": "default"}).job_id is None
    # Likewise "none", torchrun's run id without --standalone or --rdzv-id; its restarts still count.
    static = JobAttempt.from_environ({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert static.job_id is None and static.is_restart


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("TORCHELASTIC_RESTART_COUNT", "-1", "a restart count"),
        ("SLURM_RESTART_COUNT", "two", "a restart count"),
        ("TORCHELASTIC_RUN_ID", "../etc", "a job id of letters"),
        ("SLURM_JOB_ID", "12 34", "a job id of letters"),
    ],
)
def test_malformed_variable_is_named(variable, value, expected):
    environ = {"TORCHELASTIC_RUN_ID": "r", "SLURM_JOB_ID": "1", variable: value}
    with pytest.raises(ValueError, match=rf"{variable}={value!r} is invalid: expected {expected}"):
        JobAttempt.from_environ(environ)


def test_restart_count_above_the_limit_is_refused():
    environ = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "4", "TORCHELASTIC_MAX_RESTARTS": "3"}
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='4' is invalid: expected at most TORCHELASTIC_MAX_RESTARTS=3"):
        JobAttempt.from_environ(environ)
