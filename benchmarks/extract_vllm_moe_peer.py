"""Extract vLLM's Triton fused-MoE kernel and its tuned configs from a vLLM wheel into a local folder.

`benchmarks/bench_fused_moe.py --peers vllm_triton` times our kernel against vLLM's, and a GPU
machine without network and with another torch cannot install vLLM. vLLM's fused_moe.py cannot be
imported without vLLM, but its two @triton.jit functions (`write_zeros_to_output`,
`fused_moe_kernel`) need only triton: they are cut out by AST into a file of their own (triton.jit
reads the source from disk), beside vLLM's tuned BF16 config JSONs for the H200 and the H100 and a
manifest (version, sha256 of the wheel, of the source and of each file written).

The folder is vLLM's code (Apache-2.0), not ours: it is git-ignored (/.vllm-peer/) and never
committed; carry it to the GPU machine with the run. About 150 KB.

Stages: pip download vllm==VERSION --no-deps into a temporary folder (or --wheel PATH) -> cut the
kernel -> copy the configs -> write MANIFEST.json. Usage:

    python benchmarks/extract_vllm_moe_peer.py [--version 0.32.0] [--out .vllm-peer] [--wheel PATH]
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
CONFIG_DIR = "vllm/model_executor/layers/fused_moe/configs/"
FUNCTIONS = ("write_zeros_to_output", "fused_moe_kernel")
KERNEL_FILE = "fused_moe_kernel.py"
# BF16 configs carry no dtype selector in their name (fp8 ones end ",dtype=fp8_w8a8...json").
CONFIG_NAME = re.compile(r"^E=\d+,N=\d+,device_name=(NVIDIA_H200|NVIDIA_H100_80GB_HBM3)\.json$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download_wheel(version: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-d", str(into), "-q"],
        check=True,
    )
    wheels = sorted(into.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no vllm-{version} wheel in {into}")
    return wheels[0]


def cut_kernel(source: str, version: str) -> str:
    """The @triton.jit functions of fused_moe.py, decorators included, with only triton imported.

    Their only free names are `tl`, `triton` and each other (checked when the file is loaded).
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    chunks = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            chunks[node.name] = "\n".join(lines[start - 1 : node.end_lineno])
    missing = set(FUNCTIONS) - set(chunks)
    if missing:
        raise ValueError(f"{SOURCE} of vLLM {version} has no {sorted(missing)}")
    header = (
        f"# Cut from vLLM {version}, {SOURCE} (Apache-2.0, the vLLM project) by\n"
        "# benchmarks/extract_vllm_moe_peer.py, for benchmarking only. "
        "Not part of moe-eval; never committed.\n"
        "import triton\nimport triton.language as tl\n\n\n"
    )
    return header + "\n\n\n".join(chunks[name] for name in FUNCTIONS) + "\n"


def extract(wheel: Path, out: Path, version: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "configs").mkdir(exist_ok=True)
    wheel_bytes = wheel.read_bytes()
    files = {}
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(SOURCE)
        kernel = cut_kernel(source.decode(), version).encode()
        (out / KERNEL_FILE).write_bytes(kernel)
        files[KERNEL_FILE] = sha256(kernel)
        for name in sorted(zf.namelist()):
            base = name[len(CONFIG_DIR) :] if name.startswith(CONFIG_DIR) else ""
            if CONFIG_NAME.match(base):
                data = zf.read(name)
                (out / "configs" / base).write_bytes(data)
                files[f"configs/{base}"] = sha256(data)
        version_py = zf.read("vllm/_version.py").decode() if "vllm/_version.py" in zf.namelist() else ""
    found = re.search(r"version = .*?['\"]([^'\"]+)['\"]", version_py)
    manifest = {
        "vllm_version": found.group(1) if found else version,
        "wheel": wheel.name,
        "wheel_sha256": sha256(wheel_bytes),
        "source": SOURCE,
        "source_sha256": sha256(source),
        "functions": list(FUNCTIONS),
        "files": files,
        "extracted": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.32.0")
    parser.add_argument("--out", type=Path, default=ROOT / ".vllm-peer")
    parser.add_argument("--wheel", type=Path, help="use this wheel instead of downloading one")
    args = parser.parse_args(argv)
    if args.wheel is not None:
        manifest = extract(args.wheel, args.out, args.version)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            manifest = extract(download_wheel(args.version, Path(tmp)), args.out, args.version)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out}: vLLM {manifest['vllm_version']}, {len(manifest['files'])} files, "
          f"{size / 1024:.0f} KB", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
