"""Scripts the advisor must stop with a reason: ``noopt`` never builds a DistributedOptimizer,
``short`` steps twice and ends, ``slow`` never reaches its second step."""
import sys
import time

import torch

import aiak_training.torch as hvd

mode = sys.argv[1]
hvd.init()
model = torch.nn.Linear(8, 2)
if mode == "noopt":
    print("trained nothing", flush=True)
    raise SystemExit(0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
for step in range(2 if mode == "short" else 1000):
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    if mode == "slow":
        time.sleep(3600)
