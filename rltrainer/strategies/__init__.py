"""Training strategies: the interface, and ``"single"`` (one device, in-process)."""

from rltrainer.strategies.single import SingleDeviceStrategy
from rltrainer.strategies.strategy import STRATEGIES, Strategy, build_strategy

STRATEGIES.register_preset("auto", "single", description="alias of 'single' (one device, in-process)")
STRATEGIES.register_preset("cpu", "single", description="'single' on the CPU", device="cpu")

__all__ = ["STRATEGIES", "SingleDeviceStrategy", "Strategy", "build_strategy"]
