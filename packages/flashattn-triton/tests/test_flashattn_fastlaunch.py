"""CPU checks of the launch-plan replay (``fastlaunch``) with stand-in kernels: what it maps
to buffers, what it refuses, and how it falls back. The real kernels are checked against
Triton's dispatch bit for bit by the GPU tests (``test_fast_launch_replays_exactly``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch

from flashattn_triton import fastlaunch


@dataclass
class TensorDescriptor:  # the shape of Triton's host descriptor, for the replay's purposes
    base: object
    shape: list
    strides: list
    block_shape: list


class FakeCompiled:
    """Stands in for Triton's CompiledKernel: records what each launch received."""

    def __init__(self) -> None:
        self.function, self.packed_metadata, self.calls = "fn", "meta", []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
        self.calls.append(((g0, g1, g2), stream, args))


class FakeKernel:
    """Stands in for a JITFunction: ``kernel[grid](...)`` returns its compiled kernel."""

    def __init__(self) -> None:
        def kernel(X, Y, DESC, n, scale, BLOCK: int = 16):
            pass

        self.signature = inspect.signature(kernel)
        self.compiled = FakeCompiled()
        self.dispatched = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.dispatched += 1
            return self.compiled

        return run


def _buffers(n=8):
    x, y = torch.randn(n), torch.randn(n)
    return x, y, [x.data_ptr(), y.data_ptr()]


def test_replay_fills_new_addresses_in_recorded_positions():
    kern = FakeKernel()
    x, y, addresses = _buffers()
    with fastlaunch.Recorder() as rec:
        fastlaunch.launch(kern, (3, 2), x, y, TensorDescriptor(y, [8], [1], [4]), 8, 0.5)
    replay = fastlaunch.Replay.build(rec.records, addresses)
    assert replay is not None
    x2, y2, new = _buffers()
    replay.run(new, stream=7)
    grid, stream, args = kern.compiled.calls[-1]
    assert grid == (3, 2, 1)
    assert stream == 7
    assert args[0] == x2.data_ptr()
    assert args[1] == y2.data_ptr()
    assert args[2].base.data_ptr() == y2.data_ptr()
    assert args[2].block_shape == [4]
    assert args[3:] == (8, 0.5, 16)  # constants as recorded, defaults applied
    assert kern.dispatched == 1  # the replay did not go through the dispatcher


def test_unknown_tensor_or_callable_grid_is_not_replayed():
    kern = FakeKernel()
    x, y, addresses = _buffers()
    stranger = torch.randn(4)
    with fastlaunch.Recorder() as rec:
        fastlaunch.launch(kern, (1,), x, stranger, None, 1, 1.0)
    assert fastlaunch.Replay.build(rec.records, addresses) is None
    with fastlaunch.Recorder() as rec:
        fastlaunch.launch(kern, lambda meta: (1,), x, y, None, 1, 1.0)
    assert fastlaunch.Replay.build(rec.records, addresses) is None
    assert fastlaunch.Replay.build([], addresses) is None


def test_plan_cache_records_once_then_replays():
    kern = FakeKernel()
    cache = fastlaunch.PlanCache()
    x, y, addresses = _buffers()

    def slow():
        fastlaunch.launch(kern, (2,), x, y, None, 4, 1.0)

    cache.run(("k",), addresses, 0, slow)
    assert kern.dispatched == 1
    assert cache.replays() == 1
    cache.run(("k",), addresses, 0, slow)
    cache.run(("k",), addresses, 0, slow)
    assert kern.dispatched == 1
    assert len(kern.compiled.calls) == 2
    cache.clear()
    assert cache.replays() == 0


def test_plan_cache_falls_back_for_good_when_a_replay_raises():
    kern = FakeKernel()
    cache = fastlaunch.PlanCache()
    x, y, addresses = _buffers()

    def slow():
        fastlaunch.launch(kern, (2,), x, y, None, 4, 1.0)

    cache.run(("k",), addresses, 0, slow)

    def broken(*args, **kwargs):
        raise TypeError("launcher changed")

    kern.compiled.run = broken
    with pytest.warns(RuntimeWarning, match="launcher changed"):
        cache.run(("k",), addresses, 0, slow)
    assert kern.dispatched == 2
    assert cache.replays() == 0
    cache.run(("k",), addresses, 0, slow)  # no second warning, no replay attempt
    assert kern.dispatched == 3


def test_recorder_is_per_thread_and_nests():
    kern = FakeKernel()
    x, y, _ = _buffers()
    with fastlaunch.Recorder() as outer:
        with fastlaunch.Recorder() as inner:
            fastlaunch.launch(kern, (1,), x, y, None, 1, 1.0)
        fastlaunch.launch(kern, (1,), x, y, None, 1, 1.0)
    assert len(inner.records) == 1
    assert len(outer.records) == 1
    fastlaunch.launch(kern, (1,), x, y, None, 1, 1.0)  # no recorder: nothing noted
    assert len(outer.records) == 1


def test_direct_launch_expands_each_descriptor_once_per_address():
    calls, expansions = [], []

    def raw(*args):
        calls.append(args)

    def expand(desc, meta):
        expansions.append(int(desc.base))
        return [f"map@{int(desc.base)}", *desc.shape, *desc.strides]

    template = TensorDescriptor(torch.zeros(4), [4], [1], [4])
    direct = fastlaunch._Direct(
        launch=raw,
        head=("coop", "pdl"),
        args=[0, "map", 4, 1, 7],
        pointers=[(0, 0)],
        descriptors=[(1, 4, 1, template, None, {})],
        expand=expand,
    )
    direct.run("fn", (2, 1, 1), 5, [100, 200])
    direct.run("fn", (2, 1, 1), 5, [101, 200])  # same descriptor base: no new expansion
    direct.run("fn", (2, 1, 1), 5, [101, 300])
    assert expansions == [200, 300]
    assert calls[0] == (2, 1, 1, 5, "fn", "coop", "pdl", 100, "map@200", 4, 1, 7)
    assert calls[1][7] == 101
    assert calls[2][8] == "map@300"
    assert direct.args == [0, "map", 4, 1, 7]  # the template itself is never changed


def test_unknown_launchers_are_not_launched_directly():
    kern = FakeKernel()
    x, y, addresses = _buffers()
    with fastlaunch.Recorder() as rec:
        fastlaunch.launch(kern, (1,), x, y, None, 1, 1.0)
    replay = fastlaunch.Replay.build(rec.records, addresses)
    assert replay.steps[0].direct is None  # not Triton 3.6's CudaLauncher: compiled.run


def test_option_changes_drop_every_launchers_per_key_choices(set_options):
    """The backward's scheme choices, the decode splits and the remembered calls are kept by
    key in their own modules; an option change (or ``clear_plans``) drops them with the
    plans, so no choice made under the old options is reused."""
    from flashattn_triton import launch, launch_backward, launch_plans, launch_varlen

    caches = (launch_backward._BWD_SCHEMES, launch._DECODE_PLANS, launch._CALLS)
    caches += (launch_backward._CALLS, launch_varlen._FWD_CALLS, launch_varlen._BWD_CALLS)
    for cache in caches:
        cache[("stale",)] = "a choice under the old options"
    generation = launch_plans._GENERATION[0]
    set_options(backward="split")
    assert not any(caches)
    assert launch_plans._GENERATION[0] > generation  # keys made before no longer match
    launch_backward._BWD_SCHEMES[("stale",)] = "again"
    launch.clear_plans()
    assert not launch_backward._BWD_SCHEMES


def test_remembered_calls_need_a_replay_and_sound_buffers(monkeypatch):
    """``call_key`` is None off-GPU and for float32 (whose launches follow torch's matmul
    precision); ``remember_call`` keeps only plans with a replay; ``replay_call`` refuses
    outputs off 16-byte alignment and aliased buffers before launching anything."""
    from flashattn_triton import launch_plans

    x = torch.zeros(4, 8)
    assert launch_plans.call_key((x, x), True) is None
    assert launch_plans.call_key((x.half(), x.half()), True) is None  # CPU
    cache: dict = {}
    monkeypatch.setattr(launch_plans._PLANS, "replay", lambda key: None)
    launch_plans.remember_call(cache, ("call",), ("plan",), ())
    assert not cache
    replay = object()
    monkeypatch.setattr(launch_plans._PLANS, "replay", lambda key: replay)
    launch_plans.remember_call(cache, ("call",), ("plan",), ("recipe",))
    launch_plans.remember_call(cache, None, ("plan",), ())  # no call key: nothing kept
    assert cache == {("call",): (replay, ("recipe",))}
    assert not launch_plans.replay_call(cache, ("call",), replay, [0, 16, 40], 2)  # misaligned
    assert not launch_plans.replay_call(cache, ("call",), replay, [0, 16, 16], 2)  # aliased


def test_decode_replay_places_buffers_as_the_first_call_did(monkeypatch):
    """A split-KV decode call keeps the splits' partial results in one float32 workspace:
    the first call's two scratch buffers sit at the workspace offsets that a replay of the
    remembered call recomputes from its own allocation, 128-byte aligned and distinct; o and
    lse stay allocations of their own."""
    from flashattn_triton import launch

    seen: dict = {}
    real_planned = launch._launch_planned

    def planned(key, inputs, outputs, launch_jit):
        seen["outputs"] = outputs
        return real_planned(key, inputs, outputs, launch_jit)

    monkeypatch.setattr(launch, "_launch_planned", planned)
    monkeypatch.setattr(launch, "remember_call", lambda c, call, key, r: seen.update(recipe=r))
    q = torch.randn(2, 4, 1, 16)
    k, v = torch.randn(2, 2, 2048, 16), torch.randn(2, 2, 2048, 16)
    _o, lse = launch.forward(q, k, v, True, 0.25)
    outputs, scratch = seen["outputs"], seen["recipe"]
    assert len(outputs) == 4, "one split: no scratch to place"
    assert lse.untyped_storage().nbytes() == lse.numel() * 4  # lse holds no scratch
    offsets, total = scratch
    first = [t.data_ptr() for t in outputs[2:]]
    assert [a - first[0] for a in first] == [4 * off for off in offsets]
    assert all((a - first[0]) % 128 == 0 for a in first)  # from the base's alignment on
    assert first[0] % 16 == 0
    assert len(set(first)) == 2
    assert total >= max(off + t.numel() for off, t in zip(offsets, outputs[2:]))

    got: dict = {}
    monkeypatch.setitem(launch._CALLS, ("call",), ("replay", scratch))
    monkeypatch.setattr(
        launch, "replay_call", lambda cache, call, replay, addresses, n: got.update(a=addresses)
        or True,
    )  # fmt: skip
    o2, lse2 = launch.replay_forward(("call",), (q, k, v))
    addresses = got["a"]
    assert addresses[:5] == [t.data_ptr() for t in (q, k, v, o2, lse2)]
    assert o2.shape == q.shape
    assert lse2.shape == lse.shape
    assert lse2.stride() == lse.stride()
    assert len(addresses) == 7
    assert [a - addresses[5] for a in addresses[5:]] == [4 * off for off in offsets]
    assert addresses[5] % 16 == 0
