"""The recipes' command line: a misspelled strategy option is answered with the options spelled alike."""

from __future__ import annotations

import pytest

from lit_dp_recipes.cli import unknown_strategy_keys


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["strategy.comm_bufer_size=5"],
         "strategy.comm_bufer_size is not an option of strategy=paddle_dp: did you mean strategy.comm_buffer_size"),
        (["strategy=ddp", "strategy.find_unused=true"],
         "strategy.find_unused is not an option of strategy=ddp: did you mean strategy.find_unused_parameters?"),
        # In a sweep each strategy is checked: ddp has no comm_hook, paddle_dp has it spelled otherwise.
        (["-m", "strategy=paddle_dp,ddp", "strategy.comm_hok=bf16"],
         "strategy.comm_hok is not an option of strategy=paddle_dp: did you mean strategy.comm_hook? "
         "(docs/options.md lists them all)\n"
         "strategy.comm_hok is not an option of strategy=ddp: its options: backend, comm_buffer_size,"),
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
        ["strategy.comm_buffer_size=1,5", "-m"],
    ],
)
def test_options_the_strategy_has_pass(arguments):
    assert unknown_strategy_keys("digits", arguments) is None
