#!/usr/bin/env bash
# Fetch, on a machine with internet, the wheels the GPU image lacks (it cannot install from a
# registry): datasets, pydantic and what they need, for its Python 3.12. They land in .whl/ (git
# ignores it); bench/gpu_check.sh installs them there. Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl datasets==5.2.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 dill==0.4.1 multiprocess==0.70.19
ls -la .whl
