from rltrainer.callbacks.callback import Callback
from rltrainer.callbacks.checkpoint import ModelCheckpoint
from rltrainer.callbacks.learning_signal import LearningSignal
from rltrainer.callbacks.progress import ProgressBar

__all__ = ["Callback", "LearningSignal", "ModelCheckpoint", "ProgressBar"]
