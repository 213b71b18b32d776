"""Fixtures shared by several test files."""

import os

import pytest

# Rank processes of one test module's in-process runs serve its later runs of the same shape
# (novarl/distributed/kept_ranks.py: REUSE_RANKS_VARIABLE): ~6 s of imports a rank saved each time.
os.environ.setdefault("NOVARL_REUSE_RANKS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core, each starting ranks and engines: every process computes on
    # one thread (torch's default, a thread per core in each, spends ~15 % more CPU time on the same
    # tests where the cores are all busy). Inherited by the runs' subprocesses and Ray's workers.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers.hub import hub_cache  # noqa: F401 (a fixture: an empty Hugging Face cache in tmp_path)


@pytest.fixture(scope="session")
def ray_session():
    """Ray for the modules that start ranks (`pytest.mark.usefixtures("ray_session")`; skipped where Ray
    is not installed), shut down when the test process ends: one local instance serves every such
    module a pytest-xdist worker runs (~5 s of starting and stopping Ray saved for each), and the rank
    processes a module's last run keeps serve the next module's runs of the same shape. A test that
    needs an instance of its own shuts this one down; the next run starts another."""
    ray = pytest.importorskip("ray")
    yield
    ray.shutdown()


LONGEST_FIRST = ("test_vllm.py", "test_deepspeed.py", "test_megatron_backend.py", "test_distributed.py",
                 "test_ppo.py", "test_network_safety.py", "test_lora_parallel.py", "test_generation_engines.py",
                 "test_async_grpo.py", "test_packing.py", "test_fuzz.py", "test_readme.py", "test_e2e.py",
                 "test_ray_cluster.py", "test_context_parallel.py", "test_critic.py", "test_megatron_layouts.py",
                 "test_checkpoint_integrity.py", "test_cli_errors.py", "test_checkpoint.py", "test_megatron_convert.py",
                 "test_algorithm_loop.py", "test_backend_conformance.py", "test_types.py")
"""The test files that take longest (most start ranks), longest first (their tests' durations summed over a
`make test` run with ranks kept between runs, 2026-11-27)."""


def pytest_collection_modifyitems(config, items):
    """The longest files first, each file's tests in their order: `make test` spreads whole files over
    pytest-xdist workers in this order, so the long ones start at once instead of ending the run alone."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
