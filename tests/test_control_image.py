"""The coordinator and the operator need no torch, so their image (Dockerfile target `control`) is built without
it: torch is the `rank` extra, and a coordinator process in which torch cannot be imported at all serves a real
group end to end; `lockstep rank` without torch says what to install instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("torch", "transformers", "accelerate")
SITECUSTOMIZE = f"""
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: the control image has no torch)")
        return None
sys.meta_path.insert(0, _NoTorch())
"""


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose Python processes cannot import torch (as in the control image)."""
    site = tmp_path_factory.mktemp("no_torch")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=os.environ | env, capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "control image has no torch" in probe.stderr  # the block works
    return env


def test_torch_is_only_in_the_rank_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip() for r in reqs}
    assert "torch" not in names(project["dependencies"])
    assert "torch" in names(project["optional-dependencies"]["rank"])
    assert "lockstep[rank]" in project["optional-dependencies"]["test"]  # the tests run ranks
    docker = (ROOT / "Dockerfile").read_text()
    assert "AS control" in docker and "'.[rank]'" in docker


def test_the_coordinator_serves_a_group_without_torch(tiny_llama, tmp_path, no_torch_env):
    from cluster import Cluster, http

    c = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path, coordinator_env=no_torch_env)
    try:
        status, out = c.complete({"prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 6
        status, chat = http("POST", c.url + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200, chat
        assert "ModuleNotFoundError" not in c.log(c.coordinator)
        c.assert_no_leak()
    finally:
        c.close()


def test_the_operator_imports_and_builds_manifests_without_torch(no_torch_env):
    code = ("import lockstep_operator.main, lockstep_operator.handlers\n"
            "from lockstep_operator.crd import build_crd\n"
            "assert build_crd()['kind'] == 'CustomResourceDefinition'\n"
            "import sys; assert 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], env=os.environ | no_torch_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", ["rank", "serve"])
def test_commands_that_run_the_model_say_what_to_install_without_torch(command, no_torch_env):
    done = subprocess.run([sys.executable, "-m", "lockstep.cli", command, "--help"], env=os.environ | no_torch_env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pip install 'lockstep[rank]'" in done.stderr and "Traceback" not in done.stderr
