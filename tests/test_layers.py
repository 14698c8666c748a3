"""The layers import one way: kernels <- engine <- server <- (loadtest | clients), and the API process loads
neither the model nor the kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_layer_imports_a_higher_one():
    out = subprocess.run([sys.executable, "-m", "importlinter.cli", "--config", str(ROOT / "pyproject.toml")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_the_api_process_loads_no_model_or_kernel_code():
    """What ``harpoon serve`` imports in the API process (the engine runs in its own): the message types, the
    request checks and the tokenizer's side, not the model, the runner, the scheduler or any kernel."""
    code = ("import sys, server.cli, server.api, server.engine_client\n"
            "heavy = ('engine.engine_core', 'engine.models', 'engine.model_runner', 'engine.scheduler', "
            "'engine.backends', 'engine.attention', 'kernels.')\n"
            "print(sorted(m for m in sys.modules if m.startswith(heavy)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
