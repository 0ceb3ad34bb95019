"""``python -m lit_dp.forecast RUN_FOLDER``: what each setting would cost at scale, from the run's own measurements.

python -m lit_dp.forecast outputs/digits/<time>
python -m lit_dp.forecast outputs/gpt/<time> --ranks 8,64 --bandwidth 10Gbit,1Gbit --latency 20us
python -m lit_dp.forecast outputs/gpt/<time> --ranks 64 --bandwidth 400Gbit --ranks-per-node 8 --inter-node 100Gbit
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from lit_dp.forecast.model import predict
from lit_dp.forecast.report import table
from lit_dp.forecast.run import NoRunError, load_profiles, measure
from lit_dp.options.forecast import BANDWIDTH_EXAMPLES, LATENCY_EXAMPLES, parse_bandwidth, parse_latency

PROG = "python -m lit_dp.forecast"
DEFAULT_RANKS = (8,)


def _ranks(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(value < 2 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected numbers of ranks, each at least 2, e.g. 8,64")
    return values


def _sizes(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(value > 0 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected bucket sizes in MB, e.g. 5,10")
    return values


def _bandwidths(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",")]
    for value in values:
        _checked(parse_bandwidth)(value)
    return values


def _checked(parse):
    """``parse(name, text)``'s refusal as argparse words it: after ``argument --flag:``, the value and what is expected."""

    def check(text: str) -> str:
        try:
            parse("", text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: {str(error).split(' is invalid: ', 1)[1]}"
            ) from None
        return text

    return check


class _OneLineParser(argparse.ArgumentParser):
    """A mistake on the command line is one line, ``error: ...``, as the recipes answer theirs (docs/conventions.md)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description=__doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument(
        "run_folder", help="a run folder (outputs/<task>/<time>), a log folder or a lit_dp_profile.rank*.json"
    )
    parser.add_argument("--ranks", type=_ranks, help="numbers of ranks, e.g. 8,64 (default: the run's own and 8)")
    parser.add_argument(
        "--bandwidth",
        type=_bandwidths,
        help=f"links to forecast over, e.g. {BANDWIDTH_EXAMPLES} (default: the run's own, fitted)",
    )
    parser.add_argument(
        "--latency",
        type=_checked(parse_latency),
        help=f"per hop, e.g. {LATENCY_EXAMPLES} (default: the run's own, fitted)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        help="ranks sharing a node's link (with --inter-node): adds replica groups per node",
    )
    parser.add_argument(
        "--buckets", type=_sizes, default=[], help="bucket sizes (MB) to add a data-parallel row for, e.g. 5,10"
    )
    parser.add_argument(
        "--inter-node", type=_checked(parse_bandwidth), help="the bandwidth between nodes (with --ranks-per-node)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    if (arguments.ranks_per_node is None) != (arguments.inter_node is None):
        parser().error(
            "--ranks-per-node and --inter-node go together: ranks per node share a node's link, nodes meet over --inter-node"
        )
    try:
        measured = measure(load_profiles(arguments.run_folder))
    except NoRunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ranks = arguments.ranks or sorted({measured.ranks, *DEFAULT_RANKS})
    forecast = predict(
        measured,
        ranks=ranks,
        bandwidth=arguments.bandwidth,
        latency=arguments.latency,
        ranks_per_node=arguments.ranks_per_node,
        inter_node=arguments.inter_node,
        bucket_sizes=arguments.buckets,
    )
    try:
        print(table(forecast))
    except BrokenPipeError:  # `... | head`: the reader has what it wanted
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
