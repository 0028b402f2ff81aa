#!/usr/bin/env bash
# Fetch, where the internet is, the wheels the GPU machine's image lacks or must have in the version
# this project is tested with (the GPU machine cannot reach a registry): the data stack (datasets,
# pydantic and what they need), peft (LoRA), torchao (fp8), tensorboard (the Accelerate-compat
# tracker), for the image's Python 3.12 on x86-64. They land in .whl/ (git-ignored: name it in the
# device call's `carry`); bench/gpu_all.sh (and each GPU check) installs them there into /tmp/site.
# Run from anywhere: bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19                              # the data pipeline
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2  # config
  peft==0.21.2                                                                   # adapter: lora
  torchao==0.18.0                                                                # fp8 (needs torch >= 2.11)
  tensorboard==2.21.0                                                            # log_with="tensorboard"
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
# one version of each (two stop the whole install on the GPU machine)
dupes=$(ls .whl | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "gpu_wheels.sh: several versions of: $dupes (remove the old ones from .whl/)" >&2; exit 1; }
ls -la .whl
du -sh .whl
