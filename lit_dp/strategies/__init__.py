"""The Lightning layer: the Trainer's and Fabric's strategies, and what they share."""

# Lightning before any module of this package: importing it loads the strategy modules
# (lit_dp/__init__.py's post-import hook), which import their siblings; had a sibling started
# the import, they would meet it half-initialised (`import lit_dp.strategies.monitor` failed so).
import lightning  # noqa: F401
