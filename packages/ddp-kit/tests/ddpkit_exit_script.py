"""A training script as users write them, top-level code and all, for the exit cases of
ddpkit_faults.py: `python ddpkit_exit_script.py CASE WRAPPER RANK WORLD STORE`.

It trains a few steps, all-reduces its logged metrics, and ends with the wrapper alive:
after destroy_process_group() (CASE "exit"), without it ("exit-no-destroy"), or without it and
without ddp_kit's exit guard ("exit-unguarded", a control run that shows the abort the guard
prevents). It prints one JSON line before its last step and nothing after, then leaves through
the interpreter's normal exit. A long switch interval keeps the main thread on the GIL until
it blocks, which widens the window in which a gloo worker thread still owes the release of a
finished call when finalization starts.
"""

import atexit
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from ddpkit_faults import CALM_TIMEOUT_S, make_model, make_wrapper

import ddp_kit

case, kind, store = sys.argv[1], sys.argv[2], sys.argv[5]
rank, world = int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group(
    "gloo",
    init_method=f"file://{store}",
    rank=rank,
    world_size=world,
    timeout=datetime.timedelta(seconds=120),
)
torch.manual_seed(rank)
model = make_model(torch, with_branch=True)
ddp = make_wrapper(ddp_kit, kind, model, CALM_TIMEOUT_S)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(4):
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    ddp.finish_gradient_synchronization()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (P,)
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
print(json.dumps({"rank": rank, "ranks_equal": all(torch.equal(g, flat) for g in gathered)}))
sys.stdout.flush()

sys.setswitchinterval(10.0)
loss = torch.nn.functional.mse_loss(ddp(x), y)
loss.backward()
ddp.finish_gradient_synchronization()
metrics = [loss.detach(), *(torch.ones(1000) for _ in range(7))]  # logged, kept until exit
for metric in metrics:
    dist.all_reduce(metric)
if case == "exit-unguarded":
    atexit.unregister(time.sleep)
if case == "exit":
    dist.destroy_process_group()
