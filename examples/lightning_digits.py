"""Train the digits MLP of examples/pytorch_digits.py with Lightning 2 on aiak-training.

The Trainer gets ``strategy=AiakStrategy()``; the ranks come from the launcher:

    aiakrun -np 2 python examples/lightning_digits.py
    mpiexec -n 2 python examples/lightning_digits.py

Same split, model, optimizer, learning rate (scaled by the number of ranks) and per-rank
batch size as pytorch_digits.py; Lightning's distributed sampler shards the training set.
Needs ``pip install 'aiak-training[lightning,examples]'``.
"""
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ImportError:  # the pytorch-lightning distribution alone
    import pytorch_lightning as pl

import aiak_training.torch as hvd
import digits_data  # beside this file: the options, data split and report of all examples
from aiak_training.lightning import AiakStrategy


class DigitsModel(pl.LightningModule):
    """The MLP of pytorch_digits.py, with SGD and momentum."""

    def __init__(self, lr: float, momentum: float):
        super().__init__()
        self.lr, self.momentum = lr, momentum
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def on_train_epoch_start(self):
        self.loss_sum = torch.zeros(2)  # (sum of losses, batches) on this rank
        self.started = time.monotonic()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.loss_sum += torch.stack([loss.detach(), torch.tensor(1.0)])
        return loss

    def on_train_epoch_end(self):
        # One reduction per epoch (self.log on every step costs more than this model's step).
        total = self.trainer.strategy.reduce(self.loss_sum, reduce_op="sum")
        if self.trainer.is_global_zero:  # one line per epoch, like the other digits examples
            epoch, epochs = self.current_epoch + 1, self.trainer.max_epochs
            print(f"epoch {epoch:3d}/{epochs} [{'#' * int(30 * epoch / epochs):<30}] "
                  f"loss {total[0] / total[1]:.4f}  {time.monotonic() - self.started:.2f}s",
                  flush=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        correct = (self(x).argmax(1) == y).sum()
        # Summed over every batch of every rank: the whole test set's count.
        self.log("test_correct", correct.float(), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def main():
    p = digits_data.parser(__doc__)
    p.add_argument("--overlap-update", action="store_true",
                   help="overlap the optimizer update with the gradients' allreduce")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # several ranks share this machine's cores
    strategy = AiakStrategy(overlap_update=args.overlap_update or None)

    x_train, x_test, y_train, y_test = (torch.from_numpy(a) for a in digits_data.split(args.seed))
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size,
                       shuffle=True, drop_last=True)
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=256)
    model = DigitsModel(args.lr * strategy.world_size, args.momentum)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1,
                         max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    if trainer.is_global_zero:
        print(f"training on {trainer.world_size} rank(s) with Lightning {pl.__version__}, "
              f"{args.epochs} epochs", flush=True)
    trainer.fit(model, train)
    trainer.test(model, test, verbose=False)

    # Every rank evaluates the whole test set too: equal counts mean equal weights.
    model.eval()
    with torch.no_grad():
        correct = int((model(x_test).argmax(1) == y_test).sum())
    if len(y_test) % trainer.world_size == 0:  # else the sampler repeats a few samples
        assert int(trainer.callback_metrics["test_correct"]) == correct, "sharded count differs"
    digits_data.report(hvd.allgather_object(correct), len(y_test), hvd.rank())


if __name__ == "__main__":
    main()
