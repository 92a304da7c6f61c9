"""Training strategies: the interface, ``"single"`` (one device, in-process), ``"fsdp2"`` and
``"megatron"``."""

from rltrainer.strategies.fsdp2 import FSDP2Strategy
from rltrainer.strategies.megatron import MegatronStrategy
from rltrainer.strategies.single import SingleDeviceStrategy
from rltrainer.strategies.strategy import STRATEGIES, Strategy, build_strategy

STRATEGIES.register_preset("auto", "single", description="alias of 'single' (one device, in-process)")
STRATEGIES.register_preset("cpu", "single", description="'single' on the CPU", device="cpu")

__all__ = ["STRATEGIES", "FSDP2Strategy", "MegatronStrategy", "SingleDeviceStrategy", "Strategy", "build_strategy"]
