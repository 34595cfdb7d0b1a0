"""parallelwrapper: data-parallel training in PyTorch by periodic model averaging.

    wrapper = ParallelWrapper.builder(model).workers(2).averaging_frequency(3).build()
    with wrapper:
        history = wrapper.fit(batches, epochs=1)
"""

from .config import Config, NanPolicy, TrainingMode
from .inference import InferenceError, InferenceMode, ParallelInference
from .listeners import CsvWriter, EarlyStopping, EpochEnd, History, JsonlWriter, ProgressBar, Score, ScoreLogger, Validation
from .tensorboard_logger import TensorBoardLogger
from .types import TrainingError, WorkerError
from .wrapper import Builder, ParallelWrapper

__all__ = [
    "Builder",
    "Config",
    "CsvWriter",
    "EarlyStopping",
    "EpochEnd",
    "History",
    "InferenceError",
    "InferenceMode",
    "JsonlWriter",
    "NanPolicy",
    "ParallelInference",
    "ParallelWrapper",
    "ProgressBar",
    "Score",
    "ScoreLogger",
    "TensorBoardLogger",
    "TrainingError",
    "TrainingMode",
    "Validation",
    "WorkerError",
]
__version__ = "0.1.0"
