"""``--model hf:mixtral|hf:qwen3_moe|hf:deepseek_v3``: Hugging Face mixtures of experts in the
trainer, with FSDP over all ranks (``--ep 1``) and with expert parallelism (``--ep N``).

Each distributed run is the trainer's own ``_train`` on 4 gloo ranks forked by ``run_gloo`` (as
tests/train/test_train_moe.py), several runs in one call, with ``--output`` saving the final full
state dict. The reference is the same ``transformers`` model in one process on the concatenated
batch with the same AdamW, schedule and clipping; every router call of the reference asserts
that the k-th and (k+1)-th expert scores of every token differ by at least ``MARGIN`` (the seeds
are chosen for it), so the distributed runs, whose scores agree to rounding, route every token
to the same experts and the comparison is exact.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from common_fsdp import routed_reference
from dist_utils import run_gloo

from ragged_placement import train
from ragged_placement.trainer.build import new_model
from ragged_placement.trainer.config import check_world, parse_config
from ragged_placement.trainer.distributed import DistributedEnv

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
transformers = pytest.importorskip("transformers")

STEPS, WORLD, GLOBAL_BATCH, ATOL = 6, 4, 4, 1e-5
# The smallest gap between the k-th and (k+1)-th router score the reference allows. Per family
# the seed with the widest gap among 0-59 (6 steps): Mixtral 6.9e-5 (2 MoE layers), Qwen3-MoE
# 2.7e-4, DeepSeek-V3 3.9e-4; the distributed scores differ from one process's by ~1e-7.
MARGIN = 2.5e-5
SEEDS = {"mixtral": 24, "qwen3_moe": 30, "deepseek_v3": 12}


def _argv(kind: str) -> list[str]:
    layers = [] if kind == "mixtral" else ["--moe-layers", "1"]  # Mixtral: every layer MoE
    return ["--model", f"hf:{kind}", "--layers", "2", *layers, "--experts", "8", "--top-k", "2",
            "--width", "32", "--heads", "2", "--seq", "16", "--data-bytes", "65536",
            "--steps", str(STEPS), "--lr", "3e-3", "--warmup", "2", "--seed", str(SEEDS[kind]),
            "--log-every", "3"]


def _router_margins(model: torch.nn.Module) -> list[float]:
    """Hooks appending, per router call, the smallest gap between the k-th and (k+1)-th score
    (softmax; DeepSeek-V3: sigmoid plus its correction bias, which chooses its experts)."""
    margins: list[float] = []

    def hook(gate: torch.nn.Module, args, out) -> None:
        logits = out[0].detach().float()
        bias = getattr(gate, "e_score_correction_bias", None)
        scores = logits.sigmoid() + bias if bias is not None else logits.softmax(-1)
        top = torch.topk(scores, gate.top_k + 1, dim=-1).values
        margins.append((top[:, -2] - top[:, -1]).min().item())

    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    assert routers, "no router found"
    for m in routers:
        m.register_forward_hook(hook)
    return margins


@functools.cache
def _reference(kind: str) -> tuple[tuple[float, ...], dict[str, torch.Tensor]]:
    """One process, the whole global batch, the trainer's initial weights, AdamW, schedule and
    clipping; asserts the routing margin of every step."""
    cfg = parse_config([*_argv(kind), "--batch", str(GLOBAL_BATCH)])
    torch.manual_seed(cfg.seed)
    model = new_model(cfg)
    return routed_reference(cfg, model, STEPS, _router_margins(model), MARGIN)


def _train_runs(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """The trainer on this gloo rank, once per argv of ``runs``."""
    import torch.distributed as dist

    out = []
    for argv in runs:
        cfg = parse_config(argv)
        check_world(cfg, world)
        env = DistributedEnv(rank, world, rank, torch.device("cpu"),
                             dist.distributed_c10d._get_default_store(), 60.0)
        out.append(train._train(cfg, env, None))
    return out


def _gathered(out: dict) -> float:
    """All-gather bytes per step of rank 0."""
    return sum(v for k, v in out["collective_bytes_by_call"].items() if "all_gather" in k)


def _check_family(kind: str, runs: list[tuple[str, int, str]], tmp_path) -> None:
    """``runs`` ((runtime, ep, extra flags) each) on 4 gloo ranks end within 1e-5 of one process
    (losses and every weight), so within 2e-5 of each other; with ``--ep`` > 1 the runtime
    gathers less (the experts are sharded by expert over ep, gathered only over the ranks beside
    it)."""
    losses, expected = _reference(kind)
    per_rank = ["--batch", str(GLOBAL_BATCH // WORLD)]
    argvs = [[*_argv(kind), *per_rank, "--runtime", runtime, "--ep", str(ep), *extra.split(),
              "--output", str(tmp_path / f"{i}.pt")] for i, (runtime, ep, extra) in enumerate(runs)]
    results = run_gloo(_train_runs, WORLD, argvs)[0]
    by_run = dict(zip(runs, results))
    for i, ((runtime, ep, extra), out) in enumerate(by_run.items()):
        run = f"{runtime} --ep {ep} {extra}".strip()
        if ep > 1 and (runtime, 1, extra) in by_run:
            assert _gathered(out) < _gathered(by_run[runtime, 1, extra]), run
        torch.testing.assert_close(out["losses"], list(losses), atol=ATOL, rtol=ATOL, msg=run)
        trained = torch.load(tmp_path / f"{i}.pt")
        assert trained.keys() == expected.keys()
        print(f"{kind} {run}: loss "
              f"{max(abs(a - b) for a, b in zip(out['losses'], losses)):.1e}, weights "
              f"{max((trained[k] - v).abs().max().item() for k, v in expected.items()):.1e}")
        for name, value in expected.items():
            torch.testing.assert_close(trained[name], value, atol=ATOL, rtol=ATOL,
                                       msg=f"{run}: {name}")


def test_hf_moe_recomputed_by_activation_checkpointing_matches_one_pass():
    """DeepSeek-V3 with every layer under the trainer's ``checkpoint_wrapper``: the same loss
    and gradients as without (``use_cache`` is off: with a KV cache, the recomputed attention
    appended to the cache of the first pass and saw 32 keys instead of 16)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from ragged_placement.trainer.build import TokenData, loss_fn

    cfg = parse_config(_argv("deepseek_v3"))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(cfg.seed)
        model = new_model(cfg)
        if checkpointed:
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = checkpoint_wrapper(layer)
        loss_fn(model, *TokenData(cfg).batch(0, 0, 1)).backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, atol=0, rtol=0)


def _config_json(tmp_path, **changes) -> str:
    """A Qwen3-MoE config.json of the test's sizes with ``changes``."""
    cfg = parse_config(_argv("qwen3_moe"))
    from ragged_placement.trainer.hf import hf_config

    doc = {**hf_config(cfg, 256).to_dict(), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "hf:mixtral", "--experts", "8", "--ep", "3"],
         "--ep 3 does not divide the 8 experts of --model 'hf:mixtral'"),
        (["--model", "hf:qwen3_moe", "--experts", "4", "--top-k", "5"],
         "--top-k 5 exceeds --experts 4"),
        (["--model", "hf:deepseek_v3", "--layers", "2", "--moe-layers", "3"],
         "--moe-layers 3 exceeds --layers 2"),
        (["--model", "hf:mixtral", "--moe-layers", "1"],
         "--moe-layers is an option of --model moe, got --model 'hf:mixtral'.* Mixtral no"),
        (["--model", "hf:llama", "--ep", "2"], "--ep is an option of --model moe"),
        (["--model", "hf:qwen3_moe", "--ep", "2", "--state-sharding", "zero2"],
         "--state-sharding zero2 with --ep 2 and --model 'hf:qwen3_moe' is not supported"),
        (["--model", "hf:qwen3_moe", "--ep", "2", "--mesh", "2x2"],
         "--mesh 2x2 with --model hf:qwen3_moe: .* set by --ep"),
        (["--model", "hf:deepseek_v3", "--fp8"], "--fp8 with --model 'hf:deepseek_v3'"),
    ],
)
def test_bad_hf_moe_flags_raise_naming_the_flag(argv, message):
    """Checked by parse_config, before any process group."""
    with pytest.raises(ValueError, match=message):
        parse_config(argv)


def test_hf_moe_config_json_refusals(tmp_path):
    """A config.json: its experts are in the file (--experts refused, --ep checked against
    them); a router auxiliary loss or router noise, which the trainer would not reproduce as
    one process, is refused (in any Hugging Face model); the file's own ep-compatible config is
    accepted."""
    def parse(path: str, *argv: str):
        return parse_config(["--model", path, "--seq", "16", *argv])

    path = _config_json(tmp_path)
    assert parse(path, "--ep", "4").ep == 4
    with pytest.raises(ValueError, match="--experts is an option of --model moe"):
        parse(path, "--experts", "8")
    with pytest.raises(ValueError, match="--ep 3 does not divide the 8 experts of --model"):
        parse(path, "--ep", "3")
    for kind in ("qwen3_moe", "qwen2_moe"):  # qwen2_moe: a mixture of experts --ep does not take
        with pytest.raises(ValueError, match="output_router_logits is true"):
            parse(_config_json(tmp_path, model_type=kind, output_router_logits=True))
    with pytest.raises(ValueError, match="router_jitter_noise 0.1 draws noise per rank"):
        parse(_config_json(tmp_path, model_type="mixtral", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="num_experts_per_tok 9 exceeds the 8 experts"):
        parse(_config_json(tmp_path, num_experts_per_tok=9))


@pytest.mark.multiprocess
def test_hf_qwen3_moe_expert_parallel_matches_one_process(tmp_path):
    """Qwen3-MoE (the last layer MoE), EP 2 x FSDP 2 (ours): 6 AdamW steps within 1e-5 of one
    process. (FSDP without EP, EP 4 and torch FSDP2: the opt-in test below.)"""
    _check_family("qwen3_moe", [("ours", 2, "")], tmp_path)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_hf_moe_fsdp_and_expert_parallel_match_one_process(kind, tmp_path):
    """Mixtral (every layer MoE), Qwen3-MoE and DeepSeek-V3 (a shared expert, sigmoid router
    with its correction bias, MLA; the last layer MoE): FSDP over 4 ranks (ours and torch
    FSDP2), EP 2 x FSDP 2 and EP 4 (ours), EP 2 x FSDP 2 and EP 4 (torch FSDP2 + the same EP),
    and EP 2 x FSDP 2 with activation checkpointing (both runtimes): 6 AdamW steps within 1e-5
    of one process. Opt-in (``-m slow``, ``make test-slow``)."""
    runs = [(runtime, ep, "") for runtime in ("ours", "fsdp2") for ep in (1, 2, 4)]
    runs += [(runtime, 2, "--activation-checkpointing") for runtime in ("ours", "fsdp2")]
    _check_family(kind, runs, tmp_path)
