"""A small data-parallel MLP for the advisor's end-to-end tests (aiakrun --advise)."""
import torch

import aiak_training.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters())
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for _ in range(1000):  # far more than the advisor needs: it stops the script itself
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
raise SystemExit("the advisor did not stop the script")
