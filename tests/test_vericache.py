"""VeriCache (`longflow.verify`): greedy output equal to the full cache's token for token, whatever the
drafting method, on the canary and the tiny random models; per-row rounds; the compressed cache back
in step after rounds (against the method decoding the committed tokens itself, for every method
config); a round that changes host state no row can be rolled back through fails; the run's
acceptance metrics; the config's checks and the run identity."""

from __future__ import annotations

import functools
import types

import pytest
import torch
from helpers import TEXTS, lkv_weights_file, method_variants, policy_of, synthetic_calibration, tiny_model

from baselines.keydiff import KeyDiffPolicy
from evals.canary.task import CanaryTask
from evals.configs import compose_config, model_spec
from evals.datasets import Item
from evals.metrics import summarize_verify
from evals.pipeline import Job, Setup
from evals.prompts import build_messages, render_prompt
from evals.store import run_name
from longflow.config import GenerationConfig, VerifyConfig
from longflow.engine import DecodeState, Engine
from longflow.errors import UserError
from longflow.models import eos_token_ids, load_model
from longflow.verify import RowState, block_attention

HORIZON = 6


@functools.cache
def canary():
    model, tokenizer = load_model(model_spec("canary"), torch.device("cpu"))
    programs = [p for p in CanaryTask().heldout() if p.steps <= 10][:2]
    prompts = [render_prompt(tokenizer, build_messages(Item(str(i), p.question(), str(p.answer)), "math"),
                             thinking=True) for i, p in enumerate(programs)]
    return model, tokenizer, prompts


@functools.cache
def tiny(family: str):
    model, tokenizer = tiny_model(family)
    return model, tokenizer, [tokenizer(text)["input_ids"] for text in TEXTS]


def engine_of(model, tokenizer, factory, verify: VerifyConfig | None = None, eos=None, **engine_fields) -> Engine:
    from longflow.config import EngineConfig
    eos = eos_token_ids(model, tokenizer) if eos is None else eos
    return Engine(model, factory, eos, tokenizer.pad_token_id, EngineConfig(**engine_fields), verify)


def verified(horizon: int = HORIZON, **fields) -> VerifyConfig:
    return VerifyConfig(name="vericache", horizon=horizon, **fields)


@functools.cache
def reference(which: str, max_new_tokens: int, ignore_eos: bool) -> list[list[int]]:
    """The full cache's greedy tokens."""
    model, tokenizer, prompts = canary() if which == "canary" else tiny(which)
    engine = engine_of(model, tokenizer, lambda: policy_of("vanilla", None))
    generation = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    return engine.generate(prompts, generation, [0] * len(prompts)).tokens


@pytest.mark.parametrize("method", ["h2o", "streaming", "longflow", "random_attention"])
@pytest.mark.parametrize("budget", [96, 192])
def test_the_canary_decodes_as_the_full_cache_whatever_drafts(method, budget):
    """Both items end with EOS inside a round (they stop at it, not at the limit)."""
    model, tokenizer, prompts = canary()
    engine = engine_of(model, tokenizer, lambda: policy_of(method, budget), verified())
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=260), [0] * len(prompts))
    assert result.tokens == reference("canary", 260, False)
    assert result.finish_reasons == ["eos", "eos"]
    stats = result.verify
    assert all(s["verify_rounds"] >= 1 and sum(s["accepted_histogram"]) == s["verify_rounds"] for s in stats)
    assert all(0 < s["drafted_tokens"] < len(tokens) for s, tokens in zip(stats, result.tokens, strict=True))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("method,budget", [("h2o", 8), ("tova", 12), ("keydiff", 16), ("streaming", 8)])
def test_random_tiny_models_decode_as_the_full_cache(family, method, budget):
    """Random weights: drafts are mostly rejected, so nearly every round restores and replays; rows
    of different prompt lengths."""
    model, tokenizer, prompts = tiny(family)
    factory = (lambda: policy_of(method, budget, compress_every=4)) if method == "keydiff" else (
        lambda: policy_of(method, budget))
    engine = engine_of(model, tokenizer, factory, verified(4))
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=20, ignore_eos=True), [0] * len(prompts))
    assert result.tokens == reference(family, 20, True)


def test_rows_advance_by_their_own_acceptance():
    """Row 1's prompt and output fit the budget, so its drafts are the full cache's and every round
    accepts all h; row 0 is compressed and rejects some. Both decode as the full cache."""
    model, tokenizer, _ = tiny("qwen3")
    prompts = [tokenizer(TEXTS[2])["input_ids"], tokenizer("hi")["input_ids"]]
    engine = engine_of(model, tokenizer, lambda: policy_of("h2o", 32), verified(4))
    generation = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    result = engine.generate(prompts, generation, [0, 0])
    full = engine_of(model, tokenizer, lambda: policy_of("vanilla", None)).generate(prompts, generation, [0, 0])
    assert result.tokens == full.tokens
    compressed, whole = result.verify
    assert whole["accepted_histogram"][-1] == whole["verify_rounds"]  # a = h in every round
    assert compressed["accepted_histogram"][-1] < compressed["verify_rounds"]
    assert compressed["verify_rounds"] > whole["verify_rounds"]


def test_eos_and_limits_inside_a_round_stop_the_row_there():
    """An EOS id that the output reaches mid-round, and row limits that end inside a round: the rows
    commit up to and with them, as the full cache does."""
    model, tokenizer, prompts = tiny("qwen3")
    plain = reference("qwen3", 20, True)
    eos = [plain[0][9]]  # the full cache stops row 0 there (or earlier, at its first occurrence)
    generation = GenerationConfig(max_new_tokens=20)
    limits = [20, 7, 13]
    full = engine_of(model, tokenizer, lambda: policy_of("vanilla", None), eos=eos)
    expected = full.generate(prompts, generation, [0, 0, 0], limits)
    engine = engine_of(model, tokenizer, lambda: policy_of("h2o", 8), verified(5), eos=eos)
    result = engine.generate(prompts, generation, [0, 0, 0], limits)
    assert result.tokens == expected.tokens and result.finish_reasons == expected.finish_reasons
    assert result.tokens[0][-1] == eos[0] and len(result.tokens[0]) <= 10


def test_continuous_batching_verifies_each_row():
    model, tokenizer, prompts = tiny("qwen3")
    engine = engine_of(model, tokenizer, lambda: policy_of("h2o", 8), verified(3), batch_size=2, refill_rows=1,
                       check_every=4)
    served = [s for round_ in engine.serve(prompts, GenerationConfig(max_new_tokens=20, ignore_eos=True), [0] * 3)
              for s in round_.finished]
    assert [s.tokens for s in sorted(served, key=lambda s: s.index)] == reference("qwen3", 20, True)
    assert all(s.verify["verify_rounds"] == sum(s.verify["accepted_histogram"]) >= 1 for s in served)


def test_a_full_cache_in_host_memory_gives_the_same_tokens():
    """On the CPU both placements are the same memory: this checks the staging and write-back path."""
    model, tokenizer, prompts = tiny("qwen3")
    engine = engine_of(model, tokenizer, lambda: policy_of("h2o", 8), verified(4, full_cache="host"))
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=20, ignore_eos=True), [0] * 3)
    assert result.tokens == reference("qwen3", 20, True)
    assert result.round_seconds.transfer > 0


# Each method at a budget and intervals small enough that the tiny model's 53-token prompt and 30
# outputs are compressed, several times for the interval methods; a method not listed runs at 16
# slots with its defaults (an interval method's interval then shrinks to a quarter of the budget).
# The horizon, 5, is prime to the intervals: a host count left at its drafted steps after a
# rollback is then off by a part of an interval, and cuts at other steps (at horizon 4, an
# interval of 4 hid CompressKV's unrestored per-layer counts).
AMS_SMALL = {"compress_every": 4, "window_size": 4, "min_seg_len": 2, "max_seg_len": 8, "min_keep_per_segment": 1,
             "n_sink": 2, "always_keep_last": 4}
ROLLBACK_SETTINGS = {
    "vanilla": (None, {}), "h2o": (8, {}), "vatp": (16, {"n_sink": 4}), "tova": (8, {}), "longflow": (8, {}),
    "streaming": (8, {"lf_n_sink": 4}), "keydiff": (12, {"compress_every": 4}), "rkv": (12, {"compress_every": 4}),
    "random_attention": (16, {"compress_every": 4}), "rpc": (16, {"compress_every": 4, "window": 4}),
    "infokv": (16, {"compress_every": 4, "window": 4}), "kara": (16, {"window": 8}),
    "expected_attention": (16, {"compress_every": 4, "n_queries": 8, "n_sink": 2}),
    "beaconkv": (24, {"keep_last": 4, "n_recent": 4, "n_beacons": 4, "buffer_size": 8, "keep_prompt": False}),
    "compresskv": (32, {"min_layer_budget": 8, "compress_every": 4}),  # + a calibration file of the model
    "lkv": (12, {}),  # + a weights file of the model
    **{name: (16, AMS_SMALL) for name in ("ams_tova", "ams_keydiff", "ams_rkv", "ams_longflow",
                                          "ams_expected_attention")},
}


@pytest.mark.parametrize("method,variant", [*method_variants(), ("vanilla", None)])
def test_after_its_rounds_the_compressed_cache_is_the_methods_own(method, variant, tmp_path):
    """The compressed cache after rounds that committed 30 tokens equals that of the method decoding
    the committed tokens itself, one ordinary step each (rollback and replay lose nothing): slots,
    per-slot states and every host value the policy holds (its per-row counts included)."""
    model, tokenizer, prompts = tiny("qwen3")
    config = model.config
    budget, fields = ROLLBACK_SETTINGS.get(method, (16, {}))
    fields = {**fields, **({} if variant is None else {"variant": variant})}
    if method == "compresskv":
        fields["calibration"] = synthetic_calibration(tmp_path, config.num_hidden_layers,
                                                      config.num_attention_heads)
    if method == "lkv":
        logits = torch.randn(config.num_hidden_layers, config.num_key_value_heads,
                             generator=torch.Generator().manual_seed(0))
        fields["weights"] = lkv_weights_file(tmp_path, config.num_hidden_layers, config.num_key_value_heads,
                                             config.head_dim, logits)
    prompt, horizon, limit = prompts[2], 5, 40
    generation = GenerationConfig(max_new_tokens=limit, ignore_eos=True)
    engine = engine_of(model, tokenizer, lambda: policy_of(method, budget, **fields), verified(horizon))
    input_ids, pad = engine.batch_inputs([prompt])
    cache = engine.new_cache(engine.policy_factory, 1, pad.shape[1], generation)
    full = engine.new_full_cache(1, pad.shape[1], generation)
    state = DecodeState(1, limit, engine.vocab, [0], engine.pad_id, engine.device, track_seen=False)
    engine.prefill(cache, state, input_ids, pad, generation, full)
    verifier = engine.verifier(cache, full, state, generation)
    while int(state.step) < 30:
        verifier.run_round()
    committed = state.out[0, :int(state.step)].tolist()

    own = engine.new_cache(engine.policy_factory, 1, pad.shape[1], generation)
    forced = DecodeState(1, limit, engine.vocab, [0], engine.pad_id, engine.device, track_seen=False)
    engine.prefill(own, forced, input_ids, pad, generation)
    for step, token in enumerate(committed[:-1]):
        own.policy.before_step(step)
        forced.token.fill_(token)
        engine.decode_one_token(own, forced, generation)
        own.policy.after_step(step)
    assert int(forced.positions) == int(state.positions)
    if budget is not None:  # some rounds rolled back and the method evicted: the comparison covers both
        assert int(verifier.accepted[0, :horizon].sum()) > 0
        assert max(int(slots.valid.sum(dim=-1).max()) for slots in own.policy.layers) < len(prompt) + len(committed) - 1
    for mine, theirs in zip(cache.policy.layers, own.policy.layers, strict=True):
        assert torch.equal(mine.positions, theirs.positions) and torch.equal(mine.valid, theirs.valid)
        torch.testing.assert_close(mine.keys, theirs.keys)
        for name in mine.state:
            torch.testing.assert_close(mine.state[name], theirs.state[name])
    verified_rows, own_rows = verifier.rows, RowState(own.policy, 1)
    (lists, shared), (own_lists, own_shared) = verified_rows.host_state(), own_rows.host_state()
    assert lists == own_lists and shared == own_shared
    assert [verified_rows.resolve(path) for path in lists] == [own_rows.resolve(path) for path in lists]


@pytest.mark.parametrize("count", ["of the batch", "per row in a dict"])
def test_host_state_no_row_can_be_rolled_back_through_fails_the_round(count):
    """A count the rows share, or a per-row count in a form RowState does not restore, changes in a
    round: the round raises, naming it, rather than decode with counts that kept the drafted steps."""

    class Counting(KeyDiffPolicy):
        def begin_decode(self, positions):
            super().begin_decode(positions)
            self.steps = 0 if count == "of the batch" else dict.fromkeys(range(self.spec.batch), 0)

        def after_step(self, step):
            super().after_step(step)
            if count == "of the batch":
                self.steps += 1
            else:
                self.steps.update((row, n + 1) for row, n in self.steps.items())

    model, tokenizer, prompts = tiny("qwen3")
    engine = engine_of(model, tokenizer, lambda: Counting(12, compress_every=4), verified(4))
    with pytest.raises(RuntimeError, match="keydiff: host state steps.* changed in a verify round"):
        engine.generate(prompts, GenerationConfig(max_new_tokens=12, ignore_eos=True), [0] * 3)


def test_row_state_restores_chosen_rows_only():
    model, tokenizer, prompts = tiny("qwen3")
    generation = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    engine = engine_of(model, tokenizer, lambda: policy_of("keydiff", 12, compress_every=4))
    input_ids, pad = engine.batch_inputs(prompts)
    cache = engine.new_cache(engine.policy_factory, 3, pad.shape[1], generation)
    state = DecodeState(3, 12, engine.vocab, [0] * 3, engine.pad_id, engine.device, track_seen=False)
    engine.prefill(cache, state, input_ids, pad, generation)
    rows = RowState(cache.policy, 3)
    before = [tensor.clone() for tensor in rows.saved_tensors]
    held = list(cache.policy.held)
    engine.decode_n_tokens(cache, state, generation, 6)  # a compression included
    after = [rows._get(owner, key).clone() for owner, key in rows.tensors]
    rows.restore_rows([0, 2])
    for old, new, (owner, key) in zip(before, after, rows.tensors, strict=True):
        live = rows._get(owner, key)
        assert torch.equal(live[[0, 2]], old[[0, 2]]) and torch.equal(live[1], new[1])
    assert [cache.policy.held[0], cache.policy.held[2]] == [held[0], held[2]]
    assert any(owner is cache.policy.layers[0] and key == "keys" for owner, key in rows.tensors)


@pytest.mark.parametrize("fused", [False, True])
def test_block_attention_is_causal_by_position(fused):
    """Against one query at a time over the slots up to its position (float64 truth); both paths
    (`fused`: SDPA with the mask, the CUDA one)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    positions = torch.arange(10).expand(2, 10).clone()
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :2] = False
    query_positions = torch.tensor([[5, 6, 7], [7, 8, 9]])
    out = block_attention(q, k, v, valid, positions, query_positions, 0.3, fused)  # [B, Lq, Hq, D]
    for b in range(2):
        for j in range(3):
            seen = valid[b] & (positions[b] <= query_positions[b, j])
            keys, values = k[b].repeat_interleave(2, dim=0)[:, seen], v[b].repeat_interleave(2, dim=0)[:, seen]
            probs = torch.softmax(torch.einsum("hd,hsd->hs", q[b, :, j].double(), keys.double()) * 0.3, dim=-1)
            torch.testing.assert_close(out[b, j].double(), torch.einsum("hs,hsd->hd", probs, values.double()),
                                       atol=1e-6, rtol=1e-5)


def test_acceptance_metrics_by_hand():
    records = [
        {"output_tokens": 10, "verify_rounds": 3, "accepted_histogram": [1, 0, 2], "drafted_tokens": 6},
        {"output_tokens": 5, "verify_rounds": 2, "accepted_histogram": [0, 1, 1], "drafted_tokens": 2},
        {"output_tokens": 7},  # copied from the full cache's run: no figures
    ]
    summary = summarize_verify(records)
    assert summary["verify_rounds"] == 5 and summary["accepted_histogram"] == [1, 1, 3]
    assert summary["accepted_per_round"] == pytest.approx((0 * 1 + 1 * 1 + 2 * 3) / 5)
    assert summary["compressed_only_share"] == pytest.approx(8 / 15)


@pytest.mark.parametrize("fields,needle", [
    ({"temperature": 0.7}, "greedy tokens only"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
])
def test_sampling_is_refused_in_one_line(fields, needle):
    with pytest.raises(UserError, match=needle):
        verified().check_generation(GenerationConfig(**fields))
    with pytest.raises(UserError, match=needle):
        Setup.from_config(compose_config(["verify=vericache", "generation=sampling", *(
            ["generation.temperature=0", "generation.repetition_penalty=1.2", "generation.n_samples=1"]
            if "repetition_penalty" in fields else [])]))


@pytest.mark.parametrize("fields,needle", [({"horizon": 0}, "verify.horizon must be positive"),
                                           ({"full_cache": "disk"}, "verify.full_cache must be one of"),
                                           ({"name": "medusa"}, "verify.name must be one of")])
def test_bad_verify_fields_are_refused(fields, needle):
    with pytest.raises(UserError, match=needle):
        VerifyConfig(**{"name": "vericache", **fields})


def identity_of(*overrides: str) -> dict:
    setup = Setup.from_config(compose_config(["method=h2o", "budget=96", *overrides]))
    job = Job(name="canary", kind="math", items=[], size=200, fingerprint="f")
    return setup.identity(job, types.SimpleNamespace(chat_template="t"))


def test_the_run_fingerprint_covers_the_verifier():
    from evals.fingerprint import code_record

    assert "longflow/verify.py" in code_record(policy_of("h2o", 96))["files"]


def test_the_identity_changes_only_when_verifying():
    plain = identity_of()
    assert "verify" not in plain  # the runs made before verification existed keep their directories
    cfg = compose_config(["method=h2o", "budget=96"])
    del cfg["verify"]
    job = Job(name="canary", kind="math", items=[], size=200, fingerprint="f")
    assert Setup.from_config(cfg).identity(job, types.SimpleNamespace(chat_template="t")) == plain
    verifying = identity_of("verify=vericache")
    assert verifying["verify"] == {"name": "vericache", "horizon": 25}
    assert identity_of("verify=vericache", "verify.full_cache=host") == verifying
    assert identity_of("verify=vericache", "verify.horizon=10") != verifying
    assert "__h2o+vericache__b96__" in run_name(verifying) and "__h2o__b96__" in run_name(plain)


@pytest.mark.gpu
def test_on_cuda_verification_gives_the_full_caches_tokens():
    """CUDA graphs for the draft, replay and verify steps; bf16 numerics of a multi-token forward
    against single-token steps may flip a near tie, so the canary in float32."""
    model, tokenizer = load_model(model_spec("canary"), torch.device("cuda"))
    _, _, prompts = canary()
    generation = GenerationConfig(max_new_tokens=260)
    full = engine_of(model, tokenizer, lambda: policy_of("vanilla", None)).generate(prompts, generation, [0, 0])
    for method in ("h2o", "longflow"):
        result = engine_of(model, tokenizer, lambda m=method: policy_of(m, 96), verified()).generate(
            prompts, generation, [0, 0])
        assert result.tokens == full.tokens and result.cuda_graph


def test_runs_store_acceptance_and_the_reports_show_it(tmp_path):
    """`python -m evals.run ... verify=vericache` end to end (continuous batching, the default), the
    vanilla run's text, then `--metric accepted_per_round` in the table and the acceptance figure."""
    from evals.pipeline import evaluate
    from evals.report.figures import acceptance_figure, plot_acceptance, table_points
    from evals.report.runs import collect
    from evals.report.table import build_table, write_table

    base = ["model=canary", "dataset=canary", "limit=2", "device=cpu", "generation.max_new_tokens=40",
            f"results_dir={tmp_path}"]
    full = evaluate(compose_config([*base, "method=vanilla"]))[0]
    outputs, accepted = {}, {}
    for method, budget in (("h2o", 32), ("h2o", 96), ("streaming", 32)):
        metrics = evaluate(compose_config([*base, f"method={method}", f"budget={budget}", "verify=vericache",
                                              "verify.horizon=8"]))[0]
        assert metrics["verify"] == "vericache" and metrics["verify_horizon"] == 8
        assert metrics["verify_rounds"] == sum(metrics["accepted_histogram"]) > 0
        assert 0 < metrics["compressed_only_share"] < 1 and 0 <= metrics["accepted_per_round"] <= 8
        outputs[method, budget] = (tmp_path / metrics["run_id"] / "generations.jsonl").read_text()
        accepted[method, budget] = metrics["accepted_per_round"]
    reference = (tmp_path / full["run_id"] / "generations.jsonl").read_text()
    texts = [sorted((r["id"], r["output"]) for r in map(__import__("json").loads, lines.splitlines()))
             for lines in (reference, *outputs.values())]
    assert all(text == texts[0] for text in texts)
    runs = collect(tmp_path)
    table = build_table(runs, "accepted_per_round")
    assert {"H2O + VeriCache", "StreamingLLM + VeriCache"} <= set(table.values.index.get_level_values("Method"))
    png, pdf = plot_acceptance(runs, tmp_path / "figures")
    assert png.read_bytes().startswith(b"\x89PNG") and pdf.read_bytes().startswith(b"%PDF")
    # The same figure drawn from the table's CSV alone (`--table`): the runs' own figures, line by line.
    write_table(table, tmp_path / "acceptance")
    figure = acceptance_figure(table_points(tmp_path / "acceptance.csv"), [8.0])
    lines = {line.get_label(): ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
             for line in figure.axes[0].lines}
    assert lines["H2O + VeriCache"] == ([32.0, 96.0], pytest.approx([accepted["h2o", 32], accepted["h2o", 96]]))
    assert lines["StreamingLLM + VeriCache"] == ([32.0], pytest.approx([accepted["streaming", 32]]))
    assert ([0.0, 1.0], [8.0, 8.0]) in lines.values()  # the horizon, across the panel
