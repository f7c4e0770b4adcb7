"""A training script as users write them, top-level code and all, for the exit cases of
zs_faults.py: `python zs_exit_script.py CASE RANK WORLD STORE`.

It trains a model under FSDP and another with a ShardedOptimizer for a few steps, all-reduces
its logged metrics, and ends with both alive: after destroy_process_group() (CASE "exit"),
without it ("exit-no-destroy"), or without it and without zero_shard's exit guard
("exit-unguarded", a control run that shows the abort the guard prevents). It prints one JSON
line before its last step and nothing after, then leaves through the interpreter's normal exit.
A long switch interval keeps the main thread on the GIL until it blocks, which widens the
window in which a gloo worker thread still owes the release of a finished call when
finalization starts.
"""

import atexit
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from zs_faults import CALM_TIMEOUT_S, model_class

from zero_shard import FSDP, ShardedOptimizer

case, store = sys.argv[1], sys.argv[4]
rank, world = int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group(
    "gloo",
    init_method=f"file://{store}",
    rank=rank,
    world_size=world,
    timeout=datetime.timedelta(seconds=120),
)
net = model_class(torch)
torch.manual_seed(rank)
fsdp = FSDP(net(), timeout=CALM_TIMEOUT_S)
fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
plain = net()
opt = ShardedOptimizer(plain.parameters(), torch.optim.AdamW, lr=1e-2, timeout=CALM_TIMEOUT_S)


def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(fsdp(x), y)
    loss.backward()
    fsdp.finish_gradient_synchronization()
    fsdp_opt.step()
    fsdp_opt.zero_grad()
    plain_loss = torch.nn.functional.mse_loss(plain(x), y)
    plain_loss.backward()
    for p in plain.parameters():  # the script's own gradient averaging
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()
    return loss.detach()


for i in range(3):
    gen = torch.Generator().manual_seed(100 * i + rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
    step(x, y)
flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])  # (P,)
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
print(json.dumps({"rank": rank, "ranks_equal": all(torch.equal(g, flat) for g in gathered)}))
sys.stdout.flush()

sys.setswitchinterval(10.0)
loss = step(x, y)
metrics = [loss, *(torch.ones(1000) for _ in range(7))]  # logged, kept until exit
for metric in metrics:
    dist.all_reduce(metric)
if case == "exit-unguarded":
    atexit.unregister(time.sleep)
if case == "exit":
    dist.destroy_process_group()
