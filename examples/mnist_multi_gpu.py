"""DL4J's multi-GPU MNIST tutorial ("Using Multiple GPUs"), translated to parallelwrapper.

The tutorial trains a LeNet on MNIST with two workers that each take 3 local steps, then average.
Line by line:

    DL4J                                                parallelwrapper
    new MnistDataSetIterator(128, true, 12345)          load_mnist(dir, "train").batches(128, shuffle=True, seed=12345)
    new MnistDataSetIterator(128, false, 12345)         load_mnist(dir, "test").batches(128)
    NeuralNetConfiguration.Builder().seed(123)          torch.manual_seed(123)
      .weightInit(XAVIER) ... conv/pool/dense/output    LeNet()  (parallelwrapper/app/models.py: the same layers)
      .updater(Updater.NESTEROVS)                       .optimizer(torch.optim.SGD, lr=0.04, momentum=0.9, nesterov=True)
      LossFunction.NEGATIVELOGLIKELIHOOD + SOFTMAX      .loss_fn(F.cross_entropy)  (LeNet returns logits)
    new ParallelWrapper.Builder(model)                  ParallelWrapper.builder(model)
      .prefetchBuffer(24)                                 .prefetch_buffer(24)
      .workers(2)                                         .workers(2)
      .averagingFrequency(3)                              .averaging_frequency(3)
      .reportScoreAfterAveraging(true)                    .report_score_after_averaging(True)
    model.setListeners(new ScoreIterationListener(10))    .listeners(ScoreLogger(10))
    wrapper.fit(mnistTrain)                             wrapper.fit(train)
    model.evaluate(mnistTest)                           wrapper.evaluate(test)

Workers are spawned processes, so the script's entry point is guarded by `if __name__ == "__main__"`.

    python examples/mnist_multi_gpu.py --data-dir ../shared/data/mnist          # one epoch, ~98.4%
    python examples/mnist_multi_gpu.py --data-dir ../shared/data/mnist --tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from parallelwrapper import ParallelWrapper, ScoreLogger
from parallelwrapper.app.mnist import load_mnist
from parallelwrapper.app.models import LeNet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="MNIST IDX files (default: the cache dir, downloading)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="1,024 training and 1,000 test images: a smoke run")
    args = parser.parse_args()

    # Data: DL4J's iterators, batch 128, shuffled with seed 12345.
    batch_size = 128
    train_split = load_mnist(args.data_dir, "train")
    test_split = load_mnist(args.data_dir, "test")
    train = train_split.batches(batch_size, shuffle=True, seed=12345)
    test = test_split.batches(batch_size)
    if args.tiny:
        train, test = train[:8], test[:8]

    # Model: the tutorial's LeNet, initialised from seed 123.
    torch.manual_seed(123)
    model = LeNet()

    # The wrapper, as the tutorial builds it.
    wrapper = (
        ParallelWrapper.builder(model)
        .optimizer(torch.optim.SGD, lr=0.04, momentum=0.9, nesterov=True)
        .loss_fn(F.cross_entropy)
        .prefetch_buffer(24)
        .workers(2)
        .averaging_frequency(3)
        .report_score_after_averaging(True)
        .listeners(ScoreLogger(10))
        .seed(123)
        .build()
    )

    start = time.perf_counter()
    with wrapper:
        for epoch in range(args.epochs):
            wrapper.fit(train)
            result = wrapper.evaluate(test)
            print(f"epoch {epoch}: test accuracy {result['accuracy']:.4f}, test loss {result['loss']:.4f}")
    seconds = time.perf_counter() - start
    print(f"{wrapper.samples} samples in {seconds:.1f} s ({wrapper.samples / seconds:.0f} samples/s), "
          f"{wrapper.rounds} averagings; final test accuracy {result['accuracy']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
