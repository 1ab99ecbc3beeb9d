"""How fast a node checks its artifacts against their manifest (unit_launcher.artifact_manifest.check_node).

Writes `--files` random files of `--mib` MiB each as one node's shards, builds their manifest, and
times the check (size and SHA-256 of every file, HASH_THREADS at once). Run 1 hashes every file (from
the page cache here; on a node the first check after a fetch is disk-bound); run 2 is a restart's
check, which hashes nothing that was not written since it last matched.

    .venv/bin/python containers/inference/bench_manifest_check.py --files 4 --mib 256
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from unit_launcher import artifact_manifest as am


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = root / "neuron" / "L" / "weights"
        weights.mkdir(parents=True)
        for rank in range(args.files):
            (weights / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(os.urandom(args.mib << 20))
        layout = {"model": "m", "instance_type": "cpu", "nodes": 1, "tp_degree": args.files, "cp_degree": 1,
                  "attention_dp_degree": 1, "world_size": args.files, "local_ranks_size": args.files,
                  "logical_nc_config": 1, "batch_size": 1, "seq_len": 16, "max_context_length": 16,
                  "torch_dtype": "bfloat16", "sequence_parallel_enabled": False, "is_continuous_batching": False}
        versions = {"image_digest": "none", "neuron_sdk": "-", "nxdi": "-", "vllm_neuron": "-", "vllm": "-"}
        inputs = am.KeyInputs.model_validate({"checkpoint": {"c": {"size": 0, "sha256": "0" * 64}}, "layout": layout,
                                              "versions": versions, "compiler_args": []})
        manifest = am.build(root, "neuron/L", inputs)
        total = args.files * args.mib
        for run in (1, 2):
            started = time.monotonic()
            am.check_node(manifest, root, 0, planned=layout, expected_key=manifest.key)
            seconds = time.monotonic() - started
            print(f"run {run}: {args.files} files, {total} MiB checked in {seconds:.2f} s "
                  f"({total / seconds:.0f} MiB/s, {am.HASH_THREADS} threads, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
