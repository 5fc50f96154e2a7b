"""Model and tokenizer loading: from the hub, or from an architecture with random weights.

A model config carries its hub id and its architecture (the fields of the hub's config.json that
shape the network), so the same model can be built offline with random weights: the tiny models of
the tests and the demo, and full-size architectures for speed benchmarks on a GPU.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from longflow.cache import ATTENTION_NAME
from longflow.config import check_types
from longflow.errors import UserError
from longflow.tokenizer import CHAT_FORMATS, build_tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LARGE_ON_CPU = 1e9  # parameters above which decoding on the CPU takes hours per long output

logger = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelSpec:
    """What to load. `weights`: "hub" (pretrained from `hub_id`: a hub id, or a local folder written by
    `save_pretrained`, such as a fine-tuned checkpoint) or "random" (built from `architecture`)."""

    name: str
    hub_id: str
    architecture: dict = field(default_factory=dict)
    revision: str = "main"
    weights: str = "hub"
    chat_format: str = "qwen3"
    thinks: bool = True
    dtype: str = "bfloat16"
    init_seed: int = 0
    sampling_top_k: int = 0  # the family's recommended top_k when sampling (Qwen3: 20); 0 = off

    def __post_init__(self):
        check_types(self, "model")
        if not isinstance(self.architecture, dict):
            raise UserError(f"model.architecture must be a mapping, got {self.architecture!r}")
        if self.weights not in ("hub", "random"):
            raise UserError(f"model.weights must be 'hub' or 'random', got {self.weights!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"model.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.chat_format not in CHAT_FORMATS:
            raise UserError(f"model.chat_format must be one of {sorted(CHAT_FORMATS)}, got {self.chat_format!r}")
        if self.weights == "random" and "model_type" not in self.architecture:
            raise UserError(f"model {self.name!r}: weights=random needs architecture.model_type")


def checkpoint_location(hub_id: str) -> str:
    """`hub_id` as `from_pretrained` should get it. A relative path that is no folder under the working
    directory but one under the project root (the canary's `evals/canary/model`) becomes that folder,
    so that configs name committed checkpoints without an absolute path and runs work from any
    directory; anything else (a hub id, an absolute or existing path) is returned as it is."""
    path = Path(hub_id).expanduser()
    if path.is_absolute() or path.is_dir():
        return str(path)
    return str(PROJECT_ROOT / path) if (PROJECT_ROOT / path).is_dir() else hub_id


def check_device(device: str) -> None:
    if not isinstance(device, str) or re.fullmatch(r"auto|cpu|cuda(?::\d+)?", device) is None:
        raise UserError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")


def resolve_device(device: str) -> torch.device:
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device!r} was asked for but no CUDA GPU is visible (use device=cpu)")
    return torch.device(device)


def model_config(spec: ModelSpec):
    """The model's transformers config, without its weights: its architecture for random weights,
    else its folder's or the hub's config.json; None when that cannot be had here (`load_model`
    then says why)."""
    try:
        if spec.weights == "random":
            return AutoConfig.for_model(**spec.architecture)
        return AutoConfig.from_pretrained(checkpoint_location(spec.hub_id), revision=spec.revision)
    except (OSError, ValueError):
        return None


def context_length(spec: ModelSpec) -> int | None:
    """The model's positions (`max_position_embeddings`), from its config; None without one."""
    config = model_config(spec)
    return None if config is None else getattr(config.get_text_config(), "max_position_embeddings", None)


def parameter_count(spec: ModelSpec) -> int | None:
    """The model's parameters, counted on the meta device from its config (a fraction of a second,
    no memory): what an 8B model costs is known before its 16 GB are read. None without a config."""
    config = model_config(spec)
    if config is None:
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).num_parameters()


def check_fits_device(spec: ModelSpec, device: torch.device, asked: str, cpu_option: str = "device=cpu") -> None:
    """Before the weights load: a model of over `LARGE_ON_CPU` parameters that is to decode on the
    CPU is refused unless the CPU was asked for (`asked`, the `device` setting), and warned about
    when it was: device=auto on a machine without a visible GPU would read all its weights into
    host memory (16 GB for an 8B model, enough to get the machine's processes killed), then take
    hours per item."""
    parameters = parameter_count(spec) if device.type == "cpu" else None
    if parameters is None or parameters <= LARGE_ON_CPU:
        return
    gigabytes = parameters * DTYPES[spec.dtype].itemsize / 1e9
    size = f"{parameters / 1e9:.1f}B parameters, {gigabytes:.0f} GB in {spec.dtype}"
    if asked != "cpu":
        raise UserError(f"model {spec.name} ({size}) would run on the CPU: device={asked} found no GPU here; run it "
                        f"on a GPU machine, or pass {cpu_option} to load it into this machine's memory anyway")
    logger.warning("model %s (%s) runs on the CPU: expect hours per item", spec.name, size)


def load_model(spec: ModelSpec, device: torch.device) -> tuple[PreTrainedModel, object]:
    """Returns (model in eval mode on `device` with the `kv_policy` attention, tokenizer)."""
    dtype = DTYPES[spec.dtype]
    if spec.weights == "random":
        config = AutoConfig.for_model(**spec.architecture)
        tokenizer = build_tokenizer(config.vocab_size, spec.chat_format)
        # The architecture's default special ids (Llama's eos=2, say) mean nothing to this tokenizer.
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(spec.init_seed)
        # Built directly on the device: initialising an 8B model on the CPU first takes minutes.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    else:
        location = checkpoint_location(spec.hub_id)
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, revision=spec.revision)
            # device_map puts each weight on the device as it is read: an 8B model never takes a
            # second copy in host memory.
            model = AutoModelForCausalLM.from_pretrained(
                location, revision=spec.revision, dtype=dtype, device_map=str(device)
            )
        except OSError as error:
            raise UserError(
                f"cannot load {spec.hub_id!r} (revision {spec.revision}) as a local checkpoint folder, from "
                f"the hub or from its cache: {str(error).splitlines()[0]} -- model.hub_id takes a hub id or a "
                "folder written by save_pretrained; model.weights=random builds the architecture instead"
            ) from error
    model.set_attn_implementation(ATTENTION_NAME)
    model.eval()
    return model, tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer) -> list[int]:
    """Every id that ends a generation: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)
