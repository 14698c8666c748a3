"""Write docker/requirements.lock: harpoon's runtime dependencies, pinned to the versions installed in .venv.

torch and triton are left out: the image installs torch==2.13.0 first (PyPI's CUDA build), which brings the
triton and CUDA libraries it was built against.

    .venv/bin/python scripts/lock.py > docker/requirements.lock
"""

from __future__ import annotations

import importlib.metadata as md

from packaging.requirements import Requirement

LEFT_TO_TORCH = {"torch", "triton"}


def runtime_closure(root: str) -> dict[str, str]:
    versions: dict[str, str] = {}
    stack = [root]
    while stack:
        name = stack.pop()
        key = name.lower().replace("_", "-")
        if key in versions or key in LEFT_TO_TORCH:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        versions[key] = dist.version.split("+")[0]
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(req.name)
    versions.pop(root)
    return versions


def main() -> None:
    print("# harpoon's runtime dependencies, pinned to the tested versions (scripts/lock.py writes this file).")
    print("# torch==2.13.0 is installed before it and brings its own triton and CUDA libraries.")
    for name, version in sorted(runtime_closure("harpoon").items()):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
