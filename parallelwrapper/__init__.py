"""parallelwrapper: data-parallel training in PyTorch by periodic model averaging.

    wrapper = ParallelWrapper.builder(model).workers(2).averaging_frequency(3).build()
    with wrapper:
        history = wrapper.fit(batches, epochs=1)
"""

from .autopilot import Autopilot
from .checkpoint import CheckpointError, checkpoint_counters
from .config import CONFLICTS, OPTIONS, PAYLOAD_DTYPES, PIPELINE_SCHEDULES, PRECISIONS, Config, GradientEncoding, NanPolicy, Pipeline, TrainingMode
from .errors import FleetEnded, TrainingError, WorkerError
from .inference import INFERENCE_OPTIONS, InferenceError, InferenceMode, ParallelInference
from .listeners import CsvWriter, EarlyStopping, History, JsonlWriter, ProgressBar, ScoreLogger, autopilot_changes, exchange_share
from .registry import declared
from .tensorboard_logger import TensorBoardLogger
from .traffic import RoundPayload, round_payload
from .types import EpochEnd, Score, Validation
from .wrapper import Builder, ParallelWrapper

__all__ = [
    "Autopilot",
    "Builder",
    "CONFLICTS",
    "CheckpointError",
    "Config",
    "CsvWriter",
    "EarlyStopping",
    "EpochEnd",
    "FleetEnded",
    "INFERENCE_OPTIONS",
    "GradientEncoding",
    "History",
    "InferenceError",
    "InferenceMode",
    "JsonlWriter",
    "NanPolicy",
    "OPTIONS",
    "PAYLOAD_DTYPES",
    "PIPELINE_SCHEDULES",
    "PRECISIONS",
    "ParallelInference",
    "ParallelWrapper",
    "Pipeline",
    "ProgressBar",
    "RoundPayload",
    "Score",
    "ScoreLogger",
    "TensorBoardLogger",
    "TrainingError",
    "TrainingMode",
    "Validation",
    "WorkerError",
    "autopilot_changes",
    "checkpoint_counters",
    "declared",
    "exchange_share",
    "round_payload",
]
__version__ = "0.1.0"
