"""The engine's options: one frozen ``EngineConfig`` in groups, the kernels one ``KernelChoice`` resolved once
into the ``KernelPlan`` the model is built with (the fusion ladder and its conditions in one place), the
groups' options by their flat (SGLang) names, and the old ``cpu_*`` flags mapped once with a warning."""

import argparse
import dataclasses

import pytest
import torch

from rollout.config import EngineConfig, KernelChoice, LoraOptions, SpeculativeOptions
from rollout.kernels.choice import FUSED_OPS, KernelPlan

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ALL_OPS = {op: True for op in FUSED_OPS if op != "moe"}  # (a dense model's)


def plan(choice=KernelChoice(), device=CPU, built=True, tp_size=1, qk_norm=False, dtype=torch.bfloat16,
         deterministic=False, moe=False) -> KernelPlan:
    return choice.resolve(device=device, built=built, tp_size=tp_size, qk_norm=qk_norm, dtype=dtype,
                          deterministic=deterministic, moe=moe)


def test_the_config_is_frozen_grouped_and_small():
    config = EngineConfig.from_kwargs("m")
    assert len(dataclasses.fields(EngineConfig)) <= 36
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kernels.fusion = "torch"  # type: ignore[misc]
    assert config.lora == LoraOptions() and config.speculative == SpeculativeOptions() and config.kernels == KernelChoice()
    assert hash(config) == hash(EngineConfig.from_kwargs("m"))  # plain values all the way down


def test_each_rung_of_the_ladder_contains_the_one_below():
    assert plan(KernelChoice(fusion="torch")) == KernelPlan(adapt_threads=True)
    assert plan(KernelChoice(fusion="ops")) == KernelPlan(**ALL_OPS, adapt_threads=True)
    assert plan(KernelChoice(fusion="layer")) == KernelPlan(**ALL_OPS, layer=True, adapt_threads=True)
    assert plan() == KernelPlan(**ALL_OPS, layer=True, stack=True, adapt_threads=True)


@pytest.mark.parametrize("why, kwargs", [
    ("a layer's norm on the torch path", dict(choice=KernelChoice(unfused=("norm",)))),
    ("its SiLU on the torch path", dict(choice=KernelChoice(unfused=("silu",)))),
    ("its attention gathering the cache", dict(choice=KernelChoice(unfused=("paged_attention",)))),
    ("two TP ranks", dict(tp_size=2)),
    ("q/k norms (Qwen3)", dict(qk_norm=True)),
    ("fp16 weights", dict(dtype=torch.float16)),
])
def test_a_layer_in_one_call_only_where_every_piece_it_strings_together_serves(why, kwargs):
    resolved = plan(**kwargs)
    assert not resolved.layer and not resolved.stack, why


def test_the_experts_kernel_serves_mixtures_of_experts_outside_the_batch_invariant_mode():
    assert plan(moe=True).moe and plan(KernelChoice(fusion="ops"), moe=True, dtype=torch.float32).moe
    assert not plan(moe=True).layer  # the one-call layer strings a dense MLP
    for why, kwargs in [("a dense model", {}), ("batch-invariant", dict(deterministic=True)),
                        ("unfused", dict(choice=KernelChoice(unfused=("moe",)))), ("fp16", dict(dtype=torch.float16)),
                        ("torch rung", dict(choice=KernelChoice(fusion="torch"))), ("no build", dict(built=False)),
                        ("CUDA (Triton's fused MoE)", dict(device=CUDA))]:
        assert not plan(**{"moe": why != "a dense model", **kwargs}).moe, why


def test_rotary_with_the_cache_write_follows_the_paged_kernel_and_the_sampler_is_its_own():
    resolved = plan(KernelChoice(unfused=("paged_attention",)))
    assert not resolved.paged_attention and not resolved.rope and resolved.norm and resolved.silu
    resolved = plan(KernelChoice(unfused=("sampler",)))
    assert not resolved.sampler and resolved.layer and resolved.stack  # the sampler is no part of a layer


def test_nothing_of_the_cpu_kernels_serves_without_the_build_or_on_cuda():
    assert plan(built=False) == KernelPlan(adapt_threads=True)  # no compiler: torch serves, threads still adapt
    assert plan(device=CUDA, built=False) == KernelPlan(paged_attention=True, triton=True)  # CUDA: Triton's kernels
    assert plan(KernelChoice(fusion="torch"), device=CUDA) == KernelPlan()
    assert plan(KernelChoice(triton=False), device=CUDA) == KernelPlan()
    assert plan(device=CUDA, dtype=torch.float16) == KernelPlan()  # the fused kernels round as fp32 / bf16 only


def test_the_cuda_plan_runs_on_a_cpu_only_under_tritons_interpreter(monkeypatch):
    assert plan(KernelChoice(triton=True), dtype=torch.float32) == KernelPlan(paged_attention=True, triton=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="kernels.triton=True: needs CUDA, or on a CPU TRITON_INTERPRET=1"):
        plan(KernelChoice(triton=True))
    with pytest.raises(ValueError, match="kernels.triton='yes'"):
        KernelChoice(triton="yes")


def test_gpu_memory_utilization_is_vllms_option_and_sglangs_mem_fraction_static():
    assert EngineConfig.from_kwargs("m", mem_fraction_static=0.8).gpu_memory_utilization == 0.8
    assert EngineConfig.from_kwargs("m", gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    with pytest.raises(ValueError, match="one option"):
        EngineConfig.from_kwargs("m", mem_fraction_static=0.8, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs("m", gpu_memory_utilization=1.5)


def test_threads_adapt_by_default_for_bf16_outside_the_batch_invariant_mode():
    assert plan().adapt_threads and not plan(dtype=torch.float32).adapt_threads
    assert not plan(deterministic=True).adapt_threads
    assert plan(KernelChoice(adapt_threads=True), dtype=torch.float32).adapt_threads
    assert not plan(KernelChoice(adapt_threads=False)).adapt_threads


@pytest.mark.parametrize("old, choice", [
    (dict(cpu_fused_norm=False), KernelChoice(unfused=("norm",))),
    (dict(cpu_fused_rope=False, cpu_fused_silu=False), KernelChoice(unfused=("rope", "silu"))),
    (dict(cpu_paged_attention=False, cpu_fused_sampler=False), KernelChoice(unfused=("paged_attention", "sampler"))),
    (dict(cpu_fused_layer=False), KernelChoice(fusion="ops")),
    (dict(cpu_fused_stack=False), KernelChoice(fusion="layer")),
    (dict(cpu_fused_stack=False, cpu_fused_layer=False), KernelChoice(fusion="ops")),
    (dict(cpu_packed_weights=False), KernelChoice(gemm="linear")),
    (dict(cpu_gemm_kernel="tiled", cpu_fp32_gemm_rows=0, cpu_small_gemm_rows=8, cpu_adapt_threads=False),
     KernelChoice(gemm="tiled", fp32_gemm_rows=0, small_gemm_rows=8, adapt_threads=False)),
    (dict(cpu_fused_norm=True, cpu_fused_stack=True), KernelChoice()),
])
def test_the_old_flat_kernel_flags_map_once_onto_the_choice_with_a_warning(old, choice):
    with pytest.warns(DeprecationWarning, match="deprecated: pass kernels=KernelChoice") as caught:
        config = EngineConfig.from_kwargs("m", **old)
    assert config.kernels == choice
    assert all(name in str(caught[0].message) for name in old)


def test_groups_by_their_flat_names_whole_or_as_dicts():
    config = EngineConfig.from_kwargs("m", max_loaded_loras=2, lora_backend="torch", speculative_num_draft_tokens=4,
                                      kernel_fusion="ops", kernel_unfused=["rope"])
    assert config.lora == LoraOptions(max_loaded=2, backend="torch")
    assert config.speculative.num_draft_tokens == 4
    assert config.kernels == KernelChoice(fusion="ops", unfused=("rope",))
    assert EngineConfig.from_kwargs("m", kernels={"fusion": "layer"}).kernels == KernelChoice(fusion="layer")
    # a group given whole, and one of its fields by flat name on top
    both = EngineConfig.from_kwargs("m", lora=LoraOptions(max_rank=8), max_loaded_loras=3)
    assert both.lora == LoraOptions(max_loaded=3, max_rank=8)


@pytest.mark.parametrize("kwargs, names", [
    (dict(kernel_fusion="all"), "kernels.fusion='all'"),
    (dict(kernel_unfused=("attention",)), "kernels.unfused"),
    (dict(kernel_gemm="blas"), "kernels.gemm='blas'"),
    (dict(kernel_small_gemm_rows=-1), "kernels.small_gemm_rows=-1"),
    (dict(kernels={"fushion": "ops"}), "unknown field"),
    (dict(max_lora_rank=0), "max_lora_rank=0"),
    (dict(lora_backend="cuda"), "lora_backend='cuda'"),
    (dict(speculative_max_batch=-2), "speculative_max_batch=-2"),
    (dict(cpu_fused_norm="yes"), "cpu_fused_norm='yes'"),
    (dict(kernel_fuzion="ops"), "unknown engine option"),
])
def test_a_bad_option_is_refused_naming_it(kwargs, names):
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(".", r"\.")):
        EngineConfig.from_kwargs("m", **kwargs)


def test_the_cli_has_a_flag_for_every_option_and_reads_a_list_of_ops():
    from rollout.cli import _engine_option_flags

    parser = argparse.ArgumentParser()
    _engine_option_flags(parser)
    args = parser.parse_args(["--model-path", "m", "--kernel-unfused", "norm,rope", "--kernel-fusion", "layer",
                              "--max-loaded-loras", "3", "--no-kernel-adapt-threads"])
    flat = set(EngineConfig.flat_options())
    assert flat <= set(vars(args)) and not {"lora", "speculative", "kernels"} & set(vars(args))
    config = EngineConfig.from_kwargs(**vars(args))
    assert config.kernels == KernelChoice(fusion="layer", unfused=("norm", "rope"), adapt_threads=False)
    assert config.lora.max_loaded == 3
