"""The one seam of features (feature.Feature, built by features.of): what each feature answers, and
Plain's answers when none is on. Fast tier: builds the objects, starts no process."""

from __future__ import annotations

import pickle
from typing import cast

import pytest

from parallelwrapper import features
from parallelwrapper.config import Config, Pipeline
from parallelwrapper.feature import Plain
from parallelwrapper.job import Job
from parallelwrapper.types import TrainingState

pytestmark = pytest.mark.fast


def test_with_no_feature_plain_answers() -> None:
    plain = features.of(Config())
    assert isinstance(plain, Plain)
    assert (plain.processes, plain.alone, plain.redoes, plain.notes(False), plain.notes(True), plain.fingerprint()) == (1, True, False, (), (), {})
    state = TrainingState({}, {}, None, None)
    assert plain.joined([state], cast(Job, None)) is state  # a worker is its one process


def test_a_pipeline_is_its_stages_processes_whose_states_split_by_process() -> None:
    stages = features.of(Config(workers=2, pipeline=Pipeline(3)))
    assert (stages.processes, stages.alone, stages.redoes, stages.fingerprint()) == (3, False, False, {"stages": 3})


def test_a_hierarchy_over_replacement_answers_for_both() -> None:
    """The config lets the two go together, each acting under a host of its own: each says so."""
    both = features.of(Config(workers=1, hierarchy="node", on_worker_failure="replace"))
    assert (both.processes, both.alone, both.redoes, both.fingerprint()) == (1, False, True, {})
    spawned, torchrun = both.notes(False), both.notes(True)
    assert [n.split(" ")[0] for n in spawned] == ["hierarchy('node')", 'on_worker_failure("replace")']
    assert len(torchrun) == 1 and torchrun[0].startswith('under torchrun, on_worker_failure("replace") is ignored')
    assert features.of(Config(workers=2, on_worker_failure="replace")).notes(False) == ()


@pytest.mark.parametrize("options", [{}, {"pipeline": Pipeline(2)}, {"hierarchy": "node", "on_worker_failure": "replace"}])
def test_a_feature_goes_to_a_spawned_worker_by_pickle(options: dict[str, object]) -> None:
    """WorkerPool hands it to each worker's process with its arguments."""
    feature = features.of(Config(workers=2, **options))  # type: ignore[arg-type]
    again = pickle.loads(pickle.dumps(feature))
    assert (again.processes, again.alone, again.redoes, again.fingerprint()) == (feature.processes, feature.alone, feature.redoes, feature.fingerprint())
