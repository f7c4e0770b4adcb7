"""`ShardedOptimizer`: keep optimizer state for this rank's shard of the parameters only.

Every rank holds all parameters and gradients (as in data parallelism), but the wrapped
optimizer on each rank is built over only the parameters that rank owns, so its state (AdamW:
two tensors per parameter) exists once across the group instead of once per rank. After each
rank steps its shard, the updated parameters are broadcast from their owners (see `sync.py`).

Hyperparameters live in the wrapper's `param_groups` (what schedulers and training loops
change); they are copied into the local optimizer's groups before every step and copied back
after it, so both views agree.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from zero_shard._comm import Comm, check_timeout
from zero_shard.partition import greedy_partition
from zero_shard.sharded_state import check_by_name, zero_lr_and_grads
from zero_shard.sync import (
    GatherGroup,
    SyncUnit,
    allgather_params,
    broadcast_params,
    build_gather_plan,
    build_plan,
)
from zero_shard.transfer import recv_object, send_object, to_cpu

_NOT_HPARAMS = ("params", "param_names")


class ShardedOptimizer(Optimizer):
    """A `torch.optim.Optimizer` whose state is sharded across the ranks of a process group.

    Args:
        params: parameters or parameter groups (dicts), as for any torch optimizer. Every rank
            must pass the same parameters (same count, sizes and order).
        optimizer_cls: the optimizer to run on each shard (any `torch.optim.Optimizer`
            subclass, e.g. `torch.optim.AdamW`).
        process_group: the ranks to shard across; None means the default (WORLD) group.
        bucket_cap_mb: parameters smaller than this are packed into buckets of up to this size
            for the post-step broadcast; larger ones are broadcast in place. With
            `param_sync="allgather"`: the size each rank contributes to one all-gather.
        param_sync: "broadcast" (each owner broadcasts its parameters; no copies) or
            "allgather" (flat shards exchanged in chunks by all-gather: every rank sends and
            receives at once, at the cost of a pack and an unpack copy). See `sync.py`.
        timeout: a bound on each collective this optimizer issues: None (default) uses the
            process group's timeout; a number of seconds or a `datetime.timedelta` makes a
            collective that some rank does not join raise `zero_shard.CollectiveError` (naming
            it and this rank) after that long (see `zero_shard._comm`).
        **kwargs: the optimizer's hyperparameters (lr, weight_decay, ...), forwarded to
            `optimizer_cls` as its defaults.

    The parameters of every group (at construction and in `add_param_group`) are broadcast
    from group rank 0 first, as torch's DistributedDataParallel does, so the ranks start from
    identical values even without a data-parallel wrapper. Parameters are assigned to ranks by
    `greedy_partition` (balanced by element count, the same on every rank). `step()` runs the
    local optimizer, then broadcasts each parameter from its owner. The constructor, `step`,
    `add_param_group` and `consolidate_state_dict` are collectives: every rank must call them,
    in the same order.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        *,
        bucket_cap_mb: float = 16.0,
        param_sync: str = "broadcast",
        timeout: float | datetime.timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(
                "optimizer_cls: expected a subclass of torch.optim.Optimizer "
                f"(e.g. torch.optim.AdamW, the class itself), got {optimizer_cls!r}"
            )
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError("optimizer_cls: a ShardedOptimizer cannot wrap another one")
        if param_sync not in ("broadcast", "allgather"):
            raise ValueError(f"param_sync: expected 'broadcast' or 'allgather', got {param_sync!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb: expected a positive size in MB, got {bucket_cap_mb}")
        limit = check_timeout(timeout, "ShardedOptimizer")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if not params:
            raise ValueError(
                "params: got an empty parameter list; pass model.parameters() or a list of "
                "parameter groups"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ShardedOptimizer needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first (e.g. under torchrun)"
            )
        self._group = process_group if process_group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self._group)
        if self._rank < 0:
            raise ValueError("process_group: this process is not a member of the given group")
        self._comm = Comm(self._group, limit, "ShardedOptimizer")
        self._world_size = dist.get_world_size(process_group)
        self._backend = str(dist.get_backend(process_group))
        self._comm_device: torch.device | None = None
        self._bucket_cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        self._optimizer_cls = optimizer_cls
        self._owner: dict[torch.Tensor, int] = {}
        self._loads = [0] * self._world_size  # elements owned per rank
        self._local: Optimizer | None = None
        self._param_sync = param_sync
        self._plan: list[SyncUnit] | None = None
        self._gather_plan: list[GatherGroup] = []
        self._consolidated: dict[str, Any] | None = None
        self._has_state = False  # set by a step or a load, on every rank alike

        super().__init__(params, kwargs)  # calls self.add_param_group for every group

        self._local = optimizer_cls([self._local_group(g) for g in self.param_groups], **kwargs)
        self._pull_hparams()  # the wrapper's groups now show optimizer_cls's defaults too
        self.defaults = dict(self._local.defaults)

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The local optimizer's state: entries for this rank's parameters only."""
        local = self.__dict__.get("_local")
        return local.state if local is not None else self.__dict__["_base_state"]

    @state.setter
    def state(self, value: Any) -> None:
        # Optimizer.__init__ assigns an empty state before the local optimizer exists.
        self.__dict__["_base_state"] = value

    # ------------------------------------------------------------------ introspection
    @property
    def local_optimizer(self) -> Optimizer:
        """The `optimizer_cls` instance that steps this rank's shard."""
        assert self._local is not None
        return self._local

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def owner(self, param: torch.Tensor) -> int:
        """The rank (within the process group) whose optimizer updates `param`."""
        try:
            return self._owner[param]
        except KeyError:
            raise ValueError("param: not a parameter of this optimizer") from None

    def shard_numels(self) -> list[int]:
        """Elements owned by each rank (index = rank in the process group)."""
        return list(self._loads)

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (hyperparameters kept) and assign its parameters to ranks.

        Works during construction and during training (e.g. unfreezing layers). Already
        assigned parameters never move. Collective: every rank must add the same group.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group: expected a dict, got {type(param_group).__name__}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_devices(group["params"])
            self._check_same_on_all_ranks(group["params"])
        except Exception:
            self.param_groups.pop()
            raise
        self._broadcast_from_rank0(group["params"])
        owners = greedy_partition([p.numel() for p in group["params"]], self._loads)
        for p, r in zip(group["params"], owners):
            self._owner[p] = r
        self._plan = None
        self._consolidated = None
        if self._local is not None:
            self._local.add_param_group(self._local_group(group))
            _copy_hparams(self._local.param_groups[-1], group)

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """`group` restricted to the parameters this rank owns (may be empty)."""
        mine = [self._owner[p] == self._rank for p in group["params"]]
        local = {k: v for k, v in group.items() if k not in _NOT_HPARAMS}
        local["params"] = [p for p, m in zip(group["params"], mine) if m]
        if "param_names" in group:
            local["param_names"] = [n for n, m in zip(group["param_names"], mine) if m]
        return local

    def _push_hparams(self) -> None:
        """Wrapper groups -> local groups (lr set by a scheduler or a training loop)."""
        for src, dst in zip(self.param_groups, self.local_optimizer.param_groups):
            _copy_hparams(src, dst)

    def _pull_hparams(self) -> None:
        for src, dst in zip(self.local_optimizer.param_groups, self.param_groups):
            _copy_hparams(src, dst)

    # ------------------------------------------------------------------ step
    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        """Step this rank's shard, then broadcast updated parameters from their owners.

        Collective: every rank must call it. `closure` (re-evaluates the loss) and `kwargs` go
        to the local optimizer's `step`. Returns what that returns.
        """
        self._push_hparams()
        if closure is not None:
            loss = self.local_optimizer.step(closure=closure, **kwargs)
        else:
            loss = self.local_optimizer.step(**kwargs)
        self._pull_hparams()
        self._consolidated = None
        self._has_state = True
        self._sync_params()
        return loss

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _sync_params(self) -> None:
        if self._world_size == 1:
            return
        if self._plan is None:
            params = self._all_params()
            owners = [self._owner[p] for p in params]
            gather = [self._param_sync == "allgather" and p.is_contiguous() for p in params]
            self._gather_plan = build_gather_plan(
                [p for p, g in zip(params, gather) if g],
                [o for o, g in zip(owners, gather) if g],
                self._world_size,
                self._bucket_cap_bytes,
            )
            self._plan = build_plan(
                [p for p, g in zip(params, gather) if not g],
                [o for o, g in zip(owners, gather) if not g],
                self._world_size,
                self._bucket_cap_bytes,
            )
        allgather_params(self._gather_plan, self._rank, self._world_size, self._comm)
        broadcast_params(self._plan, self._rank, self._comm)

    # ------------------------------------------------------------------ checks
    def _check_devices(self, params: list[torch.Tensor]) -> None:
        if self._backend == "nccl":
            bad = [p.device for p in params if p.device.type != "cuda"]
            if bad:
                raise ValueError(
                    f"params: the process group's backend is NCCL, which needs CUDA tensors; "
                    f"got parameters on {bad[0]}. Move the model to this rank's GPU before "
                    "building the optimizer, or use the gloo backend for CPU training"
                )
        if self._comm_device is None and params:
            p = params[0]
            use_gpu = p.device.type == "cuda" and "nccl" in self._backend
            self._comm_device = p.device if use_gpu else torch.device("cpu")

    def _check_same_on_all_ranks(self, params: list[torch.Tensor]) -> None:
        """Fail on every rank (instead of hanging later) if ranks pass different params."""
        if self._world_size == 1:
            return
        h = 0
        for p in params:
            for n in (p.dim(), *p.shape):
                h = (h * 1_000_003 + int(n) + 1) % (2**61 - 1)
        device = self._comm_device or torch.device("cpu")
        mine = torch.tensor([len(params), sum(p.numel() for p in params), h], device=device)
        everyone = [torch.empty_like(mine) for _ in range(self._world_size)]
        what = ("all_gather of the parameters' fingerprint", ())
        self._comm.all_gather(everyone, mine, what).wait()
        rows = [tuple(int(v) for v in t.tolist()) for t in everyone]
        if any(r != rows[0] for r in rows):
            desc = ", ".join(
                f"rank {i}: {r[0]} tensors / {r[1]} elements" for i, r in enumerate(rows)
            )
            raise ValueError(
                "params: every rank must pass the same parameters (count, shapes, order); "
                f"this parameter group differs across ranks ({desc})"
            )

    # ------------------------------------------------------------------ state dicts
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every shard's optimizer state onto rank `to` (rank within the group).

        .. warning:: Collective: every rank must call it. Afterwards `state_dict()` on rank
           `to` returns the full state (on CPU); other ranks hold nothing. The snapshot is
           dropped at the next `step()` or `add_param_group()`.
        """
        if not 0 <= to < self._world_size:
            raise ValueError(f"to: expected a rank in [0, {self._world_size}), got {to}")
        self._push_hparams()
        local_sd = self.local_optimizer.state_dict()
        local_params = [p for g in self.local_optimizer.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(self._all_params())}
        state = {index[local_params[i]]: v for i, v in local_sd["state"].items()}
        device = self._comm_device or torch.device("cpu")
        if self._rank != to:
            send_object(state, to, self._comm, device)
            self._consolidated = None
            return
        merged = to_cpu(state)
        for src in range(self._world_size):
            if src != to:
                merged.update(recv_object(src, self._comm, device))
        self._consolidated = {
            "state": dict(sorted(merged.items())),
            "param_groups": self._packed_groups(),
        }

    @torch.no_grad()
    def _broadcast_from_rank0(self, params: list[torch.Tensor]) -> None:
        """Collective: every rank takes group rank 0's values of `params` (a non-contiguous
        parameter goes through a contiguous copy)."""
        if self._world_size == 1:
            return
        pending = []
        for i, p in enumerate(params):
            data = p.detach()
            buf = data if data.is_contiguous() else data.contiguous()
            what = ("broadcast of parameter %d of %d from rank 0", (i, len(params)))
            pending.append((data, buf, self._comm.broadcast(buf, 0, what)))
        for data, buf, work in pending:
            work.wait()
            if buf is not data:
                data.copy_(buf)

    def _packed_groups(self) -> list[dict[str, Any]]:
        """param_groups with parameters as consecutive indices, as `Optimizer.state_dict`."""
        packed, start = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            packed.append(d)
        return packed

    def state_dict(self) -> dict[str, Any]:
        """The full (unsharded) state, in the layout `optimizer_cls` itself would produce.

        Only on the rank that `consolidate_state_dict(to=...)` targeted, and only until the next
        step. It loads into a plain `optimizer_cls` or into a `ShardedOptimizer` of any world
        size.
        """
        if self._consolidated is None:
            raise RuntimeError(
                "ShardedOptimizer.state_dict(): the state is not consolidated on this rank "
                f"(or a step has run since). Call consolidate_state_dict(to={self._rank}) on "
                "every rank first"
            )
        return dict(self._consolidated)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from `state_dict()` or a plain optimizer); keep our shard.

        Call it on every rank with the same dict (no communication happens). Raises ValueError
        naming what differs when the dict comes from another model or group layout.
        """
        if isinstance(state_dict, dict) and "zero_shard" in state_dict:
            raise ValueError(
                "state_dict: this is one rank's shard (from local_state_dict()); load it with "
                "load_local_state_dict()"
            )
        if not (isinstance(state_dict, dict) and {"state", "param_groups"} <= state_dict.keys()):
            raise ValueError(
                "state_dict: expected a full optimizer state dict with keys 'state' and "
                "'param_groups' (ShardedOptimizer.state_dict() after consolidate_state_dict, "
                "or a plain optimizer's state_dict())"
            )
        saved_groups = state_dict["param_groups"]
        params_of = self._match_saved(saved_groups)
        for key, value in state_dict["state"].items():
            if key not in params_of:
                raise ValueError(
                    f"state_dict: 'state' has an entry for parameter index {key!r}, which no "
                    "parameter group lists: the state dict is corrupt or from another model"
                )
            _check_state_shapes(key, value, params_of[key])
        local_params = [p for g in self.local_optimizer.param_groups for p in g["params"]]
        local_index = {p: i for i, p in enumerate(local_params)}
        local_state = {
            local_index[params_of[k]]: v
            for k, v in state_dict["state"].items()
            if self._owner[params_of[k]] == self._rank
        }
        local_groups = []
        for saved, local in zip(saved_groups, self.local_optimizer.param_groups):
            d = {k: v for k, v in saved.items() if k not in _NOT_HPARAMS}
            d["params"] = [local_index[p] for p in local["params"]]
            local_groups.append(d)
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._pull_hparams()
        self._consolidated = None
        self._has_state = True

    def _match_saved(self, saved_groups: list[dict[str, Any]]) -> dict[Any, torch.Tensor]:
        """Saved parameter index -> our parameter, checking the group layout matches."""
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict: it has {len(saved_groups)} parameter group(s), this optimizer "
                f"has {len(self.param_groups)}: it comes from another model or group layout"
            )
        params_of: dict[Any, torch.Tensor] = {}
        for i, (saved, ours) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(
                    f"state_dict: parameter group {i} lists {len(saved['params'])} parameters, "
                    f"this optimizer's has {len(ours['params'])}: it comes from another model"
                )
            params_of.update(zip(saved["params"], ours["params"]))
        return params_of

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's shard only (no communication), tagged with the sharding layout.

        For checkpoints too large to consolidate: every rank saves its own file and later
        loads it with `load_local_state_dict` under the same world size and parameters.
        """
        self._push_hparams()
        return {"zero_shard": self._layout(), "optimizer": self.local_optimizer.state_dict()}

    def load_local_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `local_state_dict()` returned on this rank in an identical setup."""
        if not (isinstance(state_dict, dict) and "zero_shard" in state_dict):
            raise ValueError(
                "state_dict: expected the output of local_state_dict() (a 'zero_shard' key); "
                "load full state dicts with load_state_dict()"
            )
        saved, ours = state_dict["zero_shard"], self._layout()
        for key, what in (
            ("world_size", "world size"),
            ("rank", "rank"),
            ("group_sizes", "parameters per group"),
            ("numels", "parameter sizes"),
            ("owners", "parameter-to-rank assignment"),
        ):
            if saved.get(key) != ours[key]:
                shown = (
                    f"{saved.get(key)} vs {ours[key]}"
                    if key in ("world_size", "rank", "group_sizes")
                    else "they differ"
                )
                raise ValueError(
                    f"state_dict: saved with another {what} ({shown}, saved vs now); a shard "
                    "loads only into the same setup. To change world size or model, save a "
                    "consolidated state_dict() instead"
                )
        self.local_optimizer.load_state_dict(state_dict["optimizer"])
        self._pull_hparams()
        self._consolidated = None
        self._has_state = True

    def sharded_state_dict(self, param_names: Sequence[str] | None = None) -> dict[str, Any]:
        """This rank's part of the state for torch.distributed.checkpoint: `{"state": {name:
        {...}}, "param_groups": [{..., "params": [name, ...]}]}` (torch's `get_state_dict`
        layout) with the state of the parameters this rank owns only, as they are (views;
        `dcp.load` into it loads in place).

        `param_names`: a name per parameter, in the order of `param_groups` (e.g. the model's
        `named_parameters()` names); default "0", "1", ... Each parameter's state is whole on
        its owner, so DCP writes every rank's part in parallel and any world size loads it.
        Collective the first time before any step (the state is created by a step at lr 0).
        """
        names = self._names(param_names)
        self._init_state()
        self._push_hparams()
        local_sd = self.local_optimizer.state_dict()
        local_params = [p for g in self.local_optimizer.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(self._all_params())}
        state = {names[index[local_params[i]]]: v for i, v in local_sd["state"].items()}
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in self._packed_groups()]
        return {"state": state, "param_groups": groups}

    def load_sharded_state_dict(
        self, state_dict: dict[str, Any], param_names: Sequence[str] | None = None
    ) -> None:
        """Load a `sharded_state_dict()` layout (by parameter name; it needs the state of this
        rank's parameters only, and may hold more). Local; call it on every rank."""
        names = self._names(param_names)
        check_by_name(state_dict, "ShardedOptimizer.sharded_state_dict()")
        index = {n: i for i, n in enumerate(names)}
        unknown = sorted(set(state_dict["state"]) - set(index))
        if unknown:
            raise ValueError(f"state_dict: state for {unknown[:5]}, not parameters named here")
        groups = []
        for g, saved in enumerate(state_dict["param_groups"]):
            missing = [n for n in saved.get("params", []) if n not in index]
            if missing:
                raise ValueError(f"state_dict: param_groups[{g}] lists {missing[:3]}, not ours")
            groups.append({**saved, "params": [index[n] for n in saved["params"]]})
        state = {index[n]: v for n, v in state_dict["state"].items()}
        self.load_state_dict({"state": state, "param_groups": groups})

    def _names(self, param_names: Sequence[str] | None) -> list[str]:
        n = len(self._all_params())
        if param_names is None:
            return [str(i) for i in range(n)]
        names = list(param_names)
        if len(names) != n or len(set(names)) != n:
            raise ValueError(
                f"param_names: expected {n} distinct names (one per parameter, in param_groups "
                f"order), got {len(names)} ({len(set(names))} distinct)"
            )
        return names

    @torch.no_grad()
    def _init_state(self) -> None:
        """Create the state (a collective step at lr 0 on zero gradients, which changes no
        parameter) unless a step or a load happened already: the same on every rank."""
        if self._has_state:
            return
        try:
            with zero_lr_and_grads(self.param_groups):
                self.step()
        finally:
            self._push_hparams()

    def _layout(self) -> dict[str, Any]:
        params = self._all_params()
        return {
            "world_size": self._world_size,
            "rank": self._rank,
            "group_sizes": [len(g["params"]) for g in self.param_groups],
            "numels": [p.numel() for p in params],
            "owners": [self._owner[p] for p in params],
        }


def _copy_hparams(src: dict[str, Any], dst: dict[str, Any]) -> None:
    for k, v in src.items():
        if k not in _NOT_HPARAMS:
            dst[k] = v


def _check_state_shapes(key: Any, state: Any, param: torch.Tensor) -> None:
    """Per-element state (momentum, Adam moments) must have the parameter's shape.

    Tensors with fewer elements than the parameter are allowed (scalars such as `step`,
    factored statistics); a tensor at least as large as the parameter but shaped differently
    means the state belongs to another model.
    """
    if not isinstance(state, dict):
        return
    for name, value in state.items():
        if (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and value.numel() >= param.numel()
            and value.shape != param.shape
        ):
            raise ValueError(
                f"state_dict: state {name!r} of parameter {key!r} has shape "
                f"{tuple(value.shape)}, but the parameter has shape {tuple(param.shape)}: the "
                "state dict comes from another model"
            )
