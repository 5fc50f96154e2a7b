"""RPC: the score against a plain transcription of the official `RPCCluster.compress_kv` (repeat_kv,
softmax over the generated keys before the R newest, sum over the selectors, mean over all heads,
avg-pool 7, top-k), the selectors against the official query cache's counter, and both budget
forms, step by step, against a loop-by-loop reference of docs/methods.md. Large budget = the full
cache's tokens and the hard cap: test_methods.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import drive_layer, method_defaults, policy_of, tiny_model

from baselines.rpc import RPCPolicy, ratio_peak, rpc_scores, selector_weights
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.errors import UserError
from longflow.methods import locate

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


def official_compress(keys, queries, prompt_len, recent, kept, kernel=7, pooling="avgpool", aggregation="all"):
    """`RPCCluster.compress_kv` (rpc_utils.py:94-171) for one row, in float64: keys `[Hkv, L, D]` in
    cache order, queries `[Hq, W, D]` the selectors. Returns the kept cache indices, sorted, and the
    pooled scores of the candidates `[Hkv or 1, L - prompt_len - recent]`."""
    kv_heads, length, head_dim = keys.shape
    group = queries.shape[0] // kv_heads
    expanded = keys.double().repeat_interleave(group, dim=0)  # repeat_kv
    weights = queries.double() @ expanded.transpose(1, 2) / math.sqrt(head_dim)  # [Hq, W, L]
    weights = torch.softmax(weights[:, :, prompt_len:length - recent], dim=-1).sum(dim=-2)  # [Hq, N]
    if aggregation == "all":
        summed = weights.mean(dim=0, keepdim=True)
    else:
        summed = weights.view(kv_heads, group, -1).mean(dim=1)
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    pooled = pool(summed[:, None], kernel, padding=kernel // 2, stride=1)[:, 0]
    chosen = pooled.topk(kept, dim=-1).indices.sort(dim=-1).values + prompt_len
    index = torch.arange(length)
    prompt, newest = index[:prompt_len], index[length - recent:]
    return [torch.cat([prompt, row, newest]).tolist() for row in chosen], pooled


@pytest.mark.parametrize("aggregation", ["all", "group"])
@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_scores_match_the_official_rule(aggregation, pooling):
    torch.manual_seed(0)
    kv_heads, group, head_dim, prompt_len, candidates, recent, kept = 2, 3, 8, 5, 17, 4, 6
    length = prompt_len + candidates + recent
    keys = torch.randn(2, kv_heads, length, head_dim)
    queries = torch.randn(2, kv_heads * group, recent, head_dim)
    index = torch.arange(length)
    mask = ((index >= prompt_len) & (index < length - recent)).expand(2, kv_heads, length)
    weights = torch.ones(2, recent)
    ours = rpc_scores(queries, weights, keys, mask, kernel=7, pooling=pooling, aggregation=aggregation)
    for b in range(2):
        expected_kept, pooled = official_compress(keys[b], queries[b], prompt_len, recent, kept, pooling=pooling,
                                                  aggregation=aggregation)
        torch.testing.assert_close(ours[b][:, prompt_len:length - recent].double(),
                                   pooled.expand(kv_heads, -1), rtol=1e-5, atol=1e-7)
        assert torch.isinf(ours[b][~mask[b]]).all()
        best = ours[b].topk(kept, dim=-1)
        torch.testing.assert_close(best.values.double(), pooled.topk(kept, dim=-1).values.expand(kv_heads, -1),
                                   rtol=1e-5, atol=1e-7)
        if pooling == "maxpool":
            continue  # a max pool has plateaus: tied slots may be taken in another order
        for h in range(kv_heads):
            expected = expected_kept[0 if aggregation == "all" else h]
            chosen = best.indices[h].sort().values.tolist()
            assert [*range(prompt_len), *chosen, *range(length - recent, length)] == expected


def official_selectors(period: int, window: int) -> list[int]:
    """The generated tokens whose queries select at the first compression, with repeats, from the
    official counter (qwen2_custom.py:93-99, rpc_utils.py:88-98): index g = tokens in the cache
    before the step's own (the step's token is generated token g)."""
    cached = []
    for g in range(period + window):
        target = g - window  # cache length - prompt - num_comp * T - R, before the update
        if target > period - window:
            cached.append(g)
        if target == period - 1:
            return cached + [g]
    raise AssertionError("no compression")


@pytest.mark.parametrize("window", [1, 2, 5, 32])
def test_selector_weights_follow_the_official_query_cache(window):
    period = 40
    selectors = official_selectors(period, window)
    newest = period + window - 1  # the compressing step's token; the window is tokens newest-R+1..newest
    expected = [selectors.count(newest - window + 1 + i) for i in range(window)]
    assert selector_weights(window, "recent").tolist() == expected
    assert selector_weights(window, "new").tolist() == [0] * (window - 1) + [1]


def test_ratio_peak_matches_a_count_by_steps():
    for max_new, period, kept, window in [(1, 8, 2, 2), (9, 8, 2, 2), (10, 8, 2, 2), (200, 8, 2, 2),
                                          (5000, 1024, 256, 32), (70, 16, 16, 3)]:
        held = cuts = peak = 0
        for _ in range(max_new):
            held += 1
            peak = max(peak, held)
            if held == cuts * kept + period + window:
                held, cuts = (cuts + 1) * kept + window, cuts + 1
        assert ratio_peak(max_new, period, kept, window) == peak


def reference_rpc(q, k, pad, steps, *, mode, period, window, kept_per_cut, budget=None, keep_after=None):
    """Per row, loop by loop, of one layer: the positions each step's query attends to `[t][b] -> set`
    (a compressing step attends to the uncut cache, as the official one does, then cuts).

    `ratio`: the official schedule as its code counts (qwen2_custom.py:93-114): a query is cached once
    the cache is within R - 1 tokens of a compression; at the compressing step the cached queries and
    the step's own select, and `official_compress` keeps the prompt, (n + 1) T chosen and the R newest.
    `cap`: a full row (budget) is cut to keep_after: the first min(prompt, keep_after - R) prompt
    tokens and the R newest kept, the rest chosen by the same score with the R - 1 newest queries and
    the newest twice. Prompts must fit the slots (no prefill cut)."""
    batch, _, length, _ = q.shape
    log = [[None] * batch for _ in steps]
    for b in range(batch):
        n = int(pad[b].sum())
        keys = {p: k[b, :, length - n + p] for p in range(n)}
        queries = {p: q[b, :, length - n + p] for p in range(n)}
        held = list(range(n))
        cached, cuts = [], 0
        for t, (qs, ks, _) in enumerate(steps):
            position = n + t
            keys[position], queries[position] = ks[b, :, 0], qs[b, :, 0]
            if mode == "ratio":
                target = len(held) - n - cuts * kept_per_cut - window
                if target > period - window:
                    cached.append(position)
                held.append(position)
                log[t][b] = set(held)
                if target == period - 1:
                    selectors = torch.stack([queries[p] for p in cached + [position]], dim=1)
                    order = torch.stack([keys[p] for p in held], dim=1)
                    kept, _ = official_compress(order, selectors, n, window, (cuts + 1) * kept_per_cut)
                    held = [held[i] for i in kept[0]]
                    cached, cuts = [], cuts + 1
            else:
                held.append(position)
                log[t][b] = set(held)
                if len(held) == budget:
                    prompt = [p for p in held if p < n][:keep_after - window]
                    newest = held[-window:]
                    protect = sorted(set(prompt) | set(newest))
                    candidates = [p for p in held if p not in protect]
                    selectors = [p for p in range(position - window + 2, position + 1)] + [position]
                    order = torch.stack([keys[p] for p in candidates], dim=1)
                    query = torch.stack([queries[p] for p in selectors], dim=1)
                    count = keep_after - len(protect)
                    kept, _ = official_compress(order, query, 0, 0, count)
                    held = sorted(protect + [candidates[i] for i in kept[0]])
    return log


@pytest.mark.parametrize("mode", ["ratio", "cap"])
def test_schedules_match_the_reference(mode):
    torch.manual_seed(1)
    batch, q_heads, kv_heads, length, head_dim, count = 3, 4, 2, 12, 8, 60
    pad = torch.arange(length)[None, :] >= (length - torch.tensor([12, 7, 3]))[:, None]
    q, k, v = (torch.randn(batch, h, length, head_dim) for h in (q_heads, kv_heads, kv_heads))
    steps = [(torch.randn(batch, q_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim),
              torch.randn(batch, kv_heads, 1, head_dim)) for _ in range(count)]
    if mode == "ratio":
        policy = RPCPolicy(8, compress_every=10, window=3, ratio=2.5, budget_mode="ratio")
        sizes = dict(period=10, window=3, kept_per_cut=4)
    else:
        policy = RPCPolicy(20, compress_every=6, window=3)
        sizes = dict(period=6, window=3, kept_per_cut=None, budget=20, keep_after=14)
    held, _ = drive_layer(policy, q, k, v, pad, steps, head_dim ** -0.5)
    expected = reference_rpc(q, k, pad, steps, mode=mode, **sizes)
    for t in range(count):
        for b in range(batch):
            assert held[t][b][0] == held[t][b][1] == expected[t][b], (t, b)
    if mode == "ratio":  # the schedule compressed several times, past the budget
        assert max(len(held[t][b][0]) for t in range(count) for b in range(batch)) > 8


def test_cap_keeps_the_prompt_that_fits_and_the_newest():
    torch.manual_seed(2)
    batch, q_heads, kv_heads, length, head_dim = 1, 2, 1, 14, 4
    pad = torch.ones(batch, length, dtype=torch.bool)
    q, k, v = (torch.randn(batch, h, length, head_dim) for h in (q_heads, kv_heads, kv_heads))
    steps = [(torch.randn(batch, q_heads, 1, head_dim), torch.randn(batch, kv_heads, 1, head_dim),
              torch.randn(batch, kv_heads, 1, head_dim)) for _ in range(30)]
    policy = RPCPolicy(16, compress_every=4, window=3)  # a cut keeps 12: 9 prompt tokens and the 3 newest
    held, _ = drive_layer(policy, q, k, v, pad, steps, head_dim ** -0.5)
    for t, step in enumerate(held):
        positions = step[0][0]
        assert len(positions) <= 16
        assert set(range(length, length + t + 1)[-3:]) <= positions
        if t >= 2:  # cut at step 1 (after its attention): the prompt's first 9 tokens stay, the next 4 are gone
            assert set(range(9)) <= positions and not positions & set(range(9, 13))


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")


def test_ratio_schedule_records_its_peak_over_the_budget(qwen3):
    model, tokenizer = qwen3
    prompts = [[5 + (7 * i + 3 * n) % 300 for i in range(n)] for n in (9, 21)]
    engine = Engine(model, lambda: RPCPolicy(16, compress_every=8, window=2, ratio=4, budget_mode="ratio"), [],
                    tokenizer.pad_token_id)
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=60, ignore_eos=True), [0, 1])
    # 59 tokens stored: cuts at 10, 18, 26, ... generated held (2 kept per cut, R = 2)
    assert result.peak_slots == [n + ratio_peak(59, 8, 2, 2) for n in (9, 21)]
    assert min(result.peak_slots) > 16


@pytest.mark.parametrize("fields", [dict(budget=24, compress_every=8, window=4),
                                    dict(budget=24, compress_every=8, window=2, ratio=4, budget_mode="ratio")])
def test_rows_are_compressed_independently(qwen3, fields):
    """A row's tokens are the same alone, in a static batch and in continuous batching."""
    model, tokenizer = qwen3
    prompts = [[5 + (7 * i + 3 * n) % 300 for i in range(n)] for n in (7, 30, 19)]
    generation = GenerationConfig(max_new_tokens=48, ignore_eos=True)

    def engine(**config):
        return Engine(model, lambda: RPCPolicy(**fields), [], tokenizer.pad_token_id, EngineConfig(**config))

    alone = [engine().generate([p], generation, [0]).tokens[0] for p in prompts]
    assert engine().generate(prompts, generation, [0, 1, 2]).tokens == alone
    served = engine(batch_size=2, check_every=4, refill_rows=1, prefill_rows=1)
    finished = {s.index: s.tokens for r in served.serve(prompts, generation, [0, 1, 2]) for s in r.finished}
    assert [finished[i] for i in range(3)] == alone


def test_config_builds_the_policy():
    path = Path(__file__).resolve().parents[1] / "conf" / "method" / "rpc.yaml"
    fields = yaml.safe_load(path.read_text())
    assert fields.pop("name") == "rpc" and locate(fields.pop("_target_")) is RPCPolicy
    assert fields == method_defaults(RPCPolicy)
    policy = policy_of("rpc", 2048)
    sizes = (policy.keep_after, policy.newest_kept, policy.kept_per_cut, policy.shared_selection)
    assert sizes == (1024, 32, 256, True)
    assert not RPCPolicy(2048, aggregation="group").shared_selection


def test_small_budgets_shrink_the_interval_then_the_window():
    with pytest.warns(UserWarning, match="using 48"):
        policy = RPCPolicy(192)
    assert (policy.keep_after, policy.newest_kept) == (144, 32)
    with pytest.warns(UserWarning, match="no room for 32 newest tokens; using 15"):
        policy = RPCPolicy(40)
    assert (policy.keep_after, policy.newest_kept) == (30, 15)


@pytest.mark.parametrize("bad", [dict(budget_mode="target"), dict(pooling="x"), dict(aggregation="none"),
                                 dict(selectors="x"), dict(kernel=4), dict(ratio=0.5), dict(window=0),
                                 dict(compress_every=2, ratio=4), dict(budget=3)])
def test_invalid_settings(bad):
    with pytest.raises(UserError):
        RPCPolicy(**{"budget": 2048, **bad})
