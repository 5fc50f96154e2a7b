"""CompressKV: the official layer-budget allocation and prompt selection transcribed plainly, the
selection's use of its heads only, the total budget on a model, and the calibration command's parts.

Greedy tokens equal the full cache's with a large budget, and the budget holds at every step, for
the default config (no calibration file): tests/test_methods.py. Here the same with a synthetic
calibration file (random head and layer scores), made by the tests.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import (
    LONG_TEXTS,
    REPO,
    capped,
    drive_layer,
    generate,
    method_defaults,
    policy_of,
    synthetic_calibration,
    tiny_model,
)

from baselines.compresskv import CompressKVPolicy, layer_budgets, srh_scores
from baselines.vanilla import VanillaPolicy
from evals.calibrate import layer_error, retrieval_mass, write_calibration
from longflow.calibration import load_calibration
from longflow.config import EngineConfig, GenerationConfig
from longflow.engine import Engine
from longflow.errors import UserError
from longflow.methods import locate
from longflow.models import eos_token_ids

pytestmark = pytest.mark.filterwarnings("ignore:.*leaves no room:UserWarning")


def official_allocation(layer_ratio, total_budget, min_tokens, max_tokens):
    """`error_aware_layer_budget_allocation` (longbench/pred_compresskv.py:18-50), in plain Python."""
    base = [float(min_tokens)] * len(layer_ratio)
    remaining = total_budget - sum(base)
    budget = [b + round(r * remaining) for b, r in zip(base, layer_ratio, strict=True)]
    budget = [min(max(b, min_tokens), max_tokens) for b in budget]
    diff = int(total_budget - sum(budget))
    while diff != 0:
        if diff > 0:
            candidates = [i for i in range(len(budget)) if budget[i] < max_tokens]
            if not candidates:
                break
            for i in sorted(candidates, key=lambda i: -layer_ratio[i]):
                if budget[i] < max_tokens:
                    budget[i] += 1
                    diff -= 1
                    if diff == 0:
                        break
        else:
            candidates = [i for i in range(len(budget)) if budget[i] > min_tokens]
            if not candidates:
                break
            for i in sorted(candidates, key=lambda i: layer_ratio[i]):
                if budget[i] > min_tokens:
                    budget[i] -= 1
                    diff += 1
                    if diff == 0:
                        break
    return [int(b) for b in budget]


@pytest.mark.parametrize("seed", range(40))
def test_layer_budgets_follow_the_official_allocation_sum_to_the_total_and_keep_their_bounds(seed):
    rng = random.Random(seed)
    layers, budget = rng.choice([2, 4, 28, 36]), rng.choice([40, 96, 128, 1024])
    raw = [rng.random() ** rng.choice([1, 4]) for _ in range(layers)]
    scores = [x / sum(raw) for x in raw]
    low, high = 32, 3 * budget
    budgets = layer_budgets(scores, budget * layers, low, high)
    assert budgets == official_allocation(scores, budget * layers, low, high)
    assert sum(budgets) == budget * layers
    assert all(low <= b <= high for b in budgets)


def test_layer_budgets_by_hand():
    # 32 + round(r * 272) = 59, 86, 114, 141, the last clipped to 120: 21 short, given one per pass to
    # the layers below 120, most important first: 6 passes to 65, 92, 120, then 66, 93 and 94.
    assert layer_budgets([0.1, 0.2, 0.3, 0.4], 400, 32, 120) == [66, 94, 120, 120]
    assert layer_budgets([0.5, 0.5], 100, 32, 40) == [40, 40]  # every layer at its bound: short of the total


def official_prompt_selection(q, k, heads, capacity, window=8, kernel=5):
    """`compresskvCluster.update_kv` (methods/compresskv/snapkv_utils.py:47-84) for one row, no padding:
    the kept prompt positions."""
    q_heads, length, head_dim = q.shape[1], q.shape[2], q.shape[3]
    group = q_heads // k.shape[1]
    keys = k[:, heads // group]  # get_important_head_kv
    logits = torch.matmul(q[:, heads, -window:], keys.transpose(2, 3)) / math.sqrt(head_dim)
    mask = torch.full((window, window), torch.finfo(logits.dtype).min)
    cond = torch.arange(window)
    mask.masked_fill_(cond < (cond + 1).view(window, 1), 0)
    logits[:, :, -window:, -window:] += mask[None, None]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    sums = probs[:, :, -window:, :-window].sum(dim=-2)
    pooled = F.avg_pool1d(sums, kernel_size=kernel, padding=kernel // 2, stride=1).mean(dim=1)
    top = pooled.topk(capacity - window, dim=-1).indices[0]
    return set(top.tolist()) | set(range(length - window, length))


@pytest.mark.parametrize("seed", range(4))
def test_prompt_selection_matches_the_official_rule(tmp_path, seed):
    torch.manual_seed(seed)
    q_heads, kv_heads, length, head_dim, capacity = 8, 2, 40, 16, 20
    q = 2 * torch.randn(1, q_heads, length, head_dim)
    k, v = torch.randn(2, 1, kv_heads, length, head_dim)
    head_scores = torch.rand(1, q_heads)
    path = tmp_path / "synthetic.pt"
    write_calibration(path, head_scores, torch.ones(1))
    heads = head_scores[0].argsort(descending=True)[:4]
    # The budget counts the first decode token's slot: capacity + 1 keeps `capacity` prompt tokens.
    policy = CompressKVPolicy(capacity + 1, calibration=str(path))
    held, _ = drive_layer(policy, q, k, v, torch.ones(1, length, dtype=torch.bool),
                          [(torch.randn(1, q_heads, 1, head_dim), torch.randn(1, kv_heads, 1, head_dim),
                            torch.randn(1, kv_heads, 1, head_dim))], head_dim ** -0.5)
    expected = official_prompt_selection(q, k, heads, capacity)
    assert held[0][0][0] - {length} == expected and held[0][0][1] == held[0][0][0]


def test_only_the_selecting_heads_choose_and_every_kv_head_shares_the_choice():
    torch.manual_seed(0)
    rows, q_heads, kv_heads, window, slots, head_dim = 2, 8, 2, 8, 30, 16
    queries = torch.randn(rows, q_heads, window, head_dim)
    keys = torch.randn(rows, kv_heads, slots, head_dim)
    positions = torch.arange(slots).expand(rows, kv_heads, -1)
    query_positions = torch.arange(slots - window, slots).expand(rows, -1)
    held = torch.ones(rows, kv_heads, slots, dtype=torch.bool)
    every = torch.ones(rows, window, dtype=torch.bool)
    heads = torch.tensor([5, 1, 6, 2])
    scores = srh_scores(queries, query_positions, every, keys, positions, held, heads, 0.25, 5, "avgpool")
    others = queries.clone()
    others[:, [0, 3, 4, 7]] = torch.randn(rows, 4, window, head_dim)
    assert torch.equal(scores, srh_scores(others, query_positions, every, keys, positions, held, heads, 0.25, 5,
                                          "avgpool"))
    assert torch.equal(scores[:, 0], scores[:, 1])
    assert torch.isinf(scores[..., -window:]).all()
    changed = queries.clone()
    changed[:, 5] = torch.randn(rows, window, head_dim)
    assert not torch.equal(scores, srh_scores(changed, query_positions, every, keys, positions, held, heads, 0.25,
                                              5, "avgpool"))


def test_total_budget_on_a_model_holds_and_a_covering_budget_is_the_full_cache(tmp_path):
    tiny = tiny_model("qwen3")
    config = tiny[0].config
    calibration = synthetic_calibration(tmp_path, config.num_hidden_layers, config.num_attention_heads)
    made = []

    def factory():
        made.append(capped(CompressKVPolicy)(48, calibration=calibration, min_layer_budget=16))
        return made[-1]

    prompts, result = generate(tiny, factory, LONG_TEXTS, max_new_tokens=120)
    capacities = [slots.slots for slots in made[0].layers]
    assert sum(capacities) == 48 * len(capacities) and len(set(capacities)) > 1
    assert all(16 <= c <= 3 * 48 for c in capacities)
    assert max(result.peak_slots) == max(capacities)  # the largest layer, full
    texts = ["What is 2 + 3?", "Compute the sum of the first ten odd numbers, please."]
    _, full = generate(tiny, VanillaPolicy, texts, max_new_tokens=24)
    budget = max(len(tiny[1](t)["input_ids"]) for t in texts) + 24
    _, result = generate(tiny, lambda: CompressKVPolicy(budget, calibration=calibration), texts, max_new_tokens=24)
    assert result.tokens == full.tokens


SHORT = "What is 2 + 3? Answer briefly."  # 30 tokens on the tiny models
LONG = "Compute the sum of the first ten odd numbers, please, and then explain each step in detail to me now."  # 101


def skewed_calibration(tmp_path, config) -> str:
    """Layer scores 0.9 and 0.1: at a budget of 64, layer 0's is 102 slots, more than the short
    prompt's padded length + 64 new tokens (96), so a cap by that length would bind alone, not batched."""
    path = tmp_path / "skewed.pt"
    generator = torch.Generator().manual_seed(0)
    write_calibration(path, torch.rand(config.num_hidden_layers, config.num_attention_heads, generator=generator),
                      torch.tensor([0.9, 0.1]))
    return str(path)


def test_a_rows_capacities_and_tokens_do_not_depend_on_its_batch_mates(tmp_path):
    """The short prompt alone, batched with the long one, and served from a queue with it (rows
    allocated for the queue's longest prompt): the same layer capacities, the official allocation,
    and the same tokens."""
    model, tokenizer = tiny_model("qwen3")
    calibration = skewed_calibration(tmp_path, model.config)
    made = []

    def factory():
        made.append(CompressKVPolicy(64, calibration=calibration, min_layer_budget=16, compress_every=8))
        return made[-1]

    prompts = [tokenizer(text)["input_ids"] for text in (SHORT, LONG)]
    generation = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    eos = eos_token_ids(model, tokenizer)
    engine = Engine(model, factory, eos, tokenizer.pad_token_id)
    alone = engine.generate(prompts[:1], generation, [0])
    assert [slots.slots for slots in made[-1].layers] == [102, 26]
    paired = engine.generate(prompts, generation, [0, 0])
    assert [slots.slots for slots in made[-1].layers] == [102, 26]
    serving = Engine(model, factory, eos, tokenizer.pad_token_id, EngineConfig(batch_size=1))
    served = {s.index: s.tokens for round_ in serving.serve(prompts, generation, [0, 0]) for s in round_.finished}
    assert all([slots.slots for slots in policy.layers] == [102, 26] for policy in made)
    assert paired.tokens[0] == alone.tokens[0] == served[0]
    assert max(paired.peak_slots) > 64  # layer 0 held more than the budget: the allocation is not uniform


def test_a_budget_covering_a_row_decodes_it_as_the_full_cache_beside_a_row_it_does_not_cover(tmp_path):
    """The budget is the short prompt + max_new_tokens; the long prompt alone exceeds it."""
    model, tokenizer = tiny_model("qwen3")
    calibration = skewed_calibration(tmp_path, model.config)
    prompts = [tokenizer(text)["input_ids"] for text in (SHORT, LONG)]
    generation = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    budget = len(prompts[0]) + 40
    assert len(prompts[1]) > budget
    eos = eos_token_ids(model, tokenizer)
    full = Engine(model, VanillaPolicy, eos, tokenizer.pad_token_id).generate(prompts, generation, [0, 0])
    engine = Engine(model, lambda: CompressKVPolicy(budget, calibration=calibration), eos, tokenizer.pad_token_id)
    for batch in (prompts, prompts[:1]):
        assert engine.generate(batch, generation, [0] * len(batch)).tokens[0] == full.tokens[0]


def test_a_calibration_file_for_another_model_is_one_user_error(tmp_path):
    calibration = synthetic_calibration(tmp_path, 3, 8)
    with pytest.raises(UserError, match="head_scores has shape"):
        generate(tiny_model("qwen3"), lambda: CompressKVPolicy(40, calibration=calibration), LONG_TEXTS,
                 max_new_tokens=2)
    with pytest.raises(UserError, match="not found"):
        CompressKVPolicy(40, calibration=str(tmp_path / "missing.pt"))


def test_retrieval_mass_is_the_mass_on_earlier_copies_of_each_output_token():
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    ids = torch.tensor([5, 6, 7, 5, 8, 6, 5, 7, 9])  # prompt of 4, then 5 output tokens
    prompt, length = 4, len(ids) - 1
    queries, keys = torch.randn(heads, length, dim), torch.randn(kv_heads, length, dim)
    expected = torch.zeros(heads)
    for t in range(length - prompt + 1):
        row = prompt - 1 + t
        for h in range(heads):
            probs = torch.softmax(queries[h, row] @ keys[h // 2, :row + 1].T * 0.3, dim=0)
            expected[h] += sum(probs[j] for j in range(row + 1) if ids[j] == ids[row + 1])
    torch.testing.assert_close(retrieval_mass(queries, keys, ids, prompt, 0.3), expected)


def test_layer_error_is_zero_when_the_budget_holds_the_context_and_positive_when_it_cuts():
    torch.manual_seed(0)
    heads, kv_heads, length, dim = 4, 2, 40, 8
    q, k, v = torch.randn(heads, length, dim), torch.randn(kv_heads, length, dim), torch.randn(kv_heads, length, dim)
    o_proj = torch.nn.Linear(heads * dim, 16, bias=False)
    steps = list(range(20, length))
    assert layer_error(q, k, v, o_proj, torch.tensor([0, 1]), steps, length, 0.35) == 0.0
    assert layer_error(q, k, v, o_proj, torch.tensor([0, 1]), steps, 12, 0.35) > 0.0


def test_a_written_calibration_file_loads():
    path = REPO / "results" / "calibration" / "compresskv" / "canary-v1.pt"
    if not path.exists():
        pytest.skip("the canary's calibration file is not committed")
    tensors = load_calibration(str(path), "compresskv", ("head_scores", "layer_scores"))
    assert tensors["head_scores"].shape == (4, 8) and tensors["layer_scores"].shape == (4,)
    torch.testing.assert_close(tensors["layer_scores"].sum(), torch.tensor(1.0))


def test_config():
    fields = yaml.safe_load((REPO / "conf" / "method" / "compresskv.yaml").read_text())
    assert fields.pop("name") == CompressKVPolicy.name and locate(fields.pop("_target_")) is CompressKVPolicy
    assert fields.pop("budget_scope") == "total"
    assert fields == method_defaults(CompressKVPolicy)
    assert isinstance(policy_of("compresskv", 64), CompressKVPolicy)


def test_a_run_knows_the_calibration_it_read(tmp_path):
    """The code fingerprint covers the file a policy's field names: a run resumed after the
    calibration was remade under the same path is refused like one resumed by edited code."""
    from evals.fingerprint import code_record

    path = synthetic_calibration(tmp_path, 2, 4, seed=0)
    before = code_record(CompressKVPolicy(16, calibration=path))
    assert str(Path(path).resolve()) in before["files"]
    synthetic_calibration(tmp_path, 2, 4, seed=1)  # the same path, other scores
    after = code_record(CompressKVPolicy(16, calibration=path))
    assert after["fingerprint"] != before["fingerprint"]
    assert code_record(CompressKVPolicy(16))["fingerprint"] != before["fingerprint"]
