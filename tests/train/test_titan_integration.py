"""``ragged_placement.integrations.torchtitan``: torchtitan's own trainer (``torchrun ... -m
torchtitan.train --module integration_config --config NAME``, CPU/gloo, the llama3 debug model in
fp32) on our runtime through ``configure``, against torchtitan with torch FSDP2 and against one
process.

In the default suite: the configuration checks (in-process, no process group), Muon's param
groups under torchtitan's LR scheduler, the FP8 converter, the call redirection, and one short
torchtitan run of the issue's example (the partitioner and Muon on 2 ranks, 3 steps) against one
process's Muon. Marked ``slow`` (``make titan-integration``): AMSP and the partitioner on a 2x2
mesh against torchtitan's HSDP with FSDP2, Muon on AMSP against one process, block-wise FP8
against one process and against FSDP2 with the same FP8 layers.

The one-process references (``integration_config.*_one_process``) run torch FSDP2 on one rank,
each step accumulating the gradients of the batches the data-parallel ranks get, in rank order:
the same data and, for 2 ranks, the same sums in the same order as the 2-rank reduction. They
run without gradient clipping (``--training.max_norm 1e9``): torchtitan's logged norm, which
clipping divides by, is an fp32 sum over each rank's shard whose rounding depends on the cuts
(one process's whole tensors: 1.4e-4 relative off the fp64 norm, measured), and the clip
coefficient would carry that into the update. Every comparison checks the losses and the norm
of the full gradients torchtitan clips, summed in fp64 (``stand_ins.record_exact_grad_norm``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import textwrap

import pytest
import torch

pytest.importorskip("torchtitan", reason="make test installs the titan extra")
from ragged_placement._compat import torchtitan_unsupported  # noqa: E402

if (_reason := torchtitan_unsupported()) is not None:
    pytest.skip(_reason, allow_module_level=True)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "titan"))

import compare  # noqa: E402
import titan_jobs  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from ragged_placement.fsdp import StateSharding  # noqa: E402
from ragged_placement.integrations.torchtitan import (  # noqa: E402
    BlockFP8Linear,
    BlockFP8LinearConverter,
    Parallelize,
    ShardedOptimizersContainer,
    TrainerConfig,
    configure,
    from_adamw,
)
from ragged_placement.integrations.torchtitan.parallelize import with_fully_shard  # noqa: E402
from ragged_placement.optim import Muon  # noqa: E402

TOLERANCE = compare.TOLERANCE  # 1e-5
NO_CLIP = ("--training.max_norm", "1e9")
HSDP_2X2 = ("--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2")

# The issue's example, as a user writes it, and configs the checks below build from.
_USER_MODULE = '''
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from ragged_placement.fsdp import StateSharding
from ragged_placement.integrations.torchtitan import configure

def llama3_8b_amsp():
    return configure(llama3_8b(), state_sharding="auto", optimizer="muon")

def ours():
    return configure(llama3_debugmodel())

def amsp():
    return configure(llama3_debugmodel(), state_sharding="amsp")

def auto():
    return configure(llama3_debugmodel(), state_sharding="auto")

def auto_bandwidth():
    return configure(llama3_debugmodel(), state_sharding="auto", bandwidth={"inter": 1e9})

def zero2():
    return configure(llama3_debugmodel(), state_sharding="zero2")

def misordered():
    return configure(llama3_debugmodel(), state_sharding=StateSharding(
        params=("fsdp",), grads=("fsdp", "dp_replicate"), optim=("fsdp", "dp_replicate")))

def fp8():
    return configure(llama3_debugmodel(), fp8=True)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_titan_cfg.py").write_text(_USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_titan_cfg"
    sys.modules.pop("user_titan_cfg", None)


def _parse(module: str, config: str, *options: str):
    return ConfigManager().parse_args(["--module", module, "--config", config, *options])


# -- configure: what it returns, what it refuses (no process group) ------------------------------
def test_the_issues_example_parses_through_torchtitans_config_manager(user_module):
    """``--module M --config llama3_8b_amsp`` (the issue's module as written) gives our config:
    torchtitan's parallelize_fn wrapped, our Muon container with AdamW's lr and weight decay,
    the DTensor backend; the stock config it wrapped is untouched."""
    stock = llama3_debugmodel()
    stock_optimizer, stock_fn = stock.optimizer, stock.model_spec.parallelize_fn
    configured = configure(stock, optimizer="muon")
    assert stock.optimizer is stock_optimizer and stock.model_spec.parallelize_fn is stock_fn
    assert stock.parallelism.spmd_backend == "spmd_types" != configured.parallelism.spmd_backend

    config = _parse(user_module, "llama3_8b_amsp", "--parallelism.data_parallel_shard_degree", "8")
    assert type(config) is TrainerConfig
    fn = config.model_spec.parallelize_fn
    assert isinstance(fn, Parallelize) and fn.options.state_sharding == "auto"
    assert fn.parallelize_fn.__qualname__ == "parallelize_llama"
    assert config.parallelism.spmd_backend == "partial_dtensor"
    assert isinstance(config.optimizer, ShardedOptimizersContainer.Config)
    (group,) = config.optimizer.param_groups
    assert group.optimizer_name == "Muon"
    assert group.optimizer_kwargs == {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95),
                                      "adamw_eps": 1e-8}
    assert config.parallelism.data_parallel_shard_degree == 8  # the command line still applies
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("kwargs, match", [
    ({"state_sharding": "zero4"}, "state_sharding must be"),
    ({"optimizer": "sgd"}, "optimizer must be"),
    ({"optimizer_kwargs": {"momentum": 0.9}}, "optimizer_kwargs are the hyper-parameters"),
    ({"optimizer": "muon", "optimizer_kwargs": {"lr_decay": 1}}, r"\['lr_decay'\] are not Muon's"),
    ({"optimizer": "muon", "optimizer_kwargs": {"ns_dtype": torch.float16}}, "ns_dtype"),
    ({"optimizer": "shampoo", "optimizer_kwargs": {"momentum": 0.9}}, "not Shampoo's"),
    ({"state_sharding": "amsp", "bandwidth": {"fsdp": 1e9}}, "bandwidth is the partitioner's"),
    ({"memory_budget": 1e9}, "memory_budget is the partitioner's"),
    ({"state_sharding": "auto", "memory_budget": -1.0}, "memory_budget must be a positive"),
    ({"state_sharding": "auto", "bandwidth": {"fsdp": 0.0}}, "bandwidth must be"),
    ({"fp8": "e4m3"}, "fp8 must be"),
])
def test_configure_refuses_a_bad_argument_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        configure(llama3_debugmodel(), **kwargs)


def test_configure_refuses_what_it_cannot_take_over():
    config = llama3_debugmodel()
    with pytest.raises(ValueError, match="already configure's result"):
        configure(configure(config))
    with pytest.raises(TypeError, match="Trainer.Config"):
        configure(config.training)
    config.optimizer.param_groups[0].optimizer_name = "DistMuon"
    with pytest.raises(ValueError, match=r"group '\.\*' is DistMuon"):
        configure(config, optimizer="muon")
    converted = llama3_debugmodel()
    converted.model_spec = model_registry("debugmodel",
                                          converters=[BlockFP8LinearConverter.Config()])
    with pytest.raises(ValueError, match="fp8: the model's Linear layers are already converted"):
        configure(converted, fp8=True)
    spec = llama3_debugmodel().model_spec
    no_fsdp = dataclasses.replace(spec, parallelize_fn=lambda model, **kwargs: model)
    with pytest.raises(ValueError, match="applies no FSDP through torch's fully_shard"):
        configure(dataclasses.replace(llama3_debugmodel(), model_spec=no_fsdp))


_HSDP = {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}}


@pytest.mark.parametrize("config, overrides, match", [
    ("amsp", {}, "data_parallel_replicate_degree=1 leaves out"),
    ("auto", {"parallelism": {"fsdp_reshard_after_forward": "never"}},
     "fsdp_reshard_after_forward"),
    ("auto_bandwidth", {}, r"one bytes/s per data-parallel mesh dim \('fsdp',\)"),
    ("fp8", {"parallelism": {"tensor_parallel_degree": 2}}, "tensor_parallel_degree=2"),
    ("amsp", {"parallelism": {**_HSDP["parallelism"], "pipeline_parallel_degree": 2},
              "training": {"disable_cuda_graphs": True}}, "pipeline_parallel_degree=2"),
    ("zero2", {"training": {"enable_cpu_offload": True}}, "enable_cpu_offload=True"),
    ("amsp", {"parallelism": {**_HSDP["parallelism"], "tensor_parallel_degree": 2}},
     "tensor_parallel_degree=2: pass state_sharding='zero1' or 'zero2'"),
    ("zero2", {"parallelism": {"expert_parallel_degree": 2}}, "expert_parallel_degree=2"),
    ("zero2", {"parallelism": {"spmd_backend": "full_dtensor"}}, "spmd_backend='full_dtensor'"),
    ("ours", {"parallelism": {"spmd_backend": "spmd_types"}}, "spmd_backend='spmd_types'"),
    ("misordered", _HSDP, "out of the mesh's order"),
    ("misordered", {}, "'dp_replicate'.*not a dim of the mesh"),
])
def test_a_combination_is_refused_when_the_final_config_is_built(
        user_module, config, overrides, match):
    """configure's result rebuilt with the fields torchtitan's command line sets (torchtitan
    builds it again from its command line, and ``build()`` once more): a ``ValueError`` naming
    the option (or configure's argument) and the fix, before any process group exists."""
    import importlib

    configured = getattr(importlib.import_module(user_module), config)()
    sections = {k: dataclasses.replace(getattr(configured, k), **v) for k, v in overrides.items()}
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(configured, **sections)
    assert not torch.distributed.is_initialized()


def test_symmetric_memory_is_refused(user_module):
    """(torchtitan's own check refuses it first on a GPU below compute capability 9.0, and on a
    CPU: set past it here.)"""
    import importlib

    from ragged_placement.integrations.torchtitan import check

    configured = importlib.import_module(user_module).ours()
    configured.parallelism.enable_fsdp_symm_mem = True
    with pytest.raises(ValueError, match="enable_fsdp_symm_mem: .* not symmetric memory"):
        check(configured.model_spec.parallelize_fn.options, configured)


def test_torchtitans_command_line_stops_on_a_refused_combination(user_module, capsys):
    """The same check when torchtitan's ConfigManager builds the config: tyro reports the
    ValueError and exits, before the trainer (and any process group) exists."""
    with pytest.raises(SystemExit) as exit_:
        _parse(user_module, "zero2", "--parallelism.expert_parallel_degree", "2")
    assert exit_.value.code != 0
    shown = "".join(c for c in capsys.readouterr().err if c.isalnum() or c in "_.=")
    assert "state_sharding=zero2withparallelism.expert_parallel_degree=2" in shown
    assert not torch.distributed.is_initialized()


def test_the_command_line_completes_what_configure_chose(user_module):
    """AMSP needs the replicate dim: configure takes it, the command line gives it."""
    config = _parse(user_module, "amsp", *HSDP_2X2)
    assert config.model_spec.parallelize_fn.options.state_sharding == "amsp"
    assert dataclasses.replace(config).parallelism.data_parallel_replicate_degree == 2  # build()


# -- the FSDP calls torchtitan makes reach ours, and torchtitan is left as it is ----------------
_HELPERS = '''
from torch.distributed.fsdp import fully_shard

def helper(module, **kwargs):
    return fully_shard(module, **kwargs)

def parallelize(module, **kwargs):
    return helper(module, **kwargs)

def no_fsdp(module):
    return module

counter = 0

def counts(module):
    global counter
    counter += 1
    return fully_shard(module)
'''


def _module(name: str, source: str):
    import types

    module = types.ModuleType(name)
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def _attributes(module) -> dict[str, int]:
    return {k: id(v) for k, v in vars(module).items()}


def test_with_fully_shard_redirects_torchtitans_calls_and_changes_no_module():
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.models.llama3.parallelize as llama3_parallelize

    before = [_attributes(m) for m in (titan_fsdp, llama3_parallelize)]
    calls = []

    def record(module, **kwargs):
        calls.append(module)

    copy = with_fully_shard(llama3_parallelize.parallelize_llama, record)
    helper = copy.__globals__["apply_fsdp_to_decoder"]
    assert helper is not titan_fsdp.apply_fsdp_to_decoder
    assert helper.__globals__["fully_shard"] is record
    assert helper.__code__ is titan_fsdp.apply_fsdp_to_decoder.__code__  # torchtitan's own code
    assert [_attributes(m) for m in (titan_fsdp, llama3_parallelize)] == before
    assert titan_fsdp.fully_shard is torch.distributed.fsdp.fully_shard

    module = _module("torchtitan_like", _HELPERS)
    module_before = _attributes(module)
    with_fully_shard(module.parallelize, record)(torch.nn.Linear(2, 2), mesh="m")
    assert len(calls) == 1 and calls[0].in_features == 2
    assert _attributes(module) == module_before
    with pytest.raises(ValueError, match="does not call torch's fully_shard"):
        with_fully_shard(module.no_fsdp, record)
    with pytest.raises(ValueError, match="assigns a global"):
        with_fully_shard(module.counts, record)


# -- Muon in torchtitan's optimizer container, under its LR scheduler ---------------------------
def test_muon_steps_the_blocks_matrices_and_follows_torchtitans_lr_schedule():
    """torchtitan's container and scheduler over our Muon on the llama3 debug model (one
    process, plain tensors): the blocks' matrices in Muon groups, the rest in AdamW groups with
    torchtitan's betas and eps; each step's lr is the base times torchtitan's warmup-decay
    factor; the weights equal a Muon built by hand stepped with those learning rates."""
    torch.manual_seed(0)
    one_block = model_registry("debugmodel").model
    one_block.layers = one_block.layers[:1]
    model = one_block.build()
    model.init_weights()
    reference = one_block.build()
    reference.load_state_dict(model.state_dict())
    container = from_adamw(default_adamw(lr=1e-2), "muon", {"ns_dtype": torch.float32}).build(
        model_parts=[model])
    schedule = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear").build(
        optimizers=container, training_steps=6)
    (muon,) = container.optimizers
    assert isinstance(muon, Muon) and muon.ns_dtype == torch.float32
    by_algorithm = {g["algorithm"]: set(g["param_names"]) for g in muon.param_groups}
    matrices = {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    assert by_algorithm == {"muon": matrices,
                            "adamw": {n for n, _ in model.named_parameters()} - matrices}
    assert all(g["betas"] == (0.9, 0.95) and g["adamw_eps"] == 1e-8 and g["weight_decay"] == 0.1
               for g in muon.param_groups)

    named = dict(reference.named_parameters())
    by_hand = Muon([{"params": [named[n] for n in sorted(matrices)]},
                    {"params": [named[n] for n in sorted(set(named) - matrices)],
                     "algorithm": "adamw"}],
                   lr=1e-2, weight_decay=0.1, adjust_lr="match_rms_adamw", betas=(0.9, 0.95),
                   adamw_eps=1e-8, ns_dtype=torch.float32)
    # warmup over 2 steps, one stable step, then linear decay to 0 at step 7 (torchtitan's WSD)
    factors = [0.5, 1.0, 1.0, 0.75]
    for factor in factors:
        assert {g["lr"] for g in muon.param_groups} == {1e-2 * factor}
        grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
            named[n].grad = grads[n].clone()
        for g in by_hand.param_groups:
            g["lr"] = 1e-2 * factor
        container.step()
        schedule.step()
        by_hand.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, named[n], rtol=0, atol=0, msg=n)


# -- block-wise FP8 as a torchtitan model converter ----------------------------------------------
def test_the_fp8_converter_swaps_the_blocks_linears_and_keeps_the_head():
    spec = model_registry("debugmodel", converters=[BlockFP8LinearConverter.Config()])
    kinds = {fqn: type(c) for fqn, c, _, _ in spec.model.traverse(Linear.Config)}
    assert kinds["lm_head"] is Linear.Config
    blocks = {k: v for k, v in kinds.items() if k.startswith("layers.")}
    assert blocks and set(blocks.values()) == {BlockFP8Linear.Config}
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    fp8 = [m for m in model.modules() if isinstance(m, BlockFP8Linear)]
    assert len(fp8) == len(blocks) and all(m.config.block == (128, 128) for m in fp8)
    config = configure(llama3_debugmodel(), fp8=BlockFP8LinearConverter.Config(block=(64, 64)))
    assert config.model_spec.parallelize_fn.options.fp8.block == (64, 64)
    with pytest.raises(ValueError, match="converts no Linear layer"):
        BlockFP8LinearConverter.Config(filter_fqns=["layers", "lm_head"]).build().convert(
            model_registry("debugmodel").model)


# -- torchtitan's trainer --------------------------------------------------------------------------
def _assert_within(reference, other, tolerance: float = TOLERANCE) -> dict[str, float]:
    """Per-step losses and fp64 full-gradient norms (relative) of ``other`` within
    ``tolerance`` of ``reference``'s, at every step of the reference."""
    assert [r["step"] for r in other] == [r["step"] for r in reference]
    diffs = titan_jobs.max_differences(reference, other)
    assert diffs["loss"] <= tolerance, diffs
    assert diffs["grad_norm_fp64"] <= tolerance, diffs
    return diffs


@pytest.mark.multiprocess
def test_the_issues_example_trains_as_one_process_with_our_muon(tmp_path):
    """``configure(..., state_sharding="auto", optimizer="muon")`` under ``torchrun -m
    torchtitan.train`` on 2 ranks, 3 steps: the partitioner's choice logged, our Muon built
    by torchtitan's container, the same losses and full-gradient norms as one process with our
    Muon on the same batches (bit for bit, measured), and no torchtitan attribute changed but
    those its own FSDP2 run changes."""
    work = titan_jobs.assets_only(str(tmp_path))
    steps = ("--training.steps", "3", *NO_CLIP)
    ours = titan_jobs.run(2, "llama3_auto_muon", str(tmp_path / "ours"), work, steps,
                          exact_norms=True, watch_attributes=True)
    one = titan_jobs.run(1, "llama3_muon_one_process", str(tmp_path / "one"), work, steps,
                         exact_norms=True, watch_attributes=True)
    # torchtitan's own state (its SPMD backend, step counters, logger) and nothing else: what
    # its FSDP2 run changes itself
    assert ours.changed == one.changed
    assert all(a.rsplit(".", 1)[1].startswith("_") for a in ours.changed), ours.changed
    assert "state_sharding='auto' chose" in ours.log
    assert "Optimizer Muon (model_part=0)" in ours.log
    assert ours.steps[-1]["loss"] < ours.steps[0]["loss"] - 0.05  # it trains
    _assert_within(one.steps, ours.steps)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """Assets and torchtitan's seed checkpoint of the llama3 debug model (both runtimes and the
    one-process references start from it)."""
    return compare.make_workdir(str(tmp_path_factory.mktemp("titan_integration")))


STEPS = ("--training.steps", "8")


@pytest.fixture(scope="module")
def fsdp2_hsdp(seeded):
    """torchtitan as it ships (torch FSDP2) with HSDP on 2x2, 8 steps from the seed."""
    return titan_jobs.run(4, "llama3_fsdp2", os.path.join(seeded.root, "fsdp2_hsdp"), seeded,
                          STEPS + HSDP_2X2, exact_norms=True, seed=True)


# torchtitan's logged norm is an fp32 sum of squares over each rank's shard: its rounding depends
# on the cuts (AMSP's 4-way optimizer shards against HSDP's 2-way ones: 4.5e-5 relative apart,
# measured; one process's whole tensors are 1.4e-4 off the fp64 norm). A gradient reduced over
# the wrong ranks or divided once too often moves it by a factor (0.7, 2): far beyond this bound.
LOGGED_NORM_ROUNDING = 5e-4


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["llama3_amsp", "llama3_auto"])
def test_per_state_sharding_on_2x2_matches_torchtitans_hsdp_with_fsdp2(seeded, fsdp2_hsdp, config):
    """AMSP (parameters over fsdp, gradients and optimizer state over both dims) and the
    partitioner's choice, 8 steps on 4 ranks with torchtitan's clipping: losses and the fp64
    norms of the gradients torchtitan clips within 1e-5 of FSDP2's HSDP per step, and its
    logged fp32 norm within that norm's rounding."""
    ours = titan_jobs.run(4, config, os.path.join(seeded.root, config), seeded,
                          STEPS + HSDP_2X2, exact_norms=True, seed=True)
    diffs = _assert_within(fsdp2_hsdp.steps, ours.steps)
    assert diffs["grad_norm"] <= LOGGED_NORM_ROUNDING * min(
        s["grad_norm"] for s in fsdp2_hsdp.steps), diffs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_muon_on_amsp_matches_one_process_muon(seeded):
    """Our Muon on AMSP over 2x2 (one optimizer mesh over the 4 ranks), 8 steps: losses and
    fp64 full-gradient norms within 1e-5 of one process's Muon on the 4 ranks' batches."""
    options = STEPS + NO_CLIP
    ours = titan_jobs.run(4, "llama3_amsp_muon", os.path.join(seeded.root, "amsp_muon"), seeded,
                          options + HSDP_2X2, exact_norms=True, seed=True)
    one = titan_jobs.run(1, "llama3_muon_one_process", os.path.join(seeded.root, "muon_one"),
                         seeded, options + ("--dataloader.ranks", "4",
                                            "--training.global_batch_size", "8"),
                         exact_norms=True, seed=True)
    _assert_within(one.steps, ours.steps)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_block_fp8_matches_one_process_fp8_bit_for_bit(seeded):
    """FP8 all-gathers and GEMMs on 2 ranks, 8 steps: losses and fp64 full-gradient norms bit
    for bit those of one process whose FP8 layers quantize their whole weight in each forward
    (the ranks' gradients summed in the same order), and those of torch FSDP2 with the same FP8
    layers on 2 ranks. FP8 rounds last-bit weight differences into larger ones, so nothing
    looser than the same sums would do (one process on the concatenated batch: 8e-5 by step 4)."""
    options = STEPS + NO_CLIP
    runs = {name: titan_jobs.run(n, name, os.path.join(seeded.root, name), seeded, options,
                                 exact_norms=True, seed=True)
            for n, name in ((2, "llama3_fp8"), (1, "llama3_fp8_one_process"),
                            (2, "llama3_fp8_fsdp2"))}
    ours = runs["llama3_fp8"]
    assert "quant=BlockFP8Config(block=(128, 128)" in ours.log  # what configure passed
    _assert_within(runs["llama3_fp8_one_process"].steps, ours.steps, 0.0)
    _assert_within(runs["llama3_fp8_fsdp2"].steps, ours.steps, 0.0)


# -- torchao's float8 all-gather: refused by ours (docs/torchtitan.md, "torchao's float8") --------
def _torchao_float8_gather_weights(rank: int, world: int):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from ragged_placement.fsdp import fully_shard

    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        recipe = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        return convert_to_float8_training(net, config=recipe)

    mesh = DeviceMesh("cpu", list(range(world)))
    assert hasattr(type(model()[0].weight), "fsdp_pre_all_gather")
    torch_fully_shard(model(), mesh=mesh)  # FSDP2 takes them (its all-gather extension)
    with pytest.raises(NotImplementedError, match=r"'0.weight' .*fsdp_pre_all_gather"):
        fully_shard(model(), mesh=mesh)
    return True


def test_torchaos_float8_all_gather_weights_are_refused_naming_the_parameter():
    """torchao's tensorwise float8 weights with ``enable_fsdp_float8_all_gather`` (the only
    recipe torchao gathers in float8; torchtitan 0.3.0's converter never enables it) carry
    FSDP2's all-gather extension; ours refuses them rather than gathering them in fp32."""
    pytest.importorskip("torchao", reason="pip install torchao==0.18.0")
    from dist_utils import run_threaded

    assert all(run_threaded(_torchao_float8_gather_weights, 2))
