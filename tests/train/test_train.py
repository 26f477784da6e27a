"""``python -m ragged_placement.train`` under ``torchrun``: checkpoints, resume, failures, options.

One uninterrupted run per runtime (ours, torch FSDP2) is the reference of a run whose rank 1
fails at step 5 (ours: killed; FSDP2: frozen, so rank 0's collective times out) under
``torchrun --max-restarts 1``: the restarted workers resume from the step-4 checkpoint by
themselves and must end with bitwise the same weights (fp32). The uninterrupted runs are also
checked against one process training on the concatenated batch, their checkpoint directories
against the retention rule, and a copy with a flipped byte must be refused naming the file.
Bad options are checked in-process (they fail before any process-group work).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from dist_utils import run_gloo
from fault_injection import FAULT_ENV
from fault_injection import SCRIPT as FAULT_SCRIPT
from torch.utils._python_dispatch import TorchDispatchMode

from ragged_placement.models import GPT, GPTConfig, StdlibCorpus
from ragged_placement import train
from ragged_placement.train import main
from ragged_placement.trainer.checkpoint import MANIFEST, CheckpointCorruptError, Checkpointer
from ragged_placement.trainer.config import check_world, parse_config
from ragged_placement.trainer.distributed import DistributedEnv
from ragged_placement.trainer.resume import find_resume

STEPS, EVERY, FAULT_STEP = 8, 2, 5
SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--seq", "16", "--batch", "2",
         "--data-bytes", "65536", "--steps", str(STEPS), "--lr", "1e-2", "--warmup", "2",
         "--seed", "3", "--log-every", "4"]
# main() in-process: torchrun's @record cannot install its fault handler under pytest's capture
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
TIMEOUT = 900  # hang guard per torchrun launch (a launch takes about 2 min on 2 busy cores)
REPO = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def run_command(cmd: list[str], *, env: dict[str, str] | None = None,
                timeout: float = TIMEOUT) -> tuple[int, str]:
    """Run ``cmd`` (output merged). On timeout: SIGTERM (torchrun stops its workers,
    two_nodes.sh removes its namespaces), then SIGKILL whatever is left under it; raise."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = _descendants(proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        for pid in [*tree, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} ran over {timeout} s:\n{out[-4000:]}") from None
    return proc.returncode, out


def torchrun(args: list[str], *, restarts: int = 0, env: dict[str, str] | None = None,
             nproc: int = 2, fault: str | None = None) -> tuple[int, str, float]:
    """``python -m ragged_placement.train args`` under torchrun; with ``fault``
    (``kill:<rank>:<step>`` or ``hang:``), the trainer with that fault injected
    (``fault_injection.py``)."""
    t0 = time.monotonic()
    entry = ["-m", "ragged_placement.train"] if fault is None else [FAULT_SCRIPT]
    env = env if fault is None else {**(env or {}), FAULT_ENV: fault}
    rc, out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
                           *entry, *args], env=env)
    return rc, out, time.monotonic() - t0


@pytest.fixture
def torchrun_rank(monkeypatch):
    """torchrun's environment of rank 0 of 2, for ``main`` in-process (its checks run before
    any process-group work, which is never reached here)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module", params=["ours", "fsdp2"])
def runs(request, tmp_path_factory) -> dict:
    """An uninterrupted run and a failed-then-restarted run of ``--runtime``."""
    runtime, tmp = request.param, tmp_path_factory.mktemp(request.param)
    common = [*SMALL, "--runtime", runtime, "--checkpoint-every", str(EVERY)]
    full = [*common, "--checkpoint-dir", str(tmp / "full"), "--output", str(tmp / "full.pt")]
    rc, out, _ = torchrun(full)
    assert rc == 0, out[-4000:]
    fault = "kill" if runtime == "ours" else "hang"
    failed = [*common, "--checkpoint-dir", str(tmp / "failed"), "--output", str(tmp / "failed.pt"),
              "--collective-timeout", "5"]
    rc2, out2, _ = torchrun(failed, restarts=1, fault=f"{fault}:1:{FAULT_STEP}")
    assert rc2 == 0, out2[-4000:]
    return {"runtime": runtime, "dir": tmp, "out": out, "failed_out": out2}


def _one_process_model(model: str) -> tuple[torch.nn.Module, Callable]:
    """The reference's model of ``--model`` (seeded by the caller) and its loss."""
    if model == "gpt":
        net = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32))
        return net, net
    transformers = pytest.importorskip("transformers")
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, tie_word_embeddings=False))

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(net(x).logits.view(-1, 256), y.view(-1))

    return net, loss


@functools.cache
def _reference(model: str = "gpt", extended: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """One process, the concatenated batch of both ranks, the same schedule (warmup, cosine).
    ``extended=(at, steps)``: from step ``at`` on, the schedule of ``steps`` steps and training
    to ``steps`` (a run resumed at ``at`` with a larger ``--steps``)."""
    torch.manual_seed(3)
    net, loss_of = _one_process_model(model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    total = STEPS

    def factor(s: int) -> float:
        if s < 2:
            return (s + 1) / 2
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 2) / (total - 2))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    corpus = StdlibCorpus(max_bytes=65536)
    for s in range(STEPS if extended is None else extended[1]):
        if extended is not None and s == extended[0]:
            total = extended[1]
            for group in opt.param_groups:
                group["lr"] = 1e-2 * factor(s)
        loss = loss_of(*corpus.batch(s, 4, 16, seed=3))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
    return net.state_dict()


def _assert_matches_reference(trained: dict[str, torch.Tensor], model: str = "gpt") -> None:
    _assert_weights_close(trained, _reference(model))


def _assert_weights_close(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
                          ) -> None:
    for name, value in expected.items():
        got = trained[name]
        if name.endswith("attn.qkv.bias"):
            # The key bias cancels in the softmax: its gradient is rounding noise, which Adam
            # scales to lr-sized steps (1.3e-5 apart here); the query and value biases count.
            got, value = got[torch.arange(96) // 32 != 1], value[torch.arange(96) // 32 != 1]
        torch.testing.assert_close(got, value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.multiprocess
def test_restart_after_failure_is_bitwise_equal_to_uninterrupted(runs):
    full = torch.load(runs["dir"] / "full.pt")
    failed = torch.load(runs["dir"] / "failed.pt")
    assert full.keys() == failed.keys()
    for name in full:
        assert torch.equal(full[name], failed[name]), name
    out = runs["failed_out"]
    assert "resumed from" in out and f"step_{FAULT_STEP - 1:08d} at step {FAULT_STEP - 1}" in out
    if runs["runtime"] == "fsdp2":  # rank 1 froze: the collective timeout, not the hang guard, ended it
        assert "rank 0: collective" in out and f"in step {FAULT_STEP}" in out
        assert "ranks behind it, dead or frozen: rank 1 (entered" in out


@pytest.mark.multiprocess
def test_trained_weights_match_one_process_and_two_checkpoints_kept(runs):
    _assert_matches_reference(torch.load(runs["dir"] / "full.pt"))
    kept = sorted(p.name for p in (runs["dir"] / "full").iterdir())
    assert kept == [f"step_{STEPS - EVERY:08d}", f"step_{STEPS:08d}"]


@pytest.mark.multiprocess
def test_flipped_byte_is_refused_naming_the_file(runs, tmp_path, capsys, torchrun_rank):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["dir"] / "full", ckpt)
    shard = ckpt / f"step_{STEPS:08d}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    cfg = parse_config([*SMALL, "--runtime", runs["runtime"], "--checkpoint-dir", str(ckpt)])
    with pytest.raises(CheckpointCorruptError, match=f"{shard}.* corrupt"):
        find_resume(cfg, 0, 2)
    with pytest.raises(SystemExit) as e:  # the entrypoint: before any process-group work
        main([*SMALL, "--checkpoint-dir", str(ckpt)])
    assert e.value.code == 2 and str(shard) in capsys.readouterr().err


@pytest.mark.multiprocess
def test_hugging_face_llama_ours_and_fsdp2_match_one_process(tmp_path):
    """``--model hf:llama``: a transformers LlamaForCausalLM, one fully_shard per decoder layer
    then the root, under both runtimes; the rotary embedding's non-persistent ``inv_freq`` must
    survive the meta-device build (the one-process reference has the real one)."""
    pytest.importorskip("transformers")
    losses = {}
    for runtime in ("ours", "fsdp2"):
        out_pt, metrics = tmp_path / f"{runtime}.pt", tmp_path / f"{runtime}.json"
        rc, out, _ = torchrun([*SMALL, "--model", "hf:llama", "--heads", "4", "--runtime", runtime,
                               "--output", str(out_pt), "--metrics", str(metrics)])
        assert rc == 0, out[-4000:]
        _assert_matches_reference(torch.load(out_pt), "hf:llama")
        losses[runtime] = json.loads(metrics.read_text())["losses"]
    assert len(losses["ours"]) == STEPS
    torch.testing.assert_close(losses["ours"], losses["fsdp2"], atol=1e-5, rtol=1e-5)


def test_hugging_face_model_errors_name_the_flag(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="--model 'hf:nonsense': 'nonsense' is not a causal LM"):
        parse_config(["--model", "hf:nonsense"])
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 16}))
    with pytest.raises(ValueError, match="--seq 64 > max_position_embeddings 16"):
        parse_config(["--model", str(config)])
    with pytest.raises(ValueError, match="--layers: --model .*config.json' takes its sizes"):
        parse_config(["--model", str(config), "--layers", "4"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a \"model_type\" key"):
        parse_config(["--model", str(tmp_path / "bad.json")])
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(ValueError, match="--model 'hf:llama': .* pip install transformers"):
        parse_config(["--model", "hf:llama"])


def _one_sequence_per_rank() -> list[str]:
    """``SMALL`` with one sequence per rank: 4 ranks make the reference's global batch of 4."""
    return [a if a != "2" or prev != "--batch" else "1" for prev, a in zip(["", *SMALL], SMALL)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shardings", [
    ("zero3", "auto"),
    pytest.param(("zero3", "zero2", "amsp", "auto"), marks=pytest.mark.slow, id="all"),
], ids=lambda s: "-".join(s))
def test_state_sharding_matches_one_process(tmp_path, shardings):
    """``--state-sharding`` on 4 ranks as a 2x2 mesh (inter, intra): zero3 (the mesh flattened),
    and through fully_shard's ``state_sharding`` zero2, AMSP and the partitioner's choice (the
    bandwidths given, so the choice is known: AMSP, reshard_after_forward False), each end with
    one process's weights; every point keeps 1/4 of AdamW's state per rank; of the parameters,
    each rank keeps its shard (zero3), plus the whole buffer (zero2) or a chunk of 1/2 (AMSP):
    1, 5 and 3 times the model's bytes over the 4 ranks. ``make test`` runs zero3 and the
    partitioner's AMSP (zero2 trains in the resume tests below); ``make test-slow`` all four."""
    weights, state = {}, {}
    for sharding in shardings:
        extra = ["--bandwidth", "inter=1e8,intra=1e10"] if sharding == "auto" else []
        rc, out, _ = torchrun([*_one_sequence_per_rank(), "--mesh", "2x2", "--mesh-dim-names",
                               "inter,intra", "--state-sharding", sharding, *extra,
                               "--output", str(tmp_path / f"{sharding}.pt"),
                               "--metrics", str(tmp_path / f"{sharding}.json")], nproc=4)
        assert rc == 0, out[-4000:]
        weights[sharding] = torch.load(tmp_path / f"{sharding}.pt")
        _assert_matches_reference(weights[sharding])
        state[sharding] = json.loads((tmp_path / f"{sharding}.json").read_text())["per_rank"]
    assert "the partitioner chose P(intra) G(inter,intra) OS(inter,intra), " \
           "reshard_after_forward=False" in out and "comm s" in out
    with torch.device("meta"):  # parameters() counts the tied embedding once
        unique = list(_one_process_model("gpt")[0].parameters())
    numel = sum(p.numel() for p in unique)
    adam = [r["state_bytes"]["optimizer"] for r in state["zero3"]]
    assert 8 * numel <= sum(adam) <= 1.1 * (8 * numel) + 4 * 4 * len(unique)
    for sharding in shardings[1:]:
        assert [r["state_bytes"]["optimizer"] for r in state[sharding]] == adam, sharding
    params = {s: sum(r["state_bytes"]["params"] for r in ranks) for s, ranks in state.items()}
    expected = {"zero3": 1, "zero2": 5, "amsp": 3, "auto": 3}  # times the model's bytes
    for sharding in shardings:
        assert params[sharding] == pytest.approx(expected[sharding] * 4 * numel, rel=0.05), sharding
    if "amsp" in params:
        assert params["amsp"] == params["auto"]


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.multiprocess
def test_checkpoint_of_other_options_is_never_written_over(runs, tmp_path, capsys, torchrun_rank):
    ckpt = runs["dir"] / "full"
    before = _tree(ckpt)
    with pytest.raises(SystemExit) as e:
        main([*SMALL, "--seed", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"])
    assert e.value.code == 2 and "--seed 4 differs from 3" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="never written over"):
        Checkpointer(ckpt, {}).save(STEPS, None, None, {})
    assert _tree(ckpt) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be > 0, got 0"),
        (["--steps", "ten"], "--steps must be int, got 'ten'"),
        (["--lr", "fast"], "--lr must be float"),
        (["--runtime", "deepspeed"], "--runtime must be one of ours, fsdp2, got 'deepspeed'"),
        (["--state-sharding", "zero2", "--runtime", "fsdp2"],
         "--state-sharding zero2 with --runtime fsdp2 is not supported: torch FSDP2 shards "
         "parameters, gradients and optimizer state over the same mesh dims.*; pass "
         "--state-sharding zero3, or pass --runtime ours"),
        (["--state-sharding", "auto", "--runtime", "fsdp2"],
         "--state-sharding auto with --runtime fsdp2 is not supported"),
        (["--state-sharding", "amsp"], "--state-sharding amsp needs a 2-D --mesh"),
        (["--bandwidth", "dp=1e9"], "--bandwidth is the partitioner's input: it needs --state-sharding auto"),
        (["--memory-budget", "1e9", "--state-sharding", "amsp", "--mesh", "2x2"],
         "--memory-budget is the partitioner's input"),
        (["--state-sharding", "auto", "--memory-budget", "-1"], "--memory-budget must be a finite number >= 0, got -1.0"),
        (["--state-sharding", "auto", "--bandwidth", "dp=fast"],
         "--bandwidth must be 'profile' or one positive bytes/s per mesh dim \\(dp=...\\)"),
        (["--state-sharding", "auto", "--mesh", "2x2", "--mesh-dim-names", "inter,intra",
          "--bandwidth", "inter=1e9"], "--bandwidth must be .* \\(inter=...,intra=...\\)"),
        (["--state-sharding", "hsdp"], "--state-sharding hsdp needs a 2-D --mesh"),
        (["--mesh", "2x"], "--mesh must look like 4 or 2x2, got '2x'"),
        (["--mesh", "2x2", "--mesh-dim-names", "a"], "--mesh-dim-names must give 2 distinct"),
        (["--mesh-dim-names", "a"], "--mesh-dim-names needs --mesh"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
        (["--fp8", "--runtime", "fsdp2"],
         "--fp8 with --runtime fsdp2 is not supported: torch FSDP2 has no block-wise FP8 "
         "all-gather.*; drop --fp8, or pass --runtime ours"),
        (["--model", "gpt3"], "--model must be gpt, llama, moe, hf:TYPE or a Hugging Face config"),
        (["--optimizer", "sgd"], "--optimizer must be one of adamw, muon, shampoo"),
        (["--data", "/nonexistent.bin"], "--data must be 'stdlib' or a token file"),
        (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr=-1e-3"], "--lr must be a finite number > 0, got -0.001"),
        (["--min-lr-ratio", "nan"], "--min-lr-ratio must be a finite number >= 0, got nan"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
        (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0, got nan"),
        (["--collective-timeout", "inf"], "--collective-timeout must be a finite number > 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--seed", str(2**62)], "--seed must be < 2\\*\\*40"),
        (["--heads", "3", "--width", "64"], "--heads 3 must divide --width 64 .* --heads 2"),
        (["--model", "llama", "--heads", "5", "--width", "64"], "--heads 5 must divide --width 64"),
        (["--model", "hf:gpt2", "--heads", "5", "--width", "64"], "--heads 5 must divide --width 64"),
        (["--data-bytes", "64", "--seq", "64"], "--data-bytes 64 is too small for --seq 64"),
        (["--val-batches", "1", "--data-bytes", "500"], "--data-bytes 500 is too small for --seq 64"),
        (["--state-sharding", "auto", "--bandwidth", "dp=inf"], "--bandwidth must be 'profile' or one"),
    ],
)
def test_bad_flags_raise_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_config(argv)


def test_toml_config_and_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[training]\nsteps = 7\nlr = 0.5\n[parallelism]\nmesh = "2x2"\n'
                    'mesh_dim_names = ["inter", "intra"]\nstate_sharding = "hsdp"\n')
    cfg = parse_config(["--config", str(toml), "--steps", "9"])
    assert (cfg.steps, cfg.lr, cfg.mesh, cfg.mesh_dim_names) == (9, 0.5, (2, 2), ("inter", "intra"))
    with pytest.raises(ValueError, match="--mesh 2x2 needs 4 ranks, the job has 3"):
        check_world(cfg, 3)
    toml.write_text("stepz = 3\n")
    with pytest.raises(ValueError, match="unknown option 'stepz'"):
        parse_config(["--config", str(toml)])
    toml.write_text("steps = 2.5\n")
    with pytest.raises(ValueError, match="--steps must be int, got 2.5"):
        parse_config(["--config", str(toml)])
    with pytest.raises(SystemExit):  # argparse: "unrecognized arguments: --stepz"
        parse_config(["--stepz", "3"])


@pytest.mark.multiprocess
@pytest.mark.two_nodes
def test_two_emulated_nodes_hsdp_match_one_process(tmp_path):
    """2 namespaces x 2 ranks over a 1 Gbit/s veth, HSDP (replicate across the link): 4 ranks of
    1 sequence are the reference's global batch of 4."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("iproute2 (ip, tc) is not installed")
    args = [a if a != "2" or prev != "--batch" else "1" for prev, a in zip(["", *SMALL], SMALL)]
    rc, out = run_command(["bash", "scripts/two_nodes.sh", "--", *args, "--mesh", "2x2",
                           "--mesh-dim-names", "inter,intra", "--state-sharding", "hsdp",
                           "--output", str(tmp_path / "out.pt"), "--metrics", str(tmp_path / "m.json")],
                          env={"PYTHON": sys.executable})  # this test's interpreter, any venv
    if rc == 1 and "needs root or CAP_NET_ADMIN" in out:
        pytest.skip(out.strip().splitlines()[-1])
    assert rc == 0, out[-4000:]
    tag = out.split("two_nodes.sh: ")[1].split("n0 ")[0]
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    metrics = json.loads((tmp_path / "m.json").read_text())
    veth = [b for r in metrics["per_rank"] for k, b in r["net_bytes"].items() if k.startswith(tag)]
    assert len(veth) == 2 and min(veth) > 0  # each node sent over the link
    _assert_matches_reference(torch.load(tmp_path / "out.pt"))


def _refused(argv: list[str], capsys) -> str:
    """``main``'s error line for ``argv``, which must end it with status 2 before any
    process-group work."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err


def test_checkpoint_dir_that_is_a_file_or_read_only_is_refused_at_start(tmp_path, capsys,
                                                                         torchrun_rank):
    """Before: training ran to the first save, then a raw NotADirectoryError / OSError."""
    file = tmp_path / "file"
    file.write_text("")
    err = _refused([*SMALL, "--checkpoint-dir", str(file), "--checkpoint-every", "2"], capsys)
    assert f"error: --checkpoint-dir {file} is a file, not a directory" in err
    if os.geteuid() == 0:  # root writes through file modes: sysfs refuses new files to anyone
        read_only = Path("/sys/kernel")
    else:
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
    err = _refused([*SMALL, "--checkpoint-dir", str(read_only), "--checkpoint-every", "2"], capsys)
    assert f"error: --checkpoint-dir {read_only} is not writable (" in err
    assert list(read_only.glob(".write-probe-*")) == []


@pytest.mark.multiprocess
def test_step_directory_without_manifest_is_moved_aside_at_start(runs, tmp_path, capsys,
                                                                 torchrun_rank):
    """Before: skipped, its steps trained again, then FileExistsError at its save. Now rank 0
    moves it aside at start and says so; the newest complete checkpoint is resumed."""
    if runs["runtime"] != "ours":
        pytest.skip("the checkpoint directory does not depend on the runtime")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["dir"] / "full", ckpt)
    newest = ckpt / f"step_{STEPS:08d}"
    (newest / MANIFEST).unlink()
    cfg, resume = train._check([*SMALL, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"])
    assert f"{newest} has no {MANIFEST}" in capsys.readouterr().err
    assert not newest.exists() and (ckpt / f".incomplete-step_{STEPS:08d}").is_dir()
    assert resume.path == ckpt / f"step_{STEPS - EVERY:08d}"


def _rewrite(path: Path, name: str, state: object) -> None:
    """Replace file ``name`` of checkpoint ``path`` and its checksum in the manifest."""
    torch.save(state, path / name)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.multiprocess
def test_resume_checks_what_carries_over(runs, tmp_path):
    """On 2 ranks x --batch 2 (a global batch of 4): another global batch is refused naming
    --batch, 4 ranks x 1 accepted and logged; --steps may grow, not shrink; Shampoo's
    rank-local state and RNG states that differ between ranks are refused on another world size."""
    if runs["runtime"] != "ours":
        pytest.skip("the trainer state does not depend on the runtime")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["dir"] / "full", ckpt)

    def resume(*argv: str, world: int = 2):
        return find_resume(parse_config([*SMALL, "--checkpoint-dir", str(ckpt), *argv]), 0, world)

    with pytest.raises(ValueError, match="--batch 2 on 4 ranks is a global batch of 8 .* "
                                         "--batch 2 on 2 ranks \\(4\\): pass --batch 1"):
        resume(world=4)
    with pytest.raises(ValueError, match="--batch 2 on 3 ranks .* resume on a number of ranks that divides 4"):
        resume(world=3)
    moved = resume("--batch", "1", "--mesh", "2x2", "--state-sharding", "zero2", world=4)
    assert moved.step == STEPS and not moved.schedule_changed
    assert moved.changes[0] == ("world size 2 -> 4, state sharding zero3 -> zero2, mesh 2 -> 2x2: "
                                "DCP reshards the model and optimizer state")
    assert "--batch 2 -> 1: the same global batch of 4 sequences" in moved.changes[1]
    longer = resume("--steps", "12")
    assert longer.schedule_changed and longer.changes == [
        "--steps 8 -> 12: the LR schedule now runs to step 12 (its warmup and cosine recomputed "
        "for 12 steps)"]
    with pytest.raises(ValueError, match="--steps 6 is below the step 8 of the checkpoint"):
        resume("--steps", "6")
    path = ckpt / f"step_{STEPS:08d}"
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["fingerprint"]["optimizer"] = "shampoo"  # the manifest does not checksum itself
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="--optimizer shampoo keeps its preconditioners .*\\(world size 2 -> 4"):
        resume("--optimizer", "shampoo", "--batch", "1", world=4)
    assert resume("--optimizer", "shampoo").step == STEPS  # its own layout: resumed
    manifest["fingerprint"]["optimizer"] = "adamw"
    (path / MANIFEST).write_text(json.dumps(manifest))
    state = torch.load(path / "trainer_rank1.pt", weights_only=False)
    state["rng"]["torch"] = torch.Generator().manual_seed(1).get_state()
    _rewrite(path, "trainer_rank1.pt", state)
    with pytest.raises(ValueError, match="the rng of rank 1 differs from rank 0's .* resume on 2 ranks"):
        resume("--batch", "1", world=4)


@pytest.mark.multiprocess
def test_resume_on_another_world_size_and_sharding_matches_one_process(runs, tmp_path):
    """4 ranks -> 2 (and --steps 8 -> 10, the schedule then runs to 10), 2 ranks -> 4 on a 2x2
    mesh under zero2: the same global batch, DCP resharding the model and AdamW's state, each
    ends within 1e-5 of one process trained on the same batches with the same schedule (the
    uninterrupted runs match it to the same tolerance). Before: 4 -> 2 silently halved the global
    batch; 2 -> 4 was refused."""
    if runs["runtime"] != "ours":
        pytest.skip("one runtime is enough: DCP's resharding is the same for both")
    four = [*_one_sequence_per_rank(), "--checkpoint-every", str(EVERY)]
    rc, out, _ = torchrun([*four, "--checkpoint-dir", str(tmp_path / "four")], nproc=4)
    assert rc == 0, out[-4000:]
    for src, name in ((tmp_path / "four", "to_two"), (runs["dir"] / "full", "to_four")):
        shutil.copytree(src, tmp_path / name)
        shutil.rmtree(tmp_path / name / f"step_{STEPS:08d}")  # resume from step 6
    rc, out, _ = torchrun([*SMALL, "--steps", "10", "--checkpoint-dir", str(tmp_path / "to_two"),
                           "--output", str(tmp_path / "to_two.pt")], nproc=2)
    assert rc == 0, out[-4000:]
    assert "resume: world size 4 -> 2, mesh 4 -> 2: DCP reshards" in out
    assert "resume: --steps 8 -> 10: the LR schedule now runs to step 10" in out
    _assert_weights_close(torch.load(tmp_path / "to_two.pt"), _reference("gpt", (STEPS - EVERY, 10)))
    rc, out, _ = torchrun([*four, "--mesh", "2x2", "--state-sharding", "zero2", "--checkpoint-dir",
                           str(tmp_path / "to_four"), "--output", str(tmp_path / "to_four.pt")], nproc=4)
    assert rc == 0, out[-4000:]
    assert "resume: world size 2 -> 4, state sharding zero3 -> zero2, mesh 2 -> 2x2" in out
    _assert_matches_reference(torch.load(tmp_path / "to_four.pt"))


@pytest.mark.multiprocess
def test_bad_option_under_torchrun_is_reported_once_before_the_process_group(tmp_path):
    """--heads 3 --width 64 under torchrun: before, every rank built its process group, then
    printed a traceback (139 lines for 2 ranks). Now local rank 0 prints one line and exits 2,
    the other ranks exit 0 without a word: torchrun's report names one failure. (On a busy
    machine another rank may still be starting when rank 0 exits; torchrun then stops it with
    SIGTERM and lists that too, with no error of its own.)"""
    rc, out, _ = torchrun([*SMALL, "--heads", "3", "--width", "64", "--checkpoint-dir",
                           str(tmp_path / "ckpt")], nproc=2)
    assert rc != 0
    assert out.count("error: --heads 3 must divide --width 64") == 1, out
    root = out.split("Root Cause", 1)[-1]
    assert "exitcode  : 2" in root, out
    others = re.findall(r"exitcode  : (-?\d+)", out.split("Root Cause", 1)[0])
    assert "<NO_OTHER_FAILURES>" in out or set(others) == {"-15"}, out
    assert "[rank" not in out and "layers x" not in out, out  # no traceback, no header


class C10dBytes(TorchDispatchMode):
    """The bytes of every c10d and functional-collective op dispatched inside ``with`` (the
    ops every collective reaches, whoever issued it), at the collective's size: an all-gather's
    output, a reduce-scatter's or all-to-all's input, an all-reduce's or broadcast's tensor."""

    OUTPUT = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_"}
    SECOND = {"reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
              "alltoall_base_", "alltoall_"}
    FUNCTIONAL = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

    def __init__(self) -> None:
        super().__init__()
        self.total, self.ops = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # a DTensor's own dispatch, whose collectives come back here
        out = func(*args, **(kwargs or {}))
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name != "barrier":
            sized = args[0] if name in self.OUTPUT else args[1] if name in self.SECOND else args[0]
        elif namespace.startswith("_c10d_functional") and name.startswith(self.FUNCTIONAL):
            sized = out if name.startswith("all_gather") else args[0]
        else:
            return out
        nbytes = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(sized)
                     if isinstance(t, torch.Tensor))
        self.total += nbytes
        self.ops[f"{namespace}.{name}"] += nbytes
        return out


def _comm_per_step(rank: int, world: int, argv: list[str]) -> tuple[dict, int, dict]:
    """A run of ``argv`` on this gloo rank (no torchrun: the process group exists), each step
    under :class:`C10dBytes`: the trainer's metrics and the bytes the c10d ops carried."""
    import torch.distributed as dist

    cfg = parse_config(argv)
    env = DistributedEnv(rank, world, rank, torch.device("cpu"),
                         dist.distributed_c10d._get_default_store(), 60.0)
    seen = C10dBytes()
    step = train._train_step

    def counted(*args, **kwargs):
        with seen:
            return step(*args, **kwargs)

    train._train_step = counted
    try:
        out = train._train(cfg, env, None)
    finally:
        train._train_step = step
    return out, seen.total, dict(seen.ops)


@pytest.mark.multiprocess
@pytest.mark.parametrize("runtime", ["ours", "fsdp2"])
def test_comm_counts_every_collective_of_the_step(runtime):
    """Muon (its all-to-all exchange), the gradient norm's and the loss's all-reduces, FSDP's
    all-gathers and reduce-scatters: the trainer's per-step ``collective_bytes`` (the log's
    ``comm``) equals what the c10d ops of the step carried. Before, ``sent`` counted only the
    all-gathers and reduce-scatters."""
    argv = [*SMALL, "--steps", "3", "--optimizer", "muon", "--runtime", runtime]
    for out, seen, ops in run_gloo(_comm_per_step, 2, argv):
        assert any("alltoall" in op or "all_to_all" in op for op in ops), ops
        assert out["collective_bytes"] * 3 == seen, f"{out['collective_bytes_by_call']} {ops}"
        assert out["collective_bytes"] > out["comm_bytes"]
