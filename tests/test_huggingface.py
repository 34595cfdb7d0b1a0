"""A Hugging Face-style fine-tune ports without a hand-written step (issue 50): BatchEncoding
batches, a model that returns its own loss, gradient accumulation equal to a plain loop's.
The whole recipe, with two spawned workers and a resume in a new process, is
docs/guides/huggingface.md, which tests/test_readme.py runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelwrapper import ParallelWrapper

pytestmark = pytest.mark.fast
transformers = pytest.importorskip("transformers")  # the `hf` extra: .ci/run installs it


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def encodings(n: int, seed: int) -> list[object]:
    """Padded batches as DataCollatorWithPadding makes them: BatchEncoding, a Mapping that is not a dict."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(4, 20, (8, 6), generator=g)
        mask = torch.ones_like(ids)
        mask[:4, 4:] = 0  # padded
        labels = (ids == 5).any(dim=1).long()
        batches.append(transformers.BatchEncoding({"input_ids": ids * mask, "attention_mask": mask, "labels": labels}))
    return batches


def test_batch_encodings_train_validate_and_evaluate_on_the_models_own_loss() -> None:
    train, val = encodings(12, seed=0), encodings(3, seed=1)
    wrapper = (
        ParallelWrapper.builder(tiny_bert()).workers(1).optimizer(torch.optim.AdamW, lr=3e-3).loss_from_output()
        .validation(val, every=None).build()
    )  # fmt: skip
    before = wrapper.evaluate(val)
    history = wrapper.fit(train, epochs=2)
    after = wrapper.evaluate(val)
    assert set(before) == {"loss", "accuracy", "samples"} and before["samples"] == 24
    assert after["loss"] < before["loss"]
    assert [sorted(v.metrics) for v in history.validations] == [["val_accuracy", "val_loss"]] * 2
    assert history.validations[-1].metrics["val_loss"] == pytest.approx(after["loss"], rel=1e-5)
    own = wrapper.evaluate(val, step=lambda model, batch: {"logit_mean": model(**batch).logits.mean()})
    assert set(own) == {"logit_mean", "samples"}


def test_a_mapping_batch_without_loss_from_output_names_its_type_and_the_options() -> None:
    wrapper = ParallelWrapper.builder(tiny_bert()).workers(1).build()
    with pytest.raises(ValueError, match=r"^the default metrics score \(inputs, targets\) batches, got a BatchEncoding \{input_ids: int64\[8, 6\].*"
                                         r"\.loss_from_output\(\).*evaluate\(data, step=fn\)"):
        wrapper.evaluate(encodings(1, seed=0))
    with pytest.raises(Exception, match=r"got a BatchEncoding .*use \.loss_from_output\(\)"):
        wrapper.fit(encodings(2, seed=0))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def test_accumulation_equals_a_plain_loops_and_its_schedule_steps_once_a_step() -> None:
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(10, 6, generator=g), torch.randint(0, 3, (10,), generator=g)) for _ in range(6)]
    n, steps = 2, len(batches)

    model = mlp()  # the plain loop: each batch of 10 as 2 micro-batches of 5, loss / 2 each
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps)
    rates = []
    for x, y in batches:
        for xm, ym in zip(x.chunk(n), y.chunk(n)):
            (nn.functional.cross_entropy(model(xm), ym) / n).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])

    wrapper = (
        ParallelWrapper.builder(mlp()).workers(1).accumulate(n).gradient_clipping(0.5).optimizer(torch.optim.AdamW, lr=0.01)
        .lr_scheduler(torch.optim.lr_scheduler.LinearLR, interval="step", start_factor=1.0, end_factor=0.1, total_iters=steps).build()
    )  # fmt: skip
    wrapper.fit(batches)
    for a, b in zip(model.parameters(), wrapper.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert wrapper.lr_scheduler.last_epoch == steps and wrapper.lr_scheduler.get_last_lr()[0] == pytest.approx(rates[-1])


def test_accumulate_is_refused_with_a_pipeline_naming_its_own_microbatches() -> None:
    with pytest.raises(ValueError, match=r"accumulate\(2\): a pipeline cuts each batch into micro-batches itself; use \.pipeline\(stages=2, microbatches=2\)"):
        ParallelWrapper.builder(mlp()).pipeline(stages=2).accumulate(2).build()
