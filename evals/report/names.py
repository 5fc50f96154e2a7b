"""Display names, and the paper's order, of the models, methods and datasets that run directories
name by their config keys: shared by the tables and the figures. A key without a display name is
shown as it is."""

from __future__ import annotations

import re

# Run keys -> the paper's column names, in the paper's column order. Aliases cover hub-style keys.
DATASET_NAMES = {
    "aime24": "AIME24", "aime25": "AIME25", "amc": "AMC", "amc23": "AMC", "gpqa": "GPQA",
    "gpqa_diamond": "GPQA", "gsm8k": "GSM8K", "math500": "MATH-500", "math-500": "MATH-500",
    "math_500": "MATH-500", "minerva": "Minerva", "minerva_math": "Minerva", "olympiad": "OlympiadBench",
    "olympiadbench": "OlympiadBench",
    # The canary suite's families (evals.canary.families), in its order.
    "canary_state": "state", "canary_lookup": "lookup", "canary_plan": "plan", "canary_redundant": "redundant",
    "canary_chain": "chain",
}
DATASET_ORDER = ["AIME24", "AIME25", "AMC", "GPQA", "GSM8K", "MATH-500", "Minerva", "OlympiadBench",
                 "state", "lookup", "plan", "redundant", "chain"]
# Method config names -> display names, in the table's row order (the LongFlow paper's methods, then
# the later ones, LongFlow last); a method not listed here shows its config name, after all of these.
METHOD_NAMES = {"vanilla": "FullKV", "streaming": "StreamingLLM", "h2o": "H2O", "vatp": "VATP",
                "rkv": "R-KV", "tova": "TOVA", "keydiff": "KeyDiff", "expected_attention": "Expected Attention",
                "ams_tova": "AMS (TOVA)", "ams_keydiff": "AMS (KeyDiff)",
                "ams_expected_attention": "AMS (Expected Attention)", "ams_rkv": "AMS (R-KV)",
                "ams_longflow": "AMS (LongFlow)", "rpc": "RPC", "random_attention": "Random Attention",
                "beaconkv": "BeaconKV", "infokv": "InfoKV", "kara": "Kara", "compresskv": "CompressKV",
                "lkv": "LKV", "longflow": "LongFlow"}
# conf/verify names -> display names: a run drafted by a method and checked by one of these is labelled
# "<method> + <name>" (a verify config not listed shows its config name).
VERIFY_NAMES = {"vericache": "VeriCache"}
VERIFIED = " + "  # between a drafting method's label and its verifier's name
# conf/model keys -> the names papers use (DeepSeek's distilled models without the "DeepSeek-").
MODEL_NAMES = {
    "qwen3_4b": "Qwen3-4B", "qwen3_8b": "Qwen3-8B", "r1_distill_llama_8b": "R1-Distill-Llama-8B",
    "r1_distill_qwen_1_5b": "R1-Distill-Qwen-1.5B", "r1_distill_qwen_7b": "R1-Distill-Qwen-7B",
    "r1_distill_qwen_14b": "R1-Distill-Qwen-14B",
}
DEFAULT_VARIANT = "paper"  # a method as its own paper defines it; other variants are named in labels
CAPPED = "cap"  # a method's `budget_mode` under the hard cap; other forms are named in labels


def dataset_name(key: str) -> str:
    return DATASET_NAMES.get(str(key).lower(), str(key))


def dataset_sort_key(name: str) -> tuple[int, str]:
    """The paper's column order for known datasets (display names), then the others by name."""
    return (DATASET_ORDER.index(name), "") if name in DATASET_ORDER else (len(DATASET_ORDER), name)


def method_rank(method: str) -> int:
    """Position in the table's method order; unknown methods after all known ones (then by name)."""
    order = list(METHOD_NAMES)
    return order.index(method) if method in order else len(order)


def method_label(method: str, variant: str, budget_mode: str | None = None) -> str:
    """The display name, with the variant when not the paper's and the budget form when it is not the
    cap (R-KV's `target`, RPC's `ratio`: runs whose peak may exceed their budget)."""
    name = METHOD_NAMES.get(method, method)
    marks = [mark for mark, usual in ((variant, DEFAULT_VARIANT), (budget_mode, CAPPED))
             if isinstance(mark, str) and mark != usual]
    return f"{name} ({', '.join(marks)})" if marks else name


def verified_label(label: str, verify: str) -> str:
    """The label of a method drafting for a verifier (`verify=vericache`): "H2O + VeriCache"."""
    return f"{label}{VERIFIED}{VERIFY_NAMES.get(verify, verify)}"


def parse_method_label(label: str) -> tuple[str, str, str | None, str | None]:
    """The inverse of the labels tables print (`method_label`, `verified_label`): (method, variant,
    budget mode, verify), config names where the display names are known, else the names as they
    are. Of the marks in the last parentheses, the first is the variant and a second the budget
    mode; a lone mark is read as the variant (a label does not say which)."""
    verify = None
    drafted, separator, verifier = label.rpartition(VERIFIED)
    if separator:
        label, verify = drafted, {name: key for key, name in VERIFY_NAMES.items()}.get(verifier, verifier)
    methods = {name: method for method, name in METHOD_NAMES.items()}
    if label in methods:  # whole names first: "AMS (TOVA)" is a name, "R-KV (lf_repo)" a name and a mark
        return methods[label], DEFAULT_VARIANT, None, verify
    name, opening, marks = label.rpartition(" (")
    if not (opening and marks.endswith(")")):
        return label, DEFAULT_VARIANT, None, verify
    variant, _, mode = marks[:-1].partition(", ")
    return methods.get(name, name), variant, mode or None, verify


def model_name(key: str) -> str:
    return MODEL_NAMES.get(key, key)


def model_size(key: str) -> float | None:
    """Billions of parameters, read from the display name ("R1-Distill-Qwen-1.5B": 1.5); None when it
    does not say."""
    match = re.search(r"(\d+(?:\.\d+)?)B$", model_name(key))
    return float(match[1]) if match else None
