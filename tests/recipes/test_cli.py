"""The recipes' command line: a misspelled strategy option is answered with the options spelled alike."""

from __future__ import annotations

import pytest

from lit_dp_recipes.cli import unknown_strategy_keys
from lit_dp_recipes.config import register_configs


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
    ],
)
def test_a_misspelled_strategy_option_gets_the_close_matches(arguments, message):
    assert message in unknown_strategy_keys("digits", arguments)


@pytest.mark.parametrize(
    "arguments",
    [
        [],
        ["strategy.comm_buffer_size=5", "trainer.devices=3"],
        ["+strategy.anything=1"],  # an addition is the user's business: the strategy refuses it by name
        ["strategy=ddp", "strategy.comm_buffer_size=5"],
        ["strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd.start_iter=2"],
        ["strategy.comm_buffer_size=1,5", "-m"],
    ],
)
def test_options_the_strategy_has_pass(arguments):
    assert unknown_strategy_keys("digits", arguments) is None
