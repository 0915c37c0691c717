"""Per-rank: 20 Adam steps of a small MLP with the dense DistributedOptimizer and with
shard_optimizer_state=True, from the same start and batches; prints whether the parameters
are bit-identical and their largest difference (rank 0)."""
import torch

import aiak_training.torch as hvd


def train(shard: bool) -> torch.Tensor:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-2),
                                   named_parameters=net.named_parameters(),
                                   shard_optimizer_state=shard)
    data = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(20):
        x, y = torch.randn(16, 64, generator=data), torch.randint(0, 10, (16,), generator=data)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def main() -> None:
    hvd.init()
    dense, sharded = train(False), train(True)
    if hvd.rank() == 0:
        print(f"bit-identical {torch.equal(dense, sharded)} max difference "
              f"{(dense - sharded).abs().max().item():.3e}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
