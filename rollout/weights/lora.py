"""LoRA adapters into a rank: a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
or the same config and tensors given in memory) checked against this model and installed in one slot
of every linear it targets, all or nothing.

``AdapterConfig.from_peft`` reads and checks the config (what the engine can serve: plain LoRA and
rsLoRA on the Llama family's linears, per-module ranks and alphas; DoRA, ``modules_to_save``, LoRA
biases and embedding or LM-head targets refused, saying so). ``AdapterLayout`` maps every
``...<module>.lora_A.weight`` / ``lora_B.weight`` to its linear and checks shapes against the base
weights and the rank limit from the names and shapes alone, then takes the tensors as they arrive
(this rank's part, fused) and checks finiteness; ``plan_adapter`` does both for tensors in hand.
``install`` puts a plan in a slot, ``remove`` empties one. Nothing touches the model until the whole
adapter is planned.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from rollout.kernels.cpu import build as cpu_build
from rollout.kernels.cpu.ops import DTYPE_CODES, scatter_plan, scatter_scaled
from rollout.layers.linear import ColumnParallelLinear, RowParallelLinear
from rollout.layers.lora import LORA_DTYPE, LoraSlots
from rollout.weights.loader import WeightLoadError
from rollout.weights.safetensors_io import PinnedFolder, SafetensorsFolder
from weight_sync.layout import contiguous_run, spec_tuple, views

ADAPTER_CONFIG = "adapter_config.json"

# the Llama family's linears, by their Hugging Face module names
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
_PREFIX = "base_model.model."  # peft's wrapper, in the names it saves


@contextlib.contextmanager
def peft_quietly():
    """Around ``peft`` wrapping a model: peft asks transformers a question transformers has renamed (a
    FutureWarning each time, nothing to act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def wire_order(names) -> list[int]:
    """Indices of an adapter's tensor names in the order a trainer sends them best: every ``A``, then
    every ``B``, each by layer and within a layer in ``LORA_MODULES``' order (q, k, v, o, gate, up, down).
    An engine lays out its adapter buffer in the order its ``A`` tensors arrive, so sent this way a fused
    linear's pieces lie back to back and every bucket holding only ``A`` tensors is received in place, with
    no copy (``AdapterLayout.place``). Names that are not LoRA matrices keep their order, last."""
    def key(i: int) -> tuple:
        try:
            module, ab = module_name(names[i])
        except LoraError:
            return (2, 0, 0, i)
        m = _LAYER_INDEX.search(module)
        short = module.rsplit(".", 1)[-1]
        return (ab != "A", int(m.group(1)) if m else -1,
                LORA_MODULES.index(short) if short in LORA_MODULES else len(LORA_MODULES), i)

    return sorted(range(len(names)), key=key)


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
            (cfg.get("target_parameters"), f"target_parameters={cfg.get('target_parameters')!r}: LoRA on parameters "
                                           "(a mixture of experts' fused experts) is not supported yet; target the "
                                           "attention's (and any shared expert's) linears"),
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
        if not isinstance(pattern, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for k, v in pattern.items()):
            raise LoraError("alpha_pattern must map module name patterns to finite numbers")
        for key in pattern:
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error as exc:
                raise LoraError(f"alpha_pattern key {key!r} is not a regular expression: {exc}") from None
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
    ``b``)) per targeted linear (``LoraSlots``), every one a view of ``buffer`` (one allocation).

    Kept as a spare once its version is collected, the plan lends the next load of the same adapter
    shape (every push of a training run) its buffer, its views and its copy programs: nothing of that
    is built again."""

    items: list[tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]]
    modules: list[str]  # the Hugging Face modules it targets
    max_rank: int
    buffer: torch.Tensor
    recipe: Optional[_Recipe] = None
    places: dict = field(default_factory=dict)  # tensor name -> (its place, narrowing, B's scale)
    programs: dict = field(default_factory=dict)  # (bucket layout, source memory) -> _Program
    placements: dict = field(default_factory=dict)  # id of a bucket's metas -> (the metas, where it lands or None)

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass
class _Program:
    """One received bucket's tensors into their places, over views made once (of the receive buffer and
    of the adapter's buffer): on CPU one C++ call that copies, scales ``B`` and counts non-finite values
    (``rollout.kernels.cpu.ops``); elsewhere the copies, then ``B``'s scales, as two foreach calls."""

    names: list[str]
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    scaled: list[torch.Tensor]  # the places of ``B`` tensors, scaled after the copy
    scales: list[float]
    native: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None  # slot, buffer, plan, scales

    def run(self) -> Optional[int]:
        """The number of non-finite values written, or None where not counted (``finish`` checks)."""
        if self.native is not None:
            return scatter_scaled(*self.native)
        torch._foreach_copy_(self.dst, self.src)
        if self.scaled:
            torch._foreach_mul_(self.scaled, self.scales)
        return None


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


@dataclass(frozen=True)
class _Route:
    """Where a Hugging Face module's adapter goes on this rank."""

    layer: nn.Module
    piece: int
    narrow: Optional[tuple[int, int, int]]  # the base weight's (dim, start, length) on this rank (None: whole); the
    # same narrowing cuts A's input columns (row-parallel) or B's output rows (column-parallel)
    row_parallel: bool
    full_shape: tuple[int, int]  # the module's whole weight [out, in]


def _route(model: nn.Module, name_map: dict, module: str) -> _Route:
    """(Planned once per adapter shape: ``_Recipe`` is what is cached.)"""
    short = module.rsplit(".", 1)[-1]
    if short in ("lm_head", "embed_tokens"):
        raise LoraError(f"{module}: LoRA on the embedding or the LM head is not supported")
    target = name_map.get(f"{module}.weight")
    if short not in LORA_MODULES or target is None:
        raise LoraError(f"{module}: not a linear this model can adapt (LoRA targets are "
                        f"{', '.join(LORA_MODULES)} of model.layers.N)")
    layer = model.get_submodule(target.param_name.rsplit(".", 1)[0])
    if not isinstance(getattr(layer, "lora", None), LoraSlots) or \
            not isinstance(layer, (RowParallelLinear, ColumnParallelLinear)):
        raise LoraError(f"{module}: this linear takes no adapter")
    row = isinstance(layer, RowParallelLinear)
    sl = target.slice  # only its numbers are kept: its ``dst`` is a view of the weight's storage
    return _Route(layer, 0 if row else layer.lora_piece(target.shard_id),
                  None if sl.dim is None else (sl.dim, sl.start, sl.length), row,
                  tuple(target.param.shard_shape(target.param, target.shard_id)))


_RECIPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {adapter shape: _Recipe}


@dataclass
class _Recipe:
    """Where an adapter of a given shape goes on this rank, as numbers (no tensors): checked once."""

    modules: list[str]
    max_rank: int
    placed: frozenset[str]  # every tensor name of the adapter
    n_a: int  # fp32 values of every linear's ``a`` (then every ``b``)
    total: int
    layers: list[tuple[nn.Module, int, tuple[int, int], int, tuple[int, int]]]  # (layer, a at, a shape, b at, b shape)
    places: list[tuple[str, int, tuple[int, int], tuple[int, int], Optional[tuple[int, int, int]], Optional[float]]]

    @staticmethod
    def plan(model: nn.Module, name_map: dict, config: AdapterConfig, specs, max_rank: int) -> _Recipe:
        pairs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        first_a: dict[str, int] = {}  # module -> where its A comes in the call: linears laid out in that order
        for i, (name, dtype, shape) in enumerate(specs):
            module, ab = module_name(name)
            if ab == "A":
                first_a.setdefault(module, i)
            if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise LoraError(f"{name}: must be a floating-point tensor, got {dtype}")
            if ab in pairs.setdefault(module, {}):
                raise LoraError(f"{name}: given twice")
            pairs[module][ab] = (name, tuple(shape))
        if not pairs:
            raise LoraError("the adapter holds no LoRA matrices")
        per_layer: dict[nn.Module, dict[int, tuple[str, _Route, int]]] = {}
        for module, ab in sorted(pairs.items(), key=lambda kv: (first_a.get(kv[0], len(specs)), kv[0])):
            if set(ab) != {"A", "B"}:
                raise LoraError(f"{module}: lora_{'B' if 'A' in ab else 'A'}.weight is missing")
            route = _route(model, name_map, module)
            (_, a), (_, b) = ab["A"], ab["B"]
            if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
                raise LoraError(f"{module}: lora_A {a} and lora_B {b} are not [r, in] and [out, r] of one rank r")
            out_features, in_features = route.full_shape
            if a[1] != in_features or b[0] != out_features:
                raise LoraError(f"{module}: lora_A {a} / lora_B {b} do not fit the base weight "
                                f"[{out_features}, {in_features}] (an adapter trained on another model?)")
            if a[0] < 1:
                raise LoraError(f"{module}: lora_A {a} and lora_B {b} have rank 0: an adapter's rank must be >= 1")
            if a[0] > max_rank:
                raise LoraError(f"{module}: rank {a[0]} exceeds the engine's max_lora_rank={max_rank}; raise it")
            per_layer.setdefault(route.layer, {})[route.piece] = (module, route, a[0])
        # every linear's ``a`` first (in the order the A tensors come: a sender in ``wire_order`` lands them in
        # place), then every ``b`` (zeroed in one pass)
        sizes = []
        for layer, pieces in per_layer.items():
            route = next(iter(pieces.values()))[1]
            in_local = route.narrow[2] if route.row_parallel and route.narrow is not None else route.full_shape[1]
            rank = sum(r for _, _, r in pieces.values())
            sizes.append((layer, (rank, in_local), (layer.lora.width, rank)))
        n_a = sum(math.prod(sa) for _, sa, _ in sizes)
        layers, places, ia, ib = [], [], 0, n_a
        for layer, sa, sb in sizes:
            layers.append((layer, ia, sa, ib, sb))
            pieces = per_layer[layer]
            for piece, (r0, rank, start, length) in layer.lora.blocks({p: r for p, (_, _, r) in pieces.items()}).items():
                module, route, _ = pieces[piece]
                places.append((pairs[module]["A"][0], ia + r0 * sa[1], (rank, sa[1]), (sa[1], 1),
                               route.narrow if route.row_parallel else None, None))
                places.append((pairs[module]["B"][0], ib + start * sb[1] + r0, (length, rank), (sb[1], 1),
                               None if route.row_parallel else route.narrow, config.scale(module, rank)))
            ia, ib = ia + math.prod(sa), ib + math.prod(sb)
        return _Recipe(sorted(pairs), max(r for p in per_layer.values() for _, _, r in p.values()),
                       frozenset(p[0] for p in places), n_a, ib, layers, places)


class AdapterLayout:
    """Loading an adapter in two phases. From its (name, dtype, shape) list alone — before any byte
    arrives — every name is mapped to its linear, checked against the base weight's shape, the rank
    limit and the memory budget, and given its place in one fp32 buffer (``spare``, the plan of a
    collected version: its buffer is reused when of the same size — no fresh pages to fault in — and
    with it, for the same adapter shape, its views and copy programs); then ``write`` or
    ``write_bucket`` puts tensors in place as they arrive (a bucket while the next is on the wire),
    ``A`` as this rank's slice, ``B`` scaled into its block of ``b``; ``finish`` checks that all came
    and are finite and returns the plan. Raises ``LoraError`` naming the first problem."""

    def __init__(self, model: nn.Module, name_map: dict, config: AdapterConfig, specs, max_rank: int,
                 device: torch.device, max_bytes: Optional[int] = None, spare: Optional[AdapterPlan] = None):
        specs = spec_tuple(specs)  # as the rank's call gave it (hashed once): no new tuple, no new hash
        key = (specs, config.r, config.lora_alpha, config.use_rslora, tuple(sorted(config.alpha_pattern.items())),
               max_rank)
        cache = _RECIPES.setdefault(model, {})
        recipe = cache.get(key)
        if recipe is None:  # the same adapter shape again (every push of a training run): planned once
            recipe = _Recipe.plan(model, name_map, config, specs, max_rank)
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[key] = recipe
        self.recipe, self.modules, self.max_rank = recipe, recipe.modules, recipe.max_rank
        nbytes = recipe.total * LORA_DTYPE.itemsize
        if max_bytes is not None and nbytes > max_bytes:
            raise LoraError(f"its {nbytes / 1e6:.2f} MB on this rank exceed what max_lora_memory_mb leaves "
                            f"({max_bytes / 1e6:.2f} MB); unload an adapter or raise the budget")
        self.missing = set(recipe.placed)
        self.counted, self.nonfinite = True, 0  # whether every write counted its non-finite values; how many
        if spare is not None and spare.recipe is recipe and spare.buffer.device == device:
            # every place is written again and the rest of ``b`` is still zero: nothing to build
            self.buffer, self.items, self.places, self.programs, self.placements = spare.buffer, spare.items, \
                spare.places, spare.programs, spare.placements
            return
        reuse = spare is not None and spare.buffer.numel() == recipe.total and spare.buffer.device == device
        self.buffer = spare.buffer if reuse else torch.empty(recipe.total, dtype=LORA_DTYPE, device=device)
        buffer = self.buffer
        buffer[recipe.n_a:].zero_()
        self.items = [(layer, (buffer.as_strided(sa, (sa[1], 1), ia), buffer.as_strided(sb, (sb[1], 1), ib)))
                      for layer, ia, sa, ib, sb in recipe.layers]
        # name -> (its place, the narrowing of the tensor this rank keeps, B's scale)
        self.places: dict[str, tuple[torch.Tensor, Optional[tuple[int, int, int]], Optional[float]]] = {
            name: (buffer.as_strided(shape, stride, offset), narrow, scale)
            for name, offset, shape, stride, narrow, scale in recipe.places}
        self.programs: dict = {}
        self.placements: dict = {}

    def place(self, metas, total: int) -> Optional[torch.Tensor]:
        """Where a bucket (its tensors' ``TensorMeta``, ``total`` bytes) can be received in place: the bytes
        of this adapter's buffer its tensors lie in, when every one is an ``A`` sent whole in fp32 (no
        TP narrowing, no scale) and they lie there back to back exactly as the bucket lays them out — the
        ``A`` buckets of a sender in ``wire_order``. None: the bucket lands in a receive buffer and
        ``write_bucket`` copies it. Either way ``write_bucket`` then runs on it (in place: a count only)."""
        known = self.placements.get(id(metas))
        if known is not None and known[0] is metas:  # the same bucket layout (kept with it: its id stays its own)
            return known[1]
        tensors = []
        for m in metas:
            dst, narrow, scale = self.places.get(m.name, (None, None, None))
            if dst is None or narrow is not None or scale is not None or m.dtype != "float32":
                tensors = []
                break
            tensors.append(dst)
        where = contiguous_run(tensors, list(metas), total, tail_padding_ok=False) if tensors else None
        if len(self.placements) >= 256:
            self.placements.clear()
        self.placements[id(metas)] = (metas, where)
        return where

    def write(self, named) -> None:
        """Tensors of the adapter (any of its names, in any order) into their places."""
        for name, tensor in named:
            dst, narrow, scale = self.places[name]
            src = tensor if narrow is None else tensor.narrow(*narrow)
            if scale is None:
                dst.copy_(src)
            elif src.dtype == LORA_DTYPE and src.device == dst.device:
                torch.mul(src, scale, out=dst)  # dst: rows of b, each a run of rank values
            else:  # scaled in fp32, as peft does on an fp32 adapter (or read on the host for a device)
                dst.copy_(src)
                dst.mul_(scale)
            self.missing.discard(name)
        self.counted = False

    def write_bucket(self, key, slot: torch.Tensor, metas) -> None:
        """A received bucket (``slot``: its bytes; ``metas``: its tensors' ``TensorMeta``) into place. ``key``
        names the bucket and the memory it lands in (the same for every push over the same receive
        buffers): its program — the views and the copies — is made once and kept with the plan."""
        program = self.programs.get(key)
        if program is None:
            if len(self.programs) >= 64:  # receive buffers replaced: the old programs go
                self.programs.clear()
            program = self.programs[key] = self._program(slot, metas)
        bad = program.run()
        if bad is None:
            self.counted = False
        else:
            self.nonfinite += bad
        self.missing.difference_update(program.names)

    def _program(self, slot: torch.Tensor, metas) -> _Program:
        program, pieces = _Program([], [], [], [], []), []
        for name, src in views(slot, metas):
            dst, narrow, scale = self.places[name]
            src = src if narrow is None else src.narrow(*narrow)
            program.names.append(name)
            program.src.append(src)
            program.dst.append(dst)
            pieces.append((src, dst, scale))
            if scale is not None:  # scaled in fp32 after the copy, as ``write`` does
                program.scaled.append(dst)
                program.scales.append(scale)
        if self.buffer.device.type == "cpu" and all(t.dtype in DTYPE_CODES for t in program.src) and \
                cpu_build.kernels() is not None:
            program.native = (slot, self.buffer, *scatter_plan(slot, self.buffer, pieces))
        return program

    def finish(self) -> AdapterPlan:
        if self.missing:
            raise LoraError(f"{sorted(self.missing)[0]} never arrived")
        if self.counted:  # every value was counted as it was written
            finite = self.nonfinite == 0
        else:
            lo, hi = torch.aminmax(self.buffer)  # one pass and one sync for the whole adapter
            finite = math.isfinite(float(lo)) and math.isfinite(float(hi))
        if not finite:
            bad = sorted(n for n, (dst, _, _) in self.places.items() if not bool(torch.isfinite(dst).all()))
            raise LoraError(f"{bad[0]} holds non-finite values" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        return AdapterPlan(self.items, self.modules, self.max_rank, self.buffer, self.recipe, self.places,
                           self.programs, self.placements)


def plan_adapter(model: nn.Module, name_map: dict, config: AdapterConfig, named_tensors,
                 max_rank: int, device: torch.device, max_bytes: Optional[int] = None,
                 spare: Optional[AdapterPlan] = None) -> AdapterPlan:
    """An adapter given as tensors: checked against the model and put in this rank's form
    (``AdapterLayout``); raises ``LoraError`` naming the first problem."""
    named = list(named_tensors)
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise LoraError(f"{name}: must be a floating-point tensor")
    layout = AdapterLayout(model, name_map, config, [(n, t.dtype, tuple(t.shape)) for n, t in named], max_rank,
                           device, max_bytes, spare)
    layout.write(named)
    return layout.finish()


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


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its adaptable linears


def lora_layers(model: nn.Module) -> list[nn.Module]:
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = [m for m in model.modules() if isinstance(getattr(m, "lora", None), LoraSlots)]
    return layers


def install(model: nn.Module, slot: int, plan: AdapterPlan, held: Optional[AdapterPlan] = None) -> None:
    """Put a planned adapter in ``slot``; ``held``: what the slot holds now (dropped first), or None for
    an empty slot — then no linear is visited twice (a push installs into a slot ``remove`` emptied)."""
    if held is not None:
        remove(model, slot, held)
    for layer, weights in plan.items:
        layer.lora.adapters[slot] = weights


def remove(model: nn.Module, slot: int, held: Optional[AdapterPlan] = None) -> None:
    """Empty ``slot`` in the linears of ``held`` (the adapter in it), or in every linear when not given."""
    for layer in lora_layers(model) if held is None else [layer for layer, _ in held.items]:
        layer.lora.adapters.pop(slot, None)
