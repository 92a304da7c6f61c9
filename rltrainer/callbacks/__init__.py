from rltrainer.callbacks.callback import Callback
from rltrainer.callbacks.checkpoint import ModelCheckpoint
from rltrainer.callbacks.progress import ProgressBar

__all__ = ["Callback", "ModelCheckpoint", "ProgressBar"]
