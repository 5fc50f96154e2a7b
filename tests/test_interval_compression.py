"""Interval compressions: they never wait for the device, and a cut of the whole batch (read and
written in place) or of some rows keeps what a plain per-row transcription of the rule keeps.

No-sync check: on a CPU there is no stream to wait for, so the test watches for the calls that would
wait on a GPU instead: every ATen op the compression's host hooks run goes through a dispatch mode
that rejects those reading a device value on the host (`item`, `bool(t)`, `int(t)`: the scalar read;
`nonzero`, boolean-mask indexing, `masked_select`, `unique`: a data-dependent size; a blocking copy
to another device), and `Tensor.tolist`/`numpy` (which dispatch nothing) are patched to fail. On the
GPU `torch.cuda.set_sync_debug_mode("error")` makes the same check (`test_gpu_compression_does_not_sync`).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from helpers import method_variants, policy_of, tiny_model, tiny_spec
from torch.utils._python_dispatch import TorchDispatchMode

from evals.configs import method_config
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.methods import method_factory
from longflow.models import load_model
from longflow.slots import SlotCache, SlotState

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning", "ignore:rkv. budget")

# Ops whose result the host must read (a scalar, a data-dependent size) before it can go on.
READS_THE_DEVICE = {"_local_scalar_dense", "item", "nonzero", "nonzero_numpy", "masked_select", "unique",
                    "_unique", "_unique2", "unique_dim", "unique_consecutive", "is_nonzero", "equal",
                    "allclose"}
BUDGET = 64


class HostReads(Exception):
    pass


class NoDeviceReads(TorchDispatchMode):
    """Raises HostReads at any op that would make the host wait for a GPU (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in READS_THE_DEVICE:
            raise HostReads(name)
        counts = func._schema.overload_name != "self_int"  # repeats given as a tensor
        if name == "repeat_interleave" and counts and kwargs.get("output_size") is None:
            raise HostReads("repeat_interleave by a tensor of counts")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else []
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                raise HostReads(f"{name} with a boolean mask")
        if name in ("_to_copy", "copy_"):
            source = args[1] if name == "copy_" else args[0]
            target = args[0].device if name == "copy_" else kwargs.get("device", source.device)
            if source.device != target and source.device.type == "cpu" and not kwargs.get("non_blocking", False):
                raise HostReads(f"a blocking copy from the host to {target}")
        return func(*args, **kwargs)


@contextmanager
def no_device_reads():
    """`NoDeviceReads`, and `Tensor.tolist`/`numpy` failing, for the duration."""

    def fail(*args, **kwargs):
        raise HostReads("tolist/numpy")

    saved = torch.Tensor.tolist, torch.Tensor.numpy
    torch.Tensor.tolist = torch.Tensor.numpy = fail
    try:
        with NoDeviceReads():
            yield
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = saved


INTERVAL = [(name, variant) for name, variant in method_variants()
            if method_factory({**method_config(name), **({"variant": variant} if variant else {})}).func.schedule
            == "interval"]


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")


@contextmanager
def cuda_sync_errors():
    """CUDA's own check: any synchronising call raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextmanager
def compactions_seen(seen):
    """`SlotCache.compact` calls `seen(cache, layer, rows, keep, rank)` before compacting, for the duration."""
    compact = SlotCache.compact

    def wrapped(self, layer, rows, keep, rank=None):
        seen(self, layer, rows, keep, rank)
        return compact(self, layer, rows, keep, rank)

    SlotCache.compact = wrapped
    try:
        yield
    finally:
        SlotCache.compact = compact


def decode(model, tokenizer, factory, lengths) -> None:
    """Greedy decoding of prompts of `lengths` through the engine with `factory`'s policies, for 3 x
    BUDGET tokens: several compressions at BUDGET slots."""
    prompts = [[5 + (7 * i + 3 * n) % 300 for i in range(n)] for n in lengths]
    engine = Engine(model, factory, [], tokenizer.pad_token_id, EngineConfig(compile=False))
    engine.generate(prompts, GenerationConfig(max_new_tokens=3 * BUDGET, ignore_eos=True), [0, 1, 2])


def decode_watched(model, tokenizer, method, variant, lengths, check) -> list[bool]:
    """`decode` by `method` at BUDGET slots, its host hooks (and its decode, where R-KV lf_repo cuts)
    run under `check`. The engine's own reads (prefill, the `finished` check) lie outside the hooks.
    Returns, per compaction inside a hook, whether it cut the whole batch in place."""
    overrides = {"variant": variant} if variant else {}
    compactions, hooks = [], []

    def watched(function):
        def run(*args, **kwargs):
            hooks.append(function.__name__)
            try:
                with check():
                    return function(*args, **kwargs)
            finally:
                hooks.pop()
        return run

    def factory():
        policy = policy_of(method, BUDGET, **overrides)
        for hook in ("before_step", "after_step", "decode"):
            setattr(policy, hook, watched(getattr(policy, hook)))
        return policy

    def counted(cache, layer, rows, keep, rank):
        if hooks:
            compactions.append(rows is None)

    with compactions_seen(counted):
        decode(model, tokenizer, factory, lengths)
    return compactions


LENGTHS = pytest.mark.parametrize("lengths", [(9, 9, 9), (5, 17, 11)], ids=["in_step", "out_of_step"])


@LENGTHS
@pytest.mark.parametrize("method,variant", INTERVAL)
def test_the_compression_never_reads_the_device(qwen3, method, variant, lengths):
    """Every interval method over a decode that compresses: the rows in step (every row cut at once,
    in place) and out of step (some at a time)."""
    compactions = decode_watched(*qwen3, method, variant, lengths, no_device_reads)
    assert compactions, f"{method}: no compression ran"
    if method == "rkv" and variant == "paper":
        assert all(compactions) == (lengths[0] == lengths[1])  # rows in step: the whole batch in place


@LENGTHS
@pytest.mark.parametrize("method,variant", INTERVAL)
def test_kept_slots_never_move_up(qwen3, method, variant, lengths):
    """The premise of the GPU's in-place compaction (`longflow.kernels.compact_in_place`): before every
    compaction by position (prefill's and each compression's) the held slots are in position order,
    so the j-th kept slot in position order lies at slot j or above."""
    model, tokenizer = qwen3
    by_position, out_of_order = 0, 0

    def checked(cache, layer, rows, keep, rank):
        nonlocal by_position, out_of_order
        if rank is None:
            slots = cache.layers[layer]
            held = slots.valid if rows is None else slots.valid.index_select(0, rows)
            positions = slots.positions if rows is None else slots.positions.index_select(0, rows)
            newest_below = positions.masked_fill(~held, -1).cummax(dim=-1).values  # over slots <= j
            newest_below = torch.cat([torch.full_like(newest_below[..., :1], -1), newest_below[..., :-1]], dim=-1)
            by_position += 1
            out_of_order += int((held & (positions <= newest_below)).sum())

    overrides = {"variant": variant} if variant else {}
    with compactions_seen(checked):
        decode(model, tokenizer, lambda: policy_of(method, BUDGET, **overrides), lengths)
    if method == "rkv" and variant == "lf_repo":
        assert not by_position  # it orders its slots by score: the gathers
    else:
        assert by_position > model.config.num_hidden_layers, f"{method}: no compression by position ran"
    assert out_of_order == 0  # a held slot whose position is not above every held slot below it


@pytest.mark.gpu
@LENGTHS
@pytest.mark.parametrize("method,variant", INTERVAL)
def test_gpu_compression_does_not_sync(method, variant, lengths):
    """The same decode on the GPU under `torch.cuda.set_sync_debug_mode("error")`, which also catches
    a blocking copy of host data to the device (a row index from pageable memory)."""
    model, tokenizer = load_model(tiny_spec("qwen3"), torch.device("cuda"))
    assert decode_watched(model, tokenizer, method, variant, lengths, cuda_sync_errors)


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: bool(t.any()), lambda t: int(t.argmax()), lambda t: t.tolist(),
    lambda t: t.nonzero(), lambda t: t[t > 0], lambda t: t.masked_select(t > 0), lambda t: t.unique(),
    lambda t: t.repeat_interleave(t.long().clamp(min=0)),
], ids=["item", "bool", "int", "tolist", "nonzero", "mask_index", "masked_select", "unique", "repeat_interleave"])
def test_the_check_catches_every_host_read(read):
    tensor = torch.randn(6)
    with pytest.raises(HostReads), no_device_reads():
        read(tensor)
    with no_device_reads():  # what a compression does instead
        tensor.topk(2).indices.sort().values.gather(0, torch.zeros(1, dtype=torch.long))


# ---- the compaction against its transcription ---------------------------------------------------


def compact_by_hand(keys, values, valid, positions, state, keep, fill):
    """Per row and head: the kept valid slots, in position order, moved to slots 0.. ; the rest
    zeroed, free (position -1) and at the state's fill. Plain loops; returns new tensors."""
    out = [torch.zeros_like(keys), torch.zeros_like(values), torch.zeros_like(valid),
           torch.full_like(positions, -1), torch.full_like(state, fill)]
    for b in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            kept = sorted((int(positions[b, h, j]), j) for j in range(keys.shape[2]) if keep[b, h, j])
            for slot, (_, j) in enumerate(kept):
                out[0][b, h, slot], out[1][b, h, slot] = keys[b, h, j], values[b, h, j]
                out[2][b, h, slot], out[3][b, h, slot], out[4][b, h, slot] = True, positions[b, h, j], state[b, h, j]
    return out


@pytest.mark.parametrize("cut", [[0, 1, 2, 3], [0, 2, 3], [1]], ids=["every_row", "rows", "one_row"])
def test_compaction_is_the_per_row_transcription(cut):
    """Rows at different fill levels (all, 9, 5 and 12 of 12 slots held, positions with gaps and
    another order than the slots'), a kept subset of each; rows not cut keep everything."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, slots, dim = 4, 2, 12, 3
    cache = SlotCache(batch, heads, dim, torch.float32, torch.device("cpu"), [slots],
                      states={"score": SlotState(fill=-2.0)})
    layer = cache.layers[0]
    held = torch.tensor([12, 9, 5, 12])
    layer.valid.copy_((torch.arange(slots) < held[:, None])[:, None, :].expand(batch, heads, slots))
    order = torch.rand(batch, heads, slots, generator=generator).argsort(dim=-1)
    layer.positions.copy_(torch.where(layer.valid, 3 * order + 1, -1))
    layer.keys.copy_(torch.randn(layer.keys.shape, generator=generator))
    layer.values.copy_(torch.randn(layer.values.shape, generator=generator))
    layer.state["score"].copy_(torch.randn(batch, heads, slots, generator=generator))
    keep = layer.valid & (torch.rand(batch, heads, slots, generator=generator) < 0.6)
    before = [tensor.clone() for tensor in (layer.keys, layer.values, layer.valid, layer.positions,
                                            layer.state["score"])]
    expected = compact_by_hand(*before, keep, -2.0)
    rows = None if cut == list(range(batch)) else torch.tensor(cut)
    cache.compact(0, rows, keep if rows is None else keep[rows])
    after = (layer.keys, layer.values, layer.valid, layer.positions, layer.state["score"])
    for got, old, new in zip(after, before, expected, strict=True):
        for b in range(batch):
            assert got[b].equal(new[b] if b in cut else old[b])
    free = (~layer.valid).to(torch.uint8).argmax(dim=-1)
    assert cache.next_slot[0].equal(torch.where(layer.valid.all(dim=-1), 0, free))
