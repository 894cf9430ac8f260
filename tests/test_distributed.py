"""tp.thought_patch(distributed=True): two local processes (gloo), each fitting on half of the
calibration queries, give the single-process fit of all of them (float64)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import tokenpatch as tp
from tokenpatch.testing import perturbed

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)

SETUP = """
import torch, tokenpatch as tp
from tokenpatch.testing import perturbed
torch.manual_seed(0)
model = perturbed(tp.ICLTransformer(tp.ICLConfig(d_in=3, d_model=8, n_layers=3, n_heads=2, norm="pre")).double(), 0)
g = torch.Generator().manual_seed(1)
prompt = torch.randn(5, 3, generator=g, dtype=torch.float64)
queries = torch.randn(301, 1, 3, generator=g, dtype=torch.float64)
"""

WORKER = (
    SETUP
    + """
import os, sys
torch.distributed.init_process_group("gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
shard = queries[rank::world]  # uneven shards: 151 and 150 queries
fit = tp.thought_patch(model, prompt, shard, ridge=1e-3, distributed=True, batch_size=64, solver=sys.argv[2])
assert fit.fits[0].n == 301, fit.fits[0].n
tp.save_patch(fit.patch, f"{sys.argv[1]}/rank{rank}.safetensors")
torch.distributed.destroy_process_group()
"""
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: tp.Patch, b: tp.Patch) -> float:
    dense = lambda d: d.dense() if isinstance(d, tp.LowRank) else d  # noqa: E731
    assert set(a) == set(b)
    return max(float((dense(a[n]) - dense(b[n])).abs().max() / dense(a[n]).abs().max()) for n in a)


@pytest.mark.parametrize("solver", ["normal", "qr"])
def test_two_processes_fit_what_one_fits(tmp_path, solver):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WORKER), str(tmp_path), solver],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    scope: dict = {}
    exec(SETUP, scope)  # the same model, prompt and queries in this process
    one = tp.thought_patch(scope["model"], scope["prompt"], scope["queries"], ridge=1e-3, solver=solver)
    # The shards' sums are added in another order than one process adds them: a relative change of
    # a few eps in the normal equations, which the solve amplifies by their condition number (the
    # fits report it, ~1e4 here). So the bound is rounding times condition, not a fixed 1e-12: on some
    # CPUs the unpenalised bias column differs by 3e-12 = 1.4 eps x cond.
    cond = max(max(f.input_condition, f.output_condition) for f in one.fits)
    bound = 64 * torch.finfo(torch.float64).eps * cond
    assert bound < 1e-9, bound  # the problem stays well enough conditioned for the check to mean something
    for r in range(2):
        assert _rel(one.patch, tp.load_patch(tmp_path / f"rank{r}.safetensors")) <= bound


def test_distributed_without_a_process_group_is_one_clear_error():
    model = perturbed(tp.ICLTransformer(tp.ICLConfig(d_in=3, d_model=4, n_layers=1, n_heads=2)).double(), 0)
    with pytest.raises(tp.InputError, match="needs an initialised torch.distributed process group"):
        tp.thought_patch(
            model, torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4, 1, 3, dtype=torch.float64), distributed=True
        )
