"""LoRA adapters into a rank: a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
or the same config and tensors given in memory) checked against this model and installed in one slot
of every linear it targets, all or nothing.

``AdapterConfig.from_peft`` reads and checks the config (what the engine can serve: plain LoRA and
rsLoRA on the Llama family's linears, per-module ranks and alphas; DoRA, ``modules_to_save``, LoRA
biases and embedding or LM-head targets refused, saying so). ``plan_adapter`` maps every
``...<module>.lora_A.weight`` / ``lora_B.weight`` to its linear, checks shapes against the base
weights, finiteness and the rank limit, and slices this rank's part; ``install`` puts a plan in a
slot, ``remove`` empties one. Nothing touches the model until the whole adapter is planned.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from rollout.layers.linear import ColumnParallelLinear, RowParallelLinear
from rollout.layers.lora import LORA_DTYPE, LoraPiece, LoraSlots
from rollout.weights.loader import WeightLoadError, nonfinite_names
from rollout.weights.safetensors_io import PinnedFolder, SafetensorsFolder

ADAPTER_CONFIG = "adapter_config.json"

# the Llama family's linears, by their Hugging Face module names
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
_PREFIX = "base_model.model."  # peft's wrapper, in the names it saves


class LoraError(WeightLoadError):
    """An adapter this engine cannot serve, or one that does not fit the model: nothing was loaded."""


def _pattern_key(patterns: dict, module: str) -> Optional[str]:
    """peft's rule for ``rank_pattern`` / ``alpha_pattern`` keys: a key matches a module whose name
    ends with it (after a dot) as a regular expression."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine needs of a PEFT LoRA config; the rank of each module is its tensors'."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    alpha_pattern: dict = field(default_factory=dict)
    target_modules: Any = None  # as peft wrote it (a list, a regex string, "all-linear"): reported only

    @staticmethod
    def from_peft(cfg: Any) -> AdapterConfig:
        if not isinstance(cfg, dict):
            raise LoraError("adapter_config.json must hold a JSON object (peft's LoraConfig)")
        peft_type = cfg.get("peft_type", "LORA")
        peft_type = str(getattr(peft_type, "value", peft_type)).upper()  # peft's PeftType enum, or its value
        if peft_type != "LORA":
            raise LoraError(f"peft_type {cfg.get('peft_type')!r}: only LoRA adapters are served")
        refusals = [
            (cfg.get("use_dora"), "use_dora=true: DoRA adapters are not supported (train with use_dora=False)"),
            (cfg.get("modules_to_save"), f"modules_to_save={cfg.get('modules_to_save')!r}: an adapter that also "
                                         "trains whole modules is not supported; only LoRA matrices are served"),
            (cfg.get("lora_bias"), "lora_bias=true: LoRA biases are not supported"),
            (cfg.get("bias", "none") not in ("none", None), f"bias={cfg.get('bias')!r}: only bias='none' adapters "
                                                            "are supported"),
            (cfg.get("fan_in_fan_out"), "fan_in_fan_out=true is for GPT-2's Conv1D layers, not the Llama family"),
            (cfg.get("layer_replication"), "layer_replication is not supported"),
            (cfg.get("trainable_token_indices"), "trainable_token_indices (embedding targets) is not supported"),
            (cfg.get("use_qalora"), "QA-LoRA is not supported"),
            (cfg.get("alora_invocation_tokens"), "activated LoRA (alora_invocation_tokens) is not supported"),
        ]
        for bad, why in refusals:
            if bad:
                raise LoraError(why)
        r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise LoraError(f"r={r!r}: the rank must be an integer >= 1")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
            raise LoraError(f"lora_alpha={alpha!r}: must be a finite number")
        pattern = cfg.get("alpha_pattern") or {}
        if not isinstance(pattern, dict) or not all(isinstance(v, (int, float)) for v in pattern.values()):
            raise LoraError("alpha_pattern must map module name patterns to numbers")
        return AdapterConfig(r=r, lora_alpha=float(alpha), use_rslora=bool(cfg.get("use_rslora", False)),
                             alpha_pattern=dict(pattern), target_modules=cfg.get("target_modules"))

    def scale(self, module: str, rank: int) -> float:
        """peft's scaling of ``module`` (its full name) at this rank: alpha / r, or alpha / sqrt(r)."""
        key = _pattern_key(self.alpha_pattern, module)
        alpha = float(self.alpha_pattern[key]) if key is not None else self.lora_alpha
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@dataclass
class AdapterPlan:
    """A checked adapter, this rank's parts, already in the form the linears hold: (linear, (``a``,
    ``bt``)) per targeted linear (``LoraSlots.fuse``)."""

    items: list[tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]]
    modules: list[str]  # the Hugging Face modules it targets
    max_rank: int

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + bt.numel() * bt.element_size() for _, (a, bt) in self.items)


def module_name(tensor_name: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (the module's name in the
    base model, "A" or "B"); names peft gives other parts of an adapter are refused, saying what they are."""
    name = tensor_name[len(_PREFIX):] if tensor_name.startswith(_PREFIX) else tensor_name
    m = _TENSOR.match(name)
    if m is None:
        if "lora_embedding_" in name or "embed_tokens" in name or "lm_head" in name:
            raise LoraError(f"{tensor_name}: LoRA on the embedding or the LM head is not supported")
        if "lora_magnitude_vector" in name:
            raise LoraError(f"{tensor_name}: a DoRA magnitude vector (DoRA adapters are not supported)")
        if "modules_to_save" in name:
            raise LoraError(f"{tensor_name}: modules_to_save weights are not supported")
        raise LoraError(f"{tensor_name}: not a LoRA matrix (expected <module>.lora_A.weight or "
                        "<module>.lora_B.weight)")
    return m.group("module"), m.group("ab")


def plan_adapter(model: nn.Module, name_map: dict, config: AdapterConfig, named_tensors,
                 max_rank: int, device: torch.device, max_bytes: Optional[int] = None) -> AdapterPlan:
    """Check every tensor of an adapter against the model and slice this rank's part (copies in
    fp32 on ``device``), at most ``max_bytes`` of them; raises ``LoraError`` naming the first problem."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        module, ab = module_name(name)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise LoraError(f"{name}: must be a floating-point tensor")
        if ab in pairs.setdefault(module, {}):
            raise LoraError(f"{name}: given twice")
        pairs[module][ab] = tensor
    if not pairs:
        raise LoraError("the adapter holds no LoRA matrices")
    bad = nonfinite_names((f"{module}.lora_{k}.weight", t) for module, ab in pairs.items() for k, t in ab.items())
    if bad:
        raise LoraError(f"{bad[0]} holds non-finite values" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    by_layer: dict[nn.Module, dict[int, LoraPiece]] = {}
    top = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{module}: lora_{'B' if 'A' in ab else 'A'}.weight is missing")
        short = module.rsplit(".", 1)[-1]
        if short in ("lm_head", "embed_tokens"):
            raise LoraError(f"{module}: LoRA on the embedding or the LM head is not supported")
        target = name_map.get(f"{module}.weight")
        if short not in LORA_MODULES or target is None:
            raise LoraError(f"{module}: not a linear this model can adapt (LoRA targets are "
                            f"{', '.join(LORA_MODULES)} of model.layers.N)")
        layer = model.get_submodule(target.param_name.rsplit(".", 1)[0])
        if not isinstance(getattr(layer, "lora", None), LoraSlots):
            raise LoraError(f"{module}: this linear takes no adapter")
        a, b = ab["A"], ab["B"]
        out_features, in_features = target.param.shard_shape(target.param, target.shard_id)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and "
                            f"[out, r] of one rank r")
        rank = a.shape[0]
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoraError(f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base weight "
                            f"[{out_features}, {in_features}] (an adapter trained on another model?)")
        if rank > max_rank:
            raise LoraError(f"{module}: rank {rank} exceeds the engine's max_lora_rank={max_rank}; raise it")
        # this rank's part, sliced as the base weight is (``target.slice``): A's input columns of a
        # row-parallel linear, B's output rows of a column-parallel one
        if isinstance(layer, RowParallelLinear):
            piece, a = 0, target.slice.source(a)
        elif isinstance(layer, ColumnParallelLinear):
            piece, b = layer.lora_piece(target.shard_id), target.slice.source(b)
        else:
            raise LoraError(f"{module}: this linear takes no adapter")
        by_layer.setdefault(layer, {})[piece] = LoraPiece(a.to(device=device, dtype=LORA_DTYPE),
                                                          b.to(device=device, dtype=LORA_DTYPE),
                                                          config.scale(module, rank))
        top = max(top, rank)
    plan = AdapterPlan([(layer, layer.lora.fuse(pieces)) for layer, pieces in by_layer.items()], sorted(pairs), top)
    if max_bytes is not None and plan.nbytes() > max_bytes:
        raise LoraError(f"its {plan.nbytes() / 1e6:.2f} MB on this rank exceed what max_lora_memory_mb leaves "
                        f"({max_bytes / 1e6:.2f} MB); unload an adapter or raise the budget")
    return plan


def read_peft_folder(path: str, allowed=()) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """A PEFT adapter folder (``adapter_config.json`` and its ``*.safetensors``), pinned once and read
    through the pin with every header checked (as checkpoints are; no link followed, nothing unpickled):
    (config, [(name, tensor)]). ``allowed``: folders it must lie under (the server's allowed dirs)."""
    try:
        pinned = PinnedFolder.open(path, allowed)
    except WeightLoadError:
        raise LoraError(f"{path!r} is not a folder that can be opened: pass a PEFT LoRA adapter folder "
                        f"({ADAPTER_CONFIG} + adapter_model.safetensors)") from None
    with pinned as folder, SafetensorsFolder(folder) as files:
        try:
            config = files.read_json(ADAPTER_CONFIG)
        except WeightLoadError as exc:
            raise LoraError(f"{path!r} is not a PEFT adapter folder: {exc}") from None
        AdapterConfig.from_peft(config)  # refuse what cannot be served before reading any tensor
        named = [(name, lazy.read()) for name, lazy in files.tensors()]
    assert isinstance(config, dict)
    return config, named


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "lora", None), LoraSlots)]


def install(model: nn.Module, slot: int, plan: AdapterPlan) -> None:
    """Put a planned adapter in ``slot`` (whatever the slot held before is dropped first)."""
    remove(model, slot)
    for layer, weights in plan.items:
        layer.lora.adapters[slot] = weights


def remove(model: nn.Module, slot: int) -> int:
    """Empty ``slot`` in every linear; returns the bytes freed."""
    freed = 0
    for layer in lora_layers(model):
        weights = layer.lora.adapters.pop(slot, None)
        if weights is not None:
            freed += sum(t.numel() * t.element_size() for t in weights)
    return freed
