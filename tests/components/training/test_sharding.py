"""train.strategy: FSDP2 on 2 gloo ranks (plain torch.multiprocessing, no Ray) trains like DDP,
and its checkpoints are the unsharded format that resumes sharded or unsharded."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from components.config import ConfigError, DrafterConfig, TargetConfig, TrainConfig
from components.drafters import build_drafter
from components.training import (
    collate,
    load_checkpoint,
    new_train_state,
    save_checkpoint,
    sharding,
    train_step,
)
from components.training.chain import resolve_chain
from components.training.resume import load_trainer_state, load_weights
from tests.components.training.test_training_steps import _record

DRAFTER = DrafterConfig(name="dspark", block_size=4, num_anchors=8, markov_rank=8)
TC = TrainConfig(lr=3e-3, warmup_steps=1, grad_clip=1.0)
STEPS = 3


def _state(target, strategy: str):
    torch.manual_seed(0)
    return new_train_state(build_drafter(DRAFTER, target), TC, 10, seed=1 + dist.get_rank(),
                           wrap=lambda m: sharding.wrap(m, strategy))


def _full_weights(state) -> dict[str, torch.Tensor]:
    return sharding.gather_full_state(state.drafter, state.optimizer).weights


def _worker(rank: int, port: int, target_cfg: TargetConfig, out: str) -> None:
    from components.target import load_target

    faulthandler.enable()  # a crash inside torch/gloo prints where it happened
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    target = load_target(target_cfg, progress=False)
    layer_ids = build_drafter(DRAFTER, target).layer_ids
    batch = collate([_record(target, layer_ids, n, 3, 10 * rank + i, "float16") for i, n in enumerate([18, 14])])
    ddp, fsdp = _state(target, "ddp"), _state(target, "fsdp")
    assert not sharding.is_sharded(ddp.drafter) and sharding.is_sharded(fsdp.drafter)
    results = {"ddp": [train_step(ddp, batch)["train/loss"] for _ in range(STEPS)],
               "fsdp": [train_step(fsdp, batch)["train/loss"] for _ in range(STEPS)]}
    full = sharding.gather_full_state(fsdp.drafter, fsdp.optimizer)  # a collective: both ranks
    if rank == 0:
        save_checkpoint(fsdp, Path(out) / "ckpt", full=full)
    dist.barrier()
    results["ddp_weights"] = {k: v.detach().clone() for k, v in ddp.drafter.state_dict().items()}
    results["fsdp_weights"] = full.weights
    results["fsdp_exp_avg"] = full.optimizer["state"][0]["exp_avg"]
    # resume sharded: weights before wrapping, optimizer state split after
    torch.manual_seed(0)
    drafter = build_drafter(DRAFTER, target)
    load_weights(drafter, Path(out) / "ckpt")
    resumed = new_train_state(drafter, TC, 10, seed=99, wrap=lambda m: sharding.wrap(m, "fsdp"))
    load_trainer_state(resumed, Path(out) / "ckpt")
    resumed.generator.manual_seed(1 + rank)
    fsdp.generator.manual_seed(1 + rank)
    results["next"] = (train_step(fsdp, batch)["train/loss"], train_step(resumed, batch)["train/loss"])
    results["next_weights"] = (_full_weights(fsdp), _full_weights(resumed))
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_target_cfg, tiny_target_build) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fsdp")
    try:
        mp.spawn(_worker, args=(_free_port(), tiny_target_cfg, str(out)), nprocs=2, join=True)
    except mp.ProcessExitedException as err:
        # A rank killed by a signal (a SIGSEGV inside torch's gloo collectives, seen once in a
        # full-suite run and never alone) is retried once, loudly; a Python error in a rank, or a
        # second crash, fails the test.
        if err.signal_name is None:
            raise
        warnings.warn(f"FSDP rank {err.error_index} died of {err.signal_name}; retrying the two ranks once",
                      stacklevel=1)
        out = tmp_path_factory.mktemp("fsdp")
        mp.spawn(_worker, args=(_free_port(), tiny_target_cfg, str(out)), nprocs=2, join=True)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_fsdp_trains_like_ddp(two_ranks):
    _, (r0, r1) = two_ranks
    for r in (r0, r1):
        torch.testing.assert_close(torch.tensor(r["fsdp"]), torch.tensor(r["ddp"]), rtol=1e-4, atol=1e-5)
    assert r0["fsdp_weights"].keys() == r0["ddp_weights"].keys()
    for key, value in r0["ddp_weights"].items():
        torch.testing.assert_close(r0["fsdp_weights"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        assert torch.equal(r0["fsdp_weights"][key], r1["fsdp_weights"][key])  # one model on both ranks


def test_fsdp_checkpoint_is_the_unsharded_format_and_resumes(two_ranks, tiny_target):
    out, (r0, r1) = two_ranks
    plain = new_train_state(build_drafter(DRAFTER, tiny_target), TC, 10, seed=5)
    load_checkpoint(plain, out / "ckpt")  # the ordinary, single-process loader
    assert plain.step == STEPS
    for key, value in plain.drafter.state_dict().items():
        assert torch.equal(value, r0["fsdp_weights"][key]), key
    assert torch.equal(plain.optimizer.state_dict()["state"][0]["exp_avg"], r0["fsdp_exp_avg"])
    for r in (r0, r1):  # sharded resume continues exactly like the uninterrupted run
        straight, resumed = r["next_weights"]
        assert r["next"][0] == r["next"][1]
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_unknown_strategy_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.strategy: 'zero3' is not a training strategy.*ddp, fsdp"):
        resolve_chain(TrainConfig(strategy="zero3"))
    with pytest.raises(ConfigError, match=r"train\.per_objective\.opd\.strategy: 'x'"):
        resolve_chain(TrainConfig(objectives=["offline", "opd"], per_objective={"opd": {"strategy": "x"}}))
    assert [s.train.strategy for s in resolve_chain(dataclasses.replace(TC, strategy="fsdp"))] == ["fsdp"]
    with pytest.raises(ConfigError, match="train.strategy"):
        sharding.wrap(torch.nn.Linear(2, 2), "fdsp")
